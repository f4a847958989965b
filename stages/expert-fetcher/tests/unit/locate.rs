//! Locating the experts (`src/locate.rs`): routed-expert tensor names, adjacent extents
//! merged.

use k3_expert_fetcher::locate::*;

#[test]
fn names() {
    assert_eq!(
        parse_expert_name(
            "language_model.model.layers.3.block_sparse_moe.experts.17.w2.weight_scale"
        ),
        Some((3, 17, "w2.weight_scale".to_string()))
    );
    assert_eq!(
        parse_expert_name("model.layers.3.block_sparse_moe.shared_experts.w2.weight"),
        None
    );
    assert_eq!(
        parse_expert_name("model.layers.3.self_attn.q_proj.weight"),
        None
    );
}

#[test]
fn merge_adjacent_extents() {
    let mut t = ExpertTable::new(vec![]);
    t.insert(
        0,
        0,
        ExpertExtents {
            file: 0,
            extents: vec![
                Extent { offset: 10, len: 5 },
                Extent { offset: 0, len: 10 },
                Extent { offset: 20, len: 1 },
            ],
            parts: Vec::new(),
        },
    );
    let l = t.locate(0, 0).unwrap();
    assert_eq!(
        l.extents,
        vec![Extent { offset: 0, len: 15 }, Extent { offset: 20, len: 1 }]
    );
    assert_eq!(l.span(), 21);
    assert_eq!(l.bytes(), 16);
}
