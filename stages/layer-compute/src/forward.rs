//! The Kimi K3 forward pass over a [`Weights`] implementation: [`Model`] and [`Session`]
//! (incremental state). The decode loop over it is [`crate::decode`].
//!
//! Per call the forward embeds the new tokens, runs every bound layer over all of them
//! (k3-spec §4.2 AttnRes body, one [`LayerCtx`] for the call: bank snapshots of the RAW
//! layer input at block boundaries, the guarded pre-attention mix, the unguarded pre-MLP
//! mix; KDA or MLA from the config's layer map only; dense FFN or latent MoE), then the
//! model-level mix, the final norm and the head. State that must survive between calls (KDA state and conv tails, the MLA
//! cache) lives in the [`Session`]; the AttnRes bank is per token and never carried.
//!
//! One pass may carry several sessions ([`Model::forward_batch`]: groups of a session, its
//! new ids and the logits rows it wants): the rows of every group go through each product
//! together (the trunk, the lm_head and the routed experts are read once per pass), the
//! attention runs per group on its own session, and each group's results are bit for bit
//! those of a pass over it alone. The single-session calls ([`Model::prefill`],
//! [`Model::step`], [`Model::forward`], ...) are its one-group case. In a pass where some
//! rows' logits are not wanted, the last layer computes for them only what the caches keep
//! (issue 32, [`ForwardStats::rows_skipped`]).
//!
//! Full recompute and incremental decode run the same kernels in the same order on the
//! same values, so a decode step's logits are bitwise equal to the teacher-forced row.
//! The forward does no I/O of its own: weights, layer lifecycle and expert delivery all go
//! through [`Weights`].

use k3_model::config::{LayerKind, ModelConfig};
use k3_model::tensor::{Dtype, TensorRef, WeightError};

use crate::kernels::matmul::{gemm, gemm_fused, Mat};
use crate::kernels::norm;
use crate::modules::attnres::attnres_mix_rows;
use crate::modules::kda::{KdaState, KdaWeights};
use crate::modules::mla::{MlaCache, MlaWeights};
use crate::modules::mlp::glu_down64;
use crate::modules::moe::{MoeHead, MoeHooks};
use crate::modules::{gather_rows, mat_from, project_out, Eps, LayerCtx, Seg, Trace};
use crate::weights::{to_f32_vec, Delivery, Weights, LM_HEAD};
use k3_model::classify::{layer_tensor, model_tensor};

/// Why a forward pass could not run.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// A tensor is missing or does not fit its expected dtype/shape (exit 1 upstream).
    /// A tensor that holds a non-finite value is [`ForwardError::NonFinite`] instead.
    #[error("tensor does not bind: {0}")]
    Bind(WeightError),
    /// The request itself is invalid (token id out of range, no tokens, bad options).
    #[error("{0}")]
    Input(String),
    /// A layer's output holds NaN or ±Inf (corrupt weights, or an overflow): the run must
    /// not turn it into a token.
    #[error("{0}")]
    NonFinite(String),
}

impl From<WeightError> for ForwardError {
    fn from(e: WeightError) -> Self {
        match e {
            WeightError::NonFinite { .. } => ForwardError::NonFinite(e.to_string()),
            e => ForwardError::Bind(e),
        }
    }
}

/// Options of a [`Model`].
#[derive(Clone, Debug)]
pub struct ModelOptions {
    /// Worker threads for the matrix products (1 = the calling thread only).
    pub threads: usize,
    /// Bind and run only layers `0..n` (default: all).
    pub layers: Option<usize>,
    /// Epsilons (default: the spec's, [`Eps::spec`]).
    pub eps: Option<Eps>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            threads: 1,
            layers: None,
            eps: None,
        }
    }
}

/// Counters of one forward call (of a prefill in passes: summed over them). Not the
/// protocol's per-step `StepStats`, which the stage fills from these and the links'
/// counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ForwardStats {
    /// Distinct routed experts requested, summed over layers (a pass over several sessions
    /// asks for the union of all its rows' routes once).
    pub expert_requests: usize,
    /// Routed experts that failed to load (left out of their sums; the run is unsound).
    pub expert_failures: usize,
    /// One message per failure.
    pub failure_msgs: Vec<String>,
    /// Rows whose last layer stopped at what the caches and states keep, because nobody
    /// reads their output (issue 32): their attention output, `o_proj`, the post-attention
    /// mix and norm, the FFN or MoE and the final norm and head were skipped.
    pub rows_skipped: usize,
    /// Of those, routed-expert products not computed: `top_k` per skipped row when the last
    /// layer is an MoE (the experts only they would have chosen are never read).
    pub routes_skipped: usize,
}

impl ForwardStats {
    /// Add another call's counters (and its messages) to these.
    pub fn absorb(&mut self, o: ForwardStats) {
        self.expert_requests += o.expert_requests;
        self.expert_failures += o.expert_failures;
        self.failure_msgs.extend(o.failure_msgs);
        self.rows_skipped += o.rows_skipped;
        self.routes_skipped += o.routes_skipped;
    }
}

/// Which of a group's tokens get logits in a pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Every token's row (teacher forcing, scoring, traces): nothing is skipped.
    All,
    /// The last token's row (a decode row, a prompt's last pass).
    Last,
    /// None: the pass only carries the session on (a prefill pass before the last).
    None,
}

/// One session's tokens in a pass over several ([`Model::forward_batch`]): `ids` follow
/// the tokens `session` has consumed (a decode row is one id, a prompt chunk several).
pub struct Group<'s> {
    pub session: &'s mut Session,
    pub ids: &'s [u32],
    pub want: Want,
}

/// One group's part of a [`BatchOutput`].
#[derive(Clone, Debug)]
pub struct GroupOutput {
    /// `rows × vocab` logits: every token's row, the last one, or none (its [`Want`]).
    pub logits: Vec<f32>,
    pub rows: usize,
}

/// Output of one pass over several sessions.
#[derive(Debug)]
pub struct BatchOutput {
    /// One per group, in the groups' order: its logits, or why they cannot be trusted (a
    /// hidden state of its rows that is not finite: that group's session is spoiled and
    /// must be dropped; the other groups' rows never depend on it).
    pub groups: Vec<Result<GroupOutput, ForwardError>>,
    /// The pass's counters (one set of products and expert reads serves every group).
    pub stats: ForwardStats,
}

/// How a pass's rows lie ([`Model::forward_batch`]): the groups' rows back to back.
struct PassLayout {
    /// Each group's rows.
    rows: Vec<usize>,
    /// Each group's [`Want`].
    wants: Vec<Want>,
    /// Each group's first row in the pass.
    starts: Vec<usize>,
    /// Rows in all.
    ntok: usize,
    /// The rows whose logits are wanted, ascending.
    wanted: Vec<usize>,
}

/// Output of one forward call.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// `rows × vocab` logits: every new token's row, or only the last one.
    pub logits: Vec<f32>,
    pub rows: usize,
    pub stats: ForwardStats,
}

/// Carried state of one sequence: its length and the per-layer recurrent state / cache.
#[derive(Clone, Debug, Default)]
pub struct Session {
    pos: usize,
    kda: Vec<Option<KdaState>>,
    mla: Vec<Option<MlaCache>>,
}

impl Session {
    /// Tokens consumed so far.
    pub fn len(&self) -> usize {
        self.pos
    }
    /// Whether no token has been consumed.
    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }
    /// Bytes of MLA cache held.
    pub fn kv_bytes(&self) -> usize {
        self.mla.iter().flatten().map(|c| c.bytes()).sum()
    }
    /// The carried state, layer by layer (saving a session: [`crate::state`]).
    pub(crate) fn parts(&self) -> (usize, &[Option<KdaState>], &[Option<MlaCache>]) {
        (self.pos, &self.kda, &self.mla)
    }
    /// A session from saved parts ([`crate::state`] checks them against the model first).
    pub(crate) fn from_parts(
        pos: usize,
        kda: Vec<Option<KdaState>>,
        mla: Vec<Option<MlaCache>>,
    ) -> Session {
        Session { pos, kda, mla }
    }
    /// Bytes of KDA state held.
    pub fn kda_bytes(&self) -> usize {
        self.kda
            .iter()
            .flatten()
            .map(|s| 4 * (s.s.len() + s.conv_q.len() + s.conv_k.len() + s.conv_v.len()))
            .sum()
    }
    /// Bytes the session's buffers have allocated (KV cache capacity and KDA state): what
    /// it costs in memory, which [`Session::kv_bytes`] (the positions held) can be below.
    pub fn allocated_bytes(&self) -> usize {
        let kv: usize = self
            .mla
            .iter()
            .flatten()
            .map(|c| {
                4 * (c.latent.capacity()
                    + c.k_rope.capacity()
                    + c.k_nope.capacity()
                    + c.v.capacity())
            })
            .sum();
        kv + self.kda_bytes()
    }
    /// Give back the KV cache's unused capacity (a state kept for prefix reuse holds its
    /// positions, not the room its request had reserved).
    pub fn shrink_to_fit(&mut self) {
        for c in self.mla.iter_mut().flatten() {
            c.latent.shrink_to_fit();
            c.k_rope.shrink_to_fit();
            c.k_nope.shrink_to_fit();
            c.v.shrink_to_fit();
        }
    }
}

/// A model: config, weights and options.
pub struct Model<W> {
    pub(crate) cfg: ModelConfig,
    weights: W,
    threads: usize,
    n_layers: usize,
    pub(crate) eps: Eps,
    /// The routes recorded so far (`--record-routes`); None: not recording.
    routes: std::sync::Mutex<Option<crate::routes::RouteLog>>,
    /// The routed experts whose scales were scanned and found clean.
    scale_checks: crate::modules::ScaleChecks,
}

/// Each row's position in its session (for the route log; empty when `wanted` is false).
fn row_positions(
    wanted: bool,
    sessions: &[&mut Session],
    starts: &[usize],
    ntok: usize,
) -> Vec<u32> {
    if !wanted {
        return Vec::new();
    }
    (0..ntok)
        .map(|r| {
            let g = starts.partition_point(|&s| s <= r) - 1;
            (sessions[g].pos + (r - starts[g])) as u32
        })
        .collect()
}

pub(crate) fn lname(l: usize, suffix: &str) -> String {
    layer_tensor(l, suffix)
}

impl<W: Weights> Model<W> {
    /// A model over `weights`; checks the options against the config.
    pub fn new(cfg: ModelConfig, weights: W, opts: ModelOptions) -> Result<Self, ForwardError> {
        let n_layers = match opts.layers {
            None => cfg.n_layers(),
            Some(n) if n >= 1 && n <= cfg.n_layers() => n,
            Some(n) => {
                return Err(ForwardError::Input(format!(
                    "--layers {n}: the model has layers 1..={}",
                    cfg.n_layers()
                )))
            }
        };
        let eps = opts.eps.unwrap_or(Eps::spec(cfg.rms_norm_eps));
        Ok(Model {
            threads: opts.threads.max(1),
            n_layers,
            eps,
            scale_checks: crate::modules::ScaleChecks::new(cfg.n_layers(), cfg.num_experts),
            cfg,
            weights,
            routes: std::sync::Mutex::new(None),
        })
    }

    /// Record every row's routed experts per MoE layer into `log` from the next pass on
    /// (`--record-routes`). Nothing computed changes.
    pub fn record_routes(&self, log: crate::routes::RouteLog) {
        *self.routes.lock().unwrap_or_else(|e| e.into_inner()) = Some(log);
    }

    /// The routes recorded (and stop recording); None when not recording.
    pub fn take_routes(&self) -> Option<crate::routes::RouteLog> {
        self.routes.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    pub fn weights(&self) -> &W {
        &self.weights
    }
    /// Layers bound (a prefix of the model).
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }
    pub fn threads(&self) -> usize {
        self.threads
    }
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads.max(1);
    }
    pub fn vocab(&self) -> usize {
        self.cfg.vocab_size
    }

    /// A fresh sequence.
    pub fn new_session(&self) -> Session {
        Session {
            pos: 0,
            kda: vec![None; self.n_layers],
            mla: vec![None; self.n_layers],
        }
    }

    /// Reserve room in `s`'s KV cache for `positions` tokens in all (those it holds
    /// included), so that it never grows past them by doubling: a serving slot holds what
    /// the memory plan counted for it and no more. Changes no result.
    pub fn reserve_positions(&self, s: &mut Session, positions: usize) {
        let g = self.mla_geometry();
        for (l, c) in s.mla.iter_mut().enumerate() {
            if self.cfg.layer_kind(l) != LayerKind::Mla {
                continue;
            }
            let c = c.get_or_insert_with(MlaCache::default);
            let more = positions.saturating_sub(c.len);
            c.latent.reserve_exact(more * g.kv_lora);
            c.k_rope.reserve_exact(more * g.rope);
            c.k_nope.reserve_exact(more * g.heads * g.nope);
            c.v.reserve_exact(more * g.heads * g.v);
        }
    }

    /// Feed `ids` after the session's tokens; return the logits of the last token.
    pub fn prefill(&self, sess: &mut Session, ids: &[u32]) -> Result<ForwardOutput, ForwardError> {
        self.forward(sess, ids, false, None)
    }

    /// [`Model::prefill`] in passes of at most `chunk` tokens (None: one pass; the last one
    /// takes what is left): each pass carries the session on, and only the last computes logits (of its
    /// last token). The logits are those of one pass over `ids`, bit for bit (every product
    /// is independent of how many tokens share a pass, and the recurrent state and the KV
    /// cache carry across passes exactly); what changes is that a pass's experts (the union
    /// of its tokens' routes) fit a smaller arena.
    pub fn prefill_chunked(
        &self,
        sess: &mut Session,
        ids: &[u32],
        chunk: Option<usize>,
    ) -> Result<ForwardOutput, ForwardError> {
        self.prefill_passes(sess, ids, chunk, &mut |_| {})
    }

    /// [`Model::prefill_chunked`], calling `on_pass(tokens fed so far)` after each pass of a
    /// prompt longer than one pass (progress of a long prefill).
    pub fn prefill_passes(
        &self,
        sess: &mut Session,
        ids: &[u32],
        chunk: Option<usize>,
        on_pass: &mut dyn FnMut(usize),
    ) -> Result<ForwardOutput, ForwardError> {
        let chunk = match chunk {
            Some(c) if c < ids.len() => c.max(1),
            _ => return self.prefill(sess, ids),
        };
        let last = (ids.len() - 1) % chunk + 1;
        let (body, tail) = ids.split_at(ids.len() - last);
        let mut stats = ForwardStats::default();
        for (k, c) in body.chunks(chunk).enumerate() {
            let o = self.forward_rows(sess, c, Want::None, None)?;
            on_pass(((k + 1) * chunk).min(body.len()));
            stats.absorb(o.stats);
        }
        let mut out = self.forward_rows(sess, tail, Want::Last, None)?;
        on_pass(ids.len());
        stats.absorb(std::mem::take(&mut out.stats));
        out.stats = stats;
        Ok(out)
    }

    /// Feed one token; return its logits.
    pub fn step(&self, sess: &mut Session, id: u32) -> Result<ForwardOutput, ForwardError> {
        self.forward(sess, &[id], false, None)
    }

    /// Full recompute over `ids` in a fresh session; logits of every position
    /// (`ids.len() × vocab`, teacher forcing).
    pub fn forward_all(&self, ids: &[u32]) -> Result<ForwardOutput, ForwardError> {
        let mut s = self.new_session();
        self.forward(&mut s, ids, true, None)
    }

    /// Like [`Model::forward_all`], also recording intermediate values into `trace`.
    pub fn forward_traced(
        &self,
        ids: &[u32],
        trace: &mut Trace,
    ) -> Result<ForwardOutput, ForwardError> {
        let mut s = self.new_session();
        self.forward(&mut s, ids, true, Some(trace))
    }

    /// Check that every trunk and model-level tensor of the bound layers is present with
    /// the expected dtype and shape (the first problem found is returned, naming the
    /// tensor). Experts are not checked here (they are delivered per step).
    pub fn check_binding(&self) -> Result<(), ForwardError> {
        self.embed_tensor()?;
        self.head()?;
        self.vector(&model_tensor("norm.weight"), self.cfg.hidden_size)?;
        self.final_fold()?;
        for l in 0..self.n_layers {
            self.weights.begin_layer(l)?;
            let r = self.bind_layer_phases(l);
            self.weights.end_layer(l);
            r?;
        }
        Ok(())
    }

    /// Bind every trunk tensor of layer `l` the way the forward does: one use phase at a
    /// time, each released ([`Weights::end_phase`]) before the next is bound.
    fn bind_layer_phases(&self, l: usize) -> Result<(), ForwardError> {
        self.bind_attn(l)?;
        self.weights.end_phase(l);
        self.attn_out(l)?;
        self.weights.end_phase(l);
        let dense = matches!(self.bind_ffn_in(l)?.ffn, FfnIn::Dense { .. });
        self.weights.end_phase(l);
        if dense {
            self.dense_up(l)?;
            self.weights.end_phase(l);
            self.dense_down(l)?;
        } else {
            self.moe_tail(l)?;
        }
        self.weights.end_phase(l);
        Ok(())
    }

    pub(crate) fn tensor(&self, name: &str) -> Result<TensorRef<'_>, ForwardError> {
        Ok(self.weights.tensor(name)?)
    }

    pub(crate) fn mat(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Mat<'_>, ForwardError> {
        let t = self.tensor(name)?;
        Ok(mat_from(name, t, rows, cols)?)
    }

    /// A small vector of `len` values (shape `[len]` or `[1, len]`).
    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ForwardError> {
        let t = self.tensor(name)?;
        if t.numel() != len || !(t.shape == [len] || t.shape == [1, len]) {
            return Err(WeightError::Invalid {
                name: name.into(),
                msg: format!("shape {:?}, expected [{len}]", t.shape),
            }
            .into());
        }
        Ok(to_f32_vec(name, &t)?)
    }

    fn embed_tensor(&self) -> Result<TensorRef<'_>, ForwardError> {
        let name = model_tensor("embed_tokens.weight");
        let t = self.tensor(&name)?;
        let (v, d) = (self.cfg.vocab_size, self.cfg.hidden_size);
        if t.shape != [v, d]
            || !matches!(t.dtype, Dtype::BF16 | Dtype::F32)
            || t.bytes.len() != v * d * t.dtype.size()
        {
            return Err(WeightError::Invalid {
                name,
                msg: format!("{} {:?}, expected BF16/F32 [{v}, {d}]", t.dtype, t.shape),
            }
            .into());
        }
        Ok(t)
    }

    fn head(&self) -> Result<Mat<'_>, ForwardError> {
        self.mat(LM_HEAD, self.cfg.vocab_size, self.cfg.hidden_size)
    }

    /// The tensors of layer `l`'s use phase 0 (`k3_model::trunk::use_phase`): the
    /// pre-attention mix, `input_layernorm` and the attention up to its output projection
    /// (phase 1, [`Self::attn_out`]).
    fn bind_attn(&self, l: usize) -> Result<AttnW<'_>, ForwardError> {
        let d = self.cfg.hidden_size;
        let attn = match self.cfg.layer_kind(l) {
            LayerKind::Kda => Attn::Kda(self.kda_weights(l)?),
            LayerKind::Mla => Attn::Mla(self.mla_weights(l)?),
        };
        Ok(AttnW {
            attn_fold: self.fold(
                &lname(l, "self_attention_res_norm.weight"),
                &lname(l, "self_attention_res_proj.weight"),
            )?,
            in_norm: self.vector(&lname(l, "input_layernorm.weight"), d)?,
            attn,
        })
    }

    /// Phase 1: the attention's output projection, `[hidden, width]` (KDA: heads × head
    /// dim; MLA: heads × v head dim).
    fn attn_out(&self, l: usize) -> Result<Mat<'_>, ForwardError> {
        let width = match self.cfg.layer_kind(l) {
            LayerKind::Kda => self.kda_geometry().width(),
            LayerKind::Mla => self.cfg.num_attention_heads * self.cfg.v_head_dim,
        };
        self.mat(
            &lname(l, "self_attn.o_proj.weight"),
            self.cfg.hidden_size,
            width,
        )
    }

    /// The tensors of phase 2: the pre-MLP mix, `post_attention_layernorm`, and a dense
    /// FFN's gate (its up-projection is phase 3, its down-projection phase 4) or the latent
    /// MoE's head (its tail, used after the routed experts, is phase 4).
    fn bind_ffn_in(&self, l: usize) -> Result<FfnW<'_>, ForwardError> {
        let d = self.cfg.hidden_size;
        let ffn = if self.cfg.is_moe(l) {
            FfnIn::Moe(self.moe_head(l)?)
        } else {
            let f = self.cfg.intermediate_size;
            FfnIn::Dense {
                gate: self.mat(&lname(l, "mlp.gate_proj.weight"), f, d)?,
            }
        };
        Ok(FfnW {
            mlp_fold: self.fold(
                &lname(l, "mlp_res_norm.weight"),
                &lname(l, "mlp_res_proj.weight"),
            )?,
            post_norm: self.vector(&lname(l, "post_attention_layernorm.weight"), d)?,
            ffn,
        })
    }

    /// Phase 3: a dense FFN's up-projection.
    fn dense_up(&self, l: usize) -> Result<Mat<'_>, ForwardError> {
        let (d, f) = (self.cfg.hidden_size, self.cfg.intermediate_size);
        self.mat(&lname(l, "mlp.up_proj.weight"), f, d)
    }

    /// Phase 4: a dense FFN's down-projection.
    fn dense_down(&self, l: usize) -> Result<Mat<'_>, ForwardError> {
        let (d, f) = (self.cfg.hidden_size, self.cfg.intermediate_size);
        self.mat(&lname(l, "mlp.down_proj.weight"), d, f)
    }

    /// Run `ids` through the model after the session's tokens. `all_rows`: return every
    /// new token's logits (else only the last). `trace`: record intermediates.
    pub fn forward(
        &self,
        sess: &mut Session,
        ids: &[u32],
        all_rows: bool,
        trace: Option<&mut Trace>,
    ) -> Result<ForwardOutput, ForwardError> {
        let want = if all_rows { Want::All } else { Want::Last };
        self.forward_rows(sess, ids, want, trace)
    }

    /// One session's pass: the one-group case of [`Model::forward_batch`].
    fn forward_rows(
        &self,
        sess: &mut Session,
        ids: &[u32],
        want: Want,
        trace: Option<&mut Trace>,
    ) -> Result<ForwardOutput, ForwardError> {
        let mut group = [Group {
            session: sess,
            ids,
            want,
        }];
        let out = self.forward_batch(&mut group, trace)?;
        let g = out
            .groups
            .into_iter()
            .next()
            .expect("one group in, one out")?;
        Ok(ForwardOutput {
            logits: g.logits,
            rows: g.rows,
            stats: out.stats,
        })
    }

    /// One forward pass over several sessions at once: each group's `ids` follow its own
    /// session's tokens, and the rows of all groups (back to back, in the groups' order) go
    /// through every product together, so the trunk, the lm_head and each routed expert
    /// (the union of every row's routes, announced once per layer) are read once for the
    /// pass, and the [`Weights`] layer and phase hooks are called once per pass. The
    /// attention (the KDA recurrence and conv tails, the MLA cache) runs per group on its
    /// own session; everything else is per row.
    ///
    /// Batch invariance: every product computes each row by the same operations whatever
    /// the other rows (`kernels::matmul`'s contract), and nothing mixes rows, so each group's
    /// logits and its session afterwards are bit for bit those of a pass over that group
    /// alone, whatever shares the pass (design.md §3).
    ///
    /// Dead rows (issue 32): when some rows' logits are not wanted (a prompt pass that wants
    /// only its last row) and there is no `trace`, the LAST layer computes for those rows only
    /// what the caches and states keep (MLA: latent, `k_rope` and the expanded keys and
    /// values; KDA: its state and conv tails), and skips their attention output and
    /// everything after it ([`ForwardStats::rows_skipped`]). Each row is computed on its
    /// own (AttnRes mixes across depth, never across positions; k3-spec §4.1-§4.3), so the
    /// wanted rows are bit-identical either way. When every row is wanted nothing is
    /// skipped.
    ///
    /// An error (a token outside the vocabulary, a group without tokens, a tensor that does
    /// not bind) is the whole pass's; a hidden state that is not finite is its group's
    /// ([`BatchOutput::groups`]).
    pub fn forward_batch(
        &self,
        groups: &mut [Group<'_>],
        trace: Option<&mut Trace>,
    ) -> Result<BatchOutput, ForwardError> {
        let (d, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let PassLayout {
            rows,
            wants,
            starts,
            ntok,
            wanted,
        } = self.pass_layout(groups)?;
        // A trace records every row's intermediates: nothing is skipped then.
        let skip = trace.is_none() && wanted.len() < ntok;
        let ids: Vec<u32> = groups.iter().flat_map(|g| g.ids.iter().copied()).collect();
        let mut sessions: Vec<&mut Session> = groups.iter_mut().map(|g| &mut *g.session).collect();
        for s in sessions.iter_mut() {
            if s.kda.len() != self.n_layers {
                **s = self.new_session();
            }
        }
        let mut routes = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        let positions = row_positions(routes.is_some(), &sessions, &starts, ntok);
        let mut ctx = LayerCtx::new(self.threads, self.eps)
            .with_trace(trace)
            .with_routes(routes.as_mut());
        let mut stats = ForwardStats::default();
        let prof = crate::profile::begin_call();
        let mut h = self.embed(&ids)?;
        let mut bank: Vec<Vec<f32>> = Vec::new();
        // Each group's first non-finite hidden state, as its error.
        let mut spoiled: Vec<Option<ForwardError>> = (0..rows.len()).map(|_| None).collect();
        let group_of = |row: usize| starts.partition_point(|&s| s <= row) - 1;
        for l in 0..self.n_layers {
            ctx.trace_prefix(|| format!("L{l:02}."));
            let last = l + 1 == self.n_layers;
            let live = (skip && last).then_some(&wanted[..]);
            if let Some(log) = ctx.routes.as_deref_mut() {
                log.set_rows(l, &positions, live);
            }
            self.weights.begin_layer(l)?;
            let r = self.run_layer(&mut ctx, l, &mut sessions, &rows, &mut h, &mut bank, live);
            self.weights.end_layer(l);
            stats.absorb(r?);
            // `h` holds the live rows of the last layer, every row before.
            for (k, row) in h.chunks_exact(d).enumerate() {
                let Some(dim) = row.iter().position(|x| !x.is_finite()) else {
                    continue;
                };
                let r = live.map_or(k, |w| w[k]);
                let gi = group_of(r);
                if spoiled[gi].is_none() {
                    spoiled[gi] = Some(ForwardError::NonFinite(format!(
                        "layer {l} output is not finite: hidden state of token {} dim {dim} is {}",
                        sessions[gi].pos + (r - starts[gi]),
                        row[dim]
                    )));
                }
            }
            if spoiled.iter().all(Option::is_some) {
                // Nothing left to compute for.
                crate::profile::end_call(prof, ntok);
                return Ok(BatchOutput {
                    groups: spoiled
                        .into_iter()
                        .map(|e| Err(e.expect("spoiled")))
                        .collect(),
                    stats,
                });
            }
        }
        if skip {
            stats.rows_skipped = ntok - wanted.len();
            if self.cfg.is_moe(self.n_layers - 1) {
                stats.routes_skipped = stats.rows_skipped * self.cfg.num_experts_per_token;
            }
        }
        let logits = if wanted.is_empty() {
            // Passes that only carry their sessions on: no head, no logits.
            Vec::new()
        } else {
            ctx.trace_prefix(|| "final.".into());
            let head_span = crate::profile::span(crate::profile::Phase::Head);
            // Skipping, `h` holds exactly the wanted rows.
            let select = (!skip && wanted.len() < ntok).then_some(&wanted[..]);
            let logits = self.head_logits(&mut ctx, &bank, &h, select)?;
            head_span.end();
            ctx.record("logits", &logits);
            logits
        };
        crate::profile::end_call(prof, ntok);
        let mut next = 0;
        let mut out = Vec::with_capacity(rows.len());
        for (((s, &len), want), err) in sessions.into_iter().zip(&rows).zip(wants).zip(spoiled) {
            let n = match want {
                Want::All => len,
                Want::Last => 1,
                Want::None => 0,
            };
            let part = logits[next * vocab..(next + n) * vocab].to_vec();
            next += n;
            out.push(match err {
                Some(e) => Err(e),
                None => {
                    s.pos += len;
                    Ok(GroupOutput {
                        logits: part,
                        rows: n,
                    })
                }
            });
        }
        Ok(BatchOutput { groups: out, stats })
    }

    /// Check a pass's groups (at least one, each with tokens inside the vocabulary) and lay
    /// their rows out back to back.
    fn pass_layout(&self, groups: &[Group<'_>]) -> Result<PassLayout, ForwardError> {
        if groups.is_empty() {
            return Err(ForwardError::Input("no sessions to run".into()));
        }
        let vocab = self.cfg.vocab_size;
        for g in groups.iter() {
            if g.ids.is_empty() {
                return Err(ForwardError::Input("no tokens to run".into()));
            }
            if let Some(&bad) = g.ids.iter().find(|&&i| i as usize >= vocab) {
                return Err(ForwardError::Input(format!(
                    "token id {bad} is outside the vocabulary 0..{vocab}"
                )));
            }
        }
        let rows: Vec<usize> = groups.iter().map(|g| g.ids.len()).collect();
        let wants: Vec<Want> = groups.iter().map(|g| g.want).collect();
        let starts: Vec<usize> = rows
            .iter()
            .scan(0, |acc, &n| {
                let s = *acc;
                *acc += n;
                Some(s)
            })
            .collect();
        let ntok: usize = rows.iter().sum();
        // The rows whose logits are wanted, ascending.
        let wanted: Vec<usize> = groups
            .iter()
            .zip(&starts)
            .flat_map(|(g, &s)| match g.want {
                Want::All => s..s + g.ids.len(),
                Want::Last => s + g.ids.len() - 1..s + g.ids.len(),
                Want::None => s..s,
            })
            .collect();
        Ok(PassLayout {
            rows,
            wants,
            starts,
            ntok,
            wanted,
        })
    }

    /// The embedding rows of `ids` (`ntok × hidden`): read one row per token on demand
    /// where the weights can (staged compute never holds the embedding), else sliced from
    /// the tensor.
    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>, ForwardError> {
        let (ntok, d) = (ids.len(), self.cfg.hidden_size);
        let emb = self.embed_tensor()?;
        let mut h = Vec::with_capacity(ntok * d);
        let es = emb.dtype.size();
        let on_demand = self
            .weights
            .model_rows(&model_tensor("embed_tokens.weight"), ids)
            .transpose()?;
        for (k, &id) in ids.iter().enumerate() {
            let i = id as usize;
            let bytes = match &on_demand {
                Some((dt, b)) if *dt == emb.dtype && b.len() == ntok * d * es => {
                    &b[k * d * es..(k + 1) * d * es]
                }
                Some(_) => {
                    return Err(WeightError::Invalid {
                        name: model_tensor("embed_tokens.weight"),
                        msg: "on-demand rows differ from the tensor's dtype or size".into(),
                    }
                    .into())
                }
                None => &emb.bytes[i * d * es..(i + 1) * d * es],
            };
            let row = TensorRef {
                dtype: emb.dtype,
                shape: &[d],
                bytes,
            };
            let name = || format!("{} row {id}", model_tensor("embed_tokens.weight"));
            h.extend(to_f32_vec(&name(), &row)?);
        }
        Ok(h)
    }

    /// The model-level AttnRes mix of `bank` and the last layer's output `h` (rows of
    /// `hidden`), the final norm and the lm_head: the logits of the rows `select` (indices
    /// into `h`'s rows; None: every row), `rows × vocab`.
    fn head_logits(
        &self,
        ctx: &mut LayerCtx<'_>,
        bank: &[Vec<f32>],
        h: &[f32],
        select: Option<&[usize]>,
    ) -> Result<Vec<f32>, ForwardError> {
        let d = self.cfg.hidden_size;
        let ntok = h.len() / d;
        let fold = self.final_fold()?;
        let mixed = attnres_mix_rows(bank, h, &fold, ctx.eps.rms, ntok);
        ctx.record("mix", &mixed);
        let nw = self.vector(&model_tensor("norm.weight"), d)?;
        let normed = rmsnorm_rows(&mixed, &nw, ctx.eps.rms, d);
        ctx.record("norm", &normed);
        match select {
            None => self.lm_head(&normed, ntok, ctx.threads),
            Some(rows) => {
                let src = gather_rows(&normed, rows, d);
                self.lm_head(&src, rows.len(), ctx.threads)
            }
        }
    }

    /// The lm_head over `rows` normed rows `src`: whole, or streamed in row chunks (every
    /// logit is one dot product, the same bits either way).
    fn lm_head(&self, src: &[f32], rows: usize, threads: usize) -> Result<Vec<f32>, ForwardError> {
        let (d, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let mut logits = vec![0f32; rows * vocab];
        let mut chunk_out = Vec::new();
        let chunked = self.weights.matrix_chunks(LM_HEAD, &mut |r0, t| {
            let n = t.shape.first().copied().unwrap_or(0);
            if r0 + n > vocab {
                return Err(WeightError::Invalid {
                    name: LM_HEAD.into(),
                    msg: format!("chunk rows {r0}..{} past the vocabulary {vocab}", r0 + n),
                });
            }
            let m = mat_from(LM_HEAD, t, n, d)?;
            chunk_out.clear();
            chunk_out.resize(rows * n, 0f32);
            gemm(&m, src, &mut chunk_out, rows, threads);
            for r in 0..rows {
                logits[r * vocab + r0..r * vocab + r0 + n]
                    .copy_from_slice(&chunk_out[r * n..(r + 1) * n]);
            }
            Ok(())
        });
        match chunked {
            Some(r) => r?,
            None => {
                let head = self.head()?;
                gemm(&head, src, &mut logits, rows, threads);
            }
        }
        Ok(logits)
    }

    /// Run decoder layer `l` alone over `ntok` tokens: `h` (`ntok × hidden`) is the layer
    /// input and becomes its output; `bank` holds the AttnRes snapshots (each
    /// `ntok × hidden`, oldest first) and is appended to at a block boundary. Brackets the
    /// layer with `begin_layer`/`end_layer`. (Layer-level tests and staged drivers.)
    pub fn forward_layer(
        &self,
        l: usize,
        sess: &mut Session,
        h: &mut Vec<f32>,
        bank: &mut Vec<Vec<f32>>,
        ntok: usize,
    ) -> Result<ForwardStats, ForwardError> {
        if l >= self.n_layers {
            return Err(ForwardError::Input(format!(
                "layer {l} is not bound (0..{})",
                self.n_layers
            )));
        }
        if h.len() != ntok * self.cfg.hidden_size || bank.iter().any(|b| b.len() != h.len()) {
            return Err(ForwardError::Input(
                "forward_layer: activation sizes do not match".into(),
            ));
        }
        if sess.kda.len() != self.n_layers {
            *sess = self.new_session();
        }
        let mut ctx = LayerCtx::new(self.threads, self.eps);
        self.weights.begin_layer(l)?;
        let r = self.run_layer(&mut ctx, l, &mut [sess], &[ntok], h, bank, None);
        self.weights.end_layer(l);
        r
    }

    /// Decoder layer `l` over the rows of a pass (k3-spec §4.2; the numbers are its
    /// steps): `rows[i]` consecutive tokens of `sessions[i]`, back to back. `h` is the layer
    /// input and becomes its output, `bank` the AttnRes snapshots. `live` (ascending row
    /// indices; None: every row) names the rows whose output is read afterwards: the others
    /// only carry their sessions on (their attention output and everything after it are
    /// skipped), and `h` and `bank` come back holding the live rows only. Each use phase's
    /// tensors are bound when it starts and released when it ends (`Weights::end_phase`),
    /// so a trunk streamed in parts holds one phase at a time. Returns the layer's expert
    /// counters.
    #[allow(clippy::too_many_arguments)]
    fn run_layer(
        &self,
        ctx: &mut LayerCtx<'_>,
        l: usize,
        sessions: &mut [&mut Session],
        rows: &[usize],
        h: &mut Vec<f32>,
        bank: &mut Vec<Vec<f32>>,
        live: Option<&[usize]>,
    ) -> Result<ForwardStats, ForwardError> {
        ctx.record("in", h);
        let mut p = self.attention_block(ctx, l, sessions, rows, h, bank, live)?;
        let nout = p.len() / self.cfg.hidden_size;
        let (z, stats) = if nout > 0 {
            self.ffn_block(ctx, l, bank, &p, nout)?
        } else {
            (Vec::new(), ForwardStats::default())
        };
        ctx.record("ffn_out", &z);
        // (10)
        p.iter_mut().zip(&z).for_each(|(a, b)| *a += b);
        ctx.record("out", &p);
        *h = p;
        Ok(stats)
    }

    /// Steps (2)-(6) of layer `l`: the pre-attention mix, the block boundary (`h`, the RAW
    /// layer input, is banked there and the prefix restarts), `input_layernorm`, the
    /// attention (each group on its own session) and its output projection, accumulated
    /// into the prefix. `h` is taken; returns the prefix of the `live` rows (every row when
    /// None), and leaves only their rows in `bank`.
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        ctx: &mut LayerCtx<'_>,
        l: usize,
        sessions: &mut [&mut Session],
        rows: &[usize],
        h: &mut Vec<f32>,
        bank: &mut Vec<Vec<f32>>,
        live: Option<&[usize]>,
    ) -> Result<Vec<f32>, ForwardError> {
        let (d, eps) = (self.cfg.hidden_size, ctx.eps);
        let ntok: usize = rows.iter().sum();
        let w = self.bind_attn(l)?;
        // (2) pre-attention mix, guarded on an empty bank.
        let a = if bank.is_empty() {
            h.clone()
        } else {
            attnres_mix_rows(bank, h, &w.attn_fold, eps.rms, ntok)
        };
        ctx.record("attn_mix", &a);
        // (3) block boundary: bank the RAW layer input, restart the prefix.
        let boundary = self.cfg.is_attn_res_boundary(l);
        let mut p = std::mem::take(h);
        if boundary {
            bank.push(std::mem::take(&mut p));
        }
        // (4-5) attention.
        let u = rmsnorm_rows(&a, &w.in_norm, eps.rms, d);
        let attn_span = crate::profile::span(crate::profile::Phase::Attn);
        let a = match &w.attn {
            Attn::Kda(kw) => {
                let g = self.kda_geometry();
                let mut segs: Vec<Seg<'_, KdaState>> = sessions
                    .iter_mut()
                    .zip(rows)
                    .map(|(s, &n)| Seg {
                        rows: n,
                        state: s.kda[l].get_or_insert_with(|| KdaState::new(&g)),
                    })
                    .collect();
                kw.attend_groups(ctx, &g, &u, &mut segs, live)
            }
            Attn::Mla(mw) => {
                let g = self.mla_geometry();
                let mut segs: Vec<Seg<'_, MlaCache>> = sessions
                    .iter_mut()
                    .zip(rows)
                    .map(|(s, &n)| Seg {
                        rows: n,
                        state: s.mla[l].get_or_insert_with(MlaCache::default),
                    })
                    .collect();
                mw.attend_groups(ctx, &g, &u, &mut segs, live)
            }
        };
        attn_span.end();
        drop(w);
        self.weights.end_phase(l);
        let nout = live.map_or(ntok, |r| r.len());
        // Only the live rows go on: the prefix and the bank keep theirs.
        if let Some(keep) = live {
            if !p.is_empty() {
                p = gather_rows(&p, keep, d);
            }
            for b in bank.iter_mut() {
                *b = gather_rows(b, keep, d);
            }
        }
        if nout == 0 {
            // Nothing is read from this layer's output: no output projection.
            return Ok(p);
        }
        // The output projection is its own phase, bound once the rest is given back (its
        // bind may wait for the trunk: its own profile phase).
        let o = self.attn_out(l)?;
        let attn_span = crate::profile::span(crate::profile::Phase::Attn);
        let y = project_out(&o, &a, d, nout, ctx.threads);
        attn_span.end();
        self.weights.end_phase(l);
        ctx.record("attn_out", &y);
        // (6) accumulate.
        if p.is_empty() {
            p = y;
        } else {
            p.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
        }
        Ok(p)
    }

    /// Steps (7)-(9) of layer `l`: the pre-MLP mix of `bank` and the prefix `p`
    /// (unguarded), `post_attention_layernorm` and the FFN (dense or latent MoE). Returns
    /// the FFN's output and the layer's expert counters.
    fn ffn_block(
        &self,
        ctx: &mut LayerCtx<'_>,
        l: usize,
        bank: &[Vec<f32>],
        p: &[f32],
        ntok: usize,
    ) -> Result<(Vec<f32>, ForwardStats), ForwardError> {
        let (d, eps) = (self.cfg.hidden_size, ctx.eps);
        // (7-8) pre-MLP mix, unguarded.
        let w = self.bind_ffn_in(l)?;
        let m = attnres_mix_rows(bank, p, &w.mlp_fold, eps.rms, ntok);
        ctx.record("mlp_mix", &m);
        let v = rmsnorm_rows(&m, &w.post_norm, eps.rms, d);
        // (9) FFN.
        match &w.ffn {
            FfnIn::Dense { gate } => Ok((
                self.dense_ffn(ctx, l, gate, &v, ntok)?,
                ForwardStats::default(),
            )),
            FfnIn::Moe(mw) => self.moe_ffn(ctx, l, mw, &v, ntok),
        }
    }

    /// A dense FFN over `v` (post-norm rows), given its bound `gate`: glu_mlp's products,
    /// gate and up, then the down projection of the SiTU. Gate and up are fused (one pass
    /// over `v`) when the layer is bound whole; a trunk in parts gives each phase back
    /// before the next is bound. Either way each product is bit-identical (`gemm_fused`'s
    /// contract).
    fn dense_ffn(
        &self,
        ctx: &LayerCtx<'_>,
        l: usize,
        gate: &Mat<'_>,
        v: &[f32],
        ntok: usize,
    ) -> Result<Vec<f32>, ForwardError> {
        let th = ctx.threads;
        let dense = crate::profile::span(crate::profile::Phase::Dense);
        let f = gate.rows;
        let mut g = vec![0f32; ntok * f];
        let mut u = vec![0f32; ntok * f];
        if self.weights.in_parts(l) {
            gemm(gate, v, &mut g, ntok, th);
            // `gate` (with the mix and the norm) is not read again from here on.
            self.weights.end_phase(l);
            // Binding `up` or `down` may wait for the trunk (its own profile phase).
            dense.end();
            let up = self.dense_up(l)?;
            let _dense = crate::profile::span(crate::profile::Phase::Dense);
            gemm(&up, v, &mut u, ntok, th);
            self.weights.end_phase(l);
        } else {
            let up = self.dense_up(l)?;
            gemm_fused(&[gate, &up], v, &mut [&mut g, &mut u], ntok, th);
            self.weights.end_phase(l);
            dense.end();
        }
        let down = self.dense_down(l)?;
        let _dense = crate::profile::span(crate::profile::Phase::Dense);
        Ok(glu_down64(&g, &u, &down, self.situ(), ntok, th)
            .into_iter()
            .map(|x| x as f32)
            .collect())
    }

    /// The latent MoE of layer `l` over `v` (post-norm rows), given its bound head: its
    /// output and the layer's expert counters (failures named with the layer).
    fn moe_ffn(
        &self,
        ctx: &mut LayerCtx<'_>,
        l: usize,
        head: &MoeHead<'_>,
        v: &[f32],
        ntok: usize,
    ) -> Result<(Vec<f32>, ForwardStats), ForwardError> {
        let mut fetch = |ids: &[u32], deliver: &mut dyn for<'b> FnMut(Delivery<'b>)| {
            self.weights.experts(l, ids, deliver)
        };
        // The expert reads start when the router has chosen (before the shared experts are
        // computed), so they overlap that compute; the head's part is given back before the
        // routed experts (a streamed trunk reads its next part meanwhile) and the tail bound
        // after them.
        let threads = ctx.threads;
        let mut hooks = MoeHooks {
            announce: &mut |ids: &[u32]| {
                self.weights.announce_experts(l, ids);
                self.guess_next(l, head, v, ntok, threads);
            },
            fetch: &mut fetch,
            release_head: &mut || self.weights.end_phase(l),
            tail: &mut || self.moe_tail(l),
            checks: &self.scale_checks,
        };
        let (z, ms) = head.forward_phased(ctx, &self.moe_params(l), v, ntok, &mut hooks)?;
        let stats = ForwardStats {
            expert_requests: ms.requests,
            expert_failures: ms.failures,
            failure_msgs: ms
                .failure_msgs
                .into_iter()
                .map(|m| format!("layer {l}: {m}"))
                .collect(),
            ..ForwardStats::default()
        };
        Ok((z, stats))
    }
}

impl<W: Weights> Model<W> {
    /// `--speculate on` (`crate::predict`): keep layer `l`'s router, and guess layer
    /// `l + 1`'s experts from this layer's MoE input `v` for the expert reader.
    fn guess_next(&self, l: usize, head: &MoeHead<'_>, v: &[f32], ntok: usize, threads: usize) {
        let Some(pr) = self.weights.predictor() else {
            return;
        };
        pr.learn(l, head);
        if l + 1 < self.n_layers {
            if let Some(ids) = pr.guess(&self.moe_params(l + 1), v, ntok, threads) {
                self.weights.guess_experts(l + 1, &ids);
            }
        }
    }
}

/// RMSNorm of each `d`-wide row of `x` with the weight `w`.
fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (x, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        norm::rmsnorm(x, Some(w), eps, o);
    }
    out
}

// One of each per layer, bound in place and dropped at the end of its phase (never moved
// in a loop): boxing the larger variant would only add an allocation per layer.
#[allow(clippy::large_enum_variant)]
enum Attn<'a> {
    Kda(KdaWeights<'a>),
    Mla(MlaWeights<'a>),
}

// As `Attn`: one per layer, bound in place.
#[allow(clippy::large_enum_variant)]
enum FfnIn<'a> {
    /// A dense FFN's gate (its up- and down-projections are phases 3 and 4).
    Dense {
        gate: Mat<'a>,
    },
    Moe(MoeHead<'a>),
}

struct AttnW<'a> {
    attn_fold: Vec<f32>,
    in_norm: Vec<f32>,
    attn: Attn<'a>,
}

struct FfnW<'a> {
    mlp_fold: Vec<f32>,
    post_norm: Vec<f32>,
    ffn: FfnIn<'a>,
}
