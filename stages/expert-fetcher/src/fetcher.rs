//! The expert cache: an arena of equal slots managed as an LRU, filled by batch fetches.
//!
//! A slot is EMPTY, INFLIGHT (a read is landing in it right now; never a victim) or resident
//! (holding one `(layer, expert)`), and a resident slot may be pinned (never a victim).
//!
//! [`ExpertFetcher::fetch_batch`] serves the experts one router decision needs:
//! 1. reserve serially: each requested expert is either resident (a hit) or gets a victim
//!    slot, chosen EMPTY first, then least recently used; a slot claimed by this batch is
//!    never a victim for another expert of the same batch;
//! 2. read the misses in parallel, sorted by (file, offset), on a pool of reader threads
//!    (the queue depth, 16 by default), with O_DIRECT where the file system allows, each
//!    expert in pieces of 4 MiB taken in issue order, so the depth is the same whatever
//!    the slot count and experts land in the order they were issued. With files on several
//!    drives ([`ExpertFetcher::set_devices`]) each drive has its own pool and queue depth,
//!    the reads are issued to every drive at once (disk order within a drive, the drives
//!    taking turns: `crate::devices::interleave`) and a failed read names its drive;
//! 3. publish each expert through the callback as it lands, in arrival order (hits first,
//!    they are already there). A read that fails is reported as [`BatchEvent::Failed`], counted,
//!    its slot goes back to EMPTY, and its bytes are never published.
//!
//! When a batch asks for more experts than it can claim slots, the rest wait in disk order
//! and take the batch's slots in turn (hits' first, then the reads' in issue order), each
//! as soon as its expert is done with: at once for a plain callback (its use ends when it
//! returns), or, with [`ExpertFetcher::hold_published`], when the reader releases it, which
//! [`BatchIo::releases`] reports during the batch. Reads keep landing while a release is
//! awaited, so reading overlaps the reader's work and a few slots serve a whole batch
//! (what the smallest budgets need). The slot each expert lands in follows from the
//! request and the cache alone, never from when a read or a release arrives.
//!
//! A slot mirrors the file's page layout: it holds the expert's bytes starting at
//! `offset % 4096`, so reads are page-aligned (O_DIRECT) whatever the expert's offset and size.
//! Hence the slot size [`slot_bytes_for`]: the largest span rounded up to 4096, plus a page.

// Speculative reads (`--speculate on`): a child module so its hooks (marked `guess:`
// below) reach the cache's private state.
#[path = "guess.rs"]
mod guess;
pub use guess::GuessStats;

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::devices::{assign_copies, interleave, DeviceMap};
use crate::locate::{ExpertExtents, Extent, Locate};
use crate::trace::TraceRecorder;
use k3_io::arena::{align_down, align_up, slot_bytes_for, ArenaMemory, OwnedArena, ALIGN};
use k3_io::direct::ReadAt;

/// Slots a budget of `budget_bytes` holds (at least 0).
pub fn slots_for_budget(budget_bytes: u64, slot_bytes: u64) -> usize {
    budget_bytes.checked_div(slot_bytes).unwrap_or(0) as usize
}

/// How often a batch waiting for a read also looks for releases (only while its next
/// deferred expert waits for a held slot).
const RELEASE_POLL: Duration = Duration::from_millis(1);

/// Where a batch publishes, and (for a reader that holds what it is given) how it learns
/// that the reader is done with an expert.
pub trait BatchIo {
    /// One expert is ready (or failed).
    fn event(&mut self, ev: BatchEvent<'_>);
    /// Whether [`releases`](Self::releases) can ever return something.
    fn takes_releases(&self) -> bool {
        false
    }
    /// Experts the reader released since the last call, as `(layer, ids)`: waiting at most
    /// `wait` for the first (`None`: until one comes). An error ends the wait for good
    /// (the reader is gone); the batch then fails what it could not read.
    fn releases(&mut self, _wait: Option<Duration>) -> Result<Vec<(u32, Vec<u32>)>, ReaderGone> {
        Ok(Vec::new())
    }
}

/// A plain callback: publishes, never releases.
struct Callback<F>(F);

impl<F: FnMut(BatchEvent<'_>)> BatchIo for Callback<F> {
    fn event(&mut self, ev: BatchEvent<'_>) {
        (self.0)(ev)
    }
}

/// How the fetcher is built.
#[derive(Clone, Copy, Debug)]
pub struct ExpertCacheConfig {
    /// Number of slots (at least 1).
    pub slots: usize,
    /// Bytes per slot; 0 means [`slot_bytes_for`] the locator's largest span.
    pub slot_bytes: u64,
    /// Reader threads, i.e. reads in flight at once (the queue depth). At least 1.
    pub readers: usize,
}

/// Reader threads per drive unless configured: the queue depth the fetcher reads at.
pub const DEFAULT_READERS: usize = 16;

impl Default for ExpertCacheConfig {
    fn default() -> Self {
        ExpertCacheConfig {
            slots: 64,
            slot_bytes: 0,
            readers: DEFAULT_READERS,
        }
    }
}

/// The state of one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    Empty,
    Inflight,
    Resident,
}

/// The reader of a held batch can no longer release experts (it stopped, or its link
/// failed); the message says why, in the reader's words.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ReaderGone(pub String);

/// Why a read of an expert did not complete.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReadFailure {
    #[error("pages {start}..{end} overrun the {slot}-byte slot")]
    Overrun { start: u64, end: u64, slot: usize },
    /// The read failed: the I/O error's message (an `io::Error` cannot be cloned, and a
    /// failure is both reported and counted).
    #[error("{0}")]
    Io(String),
    #[error("short read at offset {offset}: got {got} bytes, needed {need}")]
    Short { offset: u64, got: usize, need: u64 },
    #[error("the reader panicked")]
    Panicked,
    #[error("the reader pool stopped")]
    PoolStopped,
    /// A held batch's reader went away before the expert could get a slot.
    #[error(transparent)]
    ReaderGone(#[from] ReaderGone),
}

/// Why an expert was not published.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    #[error("layer {layer} expert {expert}: no such routed expert in the checkpoint")]
    Unknown { layer: u32, expert: u32 },
    #[error(
        "layer {layer} expert {expert}: spans {need} bytes of pages, more than a {slot}-byte slot"
    )]
    TooBig {
        layer: u32,
        expert: u32,
        need: u64,
        slot: u64,
    },
    #[error("layer {layer} expert {expert}: every slot is pinned, none can take it")]
    NoSlot { layer: u32, expert: u32 },
    #[error("layer {layer} expert {expert}: read failed: {why}")]
    Read {
        layer: u32,
        expert: u32,
        why: ReadFailure,
    },
}

impl FetchError {
    /// The expert it is about: `(layer, expert)`.
    pub fn key(&self) -> (u32, u32) {
        match self {
            FetchError::Unknown { layer, expert }
            | FetchError::TooBig { layer, expert, .. }
            | FetchError::NoSlot { layer, expert }
            | FetchError::Read { layer, expert, .. } => (*layer, *expert),
        }
    }
}

/// An expert that is in the arena, handed to the batch callback.
#[derive(Debug)]
pub struct Arrival<'a> {
    pub layer: u32,
    pub expert: u32,
    /// The slot it sits in.
    pub slot: usize,
    /// Where the expert's first byte is, from the start of the arena (for a shared-memory
    /// handle `{region, offset, len}`).
    pub arena_offset: u64,
    /// The expert's span in bytes (`data.len()`).
    pub len: u64,
    /// The expert's bytes, laid out as in the file from its first byte (for a non-contiguous
    /// expert, the gaps between its extents are file bytes that belong to something else).
    pub data: &'a [u8],
    /// True when it was already in the arena (a hit), false when this batch read it.
    pub hit: bool,
}

/// What the batch callback receives, once per distinct requested expert.
#[derive(Debug)]
pub enum BatchEvent<'a> {
    Ready(Arrival<'a>),
    Failed(FetchError),
}

/// Counters; kept for the current step and for the whole run.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct FetchStats {
    /// Experts asked for by `fetch_batch` (distinct within a batch).
    pub requests: u64,
    /// Requests served from the arena without a read by that request.
    pub hits: u64,
    /// Of those hits, how many were read into the arena during this same step (by a
    /// prefetch): hits, but not savings.
    pub hits_read_this_step: u64,
    /// Requests that needed a read (including those that failed).
    pub misses: u64,
    /// Resident experts dropped to make room.
    pub evictions: u64,
    /// Requests that ended without data (read error, unknown expert, no slot).
    pub failed: u64,
    /// Reads issued by `prefetch` (not requests).
    pub prefetch_reads: u64,
    /// Prefetch reads that failed (the later request retries them).
    pub prefetch_failed: u64,
    /// Reads that completed.
    pub reads: u64,
    /// Bytes those reads transferred (whole pages).
    pub bytes_read: u64,
    /// Wall-clock seconds during which reads were outstanding.
    pub io_seconds: f64,
    /// Reads that failed on a drive and were read again from another copy of the expert
    /// on a drive that had not failed (`pack-experts --copies`). Left out of the JSON
    /// when 0, so a run without failures reports what it did before copies existed (the
    /// replay recordings compare it).
    #[serde(skip_serializing_if = "is_zero")]
    pub failovers: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl FetchStats {
    /// Hits that were resident before the step began.
    pub fn resident_hits(&self) -> u64 {
        self.hits - self.hits_read_this_step
    }

    /// hits / requests (counts prefetched experts as hits: optimistic).
    pub fn hit_rate(&self) -> f64 {
        ratio(self.hits, self.requests)
    }

    /// The TRUE resident hit rate: requests served from experts resident before the step.
    pub fn true_resident_hit_rate(&self) -> f64 {
        ratio(self.resident_hits(), self.requests)
    }

    /// Read throughput while reads were outstanding, in MB/s (10^6 bytes).
    pub fn mb_per_s(&self) -> f64 {
        if self.io_seconds > 0.0 {
            self.bytes_read as f64 / 1e6 / self.io_seconds
        } else {
            0.0
        }
    }

    /// Add another set of counters (e.g. per-step ones into a total).
    pub fn accumulate(&mut self, o: &FetchStats) {
        self.requests += o.requests;
        self.hits += o.hits;
        self.hits_read_this_step += o.hits_read_this_step;
        self.misses += o.misses;
        self.evictions += o.evictions;
        self.failed += o.failed;
        self.prefetch_reads += o.prefetch_reads;
        self.prefetch_failed += o.prefetch_failed;
        self.reads += o.reads;
        self.bytes_read += o.bytes_read;
        self.io_seconds += o.io_seconds;
        self.failovers += o.failovers;
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    state: SlotState,
    key: (u32, u32),
    pinned: bool,
    /// Claimed by the batch in progress (never an LRU victim).
    in_batch: bool,
    /// Published and not yet released by its reader (never a victim; see
    /// [`ExpertFetcher::hold_published`]).
    held: bool,
    /// LRU clock of the last use.
    stamp: u64,
    /// Step in which it was read.
    loaded_step: u64,
    /// Offset of the expert's first byte inside the slot, and its span.
    data_off: u64,
    len: u64,
    /// The file its last read was issued to (which copy, where the expert has several).
    file: u32,
}

const EMPTY_SLOT: Slot = Slot {
    state: SlotState::Empty,
    key: (u32::MAX, u32::MAX),
    pinned: false,
    held: false,
    in_batch: false,
    stamp: 0,
    loaded_step: 0,
    data_off: 0,
    len: 0,
    file: u32::MAX,
};

/// A raw pointer that may cross to a reader thread.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: it points into the arena, which a `Job` keeps alive through its `Arc`; the slot it
// designates is INFLIGHT and written only by the one job that carries it.
unsafe impl Send for SendPtr {}

struct Job {
    tag: usize,
    file: u32,
    /// What to add to an offset of the expert's coordinates to get `file`'s: 0, except
    /// for a part of a split expert ([`crate::locate::Part`]).
    shift: i64,
    /// First byte of the slot.
    slot: SendPtr,
    slot_bytes: usize,
    /// File offset that the slot's first byte mirrors (page-aligned).
    base: u64,
    /// The expert's page ranges ([`page_ranges`]), shared by its pieces.
    ranges: Arc<[(u64, u64, u64)]>,
    /// The file bytes `[from, to)` this job reads of the expert (one piece of it).
    window: (u64, u64),
    /// The expert's pieces: the last to finish reports the expert `Done`.
    group: Arc<Group>,
    /// Keeps the arena alive while the job runs.
    _arena: Arc<dyn ArenaMemory>,
}

/// The pieces of one expert's read.
struct Group {
    left: std::sync::atomic::AtomicUsize,
    bytes: std::sync::atomic::AtomicU64,
    err: Mutex<Option<ReadFailure>>,
}

/// Bytes one reader job reads of an expert: the disk's largest request here (4 MiB), so
/// the readers' queue depth is in requests whatever the slot count, and pieces are taken
/// in issue order, so experts land in the order they were issued.
pub const PIECE: u64 = 4 << 20;

struct Done {
    tag: usize,
    result: Result<u64, ReadFailure>,
    /// When the read finished (so callback time does not count as I/O time).
    at: Instant,
}

/// Read one expert into its slot; returns the bytes transferred.
/// An expert's extents as coalesced page ranges: (aligned start, aligned end, the end of
/// the bytes that must arrive).
fn page_ranges(extents: &[Extent]) -> Vec<(u64, u64, u64)> {
    let mut ranges: Vec<(u64, u64, u64)> = Vec::new();
    for e in extents {
        let (s, end) = (align_down(e.offset), align_up(e.offset + e.len));
        match ranges.last_mut() {
            Some(r) if s <= r.1 => {
                r.1 = r.1.max(end);
                r.2 = r.2.max(e.offset + e.len);
            }
            _ => ranges.push((s, end, e.offset + e.len)),
        }
    }
    ranges
}

/// Read one piece of an expert (its window of the expert's page ranges) into its slot;
/// returns the bytes transferred.
fn run_job(reader: &dyn ReadAt, job: &Job) -> Result<u64, ReadFailure> {
    let mut total = 0u64;
    let (w0, w1) = job.window;
    for &(s, end, need) in job.ranges.iter() {
        let (s, end) = (s.max(w0), end.min(w1));
        if s >= end {
            continue;
        }
        let need = need.min(end);
        let (a, b) = ((s - job.base) as usize, (end - job.base) as usize);
        if b > job.slot_bytes {
            return Err(ReadFailure::Overrun {
                start: s,
                end,
                slot: job.slot_bytes,
            });
        }
        // SAFETY: [a, b) lies inside this job's slot (checked above); the slot is INFLIGHT, so
        // nothing else reads or writes it until this job reports `Done`, and `_arena` keeps
        // the memory alive.
        let dst = unsafe { std::slice::from_raw_parts_mut(job.slot.0.add(a), b - a) };
        let at = s
            .checked_add_signed(job.shift)
            .ok_or(ReadFailure::Overrun {
                start: s,
                end,
                slot: job.slot_bytes,
            })?;
        let got = reader
            .read_at(job.file, at, dst)
            .map_err(|e| ReadFailure::Io(e.to_string()))?;
        if s + (got as u64) < need {
            return Err(ReadFailure::Short {
                offset: s,
                got,
                need: need - s,
            });
        }
        total += got as u64;
    }
    Ok(total)
}

/// The reader threads: one queue and `readers` threads per device ([`DeviceMap`]), so each
/// drive has its own queue depth and a batch's reads go to every drive at once, while
/// within one drive they keep the order they were issued in (disk order). Every expert
/// lands on the one `done` channel.
struct Pool {
    txs: Vec<mpsc::Sender<Job>>,
    devices: DeviceMap,
    done: mpsc::Receiver<Done>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    fn new(readers: usize, reader: Arc<dyn ReadAt>, devices: DeviceMap) -> Pool {
        let (dtx, done) = mpsc::channel::<Done>();
        let mut txs = Vec::with_capacity(devices.len());
        let mut threads = Vec::new();
        for d in 0..devices.len().max(1) {
            let (tx, rx) = mpsc::channel::<Job>();
            let rx = Arc::new(Mutex::new(rx));
            let name: Arc<str> = devices.name(d).into();
            for i in 0..readers.max(1) {
                let thread = if devices.len() > 1 {
                    format!("k3-expert-read-{d}.{i}")
                } else {
                    format!("k3-expert-read-{i}")
                };
                let (rx, dtx) = (Arc::clone(&rx), dtx.clone());
                let (reader, name) = (Arc::clone(&reader), Arc::clone(&name));
                threads.push(
                    std::thread::Builder::new()
                        .name(thread)
                        .spawn(move || read_loop(&rx, &dtx, reader.as_ref(), &name))
                        .expect("spawn a reader thread"),
                );
            }
            txs.push(tx);
        }
        Pool {
            txs,
            devices,
            done,
            threads,
        }
    }

    /// The queue of the device holding `file`.
    fn sender(&self, file: u32) -> Option<&mpsc::Sender<Job>> {
        self.txs.get(self.devices.device_of(file))
    }
}

/// One reader thread: take the device's jobs in order until the pool stops; the last piece
/// of an expert reports it `Done`. A read error names the device (when the map has names).
fn read_loop(
    rx: &Mutex<mpsc::Receiver<Job>>,
    dtx: &mpsc::Sender<Done>,
    reader: &dyn ReadAt,
    device: &str,
) {
    use std::sync::atomic::Ordering::{AcqRel, Acquire};
    loop {
        let job = match rx.lock() {
            Ok(g) => g.recv(),
            Err(_) => return,
        };
        let Ok(job) = job else { return };
        let piece = std::panic::catch_unwind(AssertUnwindSafe(|| run_job(reader, &job)))
            .unwrap_or(Err(ReadFailure::Panicked));
        let g = &job.group;
        match piece {
            Ok(b) => {
                g.bytes.fetch_add(b, AcqRel);
            }
            Err(e) => {
                let e = match e {
                    ReadFailure::Io(m) if !device.is_empty() => {
                        ReadFailure::Io(format!("{m} (device {device})"))
                    }
                    e => e,
                };
                g.err
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
            }
        }
        if g.left.fetch_sub(1, AcqRel) != 1 {
            continue;
        }
        let result = match g.err.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(g.bytes.load(Acquire)),
        };
        let done = Done {
            tag: job.tag,
            result,
            at: Instant::now(),
        };
        if dtx.send(done).is_err() {
            return;
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.txs.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The state of the batch in progress ([`ExpertFetcher::run_batch`]'s steps share it).
struct Batch {
    layer: u32,
    /// A request (published), not a prefetch.
    publish: bool,
    /// Published experts stay held until released.
    hold: bool,
    /// Slots this batch claimed, in claim order.
    claimed: Vec<usize>,
    /// Hits, in request order.
    hits: Vec<usize>,
    /// Misses with a slot, until their reads are issued.
    misses: Vec<(usize, ExpertExtents)>,
    /// Misses waiting for a slot of this batch, in disk order.
    deferred: VecDeque<(u32, ExpertExtents)>,
    /// The batch's slots in the order the deferred misses take them.
    rotation: Vec<usize>,
    next_turn: usize,
    /// Reads in flight, by tag: the slot each lands in.
    inflight: HashMap<usize, usize>,
    /// guess: slots of guess reads in flight this batch adopted (they join the rotation).
    adopted: Vec<usize>,
    /// guess: slots of guess reads in flight this batch took over for its misses (they join
    /// the rotation last), and by the guess's tag the slot and the miss read into it once
    /// the guess read lands.
    taken: Vec<usize>,
    after_guess: HashMap<usize, (usize, ExpertExtents)>,
    tag: usize,
    t0: Instant,
    last_done: Instant,
    any_read: bool,
    summary: BatchSummary,
}

impl Batch {
    fn new(layer: u32, publish: bool, hold: bool) -> Batch {
        let now = Instant::now();
        Batch {
            layer,
            publish,
            hold,
            claimed: Vec::new(),
            hits: Vec::new(),
            misses: Vec::new(),
            deferred: VecDeque::new(),
            rotation: Vec::new(),
            next_turn: 0,
            inflight: HashMap::new(),
            adopted: Vec::new(),
            taken: Vec::new(),
            after_guess: HashMap::new(),
            tag: 0,
            t0: now,
            last_done: now,
            any_read: false,
            summary: BatchSummary::default(),
        }
    }

    /// The rotation's slot whose turn is next.
    fn next_slot(&self) -> Option<usize> {
        self.rotation
            .get(self.next_turn % self.rotation.len().max(1))
            .copied()
    }
}

/// What one `fetch_batch` / `prefetch` did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BatchSummary {
    pub published: usize,
    pub hits: usize,
    pub reads: usize,
    pub failed: usize,
    /// Reads that went into a slot this batch had already used (the batch asked for more
    /// experts than it could claim slots).
    pub recycled: usize,
}

/// The expert cache. See the module documentation.
pub struct ExpertFetcher {
    arena: Arc<dyn ArenaMemory>,
    slot_bytes: u64,
    slots: Vec<Slot>,
    index: HashMap<(u32, u32), usize>,
    /// Resident, unpinned, unheld, not in the batch: (stamp, slot), oldest first.
    lru: BTreeSet<(u64, usize)>,
    /// EMPTY slots.
    free: Vec<usize>,
    locator: Arc<dyn Locate>,
    reader: Arc<dyn ReadAt>,
    pool: Pool,
    readers: usize,
    clock: u64,
    step: u64,
    step_stats: FetchStats,
    total_stats: FetchStats,
    recorder: Option<TraceRecorder>,
    /// Published slots stay held until released (see [`ExpertFetcher::hold_published`]).
    hold: bool,
    /// The batch in progress (its layer and distinct ids), for releases that arrive before
    /// their expert is published, which are kept in `early`.
    batch_layer: Option<u32>,
    batch_ids: HashSet<u32>,
    early: HashSet<(u32, u32)>,
    /// guess: compute's guesses and their reads (`guess.rs`).
    guess: guess::GuessState,
    /// Files that failed a read: where an expert has a copy in another file, it is read
    /// there from then on ([`ExpertFetcher::failover`]).
    down: BTreeSet<u32>,
}

/// The fetcher could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("the expert cache needs at least one slot (got 0; raise --cache-gb)")]
    NoSlots,
    #[error("a {slot}-byte slot cannot hold the largest expert (needs {need} bytes)")]
    SlotTooSmall { slot: u64, need: u64 },
    #[error("the arena of {have} bytes is smaller than {slots} slots x {slot} bytes")]
    ArenaTooSmall {
        have: usize,
        slots: usize,
        slot: u64,
    },
    #[error(transparent)]
    Arena(#[from] k3_io::arena::ArenaError),
}

impl ExpertFetcher {
    /// Build a fetcher over a fresh [`OwnedArena`].
    pub fn new(
        config: ExpertCacheConfig,
        locator: Arc<dyn Locate>,
        reader: Arc<dyn ReadAt>,
    ) -> Result<ExpertFetcher, SetupError> {
        let slot_bytes = Self::resolve_slot_bytes(&config, locator.as_ref())?;
        let bytes = (config.slots as u64)
            .checked_mul(slot_bytes)
            .ok_or(SetupError::NoSlots)? as usize;
        let arena: Arc<dyn ArenaMemory> = Arc::new(OwnedArena::new(bytes)?);
        Self::with_arena(config, locator, reader, arena)
    }

    fn resolve_slot_bytes(
        config: &ExpertCacheConfig,
        locator: &dyn Locate,
    ) -> Result<u64, SetupError> {
        if config.slots == 0 {
            return Err(SetupError::NoSlots);
        }
        let need = slot_bytes_for(locator.max_span());
        let slot = if config.slot_bytes == 0 {
            need
        } else {
            align_up(config.slot_bytes)
        };
        if slot < need {
            return Err(SetupError::SlotTooSmall { slot, need });
        }
        Ok(slot)
    }

    /// Build a fetcher over memory the caller provides (e.g. a shared-memory region).
    pub fn with_arena(
        config: ExpertCacheConfig,
        locator: Arc<dyn Locate>,
        reader: Arc<dyn ReadAt>,
        arena: Arc<dyn ArenaMemory>,
    ) -> Result<ExpertFetcher, SetupError> {
        let slot_bytes = Self::resolve_slot_bytes(&config, locator.as_ref())?;
        if (arena.len() as u64) < config.slots as u64 * slot_bytes {
            return Err(SetupError::ArenaTooSmall {
                have: arena.len(),
                slots: config.slots,
                slot: slot_bytes,
            });
        }
        Ok(ExpertFetcher {
            arena,
            slot_bytes,
            slots: vec![EMPTY_SLOT; config.slots],
            index: HashMap::new(),
            lru: BTreeSet::new(),
            free: (0..config.slots).rev().collect(),
            pool: Pool::new(
                config.readers,
                Arc::clone(&reader),
                DeviceMap::single(locator.files().len(), ""),
            ),
            locator,
            reader,
            readers: config.readers.max(1),
            clock: 0,
            step: 1,
            step_stats: FetchStats::default(),
            total_stats: FetchStats::default(),
            recorder: None,
            hold: false,
            batch_layer: None,
            batch_ids: HashSet::new(),
            early: HashSet::new(),
            guess: guess::GuessState::default(),
            down: BTreeSet::new(),
        })
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Number of slots.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Reader threads (queue depth) per device.
    pub fn readers(&self) -> usize {
        self.readers
    }

    /// Read each device's files on its own pool of [`readers`](Self::readers) threads with
    /// its own queue, every device at once (`crate::devices`); until this is called, all
    /// files share one pool. Call it between batches (the pools are rebuilt).
    pub fn set_devices(&mut self, devices: DeviceMap) {
        self.pool = Pool::new(self.readers, Arc::clone(&self.reader), devices);
    }

    /// The devices the reads are grouped by.
    pub fn devices(&self) -> &DeviceMap {
        &self.pool.devices
    }

    /// The arena (to share it, or to map a published `(arena_offset, len)`).
    pub fn arena(&self) -> &Arc<dyn ArenaMemory> {
        &self.arena
    }

    /// `(offset, len)` of a slot in the arena.
    pub fn slot_range(&self, slot: usize) -> (u64, u64) {
        (slot as u64 * self.slot_bytes, self.slot_bytes)
    }

    /// The state of a slot, with its key when resident.
    pub fn slot_state(&self, slot: usize) -> (SlotState, Option<(u32, u32)>, bool) {
        let s = &self.slots[slot];
        let key = (s.state == SlotState::Resident).then_some(s.key);
        (s.state, key, s.pinned)
    }

    /// True when `(layer, expert)` is in the arena.
    pub fn is_resident(&self, layer: u32, expert: u32) -> bool {
        self.index.contains_key(&(layer, expert))
    }

    /// Resident experts.
    pub fn resident(&self) -> usize {
        self.index.len()
    }

    /// Pinned experts.
    pub fn pinned(&self) -> usize {
        self.slots.iter().filter(|s| s.pinned).count()
    }

    /// Pin a resident expert so it is never evicted. False if it is not resident.
    pub fn pin(&mut self, layer: u32, expert: u32) -> bool {
        let Some(&s) = self.index.get(&(layer, expert)) else {
            return false;
        };
        let slot = &mut self.slots[s];
        if !slot.pinned {
            slot.pinned = true;
            self.lru.remove(&(slot.stamp, s));
        }
        true
    }

    /// Undo [`pin`](Self::pin). False if it is not resident.
    pub fn unpin(&mut self, layer: u32, expert: u32) -> bool {
        let Some(&s) = self.index.get(&(layer, expert)) else {
            return false;
        };
        let slot = &mut self.slots[s];
        if slot.pinned {
            slot.pinned = false;
            if !slot.held {
                self.lru.insert((slot.stamp, s));
            }
        }
        true
    }

    /// With `hold` on, every expert a [`fetch_batch`](Self::fetch_batch) publishes stays in
    /// its slot, never a victim, until [`release`](Self::release) names it: the reader in
    /// another process maps the slot in place, so reuse must wait for its word, not for a
    /// convention. A batch that finds every slot held fails its misses with
    /// [`FetchError::NoSlot`] rather than overwrite a slot being read.
    pub fn hold_published(&mut self, hold: bool) {
        self.hold = hold;
    }

    /// The reader is done with these experts of `layer`: their slots may be evicted again.
    /// Returns how many were held.
    pub fn release(&mut self, layer: u32, ids: &[u32]) -> usize {
        ids.iter()
            .filter(|&&id| self.release_one(layer, id))
            .count()
    }

    /// Slots published and not yet released.
    pub fn held(&self) -> usize {
        self.slots.iter().filter(|s| s.held).count()
    }

    /// Start a new step (token): step counters reset, totals keep counting.
    pub fn begin_step(&mut self) {
        self.step += 1;
        self.step_stats = FetchStats::default();
    }

    /// Counters of the current step.
    pub fn step_stats(&self) -> FetchStats {
        self.step_stats
    }

    /// Counters of the whole run.
    pub fn total_stats(&self) -> FetchStats {
        self.total_stats
    }

    /// Start recording every request (for `--dump-cache-trace`).
    pub fn record_trace(&mut self) {
        self.recorder.get_or_insert_with(TraceRecorder::new);
    }

    /// The recorded requests, if recording.
    pub fn trace(&self) -> Option<&TraceRecorder> {
        self.recorder.as_ref()
    }

    fn count(&mut self, f: impl Fn(&mut FetchStats)) {
        f(&mut self.step_stats);
        f(&mut self.total_stats);
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// A read into slot `s` landed: its expert is RESIDENT, read in this step, used now
    /// (the LRU clock's next tick, returned) and found by its key. Where it goes next (the
    /// batch's published slots, the LRU) is the caller's.
    fn land(&mut self, s: usize) -> u64 {
        let stamp = self.tick();
        let step = self.step;
        let slot = &mut self.slots[s];
        slot.state = SlotState::Resident;
        slot.loaded_step = step;
        slot.stamp = stamp;
        self.index.insert(slot.key, s);
        stamp
    }

    /// A slot for a new expert: EMPTY first, else the least recently used evictable one.
    fn take_victim(&mut self) -> Option<usize> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let (_, s) = self.lru.pop_first()?;
        let key = self.slots[s].key;
        self.index.remove(&key);
        self.guess.on_evict(key); // guess:
        self.slots[s] = EMPTY_SLOT;
        self.count(|c| c.evictions += 1);
        Some(s)
    }

    fn arrival(&self, s: usize, hit: bool) -> Arrival<'_> {
        let slot = &self.slots[s];
        let arena_offset = s as u64 * self.slot_bytes + slot.data_off;
        // SAFETY: the slot is resident and claimed by the batch in progress, so no reader
        // thread writes it, and the batch reuses it only after the callback that sees this
        // arrival has returned (and, holding, after its release); `&self` borrows the
        // arena for the lifetime of the slice; the range lies inside the slot.
        let data = unsafe {
            std::slice::from_raw_parts(
                self.arena.base().add(arena_offset as usize) as *const u8,
                slot.len as usize,
            )
        };
        Arrival {
            layer: slot.key.0,
            expert: slot.key.1,
            slot: s,
            arena_offset,
            len: slot.len,
            data,
            hit,
        }
    }

    /// Fetch the experts of one router decision; `on_event` sees each distinct expert once,
    /// as it becomes available (hits first), or its failure. Duplicate ids are served once.
    /// With [`hold_published`](Self::hold_published) on, releases can only come from
    /// [`release`](Self::release) between batches (use [`fetch_batch_io`](Self::fetch_batch_io)
    /// to take them during one).
    pub fn fetch_batch<F: FnMut(BatchEvent<'_>)>(
        &mut self,
        layer: u32,
        ids: &[u32],
        on_event: F,
    ) -> BatchSummary {
        self.fetch_batch_io(layer, ids, &mut Callback(on_event))
    }

    /// [`fetch_batch`](Self::fetch_batch) publishing through `io`, which with
    /// [`hold_published`](Self::hold_published) on also says when the reader is done with a
    /// published expert: a batch larger than the slots it could claim then reuses each slot
    /// as soon as its expert is released.
    pub fn fetch_batch_io(
        &mut self,
        layer: u32,
        ids: &[u32],
        io: &mut dyn BatchIo,
    ) -> BatchSummary {
        if let Some(r) = &mut self.recorder {
            r.record(layer, ids);
        }
        self.run_batch(layer, ids, true, io)
    }

    /// Read experts ahead of their request (a routing hint); nothing is published and no
    /// request is counted. A later `fetch_batch` of them is a hit "read this step".
    pub fn prefetch(&mut self, layer: u32, ids: &[u32]) -> BatchSummary {
        self.run_batch(layer, ids, false, &mut Callback(|_: BatchEvent<'_>| {}))
    }

    /// A slot of the batch's rotation can take the next deferred expert: no read lands in it,
    /// no reader holds it, it is not pinned.
    fn reusable(&self, s: usize) -> bool {
        let slot = &self.slots[s];
        slot.state != SlotState::Inflight && !slot.held && !slot.pinned
    }

    /// The reader released `(layer, id)`: its slot may be reused (by the batch in progress
    /// when it claimed it, else as an LRU entry). A release of an expert of the batch in
    /// progress that is not published yet is kept and applied when it is (only a replayed
    /// recording sends those). Returns whether a held slot was released.
    fn release_one(&mut self, layer: u32, id: u32) -> bool {
        if let Some(&s) = self.index.get(&(layer, id)) {
            let slot = &mut self.slots[s];
            if slot.held {
                slot.held = false;
                if !slot.pinned && !slot.in_batch {
                    self.lru.insert((slot.stamp, s));
                }
                return true;
            }
        }
        if self.batch_layer == Some(layer) && self.batch_ids.contains(&id) {
            self.early.insert((layer, id));
        }
        false
    }

    /// Mark slot `s` published: held until released when the batch holds (unless its
    /// release came first).
    fn mark_published(&mut self, s: usize, hold: bool) {
        if hold {
            let key = self.slots[s].key;
            self.slots[s].held = !self.early.remove(&key);
        }
    }

    /// Start the read of `loc` into slot `s` as job `tag`; false when the pool is gone.
    /// The expert goes in [`PIECE`]s, each to its file's device queue: a split expert's
    /// parts to their own drives at once.
    fn issue(&self, tag: usize, s: usize, loc: &ExpertExtents) -> bool {
        let base = align_down(loc.start());
        let end = align_up(loc.start() + loc.span());
        // (file, shift, from, to) of each range read from one file: the whole expert, or
        // each part of a split one.
        let by_file: Vec<(u32, i64, u64, u64)> = if loc.parts.is_empty() {
            vec![(loc.file, 0, base, end)]
        } else {
            (loc.parts.iter())
                .map(|p| {
                    let shift = p.offset as i64 - p.from as i64;
                    let (from, to) = (align_down(p.from).max(base), align_up(p.to).min(end));
                    (p.file, shift, from, to)
                })
                .collect()
        };
        let mut windows: Vec<(u32, i64, (u64, u64))> = Vec::new();
        for &(file, shift, from, to) in &by_file {
            for w in (from..to).step_by(PIECE as usize) {
                windows.push((file, shift, (w, (w + PIECE).min(to))));
            }
        }
        let ranges: Arc<[(u64, u64, u64)]> = page_ranges(&loc.extents).into();
        let group = Arc::new(Group {
            left: std::sync::atomic::AtomicUsize::new(windows.len()),
            bytes: std::sync::atomic::AtomicU64::new(0),
            err: Mutex::new(None),
        });
        for (file, shift, window) in windows {
            let Some(tx) = self.pool.sender(file) else {
                return false;
            };
            let job = Job {
                tag,
                file,
                shift,
                // SAFETY: s < slots, and slots * slot_bytes <= arena.len() (checked at setup).
                slot: SendPtr(unsafe {
                    self.arena.base().add((s as u64 * self.slot_bytes) as usize)
                }),
                slot_bytes: self.slot_bytes as usize,
                base,
                ranges: Arc::clone(&ranges),
                window,
                group: Arc::clone(&group),
                _arena: Arc::clone(&self.arena),
            };
            if tx.send(job).is_err() {
                return false;
            }
        }
        true
    }

    /// Claim slot `s` for `(layer, id)` at `loc`: INFLIGHT, counted as a miss (or a prefetch).
    fn claim_for_read(
        &mut self,
        s: usize,
        layer: u32,
        id: u32,
        loc: &ExpertExtents,
        publish: bool,
    ) {
        let slot = &mut self.slots[s];
        slot.state = SlotState::Inflight;
        slot.key = (layer, id);
        slot.in_batch = true;
        slot.held = false;
        slot.data_off = loc.start() % ALIGN as u64;
        slot.len = loc.span();
        if publish {
            self.count(|c| {
                c.requests += 1;
                c.misses += 1;
            });
        } else {
            self.count(|c| c.prefetch_reads += 1);
        }
    }

    /// One batch (see the module documentation): its numbered steps are
    /// [`reserve`](Self::reserve), [`issue_reads`](Self::issue_reads),
    /// [`publish_hits`](Self::publish_hits), [`land_reads`](Self::land_reads) and
    /// [`end_batch`](Self::end_batch).
    fn run_batch(
        &mut self,
        layer: u32,
        ids: &[u32],
        publish: bool,
        io: &mut dyn BatchIo,
    ) -> BatchSummary {
        let mut pending: Vec<u32> = Vec::with_capacity(ids.len());
        for &id in ids {
            if !pending.contains(&id) {
                pending.push(id);
            }
        }
        self.early.clear();
        self.batch_layer = Some(layer);
        self.batch_ids = pending.iter().copied().collect();
        if publish {
            self.guesses_before_batch(layer, &pending); // guess:
        }
        let mut b = Batch::new(layer, publish, self.hold && publish);
        self.reserve(&mut b, pending, io);
        self.issue_reads(&mut b, io);
        self.publish_hits(&mut b, io);
        self.land_reads(&mut b, io);
        self.end_batch(b)
    }

    /// 1. Reserve serially: hits, then a victim slot per miss while there is one; the
    ///    misses left over wait for a slot of this batch to be done with.
    fn reserve(&mut self, b: &mut Batch, pending: Vec<u32>, io: &mut dyn BatchIo) {
        let (layer, publish) = (b.layer, b.publish);
        let mut deferred: Vec<(u32, ExpertExtents)> = Vec::new();
        for id in pending {
            let key = (layer, id);
            if let Some(&s) = self.index.get(&key) {
                if !publish {
                    continue; // prefetch of a resident expert: nothing to do
                }
                self.guess.on_hit(key); // guess:
                let read_now = self.slots[s].loaded_step == self.step;
                self.count(|c| {
                    c.requests += 1;
                    c.hits += 1;
                    c.hits_read_this_step += read_now as u64;
                });
                let slot = &mut self.slots[s];
                if !slot.in_batch {
                    self.lru.remove(&(slot.stamp, s));
                    slot.in_batch = true;
                    b.claimed.push(s);
                }
                b.hits.push(s);
                continue;
            }
            if publish && self.adopt_guess(b, key) {
                continue; // guess: its read is in flight; it counts when it lands
            }
            let Some(loc) = self.locator.locate(layer, id) else {
                self.fail_request(FetchError::Unknown { layer, expert: id }, publish, io);
                b.summary.failed += 1;
                continue;
            };
            let need = align_up(loc.start() % ALIGN as u64 + loc.span());
            if need > self.slot_bytes || loc.extents.is_empty() {
                let e = FetchError::TooBig {
                    layer,
                    expert: id,
                    need,
                    slot: self.slot_bytes,
                };
                self.fail_request(e, publish, io);
                b.summary.failed += 1;
                continue;
            }
            match self.take_victim() {
                Some(s) => {
                    self.claim_for_read(s, layer, id, &loc, publish);
                    b.claimed.push(s);
                    b.misses.push((s, loc));
                }
                // guess: a guess read in flight that this batch did not ask for gives up
                // its slot; the read into it starts when the guess's lands.
                None if publish && self.take_over_guess(b, id, &loc) => {}
                None => deferred.push((id, loc)),
            }
        }
        self.choose_copies(layer, &mut b.misses, &mut deferred);
        let devices = &self.pool.devices;
        b.deferred = interleave(deferred, |(_, l)| {
            (devices.device_of(l.file), (l.file, l.start()))
        })
        .into();
    }

    /// Where the experts have copies (`pack-experts --copies`), which copy each of the
    /// batch's reads (`misses`, then `deferred`, in request order) takes: the choice of
    /// [`assign_copies`] over all of them at once, so the busiest drive reads as few of
    /// the layer's experts as the copies allow (plain stripes leave it 1.2-2x its share).
    /// Copies are laid out alike ([`crate::ExpertTable::insert_copy`]), so a slot claimed
    /// for one holds any; they hold the same bytes (`pack-experts --verify`), so which is
    /// read changes no bit and no slot.
    fn choose_copies(
        &self,
        layer: u32,
        misses: &mut [(usize, ExpertExtents)],
        deferred: &mut [(u32, ExpertExtents)],
    ) {
        let ids: Vec<u32> = (misses.iter().map(|(s, _)| self.slots[*s].key.1))
            .chain(deferred.iter().map(|(id, _)| *id))
            .collect();
        let copies: Vec<Vec<ExpertExtents>> =
            ids.iter().map(|&id| self.live_copies(layer, id)).collect();
        // Nothing to choose, and `reserve` located each read at its only copy. (With a
        // file down, a read it located there must move even when one copy is left.)
        if copies.iter().all(|c| c.len() < 2) && self.down.is_empty() {
            return;
        }
        let devices = &self.pool.devices;
        let on: Vec<Vec<usize>> = (copies.iter())
            .map(|c| c.iter().map(|l| devices.device_of(l.file)).collect())
            .collect();
        let bytes: Vec<u64> = copies
            .iter()
            .map(|c| c.first().map_or(0, |l| l.span()))
            .collect();
        let mut load = vec![0u64; devices.len()];
        let pick = assign_copies(&on, &bytes, &mut load);
        let locs = misses.iter_mut().map(|(_, l)| l);
        for ((loc, mut c), j) in locs
            .chain(deferred.iter_mut().map(|(_, l)| l))
            .zip(copies)
            .zip(pick)
        {
            if j < c.len() {
                *loc = c.swap_remove(j);
            }
        }
    }

    /// 2. Issue the reads in disk order (per drive, the drives taking turns). The batch's slots form a rotation in the order
    ///    they are filled (hits first, then the reads as issued): the deferred misses, in
    ///    disk order too, take them in turn, each once its expert is done with. Which slot
    ///    an expert lands in depends only on the request and on what is resident, never on
    ///    when a read or a release arrives.
    fn issue_reads(&mut self, b: &mut Batch, io: &mut dyn BatchIo) {
        let devices = &self.pool.devices;
        b.misses = interleave(std::mem::take(&mut b.misses), |(_, l)| {
            (devices.device_of(l.file), (l.file, l.start()))
        });
        b.rotation = b.hits.clone();
        b.rotation.extend(b.misses.iter().map(|(s, _)| *s));
        b.rotation.extend(b.adopted.iter().copied()); // guess:
        b.rotation.extend(b.taken.iter().copied()); // guess:
        b.rotation.retain(|&s| !self.slots[s].pinned);
        b.t0 = Instant::now();
        b.last_done = b.t0;
        for (s, loc) in std::mem::take(&mut b.misses) {
            self.start_read(b, s, &loc, io);
        }
    }

    /// Start the read of `loc` into slot `s` (already claimed) as the batch's next tag; a
    /// pool that stopped fails it.
    fn start_read(&mut self, b: &mut Batch, s: usize, loc: &ExpertExtents, io: &mut dyn BatchIo) {
        self.slots[s].file = loc.file;
        if self.issue(b.tag, s, loc) {
            b.inflight.insert(b.tag, s);
            b.any_read = true;
        } else {
            self.fail_read(s, ReadFailure::PoolStopped, b.publish, io);
            b.summary.failed += 1;
        }
        b.tag += 1;
    }

    /// 3a. Hits are already there.
    fn publish_hits(&mut self, b: &mut Batch, io: &mut dyn BatchIo) {
        if !b.publish {
            return;
        }
        for &s in &b.hits {
            b.summary.hits += 1;
            b.summary.published += 1;
            self.mark_published(s, b.hold);
            io.event(BatchEvent::Ready(self.arrival(s, true)));
        }
    }

    /// 3b. Misses, in arrival order; each slot done with takes the next deferred miss.
    fn land_reads(&mut self, b: &mut Batch, io: &mut dyn BatchIo) {
        loop {
            self.reuse_slots(b, io);
            if b.inflight.is_empty() && b.deferred.is_empty() {
                break;
            }
            let blocked =
                !b.deferred.is_empty() && !b.next_slot().is_some_and(|s| self.reusable(s));
            // Only a release can unblock the next deferred miss when nothing is in flight.
            let can_wait_release = b.hold && io.takes_releases() && !b.rotation.is_empty();
            if b.inflight.is_empty() {
                if !can_wait_release {
                    // No slot of this batch can come back: every one is pinned or held by
                    // a reader that cannot release it during the batch.
                    for (id, _) in std::mem::take(&mut b.deferred) {
                        let e = FetchError::NoSlot {
                            layer: b.layer,
                            expert: id,
                        };
                        self.fail_request(e, b.publish, io);
                        b.summary.failed += 1;
                    }
                    break;
                }
                b.summary.failed += self.take_releases(io, None, b.layer, &mut b.deferred);
                continue;
            }
            let done = if blocked && can_wait_release {
                // Wait for a read, looking for releases meanwhile.
                match self.pool.done.recv_timeout(RELEASE_POLL) {
                    Ok(d) => Some(d),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        let wait = Some(Duration::ZERO);
                        b.summary.failed += self.take_releases(io, wait, b.layer, &mut b.deferred);
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => None,
                }
            } else {
                self.pool.done.recv().ok()
            };
            match done {
                Some(done) => self.landed(b, done, io),
                None => {
                    let mut lost: Vec<usize> = b.inflight.drain().map(|(_, s)| s).collect();
                    lost.sort_unstable();
                    for s in lost {
                        self.fail_read(s, ReadFailure::PoolStopped, b.publish, io);
                        b.summary.failed += 1;
                    }
                }
            }
        }
        if b.any_read {
            let secs = b.last_done.duration_since(b.t0).as_secs_f64();
            self.count(|c| c.io_seconds += secs);
        }
    }

    /// While the rotation's next slot is done with, give it to the next deferred miss.
    fn reuse_slots(&mut self, b: &mut Batch, io: &mut dyn BatchIo) {
        while !b.deferred.is_empty() {
            let Some(s) = b.next_slot() else {
                break;
            };
            if !self.reusable(s) {
                break;
            }
            let Some((id, loc)) = b.deferred.pop_front() else {
                break;
            };
            b.next_turn += 1;
            match self.slots[s].state {
                SlotState::Resident => {
                    let key = self.slots[s].key;
                    self.index.remove(&key);
                    self.guess.on_evict(key); // guess:
                    self.count(|c| c.evictions += 1);
                }
                // A failed read left it EMPTY (and on the free list).
                _ => self.free.retain(|&f| f != s),
            }
            self.claim_for_read(s, b.layer, id, &loc, b.publish);
            b.summary.recycled += 1;
            self.start_read(b, s, &loc, io);
        }
    }

    /// A read of the batch finished: its expert is resident (and published), or failed.
    fn landed(&mut self, b: &mut Batch, done: Done, io: &mut dyn BatchIo) {
        if let Some((s, loc)) = b.after_guess.remove(&done.tag) {
            // guess: a taken-over guess read landed; its slot is free for the batch's read.
            b.inflight.remove(&done.tag);
            self.guess.taken_over_landed(&done.result);
            return self.start_read(b, s, &loc, io);
        }
        if self.guess.owns(done.tag) {
            return self.guess_landed(done); // guess: not this batch's
        }
        let Some(s) = b.inflight.remove(&done.tag) else {
            return;
        };
        b.last_done = b.last_done.max(done.at);
        match done.result {
            Ok(bytes) => {
                self.land(s);
                self.count(|c| {
                    c.reads += 1;
                    c.bytes_read += bytes;
                });
                b.summary.reads += 1;
                if done.tag >= guess::GUESS_TAG {
                    self.guess.adopted_landed(bytes); // guess: adopted
                }
                if b.publish {
                    b.summary.published += 1;
                    self.mark_published(s, b.hold);
                    io.event(BatchEvent::Ready(self.arrival(s, false)));
                }
            }
            Err(why) => {
                if let Some(other) = self.failover(s, &why) {
                    self.count(|c| c.failovers += 1);
                    return self.start_read(b, s, &other, io);
                }
                self.fail_read(s, why, b.publish, io);
                b.summary.failed += 1;
            }
        }
    }

    /// The copies of `(layer, id)` ([`Locate::copies`]) less those in files that failed a
    /// read, unless no other copy is left (then all of them: the read fails plainly).
    pub(super) fn live_copies(&self, layer: u32, id: u32) -> Vec<ExpertExtents> {
        let mut c = self.locator.copies(layer, id);
        if c.iter().any(|l| self.live(l)) {
            c.retain(|l| self.live(l));
        }
        c
    }

    /// Whether none of the files `l` is read from failed a read.
    fn live(&self, l: &ExpertExtents) -> bool {
        l.files().all(|f| !self.down.contains(&f))
    }

    /// A read into slot `s` failed with `why`: an I/O error or a short read marks its file
    /// down (said once, as a warning naming the file and the error its device), and the
    /// expert's first copy in a file that is not down, if any, is where to read it again,
    /// into the same slot. None: the read fails as it would without copies (the run exits 4,
    /// naming the device). The copies hold the same bytes, so the expert and the ids are
    /// unchanged.
    fn failover(&mut self, s: usize, why: &ReadFailure) -> Option<ExpertExtents> {
        if !matches!(why, ReadFailure::Io(_) | ReadFailure::Short { .. }) {
            return None;
        }
        let slot = &self.slots[s];
        let (file, key) = (slot.file, slot.key);
        let copies = self.locator.copies(key.0, key.1);
        if copies.len() < 2 {
            return None;
        }
        if self.down.insert(file) {
            // `why` names the device.
            tracing::warn!(
                "{} failed a read ({why}); experts with a copy elsewhere are read from there \
                 from now on",
                self.file_path(file)
            );
        }
        copies.into_iter().find(|l| self.live(l))
    }

    /// File `file`'s path, for messages.
    fn file_path(&self, file: u32) -> String {
        match self.locator.files().get(file as usize) {
            Some(p) => p.display().to_string(),
            None => format!("file {file}"),
        }
    }

    /// A file that failed a read, for the report: its path and its device.
    fn down_name(&self, file: u32) -> String {
        let dev = self.pool.devices.name(self.pool.devices.device_of(file));
        format!("{} (device {dev})", self.file_path(file))
    }

    /// 4. The batch is over: its slots become ordinary LRU entries, in the order they
    ///    were claimed, except those a reader still holds (or pinned ones, or EMPTY ones
    ///    already on the free list).
    fn end_batch(&mut self, b: Batch) -> BatchSummary {
        for s in b.claimed {
            let stamp = self.tick();
            let slot = &mut self.slots[s];
            slot.in_batch = false;
            slot.stamp = stamp;
            if slot.state == SlotState::Resident && !slot.pinned && !slot.held {
                self.lru.insert((stamp, s));
            }
        }
        self.batch_layer = None;
        self.batch_ids.clear();
        self.early.clear();
        b.summary
    }

    /// Take the releases the reader sent during a held batch (waiting at most `wait` for
    /// the first). When the reader is gone, every deferred miss fails with its reason (a
    /// held batch always publishes); returns how many failed.
    fn take_releases(
        &mut self,
        io: &mut dyn BatchIo,
        wait: Option<Duration>,
        layer: u32,
        deferred: &mut VecDeque<(u32, ExpertExtents)>,
    ) -> usize {
        match io.releases(wait) {
            Ok(r) => {
                self.apply_releases(r);
                0
            }
            Err(gone) => {
                let n = deferred.len();
                for (id, _) in std::mem::take(deferred) {
                    let e = FetchError::Read {
                        layer,
                        expert: id,
                        why: gone.clone().into(),
                    };
                    self.fail_request(e, true, io);
                }
                n
            }
        }
    }

    /// A request that ends without data: counted (a failed miss, or a failed prefetch) and,
    /// when the batch publishes, reported.
    fn fail_request(&mut self, e: FetchError, publish: bool, io: &mut dyn BatchIo) {
        if publish {
            self.count(|c| {
                c.requests += 1;
                c.misses += 1;
                c.failed += 1;
            });
            io.event(BatchEvent::Failed(e));
        } else {
            self.count(|c| c.prefetch_failed += 1);
        }
    }

    /// Apply releases the reader sent during a batch.
    fn apply_releases(&mut self, released: Vec<(u32, Vec<u32>)>) {
        for (layer, ids) in released {
            for id in ids {
                self.release_one(layer, id);
            }
        }
    }

    /// A read that did not complete: the slot goes back to EMPTY (and to the free list) and
    /// the failure is reported.
    fn fail_read(&mut self, s: usize, why: ReadFailure, publish: bool, io: &mut dyn BatchIo) {
        let key = self.slots[s].key;
        self.slots[s] = EMPTY_SLOT;
        // Still the batch's until it ends (its rotation may reuse it).
        self.slots[s].in_batch = true;
        self.free.push(s);
        if publish {
            self.count(|c| c.failed += 1);
            io.event(BatchEvent::Failed(FetchError::Read {
                layer: key.0,
                expert: key.1,
                why,
            }));
        } else {
            self.count(|c| c.prefetch_failed += 1);
        }
    }

    /// The seed-style report block for a set of counters.
    pub fn render_stats(&self, title: &str, st: &FetchStats) -> String {
        let mb = self.slot_bytes as f64 / 1e6;
        format!(
            "cache [{title}]\n  slots        : {} of {:.2} MB = {:.2} GB arena ({} resident, {} pinned)\n  \
             requests     : {}  hits {} ({:.2}%)  misses {}  evictions {}  failed {}\n  \
             of those hits : {} were read from disk this step; TRUE resident hit rate {:.2}%\n  \
             read from disk: {:.2} GB in {:.2} s ({:.0} MB/s while loading), {} reads\n{}",
            self.slots.len(),
            mb,
            self.slots.len() as f64 * mb / 1e3,
            self.resident(),
            self.pinned(),
            st.requests,
            st.hits,
            100.0 * st.hit_rate(),
            st.misses,
            st.evictions,
            st.failed,
            st.hits_read_this_step,
            100.0 * st.true_resident_hit_rate(),
            st.bytes_read as f64 / 1e9,
            st.io_seconds,
            st.mb_per_s(),
            st.reads,
            if st.failovers > 0 {
                let names: Vec<String> = self.down.iter().map(|&f| self.down_name(f)).collect();
                format!(
                    "  failed over  : {} reads read again from another copy (failed: {})\n",
                    st.failovers,
                    names.join(", ")
                )
            } else {
                String::new()
            }
        )
    }
}
