//! Memory cgroups for the stage processes: the kernel interfaces, v2 and v1.
//!
//! [`probe`] finds where memory cgroups can be created, or says plainly why they cannot
//! (no memory controller mounted, it is bound to the other hierarchy, no permission, a
//! read-only cgroup file system...). It prefers cgroup v2 when its memory controller is
//! available there, and falls back to the v1 memory hierarchy (the only one on this
//! project's machines, which have no systemd).
//!
//! [`RunCgroups::create`] makes `k3-<pid>/` under this process's own memory cgroup (so every
//! stage limit nests inside whatever limit we run under) and [`RunCgroups::add_stage`] one
//! child group per stage with its budget and swap off:
//!
//! | | v1 (`/sys/fs/cgroup/memory/...`) | v2 |
//! |---|---|---|
//! | budget | `memory.limit_in_bytes` | `memory.max` |
//! | swap off | `memory.memsw.limit_in_bytes` = budget (when swap accounting exists), `memory.swappiness` = 0 | `memory.swap.max` = 0 |
//! | peak | `memory.max_usage_in_bytes` | `memory.peak` (Linux 5.19+) |
//! | OOM kill | `oom_kill N` in `memory.oom_control` | `oom_kill N` in `memory.events` |
//! | limit hits | `memory.failcnt` | `max N` in `memory.events` |
//!
//! A process joins its group either from the orchestrator ([`StageGroup::move_pid`]) or,
//! better, before it runs any code of its own ([`StageGroup::join_on_spawn`]: the child writes
//! `0` to `cgroup.procs` between fork and exec, so even its first page is charged there).
//!
//! Dropping [`RunCgroups`] removes the groups (after their processes are gone; it retries
//! briefly while the kernel finishes tearing the last task down).

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k3_protocol::messages::Stage;

/// Why memory cgroups cannot be used, or an operation on one failed. Each message names
/// the file or directory and the cause.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("this process is in no cgroup v2 hierarchy")]
    NoV2Group,
    #[error("this process is in no cgroup v1 hierarchy with the {0} controller")]
    NoV1Group(&'static str),
    #[error("our {}cgroup {cgroup} is outside the {}mount at {}",
        if *v1 { "memory " } else { "" }, if *v1 { "" } else { "v2 " }, mount.display())]
    OutsideMount {
        cgroup: String,
        mount: PathBuf,
        v1: bool,
    },
    #[error("cannot create a cgroup under {}: {source}{}", dir.display(), trial_hint(source))]
    Trial {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cgroup v2 is mounted at {} but its memory controller is not available there (it is \
         bound to a v1 hierarchy)",
        .0.display()
    )]
    NoV2Memory(PathBuf),
    #[error("no cgroup v1 hierarchy with the memory controller is mounted")]
    NoV1Memory,
    /// What one interface said when it was tried.
    #[error("{version}: {source}")]
    In {
        version: Version,
        #[source]
        source: Box<CgroupError>,
    },
    /// Neither interface can be used: why, for each.
    #[error("{}", join(.0))]
    Unavailable(Vec<CgroupError>),
    #[error("cannot open {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing {value:?} to {}: {source}", path.display())]
    Write {
        path: PathBuf,
        value: String,
        #[source]
        source: std::io::Error,
    },
    #[error("bad cgroup name {0:?}")]
    BadName(String),
    #[error("bad cgroup stage name {0:?}")]
    BadStageName(String),
    #[error("cgroup for stage {0} exists already")]
    Exists(String),
    #[error("cannot create cgroup {}: {source}", dir.display())]
    Create {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot remove cgroup {}: {source}", dir.display())]
    Remove {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Several groups could not be removed.
    #[error("{}", join(.0))]
    Several(Vec<CgroupError>),
    #[error("no cgroup for {0}")]
    NoGroup(Stage),
}

/// Errors one after another, `; ` between them.
fn join(errors: &[CgroupError]) -> String {
    errors
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

/// What a failed trial `mkdir` usually means.
fn trial_hint(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => " (needs root or a delegated cgroup)",
        Some(libc::EROFS) => {
            " (the cgroup file system is mounted read-only, as in many containers)"
        }
        _ => "",
    }
}

/// One error for `errors` (none: Ok).
fn all_or_nothing(errors: Vec<CgroupError>) -> Result<(), CgroupError> {
    if errors.is_empty() {
        Ok(())
    } else {
        Err(CgroupError::Several(errors))
    }
}

/// Which cgroup interface is in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Version::V1 => "cgroup v1",
            Version::V2 => "cgroup v2",
        })
    }
}

/// Where stage groups can be created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Support {
    pub version: Version,
    /// This process's own memory cgroup directory; run groups are created inside it.
    pub parent: PathBuf,
    /// v1: swap accounting is on (`memory.memsw.*` exists), so swap can be limited.
    /// v2: `memory.swap.max` exists.
    pub swap_control: bool,
}

/// One line of `/proc/self/mountinfo` that matters here.
#[derive(Debug)]
struct Mount {
    root: String,
    point: PathBuf,
    fstype: String,
    super_opts: String,
}

fn read(path: &str) -> Result<String, CgroupError> {
    fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.into(),
        source,
    })
}

fn mounts() -> Result<Vec<Mount>, CgroupError> {
    let text = read("/proc/self/mountinfo")?;
    let mut out = Vec::new();
    for line in text.lines() {
        // id parent major:minor root mount-point opts [optional...] - fstype source super-opts
        let Some((pre, post)) = line.split_once(" - ") else {
            continue;
        };
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        if pre.len() < 5 || post.len() < 3 {
            continue;
        }
        out.push(Mount {
            root: unescape(pre[3]),
            point: PathBuf::from(unescape(pre[4])),
            fstype: post[0].to_string(),
            super_opts: post[2].to_string(),
        });
    }
    Ok(out)
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// This process's cgroup path in the hierarchy that has `controller` (v1), or in the unified
/// hierarchy (`controller == None`), from `/proc/self/cgroup`.
fn own_cgroup(controller: Option<&'static str>) -> Result<String, CgroupError> {
    let text = read("/proc/self/cgroup")?;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let hit = match controller {
            None => id == "0" && ctrls.is_empty(),
            Some(c) => ctrls.split(',').any(|x| x == c),
        };
        if hit {
            return Ok(path.to_string());
        }
    }
    Err(match controller {
        None => CgroupError::NoV2Group,
        Some(c) => CgroupError::NoV1Group(c),
    })
}

/// Map a cgroup path (as in /proc/self/cgroup) to a directory under a mount of that hierarchy.
fn dir_for(m: &Mount, cg: &str) -> Option<PathBuf> {
    let rel = if m.root == "/" {
        cg
    } else if cg == m.root {
        "/"
    } else {
        cg.strip_prefix(&m.root).filter(|r| r.starts_with('/'))?
    };
    Some(m.point.join(rel.trim_start_matches('/')))
}

/// Try to create and remove a scratch group in `dir`; Err says why it failed.
fn trial_mkdir(dir: &Path) -> Result<(), CgroupError> {
    let probe = dir.join(format!("k3-probe-{}", std::process::id()));
    match fs::create_dir(&probe) {
        Ok(()) => {
            let _ = fs::remove_dir(&probe);
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let _ = fs::remove_dir(&probe);
            Ok(())
        }
        Err(source) => Err(CgroupError::Trial {
            dir: dir.to_path_buf(),
            source,
        }),
    }
}

/// Find where per-stage memory cgroups can be created, or say why they cannot.
pub fn probe() -> Result<Support, CgroupError> {
    let within = |version| {
        move |e| CgroupError::In {
            version,
            source: Box::new(e),
        }
    };
    let ms = mounts()?;
    let mut why = Vec::new();
    // v2 first, when its memory controller is there.
    if let Some(m) = ms.iter().find(|m| m.fstype == "cgroup2") {
        let ctrls = fs::read_to_string(m.point.join("cgroup.controllers")).unwrap_or_default();
        if ctrls.split_whitespace().any(|c| c == "memory") {
            match own_cgroup(None).and_then(|cg| {
                dir_for(m, &cg).ok_or_else(|| CgroupError::OutsideMount {
                    mount: m.point.clone(),
                    cgroup: cg,
                    v1: false,
                })
            }) {
                Ok(parent) => match trial_mkdir(&parent) {
                    Ok(()) => {
                        return Ok(Support {
                            version: Version::V2,
                            swap_control: parent.join("memory.swap.max").exists()
                                || parent == m.point,
                            parent,
                        })
                    }
                    Err(e) => why.push(within(Version::V2)(e)),
                },
                Err(e) => why.push(within(Version::V2)(e)),
            }
        } else {
            why.push(CgroupError::NoV2Memory(m.point.clone()));
        }
    }
    match ms
        .iter()
        .find(|m| m.fstype == "cgroup" && m.super_opts.split(',').any(|o| o == "memory"))
    {
        Some(m) => match own_cgroup(Some("memory")).and_then(|cg| {
            dir_for(m, &cg).ok_or_else(|| CgroupError::OutsideMount {
                mount: m.point.clone(),
                cgroup: cg,
                v1: true,
            })
        }) {
            Ok(parent) => match trial_mkdir(&parent) {
                Ok(()) => {
                    return Ok(Support {
                        version: Version::V1,
                        swap_control: parent.join("memory.memsw.limit_in_bytes").exists(),
                        parent,
                    })
                }
                Err(e) => why.push(within(Version::V1)(e)),
            },
            Err(e) => why.push(within(Version::V1)(e)),
        },
        None => why.push(CgroupError::NoV1Memory),
    }
    Err(CgroupError::Unavailable(why))
}

fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|source| CgroupError::Open {
            path: path.to_path_buf(),
            source,
        })?;
    f.write_all(value.as_bytes())
        .map_err(|source| CgroupError::Write {
            path: path.to_path_buf(),
            value: value.to_string(),
            source,
        })
}

fn read_u64(path: &Path) -> Option<u64> {
    let s = fs::read_to_string(path).ok()?;
    let s = s.trim();
    if s == "max" {
        return Some(u64::MAX);
    }
    s.parse().ok()
}

/// Value of `key N` in a flat keyed file (memory.events, memory.oom_control).
fn keyed(path: &Path, key: &str) -> Option<u64> {
    fs::read_to_string(path).ok()?.lines().find_map(|l| {
        l.strip_prefix(key)
            .and_then(|r| r.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// One stage's memory cgroup.
#[derive(Debug)]
pub struct StageGroup {
    name: String,
    dir: PathBuf,
    limit: u64,
    version: Version,
    swap_off: bool,
}

impl StageGroup {
    /// Stage name the group was created for.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The group's directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }
    /// The memory limit, bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }
    /// Whether swap could be limited to nothing for this group (v1 needs swap accounting).
    pub fn swap_off(&self) -> bool {
        self.swap_off
    }

    /// Move process `pid` (all its threads) into the group.
    pub fn move_pid(&self, pid: u32) -> Result<(), CgroupError> {
        write_file(&self.dir.join("cgroup.procs"), &pid.to_string())
    }

    /// Make the process `cmd` starts join this group before it executes anything: the child
    /// writes `0` (itself) to the group's `cgroup.procs` between fork and exec.
    pub fn join_on_spawn(&self, cmd: &mut Command) -> Result<(), CgroupError> {
        let path = self.dir.join("cgroup.procs");
        let f = fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|source| CgroupError::Open { path, source })?;
        let fd = OwnedFd::from(f);
        // SAFETY: the closure runs in the forked child before exec and only calls write(2),
        // which is async-signal-safe; it allocates nothing. The fd stays open in the parent
        // for as long as `cmd` (which owns the closure) lives and is close-on-exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(cmd, move || {
                let raw = fd.as_raw_fd();
                if libc::write(raw, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// Highest memory use recorded for the group (None where the kernel has no peak file).
    pub fn peak_bytes(&self) -> Option<u64> {
        match self.version {
            Version::V1 => read_u64(&self.dir.join("memory.max_usage_in_bytes")),
            Version::V2 => read_u64(&self.dir.join("memory.peak")),
        }
    }

    /// Current memory use.
    pub fn usage_bytes(&self) -> Option<u64> {
        match self.version {
            Version::V1 => read_u64(&self.dir.join("memory.usage_in_bytes")),
            Version::V2 => read_u64(&self.dir.join("memory.current")),
        }
    }

    /// Processes the kernel's OOM killer killed in this group.
    pub fn oom_kills(&self) -> u64 {
        match self.version {
            Version::V1 => keyed(&self.dir.join("memory.oom_control"), "oom_kill"),
            Version::V2 => keyed(&self.dir.join("memory.events"), "oom_kill"),
        }
        .unwrap_or(0)
    }

    /// Times usage hit the limit (v1 `memory.failcnt` / `memory.memsw.failcnt`, v2 `max`
    /// events).
    pub fn limit_hits(&self) -> u64 {
        match self.version {
            // With memsw == limit the memory+swap counter is the one that fails first.
            Version::V1 => read_u64(&self.dir.join("memory.failcnt"))
                .max(read_u64(&self.dir.join("memory.memsw.failcnt"))),
            Version::V2 => keyed(&self.dir.join("memory.events"), "max"),
        }
        .unwrap_or(0)
    }

    /// Pids currently in the group.
    pub fn pids(&self) -> Vec<u32> {
        fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

/// The groups of one run: `k3-<pid>/<stage>` under this process's memory cgroup.
#[derive(Debug)]
pub struct RunCgroups {
    support: Support,
    dir: PathBuf,
    stages: Vec<StageGroup>,
}

/// Run groups (`k3-<pid>/`) under `parent` whose k3-orch is gone: what a SIGKILLed run
/// leaves behind (its stages died with it; the groups did not).
pub fn dead_runs(parent: &Path) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let pid: u32 = name.strip_prefix("k3-")?.parse().ok()?;
            let alive = Path::new(&format!("/proc/{pid}")).exists();
            (!alive && pid != std::process::id() && e.path().is_dir()).then(|| e.path())
        })
        .collect();
    out.sort();
    out
}

/// Remove the groups of dead runs that hold no process (a group with a live process is
/// left alone and reported). Returns (removed, kept with the reason).
pub fn sweep_dead_runs(parent: &Path) -> (Vec<PathBuf>, Vec<(PathBuf, String)>) {
    let mut removed = Vec::new();
    let mut kept = Vec::new();
    for run in dead_runs(parent) {
        let stages: Vec<PathBuf> = fs::read_dir(&run)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.is_dir())
                    .collect()
            })
            .unwrap_or_default();
        let busy = stages.iter().chain(std::iter::once(&run)).any(|g| {
            fs::read_to_string(g.join("cgroup.procs")).is_ok_and(|s| !s.trim().is_empty())
        });
        if busy {
            kept.push((run, "still holds processes".to_string()));
            continue;
        }
        let ok = stages.iter().all(|g| fs::remove_dir(g).is_ok()) && fs::remove_dir(&run).is_ok();
        if ok {
            removed.push(run);
        } else {
            kept.push((run, "could not be removed".to_string()));
        }
    }
    (removed, kept)
}

impl RunCgroups {
    /// Create the run directory `k3-<our pid>` (v2: with the memory controller enabled for
    /// its children).
    pub fn create(support: &Support) -> Result<RunCgroups, CgroupError> {
        let (removed, kept) = sweep_dead_runs(&support.parent);
        for r in &removed {
            tracing::info!("k3-orch: removed the cgroup of a dead run: {}", r.display());
        }
        for (r, why) in &kept {
            tracing::warn!("k3-orch: cgroup of a dead run {}: {why}", r.display());
        }
        Self::create_named(support, &format!("k3-{}", std::process::id()))
    }

    /// Like [`RunCgroups::create`] with an explicit directory name (one path component).
    pub fn create_named(support: &Support, name: &str) -> Result<RunCgroups, CgroupError> {
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            return Err(CgroupError::BadName(name.to_string()));
        }
        let dir = support.parent.join(name);
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(CgroupError::Create { dir, source }),
        }
        let run = RunCgroups {
            support: support.clone(),
            dir,
            stages: Vec::new(),
        };
        if support.version == Version::V2 {
            // Children of the run group need the memory controller enabled in it (and in
            // our own group, which must then hold no processes: true for the root only, or
            // for a delegated subtree set up that way).
            let _ = write_file(&support.parent.join("cgroup.subtree_control"), "+memory");
            write_file(&run.dir.join("cgroup.subtree_control"), "+memory")?;
        }
        Ok(run)
    }

    /// The run directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The interface in use.
    pub fn version(&self) -> Version {
        self.support.version
    }

    /// Create the group of `stage` with a memory limit of `limit_bytes` and swap off.
    pub fn add_stage(&mut self, stage: &str, limit_bytes: u64) -> Result<&StageGroup, CgroupError> {
        if stage.is_empty() || stage.contains('/') || stage.starts_with('.') {
            return Err(CgroupError::BadStageName(stage.to_string()));
        }
        if self.stages.iter().any(|s| s.name == stage) {
            return Err(CgroupError::Exists(stage.to_string()));
        }
        let dir = self.dir.join(stage);
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(CgroupError::Create { dir, source }),
        }
        let mut swap_off = false;
        match self.support.version {
            Version::V1 => {
                write_file(&dir.join("memory.limit_in_bytes"), &limit_bytes.to_string())?;
                let memsw = dir.join("memory.memsw.limit_in_bytes");
                if memsw.exists() {
                    write_file(&memsw, &limit_bytes.to_string())?;
                    swap_off = true;
                }
                // Best effort: the root group and some kernels refuse swappiness writes.
                let _ = write_file(&dir.join("memory.swappiness"), "0");
            }
            Version::V2 => {
                write_file(&dir.join("memory.max"), &limit_bytes.to_string())?;
                let swap = dir.join("memory.swap.max");
                if swap.exists() {
                    write_file(&swap, "0")?;
                    swap_off = true;
                }
            }
        }
        self.stages.push(StageGroup {
            name: stage.to_string(),
            dir,
            limit: limit_bytes,
            version: self.support.version,
            swap_off,
        });
        Ok(self.stages.last().expect("just pushed"))
    }

    /// The group of `stage`.
    pub fn stage(&self, stage: &str) -> Option<&StageGroup> {
        self.stages.iter().find(|s| s.name == stage)
    }

    /// All stage groups, in creation order.
    pub fn stages(&self) -> &[StageGroup] {
        &self.stages
    }

    /// Remove every group now (they must be empty of processes). Errors name the groups that
    /// could not be removed.
    pub fn remove(&mut self) -> Result<(), CgroupError> {
        let mut failed = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(2);
        for s in self.stages.drain(..).rev() {
            if let Err(e) = rmdir_retry(&s.dir, deadline) {
                failed.push(e);
            }
        }
        if self.dir.exists() {
            if let Err(e) = rmdir_retry(&self.dir, deadline) {
                failed.push(e);
            }
        }
        all_or_nothing(failed)
    }
}

fn rmdir_retry(dir: &Path, deadline: Instant) -> Result<(), CgroupError> {
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            // EBUSY while an exiting task is still being detached.
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(source) => {
                return Err(CgroupError::Remove {
                    dir: dir.to_path_buf(),
                    source,
                })
            }
        }
    }
}

impl Drop for RunCgroups {
    fn drop(&mut self) {
        let _ = self.remove();
    }
}

/// The cgroups of one run's stages (removed on drop, after the stages are gone).
pub struct StageCgroups {
    run: RunCgroups,
}

impl StageCgroups {
    /// One memory cgroup per stage with its budget and swap off.
    pub fn create(budgets: &HashMap<Stage, u64>) -> Result<StageCgroups, CgroupError> {
        let support = probe()?;
        let mut run = RunCgroups::create(&support)?;
        for s in Stage::WORKERS {
            let limit = budgets.get(&s).copied().unwrap_or(u64::MAX / 2);
            run.add_stage(s.name(), limit)?;
        }
        Ok(StageCgroups { run })
    }

    /// Make the process `cmd` will start join `stage`'s group before it runs anything.
    pub fn join_on_spawn(&self, stage: Stage, cmd: &mut Command) -> Result<(), CgroupError> {
        self.run
            .stage(stage.name())
            .ok_or(CgroupError::NoGroup(stage))?
            .join_on_spawn(cmd)
    }

    /// The memory limit of a stage whose group recorded an OOM kill.
    pub fn oom_killed(&self, s: Stage) -> Option<u64> {
        let g = self.run.stage(s.name())?;
        (g.oom_kills() > 0).then(|| g.limit())
    }

    /// (stage, cgroup path, limit, peak bytes) per stage.
    pub fn report(&self) -> Vec<(Stage, String, u64, Option<u64>)> {
        Stage::WORKERS
            .iter()
            .filter_map(|s| {
                let g = self.run.stage(s.name())?;
                Some((
                    *s,
                    g.path().display().to_string(),
                    g.limit(),
                    g.peak_bytes(),
                ))
            })
            .collect()
    }

    /// (current usage, peak, limit) of a stage's group, for `/metrics`.
    pub fn usage(&self, s: Stage) -> Option<(Option<u64>, Option<u64>, u64)> {
        let g = self.run.stage(s.name())?;
        Some((g.usage_bytes(), g.peak_bytes(), g.limit()))
    }

    /// Which interface is in use, for the report.
    pub fn version(&self) -> String {
        self.run.version().to_string()
    }

    /// Every directory, in removal order (the stages' groups, then the run's), for
    /// [`remove_dirs`] from another thread.
    pub fn dirs(&self) -> Vec<PathBuf> {
        let mut d: Vec<PathBuf> = self
            .run
            .stages()
            .iter()
            .rev()
            .map(|g| g.path().to_path_buf())
            .collect();
        d.push(self.run.path().to_path_buf());
        d
    }
}

/// Remove the groups `dirs` (from [`StageCgroups::dirs`], their processes gone), retrying
/// a busy one until `deadline`; one already removed is fine. Errors name what is left.
pub fn remove_dirs(dirs: &[PathBuf], deadline: Instant) -> Result<(), CgroupError> {
    all_or_nothing(
        dirs.iter()
            .filter_map(|d| rmdir_retry(d, deadline).err())
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Stdio;

    /// Most machines that run this either allow cgroups (root, this project's machines) or
    /// say why not; either way `probe` must not panic and must give a reason.
    fn support_or_skip() -> Option<Support> {
        match probe() {
            Ok(s) => Some(s),
            Err(why) => {
                assert!(!why.to_string().is_empty());
                eprintln!("skipping: cgroups unavailable: {why}");
                None
            }
        }
    }

    #[test]
    fn mountinfo_unescape_and_dir_mapping() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape(r"/plain"), "/plain");
        let m = Mount {
            root: "/docker/abc".into(),
            point: "/sys/fs/cgroup/memory".into(),
            fstype: "cgroup".into(),
            super_opts: "rw,memory".into(),
        };
        assert_eq!(
            dir_for(&m, "/docker/abc/x"),
            Some(PathBuf::from("/sys/fs/cgroup/memory/x"))
        );
        assert_eq!(
            dir_for(&m, "/docker/abc"),
            Some(PathBuf::from("/sys/fs/cgroup/memory/"))
        );
        // A path outside the mounted subtree (or sharing only a name prefix) cannot be mapped.
        assert_eq!(dir_for(&m, "/docker/abcd"), None);
        assert_eq!(dir_for(&m, "/other"), None);
    }

    /// Catches: limits written to the wrong file or not at all, a swap limit left unlimited,
    /// a pid that is not moved, and groups left behind after drop.
    #[test]
    fn groups_limits_membership_and_cleanup() {
        let Some(sup) = support_or_skip() else {
            return;
        };
        let mut run =
            RunCgroups::create_named(&sup, &format!("k3-{}-test-groups", std::process::id()))
                .unwrap();
        let run_dir = run.path().to_path_buf();
        let limit = 96 << 20;
        let g = run.add_stage("trunk-loader", limit).unwrap();
        let lim_file = match sup.version {
            Version::V1 => "memory.limit_in_bytes",
            Version::V2 => "memory.max",
        };
        assert_eq!(read_u64(&g.path().join(lim_file)), Some(limit));
        if sup.version == Version::V1 && g.swap_off() {
            assert_eq!(
                read_u64(&g.path().join("memory.memsw.limit_in_bytes")),
                Some(limit)
            );
        }
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        g.move_pid(child.id()).unwrap();
        assert_eq!(g.pids(), vec![child.id()]);
        assert_eq!(g.oom_kills(), 0);
        assert!(run.add_stage("trunk-loader", 1).is_err());
        assert!(run.add_stage("../evil", 1).is_err());
        child.kill().unwrap();
        child.wait().unwrap();
        drop(run);
        assert!(!run_dir.exists(), "{} left behind", run_dir.display());
    }

    /// A process that touches more than its budget is OOM-killed by the kernel, and the group
    /// says so; the peak stays within the limit. Catches: reading the wrong OOM counter,
    /// joining the group after the allocation (no kill), or a limit that is not enforced.
    #[test]
    fn over_budget_process_is_oom_killed_and_reported() {
        let Some(sup) = support_or_skip() else {
            return;
        };
        let mut run =
            RunCgroups::create_named(&sup, &format!("k3-{}-test-oom", std::process::id())).unwrap();
        let limit: u64 = 32 << 20;
        let g = run.add_stage("expert-fetcher", limit).unwrap();
        if !g.swap_off() {
            tracing::warn!("note: no swap accounting; relying on the machine having no swap");
        }
        // dd allocates one 256 MiB buffer and fills it from /dev/zero: every page touched.
        let mut cmd = Command::new("dd");
        cmd.args(["if=/dev/zero", "of=/dev/null", "bs=256M", "count=1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        g.join_on_spawn(&mut cmd).unwrap();
        let mut child = cmd.spawn().unwrap();
        let st = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            st.signal(),
            Some(libc::SIGKILL),
            "dd over a 32 MiB budget: {st:?}"
        );
        assert!(g.oom_kills() >= 1, "oom_kill count after the kill");
        if let Some(peak) = g.peak_bytes() {
            assert!(peak <= limit, "peak {peak} over the limit {limit}");
        }
        // (`limit_hits` is not asserted: v1 `memory.failcnt` stays 0 on recent kernels even
        // when the limit kills a process.)
        run.remove().unwrap();
    }

    #[test]
    fn probe_reasons_are_plain() {
        // Whatever the machine, an Err names a cause a user can act on.
        if let Err(why) = probe() {
            assert!(why.to_string().contains("cgroup"), "{why}");
        }
    }
}
