//! The staged pipeline: the orchestrator side.
//!
//! `run` starts the four stages (processes re-executing this binary as `k3-orch stage
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
//! sending heartbeats for `--stage-timeout` seconds ends the run with exit 1, naming the
//! stage and the cause; every other stage is killed and reaped first. Memory shared
//! between stages is memfd-backed, so nothing outlives the processes.

pub mod cgroup;
pub mod chat;
pub mod conf;
pub mod limits;
pub mod link;
pub mod numa;
pub mod stages;
pub mod supervisor;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k3_protocol::control::{self, ControlSocket};
use k3_protocol::messages::{Msg, RegionRole, Stage, StepStats};
use k3_protocol::shm::Region;
use k3_protocol::transport::{ShmTransport, Side};

use supervisor::{ExitCause, Exited, Watcher};

/// How the stages run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Processes,
    Threads,
}

/// What each stage gets, already serialised.
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
    pub quiet: bool,
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

/// A failure that ends the run, with its exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub msg: String,
}

impl Failure {
    fn new(code: i32, msg: impl Into<String>) -> Failure {
        Failure {
            code,
            msg: msg.into(),
        }
    }
}

/// Events the orchestrator's loop waits on.
enum Event {
    Control(Stage, Result<(Msg, Vec<OwnedFd>), String>),
    Exit(Exited),
}

impl From<Exited> for Event {
    fn from(e: Exited) -> Event {
        Event::Exit(e)
    }
}

/// Run one stage role on a control socket (the body of `k3-orch stage <name>` and of each
/// `--inproc` thread).
pub fn stage_main(stage: Stage, control: ControlSocket) -> Result<(), String> {
    let ctx = link::StageCtx::connect(stage, control)?;
    match stage {
        Stage::Tokenizer => stages::tokenizer::run(ctx),
        Stage::TrunkLoader => stages::trunk::run(ctx),
        Stage::ExpertFetcher => stages::fetcher::run(ctx),
        Stage::LayerCompute => stages::compute::run(ctx),
        Stage::Orchestrator => Err("the orchestrator is not a stage role".into()),
    }
}

struct Running {
    controls: HashMap<Stage, Arc<ControlSocket>>,
    watcher: Option<Watcher>,
    threads: Vec<(Stage, std::thread::JoinHandle<Result<(), String>>)>,
    events: Receiver<Event>,
    pids: HashMap<Stage, u32>,
    last_seen: HashMap<Stage, Instant>,
    exited: HashMap<Stage, Exited>,
    cgroups: Option<limits::StageCgroups>,
    notes: Vec<String>,
    numa: HashMap<Stage, u32>,
}

impl Running {
    fn kill_all(&mut self) {
        if let Some(w) = &self.watcher {
            w.kill_all(Duration::from_millis(300));
        }
        // Threads end when their control sockets close (the Running value is dropped).
    }

    fn send(&self, s: Stage, m: &Msg, fds: &[std::os::fd::BorrowedFd<'_>]) -> Result<(), Failure> {
        self.controls[&s]
            .send(m, fds)
            .map_err(|e| Failure::new(1, format!("k3-orch: sending to {s}: {e}")))
    }
}

fn spawn_all(launch: &Launch) -> Result<Running, Failure> {
    let (tx, rx) = channel::<Event>();
    let mut controls = HashMap::new();
    let mut children = Vec::new();
    let mut threads = Vec::new();
    let mut notes = Vec::new();
    let exe = std::env::current_exe()
        .map_err(|e| Failure::new(1, format!("k3-orch: cannot find its own binary: {e}")))?;
    let mut cgroups = None;
    let mut numa_nodes = HashMap::new();
    if launch.mode == Mode::Processes {
        match limits::StageCgroups::create(&launch.budgets) {
            Ok(cg) => cgroups = Some(cg),
            Err(why) => {
                if launch.require_cgroups {
                    return Err(Failure::new(
                        2,
                        format!("k3-orch: --require-cgroups: per-stage memory cgroups are unavailable: {why}"),
                    ));
                }
                let n = format!("running without per-stage memory cgroups: {why}");
                eprintln!("k3-orch: note: {n}");
                notes.push(n);
            }
        }
        let (map, ns) = limits::numa_plan(launch.numa.as_deref(), &launch.trunk.model_dir)
            .map_err(|e| Failure::new(2, format!("k3-orch: --numa: {e}")))?;
        numa_nodes = map;
        notes.extend(ns);
    } else if launch.numa.is_some() {
        notes.push("numa: --inproc runs every stage in one process; --numa is ignored".into());
    }
    for stage in Stage::WORKERS {
        let (ours, theirs) = control::pair()
            .map_err(|e| Failure::new(1, format!("k3-orch: control socket for {stage}: {e}")))?;
        match launch.mode {
            Mode::Processes => {
                let cg = cgroups.as_ref();
                let node = numa_nodes.get(&stage).copied();
                let child = supervisor::spawn_stage(&exe, stage.name(), theirs, |cmd| {
                    if let Some(n) = node {
                        cmd.env(limits::NUMA_ENV, n.to_string());
                    }
                    match cg {
                        Some(cg) => cg.join_on_spawn(stage, cmd),
                        None => Ok(()),
                    }
                })
                .map_err(|e| Failure::new(1, format!("k3-orch: starting {stage}: {e}")))?;
                children.push(child);
            }
            Mode::Threads => {
                let h = std::thread::Builder::new()
                    .name(format!("k3-{stage}"))
                    .spawn(move || stage_main(stage, theirs))
                    .map_err(|e| Failure::new(1, format!("k3-orch: starting {stage}: {e}")))?;
                threads.push((stage, h));
            }
        }
        let ours = Arc::new(ours);
        let (c2, tx2) = (ours.clone(), tx.clone());
        std::thread::Builder::new()
            .name(format!("k3-ctl-{stage}"))
            .spawn(move || loop {
                let r = c2.recv(None).map_err(|e| e.to_string());
                let stop = r.is_err();
                if tx2.send(Event::Control(stage, r)).is_err() || stop {
                    break;
                }
            })
            .map_err(|e| Failure::new(1, format!("k3-orch: control reader: {e}")))?;
        controls.insert(stage, ours);
    }
    let pids: HashMap<Stage, u32> = children
        .iter()
        .filter_map(|c| Stage::parse(&c.stage).map(|s| (s, c.pid)))
        .collect();
    let watcher = if launch.mode == Mode::Processes {
        Some(Watcher::start(children, tx.clone()))
    } else {
        None
    };
    Ok(Running {
        controls,
        watcher,
        threads,
        events: rx,
        pids,
        last_seen: HashMap::new(),
        exited: HashMap::new(),
        cgroups,
        notes,
        numa: numa_nodes,
    })
}

/// Wait for the next event, watching heartbeats; returns a failure for a silent stage.
fn next_event(
    r: &mut Running,
    timeout: Duration,
    expect_alive: &[Stage],
) -> Result<Event, Failure> {
    loop {
        if supervisor::INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Failure::new(130, "k3-orch: interrupted; stages stopped"));
        }
        match r.events.recv_timeout(Duration::from_millis(100)) {
            Ok(ev) => {
                if let Event::Control(s, Ok(_)) = &ev {
                    r.last_seen.insert(*s, Instant::now());
                }
                return Ok(ev);
            }
            Err(RecvTimeoutError::Timeout) => {
                let now = Instant::now();
                for s in expect_alive {
                    if r.exited.contains_key(s) {
                        continue;
                    }
                    let seen = *r.last_seen.entry(*s).or_insert(now);
                    if now.duration_since(seen) > timeout {
                        return Err(Failure::new(
                            1,
                            format!(
                                "k3-orch: stage {s} stopped answering (no heartbeat for {:.0} s); stopping the pipeline",
                                timeout.as_secs_f64()
                            ),
                        ));
                    }
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(Failure::new(1, "k3-orch: every stage connection is gone"))
            }
        }
    }
}

/// Turn an unexpected exit into a failure naming the stage and the cause.
fn exit_failure(r: &Running, e: &Exited) -> Failure {
    let stage = e.stage.clone();
    let mut msg = format!("k3-orch: stage {stage} (pid {}) {}", e.pid, e.cause);
    if let Some(cg) = &r.cgroups {
        if let Some(s) = Stage::parse(&stage) {
            if let Some(limit) = cg.oom_killed(s) {
                msg = format!(
                    "k3-orch: stage {stage} (pid {}) was killed by the kernel OOM killer at its memory limit of {} ({})",
                    e.pid,
                    crate::gen::plan::human(limit),
                    e.cause
                );
            }
        }
    }
    if matches!(e.cause, ExitCause::Code(0)) {
        msg.push_str(" before the run was finished");
    }
    Failure::new(1, msg)
}

fn handle_common(
    r: &mut Running,
    ev: Event,
    phase: &str,
) -> Result<Option<(Stage, Msg, Vec<OwnedFd>)>, Failure> {
    match ev {
        Event::Control(s, Ok((Msg::Pong { .. }, _))) => {
            let _ = s;
            Ok(None)
        }
        Event::Control(s, Ok((Msg::Error { stage, msg }, _))) => {
            let _ = s;
            Err(Failure::new(
                1,
                format!("k3-orch: stage {stage} failed: {msg}"),
            ))
        }
        Event::Control(s, Ok((m, fds))) => Ok(Some((s, m, fds))),
        Event::Control(s, Err(e)) => {
            // The control socket closed: the exit event (process mode) says why; give it a
            // moment to arrive.
            let deadline = Instant::now() + Duration::from_millis(500);
            while Instant::now() < deadline {
                if let Ok(Event::Exit(x)) = r.events.recv_timeout(Duration::from_millis(50)) {
                    let f = exit_failure(r, &x);
                    r.exited.insert(s, x);
                    return Err(f);
                }
            }
            Err(Failure::new(
                1,
                format!("k3-orch: stage {s} closed its control socket {phase}: {e}"),
            ))
        }
        Event::Exit(x) => {
            let f = exit_failure(r, &x);
            if let Some(s) = Stage::parse(&x.stage) {
                r.exited.insert(s, x);
            }
            Err(f)
        }
    }
}

fn link_region(id: u32, a: Stage, b: Stage) -> Result<Region, Failure> {
    ShmTransport::create_region(id, &format!("link-{a}-{b}"), &link::link_ring())
        .map_err(|e| Failure::new(1, format!("k3-orch: link region {a}<->{b}: {e}")))
}

/// Run the pipeline; on success the outcome, else a failure with its exit code. Stages are
/// always stopped and reaped before this returns.
pub fn run(launch: &Launch) -> Result<Outcome, Failure> {
    supervisor::install_interrupt_handler();
    let t_start = Instant::now();
    let mut r = spawn_all(launch)?;
    let res = drive(launch, &mut r);
    match res {
        Ok(mut out) => {
            // Wait for every stage to finish on its own, then collect what they used.
            if r.watcher.is_some() {
                let deadline = Instant::now() + Duration::from_secs(10);
                while r.exited.len() < Stage::WORKERS.len() && Instant::now() < deadline {
                    if let Ok(Event::Exit(x)) = r.events.recv_timeout(Duration::from_millis(50)) {
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
            for (s, h) in r.threads.drain(..) {
                match h.join() {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(Failure::new(1, format!("k3-orch: stage {s}: {e}"))),
                    Err(_) => return Err(Failure::new(1, format!("k3-orch: stage {s} panicked"))),
                }
            }
            for (s, x) in &r.exited {
                out.peak_rss.insert(s.name().to_string(), x.peak_rss_bytes);
                if x.cause != ExitCause::Code(0) {
                    return Err(Failure::new(
                        1,
                        format!("k3-orch: stage {s} {} at shutdown", x.cause),
                    ));
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

fn drive(launch: &Launch, r: &mut Running) -> Result<Outcome, Failure> {
    let timeout = launch.stage_timeout;
    let all = Stage::WORKERS;
    // 1. Hello from everyone.
    let mut hello: HashMap<Stage, u32> = HashMap::new();
    while hello.len() < all.len() {
        let ev = next_event(r, timeout, &all)?;
        if let Some((s, m, _)) = handle_common(r, ev, "during start-up")? {
            match m {
                Msg::Hello {
                    stage,
                    pid,
                    version,
                } if stage == s => {
                    if version != k3_protocol::messages::PROTOCOL_VERSION {
                        return Err(Failure::new(
                            1,
                            format!("k3-orch: {s} speaks protocol {version}"),
                        ));
                    }
                    hello.insert(s, pid);
                }
                other => {
                    return Err(Failure::new(
                        1,
                        format!("k3-orch: {s} sent {other:?} before Hello"),
                    ))
                }
            }
        }
    }
    let peer_pid = |s: Stage| -> u32 {
        if launch.mode == Mode::Processes {
            hello[&s]
        } else {
            0
        }
    };
    // 2. Links: compute is side A of each.
    for (link_id, peer) in
        (1u32..).zip([Stage::TrunkLoader, Stage::ExpertFetcher, Stage::Tokenizer])
    {
        let region = link_region(link_id, Stage::LayerCompute, peer)?;
        r.send(
            Stage::LayerCompute,
            &Msg::Region {
                id: link_id,
                role: RegionRole::Link {
                    peer,
                    side: Side::A,
                    peer_pid: peer_pid(peer),
                },
            },
            &[region.fd()],
        )?;
        r.send(
            peer,
            &Msg::Region {
                id: link_id,
                role: RegionRole::Link {
                    peer: Stage::LayerCompute,
                    side: Side::B,
                    peer_pid: peer_pid(Stage::LayerCompute),
                },
            },
            &[region.fd()],
        )?;
    }
    // 3. Configure the servers; collect their data regions.
    let json = |v: &dyn erased::Json| v.json();
    r.send(
        Stage::Tokenizer,
        &Msg::Configure {
            json: json(&launch.tokenizer),
        },
        &[],
    )?;
    r.send(
        Stage::TrunkLoader,
        &Msg::Configure {
            json: json(&launch.trunk),
        },
        &[],
    )?;
    r.send(
        Stage::ExpertFetcher,
        &Msg::Configure {
            json: json(&launch.fetcher),
        },
        &[],
    )?;
    let mut ready: Vec<Stage> = Vec::new();
    let mut data: Vec<(u32, String, OwnedFd)> = Vec::new();
    while ready.len() < 3 {
        let ev = next_event(r, timeout, &all)?;
        if let Some((s, m, mut fds)) = handle_common(r, ev, "during set-up")? {
            match m {
                Msg::Ready { stage } if stage == s => ready.push(s),
                Msg::Region {
                    id,
                    role: RegionRole::Data { name },
                } => {
                    let fd = fds.pop().ok_or_else(|| {
                        Failure::new(
                            1,
                            format!("k3-orch: {s} announced region {name} without its fd"),
                        )
                    })?;
                    data.push((id, name, fd));
                }
                other => {
                    return Err(Failure::new(
                        1,
                        format!("k3-orch: {s} sent {other:?} during set-up"),
                    ))
                }
            }
        }
    }
    // 4. The prompt.
    let mut compute = launch.compute.clone();
    if let Some(req) = &launch.prompt {
        r.send(Stage::Tokenizer, req, &[])?;
        loop {
            let ev = next_event(r, timeout, &all)?;
            if let Some((s, m, _)) = handle_common(r, ev, "while encoding the prompt")? {
                match m {
                    Msg::Ids { ids, .. } if s == Stage::Tokenizer => {
                        compute.prompt_ids = ids;
                        break;
                    }
                    other => {
                        return Err(Failure::new(
                            1,
                            format!("k3-orch: {s} sent {other:?} while encoding"),
                        ))
                    }
                }
            }
        }
    }
    if compute.prompt_ids.is_empty() {
        return Err(Failure::new(2, "k3-orch: the prompt encodes to no tokens"));
    }
    if compute.prompt_ids.len() > crate::gen::args::MAX_PROMPT {
        return Err(Failure::new(
            2,
            format!(
                "k3-orch: the prompt is {} tokens, over the {}-token limit",
                compute.prompt_ids.len(),
                crate::gen::args::MAX_PROMPT
            ),
        ));
    }
    // 5. Compute: data regions, configuration, go.
    for (id, name, fd) in &data {
        r.send(
            Stage::LayerCompute,
            &Msg::Region {
                id: *id,
                role: RegionRole::Data { name: name.clone() },
            },
            &[fd.as_fd()],
        )?;
    }
    drop(data);
    r.send(
        Stage::LayerCompute,
        &Msg::Configure {
            json: json(&compute),
        },
        &[],
    )?;
    loop {
        let ev = next_event(r, timeout, &all)?;
        if let Some((s, m, _)) = handle_common(r, ev, "during set-up")? {
            match m {
                Msg::Ready { stage } if stage == s && s == Stage::LayerCompute => break,
                other => {
                    return Err(Failure::new(
                        1,
                        format!("k3-orch: {s} sent {other:?} during set-up"),
                    ))
                }
            }
        }
    }
    for s in all {
        r.send(
            s,
            &Msg::Ready {
                stage: Stage::Orchestrator,
            },
            &[],
        )?;
    }
    // 6. Generation.
    let mut out = Outcome {
        prompt_ids: compute.prompt_ids.clone(),
        ..Default::default()
    };
    if !launch.quiet {
        println!("{}", crate::gen::report::step_header());
    }
    let mut finished = false;
    let mut summaries_left: Vec<Stage> = all.to_vec();
    summaries_left.retain(|s| *s != Stage::LayerCompute);
    while !(finished && summaries_left.is_empty()) {
        // Compute must stay alive until Finished; the others until their Summary.
        let alive: Vec<Stage> = all
            .iter()
            .copied()
            .filter(|s| {
                if *s == Stage::LayerCompute {
                    !finished
                } else {
                    summaries_left.contains(s)
                }
            })
            .collect();
        let ev = next_event(r, timeout, &alive)?;
        // After Finished, compute exits on its own; a clean exit is expected then.
        if let Event::Exit(x) = &ev {
            if let Some(s) = Stage::parse(&x.stage) {
                let done = (s == Stage::LayerCompute && finished)
                    || (s != Stage::LayerCompute && !summaries_left.contains(&s));
                if done && x.cause == ExitCause::Code(0) {
                    r.exited.insert(s, x.clone());
                    continue;
                }
            }
        }
        if let Event::Control(s, Err(_)) = &ev {
            let done = (*s == Stage::LayerCompute && finished)
                || (*s != Stage::LayerCompute && !summaries_left.contains(s));
            if done {
                continue;
            }
        }
        let Some((s, m, _)) = handle_common(r, ev, "during generation")? else {
            continue;
        };
        match m {
            Msg::StepStats(st) => {
                if !launch.quiet {
                    println!(
                        "{}",
                        crate::gen::report::step_line(&crate::gen::to_step_report(&st))
                    );
                }
                out.steps.push(st);
            }
            Msg::Text { bytes } => out.text.extend_from_slice(&bytes),
            Msg::Finished { generated } => {
                out.generated = generated;
                finished = true;
            }
            Msg::Summary { stage, json } => {
                summaries_left.retain(|x| *x != stage);
                out.summaries.insert(
                    stage.name().to_string(),
                    serde_json::from_str(&json).unwrap_or(serde_json::Value::String(json)),
                );
            }
            other => {
                return Err(Failure::new(
                    1,
                    format!("k3-orch: {s} sent {other:?} during generation"),
                ))
            }
        }
    }
    Ok(out)
}

mod erased {
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

/// The body of `k3-orch stage <name>`: take the control socket from the environment.
pub fn stage_process(name: &str) -> i32 {
    let Some(stage) = Stage::parse(name).filter(|s| *s != Stage::Orchestrator) else {
        eprintln!("k3-orch stage: unknown stage '{name}' (tokenizer, trunk-loader, expert-fetcher, layer-compute)");
        return 2;
    };
    let control = match ControlSocket::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("k3-orch stage {name}: {e} (stages are started by k3-orch, not by hand)");
            return 2;
        }
    };
    if let Err(e) = limits::apply_numa_from_env() {
        eprintln!("k3-orch stage {name}: numa: {e}");
        return 1;
    }
    match stage_main(stage, control) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}
