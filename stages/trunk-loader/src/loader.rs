//! The trunk loader: pinned layers loaded once, the other layers streamed through a ring
//! ([`Ring`]) by a reader thread that runs ahead in layer order as far as its free bytes allow.
//!
//! The consumer walks layers 0..L-1 on every token: [`TrunkLoader::acquire`] blocks until
//! the layer is in memory and returns where it is; [`TrunkLoader::release`] gives a streamed
//! layer's slot back so the reader can load the next one (a pinned layer's release is a
//! no-op). [`TrunkLoader::layer`] wraps both in a guard that derefs to the bytes.
//!
//! Streamed layers must be acquired in cyclic layer order (pinned ones in any order): the
//! reader's order is fixed, so an out-of-order acquire is an error rather than a deadlock.
//!
//! A coded trunk (`pack-trunk --codec`) is read through [`trunk_reader`]'s
//! [`CodedReader`]: the same raw offsets, each chunk read and decoded by the reader thread
//! that asked for it, straight into the slot; the per-MiB CRCs below then check the decoded
//! bytes as they check a raw trunk's. A read that starts inside a chunk (a layer's part) is
//! cut at the chunk's end ([`ChunkGrid`]), so no chunk is decoded twice.
//!
//! Without a packed trunk there is nothing to stream: the caller loads the whole trunk
//! resident from the shards instead (memory-map or read it); this loader is only for
//! `trunk.bin`, whose runs are page-aligned, though unaligned runs work too.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use k3_io::arena::{align_down, ArenaError, ArenaMemory, OwnedArena, ALIGN};
use k3_io::direct::{ParallelReadError, ReadAt};
use k3_model::codec_trunk::CodedReader;
use k3_model::trunk::{CheckError, TrunkError, TrunkManifest};

use crate::plan::{LayerRun, TrunkPlan};

/// A layer that could not be served.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("trunk layer {layer}: read failed: {why}")]
    Read { layer: usize, why: UnitReadError },
    #[error("trunk layer {layer} does not exist (the trunk has {layers} layers)")]
    NoSuchLayer { layer: usize, layers: usize },
    #[error("trunk layer {layer} acquired out of order: the stream is at layer {expected}")]
    OutOfOrder { layer: usize, expected: usize },
    #[error("trunk layer {layer} released but not acquired")]
    NotAcquired { layer: usize },
    #[error("the trunk reader has stopped")]
    Stopped,
}

/// Why reading one unit failed. Kept by the loader and handed to every acquire of the unit
/// (hence `Clone`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UnitReadError {
    #[error("needs {need} bytes, the region holds {cap}")]
    TooBig { need: u64, cap: u64 },
    /// The read failed: the I/O error's message (an `io::Error` cannot be cloned).
    #[error("{0}")]
    Io(String),
    #[error("short read: {got} bytes at offset {start}, needed {need}")]
    Short { got: usize, start: u64, need: u64 },
    /// The bytes are not what was packed.
    #[error(transparent)]
    Check(#[from] CheckError),
    #[error("internal: no check {0}")]
    NoCheck(usize),
    #[error("piece {0} was not read")]
    NotRead(usize),
}

impl From<ParallelReadError<CheckError>> for UnitReadError {
    fn from(e: ParallelReadError<CheckError>) -> UnitReadError {
        match e {
            ParallelReadError::Io(e) => UnitReadError::Io(e.to_string()),
            ParallelReadError::Rejected(c) => UnitReadError::Check(c),
            ParallelReadError::NotRead(i) => UnitReadError::NotRead(i),
        }
    }
}

/// A loader that could not be built: the packed trunk, the plan, the arena or the reader.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    #[error(transparent)]
    Manifest(#[from] TrunkError),
    #[error("{}: --layers {layers} but the packed trunk has {have} layers", dir.display())]
    TooFewLayers {
        dir: std::path::PathBuf,
        layers: usize,
        have: usize,
    },
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),
    /// Opening the trunk's files (`DirectFiles::open` names the file in `source`).
    #[error("{source}")]
    Open {
        #[source]
        source: std::io::Error,
    },
    #[error("trunk arena: {0}")]
    Arena(#[source] ArenaError),
    #[error("the plan is for {plan} layers, the trunk has {have}")]
    PlanLayers { plan: usize, have: usize },
    #[error("the trunk arena has {have} bytes, the plan needs {need}")]
    ArenaTooSmall { have: usize, need: u64 },
    #[error("a plan that streams layers needs at least one ring slot")]
    NoRingSlot,
    #[error("layer {layer} needs {need} bytes, more than the {slot}-byte ring slot")]
    UnitTooBig { layer: usize, need: u64, slot: u64 },
    #[error("cannot start the trunk reader: {0}")]
    Thread(#[source] std::io::Error),
    #[error("the trunk is stored with codec {0:?}, which this build cannot decode")]
    Codec(String),
    #[error("reading the layers kept coded in memory: {0}")]
    Keep(#[source] std::io::Error),
}

/// The reader of a packed trunk in `dir`: `trunk.bin` directly, or a coded trunk's stored
/// file through a [`CodedReader`] (also returned, for its counters) that serves the same
/// raw bytes at the same offsets (file 0 either way).
#[allow(clippy::type_complexity)]
pub fn trunk_reader(
    dir: &std::path::Path,
    m: &TrunkManifest,
) -> Result<(Arc<dyn ReadAt>, Option<Arc<CodedReader>>), LoaderError> {
    trunk_reader_keeping(dir, &[], m, None)
}

/// Layers of a coded trunk kept coded in memory: their stored runs, back to back from
/// byte `at` of `arena` ([`crate::plan::TrunkPlan::kept_at`]).
pub struct KeepCoded<'a> {
    pub layers: &'a [usize],
    pub arena: Arc<dyn ArenaMemory>,
    pub at: u64,
}

/// [`trunk_reader`] that first reads the stored runs of `keep`'s layers into its arena
/// ([`CodedReader::keep_layers`]): those layers are decoded from memory from then on.
#[allow(clippy::type_complexity)]
pub fn trunk_reader_keeping(
    dir: &std::path::Path,
    copies: &[std::path::PathBuf],
    m: &TrunkManifest,
    keep: Option<KeepCoded<'_>>,
) -> Result<(Arc<dyn ReadAt>, Option<Arc<CodedReader>>), LoaderError> {
    let file = m.data_file().0;
    let paths: Vec<std::path::PathBuf> = std::iter::once(dir)
        .chain(copies.iter().map(|c| c.as_path()))
        .map(|d| d.join(file))
        .collect();
    let files =
        k3_io::open_copies(&paths, "trunk copy").map_err(|source| LoaderError::Open { source })?;
    match &m.codec {
        None => Ok((files, None)),
        Some(c) => {
            let mut coded =
                CodedReader::new(m, files, 0).ok_or_else(|| LoaderError::Codec(c.name.clone()))?;
            if let Some(k) = keep.filter(|k| !k.layers.is_empty()) {
                coded
                    .keep_layers(k.layers, k.arena, k.at)
                    .map_err(LoaderError::Keep)?;
            }
            let coded = Arc::new(coded);
            let r: Arc<dyn ReadAt> = coded.clone();
            Ok((r, Some(coded)))
        }
    }
}

/// Heap the decoding of a coded trunk holds at most (every reader thread of a
/// [`read_parallel`] with its chunk buffers); 0 for a raw trunk. The memory plan counts it.
pub fn decode_buffer_bytes(m: &TrunkManifest) -> u64 {
    READ_QD as u64 * CodedReader::buffer_bytes_per_thread(m)
}

/// [`decode_buffer_bytes`] of any coded trunk with chunks of `chunk` decoded bytes (a chunk
/// stores at most its bytes plus a few of header and frame, page-aligned): what a plan
/// projects before the trunk is packed (`inspect --codec-ratio`).
pub fn decode_buffer_bound(chunk: u64) -> u64 {
    let stored = k3_io::arena::align_up(chunk + 4096);
    READ_QD as u64 * (stored + chunk + chunk / 2)
}

/// Where an acquired layer's bytes are: `arena_offset..arena_offset + len` of the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerHandle {
    pub layer: usize,
    pub arena_offset: u64,
    pub len: u64,
    /// True when it was already resident (a pinned layer after its first use).
    pub hit: bool,
}

/// One contiguous byte range of the trunk file that a [`Unit`] reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to read.
    pub len: u64,
    /// The run check (`checks[i]`) that covers it and the byte of that run it starts at (a
    /// multiple of `CHECK_CHUNK`); `None`: unchecked (or checked by `tensor_checks`).
    pub check: Option<(usize, u64)>,
    /// Checks of single tensors inside the piece (a part of a layer): `checks[i]` for the
    /// tensor that starts `at` bytes after the piece's first byte.
    pub tensor_checks: Vec<(usize, u64)>,
}

impl Piece {
    /// Arena bytes it occupies (page-mirrored: an unaligned start is read from its page).
    pub fn footprint(&self) -> u64 {
        k3_io::arena::align_up(self.offset % ALIGN as u64 + self.len)
    }
}

/// What the loader streams as one: a whole layer (one piece), or a part of a layer (the
/// pieces holding the tensors the forward uses together), read back to back into one slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    pub pieces: Vec<Piece>,
}

impl Unit {
    /// Arena bytes of the whole unit.
    pub fn footprint(&self) -> u64 {
        self.pieces.iter().map(Piece::footprint).sum()
    }

    /// Where piece `k`'s first byte lands, relative to the unit's first arena byte.
    pub fn piece_at(&self, k: usize) -> u64 {
        let before: u64 = self.pieces[..k].iter().map(Piece::footprint).sum();
        before + self.pieces[k].offset % ALIGN as u64
    }

    /// As a [`LayerRun`] of the same footprint (what [`crate::plan::plan`] sizes).
    pub fn as_run(&self) -> LayerRun {
        LayerRun {
            offset: 0,
            len: self.footprint(),
        }
    }
}

/// Counters for the whole run.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct TrunkStats {
    pub layers: usize,
    pub pinned: usize,
    pub ring_slots: usize,
    pub slot_bytes: u64,
    /// `acquire` calls.
    pub binds: u64,
    /// Binds of a pinned layer that was already loaded (the first bind of each pinned layer
    /// pays for its load, as in the seed's ladder: 7 x 90 of 8 x 93 binds = 84.7%).
    pub hits: u64,
    /// Layers read and the bytes those reads transferred.
    pub reads: u64,
    pub bytes_read: u64,
    /// Seconds the reader thread spent in reads.
    pub io_seconds: f64,
    /// Seconds `acquire` spent waiting for a layer to arrive (the stall the consumer saw).
    pub wait_seconds: f64,
}

impl TrunkStats {
    /// hits / binds: deterministic, it depends only on the plan and the number of tokens.
    pub fn hit_rate(&self) -> f64 {
        if self.binds == 0 {
            0.0
        } else {
            self.hits as f64 / self.binds as f64
        }
    }

    /// Read throughput in MB/s (10^6 bytes).
    pub fn mb_per_s(&self) -> f64 {
        if self.io_seconds > 0.0 {
            self.bytes_read as f64 / 1e6 / self.io_seconds
        } else {
            0.0
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Loaded {
    No,
    Yes,
    Failed(UnitReadError),
}

/// One streamed unit in the ring: where it sits and how far it got.
#[derive(Clone, Debug)]
struct RingSlot {
    /// None once released (or failed and passed over); its bytes are free when every older
    /// entry's are ([`Ring::place`]).
    layer: Option<usize>,
    loaded: Loaded,
    acquired: bool,
    /// Bytes the read that loaded it transferred (counted as served when acquired).
    bytes: u64,
    /// Its region: `[at, at + len)` from the ring's first byte.
    at: u64,
    len: u64,
}

/// The ring's bytes. The reader reads units in the order the consumer uses them.
///
/// - **One slot** (the plan under a tight budget): the bytes are handed out first in,
///   first out. Each unit is placed right after the one read before it (wrapping to the
///   start when the end cannot hold it) as soon as the units before it have given back
///   enough room, so the slot holds a small unit in use and reads the next one beside it
///   (a latent MoE layer's 51 MB phase-4 part held through the expert wait, the next
///   layer's 176 MB output projection read meanwhile). A unit released before an older one
///   stays counted until the older one goes. With nothing held the whole slot is free, so
///   it never holds fewer units than one whole slot would.
/// - **Several slots**: whole slots, one unit each. First in, first out could hold fewer
///   there (a unit that does not fit before the wrap waits while a whole slot is free).
#[derive(Debug, Default)]
struct Ring {
    /// Entries, oldest first.
    entries: std::collections::VecDeque<RingSlot>,
    /// The plan's slots and bytes per slot.
    slots: usize,
    slot: u64,
}

impl Ring {
    fn new(slots: usize, slot: u64) -> Ring {
        Ring {
            entries: Default::default(),
            slots,
            slot,
        }
    }

    /// Where a unit of `len` bytes (at most a slot) would go now, if anywhere, from the
    /// ring's first byte (released entries are dropped first).
    fn place(&mut self, len: u64) -> Option<u64> {
        if self.slots > 1 {
            self.entries.retain(|e| e.layer.is_some());
            return (0..self.slots as u64)
                .map(|k| k * self.slot)
                .find(|&at| self.entries.iter().all(|e| e.at != at));
        }
        while self.entries.front().is_some_and(|e| e.layer.is_none()) {
            self.entries.pop_front();
        }
        let cap = self.slot * self.slots as u64;
        let (Some(front), Some(back)) = (self.entries.front(), self.entries.back()) else {
            return (len <= cap).then_some(0);
        };
        let (tail, head) = (front.at, back.at + back.len);
        if back.at >= tail {
            // One run [tail, head): after it, or else from the start up to the tail.
            if head + len <= cap {
                Some(head)
            } else {
                (len <= tail).then_some(0)
            }
        } else {
            // Wrapped: the free bytes are [head, tail).
            (head + len <= tail).then_some(head)
        }
    }

    /// The entry holding `layer`, acquired or not yet.
    fn find(&self, layer: usize, acquired: bool) -> Option<usize> {
        self.entries
            .iter()
            .position(|s| s.layer == Some(layer) && s.acquired == acquired)
    }
}

struct State {
    pinned: Vec<Loaded>,
    pinned_used: Vec<bool>,
    ring: Ring,
    /// The streamed layer the consumer must acquire next.
    next_consume: usize,
    stop: bool,
    /// With [`TrunkLoader::hold_wrap`]: passes the consumer has opened
    /// ([`TrunkLoader::open_pass`]) and times the reader has started the first streamed
    /// unit; the reader starts it for pass `n + 1` only once `opened > n`.
    hold_wrap: bool,
    opened: u64,
    wraps: u64,
    stats: TrunkStats,
    /// Bytes each pinned layer's read transferred (counted as served at its first bind).
    pinned_bytes: Vec<u64>,
    /// Bytes of the reads behind the units served so far (see [`TrunkLoader::served_bytes`]).
    served_bytes: u64,
}

struct Shared {
    arena: Arc<dyn ArenaMemory>,
    units: Vec<Unit>,
    plan: TrunkPlan,
    /// Arena offset of each pinned layer's page-mirror.
    pinned_at: Vec<u64>,
    /// Arena offset of the ring's first byte.
    ring_at: u64,
    reader: Arc<dyn ReadAt>,
    file: u32,
    /// A coded trunk's chunk grid (reads of unchecked pieces are cut on it).
    grid: Option<ChunkGrid>,
    /// Per-run CRCs checked after every read, named by each piece's `check` (empty:
    /// unchecked, e.g. a raw file in tests).
    checks: Vec<k3_model::trunk::RunCheck>,
    state: Mutex<State>,
    cv: Condvar,
}

pub use k3_io::direct::{READ_CHUNK, READ_QD};

/// Where a coded trunk's chunks start (`pack-trunk --codec`): every `chunk` bytes from each
/// layer's first byte (`starts`, the layers' offsets in the raw layout, ascending).
///
/// [`read_parallel`] cuts a read into [`READ_CHUNK`] pieces from its first byte; a part
/// that starts inside a chunk would then cut every chunk it spans across two pieces, and
/// each piece decodes the whole chunk: half as much decoding and stored reading again. The
/// loader cuts such a read at the first chunk boundary instead, so every later piece is
/// whole chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkGrid {
    pub starts: Vec<u64>,
    pub chunk: u64,
}

impl ChunkGrid {
    /// The grid of coded trunk `m` (None for a raw one).
    pub fn of(m: &TrunkManifest) -> Option<ChunkGrid> {
        let c = m.codec.as_ref()?;
        Some(ChunkGrid {
            starts: m.layers.iter().map(|l| l.offset).collect(),
            chunk: c.chunk.max(1),
        })
    }

    /// Bytes from `start` to the first chunk boundary after it, when that lies inside a
    /// read of `len` bytes (None: `start` is on a boundary, or the read ends first).
    pub fn cut(&self, start: u64, len: usize) -> Option<usize> {
        let i = self
            .starts
            .partition_point(|&o| o <= start)
            .checked_sub(1)?;
        let rel = start - self.starts[i];
        let to = (self.chunk - rel % self.chunk) % self.chunk;
        (to > 0 && (to as usize) < len).then_some(to as usize)
    }
}

/// Fill `dst` from `offset` of `file` with [`k3_io::direct::read_parallel`] ([`READ_CHUNK`]
/// pieces, [`READ_QD`] in flight), checking each piece against `check`'s CRCs. Returns the
/// bytes read: `dst.len()`, or fewer only when the file ends inside the last piece read.
pub fn read_parallel(
    reader: &dyn ReadAt,
    file: u32,
    offset: u64,
    dst: &mut [u8],
    check: Option<&k3_model::trunk::RunCheck>,
) -> Result<usize, ParallelReadError<CheckError>> {
    read_parallel_at(reader, file, offset, dst, check.map(|c| (c, 0)))
}

/// [`read_parallel`] of bytes that start at byte `at` of the checked run (`at` a multiple
/// of `CHECK_CHUNK`): the pieces are checked against the run's CRCs from there.
pub fn read_parallel_at(
    reader: &dyn ReadAt,
    file: u32,
    offset: u64,
    dst: &mut [u8],
    check: Option<(&k3_model::trunk::RunCheck, u64)>,
) -> Result<usize, ParallelReadError<CheckError>> {
    const _: () = assert!((READ_CHUNK as u64).is_multiple_of(k3_model::trunk::CHECK_CHUNK));
    let on_piece = |at: usize, got: &[u8]| match check {
        Some((c, base)) => c.check_range(base + at as u64, got),
        None => Ok(()),
    };
    k3_io::direct::read_parallel(reader, file, offset, dst, &on_piece)
}

/// Serves trunk layers. See the module documentation.
pub struct TrunkLoader {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl State {
    /// Holding the wrap, the next pass's first streamed unit may not be read yet.
    fn wrap_closed(&self) -> bool {
        self.hold_wrap && self.opened <= self.wraps
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Shared::read_unit`], read again from the other copies of the trunk
    /// (`--trunk DIR,COPY`) while it fails (its bytes fail their CRCs, a coded chunk does not
    /// decode, a read fails on every copy): each try takes every piece from another copy
    /// than the try before. Returns the bytes read.
    fn read_layer(&self, unit: usize, at: u64, cap: u64) -> Result<u64, UnitReadError> {
        let mut r = self.read_unit(unit, at, cap);
        for _ in 1..self.reader.copies() {
            let why = match &r {
                Ok(_) | Err(UnitReadError::TooBig { .. } | UnitReadError::NoCheck(_)) => break,
                Err(e) => e.to_string(),
            };
            tracing::warn!("trunk unit {unit}: {why}; reading it again from the other copies");
            self.reader.next_copy();
            r = self.read_unit(unit, at, cap);
        }
        r
    }

    /// Read unit `unit` into the arena region at `at` (each piece page-mirrored, back to
    /// back); returns the bytes read.
    fn read_unit(&self, unit: usize, at: u64, cap: u64) -> Result<u64, UnitReadError> {
        let u = &self.units[unit];
        let need = u.footprint();
        if need > cap {
            return Err(UnitReadError::TooBig { need, cap });
        }
        let mut total = 0u64;
        let mut pos = at;
        for r in &u.pieces {
            let fp = r.footprint();
            // SAFETY: [pos, pos + fp) lies inside the unit's region [at, at + need), which
            // lies inside the arena (regions are laid out from the plan in `new`); the region
            // is not loaded, so no consumer holds a reference into it, and only this reader
            // thread writes it.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(self.arena.base().add(pos as usize), fp as usize)
            };
            let start = align_down(r.offset);
            // Packed trunks start every run on a page and record a CRC-32C per MiB: each
            // piece is checked by the thread that read it, right after it lands.
            let check = r
                .check
                .and_then(|(i, a)| self.checks.get(i).map(|c| (c, a)));
            let aligned = check.filter(|_| start == r.offset);
            let got = self.read_cut(start, dst, aligned)?;
            if start + (got as u64) < r.offset + r.len {
                return Err(UnitReadError::Short {
                    got,
                    start,
                    need: r.offset + r.len - start,
                });
            }
            let head = (r.offset - start) as usize;
            if let (Some((c, a)), false) = (check, start == r.offset) {
                c.check_range(a, &dst[head..head + r.len as usize])?;
            }
            for &(i, off) in &r.tensor_checks {
                let c = self.checks.get(i).ok_or(UnitReadError::NoCheck(i))?;
                let from = head + off as usize;
                c.check(dst.get(from..).unwrap_or_default())?;
            }
            total += got as u64;
            pos += fp;
        }
        Ok(total)
    }

    /// [`read_parallel_at`] of `dst` from `start`; an unchecked read of a coded trunk is cut
    /// at its first chunk boundary (see [`ChunkGrid`]).
    fn read_cut(
        &self,
        start: u64,
        dst: &mut [u8],
        check: Option<(&k3_model::trunk::RunCheck, u64)>,
    ) -> Result<usize, ParallelReadError<CheckError>> {
        let cut = match (&self.grid, check) {
            (Some(g), None) => g.cut(start, dst.len()),
            _ => None,
        };
        let Some(cut) = cut else {
            return read_parallel_at(&*self.reader, self.file, start, dst, check);
        };
        let (head, tail) = dst.split_at_mut(cut);
        let got = read_parallel_at(&*self.reader, self.file, start, head, None)?;
        if got < cut {
            return Ok(got);
        }
        Ok(cut + read_parallel_at(&*self.reader, self.file, start + cut as u64, tail, None)?)
    }

    fn next_streamed(&self, layer: usize) -> usize {
        if layer + 1 >= self.plan.layers {
            self.plan.pinned
        } else {
            layer + 1
        }
    }

    fn run(&self) {
        let p = &self.plan;
        for layer in 0..p.pinned {
            if self.lock().stop {
                return;
            }
            let t0 = Instant::now();
            let r = self.read_layer(layer, self.pinned_at[layer], self.units[layer].footprint());
            let dt = t0.elapsed().as_secs_f64();
            let mut st = self.lock();
            st.stats.io_seconds += dt;
            st.pinned[layer] = match r {
                Ok(b) => {
                    st.stats.reads += 1;
                    st.stats.bytes_read += b;
                    st.pinned_bytes[layer] = b;
                    Loaded::Yes
                }
                Err(w) => Loaded::Failed(w),
            };
            self.cv.notify_all();
        }
        if p.ring_slots == 0 {
            return;
        }
        let mut next = p.pinned;
        loop {
            // Wait for a free slot (and, holding the wrap, for the pass that uses it).
            let at = {
                let mut st = self.lock();
                loop {
                    if st.stop {
                        return;
                    }
                    // Pass 1's first streamed unit is read at once; pass n + 1's once the
                    // consumer has opened it.
                    let held = next == p.pinned && st.wraps > 0 && st.wrap_closed();
                    let len = self.units[next].footprint();
                    let free = if held { None } else { st.ring.place(len) };
                    if let Some(at) = free {
                        st.ring.entries.push_back(RingSlot {
                            layer: Some(next),
                            loaded: Loaded::No,
                            acquired: false,
                            bytes: 0,
                            at,
                            len,
                        });
                        if next == p.pinned {
                            st.wraps += 1;
                        }
                        break at;
                    }
                    st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                }
            };
            let t0 = Instant::now();
            let r = self.read_layer(next, self.ring_at + at, p.slot_bytes);
            let dt = t0.elapsed().as_secs_f64();
            let mut st = self.lock();
            st.stats.io_seconds += dt;
            if let Ok(b) = r {
                st.stats.reads += 1;
                st.stats.bytes_read += b;
            }
            // The entry just placed (only this thread adds or drops entries).
            if let Some(e) =
                (st.ring.entries.iter_mut().rev()).find(|e| e.layer == Some(next) && e.at == at)
            {
                (e.bytes, e.loaded) = match r {
                    Ok(b) => (b, Loaded::Yes),
                    Err(w) => (0, Loaded::Failed(w)),
                };
            }
            drop(st);
            self.cv.notify_all();
            next = self.next_streamed(next);
        }
    }
}

/// The runs of a packed trunk's manifest, in layer order (payload lengths; the padding
/// makes each footprint exactly `padded_length`).
pub fn runs_from_manifest(m: &k3_model::trunk::TrunkManifest) -> Vec<LayerRun> {
    m.layers
        .iter()
        .map(|l| LayerRun {
            offset: l.offset,
            len: l.length,
        })
        .collect()
}

impl TrunkLoader {
    /// Open a packed trunk directory (`trunk.json` + `trunk.bin`), plan `budget` bytes over
    /// its first `layers` layers (all when `None`) and start loading. Returns the manifest
    /// too (it names each layer's tensors and their offsets inside the run).
    pub fn open_dir(
        dir: &std::path::Path,
        budget: u64,
        ring: crate::plan::RingPolicy,
        layers: Option<usize>,
    ) -> Result<(k3_model::trunk::TrunkManifest, TrunkLoader), LoaderError> {
        let m = k3_model::trunk::TrunkManifest::load_dir(dir)?;
        let mut runs = runs_from_manifest(&m);
        if let Some(n) = layers {
            if n > runs.len() {
                return Err(LoaderError::TooFewLayers {
                    dir: dir.to_path_buf(),
                    layers: n,
                    have: runs.len(),
                });
            }
            runs.truncate(n);
        }
        let plan = crate::plan::plan(budget, &runs, ring)?;
        let (reader, _) = trunk_reader(dir, &m)?;
        let bytes = plan.bytes().max(ALIGN as u64);
        let arena: Arc<dyn ArenaMemory> =
            Arc::new(OwnedArena::new(bytes as usize).map_err(LoaderError::Arena)?);
        let checks = m.run_checks();
        let loader = TrunkLoader::with_arena_checked(runs, plan, reader, 0, arena, checks)?;
        Ok((m, loader))
    }

    /// Start loading: allocates the arena for `plan` and starts the reader thread, which
    /// loads the pinned layers first, then streams. `runs` are the layers of file `file` of
    /// `reader`.
    pub fn new(
        runs: Vec<LayerRun>,
        plan: TrunkPlan,
        reader: Arc<dyn ReadAt>,
        file: u32,
    ) -> Result<TrunkLoader, LoaderError> {
        let bytes = plan.bytes().max(ALIGN as u64);
        let arena: Arc<dyn ArenaMemory> =
            Arc::new(OwnedArena::new(bytes as usize).map_err(LoaderError::Arena)?);
        Self::with_arena(runs, plan, reader, file, arena)
    }

    /// Like [`new`](Self::new) over memory the caller provides (e.g. a shared-memory region
    /// of at least `plan.bytes()` bytes).
    pub fn with_arena(
        runs: Vec<LayerRun>,
        plan: TrunkPlan,
        reader: Arc<dyn ReadAt>,
        file: u32,
        arena: Arc<dyn ArenaMemory>,
    ) -> Result<TrunkLoader, LoaderError> {
        Self::with_arena_checked(runs, plan, reader, file, arena, Vec::new())
    }

    /// Like [`with_arena`](Self::with_arena), checking every layer read against
    /// `checks[layer]` (a packed trunk's per-chunk CRCs, [`TrunkManifest::run_checks`]): a
    /// mismatch fails that layer's acquire with the layer and the offset.
    ///
    /// [`TrunkManifest::run_checks`]: k3_model::trunk::TrunkManifest::run_checks
    pub fn with_arena_checked(
        runs: Vec<LayerRun>,
        plan: TrunkPlan,
        reader: Arc<dyn ReadAt>,
        file: u32,
        arena: Arc<dyn ArenaMemory>,
        checks: Vec<k3_model::trunk::RunCheck>,
    ) -> Result<TrunkLoader, LoaderError> {
        let units = runs
            .iter()
            .enumerate()
            .map(|(l, r)| Unit {
                pieces: vec![Piece {
                    offset: r.offset,
                    len: r.len,
                    check: (l < checks.len()).then_some((l, 0)),
                    tensor_checks: Vec::new(),
                }],
            })
            .collect();
        Self::with_units(units, plan, reader, file, arena, checks)
    }

    /// Like [`with_arena_checked`](Self::with_arena_checked) over units of several pieces
    /// (a trunk streamed in parts): unit `i` is what `acquire(i)` serves; each piece names
    /// the check in `checks` that covers it. `plan` is over the units' footprints
    /// ([`Unit::as_run`]).
    pub fn with_units(
        units: Vec<Unit>,
        plan: TrunkPlan,
        reader: Arc<dyn ReadAt>,
        file: u32,
        arena: Arc<dyn ArenaMemory>,
        checks: Vec<k3_model::trunk::RunCheck>,
    ) -> Result<TrunkLoader, LoaderError> {
        Self::with_units_grid(units, plan, reader, file, arena, checks, None)
    }

    /// Like [`with_units`](Self::with_units) over a coded trunk read through a
    /// `CodedReader` whose chunks lie on `grid` ([`ChunkGrid::of`]): a piece that starts
    /// inside a chunk is read cut at the chunk's end, so no chunk is decoded twice.
    pub fn with_units_grid(
        units: Vec<Unit>,
        plan: TrunkPlan,
        reader: Arc<dyn ReadAt>,
        file: u32,
        arena: Arc<dyn ArenaMemory>,
        checks: Vec<k3_model::trunk::RunCheck>,
        grid: Option<ChunkGrid>,
    ) -> Result<TrunkLoader, LoaderError> {
        let runs = &units;
        if runs.len() != plan.layers {
            return Err(LoaderError::PlanLayers {
                plan: plan.layers,
                have: runs.len(),
            });
        }
        if (arena.len() as u64) < plan.bytes() {
            return Err(LoaderError::ArenaTooSmall {
                have: arena.len(),
                need: plan.bytes(),
            });
        }
        if plan.pinned < plan.layers && plan.ring_slots == 0 {
            return Err(LoaderError::NoRingSlot);
        }
        if let Some(l) = (plan.pinned..plan.layers).find(|&l| runs[l].footprint() > plan.slot_bytes)
        {
            return Err(LoaderError::UnitTooBig {
                layer: l,
                need: runs[l].footprint(),
                slot: plan.slot_bytes,
            });
        }
        let mut pinned_at = Vec::with_capacity(plan.pinned);
        let mut at = 0u64;
        for r in &runs[..plan.pinned] {
            pinned_at.push(at);
            at += r.footprint();
        }
        let stats = TrunkStats {
            layers: plan.layers,
            pinned: plan.pinned,
            ring_slots: plan.ring_slots,
            slot_bytes: plan.slot_bytes,
            ..Default::default()
        };
        let shared = Arc::new(Shared {
            arena,
            plan,
            pinned_at,
            ring_at: at,
            reader,
            file,
            grid,
            checks,
            state: Mutex::new(State {
                pinned: vec![Loaded::No; plan.pinned],
                pinned_used: vec![false; plan.pinned],
                pinned_bytes: vec![0; plan.pinned],
                served_bytes: 0,
                ring: Ring::new(plan.ring_slots, plan.slot_bytes),
                next_consume: plan.pinned,
                stop: false,
                hold_wrap: false,
                opened: 0,
                wraps: 0,
                stats,
            }),
            cv: Condvar::new(),
            units,
        });
        let s2 = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("k3-trunk-read".into())
            .spawn(move || s2.run())
            .map_err(LoaderError::Thread)?;
        Ok(TrunkLoader {
            shared,
            thread: Some(thread),
        })
    }

    /// Hold the read of each pass's first streamed unit until that pass is opened
    /// ([`open_pass`](Self::open_pass)) instead of reading it as soon as a slot frees. For a
    /// consumer that streams other bytes from the same disk between passes (a streamed
    /// lm_head) and starts each pass with pinned units: the read then overlaps the pinned
    /// units' compute instead of sharing the disk with the other stream. Never changes what
    /// is served, only when it is read.
    pub fn hold_wrap(&self, on: bool) {
        self.shared.lock().hold_wrap = on;
        self.shared.cv.notify_all();
    }

    /// A pass has started (see [`hold_wrap`](Self::hold_wrap)); without the hold a no-op.
    pub fn open_pass(&self) {
        self.shared.lock().opened += 1;
        self.shared.cv.notify_all();
    }

    /// The plan in use.
    pub fn plan(&self) -> TrunkPlan {
        self.shared.plan
    }

    /// The arena (to share it, or to map a handle).
    pub fn arena(&self) -> &Arc<dyn ArenaMemory> {
        &self.shared.arena
    }

    /// Counters so far.
    pub fn stats(&self) -> TrunkStats {
        self.shared.lock().stats
    }

    /// Bytes of the reads behind the units served so far, each counted when the unit it
    /// loaded is first acquired. Unlike `stats().bytes_read` (counted when a read lands),
    /// the difference over a pass is exactly what that pass used: the ring reads the next
    /// pass's first streamed unit as soon as a slot frees, which lands between passes.
    pub fn served_bytes(&self) -> u64 {
        self.shared.lock().served_bytes
    }

    /// Wait until `layer` is in memory; its bytes stay valid until [`release`](Self::release).
    pub fn acquire(&self, layer: usize) -> Result<LayerHandle, LoadError> {
        let sh = &*self.shared;
        let p = sh.plan;
        if layer >= p.layers {
            return Err(LoadError::NoSuchLayer {
                layer,
                layers: p.layers,
            });
        }
        let u = &sh.units[layer];
        let head = u.pieces.first().map_or(0, |p| p.offset % ALIGN as u64);
        let len = match u.pieces.as_slice() {
            [one] => one.len,
            _ => u.footprint() - head,
        };
        let t0 = Instant::now();
        let mut st = sh.lock();
        if layer < p.pinned {
            loop {
                match &st.pinned[layer] {
                    Loaded::Yes => break,
                    Loaded::Failed(w) => {
                        return Err(LoadError::Read {
                            layer,
                            why: w.clone(),
                        })
                    }
                    Loaded::No => {}
                }
                if st.stop {
                    return Err(LoadError::Stopped);
                }
                st = sh.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            let hit = st.pinned_used[layer];
            st.pinned_used[layer] = true;
            if !hit {
                st.served_bytes += st.pinned_bytes[layer];
            }
            st.stats.binds += 1;
            st.stats.hits += hit as u64;
            st.stats.wait_seconds += t0.elapsed().as_secs_f64();
            return Ok(LayerHandle {
                layer,
                arena_offset: sh.pinned_at[layer] + head,
                len,
                hit,
            });
        }
        if layer != st.next_consume {
            return Err(LoadError::OutOfOrder {
                layer,
                expected: st.next_consume,
            });
        }
        let started = st.ring.entries.iter().any(|s| s.layer == Some(layer));
        if layer == p.pinned && !started && st.wrap_closed() {
            // The consumer wants the held unit: its pass has started, opened or not.
            st.opened = st.wraps + 1;
            sh.cv.notify_all();
        }
        loop {
            if let Some(i) = st.ring.find(layer, false) {
                let at = st.ring.entries[i].at;
                match &st.ring.entries[i].loaded {
                    Loaded::Yes => {
                        st.ring.entries[i].acquired = true;
                        st.served_bytes += std::mem::take(&mut st.ring.entries[i].bytes);
                        st.next_consume = sh.next_streamed(layer);
                        st.stats.binds += 1;
                        st.stats.wait_seconds += t0.elapsed().as_secs_f64();
                        return Ok(LayerHandle {
                            layer,
                            arena_offset: sh.ring_at + at + head,
                            len,
                            hit: false,
                        });
                    }
                    Loaded::Failed(w) => {
                        // Give the slot back so the stream can go on, and move past the layer.
                        let why = w.clone();
                        st.ring.entries[i].layer = None;
                        st.next_consume = sh.next_streamed(layer);
                        st.stats.binds += 1;
                        drop(st);
                        sh.cv.notify_all();
                        return Err(LoadError::Read { layer, why });
                    }
                    Loaded::No => {}
                }
            }
            if st.stop {
                return Err(LoadError::Stopped);
            }
            st = sh.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Give a streamed layer's slot back (a no-op for pinned layers).
    pub fn release(&self, layer: usize) -> Result<(), LoadError> {
        let sh = &*self.shared;
        if layer < sh.plan.pinned {
            return Ok(());
        }
        let mut st = sh.lock();
        let Some(i) = st.ring.find(layer, true) else {
            return Err(LoadError::NotAcquired { layer });
        };
        st.ring.entries[i].layer = None;
        drop(st);
        sh.cv.notify_all();
        Ok(())
    }

    /// The bytes of an acquired layer.
    ///
    /// # Safety
    /// `h` must come from [`acquire`](Self::acquire) on this loader, and the slice must not be
    /// used after `release(h.layer)` (the reader then reuses the slot).
    pub unsafe fn bytes(&self, h: &LayerHandle) -> &[u8] {
        // SAFETY: the caller guarantees the handle is live; handles lie inside the arena.
        unsafe {
            std::slice::from_raw_parts(
                self.shared.arena.base().add(h.arena_offset as usize) as *const u8,
                h.len as usize,
            )
        }
    }

    /// Acquire `layer` and hold it until the guard is dropped.
    pub fn layer(&self, layer: usize) -> Result<LayerGuard<'_>, LoadError> {
        let handle = self.acquire(layer)?;
        Ok(LayerGuard {
            loader: self,
            handle,
        })
    }

    /// The seed-style report block.
    pub fn render_stats(&self) -> String {
        let s = self.stats();
        format!(
            "trunk [final]\n  pinned {}/{} layers, ring {} slots of {:.2} GB\n  \
             binds {}, hits {} ({:.1}%, deterministic)\n  read {:.2} GB in {:.2} s ({:.0} MB/s), \
             waited {:.2} s\n",
            s.pinned,
            s.layers,
            s.ring_slots,
            s.slot_bytes as f64 / 1e9,
            s.binds,
            s.hits,
            100.0 * s.hit_rate(),
            s.bytes_read as f64 / 1e9,
            s.io_seconds,
            s.mb_per_s(),
            s.wait_seconds
        )
    }
}

impl Drop for TrunkLoader {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An acquired layer; derefs to its bytes and releases it when dropped.
pub struct LayerGuard<'a> {
    loader: &'a TrunkLoader,
    handle: LayerHandle,
}

impl LayerGuard<'_> {
    /// Where the bytes are.
    pub fn handle(&self) -> LayerHandle {
        self.handle
    }
}

impl std::ops::Deref for LayerGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the handle came from `acquire` and is released only when the guard drops,
        // which the borrow of `self` outlives.
        unsafe { self.loader.bytes(&self.handle) }
    }
}

impl Drop for LayerGuard<'_> {
    fn drop(&mut self) {
        let _ = self.loader.release(self.handle.layer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use k3_io::MemFile as Mem;

    /// A file in memory that logs the offset of every read.
    struct Logged(Mem, Mutex<Vec<u64>>);

    impl ReadAt for Logged {
        fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> std::io::Result<usize> {
            self.1.lock().unwrap().push(offset);
            self.0.read_at(file, offset, dst)
        }
    }

    /// Three one-page layers, layer 0 pinned, one ring slot for layers 1 and 2; returns the
    /// loader and the read log.
    fn ring_of_three(hold: bool) -> (TrunkLoader, Arc<Logged>) {
        let page = ALIGN as u64;
        let runs: Vec<LayerRun> = (0..3)
            .map(|l| LayerRun {
                offset: l * page,
                len: page,
            })
            .collect();
        let log = Arc::new(Logged(Mem(vec![7u8; 3 * ALIGN]), Mutex::new(Vec::new())));
        let plan = crate::plan::plan(2 * page, &runs, crate::plan::RingPolicy::default()).unwrap();
        assert_eq!((plan.pinned, plan.ring_slots), (1, 1));
        let reader: Arc<dyn ReadAt> = log.clone();
        let loader = TrunkLoader::new(runs, plan, reader, 0).unwrap();
        loader.hold_wrap(hold);
        (loader, log)
    }

    fn reads_of(log: &Logged, offset: u64) -> usize {
        log.1
            .lock()
            .unwrap()
            .iter()
            .filter(|&&o| o == offset)
            .count()
    }

    /// One pass: open it, bind layer 0 (pinned), then stream 1 and 2 through the slot.
    fn pass(loader: &TrunkLoader) {
        loader.open_pass();
        for l in 0..3 {
            loader.acquire(l).unwrap();
            loader.release(l).unwrap();
        }
    }

    // With the hold, the next pass's first streamed layer is not read when the slot frees
    // at the end of a pass, only once that pass is opened; without it, at once. Catches a
    // hold that is ignored (the read happens between passes), an open that does not start
    // the read, and a consumer that never opens its pass left waiting forever.
    #[test]
    fn a_held_wrap_is_read_when_the_pass_opens() {
        let page = ALIGN as u64;
        let wait_for = |log: &Logged, n: usize| {
            let t0 = Instant::now();
            while reads_of(log, page) < n && t0.elapsed().as_secs() < 10 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            reads_of(log, page)
        };
        let (free, log) = ring_of_three(false);
        pass(&free);
        assert_eq!(
            wait_for(&log, 2),
            2,
            "without the hold the wrap is read at once"
        );
        let (held, log) = ring_of_three(true);
        pass(&held);
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(
            reads_of(&log, page),
            1,
            "the held wrap was read between passes"
        );
        held.open_pass();
        assert_eq!(
            wait_for(&log, 2),
            2,
            "opening the pass did not start the read"
        );
        for l in 0..3 {
            held.acquire(l).unwrap();
            held.release(l).unwrap();
        }
        // A consumer that asks for the held layer without opening its pass is served.
        held.acquire(0).unwrap();
        held.acquire(1).unwrap();
        assert_eq!(reads_of(&log, page), 3);
    }

    fn entry(layer: usize, at: u64, len: u64) -> RingSlot {
        RingSlot {
            layer: Some(layer),
            loaded: Loaded::Yes,
            acquired: false,
            bytes: 0,
            at,
            len,
        }
    }

    // One slot, first in, first out: a unit goes right after the newest, wraps to the start
    // when the end cannot hold it, waits while the older units hold the room, and a unit
    // released before an older one frees nothing until the older one goes. Catches a
    // placement that overlaps a held unit (after the wrap, or past the slot's end) and one
    // that waits for room that is free.
    #[test]
    fn one_slot_places_units_first_in_first_out() {
        let mut r = Ring::new(1, 100);
        assert_eq!(r.place(100), Some(0), "an empty ring holds a whole slot");
        r.entries.push_back(entry(1, 0, 60));
        assert_eq!(r.place(30), Some(60));
        assert_eq!(
            r.place(41),
            None,
            "60 + 41 passes the end; 41 > the 0 bytes before 60"
        );
        r.entries.push_back(entry(2, 60, 30));
        r.entries[0].layer = None; // unit 1 released
        assert_eq!(
            r.place(50),
            Some(0),
            "wraps into the 60 bytes unit 1 gave back"
        );
        assert_eq!(r.place(61), None);
        r.entries.push_back(entry(3, 0, 50));
        assert_eq!(
            r.place(10),
            Some(50),
            "after the wrap, up to the oldest (at 60)"
        );
        assert_eq!(r.place(11), None, "would overlap unit 2 at 60");
        r.entries[1].layer = None; // unit 3 released before unit 2
        assert_eq!(
            r.place(11),
            None,
            "unit 3's bytes stay counted while unit 2 is held"
        );
        r.entries[0].layer = None; // unit 2 released: only unit 3's entry is left, released
        assert_eq!(r.place(100), Some(0));
    }

    // Several slots: one unit a slot, never fewer units than slots. Catches the first in,
    // first out placement there (a 100-byte unit after a 50 and a 100 would wait).
    #[test]
    fn several_slots_hold_a_unit_each() {
        let mut r = Ring::new(2, 100);
        r.entries.push_back(entry(1, 0, 50));
        assert_eq!(r.place(100), Some(100));
        r.entries.push_back(entry(2, 100, 100));
        assert_eq!(r.place(10), None);
        r.entries[0].layer = None;
        assert_eq!(r.place(100), Some(0));
    }

    // A one-slot ring reads the next small unit while the consumer holds one: units 1 and
    // 2 (a page each) share the two-page slot of unit 3 (two pages). Unit 2 is read while
    // unit 1 is held, and unit 3 only once both are given back; every unit serves its own
    // bytes. Catches whole-slot behaviour (unit 2 read only after unit 1's release) and a
    // unit read over one still held (its bytes would change under the consumer).
    #[test]
    fn one_slot_reads_a_small_unit_beside_a_held_one() {
        let page = ALIGN as u64;
        let lens = [page, page, page, 2 * page];
        let mut offset = 0;
        let runs: Vec<LayerRun> = lens
            .iter()
            .map(|&len| {
                let r = LayerRun { offset, len };
                offset += len;
                r
            })
            .collect();
        let bytes: Vec<u8> = (0..offset).map(|i| (i / page) as u8 + 1).collect();
        let log = Arc::new(Logged(Mem(bytes), Mutex::new(Vec::new())));
        let plan = TrunkPlan {
            layers: 4,
            pinned: 1,
            pinned_bytes: page,
            ring_slots: 1,
            slot_bytes: 2 * page,
            budget: 3 * page,
            kept: 0,
            kept_bytes: 0,
        };
        let reader: Arc<dyn ReadAt> = log.clone();
        let loader = TrunkLoader::new(runs, plan, reader, 0).unwrap();
        let wait_for = |off: u64| {
            let t0 = Instant::now();
            while reads_of(&log, off) == 0 && t0.elapsed().as_secs() < 10 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            reads_of(&log, off)
        };
        let check = |g: &LayerGuard<'_>, first: u8, n: u64| {
            let want: Vec<u8> = (0..n * page).map(|i| first + (i / page) as u8).collect();
            assert!(
                g[..] == want[..],
                "unit starting with {first} served other bytes"
            );
        };
        let one = loader.layer(1).unwrap();
        check(&one, 2, 1);
        assert_eq!(wait_for(2 * page), 1, "unit 2 was not read beside unit 1");
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(
            reads_of(&log, 3 * page),
            0,
            "unit 3 was read over a held unit"
        );
        drop(one);
        let two = loader.layer(2).unwrap();
        check(&two, 3, 1);
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(reads_of(&log, 3 * page), 0, "unit 3 was read over unit 2");
        drop(two);
        let three = loader.layer(3).unwrap();
        check(&three, 4, 2);
    }

    // Pieces land at their own offsets, in parallel, and a file ending inside the last
    // piece gives the short count. Catches a piece written to the wrong place (a shifted
    // or swapped chunk), a lost last partial piece, and a count past the end of the file.
    #[test]
    fn parallel_reads_fill_every_piece_in_place() {
        let len = 3 * READ_CHUNK + 12_345;
        let data: Vec<u8> = (0..len as u64)
            .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
            .collect();
        let m = Mem(data.clone());
        let mut dst = vec![0u8; len];
        assert_eq!(read_parallel(&m, 0, 0, &mut dst, None).unwrap(), len);
        assert!(dst == data);
        // From an offset, with the file ending 100 bytes into the last piece.
        let off = 4096u64;
        let mut dst = vec![0u8; 2 * READ_CHUNK + 8192];
        let got = read_parallel(
            &Mem(data[..(off as usize + 2 * READ_CHUNK + 100)].to_vec()),
            0,
            off,
            &mut dst,
            None,
        )
        .unwrap();
        assert_eq!(got, 2 * READ_CHUNK + 100);
        assert!(dst[..got] == data[off as usize..off as usize + got]);
        // Small reads go straight through.
        let mut small = vec![0u8; 5000];
        assert_eq!(read_parallel(&m, 0, 10, &mut small, None).unwrap(), 5000);
        assert!(small[..] == data[10..5010]);
    }
}
