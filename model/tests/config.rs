//! Tests of the strict `config.json` reader against the released config (written from
//! k3-spec §1), the two tiny fixture configs and the seed's three rejections redone in the
//! released shape.

use k3_model::config::{ExpertFormat, LayerKind, ModelConfig};
use k3_model::tensor::Dtype;
use serde_json::Value;
use std::path::PathBuf;

fn fixture(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(p)
}

fn released_json() -> Value {
    let text = std::fs::read_to_string(fixture("released/config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn tiny_json() -> Value {
    let text = std::fs::read_to_string(fixture("tiny-mxfp4/config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn load_value(v: &Value) -> Result<ModelConfig, k3_model::config::ConfigError> {
    ModelConfig::from_json_str(&serde_json::to_string(v).unwrap())
}

/// Every value of the released config (k3-spec §1). A reader that looked for fields at the
/// top level (flat shape) or read the layer lists as 0-based fails here.
#[test]
fn released_config_every_value() {
    let c = ModelConfig::load(fixture("released/config.json")).unwrap();
    assert_eq!(c.hidden_size, 7168);
    assert_eq!(c.vocab_size, 163840);
    assert_eq!(c.num_hidden_layers, 93);
    assert_eq!(c.n_layers(), 93);
    assert_eq!(c.num_attention_heads, 96);
    assert_eq!(c.num_key_value_heads, 96);
    assert_eq!(c.intermediate_size, 33792);
    assert_eq!(c.hidden_act, "situ");
    assert_eq!(c.activation_situ_beta, 4.0);
    assert_eq!(c.activation_situ_linear_beta, 25.0);
    assert_eq!(c.rms_norm_eps, 1e-5f32);
    assert_eq!(c.q_lora_rank, 1536);
    assert_eq!(c.kv_lora_rank, 512);
    assert_eq!(c.qk_nope_head_dim, 128);
    assert_eq!(c.qk_rope_head_dim, 64);
    assert_eq!(c.v_head_dim, 128);
    assert_eq!(c.mla_qk_head_dim(), 192);
    assert!(c.mla_use_nope);
    assert!(c.mla_use_output_gate);
    assert_eq!(c.num_experts, 896);
    assert_eq!(c.num_experts_per_token, 16);
    assert_eq!(c.num_shared_experts, 2);
    assert_eq!(c.moe_intermediate_size, 3072);
    assert_eq!(c.shared_expert_width(), 6144);
    assert_eq!(c.routed_expert_hidden_size, 3584);
    assert!(c.latent_moe_use_norm);
    assert_eq!(c.moe_router_activation_func, "sigmoid");
    assert!(c.moe_renormalize);
    assert_eq!(c.routed_scaling_factor, 1.0);
    assert_eq!(c.topk_method, "noaux_tc");
    assert_eq!(c.num_expert_group, 1);
    assert_eq!(c.topk_group, 1);
    assert_eq!(c.first_k_dense_replace, 1);
    assert_eq!(c.moe_layer_freq, 1);
    assert_eq!(c.attn_res_block_size, 12);
    assert_eq!(c.bos_token_id, 163584);
    assert_eq!(c.eos_token_id, 163586);
    assert_eq!(c.pad_token_id, Some(163839));
    assert!(!c.tie_word_embeddings);
    let la = &c.linear_attn;
    assert_eq!(la.num_heads, 96);
    assert_eq!(la.head_dim, 128);
    assert_eq!(c.kda_dim(), 12288);
    assert_eq!(la.short_conv_kernel_size, 4);
    assert!(la.use_full_rank_gate);
    assert_eq!(la.gate_lower_bound, -5.0);
    assert_eq!(la.kda_layers.len(), 69);
    assert_eq!(la.full_attn_layers.len(), 24);
    let q = c
        .quantization
        .as_ref()
        .expect("quantization_config inside text_config");
    assert_eq!(q.quant_method, "compressed-tensors");
    assert_eq!(q.format, "mxfp4-pack-quantized");
    assert_eq!(q.group_size, 32);
    assert_eq!(q.num_bits, 4);
    assert_eq!(q.ignore.len(), 6);
    assert_eq!(c.expert_format(), ExpertFormat::Mxfp4 { group_size: 32 });
    assert!(c.defaulted.is_empty(), "{:?}", c.defaulted);

    // 0-based MLA layers 3, 7, ..., 87, 91, 92 (spec §1.1); both 91 and 92 are MLA.
    let mut want_mla: Vec<usize> = (3..=91).step_by(4).collect();
    want_mla.push(92);
    assert_eq!(want_mla.len(), 24);
    assert_eq!(c.mla_layer_indices(), want_mla);
    assert_eq!(c.layer_kind(91), LayerKind::Mla);
    assert_eq!(c.layer_kind(92), LayerKind::Mla);
    assert_eq!(c.layer_kind(90), LayerKind::Kda);
    assert_eq!(c.layer_kind(0), LayerKind::Kda);
    assert_eq!(c.kda_layer_indices().len(), 69);
    // Layer 0 dense, 1..92 MoE.
    assert!(!c.is_moe(0));
    assert!((1..93).all(|l| c.is_moe(l)));
    assert!(!c.is_moe(93));
    assert_eq!(c.moe_layer_indices().len(), 92);
    // Bytes per expert (spec §2.6): 17,547,264.
    assert_eq!(c.expert_bytes(Dtype::BF16), 17_547_264);
    let t = c.expert_tensors(Dtype::BF16);
    assert_eq!(t[0].suffix, "w1.weight_packed");
    assert_eq!(t[0].shape, [3072, 1792]);
    assert_eq!(t[1].shape, [3072, 112]);
    assert_eq!(t[2].suffix, "w2.weight_packed");
    assert_eq!(t[2].shape, [3584, 1536]);
    assert_eq!(t[3].shape, [3584, 96]);
    assert!(c.is_attn_res_boundary(0) && c.is_attn_res_boundary(12) && !c.is_attn_res_boundary(11));
}

/// tiny-mxfp4 (quantised, every field present) and tiny-seed (no quantization_config, a few
/// architecture switches absent) both load, with the fixture geometry of FIXTURES.md.
#[test]
fn tiny_fixture_configs_load() {
    for dir in [
        "tiny-mxfp4",
        "tiny-mxfp4/sharded",
        "tiny-seed",
        "tiny-seed/sharded",
    ] {
        let c = ModelConfig::load_dir(fixture(dir)).unwrap_or_else(|e| panic!("{dir}: {e}"));
        assert_eq!(c.hidden_size, 128);
        assert_eq!(c.num_hidden_layers, 13);
        assert_eq!(c.num_experts, 8);
        assert_eq!(c.num_experts_per_token, 2);
        // MLA layers are 3, 7, 11, 12 (FIXTURES.md).
        assert_eq!(c.mla_layer_indices(), vec![3, 7, 11, 12], "{dir}");
        assert_eq!(c.kda_layer_indices(), vec![0, 1, 2, 4, 5, 6, 8, 9, 10]);
        assert_eq!(c.attn_res_block_size, 3);
    }
    let m = ModelConfig::load_dir(fixture("tiny-mxfp4")).unwrap();
    assert_eq!(m.routed_scaling_factor, 2.5);
    assert_eq!(m.moe_intermediate_size, 64);
    assert_eq!(m.expert_format(), ExpertFormat::Mxfp4 { group_size: 32 });
    assert_eq!(m.bos_token_id, 253);
    // w1/w3: [64, 32] + [64, 2]; w2: [64, 32] + [64, 2] -> 3 * (2048 + 128).
    assert_eq!(m.expert_bytes(Dtype::BF16), 3 * (2048 + 128));
    let s = ModelConfig::load_dir(fixture("tiny-seed")).unwrap();
    assert_eq!(s.quantization, None);
    assert_eq!(s.expert_format(), ExpertFormat::Unquantized);
    assert_eq!(s.moe_intermediate_size, 48);
    assert_eq!(s.pad_token_id, None);
    // F32 experts: 3 * 48 * 64 * 4 bytes.
    assert_eq!(s.expert_bytes(Dtype::F32), 3 * 48 * 64 * 4);
    assert!(
        s.defaulted.iter().any(|d| d == "text_config.topk_method"),
        "{:?}",
        s.defaulted
    );
}

fn la(v: &mut Value) -> &mut serde_json::Map<String, Value> {
    v["text_config"]["linear_attn_config"]
        .as_object_mut()
        .unwrap()
}

/// Seed rejection 1 in the released shape: no layer map at all. A permissive reader would
/// make every layer KDA.
#[test]
fn rejects_missing_layer_map() {
    let mut v = tiny_json();
    la(&mut v).remove("full_attn_layers");
    la(&mut v).remove("kda_layers");
    let e = load_value(&v).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("text_config.linear_attn_config.full_attn_layers: missing"),
        "{msg}"
    );
    assert!(
        msg.contains("text_config.linear_attn_config.kda_layers: missing"),
        "{msg}"
    );
    assert_eq!(e.problems.len(), 2, "{msg}");
}

/// Seed rejection 2: full_attn_layers entry 999 in a 13-layer model. A reader that only
/// looks up kinds for layers it runs would accept it.
#[test]
fn rejects_layer_index_999() {
    let mut v = tiny_json();
    la(&mut v)["full_attn_layers"] = serde_json::json!([4, 8, 999, 13]);
    let e = load_value(&v).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("full_attn_layers[2] = 999 is outside 1..13"),
        "{msg}"
    );
    assert!(msg.contains("ONE-based"), "{msg}");
    // Layer 12 (ONE-based) is now in neither list.
    assert!(
        msg.contains("layer(s) 12 (ONE-based) are in neither"),
        "{msg}"
    );
}

/// Seed rejection 3: top-k 128 with 8 experts.
#[test]
fn rejects_topk_above_experts() {
    let mut v = tiny_json();
    v["text_config"]["num_experts_per_token"] = 128.into();
    let e = load_value(&v).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("num_experts_per_token = 128 is more than num_experts = 8"),
        "{msg}"
    );
    assert_eq!(e.problems.len(), 1);
}

/// Several problems at once are all listed in one error (a reader that stops at the first
/// missing field fails here), and the file path is named.
#[test]
fn lists_every_problem_and_the_file() {
    let mut v = released_json();
    let tc = v["text_config"].as_object_mut().unwrap();
    tc.remove("hidden_size");
    tc.remove("rms_norm_eps");
    tc.insert("num_experts".into(), Value::String("896".into()));
    tc.insert("mla_use_nope".into(), 1.into());
    tc.insert("hidden_act".into(), "silu".into());
    tc["linear_attn_config"]["kda_layers"]
        .as_array_mut()
        .unwrap()
        .push(4.into());
    tc["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16.into();
    let dir = std::env::temp_dir().join(format!("k3-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
    let e = ModelConfig::load(&path).unwrap_err();
    std::fs::remove_dir_all(&dir).ok();
    let msg = e.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    for want in [
        "text_config.hidden_size: missing",
        "text_config.rms_norm_eps: missing",
        "text_config.num_experts: expected a non-negative integer, found string \"896\"",
        "text_config.mla_use_nope: expected true or false, found number 1",
        "text_config.hidden_act = \"silu\" is not supported",
        "full_attn_layers[0] = 4 is also in kda_layers",
        "weights.group_size = 16 is not supported",
    ] {
        assert!(msg.contains(want), "missing {want:?} in:\n{msg}");
    }
    assert_eq!(e.problems.len(), 7, "{msg}");
}

/// The flat (seed) shape is refused with a hint, not read with defaults.
#[test]
fn rejects_flat_seed_shape() {
    let text = std::fs::read_to_string(fixture("seed/cfg/bad_topk.json")).unwrap();
    let e = ModelConfig::from_json_str(&text).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("config.text_config: missing"), "{msg}");
    assert!(msg.contains("flat config"), "{msg}");
}

/// Values the engine cannot run are refused even when well-typed; an architecture switch
/// given explicitly at an unsupported value is refused, not overridden.
#[test]
fn rejects_unsupported_values() {
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "num_key_value_heads",
            8.into(),
            "num_key_value_heads = 8 differs",
        ),
        (
            "num_expert_group",
            8.into(),
            "num_expert_group = 8 is not supported",
        ),
        (
            "topk_method",
            "greedy".into(),
            "topk_method = \"greedy\" is not supported",
        ),
        (
            "moe_router_activation_func",
            "softmax".into(),
            "\"softmax\" is not supported",
        ),
        (
            "eos_token_id",
            256.into(),
            "eos_token_id = 256 is outside the vocabulary 0..256",
        ),
        (
            "first_k_dense_replace",
            14.into(),
            "first_k_dense_replace = 14 is more than",
        ),
        (
            "rms_norm_eps",
            (-1.0).into(),
            "rms_norm_eps = -1 must be positive",
        ),
        (
            "hidden_size",
            0.into(),
            "hidden_size = 0 must be at least 1",
        ),
        // A reader that allocated per layer before checking would abort on this.
        (
            "num_hidden_layers",
            4_000_000_000u64.into(),
            "num_hidden_layers = 4000000000 is implausible",
        ),
        (
            "moe_intermediate_size",
            48.into(),
            "moe_intermediate_size = 48 is not a multiple",
        ),
    ];
    for (key, val, want) in cases {
        let mut v = tiny_json();
        v["text_config"][key] = val;
        let msg = load_value(&v).unwrap_err().to_string();
        assert!(msg.contains(want), "{key}: {msg}");
    }
    let mut v = tiny_json();
    la(&mut v)["use_full_rank_gate"] = false.into();
    la(&mut v)["gate_lower_bound"] = 0.5.into();
    let msg = load_value(&v).unwrap_err().to_string();
    assert!(
        msg.contains("use_full_rank_gate = false is not supported"),
        "{msg}"
    );
    assert!(
        msg.contains("gate_lower_bound = 0.5 must be negative"),
        "{msg}"
    );
    let mut v = tiny_json();
    la(&mut v)["kda_layers"] = serde_json::json!([1, 2, 3, 5, 6, 7, 9, 10, 11, 11]);
    let msg = load_value(&v).unwrap_err().to_string();
    assert!(msg.contains("kda_layers[9] = 11 is listed twice"), "{msg}");
}

/// Garbage never panics.
#[test]
fn garbage_is_an_error() {
    for text in [
        "",
        "[]",
        "{",
        "{\"text_config\": 3}",
        "null",
        "{\"text_config\": {}}",
    ] {
        let e = ModelConfig::from_json_str(text).unwrap_err();
        assert!(!e.problems.is_empty());
    }
    let e = ModelConfig::load(fixture("released/does-not-exist.json")).unwrap_err();
    assert!(e.to_string().contains("cannot read"));
}
