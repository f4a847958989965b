//! The shape of a synthetic model: dimensions, layer kinds, the tensor list of every shard
//! (in the order the released safetensors writer lays them out) and the released-shape
//! `config.json` that describes it.
//!
//! Tensor order inside a layer shard follows the released files (k3-spec §7): the layer's
//! trunk first, F32 tensors then BF16 tensors, each group sorted by name (the safetensors
//! writer's order), then the routed experts in lexicographic name order so each expert's
//! tensors are contiguous (`experts.0.*`, `experts.1.*`, `experts.10.*`, ...).

use serde_json::{json, Value};

use k3_model::classify::{expert_tensor, layer_tensor, model_tensor, LM_HEAD};
use k3_model::tensor::Dtype;

/// Why a geometry cannot be read from a config, or cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum GeometryError {
    #[error("{path}: not valid JSON: {source}")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: missing or non-integer field(s): {}", fields.join(", "))]
    Missing { path: String, fields: Vec<String> },
    #[error(
        "{path}: text_config.linear_attn_config.full_attn_layers entry {entry} is not in \
         1..={layers}"
    )]
    FullAttnEntry {
        path: String,
        entry: String,
        layers: usize,
    },
    /// Dimensions this tool cannot write a model for: every problem found.
    #[error("{}", .0.join("; "))]
    Unwritable(Vec<String>),
}

/// Dimensions of a synthetic model (field meanings as in k3-spec §1).
#[derive(Clone, Debug, PartialEq)]
pub struct Geometry {
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub mla_heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_head: usize,
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub conv: usize,
    pub experts: usize,
    pub top_k: usize,
    pub moe_inter: usize,
    pub latent: usize,
    pub n_shared: usize,
    pub dense_inter: usize,
    pub first_dense: usize,
    pub attn_res_block: usize,
    pub rms_eps: f64,
    pub routed_scaling_factor: f64,
    pub max_pos: usize,
    pub bos: usize,
    pub eos: usize,
    pub pad: usize,
    /// Per layer (0-based): true for MLA, false for KDA.
    pub mla: Vec<bool>,
    /// A line for config.json's `k3_synth.note` (what differs from the release).
    pub note: String,
}

/// Layer kinds by the released rule: MLA iff (l+1) % 4 == 0 or l is the last layer
/// (released: 3, 7, ..., 87, 91, 92; tiny: 3, 7, 11, 12).
pub fn default_layer_kinds(layers: usize) -> Vec<bool> {
    (0..layers)
        .map(|l| (l + 1) % 4 == 0 || l + 1 == layers)
        .collect()
}

impl Geometry {
    /// The 13-layer geometry of `tests/fixtures/tiny-mxfp4/config.json`.
    pub fn tiny() -> Geometry {
        Geometry {
            vocab: 256,
            hidden: 128,
            layers: 13,
            mla_heads: 4,
            q_lora: 64,
            kv_lora: 32,
            nope: 24,
            rope: 8,
            v_head: 16,
            kda_heads: 4,
            kda_head_dim: 16,
            conv: 4,
            experts: 8,
            top_k: 2,
            moe_inter: 64,
            latent: 64,
            n_shared: 2,
            dense_inter: 96,
            first_dense: 1,
            attn_res_block: 3,
            rms_eps: 1e-5,
            routed_scaling_factor: 2.5,
            max_pos: 4096,
            bos: 253,
            eos: 254,
            pad: 255,
            mla: default_layer_kinds(13),
            note: "tiny: the 13-layer geometry of tests/fixtures/tiny-mxfp4, random weights"
                .to_string(),
        }
    }

    /// Released per-layer dimensions with few layers and experts (k3-spec §1, §2).
    /// The vocabulary is reduced (`vocab`), so the special ids move to its top.
    pub fn slice(vocab: usize) -> Geometry {
        let layers = 4;
        Geometry {
            vocab,
            hidden: 7168,
            layers,
            mla_heads: 96,
            q_lora: 1536,
            kv_lora: 512,
            nope: 128,
            rope: 64,
            v_head: 128,
            kda_heads: 96,
            kda_head_dim: 128,
            conv: 4,
            experts: 64,
            top_k: 16,
            moe_inter: 3072,
            latent: 3584,
            n_shared: 2,
            dense_inter: 33792,
            first_dense: 1,
            attn_res_block: 12,
            rms_eps: 1e-5,
            routed_scaling_factor: 1.0,
            max_pos: 1048576,
            bos: vocab.saturating_sub(256),
            eos: vocab.saturating_sub(254),
            pad: vocab.saturating_sub(1),
            mla: default_layer_kinds(layers),
            note: String::new(),
        }
    }

    /// Read the dimensions from a config.json in the released nested shape (or a flat
    /// text config). Every field used must be present; errors name the field.
    pub fn from_config_json(text: &str, path: &str) -> Result<Geometry, GeometryError> {
        let root: Value = serde_json::from_str(text).map_err(|source| GeometryError::Json {
            path: path.to_string(),
            source,
        })?;
        let tc = root.get("text_config").unwrap_or(&root);
        let mut missing = Vec::new();
        let mut num = |obj: &Value, key: &str, prefix: &str| -> usize {
            match obj.get(key).and_then(Value::as_u64) {
                Some(v) => v as usize,
                None => {
                    missing.push(format!("{prefix}{key}"));
                    0
                }
            }
        };
        let la = tc.get("linear_attn_config").unwrap_or(&Value::Null);
        let mut g = Geometry {
            vocab: num(tc, "vocab_size", "text_config."),
            hidden: num(tc, "hidden_size", "text_config."),
            layers: num(tc, "num_hidden_layers", "text_config."),
            mla_heads: num(tc, "num_attention_heads", "text_config."),
            q_lora: num(tc, "q_lora_rank", "text_config."),
            kv_lora: num(tc, "kv_lora_rank", "text_config."),
            nope: num(tc, "qk_nope_head_dim", "text_config."),
            rope: num(tc, "qk_rope_head_dim", "text_config."),
            v_head: num(tc, "v_head_dim", "text_config."),
            kda_heads: num(la, "num_heads", "text_config.linear_attn_config."),
            kda_head_dim: num(la, "head_dim", "text_config.linear_attn_config."),
            conv: num(
                la,
                "short_conv_kernel_size",
                "text_config.linear_attn_config.",
            ),
            experts: num(tc, "num_experts", "text_config."),
            top_k: num(tc, "num_experts_per_token", "text_config."),
            moe_inter: num(tc, "moe_intermediate_size", "text_config."),
            latent: num(tc, "routed_expert_hidden_size", "text_config."),
            n_shared: num(tc, "num_shared_experts", "text_config."),
            dense_inter: num(tc, "intermediate_size", "text_config."),
            first_dense: num(tc, "first_k_dense_replace", "text_config."),
            attn_res_block: num(tc, "attn_res_block_size", "text_config."),
            max_pos: num(tc, "max_position_embeddings", "text_config."),
            bos: num(tc, "bos_token_id", "text_config."),
            eos: num(tc, "eos_token_id", "text_config."),
            pad: num(tc, "pad_token_id", "text_config."),
            rms_eps: tc
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-5),
            routed_scaling_factor: tc
                .get("routed_scaling_factor")
                .and_then(Value::as_f64)
                .unwrap_or(1.0),
            mla: Vec::new(),
            note: format!("shape from {path}"),
        };
        if !missing.is_empty() {
            return Err(GeometryError::Missing {
                path: path.to_string(),
                fields: missing,
            });
        }
        // Layer kinds from the ONE-based full_attn_layers list when present.
        g.mla = match la.get("full_attn_layers").and_then(Value::as_array) {
            Some(list) => {
                let mut mla = vec![false; g.layers];
                for v in list {
                    let n = v.as_u64().unwrap_or(0) as usize;
                    if n == 0 || n > g.layers {
                        return Err(GeometryError::FullAttnEntry {
                            path: path.to_string(),
                            entry: v.to_string(),
                            layers: g.layers,
                        });
                    }
                    mla[n - 1] = true;
                }
                mla
            }
            None => default_layer_kinds(g.layers),
        };
        Ok(g)
    }

    /// Change the layer count (layer kinds follow the released rule).
    pub fn set_layers(&mut self, layers: usize) {
        self.layers = layers;
        self.mla = default_layer_kinds(layers);
    }

    /// Check the dimensions make a model this tool can write.
    pub fn check(&self) -> Result<(), GeometryError> {
        let mut bad = Vec::new();
        for (name, v) in [
            ("vocab", self.vocab),
            ("hidden", self.hidden),
            ("layers", self.layers),
            ("mla_heads", self.mla_heads),
            ("kda_heads", self.kda_heads),
            ("kda_head_dim", self.kda_head_dim),
            ("experts", self.experts),
            ("top_k", self.top_k),
            ("moe_intermediate_size", self.moe_inter),
            ("routed_expert_hidden_size", self.latent),
            ("conv", self.conv),
        ] {
            if v == 0 {
                bad.push(format!("{name} must be > 0"));
            }
        }
        if self.top_k > self.experts {
            bad.push(format!(
                "top-k {} is more than the {} experts",
                self.top_k, self.experts
            ));
        }
        if self.first_dense > self.layers {
            bad.push(format!(
                "first_k_dense_replace {} > {} layers",
                self.first_dense, self.layers
            ));
        }
        if self.mla.len() != self.layers {
            bad.push("layer kind list does not match the layer count".to_string());
        }
        if self.layers > 99_999 {
            bad.push("more than 99,999 layers".to_string());
        }
        if bad.is_empty() {
            Ok(())
        } else {
            Err(GeometryError::Unwritable(bad))
        }
    }

    /// Whether the routed experts can be MXFP4 (both dimensions multiples of 32).
    pub fn experts_mxfp4(&self) -> bool {
        self.latent.is_multiple_of(32) && self.moe_inter.is_multiple_of(32)
    }

    /// Bytes of one routed expert.
    pub fn expert_bytes(&self) -> u64 {
        expert_tensors_e(self, 0, 0)
            .iter()
            .map(TensorSpec::bytes)
            .sum()
    }

    fn is_moe(&self, l: usize) -> bool {
        l >= self.first_dense
    }

    /// The released `config.json` (nested text_config, linear_attn_config,
    /// quantization_config inside text_config) for this geometry.
    pub fn config_json(&self, shape: &str, seed: u64) -> Value {
        let kda: Vec<usize> = (0..self.layers)
            .filter(|&l| !self.mla[l])
            .map(|l| l + 1)
            .collect();
        let full: Vec<usize> = (0..self.layers)
            .filter(|&l| self.mla[l])
            .map(|l| l + 1)
            .collect();
        let mut tc = json!({
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.mla_heads,
            "num_key_value_heads": self.mla_heads,
            "intermediate_size": self.dense_inter,
            "hidden_act": "situ",
            "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0,
            "rms_norm_eps": self.rms_eps,
            "initializer_range": 0.02,
            "max_position_embeddings": self.max_pos,
            "tie_word_embeddings": false,
            "bos_token_id": self.bos,
            "eos_token_id": self.eos,
            "pad_token_id": self.pad,
            "use_cache": true,
        });
        let more = self.text_config_rest(&kda, &full);
        if let (Some(a), Value::Object(b)) = (tc.as_object_mut(), more) {
            a.extend(b);
        }
        if self.experts_mxfp4() {
            tc["quantization_config"] = mxfp4_quantization_config();
        }
        json!({
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "bos_token_id": self.bos,
            "eos_token_id": self.eos,
            "pad_token_id": self.pad,
            "dtype": "bfloat16",
            "tie_word_embeddings": false,
            "text_config": tc,
            "k3_synth": {
                "tool": "k3-orch synth",
                "shape": shape,
                "seed": seed,
                "random_weights": true,
                "note": self.note,
            }
        })
    }

    /// The text config's MLA, MoE and linear-attention fields (after the common ones).
    fn text_config_rest(&self, kda: &[usize], full: &[usize]) -> Value {
        json!({
            "q_lora_rank": self.q_lora,
            "kv_lora_rank": self.kv_lora,
            "qk_nope_head_dim": self.nope,
            "qk_rope_head_dim": self.rope,
            "v_head_dim": self.v_head,
            "mla_use_nope": true,
            "mla_use_output_gate": true,
            "num_experts": self.experts,
            "num_experts_per_token": self.top_k,
            "num_shared_experts": self.n_shared,
            "moe_intermediate_size": self.moe_inter,
            "routed_expert_hidden_size": self.latent,
            "latent_moe_use_norm": true,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": true,
            "routed_scaling_factor": self.routed_scaling_factor,
            "topk_method": "noaux_tc",
            "use_grouped_topk": true,
            "num_expert_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": self.first_dense,
            "moe_layer_freq": 1,
            "num_nextn_predict_layers": 0,
            "attn_res_block_size": self.attn_res_block,
            "linear_attn_config": {
                "num_heads": self.kda_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.conv,
                "use_full_rank_gate": true,
                "gate_lower_bound": -5.0,
                "kda_layers": kda,
                "full_attn_layers": full,
            },
        })
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// ~N(0, std) (a projection: std = 1/sqrt(in)).
    Normal(f32),
    /// 1 + ~N(0, 0.02): a norm gain.
    Gain,
    /// KDA A_log: log of a decay rate in [0.5, 8) for the first `heads` entries, 0 after.
    ALog(usize),
    /// Uniform in [lo, hi).
    Uniform(f32, f32),
    /// MXFP4 codes: uniform random bytes.
    Packed,
    /// E8M0 scales: `center - 1 ..= center + 1`.
    Scale(u8),
    /// MXFP4 codes quantized from N(0, std) groups (`synth --weights gaussian`).
    QuantCodes(f32),
    /// The E8M0 scales of those groups.
    QuantScales(f32),
}

/// One tensor to write.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl TensorSpec {
    pub fn bytes(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product::<u64>() * self.dtype.size() as u64
    }
}

fn t(name: String, dtype: Dtype, shape: &[usize], init: Init) -> TensorSpec {
    TensorSpec {
        name,
        dtype,
        shape: shape.to_vec(),
        init,
    }
}

fn lin(name: String, out: usize, inp: usize) -> TensorSpec {
    t(
        name,
        Dtype::BF16,
        &[out, inp],
        Init::Normal(1.0 / (inp.max(1) as f32).sqrt()),
    )
}

/// The E8M0 byte that makes uniform random E2M1 codes (rms ≈ 2.93) have rms 1/sqrt(in).
pub fn scale_center(inp: usize) -> u8 {
    let target = 1.0 / (inp.max(1) as f64).sqrt() / 2.926;
    let e = 127.0 + target.log2();
    e.round().clamp(2.0, 252.0) as u8
}

/// Tensors of routed expert `e` of layer `l`, in their on-disk order.
fn expert_tensors_e(g: &Geometry, l: usize, e: usize) -> Vec<TensorSpec> {
    let name = |suffix: &str| expert_tensor(l, e, suffix);
    // (name, rows, cols): w1 gate and w3 up map latent -> F; w2 maps back.
    let mats = [
        ("w1", g.moe_inter, g.latent),
        ("w2", g.latent, g.moe_inter),
        ("w3", g.moe_inter, g.latent),
    ];
    let mut out = Vec::with_capacity(6);
    for (w, rows, cols) in mats {
        if g.experts_mxfp4() {
            out.push(t(
                name(&format!("{w}.weight_packed")),
                Dtype::U8,
                &[rows, cols / 2],
                Init::Packed,
            ));
            out.push(t(
                name(&format!("{w}.weight_scale")),
                Dtype::U8,
                &[rows, cols / 32],
                Init::Scale(scale_center(cols)),
            ));
        } else {
            out.push(lin(name(&format!("{w}.weight")), rows, cols));
        }
    }
    out
}

/// The non-expert ("trunk") tensors of layer `l`, unsorted.
fn trunk_tensors(g: &Geometry, l: usize) -> Vec<TensorSpec> {
    // `p(suffix)`, `a(suffix)` and `m(suffix)`: names in the layer, its attention and
    // its MoE block.
    let p = |suffix: &str| layer_tensor(l, suffix);
    let a = |suffix: &str| layer_tensor(l, &format!("self_attn.{suffix}"));
    let m = |suffix: &str| layer_tensor(l, &format!("block_sparse_moe.{suffix}"));
    let d = g.hidden;
    let mut v = Vec::new();
    for n in [
        "input_layernorm",
        "post_attention_layernorm",
        "self_attention_res_norm",
        "mlp_res_norm",
    ] {
        v.push(t(p(&format!("{n}.weight")), Dtype::BF16, &[d], Init::Gain));
    }
    for n in ["self_attention_res_proj", "mlp_res_proj"] {
        v.push(lin(p(&format!("{n}.weight")), 1, d));
    }
    if g.mla[l] {
        let h = g.mla_heads;
        v.push(lin(a("q_a_proj.weight"), g.q_lora, d));
        v.push(t(
            a("q_a_layernorm.weight"),
            Dtype::BF16,
            &[g.q_lora],
            Init::Gain,
        ));
        v.push(lin(a("q_b_proj.weight"), h * (g.nope + g.rope), g.q_lora));
        v.push(lin(a("kv_a_proj_with_mqa.weight"), g.kv_lora + g.rope, d));
        v.push(t(
            a("kv_a_layernorm.weight"),
            Dtype::BF16,
            &[g.kv_lora],
            Init::Gain,
        ));
        v.push(lin(
            a("kv_b_proj.weight"),
            h * (g.nope + g.v_head),
            g.kv_lora,
        ));
        v.push(lin(a("g_proj.weight"), h * g.v_head, d));
        v.push(lin(a("o_proj.weight"), d, h * g.v_head));
    } else {
        let hd = g.kda_head_dim;
        let pp = g.kda_heads * hd;
        for n in ["q_proj", "k_proj", "v_proj", "g_proj"] {
            v.push(lin(a(&format!("{n}.weight")), pp, d));
        }
        v.push(lin(a("o_proj.weight"), d, pp));
        let conv_std = 1.0 / (g.conv as f32).sqrt();
        for n in ["q_conv1d", "k_conv1d", "v_conv1d"] {
            v.push(t(
                a(&format!("{n}.weight")),
                Dtype::F32,
                &[pp, 1, g.conv],
                Init::Normal(conv_std),
            ));
        }
        v.push(lin(a("f_a_proj.weight"), hd, d));
        v.push(lin(a("f_b_proj.weight"), pp, hd));
        v.push(t(a("dt_bias"), Dtype::F32, &[pp], Init::Uniform(-1.0, 1.0)));
        v.push(t(
            a("A_log"),
            Dtype::F32,
            &[hd.max(g.kda_heads)],
            Init::ALog(g.kda_heads),
        ));
        v.push(lin(a("b_proj.weight"), g.kda_heads, d));
        v.push(t(a("o_norm.weight"), Dtype::F32, &[hd], Init::Gain));
    }
    if g.is_moe(l) {
        v.push(lin(m("gate.weight"), g.experts, d));
        v.push(t(
            m("gate.e_score_correction_bias"),
            Dtype::F32,
            &[g.experts],
            Init::Uniform(-0.01, 0.01),
        ));
        v.push(lin(m("routed_expert_down_proj.weight"), g.latent, d));
        v.push(t(
            m("routed_expert_norm.weight"),
            Dtype::BF16,
            &[g.latent],
            Init::Gain,
        ));
        v.push(lin(m("routed_expert_up_proj.weight"), d, g.latent));
        let fs = g.n_shared * g.moe_inter;
        v.push(lin(m("shared_experts.gate_proj.weight"), fs, d));
        v.push(lin(m("shared_experts.up_proj.weight"), fs, d));
        v.push(lin(m("shared_experts.down_proj.weight"), d, fs));
    } else {
        v.push(lin(p("mlp.gate_proj.weight"), g.dense_inter, d));
        v.push(lin(p("mlp.up_proj.weight"), g.dense_inter, d));
        v.push(lin(p("mlp.down_proj.weight"), d, g.dense_inter));
    }
    v
}

/// Sort key of the safetensors writer: wider dtypes first (F32, then BF16, then U8), then
/// the name.
fn dtype_rank(d: Dtype) -> u8 {
    match d {
        Dtype::F64 | Dtype::I64 => 0,
        Dtype::F32 | Dtype::I32 => 1,
        Dtype::BF16 | Dtype::F16 | Dtype::I16 => 2,
        _ => 3,
    }
}

fn writer_sort(v: &mut [TensorSpec]) {
    v.sort_by(|a, b| {
        (dtype_rank(a.dtype), a.name.as_str()).cmp(&(dtype_rank(b.dtype), b.name.as_str()))
    });
}

/// One shard: its file name and tensors in data order.
#[derive(Clone, Debug)]
pub struct ShardSpec {
    pub file: String,
    pub tensors: Vec<TensorSpec>,
    /// Number of leading tensors that are the layer trunk (all of them for the last shard).
    #[cfg_attr(not(test), allow(dead_code))]
    pub trunk_count: usize,
}

/// Every shard of the model: layer l in shard l+1, then the model-level shard.
pub fn shards(g: &Geometry) -> Vec<ShardSpec> {
    let total = g.layers + 1;
    let name = |i: usize| format!("model-{i:05}-of-{total:06}.safetensors");
    let mut out = Vec::with_capacity(total);
    for l in 0..g.layers {
        let mut trunk = trunk_tensors(g, l);
        writer_sort(&mut trunk);
        let trunk_count = trunk.len();
        let mut tensors = trunk;
        if g.is_moe(l) {
            let mut ids: Vec<String> = (0..g.experts).map(|e| e.to_string()).collect();
            ids.sort();
            for id in ids {
                let e: usize = id.parse().unwrap_or(0);
                tensors.extend(expert_tensors_e(g, l, e));
            }
        }
        out.push(ShardSpec {
            file: name(l + 1),
            tensors,
            trunk_count,
        });
    }
    let d = g.hidden;
    let mut last = vec![
        lin(model_tensor("embed_tokens.weight"), g.vocab, d),
        lin(LM_HEAD.into(), g.vocab, d),
        t(model_tensor("norm.weight"), Dtype::BF16, &[d], Init::Gain),
        t(
            model_tensor("output_attn_res_norm.weight"),
            Dtype::BF16,
            &[d],
            Init::Gain,
        ),
        lin(model_tensor("output_attn_res_proj.weight"), 1, d),
    ];
    // Embedding rows are looked up, not multiplied: give them unit scale.
    last[0].init = Init::Normal(1.0);
    writer_sort(&mut last);
    let n = last.len();
    out.push(ShardSpec {
        file: name(total),
        tensors: last,
        trunk_count: n,
    });
    out
}

/// The released checkpoint's `quantization_config` for MXFP4 routed experts
/// (compressed-tensors, group 32).
fn mxfp4_quantization_config() -> Value {
    json!({
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": null,
        "kv_cache_scheme": null,
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": ["Linear"],
                "input_activations": null,
                "output_activations": null,
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": true,
                    "dynamic": false,
                    "scale_dtype": "torch.uint8",
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "actorder": null,
                    "block_structure": null,
                    "zp_dtype": null
                }
            }
        },
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*"
        ]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trunk_bytes(s: &ShardSpec) -> u64 {
        s.tensors[..s.trunk_count]
            .iter()
            .map(TensorSpec::bytes)
            .sum()
    }

    /// The slice's per-layer runs must be the released ones (k3-spec §7: layer 0
    /// 2,341,213,184; KDA+MoE 1,267,744,256; MLA+MoE 844,335,616) and an expert exactly
    /// 17,547,264 bytes. A wrong shape anywhere (e.g. A_log as [96], or the shared
    /// experts at width 3072) moves one of these sums.
    #[test]
    fn slice_matches_released_sizes() {
        let mut g = Geometry::slice(8192);
        assert_eq!(g.expert_bytes(), 17_547_264);
        // The router (gate [E, 7168] BF16, e_score_correction_bias [E] F32) scales with the
        // expert count: at the default 64 experts a MoE layer's trunk is 832 x 14,340 bytes
        // smaller than released.
        let small = shards(&g);
        g.experts = 896;
        let s = shards(&g);
        assert_eq!(
            trunk_bytes(&s[1]) - trunk_bytes(&small[1]),
            832 * (7168 * 2 + 4)
        );
        assert_eq!(s.len(), 5);
        assert_eq!(trunk_bytes(&s[0]), 2_341_213_184);
        assert_eq!(trunk_bytes(&s[1]), 1_267_744_256);
        assert_eq!(trunk_bytes(&s[2]), 1_267_744_256);
        assert_eq!(trunk_bytes(&s[3]), 844_335_616);
        assert_eq!(s[0].file, "model-00001-of-000005.safetensors");
        // Released tensor counts per layer kind (spec §7: KDA 14 + common 6 + MoE trunk 8).
        assert_eq!(s[1].trunk_count, 14 + 6 + 8);
        assert_eq!(s[3].trunk_count, 8 + 6 + 8);
        assert_eq!(s[0].trunk_count, 14 + 6 + 3);
    }

    /// Layer kinds of the tiny fixture: full_attn_layers [4, 8, 12, 13] (one-based).
    #[test]
    fn tiny_layer_kinds() {
        let g = Geometry::tiny();
        let mla: Vec<usize> = (0..13).filter(|&l| g.mla[l]).collect();
        assert_eq!(mla, vec![3, 7, 11, 12]);
    }

    /// The E8M0 scale gives weights of rms ~1/sqrt(in): 3584 -> 2^-7.45 ⇒ 119/120.
    #[test]
    fn scale_centre_is_sane() {
        let c = scale_center(3584);
        assert!((118..=124).contains(&c), "{c}");
    }
}
