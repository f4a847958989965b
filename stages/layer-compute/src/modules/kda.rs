//! Kimi Delta Attention (k3-spec §4.5): the module over a token batch and its weight binding.
//!
//! The module is two use phases (`k3_model::trunk::use_phase`): [`KdaWeights::attend`]
//! (everything up to the gated, normed per-head output), then the output projection
//! `o_proj` ([`project_out`](super::project_out)), bound after the first phase is given
//! back.

use k3_model::classify::layer_tensor;
use k3_model::tensor::WeightError;
use rayon::prelude::*;

use super::{gather_rows, out_slots, LayerCtx, Seg};
use crate::forward::{ForwardError, Model};
use crate::kernels::act::sigmoid;
use crate::kernels::matmul::{gemm, gemm_fused, Mat};
use crate::kernels::{conv, kda, norm};
use crate::profile::{self, Phase};
use crate::weights::to_f32_vec;
use crate::weights::Weights;

/// KDA geometry.
#[derive(Clone, Copy, Debug)]
pub struct KdaGeometry {
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub conv: usize,
    pub lower_bound: f32,
}

impl KdaGeometry {
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// Weights of one KDA module up to its output projection (use phase 0; `o_proj` is phase 1).
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
    /// A zero state. Its pages are written here, one value per 4 KiB page, on the calling
    /// thread: the head-parallel recurrence then finds them in place. Left to the first
    /// token (zeroed allocations are mapped lazily), the pool's threads took those page
    /// faults side by side inside the recurrence, and on this VM the slice's 16-token prompt
    /// spent 21-28 ms per KDA layer in it against 6-7 ms with the state touched here (for
    /// about 3-4 ms of faults, 6 MiB a layer; `docs/measurements.md`).
    pub fn new(d: &KdaGeometry) -> Self {
        let (state, tail) = Self::lens(d);
        let mut s = vec![0f32; state];
        k3_io::arena::touch_f32_pages(&mut s);
        KdaState {
            s,
            conv_q: vec![0.0; tail],
            conv_k: vec![0.0; tail],
            conv_v: vec![0.0; tail],
        }
    }

    /// Values in the per-head state (`s`) and in each conv tail, for `d`.
    pub fn lens(d: &KdaGeometry) -> (usize, usize) {
        (
            d.heads * d.head_dim * d.head_dim,
            d.width() * d.conv.saturating_sub(1),
        )
    }
}

impl KdaWeights<'_> {
    /// KDA over `ntok` consecutive tokens `u` (`ntok × hidden`, post input_layernorm) up to
    /// its output projection, advancing `st`: the gated, normed per-head output
    /// (`ntok × width`) that `o_proj` ([`project_out`](super::project_out)) maps back to the
    /// hidden size. The one-group case of [`KdaWeights::attend_groups`].
    pub fn attend(
        &self,
        ctx: &mut LayerCtx<'_>,
        d: &KdaGeometry,
        u: &[f32],
        ntok: usize,
        st: &mut KdaState,
    ) -> Vec<f32> {
        self.attend_groups(
            ctx,
            d,
            u,
            &mut [Seg {
                rows: ntok,
                state: st,
            }],
            None,
        )
    }

    /// KDA over the rows `u` of a pass (`ntok × hidden`, post input_layernorm), the groups'
    /// rows back to back, each group advancing its own state: the gated, normed per-head
    /// output of the rows in `live` (ascending row indices; None: every row), `live.len() ×
    /// width`. A row outside `live` still carries its group's state on (its projections,
    /// conv tails and recurrence step), but its output gate, norm and gating are skipped.
    ///
    /// The projections run over every row at once (the output gate's over the live rows
    /// only); the conv tails and the recurrence run per group, head by head on the pool.
    pub fn attend_groups(
        &self,
        ctx: &mut LayerCtx<'_>,
        d: &KdaGeometry,
        u: &[f32],
        groups: &mut [Seg<'_, KdaState>],
        live: Option<&[usize]>,
    ) -> Vec<f32> {
        let threads = ctx.threads;
        let ntok: usize = groups.iter().map(|g| g.rows).sum();
        let slots = out_slots(ntok, live);
        let nout = live.map_or(ntok, |l| l.len());
        let p = d.width();
        let pr = self.project_input(d, u, live, ntok, nout, threads);
        let mut qc = vec![0f32; ntok * p];
        let mut kc = vec![0f32; ntok * p];
        let mut vc = vec![0f32; ntok * p];
        let core = profile::span(Phase::AttnCore);
        let mut r0 = 0;
        for g in groups.iter_mut() {
            let r = r0 * p..(r0 + g.rows) * p;
            let st = &mut *g.state;
            conv::shortconv_silu(
                &pr.q[r.clone()],
                &self.q_conv,
                d.conv,
                p,
                &mut st.conv_q,
                &mut qc[r.clone()],
            );
            conv::shortconv_silu(
                &pr.k[r.clone()],
                &self.k_conv,
                d.conv,
                p,
                &mut st.conv_k,
                &mut kc[r.clone()],
            );
            conv::shortconv_silu(
                &pr.v[r.clone()],
                &self.v_conv,
                d.conv,
                p,
                &mut st.conv_v,
                &mut vc[r],
            );
            r0 += g.rows;
        }
        core.end();
        let mut z = vec![0f32; ntok * p];
        gemm(&self.f_b, &pr.fa, &mut z, ntok, threads);
        let conv = Convolved {
            q: qc,
            k: kc,
            v: vc,
            z,
            beta: pr.beta,
            gate: pr.gate,
        };
        let _core = profile::span(Phase::AttnCore);
        let o = self.recurrence(ctx, d, &conv, groups, &slots, nout);
        for g in groups.iter() {
            ctx.record("kda_state", &g.state.s);
        }
        o
    }

    /// The products of the layer input `u` (`ntok × hidden`), every row's but the output
    /// gate's, which is the live rows' only (`nout` rows).
    fn project_input(
        &self,
        d: &KdaGeometry,
        u: &[f32],
        live: Option<&[usize]>,
        ntok: usize,
        nout: usize,
        threads: usize,
    ) -> Projections {
        let w = self;
        let (p, h) = (d.width(), d.heads);
        let mut q = vec![0f32; ntok * p];
        let mut k = vec![0f32; ntok * p];
        let mut v = vec![0f32; ntok * p];
        let mut beta = vec![0f32; ntok * h];
        let mut fa = vec![0f32; ntok * w.f_a.rows];
        let mut gate = vec![0f32; nout * p];
        // Every projection of the layer input in one pass over `u` (each result bit-identical
        // to its own product); the output gate only where an output is wanted.
        match live {
            None => gemm_fused(
                &[&w.q, &w.k, &w.v, &w.b, &w.f_a, &w.g],
                u,
                &mut [&mut q, &mut k, &mut v, &mut beta, &mut fa, &mut gate],
                ntok,
                threads,
            ),
            Some(rows) => {
                gemm_fused(
                    &[&w.q, &w.k, &w.v, &w.b, &w.f_a],
                    u,
                    &mut [&mut q, &mut k, &mut v, &mut beta, &mut fa],
                    ntok,
                    threads,
                );
                if nout > 0 {
                    let ul = gather_rows(u, rows, d.hidden);
                    gemm(&w.g, &ul, &mut gate, nout, threads);
                }
            }
        }
        Projections {
            q,
            k,
            v,
            beta,
            fa,
            gate,
        }
    }

    /// The recurrence, group by group and head by head, advancing each group's state: the
    /// gated, normed output of the rows with an output slot (`slots`), `nout × width`.
    ///
    /// Every head's state, gate, norms and output depend on that head's channels of its own
    /// group only, so the (group, head) pairs run on the pool (each in token order, exactly
    /// the sequential operations) and the result does not depend on the thread count or on
    /// the other groups.
    fn recurrence(
        &self,
        ctx: &LayerCtx<'_>,
        d: &KdaGeometry,
        c: &Convolved,
        groups: &mut [Seg<'_, KdaState>],
        slots: &[Option<usize>],
        nout: usize,
    ) -> Vec<f32> {
        let (w, eps, threads) = (self, ctx.eps, ctx.threads);
        let p = d.width();
        let (h, dk) = (d.heads, d.head_dim);
        let qscale = 1.0 / (dk as f32).sqrt();
        // (first row of the group, its rows, head, the head's state)
        let head = |(r0, rows, hh, s): (usize, usize, usize, &mut [f32])| -> Vec<f32> {
            let hr = hh * dk..(hh + 1) * dk;
            let (mut g, mut alpha) = (vec![0f32; dk], vec![0f32; dk]);
            let (mut qh, mut kh) = (vec![0f32; dk], vec![0f32; dk]);
            let mut scratch = vec![0f32; dk];
            let mut out = vec![0f32; rows * dk];
            for t in 0..rows {
                // Head hh's channels of row r0 + t.
                let ch = (r0 + t) * p + hr.start..(r0 + t) * p + hr.end;
                kda::decay_gate(
                    &c.z[ch.clone()],
                    &w.a_log[hh..hh + 1],
                    &w.dt_bias[hr.clone()],
                    1,
                    dk,
                    d.lower_bound,
                    &mut g,
                    &mut alpha,
                );
                qh.copy_from_slice(&c.q[ch.clone()]);
                kh.copy_from_slice(&c.k[ch.clone()]);
                norm::l2norm_inplace(&mut qh, eps.kda_l2);
                norm::l2norm_inplace(&mut kh, eps.kda_l2);
                qh.iter_mut().for_each(|x| *x *= qscale);
                let b = sigmoid(c.beta[(r0 + t) * h + hh]);
                let oh = &mut out[t * dk..(t + 1) * dk];
                let x = kda::DeltaIn {
                    q: &qh,
                    k: &kh,
                    v: &c.v[ch],
                    alpha: &alpha,
                    beta: b,
                };
                kda::delta_step(s, x, oh, &mut scratch);
                if let Some(j) = slots[r0 + t] {
                    let gc = j * p + hr.start..j * p + hr.end;
                    kda::output_norm_gate(oh, &c.gate[gc], &w.o_norm, 1, eps.rms);
                }
            }
            out
        };
        let mut jobs = Vec::with_capacity(groups.len() * h);
        let mut r0 = 0;
        for g in groups.iter_mut() {
            for (hh, s) in g.state.s.chunks_mut(dk * dk).enumerate() {
                jobs.push((r0, g.rows, hh, s));
            }
            r0 += g.rows;
        }
        let placed: Vec<(usize, usize, usize)> = jobs
            .iter()
            .map(|&(r0, rows, hh, _)| (r0, rows, hh))
            .collect();
        let per_job: Vec<Vec<f32>> = if threads > 1 {
            jobs.into_par_iter().map(head).collect()
        } else {
            jobs.into_iter().map(head).collect()
        };
        let mut o = vec![0f32; nout * p];
        for (&(r0, rows, hh), oh) in placed.iter().zip(&per_job) {
            for t in 0..rows {
                if let Some(j) = slots[r0 + t] {
                    o[j * p + hh * dk..j * p + (hh + 1) * dk]
                        .copy_from_slice(&oh[t * dk..(t + 1) * dk]);
                }
            }
        }
        o
    }
}

/// The products of a pass's layer input (`ntok` rows; the output gate `nout` rows).
struct Projections {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    beta: Vec<f32>,
    fa: Vec<f32>,
    gate: Vec<f32>,
}

/// What the recurrence reads: the convolved `q`, `k`, `v`, the decay-gate input `z`
/// (`f_b · f_a`), `beta` and the output gate.
struct Convolved {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    z: Vec<f32>,
    beta: Vec<f32>,
    gate: Vec<f32>,
}

impl<W: Weights> Model<W> {
    pub(crate) fn kda_geometry(&self) -> KdaGeometry {
        let la = &self.cfg.linear_attn;
        KdaGeometry {
            hidden: self.cfg.hidden_size,
            heads: la.num_heads,
            head_dim: la.head_dim,
            conv: la.short_conv_kernel_size,
            lower_bound: la.gate_lower_bound,
        }
    }
    pub(crate) fn conv_taps(
        &self,
        name: &str,
        channels: usize,
        width: usize,
    ) -> Result<Vec<f32>, ForwardError> {
        let t = self.tensor(name)?;
        if !(t.shape == [channels, 1, width] || t.shape == [channels, width]) {
            return Err(WeightError::Invalid {
                name: name.into(),
                msg: format!("shape {:?}, expected [{channels}, 1, {width}]", t.shape),
            }
            .into());
        }
        Ok(to_f32_vec(name, &t)?)
    }
    /// Layer `l`'s KDA weights of use phase 0 (up to the output projection).
    pub(crate) fn kda_weights(&self, l: usize) -> Result<KdaWeights<'_>, ForwardError> {
        let d = self.kda_geometry();
        let (h, p, dk, hid) = (d.heads, d.width(), d.head_dim, d.hidden);
        let n = |s: &str| layer_tensor(l, &format!("self_attn.{s}"));
        let a_log_name = n("A_log");
        let a_log_t = self.tensor(&a_log_name)?;
        // A_log is per HEAD: [heads], or padded to [head_dim] (released); use the first heads.
        if a_log_t.shape.len() != 1 || a_log_t.shape[0] < h {
            return Err(WeightError::Invalid {
                name: a_log_name,
                msg: format!(
                    "shape {:?}, expected [{h}] or a padded [>= {h}]",
                    a_log_t.shape
                ),
            }
            .into());
        }
        let a_log = to_f32_vec(&a_log_name, &a_log_t)?[..h].to_vec();
        let frank = {
            let t = self.tensor(&n("f_a_proj.weight"))?;
            t.shape.first().copied().unwrap_or(0)
        };
        Ok(KdaWeights {
            q: self.mat(&n("q_proj.weight"), p, hid)?,
            k: self.mat(&n("k_proj.weight"), p, hid)?,
            v: self.mat(&n("v_proj.weight"), p, hid)?,
            q_conv: self.conv_taps(&n("q_conv1d.weight"), p, d.conv)?,
            k_conv: self.conv_taps(&n("k_conv1d.weight"), p, d.conv)?,
            v_conv: self.conv_taps(&n("v_conv1d.weight"), p, d.conv)?,
            f_a: self.mat(&n("f_a_proj.weight"), frank, hid)?,
            f_b: self.mat(&n("f_b_proj.weight"), p, frank)?,
            b: self.mat(&n("b_proj.weight"), h, hid)?,
            g: self.mat(&n("g_proj.weight"), p, hid)?,
            a_log,
            dt_bias: self.vector(&n("dt_bias"), p)?,
            o_norm: self.vector(&n("o_norm.weight"), dk)?,
        })
    }
}
