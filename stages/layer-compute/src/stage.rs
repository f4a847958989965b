//! The layer-compute stage's process loop: configure, then run the one decode loop
//! ([`crate::decode::decode_resumed`]) over [`StagedWeights`], streaming each id to the
//! tokenizer and each step's statistics to the orchestrator. A warm stage (`serve`, `chat`:
//! `ComputeConf::warm`) runs request after request (`Generate` ... `RequestDone` on the
//! control socket) on the same model, keeping session states for prefix reuse, until
//! `Shutdown`; between requests it also writes and reads those states for `k3-orch chat`'s
//! `/save` and `/load` (`SaveState` / `LoadState`, answered by `StateDone`). Between steps
//! it reads `StopRequest` (a stop string, a client gone).
//!
//! Model-level tensors (embeddings, lm_head, final norms) are this stage's own (the
//! embedding read a row per token, the lm_head held or read in chunks: `crate::links`), so
//! its cgroup pays for them together with the KV cache, the recurrent state and the
//! scratch. The matrix products run on a rayon pool of `threads` workers built here,
//! inside this process (whose CPU affinity k3-orch has already set).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k3_model::config::ModelConfig;
use k3_model::mmap_weights::MmapWeights;
use k3_protocol::conf::ComputeConf;
use k3_protocol::failure::StageFailure;
use k3_protocol::link::{send_to, Link, StageCtx};
use k3_protocol::messages::{GenRequest, Msg, Stage, StepStats};
use k3_protocol::shm::Region;

use crate::decode::{
    decode_resumed, decode_session, LoopOptions, PrefixCache, Resume, Step, StepHooks,
};
use crate::error::{ComputeError, PeerError};
use crate::forward::{Model, ModelOptions, Session};
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
    /// `Shutdown` arrived during the request: end it, then the stage.
    shutdown: bool,
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
                Ok((Msg::Shutdown, _)) => {
                    self.stop = true;
                    self.shutdown = true;
                }
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
        .with_model_stream(conf.lm_head_chunk_bytes, conf.lm_head_held_bytes)
        .map_err(ComputeError::ModelStream)?;
    let model = Model::new(
        cfg,
        &weights,
        ModelOptions {
            threads: conf.threads.max(1),
            layers: conf.layers,
            eps: None,
        },
    )?;
    let generated = if conf.warm {
        serve_requests(ctx, &model, &weights, &mut tok, timeout, conf.prefill_chunk)?;
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
                shutdown: false,
                failures: 0,
            },
        )?;
        if let Some(p) = &conf.save_state {
            start.save(p, &conf.state_fingerprint, &generated)?;
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

/// A warm stage (`serve`, `chat`): run requests (`Generate` on the control socket) one after
/// another on the same model and links until `Shutdown`. After each request the session
/// state (MLA KV, KDA state, conv tails) is kept, keyed by the tokens it consumed (and at the
/// request's `snapshot_at`), so a prompt that extends a kept key prefills only the rest.
fn serve_requests(
    ctx: &StageCtx,
    model: &Model<&StagedWeights>,
    weights: &StagedWeights,
    tok: &mut Link,
    timeout: Option<Duration>,
    prefill_chunk: Option<usize>,
) -> Result<(), ComputeError> {
    let mut warm = Warm {
        ctx,
        model,
        weights,
        tok,
        timeout,
        prefill_chunk,
        cache: PrefixCache::new(0),
    };
    loop {
        let (m, _) = ctx.control.recv(None)?;
        match m {
            Msg::Generate(r) => {
                if warm.request(r)? {
                    return Ok(());
                }
            }
            Msg::SaveState {
                req,
                path,
                fingerprint,
                tokens,
            } => {
                let res = warm.save(&path, &fingerprint, &tokens);
                ctx.send_control(&state_done(req, res))?;
            }
            Msg::LoadState {
                req,
                path,
                fingerprint,
                tokens,
                cache_entries,
            } => {
                let res = warm.load(&path, &fingerprint, &tokens, cache_entries);
                ctx.send_control(&state_done(req, res))?;
            }
            Msg::Shutdown => return Ok(()),
            // A stop that arrived after its request had ended.
            Msg::StopRequest { .. } | Msg::Ping { .. } => {}
            other => {
                return Err(PeerError::Unexpected {
                    got: format!("{other:?}"),
                    when: "between requests",
                }
                .into())
            }
        }
    }
}

/// A warm stage between requests: the model and links it runs on, and the session states
/// kept for prefix reuse.
struct Warm<'a> {
    ctx: &'a StageCtx,
    model: &'a Model<&'a StagedWeights>,
    weights: &'a StagedWeights,
    tok: &'a mut Link,
    timeout: Option<Duration>,
    prefill_chunk: Option<usize>,
    cache: PrefixCache,
}

impl Warm<'_> {
    /// Run one request (`Generate`) from `RequestStarted` to `RequestDone`. True when a
    /// `Shutdown` came during it (the stage ends after it).
    fn request(&mut self, r: GenRequest) -> Result<bool, ComputeError> {
        let (ctx, model) = (self.ctx, self.model);
        self.cache.cap = r.cache_entries as usize;
        let (cached, mut sess) = self
            .cache
            .lookup(&r.prompt)
            .unwrap_or_else(|| (0, model.new_session()));
        ctx.send_control(&Msg::RequestStarted {
            req: r.req,
            cached_tokens: cached as u32,
        })?;
        let (fed, snapshot_failures) = self.snapshot(&r, &mut sess, cached)?;
        let mut hooks = Staged {
            ctx,
            weights: self.weights,
            tok: &mut *self.tok,
            timeout: self.timeout,
            req: r.req,
            stop: false,
            shutdown: false,
            failures: snapshot_failures,
        };
        let generated = decode_session(
            model,
            &mut sess,
            fed,
            &LoopOptions {
                prompt: &r.prompt,
                gen: r.gen as usize,
                incremental: true,
                sampler: r.sampler,
                stop_ids: &r.stop_ids,
                dump_logits: None,
                prefill_chunk: self.prefill_chunk,
            },
            &mut hooks,
        )?;
        let (shutdown, failures) = (hooks.shutdown, hooks.failures);
        // The session has consumed the prompt and every generated id but the last; it is
        // kept only when every expert of every step was there.
        if failures == 0 {
            let mut seq = r.prompt.clone();
            seq.extend_from_slice(&generated);
            seq.pop();
            self.cache.insert(seq, sess);
        }
        ctx.send_control(&Msg::RequestDone {
            req: r.req,
            generated,
        })?;
        Ok(shutdown)
    }

    /// Prefill `sess` (which has consumed the first `cached` prompt tokens) up to the
    /// request's `snapshot_at` when that lies inside the prompt, and keep the state there
    /// (unless an expert failed to load). Returns the prompt tokens fed so far and the
    /// routed experts that failed in this prefill.
    fn snapshot(
        &mut self,
        r: &GenRequest,
        sess: &mut Session,
        cached: usize,
    ) -> Result<(usize, u64), ComputeError> {
        let Some(b) = r
            .snapshot_at
            .map(|b| b as usize)
            .filter(|&b| b > cached && b < r.prompt.len())
        else {
            return Ok((cached, 0));
        };
        let _ = self.weights.take_io();
        let res = self
            .model
            .prefill_chunked(sess, &r.prompt[cached..b], self.prefill_chunk);
        if let Some(e) = self.weights.take_link_error() {
            return Err(e.into());
        }
        let out = res?;
        for m in &out.stats.failure_msgs {
            tracing::warn!("layer-compute: {m}");
        }
        // A state computed without some of its experts is never kept.
        let failures = out.stats.expert_failures as u64;
        if failures == 0 {
            self.cache.insert(r.prompt[..b].to_vec(), sess.clone());
        }
        Ok((b, failures))
    }

    /// `SaveState`: write the kept state that `tokens` start with to `path`; the tokens it
    /// holds.
    fn save(
        &mut self,
        path: &Path,
        fingerprint: &str,
        tokens: &[u32],
    ) -> Result<usize, StateError> {
        let (bytes, n) = crate::state::encode_prefix(&mut self.cache, tokens, fingerprint)?;
        k3_io::output::write_atomic(path, &bytes).map_err(|source| StateError::File {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(n)
    }

    /// `LoadState`: read the state file `path`, check it against the model and `tokens`,
    /// and keep it (the cache then holds `cache_entries`); the tokens it holds.
    fn load(
        &mut self,
        path: &Path,
        fingerprint: &str,
        tokens: &[u32],
        cache_entries: u32,
    ) -> Result<usize, StateError> {
        crate::state::read(path)
            .and_then(|b| crate::state::decode_prefix(&b, fingerprint, self.model, tokens))
            .map(|(key, sess)| {
                let n = key.len();
                self.cache.cap = cache_entries as usize;
                self.cache.insert(key, sess);
                n
            })
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
