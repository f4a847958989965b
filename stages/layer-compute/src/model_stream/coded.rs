//! A streamed lm_head read from its coded copy (`pack-trunk --codec`: `lm_head.k3z`,
//! [`CodedHead`]), in three stages that run at once: while compute multiplies stream chunk
//! `i`, the chunks of stream chunk `i + 1` are decoded (on [`head_decoders`] threads, from
//! their stored bytes already in memory) and the stored bytes of stream chunk `i + 2` are
//! read (one span, `read_parallel`'s pieces in flight). A stream chunk is a whole number of
//! coded chunks, which hold whole rows, so every decoded byte lands once, in place.
//!
//! Each coded chunk's stored and decoded CRC-32C are checked (`decode_chunk`): damage is an
//! error naming the coded lm_head and the chunk.
//!
//! With copies of the trunk on other drives (`--trunk DIR,COPY,...`) the stored spans are
//! read spread over every copy's `lm_head.k3z` ([`k3_io::Spread`]), as the trunk-loader
//! reads the trunk: a piece whose read fails is read from another copy, and a stream chunk
//! whose coded chunks fail their check is read again from the other copies, once each,
//! before it is an error.
//!
//! Measured before this shape: four threads that each read one coded chunk and decoded it
//! took 0.83-1.10 s per token for the slice's lm_head, against 0.69-0.81 s to read it raw
//! (docs/measurements.md, "The coded lm_head").

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use k3_io::arena::{OwnedArena, ALIGN};
use k3_io::direct::ReadAt;
use k3_model::codec::{Codec, Decoder};
use k3_model::codec_trunk::{decode_chunk, Unit};
use k3_model::tensor::{Dtype, TensorRef, WeightError};
use k3_model::trunk::{CodedHead, TrunkManifest};

/// Threads that decode a stream chunk's coded chunks: every core (at most 8). While the
/// lm_head streams, compute only multiplies each chunk as it lands.
pub fn head_decoders() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 8))
}

/// Bytes compute holds beside the two chunk buffers to stream the coded lm_head `h` in
/// stream chunks of `chunk_bytes` (whole coded chunks: `head_stream_chunk_bytes`): two
/// buffers of a stream chunk's stored span and each decoder's exponent plane.
pub fn coded_head_buffer_bytes(h: &CodedHead, chunk_bytes: u64) -> u64 {
    coded_head_buffer_bound(max_stored(h), h.chunk_rows * h.row_bytes(), chunk_bytes)
}

/// [`coded_head_buffer_bytes`] of a coded lm_head whose largest chunk stores `max_stored`
/// bytes and decodes to `raw_chunk` (a projection's, before any lm_head is coded).
pub fn coded_head_buffer_bound(max_stored: u64, raw_chunk: u64, chunk_bytes: u64) -> u64 {
    let raw_chunk = raw_chunk.max(1);
    2 * span_bytes(max_stored, raw_chunk, chunk_bytes) + head_decoders() as u64 * raw_chunk / 2
}

/// The largest stored span of a stream chunk of `chunk_bytes`: its coded chunks' stored
/// bytes (each at most `max_stored`, decoding to `raw_chunk`), each aligned up (as they
/// lie in the file).
fn span_bytes(max_stored: u64, raw_chunk: u64, chunk_bytes: u64) -> u64 {
    let per = (chunk_bytes / raw_chunk.max(1)).max(1);
    per * max_stored.next_multiple_of(ALIGN as u64).max(ALIGN as u64)
}

/// The stored bytes of `h`'s largest chunk.
fn max_stored(h: &CodedHead) -> u64 {
    h.chunks.iter().map(|c| c.stored).max().unwrap_or(0)
}

/// A coded lm_head to stream from: the stored file and its copies on other drives, the
/// manifest's record of it, the codec.
pub struct CodedHeadFile {
    pub path: PathBuf,
    pub copies: Vec<PathBuf>,
    pub head: CodedHead,
    pub codec: Codec,
}

impl CodedHeadFile {
    /// The coded lm_head of the trunk in `dir`, with the same file in each of `copies`
    /// (copies of that trunk, checked against it when the run was planned); None: the trunk
    /// is raw or has none.
    pub fn of_trunk(dir: &Path, copies: &[PathBuf]) -> std::io::Result<Option<CodedHeadFile>> {
        let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
        let m = TrunkManifest::load_dir(dir).map_err(|e| bad(e.to_string()))?;
        let Some(c) = &m.codec else { return Ok(None) };
        let Some(h) = &c.head else { return Ok(None) };
        let codec = Codec::from_name(&c.name)
            .ok_or_else(|| bad(format!("codec {} is not one this build decodes", c.name)))?;
        Ok(Some(CodedHeadFile {
            path: dir.join(&h.file),
            copies: copies.iter().map(|c| c.join(&h.file)).collect(),
            head: h.clone(),
            codec,
        }))
    }
}

/// The matrix a coded lm_head must code: its name, dtype, rows and bytes per row.
pub(super) struct Shape<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub rows: usize,
    pub row_bytes: u64,
}

/// An open coded lm_head, its decoders and its stored-span buffers.
pub(super) struct Coded {
    /// The stored file, spread over its copies when there are any.
    files: std::sync::Arc<dyn ReadAt>,
    pub(super) head: CodedHead,
    codec: Codec,
    decoders: Mutex<Vec<Decoder>>,
    spans: Option<[OwnedArena; 2]>,
}

/// One stream chunk: its rows `[r0, r1)`.
type Rows = (usize, usize);

/// A coded chunk to decode (its index and its rows' bytes in the output), taken once.
type Job<'a> = Mutex<Option<(usize, &'a mut [u8])>>;

impl Coded {
    /// Open `c` for the checkpoint's lm_head `s`: refused unless it codes the same matrix.
    pub(super) fn open(s: &Shape<'_>, c: CodedHeadFile) -> std::io::Result<Coded> {
        let h = &c.head;
        if h.tensor != s.name
            || h.dtype != s.dtype
            || h.rows() != s.rows as u64
            || h.row_bytes() != s.row_bytes
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{}: the coded lm_head is {} {:?}, the checkpoint's {} is {} [{}, {}]",
                    c.path.display(),
                    h.dtype,
                    h.shape,
                    s.name,
                    s.dtype,
                    s.rows,
                    s.row_bytes / s.dtype.size().max(1) as u64
                ),
            ));
        }
        let paths: Vec<PathBuf> = std::iter::once(c.path).chain(c.copies).collect();
        Ok(Coded {
            files: k3_io::open_copies(&paths, "coded lm_head: trunk copy")?,
            head: c.head,
            codec: c.codec,
            decoders: Mutex::new(Vec::new()),
            spans: None,
        })
    }

    /// The stored span of the coded chunks of rows `r`: its file offset and aligned length.
    fn span(&self, r: Rows) -> (u64, usize) {
        let ks = self.head.chunks_of(r.0 as u64, r.1 as u64);
        let (a, b) = (&self.head.chunks[ks.start], &self.head.chunks[ks.end - 1]);
        let end = (b.offset + b.stored).next_multiple_of(ALIGN as u64);
        (a.offset, (end - a.offset) as usize)
    }

    /// Read the stored span of rows `r` into `buf`; its seconds.
    fn read_span(&self, r: Rows, buf: &mut OwnedArena) -> std::io::Result<f64> {
        let t = Instant::now();
        let (at, len) = self.span(r);
        let dst = buf.as_mut_slice().get_mut(..len).ok_or_else(|| {
            std::io::Error::other(format!(
                "coded lm_head rows {}..{}: {len} stored bytes exceed their buffer",
                r.0, r.1
            ))
        })?;
        let none = |_: usize, _: &[u8]| Ok::<(), std::convert::Infallible>(());
        let got = k3_io::direct::read_parallel(&*self.files, 0, at, dst, &none)
            .map_err(std::io::Error::other)?;
        if got < len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "coded lm_head rows {}..{}: the stored file ends early",
                    r.0, r.1
                ),
            ));
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Decode rows `r` from their stored span in `span` into `out`, the coded chunks
    /// spread over [`head_decoders`] threads.
    fn decode_span(&self, r: Rows, span: &[u8], out: &mut [u8]) -> std::io::Result<()> {
        let ks = self.head.chunks_of(r.0 as u64, r.1 as u64);
        let base = self.head.chunks[ks.start].offset;
        let per = (self.head.chunk_rows * self.head.row_bytes()) as usize;
        let want = (r.1 - r.0) * self.head.row_bytes() as usize;
        let jobs: Vec<Job<'_>> = ks
            .zip(out[..want].chunks_mut(per))
            .map(|j| Mutex::new(Some(j)))
            .collect();
        let next = AtomicUsize::new(0);
        let first_err = Mutex::new(None);
        let one = |k: usize, dst: &mut [u8]| -> std::io::Result<()> {
            let ch = &self.head.chunks[k];
            let o = (ch.offset - base) as usize;
            let stored = span.get(o..o + ch.stored as usize).ok_or_else(|| {
                std::io::Error::other(format!("coded lm_head chunk {k}: outside its span"))
            })?;
            let pooled = self
                .decoders
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop();
            let mut dec = pooled.unwrap_or_default();
            let res = decode_chunk(&mut dec, self.codec, Unit::Head, k, ch, stored, dst);
            self.decoders
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(dec);
            res.map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))
        };
        std::thread::scope(|s| {
            for _ in 0..head_decoders().min(jobs.len()) {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { return };
                    let taken = job.lock().unwrap_or_else(|p| p.into_inner()).take();
                    let Some((k, dst)) = taken else { continue };
                    if let Err(e) = one(k, dst) {
                        first_err
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
                        next.store(jobs.len(), Ordering::Relaxed);
                        return;
                    }
                });
            }
        });
        match first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Decode rows `r` from their stored span, read into `span` already, into `out`. When
    /// their coded chunks fail their check and the stored file has copies, the span is read
    /// again from the other copies (every piece from another copy than before), once each.
    fn decode_checked(
        &self,
        r: Rows,
        span: &mut OwnedArena,
        out: &mut OwnedArena,
    ) -> std::io::Result<()> {
        let len = self.span(r).1;
        let mut res = self.decode_span(r, &span.as_mut_slice()[..len], out.as_mut_slice());
        for _ in 1..self.files.copies() {
            match &res {
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => tracing::warn!(
                    "coded lm_head rows {}..{}: {e}; reading them again from the other trunk \
                     copies",
                    r.0,
                    r.1
                ),
                _ => break,
            }
            self.files.next_copy();
            self.read_span(r, span)?;
            res = self.decode_span(r, &span.as_mut_slice()[..len], out.as_mut_slice());
        }
        res
    }

    /// Stream rows `[start, rows)` in chunks of `step` rows (whole coded chunks) through
    /// `outs`, calling `f` on each decoded chunk; `held` (the leading `start` rows, held)
    /// is multiplied while the first span is read. Returns the stored bytes and the reads'
    /// seconds.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn stream(
        &mut self,
        name: &str,
        cols: usize,
        dtype: Dtype,
        (start, rows, step): (usize, usize, usize),
        outs: [&mut OwnedArena; 2],
        held: Option<&[u8]>,
        f: &mut dyn FnMut(usize, TensorRef<'_>) -> Result<(), WeightError>,
    ) -> Result<(u64, f64), WeightError> {
        let io = |e: std::io::Error| WeightError::Io {
            name: name.to_string(),
            msg: e.to_string(),
        };
        let chunks: Vec<Rows> = (start..rows)
            .step_by(step.max(1))
            .map(|r0| (r0, (r0 + step).min(rows)))
            .collect();
        let shape = [start, cols];
        let mut held = || match held {
            Some(bytes) => f(
                0,
                TensorRef {
                    dtype,
                    shape: &shape,
                    bytes,
                },
            ),
            None => Ok(()),
        };
        if chunks.is_empty() {
            held()?;
            return Ok((0, 0.0));
        }
        let mut spans = match self.spans.take() {
            Some(s) => s,
            None => {
                let h = &self.head;
                let raw_chunk = h.chunk_rows * h.row_bytes();
                let chunk = step as u64 * h.row_bytes();
                let cap = span_bytes(max_stored(h), raw_chunk, chunk) as usize;
                let a = OwnedArena::new(cap).and_then(|a| Ok([a, OwnedArena::new(cap)?]));
                a.map_err(|e| io(std::io::Error::other(format!("lm_head spans: {e}"))))?
            }
        };
        let first = std::thread::scope(|s| {
            let h = s.spawn(|| self.read_span(chunks[0], &mut spans[0]));
            (held(), h.join())
        });
        let res = match first {
            (Err(e), _) => Err(e),
            (Ok(()), r) => r
                .map_err(|_| io(panicked()))
                .and_then(|r| r.map_err(io))
                .and_then(|secs| {
                    let run = self.run(&chunks, cols, dtype, &mut spans, outs, f, &io);
                    run.map(|s| s + secs)
                }),
        };
        self.spans = Some(spans);
        let stored = self.head.stored_from(start as u64);
        res.map(|secs| (stored, secs))
    }

    /// [`Coded::stream`]'s pipeline over `chunks`, the first one's span read into
    /// `spans[0]` already: the reads' seconds.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        chunks: &[Rows],
        cols: usize,
        dtype: Dtype,
        spans: &mut [OwnedArena; 2],
        outs: [&mut OwnedArena; 2],
        f: &mut dyn FnMut(usize, TensorRef<'_>) -> Result<(), WeightError>,
        io: &dyn Fn(std::io::Error) -> WeightError,
    ) -> Result<f64, WeightError> {
        let [s0, s1] = spans;
        let [o0, o1] = outs;
        let (mut s_dec, mut s_read) = (s0, s1);
        let (mut o_cur, mut o_next) = (o0, o1);
        let mut secs = 0.0;
        // The first chunk decoded while the second span is read; then, each step,
        // chunk i multiplied while i + 1 is decoded and the span of i + 2 read.
        secs += self.step(chunks, 0, s_dec, s_read, o_cur, || Ok(()), io)?;
        std::mem::swap(&mut s_dec, &mut s_read);
        for (i, &(r0, r1)) in chunks.iter().enumerate() {
            let bytes = &o_cur.as_mut_slice()[..(r1 - r0) * cols * dtype.size()];
            let shape = [r1 - r0, cols];
            let work = || {
                f(
                    r0,
                    TensorRef {
                        dtype,
                        shape: &shape,
                        bytes,
                    },
                )
            };
            secs += self.step(chunks, i + 1, s_dec, s_read, o_next, work, io)?;
            std::mem::swap(&mut o_cur, &mut o_next);
            std::mem::swap(&mut s_dec, &mut s_read);
        }
        Ok(secs)
    }

    /// Run `work` here while chunk `i` is decoded from `s_dec` into `out` and the span of
    /// chunk `i + 1` is read into `s_read` (each only when there is such a chunk). The
    /// read's seconds, or the first error: `work`'s, the decoding's, the read's.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        chunks: &[Rows],
        i: usize,
        s_dec: &mut OwnedArena,
        s_read: &mut OwnedArena,
        out: &mut OwnedArena,
        work: impl FnOnce() -> Result<(), WeightError>,
        io: &dyn Fn(std::io::Error) -> WeightError,
    ) -> Result<f64, WeightError> {
        let (w, dec, read) = std::thread::scope(|s| {
            let read = chunks
                .get(i + 1)
                .map(|&r| s.spawn(move || self.read_span(r, s_read)));
            let dec = chunks
                .get(i)
                .map(|&r| s.spawn(move || self.decode_checked(r, s_dec, out)));
            (work(), dec.map(|h| h.join()), read.map(|h| h.join()))
        });
        w?;
        if let Some(d) = dec {
            d.map_err(|_| io(panicked()))?.map_err(io)?;
        }
        match read {
            Some(r) => r.map_err(|_| io(panicked()))?.map_err(io),
            None => Ok(0.0),
        }
    }
}

fn panicked() -> std::io::Error {
    std::io::Error::other("an lm_head reader or decoder thread panicked")
}
