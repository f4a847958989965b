//! Tensor names: the ONE place they are parsed ([`layer_of`], [`split_layer`],
//! [`expert_of`], [`split_expert`], [`classify`]) and formatted ([`model_tensor`],
//! [`layer_tensor`], [`expert_tensor`], [`LM_HEAD`]).
//!
//! Classification by released name: what is streamed (routed experts) and what must be
//! resident (everything else the text model uses).
//!
//! The two shared experts sit in the same `block_sparse_moe` namespace as the routed ones
//! but run on every token, so they are resident; confusing the two makes the resident floor
//! look smaller than it is. Names follow k3-spec §2 (`language_model.model.layers.<l>.…`);
//! the historical `language_model.layers.<l>.` / `model.layers.<l>.` prefixes are accepted
//! for the layer index.
//!
//! ```
//! use k3_model::classify::{classify, TensorClass};
//! let n = "language_model.model.layers.5.block_sparse_moe.experts.17.w2.weight_scale";
//! assert_eq!(classify(n), TensorClass::RoutedExpert);
//! ```

use std::fmt;

/// Prefix of every text-model tensor except the lm_head.
pub const MODEL_PREFIX: &str = "language_model.model.";
/// The output projection.
pub const LM_HEAD: &str = "language_model.lm_head.weight";
/// Namespace of the routed experts inside a layer.
const EXPERTS: &str = "block_sparse_moe.experts.";

/// `language_model.model.<suffix>` (embed_tokens.weight, norm.weight, ...).
pub fn model_tensor(suffix: &str) -> String {
    format!("{MODEL_PREFIX}{suffix}")
}

/// `language_model.model.layers.<layer>.<suffix>`.
pub fn layer_tensor(layer: usize, suffix: &str) -> String {
    format!("{MODEL_PREFIX}layers.{layer}.{suffix}")
}

/// `language_model.model.layers.<layer>.block_sparse_moe.experts.<expert>.<suffix>`.
pub fn expert_tensor(layer: usize, expert: usize, suffix: &str) -> String {
    format!("{MODEL_PREFIX}layers.{layer}.{EXPERTS}{expert}.{suffix}")
}

/// `(layer, rest)` of a decoder-layer tensor: `rest` is what follows `layers.<l>.`.
pub fn split_layer(name: &str) -> Option<(usize, &str)> {
    let l = layer_of(name)?;
    let at = name.find("layers.")? + "layers.".len();
    let rest = &name[at..];
    let dot = rest.find('.')?;
    Some((l, &rest[dot + 1..]))
}

/// `(layer, expert, suffix)` of a routed-expert tensor: `suffix` is what follows
/// `experts.<e>.` (`w1.weight_packed`, ...).
pub fn split_expert(name: &str) -> Option<(usize, usize, &str)> {
    let (l, rest) = split_layer(name)?;
    let tail = rest.strip_prefix(EXPERTS)?;
    let (e, suffix) = tail.split_once('.')?;
    Some((l, e.parse().ok()?, suffix))
}

/// What a tensor is, for memory planning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TensorClass {
    /// `block_sparse_moe.experts.<e>.*`: streamed, only top-k of them per token.
    RoutedExpert,
    /// `block_sparse_moe.shared_experts.*`: runs on every token, resident.
    SharedExpert,
    /// `self_attn.*` (KDA and MLA projections, convs, gates, norms inside attention).
    Attention,
    /// `embed_tokens` and `lm_head`.
    Embedding,
    /// `vision_tower.*` and `mm_projector.*`: not used by the text model.
    Vision,
    /// Everything else: layer norms, AttnRes projections, router, latent projections,
    /// dense FFN of layer 0, final norm.
    Other,
}

impl TensorClass {
    /// All classes, in report order.
    pub const ALL: [TensorClass; 6] = [
        TensorClass::RoutedExpert,
        TensorClass::SharedExpert,
        TensorClass::Attention,
        TensorClass::Embedding,
        TensorClass::Other,
        TensorClass::Vision,
    ];

    /// Short label for reports.
    pub fn label(self) -> &'static str {
        match self {
            TensorClass::RoutedExpert => "routed expert",
            TensorClass::SharedExpert => "shared expert",
            TensorClass::Attention => "attention",
            TensorClass::Embedding => "embedding/lm_head",
            TensorClass::Vision => "vision (unused)",
            TensorClass::Other => "other",
        }
    }

    /// Whether the text model keeps this class resident (not streamed, not skipped).
    pub fn resident(self) -> bool {
        !matches!(self, TensorClass::RoutedExpert | TensorClass::Vision)
    }
}

impl fmt::Display for TensorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The class of the tensor called `name`.
pub fn classify(name: &str) -> TensorClass {
    if name.starts_with("vision_tower.")
        || name.starts_with("mm_projector.")
        || name.contains(".vision_tower.")
        || name.contains(".mm_projector.")
    {
        TensorClass::Vision
    } else if name.contains(".block_sparse_moe.experts.") {
        TensorClass::RoutedExpert
    } else if name.contains(".block_sparse_moe.shared_expert") {
        TensorClass::SharedExpert
    } else if name.contains(".self_attn.") {
        TensorClass::Attention
    } else if name.contains("embed_tokens") || name.contains("lm_head") {
        TensorClass::Embedding
    } else {
        TensorClass::Other
    }
}

/// The decoder layer of a tensor (`...layers.<l>.…`), or `None` for model-level tensors.
pub fn layer_of(name: &str) -> Option<usize> {
    let at = name.find("layers.")?;
    // Only the decoder's layers: not vision_tower.encoder.blocks or similar.
    if !(at == 0 || name[..at].ends_with("model.") || name[..at].ends_with("language_model.")) {
        return None;
    }
    let rest = &name[at + "layers.".len()..];
    let end = rest.find('.')?;
    rest[..end].parse().ok()
}

/// The (layer, expert id) of a routed-expert tensor.
pub fn expert_of(name: &str) -> Option<(usize, usize)> {
    let l = layer_of(name)?;
    let key = ".block_sparse_moe.experts.";
    let at = name.find(key)?;
    let rest = &name[at + key.len()..];
    let end = rest.find('.')?;
    Some((l, rest[..end].parse().ok()?))
}

/// Whether a tensor belongs to a layer's trunk: a decoder-layer tensor that is not a routed
/// expert (what `pack-trunk` packs).
pub fn is_layer_trunk(name: &str) -> bool {
    layer_of(name).is_some() && classify(name) != TensorClass::RoutedExpert
}
