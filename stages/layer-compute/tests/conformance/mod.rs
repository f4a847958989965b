//! The `Weights` conformance suite: one set of checks, run against every implementation.
//!
//! - `SourceWeights` over mmapped shards: `stages/layer-compute/tests/weights_conformance.rs`;
//! - `StagedWeights` over live trunk-loader and expert-fetcher stages (links, shared-memory
//!   arenas, handles): `tests/e2e/weights_conformance.rs`, which includes this file by path.
//!
//! What every implementation must do, in the order the forward uses it:
//! - between `begin_layer(l)` and `end_layer(l)`, every trunk tensor of layer `l` comes back
//!   with the checkpoint's dtype, shape and bytes (an implementation that served the wrong
//!   layer's slot, a stale ring slot, or the padded run instead of the tensor fails), asked
//!   for one use phase at a time (`k3_model::trunk::use_phase`) with `end_phase(l)` between
//!   phases, as the forward does (a trunk streamed in parts holds one phase at a time);
//! - a name that is not in the checkpoint is `WeightError::Missing` naming it, not a panic;
//! - `experts(l, ids)` delivers every index exactly once, each with the checkpoint's bytes
//!   of that expert (a fetcher that published the wrong slot, or delivered an expert twice
//!   or never, fails), and an id outside the layer is an `Err` delivered for that index;
//! - model-level tensors (embedding, lm_head, final norm) are the checkpoint's;
//! - passes repeat: the second pass over the layers serves the same bytes;
//! - the model run through it gives the oracle's greedy ids.

#![allow(dead_code)]

use k3_layer_compute::weights::{expert_from_source, ExpertProj, ExpertRef, Weights};
use k3_layer_compute::{generate, Model, ModelOptions};
use k3_model::classify::{layer_of, split_expert, LM_HEAD, MODEL_PREFIX};
use k3_model::config::ModelConfig;
use k3_model::mmap_weights::MmapWeights;
use k3_model::tensor::{TensorRef, WeightError, WeightSource};

fn same(what: &str, got: &TensorRef<'_>, want: &TensorRef<'_>) {
    assert_eq!(got.dtype, want.dtype, "{what}: dtype");
    assert_eq!(got.shape, want.shape, "{what}: shape");
    assert_eq!(got.bytes.len(), want.bytes.len(), "{what}: byte count");
    assert!(got.bytes == want.bytes, "{what}: bytes differ");
}

fn same_expert_proj(what: &str, got: &ExpertProj<'_>, want: &ExpertProj<'_>) {
    match (got, want) {
        (ExpertProj::Dense(g), ExpertProj::Dense(w)) => same(what, g, w),
        (
            ExpertProj::Mxfp4 { packed, scale },
            ExpertProj::Mxfp4 {
                packed: wp,
                scale: ws,
            },
        ) => {
            same(&format!("{what}.weight_packed"), packed, wp);
            same(&format!("{what}.weight_scale"), scale, ws);
        }
        _ => panic!("{what}: encoding differs from the checkpoint's"),
    }
}

fn same_expert(what: &str, got: &ExpertRef<'_>, want: &ExpertRef<'_>) {
    same_expert_proj(&format!("{what} w1"), &got.w1, &want.w1);
    same_expert_proj(&format!("{what} w2"), &got.w2, &want.w2);
    same_expert_proj(&format!("{what} w3"), &got.w3, &want.w3);
}

/// Trunk tensor names of layer `l` in the checkpoint (not routed experts).
fn layer_trunk(src: &MmapWeights, l: usize) -> Vec<String> {
    let mut v: Vec<String> = src
        .catalog()
        .iter()
        .map(|(n, _)| n)
        .filter(|n| layer_of(n) == Some(l) && split_expert(n).is_none())
        .collect();
    v.sort();
    v
}

/// One pass over the first `layers` layers, checking tensors and experts against `src`.
pub fn check_pass<W: Weights>(w: &W, src: &MmapWeights, cfg: &ModelConfig, layers: usize) {
    let mut experts_checked = 0usize;
    for l in 0..layers {
        w.begin_layer(l)
            .unwrap_or_else(|e| panic!("begin_layer({l}): {e}"));
        let mut names = layer_trunk(src, l);
        assert!(
            !names.is_empty(),
            "layer {l}: the checkpoint has no trunk tensors"
        );
        let phase = |n: &str| {
            k3_model::classify::split_layer(n).map_or(3, |(_, s)| k3_model::trunk::use_phase(s))
        };
        names.sort_by_key(|n| phase(n));
        let mut last = None;
        for n in &names {
            if last.is_some_and(|p| p != phase(n)) {
                w.end_phase(l);
            }
            last = Some(phase(n));
            let got = w.tensor(n).unwrap_or_else(|e| panic!("{n}: {e}"));
            same(n, &got, &src.tensor(n).unwrap());
        }
        let missing = format!("{MODEL_PREFIX}layers.{l}.no_such_tensor.weight");
        match w.tensor(&missing) {
            Err(WeightError::Missing(name)) => assert!(name.contains("no_such_tensor"), "{name}"),
            other => panic!(
                "{missing}: expected Missing, got {:?}",
                other.map(|t| t.shape)
            ),
        }
        if cfg.is_moe(l) {
            // Reverse order, a repeat-free set, and one id outside the layer.
            let k = cfg.num_experts_per_token.min(cfg.num_experts);
            let mut ids: Vec<u32> = (0..k as u32).rev().collect();
            ids.push(cfg.num_experts as u32 + 3);
            let mut seen = vec![0usize; ids.len()];
            w.experts(l, &ids, &mut |batch| {
                for (i, r) in batch {
                    seen[i] += 1;
                    let id = ids[i];
                    if id as usize >= cfg.num_experts {
                        assert!(
                            r.is_err(),
                            "layer {l} expert {id} (outside the layer) delivered"
                        );
                        continue;
                    }
                    let got = r.unwrap_or_else(|e| panic!("layer {l} expert {id}: {e}"));
                    let want = expert_from_source(src, l, id).unwrap();
                    same_expert(&format!("layer {l} expert {id}"), &got, &want);
                }
            });
            assert!(
                seen.iter().all(|&n| n == 1),
                "layer {l}: deliveries per index {seen:?} (each exactly once)"
            );
            experts_checked += k;
        }
        w.end_layer(l);
    }
    assert!(experts_checked > 0, "no MoE layer was checked");
    for n in [
        format!("{MODEL_PREFIX}embed_tokens.weight"),
        LM_HEAD.to_string(),
        format!("{MODEL_PREFIX}norm.weight"),
    ] {
        let got = w.tensor(&n).unwrap_or_else(|e| panic!("{n}: {e}"));
        same(&n, &got, &src.tensor(&n).unwrap());
    }
}

/// Greedy ids of `prompt` through `w` (incremental decode), for comparison with an oracle.
pub fn greedy_ids<W: Weights>(w: W, cfg: &ModelConfig, prompt: &[u32], n: usize) -> Vec<u32> {
    let m = Model::new(
        cfg.clone(),
        w,
        ModelOptions {
            threads: 1,
            layers: None,
            eps: None,
        },
    )
    .unwrap();
    generate(&m, prompt, n, true).unwrap().ids
}
