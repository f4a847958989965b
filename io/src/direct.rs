//! The one positioned reader of k3: O_DIRECT when the request is aligned and the file system
//! allows it, buffered otherwise, plus a fault-injecting wrapper for tests.
//!
//! Aligned requests (offset, length and address multiples of [`ALIGN`]) go straight to
//! O_DIRECT: that is every expert slot and every packed-trunk chunk. A request at any other
//! offset is widened to the aligned [`window`] that contains it and read into an aligned
//! scratch buffer ([`DirectFiles::read_exact_unaligned`]); the last window of a file may run
//! past EOF as long as the payload is covered.
//!
//! The fetcher always asks for page-aligned offsets into page-aligned buffers of whole pages
//! (its slots mirror the file's page layout), so on a local disk every expert read bypasses
//! the page cache. Where O_DIRECT is refused (tmpfs, some network file systems) the reader
//! falls back to buffered reads and counts them, so a report can say so.
//!
//! A big read is one request at a time, which leaves a drive's queue mostly empty:
//! [`read_parallel`] splits it into [`READ_CHUNK`] pieces with [`READ_QD`] in flight (the
//! trunk-loader's units, a streamed lm_head's chunks).

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::arena::{ArenaMemory, OwnedArena, ALIGN};

/// The aligned window `[start, start + len)` that contains `[off, off + len)`; `None` on
/// arithmetic overflow.
pub fn window(off: u64, len: u64) -> Option<(u64, u64)> {
    let a = ALIGN as u64;
    let start = off - off % a;
    let end = off.checked_add(len)?;
    let wend = end.checked_add(a - 1)? / a * a;
    Some((start, wend - start))
}

/// Read bytes of file number `file` at `offset` into `dst`.
pub trait ReadAt: Send + Sync {
    /// Fill `dst` from `offset`, returning how many bytes were read: `dst.len()`, or fewer
    /// only at the end of the file.
    fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> io::Result<usize>;

    /// Copies of the same bytes this reader reads from (1: one file per number).
    fn copies(&self) -> u32 {
        1
    }

    /// Read every later piece from another copy than before (a no-op with one copy): a
    /// caller whose bytes failed their check tries again `copies() - 1` times.
    fn next_copy(&self) {}
}

struct OpenFile {
    path: PathBuf,
    direct: Option<File>,
    buffered: File,
}

/// Files opened twice, with O_DIRECT and without.
pub struct DirectFiles {
    files: Vec<OpenFile>,
    direct_ok: AtomicBool,
    direct_reads: AtomicU64,
    buffered_reads: AtomicU64,
}

fn fill(f: &File, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
    let mut got = 0usize;
    while got < dst.len() {
        match f.read_at(&mut dst[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

impl DirectFiles {
    /// Open every file; O_DIRECT is attempted and silently dropped where refused.
    pub fn open(paths: &[PathBuf]) -> io::Result<DirectFiles> {
        let mut files = Vec::with_capacity(paths.len());
        for p in paths {
            let buffered = File::open(p).map_err(|e| annotate(p, e))?;
            let direct = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(p)
                .ok();
            files.push(OpenFile {
                path: p.clone(),
                direct,
                buffered,
            });
        }
        Ok(DirectFiles {
            files,
            direct_ok: AtomicBool::new(true),
            direct_reads: AtomicU64::new(0),
            buffered_reads: AtomicU64::new(0),
        })
    }

    /// Never use O_DIRECT (for measuring the page-cache path).
    pub fn disable_direct(&self) {
        self.direct_ok.store(false, Ordering::Relaxed);
    }

    /// Reads that bypassed the page cache.
    pub fn direct_reads(&self) -> u64 {
        self.direct_reads.load(Ordering::Relaxed)
    }

    /// Reads that went through the page cache (unaligned, or O_DIRECT refused).
    pub fn buffered_reads(&self) -> u64 {
        self.buffered_reads.load(Ordering::Relaxed)
    }

    /// Read `dst.len()` bytes at `offset` of file `file`, at any alignment: the aligned
    /// window around them is read into `scratch` (grown as needed), with O_DIRECT where the
    /// file system allows it, and the payload is copied out. A file that ends before the
    /// payload does is an `UnexpectedEof` error naming the file and the range.
    pub fn read_exact_unaligned(
        &self,
        file: u32,
        offset: u64,
        dst: &mut [u8],
        scratch: &mut Option<OwnedArena>,
    ) -> io::Result<()> {
        let len = dst.len() as u64;
        let name = || {
            self.files
                .get(file as usize)
                .map_or_else(|| format!("file {file}"), |f| f.path.display().to_string())
        };
        let (start, wlen) = window(offset, len).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: read [{offset}, +{len}): offset + length overflows",
                    name()
                ),
            )
        })?;
        if scratch.as_ref().is_none_or(|s| (s.len() as u64) < wlen) {
            *scratch = Some(OwnedArena::new(wlen as usize).map_err(io::Error::other)?);
        }
        let buf = &mut scratch
            .as_mut()
            .expect("scratch was just allocated")
            .as_mut_slice()[..wlen as usize];
        let got = self.read_at(file, start, buf)?;
        let skip = (offset - start) as usize;
        if got < skip + dst.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{}: read [{offset}, +{len}): the file ends {} bytes into the payload",
                    name(),
                    got.saturating_sub(skip)
                ),
            ));
        }
        dst.copy_from_slice(&buf[skip..skip + dst.len()]);
        Ok(())
    }

    /// True while O_DIRECT is in use for aligned reads.
    pub fn direct_in_use(&self) -> bool {
        self.direct_ok.load(Ordering::Relaxed) && self.files.iter().any(|f| f.direct.is_some())
    }
}

fn annotate(p: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", p.display()))
}

impl ReadAt for DirectFiles {
    fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        let f = self.files.get(file as usize).ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, format!("no file number {file}"))
        })?;
        let aligned = offset.is_multiple_of(ALIGN as u64)
            && (dst.as_ptr() as usize).is_multiple_of(ALIGN)
            && dst.len().is_multiple_of(ALIGN);
        if aligned && self.direct_ok.load(Ordering::Relaxed) {
            if let Some(d) = &f.direct {
                match fill(d, offset, dst) {
                    Ok(n) => {
                        self.direct_reads.fetch_add(1, Ordering::Relaxed);
                        return Ok(n);
                    }
                    // The file system does not do O_DIRECT after all: fall back for good.
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        self.direct_ok.store(false, Ordering::Relaxed);
                    }
                    Err(e) => return Err(annotate(&f.path, e)),
                }
            }
        }
        self.buffered_reads.fetch_add(1, Ordering::Relaxed);
        fill(&f.buffered, offset, dst).map_err(|e| annotate(&f.path, e))
    }
}

/// A reader that fails every read touching one of the given byte ranges (error injection).
pub struct FaultyReader<R> {
    inner: R,
    /// `(file, start, end)`: a read of `file` overlapping `[start, end)` fails with EIO.
    fail: Vec<(u32, u64, u64)>,
    injected: AtomicU64,
}

impl<R: ReadAt> FaultyReader<R> {
    /// Wrap `inner`; reads overlapping any `(file, start, end)` range fail.
    pub fn new(inner: R, fail: Vec<(u32, u64, u64)>) -> Self {
        FaultyReader {
            inner,
            fail,
            injected: AtomicU64::new(0),
        }
    }

    /// How many reads were failed on purpose.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }
}

impl<R: ReadAt> ReadAt for FaultyReader<R> {
    fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        let end = offset + dst.len() as u64;
        if self
            .fail
            .iter()
            .any(|&(f, s, e)| f == file && s < end && offset < e)
        {
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(io::Error::other(format!(
                "injected read error (file {file}, bytes {offset}..{end})"
            )));
        }
        self.inner.read_at(file, offset, dst)
    }

    fn copies(&self) -> u32 {
        self.inner.copies()
    }

    fn next_copy(&self) {
        self.inner.next_copy()
    }
}

/// One file's bytes in memory, read as file 0 (the file number is not looked at): the
/// reader tests and replays hand to code that takes a [`ReadAt`].
pub struct MemFile(pub Vec<u8>);

impl ReadAt for MemFile {
    fn read_at(&self, _file: u32, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        let from = usize::try_from(offset).map_or(self.0.len(), |o| o.min(self.0.len()));
        let n = dst.len().min(self.0.len() - from);
        dst[..n].copy_from_slice(&self.0[from..from + n]);
        Ok(n)
    }
}

/// Every method forwarded: a default here would answer for the reader inside (a method
/// call on an `Arc<dyn ReadAt>` finds this impl first).
impl<R: ReadAt + ?Sized> ReadAt for std::sync::Arc<R> {
    fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        (**self).read_at(file, offset, dst)
    }

    fn copies(&self) -> u32 {
        (**self).copies()
    }

    fn next_copy(&self) {
        (**self).next_copy()
    }
}

/// Bytes of one piece of a [`read_parallel`].
pub const READ_CHUNK: usize = 8 << 20;
/// Pieces of a [`read_parallel`] in flight (the device's queue depth; one big read is one
/// request at a time, which leaves an NVMe drive mostly idle).
pub const READ_QD: usize = 8;

/// A piece that landed: `(at, bytes)`, `at` its offset in the destination. Returning an
/// error fails the whole read (a checksum, say) with [`ParallelReadError::Rejected`].
pub type OnPiece<'a, E> = dyn Fn(usize, &[u8]) -> Result<(), E> + Sync + 'a;

/// Why a [`read_parallel`] failed: a read, or the caller's check of a piece (`E`, the
/// error [`OnPiece`] returns).
#[derive(Debug, thiserror::Error)]
pub enum ParallelReadError<E> {
    #[error("{0}")]
    Io(#[source] io::Error),
    #[error("{0}")]
    Rejected(E),
    /// A piece no reader thread got to (a reader thread died).
    #[error("piece {0} was not read")]
    NotRead(usize),
}

/// Fill `dst` from `offset` of `file` in [`READ_CHUNK`] pieces, [`READ_QD`] in flight, each
/// piece at an offset of `dst` that is a multiple of [`READ_CHUNK`] (an aligned `offset`
/// and buffer keep every piece O_DIRECT). `on_piece` sees each piece as it lands. Returns
/// the bytes read: `dst.len()`, or fewer only when the file ends inside the last piece.
pub fn read_parallel<E: Send>(
    reader: &dyn ReadAt,
    file: u32,
    offset: u64,
    dst: &mut [u8],
    on_piece: &OnPiece<'_, E>,
) -> Result<usize, ParallelReadError<E>> {
    use std::sync::Mutex;
    if dst.len() <= READ_CHUNK {
        let got = reader
            .read_at(file, offset, dst)
            .map_err(ParallelReadError::Io)?;
        on_piece(0, &dst[..got]).map_err(ParallelReadError::Rejected)?;
        return Ok(got);
    }
    let pieces: Vec<(usize, &mut [u8])> = dst
        .chunks_mut(READ_CHUNK)
        .enumerate()
        .map(|(i, c)| (i * READ_CHUNK, c))
        .collect();
    let n = pieces.len();
    let next = AtomicU64::new(0);
    type Piece<'a> = Mutex<Option<(usize, &'a mut [u8])>>;
    type Outcome<E> = Mutex<Option<Result<(usize, usize, usize), ParallelReadError<E>>>>;
    let slots: Vec<Piece<'_>> = pieces.into_iter().map(|p| Mutex::new(Some(p))).collect();
    let results: Vec<Outcome<E>> = (0..n).map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..READ_QD.min(n) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                if i >= n {
                    return;
                }
                let Some((at, buf)) = slots[i].lock().unwrap_or_else(|p| p.into_inner()).take()
                else {
                    continue;
                };
                let r = reader
                    .read_at(file, offset + at as u64, buf)
                    .map_err(ParallelReadError::Io)
                    .and_then(|got| {
                        on_piece(at, &buf[..got]).map_err(ParallelReadError::Rejected)?;
                        Ok((at, got, buf.len()))
                    });
                *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            });
        }
    });
    let mut total = 0usize;
    for (i, r) in results.into_iter().enumerate() {
        let r = r
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .unwrap_or(Err(ParallelReadError::NotRead(i)))?;
        let (at, got, len) = r;
        total = at + got;
        // A short piece is the end of the file: nothing after it can hold data.
        if got < len {
            break;
        }
    }
    Ok(total)
}
