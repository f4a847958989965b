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
        // Each drive has `readers` readers of its own: half of them at most, on the drive
        // this read goes to; of an expert's live copies, the one on the drive with the
        // fewest guess pieces in flight.
        let pieces_on = |f: &ExpertFetcher, dev: usize| -> usize {
            (f.guess.inflight.values())
                .filter(|&&(_, _, d)| d == dev)
                .map(|&(_, p, _)| p)
                .sum()
        };
        let devices = &self.pool.devices;
        let Some((busy, loc)) = (self.live_copies(layer, id).into_iter())
            .map(|l| (pieces_on(self, devices.device_of(l.file)), l))
            .min_by_key(|(b, _)| *b)
        else {
            return true;
        };
        let need = align_up(loc.start() % ALIGN as u64 + loc.span());
        if need > self.slot_bytes || loc.extents.is_empty() {
            return true;
        }
        let span = align_up(loc.start() + loc.span()) - align_down(loc.start());
        let pieces = span.div_ceil(PIECE) as usize;
        let dev = devices.device_of(loc.file);
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
        slot.file = loc.file;
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
