//! NoPE multi-head latent attention (k3-spec §4.6): the module and its weight binding.
//!
//! Two use phases (`k3_model::trunk::use_phase`), as in KDA: [`MlaWeights::attend`], then
//! the output projection `o_proj` ([`project_out`](super::project_out)).

use k3_model::classify::layer_tensor;

use super::{gather_rows, out_slots, LayerCtx, Seg};
use crate::forward::{ForwardError, Model};
use crate::kernels::act::mul_sigmoid;
use crate::kernels::matmul::{gemm, gemm_fused, Mat};
use crate::kernels::{mla, norm};
use crate::profile::{self, Phase};
use crate::weights::Weights;

/// MLA geometry.
#[derive(Clone, Copy, Debug)]
pub struct MlaGeometry {
    pub hidden: usize,
    pub heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
}

/// Weights of one MLA module up to its output projection (use phase 0; `o_proj` is phase 1).
pub struct MlaWeights<'a> {
    pub q_a: Mat<'a>,
    pub q_a_norm: Vec<f32>,
    pub q_b: Mat<'a>,
    pub kv_a: Mat<'a>,
    pub kv_a_norm: Vec<f32>,
    pub kv_b: Mat<'a>,
    /// The output gate (`g_proj`); `None` when `mla_use_output_gate` is false.
    pub g: Option<Mat<'a>>,
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

impl MlaWeights<'_> {
    /// MLA over `ntok` tokens `u` (`ntok × hidden`, post input_layernorm) following the
    /// cached ones, up to its output projection, appending them to `cache`: the (gated)
    /// per-head values (`ntok × heads·v`) that `o_proj` ([`project_out`](super::project_out))
    /// maps back to the hidden size. The one-group case of [`MlaWeights::attend_groups`].
    pub fn attend(
        &self,
        ctx: &mut LayerCtx<'_>,
        d: &MlaGeometry,
        u: &[f32],
        ntok: usize,
        cache: &mut MlaCache,
    ) -> Vec<f32> {
        self.attend_groups(
            ctx,
            d,
            u,
            &mut [Seg {
                rows: ntok,
                state: cache,
            }],
            None,
        )
    }

    /// MLA over the rows `u` of a pass (`ntok × hidden`, post input_layernorm), the groups'
    /// rows back to back, each group following its own cached tokens and appended to its
    /// own cache: the (gated) per-head values of the rows in `live` (ascending row indices;
    /// None: every row), `live.len() × heads·v`. A row outside `live` is only cached (its
    /// latent, `k_rope`, and the keys and values expanded from the latent); its query, output
    /// gate and attention are skipped.
    pub fn attend_groups(
        &self,
        ctx: &mut LayerCtx<'_>,
        d: &MlaGeometry,
        u: &[f32],
        groups: &mut [Seg<'_, MlaCache>],
        live: Option<&[usize]>,
    ) -> Vec<f32> {
        let (w, eps, threads) = (self, ctx.eps, ctx.threads);
        let ntok: usize = groups.iter().map(|g| g.rows).sum();
        let slots = out_slots(ntok, live);
        let nout = live.map_or(ntok, |l| l.len());
        let qh = d.nope + d.rope;
        let kvw = d.kv_lora + d.rope;
        let ow = d.heads * d.v;
        let (mut cq, kv, gate) = w.project_input(d, u, live, ntok, nout, threads);
        let core = profile::span(Phase::AttnCore);
        for t in 0..nout {
            norm::rmsnorm_inplace(
                &mut cq[t * d.q_lora..(t + 1) * d.q_lora],
                Some(&w.q_a_norm),
                eps.mla_lora,
            );
        }
        core.end();
        let mut q = vec![0f32; nout * d.heads * qh];
        if nout > 0 {
            gemm(&w.q_b, &cq, &mut q, nout, threads);
        }
        let core = profile::span(Phase::AttnCore);
        let mut lat = vec![0f32; ntok * d.kv_lora];
        for t in 0..ntok {
            norm::rmsnorm(
                &kv[t * kvw..t * kvw + d.kv_lora],
                Some(&w.kv_a_norm),
                eps.mla_lora,
                &mut lat[t * d.kv_lora..(t + 1) * d.kv_lora],
            );
        }
        ctx.record("mla_latent", &lat);
        for t in 0..ntok {
            ctx.record("mla_k_rope", &kv[t * kvw + d.kv_lora..(t + 1) * kvw]);
        }
        core.end();
        let per = d.nope + d.v;
        let mut kvb = vec![0f32; ntok * d.heads * per];
        gemm(&w.kv_b, &lat, &mut kvb, ntok, threads);
        let dims = mla::MlaDims {
            heads: d.heads,
            nope: d.nope,
            rope: d.rope,
            v: d.v,
        };
        let _core = profile::span(Phase::AttnCore);
        let mut o = vec![0f32; nout * ow];
        let mut r0 = 0;
        for g in groups.iter_mut() {
            let cache = &mut *g.state;
            let rows = r0..r0 + g.rows;
            let first = cache.len;
            cache_rows(cache, d, rows.clone(), &kv, &lat, &kvb);
            let view = mla::MlaCacheView {
                k_nope: &cache.k_nope,
                v: &cache.v,
                k_rope: &cache.k_rope,
            };
            // The group's live rows attend together (their keys transposed once).
            let picks: Vec<(usize, usize)> = rows
                .filter_map(|t| slots[t].map(|j| (j, first + (t - r0))))
                .collect();
            mla::attend_rows(dims, &q, &picks, &view, &mut o, threads);
            r0 += g.rows;
        }
        if w.g.is_some() {
            mul_sigmoid(&mut o, &gate);
        }
        o
    }

    /// The products of the layer input `u` (`ntok × hidden`): the query latent `cq` and the
    /// output gate of the live rows (`nout` rows each; the gate empty without `g_proj`) and
    /// `kv_a` of every row (`ntok × (kv_lora + rope)`), as `(cq, kv, gate)`.
    fn project_input(
        &self,
        d: &MlaGeometry,
        u: &[f32],
        live: Option<&[usize]>,
        ntok: usize,
        nout: usize,
        threads: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let w = self;
        let mut cq = vec![0f32; nout * d.q_lora];
        let kvw = d.kv_lora + d.rope;
        let mut kv = vec![0f32; ntok * kvw];
        let ow = d.heads * d.v;
        let mut gate = vec![0f32; if w.g.is_some() { nout * ow } else { 0 }];
        match live {
            // q_a, kv_a and the output gate all read the layer input: one pass over `u`.
            None => match &w.g {
                Some(g) => gemm_fused(
                    &[&w.q_a, &w.kv_a, g],
                    u,
                    &mut [&mut cq, &mut kv, &mut gate],
                    ntok,
                    threads,
                ),
                None => gemm_fused(
                    &[&w.q_a, &w.kv_a],
                    u,
                    &mut [&mut cq, &mut kv],
                    ntok,
                    threads,
                ),
            },
            // Every row is cached; only the live rows ask a query (and an output gate).
            Some(rows) => {
                gemm(&w.kv_a, u, &mut kv, ntok, threads);
                if nout > 0 {
                    let ul = gather_rows(u, rows, d.hidden);
                    match &w.g {
                        Some(g) => {
                            gemm_fused(&[&w.q_a, g], &ul, &mut [&mut cq, &mut gate], nout, threads)
                        }
                        None => gemm(&w.q_a, &ul, &mut cq, nout, threads),
                    }
                }
            }
        }
        (cq, kv, gate)
    }
}

/// Append the pass rows `rows` to `cache`: their `k_rope` (from `kv`), latent (`lat`), and
/// the per-head keys and values expanded from the latent (`kvb`, `[row][head][nope + v]`).
fn cache_rows(
    cache: &mut MlaCache,
    d: &MlaGeometry,
    rows: std::ops::Range<usize>,
    kv: &[f32],
    lat: &[f32],
    kvb: &[f32],
) {
    let kvw = d.kv_lora + d.rope;
    let per = d.nope + d.v;
    for t in rows.clone() {
        cache
            .k_rope
            .extend_from_slice(&kv[t * kvw + d.kv_lora..(t + 1) * kvw]);
    }
    cache
        .latent
        .extend_from_slice(&lat[rows.start * d.kv_lora..rows.end * d.kv_lora]);
    for t in rows.clone() {
        for h in 0..d.heads {
            let base = (t * d.heads + h) * per;
            cache.k_nope.extend_from_slice(&kvb[base..base + d.nope]);
        }
        for h in 0..d.heads {
            let base = (t * d.heads + h) * per;
            cache.v.extend_from_slice(&kvb[base + d.nope..base + per]);
        }
    }
    cache.len += rows.len();
}

impl<W: Weights> Model<W> {
    pub(crate) fn mla_geometry(&self) -> MlaGeometry {
        let c = &self.cfg;
        MlaGeometry {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            q_lora: c.q_lora_rank,
            kv_lora: c.kv_lora_rank,
            nope: c.qk_nope_head_dim,
            rope: c.qk_rope_head_dim,
            v: c.v_head_dim,
        }
    }
    /// Layer `l`'s MLA weights of use phase 0 (up to the output projection).
    pub(crate) fn mla_weights(&self, l: usize) -> Result<MlaWeights<'_>, ForwardError> {
        let d = self.mla_geometry();
        let n = |s: &str| layer_tensor(l, &format!("self_attn.{s}"));
        let qh = d.nope + d.rope;
        Ok(MlaWeights {
            q_a: self.mat(&n("q_a_proj.weight"), d.q_lora, d.hidden)?,
            q_a_norm: self.vector(&n("q_a_layernorm.weight"), d.q_lora)?,
            q_b: self.mat(&n("q_b_proj.weight"), d.heads * qh, d.q_lora)?,
            kv_a: self.mat(
                &n("kv_a_proj_with_mqa.weight"),
                d.kv_lora + d.rope,
                d.hidden,
            )?,
            kv_a_norm: self.vector(&n("kv_a_layernorm.weight"), d.kv_lora)?,
            kv_b: self.mat(&n("kv_b_proj.weight"), d.heads * (d.nope + d.v), d.kv_lora)?,
            g: if self.cfg.mla_use_output_gate {
                Some(self.mat(&n("g_proj.weight"), d.heads * d.v, d.hidden)?)
            } else {
                None
            },
        })
    }
}
