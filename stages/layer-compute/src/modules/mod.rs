//! The Kimi K3 modules over a batch of consecutive tokens, one file each, every module's
//! weight binding beside its forward (k3-spec §4.2-§4.8): [`kda`], [`mla`] (NoPE MLA),
//! [`moe`] (the latent MoE), [`mlp`] (the dense SiTU-GLU FFN) and [`attnres`] (the AttnRes
//! mix that wires a decoder layer). This file holds what they share: the trace, the
//! epsilons and turning tensors into matrices.
//!
//! Each module takes its weights as a plain struct (borrowed matrices, small f32 vectors),
//! so the forward pass and the single-op fixture tests drive the same code. Activations
//! are f32 rows, token-major (`ntok × width`). Sequential state (KDA recurrence and conv
//! tails, the MLA cache) lives in the caller's session and is advanced in token order, so
//! a batch of T tokens gives bit-identical results to T single-token calls.

use std::collections::BTreeMap;

use k3_model::tensor::{Dtype, TensorRef, WeightError};

use crate::kernels::matmul::Mat;
use crate::weights::ExpertTensor;

pub mod attnres;
pub mod kda;
pub mod mla;
pub mod mlp;
pub mod moe;

/// Intermediate values by name (`<prefix><name>`, e.g. `L03.attn_out`), rows appended in
/// token order: a debugging aid matching the names of the k3ref trace files.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// Prepended to every name recorded (the forward sets `Lnn.` per layer).
    pub prefix: String,
    pub arrays: BTreeMap<String, Vec<f32>>,
}

pub(crate) fn trace_put(tr: &mut Option<&mut Trace>, name: &str, data: &[f32]) {
    if let Some(t) = tr.as_deref_mut() {
        let key = format!("{}{}", t.prefix, name);
        t.arrays.entry(key).or_default().extend_from_slice(data);
    }
}

/// The epsilons the forward uses (spec: KDA q/k L2 1e-6, MLA LoRA norms 1e-6, every other
/// RMSNorm `rms_norm_eps`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Eps {
    pub rms: f32,
    pub kda_l2: f32,
    pub mla_lora: f32,
}

impl Eps {
    /// The spec's epsilons for a model whose `rms_norm_eps` is `rms`.
    pub fn spec(rms: f32) -> Self {
        Eps {
            rms,
            kda_l2: 1e-6,
            mla_lora: 1e-6,
        }
    }
}

/// An attention module's output projection (`o_proj`, `[hidden, width]`) of `ntok` rows of
/// `a` (`ntok × width`): its own use phase (`k3_model::trunk::use_phase`), bound after the
/// module's inputs are given back.
pub fn project_out(o: &Mat<'_>, a: &[f32], hidden: usize, ntok: usize, threads: usize) -> Vec<f32> {
    let mut y = vec![0f32; ntok * hidden];
    crate::kernels::matmul::gemm(o, a, &mut y, ntok, threads);
    y
}

/// A weight matrix from a tensor, checked against the expected logical shape.
pub fn mat_from<'a>(
    name: &str,
    t: TensorRef<'a>,
    rows: usize,
    cols: usize,
) -> Result<Mat<'a>, WeightError> {
    let bad = |msg: String| WeightError::Invalid {
        name: name.to_string(),
        msg,
    };
    if t.shape != [rows, cols] {
        return Err(bad(format!(
            "shape {:?}, expected [{rows}, {cols}]",
            t.shape
        )));
    }
    let m = match t.dtype {
        Dtype::BF16 => Mat::bf16(t.bytes, rows, cols),
        Dtype::F32 => Mat::f32(t.bytes, rows, cols),
        other => return Err(bad(format!("dtype {other}, expected BF16 or F32"))),
    };
    m.map_err(|e| bad(e.0))
}

/// An MXFP4 matrix from its packed and scale tensors, checked against `rows × cols`.
pub fn mxfp4_from<'a>(
    name: &str,
    packed: TensorRef<'a>,
    scale: TensorRef<'a>,
    rows: usize,
    cols: usize,
) -> Result<Mat<'a>, WeightError> {
    let bad = |msg: String| WeightError::Invalid {
        name: name.to_string(),
        msg,
    };
    let pc = cols.div_ceil(2);
    let sc = cols.div_ceil(crate::kernels::mxfp4::GROUP);
    if packed.dtype != Dtype::U8 || packed.shape != [rows, pc] {
        return Err(bad(format!(
            "weight_packed {} {:?}, expected U8 [{rows}, {pc}]",
            packed.dtype, packed.shape
        )));
    }
    if scale.dtype != Dtype::U8 || scale.shape != [rows, sc] {
        return Err(bad(format!(
            "weight_scale {} {:?}, expected U8 [{rows}, {sc}]",
            scale.dtype, scale.shape
        )));
    }
    Mat::mxfp4(packed.bytes, scale.bytes, rows, cols).map_err(|e| bad(e.0))
}

pub(crate) fn expert_mat<'a>(
    what: &str,
    t: ExpertTensor<'a>,
    rows: usize,
    cols: usize,
) -> Result<Mat<'a>, WeightError> {
    match t {
        ExpertTensor::Dense(t) => mat_from(what, t, rows, cols),
        ExpertTensor::Mxfp4 { packed, scale } => mxfp4_from(what, packed, scale, rows, cols),
    }
}
