//! Several requests decoding together (issue 33, the compute side): the [`Scheduler`].
//!
//! The scheduler keeps up to `slots` requests, each in its own slot with its own
//! [`Session`] (KV cache and KDA state), and a bounded queue of requests waiting for a
//! slot. Each [`Scheduler::step`] builds ONE forward pass ([`Model::forward_batch`]):
//!
//! - one decode row per slot that is decoding (its last sampled id);
//! - at most `chunk` prompt tokens of the slots still prefilling, oldest admission first
//!   (chunked prefill interleaved with the others' decode steps, so a long prompt never
//!   holds the other slots up for more than one pass);
//!
//! runs it, samples every slot whose row produced logits (each with its own sampler config,
//! seed and step count: a seeded request draws what it draws alone), and reports per-request
//! [`Event`]s. A request submitted between passes takes a free slot at the start of the
//! next one; a request that finishes (its length, a stop id), is cancelled or fails frees
//! its slot at once (the next pass can give it to a queued request).
//!
//! Batch invariance: a request's ids and logits are bit for bit those of the same request
//! run alone through [`crate::decode::decode_loop`] (incremental, any prefill chunk),
//! whatever shares its passes and whenever it started (`Model::forward_batch`'s contract;
//! `tests/batch_invariance.rs` proves it on both tiny models and every SIMD path).
//!
//! Prefix reuse: the scheduler keeps a [`PrefixCache`] (`prefix_entries` states; a caller
//! bounds their bytes too through [`Scheduler::prefix_cache`]). A request whose prompt
//! extends a kept state starts from a clone of it ([`Event::Started`] reports
//! `cached_tokens`), and a request that ends by its length or a stop id, with every routed
//! expert of every pass it was in loaded, is kept under the tokens its session consumed
//! (the prompt and every generated id but the last); so is its state at
//! [`Request::snapshot_at`] (a chat's history, which the next turn extends).
//! [`Scheduler::prefix_cache`] gives the cache to a caller that loads saved states.
//!
//! Bounds (nothing grows without one): `slots` sessions, each at most `ctx` tokens (a
//! request with `prompt + max_tokens > ctx` is refused up front; its slot's KV room is
//! reserved for `prompt + max_tokens` positions when it starts, so it never grows past
//! them); `max_queue` waiting
//! requests (a full queue refuses with [`Refused::QueueFull`]); `prefix_entries` kept
//! states; a pass holds at most `slots - 1 + chunk` rows; a step's events are at most a few
//! per request touched; a slot's logits rows are only kept when its request asks
//! ([`Request::keep_logits`]), one row per event.
//!
//! The scheduler is transport-independent and single-threaded: the serve loop (or the CLI)
//! owns it, submits what arrives between steps, and forwards the events. Only the
//! [`Request::cancel`] flag is meant to be set from another thread (a client that went
//! away).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::decode::{check_finite, PrefixCache};
use crate::forward::{ForwardError, ForwardStats, Group, GroupOutput, Model, Session, Want};
use crate::sampler::{self, SamplerConfig};
use crate::weights::Weights;

/// A request's number, given by [`Scheduler::submit`] (increasing from 0).
pub type RequestId = u64;

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// The prompt's ids (at least one, each inside the vocabulary).
    pub prompt: Vec<u32>,
    /// Ids to generate at most (0: the request finishes at once, reason `Length`).
    pub max_tokens: usize,
    /// Greedy or seeded sampling; step `i` of this request draws with step number `i`.
    pub sampler: SamplerConfig,
    /// Generation ends after one of these ids (which is kept in the output).
    pub stop_ids: Vec<u32>,
    /// Set it (from any thread) to cancel: the request ends at the next pass boundary with
    /// [`FinishReason::Cancelled`] and frees its slot.
    pub cancel: Arc<AtomicBool>,
    /// Give every step's logits row with its token ([`Event::Token::logits`]): a debug
    /// endpoint, `--dump-logits`, the invariance tests.
    pub keep_logits: bool,
    /// Also keep the state after this many prompt tokens for prefix reuse (the end of a
    /// chat's last complete message: the next turn starts there), when it lies past the
    /// kept prefix and inside the prompt: the prompt's chunks stop there once. Changes no
    /// result (a prompt fed in any chunks gives the same bits).
    pub snapshot_at: Option<usize>,
}

impl Request {
    /// A greedy request of `max_tokens` after `prompt`, without stop ids.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
        Request {
            prompt,
            max_tokens,
            sampler: SamplerConfig::default(),
            stop_ids: Vec::new(),
            cancel: Arc::new(AtomicBool::new(false)),
            keep_logits: false,
            snapshot_at: None,
        }
    }
}

/// The scheduler's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerOptions {
    /// Requests decoding together (at least 1; 1 runs them one after another).
    pub slots: usize,
    /// Requests waiting for a slot, at most (0: a request needs a free slot now).
    pub max_queue: usize,
    /// Prompt tokens per pass, over every slot still prefilling (at least 1).
    pub chunk: usize,
    /// Tokens per slot: a request needs `prompt + max_tokens <= ctx`.
    pub ctx: usize,
    /// Session states kept for prefix reuse (0: none).
    pub prefix_entries: usize,
}

impl Default for SchedulerOptions {
    /// 4 slots, a queue of 64, 64-token prompt chunks, 4,096 tokens per slot, no prefix
    /// states kept.
    fn default() -> Self {
        SchedulerOptions {
            slots: 4,
            max_queue: 64,
            chunk: 64,
            ctx: 4096,
            prefix_entries: 0,
        }
    }
}

/// Why [`Scheduler::submit`] refused a request (nothing of it was kept).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refused {
    /// Every slot is busy and the queue holds `max_queue` requests (serve: 429 with
    /// Retry-After).
    #[error("the queue is full ({0} requests wait for a slot)")]
    QueueFull(usize),
    /// The request cannot run (serve: 400): an empty prompt, an id outside the vocabulary,
    /// or more tokens than a slot holds.
    #[error("{0}")]
    Invalid(String),
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` ids were generated.
    Length,
    /// The last id generated is one of its stop ids.
    Stop,
    /// Its cancel flag was set (or [`Scheduler::cancel`] called).
    Cancelled,
}

/// What happened to a request in a step, in the order it happened.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// It took slot `slot`; the first `cached_tokens` prompt tokens came from a kept state.
    Started {
        id: RequestId,
        slot: usize,
        cached_tokens: usize,
    },
    /// A pass fed its prompt up to `done` of `total` tokens without finishing it.
    Prefill {
        id: RequestId,
        done: usize,
        total: usize,
    },
    /// Its `index`-th generated id (0-based), with the logits row it was drawn from when the
    /// request keeps them.
    Token {
        id: RequestId,
        index: usize,
        token: u32,
        logits: Option<Vec<f32>>,
    },
    /// It ended; its slot is free (a request cancelled while queued ends without a
    /// `Started`). `generated` is every id it generated; `expert_failures`
    /// counts the routed experts that failed to load in the passes it was in (each such
    /// pass is counted against every request in it: a run with any is unsound, exit 4).
    Finished {
        id: RequestId,
        reason: FinishReason,
        generated: Vec<u32>,
        expert_failures: usize,
    },
    /// It failed (its hidden state or logits were not finite, or its pass failed as a
    /// whole); its slot is free.
    Failed { id: RequestId, error: String },
}

/// What one [`Scheduler::step`] did.
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    pub events: Vec<Event>,
    /// Rows in the pass (0: nothing to run, no pass): decode rows plus prompt rows.
    pub rows: usize,
    pub decode_rows: usize,
    pub prefill_rows: usize,
    /// The pass's counters (expert requests are the union over its rows).
    pub stats: ForwardStats,
    /// The pass failed as a whole (a tensor did not bind, a link failed): every request in
    /// it got [`Event::Failed`] and its slot is free. The caller decides whether the engine
    /// is still sound (a staged run restarts its stages).
    pub error: Option<String>,
}

/// A request in a slot.
struct Slot {
    id: RequestId,
    req: Request,
    session: Session,
    /// Admission number (prefill order: oldest first).
    order: u64,
    /// Prompt tokens the session has consumed (kept prefix included).
    fed: usize,
    /// The prompt then every generated id (the repetition penalty's history).
    seq: Vec<u32>,
    expert_failures: usize,
}

impl Slot {
    fn generated(&self) -> &[u32] {
        &self.seq[self.req.prompt.len()..]
    }
    fn prefilling(&self) -> bool {
        self.fed < self.req.prompt.len()
    }
    /// Where the prompt's state is kept on the way (inside the prompt, past what was
    /// reused).
    fn snapshot(&self) -> Option<usize> {
        self.req
            .snapshot_at
            .filter(|&b| b > 0 && b < self.req.prompt.len())
    }
}

/// A slot whose prompt has just reached its snapshot point, in passes whose experts all
/// loaded, leaves a copy of its state there.
fn keep_snapshot(s: &Slot, cache: &mut PrefixCache) {
    if s.snapshot() == Some(s.fed) && s.expert_failures == 0 && cache.cap > 0 {
        cache.insert(s.req.prompt[..s.fed].to_vec(), s.session.clone());
    }
}

/// N requests decoding together over one model (the module doc).
pub struct Scheduler {
    opts: SchedulerOptions,
    vocab: usize,
    next_id: RequestId,
    next_order: u64,
    queue: VecDeque<(RequestId, Request)>,
    slots: Vec<Option<Slot>>,
    cache: PrefixCache,
}

/// [`SchedulerOptions`] without a slot, a prompt chunk or a context.
#[derive(Clone, Copy, Debug, thiserror::Error)]
#[error(
    "the scheduler needs at least one slot, a prompt chunk of at least one token and a context \
     of at least one token (slots {}, chunk {}, ctx {})",
    .0.slots,
    .0.chunk,
    .0.ctx
)]
pub struct BadOptions(pub SchedulerOptions);

impl Scheduler {
    /// A scheduler for `model`'s requests (its vocabulary checks their ids); refuses
    /// options without a slot, a chunk or a context.
    pub fn new<W: Weights>(model: &Model<W>, opts: SchedulerOptions) -> Result<Self, BadOptions> {
        if opts.slots == 0 || opts.chunk == 0 || opts.ctx == 0 {
            return Err(BadOptions(opts));
        }
        Ok(Scheduler {
            vocab: model.vocab(),
            next_id: 0,
            next_order: 0,
            queue: VecDeque::new(),
            slots: (0..opts.slots).map(|_| None).collect(),
            cache: PrefixCache::new(opts.prefix_entries),
            opts,
        })
    }

    pub fn options(&self) -> SchedulerOptions {
        self.opts
    }

    /// Queue `req`; it takes a slot at the start of a coming step. Refused (and dropped)
    /// when it cannot run or the queue is full.
    pub fn submit(&mut self, req: Request) -> Result<RequestId, Refused> {
        if req.prompt.is_empty() {
            return Err(Refused::Invalid("the prompt holds no token".into()));
        }
        if let Some(&bad) = req.prompt.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(Refused::Invalid(format!(
                "token id {bad} is outside the vocabulary 0..{}",
                self.vocab
            )));
        }
        let need = req.prompt.len().saturating_add(req.max_tokens);
        if need > self.opts.ctx {
            return Err(Refused::Invalid(format!(
                "{} prompt tokens and {} to generate need {need} tokens; a slot holds {}",
                req.prompt.len(),
                req.max_tokens,
                self.opts.ctx
            )));
        }
        let free = self.slots.iter().filter(|s| s.is_none()).count();
        if self.queue.len() >= self.opts.max_queue + free {
            return Err(Refused::QueueFull(self.queue.len()));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.queue.push_back((id, req));
        Ok(id)
    }

    /// Cancel request `id` (queued or in a slot): it ends at the next step. False when no
    /// such request is waiting or running.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let flag = self
            .queue
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, r)| &r.cancel)
            .or_else(|| {
                self.slots
                    .iter()
                    .flatten()
                    .find(|s| s.id == id)
                    .map(|s| &s.req.cancel)
            });
        match flag {
            Some(f) => {
                f.store(true, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Slots holding a request.
    pub fn busy(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Nothing running and nothing waiting.
    pub fn is_idle(&self) -> bool {
        self.busy() == 0 && self.queue.is_empty()
    }

    /// Bytes of KV cache and KDA state the slots' sessions hold now.
    pub fn state_bytes(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .map(|s| s.session.kv_bytes() + s.session.kda_bytes())
            .sum()
    }

    /// The kept prefix states (a caller that loads saved states puts them here).
    pub fn prefix_cache(&mut self) -> &mut PrefixCache {
        &mut self.cache
    }

    /// One pass: end what was cancelled, admit queued requests into free slots, run one
    /// decode row per decoding slot and up to `chunk` prompt tokens of the prefilling ones,
    /// sample, and report. Does nothing (no pass, `rows` 0) when no slot has work.
    pub fn step<W: Weights>(&mut self, model: &Model<W>) -> StepReport {
        let mut rep = StepReport::default();
        self.end_cancelled(&mut rep.events);
        self.admit(model, &mut rep.events);
        let plan = self.plan_pass(&mut rep);
        if plan.is_empty() {
            return rep;
        }
        let mut groups = Vec::with_capacity(plan.len());
        {
            // Each planned slot once: borrow them all, in plan order.
            let mut by_slot: Vec<Option<&mut Slot>> =
                self.slots.iter_mut().map(|s| s.as_mut()).collect();
            for &(i, fed, n) in &plan {
                let s = by_slot[i].take().expect("each slot planned once");
                let (ids, want) = if s.fed < s.req.prompt.len() {
                    let end = fed + n;
                    let want = if end == s.req.prompt.len() {
                        Want::Last
                    } else {
                        Want::None
                    };
                    (&s.req.prompt[fed..end], want)
                } else {
                    (&s.seq[s.seq.len() - 1..], Want::Last)
                };
                groups.push(Group {
                    session: &mut s.session,
                    ids,
                    want,
                });
            }
        }
        let out = model.forward_batch(&mut groups, None);
        drop(groups);
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                let msg = format!("forward pass failed: {e}");
                for &(i, _, _) in &plan {
                    let s = self.slots[i].take().expect("a planned slot");
                    rep.events.push(Event::Failed {
                        id: s.id,
                        error: msg.clone(),
                    });
                }
                rep.error = Some(msg);
                return rep;
            }
        };
        let failures = out.stats.expert_failures;
        rep.stats = out.stats;
        for (&(i, _, n), res) in plan.iter().zip(out.groups) {
            self.slots[i]
                .as_mut()
                .expect("a planned slot")
                .expert_failures += failures;
            self.take_group(i, n, res, &mut rep.events);
        }
        rep
    }

    /// The pass: (slot, first prompt token fed, tokens) per group, decode rows first, then
    /// up to `chunk` prompt tokens of the prefilling slots, oldest admission first (a
    /// chunk stops at its slot's snapshot point); the row counts go in `rep`.
    fn plan_pass(&self, rep: &mut StepReport) -> Vec<(usize, usize, usize)> {
        let mut plan: Vec<(usize, usize, usize)> = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(s) = s.as_ref().filter(|s| !s.prefilling()) {
                plan.push((i, s.fed, 1));
            }
        }
        rep.decode_rows = plan.len();
        let mut prefilling: Vec<(u64, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().filter(|s| s.prefilling()).map(|s| (s.order, i)))
            .collect();
        prefilling.sort_unstable();
        let mut budget = self.opts.chunk;
        for (_, i) in prefilling {
            if budget == 0 {
                break;
            }
            let s = self.slots[i].as_ref().expect("a prefilling slot");
            let mut n = budget.min(s.req.prompt.len() - s.fed);
            if let Some(b) = s.snapshot().filter(|&b| b > s.fed) {
                n = n.min(b - s.fed);
            }
            plan.push((i, s.fed, n));
            budget -= n;
            rep.prefill_rows += n;
        }
        rep.rows = rep.decode_rows + rep.prefill_rows;
        plan
    }

    /// Take slot `i`'s part of the pass (`n` rows fed): fail it, count its prefill, or
    /// sample its next token and finish it on a stop id or its length.
    fn take_group(
        &mut self,
        i: usize,
        n: usize,
        res: Result<GroupOutput, ForwardError>,
        events: &mut Vec<Event>,
    ) {
        let s = self.slots[i].as_mut().expect("a planned slot");
        let g = match res {
            Ok(g) => g,
            Err(e) => {
                let s = self.slots[i].take().expect("a planned slot");
                events.push(Event::Failed {
                    id: s.id,
                    error: format!("forward pass failed: {e}"),
                });
                return;
            }
        };
        if s.prefilling() {
            s.fed += n;
            keep_snapshot(s, &mut self.cache);
            if g.rows == 0 {
                events.push(Event::Prefill {
                    id: s.id,
                    done: s.fed,
                    total: s.req.prompt.len(),
                });
                return;
            }
        }
        let row = &g.logits[..];
        if let Err(e) = check_finite(row) {
            let s = self.slots[i].take().expect("a planned slot");
            events.push(Event::Failed {
                id: s.id,
                error: format!("generation step {}: {e}", s.generated().len()),
            });
            return;
        }
        let index = s.generated().len();
        let token =
            sampler::sample(row, &s.req.sampler, index as u64, &s.seq, s.generated()) as u32;
        s.seq.push(token);
        events.push(Event::Token {
            id: s.id,
            index,
            token,
            logits: s.req.keep_logits.then(|| row.to_vec()),
        });
        let reason = if s.req.stop_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if index + 1 >= s.req.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        if let Some(reason) = reason {
            self.finish(i, reason, events);
        }
    }

    /// End every cancelled request, queued or in a slot.
    fn end_cancelled(&mut self, events: &mut Vec<Event>) {
        let cancelled = |r: &Request| r.cancel.load(Ordering::Relaxed);
        let mut kept = VecDeque::with_capacity(self.queue.len());
        for (id, r) in self.queue.drain(..) {
            if cancelled(&r) {
                events.push(Event::Finished {
                    id,
                    reason: FinishReason::Cancelled,
                    generated: Vec::new(),
                    expert_failures: 0,
                });
            } else {
                kept.push_back((id, r));
            }
        }
        self.queue = kept;
        for i in 0..self.slots.len() {
            if self.slots[i].as_ref().is_some_and(|s| cancelled(&s.req)) {
                self.finish(i, FinishReason::Cancelled, events);
            }
        }
    }

    /// Give free slots to queued requests, oldest first.
    fn admit<W: Weights>(&mut self, model: &Model<W>, events: &mut Vec<Event>) {
        while let Some(i) = self.slots.iter().position(Option::is_none) {
            let Some((id, req)) = self.queue.pop_front() else {
                break;
            };
            let (cached, mut session) = self
                .cache
                .lookup(&req.prompt)
                .unwrap_or_else(|| (0, model.new_session()));
            // The slot's KV room for the whole request, reserved now: it never grows past
            // what the request can use (at most `ctx` positions) by doubling.
            model.reserve_positions(&mut session, req.prompt.len() + req.max_tokens);
            events.push(Event::Started {
                id,
                slot: i,
                cached_tokens: cached,
            });
            let max_tokens = req.max_tokens;
            self.slots[i] = Some(Slot {
                id,
                seq: req.prompt.clone(),
                req,
                session,
                order: self.next_order,
                fed: cached,
                expert_failures: 0,
            });
            self.next_order += 1;
            if max_tokens == 0 {
                self.finish(i, FinishReason::Length, events);
            }
        }
    }

    /// End the request in slot `i` and free the slot; a request that ended by its length or
    /// a stop id, with every expert loaded, leaves its session in the prefix cache.
    fn finish(&mut self, i: usize, reason: FinishReason, events: &mut Vec<Event>) {
        let Some(mut s) = self.slots[i].take() else {
            return;
        };
        let generated = s.generated().to_vec();
        if reason != FinishReason::Cancelled
            && s.expert_failures == 0
            && !generated.is_empty()
            && self.cache.cap > 0
        {
            // The session consumed the prompt and every generated id but the last.
            s.seq.pop();
            self.cache.insert(s.seq, s.session);
        }
        events.push(Event::Finished {
            id: s.id,
            reason,
            generated,
            expert_failures: s.expert_failures,
        });
    }
}
