//! The layer-compute stage's process loop: configure, then run the one decode loop
//! ([`crate::decode::decode_resumed`]) over [`StagedWeights`], streaming each id to the
//! tokenizer and each step's statistics to the orchestrator. A warm stage (`serve`, `chat`:
//! `ComputeConf::warm`) runs the requests it is sent (`Generate` ... `RequestDone` on the
//! control socket) together on the same model through the batch
//! [`Scheduler`](crate::batch::Scheduler) (`ComputeConf::slots` of them at once, each with
//! its own session; continuous batching), keeping session states for prefix reuse, until
//! `Shutdown`; between passes it also writes and reads those states for `k3-orch chat`'s
//! `/save` and `/load` (`SaveState` / `LoadState`, answered by `StateDone`) and reads
//! `StopRequest` (a stop string, a client gone).
//!
//! Model-level tensors (embeddings, lm_head, final norms) are this stage's own (the
//! embedding read a row per token, the lm_head held or read in chunks: `crate::links`), so
//! its cgroup pays for them together with the KV cache, the recurrent state and the
//! scratch. The matrix products run on a rayon pool of `threads` workers built here,
//! inside this process (whose CPU affinity k3-orch has already set).

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k3_model::config::ModelConfig;
use k3_model::mmap_weights::MmapWeights;
use k3_protocol::conf::ComputeConf;
use k3_protocol::failure::StageFailure;
use k3_protocol::link::{send_to, Link, StageCtx};
use k3_protocol::messages::{GenRequest, Msg, PassStats, Stage, StepStats, TokenMsg};
use k3_protocol::shm::Region;

use crate::batch::{Event, Request, RequestId, Scheduler, SchedulerOptions};
use crate::decode::{decode_resumed, LoopOptions, Resume, Step, StepHooks};
use crate::error::{ComputeError, PeerError};
use crate::forward::{Model, ModelOptions};
use crate::links::{LoaderLinks, StagedWeights};
use crate::state::{Start, StateError};

/// Run the layer-compute stage until generation is finished.
pub fn run(mut ctx: StageCtx) -> Result<(), StageFailure> {
    ctx.wait_configure()?;
    let conf: ComputeConf =
        serde_json::from_str(&ctx.conf_json).map_err(|e| ctx.fail(ComputeError::Configure(e)))?;
    crate::kernels::tuning::install(conf.tuning);
    let pool = crate::pool::build(conf.threads).map_err(|e| ctx.fail(ComputeError::from(e)))?;
    ctx.ready()?;
    ctx.wait_go()?;
    tracing::debug!(
        threads = pool.current_num_threads(),
        "layer-compute: pool ready"
    );
    pool.install(|| run_configured(&mut ctx, &conf))
        .map_err(|e| ctx.fail(e))
}

fn region(ctx: &StageCtx, name: &'static str) -> Result<Arc<Region>, ComputeError> {
    let id = ctx.data.get(name).ok_or(ComputeError::NoRegion { name })?;
    ctx.regions
        .get(*id)
        .cloned()
        .ok_or(ComputeError::Unmapped { id: *id, name })
}

/// The staged mode's hooks: reset and read the link counters around each step, send the id
/// to the tokenizer and the statistics to the orchestrator, and end the request early when
/// the orchestrator says so (`StopRequest`: a stop string, a client gone; `Shutdown`).
struct Staged<'a> {
    ctx: &'a StageCtx,
    weights: &'a StagedWeights,
    tok: &'a mut Link,
    timeout: Option<Duration>,
    /// The request running (0 in a one-shot run).
    req: u64,
    stop: bool,
    /// Routed experts that failed to load in this request so far (a failure before the
    /// first step, in a snapshot's prefill, is reported with the first step).
    failures: u64,
}

impl Staged<'_> {
    /// Read what the orchestrator sent since the last step, without waiting.
    fn poll_control(&mut self) -> Result<(), PeerError> {
        loop {
            match self.ctx.control.recv(Some(Duration::ZERO)) {
                Ok((Msg::StopRequest { req }, _)) => {
                    if req == self.req {
                        self.stop = true;
                    }
                }
                Ok((Msg::Shutdown, _)) => self.stop = true,
                Ok((Msg::Ping { .. }, _)) => {}
                Ok((other, _)) => {
                    return Err(PeerError::Unexpected {
                        got: format!("{other:?}"),
                        when: "during a generation",
                    })
                }
                Err(k3_protocol::control::ControlError::Timeout) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

impl StepHooks for Staged<'_> {
    type Error = PeerError;

    fn prefill_pass(&mut self, done: usize, total: usize) {
        // A one-shot run's prompt (a warm stage's requests report no prefill progress).
        if self.req == 0 {
            self.ctx
                .progress("prefill-passes", done as u64, total as u64);
        }
    }

    fn before_step(&mut self, _step: usize) {
        let _ = self.weights.take_io();
    }

    fn after_forward(&mut self, _step: usize) -> Result<(), PeerError> {
        match self.weights.take_link_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn on_step(&mut self, s: Step<'_>) -> Result<(), PeerError> {
        let io = self.weights.take_io();
        // The first step also reports what `failures` holds from before it (a snapshot's
        // prefill).
        let own = s.out.stats.expert_failures as u64;
        let reported = if s.step == 0 {
            self.failures + own
        } else {
            own
        };
        self.failures += own;
        tracing::debug!(
            step = s.step,
            token = s.token,
            seconds = s.seconds,
            wait_seconds = io.wait_seconds,
            trunk_read_bytes = io.trunk_read_bytes,
            expert_read_bytes = io.expert_read_bytes,
            "layer-compute: step"
        );
        send_to(
            &mut **self.tok,
            Stage::LayerCompute,
            Stage::Tokenizer,
            &Msg::DecodeId { id: s.token },
            self.timeout,
        )?;
        self.ctx.send_control(&Msg::StepStats(StepStats {
            step: s.step as u32,
            token: s.token,
            seconds: s.seconds,
            trunk_read_bytes: io.trunk_read_bytes,
            expert_read_bytes: io.expert_read_bytes,
            expert_requests: io.expert_requests,
            resident_hits: io.resident_hits,
            expert_failures: reported,
            io_wait_seconds: io.wait_seconds,
        }))?;
        for m in &s.out.stats.failure_msgs {
            tracing::warn!("layer-compute: {m}");
        }
        self.poll_control()
    }

    fn done(&mut self) -> bool {
        self.stop
    }
}

/// The coded lm_head the conf streams from (None: raw, or the lm_head is not streamed),
/// with its copies; a trunk without one when the conf names it is refused (the plan counted
/// its bytes).
fn coded_head(
    conf: &ComputeConf,
) -> Result<Option<crate::model_stream::CodedHeadFile>, ComputeError> {
    let (Some(dir), Some(_)) = (&conf.lm_head_coded, conf.lm_head_chunk_bytes) else {
        return Ok(None);
    };
    match crate::model_stream::CodedHeadFile::of_trunk(dir, &conf.lm_head_coded_copies) {
        Ok(Some(c)) => Ok(Some(c)),
        Ok(None) => Err(ComputeError::ModelStream(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: the trunk has no coded lm_head", dir.display()),
        ))),
        Err(e) => Err(ComputeError::ModelStream(e)),
    }
}

/// Bind the links and the model, then run the one-shot generation, or (a warm stage) the
/// requests until `Shutdown`; then say `Finished`.
fn run_configured(ctx: &mut StageCtx, conf: &ComputeConf) -> Result<(), ComputeError> {
    let cfg = ModelConfig::load(&conf.config_path)?;
    let n_layers = conf
        .layers
        .unwrap_or(cfg.num_hidden_layers)
        .min(cfg.num_hidden_layers);
    let model_w = MmapWeights::open(&conf.model_dir)?;
    let links = LoaderLinks {
        trunk_region: region(ctx, "trunk")?,
        expert_region: region(ctx, "experts")?,
        trunk: ctx.take_link(Stage::TrunkLoader)?,
        fetch: ctx.take_link(Stage::ExpertFetcher)?,
    };
    let mut tok = ctx.take_link(Stage::Tokenizer)?;
    let timeout = Some(Duration::from_secs_f64(conf.io_timeout_s));
    let weights = StagedWeights::new(model_w, links, n_layers, timeout, ctx.rec.clone())
        .with_model_stream(
            conf.lm_head_chunk_bytes,
            conf.lm_head_held_bytes,
            coded_head(conf)?,
        )
        .map_err(ComputeError::ModelStream)?
        .with_speculation(conf.speculate);
    let model = Model::new(
        cfg,
        &weights,
        ModelOptions {
            threads: conf.threads.max(1),
            layers: conf.layers,
            eps: None,
        },
    )?;
    // One run's routes (a warm stage's requests are not one run: serve refuses the flag).
    if conf.record_routes.is_some() && !conf.warm {
        crate::routes::start(&model, &conf.config_path, &conf.model_dir)?;
    }
    let generated = if conf.warm {
        serve_requests(ctx, &model, &weights, &mut tok, timeout, conf)?;
        Vec::new()
    } else {
        let load = conf
            .load_state
            .as_deref()
            .map(|p| (p, conf.state_fingerprint.as_str()));
        let mut start = Start::new(&model, load, &conf.prompt_ids)?;
        let generated = decode_resumed(
            &model,
            &mut start.session,
            &Resume {
                history: &start.history,
                first_step: start.first_step,
            },
            &LoopOptions {
                prompt: &start.prompt,
                gen: conf.gen,
                incremental: conf.incremental,
                sampler: conf.sampler,
                stop_ids: &conf.stop_ids,
                dump_logits: conf.dump_logits.as_deref(),
                prefill_chunk: conf.prefill_chunk,
            },
            &mut Staged {
                ctx,
                weights: &weights,
                tok: &mut tok,
                timeout,
                req: 0,
                stop: false,
                failures: 0,
            },
        )?;
        if let Some(p) = &conf.save_state {
            start.save(p, &conf.state_fingerprint, &generated)?;
        }
        if let Some(p) = &conf.record_routes {
            crate::routes::finish(&model, p)?;
        }
        generated
    };
    drop(model);
    weights.shutdown()?;
    send_to(
        &mut *tok,
        Stage::LayerCompute,
        Stage::Tokenizer,
        &Msg::Shutdown,
        timeout,
    )?;
    ctx.send_control(&Msg::Finished { generated })?;
    Ok(ctx.finish_recording()?)
}

/// A warm stage (`serve`, `chat`): run the requests that arrive (`Generate` on the control
/// socket) together on the same model and links until `Shutdown`, through the
/// [`Scheduler`]: up to `conf.slots.slots` requests decode together, one row each per pass,
/// a new one joins at the next pass, prompts are fed in chunks interleaved with the others'
/// decode steps, and each request's ids are those it gets alone (batch invariance).
/// Between passes it reads what the orchestrator sent: new requests, `StopRequest` (a
/// stop string, a client gone: the request ends at the next pass and frees its slot),
/// `SaveState` / `LoadState`, `Shutdown` (every request ends, then the stage). Each pass
/// reports `RequestStarted`, `Token` (and `DecodeId` to the tokenizer, in the same order),
/// `RequestDone` or `RequestFailed` per request, and one `PassStats`. Session states are
/// kept for prefix reuse (bounded in entries and bytes). A pass that fails as a whole (a
/// link, a tensor) ends the stage with that error: the orchestrator restarts the stages.
fn serve_requests(
    ctx: &StageCtx,
    model: &Model<&StagedWeights>,
    weights: &StagedWeights,
    tok: &mut Link,
    timeout: Option<Duration>,
    conf: &ComputeConf,
) -> Result<(), ComputeError> {
    let w = conf.slots;
    let opts = SchedulerOptions {
        slots: w.slots.max(1),
        max_queue: w.max_queue,
        chunk: conf.prefill_chunk.unwrap_or(w.ctx).max(1),
        ctx: w.ctx.max(1),
        prefix_entries: 0,
    };
    let mut warm = WarmSlots {
        ctx,
        weights,
        tok,
        timeout,
        sched: Scheduler::new(model, opts).map_err(ComputeError::Slots)?,
        reqs: HashMap::new(),
        ids: HashMap::new(),
        shutdown: false,
    };
    warm.sched.prefix_cache().byte_cap = usize::try_from(w.prefix_bytes).unwrap_or(usize::MAX);
    tracing::debug!(?opts, "layer-compute: warm slots");
    loop {
        // Idle: wait for the next message; busy: read what came since the last pass.
        let mut wait = if warm.sched.is_idle() {
            None
        } else {
            Some(Duration::ZERO)
        };
        loop {
            match ctx.control.recv(wait) {
                Ok((m, _)) => warm.control(model, m)?,
                Err(k3_protocol::control::ControlError::Timeout) => break,
                Err(e) => return Err(e.into()),
            }
            wait = Some(Duration::ZERO);
        }
        if !warm.sched.is_idle() {
            warm.pass(model)?;
        }
        if warm.shutdown && warm.sched.is_idle() {
            return Ok(());
        }
    }
}

/// A request a warm stage holds.
struct Held {
    /// The orchestrator's number.
    req: u64,
    /// Routed experts that failed in its passes since its last token.
    failures: u64,
}

/// A warm stage's requests: the scheduler and what maps its requests to the
/// orchestrator's.
struct WarmSlots<'a> {
    ctx: &'a StageCtx,
    weights: &'a StagedWeights,
    tok: &'a mut Link,
    timeout: Option<Duration>,
    sched: Scheduler,
    /// By scheduler id.
    reqs: HashMap<RequestId, Held>,
    /// Scheduler id by the orchestrator's number.
    ids: HashMap<u64, RequestId>,
    /// `Shutdown` came: every request was cancelled; the stage ends once they are done.
    shutdown: bool,
}

impl WarmSlots<'_> {
    /// One message from the orchestrator.
    fn control(&mut self, model: &Model<&StagedWeights>, m: Msg) -> Result<(), ComputeError> {
        match m {
            Msg::Generate(r) => self.submit(r)?,
            Msg::StopRequest { req } => {
                // A stop for a request that has ended is ignored.
                if let Some(&id) = self.ids.get(&req) {
                    self.sched.cancel(id);
                }
            }
            Msg::SaveState {
                req,
                path,
                fingerprint,
                tokens,
            } => {
                let res =
                    crate::state::encode_prefix(self.sched.prefix_cache(), &tokens, &fingerprint)
                        .and_then(|(bytes, n)| {
                            k3_io::output::write_atomic(&path, &bytes)
                                .map(|()| n)
                                .map_err(|source| StateError::File {
                                    path: path.clone(),
                                    source,
                                })
                        });
                self.ctx.send_control(&state_done(req, res))?;
            }
            Msg::LoadState {
                req,
                path,
                fingerprint,
                tokens,
                cache_entries,
            } => {
                let res = crate::state::read(&path)
                    .and_then(|b| crate::state::decode_prefix(&b, &fingerprint, model, &tokens))
                    .map(|(key, sess)| {
                        let n = key.len();
                        let cache = self.sched.prefix_cache();
                        cache.cap = cache_entries as usize;
                        cache.insert(key, sess);
                        n
                    });
                self.ctx.send_control(&state_done(req, res))?;
            }
            Msg::Shutdown => {
                self.shutdown = true;
                let ids: Vec<RequestId> = self.reqs.keys().copied().collect();
                for id in ids {
                    self.sched.cancel(id);
                }
            }
            Msg::Ping { .. } => {}
            other => {
                return Err(PeerError::Unexpected {
                    got: format!("{other:?}"),
                    when: "on a warm stage",
                }
                .into())
            }
        }
        Ok(())
    }

    /// Queue a `Generate`; one the scheduler refuses fails at once (`RequestFailed`).
    fn submit(&mut self, r: GenRequest) -> Result<(), ComputeError> {
        if self.shutdown {
            return self
                .ctx
                .send_control(&Msg::RequestFailed {
                    req: r.req,
                    error: "the stage is shutting down".into(),
                })
                .map_err(Into::into);
        }
        self.sched.prefix_cache().cap = r.cache_entries as usize;
        let q = Request {
            prompt: r.prompt,
            max_tokens: r.gen as usize,
            sampler: r.sampler,
            stop_ids: r.stop_ids,
            cancel: Arc::new(AtomicBool::new(false)),
            keep_logits: r.keep_logits,
            snapshot_at: r.snapshot_at.map(|b| b as usize),
        };
        match self.sched.submit(q) {
            Ok(id) => {
                self.reqs.insert(
                    id,
                    Held {
                        req: r.req,
                        failures: 0,
                    },
                );
                self.ids.insert(r.req, id);
                Ok(())
            }
            Err(e) => self
                .ctx
                .send_control(&Msg::RequestFailed {
                    req: r.req,
                    error: e.to_string(),
                })
                .map_err(Into::into),
        }
    }

    /// One pass over the requests held, and its reports.
    fn pass(&mut self, model: &Model<&StagedWeights>) -> Result<(), ComputeError> {
        let _ = self.weights.take_io();
        let t0 = Instant::now();
        let rep = self.sched.step(model);
        let seconds = t0.elapsed().as_secs_f64();
        // A link failure is the cause of whatever the pass reports.
        if let Some(e) = self.weights.take_link_error() {
            return Err(e.into());
        }
        if let Some(e) = rep.error {
            return Err(ComputeError::Pass(e));
        }
        let io = self.weights.take_io();
        for m in &rep.stats.failure_msgs {
            tracing::warn!("layer-compute: {m}");
        }
        let pass_failures = rep.stats.expert_failures as u64;
        for ev in rep.events {
            match ev {
                Event::Started {
                    id, cached_tokens, ..
                } => {
                    let req = self.held(id)?.req;
                    self.ctx.send_control(&Msg::RequestStarted {
                        req,
                        cached_tokens: u32::try_from(cached_tokens).unwrap_or(u32::MAX),
                    })?;
                }
                Event::Prefill { id, .. } => self.held(id)?.failures += pass_failures,
                Event::Token {
                    id,
                    index,
                    token,
                    logits,
                } => {
                    let h = self.held(id)?;
                    let failures = std::mem::take(&mut h.failures) + pass_failures;
                    let req = h.req;
                    send_to(
                        &mut **self.tok,
                        Stage::LayerCompute,
                        Stage::Tokenizer,
                        &Msg::DecodeId { id: token },
                        self.timeout,
                    )?;
                    self.ctx.send_control(&Msg::Token(TokenMsg {
                        req,
                        index: u32::try_from(index).unwrap_or(u32::MAX),
                        token,
                        expert_failures: failures,
                        logits,
                    }))?;
                }
                Event::Finished { id, generated, .. } => {
                    let req = self.forget(id)?;
                    self.ctx
                        .send_control(&Msg::RequestDone { req, generated })?;
                }
                Event::Failed { id, error } => {
                    let req = self.forget(id)?;
                    self.ctx.send_control(&Msg::RequestFailed {
                        req,
                        error: format!("layer-compute: {error}"),
                    })?;
                }
            }
        }
        if rep.rows > 0 {
            let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
            self.ctx.send_control(&Msg::PassStats(PassStats {
                rows: n(rep.rows),
                decode_rows: n(rep.decode_rows),
                prefill_rows: n(rep.prefill_rows),
                busy: n(self.sched.busy()),
                queued: n(self.sched.queued()),
                seconds,
                trunk_read_bytes: io.trunk_read_bytes,
                expert_read_bytes: io.expert_read_bytes,
                expert_requests: io.expert_requests,
                resident_hits: io.resident_hits,
                expert_failures: pass_failures,
                io_wait_seconds: io.wait_seconds,
            }))?;
        }
        Ok(())
    }

    fn held(&mut self, id: RequestId) -> Result<&mut Held, PeerError> {
        self.reqs.get_mut(&id).ok_or_else(|| {
            PeerError::Internal(format!(
                "the scheduler reported request {id}, which it was not given"
            ))
        })
    }

    /// A request ended: its orchestrator number.
    fn forget(&mut self, id: RequestId) -> Result<u64, PeerError> {
        let h = self.reqs.remove(&id).ok_or_else(|| {
            PeerError::Internal(format!(
                "the scheduler ended request {id}, which it was not given"
            ))
        })?;
        self.ids.remove(&h.req);
        Ok(h.req)
    }
}

/// The answer to `SaveState` / `LoadState` (a file's error names its path, not the flag).
fn state_done(req: u64, res: Result<usize, StateError>) -> Msg {
    match res {
        Ok(n) => Msg::StateDone {
            req,
            tokens: n.min(u32::MAX as usize) as u32,
            error: None,
        },
        Err(e) => Msg::StateDone {
            req,
            tokens: 0,
            error: Some(e.without_flag()),
        },
    }
}
