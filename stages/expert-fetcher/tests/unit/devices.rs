//! The drives of the expert files (`src/devices.rs`): files grouped by device, reads
//! interleaved in disk order, symlinks resolved, drives counted.

use k3_expert_fetcher::devices::*;

/// Catches a grouping by file (every shard its own pool: queue depth times the shard
/// count on one drive) or by path prefix (a symlinked shard left on the model's drive):
/// only the device key counts, in order of first appearance, and unknown files share one
/// group of their own.
#[test]
fn files_group_by_device_key() {
    let keys = [Some(7), Some(9), Some(7), None, Some(9), None, Some(3)];
    let m = DeviceMap::from_keys(&keys, |k| format!("fake{k}"));
    assert_eq!(m.len(), 4);
    let devs: Vec<usize> = (0..7).map(|f| m.device_of(f)).collect();
    assert_eq!(devs, vec![0, 1, 0, 2, 1, 2, 3]);
    assert_eq!(m.names(), &["fake7", "fake9", "unknown", "fake3"]);
    assert_eq!(
        m.device_of(99),
        0,
        "an unknown file number falls back to device 0"
    );
    let one = DeviceMap::from_keys(&[Some(1), Some(1), Some(1)], |k| k.to_string());
    assert_eq!(one, DeviceMap::single(3, "1"));
}

/// Catches issuing a batch in plain (file, offset) order over several drives (the
/// second drive idles until the first one's reads are all queued) and an interleave
/// that breaks the disk order inside a drive or changes the single-drive order.
#[test]
fn interleave_takes_turns_in_disk_order() {
    // (device, offset)
    let items = vec![(1, 50), (0, 30), (1, 10), (0, 20), (0, 10), (2, 5)];
    let got = interleave(items.clone(), |&(d, o)| (d, o));
    assert_eq!(
        got,
        vec![(0, 10), (1, 10), (2, 5), (0, 20), (1, 50), (0, 30)]
    );
    let one: Vec<(usize, u64)> = vec![(0, 9), (0, 3), (0, 7)];
    assert_eq!(
        interleave(one, |&(d, o)| (d, o)),
        vec![(0, 3), (0, 7), (0, 9)]
    );
}

#[test]
fn real_files_resolve_through_symlinks() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    std::fs::write(&a, b"x").unwrap();
    let link = tmp.path().join("b");
    std::os::unix::fs::symlink(&a, &link).unwrap();
    let m = DeviceMap::of_files(&[a.clone(), link, tmp.path().join("missing")]);
    assert_eq!(
        m.device_of(0),
        m.device_of(1),
        "a symlink is its target's device"
    );
    assert_ne!(m.device_of(0), m.device_of(2));
    assert_eq!(m.name(m.device_of(2)), "unknown");
    assert_eq!(
        parse_devnum("259:3"),
        Some(DevNum {
            major: 259,
            minor: 3
        })
    );
    assert_eq!(parse_devnum("x"), None);
}

/// Catches a drive count that counts files (every shard a drive: the plan would keep
/// 16 expert slots in flight per shard) or the files it cannot examine (a missing file
/// is no drive), and a count of 0 for a model with no examinable file (the plan keeps
/// one drive's reads). On this machine a file on tmpfs (`/dev/shm`) and one on the
/// disk are two drives when both are there.
#[test]
fn drives_are_counted_by_device() {
    assert_eq!(drive_count(&[Some(7), Some(9), Some(7), None]), 2);
    assert_eq!(drive_count::<u32>(&[None, None]), 1);
    assert_eq!(drive_count::<u32>(&[]), 1);
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::write(&a, b"x").unwrap();
    std::fs::write(&b, b"y").unwrap();
    let missing = tmp.path().join("missing");
    assert_eq!(drives_of(&[a.clone(), b, missing]), 1);
    if let Ok(shm) = tempfile::tempdir_in("/dev/shm") {
        let c = shm.path().join("c");
        std::fs::write(&c, b"z").unwrap();
        if device_of(&c) != device_of(&a) {
            let link = tmp.path().join("link");
            std::os::unix::fs::symlink(&c, &link).unwrap();
            assert_eq!(drives_of(&[a.clone(), link]), 2, "a symlink to tmpfs");
        }
    }
}

/// The least possible busiest load of `on` (each read one unit, on one of its devices),
/// by trying every choice: the oracle for [`assign_copies`].
fn best_busiest(on: &[Vec<usize>], devices: usize) -> u64 {
    let mut best = u64::MAX;
    let mut pick = vec![0usize; on.len()];
    loop {
        let mut load = vec![0u64; devices];
        for (i, devs) in on.iter().enumerate() {
            load[devs[pick[i]]] += 1;
        }
        best = best.min(*load.iter().max().unwrap());
        // The next choice, as an odometer over the reads' copies.
        let mut i = 0;
        while i < on.len() {
            pick[i] += 1;
            if pick[i] < on[i].len() {
                break;
            }
            pick[i] = 0;
            i += 1;
        }
        if i == on.len() {
            return best;
        }
    }
}

/// Reads with two copies each over four devices (random pairs, a fixed seed, 400 cases of
/// 4 to 11 reads): `assign_copies` reaches the least possible busiest load found by trying
/// every choice, and its loads are the chosen copies'. Catches the greedy pass alone,
/// which a read order can trap, and a chain applied the wrong way round. One trap is
/// written out: read by read, the least busy device puts reads 0, 4 and 5 on device 0
/// (3 reads), where 2 is possible (reads 2 and 3 on device 2).
#[test]
fn copies_reach_the_least_busiest_load() {
    let on = vec![
        vec![0, 1],
        vec![0, 1],
        vec![0, 2],
        vec![1, 2],
        vec![0, 1],
        vec![0, 1],
    ];
    let mut greedy = vec![0u64; 3];
    for devs in &on {
        let j = least_loaded(devs, &greedy).unwrap();
        greedy[devs[j]] += 1;
    }
    assert_eq!(greedy, vec![3, 2, 1]);
    let mut load = vec![0; 3];
    let pick = assign_copies(&on, &[1; 6], &mut load);
    assert_eq!(load, vec![2, 2, 2], "{pick:?}");
    assert_eq!(best_busiest(&on, 3), 2);
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    for case in 0..400 {
        let reads = 4 + next(8);
        let on: Vec<Vec<usize>> = (0..reads)
            .map(|_| {
                let a = next(4);
                vec![a, (a + 1 + next(3)) % 4]
            })
            .collect();
        let mut load = vec![0u64; 4];
        let pick = assign_copies(&on, &vec![4096; reads], &mut load);
        let mut want = vec![0u64; 4];
        for (i, devs) in on.iter().enumerate() {
            want[devs[pick[i]]] += 4096;
        }
        assert_eq!(load, want, "case {case}: {on:?}");
        let busiest = load.iter().max().unwrap() / 4096;
        assert_eq!(
            busiest,
            best_busiest(&on, 4),
            "case {case}: {on:?} -> {pick:?}"
        );
    }
}
