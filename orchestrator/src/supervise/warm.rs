//! Warm stages for `serve` and `chat`: the four stage processes are started and wired once
//! (the trunk is loaded once), then serve request after request. Layer-compute runs in warm
//! mode (`ComputeConf::warm`): each request is `Generate` on its control socket, answered by
//! `RequestStarted`, the usual `StepStats` (and the tokenizer's `Text` per id), then
//! `RequestDone`; `StopRequest` ends a request early. Compute keeps the session states
//! between requests (prefix reuse); `SaveState` / `LoadState` (answered by `StateDone`)
//! write one to a state file and read one back (`k3-orch chat`'s `/save` and `/load`).
//!
//! Faults: a stage that dies, reports an `Error` or falls silent fails the request in
//! progress with a [`RunError`] naming the stage and the cause; the caller then drops this
//! [`Warm`] ([`Warm::kill`]: every stage killed and reaped, cgroups removed) and starts a
//! new one. [`Warm::poll`] notices a stage that died between requests. A [`Stopper`] kills
//! the stages and removes the cgroups from another thread (a server's shutdown deadline).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use k3_protocol::conf::SamplerConfig;
use k3_protocol::messages::{GenRequest, Msg, Stage, StepStats};

use super::drive::{handle_common, next_event, start_compute, wire};
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
}

/// What a request reports while it runs.
pub trait WarmObserver {
    /// Compute started the request, reusing `cached_tokens` prompt tokens.
    fn started(&mut self, _cached_tokens: usize) {}
    /// One generated token, in order, with its decoded bytes; true ends the request there
    /// (a stop string, a stop id, a client gone).
    fn token(&mut self, step: &StepStats, bytes: &[u8]) -> bool;
    /// Asked often while the request runs: true cancels it.
    fn cancelled(&mut self) -> bool {
        false
    }
}

/// A finished request.
#[derive(Clone, Debug, Default)]
pub struct WarmDone {
    /// Every id compute generated (it may run a step or two past a stop the observer saw).
    pub generated: Vec<u32>,
    pub cached_tokens: usize,
    pub steps: Vec<StepStats>,
}

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

    /// Read what arrived while no request ran (heartbeats); a stage that died, failed or
    /// went silent meanwhile is an error (the pipeline must be restarted).
    pub fn poll(&mut self) -> Result<(), RunError> {
        let timeout = self.launch.stage_timeout;
        while let Ok(ev) = self.r.events.try_recv() {
            if let StageEvent::Control(s, Ok(_)) = &ev {
                self.r.last_seen.insert(*s, Instant::now());
            }
            if let Some((s, m, _)) = handle_common(&mut self.r, ev, "between requests")? {
                return Err(RunError::new(
                    1,
                    format!("k3-orch: {s} sent {m:?} between requests"),
                ));
            }
        }
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

    /// Run one request to its end.
    pub fn generate(
        &mut self,
        q: &WarmRequest,
        obs: &mut dyn WarmObserver,
    ) -> Result<WarmDone, RunError> {
        self.poll()?;
        let req = self.next_req;
        self.next_req += 1;
        self.r.send(
            Stage::LayerCompute,
            &Msg::Generate(GenRequest {
                req,
                prompt: q.prompt.clone(),
                gen: q.gen.min(u32::MAX as usize) as u32,
                sampler: q.sampler,
                stop_ids: q.stop_ids.clone(),
                snapshot_at: q.snapshot_at.map(|b| b.min(u32::MAX as usize) as u32),
                cache_entries: q.cache_entries.min(u32::MAX as usize) as u32,
            }),
            &[],
        )?;
        let timeout = self.launch.stage_timeout;
        let all = Stage::WORKERS;
        let mut out = WarmDone::default();
        // The tokenizer's Text for id i and compute's StepStats for id i come on different
        // sockets: pair them up in order.
        let mut texts: VecDeque<Vec<u8>> = VecDeque::new();
        let mut delivered = 0usize;
        let mut done: Option<Vec<u32>> = None;
        let mut stopped = false;
        let mut stop_sent = false;
        loop {
            while delivered < out.steps.len() && !texts.is_empty() {
                let bytes = texts.pop_front().unwrap_or_default();
                let st = &out.steps[delivered];
                delivered += 1;
                if !stopped && obs.token(st, &bytes) {
                    stopped = true;
                }
            }
            if !stopped && obs.cancelled() {
                stopped = true;
            }
            if stopped && !stop_sent && done.is_none() {
                stop_sent = true;
                self.r
                    .send(Stage::LayerCompute, &Msg::StopRequest { req }, &[])?;
            }
            if let Some(g) = &done {
                if delivered >= g.len() {
                    break;
                }
            }
            let ev = next_event(&mut self.r, timeout, &all)?;
            let Some((s, m, _)) = handle_common(&mut self.r, ev, "during a request")? else {
                continue;
            };
            match m {
                Msg::RequestStarted {
                    req: r,
                    cached_tokens,
                } if r == req && s == Stage::LayerCompute => {
                    out.cached_tokens = cached_tokens as usize;
                    obs.started(out.cached_tokens);
                }
                Msg::StepStats(st) if s == Stage::LayerCompute => out.steps.push(st),
                Msg::Text { bytes } if s == Stage::Tokenizer => texts.push_back(bytes),
                Msg::RequestDone { req: r, generated } if r == req => done = Some(generated),
                other => {
                    return Err(RunError::new(
                        1,
                        format!("k3-orch: {s} sent {other:?} during a request"),
                    ))
                }
            }
        }
        out.generated = done.unwrap_or_default();
        Ok(out)
    }

    /// `k3-orch chat`'s `/save`: compute writes the kept state for the longest proper prefix
    /// of `tokens` to `path` (see [`Msg::SaveState`]). The outer error is a pipeline fault;
    /// the inner one says why nothing was saved (the stages carry on).
    pub fn save_state(
        &mut self,
        path: &std::path::Path,
        fingerprint: &str,
        tokens: &[u32],
    ) -> Result<Result<usize, String>, RunError> {
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
    ) -> Result<Result<usize, String>, RunError> {
        let req = self.next_req;
        self.state_request(Msg::LoadState {
            req,
            path: path.to_path_buf(),
            fingerprint: fingerprint.to_string(),
            tokens: tokens.to_vec(),
            cache_entries: cache_entries.min(u32::MAX as usize) as u32,
        })
    }

    /// Send a `SaveState`/`LoadState` (numbered `self.next_req`) and wait for its `StateDone`.
    fn state_request(&mut self, m: Msg) -> Result<Result<usize, String>, RunError> {
        self.poll()?;
        let req = self.next_req;
        self.next_req += 1;
        self.r.send(Stage::LayerCompute, &m, &[])?;
        let timeout = self.launch.stage_timeout;
        loop {
            let ev = next_event(&mut self.r, timeout, &Stage::WORKERS)?;
            let Some((s, m, _)) = handle_common(&mut self.r, ev, "saving or loading a state")?
            else {
                continue;
            };
            match m {
                Msg::StateDone {
                    req: r,
                    tokens,
                    error,
                } if r == req && s == Stage::LayerCompute => {
                    return Ok(match error {
                        None => Ok(tokens as usize),
                        Some(e) => Err(e),
                    })
                }
                other => {
                    return Err(RunError::new(
                        1,
                        format!("k3-orch: {s} sent {other:?} while saving or loading a state"),
                    ))
                }
            }
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
