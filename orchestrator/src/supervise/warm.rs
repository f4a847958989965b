//! Warm stages for `serve` and `chat`: the four stage processes are started and wired once
//! (the trunk is loaded once), then serve requests, several at once. Layer-compute runs in
//! warm mode (`ComputeConf::warm`, with `ComputeConf::slots`): each request is `Generate`
//! on its control socket ([`Warm::submit`]); compute runs every request it holds together
//! (continuous batching) and reports `RequestStarted`, a `Token` per id (while the
//! tokenizer sends the id's `Text`), `RequestDone` or `RequestFailed` per request and a
//! `PassStats` per pass, which [`Warm::events`] hands out in compute's order, each token
//! paired with its text. [`Warm::stop`] (`StopRequest`) ends a request early. Compute keeps
//! session states between requests (prefix reuse); `SaveState` / `LoadState` (answered by
//! `StateDone`) write one to a state file and read one back (`k3-orch chat`'s `/save` and
//! `/load`).
//!
//! Bounds: what waits here is at most what compute sent since the last [`Warm::events`]
//! (each token's report waits only for its text, which the tokenizer sends for every id).
//!
//! Faults: a stage that dies, reports an `Error` or falls silent is a [`RunError`] naming
//! the stage and the cause, from [`Warm::events`] (every request in flight is lost); the
//! caller then drops this [`Warm`] ([`Warm::kill`]: every stage killed and reaped, cgroups
//! removed) and starts a new one. [`Warm::poll`] notices a stage that died between
//! requests. A [`Stopper`] kills the stages and removes the cgroups from another thread (a
//! server's shutdown deadline).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use k3_protocol::conf::SamplerConfig;
use k3_protocol::messages::{GenRequest, Msg, PassStats, Stage};

use super::drive::{handle_common, start_compute, wire};
use super::spawn::{spawn_all, Running, StageEvent};
use super::{Launch, Mode};
use crate::error::RunError;

/// One request.
#[derive(Clone, Debug)]
pub struct WarmRequest {
    pub prompt: Vec<u32>,
    pub gen: usize,
    pub sampler: SamplerConfig,
    pub stop_ids: Vec<u32>,
    /// Also keep the state after this many prompt tokens (end of the last complete message).
    pub snapshot_at: Option<usize>,
    /// Session states compute keeps (0: no prefix reuse).
    pub cache_entries: usize,
    /// Report each step's logits row with its token (a debug endpoint).
    pub keep_logits: bool,
}

/// What the stages reported for the requests in flight, in compute's order.
#[derive(Clone, Debug)]
pub enum WarmEvent {
    /// Request `req` took a slot, reusing `cached_tokens` prompt tokens.
    Started { req: u64, cached_tokens: usize },
    /// Its `index`-th generated id and its decoded bytes; `expert_failures` counts the
    /// routed experts that failed in its passes since its last token (any: unsound).
    Token {
        req: u64,
        index: usize,
        token: u32,
        bytes: Vec<u8>,
        expert_failures: u64,
        logits: Option<Vec<f32>>,
    },
    /// One forward pass.
    Pass(PassStats),
    /// It ended (its length, a stop id, a stop): every id compute generated (it may have
    /// run a pass past a stop the caller saw).
    Done { req: u64, generated: Vec<u32> },
    /// It failed on its own (the others carry on).
    Failed { req: u64, error: String },
    /// A `SaveState` / `LoadState` answer (see [`Warm::save_state`]).
    State {
        req: u64,
        result: Result<usize, StateRefused>,
    },
}

/// Why layer-compute saved or loaded no state (its `StateDone` error: a file it could not
/// write, a state for another model or conversation); the stages carry on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StateRefused(pub String);

/// Memory of one stage, from its cgroup.
#[derive(Clone, Debug)]
pub struct StageMemory {
    pub stage: &'static str,
    pub pid: u32,
    pub usage_bytes: Option<u64>,
    pub peak_bytes: Option<u64>,
    pub limit_bytes: Option<u64>,
}

/// Stops a [`Warm`]'s stages from another thread, whatever the thread that owns it is
/// doing (a server's shutdown deadline): every stage SIGKILLed and reaped, then the cgroups
/// removed. The owner then sees the stages die as a fault; its own cleanup finds nothing
/// left to do.
#[derive(Clone)]
pub struct Stopper {
    killer: Option<super::spawn::Killer>,
    cgroups: Vec<std::path::PathBuf>,
}

impl Stopper {
    /// Kill and reap the stages, remove the cgroups; within about a second at most.
    pub fn stop_now(&self) {
        if let Some(k) = &self.killer {
            if !k.kill_now(Duration::from_millis(500)) {
                tracing::warn!("k3-orch: a stage was not reaped 0.5 s after SIGKILL");
            }
        }
        let deadline = Instant::now() + Duration::from_millis(400);
        if let Err(e) = super::cgroup::remove_dirs(&self.cgroups, deadline) {
            tracing::warn!("k3-orch: {e}");
        }
    }
}

/// The started pipeline.
pub struct Warm {
    r: Running,
    launch: Launch,
    next_req: u64,
    /// The tokenizer's text for each token compute reported, in order (a token's text may
    /// come before or after its report: they travel on different sockets).
    texts: VecDeque<Vec<u8>>,
    /// Compute's reports not yet complete (a token waiting for its text), in order.
    pending: VecDeque<WarmEvent>,
    /// Complete reports not yet handed out.
    ready: Vec<WarmEvent>,
}

impl Warm {
    /// Start the four stage processes and wire them (the loaders fill their arenas here).
    pub fn start(launch: &Launch) -> Result<Warm, RunError> {
        let mut launch = launch.clone();
        launch.mode = Mode::Processes;
        launch.prompt = None;
        launch.compute.warm = true;
        launch.compute.prompt_ids.clear();
        launch.compute.dump_logits = None;
        let mut r = spawn_all(&launch)?;
        let res = wire(&launch, &mut r).and_then(|data| {
            let c = launch.compute.clone();
            start_compute(&launch, &mut r, &c, data)
        });
        // The load had its progress line; per-request prefills in a server do not.
        r.progress = super::progress::Progress::new(false);
        match res {
            Ok(()) => Ok(Warm {
                r,
                launch,
                next_req: 1,
                texts: VecDeque::new(),
                pending: VecDeque::new(),
                ready: Vec::new(),
            }),
            Err(e) => {
                r.kill_all();
                Err(e.into())
            }
        }
    }

    /// A handle that stops these stages from another thread.
    pub fn stopper(&self) -> Stopper {
        Stopper {
            killer: self.r.watcher.as_ref().map(|w| w.killer()),
            cgroups: self.r.cgroups.as_ref().map_or(Vec::new(), |c| c.dirs()),
        }
    }

    /// The configuration it was started with (to start it again).
    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    /// Stage pids.
    pub fn pids(&self) -> Vec<(Stage, u32)> {
        Stage::WORKERS
            .iter()
            .filter_map(|s| self.r.pids.get(s).map(|p| (*s, *p)))
            .collect()
    }

    /// Per-stage memory (cgroup usage and peak; nothing when cgroups are unavailable).
    pub fn memory(&self) -> Vec<StageMemory> {
        Stage::WORKERS
            .iter()
            .map(|s| {
                let u = self.r.cgroups.as_ref().and_then(|c| c.usage(*s));
                StageMemory {
                    stage: s.name(),
                    pid: self.r.pids.get(s).copied().unwrap_or(0),
                    usage_bytes: u.and_then(|x| x.0),
                    peak_bytes: u.and_then(|x| x.1),
                    limit_bytes: u.map(|x| x.2),
                }
            })
            .collect()
    }

    /// Read what arrived since the last call without waiting (heartbeats, reports); a
    /// stage that died, failed or went silent is an error (the pipeline must be
    /// restarted). What compute reported is kept for [`Warm::events`].
    pub fn poll(&mut self) -> Result<(), RunError> {
        self.receive(Duration::ZERO, usize::MAX)
    }

    /// Start one request: compute queues it and runs it beside the others it holds (it
    /// takes a slot at the next pass boundary). Its number, which its events carry.
    pub fn submit(&mut self, q: &WarmRequest) -> Result<u64, RunError> {
        let req = self.next_req;
        self.next_req += 1;
        let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        self.r.send(
            Stage::LayerCompute,
            &Msg::Generate(GenRequest {
                req,
                prompt: q.prompt.clone(),
                gen: n(q.gen),
                sampler: q.sampler,
                stop_ids: q.stop_ids.clone(),
                snapshot_at: q.snapshot_at.map(n),
                cache_entries: n(q.cache_entries),
                keep_logits: q.keep_logits,
            }),
            &[],
        )?;
        Ok(req)
    }

    /// End request `req` at compute's next pass boundary (a stop string, a client gone);
    /// its `Done` follows. A stop for a request that has ended is ignored.
    pub fn stop(&mut self, req: u64) -> Result<(), RunError> {
        Ok(self
            .r
            .send(Stage::LayerCompute, &Msg::StopRequest { req }, &[])?)
    }

    /// What the requests in flight did: waits up to `wait` for the first report, then
    /// takes what else has arrived (at most a few hundred messages), in compute's order,
    /// each token with its decoded bytes. An error is the pipeline's (a stage died, failed
    /// or fell silent: every request in flight is lost; restart the stages).
    pub fn events(&mut self, wait: Duration) -> Result<Vec<WarmEvent>, RunError> {
        if self.ready.is_empty() {
            self.receive(wait, 1)?;
        }
        self.receive(Duration::ZERO, 512)?;
        Ok(self.ready.drain(..).collect())
    }

    /// Receive up to `max` messages, the first within `wait` and the rest already there;
    /// sort them into compute's reports (paired with the tokenizer's text).
    fn receive(&mut self, wait: Duration, max: usize) -> Result<(), RunError> {
        let deadline = Instant::now() + wait;
        let mut got = 0usize;
        while got < max {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = match self.r.events.recv_timeout(left) {
                Ok(ev) => ev,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => break,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(RunError::new(1, "k3-orch: every stage connection is gone"))
                }
            };
            got += 1;
            if let StageEvent::Control(s, Ok(_)) = &ev {
                self.r.last_seen.insert(*s, Instant::now());
            }
            let Some((s, m, _)) = handle_common(&mut self.r, ev, "while serving requests")? else {
                continue;
            };
            self.sort(s, m)?;
        }
        self.release();
        self.check_heartbeats()
    }

    /// One message from a stage, into the reports.
    fn sort(&mut self, s: Stage, m: Msg) -> Result<(), RunError> {
        let ev = match (s, m) {
            (Stage::Tokenizer, Msg::Text { bytes }) => {
                self.texts.push_back(bytes);
                return Ok(());
            }
            (Stage::LayerCompute, Msg::RequestStarted { req, cached_tokens }) => {
                WarmEvent::Started {
                    req,
                    cached_tokens: cached_tokens as usize,
                }
            }
            (Stage::LayerCompute, Msg::Token(t)) => WarmEvent::Token {
                req: t.req,
                index: t.index as usize,
                token: t.token,
                bytes: Vec::new(),
                expert_failures: t.expert_failures,
                logits: t.logits,
            },
            (Stage::LayerCompute, Msg::PassStats(p)) => WarmEvent::Pass(p),
            (Stage::LayerCompute, Msg::RequestDone { req, generated }) => {
                WarmEvent::Done { req, generated }
            }
            (Stage::LayerCompute, Msg::RequestFailed { req, error }) => {
                WarmEvent::Failed { req, error }
            }
            (Stage::LayerCompute, Msg::StateDone { req, tokens, error }) => WarmEvent::State {
                req,
                result: match error {
                    None => Ok(tokens as usize),
                    Some(e) => Err(StateRefused(e)),
                },
            },
            (s, other) => {
                return Err(RunError::new(
                    1,
                    format!("k3-orch: {s} sent {other:?} while serving requests"),
                ))
            }
        };
        // Bounded: compute sends one Token per DecodeId, and the tokenizer one Text per
        // DecodeId; a report waits only for its token's text.
        self.pending.push_back(ev);
        Ok(())
    }

    /// Move compute's reports that are complete (a token with its text) to `ready`, in
    /// order: a token waits for its text, and everything after it waits too.
    fn release(&mut self) {
        while let Some(ev) = self.pending.front() {
            if matches!(ev, WarmEvent::Token { .. }) {
                let Some(bytes) = self.texts.pop_front() else {
                    break;
                };
                let Some(WarmEvent::Token {
                    req,
                    index,
                    token,
                    expert_failures,
                    logits,
                    ..
                }) = self.pending.pop_front()
                else {
                    break;
                };
                self.ready.push(WarmEvent::Token {
                    req,
                    index,
                    token,
                    bytes,
                    expert_failures,
                    logits,
                });
            } else if let Some(ev) = self.pending.pop_front() {
                self.ready.push(ev);
            }
        }
    }

    /// A stage that has sent nothing (not even its heartbeat) for the stage timeout has
    /// hung.
    fn check_heartbeats(&mut self) -> Result<(), RunError> {
        let timeout = self.launch.stage_timeout;
        let now = Instant::now();
        for s in Stage::WORKERS {
            let seen = *self.r.last_seen.entry(s).or_insert(now);
            if now.duration_since(seen) > timeout {
                return Err(RunError::new(
                    1,
                    format!(
                        "k3-orch: stage {s} stopped answering (no heartbeat for {:.0} s)",
                        timeout.as_secs_f64()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `k3-orch chat`'s `/save`: compute writes the kept state for the longest proper prefix
    /// of `tokens` to `path` (see [`Msg::SaveState`]). The outer error is a pipeline fault;
    /// the inner one says why nothing was saved (the stages carry on).
    pub fn save_state(
        &mut self,
        path: &std::path::Path,
        fingerprint: &str,
        tokens: &[u32],
    ) -> Result<Result<usize, StateRefused>, RunError> {
        let req = self.next_req;
        self.state_request(Msg::SaveState {
            req,
            path: path.to_path_buf(),
            fingerprint: fingerprint.to_string(),
            tokens: tokens.to_vec(),
        })
    }

    /// `k3-orch chat`'s `/load`: compute reads and checks the state file at `path` and keeps
    /// it for prefix reuse when its tokens start `tokens` (see [`Msg::LoadState`]).
    pub fn load_state(
        &mut self,
        path: &std::path::Path,
        fingerprint: &str,
        tokens: &[u32],
        cache_entries: usize,
    ) -> Result<Result<usize, StateRefused>, RunError> {
        let req = self.next_req;
        self.state_request(Msg::LoadState {
            req,
            path: path.to_path_buf(),
            fingerprint: fingerprint.to_string(),
            tokens: tokens.to_vec(),
            cache_entries: cache_entries.min(u32::MAX as usize) as u32,
        })
    }

    /// Send a `SaveState`/`LoadState` (numbered `self.next_req`) and wait for its
    /// `StateDone`; the other reports that arrive meanwhile stay for [`Warm::events`].
    fn state_request(&mut self, m: Msg) -> Result<Result<usize, StateRefused>, RunError> {
        self.poll()?;
        let req = self.next_req;
        self.next_req += 1;
        self.r.send(Stage::LayerCompute, &m, &[])?;
        let deadline = Instant::now() + self.launch.stage_timeout;
        loop {
            if let Some(i) = self
                .ready
                .iter()
                .position(|e| matches!(e, WarmEvent::State { req: r, .. } if *r == req))
            {
                if let WarmEvent::State { result, .. } = self.ready.remove(i) {
                    return Ok(result);
                }
            }
            if Instant::now() > deadline {
                return Err(RunError::new(
                    1,
                    "k3-orch: layer-compute did not answer a state request".to_string(),
                ));
            }
            self.receive(Duration::from_millis(50), 512)?;
        }
    }

    /// Stop every stage cleanly (compute ends the loaders and the tokenizer), within
    /// `grace`; what is still running then is killed. Cgroups are removed.
    pub fn shutdown(self, grace: Duration) {
        let _ = self.r.send(Stage::LayerCompute, &Msg::Shutdown, &[]);
        let deadline = Instant::now() + grace;
        let mut exited = 0usize;
        while exited < Stage::WORKERS.len() && Instant::now() < deadline {
            if let Ok(StageEvent::Exit(_)) = self.r.events.recv_timeout(Duration::from_millis(20)) {
                exited += 1;
            }
        }
        self.kill();
    }

    /// Kill and reap every stage, remove the cgroups.
    pub fn kill(mut self) {
        self.r.kill_all();
        drop(self.r);
    }
}
