//! The model-level matrices read from disk instead of held: the token embedding one row per
//! token on demand, and (when the memory plan does not pin it) the lm_head in bounded row
//! chunks, double-buffered so the read of chunk k+1 runs while chunk k is multiplied.
//!
//! A streamed lm_head may keep its leading rows held for the whole run (the memory plan
//! spends what the trunk leaves on them: each held byte is one byte less read per token).
//! They are read once, on first use, and multiplied while the first streamed chunk is read.
//!
//! Reads are O_DIRECT where the file system allows (`k3_io::direct::DirectFiles`), so they
//! leave no page cache behind to be charged to compute's cgroup: what compute holds is the
//! few rows of a pass and two chunk buffers, whatever the vocabulary.
//!
//! With a coded trunk that carries the lm_head coded (`pack-trunk --codec`), the streamed
//! rows may be read from its stored chunks and decoded instead ([`coded`]): the disk then
//! delivers about two thirds of the bytes. The held rows are read raw, once, and are whole
//! coded chunks, so the streamed rows start on one.

use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::time::Instant;

use k3_io::arena::{slot_bytes_for, OwnedArena};
use k3_io::direct::{window, DirectFiles};
use k3_model::catalog::Catalog;
use k3_model::classify::{model_tensor, LM_HEAD};
use k3_model::tensor::{Dtype, TensorRef, WeightError};

mod coded;
pub use coded::{coded_head_buffer_bound, coded_head_buffer_bytes, head_decoders, CodedHeadFile};

/// Where a `[rows, cols]` model-level matrix lies in the shards.
#[derive(Clone, Debug)]
struct Matrix {
    name: String,
    shard: u32,
    offset: u64,
    rows: usize,
    row_bytes: u64,
    dtype: Dtype,
}

/// Bytes and seconds of lm_head chunks read since the last [`ModelStream::take_read`]
/// (embedding rows are not counted: see [`ModelStream::rows`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct HeadReads {
    pub bytes: u64,
    pub seconds: f64,
}

/// A chunk read into its buffer: the payload's byte range in it, and the read's seconds.
type Landed = ((usize, usize), f64);

/// Embedding rows on demand and lm_head chunks.
pub struct ModelStream {
    files: DirectFiles,
    embed: Option<Matrix>,
    head: Option<Matrix>,
    /// Rows per lm_head chunk; None: the lm_head is held (not chunked).
    head_chunk_rows: Option<usize>,
    /// Leading lm_head rows held for the run (0: none), and their buffer once read (with
    /// the payload's range in it).
    head_held_rows: usize,
    held: RefCell<Option<(OwnedArena, (usize, usize))>>,
    scratch: RefCell<Option<OwnedArena>>,
    /// Two chunk buffers, allocated on first use.
    bufs: RefCell<Option<[OwnedArena; 2]>>,
    read: Cell<HeadReads>,
    /// The streamed rows' coded source (None: read raw from the shards).
    coded: RefCell<Option<coded::Coded>>,
}

/// The bytes of a streamed lm_head's chunk when the plan asks for `chunk_bytes`: with a
/// coded head of `coded_rows` rows per coded chunk, whole coded chunks (at least one).
pub fn head_stream_chunk_bytes(chunk_bytes: u64, row: u64, coded_rows: Option<u64>) -> u64 {
    let rows = (chunk_bytes / row.max(1)).max(1);
    match coded_rows {
        Some(cr) => (rows / cr.max(1)).max(1) * cr.max(1) * row,
        None => rows * row,
    }
}

/// The leading rows a streamed lm_head holds when `rows` of its `all` fit: with a coded
/// head of `coded_rows` rows per coded chunk, whole coded chunks (the streamed rows then
/// start on one), unless every row is held.
pub fn head_held_rows(rows: u64, all: u64, coded_rows: Option<u64>) -> u64 {
    match coded_rows {
        Some(cr) if rows < all => rows / cr.max(1) * cr.max(1),
        _ => rows,
    }
}

fn matrix(cat: &Catalog, name: &str) -> Option<Matrix> {
    let e = cat.get(name)?;
    let (rows, cols) = match e.shape {
        [r, c] => (*r, *c),
        _ => return None,
    };
    Some(Matrix {
        name: name.to_string(),
        shard: e.shard as u32,
        offset: e.offset,
        rows,
        row_bytes: (cols * e.dtype.size()) as u64,
        dtype: e.dtype,
    })
}

impl ModelStream {
    /// Open the shards of `cat`. `head_chunk_bytes`: stream the lm_head in chunks of about
    /// that many bytes (at least one row); None: the lm_head stays held by the caller.
    /// `head_held_bytes`: with a streamed lm_head, hold that many bytes of its leading rows
    /// (whole rows, fewer than all) and stream only the rest.
    /// `coded`: read the streamed rows from this coded lm_head (checked against `cat`'s).
    pub fn open(
        cat: &Catalog,
        head_chunk_bytes: Option<u64>,
        head_held_bytes: u64,
        coded: Option<CodedHeadFile>,
    ) -> std::io::Result<ModelStream> {
        let paths: Vec<PathBuf> = cat.shards().iter().map(|s| s.path.clone()).collect();
        let files = DirectFiles::open(&paths)?;
        let embed = matrix(cat, &model_tensor("embed_tokens.weight"));
        let head = matrix(cat, LM_HEAD);
        let coded = match (&head, coded, head_chunk_bytes) {
            (Some(h), Some(c), Some(_)) => {
                let shape = coded::Shape {
                    name: &h.name,
                    dtype: h.dtype,
                    rows: h.rows,
                    row_bytes: h.row_bytes,
                };
                Some(coded::Coded::open(&shape, c)?)
            }
            _ => None,
        };
        let coded_rows = coded.as_ref().map(|c| c.head.chunk_rows);
        let head_chunk_rows = match (&head, head_chunk_bytes) {
            (Some(h), Some(b)) => {
                let bytes = head_stream_chunk_bytes(b, h.row_bytes, coded_rows);
                Some(((bytes / h.row_bytes.max(1)) as usize).clamp(1, h.rows))
            }
            _ => None,
        };
        let head_held_rows = match (&head, head_chunk_rows) {
            (Some(h), Some(_)) => {
                let rows = (head_held_bytes / h.row_bytes.max(1)).min(h.rows as u64);
                head_held_rows(rows, h.rows as u64, coded_rows) as usize
            }
            _ => 0,
        };
        Ok(ModelStream {
            files,
            embed,
            head,
            head_chunk_rows,
            head_held_rows,
            held: RefCell::new(None),
            scratch: RefCell::new(None),
            bufs: RefCell::new(None),
            read: Cell::new(HeadReads::default()),
            coded: RefCell::new(coded),
        })
    }

    /// What was read since the last call (and reset it).
    pub fn take_read(&self) -> HeadReads {
        self.read.replace(HeadReads::default())
    }

    fn count(&self, bytes: u64, seconds: f64) {
        let mut r = self.read.get();
        r.bytes += bytes;
        r.seconds += seconds;
        self.read.set(r);
    }

    /// Rows of the embedding (None for any other name, or without an embedding).
    pub fn rows(&self, name: &str, rows: &[u32]) -> Option<Result<(Dtype, Vec<u8>), WeightError>> {
        let m = self.embed.as_ref().filter(|m| m.name == name)?;
        let rb = m.row_bytes as usize;
        let mut out = vec![0u8; rows.len() * rb];
        let mut scratch = self.scratch.borrow_mut();
        for (k, &r) in rows.iter().enumerate() {
            if r as usize >= m.rows {
                return Some(Err(WeightError::Invalid {
                    name: name.to_string(),
                    msg: format!("row {r} of {}", m.rows),
                }));
            }
            let off = m.offset + r as u64 * m.row_bytes;
            if let Err(e) = self.files.read_exact_unaligned(
                m.shard,
                off,
                &mut out[k * rb..(k + 1) * rb],
                &mut scratch,
            ) {
                return Some(Err(WeightError::Io {
                    name: name.to_string(),
                    msg: e.to_string(),
                }));
            }
        }
        // Not counted in the step's read bytes: one row per token (14 KB at full scale) is
        // noise beside a layer, and the committed replay recordings compare those bytes.
        Some(Ok((m.dtype, out)))
    }

    /// Rows per lm_head chunk when it is streamed.
    pub fn head_chunk_rows(&self) -> Option<usize> {
        self.head_chunk_rows
    }

    /// Read rows `r0..r1` of `m` into `buf` (page-aligned window); the payload's range.
    fn read_rows(
        files: &DirectFiles,
        m: &Matrix,
        r0: usize,
        r1: usize,
        buf: &mut OwnedArena,
    ) -> std::io::Result<(usize, usize)> {
        let off = m.offset + r0 as u64 * m.row_bytes;
        let len = (r1 - r0) as u64 * m.row_bytes;
        let (start, wlen) = window(off, len)
            .ok_or_else(|| std::io::Error::other("lm_head chunk offset overflows"))?;
        let dst = &mut buf.as_mut_slice()[..wlen as usize];
        // In pieces, several in flight: one 32 MiB request at a time left the disk's queue
        // mostly empty.
        let got = k3_io::direct::read_parallel(files, m.shard, start, dst, &|_, _| {
            Ok::<_, std::convert::Infallible>(())
        })
        .map_err(std::io::Error::other)?;
        let skip = (off - start) as usize;
        if got < skip + len as usize {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{}: rows {r0}..{r1} end past the file", m.name),
            ));
        }
        Ok((skip, skip + len as usize))
    }

    /// Run `work` here while rows `r0..r1` of `m` are read into `buf` on another thread
    /// (nothing is read when the range is empty). Returns the payload's range in `buf` and
    /// the read's seconds, or the first error: `work`'s, then the read's.
    fn overlapped(
        files: &DirectFiles,
        m: &Matrix,
        r0: usize,
        r1: usize,
        buf: &mut OwnedArena,
        work: impl FnOnce() -> Result<(), WeightError>,
    ) -> Result<Option<Landed>, WeightError> {
        let (res, read) = std::thread::scope(|s| {
            let h = (r0 < r1).then(|| {
                s.spawn(move || {
                    let t = Instant::now();
                    let r = Self::read_rows(files, m, r0, r1, buf);
                    (r, t.elapsed().as_secs_f64())
                })
            });
            let res = work();
            (res, h.map(|h| h.join()))
        });
        res?;
        match read {
            None => Ok(None),
            Some(Ok((Ok(rg), secs))) => Ok(Some((rg, secs))),
            Some(Ok((Err(e), _))) => Err(WeightError::Io {
                name: m.name.clone(),
                msg: e.to_string(),
            }),
            Some(Err(_)) => Err(WeightError::Io {
                name: m.name.clone(),
                msg: "the lm_head reader thread panicked".into(),
            }),
        }
    }

    /// The lm_head in chunks (see `Weights::matrix_chunks`); None when it is held.
    pub fn chunks(
        &self,
        name: &str,
        f: &mut dyn FnMut(usize, TensorRef<'_>) -> Result<(), WeightError>,
    ) -> Option<Result<(), WeightError>> {
        let m = self.head.as_ref().filter(|m| m.name == name)?;
        let step = self.head_chunk_rows?;
        let cols = (m.row_bytes as usize) / m.dtype.size();
        let cap = slot_bytes_for(step as u64 * m.row_bytes) as usize;
        let mut bufs = self.bufs.borrow_mut();
        if bufs.is_none() {
            let a = OwnedArena::new(cap).and_then(|a| Ok([a, OwnedArena::new(cap)?]));
            match a {
                Ok(a) => *bufs = Some(a),
                Err(e) => {
                    return Some(Err(WeightError::Io {
                        name: name.to_string(),
                        msg: format!("lm_head chunk buffers: {e}"),
                    }))
                }
            }
        }
        let [a, b] = bufs.as_mut().expect("allocated above");
        let io_err = |e: std::io::Error| WeightError::Io {
            name: name.to_string(),
            msg: e.to_string(),
        };
        let mut io_s = 0.0;
        let mut read_bytes = 0u64;
        let held_rows = self.head_held_rows;
        let mut held = self.held.borrow_mut();
        if held_rows > 0 && held.is_none() {
            let t = Instant::now();
            let cap = slot_bytes_for(held_rows as u64 * m.row_bytes) as usize;
            let mut buf = match OwnedArena::new(cap) {
                Ok(x) => x,
                Err(e) => {
                    return Some(Err(WeightError::Io {
                        name: name.to_string(),
                        msg: format!("held lm_head rows: {e}"),
                    }))
                }
            };
            match Self::read_rows(&self.files, m, 0, held_rows, &mut buf) {
                Ok(range) => *held = Some((buf, range)),
                Err(e) => return Some(Err(io_err(e))),
            }
            io_s += t.elapsed().as_secs_f64();
            read_bytes += held_rows as u64 * m.row_bytes;
        }
        let start = held_rows.min(m.rows);
        if let Some(c) = self.coded.borrow_mut().as_mut() {
            let held = held
                .as_mut()
                .map(|(buf, (lo, hi))| &buf.as_mut_slice()[*lo..*hi]);
            let span = (start, m.rows, step);
            return Some(
                c.stream(&m.name, cols, m.dtype, span, [a, b], held, f)
                    .map(|(stored, secs)| self.count(read_bytes + stored, io_s + secs)),
            );
        }
        let files = &self.files;
        // The held rows are multiplied while the first streamed chunk is read.
        let held_work = || match held.as_mut() {
            Some((buf, (lo, hi))) => {
                let shape = [start, cols];
                f(
                    0,
                    TensorRef {
                        dtype: m.dtype,
                        shape: &shape,
                        bytes: &buf.as_mut_slice()[*lo..*hi],
                    },
                )
            }
            None => Ok(()),
        };
        let first_end = (start + step).min(m.rows);
        let mut first = match Self::overlapped(files, m, start, first_end, a, held_work) {
            Ok(Some((rg, secs))) => {
                io_s += secs;
                rg
            }
            Ok(None) => (0, 0),
            Err(e) => return Some(Err(e)),
        };
        let (mut cur, mut next) = (a, b);
        let mut r0 = start;
        while r0 < m.rows {
            let r1 = (r0 + step).min(m.rows);
            let r2 = (r1 + step).min(m.rows);
            // Read chunk k+1 into `next` while chunk k is multiplied here.
            let (lo, hi) = first;
            let cur_bytes = &cur.as_mut_slice()[lo..hi];
            let work = || {
                let shape = [r1 - r0, cols];
                f(
                    r0,
                    TensorRef {
                        dtype: m.dtype,
                        shape: &shape,
                        bytes: cur_bytes,
                    },
                )
            };
            match Self::overlapped(files, m, r1, r2, next, work) {
                Ok(Some((rg, secs))) => {
                    io_s += secs;
                    first = rg;
                }
                Ok(None) => {}
                Err(e) => return Some(Err(e)),
            }
            std::mem::swap(&mut cur, &mut next);
            r0 = r1;
        }
        read_bytes += (m.rows - start) as u64 * m.row_bytes;
        self.count(read_bytes, io_s);
        Some(Ok(()))
    }
}
