//! The model config: a strict reader of the released `config.json` shape (k3-spec §1).
//!
//! The released file nests the text model under `text_config`, with
//! `text_config.linear_attn_config` (the KDA / full-attention layer map, ONE-based) and
//! `text_config.quantization_config` (compressed-tensors MXFP4 for the routed experts).
//!
//! The reader refuses to guess: every field the engine uses is required, and one
//! [`ConfigError`] lists every missing, mistyped or unsupported field at once (with the
//! file path). A permissive reader that fills in defaults silently builds a different model
//! (an empty `full_attn_layers` turns all 93 layers into KDA), so nothing the forward pass
//! depends on is defaulted.
//!
//! The only exceptions are a few *architecture switches* that the engine supports at exactly
//! one value — `topk_method` ("noaux_tc"), `num_expert_group` and `topk_group` (1),
//! `use_full_rank_gate` (true), `use_grouped_topk` (true) — plus `moe_layer_freq` (HF
//! default 1, any value ≥ 1 accepted when given) and the optional `pad_token_id`. The seed's
//! tiny model omits them; when absent they take that value and are listed in
//! [`ModelConfig::defaulted`]; when present at an unsupported value they are refused.
//!
//! Validation: dimensions ≥ 1; `num_key_value_heads` = `num_attention_heads`; top-k ≤
//! experts; `first_k_dense_replace` ≤ layers; token ids inside the vocabulary; positive
//! eps, SiTU betas and scaling; negative `gate_lower_bound`; MXFP4 dims multiples of the
//! group size; the ONE-based layer lists in range, without duplicates, disjoint, and
//! together covering every layer. Unsupported values (`hidden_act` other than "situ", a
//! non-sigmoid router, `mla_use_nope` = false, other quantisation formats) are refused.
//!
//! ```no_run
//! use k3_model::config::{LayerKind, ModelConfig};
//! let cfg = ModelConfig::load("model/config.json").unwrap();
//! assert_eq!(cfg.layer_kind(3), LayerKind::Mla);
//! ```

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::tensor::Dtype;

/// Attention kind of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Kimi Delta Attention (linear attention with a recurrent state).
    Kda,
    /// Gated multi-head latent attention (full attention, NoPE).
    Mla,
}

/// How the routed experts' `w1`/`w2`/`w3` are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertFormat {
    /// compressed-tensors "mxfp4-pack-quantized": `weight_packed` U8 `[rows, cols/2]`
    /// (low nibble = even column) and `weight_scale` U8 `[rows, cols/group_size]` (E8M0).
    Mxfp4 { group_size: usize },
    /// Plain `weight` tensors (BF16 or F32; the dtype is in the checkpoint, not the config).
    Unquantized,
}

/// `text_config.linear_attn_config`.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearAttnConfig {
    /// KDA heads (96 released).
    pub num_heads: usize,
    /// KDA head dim, d_k = d_v (128 released).
    pub head_dim: usize,
    /// Depthwise causal conv width (4 released).
    pub short_conv_kernel_size: usize,
    /// Full-rank output gate `self_attn.g_proj` (always true; false is refused).
    pub use_full_rank_gate: bool,
    /// Lower bound of the bounded-sigmoid decay gate (-5 released; must be < 0).
    pub gate_lower_bound: f32,
    /// ONE-based KDA layer numbers, as in the file.
    pub kda_layers: Vec<usize>,
    /// ONE-based full-attention (MLA) layer numbers, as in the file.
    pub full_attn_layers: Vec<usize>,
}

/// `text_config.quantization_config` (only compressed-tensors MXFP4 is accepted).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantConfig {
    /// "compressed-tensors".
    pub quant_method: String,
    /// "mxfp4-pack-quantized".
    pub format: String,
    /// Elements per E8M0 scale along the input dimension (32).
    pub group_size: usize,
    /// Bits per weight code (4).
    pub num_bits: usize,
    /// The `ignore` list (module regexes left unquantised), informational.
    pub ignore: Vec<String>,
}

/// The typed text-model config. Field names follow `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub num_hidden_layers: usize,
    /// MLA heads.
    pub num_attention_heads: usize,
    /// Must equal `num_attention_heads` (MLA is MHA after kv_b expansion).
    pub num_key_value_heads: usize,
    /// Dense FFN width of the first `first_k_dense_replace` layers.
    pub intermediate_size: usize,
    /// "situ" (the only activation accepted).
    pub hidden_act: String,
    /// SiTU β₁ (gate soft-cap).
    pub activation_situ_beta: f32,
    /// SiTU β₂ (up soft-cap).
    pub activation_situ_linear_beta: f32,
    pub rms_norm_eps: f32,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Must be true (no RoPE in K3's MLA).
    pub mla_use_nope: bool,
    pub mla_use_output_gate: bool,
    pub num_experts: usize,
    /// Routed experts chosen per token (top-k).
    pub num_experts_per_token: usize,
    /// A width multiplier: one shared MLP of width `num_shared_experts * moe_intermediate_size`.
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    /// Latent width the routed experts act in.
    pub routed_expert_hidden_size: usize,
    pub latent_moe_use_norm: bool,
    /// "sigmoid" (the only router activation accepted).
    pub moe_router_activation_func: String,
    pub moe_renormalize: bool,
    pub routed_scaling_factor: f32,
    /// "noaux_tc" (bias-corrected selection; the only method accepted).
    pub topk_method: String,
    /// Must be 1.
    pub num_expert_group: usize,
    /// Must be 1.
    pub topk_group: usize,
    /// Layers `0..first_k_dense_replace` use the dense FFN.
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    /// Block Attention Residuals block size (12 released).
    pub attn_res_block_size: usize,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: Option<u32>,
    pub tie_word_embeddings: bool,
    pub linear_attn: LinearAttnConfig,
    /// `None` when the checkpoint is unquantised (tiny-seed).
    pub quantization: Option<QuantConfig>,
    /// Architecture switches that were absent and took their only supported value
    /// (dotted paths, e.g. `text_config.topk_method`).
    pub defaulted: Vec<String>,
    layer_kinds: Vec<LayerKind>,
}

/// A config that could not be read: the file and every problem found, one per line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The file read, or `<string>` for [`ModelConfig::from_json_str`].
    pub file: String,
    /// Every problem, each naming its dotted field path.
    pub problems: Vec<String>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "config {}: {} problem(s); refusing to guess (a config this reader cannot fully \
             understand would silently build a different model):",
            self.file,
            self.problems.len()
        )?;
        for p in &self.problems {
            write!(f, "\n  - {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// Accumulates problems while reading fields of one JSON object.
struct Reader {
    problems: Vec<String>,
    defaulted: Vec<String>,
}

fn type_name(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => {
            let mut s = s.clone();
            if s.len() > 40 {
                let mut cut = 40;
                while !s.is_char_boundary(cut) {
                    cut -= 1;
                }
                s.truncate(cut);
                s.push('…');
            }
            format!("string {s:?}")
        }
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

impl Reader {
    fn new() -> Self {
        Reader {
            problems: Vec::new(),
            defaulted: Vec::new(),
        }
    }

    fn problem(&mut self, msg: String) {
        self.problems.push(msg);
    }

    fn get<'v>(&mut self, obj: &'v Map<String, Value>, path: &str, key: &str) -> Option<&'v Value> {
        match obj.get(key) {
            Some(v) => Some(v),
            None => {
                self.problem(format!("{path}.{key}: missing (required)"));
                None
            }
        }
    }

    fn as_usize(&mut self, v: &Value, what: &str) -> Option<usize> {
        match v.as_u64() {
            Some(n) if usize::try_from(n).is_ok() && n <= u32::MAX as u64 => Some(n as usize),
            _ => {
                self.problem(format!(
                    "{what}: expected a non-negative integer, found {}",
                    type_name(v)
                ));
                None
            }
        }
    }

    fn usize(&mut self, obj: &Map<String, Value>, path: &str, key: &str) -> Option<usize> {
        let v = self.get(obj, path, key)?;
        self.as_usize(v, &format!("{path}.{key}"))
    }

    fn f32(&mut self, obj: &Map<String, Value>, path: &str, key: &str) -> Option<f32> {
        let v = self.get(obj, path, key)?;
        match v.as_f64() {
            Some(x) if x.is_finite() && (x as f32).is_finite() => Some(x as f32),
            _ => {
                self.problem(format!(
                    "{path}.{key}: expected a finite number, found {}",
                    type_name(v)
                ));
                None
            }
        }
    }

    fn bool(&mut self, obj: &Map<String, Value>, path: &str, key: &str) -> Option<bool> {
        let v = self.get(obj, path, key)?;
        match v.as_bool() {
            Some(b) => Some(b),
            None => {
                self.problem(format!(
                    "{path}.{key}: expected true or false, found {}",
                    type_name(v)
                ));
                None
            }
        }
    }

    fn string(&mut self, obj: &Map<String, Value>, path: &str, key: &str) -> Option<String> {
        let v = self.get(obj, path, key)?;
        match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                self.problem(format!(
                    "{path}.{key}: expected a string, found {}",
                    type_name(v)
                ));
                None
            }
        }
    }

    fn object<'v>(
        &mut self,
        obj: &'v Map<String, Value>,
        path: &str,
        key: &str,
    ) -> Option<&'v Map<String, Value>> {
        let v = self.get(obj, path, key)?;
        match v.as_object() {
            Some(o) => Some(o),
            None => {
                self.problem(format!(
                    "{path}.{key}: expected an object, found {}",
                    type_name(v)
                ));
                None
            }
        }
    }

    fn usize_list(
        &mut self,
        obj: &Map<String, Value>,
        path: &str,
        key: &str,
    ) -> Option<Vec<usize>> {
        let v = self.get(obj, path, key)?;
        let Some(arr) = v.as_array() else {
            self.problem(format!(
                "{path}.{key}: expected an array of ONE-based layer numbers, found {}",
                type_name(v)
            ));
            return None;
        };
        let mut out = Vec::with_capacity(arr.len());
        let mut ok = true;
        for (i, x) in arr.iter().enumerate() {
            match self.as_usize(x, &format!("{path}.{key}[{i}]")) {
                Some(n) => out.push(n),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    /// An architecture switch supported at one value: absent -> that value (recorded),
    /// present -> must equal it.
    fn switch_usize(
        &mut self,
        obj: &Map<String, Value>,
        path: &str,
        key: &str,
        only: usize,
        why: &str,
    ) -> Option<usize> {
        match obj.get(key) {
            None => {
                self.defaulted.push(format!("{path}.{key}"));
                Some(only)
            }
            Some(v) => {
                let n = self.as_usize(v, &format!("{path}.{key}"))?;
                if n != only {
                    self.problem(format!("{path}.{key} = {n} is not supported ({why})"));
                }
                Some(n)
            }
        }
    }

    fn switch_str(
        &mut self,
        obj: &Map<String, Value>,
        path: &str,
        key: &str,
        only: &str,
        why: &str,
    ) -> Option<String> {
        match obj.get(key) {
            None => {
                self.defaulted.push(format!("{path}.{key}"));
                Some(only.to_string())
            }
            Some(Value::String(s)) => {
                if s != only {
                    self.problem(format!("{path}.{key} = {s:?} is not supported ({why})"));
                }
                Some(s.clone())
            }
            Some(v) => {
                self.problem(format!(
                    "{path}.{key}: expected a string, found {}",
                    type_name(v)
                ));
                None
            }
        }
    }

    fn switch_bool(
        &mut self,
        obj: &Map<String, Value>,
        path: &str,
        key: &str,
        only: bool,
        why: &str,
    ) -> Option<bool> {
        match obj.get(key) {
            None => {
                self.defaulted.push(format!("{path}.{key}"));
                Some(only)
            }
            Some(Value::Bool(b)) => {
                if *b != only {
                    self.problem(format!("{path}.{key} = {b} is not supported ({why})"));
                }
                Some(*b)
            }
            Some(v) => {
                self.problem(format!(
                    "{path}.{key}: expected true or false, found {}",
                    type_name(v)
                ));
                None
            }
        }
    }
}

impl ModelConfig {
    /// Read and validate `config.json` at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<ModelConfig, ConfigError> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let text = k3_io::input::read_capped_string(path, k3_io::input::JSON_CAP).map_err(|e| {
            ConfigError {
                file: file.clone(),
                problems: vec![format!("cannot read: {e}")],
            }
        })?;
        Self::parse(&text, file)
    }

    /// Read and validate `config.json` of a model directory (`dir/config.json`).
    pub fn load_dir(dir: impl AsRef<Path>) -> Result<ModelConfig, ConfigError> {
        let p: PathBuf = dir.as_ref().join("config.json");
        Self::load(p)
    }

    /// Parse and validate config JSON text (errors name the file as `<string>`).
    pub fn from_json_str(text: &str) -> Result<ModelConfig, ConfigError> {
        Self::parse(text, "<string>".to_string())
    }

    fn parse(text: &str, file: String) -> Result<ModelConfig, ConfigError> {
        let fail = |problems: Vec<String>| ConfigError {
            file: file.clone(),
            problems,
        };
        let root: Value =
            serde_json::from_str(text).map_err(|e| fail(vec![format!("not valid JSON: {e}")]))?;
        let Some(root) = root.as_object() else {
            return Err(fail(vec![format!(
                "top level: expected an object, found {}",
                type_name(&root)
            )]));
        };
        let mut r = Reader::new();
        let Some(tc) = r.object(root, "config", "text_config") else {
            let mut problems = r.problems;
            if root.contains_key("hidden_size") {
                problems.push(
                    "this looks like a flat config; the released shape nests the text model \
                     under `text_config`"
                        .into(),
                );
            }
            return Err(fail(problems));
        };
        let cfg = read_text_config(&mut r, root, tc);
        match cfg {
            Some(cfg) if r.problems.is_empty() => Ok(cfg),
            _ => {
                if r.problems.is_empty() {
                    r.problems
                        .push("config could not be read (internal: no problem recorded)".into());
                }
                Err(fail(r.problems))
            }
        }
    }

    /// Number of decoder layers.
    pub fn n_layers(&self) -> usize {
        self.num_hidden_layers
    }

    /// Kind of 0-based layer `l`: KDA iff `l + 1` is in `kda_layers`.
    ///
    /// # Panics
    /// If `l >= n_layers()` (a caller bug; check user-supplied layer numbers first).
    pub fn layer_kind(&self, l: usize) -> LayerKind {
        self.layer_kinds[l]
    }

    /// Kinds of all layers, index = 0-based layer.
    pub fn layer_kinds(&self) -> &[LayerKind] {
        &self.layer_kinds
    }

    /// 0-based KDA layers, ascending.
    pub fn kda_layer_indices(&self) -> Vec<usize> {
        (0..self.n_layers())
            .filter(|&l| self.layer_kinds[l] == LayerKind::Kda)
            .collect()
    }

    /// 0-based MLA (full-attention) layers, ascending.
    pub fn mla_layer_indices(&self) -> Vec<usize> {
        (0..self.n_layers())
            .filter(|&l| self.layer_kinds[l] == LayerKind::Mla)
            .collect()
    }

    /// Whether 0-based layer `l` uses the latent MoE (else the dense FFN):
    /// `l >= first_k_dense_replace && l % moe_layer_freq == 0`.
    pub fn is_moe(&self, l: usize) -> bool {
        l < self.n_layers()
            && l >= self.first_k_dense_replace
            && l.is_multiple_of(self.moe_layer_freq)
    }

    /// 0-based MoE layers, ascending.
    pub fn moe_layer_indices(&self) -> Vec<usize> {
        (0..self.n_layers()).filter(|&l| self.is_moe(l)).collect()
    }

    /// Whether layer `l` starts an Attention-Residual block (`l % attn_res_block_size == 0`).
    pub fn is_attn_res_boundary(&self, l: usize) -> bool {
        l.is_multiple_of(self.attn_res_block_size)
    }

    /// MLA per-head query/key width `qk_nope_head_dim + qk_rope_head_dim` (192 released).
    pub fn mla_qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// KDA projection width `num_heads * head_dim` (12288 released).
    pub fn kda_dim(&self) -> usize {
        self.linear_attn.num_heads * self.linear_attn.head_dim
    }

    /// Shared-expert MLP width `num_shared_experts * moe_intermediate_size` (6144 released).
    pub fn shared_expert_width(&self) -> usize {
        self.num_shared_experts * self.moe_intermediate_size
    }

    /// How routed experts are stored.
    pub fn expert_format(&self) -> ExpertFormat {
        match &self.quantization {
            Some(q) => ExpertFormat::Mxfp4 {
                group_size: q.group_size,
            },
            None => ExpertFormat::Unquantized,
        }
    }

    /// The tensors of one routed expert, in the released order (w1, w2, w3; packed before
    /// scale): suffix after `experts.<e>.`, dtype and shape. For an unquantised checkpoint
    /// the three `w{1,2,3}.weight` tensors take `unquantized` as their dtype.
    ///
    /// w1 (gate) and w3 (up) map latent → moe_intermediate; w2 (down) maps back.
    pub fn expert_tensors(&self, unquantized: Dtype) -> Vec<ExpertTensorSpec> {
        let f = self.moe_intermediate_size;
        let lat = self.routed_expert_hidden_size;
        let mats: [(&'static str, usize, usize); 3] =
            [("w1", f, lat), ("w2", lat, f), ("w3", f, lat)];
        let mut out = Vec::with_capacity(6);
        match self.expert_format() {
            ExpertFormat::Mxfp4 { group_size } => {
                for (w, rows, cols) in mats {
                    out.push(ExpertTensorSpec {
                        suffix: packed_suffix(w),
                        dtype: Dtype::U8,
                        shape: [rows, cols / 2],
                    });
                    out.push(ExpertTensorSpec {
                        suffix: scale_suffix(w),
                        dtype: Dtype::U8,
                        shape: [rows, cols / group_size],
                    });
                }
            }
            ExpertFormat::Unquantized => {
                for (w, rows, cols) in mats {
                    out.push(ExpertTensorSpec {
                        suffix: plain_suffix(w),
                        dtype: unquantized,
                        shape: [rows, cols],
                    });
                }
            }
        }
        out
    }

    /// Bytes of one routed expert (17,547,264 released; `unquantized` is the dtype of
    /// plain `weight` tensors when the checkpoint is not quantised).
    pub fn expert_bytes(&self, unquantized: Dtype) -> u64 {
        self.expert_tensors(unquantized)
            .iter()
            .map(|t| t.bytes())
            .sum()
    }
}

/// One tensor of a routed expert (see [`ModelConfig::expert_tensors`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertTensorSpec {
    /// Name after `...experts.<e>.`, e.g. `w1.weight_packed`.
    pub suffix: &'static str,
    pub dtype: Dtype,
    pub shape: [usize; 2],
}

impl ExpertTensorSpec {
    /// Byte length.
    pub fn bytes(&self) -> u64 {
        (self.shape[0] as u64) * (self.shape[1] as u64) * self.dtype.size() as u64
    }
}

fn packed_suffix(w: &str) -> &'static str {
    match w {
        "w1" => "w1.weight_packed",
        "w2" => "w2.weight_packed",
        _ => "w3.weight_packed",
    }
}
fn scale_suffix(w: &str) -> &'static str {
    match w {
        "w1" => "w1.weight_scale",
        "w2" => "w2.weight_scale",
        _ => "w3.weight_scale",
    }
}
fn plain_suffix(w: &str) -> &'static str {
    match w {
        "w1" => "w1.weight",
        "w2" => "w2.weight",
        _ => "w3.weight",
    }
}

const TC: &str = "text_config";
/// Largest layer count accepted (the release has 93); guards allocations on bad input.
pub const MAX_LAYERS: usize = 65_536;
const LA: &str = "text_config.linear_attn_config";
const QC: &str = "text_config.quantization_config";

fn read_text_config(
    r: &mut Reader,
    root: &Map<String, Value>,
    tc: &Map<String, Value>,
) -> Option<ModelConfig> {
    let f = read_text_fields(r, tc);
    let linear_attn = read_linear_attn(r, tc);
    let quantization = read_quantization(r, root, tc);
    check_text_fields(r, &f, &quantization);
    let layer_kinds = check_linear_attn(r, &linear_attn, f.num_hidden_layers);
    let TextFields {
        hidden_size,
        vocab_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        intermediate_size,
        hidden_act,
        activation_situ_beta,
        activation_situ_linear_beta,
        rms_norm_eps,
        q_lora_rank,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        mla_use_nope,
        mla_use_output_gate,
        num_experts,
        num_experts_per_token,
        num_shared_experts,
        moe_intermediate_size,
        routed_expert_hidden_size,
        latent_moe_use_norm,
        moe_router_activation_func,
        moe_renormalize,
        routed_scaling_factor,
        topk_method,
        num_expert_group,
        topk_group,
        first_k_dense_replace,
        moe_layer_freq,
        attn_res_block_size,
        bos,
        eos,
        pad,
        tie_word_embeddings,
    } = f;
    Some(ModelConfig {
        hidden_size: hidden_size?,
        vocab_size: vocab_size?,
        num_hidden_layers: num_hidden_layers?,
        num_attention_heads: num_attention_heads?,
        num_key_value_heads: num_key_value_heads?,
        intermediate_size: intermediate_size?,
        hidden_act: hidden_act?,
        activation_situ_beta: activation_situ_beta?,
        activation_situ_linear_beta: activation_situ_linear_beta?,
        rms_norm_eps: rms_norm_eps?,
        q_lora_rank: q_lora_rank?,
        kv_lora_rank: kv_lora_rank?,
        qk_nope_head_dim: qk_nope_head_dim?,
        qk_rope_head_dim: qk_rope_head_dim?,
        v_head_dim: v_head_dim?,
        mla_use_nope: mla_use_nope?,
        mla_use_output_gate: mla_use_output_gate?,
        num_experts: num_experts?,
        num_experts_per_token: num_experts_per_token?,
        num_shared_experts: num_shared_experts?,
        moe_intermediate_size: moe_intermediate_size?,
        routed_expert_hidden_size: routed_expert_hidden_size?,
        latent_moe_use_norm: latent_moe_use_norm?,
        moe_router_activation_func: moe_router_activation_func?,
        moe_renormalize: moe_renormalize?,
        routed_scaling_factor: routed_scaling_factor?,
        topk_method: topk_method?,
        num_expert_group: num_expert_group?,
        topk_group: topk_group?,
        first_k_dense_replace: first_k_dense_replace?,
        moe_layer_freq: moe_layer_freq?,
        attn_res_block_size: attn_res_block_size?,
        bos_token_id: bos? as u32,
        eos_token_id: eos? as u32,
        pad_token_id: pad?.map(|p| p as u32),
        tie_word_embeddings: tie_word_embeddings?,
        linear_attn: linear_attn?,
        quantization: quantization?,
        defaulted: std::mem::take(&mut r.defaulted),
        layer_kinds: layer_kinds?,
    })
}

/// The scalar fields of `text_config` as read: `None` when missing or malformed (the
/// problem is recorded).
struct TextFields {
    hidden_size: Option<usize>,
    vocab_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    intermediate_size: Option<usize>,
    hidden_act: Option<String>,
    activation_situ_beta: Option<f32>,
    activation_situ_linear_beta: Option<f32>,
    rms_norm_eps: Option<f32>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    mla_use_nope: Option<bool>,
    mla_use_output_gate: Option<bool>,
    num_experts: Option<usize>,
    num_experts_per_token: Option<usize>,
    num_shared_experts: Option<usize>,
    moe_intermediate_size: Option<usize>,
    routed_expert_hidden_size: Option<usize>,
    latent_moe_use_norm: Option<bool>,
    moe_router_activation_func: Option<String>,
    moe_renormalize: Option<bool>,
    routed_scaling_factor: Option<f32>,
    topk_method: Option<String>,
    num_expert_group: Option<usize>,
    topk_group: Option<usize>,
    first_k_dense_replace: Option<usize>,
    moe_layer_freq: Option<usize>,
    attn_res_block_size: Option<usize>,
    bos: Option<usize>,
    eos: Option<usize>,
    pad: Option<Option<usize>>,
    tie_word_embeddings: Option<bool>,
}

/// Read `text_config`'s scalar fields, in the order problems are reported.
fn read_text_fields(r: &mut Reader, tc: &Map<String, Value>) -> TextFields {
    let hidden_size = r.usize(tc, TC, "hidden_size");
    let vocab_size = r.usize(tc, TC, "vocab_size");
    let num_hidden_layers = r.usize(tc, TC, "num_hidden_layers");
    let num_attention_heads = r.usize(tc, TC, "num_attention_heads");
    let num_key_value_heads = r.usize(tc, TC, "num_key_value_heads");
    let intermediate_size = r.usize(tc, TC, "intermediate_size");
    let hidden_act = r.string(tc, TC, "hidden_act");
    let activation_situ_beta = r.f32(tc, TC, "activation_situ_beta");
    let activation_situ_linear_beta = r.f32(tc, TC, "activation_situ_linear_beta");
    let rms_norm_eps = r.f32(tc, TC, "rms_norm_eps");
    let q_lora_rank = r.usize(tc, TC, "q_lora_rank");
    let kv_lora_rank = r.usize(tc, TC, "kv_lora_rank");
    let qk_nope_head_dim = r.usize(tc, TC, "qk_nope_head_dim");
    let qk_rope_head_dim = r.usize(tc, TC, "qk_rope_head_dim");
    let v_head_dim = r.usize(tc, TC, "v_head_dim");
    let mla_use_nope = r.bool(tc, TC, "mla_use_nope");
    let mla_use_output_gate = r.bool(tc, TC, "mla_use_output_gate");
    let num_experts = r.usize(tc, TC, "num_experts");
    let num_experts_per_token = r.usize(tc, TC, "num_experts_per_token");
    let num_shared_experts = r.usize(tc, TC, "num_shared_experts");
    let moe_intermediate_size = r.usize(tc, TC, "moe_intermediate_size");
    let routed_expert_hidden_size = r.usize(tc, TC, "routed_expert_hidden_size");
    let latent_moe_use_norm = r.bool(tc, TC, "latent_moe_use_norm");
    let moe_router_activation_func = r.string(tc, TC, "moe_router_activation_func");
    let moe_renormalize = r.bool(tc, TC, "moe_renormalize");
    let routed_scaling_factor = r.f32(tc, TC, "routed_scaling_factor");
    let topk_method = r.switch_str(
        tc,
        TC,
        "topk_method",
        "noaux_tc",
        "only bias-corrected \"noaux_tc\" selection is implemented",
    );
    let _use_grouped = r.switch_bool(
        tc,
        TC,
        "use_grouped_topk",
        true,
        "K3 sets it; with one group it is plain top-k",
    );
    let num_expert_group = r.switch_usize(
        tc,
        TC,
        "num_expert_group",
        1,
        "grouped top-k with more than one group is not implemented",
    );
    let topk_group = r.switch_usize(
        tc,
        TC,
        "topk_group",
        1,
        "grouped top-k with more than one group is not implemented",
    );
    let first_k_dense_replace = r.usize(tc, TC, "first_k_dense_replace");
    let moe_layer_freq = match tc.get("moe_layer_freq") {
        None => {
            r.defaulted.push(format!("{TC}.moe_layer_freq"));
            Some(1)
        }
        Some(v) => r.as_usize(v, &format!("{TC}.moe_layer_freq")),
    };
    let attn_res_block_size = r.usize(tc, TC, "attn_res_block_size");
    let bos = r.usize(tc, TC, "bos_token_id");
    let eos = r.usize(tc, TC, "eos_token_id");
    let pad = match tc.get("pad_token_id") {
        None | Some(Value::Null) => Some(None),
        Some(v) => r.as_usize(v, &format!("{TC}.pad_token_id")).map(Some),
    };
    let tie_word_embeddings = r.bool(tc, TC, "tie_word_embeddings");
    TextFields {
        hidden_size,
        vocab_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        intermediate_size,
        hidden_act,
        activation_situ_beta,
        activation_situ_linear_beta,
        rms_norm_eps,
        q_lora_rank,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        mla_use_nope,
        mla_use_output_gate,
        num_experts,
        num_experts_per_token,
        num_shared_experts,
        moe_intermediate_size,
        routed_expert_hidden_size,
        latent_moe_use_norm,
        moe_router_activation_func,
        moe_renormalize,
        routed_scaling_factor,
        topk_method,
        num_expert_group,
        topk_group,
        first_k_dense_replace,
        moe_layer_freq,
        attn_res_block_size,
        bos,
        eos,
        pad,
        tie_word_embeddings,
    }
}

/// Read `text_config.linear_attn_config`.
fn read_linear_attn(r: &mut Reader, tc: &Map<String, Value>) -> Option<LinearAttnConfig> {
    let la = r.object(tc, TC, "linear_attn_config");
    la.and_then(|la| {
        let num_heads = r.usize(la, LA, "num_heads");
        let head_dim = r.usize(la, LA, "head_dim");
        let short_conv_kernel_size = r.usize(la, LA, "short_conv_kernel_size");
        let use_full_rank_gate = r.switch_bool(
            la,
            LA,
            "use_full_rank_gate",
            true,
            "only the full-rank output gate g_proj is implemented, not the g_a/g_b pair",
        );
        let gate_lower_bound = r.f32(la, LA, "gate_lower_bound");
        let kda_layers = r.usize_list(la, LA, "kda_layers");
        let full_attn_layers = r.usize_list(la, LA, "full_attn_layers");
        Some(LinearAttnConfig {
            num_heads: num_heads?,
            head_dim: head_dim?,
            short_conv_kernel_size: short_conv_kernel_size?,
            use_full_rank_gate: use_full_rank_gate?,
            gate_lower_bound: gate_lower_bound?,
            kda_layers: kda_layers?,
            full_attn_layers: full_attn_layers?,
        })
    })
}

/// Read the quantization config: `None` when it is malformed, `Some(None)` when absent.
fn read_quantization(
    r: &mut Reader,
    root: &Map<String, Value>,
    tc: &Map<String, Value>,
) -> Option<Option<QuantConfig>> {
    // quantization_config: inside text_config (released); a loaded-and-resaved HF config may
    // carry it at the top level instead.
    let qc_val = match (
        tc.get("quantization_config"),
        root.get("quantization_config"),
    ) {
        (Some(v), _) => Some((v, QC)),
        (None, Some(v)) => Some((v, "config.quantization_config")),
        (None, None) => None,
    };
    match qc_val {
        None | Some((Value::Null, _)) => Some(None),
        Some((v, path)) => read_quant(r, v, path).map(Some),
    }
}

/// Check the values present against each other and the supported range (each check
/// only when its inputs were read).
fn check_text_fields(r: &mut Reader, f: &TextFields, quantization: &Option<Option<QuantConfig>>) {
    let TextFields {
        hidden_size,
        vocab_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        intermediate_size,
        q_lora_rank,
        kv_lora_rank,
        qk_nope_head_dim,
        v_head_dim,
        num_experts,
        num_experts_per_token,
        moe_intermediate_size,
        routed_expert_hidden_size,
        first_k_dense_replace,
        moe_layer_freq,
        attn_res_block_size,
        ..
    } = *f;
    let why_pos = |r: &mut Reader, v: Option<usize>, key: &str| {
        if v == Some(0) {
            r.problem(format!("{TC}.{key} = 0 must be at least 1"));
        }
    };
    for (v, k) in [
        (hidden_size, "hidden_size"),
        (vocab_size, "vocab_size"),
        (num_hidden_layers, "num_hidden_layers"),
        (num_attention_heads, "num_attention_heads"),
        (num_key_value_heads, "num_key_value_heads"),
        (intermediate_size, "intermediate_size"),
        (q_lora_rank, "q_lora_rank"),
        (kv_lora_rank, "kv_lora_rank"),
        (qk_nope_head_dim, "qk_nope_head_dim"),
        (v_head_dim, "v_head_dim"),
        (num_experts, "num_experts"),
        (num_experts_per_token, "num_experts_per_token"),
        (moe_intermediate_size, "moe_intermediate_size"),
        (routed_expert_hidden_size, "routed_expert_hidden_size"),
        (attn_res_block_size, "attn_res_block_size"),
        (moe_layer_freq, "moe_layer_freq"),
    ] {
        why_pos(r, v, k);
    }
    if let (Some(h), Some(kv)) = (num_attention_heads, num_key_value_heads) {
        if h != kv {
            r.problem(format!(
                "{TC}.num_key_value_heads = {kv} differs from num_attention_heads = {h} (MLA is \
                 multi-head after kv_b expansion; grouped KV heads are not supported)"
            ));
        }
    }
    if let (Some(k), Some(e)) = (num_experts_per_token, num_experts) {
        if k > e {
            r.problem(format!(
                "{TC}.num_experts_per_token = {k} is more than num_experts = {e} (top-k must not \
                 exceed the expert count)"
            ));
        }
    }
    if let Some(n) = num_hidden_layers {
        if n > MAX_LAYERS {
            r.problem(format!(
                "{TC}.num_hidden_layers = {n} is implausible (more than {MAX_LAYERS})"
            ));
        }
    }
    if let (Some(f), Some(n)) = (first_k_dense_replace, num_hidden_layers) {
        if f > n {
            r.problem(format!(
                "{TC}.first_k_dense_replace = {f} is more than num_hidden_layers = {n}"
            ));
        }
    }
    check_text_values(r, f, quantization);
}

/// Check the supported activations and switches, positive scalars, token ids inside the
/// vocabulary, and MXFP4 expert sizes in whole groups.
fn check_text_values(r: &mut Reader, f: &TextFields, quantization: &Option<Option<QuantConfig>>) {
    let TextFields {
        vocab_size,
        ref hidden_act,
        activation_situ_beta,
        activation_situ_linear_beta,
        rms_norm_eps,
        mla_use_nope,
        moe_intermediate_size,
        routed_expert_hidden_size,
        ref moe_router_activation_func,
        routed_scaling_factor,
        bos,
        eos,
        pad,
        ..
    } = *f;
    if let Some(a) = &hidden_act {
        if a != "situ" {
            r.problem(format!(
                "{TC}.hidden_act = {a:?} is not supported (only \"situ\", SiTU-GLU)"
            ));
        }
    }
    if let Some(a) = &moe_router_activation_func {
        if a != "sigmoid" {
            r.problem(format!(
                "{TC}.moe_router_activation_func = {a:?} is not supported (only \"sigmoid\")"
            ));
        }
    }
    if mla_use_nope == Some(false) {
        r.problem(format!(
            "{TC}.mla_use_nope = false is not supported (K3's MLA has no rotary embedding and \
             the config gives no RoPE parameters)"
        ));
    }
    for (v, k) in [
        (activation_situ_beta, "activation_situ_beta"),
        (activation_situ_linear_beta, "activation_situ_linear_beta"),
        (rms_norm_eps, "rms_norm_eps"),
        (routed_scaling_factor, "routed_scaling_factor"),
    ] {
        if let Some(x) = v {
            if x <= 0.0 {
                r.problem(format!("{TC}.{k} = {x} must be positive"));
            }
        }
    }
    if let Some(vocab) = vocab_size {
        for (v, k) in [
            (bos, "bos_token_id"),
            (eos, "eos_token_id"),
            (pad.flatten(), "pad_token_id"),
        ] {
            if let Some(id) = v {
                if id >= vocab {
                    r.problem(format!(
                        "{TC}.{k} = {id} is outside the vocabulary 0..{vocab}"
                    ));
                }
            }
        }
    }
    if let (Some(Some(q)), Some(f), Some(lat)) = (
        &quantization,
        moe_intermediate_size,
        routed_expert_hidden_size,
    ) {
        for (dim, k) in [
            (f, "moe_intermediate_size"),
            (lat, "routed_expert_hidden_size"),
        ] {
            if q.group_size > 0 && dim % q.group_size != 0 {
                r.problem(format!(
                    "{TC}.{k} = {dim} is not a multiple of the MXFP4 group size {} (an MXFP4 \
                     expert needs whole groups)",
                    q.group_size
                ));
            }
        }
    }
}

/// Check the linear-attention values and build the layer map (`None` on a problem).
fn check_linear_attn(
    r: &mut Reader,
    linear_attn: &Option<LinearAttnConfig>,
    num_hidden_layers: Option<usize>,
) -> Option<Vec<LayerKind>> {
    let mut layer_kinds = None;
    if let (Some(la), Some(n)) = (&linear_attn, num_hidden_layers) {
        if la.gate_lower_bound >= 0.0 {
            r.problem(format!(
                "{LA}.gate_lower_bound = {} must be negative (bounded-sigmoid decay gate)",
                la.gate_lower_bound
            ));
        }
        for (v, k) in [
            (la.num_heads, "num_heads"),
            (la.head_dim, "head_dim"),
            (la.short_conv_kernel_size, "short_conv_kernel_size"),
        ] {
            if v == 0 {
                r.problem(format!("{LA}.{k} = 0 must be at least 1"));
            }
        }
        if n <= MAX_LAYERS {
            layer_kinds = check_layer_map(r, la, n);
        }
    }
    layer_kinds
}

/// Check the ONE-based lists: entries in 1..=n, no duplicates, disjoint, union = all layers.
fn check_layer_map(r: &mut Reader, la: &LinearAttnConfig, n: usize) -> Option<Vec<LayerKind>> {
    let mut kind: Vec<Option<(LayerKind, &str)>> = vec![None; n];
    let before = r.problems.len();
    for (list, name, k) in [
        (&la.kda_layers, "kda_layers", LayerKind::Kda),
        (&la.full_attn_layers, "full_attn_layers", LayerKind::Mla),
    ] {
        for (i, &x) in list.iter().enumerate() {
            if x == 0 || x > n {
                r.problem(format!(
                    "{LA}.{name}[{i}] = {x} is outside 1..{n} (the list is ONE-based: layer l \
                     (0-based) is listed as l+1)"
                ));
                continue;
            }
            match kind[x - 1] {
                None => kind[x - 1] = Some((k, name)),
                Some((_, other)) if other == name => {
                    r.problem(format!("{LA}.{name}[{i}] = {x} is listed twice"));
                }
                Some((_, other)) => {
                    r.problem(format!(
                        "{LA}.{name}[{i}] = {x} is also in {other} (the lists must be disjoint)"
                    ));
                }
            }
        }
    }
    let missing: Vec<String> = (0..n)
        .filter(|&l| kind[l].is_none())
        .map(|l| (l + 1).to_string())
        .collect();
    if !missing.is_empty() {
        r.problem(format!(
            "{LA}: layer(s) {} (ONE-based) are in neither kda_layers nor full_attn_layers (the \
             two lists must cover all {n} layers)",
            missing.join(", ")
        ));
    }
    if r.problems.len() != before {
        return None;
    }
    Some(
        kind.into_iter()
            .map(|k| k.map(|(k, _)| k).unwrap_or(LayerKind::Kda))
            .collect(),
    )
}

fn read_quant(r: &mut Reader, v: &Value, path: &str) -> Option<QuantConfig> {
    let Some(q) = v.as_object() else {
        r.problem(format!(
            "{path}: expected an object, found {}",
            type_name(v)
        ));
        return None;
    };
    let quant_method = r.string(q, path, "quant_method");
    let format = r.string(q, path, "format");
    if let Some(m) = &quant_method {
        if m != "compressed-tensors" {
            r.problem(format!(
                "{path}.quant_method = {m:?} is not supported (only \"compressed-tensors\")"
            ));
        }
    }
    if let Some(f) = &format {
        if f != "mxfp4-pack-quantized" {
            r.problem(format!(
                "{path}.format = {f:?} is not supported (only \"mxfp4-pack-quantized\")"
            ));
        }
    }
    let ignore = match q.get("ignore") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_str().map(str::to_string))
            .collect(),
        Some(x) => {
            r.problem(format!(
                "{path}.ignore: expected an array of strings, found {}",
                type_name(x)
            ));
            Vec::new()
        }
    };
    let groups = r.object(q, path, "config_groups")?;
    if groups.len() != 1 {
        r.problem(format!(
            "{path}.config_groups has {} groups; exactly one (the routed experts' MXFP4 scheme) \
             is supported",
            groups.len()
        ));
        return None;
    }
    let (gname, g) = groups.iter().next()?;
    let gpath = format!("{path}.config_groups.{gname}");
    let Some(g) = g.as_object() else {
        r.problem(format!(
            "{gpath}: expected an object, found {}",
            type_name(g)
        ));
        return None;
    };
    let w = r.object(g, &gpath, "weights")?;
    let wpath = format!("{gpath}.weights");
    let num_bits = r.usize(w, &wpath, "num_bits");
    let group_size = r.usize(w, &wpath, "group_size");
    let ty = r.string(w, &wpath, "type");
    if let Some(b) = num_bits {
        if b != 4 {
            r.problem(format!(
                "{wpath}.num_bits = {b} is not supported (MXFP4 has 4)"
            ));
        }
    }
    if let Some(gs) = group_size {
        if gs != 32 {
            r.problem(format!(
                "{wpath}.group_size = {gs} is not supported (MXFP4 groups are 32)"
            ));
        }
    }
    if let Some(t) = &ty {
        if t != "float" {
            r.problem(format!(
                "{wpath}.type = {t:?} is not supported (MXFP4 codes are \"float\" E2M1)"
            ));
        }
    }
    for key in ["symmetric"] {
        if let Some(Value::Bool(false)) = w.get(key) {
            r.problem(format!("{wpath}.{key} = false is not supported"));
        }
    }
    Some(QuantConfig {
        quant_method: quant_method?,
        format: format?,
        group_size: group_size?,
        num_bits: num_bits?,
        ignore,
    })
}
