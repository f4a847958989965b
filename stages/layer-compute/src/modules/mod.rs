//! The Kimi K3 modules over a batch of consecutive tokens, one file each, every module's
//! weight binding beside its forward (k3-spec §4.2-§4.8): [`kda`], [`mla`] (NoPE MLA),
//! [`moe`] (the latent MoE), [`mlp`] (the dense SiTU-GLU FFN) and [`attnres`] (the AttnRes
//! mix that wires a decoder layer). This file holds what they share: the [`LayerCtx`]
//! (threads, epsilons, trace), the output projection and turning tensors into matrices.
//!
//! Each module's weights are a plain struct (borrowed matrices, small f32 vectors) whose
//! method is the module's forward ([`kda::KdaWeights::attend`], [`mla::MlaWeights::attend`],
//! [`moe::MoeWeights::forward`]), so the forward pass and the single-op fixture tests drive
//! the same code. Activations are f32 rows, token-major (`ntok × width`). Sequential state
//! (KDA recurrence and conv tails, the MLA cache) lives in the caller's session and is
//! advanced in token order, so a batch of T tokens gives bit-identical results to T
//! single-token calls.
//!
//! A pass may carry several sessions at once: its rows are the [`Seg`]s of its groups back
//! to back (each group a session's consecutive tokens with that session's state). Every
//! product runs over all rows together; what is sequential (the conv tails, the
//! recurrence, the cache) runs per group on the group's own state. Every row's result is
//! a function of its own row and its own session only (the products' contract,
//! `kernels::matmul`), so it is the same whatever else shares the pass.

use std::collections::BTreeMap;

use k3_model::tensor::{Dtype, TensorRef, WeightError};

use crate::kernels::matmul::Mat;
use crate::weights::ExpertProj;

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

impl Trace {
    /// Append `data` under `<prefix><name>`.
    fn put(&mut self, name: &str, data: &[f32]) {
        let key = format!("{}{}", self.prefix, name);
        self.arrays.entry(key).or_default().extend_from_slice(data);
    }
}

/// What every layer module takes besides its weights, its geometry, its input and its
/// carried state: the thread count of its products, the epsilons and the trace. Built once
/// per forward call; a module's forward is a method on its bound weights taking `&mut` this
/// (as candle's `Module::forward`), e.g. [`KdaWeights::attend`](kda::KdaWeights::attend).
#[derive(Debug)]
pub struct LayerCtx<'t> {
    /// Worker threads for the matrix products (1 = the calling thread only); a product's
    /// bits never depend on it.
    pub threads: usize,
    pub eps: Eps,
    /// Where intermediate values are recorded (None: nothing is recorded).
    pub trace: Option<&'t mut Trace>,
    /// Where the router's choices are recorded (`--record-routes`; None: nowhere).
    pub routes: Option<&'t mut crate::routes::RouteLog>,
}

impl<'t> LayerCtx<'t> {
    /// A context without a trace.
    pub fn new(threads: usize, eps: Eps) -> Self {
        LayerCtx {
            threads: threads.max(1),
            eps,
            trace: None,
            routes: None,
        }
    }

    /// The same context recording into `trace`.
    pub fn with_trace(self, trace: Option<&'t mut Trace>) -> Self {
        LayerCtx { trace, ..self }
    }

    /// The same context recording the router's choices into `routes`.
    pub fn with_routes(self, routes: Option<&'t mut crate::routes::RouteLog>) -> Self {
        LayerCtx { routes, ..self }
    }

    /// Record each row's top-k, when recording routes.
    pub(crate) fn record_routes(&mut self, routes: &[crate::kernels::router::Routing]) {
        if let Some(r) = self.routes.as_deref_mut() {
            r.push(routes);
        }
    }

    /// Record `data` under `name` (after the trace's prefix), when tracing.
    pub(crate) fn record(&mut self, name: &str, data: &[f32]) {
        if let Some(t) = self.trace.as_deref_mut() {
            t.put(name, data);
        }
    }

    /// Set the prefix of the names recorded from here on (`Lnn.`, `final.`), when tracing.
    pub(crate) fn trace_prefix(&mut self, prefix: impl FnOnce() -> String) {
        if let Some(t) = self.trace.as_deref_mut() {
            t.prefix = prefix();
        }
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

/// One group of a pass over several sessions: `rows` consecutive tokens of one session and
/// that session's carried state for the layer ([`kda::KdaState`], [`mla::MlaCache`]).
pub struct Seg<'s, S> {
    pub rows: usize,
    pub state: &'s mut S,
}

/// For each of `ntok` rows, its index among the rows whose output is wanted (`live`,
/// ascending row indices; None: every row, in order), or None for a row whose output is
/// not wanted.
pub(crate) fn out_slots(ntok: usize, live: Option<&[usize]>) -> Vec<Option<usize>> {
    match live {
        None => (0..ntok).map(Some).collect(),
        Some(rows) => {
            let mut slots = vec![None; ntok];
            for (j, &r) in rows.iter().enumerate() {
                slots[r] = Some(j);
            }
            slots
        }
    }
}

/// The `width`-wide rows `rows` of `x`, back to back.
pub(crate) fn gather_rows(x: &[f32], rows: &[usize], width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * width);
    for &r in rows {
        out.extend_from_slice(&x[r * width..(r + 1) * width]);
    }
    out
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
    mxfp4_mat(name, packed, scale, (rows, cols), true)
}

/// [`mxfp4_from`], its scales scanned for NaN only when `scan`.
fn mxfp4_mat<'a>(
    name: &str,
    packed: TensorRef<'a>,
    scale: TensorRef<'a>,
    (rows, cols): (usize, usize),
    scan: bool,
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
    // E8M0 0xFF is NaN (OCP MX spec); the kernels decode it as 0, so a corrupt scale would
    // silently zero its group: refused here, naming the tensor. One byte per 32 weights:
    // the `memchr` crate's vector scan, where `<[u8]>::contains` scans a word at a time.
    if let Some(at) = scan.then(|| memchr::memchr(0xFF, scale.bytes)).flatten() {
        return Err(WeightError::NonFinite {
            name: format!("{name}.weight_scale"),
            msg: format!(
                "E8M0 scale byte 0xFF (NaN) at row {}, group {}",
                at / sc,
                at % sc
            ),
        });
    }
    Mat::mxfp4(packed.bytes, scale.bytes, rows, cols).map_err(|e| bad(e.0))
}

/// A routed expert's projection as a matrix. `scales_known`: this model already bound
/// this expert and found no NaN scale (its bytes come from the same checkpoint tensor every
/// time: [`ScaleChecks`]), so the scan is skipped; the shapes and dtypes are checked always.
pub(crate) fn expert_mat<'a>(
    what: &str,
    t: ExpertProj<'a>,
    rows: usize,
    cols: usize,
    scales_known: bool,
) -> Result<Mat<'a>, WeightError> {
    match t {
        ExpertProj::Dense(t) => mat_from(what, t, rows, cols),
        ExpertProj::Mxfp4 { packed, scale } => {
            mxfp4_mat(what, packed, scale, (rows, cols), !scales_known)
        }
    }
}

/// The routed experts of one model whose E8M0 scales were scanned and held no 0xFF (NaN):
/// one bit per (layer, expert). A model's expert `(layer, id)` is always the same
/// checkpoint tensor, whichever copy, drive or fetcher slot delivers it, so one scan a run
/// is enough; an expert that failed the scan is never marked, and fails every bind. The
/// scan was 1.4-1.5% of a decode's samples and of a 16-token prompt's on the slice (1 MB
/// of scales an expert, every bind), counted in the passes' expert wait.
pub struct ScaleChecks {
    layers: usize,
    experts: usize,
    bits: Vec<std::sync::atomic::AtomicU64>,
}

impl ScaleChecks {
    /// Room for `layers` × `experts` marks (0 × 0: nothing is ever known, every bind scans).
    pub fn new(layers: usize, experts: usize) -> ScaleChecks {
        let n = (layers * experts).div_ceil(64);
        ScaleChecks {
            layers,
            experts,
            bits: (0..n)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
        }
    }

    fn at(&self, layer: usize, id: u32) -> Option<(usize, u64)> {
        let i = layer * self.experts + id as usize;
        (layer < self.layers && (id as usize) < self.experts).then(|| (i / 64, 1 << (i % 64)))
    }

    /// Whether expert `id` of `layer` was scanned and clean.
    pub fn known(&self, layer: usize, id: u32) -> bool {
        use std::sync::atomic::Ordering;
        self.at(layer, id)
            .is_some_and(|(w, b)| self.bits[w].load(Ordering::Relaxed) & b != 0)
    }

    /// Expert `id` of `layer` was scanned and is clean.
    pub fn mark(&self, layer: usize, id: u32) {
        use std::sync::atomic::Ordering;
        if let Some((w, b)) = self.at(layer, id) {
            self.bits[w].fetch_or(b, Ordering::Relaxed);
        }
    }
}
