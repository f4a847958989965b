//! The expert fetcher against the seed's cache fixture (24 experts x 6 MXFP4 tensors whose
//! sizes are not multiples of 4096, contents derived from the expert index) and against
//! in-memory readers that record, delay or fail reads.
//!
//! The oracle for every byte is the fixture file itself, sliced by its own header offsets.

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use k3_expert_fetcher::{
    BatchEvent, BatchIo, ExpertCacheConfig, ExpertExtents, ExpertFetcher, ExpertTable, Extent,
    FetchError, Locate, ReadFailure,
};
use k3_io::arena::ArenaMemory;
use k3_io::{DirectFiles, FaultyReader, ReadAt};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/seed/cache/model-00001-of-00001.safetensors")
}

fn table() -> Arc<ExpertTable> {
    Arc::new(ExpertTable::from_safetensors(&[fixture()]).expect("fixture header"))
}

/// The expert's bytes straight from the file, by the header's offsets.
fn expected(t: &ExpertTable, expert: u32) -> Vec<u8> {
    let all = std::fs::read(fixture()).unwrap();
    let l = t.locate(0, expert).unwrap();
    all[l.start() as usize..l.end() as usize].to_vec()
}

fn fetcher(slots: usize, readers: usize, reader: Arc<dyn ReadAt>) -> ExpertFetcher {
    let t = table();
    ExpertFetcher::new(
        ExpertCacheConfig {
            slots,
            slot_bytes: 0,
            readers,
        },
        t,
        reader,
    )
    .expect("fetcher")
}

fn direct() -> Arc<dyn ReadAt> {
    Arc::new(DirectFiles::open(&[fixture()]).unwrap())
}

/// Run a batch, checking every published expert's bytes inside the callback (while the slot
/// is guaranteed), and return (published ids in arrival order, failures).
fn batch(f: &mut ExpertFetcher, ids: &[u32]) -> (Vec<(u32, bool)>, Vec<FetchError>) {
    let t = table();
    let mut got = Vec::new();
    let mut failed = Vec::new();
    f.fetch_batch(0, ids, |ev| match ev {
        BatchEvent::Ready(a) => {
            assert_eq!(a.layer, 0);
            assert_eq!(
                a.data,
                &expected(&t, a.expert)[..],
                "bytes of expert {}",
                a.expert
            );
            assert_eq!(a.len as usize, a.data.len());
            got.push((a.expert, a.hit));
        }
        BatchEvent::Failed(e) => failed.push(e),
    });
    (got, failed)
}

#[test]
fn fixture_geometry_is_non_conforming() {
    let t = table();
    assert_eq!(t.len(), 24);
    for e in 0..24 {
        let l = t.locate(0, e).unwrap();
        // 6 tensors, contiguous: 3 x (512 + 32) bytes = 1632, not a multiple of 4096.
        assert_eq!(l.extents.len(), 1, "expert {e} contiguous");
        assert_eq!(l.span(), 1632);
        assert_eq!(t.tensors(0, e).len(), 6);
    }
    // Some experts straddle a page boundary; an implementation assuming alignment breaks.
    assert!((0..24).any(|e| {
        let l = t.locate(0, e).unwrap();
        l.start() / 4096 != (l.end() - 1) / 4096
    }));
    let f = fetcher(4, 2, direct());
    assert_eq!(f.slot_bytes(), 4096 + 4096);
}

/// Wrong implementations caught: slots sized to the expert without head room (an expert at
/// offset 4000 overruns), reading to the slot start instead of `offset % 4096`, two
/// reservations landing in one slot (aliasing), publishing a slot before its read landed.
#[test]
fn every_expert_arrives_with_its_own_bytes() {
    let mut f = fetcher(8, 4, direct());
    let ids: Vec<u32> = (0..8).rev().collect();
    let (got, failed) = batch(&mut f, &ids);
    assert!(failed.is_empty(), "{failed:?}");
    let mut seen: Vec<u32> = got.iter().map(|g| g.0).collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..8).collect::<Vec<_>>());
    let st = f.total_stats();
    assert_eq!(
        (st.requests, st.hits, st.misses, st.evictions),
        (8, 0, 8, 0)
    );
    assert_eq!(st.reads, 8);
    assert!(st.bytes_read >= 8 * 1632);

    // More experts than slots: the batch's slots are reused in turn, and still no slot
    // holds the wrong expert.
    let ids: Vec<u32> = (0..24).collect();
    let (got, failed) = batch(&mut f, &ids);
    assert!(failed.is_empty());
    assert_eq!(got.len(), 24);
    // 0..8 were resident and are published first, as hits.
    assert!(got[..8].iter().all(|&(e, hit)| hit && e < 8), "{got:?}");
    assert_eq!(f.resident(), 8);
    // No slot claimed by the batch was a victim while the batch held it: the 8 hits and
    // the 16 misses went through the batch's 8 slots, with 16 evictions in all.
    assert_eq!(f.total_stats().evictions, 16);
    let summary = f.fetch_batch(0, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], |_| {});
    assert_eq!(summary.recycled, 2, "{summary:?}");
    assert_eq!((summary.hits, summary.reads), (0, 10));
    for s in 0..8 {
        let (_, key, _) = f.slot_state(s);
        let (l, e) = key.unwrap();
        let (off, len) = f.slot_range(s);
        let all = f.arena().clone();
        // SAFETY (test): the fetcher is idle, the arena outlives this read.
        let bytes =
            unsafe { std::slice::from_raw_parts(all.base().add(off as usize), len as usize) };
        let loc = table().locate(l, e).unwrap();
        let head = (loc.start() % 4096) as usize;
        assert_eq!(&bytes[head..head + 1632], &expected(&table(), e)[..]);
    }
}

#[test]
fn lru_evicts_the_least_recently_used_and_counts_true_hits() {
    let mut f = fetcher(2, 2, direct());
    batch(&mut f, &[0]);
    batch(&mut f, &[1]);
    batch(&mut f, &[0]); // 0 is now the most recent
                         // Same step: that hit was read this step, so it is not a TRUE resident hit.
    let st = f.step_stats();
    assert_eq!((st.requests, st.hits, st.hits_read_this_step), (3, 1, 1));
    assert_eq!(st.true_resident_hit_rate(), 0.0);
    f.begin_step();
    batch(&mut f, &[2]); // evicts 1 (LRU), not 0 (an MRU/FIFO bug evicts 0)
    assert!(f.is_resident(0, 0) && f.is_resident(0, 2) && !f.is_resident(0, 1));
    let (got, _) = batch(&mut f, &[0]);
    assert_eq!(got, vec![(0, true)]);
    let st = f.step_stats();
    assert_eq!(
        (st.requests, st.hits, st.hits_read_this_step, st.evictions),
        (2, 1, 0, 1)
    );
    assert_eq!(st.true_resident_hit_rate(), 0.5);
    assert_eq!(f.total_stats().requests, 5);
}

#[test]
fn pinned_experts_survive_and_prefetch_counts_as_read_this_step() {
    let mut f = fetcher(3, 2, direct());
    batch(&mut f, &[5]);
    assert!(f.pin(0, 5));
    assert!(!f.pin(0, 6), "not resident");
    for e in 6..20 {
        batch(&mut f, &[e]);
    }
    assert!(f.is_resident(0, 5));
    assert_eq!(f.pinned(), 1);
    // A batch larger than the unpinned slots reuses them around the pinned one.
    let (got, failed) = batch(&mut f, &[20, 21, 22, 23, 5]);
    assert!(failed.is_empty());
    assert_eq!(got.len(), 5);

    f.begin_step();
    f.prefetch(0, &[1, 2]);
    let (got, _) = batch(&mut f, &[1, 2, 5]);
    assert!(got.iter().all(|g| g.1));
    let st = f.step_stats();
    assert_eq!((st.requests, st.hits, st.hits_read_this_step), (3, 3, 2));
    assert_eq!(st.prefetch_reads, 2);
    assert!((st.true_resident_hit_rate() - 1.0 / 3.0).abs() < 1e-12);
}

/// A failed read is reported for that expert only, counted, never published, and its slot is
/// freed. Wrong implementations caught: publishing the slot anyway (stale bytes), dropping the
/// error silently, or leaking the slot as INFLIGHT (the arena shrinks each failure).
#[test]
fn injected_read_errors_are_reported_counted_and_not_published() {
    let t = table();
    let bad = t.locate(0, 5).unwrap();
    let faulty = Arc::new(FaultyReader::new(
        DirectFiles::open(&[fixture()]).unwrap(),
        vec![(0, bad.start(), bad.end())],
    ));
    let mut f = fetcher(4, 4, faulty.clone());
    // Expert 5's pages may also hold 4's or 6's bytes; pick neighbours that do not share them.
    let (got, failed) = batch(&mut f, &[1, 5, 12]);
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(
        matches!(&failed[0], FetchError::Read { layer: 0, expert: 5, why: why @ ReadFailure::Io(_) }
            if why.to_string().contains("injected"))
    );
    let mut ids: Vec<u32> = got.iter().map(|g| g.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![1, 12]);
    assert!(!f.is_resident(0, 5));
    assert_eq!(f.total_stats().failed, 1);
    // Again: fails again (not served from a half-filled slot), and slots are not leaked.
    for _ in 0..5 {
        let (_, failed) = batch(&mut f, &[5]);
        assert_eq!(failed.len(), 1);
    }
    assert_eq!(f.total_stats().failed, 6);
    let (got, failed) = batch(&mut f, &[20, 21, 22, 23]);
    assert!(failed.is_empty());
    assert_eq!(got.len(), 4);
    assert_eq!(f.resident(), 4);
    assert!(faulty.injected() >= 6);

    // An expert the checkpoint does not have is a failure too, not a panic.
    let (_, failed) = batch(&mut f, &[99]);
    assert_eq!(
        failed,
        vec![FetchError::Unknown {
            layer: 0,
            expert: 99
        }]
    );
}

/// Records the offsets it is asked for; serves from memory.
struct Recording {
    bytes: Vec<u8>,
    calls: Mutex<Vec<u64>>,
}

impl ReadAt for Recording {
    fn read_at(&self, _file: u32, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        self.calls.lock().unwrap().push(offset);
        let o = offset as usize;
        let n = dst.len().min(self.bytes.len().saturating_sub(o));
        dst[..n].copy_from_slice(&self.bytes[o..o + n]);
        Ok(n)
    }
}

/// `n` contiguous experts of `size` bytes in layer `layer`, expert `e` at byte
/// `1000 + e * size` of an in-memory file that records its reads; a fetcher over it.
fn in_memory(
    layer: u32,
    n: u32,
    size: u64,
    slots: usize,
    readers: usize,
) -> (ExpertFetcher, Arc<Recording>, Vec<u8>) {
    let mut t = ExpertTable::new(vec![PathBuf::from("mem")]);
    for e in 0..n {
        t.insert(
            layer,
            e,
            ExpertExtents::contiguous(0, 1000 + e as u64 * size, size),
        );
    }
    let bytes: Vec<u8> = (0..1000 + n as u64 * size + 8192)
        .map(|i| (i % 253) as u8)
        .collect();
    let rec = Arc::new(Recording {
        bytes: bytes.clone(),
        calls: Mutex::new(Vec::new()),
    });
    let f = ExpertFetcher::new(
        ExpertCacheConfig {
            slots,
            slot_bytes: 0,
            readers,
        },
        Arc::new(t),
        rec.clone(),
    )
    .unwrap();
    (f, rec, bytes)
}

/// Misses are read in disk order whatever order the router asked in. Wrong implementation
/// caught: reading in request order (random seeks on the real device).
#[test]
fn misses_are_read_in_disk_order() {
    let size = 20_000u64;
    // One reader: the call order is the issue order.
    let (mut f, rec, bytes) = in_memory(3, 16, size, 16, 1);
    let ids = [9u32, 2, 15, 0, 7, 3, 11, 1, 14, 4, 8, 13, 5, 10, 6, 12];
    let mut n = 0;
    f.fetch_batch(3, &ids, |ev| {
        let BatchEvent::Ready(a) = ev else {
            panic!("{ev:?}")
        };
        let s = 1000 + a.expert as usize * size as usize;
        assert_eq!(a.data, &bytes[s..s + size as usize]);
        n += 1;
    });
    assert_eq!(n, 16);
    let calls = rec.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 16);
    assert!(calls.windows(2).all(|w| w[0] < w[1]), "{calls:?}");
}

/// Experts whose tensors are not contiguous (six reads) land at their file-relative offsets.
#[test]
fn non_contiguous_experts_keep_their_layout() {
    let src = table();
    let mut t = ExpertTable::new(vec![fixture()]);
    // Expert 30 := expert 2's w1.weight_packed + expert 9's w3 tensors (a gap of other bytes).
    let a = src.locate(0, 2).unwrap();
    let b = src.locate(0, 9).unwrap();
    t.insert(
        0,
        30,
        ExpertExtents {
            file: 0,
            extents: vec![
                Extent {
                    offset: a.start(),
                    len: 512,
                },
                Extent {
                    offset: b.start() + 1088,
                    len: 544,
                },
            ],
            parts: Vec::new(),
        },
    );
    let all = std::fs::read(fixture()).unwrap();
    let mut f = ExpertFetcher::new(
        ExpertCacheConfig {
            slots: 2,
            slot_bytes: 0,
            readers: 2,
        },
        Arc::new(t),
        direct(),
    )
    .unwrap();
    let mut seen = HashMap::new();
    f.fetch_batch(0, &[30], |ev| {
        let BatchEvent::Ready(a2) = ev else {
            panic!("{ev:?}")
        };
        seen.insert(
            a2.expert,
            (
                a2.data[..512].to_vec(),
                a2.data[a2.data.len() - 544..].to_vec(),
            ),
        );
    });
    let (head, tail) = &seen[&30];
    assert_eq!(
        &head[..],
        &all[a.start() as usize..a.start() as usize + 512]
    );
    let bs = (b.start() + 1088) as usize;
    assert_eq!(&tail[..], &all[bs..bs + 544]);
}

#[test]
fn setup_refuses_nonsense() {
    let t = table();
    let r = ExpertFetcher::new(
        ExpertCacheConfig {
            slots: 0,
            slot_bytes: 0,
            readers: 1,
        },
        t.clone(),
        direct(),
    );
    assert!(r.is_err());
    let r = ExpertFetcher::new(
        ExpertCacheConfig {
            slots: 2,
            slot_bytes: 1632,
            readers: 1,
        },
        t,
        direct(),
    );
    assert!(
        r.is_err(),
        "a slot without head room cannot take an unaligned expert"
    );
}

#[test]
fn trace_recording_round_trips_through_the_simulator_reader() {
    let mut f = fetcher(4, 2, direct());
    f.record_trace();
    batch(&mut f, &[3, 1]);
    batch(&mut f, &[1, 2]);
    let dir = tempfile::tempdir().unwrap();
    let (bin, hist) = f.trace().unwrap().write(dir.path()).unwrap();
    let back = k3_expert_fetcher::sim::read_trace(&bin).unwrap();
    assert_eq!(back, vec![(0, 3), (0, 1), (0, 1), (0, 2)]);
    let h: serde_json::Value = serde_json::from_slice(&std::fs::read(hist).unwrap()).unwrap();
    assert_eq!(h["requests"], 4);
    assert_eq!(h["distinct"], 3);
    assert_eq!(h["layers"]["0"]["1"], 2);
}

/// The protocol's locator and this crate's header reader agree on every fixture expert.
#[test]
fn catalog_locations_match_the_header_reader() {
    let cat = k3_model::catalog::Catalog::open(fixture()).unwrap();
    let a = ExpertTable::from_catalog(&cat, 0..1, 24).unwrap();
    let b = table();
    for e in 0..24 {
        assert_eq!(a.locate(0, e), b.locate(0, e), "expert {e}");
        assert_eq!(a.tensors(0, e), b.tensors(0, e), "expert {e}");
    }
    assert!(ExpertTable::from_catalog(&cat, 0..1, 25).is_err());
}

/// The pipeline moves a fetcher into its stage thread; the report names the TRUE rate.
#[test]
fn fetcher_is_send_and_reports() {
    fn send<T: Send>() {}
    send::<ExpertFetcher>();
    let mut f = fetcher(2, 1, direct());
    batch(&mut f, &[0, 1]);
    let text = f.render_stats("final step", &f.step_stats());
    assert!(
        text.contains("requests     : 2  hits 0 (0.00%)  misses 2"),
        "{text}"
    );
    assert!(text.contains("TRUE resident hit rate 0.00%"), "{text}");
}

/// Expert-slot release is explicit: with `hold_published` (what the stage runs with), a
/// published slot is never a victim until `release` names it, so a reader in another
/// process never sees its slot rewritten. Without the hold (the old convention) the LRU
/// would evict expert 0 for expert 2 below while compute still reads it.
#[test]
fn held_slots_are_never_evicted_until_released() {
    let mut f = fetcher(2, 2, direct());
    f.hold_published(true);
    batch(&mut f, &[0, 1]);
    assert_eq!(f.held(), 2);
    // Every slot is held: the miss fails with NoSlot instead of overwriting a held slot.
    let (got, failed) = batch(&mut f, &[2]);
    assert!(got.is_empty());
    assert!(
        matches!(failed.as_slice(), [FetchError::NoSlot { expert: 2, .. }]),
        "{failed:?}"
    );
    assert!(f.is_resident(0, 0) && f.is_resident(0, 1));
    // A hit on a held expert is served (and stays held).
    let (got, _) = batch(&mut f, &[1]);
    assert_eq!(got, vec![(1, true)]);
    // Released: 0 becomes the LRU victim, 1 stays held.
    assert_eq!(f.release(0, &[0]), 1);
    let (got, failed) = batch(&mut f, &[2]);
    assert_eq!((got, failed.len()), (vec![(2, false)], 0));
    assert!(!f.is_resident(0, 0) && f.is_resident(0, 1) && f.is_resident(0, 2));
    assert_eq!(f.release(0, &[1, 2, 7]), 2);
    assert_eq!(f.held(), 0);
}

/// A reader that holds every published expert until it has used it, as compute in another
/// process does: it checks an expert's bytes in the arena only when it releases it (one
/// per poll, in arrival order, after a delay), and records where each expert was published.
struct HoldingReader {
    arena: Arc<dyn ArenaMemory>,
    table: Arc<ExpertTable>,
    held: std::collections::VecDeque<(u32, u64, u64)>,
    published: Vec<(u32, u64)>,
    /// Release everything the batch asked for at the first poll, before it is published
    /// (what a replayed recording does).
    early: Option<Vec<u32>>,
    /// What that first poll released: from then on the fetcher holds none of it, so its
    /// slots may be reused as soon as the callback returns and its bytes are not checked
    /// later (a check there raced the slot's next read).
    released: Vec<u32>,
}

impl BatchIo for HoldingReader {
    fn event(&mut self, ev: BatchEvent<'_>) {
        match ev {
            BatchEvent::Ready(a) => {
                assert_eq!(a.data, &expected(&self.table, a.expert)[..]);
                if !self.released.contains(&a.expert) {
                    self.held.push_back((a.expert, a.arena_offset, a.len));
                }
                self.published.push((a.expert, a.arena_offset));
            }
            BatchEvent::Failed(e) => panic!("{e}"),
        }
    }

    fn takes_releases(&self) -> bool {
        true
    }

    fn releases(
        &mut self,
        wait: Option<std::time::Duration>,
    ) -> Result<Vec<(u32, Vec<u32>)>, k3_expert_fetcher::ReaderGone> {
        if let Some(ids) = self.early.take() {
            self.held.retain(|h| !ids.contains(&h.0));
            self.released.clone_from(&ids);
            return Ok(vec![(0, ids)]);
        }
        let Some((e, off, len)) = self.held.pop_front() else {
            assert!(
                wait.is_some(),
                "the batch waits for a release while nothing is held"
            );
            return Ok(Vec::new());
        };
        std::thread::sleep(std::time::Duration::from_millis(2));
        // SAFETY (test): the slot is held for us until this release; the arena outlives it.
        let bytes = unsafe {
            std::slice::from_raw_parts(self.arena.base().add(off as usize), len as usize)
        };
        assert_eq!(
            bytes,
            &expected(&self.table, e)[..],
            "expert {e} rewritten while held"
        );
        Ok(vec![(0, vec![e])])
    }
}

/// Reads after a delay that varies with the offset and a seed, so reads land in a
/// different order from run to run.
struct Jittery {
    inner: Arc<dyn ReadAt>,
    seed: u64,
}

impl ReadAt for Jittery {
    fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        let h = (offset ^ self.seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 61;
        std::thread::sleep(std::time::Duration::from_millis(h));
        self.inner.read_at(file, offset, dst)
    }
}

/// A held batch larger than the arena: each slot is reused only after the reader released
/// what it held (the reader checks the bytes at release), every expert is published once,
/// nothing stays held, and the slot each expert lands in does not depend on when reads land
/// or releases come (two runs with different read delays agree). Wrong implementations
/// caught: reusing a slot on publication instead of release (the bytes change under the
/// reader), failing the rest with NoSlot as a batch without releases must, or choosing the
/// next free slot in arrival order (placements differ between the runs).
#[test]
fn a_held_batch_reuses_each_slot_once_released() {
    let ids: Vec<u32> = vec![17, 3, 9, 21, 0, 12, 5, 23, 8, 14];
    let mut placements = Vec::new();
    for seed in [1u64, 0xdead_beef] {
        let reader: Arc<dyn ReadAt> = Arc::new(Jittery {
            inner: direct(),
            seed,
        });
        let mut f = fetcher(3, 3, reader);
        f.hold_published(true);
        // Two residents first: hits are published first and take their turn too.
        let mut io = HoldingReader {
            arena: f.arena().clone(),
            table: table(),
            held: Default::default(),
            published: Vec::new(),
            early: None,
            released: Vec::new(),
        };
        f.fetch_batch_io(0, &[3, 9], &mut io);
        io.held.clear();
        assert_eq!(f.release(0, &[3, 9]), 2);
        io.published.clear();
        let summary = f.fetch_batch_io(0, &ids, &mut io);
        assert_eq!((summary.hits, summary.reads, summary.failed), (2, 8, 0));
        assert_eq!(summary.recycled, 7, "{summary:?}");
        let mut seen: Vec<u32> = io.published.iter().map(|p| p.0).collect();
        seen.sort_unstable();
        let mut want = ids.clone();
        want.sort_unstable();
        assert_eq!(seen, want);
        // What the batch did not wait for is still held until released.
        let left: Vec<u32> = io.held.iter().map(|h| h.0).collect();
        assert_eq!(f.held(), left.len());
        assert_eq!(f.release(0, &left), left.len());
        assert_eq!(f.held(), 0);
        let mut p = io.published.clone();
        p.sort_unstable();
        placements.push(p);
    }
    assert_eq!(placements[0], placements[1]);
}

/// Releases that arrive before their expert is published (a replayed recording sends a
/// batch's releases up front) are kept, not lost: the batch completes and nothing stays
/// held. Wrong implementation caught: ignoring a release of an unpublished expert (the
/// batch then waits forever for a slot; here the reader asserts on that wait).
#[test]
fn releases_before_publication_are_kept() {
    let mut f = fetcher(2, 2, direct());
    f.hold_published(true);
    let ids: Vec<u32> = (0..7).collect();
    let mut io = HoldingReader {
        arena: f.arena().clone(),
        table: table(),
        held: Default::default(),
        published: Vec::new(),
        early: Some(ids.clone()),
        released: Vec::new(),
    };
    let summary = f.fetch_batch_io(0, &ids, &mut io);
    assert_eq!((summary.reads, summary.failed, summary.recycled), (7, 0, 5));
    assert_eq!(f.held(), 0);
}

/// An expert larger than a reader's piece (4 MiB) is read in several pieces by several
/// readers at once and still arrives whole, byte for byte, at an unaligned offset; its
/// pieces are asked for in order. Wrong implementations caught: a piece written at the
/// wrong place in the slot, a missing tail piece, an expert reported before its last
/// piece landed (the bytes would be incomplete inside the callback).
#[test]
fn a_large_expert_is_read_in_pieces_and_arrives_whole() {
    let size = 9 * (1u64 << 20) + 123;
    let (mut f, rec, bytes) = in_memory(0, 3, size, 2, 4);
    let mut n = 0;
    f.fetch_batch(0, &[2, 0, 1], |ev| {
        let BatchEvent::Ready(a) = ev else {
            panic!("{ev:?}")
        };
        let s = 1000 + a.expert as usize * size as usize;
        assert!(
            a.data == &bytes[s..s + size as usize],
            "expert {}",
            a.expert
        );
        n += 1;
    });
    assert_eq!(n, 3);
    // 9 MiB + 123 bytes from an unaligned offset spans 3 pieces of 4 MiB per expert.
    assert_eq!(rec.calls.lock().unwrap().len(), 9);
}
