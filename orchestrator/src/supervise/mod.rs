//! The staged pipeline, orchestrator side: start the stage processes, wire them, drive
//! generation, watch for faults.
//!
//! - [`spawn`]: the stage processes (or `--inproc` threads), their exit watcher, Ctrl-C;
//! - [`drive`]: the wiring and the generation loop on the control sockets;
//! - [`warm`]: the same stages kept up for request after request (`serve`, `chat`), with
//!   restart after a fault;
//! - [`cgroup`]: per-stage memory cgroups (v1 and v2); [`numa`]: per-stage NUMA placement;
//! - [`progress`]: the progress line during the trunk load and the prefill;
//! - [`error`]: [`SuperviseError`], what ends a pipeline, typed (the exit code and the stage
//!   to blame come from it, in `crate::error`).
//!
//! Nothing here knows about CLI flags or reports: `run/` builds a [`Launch`] and reads the
//! [`Outcome`]; an [`Observer`] sees steps and text as they happen.
//!
//! [`run`] starts the four stages (processes re-executing this binary as `k3-orch stage
//! <name>`, or threads with `--inproc`), wires them together, drives generation and turns
//! what they report into the run report. The wiring, in order:
//!
//! 1. every stage says `Hello` on its control socket;
//! 2. the orchestrator creates one two-ring link region per compute peer (trunk-loader,
//!    expert-fetcher, tokenizer) and hands each end its fd;
//! 3. `Configure` to tokenizer, trunk-loader and expert-fetcher; the loaders create and
//!    first-touch their arenas (their cgroups pay) and send them back as fds, which the
//!    orchestrator passes on to layer-compute, read-only;
//! 4. the prompt is encoded by the tokenizer (unless ids were given);
//! 5. `Configure` to layer-compute, then `Ready` to all: compute drives the passes.
//!
//! Faults: a stage that exits or is killed before it is done, reports an `Error`, or stops
//! sending heartbeats for `--stage-timeout` seconds ends the run, naming the stage and the
//! cause; every other stage is killed and reaped first. A stage that reports a peer's death
//! is not blamed: the peer's own exit or report is waited for briefly and named instead.
//! Memory shared between stages is memfd-backed, so nothing outlives the processes.

pub mod cgroup;
pub mod drive;
pub mod error;
pub mod numa;
pub mod progress;
pub mod spawn;
pub mod warm;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use k3_protocol::conf;
use k3_protocol::control::ControlSocket;
use k3_protocol::link::StageCtx;
use k3_protocol::messages::{Msg, Stage, StepStats};

use drive::drive;
pub use error::{SpawnError, SuperviseError};
use spawn::{spawn_all, ExitCause, StageEvent};

/// How the stages run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Processes,
    Threads,
}

/// What each stage gets, already serialised.
#[derive(Clone, Debug)]
pub struct Launch {
    pub mode: Mode,
    pub tokenizer: conf::TokenizerConf,
    pub trunk: conf::TrunkConf,
    pub fetcher: conf::FetcherConf,
    pub compute: conf::ComputeConf,
    /// How to encode the prompt (None: `compute.prompt_ids` already holds it).
    pub prompt: Option<Msg>,
    pub stage_timeout: Duration,
    /// Per-stage memory budget for cgroups (bytes), when cgroups are used.
    pub budgets: HashMap<Stage, u64>,
    pub require_cgroups: bool,
    pub numa: Option<String>,
    /// Show the progress line on stderr during the trunk load and the prefill.
    pub progress: bool,
}

/// Everything the pipeline reports back.
#[derive(Debug, Default)]
pub struct Outcome {
    pub prompt_ids: Vec<u32>,
    pub generated: Vec<u32>,
    pub steps: Vec<StepStats>,
    pub text: Vec<u8>,
    pub summaries: BTreeMap<String, serde_json::Value>,
    pub pids: BTreeMap<String, u32>,
    pub peak_rss: BTreeMap<String, u64>,
    /// Per stage: cgroup path, limit, peak.
    pub cgroups: BTreeMap<String, (String, u64, Option<u64>)>,
    pub numa: BTreeMap<String, u32>,
    pub notes: Vec<String>,
    pub seconds: f64,
}

/// What the caller sees while the pipeline runs (the CLI prints step lines and streams
/// text; a server forwards them). Every method has a do-nothing default.
pub trait Observer {
    /// Generation is about to start (every stage is configured).
    fn started(&mut self) {}
    /// A step finished.
    fn step(&mut self, _s: &StepStats) {}
    /// The tokenizer decoded bytes of the output.
    fn text(&mut self, _bytes: &[u8]) {}
    /// Asked after each text: true when the output has ended (a stop string), so compute
    /// is told to stop generating.
    fn stop_requested(&self) -> bool {
        false
    }
}

/// An observer that ignores everything.
pub struct Silent;
impl Observer for Silent {}

/// Run one stage role on a control socket (the body of `k3-orch stage <name>` and of each
/// `--inproc` thread).
pub fn stage_main(
    stage: Stage,
    control: ControlSocket,
) -> Result<(), k3_protocol::failure::StageFailure> {
    let ctx = StageCtx::connect(stage, control)?;
    match stage {
        Stage::Tokenizer => k3_tokenizer::stage::run(ctx),
        Stage::TrunkLoader => k3_trunk_loader::stage::run(ctx),
        Stage::ExpertFetcher => k3_expert_fetcher::stage::run(ctx),
        Stage::LayerCompute => k3_layer_compute::stage::run(ctx),
        Stage::Orchestrator => Err(k3_protocol::failure::StageFailure::new(
            k3_protocol::failure::FailureKind::Config,
            "the orchestrator is not a stage role",
        )),
    }
}

/// Run the pipeline to the end of generation.
pub fn run(launch: &Launch, obs: &mut dyn Observer) -> Result<Outcome, SuperviseError> {
    spawn::install_interrupt_handler();
    let t_start = Instant::now();
    let mut r = spawn_all(launch)?;
    let res = drive(launch, &mut r, obs);
    match res {
        Ok(mut out) => {
            // Wait for every stage to finish on its own, then collect what they used.
            if r.watcher.is_some() {
                let deadline = Instant::now() + Duration::from_secs(10);
                while r.exited.len() < Stage::WORKERS.len() && Instant::now() < deadline {
                    if let Ok(StageEvent::Exit(x)) =
                        r.events.recv_timeout(Duration::from_millis(50))
                    {
                        if let Some(s) = Stage::parse(&x.stage) {
                            r.exited.insert(s, x);
                        }
                    }
                }
                if r.exited.len() < Stage::WORKERS.len() {
                    out.notes
                        .push("some stages did not exit within 10 s and were killed".into());
                    r.kill_all();
                }
            }
            join_threads(&mut r)?;
            for (s, x) in &r.exited {
                out.peak_rss.insert(s.name().to_string(), x.peak_rss_bytes);
                if x.cause != ExitCause::Code(0) {
                    return Err(SuperviseError::ShutdownExit {
                        stage: *s,
                        cause: x.cause.clone(),
                    });
                }
            }
            if let Some(cg) = &r.cgroups {
                for (s, name, limit, peak) in cg.report() {
                    out.cgroups
                        .insert(s.name().to_string(), (name, limit, peak));
                }
                out.notes.push(format!(
                    "memory cgroups: {} (one per stage, swap off)",
                    cg.version()
                ));
            }
            out.notes.append(&mut r.notes);
            out.numa = r
                .numa
                .iter()
                .map(|(s, n)| (s.name().to_string(), *n))
                .collect();
            out.pids = r
                .pids
                .iter()
                .map(|(s, p)| (s.name().to_string(), *p))
                .collect();
            out.seconds = t_start.elapsed().as_secs_f64();
            Ok(out)
        }
        Err(f) => {
            r.kill_all();
            Err(f)
        }
    }
}

/// Join the in-process stages (`--inproc`) of a finished run: the first one that returned
/// a failure (its own kind, as a stage process would report it) or panicked.
fn join_threads(r: &mut spawn::Running) -> Result<(), SuperviseError> {
    for (stage, h) in r.threads.drain(..) {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(failure)) => return Err(SuperviseError::ThreadFailed { stage, failure }),
            Err(_) => return Err(SuperviseError::Panicked { stage }),
        }
    }
    Ok(())
}

pub(crate) mod erased {
    /// Serialise a stage configuration.
    pub trait Json {
        fn json(&self) -> String;
    }
    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> String {
            serde_json::to_string(self).expect("stage configurations serialise")
        }
    }
}
