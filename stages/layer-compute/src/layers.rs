//! The Kimi K3 modules over a batch of consecutive tokens: KDA, NoPE MLA, the latent MoE,
//! the dense MLP, plus the AttnRes decoder-layer body that wires them (k3-spec §4.2-§4.8).
//!
//! Each module takes its weights as a plain struct (borrowed matrices, small f32 vectors),
//! so the forward pass and the single-op fixture tests drive the same code. Activations
//! are f32 rows, token-major (`ntok × width`). Sequential state (KDA recurrence and conv
//! tails, the MLA cache) lives in the caller's session and is advanced in token order, so
//! a batch of T tokens gives bit-identical results to T single-token calls.

use std::collections::BTreeMap;

use k3_model::tensor::{Dtype, TensorRef, WeightError};

use crate::kernels::act::{sigmoid, situ_glu64};
use crate::kernels::gemv::{gemm, gemm64, gemm64_x64, Mat};
use crate::kernels::{attnres, conv, kda, mla, norm, router};
use crate::weights::{ExpertRef, ExpertTensor};

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

fn expert_mat<'a>(
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

// ---------------------------------------------------------------------------------------
// KDA
// ---------------------------------------------------------------------------------------

/// KDA geometry.
#[derive(Clone, Copy, Debug)]
pub struct KdaDims {
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub conv: usize,
    pub lower_bound: f32,
}

impl KdaDims {
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// Weights of one KDA module.
pub struct KdaWeights<'a> {
    pub q: Mat<'a>,
    pub k: Mat<'a>,
    pub v: Mat<'a>,
    /// `[width, conv]` taps each.
    pub q_conv: Vec<f32>,
    pub k_conv: Vec<f32>,
    pub v_conv: Vec<f32>,
    pub f_a: Mat<'a>,
    pub f_b: Mat<'a>,
    pub b: Mat<'a>,
    pub g: Mat<'a>,
    pub o: Mat<'a>,
    /// At least `heads` entries; only the first `heads` are read.
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub o_norm: Vec<f32>,
}

/// Recurrent state of one KDA layer: the per-head state and the three conv tails.
#[derive(Clone, Debug)]
pub struct KdaState {
    /// `heads × dk × dv`, row = key channel.
    pub s: Vec<f32>,
    pub conv_q: Vec<f32>,
    pub conv_k: Vec<f32>,
    pub conv_v: Vec<f32>,
}

impl KdaState {
    pub fn new(d: &KdaDims) -> Self {
        let p = d.width();
        let hist = d.conv.saturating_sub(1);
        KdaState {
            s: vec![0.0; d.heads * d.head_dim * d.head_dim],
            conv_q: vec![0.0; p * hist],
            conv_k: vec![0.0; p * hist],
            conv_v: vec![0.0; p * hist],
        }
    }
}

/// KDA over `ntok` consecutive tokens `u` (`ntok × hidden`, post input_layernorm).
#[allow(clippy::too_many_arguments)]
pub fn kda_forward(
    w: &KdaWeights<'_>,
    d: &KdaDims,
    eps: &Eps,
    u: &[f32],
    ntok: usize,
    st: &mut KdaState,
    threads: usize,
    trace: &mut Option<&mut Trace>,
) -> Vec<f32> {
    let p = d.width();
    let (h, dk) = (d.heads, d.head_dim);
    let mut q = vec![0f32; ntok * p];
    let mut k = vec![0f32; ntok * p];
    let mut v = vec![0f32; ntok * p];
    gemm(&w.q, u, &mut q, ntok, threads);
    gemm(&w.k, u, &mut k, ntok, threads);
    gemm(&w.v, u, &mut v, ntok, threads);
    let mut qc = vec![0f32; ntok * p];
    let mut kc = vec![0f32; ntok * p];
    let mut vc = vec![0f32; ntok * p];
    conv::shortconv_silu(&q, &w.q_conv, d.conv, p, &mut st.conv_q, &mut qc);
    conv::shortconv_silu(&k, &w.k_conv, d.conv, p, &mut st.conv_k, &mut kc);
    conv::shortconv_silu(&v, &w.v_conv, d.conv, p, &mut st.conv_v, &mut vc);
    let mut beta = vec![0f32; ntok * h];
    gemm(&w.b, u, &mut beta, ntok, threads);
    let mut fa = vec![0f32; ntok * w.f_a.rows];
    gemm(&w.f_a, u, &mut fa, ntok, threads);
    let mut z = vec![0f32; ntok * p];
    gemm(&w.f_b, &fa, &mut z, ntok, threads);
    let mut gate = vec![0f32; ntok * p];
    gemm(&w.g, u, &mut gate, ntok, threads);

    let qscale = 1.0 / (dk as f32).sqrt();
    let mut g = vec![0f32; p];
    let mut alpha = vec![0f32; p];
    let mut o = vec![0f32; ntok * p];
    let mut scratch = vec![0f32; dk];
    for t in 0..ntok {
        let r = t * p..(t + 1) * p;
        let (qt, kt, vt) = (&mut qc[r.clone()], &mut kc[r.clone()], &vc[r.clone()]);
        kda::decay_gate(
            &z[r.clone()],
            &w.a_log,
            &w.dt_bias,
            h,
            dk,
            d.lower_bound,
            &mut g,
            &mut alpha,
        );
        for hh in 0..h {
            let hr = hh * dk..(hh + 1) * dk;
            norm::l2norm_inplace(&mut qt[hr.clone()], eps.kda_l2);
            norm::l2norm_inplace(&mut kt[hr.clone()], eps.kda_l2);
            qt[hr.clone()].iter_mut().for_each(|x| *x *= qscale);
            let b = sigmoid(beta[t * h + hh]);
            kda::delta_step(
                &mut st.s[hh * dk * dk..(hh + 1) * dk * dk],
                &qt[hr.clone()],
                &kt[hr.clone()],
                &vt[hr.clone()],
                &alpha[hr.clone()],
                b,
                &mut o[t * p + hh * dk..t * p + (hh + 1) * dk],
                &mut scratch,
            );
        }
        kda::output_norm_gate(&mut o[r.clone()], &gate[r], &w.o_norm, h, eps.rms);
    }
    trace_put(trace, "kda_state", &st.s);
    let mut y = vec![0f32; ntok * d.hidden];
    gemm(&w.o, &o, &mut y, ntok, threads);
    y
}

// ---------------------------------------------------------------------------------------
// MLA
// ---------------------------------------------------------------------------------------

/// MLA geometry.
#[derive(Clone, Copy, Debug)]
pub struct MlaDims {
    pub hidden: usize,
    pub heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
}

/// Weights of one MLA module.
pub struct MlaWeights<'a> {
    pub q_a: Mat<'a>,
    pub q_a_norm: Vec<f32>,
    pub q_b: Mat<'a>,
    pub kv_a: Mat<'a>,
    pub kv_a_norm: Vec<f32>,
    pub kv_b: Mat<'a>,
    /// The output gate (`g_proj`); `None` when `mla_use_output_gate` is false.
    pub g: Option<Mat<'a>>,
    pub o: Mat<'a>,
}

/// Per-position cache of one MLA layer: the spec's `c̄` (after kv_a_layernorm) and `k_r`,
/// plus the per-head keys/values expanded from `c̄` once (so a decode step does not
/// recompute `W_kvb c̄` for every earlier position).
#[derive(Clone, Debug, Default)]
pub struct MlaCache {
    pub len: usize,
    /// `[pos][kv_lora]`
    pub latent: Vec<f32>,
    /// `[pos][rope]`
    pub k_rope: Vec<f32>,
    /// `[pos][heads][nope]`
    pub k_nope: Vec<f32>,
    /// `[pos][heads][v]`
    pub v: Vec<f32>,
}

impl MlaCache {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.latent.len() + self.k_rope.len() + self.k_nope.len() + self.v.len())
    }
}

/// MLA over `ntok` tokens following the cached ones.
#[allow(clippy::too_many_arguments)]
pub fn mla_forward(
    w: &MlaWeights<'_>,
    d: &MlaDims,
    eps: &Eps,
    u: &[f32],
    ntok: usize,
    cache: &mut MlaCache,
    threads: usize,
    trace: &mut Option<&mut Trace>,
) -> Vec<f32> {
    let qh = d.nope + d.rope;
    let mut cq = vec![0f32; ntok * d.q_lora];
    gemm(&w.q_a, u, &mut cq, ntok, threads);
    for t in 0..ntok {
        norm::rmsnorm_inplace(
            &mut cq[t * d.q_lora..(t + 1) * d.q_lora],
            Some(&w.q_a_norm),
            eps.mla_lora,
        );
    }
    let mut q = vec![0f32; ntok * d.heads * qh];
    gemm(&w.q_b, &cq, &mut q, ntok, threads);
    let kvw = d.kv_lora + d.rope;
    let mut kv = vec![0f32; ntok * kvw];
    gemm(&w.kv_a, u, &mut kv, ntok, threads);
    let mut lat = vec![0f32; ntok * d.kv_lora];
    for t in 0..ntok {
        norm::rmsnorm(
            &kv[t * kvw..t * kvw + d.kv_lora],
            Some(&w.kv_a_norm),
            eps.mla_lora,
            &mut lat[t * d.kv_lora..(t + 1) * d.kv_lora],
        );
        cache
            .k_rope
            .extend_from_slice(&kv[t * kvw + d.kv_lora..(t + 1) * kvw]);
    }
    cache.latent.extend_from_slice(&lat);
    trace_put(trace, "mla_latent", &lat);
    for t in 0..ntok {
        trace_put(trace, "mla_k_rope", &kv[t * kvw + d.kv_lora..(t + 1) * kvw]);
    }
    let per = d.nope + d.v;
    let mut kvb = vec![0f32; ntok * d.heads * per];
    gemm(&w.kv_b, &lat, &mut kvb, ntok, threads);
    for t in 0..ntok {
        for h in 0..d.heads {
            let base = (t * d.heads + h) * per;
            cache.k_nope.extend_from_slice(&kvb[base..base + d.nope]);
        }
        for h in 0..d.heads {
            let base = (t * d.heads + h) * per;
            cache.v.extend_from_slice(&kvb[base + d.nope..base + per]);
        }
    }
    let first = cache.len;
    cache.len += ntok;
    let dims = mla::MlaDims {
        heads: d.heads,
        nope: d.nope,
        rope: d.rope,
        v: d.v,
    };
    let view = mla::MlaCacheView {
        k_nope: &cache.k_nope,
        v: &cache.v,
        k_rope: &cache.k_rope,
    };
    let ow = d.heads * d.v;
    let mut o = vec![0f32; ntok * ow];
    for t in 0..ntok {
        mla::attend(
            dims,
            &q[t * d.heads * qh..(t + 1) * d.heads * qh],
            &view,
            first + t,
            &mut o[t * ow..(t + 1) * ow],
        );
    }
    if let Some(g) = &w.g {
        let mut gate = vec![0f32; ntok * ow];
        gemm(g, u, &mut gate, ntok, threads);
        for (x, gv) in o.iter_mut().zip(&gate) {
            *x *= sigmoid(*gv);
        }
    }
    let mut y = vec![0f32; ntok * d.hidden];
    gemm(&w.o, &o, &mut y, ntok, threads);
    y
}

// ---------------------------------------------------------------------------------------
// FFNs
// ---------------------------------------------------------------------------------------

/// SiTU caps.
#[derive(Clone, Copy, Debug)]
pub struct Situ {
    pub b1: f32,
    pub b2: f32,
}

/// `W_down · SiTU(W_gate x, W_up x)` for `ntok` rows, as unrounded f64 sums. The SiTU
/// output stays f64 into the down projection (an f64 island inside the FFN).
pub fn glu_mlp64(
    gate: &Mat<'_>,
    up: &Mat<'_>,
    down: &Mat<'_>,
    situ: Situ,
    x: &[f32],
    ntok: usize,
    threads: usize,
) -> Vec<f64> {
    let f = gate.rows;
    let mut g = vec![0f32; ntok * f];
    let mut u = vec![0f32; ntok * f];
    gemm(gate, x, &mut g, ntok, threads);
    gemm(up, x, &mut u, ntok, threads);
    let mut a = vec![0f64; ntok * f];
    situ_glu64(&g, &u, situ.b1, situ.b2, &mut a);
    let mut y = vec![0f64; ntok * down.rows];
    gemm64_x64(down, &a, &mut y, ntok, threads);
    y
}

/// `W_down · SiTU(W_gate x, W_up x)` for `ntok` rows (rounded once to f32).
pub fn glu_mlp(
    gate: &Mat<'_>,
    up: &Mat<'_>,
    down: &Mat<'_>,
    situ: Situ,
    x: &[f32],
    ntok: usize,
    threads: usize,
) -> Vec<f32> {
    glu_mlp64(gate, up, down, situ, x, ntok, threads)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

/// Latent-MoE parameters.
#[derive(Clone, Copy, Debug)]
pub struct MoeParams {
    pub hidden: usize,
    pub n_experts: usize,
    pub top_k: usize,
    pub latent: usize,
    pub inter: usize,
    pub renormalize: bool,
    pub routed_scale: f32,
    pub situ: Situ,
    pub eps: f32,
}

/// Trunk weights of one latent-MoE block.
pub struct MoeWeights<'a> {
    pub gate: Mat<'a>,
    pub bias: Option<Vec<f32>>,
    pub down: Mat<'a>,
    pub up: Mat<'a>,
    /// `routed_expert_norm`; `None` when `latent_moe_use_norm` is false.
    pub norm: Option<Vec<f32>>,
    pub sh_gate: Mat<'a>,
    pub sh_up: Mat<'a>,
    pub sh_down: Mat<'a>,
}

/// Counters of one MoE call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MoeStats {
    /// Distinct experts requested.
    pub requests: usize,
    /// Expert slots that failed to load (or were never delivered); each is left out of
    /// the sum, and a run with any is unsound.
    pub failures: usize,
    /// One message per failure.
    pub failure_msgs: Vec<String>,
}

/// A routed-expert supplier: `fetch(ids, deliver)` calls `deliver(slot, result)` once per
/// slot, in any order.
pub type ExpertFetch<'f> =
    dyn FnMut(&[u32], &mut dyn for<'b> FnMut(usize, Result<ExpertRef<'b>, WeightError>)) + 'f;

/// The latent MoE over `ntok` rows `v` (post post_attention_layernorm).
#[allow(clippy::too_many_arguments)]
pub fn moe_forward(
    w: &MoeWeights<'_>,
    p: &MoeParams,
    v: &[f32],
    ntok: usize,
    fetch: &mut ExpertFetch<'_>,
    threads: usize,
    stats: &mut MoeStats,
    trace: &mut Option<&mut Trace>,
) -> Vec<f32> {
    let (lat, k) = (p.latent, p.top_k);
    let mut logits = vec![0f32; ntok * p.n_experts];
    gemm(&w.gate, v, &mut logits, ntok, threads);
    let routes: Vec<router::Routing> = (0..ntok)
        .map(|t| {
            router::route(
                &logits[t * p.n_experts..(t + 1) * p.n_experts],
                w.bias.as_deref(),
                k,
                p.renormalize,
                p.routed_scale,
            )
        })
        .collect();
    for r in &routes {
        trace_put(trace, "moe_scores", &r.scores);
        trace_put(
            trace,
            "moe_topk_ids",
            &r.ids.iter().map(|&i| i as f32).collect::<Vec<_>>(),
        );
        trace_put(trace, "moe_topk_weights", &r.weights);
    }
    let mut xl = vec![0f32; ntok * lat];
    gemm(&w.down, v, &mut xl, ntok, threads);

    // Distinct ids in first-use order, and who uses each: (token, slot in its top-k).
    let mut union: Vec<u32> = Vec::new();
    let mut users: Vec<Vec<(usize, usize)>> = Vec::new();
    for (t, r) in routes.iter().enumerate() {
        for (slot, &id) in r.ids.iter().enumerate() {
            match union.iter().position(|&u| u == id) {
                Some(ui) => users[ui].push((t, slot)),
                None => {
                    union.push(id);
                    users.push(vec![(t, slot)]);
                }
            }
        }
    }
    stats.requests += union.len();
    let mut outs = vec![0f32; ntok * k * lat];
    let mut done = vec![false; ntok * k];
    let mut delivered = vec![false; union.len()];
    {
        let mut deliver = |ui: usize, res: Result<ExpertRef<'_>, WeightError>| {
            if ui >= union.len() || delivered[ui] {
                stats.failures += 1;
                stats
                    .failure_msgs
                    .push(format!("expert slot {ui} delivered twice or out of range"));
                return;
            }
            delivered[ui] = true;
            let id = union[ui];
            let mats = res.and_then(|e| {
                let n = |x: &str| format!("expert {id} {x}");
                Ok((
                    expert_mat(&n("w1"), e.w1, p.inter, lat)?,
                    expert_mat(&n("w3"), e.w3, p.inter, lat)?,
                    expert_mat(&n("w2"), e.w2, lat, p.inter)?,
                ))
            });
            match mats {
                Ok((w1, w3, w2)) => {
                    let us = &users[ui];
                    let mut xb = Vec::with_capacity(us.len() * lat);
                    for &(t, _) in us {
                        xb.extend_from_slice(&xl[t * lat..(t + 1) * lat]);
                    }
                    let y = glu_mlp(&w1, &w3, &w2, p.situ, &xb, us.len(), threads);
                    for (j, &(t, slot)) in us.iter().enumerate() {
                        outs[(t * k + slot) * lat..(t * k + slot + 1) * lat]
                            .copy_from_slice(&y[j * lat..(j + 1) * lat]);
                        done[t * k + slot] = true;
                    }
                }
                Err(e) => {
                    stats.failures += 1;
                    stats.failure_msgs.push(format!("expert {id}: {e}"));
                }
            }
        };
        fetch(&union, &mut deliver);
    }
    for (ui, d) in delivered.iter().enumerate() {
        if !d {
            stats.failures += 1;
            stats
                .failure_msgs
                .push(format!("expert {} was never delivered", union[ui]));
        }
    }
    // Weighted sum in top-k order, then the latent norm on the aggregate.
    let mut agg = vec![0f32; ntok * lat];
    for t in 0..ntok {
        let a = &mut agg[t * lat..(t + 1) * lat];
        for slot in 0..k.min(routes[t].ids.len()) {
            if !done[t * k + slot] {
                continue;
            }
            let wt = routes[t].weights[slot];
            let y = &outs[(t * k + slot) * lat..(t * k + slot + 1) * lat];
            for j in 0..lat {
                a[j] += wt * y[j];
            }
        }
        if let Some(nw) = &w.norm {
            norm::rmsnorm_inplace(a, Some(nw), p.eps);
        }
    }
    // z = r + sh, added in f64 from the unrounded products and rounded once (the two
    // halves are often large and nearly cancelling).
    let mut r = vec![0f64; ntok * p.hidden];
    gemm64(&w.up, &agg, &mut r, ntok, threads);
    let sh = glu_mlp64(&w.sh_gate, &w.sh_up, &w.sh_down, p.situ, v, ntok, threads);
    r.iter().zip(&sh).map(|(a, b)| (a + b) as f32).collect()
}

// ---------------------------------------------------------------------------------------
// AttnRes
// ---------------------------------------------------------------------------------------

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
