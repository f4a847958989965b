//! The fetcher over files on several (fake) drives: each drive has its own reader pool and
//! queue, a batch's reads reach every drive at once, and a failing drive fails only its own
//! experts, each failure naming the drive.

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use k3_expert_fetcher::{
    BatchEvent, DeviceMap, ExpertCacheConfig, ExpertExtents, ExpertFetcher, ExpertTable,
    FetchError, ReadFailure,
};
use k3_io::ReadAt;

const BYTES: u64 = 8192;

/// Experts 0..4 of layer 0: the even ones in file 0, the odd ones in file 1.
fn table() -> Arc<ExpertTable> {
    let mut t = ExpertTable::new(vec![PathBuf::from("/a/0"), PathBuf::from("/b/1")]);
    for e in 0..4u32 {
        let off = (e / 2) as u64 * BYTES;
        t.insert(0, e, ExpertExtents::contiguous(e % 2, off, BYTES));
    }
    Arc::new(t)
}

/// A reader whose file-0 reads wait (at most 5 s) until a file-1 read has started: only
/// reads issued to both drives at once can all succeed with one reader per drive. Reads of
/// the files in `fail` fail. Every byte read is the file number plus one.
struct TwoDrives {
    started_1: Mutex<bool>,
    cv: Condvar,
    fail: Vec<u32>,
}

impl ReadAt for TwoDrives {
    fn read_at(&self, file: u32, _offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        if self.fail.contains(&file) {
            return Err(io::Error::other("injected EIO"));
        }
        if file == 1 {
            *self.started_1.lock().unwrap() = true;
            self.cv.notify_all();
        } else {
            let g = self.started_1.lock().unwrap();
            let (g, _) = self
                .cv
                .wait_timeout_while(g, Duration::from_secs(5), |s| !*s)
                .unwrap();
            if !*g {
                return Err(io::Error::other("drive 1 never got a read"));
            }
        }
        dst.fill(file as u8 + 1);
        Ok(dst.len())
    }
}

fn fetcher(fail: Vec<u32>) -> ExpertFetcher {
    let reader = Arc::new(TwoDrives {
        started_1: Mutex::new(false),
        cv: Condvar::new(),
        fail,
    });
    let mut f = ExpertFetcher::new(
        ExpertCacheConfig {
            slots: 4,
            slot_bytes: 0,
            readers: 1,
        },
        table(),
        reader,
    )
    .unwrap();
    f.set_devices(DeviceMap::from_keys(&[Some(7), Some(9)], |k| {
        format!("fake{k}")
    }));
    f
}

/// Catches one shared queue for every drive (or pools per drive fed in plain file order
/// through one queue): with one reader, drive 0's first read then waits for a drive-1 read
/// that is queued behind it, and fails. With a pool per drive every expert lands, with
/// its own drive's bytes.
#[test]
fn every_drive_reads_at_once() {
    let mut f = fetcher(Vec::new());
    assert_eq!(f.devices().names(), &["fake7", "fake9"]);
    let mut got = Vec::new();
    let mut failed = Vec::new();
    f.fetch_batch(0, &[0, 2, 1, 3], |ev| match ev {
        BatchEvent::Ready(a) => {
            let want = (a.expert % 2) as u8 + 1;
            assert!(a.data.iter().all(|&b| b == want), "expert {}", a.expert);
            got.push(a.expert);
        }
        BatchEvent::Failed(e) => failed.push(e.to_string()),
    });
    assert!(failed.is_empty(), "{failed:?}");
    got.sort_unstable();
    assert_eq!(got, vec![0, 1, 2, 3]);
}

/// Catches a drive failure that is silent or spreads: the failing drive's experts fail,
/// each naming the drive, and the other drive's experts are published with their bytes.
#[test]
fn a_failing_drive_fails_its_experts_naming_it() {
    let mut f = fetcher(vec![0]);
    let mut got = Vec::new();
    let mut failed = Vec::new();
    f.fetch_batch(0, &[0, 1, 2, 3], |ev| match ev {
        BatchEvent::Ready(a) => {
            assert!(a.data.iter().all(|&b| b == 2), "expert {}", a.expert);
            got.push(a.expert);
        }
        BatchEvent::Failed(e) => failed.push(e),
    });
    got.sort_unstable();
    assert_eq!(got, vec![1, 3]);
    assert_eq!(failed.len(), 2);
    for e in &failed {
        assert!(
            matches!(e, FetchError::Read { why: ReadFailure::Io(m), .. } if m.contains("device fake7")),
            "{e}"
        );
    }
}

/// Reads every file's bytes as the file number plus one, and counts the reads per file.
struct Counting(Mutex<Vec<u32>>);

impl ReadAt for Counting {
    fn read_at(&self, file: u32, _offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        self.0.lock().unwrap().push(file);
        dst.fill(file as u8 + 1);
        Ok(dst.len())
    }
}

/// Experts 0..8 of layer 0, each in both files (one per fake drive) at the same offset.
fn mirrored() -> Arc<ExpertTable> {
    let mut t = ExpertTable::new(vec![PathBuf::from("/a/0"), PathBuf::from("/b/1")]);
    for e in 0..8u32 {
        let off = e as u64 * BYTES;
        t.insert(0, e, ExpertExtents::contiguous(0, off, BYTES));
        assert!(t.insert_copy(0, e, ExpertExtents::contiguous(1, off, BYTES)));
    }
    // A copy laid out otherwise (another start within the page) is refused.
    assert!(!t.insert_copy(0, 0, ExpertExtents::contiguous(1, 100, BYTES)));
    Arc::new(t)
}

/// 8 slots over [`mirrored`], on two fake drives, reading through `reader`.
fn mirrored_fetcher(reader: Arc<dyn ReadAt>) -> ExpertFetcher {
    let mut f = ExpertFetcher::new(
        ExpertCacheConfig {
            slots: 8,
            slot_bytes: 0,
            readers: 2,
        },
        mirrored(),
        reader,
    )
    .unwrap();
    f.set_devices(DeviceMap::from_keys(&[Some(7), Some(9)], |k| {
        format!("fake{k}")
    }));
    f
}

/// Every expert on both drives (`pack-experts --copies 2`): a batch of 8 misses reads 4 from
/// each drive, and each expert is published whole. Catches a fetcher that reads the first
/// copy only (all 8 from drive 0: the layer waits for one drive reading everything), and a
/// choice that ignores the load (8 from one drive as well). A second batch of the same
/// experts reads nothing.
#[test]
fn copies_spread_a_batch_over_the_drives() {
    let reads = Arc::new(Counting(Mutex::new(Vec::new())));
    let mut f = mirrored_fetcher(reads.clone());
    let mut got = Vec::new();
    f.fetch_batch(0, &[5, 1, 7, 0, 2, 6, 3, 4], |ev| match ev {
        BatchEvent::Ready(a) => {
            assert_eq!(a.data.len() as u64, BYTES);
            assert!(
                a.data.iter().all(|&b| b == a.data[0]),
                "expert {}",
                a.expert
            );
            got.push(a.expert);
        }
        BatchEvent::Failed(e) => panic!("{e}"),
    });
    got.sort_unstable();
    assert_eq!(got, (0..8).collect::<Vec<_>>());
    let per_file = |f: u32| reads.0.lock().unwrap().iter().filter(|&&x| x == f).count();
    assert_eq!((per_file(0), per_file(1)), (4, 4));
    f.fetch_batch(0, &[0, 1, 2, 3, 4, 5, 6, 7], |_| {});
    assert_eq!(reads.0.lock().unwrap().len(), 8, "hits read nothing");
}

/// Reads every file's bytes as the file number plus one; every read of file 1 fails.
struct DeadSecond(Mutex<Vec<u32>>);

impl ReadAt for DeadSecond {
    fn read_at(&self, file: u32, _offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        self.0.lock().unwrap().push(file);
        if file == 1 {
            return Err(io::Error::other("injected EIO"));
        }
        dst.fill(file as u8 + 1);
        Ok(dst.len())
    }
}

/// Every expert on both drives and drive 1's file failing every read: each expert sent
/// there is read again from drive 0 into the same slot, published with drive 0's bytes,
/// none fails, and `failovers` counts them; the next batch sends nothing to that file.
/// Catches a failure that ends the expert although a copy is left, a retry of the same
/// dead drive, and a drive that keeps getting reads once it has failed. Without copies a
/// failing drive fails its experts (`a_failing_drive_fails_its_experts_naming_it`).
#[test]
fn a_failing_drive_is_read_around_where_copies_are_left() {
    let reads = Arc::new(DeadSecond(Mutex::new(Vec::new())));
    let mut f = mirrored_fetcher(reads.clone());
    let mut got = Vec::new();
    f.fetch_batch(0, &[0, 1, 2, 3], |ev| match ev {
        BatchEvent::Ready(a) => {
            assert!(a.data.iter().all(|&b| b == 1), "expert {}", a.expert);
            got.push(a.expert);
        }
        BatchEvent::Failed(e) => panic!("{e}"),
    });
    got.sort_unstable();
    assert_eq!(got, vec![0, 1, 2, 3]);
    let failed = reads.0.lock().unwrap().iter().filter(|&&x| x == 1).count();
    assert!(failed >= 1, "the batch sent reads to both drives");
    assert_eq!(f.total_stats().failovers, failed as u64);
    assert_eq!(f.total_stats().failed, 0);
    let before = reads.0.lock().unwrap().len();
    f.fetch_batch(0, &[4, 5, 6, 7], |ev| {
        assert!(matches!(ev, BatchEvent::Ready(_)), "{ev:?}");
    });
    let after: Vec<u32> = reads.0.lock().unwrap()[before..].to_vec();
    assert_eq!(after, vec![0; 4], "drive 1 is down");
    let report = f.render_stats("run", &f.total_stats());
    assert!(report.contains("(failed: /b/1 (device fake9))"), "{report}");
}
