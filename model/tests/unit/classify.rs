//! Tensor names (`src/classify.rs`): the released names' classes, layer and expert indices.

use k3_model::classify::*;

/// The seed's pitfall: a shared expert classified with the routed ones (a plain
/// `contains("experts")` test) would shrink the resident floor.
#[test]
fn released_names() {
    let l = "language_model.model.layers.12.";
    let cases = [
        (
            "block_sparse_moe.experts.0.w1.weight_packed",
            TensorClass::RoutedExpert,
        ),
        (
            "block_sparse_moe.experts.895.w3.weight_scale",
            TensorClass::RoutedExpert,
        ),
        (
            "block_sparse_moe.shared_experts.up_proj.weight",
            TensorClass::SharedExpert,
        ),
        ("self_attn.q_proj.weight", TensorClass::Attention),
        ("self_attn.A_log", TensorClass::Attention),
        ("block_sparse_moe.gate.weight", TensorClass::Other),
        (
            "block_sparse_moe.routed_expert_norm.weight",
            TensorClass::Other,
        ),
        ("mlp_res_proj.weight", TensorClass::Other),
        ("input_layernorm.weight", TensorClass::Other),
    ];
    for (suffix, class) in cases {
        assert_eq!(classify(&format!("{l}{suffix}")), class, "{suffix}");
    }
    assert_eq!(
        classify("language_model.model.embed_tokens.weight"),
        TensorClass::Embedding
    );
    assert_eq!(
        classify("language_model.lm_head.weight"),
        TensorClass::Embedding
    );
    assert_eq!(
        classify("language_model.model.norm.weight"),
        TensorClass::Other
    );
    assert_eq!(
        classify("vision_tower.encoder.blocks.3.wqkv.weight"),
        TensorClass::Vision
    );
    assert_eq!(classify("mm_projector.proj.0.weight"), TensorClass::Vision);
}

#[test]
fn layer_and_expert_indices() {
    let n = "language_model.model.layers.91.block_sparse_moe.experts.100.w2.weight_packed";
    assert_eq!(layer_of(n), Some(91));
    assert_eq!(expert_of(n), Some((91, 100)));
    assert!(!is_layer_trunk(n));
    assert!(is_layer_trunk(
        "language_model.model.layers.0.mlp.up_proj.weight"
    ));
    assert_eq!(layer_of("language_model.model.norm.weight"), None);
    assert_eq!(split_expert(n), Some((91, 100, "w2.weight_packed")));
    assert_eq!(expert_tensor(91, 100, "w2.weight_packed"), n);
    assert_eq!(
        split_layer("language_model.model.layers.3.self_attn.q_proj.weight"),
        Some((3, "self_attn.q_proj.weight"))
    );
    assert_eq!(
        layer_tensor(3, "mlp.up_proj.weight"),
        "language_model.model.layers.3.mlp.up_proj.weight"
    );
    assert_eq!(
        split_expert(
            "language_model.model.layers.3.block_sparse_moe.shared_experts.up_proj.weight"
        ),
        None
    );
    assert_eq!(layer_of("vision_tower.encoder.blocks.3.norm0.weight"), None);
    assert_eq!(layer_of("model.layers.7.self_attn.q_proj.weight"), Some(7));
    assert_eq!(
        layer_of("language_model.layers.7.self_attn.q_proj.weight"),
        Some(7)
    );
}
