//! The model's sizes a run's memory plan needs ([`ModelSizes`]), read from the config and
//! the checkpoint headers (no tensor data is read). `k3-orch inspect`'s tensor census by
//! class is another thing (`tools::inspect::Census`).

use std::collections::HashMap;

use k3_model::catalog::Catalog;
use k3_model::classify::{classify, model_tensor, split_expert, split_layer, TensorClass, LM_HEAD};
use k3_model::config::{LayerKind, ModelConfig};

/// Sizes of the bound layers.
pub struct ModelSizes {
    /// Per bound layer, bytes of its trunk tensors.
    pub layer_bytes: Vec<u64>,
    /// Per bound layer, what the trunk-loader's resident region gives it: each tensor
    /// rounded up to 64 bytes, the layer to a 4096-byte page (its `setup_resident` layout).
    pub layer_resident_bytes: Vec<u64>,
    /// Model-level tensors: embeddings, lm_head, final norms.
    pub model_bytes: u64,
    /// Of which the token embedding and the lm_head.
    pub embed_bytes: u64,
    pub lm_head_bytes: u64,
    /// The shard file the lm_head is read from (None: the checkpoint has none).
    pub lm_head_file: Option<std::path::PathBuf>,
    /// Bytes of one embedding row (hidden x dtype size).
    pub embed_row_bytes: u64,
    /// The largest file span of one routed expert.
    pub max_expert_span: u64,
    /// Routed experts in the bound layers.
    pub n_experts: u64,
    pub kda_state_bytes: u64,
    /// KV-cache bytes per position (MLA layers).
    pub kv_per_pos: u64,
}

/// The sizes of the first `layers` layers of `cat`.
pub fn model_sizes(cfg: &ModelConfig, cat: &Catalog, layers: usize) -> ModelSizes {
    let mut layer_bytes = vec![0u64; layers];
    let mut layer_resident_bytes = vec![0u64; layers];
    let mut model_bytes = 0u64;
    let (mut embed_bytes, mut lm_head_bytes, mut embed_row_bytes) = (0u64, 0u64, 0u64);
    let embed_name = model_tensor("embed_tokens.weight");
    let mut lm_head_file = None;
    let mut spans: HashMap<(usize, usize), (u64, u64)> = HashMap::new();
    for (name, e) in cat.iter() {
        if classify(name.as_str()) == TensorClass::Vision {
            continue;
        }
        if let Some((l, _)) = split_layer(name.as_str()) {
            if l >= layers {
                continue;
            }
            if let Some((_, x, _)) = split_expert(name.as_str()) {
                let s = spans.entry((l, x)).or_insert((u64::MAX, 0));
                s.0 = s.0.min(e.offset);
                s.1 = s.1.max(e.end());
            } else {
                layer_bytes[l] += e.len;
                layer_resident_bytes[l] += e.len.div_ceil(64) * 64;
            }
        } else if name.starts_with("language_model.") {
            model_bytes += e.len;
            if name.as_str() == LM_HEAD {
                lm_head_bytes += e.len;
                lm_head_file = cat.shards().get(e.shard).map(|s| s.path.clone());
            } else if name.as_str() == embed_name {
                embed_bytes += e.len;
                embed_row_bytes = e.len / (e.shape.first().copied().unwrap_or(1).max(1) as u64);
            }
        }
    }
    let max_expert_span = spans.values().map(|(a, b)| b - a).max().unwrap_or(0);
    let (kda_state_bytes, kv_per_pos) = state_bytes(cfg, layers);
    for b in &mut layer_resident_bytes {
        *b = b.div_ceil(4096) * 4096;
    }
    ModelSizes {
        layer_bytes,
        layer_resident_bytes,
        model_bytes,
        embed_bytes,
        lm_head_bytes,
        lm_head_file,
        embed_row_bytes,
        max_expert_span,
        n_experts: spans.len() as u64,
        kda_state_bytes,
        kv_per_pos,
    }
}

/// What the first `layers` layers hold per session, from the config alone: the KDA layers'
/// recurrent state and conv tails (f32), and the MLA layers' KV cache per position (f32).
/// Returns (state bytes, KV bytes per position).
pub fn state_bytes(cfg: &ModelConfig, layers: usize) -> (u64, u64) {
    let la = &cfg.linear_attn;
    let kda_layers = (0..layers)
        .filter(|&l| cfg.layer_kind(l) == LayerKind::Kda)
        .count() as u64;
    let mla_layers = layers as u64 - kda_layers;
    let p = (la.num_heads * la.head_dim) as u64;
    let kda_state_bytes = kda_layers
        * 4
        * ((la.num_heads * la.head_dim * la.head_dim) as u64
            + 3 * (la.short_conv_kernel_size.saturating_sub(1)) as u64 * p);
    let h = cfg.num_attention_heads as u64;
    let kv_per_pos = mla_layers
        * 4
        * (cfg.kv_lora_rank as u64
            + cfg.qk_rope_head_dim as u64
            + h * (cfg.qk_nope_head_dim + cfg.v_head_dim) as u64);
    (kda_state_bytes, kv_per_pos)
}
