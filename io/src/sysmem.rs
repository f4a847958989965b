//! How much memory this process may still take: `/proc/meminfo`'s MemAvailable, capped by
//! the room left under the memory cgroup it runs in (v2 `memory.max` against
//! `memory.current`, v1 `memory.limit_in_bytes` and `hierarchical_memory_limit` against
//! `memory.usage_in_bytes`, less inactive file cache, for the process's cgroup and every
//! ancestor the mount shows).
//!
//! The one `mem_available` of the workspace: the run's memory plan, the trunk-loader's
//! presets and `doctor` all read it here. Without the cap a run inside a small container or
//! cgroup was planned against the host's memory and then OOM-killed instead of refused up
//! front. The parsers take file text (and the `_with` functions a file reader) so that they
//! are tested on sample text.

use std::path::{Path, PathBuf};

/// Reads one file's text, `None` when it cannot.
pub type ReadText<'a> = &'a dyn Fn(&Path) -> Option<String>;

fn read_file(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok()
}

/// Memory this process may still take: MemAvailable capped by [`cgroup_room`]; whichever
/// is known when only one is, `None` when neither is.
pub fn mem_available() -> Option<u64> {
    mem_available_with(&read_file)
}

/// [`mem_available`] over the files `read` returns.
pub fn mem_available_with(read: ReadText) -> Option<u64> {
    let host = read(Path::new("/proc/meminfo")).and_then(|s| parse_meminfo(&s, "MemAvailable:"));
    match (host, cgroup_room_with(read)) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// A `Key:   123 kB` line of a meminfo-style text (`/proc/meminfo`, `smaps_rollup`), in
/// bytes; a number without a unit is taken as bytes.
pub fn parse_meminfo(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let mut it = line[key.len()..].split_whitespace();
    let n: u64 = it.next()?.parse().ok()?;
    Some(match it.next() {
        Some("kB") => n.checked_mul(1024)?,
        _ => n,
    })
}

/// Room left under the memory limits of this process's cgroup and of every ancestor visible
/// in the mount: the smallest `limit − (usage − inactive file cache)`. `None` when no limit
/// applies (or the cgroup files cannot be read).
pub fn cgroup_room() -> Option<u64> {
    cgroup_room_with(&read_file)
}

/// [`cgroup_room`] over the files `read` returns (`/proc/self/cgroup`,
/// `/proc/self/mountinfo` and the cgroup's own files).
pub fn cgroup_room_with(read: ReadText) -> Option<u64> {
    let own = read(Path::new("/proc/self/cgroup"))?;
    let mounts = read(Path::new("/proc/self/mountinfo"))?;
    let mount = memory_mount(&mounts, |point| {
        read(&Path::new(point).join("cgroup.controllers"))
    })?;
    let dir = mount.dir_of(cgroup_path(&own, mount.v2)?);
    room_up_from(dir, &mount, read)
}

/// The mount of the hierarchy that holds the memory controller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryMount {
    /// The cgroup path the mount shows at its mount point (`/` outside a namespace).
    pub root: String,
    /// Where it is mounted (`/sys/fs/cgroup`, `/sys/fs/cgroup/memory`).
    pub point: PathBuf,
    /// cgroup v2 (unified) rather than v1.
    pub v2: bool,
}

impl MemoryMount {
    /// The directory of cgroup `path` (as `/proc/self/cgroup` names it) under this mount.
    pub fn dir_of(&self, path: &str) -> PathBuf {
        let rel = if self.root == "/" {
            path
        } else {
            path.strip_prefix(self.root.as_str()).unwrap_or("/")
        };
        self.point.join(rel.trim_start_matches('/'))
    }
}

/// The first mount in a mountinfo text that holds the memory controller: a v1 `cgroup`
/// mount with `memory` among its options, or a `cgroup2` mount whose `cgroup.controllers`
/// (read through `controllers`, given the mount point) lists `memory`.
pub fn memory_mount(
    mountinfo: &str,
    controllers: impl Fn(&str) -> Option<String>,
) -> Option<MemoryMount> {
    mountinfo.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        let (root, point) = (*pre.get(3)?, *pre.get(4)?);
        let v2 = match *post.first()? {
            "cgroup2" => {
                let c = controllers(point)?;
                c.split_whitespace()
                    .any(|x| x == "memory")
                    .then_some(true)?
            }
            "cgroup" if post.get(2)?.split(',').any(|o| o == "memory") => false,
            _ => return None,
        };
        Some(MemoryMount {
            root: root.to_string(),
            point: PathBuf::from(point),
            v2,
        })
    })
}

/// This process's cgroup in a `/proc/self/cgroup` text: the `0::PATH` line for v2, the
/// line whose controllers include `memory` for v1.
pub fn cgroup_path(own: &str, v2: bool) -> Option<&str> {
    own.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (id, ctrls, path) = (f.next()?, f.next()?, f.next()?);
        let hit = if v2 {
            id == "0" && ctrls.is_empty()
        } else {
            ctrls.split(',').any(|c| c == "memory")
        };
        hit.then_some(path)
    })
}

/// A `key value` line of a cgroup `memory.stat` text.
pub fn stat_value(stat: &str, key: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// v1 reports "no limit" as a huge page-aligned number; anything past 2^62 is unlimited.
fn limited(x: u64) -> Option<u64> {
    (x < 1 << 62).then_some(x)
}

/// Room under one cgroup directory's limit, `None` when it has none.
fn room_in(dir: &Path, v2: bool, read: ReadText) -> Option<u64> {
    let num = |f: &str| -> Option<u64> { read(&dir.join(f))?.trim().parse().ok() };
    let stat = read(&dir.join("memory.stat")).unwrap_or_default();
    let (limit, usage, cache) = if v2 {
        (
            num("memory.max"),
            num("memory.current"),
            stat_value(&stat, "inactive_file"),
        )
    } else {
        let l = num("memory.limit_in_bytes").and_then(limited);
        let h = stat_value(&stat, "hierarchical_memory_limit").and_then(limited);
        (
            l.into_iter().chain(h).min(),
            num("memory.usage_in_bytes"),
            stat_value(&stat, "total_inactive_file"),
        )
    };
    let used = usage.unwrap_or(0).saturating_sub(cache.unwrap_or(0));
    Some(limit?.saturating_sub(used))
}

/// The smallest room of `dir` and its ancestors up to the mount point.
fn room_up_from(mut dir: PathBuf, mount: &MemoryMount, read: ReadText) -> Option<u64> {
    let top = &mount.point;
    let mut room: Option<u64> = None;
    loop {
        if let Some(r) = room_in(&dir, mount.v2, read) {
            room = Some(room.map_or(r, |x| x.min(r)));
        }
        if dir == *top || !dir.pop() || !dir.starts_with(top) {
            break;
        }
    }
    room
}
