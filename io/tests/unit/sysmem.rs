//! Available memory (`src/sysmem.rs`): meminfo, the memory cgroup of either version and its
//! limits.

use std::path::{Path, PathBuf};

use k3_io::sysmem::*;
use std::collections::HashMap;

const MEMINFO: &str = "MemTotal:       24000000 kB\n\
                       MemFree:         1000000 kB\n\
                       MemAvailable:   22000000 kB\n";

/// A reader over sample files.
fn files(list: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
    let m: HashMap<PathBuf, String> = list
        .iter()
        .map(|(p, t)| (PathBuf::from(p), t.to_string()))
        .collect();
    move |p: &Path| m.get(p).cloned()
}

const V2_MOUNTS: &str = "\
24 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
31 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
";

const V1_MOUNTS: &str = "\
24 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 24 0:25 / /sys/fs/cgroup/unified rw,nosuid shared:8 - cgroup2 cgroup2 rw
33 24 0:28 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:12 - cgroup cgroup rw,cpu,cpuacct
34 24 0:29 / /sys/fs/cgroup/memory rw,nosuid shared:13 - cgroup cgroup rw,memory
";

#[test]
fn meminfo_lines_in_bytes() {
    assert_eq!(
        parse_meminfo(MEMINFO, "MemAvailable:"),
        Some(22_000_000 * 1024)
    );
    assert_eq!(parse_meminfo(MEMINFO, "MemTotal:"), Some(24_000_000 * 1024));
    assert_eq!(parse_meminfo(MEMINFO, "SwapTotal:"), None);
    assert_eq!(parse_meminfo("Pss: 12\n", "Pss:"), Some(12));
    assert_eq!(parse_meminfo("Pss: x kB\n", "Pss:"), None);
}

#[test]
fn finds_the_mount_holding_the_memory_controller() {
    // v2: only when its cgroup.controllers lists memory.
    let with = |_: &str| Some("cpuset cpu io memory pids".to_string());
    let m = memory_mount(V2_MOUNTS, with).unwrap();
    assert_eq!(
        m,
        MemoryMount {
            root: "/".into(),
            point: "/sys/fs/cgroup".into(),
            v2: true
        }
    );
    assert_eq!(memory_mount(V2_MOUNTS, |_| Some("cpu io".into())), None);
    // v1 beside an unified hierarchy without memory: the v1 memory mount.
    let m = memory_mount(V1_MOUNTS, |_| Some("cpu".into())).unwrap();
    assert_eq!(m.point, PathBuf::from("/sys/fs/cgroup/memory"));
    assert!(!m.v2);
}

#[test]
fn own_cgroup_path_per_version() {
    let own = "12:pids:/user.slice\n4:memory:/k3/run\n0::/user.slice/k3.scope\n";
    assert_eq!(cgroup_path(own, false), Some("/k3/run"));
    assert_eq!(cgroup_path(own, true), Some("/user.slice/k3.scope"));
    assert_eq!(cgroup_path("4:cpu:/x\n", false), None);
    // Inside a cgroup namespace the mount root is stripped off the path.
    let m = MemoryMount {
        root: "/docker/abc".into(),
        point: "/sys/fs/cgroup".into(),
        v2: true,
    };
    assert_eq!(
        m.dir_of("/docker/abc/job"),
        PathBuf::from("/sys/fs/cgroup/job")
    );
    assert_eq!(m.dir_of("/elsewhere"), PathBuf::from("/sys/fs/cgroup/"));
}

#[test]
fn v2_room_is_the_smallest_over_the_ancestors() {
    let read = files(&[
        ("/proc/meminfo", MEMINFO),
        ("/proc/self/cgroup", "0::/a/b\n"),
        ("/proc/self/mountinfo", V2_MOUNTS),
        ("/sys/fs/cgroup/cgroup.controllers", "cpu memory\n"),
        // The leaf has no limit; its parent 1 GiB with 600 MiB used, 100 MiB of it
        // inactive file cache: 1024 − 500 = 524 MiB of room.
        ("/sys/fs/cgroup/a/b/memory.max", "max\n"),
        ("/sys/fs/cgroup/a/b/memory.current", "524288000\n"),
        ("/sys/fs/cgroup/a/memory.max", "1073741824\n"),
        ("/sys/fs/cgroup/a/memory.current", "629145600\n"),
        (
            "/sys/fs/cgroup/a/memory.stat",
            "anon 1\ninactive_file 104857600\n",
        ),
    ]);
    assert_eq!(cgroup_room_with(&read), Some(524 << 20));
    // Capped: the host has 22 GB available, the cgroup 524 MiB.
    assert_eq!(mem_available_with(&read), Some(524 << 20));
}

#[test]
fn v1_room_takes_the_hierarchical_limit_and_ignores_unlimited() {
    let read = files(&[
        ("/proc/meminfo", MEMINFO),
        ("/proc/self/cgroup", "5:memory:/k3\n0::/\n"),
        ("/proc/self/mountinfo", V1_MOUNTS),
        (
            "/sys/fs/cgroup/memory/k3/memory.limit_in_bytes",
            "9223372036854771712\n",
        ),
        ("/sys/fs/cgroup/memory/k3/memory.usage_in_bytes", "1000\n"),
        (
            "/sys/fs/cgroup/memory/k3/memory.stat",
            "hierarchical_memory_limit 64000\ntotal_inactive_file 500\n",
        ),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "9223372036854771712\n",
        ),
    ]);
    // 64000 − (1000 − 500).
    assert_eq!(cgroup_room_with(&read), Some(63_500));
    assert_eq!(mem_available_with(&read), Some(63_500));
}

#[test]
fn without_a_limit_or_cgroup_files_the_host_figure_stands() {
    let read = files(&[
        ("/proc/meminfo", MEMINFO),
        ("/proc/self/cgroup", "0::/\n"),
        ("/proc/self/mountinfo", V2_MOUNTS),
        ("/sys/fs/cgroup/cgroup.controllers", "memory\n"),
        ("/sys/fs/cgroup/memory.max", "max\n"),
    ]);
    assert_eq!(cgroup_room_with(&read), None);
    assert_eq!(mem_available_with(&read), Some(22_000_000 * 1024));
    let only_meminfo = files(&[("/proc/meminfo", MEMINFO)]);
    assert_eq!(mem_available_with(&only_meminfo), Some(22_000_000 * 1024));
    assert_eq!(mem_available_with(&files(&[])), None);
}

#[test]
fn usage_over_the_limit_leaves_no_room() {
    let read = files(&[
        ("/proc/self/cgroup", "0::/j\n"),
        ("/proc/self/mountinfo", V2_MOUNTS),
        ("/sys/fs/cgroup/cgroup.controllers", "memory\n"),
        ("/sys/fs/cgroup/j/memory.max", "4096\n"),
        ("/sys/fs/cgroup/j/memory.current", "8192\n"),
    ]);
    assert_eq!(cgroup_room_with(&read), Some(0));
    // No meminfo: the cgroup's figure alone.
    assert_eq!(mem_available_with(&read), Some(0));
}
