//! A coded trunk (`pack-trunk --codec NAME`): encoding a layer's run into independently
//! decodable chunks, checking a coded manifest, and [`CodedReader`], a [`ReadAt`] that
//! serves the raw `trunk.bin` bytes a raw trunk would hold by reading the stored chunks and
//! decoding them, chunk by chunk, straight into the caller's buffer.
//!
//! The trunk-loader reads a coded trunk through a [`CodedReader`] exactly as it reads a raw
//! one (same offsets, same slots, same per-MiB CRCs on the decoded bytes), so compute sees
//! the same bytes in its ring; the decoding runs in the loader's reader threads. Every
//! chunk's stored bytes are checked against their CRC-32C before decoding and the decoded
//! bytes against theirs after: damage is an error that names the layer and the chunk.
//!
//! Layers kept coded in memory ([`CodedReader::keep_layers`], `--trunk-resident`) have
//! their stored runs read once into the loader's arena; their chunks are then decoded from
//! there on every use, never read again, with the same two checks at decode time.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use k3_io::arena::{ArenaMemory, OwnedArena};
use k3_io::direct::ReadAt;

use crate::codec::{encode_with, Codec, CodecError, Decoder, Effort};
use crate::trunk::{
    align_up, hex_sha256, plain_file_name, CodedChunk, CodedHead, CodedLayer, TrunkCodec,
    TrunkManifest, CODEC_CHUNK,
};

/// One chunk's encoding, as a coding thread leaves it.
type EncodedChunk = Result<Vec<u8>, CodecError>;

/// Encode one layer's run with the entropy coder searching at `effort`, its chunks spread
/// over every core: its stored bytes (every chunk on an `align` boundary, zero padded to a
/// multiple of `align`) and its [`CodedLayer`] (with `offset` 0: the caller places it).
pub fn encode_run(
    codec: Codec,
    layer: usize,
    raw: &[u8],
    align: u64,
    effort: Effort,
) -> Result<(Vec<u8>, CodedLayer), CodecError> {
    let pieces: Vec<&[u8]> = raw.chunks(CODEC_CHUNK as usize).collect();
    let (out, chunks) = encode_pieces(codec, &pieces, align, effort)?;
    let stored_length = chunks.last().map(|c| c.offset + c.stored).unwrap_or(0);
    let padded_length = out.len() as u64;
    Ok((
        out,
        CodedLayer {
            layer,
            offset: 0,
            stored_length,
            padded_length,
            chunks,
        },
    ))
}

/// Rows of `row` bytes per coded lm_head chunk: as many as [`CODEC_CHUNK`] holds (at least
/// one, and at most `max_bytes` of them when that is smaller: tests code small heads in
/// several chunks).
pub fn head_chunk_rows(row: u64, max_bytes: u64) -> u64 {
    (max_bytes.min(CODEC_CHUNK) / row.max(1)).max(1)
}

/// Encode rows `[r0, r0 + raw.len() / row)` of an lm_head (`raw`: whole rows of `row`
/// bytes, `r0` a multiple of `chunk_rows`) in chunks of `chunk_rows` rows, on every core:
/// their stored bytes (each chunk on an `align` boundary, the end padded to one) and their
/// chunks, offsets relative to the start of the returned bytes.
pub fn encode_head_rows(
    codec: Codec,
    raw: &[u8],
    row: u64,
    chunk_rows: u64,
    align: u64,
    effort: Effort,
) -> Result<(Vec<u8>, Vec<CodedChunk>), CodecError> {
    if row == 0 || chunk_rows == 0 || !(raw.len() as u64).is_multiple_of(row) {
        return Err(CodecError::Encode(format!(
            "{} bytes are not whole rows of {row} bytes",
            raw.len()
        )));
    }
    let pieces: Vec<&[u8]> = raw.chunks((chunk_rows * row) as usize).collect();
    encode_pieces(codec, &pieces, align, effort)
}

/// Encode `pieces`, one chunk each, spread over every core: the stored bytes (each chunk on
/// an `align` boundary, the end zero padded to a multiple of `align`) and the chunks.
fn encode_pieces(
    codec: Codec,
    pieces: &[&[u8]],
    align: u64,
    effort: Effort,
) -> Result<(Vec<u8>, Vec<CodedChunk>), CodecError> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(pieces.len().max(1));
    let next = AtomicU64::new(0);
    let slots: Vec<Mutex<Option<EncodedChunk>>> = pieces.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(c) = pieces.get(i) else { return };
                let z = encode_with(codec, c, effort);
                *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(z);
            });
        }
    });
    let mut out = Vec::new();
    let mut chunks = Vec::new();
    for (c, slot) in pieces.iter().zip(slots) {
        let z = slot
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .ok_or_else(|| CodecError::Encode("a coding thread stopped".into()))??;
        let at = out.len() as u64;
        chunks.push(CodedChunk {
            offset: at,
            stored: z.len() as u64,
            raw: c.len() as u64,
            crc32_stored: crc32c::crc32c(&z),
            crc32_raw: crc32c::crc32c(c),
        });
        out.extend_from_slice(&z);
        out.resize(align_up(out.len() as u64, align) as usize, 0);
    }
    Ok((out, chunks))
}

/// What a coded chunk belongs to: a trunk layer's run or the coded lm_head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Layer(usize),
    Head,
}

impl From<usize> for Unit {
    fn from(layer: usize) -> Unit {
        Unit::Layer(layer)
    }
}

impl std::fmt::Display for Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unit::Layer(l) => write!(f, "trunk layer {l}"),
            Unit::Head => write!(f, "coded lm_head"),
        }
    }
}

/// A chunk that is not what was packed.
#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    #[error("{unit} chunk {chunk}: the stored bytes fail their CRC-32C (damaged on disk or in transfer)")]
    Stored { unit: Unit, chunk: usize },
    #[error("{unit} chunk {chunk}: {source}")]
    Decode {
        unit: Unit,
        chunk: usize,
        #[source]
        source: CodecError,
    },
    #[error("{unit} chunk {chunk}: the decoded bytes fail their CRC-32C")]
    Decoded { unit: Unit, chunk: usize },
}

/// Check chunk `chunk` of `unit`'s stored bytes against their CRC-32C.
pub fn check_stored(
    unit: impl Into<Unit>,
    chunk: usize,
    ch: &CodedChunk,
    stored: &[u8],
) -> Result<(), ChunkError> {
    if crc32c::crc32c(stored) != ch.crc32_stored {
        return Err(ChunkError::Stored {
            unit: unit.into(),
            chunk,
        });
    }
    Ok(())
}

/// Check chunk `chunk` of `unit` (its stored bytes `stored`) and decode it into `out`
/// (`ch.raw` bytes) with `dec` (the caller's, reused from chunk to chunk).
pub fn decode_chunk(
    dec: &mut Decoder,
    codec: Codec,
    unit: impl Into<Unit>,
    chunk: usize,
    ch: &CodedChunk,
    stored: &[u8],
    out: &mut [u8],
) -> Result<(), ChunkError> {
    let unit = unit.into();
    check_stored(unit, chunk, ch, stored)?;
    dec.decode(codec, stored, out)
        .map_err(|source| ChunkError::Decode {
            unit,
            chunk,
            source,
        })?;
    if crc32c::crc32c(out) != ch.crc32_raw {
        return Err(ChunkError::Decoded { unit, chunk });
    }
    Ok(())
}

/// Every inconsistency of `c`, the codec of manifest `m`, appended to `p`.
pub(crate) fn codec_problems(m: &TrunkManifest, c: &TrunkCodec, p: &mut Vec<String>) {
    if Codec::from_name(&c.name).is_none() {
        p.push(format!(
            "codec {:?}: this build decodes {}",
            c.name,
            Codec::NAMES.join(", ")
        ));
    }
    if c.chunk != CODEC_CHUNK {
        p.push(format!("codec chunk {} is not {CODEC_CHUNK}", c.chunk));
    }
    if !plain_file_name(&c.file) || c.file == m.file {
        p.push(format!(
            "codec file {:?} is not a plain file name of its own",
            c.file
        ));
    }
    if c.layers.len() != m.layers.len() {
        p.push(format!(
            "codec: {} layers, the trunk has {}",
            c.layers.len(),
            m.layers.len()
        ));
    }
    let (mut end, mut stored) = (0u64, 0u64);
    for (cl, l) in c.layers.iter().zip(&m.layers) {
        let who = format!("codec layer {}", cl.layer);
        if cl.layer != l.layer {
            p.push(format!("{who} is listed for layer {}", l.layer));
        }
        if cl.offset % m.align != 0 || cl.offset < end {
            p.push(format!(
                "{who}: offset {} is unaligned or overlaps",
                cl.offset
            ));
        }
        if Some(cl.padded_length) != cl.stored_length.checked_next_multiple_of(m.align) {
            p.push(format!(
                "{who}: padded_length is not stored_length aligned up"
            ));
        }
        end = cl.offset.checked_add(cl.padded_length).unwrap_or_else(|| {
            p.push(format!("{who}: offset + padded_length overflows 64 bits"));
            u64::MAX
        });
        if cl.chunks.len() as u64 != l.length.div_ceil(CODEC_CHUNK) {
            p.push(format!(
                "{who}: {} chunks, its {} bytes need {}",
                cl.chunks.len(),
                l.length,
                l.length.div_ceil(CODEC_CHUNK)
            ));
        }
        let raw = |i: u64| CODEC_CHUNK.min(l.length.saturating_sub(i * CODEC_CHUNK));
        let (at, run_stored) = chunk_problems(&cl.chunks, m.align, raw, &who, p);
        stored = stored.saturating_add(run_stored);
        if at != cl.stored_length {
            p.push(format!(
                "{who}: stored_length {} is not {at}",
                cl.stored_length
            ));
        }
    }
    if end != c.file_size {
        p.push(format!("codec file_size {} is not {end}", c.file_size));
    }
    if let Some(h) = &c.head {
        head_problems(m, c, h, p);
    }
    if stored != c.stored_bytes {
        p.push(format!(
            "codec stored_bytes {} is not {stored}",
            c.stored_bytes
        ));
    }
}

/// Every misplaced chunk of a run of `chunks` (each on an `align` boundary, none before the
/// end of the one before it, chunk `i` decoding to `raw(i)` bytes), appended to `p` under
/// `who`. Returns the end of the last chunk's stored bytes and the sum of their stored
/// bytes (both saturating: a run past 2^64 cannot match the lengths it is checked against).
fn chunk_problems(
    chunks: &[CodedChunk],
    align: u64,
    raw: impl Fn(u64) -> u64,
    who: &str,
    p: &mut Vec<String>,
) -> (u64, u64) {
    let (mut at, mut stored) = (0u64, 0u64);
    for (i, ch) in chunks.iter().enumerate() {
        if ch.raw != raw(i as u64) || ch.offset % align != 0 || ch.offset < at {
            p.push(format!(
                "{who}: chunk {i} is misplaced or of the wrong size"
            ));
        }
        at = ch.offset.saturating_add(ch.stored);
        stored = stored.saturating_add(ch.stored);
    }
    (at, stored)
}

/// Every inconsistency of `h`, the coded lm_head of codec `c` of manifest `m`.
fn head_problems(m: &TrunkManifest, c: &TrunkCodec, h: &CodedHead, p: &mut Vec<String>) {
    if !plain_file_name(&h.file) || h.file == m.file || h.file == c.file {
        p.push(format!(
            "codec head file {:?} is not a plain file name of its own",
            h.file
        ));
    }
    if h.tensor != crate::classify::LM_HEAD {
        p.push(format!(
            "codec head tensor {:?} is not the lm_head",
            h.tensor
        ));
    }
    let row = h.row_bytes();
    if h.dtype != crate::tensor::Dtype::BF16 || h.shape.len() != 2 || row == 0 {
        p.push(format!(
            "codec head: {} {:?} is not a BF16 matrix",
            h.dtype, h.shape
        ));
        return;
    }
    if h.chunk_rows == 0 || h.chunk_rows.saturating_mul(row) > CODEC_CHUNK {
        p.push(format!(
            "codec head: {} rows per chunk of {row} bytes is not 1 to {CODEC_CHUNK} bytes",
            h.chunk_rows
        ));
        return;
    }
    let rows = h.rows();
    if h.chunks.len() as u64 != rows.div_ceil(h.chunk_rows) {
        p.push(format!(
            "codec head: {} chunks, its {rows} rows need {}",
            h.chunks.len(),
            rows.div_ceil(h.chunk_rows)
        ));
    }
    if !hex_sha256(&h.sha256) {
        p.push("codec head: sha256 is not 64 hex digits".into());
    }
    let raw = |i: u64| h.chunk_rows.min(rows.saturating_sub(i * h.chunk_rows)) * row;
    let (at, stored) = chunk_problems(&h.chunks, m.align, raw, "codec head", p);
    if at.checked_next_multiple_of(m.align) != Some(h.file_size) {
        p.push(format!(
            "codec head file_size {} is not the end of its last chunk ({at}) aligned up",
            h.file_size
        ));
    }
    if stored != h.stored_bytes {
        p.push(format!(
            "codec head stored_bytes {} is not {stored}",
            h.stored_bytes
        ));
    }
}

/// What one reader thread decodes a chunk with.
struct Scratch {
    /// An aligned buffer for one chunk's stored bytes.
    stored: OwnedArena,
    /// A chunk decoded only in part (a piece that starts or ends inside it).
    raw: Vec<u8>,
    /// The zstd context and the exponent plane's buffer.
    dec: Decoder,
}

/// A [`ReadAt`] over the raw layout of a coded trunk (file 0: the raw `trunk.bin` the
/// manifest describes), reading file `file` of `inner` (the stored file) and decoding.
pub struct CodedReader {
    inner: Arc<dyn ReadAt>,
    file: u32,
    codec: Codec,
    manifest: TrunkManifest,
    /// One reader thread's decoding state each, reused from chunk to chunk and layer to
    /// layer (at most one per reader thread in flight: the loader's reads spawn their
    /// threads per read, so a thread's own state would die with it).
    scratch: Mutex<Vec<Scratch>>,
    /// [`Scratch`]es created so far (the most reader threads ever in flight at once).
    scratch_made: AtomicU64,
    /// The largest chunk's stored bytes, aligned up.
    stored_cap: usize,
    stored_read: AtomicU64,
    decoded: AtomicU64,
    /// The layers kept coded in memory ([`CodedReader::keep_layers`]).
    kept: Option<Kept>,
    /// Stored bytes decoded from memory (kept layers) rather than read.
    stored_kept: AtomicU64,
}

/// Stored runs kept in memory: layer `li`'s at byte `at[li]` of `mem` (None: read from
/// the file).
struct Kept {
    mem: Arc<dyn ArenaMemory>,
    at: Vec<Option<u64>>,
}

impl CodedReader {
    /// Over a coded manifest (`None` for a raw one).
    pub fn new(m: &TrunkManifest, inner: Arc<dyn ReadAt>, file: u32) -> Option<CodedReader> {
        let c = m.codec.as_ref()?;
        let codec = Codec::from_name(&c.name)?;
        let stored_cap = c
            .layers
            .iter()
            .flat_map(|l| &l.chunks)
            .map(|ch| align_up(ch.stored, m.align))
            .max()
            .unwrap_or(0) as usize;
        Some(CodedReader {
            inner,
            file,
            codec,
            manifest: m.clone(),
            scratch: Mutex::new(Vec::new()),
            scratch_made: AtomicU64::new(0),
            stored_cap,
            stored_read: AtomicU64::new(0),
            decoded: AtomicU64::new(0),
            kept: None,
            stored_kept: AtomicU64::new(0),
        })
    }

    /// Keep the stored runs of `layers` (indices into the manifest's layers) in `mem`, back
    /// to back from byte `at`, each its `padded_length` (`at` and the runs page-aligned, so
    /// the reads stay O_DIRECT): they are read now, once, and from then on those layers'
    /// chunks are decoded from memory (the stored and decoded CRCs still checked at each
    /// decode). Call before the reader is shared. Returns the bytes kept.
    pub fn keep_layers(
        &mut self,
        layers: &[usize],
        mem: Arc<dyn ArenaMemory>,
        at: u64,
    ) -> io::Result<u64> {
        let c = self
            .manifest
            .codec
            .as_ref()
            .ok_or_else(|| io::Error::other("not coded"))?;
        let mut where_ = vec![None; c.layers.len()];
        let mut pos = at;
        for &li in layers {
            let cl = c
                .layers
                .get(li)
                .ok_or_else(|| io::Error::other(format!("no trunk layer {li} to keep coded")))?;
            let end = pos.saturating_add(cl.padded_length);
            if end > mem.len() as u64 || where_[li].is_some() {
                return Err(io::Error::other(format!(
                    "trunk layer {}: {} stored bytes do not fit at byte {pos} of the \
                     {}-byte arena (or the layer is kept twice)",
                    cl.layer,
                    cl.padded_length,
                    mem.len()
                )));
            }
            // SAFETY: [pos, end) lies inside `mem` (checked above) and inside no other kept
            // run (each starts where the last ended); the reader is not shared yet
            // (`&mut self`) and the caller hands the arena to no one before this returns,
            // so nothing else reads or writes these bytes.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    mem.base().add(pos as usize),
                    cl.padded_length as usize,
                )
            };
            let none = |_: usize, _: &[u8]| Ok::<(), std::convert::Infallible>(());
            let got = k3_io::direct::read_parallel(&*self.inner, self.file, cl.offset, dst, &none)
                .map_err(|e| io::Error::other(format!("trunk layer {}: {e}", cl.layer)))?;
            if (got as u64) < cl.stored_length {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("trunk layer {}: the stored file ends early", cl.layer),
                ));
            }
            where_[li] = Some(pos);
            pos = end;
        }
        self.kept = Some(Kept { mem, at: where_ });
        Ok(pos - at)
    }

    /// Stored bytes decoded from memory so far (the kept layers' chunks: no read).
    pub fn stored_bytes_kept(&self) -> u64 {
        self.stored_kept.load(Ordering::Relaxed)
    }

    /// Decode buffers one reader thread holds at most: one chunk's stored bytes and one
    /// chunk decoded (a partly covered chunk), plus the codec's own plane buffer.
    pub fn buffer_bytes_per_thread(m: &TrunkManifest) -> u64 {
        match &m.codec {
            None => 0,
            Some(c) => {
                let stored = c
                    .layers
                    .iter()
                    .flat_map(|l| &l.chunks)
                    .map(|ch| align_up(ch.stored, m.align))
                    .max()
                    .unwrap_or(0);
                stored + c.chunk + c.chunk / 2
            }
        }
    }

    /// Stored bytes read so far to decode them (what the disk delivered; the kept layers'
    /// one read at load is not counted: it is their kept bytes).
    pub fn stored_bytes_read(&self) -> u64 {
        self.stored_read.load(Ordering::Relaxed)
    }

    /// Decoded bytes produced so far (what the loader received).
    pub fn decoded_bytes(&self) -> u64 {
        self.decoded.load(Ordering::Relaxed)
    }

    /// Decoders (each with its chunk buffers) created so far: the most reader threads that
    /// were ever decoding at once, however many chunks and layers they decoded.
    pub fn decoders_made(&self) -> u64 {
        self.scratch_made.load(Ordering::Relaxed)
    }

    fn take_scratch(&self) -> io::Result<Scratch> {
        let pooled = self.scratch.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match pooled {
            Some(s) => Ok(s),
            None => {
                let stored = OwnedArena::new(self.stored_cap.max(4096))
                    .map_err(|e| io::Error::other(e.to_string()))?;
                self.scratch_made.fetch_add(1, Ordering::Relaxed);
                Ok(Scratch {
                    stored,
                    raw: Vec::new(),
                    dec: Decoder::new(),
                })
            }
        }
    }

    /// Decode chunk `k` of layer `li` and copy its bytes `[from, from + dst.len())` into
    /// `dst` (straight into `dst` when the whole chunk is wanted).
    fn chunk_into(&self, li: usize, k: usize, from: usize, dst: &mut [u8]) -> io::Result<()> {
        let mut sc = self.take_scratch()?;
        let res = self.chunk_with(&mut sc, li, k, from, dst);
        self.scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(sc);
        res
    }

    fn chunk_with(
        &self,
        sc: &mut Scratch,
        li: usize,
        k: usize,
        from: usize,
        dst: &mut [u8],
    ) -> io::Result<()> {
        let c = self
            .manifest
            .codec
            .as_ref()
            .ok_or_else(|| io::Error::other("not coded"))?;
        let cl = &c.layers[li];
        let ch = &cl.chunks[k];
        let Scratch { stored, raw, dec } = sc;
        let stored = match self.kept.as_ref().and_then(|kp| Some((kp, kp.at[li]?))) {
            Some((kp, at)) => self.kept_stored(kp, at, cl, k)?,
            None => self.read_stored(stored, li, k, cl)?,
        };
        let bad = |e: ChunkError| io::Error::new(io::ErrorKind::InvalidData, e.to_string());
        if from == 0 && dst.len() as u64 == ch.raw {
            return decode_chunk(dec, self.codec, cl.layer, k, ch, stored, dst).map_err(bad);
        }
        raw.resize(ch.raw as usize, 0);
        decode_chunk(dec, self.codec, cl.layer, k, ch, stored, raw).map_err(bad)?;
        dst.copy_from_slice(&raw[from..from + dst.len()]);
        Ok(())
    }

    /// Chunk `k` of layer `li` (`cl`) read from the file into `buf`: its stored bytes.
    fn read_stored<'b>(
        &self,
        buf: &'b mut OwnedArena,
        li: usize,
        k: usize,
        cl: &CodedLayer,
    ) -> io::Result<&'b [u8]> {
        let ch = &cl.chunks[k];
        let span = align_up(ch.stored, self.manifest.align) as usize;
        let sb = buf.as_mut_slice().get_mut(..span).ok_or_else(|| {
            io::Error::other(format!(
                "trunk layer {li} chunk {k}: larger than its buffer"
            ))
        })?;
        let got = self.inner.read_at(self.file, cl.offset + ch.offset, sb)?;
        if (got as u64) < ch.stored {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("trunk layer {li} chunk {k}: the stored file ends early"),
            ));
        }
        self.stored_read.fetch_add(ch.stored, Ordering::Relaxed);
        Ok(&sb[..ch.stored as usize])
    }

    /// Chunk `k` of a kept layer (`cl`, its run at byte `at` of the kept memory): its stored
    /// bytes, in memory, decoded as [`CodedReader::chunk_with`] decodes a chunk it read.
    fn kept_stored<'k>(
        &self,
        kp: &'k Kept,
        at: u64,
        cl: &CodedLayer,
        k: usize,
    ) -> io::Result<&'k [u8]> {
        let ch = &cl.chunks[k];
        if ch.offset.saturating_add(ch.stored) > cl.padded_length {
            return Err(io::Error::other(format!(
                "trunk layer {} chunk {k}: outside its kept run",
                cl.layer
            )));
        }
        // SAFETY: the chunk lies inside the layer's kept run (checked above), which
        // `keep_layers` placed inside the arena and filled before the reader was shared;
        // nothing writes a kept run after that (the loader never places a slot over it, and
        // compute maps the arena read-only), so shared reads are sound.
        let stored = unsafe {
            std::slice::from_raw_parts(
                kp.mem.base().add((at + ch.offset) as usize) as *const u8,
                ch.stored as usize,
            )
        };
        self.stored_kept.fetch_add(ch.stored, Ordering::Relaxed);
        Ok(stored)
    }
}

impl ReadAt for CodedReader {
    /// The stored file's copies (`--trunk DIR,COPY`).
    fn copies(&self) -> u32 {
        self.inner.copies()
    }

    fn next_copy(&self) {
        self.inner.next_copy()
    }

    /// The raw trunk's bytes at `offset`: decoded runs, zero padding; short only at the
    /// raw file's end.
    fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        if file != 0 {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no file number {file}"),
            ));
        }
        let end = offset
            .saturating_add(dst.len() as u64)
            .min(self.manifest.file_size);
        let n = end.saturating_sub(offset) as usize;
        let dst = &mut dst[..n];
        dst.fill(0);
        for (li, l) in self.manifest.layers.iter().enumerate() {
            let (lo, hi) = (offset.max(l.offset), end.min(l.offset + l.length));
            if lo >= hi {
                continue;
            }
            let first = ((lo - l.offset) / CODEC_CHUNK) as usize;
            let last = ((hi - 1 - l.offset) / CODEC_CHUNK) as usize;
            for k in first..=last {
                let c0 = l.offset + k as u64 * CODEC_CHUNK;
                let (a, b) = (lo.max(c0), hi.min(c0 + CODEC_CHUNK));
                let out = &mut dst[(a - offset) as usize..(b - offset) as usize];
                self.chunk_into(li, k, (a - c0) as usize, out)?;
                self.decoded.fetch_add(b - a, Ordering::Relaxed);
            }
        }
        Ok(n)
    }
}
