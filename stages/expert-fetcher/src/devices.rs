//! Which device holds each file the fetcher reads, so that each device gets its own reader
//! pool and queue depth and a batch's reads go to every device at once.
//!
//! A file's device is the `st_dev` of the file it resolves to (a shard symlinked into
//! another file system is on that file system's device), widened from a partition to its
//! whole disk through `/sys/dev/block/MAJ:MIN` (two partitions of one drive share its
//! queue). Files that cannot be examined share one group of their own; their reads fail
//! later with the open's error. [`DeviceMap::from_keys`] is the grouping itself, over any
//! keys (the tests' fake devices).

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};

/// A block device number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevNum {
    pub major: u32,
    pub minor: u32,
}

impl std::fmt::Display for DevNum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// The files of a location table grouped by device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMap {
    /// Per file (by number), the index of its device.
    file_device: Vec<usize>,
    /// Per device, a name for messages (`nvme0n1 (259:0)`, `7:1`, `unknown`).
    names: Vec<String>,
}

impl DeviceMap {
    /// Every one of `files` files on one device (named `name`).
    pub fn single(files: usize, name: &str) -> DeviceMap {
        DeviceMap {
            file_device: vec![0; files],
            names: vec![name.to_string()],
        }
    }

    /// Group files by key: files with equal keys share a device, numbered in order of first
    /// appearance; files without a key (`None`) share one more device, named `unknown`.
    pub fn from_keys<K: PartialEq>(keys: &[Option<K>], name: impl Fn(&K) -> String) -> DeviceMap {
        let mut seen: Vec<Option<&K>> = Vec::new();
        let mut names = Vec::new();
        let mut file_device = Vec::with_capacity(keys.len());
        for k in keys {
            let d = match seen.iter().position(|s| *s == k.as_ref()) {
                Some(d) => d,
                None => {
                    seen.push(k.as_ref());
                    names.push(k.as_ref().map_or_else(|| "unknown".to_string(), &name));
                    seen.len() - 1
                }
            };
            file_device.push(d);
        }
        if names.is_empty() {
            names.push("none".into());
        }
        DeviceMap { file_device, names }
    }

    /// The devices holding `paths` (see the module documentation).
    pub fn of_files(paths: &[PathBuf]) -> DeviceMap {
        let keys: Vec<Option<DevNum>> = paths.iter().map(|p| device_of(p)).collect();
        DeviceMap::from_keys(&keys, |d| match block_name(*d) {
            Some(n) => format!("{n} ({d})"),
            None => d.to_string(),
        })
    }

    /// How many devices.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Never true: a map has at least one device (its files may be none).
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The device of file `file` (device 0 for a file number the map does not know).
    pub fn device_of(&self, file: u32) -> usize {
        self.file_device.get(file as usize).copied().unwrap_or(0)
    }

    /// The name of device `d`.
    pub fn name(&self, d: usize) -> &str {
        self.names.get(d).map_or("unknown", |s| s.as_str())
    }

    /// Every device's name, by index.
    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// How many drives hold files with these device keys: the distinct keys, at least 1 (files
/// that cannot be examined count toward none: they are on some drive already counted, or
/// their reads fail). What the memory plan sizes the reads in flight by: one reader pool
/// and queue depth per drive ([`DeviceMap`]).
pub fn drive_count<K: PartialEq>(keys: &[Option<K>]) -> usize {
    let mut seen: Vec<&K> = Vec::new();
    for k in keys.iter().flatten() {
        if !seen.contains(&k) {
            seen.push(k);
        }
    }
    seen.len().max(1)
}

/// [`drive_count`] of the files `paths` resolve to (a partition counted as its disk).
pub fn drives_of(paths: &[PathBuf]) -> usize {
    let keys: Vec<Option<DevNum>> = paths.iter().map(|p| device_of(p)).collect();
    drive_count(&keys)
}

/// Which of an expert's copies to read, given the devices they are on (`devices[i]`: copy
/// `i`'s) and the bytes a batch reads from each device so far (`load`, by device): the
/// copy whose device has the fewest (the first such on a tie; a device `load` does not
/// know counts as full). None for no copies. The first pass of [`assign_copies`].
pub fn least_loaded(devices: &[usize], load: &[u64]) -> Option<usize> {
    (0..devices.len()).min_by_key(|&i| (load.get(devices[i]).copied().unwrap_or(u64::MAX), i))
}

/// Which copy of each of a batch's reads to take, over every read at once: `on[i]` lists
/// read `i`'s copies' devices, `bytes[i]` its size, and `load` (by device) the bytes going
/// to each device already; it is updated. First [`least_loaded`] read by read, in order;
/// then, when every read has the same size (a model's experts do), while a chain of moves
/// (a read of the busiest device to another of its copies' devices, a read of that device
/// to another of its own, ...) ends at a device that stays below the busiest, the chain is
/// applied: each step takes one read off the busiest device and changes no other device's
/// load but the chain's last. When no chain is left, every device the busiest can reach
/// holds at least one read less than it, and the reads that can only go there leave some
/// device of them that many in any choice: the busiest load is the least possible. Returns
/// the chosen copy of each read. Deterministic: the same arguments, the same choice. The
/// fetcher applies it to each batch's misses; `k3-orch project` replays it to project the
/// busiest drive's share.
pub fn assign_copies(on: &[Vec<usize>], bytes: &[u64], load: &mut [u64]) -> Vec<usize> {
    let mut pick = vec![0usize; on.len()];
    for (i, devs) in on.iter().enumerate() {
        if let Some(j) = least_loaded(devs, load) {
            pick[i] = j;
            load[devs[j]] += bytes[i];
        }
    }
    let equal = bytes.windows(2).all(|w| w[0] == w[1]);
    if !equal || on.iter().all(|d| d.len() < 2) {
        return pick;
    }
    let w = bytes.first().copied().unwrap_or(0);
    // Each round takes a read off the busiest device or leaves one device fewer at the
    // top, so rounds are bounded; the bound is a guard.
    for _ in 0..on.len() * load.len() + 1 {
        let Some(hi) = (0..load.len()).max_by_key(|&d| (load[d], std::cmp::Reverse(d))) else {
            break;
        };
        // Breadth-first over devices from the busiest: how each was reached (the read
        // moved into it, its copy index, the device it left).
        let mut from: Vec<Option<(usize, usize, usize)>> = vec![None; load.len()];
        let mut seen = vec![false; load.len()];
        seen[hi] = true;
        let mut queue = std::collections::VecDeque::from([hi]);
        let mut end = None;
        'search: while let Some(u) = queue.pop_front() {
            for (i, devs) in on.iter().enumerate() {
                if devs.get(pick[i]) != Some(&u) {
                    continue;
                }
                for (j, &v) in devs.iter().enumerate() {
                    if v >= load.len() || seen[v] {
                        continue;
                    }
                    seen[v] = true;
                    from[v] = Some((i, j, u));
                    if load[v] + w < load[hi] {
                        end = Some(v);
                        break 'search;
                    }
                    queue.push_back(v);
                }
            }
        }
        let Some(mut v) = end else {
            break;
        };
        load[hi] -= w;
        load[v] += w;
        while let Some((i, j, u)) = from[v] {
            pick[i] = j;
            if u == hi {
                break;
            }
            v = u;
        }
    }
    pick
}

/// `items` in disk order per device, the devices taking turns: sorted by `key` (the device,
/// then the position on it), then one item of each device in device order, round after
/// round. With one device this is just the sort, so a single drive keeps its disk order.
pub fn interleave<T, K: Ord>(mut items: Vec<T>, key: impl Fn(&T) -> (usize, K)) -> Vec<T> {
    items.sort_by_key(&key);
    let n = items.len();
    let mut queues: BTreeMap<usize, VecDeque<T>> = BTreeMap::new();
    for it in items {
        queues.entry(key(&it).0).or_default().push_back(it);
    }
    let mut out = Vec::with_capacity(n);
    while !queues.is_empty() {
        queues.retain(|_, q| {
            out.extend(q.pop_front());
            !q.is_empty()
        });
    }
    out
}

/// The whole-disk device number of the file `p` resolves to; None when it cannot be
/// examined.
pub fn device_of(p: &Path) -> Option<DevNum> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(p).ok()?.dev();
    let d = DevNum {
        major: libc::major(dev),
        minor: libc::minor(dev),
    };
    Some(whole_disk(d).unwrap_or(d))
}

/// The disk a partition belongs to (None: not a partition, or no sysfs entry).
fn whole_disk(d: DevNum) -> Option<DevNum> {
    let sys = PathBuf::from(format!("/sys/dev/block/{d}"));
    if !sys.join("partition").exists() {
        return None;
    }
    let parent = std::fs::canonicalize(&sys).ok()?.parent()?.join("dev");
    parse_devnum(std::fs::read_to_string(parent).ok()?.trim())
}

/// `MAJ:MIN` as a device number.
pub fn parse_devnum(s: &str) -> Option<DevNum> {
    let (a, b) = s.split_once(':')?;
    Some(DevNum {
        major: a.trim().parse().ok()?,
        minor: b.trim().parse().ok()?,
    })
}

/// The kernel's name of a block device (`nvme0n1`, `loop1`), from sysfs.
pub fn block_name(d: DevNum) -> Option<String> {
    let link = std::fs::read_link(format!("/sys/dev/block/{d}")).ok()?;
    Some(link.file_name()?.to_string_lossy().into_owned())
}
