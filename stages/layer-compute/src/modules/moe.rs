//! The latent MoE (k3-spec §4.7): router, routed experts in the latent space, shared
//! experts, and its weight binding. Expert outputs are combined in top-k order, whatever
//! order they arrive in.
//!
//! The routed experts of one delivery are multiplied side by side, one per thread of the
//! pool, largest token count first, when there are at least two per thread (a prompt's
//! experts: 3 to 6 tokens each); fewer run one after another, each product split over
//! the pool by rows. A product's bits never depend on its thread count (the reduction
//! contract, `kernels::matmul`), so neither choice changes a result. Measured with
//! `examples/experts_probe` on the slice's expert shape, 2 threads, alternating: a
//! 16-token prompt's 188 experts (749 token routes) in 240-253 ms side by side against
//! 297-327 ms split by rows; a decode token's 48 experts in 28-30 against 32-36 ms
//! (`docs/measurements.md`).

use k3_model::classify::{expert_tensor, layer_tensor};
use k3_model::tensor::WeightError;

use super::mlp::{glu_down64, glu_mlp, Situ};
use super::{expert_mat, LayerCtx, ScaleChecks};
use crate::forward::{ForwardError, Model};
use crate::kernels::matmul::{gemm64, gemm_fused, Mat};
use crate::kernels::norm;
use crate::kernels::router::{self, Routing};
use crate::profile::{self, Phase};
use crate::weights::{Delivery, Weights};
use rayon::prelude::*;

/// Latent-MoE parameters.
#[derive(Clone, Copy, Debug)]
pub struct MoeParams {
    /// The decoder layer (names the tensors in an error).
    pub layer: usize,
    pub hidden: usize,
    pub n_experts: usize,
    pub top_k: usize,
    pub latent: usize,
    pub inter: usize,
    pub renormalize: bool,
    pub routed_scale: f32,
    pub situ: Situ,
}

/// Trunk weights of one latent-MoE block: the part used before the routed experts (use
/// phase 2) and the part used after them (phase 4, `k3_model::trunk::use_phase`).
pub struct MoeWeights<'a> {
    pub head: MoeHead<'a>,
    pub tail: MoeTail<'a>,
}

/// What the MoE uses before the routed experts: the router (and its bias), the latent
/// down-projection and the shared experts.
pub struct MoeHead<'a> {
    pub gate: Mat<'a>,
    pub bias: Option<Vec<f32>>,
    pub down: Mat<'a>,
    pub sh_gate: Mat<'a>,
    pub sh_up: Mat<'a>,
    pub sh_down: Mat<'a>,
}

/// What the MoE uses after the routed experts: the latent norm and up-projection of their
/// combined output.
#[derive(Clone)]
pub struct MoeTail<'a> {
    pub up: Mat<'a>,
    /// `routed_expert_norm`; `None` when `latent_moe_use_norm` is false.
    pub norm: Option<Vec<f32>>,
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
    /// The first delivered expert holding a value that is not finite (an E8M0 scale byte
    /// 0xFF): not a load failure, the whole pass fails with it.
    pub non_finite: Option<String>,
}

/// A routed-expert supplier: `fetch(ids, deliver)` calls `deliver(experts)` until every
/// slot has been delivered once, in any order and grouping ([`Weights::experts`]).
pub type ExpertFetch<'f> = dyn FnMut(&[u32], &mut dyn for<'b> FnMut(Delivery<'b>)) + 'f;

impl MoeWeights<'_> {
    /// The latent MoE over `ntok` rows `v` (post post_attention_layernorm), its routed
    /// experts from `fetch`: the output rows and the call's counters.
    pub fn forward(
        &self,
        ctx: &mut LayerCtx<'_>,
        p: &MoeParams,
        v: &[f32],
        ntok: usize,
        fetch: &mut ExpertFetch<'_>,
    ) -> Result<(Vec<f32>, MoeStats), ForwardError> {
        let checks = ScaleChecks::new(0, 0);
        let mut hooks = MoeHooks {
            announce: &mut |_| {},
            fetch,
            release_head: &mut || {},
            tail: &mut || Ok(self.tail.clone()),
            checks: &checks,
        };
        self.head.forward_phased(ctx, p, v, ntok, &mut hooks)
    }
}

/// The supplier's side of [`MoeHead::forward_phased`], called in this order:
/// `announce(ids)` the moment the router has chosen (the distinct ids, in the order `fetch`
/// will ask for them), before the shared experts and the latent down-projection are
/// computed, so the expert reads overlap that compute; `release_head()` once the head's
/// weights are read for the last time (before the routed experts: a trunk streamed in
/// parts can then read its next part while they are computed); `fetch(ids, deliver)` for
/// the routed experts ([`ExpertFetch`]); `tail()` for the tail's weights, after the routed
/// experts.
pub struct MoeHooks<'h, 't> {
    pub announce: &'h mut dyn FnMut(&[u32]),
    pub fetch: &'h mut ExpertFetch<'h>,
    pub release_head: &'h mut dyn FnMut(),
    pub tail: &'h mut dyn FnMut() -> Result<MoeTail<'t>, ForwardError>,
    /// The model's experts already scanned for NaN scales ([`ScaleChecks`]).
    pub checks: &'h ScaleChecks,
}

impl MoeHead<'_> {
    /// [`MoeWeights::forward`] in two use phases, with the supplier's hooks ([`MoeHooks`]).
    ///
    /// The order of the products changes, not their values: the router's product alone,
    /// then the latent down-projection and the shared experts' gate/up fused, then the
    /// shared experts' down-projection, then the routed experts; every product is
    /// bit-identical to the same matrix multiplied alone (`gemm_fused`'s contract), and the
    /// sums are the same.
    pub fn forward_phased(
        &self,
        ctx: &mut LayerCtx<'_>,
        p: &MoeParams,
        v: &[f32],
        ntok: usize,
        hooks: &mut MoeHooks<'_, '_>,
    ) -> Result<(Vec<f32>, MoeStats), ForwardError> {
        let router_span = profile::span(Phase::Router);
        // The router first, alone: its choice starts the expert reads.
        let routed = Routed::new(self.route(p, v, ntok, ctx.threads)?);
        ctx.record_routes(&routed.routes);
        (hooks.announce)(&routed.union);
        router_span.end();
        let shared_span = profile::span(Phase::Shared);
        // While the experts load: the latent down-projection and the shared experts.
        let (xl, sh) = self.latent_and_shared(p, v, ntok, ctx.threads);
        shared_span.end();
        // The head's weights are not read again from here on.
        (hooks.release_head)();
        for r in &routed.routes {
            ctx.record("moe_scores", &r.scores);
            ctx.record(
                "moe_topk_ids",
                &r.ids.iter().map(|&i| i as f32).collect::<Vec<_>>(),
            );
            ctx.record("moe_topk_weights", &r.weights);
        }
        let mut stats = MoeStats {
            requests: routed.union.len(),
            ..MoeStats::default()
        };
        let fx = (&mut *hooks.fetch, hooks.checks);
        let slots = routed_experts(p, &routed, &xl, ctx.threads, fx, &mut stats);
        if let Some(msg) = stats.non_finite.take() {
            return Err(ForwardError::NonFinite(msg));
        }
        let tail = (hooks.tail)()?;
        let _combine = profile::span(Phase::Combine);
        let z = tail.combine(ctx, p, &routed, &slots, &sh);
        Ok((z, stats))
    }

    /// The router's product (alone) and each token's top-k. A router logit that is not
    /// finite from a finite input row is the gate weight's (a NaN row would otherwise only
    /// steer the top-k choice, never reaching the hidden state): the pass fails naming it.
    fn route(
        &self,
        p: &MoeParams,
        v: &[f32],
        ntok: usize,
        threads: usize,
    ) -> Result<Vec<Routing>, ForwardError> {
        let mut logits = vec![0f32; ntok * p.n_experts];
        gemm_fused(&[&self.gate], v, &mut [&mut logits], ntok, threads);
        let e = p.n_experts;
        for (t, (row, x)) in logits
            .chunks_exact(e)
            .zip(v.chunks_exact(p.hidden))
            .enumerate()
        {
            let Some(i) = row.iter().position(|y| !y.is_finite()) else {
                continue;
            };
            if x.iter().all(|x| x.is_finite()) {
                return Err(WeightError::NonFinite {
                    name: layer_tensor(p.layer, "block_sparse_moe.gate.weight"),
                    msg: format!("router logit of expert {i} is {} for token {t}", row[i]),
                }
                .into());
            }
        }
        Ok((0..ntok)
            .map(|t| {
                router::route(
                    &logits[t * p.n_experts..(t + 1) * p.n_experts],
                    self.bias.as_deref(),
                    p.top_k,
                    p.renormalize,
                    p.routed_scale,
                )
            })
            .collect())
    }

    /// The latent down-projection of `v` (`ntok × latent`) and the shared experts' output
    /// (`ntok × hidden`, unrounded f64 sums).
    fn latent_and_shared(
        &self,
        p: &MoeParams,
        v: &[f32],
        ntok: usize,
        threads: usize,
    ) -> (Vec<f32>, Vec<f64>) {
        let mut xl = vec![0f32; ntok * p.latent];
        let sw = self.sh_gate.rows;
        let mut sh_g = vec![0f32; ntok * sw];
        let mut sh_u = vec![0f32; ntok * sw];
        gemm_fused(
            &[&self.down, &self.sh_gate, &self.sh_up],
            v,
            &mut [&mut xl, &mut sh_g, &mut sh_u],
            ntok,
            threads,
        );
        let sh = glu_down64(&sh_g, &sh_u, &self.sh_down, p.situ, ntok, threads);
        (xl, sh)
    }
}

/// The router's choice for a batch of tokens.
struct Routed {
    /// Each token's top-k.
    routes: Vec<Routing>,
    /// The distinct ids, in first-use order (the order the supplier is asked for them).
    union: Vec<u32>,
    /// For each id of `union`, who uses it: (token, slot in its top-k), in token order.
    users: Vec<Vec<(usize, usize)>>,
}

impl Routed {
    fn new(routes: Vec<Routing>) -> Self {
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
        Routed {
            routes,
            union,
            users,
        }
    }
}

/// The routed experts' outputs in the latent space, kept as each expert returned them (its
/// users' rows in order), and where each (token, top-k slot)'s row is: an output and a row
/// in it, or none (a failed expert's). A slot-ordered copy of every row (`ntok·top_k ×
/// latent`, 117 MB for a 512-token prompt on the slice) cost its page faults and the copy.
struct SlotOutputs {
    lat: usize,
    ys: Vec<Vec<f32>>,
    at: Vec<Option<(usize, usize)>>,
}

impl SlotOutputs {
    /// Slot `i`'s (`t · top_k + slot`) output row, if its expert ran.
    fn row(&self, i: usize) -> Option<&[f32]> {
        let (y, j) = self.at[i]?;
        Some(&self.ys[y][j * self.lat..(j + 1) * self.lat])
    }
}

/// One routed expert bound from a delivery: its index in [`Routed::union`] and its
/// matrices `[w1, w3, w2]` (gate, up, down).
type ExpertJob<'b> = (usize, [Mat<'b>; 3]);

/// Fetch and run the routed experts of `r`, each over its tokens' latent rows `xl`; every
/// expert that fails to load (or is never delivered) is counted in `stats` and left out.
fn routed_experts(
    p: &MoeParams,
    r: &Routed,
    xl: &[f32],
    threads: usize,
    (fetch, checks): (&mut ExpertFetch<'_>, &ScaleChecks),
    stats: &mut MoeStats,
) -> SlotOutputs {
    let (lat, k) = (p.latent, p.top_k);
    let ntok = r.routes.len();
    let mut slots = SlotOutputs {
        lat,
        ys: Vec::new(),
        at: vec![None; ntok * k],
    };
    let mut delivered = vec![false; r.union.len()];
    {
        // The fetch's time less the routed products inside it is the wait for weights.
        let mut wait_span = profile::span(Phase::ExpertWait);
        let mut deliver = |batch: Delivery<'_>| {
            let jobs = bind_delivery(batch, p, (&r.union, checks), &mut delivered, stats);
            if jobs.is_empty() {
                return;
            }
            let t0 = profile::enabled().then(std::time::Instant::now);
            let ex_span = profile::span(Phase::Experts);
            let ys = run_experts(&jobs, p, r, xl, threads);
            ex_span.end();
            if let Some(t0) = t0 {
                wait_span.exclude(t0.elapsed());
            }
            for ((ui, _), y) in jobs.iter().zip(ys) {
                for (j, &(t, slot)) in r.users[*ui].iter().enumerate() {
                    slots.at[t * k + slot] = Some((slots.ys.len(), j));
                }
                slots.ys.push(y);
            }
        };
        fetch(&r.union, &mut deliver);
    }
    for (ui, d) in delivered.iter().enumerate() {
        if !d {
            stats.failures += 1;
            stats
                .failure_msgs
                .push(format!("expert {} was never delivered", r.union[ui]));
        }
    }
    slots
}

/// Check every slot of a delivery and bind its matrices; failures (a slot delivered twice
/// or out of range, an expert that did not load or does not fit) are counted and left out.
fn bind_delivery<'b>(
    batch: Delivery<'b>,
    p: &MoeParams,
    (union, checks): (&[u32], &ScaleChecks),
    delivered: &mut [bool],
    stats: &mut MoeStats,
) -> Vec<ExpertJob<'b>> {
    let lat = p.latent;
    let mut jobs: Vec<ExpertJob<'b>> = Vec::with_capacity(batch.len());
    for (ui, res) in batch {
        if ui >= union.len() || delivered[ui] {
            stats.failures += 1;
            stats
                .failure_msgs
                .push(format!("expert slot {ui} delivered twice or out of range"));
            continue;
        }
        delivered[ui] = true;
        let id = union[ui];
        let known = checks.known(p.layer, id);
        let mats = res.and_then(|e| {
            let n = |x: &str| expert_tensor(p.layer, id as usize, x);
            Ok([
                expert_mat(&n("w1"), e.w1, p.inter, lat, known)?,
                expert_mat(&n("w3"), e.w3, p.inter, lat, known)?,
                expert_mat(&n("w2"), e.w2, lat, p.inter, known)?,
            ])
        });
        if mats.is_ok() && !known {
            checks.mark(p.layer, id);
        }
        match mats {
            Ok(m) => jobs.push((ui, m)),
            Err(e @ WeightError::NonFinite { .. }) => {
                stats.non_finite.get_or_insert_with(|| e.to_string());
            }
            Err(e) => {
                stats.failures += 1;
                stats.failure_msgs.push(format!("expert {id}: {e}"));
            }
        }
    }
    jobs
}

/// Each job's expert over its tokens' latent rows (`users × latent`, in the job order): side
/// by side, one expert per thread, when there are at least two per thread, else one after
/// another with each product split over the pool (the module doc).
fn run_experts(
    jobs: &[ExpertJob<'_>],
    p: &MoeParams,
    r: &Routed,
    xl: &[f32],
    threads: usize,
) -> Vec<Vec<f32>> {
    let lat = p.latent;
    // One expert over its tokens' latent rows, its products on `th` threads.
    let run = |(ui, [w1, w3, w2]): &ExpertJob<'_>, th: usize| {
        let us = &r.users[*ui];
        let mut xb = Vec::with_capacity(us.len() * lat);
        for &(t, _) in us {
            xb.extend_from_slice(&xl[t * lat..(t + 1) * lat]);
        }
        glu_mlp(w1, w3, w2, p.situ, &xb, us.len(), th)
    };
    if threads > 1 && jobs.len() >= 2 * threads {
        // Side by side, the most tokens first so the last to finish is short.
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by_key(|&j| std::cmp::Reverse(r.users[jobs[j].0].len()));
        let mut ready: Vec<(usize, Vec<f32>)> = order
            .par_iter()
            .with_max_len(1)
            .map(|&j| (j, run(&jobs[j], 1)))
            .collect();
        ready.sort_unstable_by_key(|r| r.0);
        ready.into_iter().map(|r| r.1).collect()
    } else {
        jobs.iter().map(|j| run(j, threads)).collect()
    }
}

impl MoeTail<'_> {
    /// The routed experts' weighted sum in top-k order, the latent norm on the aggregate,
    /// the latent up-projection, and the shared experts' `sh` added: the MoE's output.
    fn combine(
        &self,
        ctx: &LayerCtx<'_>,
        p: &MoeParams,
        r: &Routed,
        slots: &SlotOutputs,
        sh: &[f64],
    ) -> Vec<f32> {
        let (lat, k) = (p.latent, p.top_k);
        let ntok = r.routes.len();
        let mut agg = vec![0f32; ntok * lat];
        for (t, route) in r.routes.iter().enumerate() {
            let a = &mut agg[t * lat..(t + 1) * lat];
            for slot in 0..k.min(route.ids.len()) {
                let Some(y) = slots.row(t * k + slot) else {
                    continue;
                };
                let wt = route.weights[slot];
                for (a, &y) in a.iter_mut().zip(y) {
                    *a += wt * y;
                }
            }
            if let Some(nw) = &self.norm {
                norm::rmsnorm_inplace(a, Some(nw), ctx.eps.rms);
            }
        }
        // z = r + sh, added in f64 from the unrounded products and rounded once (the two
        // halves are often large and nearly cancelling).
        let mut z = vec![0f64; ntok * p.hidden];
        gemm64(&self.up, &agg, &mut z, ntok, ctx.threads);
        z.iter().zip(sh).map(|(a, b)| (a + b) as f32).collect()
    }
}

impl<W: Weights> Model<W> {
    /// Layer `l`'s MoE parameters.
    pub(crate) fn moe_params(&self, l: usize) -> MoeParams {
        let c = &self.cfg;
        MoeParams {
            layer: l,
            hidden: c.hidden_size,
            n_experts: c.num_experts,
            top_k: c.num_experts_per_token,
            latent: c.routed_expert_hidden_size,
            inter: c.moe_intermediate_size,
            renormalize: c.moe_renormalize,
            routed_scale: c.routed_scaling_factor,
            situ: self.situ(),
        }
    }
    pub(crate) fn situ(&self) -> Situ {
        Situ {
            b1: self.cfg.activation_situ_beta,
            b2: self.cfg.activation_situ_linear_beta,
        }
    }
    /// Layer `l`'s MoE weights of use phase 2 (before the routed experts).
    pub(crate) fn moe_head(&self, l: usize) -> Result<MoeHead<'_>, ForwardError> {
        let c = &self.cfg;
        let (d, lat, e, sw) = (
            c.hidden_size,
            c.routed_expert_hidden_size,
            c.num_experts,
            c.shared_expert_width(),
        );
        let n = |s: &str| layer_tensor(l, &format!("block_sparse_moe.{s}"));
        let bias_name = n("gate.e_score_correction_bias");
        Ok(MoeHead {
            gate: self.mat(&n("gate.weight"), e, d)?,
            bias: Some(self.vector(&bias_name, e)?),
            down: self.mat(&n("routed_expert_down_proj.weight"), lat, d)?,
            sh_gate: self.mat(&n("shared_experts.gate_proj.weight"), sw, d)?,
            sh_up: self.mat(&n("shared_experts.up_proj.weight"), sw, d)?,
            sh_down: self.mat(&n("shared_experts.down_proj.weight"), d, sw)?,
        })
    }

    /// Layer `l`'s MoE weights of use phase 4 (after the routed experts).
    pub(crate) fn moe_tail(&self, l: usize) -> Result<MoeTail<'_>, ForwardError> {
        let c = &self.cfg;
        let (d, lat) = (c.hidden_size, c.routed_expert_hidden_size);
        let n = |s: &str| layer_tensor(l, &format!("block_sparse_moe.{s}"));
        Ok(MoeTail {
            up: self.mat(&n("routed_expert_up_proj.weight"), d, lat)?,
            norm: if c.latent_moe_use_norm {
                Some(self.vector(&n("routed_expert_norm.weight"), lat)?)
            } else {
                None
            },
        })
    }
}
