//! Starting, watching and stopping the stage processes.
//!
//! Each stage is this same binary re-executed as `k3-orch stage <name>`, with its end of a
//! control socketpair on fd 3. A watcher thread reaps children as they exit; an exit the
//! orchestrator did not ask for is a fault that names the stage and its exit status or
//! signal. Children get `PR_SET_PDEATHSIG = SIGKILL`, so they cannot outlive an
//! orchestrator that is killed itself; on any fault every remaining stage is killed and
//! reaped before k3-orch exits, so no process is left behind.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::mpsc::Sender;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use std::time::Instant;

use k3_protocol::control::{self, ControlSocket};
use k3_protocol::messages::{Msg, Stage};

use super::cgroup::StageCgroups;
use super::error::{SpawnError, SuperviseError};
use super::numa::{numa_plan, NUMA_ENV};
use super::{stage_main, Launch, Mode};

/// The fd number a stage process finds its control socket on.
pub const CONTROL_FD: i32 = 3;

/// How a child ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExitCause {
    Code(i32),
    Signal(i32),
}

impl std::fmt::Display for ExitCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitCause::Code(c) => write!(f, "exited with status {c}"),
            ExitCause::Signal(s) => write!(f, "was killed by signal {s} ({})", signal_name(*s)),
        }
    }
}

/// Conventional name of a signal number.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGINT => "SIGINT",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGSTOP => "SIGSTOP",
        _ => "signal",
    }
}

/// A child that ended, with its resource usage.
#[derive(Clone, Debug)]
pub struct Exited {
    pub stage: String,
    pub pid: u32,
    pub cause: ExitCause,
    /// ru_maxrss of the child, in bytes.
    pub peak_rss_bytes: u64,
}

/// One running stage process.
#[derive(Debug)]
pub struct Child {
    pub stage: String,
    pub pid: u32,
}

/// Spawn `exe stage <name> [extra...]` with `control` (the stage's end) as its fd 3.
pub fn spawn_stage(
    exe: &std::path::Path,
    name: &str,
    control: k3_protocol::control::ControlSocket,
    prepare: impl FnOnce(&mut Command) -> Result<(), SpawnError>,
) -> Result<Child, SpawnError> {
    let mut cmd = Command::new(exe);
    cmd.arg("stage").arg(name);
    prepare(&mut cmd)?;
    cmd.stdin(Stdio::null());
    cmd.env("K3_CONTROL_FD", CONTROL_FD.to_string());
    let raw = control.fd().as_raw_fd();
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: dup2, fcntl, prctl, signal and getppid are. `raw`
    // is a valid open descriptor in the parent at fork time, so it is valid in the child too.
    unsafe {
        cmd.pre_exec(move || {
            // A terminal's Ctrl-C goes to its whole foreground process group, the stages
            // included: the stages ignore it (an ignored signal stays ignored across exec),
            // and k3-orch decides what it stops (`chat`: only the reply; a run: everything,
            // cleanly).
            libc::signal(libc::SIGINT, libc::SIG_IGN);
            if libc::dup2(raw, CONTROL_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // dup2 clears FD_CLOEXEC on the new descriptor unless raw == 3 already.
            let fl = libc::fcntl(CONTROL_FD, libc::F_GETFD);
            libc::fcntl(CONTROL_FD, libc::F_SETFD, fl & !libc::FD_CLOEXEC);
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect.
            if libc::getppid() == 1 {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    drop(control);
    Ok(Child {
        stage: name.to_string(),
        pid: child.id(),
    })
}

/// Reaps the stage processes in the background and reports each exit on a channel.
pub struct Watcher {
    children: Arc<Mutex<Vec<Child>>>,
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Watcher {
    /// Start watching `children`; every exit is sent to `tx` (then the child is forgotten).
    pub fn start<E: From<Exited> + Send + 'static>(children: Vec<Child>, tx: Sender<E>) -> Watcher {
        let children = Arc::new(Mutex::new(children));
        let stop = Arc::new(AtomicBool::new(false));
        let (c2, s2) = (children.clone(), stop.clone());
        let handle = std::thread::Builder::new()
            .name("k3-watcher".into())
            .spawn(move || loop {
                let mut exited = Vec::new();
                {
                    let mut list = c2.lock().unwrap_or_else(|e| e.into_inner());
                    list.retain(|c| match try_reap(c.pid) {
                        Some((cause, rss)) => {
                            exited.push(Exited {
                                stage: c.stage.clone(),
                                pid: c.pid,
                                cause,
                                peak_rss_bytes: rss,
                            });
                            false
                        }
                        None => true,
                    });
                }
                for e in exited {
                    let _ = tx.send(E::from(e));
                }
                if s2.load(Ordering::Relaxed) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            })
            .expect("spawn watcher thread");
        Watcher {
            children,
            stop,
            handle: Some(handle),
        }
    }

    /// Pids of the children not yet reaped.
    pub fn alive(&self) -> Vec<(String, u32)> {
        self.children
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|c| (c.stage.clone(), c.pid))
            .collect()
    }

    /// Send `sig` to every child still alive.
    pub fn signal_all(&self, sig: i32) {
        for (_, pid) in self.alive() {
            // SAFETY: kill(2) with a pid we spawned and have not reaped yet, so it cannot
            // have been reused by an unrelated process.
            unsafe {
                libc::kill(pid as i32, sig);
            }
        }
    }

    /// Wait until every child has been reaped, or `timeout` passes.
    pub fn wait_all(&self, timeout: Duration) -> bool {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < timeout {
            if self.alive().is_empty() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.alive().is_empty()
    }

    /// A handle that can kill the children from another thread (see [`Killer`]).
    pub fn killer(&self) -> Killer {
        Killer {
            children: self.children.clone(),
        }
    }

    /// Kill everything still running (SIGTERM, a grace period, then SIGKILL) and reap it.
    pub fn kill_all(&self, grace: Duration) {
        self.signal_all(libc::SIGTERM);
        if !self.wait_all(grace) {
            self.signal_all(libc::SIGKILL);
            self.wait_all(Duration::from_secs(5));
        }
    }
}

/// Kills a [`Watcher`]'s children from any thread (a server's shutdown deadline, while the
/// thread that owns the pipeline may be blocked). The children are signalled under the
/// watcher's lock, so a pid is never one the watcher has already reaped (and the system
/// may have reused).
#[derive(Clone)]
pub struct Killer {
    children: Arc<Mutex<Vec<Child>>>,
}

impl Killer {
    /// SIGKILL every child not reaped yet, then wait up to `wait` for the watcher to reap
    /// them (it reports each exit as usual); true when none is left.
    pub fn kill_now(&self, wait: Duration) -> bool {
        let t0 = Instant::now();
        {
            let list = self.children.lock().unwrap_or_else(|e| e.into_inner());
            for c in list.iter() {
                // SAFETY: kill(2) on a child that has not been reaped (the watcher reaps
                // under this lock), so the pid is still ours.
                unsafe {
                    libc::kill(c.pid as i32, libc::SIGKILL);
                }
            }
        }
        loop {
            if self
                .children
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
            {
                return true;
            }
            if t0.elapsed() >= wait {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.kill_all(Duration::from_millis(500));
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Non-blocking reap of one pid: its cause of exit and peak RSS, or None if still running.
fn try_reap(pid: u32) -> Option<(ExitCause, u64)> {
    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 writes only through the two valid pointers we pass.
    let r = unsafe { libc::wait4(pid as i32, &mut status, libc::WNOHANG, &mut ru) };
    if r != pid as i32 {
        return None;
    }
    let cause = if libc::WIFSIGNALED(status) {
        ExitCause::Signal(libc::WTERMSIG(status))
    } else {
        ExitCause::Code(libc::WEXITSTATUS(status))
    };
    Some((cause, ru.ru_maxrss.max(0) as u64 * 1024))
}

/// Peak RSS of this process so far, in bytes (getrusage).
pub fn self_peak_rss() -> u64 {
    // SAFETY: an all-zero rusage is valid; getrusage only writes through the pointer.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: see above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    ru.ru_maxrss.max(0) as u64 * 1024
}

/// Set by the SIGINT/SIGTERM handler; the orchestrator's loops poll it.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The signal that interrupted the run (0 while none has).
static INTERRUPT_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    INTERRUPT_SIGNAL.store(sig, Ordering::SeqCst);
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// The exit code of a run stopped by a signal: the shell's 128 + signal number, so SIGINT
/// exits 130 and SIGTERM 143 (a SIGTERM that exited 130 would read as a Ctrl-C).
pub fn interrupted_exit_code() -> i32 {
    match INTERRUPT_SIGNAL.load(Ordering::SeqCst) {
        0 => 128 + libc::SIGINT,
        s => 128 + s,
    }
}

/// Route SIGINT and SIGTERM to `INTERRUPTED` so a Ctrl-C shuts the stages down cleanly.
pub fn install_interrupt_handler() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

/// What the orchestrator's loop waits on from the stages: a control message (or a broken
/// control socket), or a stage process that exited. (`serve::engine::Event` is what a serve
/// job reports.)
pub(super) enum StageEvent {
    Control(Stage, Result<(Msg, Vec<OwnedFd>), control::ControlError>),
    Exit(Exited),
}

impl From<Exited> for StageEvent {
    fn from(e: Exited) -> StageEvent {
        StageEvent::Exit(e)
    }
}

pub(super) struct Running {
    pub(super) controls: HashMap<Stage, Arc<ControlSocket>>,
    pub(super) watcher: Option<Watcher>,
    pub(super) threads: Vec<(
        Stage,
        std::thread::JoinHandle<Result<(), k3_protocol::failure::StageFailure>>,
    )>,
    pub(super) events: Receiver<StageEvent>,
    pub(super) pids: HashMap<Stage, u32>,
    pub(super) last_seen: HashMap<Stage, Instant>,
    pub(super) exited: HashMap<Stage, Exited>,
    pub(super) cgroups: Option<StageCgroups>,
    pub(super) notes: Vec<String>,
    pub(super) numa: HashMap<Stage, u32>,
    pub(super) progress: super::progress::Progress,
}

impl Running {
    pub(super) fn kill_all(&mut self) {
        if let Some(w) = &self.watcher {
            w.kill_all(Duration::from_millis(300));
        }
        // Threads end when their control sockets close (the Running value is dropped).
    }

    pub(super) fn send(
        &self,
        s: Stage,
        m: &Msg,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<(), SuperviseError> {
        self.controls[&s]
            .send(m, fds)
            .map_err(|source| SuperviseError::Send { stage: s, source })
    }
}

pub(super) fn spawn_all(launch: &Launch) -> Result<Running, SuperviseError> {
    let (tx, rx) = channel::<StageEvent>();
    let mut controls = HashMap::new();
    let mut children = Vec::new();
    let mut threads = Vec::new();
    let mut notes = Vec::new();
    let exe = std::env::current_exe().map_err(SuperviseError::OwnBinary)?;
    let mut cgroups = None;
    let mut numa_nodes = HashMap::new();
    if launch.mode == Mode::Processes {
        match StageCgroups::create(&launch.budgets) {
            Ok(cg) => cgroups = Some(cg),
            Err(why) => {
                if launch.require_cgroups {
                    return Err(SuperviseError::CgroupsRequired(why));
                }
                let n = format!("running without per-stage memory cgroups: {why}");
                tracing::warn!("k3-orch: note: {n}");
                notes.push(n);
            }
        }
        let (map, ns) = numa_plan(launch.numa.as_deref(), &launch.trunk.model_dir)
            .map_err(SuperviseError::Numa)?;
        numa_nodes = map;
        notes.extend(ns);
    } else if launch.numa.is_some() {
        notes.push("numa: --inproc runs every stage in one process; --numa is ignored".into());
    }
    for stage in Stage::WORKERS {
        let (ours, theirs) =
            control::pair().map_err(|source| SuperviseError::ControlPair { stage, source })?;
        match launch.mode {
            Mode::Processes => {
                let cg = cgroups.as_ref();
                let node = numa_nodes.get(&stage).copied();
                let child = spawn_stage(&exe, stage.name(), theirs, |cmd| {
                    // K3_NUMA_NODE is internal: set per stage from the plan, and never
                    // inherited from the user's shell (a stray value would bind every stage
                    // even with --numa off).
                    match node {
                        Some(n) => cmd.env(NUMA_ENV, n.to_string()),
                        None => cmd.env_remove(NUMA_ENV),
                    };
                    match cg {
                        Some(cg) => Ok(cg.join_on_spawn(stage, cmd)?),
                        None => Ok(()),
                    }
                })
                .map_err(|source| SuperviseError::Spawn { stage, source })?;
                children.push(child);
            }
            Mode::Threads => {
                let h = std::thread::Builder::new()
                    .name(format!("k3-{stage}"))
                    .spawn(move || stage_main(stage, theirs))
                    .map_err(|e| SuperviseError::Spawn {
                        stage,
                        source: e.into(),
                    })?;
                threads.push((stage, h));
            }
        }
        let ours = Arc::new(ours);
        let (c2, tx2) = (ours.clone(), tx.clone());
        std::thread::Builder::new()
            .name(format!("k3-ctl-{stage}"))
            .spawn(move || loop {
                let r = c2.recv(None);
                let stop = r.is_err();
                if tx2.send(StageEvent::Control(stage, r)).is_err() || stop {
                    break;
                }
            })
            .map_err(SuperviseError::ControlReader)?;
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
        progress: super::progress::Progress::new(launch.progress),
    })
}
