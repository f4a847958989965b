//! NUMA placement of the stage processes: `--numa auto|off|stage=node,...`.
//!
//! - [`parse_spec`] reads the flag; [`plan`] turns it into a node per stage: `auto` puts the
//!   I/O stages on the node of the block device that holds the model files
//!   ([`device_node`], via `st_dev` -> `/sys/dev/block/M:m` -> the nearest `numa_node` up the
//!   device tree) and compute on another node; on a one-node machine nothing is placed and
//!   the plan carries a one-line note.
//! - [`apply_node`] binds the *calling thread* (call it first thing in a stage process,
//!   before it starts threads, which inherit both) to the node's CPUs (`sched_setaffinity`)
//!   and memory (`set_mempolicy`, bind or preferred).
//! - [`placement`] reports what the kernel says: `Cpus_allowed_list` and `Mems_allowed_list`
//!   from `/proc/<pid>/status`, the policies in `/proc/<pid>/numa_maps`, and (for the calling
//!   thread) `get_mempolicy`.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use k3_protocol::messages::Stage;

/// `MPOL_*` modes (linux/mempolicy.h).
pub const MPOL_DEFAULT: i32 = 0;
pub const MPOL_PREFERRED: i32 = 1;
pub const MPOL_BIND: i32 = 2;
pub const MPOL_INTERLEAVE: i32 = 3;

/// What is wrong with `--numa`, or why a placement could not be read or applied.
#[derive(Debug, thiserror::Error)]
pub enum NumaError {
    #[error("--numa: empty value (use auto, off, or stage=node,...)")]
    Empty,
    #[error("--numa: '{0}' is not stage=node (use auto, off, or stage=node,...)")]
    NotAPair(String),
    #[error("--numa: unknown stage '{stage}' (stages: {known})")]
    UnknownStage { stage: String, known: String },
    #[error("--numa: '{value}' is not a node number (in '{part}')")]
    NotANode { value: String, part: String },
    #[error("--numa: stage '{0}' given twice")]
    Twice(String),
    #[error("--numa: node {node} (for {stage}) is not online (online: {online})")]
    Offline {
        node: u32,
        stage: String,
        online: String,
    },
    #[error("bad list element '{part}' in '{list}'")]
    ListElement { part: String, list: String },
    #[error("bad range '{part}' in '{list}'")]
    ListRange { part: String, list: String },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} has no {key}", path.display())]
    NoField { path: PathBuf, key: &'static str },
    #[error("cannot stat {}: {source}", path.display())]
    Stat {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{} is on a virtual file system (device {major}:{minor}), not on a block device",
        path.display()
    )]
    Virtual {
        path: PathBuf,
        major: u32,
        minor: u32,
    },
    #[error("cannot resolve {}: {source}", path.display())]
    Resolve {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("bad {}/numa_node: {value:?}", dir.display())]
    BadNodeFile { dir: PathBuf, value: String },
    #[error("empty CPU set")]
    NoCpus,
    #[error("CPU {cpu} is beyond the {max} CPUs a cpu_set_t holds")]
    CpuRange { cpu: usize, max: usize },
    #[error("sched_setaffinity({cpus:?}): {source}")]
    Affinity {
        cpus: Vec<usize>,
        #[source]
        source: std::io::Error,
    },
    #[error("empty node set")]
    NoNodes,
    #[error("node {0} is out of range")]
    NodeRange(usize),
    #[error("set_mempolicy({policy:?}, nodes {nodes:?}): {source}")]
    SetPolicy {
        policy: MemPolicy,
        nodes: Vec<u32>,
        #[source]
        source: std::io::Error,
    },
    #[error("get_mempolicy: {0}")]
    GetPolicy(#[source] std::io::Error),
    #[error("{NUMA_ENV}={0:?} is not a node number")]
    EnvNotANode(String),
}

fn read(path: impl Into<PathBuf>) -> Result<String, NumaError> {
    let path = path.into();
    fs::read_to_string(&path).map_err(|source| NumaError::Read { path, source })
}

/// The parsed `--numa` flag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NumaSpec {
    Auto,
    Off,
    /// `stage=node` pairs, in the order given.
    Explicit(Vec<(String, u32)>),
}

/// Parse `auto`, `off` or `stage=node,stage=node` (stage names from `stages`).
pub fn parse_spec(s: &str, stages: &[&str]) -> Result<NumaSpec, NumaError> {
    match s.trim() {
        "auto" => return Ok(NumaSpec::Auto),
        "off" => return Ok(NumaSpec::Off),
        "" => return Err(NumaError::Empty),
        _ => {}
    }
    let mut out: Vec<(String, u32)> = Vec::new();
    for part in s.split(',') {
        let Some((stage, node)) = part.split_once('=') else {
            return Err(NumaError::NotAPair(part.to_string()));
        };
        let stage = stage.trim();
        if !stages.contains(&stage) {
            return Err(NumaError::UnknownStage {
                stage: stage.to_string(),
                known: stages.join(", "),
            });
        }
        let node: u32 = node.trim().parse().map_err(|_| NumaError::NotANode {
            value: node.trim().to_string(),
            part: part.to_string(),
        })?;
        if out.iter().any(|(s, _)| s == stage) {
            return Err(NumaError::Twice(stage.to_string()));
        }
        out.push((stage.to_string(), node));
    }
    Ok(NumaSpec::Explicit(out))
}

/// Parse a kernel list like `0-3,8,10-11`.
pub fn parse_list(s: &str) -> Result<Vec<usize>, NumaError> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let element = || NumaError::ListElement {
            part: part.to_string(),
            list: s.to_string(),
        };
        let a: usize = a.trim().parse().map_err(|_| element())?;
        let b: usize = b.trim().parse().map_err(|_| element())?;
        if b < a || b - a > 1 << 16 {
            return Err(NumaError::ListRange {
                part: part.to_string(),
                list: s.to_string(),
            });
        }
        out.extend(a..=b);
    }
    Ok(out)
}

/// Online NUMA nodes (`/sys/devices/system/node/online`; a machine without that file has
/// one node, 0).
pub fn online_nodes() -> Result<Vec<u32>, NumaError> {
    let path = "/sys/devices/system/node/online";
    match fs::read_to_string(path) {
        Ok(s) => Ok(parse_list(&s)?.into_iter().map(|n| n as u32).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(vec![0]),
        Err(source) => Err(NumaError::Read {
            path: path.into(),
            source,
        }),
    }
}

/// CPUs of `node`.
pub fn node_cpus(node: u32) -> Result<Vec<usize>, NumaError> {
    let p = format!("/sys/devices/system/node/node{node}/cpulist");
    match fs::read_to_string(&p) {
        Ok(s) => parse_list(&s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && node == 0 => {
            // No NUMA sysfs at all: every CPU we may use is "node 0".
            let s = read("/proc/self/status")?;
            parse_list(status_field(&s, "Cpus_allowed_list").unwrap_or("0"))
        }
        Err(source) => Err(NumaError::Read {
            path: p.into(),
            source,
        }),
    }
}

/// The block device holding `path` and its NUMA node (None when the firmware does not say,
/// i.e. `numa_node` is -1 or absent). Err when `path` is not on a block device.
pub fn device_node(path: &Path) -> Result<(String, Option<u32>), NumaError> {
    let md = fs::metadata(path).map_err(|source| NumaError::Stat {
        path: path.to_path_buf(),
        source,
    })?;
    let dev = md.dev();
    let (maj, min) = (libc::major(dev), libc::minor(dev));
    if maj == 0 {
        return Err(NumaError::Virtual {
            path: path.to_path_buf(),
            major: maj,
            minor: min,
        });
    }
    let link = PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
    let real = fs::canonicalize(&link).map_err(|source| NumaError::Resolve {
        path: link.clone(),
        source,
    })?;
    let name = real
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| format!("{maj}:{min}"));
    // Walk up from the block device (partition -> disk -> controller -> PCI function) to the
    // first directory that states a node.
    let mut dir: Option<&Path> = Some(&real);
    while let Some(d) = dir {
        if d == Path::new("/sys/devices") || d == Path::new("/") {
            break;
        }
        if let Ok(s) = fs::read_to_string(d.join("numa_node")) {
            let v: i64 = s.trim().parse().map_err(|_| NumaError::BadNodeFile {
                dir: d.to_path_buf(),
                value: s.clone(),
            })?;
            return Ok((name, u32::try_from(v).ok()));
        }
        dir = d.parent();
    }
    Ok((name, None))
}

/// A node per stage (None: leave it where the scheduler puts it), plus notes for the report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub nodes: BTreeMap<String, Option<u32>>,
    pub notes: Vec<String>,
}

/// Turn the spec into a placement for `io_stages` and `compute_stages` (other stages listed
/// in `others` are never placed by `auto`). `device` is the node of the model files' device.
pub fn plan(
    spec: &NumaSpec,
    nodes: &[u32],
    device: Option<u32>,
    io_stages: &[&str],
    compute_stages: &[&str],
    others: &[&str],
) -> Result<Plan, NumaError> {
    let mut p = Plan::default();
    for s in io_stages.iter().chain(compute_stages).chain(others) {
        p.nodes.insert(s.to_string(), None);
    }
    match spec {
        NumaSpec::Off => {}
        NumaSpec::Explicit(pairs) => {
            for (stage, node) in pairs {
                if !nodes.contains(node) {
                    return Err(NumaError::Offline {
                        node: *node,
                        stage: stage.clone(),
                        online: nodes
                            .iter()
                            .map(|n| n.to_string())
                            .collect::<Vec<_>>()
                            .join(","),
                    });
                }
                p.nodes.insert(stage.clone(), Some(*node));
            }
        }
        NumaSpec::Auto => {
            if nodes.len() <= 1 {
                p.notes.push(format!(
                    "numa: one node ({}); nothing to place",
                    nodes.first().copied().unwrap_or(0)
                ));
                return Ok(p);
            }
            let io = match device {
                Some(d) if nodes.contains(&d) => d,
                _ => {
                    p.notes.push(format!(
                        "numa: the model's device does not report a node; I/O stages go to node {}",
                        nodes[0]
                    ));
                    nodes[0]
                }
            };
            let compute = nodes.iter().copied().find(|&n| n != io).unwrap_or(io);
            for s in io_stages {
                p.nodes.insert(s.to_string(), Some(io));
            }
            for s in compute_stages {
                p.nodes.insert(s.to_string(), Some(compute));
            }
            p.notes.push(format!(
                "numa: I/O stages on node {io}, compute on node {compute}"
            ));
        }
    }
    Ok(p)
}

/// Memory policy flavour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemPolicy {
    /// Allocate only on the node (fail/OOM rather than spill).
    Bind,
    /// Prefer the node, spill elsewhere when it is full.
    Preferred,
}

/// Restrict the calling thread to `cpus`.
pub fn set_affinity(cpus: &[usize]) -> Result<(), NumaError> {
    if cpus.is_empty() {
        return Err(NumaError::NoCpus);
    }
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    for &c in cpus {
        if c >= max {
            return Err(NumaError::CpuRange { cpu: c, max });
        }
        // SAFETY: c < CPU_SETSIZE (checked).
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: pid 0 = the calling thread; `set` is a valid cpu_set_t of the given size.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        return Err(NumaError::Affinity {
            cpus: cpus.to_vec(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn node_mask(nodes: &[u32]) -> Result<Vec<libc::c_ulong>, NumaError> {
    let bits = 8 * std::mem::size_of::<libc::c_ulong>();
    let max = nodes.iter().copied().max().unwrap_or(0) as usize;
    if max >= 1024 {
        return Err(NumaError::NodeRange(max));
    }
    let mut mask = vec![0 as libc::c_ulong; max / bits + 1];
    for &n in nodes {
        mask[n as usize / bits] |= 1 << (n as usize % bits);
    }
    Ok(mask)
}

/// Set the calling thread's memory policy to `nodes`.
pub fn set_mempolicy(nodes: &[u32], policy: MemPolicy) -> Result<(), NumaError> {
    if nodes.is_empty() {
        return Err(NumaError::NoNodes);
    }
    let mask = node_mask(nodes)?;
    let mode = match policy {
        MemPolicy::Bind => MPOL_BIND,
        MemPolicy::Preferred => MPOL_PREFERRED,
    };
    let maxnode = (mask.len() * 8 * std::mem::size_of::<libc::c_ulong>() + 1) as libc::c_ulong;
    // SAFETY: set_mempolicy(mode, nodemask, maxnode) reads `maxnode - 1` bits from `mask`,
    // which holds that many.
    let r = unsafe { libc::syscall(libc::SYS_set_mempolicy, mode, mask.as_ptr(), maxnode) };
    if r != 0 {
        return Err(NumaError::SetPolicy {
            policy,
            nodes: nodes.to_vec(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// The calling thread's memory policy: (`MPOL_*` mode, nodes).
pub fn get_mempolicy() -> Result<(i32, Vec<u32>), NumaError> {
    let mut mode: libc::c_int = 0;
    let mut mask = vec![0 as libc::c_ulong; 16];
    let bits = 8 * std::mem::size_of::<libc::c_ulong>();
    let maxnode = (mask.len() * bits) as libc::c_ulong;
    // SAFETY: the kernel writes one int to `mode` and at most `maxnode` bits to `mask`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            mask.as_mut_ptr(),
            maxnode,
            std::ptr::null_mut::<libc::c_void>(),
            0 as libc::c_ulong,
        )
    };
    if r != 0 {
        return Err(NumaError::GetPolicy(std::io::Error::last_os_error()));
    }
    let nodes = (0..mask.len() * bits)
        .filter(|&i| mask[i / bits] & (1 << (i % bits)) != 0)
        .map(|i| i as u32)
        .collect();
    Ok((mode, nodes))
}

/// Bind the calling thread to `node`: its CPUs and its memory.
pub fn apply_node(node: u32, policy: MemPolicy) -> Result<(), NumaError> {
    set_affinity(&node_cpus(node)?)?;
    set_mempolicy(&[node], policy)
}

/// What the kernel reports about a task's placement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    pub cpus_allowed_list: String,
    pub mems_allowed_list: String,
    /// Distinct policies in `numa_maps` (`default`, `bind:0`, `prefer:1`, ...), sorted.
    pub numa_maps_policies: Vec<String>,
}

fn status_field<'a>(status: &'a str, key: &str) -> Option<&'a str> {
    status.lines().find_map(|l| {
        l.strip_prefix(key)
            .and_then(|r| r.strip_prefix(':'))
            .map(str::trim)
    })
}

/// Placement of process `pid`, or of the calling thread when `pid` is None (reads
/// `/proc/thread-self`, since affinity and memory policy are per thread).
pub fn placement(pid: Option<u32>) -> Result<Placement, NumaError> {
    let base = match pid {
        Some(p) => PathBuf::from(format!("/proc/{p}")),
        None => PathBuf::from("/proc/thread-self"),
    };
    let status = read(base.join("status"))?;
    let get = |key: &'static str| {
        status_field(&status, key)
            .map(str::to_string)
            .ok_or_else(|| NumaError::NoField {
                path: base.join("status"),
                key,
            })
    };
    let mut policies: Vec<String> = fs::read_to_string(base.join("numa_maps"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1).map(str::to_string))
        .collect();
    policies.sort();
    policies.dedup();
    Ok(Placement {
        cpus_allowed_list: get("Cpus_allowed_list")?,
        mems_allowed_list: get("Mems_allowed_list")?,
        numa_maps_policies: policies,
    })
}

/// Environment variable that tells a stage process which NUMA node to bind to.
pub const NUMA_ENV: &str = "K3_NUMA_NODE";

/// A node per stage from `--numa` (None: leave the stage where the kernel puts it).
pub fn numa_plan(
    spec: Option<&str>,
    model_dir: &Path,
) -> Result<(HashMap<Stage, u32>, Vec<String>), NumaError> {
    let names: Vec<&str> = Stage::WORKERS.iter().map(|s| s.name()).collect();
    let spec = match spec {
        None => return Ok((HashMap::new(), Vec::new())),
        Some(s) => parse_spec(s, &names)?,
    };
    let nodes = online_nodes()?;
    let device = device_node(model_dir).ok().and_then(|(_, n)| n);
    let p = plan(
        &spec,
        &nodes,
        device,
        &["trunk-loader", "expert-fetcher"],
        &["layer-compute"],
        &["tokenizer"],
    )?;
    let map = p
        .nodes
        .iter()
        .filter_map(|(s, n)| Some((Stage::parse(s)?, (*n)?)))
        .collect();
    Ok((map, p.notes))
}

/// In a stage process: bind to the node named by `K3_NUMA_NODE`, if any.
pub fn apply_numa_from_env() -> Result<Option<u32>, NumaError> {
    let Ok(v) = std::env::var(NUMA_ENV) else {
        return Ok(None);
    };
    let node: u32 = v.parse().map_err(|_| NumaError::EnvNotANode(v.clone()))?;
    apply_node(node, MemPolicy::Preferred)?;
    Ok(Some(node))
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAGES: &[&str] = &[
        "tokenizer",
        "trunk-loader",
        "expert-fetcher",
        "layer-compute",
    ];

    #[test]
    fn spec_parsing() {
        assert_eq!(parse_spec("auto", STAGES).unwrap(), NumaSpec::Auto);
        assert_eq!(parse_spec("off", STAGES).unwrap(), NumaSpec::Off);
        assert_eq!(
            parse_spec("trunk-loader=0,expert-fetcher=0,layer-compute=1", STAGES).unwrap(),
            NumaSpec::Explicit(vec![
                ("trunk-loader".into(), 0),
                ("expert-fetcher".into(), 0),
                ("layer-compute".into(), 1)
            ])
        );
        for bad in [
            "",
            "compute=1",
            "trunk-loader",
            "trunk-loader=x",
            "trunk-loader=0,trunk-loader=1",
            "trunk-loader=-1",
        ] {
            assert!(parse_spec(bad, STAGES).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn kernel_lists() {
        assert_eq!(
            parse_list("0-3,8,10-11\n").unwrap(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_list("5").unwrap(), vec![5]);
        assert_eq!(parse_list("").unwrap(), Vec::<usize>::new());
        assert!(parse_list("3-1").is_err());
        assert!(parse_list("a").is_err());
    }

    /// Catches: `auto` that puts compute on the device's node, ignores the device, or places
    /// stages on a one-node machine; explicit nodes that are not online.
    #[test]
    fn planning() {
        let io = ["trunk-loader", "expert-fetcher"];
        let cp = ["layer-compute"];
        let other = ["tokenizer"];
        let p = plan(&NumaSpec::Auto, &[0, 1], Some(1), &io, &cp, &other).unwrap();
        assert_eq!(p.nodes["trunk-loader"], Some(1));
        assert_eq!(p.nodes["expert-fetcher"], Some(1));
        assert_eq!(p.nodes["layer-compute"], Some(0));
        assert_eq!(p.nodes["tokenizer"], None);
        let p = plan(&NumaSpec::Auto, &[0, 1, 2], None, &io, &cp, &other).unwrap();
        assert_eq!(
            (p.nodes["trunk-loader"], p.nodes["layer-compute"]),
            (Some(0), Some(1))
        );
        assert!(p.notes.iter().any(|n| n.contains("does not report a node")));
        let p = plan(&NumaSpec::Auto, &[0], Some(0), &io, &cp, &other).unwrap();
        assert!(p.nodes.values().all(|n| n.is_none()));
        assert_eq!(
            p.notes,
            vec!["numa: one node (0); nothing to place".to_string()]
        );
        let p = plan(&NumaSpec::Off, &[0, 1], Some(1), &io, &cp, &other).unwrap();
        assert!(p.nodes.values().all(|n| n.is_none()));
        let spec = parse_spec("layer-compute=1", STAGES).unwrap();
        assert!(plan(&spec, &[0], None, &io, &cp, &other).is_err());
        let p = plan(&spec, &[0, 1], None, &io, &cp, &other).unwrap();
        assert_eq!(
            (p.nodes["layer-compute"], p.nodes["trunk-loader"]),
            (Some(1), None)
        );
    }

    #[test]
    fn device_of_a_path() {
        // The repository lives on a real block device here; its node may be unknown (-1).
        match device_node(Path::new(env!("CARGO_MANIFEST_DIR"))) {
            Ok((name, node)) => {
                assert!(!name.is_empty());
                if let Some(n) = node {
                    assert!(online_nodes().unwrap().contains(&n));
                }
            }
            Err(e) => assert!(
                matches!(
                    e,
                    NumaError::Virtual { .. } | NumaError::Stat { .. } | NumaError::Resolve { .. }
                ),
                "{e}"
            ),
        }
        let e = device_node(Path::new("/proc/self/status")).unwrap_err();
        assert!(matches!(e, NumaError::Virtual { .. }), "{e}");
    }

    /// Affinity and memory policy of a thread are what was asked, as the kernel reports them
    /// in /proc and through get_mempolicy. Runs in its own thread (both are per thread).
    /// Catches: a mask built off by one bit, a policy set on the wrong task, a wrong mode.
    #[test]
    fn apply_and_read_back_from_proc() {
        std::thread::spawn(|| {
            let nodes = online_nodes().unwrap();
            let node = nodes[0];
            let cpus = node_cpus(node).unwrap();
            // One CPU only, so the result differs from the default "all CPUs".
            set_affinity(&cpus[..1]).unwrap();
            set_mempolicy(&[node], MemPolicy::Bind).unwrap();
            // Touch fresh memory under the policy.
            let v = vec![1u8; 4 << 20];
            let pl = placement(None).unwrap();
            assert_eq!(pl.cpus_allowed_list, cpus[0].to_string());
            assert_eq!(
                parse_list(&pl.mems_allowed_list).unwrap().len(),
                nodes.len()
            );
            assert!(
                pl.numa_maps_policies
                    .iter()
                    .any(|p| p == &format!("bind:{node}")),
                "numa_maps policies: {:?}",
                pl.numa_maps_policies
            );
            assert_eq!(get_mempolicy().unwrap(), (MPOL_BIND, vec![node]));
            set_mempolicy(&[node], MemPolicy::Preferred).unwrap();
            assert_eq!(get_mempolicy().unwrap(), (MPOL_PREFERRED, vec![node]));
            drop(v);
            // The whole process (its leader thread) is untouched.
            let whole = placement(Some(std::process::id())).unwrap();
            assert!(!whole.cpus_allowed_list.is_empty());
        })
        .join()
        .unwrap();
    }
}
