//! Guessed experts read early (`src/guess.rs`): a guess never takes a held slot nor delays
//! a real read, a request takes over a wrong guess in flight, each drive's share of readers.

use std::collections::HashSet;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Duration;

use k3_expert_fetcher::fetcher::{BatchEvent, BatchSummary, ExpertCacheConfig, ExpertFetcher};
use k3_expert_fetcher::locate::{ExpertExtents, ExpertTable};
use k3_io::direct::ReadAt;

/// Each expert is one page at its own place in file 0.
const EXPERT: u64 = 4096;

fn offset(layer: u32, expert: u32) -> u64 {
    (layer as u64 * 64 + expert as u64) * 2 * EXPERT
}

/// A file of `(offset / 4096) as u8` bytes; reads of the `blocked` experts wait until
/// the gate opens.
struct GatedReader {
    blocked: HashSet<u64>,
    open: Mutex<bool>,
    cv: Condvar,
}

impl GatedReader {
    fn new(blocked: &[(u32, u32)]) -> Arc<GatedReader> {
        Arc::new(GatedReader {
            blocked: blocked.iter().map(|&(l, e)| offset(l, e)).collect(),
            open: Mutex::new(false),
            cv: Condvar::new(),
        })
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }
}

/// Opens the gate when dropped: declared after the fetcher, it is dropped first, so a
/// failing test ends (the fetcher's drop joins its readers) instead of hanging.
struct OpenOnDrop(Arc<GatedReader>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

impl ReadAt for GatedReader {
    fn read_at(&self, _file: u32, offset: u64, dst: &mut [u8]) -> std::io::Result<usize> {
        if self.blocked.contains(&offset) {
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.cv.wait(open).unwrap();
            }
        }
        dst.fill((offset / EXPERT) as u8);
        Ok(dst.len())
    }
}

fn fetcher(slots: usize, readers: usize, reader: Arc<GatedReader>) -> ExpertFetcher {
    let mut table = ExpertTable::new(vec!["experts.bin".into()]);
    for l in 0..4 {
        for e in 0..16 {
            table.insert(l, e, ExpertExtents::contiguous(0, offset(l, e), EXPERT));
        }
    }
    let config = ExpertCacheConfig {
        slots,
        slot_bytes: 0,
        readers,
    };
    ExpertFetcher::new(config, Arc::new(table), reader).unwrap()
}

/// Fetch `ids` of `layer`, checking every published expert's bytes.
fn fetch(f: &mut ExpertFetcher, layer: u32, ids: &[u32]) -> BatchSummary {
    f.fetch_batch(layer, ids, |ev| match ev {
        BatchEvent::Ready(a) => {
            let want = (offset(a.layer, a.expert) / EXPERT) as u8;
            assert!(
                a.data.iter().all(|&b| b == want),
                "{}/{}",
                a.layer,
                a.expert
            );
        }
        BatchEvent::Failed(e) => panic!("{e}"),
    })
}

/// Fetch on another thread; `None` when it did not finish within `wait`.
fn fetch_within(
    f: &mut ExpertFetcher,
    layer: u32,
    ids: &[u32],
    wait: Duration,
    after: impl FnOnce(),
) -> Option<BatchSummary> {
    std::thread::scope(|sc| {
        let (tx, rx) = mpsc::channel();
        sc.spawn(move || {
            let _ = tx.send(fetch(f, layer, ids));
        });
        let got = rx.recv_timeout(wait).ok();
        // Let a batch stuck behind a blocked read finish, so the scope can end.
        after();
        got
    })
}

/// Wait until no guess read is in flight, issuing the queued ones as slots allow.
fn settle(f: &mut ExpertFetcher) {
    f.pump_guesses();
    while f.guesses_pending() {
        std::thread::sleep(Duration::from_millis(1));
        f.pump_guesses();
    }
}

/// Catches a guess that takes a held slot or another unused guess's, and a guess read
/// of an expert that is resident already (under no budget nothing is read). With two
/// of four slots held and three guessed, one read may be in flight below the reserve
/// (more would leave the next request short of several slots).
#[test]
fn a_guess_never_takes_a_held_slot() {
    let reader = GatedReader::new(&[(1, 5), (1, 6), (1, 7)]);
    let mut f = fetcher(4, 4, reader.clone());
    let _open = OpenOnDrop(reader.clone());
    f.hold_published(true);
    assert_eq!(fetch(&mut f, 0, &[0, 1]).published, 2);
    f.guess(1, 1, &[5, 6, 7]);
    f.pump_guesses();
    assert_eq!(f.guess_stats().reads, 1, "one read below the reserve");
    reader.open();
    settle(&mut f);
    // 5 and 6 took the EMPTY slots; 7 finds only held slots and unused guesses.
    assert_eq!(f.guess_stats().reads, 2);
    assert!(f.is_resident(0, 0) && f.is_resident(0, 1));
    assert_eq!(f.held(), 2);
    assert!(f.is_resident(1, 5) && f.is_resident(1, 6));
    // Layer 0 given back: a passed layer's slot takes 7.
    f.release(0, &[0, 1]);
    settle(&mut f);
    assert_eq!(f.guess_stats().reads, 3);
    assert!(f.is_resident(1, 7));
    let s = fetch(&mut f, 1, &[5, 6, 7]);
    assert_eq!((s.hits, s.reads), (3, 0), "guess hits are cache hits");
    assert_eq!(f.guess_stats().saved, 3);
    // Resident already: a guess of them reads nothing.
    f.release(1, &[5, 6, 7]);
    f.guess(2, 1, &[5, 6]);
    assert_eq!(f.guess_stats().reads, 3);
    assert!(!f.guesses_pending());
}

/// The case that read no guess on the slice at 5.5 GB (16 slots, top-16): the cache
/// holds exactly one request. Catches a reserve of the largest request seen (or of the
/// whole cache), which leaves no slot to any guess there; and a guess that evicts the
/// layer it guesses instead of the passed one.
#[test]
fn a_guess_is_read_when_the_cache_holds_one_request() {
    let reader = GatedReader::new(&[]);
    let mut f = fetcher(4, 4, reader.clone());
    f.hold_published(true);
    assert_eq!(fetch(&mut f, 0, &[0, 1, 2, 3]).published, 4);
    f.guess(1, 1, &[4, 5, 6, 7]);
    f.pump_guesses();
    assert_eq!(f.guess_stats().reads, 0, "every slot is held");
    f.release(0, &[0, 1, 2, 3]);
    settle(&mut f);
    assert_eq!(f.guess_stats().reads, 4);
    assert!((0..4).all(|e| !f.is_resident(0, e)), "layer 0 was passed");
    let s = fetch(&mut f, 1, &[4, 5, 6, 7]);
    assert_eq!((s.hits, s.reads, s.published), (4, 0, 4));
    let g = f.guess_stats();
    assert_eq!((g.saved, g.taken_over, g.wasted_bytes), (4, 0, 0));
}

/// A wrong guess read in flight when the request comes, in a cache that holds one
/// request. Catches: a request left a slot short (its last miss failing NoSlot, or
/// waiting for compute to release a slot), a request whose other reads wait for the
/// guess read, a miss read into the slot while the guess read still writes it (it
/// would be published before the guess lands, and the guess's bytes would overwrite
/// it), and the guess's bytes not counted as wasted.
#[test]
fn a_request_takes_over_a_wrong_guess_in_flight() {
    let reader = GatedReader::new(&[(1, 9)]);
    let mut f = fetcher(4, 4, reader.clone());
    let _open = OpenOnDrop(reader.clone());
    f.hold_published(true);
    assert_eq!(fetch(&mut f, 0, &[0, 1, 2, 3]).published, 4);
    f.release(0, &[0, 1, 2, 3]);
    f.guess(1, 1, &[9]);
    assert_eq!(f.guess_stats().reads, 1);
    let wait = Duration::from_secs(10);
    let s = std::thread::scope(|sc| {
        let (tx, rx) = mpsc::channel();
        let f = &mut f;
        let h = sc.spawn(move || {
            f.fetch_batch(1, &[4, 5, 6, 7], |ev| match ev {
                BatchEvent::Ready(a) => {
                    let want = (offset(a.layer, a.expert) / EXPERT) as u8;
                    let ok = a.data.iter().all(|&b| b == want);
                    let _ = tx.send((a.expert, ok));
                }
                BatchEvent::Failed(e) => {
                    let _ = tx.send((u32::MAX, false));
                    eprintln!("{e}");
                }
            })
        });
        let mut got = Vec::new();
        for _ in 0..3 {
            got.push(rx.recv_timeout(wait).expect("a read waited on the guess"));
        }
        let early = rx.recv_timeout(Duration::from_millis(200));
        reader.open();
        assert!(early.is_err(), "read before the guess landed: {early:?}");
        let last = rx
            .recv_timeout(wait)
            .expect("the taken-over miss was never published");
        assert!(
            got.iter().all(|&(e, ok)| ok && e != 7),
            "the first three: {got:?}"
        );
        assert_eq!(last, (7, true), "the taken-over slot's expert");
        h.join().expect("the batch")
    });
    assert_eq!((s.published, s.reads, s.failed, s.recycled), (4, 4, 0, 0));
    let g = f.guess_stats();
    assert_eq!((g.taken_over, g.wasted_bytes, g.saved), (1, EXPERT, 0));
    // The slot holds 7's bytes, not the guess's that landed before them.
    f.release(1, &[4, 5, 6, 7]);
    assert_eq!(fetch(&mut f, 1, &[7]).hits, 1);
}

/// Catches a guess read queued in the readers' channel ahead of a real read (with two
/// readers, both blocked on guesses, the real read could not start), and a request
/// that waits for a queued guess instead of reading it itself.
#[test]
fn a_guess_read_never_delays_a_real_one() {
    let reader = GatedReader::new(&[(1, 5), (1, 6)]);
    let mut f = fetcher(8, 2, reader.clone());
    let _open = OpenOnDrop(reader.clone());
    assert_eq!(fetch(&mut f, 0, &[0]).published, 1);
    f.guess(1, 1, &[5, 6, 9]);
    // One reader's worth of guess pieces at most: 5 is being read, 6 and 9 wait.
    assert_eq!(f.guess_stats().reads, 1);
    let s = fetch_within(&mut f, 1, &[9, 7], Duration::from_secs(10), || {
        reader.open()
    });
    let s = s.expect("a real read waited behind a guess read");
    assert_eq!((s.published, s.reads, s.failed), (2, 2, 0));
    let g = f.guess_stats();
    assert_eq!((g.reads, g.promoted, g.saved), (1, 1, 0));
    // 5 lands later as an ordinary LRU entry; a later request of it is a saved read.
    while f.guesses_pending() {
        f.pump_guesses();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(f.is_resident(1, 5));
    let s = fetch(&mut f, 1, &[5]);
    assert_eq!((s.hits, s.reads), (1, 0));
    assert_eq!(f.guess_stats().saved, 1);
}

/// Catches a request that reads an expert again while its guess read is in flight,
/// or that does not count the adopted read when it lands; and wasted bytes counted
/// for guesses that were used.
#[test]
fn a_guess_in_flight_is_adopted_and_unused_ones_are_wasted() {
    let reader = GatedReader::new(&[(1, 5)]);
    let mut f = fetcher(8, 4, reader.clone());
    let _open = OpenOnDrop(reader.clone());
    assert_eq!(fetch(&mut f, 0, &[0]).published, 1);
    f.guess(1, 1, &[5, 6]);
    assert_eq!(f.guess_stats().reads, 2);
    let wait = Duration::from_millis(200);
    // 5's read is blocked: the request waits for it (its own expert), not for 6.
    assert!(fetch_within(&mut f, 1, &[5], wait, || reader.open()).is_none());
    let g = f.guess_stats();
    assert_eq!((g.saved, g.reads), (1, 2));
    while f.guesses_pending() {
        f.pump_guesses();
        std::thread::sleep(Duration::from_millis(1));
    }
    f.score_guess(1, 1, &[5]);
    f.finish_guesses();
    let g = f.guess_stats();
    assert_eq!(g.wasted_bytes, EXPERT, "6 was read and never used");
    assert_eq!(g.bytes_read, 2 * EXPERT);
    assert_eq!((g.guessed, g.correct, g.actual), (2, 1, 1));
    assert_eq!((g.precision(), g.recall()), (0.5, 1.0));
}

/// Experts of odd id on drive 1, even on drive 0, two readers per drive.
fn two_drive_fetcher(reader: Arc<GatedReader>) -> ExpertFetcher {
    let mut table = ExpertTable::new(vec!["a.bin".into(), "b.bin".into()]);
    for l in 0..4 {
        for e in 0..16 {
            table.insert(l, e, ExpertExtents::contiguous(e % 2, offset(l, e), EXPERT));
        }
    }
    let config = ExpertCacheConfig {
        slots: 8,
        slot_bytes: 0,
        readers: 2,
    };
    let mut f = ExpertFetcher::new(config, Arc::new(table), reader).unwrap();
    f.set_devices(k3_expert_fetcher::devices::DeviceMap::from_keys(
        &[Some(0), Some(1)],
        |k| format!("dev{k}"),
    ));
    f
}

/// Each drive has its own readers, so each takes half of its own in guess reads: two
/// drives read two guesses at once where one drive read one. Catches a cap over every
/// drive's guesses together that stays at one drive's half (the second drive's
/// readers idle: one guess read), and one that is the drives' sum (two guesses on one
/// drive hold both its readers: its real read waits behind them).
#[test]
fn each_drive_takes_half_its_own_readers_in_guesses() {
    let reader = GatedReader::new(&[(1, 5), (1, 6), (1, 9)]);
    let mut f = two_drive_fetcher(reader.clone());
    let _open = OpenOnDrop(reader.clone());
    assert_eq!(fetch(&mut f, 0, &[0]).published, 1);
    // 5 on drive 1 and 6 on drive 0: both read; 9 (drive 1) waits for 5.
    f.guess(1, 1, &[5, 6, 9]);
    assert_eq!(f.guess_stats().reads, 2);
    drop(_open);
    reader.open();
    settle(&mut f);

    let reader = GatedReader::new(&[(1, 5), (1, 9)]);
    let mut f = two_drive_fetcher(reader.clone());
    let _open = OpenOnDrop(reader.clone());
    assert_eq!(fetch(&mut f, 0, &[0]).published, 1);
    // 5 and 9 are both on drive 1: only 5 is read; 9 (and 6 behind it) wait.
    f.guess(1, 1, &[5, 9, 6]);
    assert_eq!(f.guess_stats().reads, 1);
    let s = fetch_within(&mut f, 1, &[7], Duration::from_secs(10), || reader.open());
    let s = s.expect("a real read on drive 1 waited behind guess reads");
    assert_eq!((s.published, s.reads), (1, 1));
}
