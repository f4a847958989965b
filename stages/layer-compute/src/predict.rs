//! The next layer's routed experts, guessed before its router runs (`--speculate on`,
//! issue 35): layer L+1's router (its gate weight and bias, the same top-k selection as
//! `kernels::router`) applied to layer L's MoE input, the post-norm rows layer L's own
//! router reads. The forward sends the guess right after layer L's real request
//! ([`crate::weights::Weights::guess_experts`]), so the fetcher can read it while layer L
//! multiplies its experts and layer L+1 computes its attention.
//!
//! A guess is a hint only: the forward never reads what the guess names, so the ids and
//! logits are the same with speculation on and off. The predictor keeps its own copy of
//! each router, taken when the layer first binds (the trunk may stream, so layer L+1's
//! weights are not there while layer L computes): a layer is guessed from the second pass
//! on. The copies cost the routers' bytes (the slice: 3 × 0.9 MB; the released model:
//! 92 × 12.8 MB of bf16).

use std::cell::RefCell;
use std::collections::HashMap;

use crate::kernels::matmul::{gemm_fused, Mat, MatData};
use crate::kernels::router;
use crate::modules::moe::{MoeHead, MoeParams};

/// A router's gate weight, owned.
enum OwnedGate {
    Bf16(Vec<u8>),
    F32(Vec<u8>),
    Mxfp4 { packed: Vec<u8>, scales: Vec<u8> },
}

/// One layer's router, copied.
struct RouterCopy {
    rows: usize,
    cols: usize,
    gate: OwnedGate,
    bias: Option<Vec<f32>>,
}

impl RouterCopy {
    fn mat(&self) -> Mat<'_> {
        let data = match &self.gate {
            OwnedGate::Bf16(b) => MatData::Bf16(b),
            OwnedGate::F32(b) => MatData::F32(b),
            OwnedGate::Mxfp4 { packed, scales } => MatData::Mxfp4 { packed, scales },
        };
        Mat {
            rows: self.rows,
            cols: self.cols,
            data,
        }
    }
}

/// The routers seen so far, and the guesses made from them.
#[derive(Default)]
pub struct Predictor {
    routers: RefCell<HashMap<usize, RouterCopy>>,
}

impl Predictor {
    /// A predictor that has seen no router yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keep a copy of layer `layer`'s router (once: a router never changes).
    pub fn learn(&self, layer: usize, head: &MoeHead<'_>) {
        if self.routers.borrow().contains_key(&layer) {
            return;
        }
        let g = &head.gate;
        let gate = match g.data {
            MatData::Bf16(b) => OwnedGate::Bf16(b.to_vec()),
            MatData::F32(b) => OwnedGate::F32(b.to_vec()),
            MatData::Mxfp4 { packed, scales } => OwnedGate::Mxfp4 {
                packed: packed.to_vec(),
                scales: scales.to_vec(),
            },
        };
        let copy = RouterCopy {
            rows: g.rows,
            cols: g.cols,
            gate,
            bias: head.bias.clone(),
        };
        self.routers.borrow_mut().insert(layer, copy);
    }

    /// Guess the experts layer `p.layer` will route `ntok` rows to, from the rows `v`
    /// (`hidden` wide) of an earlier layer: the union of each row's top-k under that
    /// layer's router, in row order, best first within a row. None when its router has
    /// not been seen yet (or the rows do not fit it).
    pub fn guess(&self, p: &MoeParams, v: &[f32], ntok: usize, threads: usize) -> Option<Vec<u32>> {
        let routers = self.routers.borrow();
        let r = routers.get(&p.layer)?;
        if r.cols != p.hidden || r.rows != p.n_experts || v.len() != ntok * p.hidden {
            return None;
        }
        let mut logits = vec![0f32; ntok * p.n_experts];
        gemm_fused(&[&r.mat()], v, &mut [&mut logits], ntok, threads);
        let mut ids: Vec<u32> = Vec::new();
        for row in logits.chunks_exact(p.n_experts) {
            let route = router::route(row, r.bias.as_deref(), p.top_k, false, 1.0);
            for id in route.ids {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        Some(ids)
    }
}
