//! Reads before the router decides (`--speculate on`, issue 35): compute's
//! `Guess{pass, layer, experts}` hints, read early into slots no request needs.
//!
//! A child module of [`crate::fetcher`] (declared there with `#[path]`), so its hooks reach
//! the cache's state without widening it. The rules:
//! - **Only slots nobody needs.** A guess takes an EMPTY slot, else the least recently
//!   used evictable one that is not of the guessed layer (those may be the coming
//!   request's hits) and not another unused guess; never a held, pinned, requested or
//!   INFLIGHT slot. In a decode step that is a slot of a layer already passed in this
//!   token: compute gives layer L's slots back before it asks for layer L+1, and until the
//!   next token only LRU would touch them, evicting them first anyway.
//! - **Room where it pays** (the reserve). The next request wants about as many slots as
//!   the guess names (`want`: exactly top-k for one row, the union of the rows' top-k
//!   otherwise). Guess reads in flight leave at least `want` slots free or evictable
//!   (a landed guess is either a hit or evictable, so only reads in flight count), except
//!   ONE: when the cache holds no more than one request (the slice at `--mem-gb 5.5`: 16
//!   slots, top-16, where the reserve of the largest request seen left no slot and no
//!   guess was ever read), a single guess read may be in flight below the reserve. If
//!   its guess was right the request adopts it (below); if wrong, the request **takes it
//!   over**: the slot becomes the request's at once (it claims as many slots as without
//!   guesses, so none of its experts waits for a slot compute must release), the guess
//!   read's bytes are wasted (`taken_over`), and the one miss given that slot is read as
//!   soon as the guess read lands. That read is the only one a guess can delay, by at most
//!   what is left of one guess read that was at the disk before the request came, while
//!   the request's other reads, issued at once, keep the disk busy.
//! - **Low priority.** Guess reads are issued only between batches, and at most half the
//!   readers' worth of pieces at once on each drive (none with a single reader; each drive
//!   has its own readers and queue, `devices::DeviceMap`): every guess piece is being read,
//!   none waits in a drive's queue, so a real read issued later never queues behind a
//!   guess. The rest wait here, in the order guessed.
//! - **Never waited on.** A batch waits only for its own reads (and a taken-over slot's
//!   guess read, above). When the real request arrives, a queued guess of one of its
//!   experts is dropped (the request reads it as an ordinary miss: "promoted"); a guess
//!   read in flight for it is adopted by the batch (it counts when it lands); a guess that
//!   already landed is a cache hit for the request (`saved`). Queued guesses of that layer
//!   that were not requested are dropped.
//! - Under no budget every guessed expert is resident already: nothing is read.
//!
//! Ids never depend on any of this (a slot holds the expert's file bytes, whichever read
//! filled it); only which slot an expert lands in, and the hit counts, do.

use std::collections::{HashMap, VecDeque};

use super::{Batch, Done, ExpertFetcher, SlotState, EMPTY_SLOT, PIECE};
use crate::locate::ExpertExtents;
use k3_io::arena::{align_down, align_up, ALIGN};

/// Tags of guess reads start here (a batch's own tags count up from 0, and a batch never
/// issues this many reads).
pub(super) const GUESS_TAG: usize = 1 << (usize::BITS - 2);

/// What the guesses did over a run (the report's `speculation`).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct GuessStats {
    /// `Guess` hints received.
    pub guesses: u64,
    /// Expert ids guessed, over all hints (distinct within a hint).
    pub guessed: u64,
    /// Of those, ids the same layer's request in the same pass asked for.
    pub correct: u64,
    /// Ids requested by the batches that had a guess (the recall's denominator).
    pub actual: u64,
    /// Guess reads issued (an expert already resident or in flight is not read again).
    pub reads: u64,
    /// Bytes the guess reads transferred (including those a request adopted).
    pub bytes_read: u64,
    /// Queued guesses a request asked for before they were issued (read as real misses).
    pub promoted: u64,
    /// Real requests that found their expert read by a guess: landed (a hit) or in flight
    /// (adopted, counted when it lands). Reads the request did not have to issue.
    pub saved: u64,
    /// Bytes read for guesses never used: evicted before any request, or unused at the end.
    pub wasted_bytes: u64,
    /// Guess reads that failed (the request, if any, reads it again).
    pub failed: u64,
    /// Guess reads in flight that a request took the slot of (it did not ask for their
    /// expert): their bytes count as wasted once they land.
    pub taken_over: u64,
}

impl GuessStats {
    /// correct / guessed: how many of the guessed experts were then requested.
    pub fn precision(&self) -> f64 {
        ratio(self.correct, self.guessed)
    }

    /// correct / actual: how many of the requested experts (of guessed batches) were guessed.
    pub fn recall(&self) -> f64 {
        ratio(self.correct, self.actual)
    }

    /// The report's `speculation` object: the counters, precision and recall.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!(self);
        v["precision"] = serde_json::json!(self.precision());
        v["recall"] = serde_json::json!(self.recall());
        v
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The guesses' state inside the fetcher.
#[derive(Default)]
pub(super) struct GuessState {
    /// Guessed experts not yet issued, in the order guessed.
    queue: VecDeque<(u32, u32)>,
    /// Guess reads in flight, by tag: the slot, the pieces it was issued as and the drive
    /// (`DeviceMap` index) they were issued to.
    inflight: HashMap<usize, (usize, usize, usize)>,
    next_tag: usize,
    /// Landed guesses no request has used yet, with their bytes.
    unused: HashMap<(u32, u32), u64>,
    /// The last guess of each layer, scored when that layer's request arrives.
    open: HashMap<u32, (u64, Vec<u32>)>,
    /// Distinct experts of the last guess: what the next request is expected to ask for,
    /// the free or evictable slots guess reads in flight leave (but one, see the module
    /// documentation).
    want: usize,
    stats: GuessStats,
    /// Every guess as `(pass, layer, expert)` when tracing (`--dump-cache-trace`).
    trace: Option<Vec<(u64, u32, u32)>>,
}

impl GuessState {
    /// `key` is leaving the cache: a guess no request used was wasted.
    pub(super) fn on_evict(&mut self, key: (u32, u32)) {
        if let Some(bytes) = self.unused.remove(&key) {
            self.stats.wasted_bytes += bytes;
        }
    }

    /// A request hit `key`: a guess that read it saved a read.
    pub(super) fn on_hit(&mut self, key: (u32, u32)) {
        if self.unused.remove(&key).is_some() {
            self.stats.saved += 1;
        }
    }

    /// Whether job `tag` is a guess read still owned by the guesses (not adopted).
    pub(super) fn owns(&self, tag: usize) -> bool {
        self.inflight.contains_key(&tag)
    }

    /// A read that a batch adopted landed with `bytes`.
    pub(super) fn adopted_landed(&mut self, bytes: u64) {
        self.stats.saved += 1;
        self.stats.bytes_read += bytes;
    }

    /// A guess read a batch took over landed: its bytes were read for nothing.
    pub(super) fn taken_over_landed(&mut self, result: &Result<u64, super::ReadFailure>) {
        match result {
            Ok(bytes) => {
                self.stats.bytes_read += bytes;
                self.stats.wasted_bytes += bytes;
            }
            Err(_) => self.stats.failed += 1,
        }
    }
}

impl ExpertFetcher {
    /// Keep every guess for `--dump-cache-trace` (`guess_trace.bin`).
    pub fn record_guesses(&mut self) {
        self.guess.trace.get_or_insert_with(Vec::new);
    }

    /// The guesses recorded, as `(pass, layer, expert)`, if recording.
    pub fn guess_trace(&self) -> Option<&[(u64, u32, u32)]> {
        self.guess.trace.as_deref()
    }

    /// The guesses' counters. Guesses still unused count as wasted from
    /// [`finish_guesses`](Self::finish_guesses) on.
    pub fn guess_stats(&self) -> GuessStats {
        self.guess.stats
    }

    /// Compute guessed that pass `pass` will ask for `experts` of `layer`: queue their
    /// reads and start what the rules allow (see the module documentation).
    pub fn guess(&mut self, pass: u64, layer: u32, experts: &[u32]) {
        let mut ids: Vec<u32> = Vec::with_capacity(experts.len());
        for &e in experts {
            if !ids.contains(&e) {
                ids.push(e);
            }
        }
        let g = &mut self.guess;
        g.stats.guesses += 1;
        g.stats.guessed += ids.len() as u64;
        if let Some(t) = &mut g.trace {
            t.extend(ids.iter().map(|&e| (pass, layer, e)));
        }
        // An older guess still queued is stale: its layer's request came, or never will.
        g.queue.clear();
        g.queue.extend(ids.iter().map(|&e| (layer, e)));
        g.want = ids.len();
        g.open.insert(layer, (pass, ids));
        self.pump_guesses();
    }

    /// Score the guess of `layer` in `pass` (if one was made) against the request `ids`.
    pub fn score_guess(&mut self, pass: u64, layer: u32, ids: &[u32]) {
        let Some((p, guessed)) = self.guess.open.remove(&layer) else {
            return;
        };
        if p != pass {
            return;
        }
        let mut actual: Vec<u32> = Vec::with_capacity(ids.len());
        for &e in ids {
            if !actual.contains(&e) {
                actual.push(e);
            }
        }
        let s = &mut self.guess.stats;
        s.actual += actual.len() as u64;
        s.correct += guessed.iter().filter(|e| actual.contains(e)).count() as u64;
    }

    /// Whether guess reads are in flight (the stage then polls for their landing between
    /// messages; queued guesses wait for a landing or a release, which a message brings).
    pub fn guesses_pending(&self) -> bool {
        !self.guess.inflight.is_empty()
    }

    /// Take the guess reads that landed (without waiting) and issue queued ones as the
    /// rules allow. Call between batches, after anything that frees a slot.
    pub fn pump_guesses(&mut self) {
        self.pump_landed();
        while let Some(&(layer, id)) = self.guess.queue.front() {
            if !self.issue_guess(layer, id) {
                break;
            }
            self.guess.queue.pop_front();
        }
    }

    /// The run is over: landed guesses no request used are wasted.
    pub fn finish_guesses(&mut self) {
        let g = &mut self.guess;
        g.stats.wasted_bytes += g.unused.values().sum::<u64>();
        g.unused.clear();
        g.queue.clear();
    }

    /// Issue the guess read of `(layer, id)` if the rules allow; true when the guess is
    /// done with (issued, or not worth reading), false when it must wait.
    fn issue_guess(&mut self, layer: u32, id: u32) -> bool {
        let key = (layer, id);
        let in_flight = |f: &ExpertFetcher| {
            f.guess
                .inflight
                .values()
                .any(|&(s, _, _)| f.slots[s].key == key)
        };
        if self.index.contains_key(&key) || in_flight(self) {
            return true;
        }
        let Some(loc) = self.locator.locate(layer, id) else {
            return true;
        };
        let need = align_up(loc.start() % ALIGN as u64 + loc.span());
        if need > self.slot_bytes || loc.extents.is_empty() {
            return true;
        }
        let span = align_up(loc.start() + loc.span()) - align_down(loc.start());
        let pieces = span.div_ceil(PIECE) as usize;
        // Each drive has `readers` readers of its own: half of them at most, on the drive
        // this read goes to.
        let dev = self.pool.devices.device_of(loc.file);
        let busy: usize = (self.guess.inflight.values())
            .filter(|&&(_, _, d)| d == dev)
            .map(|&(_, p, _)| p)
            .sum();
        let cap = self.readers / 2;
        let fits = busy + pieces <= cap || (busy == 0 && pieces < self.readers);
        // Taking a slot leaves fewer than the next request wants: only as the one read in
        // flight below the reserve.
        let below = self.free.len() + self.lru.len() <= self.guess.want;
        if !fits || (below && !self.guess.inflight.is_empty()) {
            return false;
        }
        let Some(s) = self.guess_victim(layer) else {
            return false;
        };
        let tag = GUESS_TAG + self.guess.next_tag;
        self.guess.next_tag += 1;
        let slot = &mut self.slots[s];
        *slot = EMPTY_SLOT;
        slot.state = SlotState::Inflight;
        slot.key = key;
        slot.data_off = loc.start() % ALIGN as u64;
        slot.len = loc.span();
        if !self.issue(tag, s, &loc) {
            // The readers stopped: the guess is dropped (a request fails it plainly).
            self.slots[s] = EMPTY_SLOT;
            self.free.push(s);
            return true;
        }
        self.guess.inflight.insert(tag, (s, pieces, dev));
        self.guess.stats.reads += 1;
        true
    }

    /// A slot for a guess of `layer`: EMPTY, else the oldest evictable one that holds
    /// neither an expert of `layer` nor an unused guess.
    fn guess_victim(&mut self, layer: u32) -> Option<usize> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let &(stamp, s) = self.lru.iter().find(|&&(_, s)| {
            let key = self.slots[s].key;
            key.0 != layer && !self.guess.unused.contains_key(&key)
        })?;
        self.lru.remove(&(stamp, s));
        let key = self.slots[s].key;
        self.index.remove(&key);
        self.slots[s] = EMPTY_SLOT;
        self.count(|c| c.evictions += 1);
        Some(s)
    }

    /// A guess read (not adopted) finished: its expert is resident and evictable, or its
    /// slot is EMPTY again.
    pub(super) fn guess_landed(&mut self, done: Done) {
        let Some((s, _, _)) = self.guess.inflight.remove(&done.tag) else {
            return;
        };
        match done.result {
            Ok(bytes) => {
                let stamp = self.land(s);
                let key = self.slots[s].key;
                self.lru.insert((stamp, s));
                self.guess.unused.insert(key, bytes);
                self.guess.stats.bytes_read += bytes;
            }
            Err(_) => {
                self.slots[s] = EMPTY_SLOT;
                self.free.push(s);
                self.guess.stats.failed += 1;
            }
        }
    }

    /// A request of `layer` for `pending` begins: take the guess reads that landed, and
    /// drop the layer's queued guesses (those it asked for are promoted: read as misses).
    pub(super) fn guesses_before_batch(&mut self, layer: u32, pending: &[u32]) {
        self.pump_landed();
        let g = &mut self.guess;
        let mut promoted = 0;
        g.queue.retain(|&(l, e)| {
            let requested = l == layer && pending.contains(&e);
            promoted += requested as u64;
            l != layer
        });
        g.stats.promoted += promoted;
    }

    /// Take the guess reads that landed, without waiting and without issuing more.
    fn pump_landed(&mut self) {
        while !self.guess.inflight.is_empty() {
            match self.pool.done.try_recv() {
                Ok(done) => self.guess_landed(done),
                Err(_) => break,
            }
        }
    }

    /// The request being reserved found no slot for its miss `id` at `loc`: when a guess
    /// read it did not ask for is in flight (the oldest, if several), the batch takes its
    /// slot, claims it for `id` and reads `id` into it once the guess read lands. True
    /// when it did.
    pub(super) fn take_over_guess(&mut self, b: &mut Batch, id: u32, loc: &ExpertExtents) -> bool {
        let layer = b.layer;
        let Some((tag, s)) = self
            .guess
            .inflight
            .iter()
            .filter(|(_, &(s, _, _))| {
                let (l, e) = self.slots[s].key;
                l != layer || !self.batch_ids.contains(&e)
            })
            .map(|(&tag, &(s, _, _))| (tag, s))
            .min()
        else {
            return false;
        };
        self.guess.inflight.remove(&tag);
        self.guess.stats.taken_over += 1;
        self.claim_for_read(s, layer, id, loc, true);
        b.claimed.push(s);
        b.taken.push(s);
        b.after_guess.insert(tag, (s, loc.clone()));
        b.inflight.insert(tag, s);
        b.any_read = true;
        true
    }

    /// The request being reserved asks for `key`, which is not resident: when a guess read
    /// of it is in flight, the batch adopts it (claims its slot, waits for its tag) and
    /// gets true.
    pub(super) fn adopt_guess(&mut self, b: &mut Batch, key: (u32, u32)) -> bool {
        let Some((&tag, &(s, _, _))) = self
            .guess
            .inflight
            .iter()
            .find(|(_, &(s, _, _))| self.slots[s].key == key)
        else {
            return false;
        };
        self.guess.inflight.remove(&tag);
        self.slots[s].in_batch = true;
        self.count(|c| {
            c.requests += 1;
            c.misses += 1;
        });
        b.claimed.push(s);
        b.adopted.push(s);
        b.inflight.insert(tag, s);
        b.any_read = true;
        true
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::{mpsc, Arc, Condvar, Mutex};
    use std::time::Duration;

    use crate::fetcher::{BatchEvent, BatchSummary, ExpertCacheConfig, ExpertFetcher};
    use crate::locate::{ExpertExtents, ExpertTable};
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
        f.set_devices(crate::devices::DeviceMap::from_keys(
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
}
