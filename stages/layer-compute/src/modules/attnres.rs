//! Attention residuals (k3-spec §4.3, wired by §4.2): the per-token mix of the bank snapshots and the
//! current prefix, and the binding of its folded norm·projection vectors.

use k3_model::classify::model_tensor;

use crate::forward::{ForwardError, Model};
use crate::kernels::attnres;
use crate::weights::Weights;

/// Mix, for every token, the bank snapshots (oldest first) and the current prefix `p`.
/// `bank[i]` and `p` are `ntok × hidden`.
pub fn attnres_mix_rows(
    bank: &[Vec<f32>],
    p: &[f32],
    fold: &[f32],
    eps: f32,
    ntok: usize,
) -> Vec<f32> {
    let d = fold.len();
    let mut out = vec![0f32; ntok * d];
    for t in 0..ntok {
        let mut srcs: Vec<&[f32]> = bank.iter().map(|b| &b[t * d..(t + 1) * d]).collect();
        srcs.push(&p[t * d..(t + 1) * d]);
        attnres::mix(&srcs, fold, eps, &mut out[t * d..(t + 1) * d]);
    }
    out
}

impl<W: Weights> Model<W> {
    pub(crate) fn fold(&self, norm_name: &str, proj_name: &str) -> Result<Vec<f32>, ForwardError> {
        let d = self.cfg.hidden_size;
        let n = self.vector(norm_name, d)?;
        let p = self.vector(proj_name, d)?;
        Ok(attnres::fold(&n, &p))
    }
    pub(crate) fn final_fold(&self) -> Result<Vec<f32>, ForwardError> {
        self.fold(
            &model_tensor("output_attn_res_norm.weight"),
            &model_tensor("output_attn_res_proj.weight"),
        )
    }
}
