//! MoE router: sigmoid scores, bias-corrected top-k selection, unbiased combine weights.
//!
//! `s = sigmoid(λ)`; selection is the top-k of `s + bias`, in descending biased score with
//! the lower expert id first on an exact tie; the combine weight of each selected expert is
//! its UNBIASED score, renormalised by `(Σ + 1e-20)` over the selected set (when
//! `renormalize`), times `routed_scaling_factor`. Returned in selection order.

use super::act::sigmoid;

/// The routing decision for one token.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Selected expert ids, best first.
    pub ids: Vec<u32>,
    /// Combine weight of each selected expert (same order).
    pub weights: Vec<f32>,
    /// Unbiased sigmoid score of every expert.
    pub scores: Vec<f32>,
}

/// Route from the router logits `λ` (one per expert).
pub fn route(
    logits: &[f32],
    bias: Option<&[f32]>,
    k: usize,
    renormalize: bool,
    scale: f32,
) -> Routing {
    let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
    let biased: Vec<f32> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores.clone(),
    };
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| biased[b].total_cmp(&biased[a]).then(a.cmp(&b)));
    order.truncate(k);
    let mut weights: Vec<f32> = order.iter().map(|&e| scores[e]).collect();
    if renormalize {
        let sum: f32 = weights.iter().sum();
        let d = sum + 1e-20;
        weights.iter_mut().for_each(|w| *w /= d);
    }
    weights.iter_mut().for_each(|w| *w *= scale);
    Routing {
        ids: order.iter().map(|&e| e as u32).collect(),
        weights,
        scores,
    }
}
