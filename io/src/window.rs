//! Aligned O_DIRECT reads with a buffered fallback.
//!
//! O_DIRECT reads bypass the page cache but need the file offset, the length and the memory
//! address aligned (to [`ALIGN`] = 4096 here, enough for every common device). A read of
//! `[off, off + len)` is therefore widened to the 4096-byte window that contains it,
//! `[floor(off), ceil(off + len))`. The last window of a file may run past EOF; that is
//! fine as long as the *payload* was covered — a read that stops short of `off + len` is an
//! error, one that stops short of the window end is not.
//!
//! Where the filesystem refuses O_DIRECT (EINVAL when opening or reading, e.g. some tmpfs
//! or network filesystems), the reader falls back to ordinary buffered reads; every read
//! returns the [`ReadMode`] that served it, so callers can report it.
//!
//! Two ways to read:
//! - [`DirectFile::read_at`] copies the payload out into any caller buffer;
//! - [`DirectFile::read_window_into`] reads the whole window into a caller-provided
//!   4096-aligned buffer (e.g. an arena slot) and returns where the payload starts in it,
//!   so nothing is copied.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Alignment of O_DIRECT windows, buffers and offsets.
pub use crate::arena::ALIGN;

/// How a read was served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadMode {
    /// O_DIRECT, bypassing the page cache.
    Direct,
    /// Ordinary buffered read (O_DIRECT was refused, or buffered was asked for).
    Buffered,
}

/// The aligned window `[start, start + len)` that contains `[off, off + len)`.
/// Returns `None` on arithmetic overflow.
pub fn window(off: u64, len: u64) -> Option<(u64, u64)> {
    let start = off - off % (ALIGN as u64);
    let end = off.checked_add(len)?;
    let wend = end.checked_add((ALIGN as u64) - 1)? / (ALIGN as u64) * (ALIGN as u64);
    Some((start, wend - start))
}

/// Result of a windowed read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowRead {
    /// Offset of the payload's first byte inside the buffer (`off % 4096`).
    pub payload_offset: usize,
    /// Bytes of the window actually read (less than the window at EOF, never less than
    /// `payload_offset + len`).
    pub bytes_read: usize,
    /// How the read was served.
    pub mode: ReadMode,
}

/// A heap buffer aligned to [`ALIGN`], zero-initialised, for O_DIRECT reads.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (rounded up to a multiple of 4096; at least 4096).
    pub fn new(len: usize) -> AlignedBuf {
        let len = len.max(1).div_ceil(ALIGN) * ALIGN;
        let layout = Layout::from_size_align(len, ALIGN).expect("aligned buffer layout");
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len }
    }

    /// Length in bytes (a multiple of 4096).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (the buffer holds at least 4096 bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout.
        unsafe { dealloc(self.ptr, Layout::from_size_align_unchecked(self.len, ALIGN)) }
    }
}

/// A file opened for O_DIRECT reads when the filesystem allows it, buffered otherwise.
#[derive(Debug)]
pub struct DirectFile {
    path: PathBuf,
    /// The O_DIRECT handle, when open with O_DIRECT succeeded.
    direct: Option<File>,
    /// The buffered handle, opened on first need.
    buffered: OnceLock<File>,
    /// Set once an O_DIRECT read was refused; all later reads are buffered.
    direct_refused: std::sync::atomic::AtomicBool,
    size: u64,
}

fn is_einval(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

impl DirectFile {
    /// Open `path`, with O_DIRECT when the filesystem accepts it (else buffered).
    pub fn open(path: impl AsRef<Path>) -> io::Result<DirectFile> {
        let path = path.as_ref();
        let direct = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(f) => Some(f),
            Err(e) if is_einval(&e) => None,
            Err(e) => return Err(with_path(e, path, "open")),
        };
        Self::finish(path, direct)
    }

    /// Open `path` for buffered reads only.
    pub fn open_buffered(path: impl AsRef<Path>) -> io::Result<DirectFile> {
        Self::finish(path.as_ref(), None)
    }

    fn finish(path: &Path, direct: Option<File>) -> io::Result<DirectFile> {
        let buffered = OnceLock::new();
        let size = match &direct {
            Some(f) => f.metadata(),
            None => {
                let f = File::open(path).map_err(|e| with_path(e, path, "open"))?;
                let m = f.metadata();
                let _ = buffered.set(f);
                m
            }
        }
        .map_err(|e| with_path(e, path, "stat"))?
        .len();
        Ok(DirectFile {
            path: path.to_path_buf(),
            direct,
            buffered,
            direct_refused: std::sync::atomic::AtomicBool::new(false),
            size,
        })
    }

    /// The mode the next read will try first.
    pub fn mode(&self) -> ReadMode {
        if self.direct.is_some()
            && !self
                .direct_refused
                .load(std::sync::atomic::Ordering::Relaxed)
        {
            ReadMode::Direct
        } else {
            ReadMode::Buffered
        }
    }

    /// File size at open.
    pub fn len(&self) -> u64 {
        self.size
    }

    /// Whether the file was empty at open.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The path opened.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn buffered_file(&self) -> io::Result<&File> {
        if let Some(f) = self.buffered.get() {
            return Ok(f);
        }
        let f = File::open(&self.path).map_err(|e| with_path(e, &self.path, "open"))?;
        Ok(self.buffered.get_or_init(|| f))
    }

    /// Fill `buf` from file offset `start` until full or EOF; returns bytes read.
    fn fill(f: &File, buf: &mut [u8], start: u64) -> io::Result<usize> {
        let mut got = 0;
        while got < buf.len() {
            match f.read_at(&mut buf[got..], start + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(got)
    }

    /// Read the window of `[off, off + len)` into the 4096-aligned `buf` (its address
    /// must be 4096-aligned and it must hold the whole window, see [`window`]). The payload
    /// lands at `buf[r.payload_offset .. r.payload_offset + len]`.
    pub fn read_window_into(&self, off: u64, len: u64, buf: &mut [u8]) -> io::Result<WindowRead> {
        let (start, wlen) = window(off, len).ok_or_else(|| {
            self.err(
                io::ErrorKind::InvalidInput,
                off,
                len,
                "offset + length overflows",
            )
        })?;
        if (buf.as_ptr() as usize) % ALIGN != 0 {
            return Err(self.err(
                io::ErrorKind::InvalidInput,
                off,
                len,
                "buffer is not 4096-aligned",
            ));
        }
        if (buf.len() as u64) < wlen {
            return Err(self.err(
                io::ErrorKind::InvalidInput,
                off,
                len,
                &format!(
                    "buffer holds {} bytes but the window needs {wlen}",
                    buf.len()
                ),
            ));
        }
        let payload_offset = (off - start) as usize;
        self.read_window_raw(off, len, start, &mut buf[..wlen as usize], payload_offset)
    }

    /// The read loop behind [`read_window_into`](Self::read_window_into), without the
    /// alignment checks: an O_DIRECT read refused with EINVAL switches this file to
    /// buffered reads for good and is retried buffered.
    fn read_window_raw(
        &self,
        off: u64,
        len: u64,
        start: u64,
        wbuf: &mut [u8],
        payload_offset: usize,
    ) -> io::Result<WindowRead> {
        let need = payload_offset + len as usize;
        let mut mode = self.mode();
        let got = loop {
            let res = match (mode, &self.direct) {
                (ReadMode::Direct, Some(f)) => Self::fill(f, wbuf, start),
                _ => {
                    mode = ReadMode::Buffered;
                    self.buffered_file()
                        .and_then(|f| Self::fill(f, wbuf, start))
                }
            };
            match res {
                Ok(n) => break n,
                Err(e) if mode == ReadMode::Direct && is_einval(&e) => {
                    self.direct_refused
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    mode = ReadMode::Buffered;
                }
                Err(e) => return Err(with_path(e, &self.path, &format!("read [{off}, +{len})"))),
            }
        };
        if got < need {
            return Err(self.err(
                io::ErrorKind::UnexpectedEof,
                off,
                len,
                &format!(
                    "read past end of file: the file has {} bytes after the window start {start}, \
                     the payload needs {need}",
                    got
                ),
            ));
        }
        Ok(WindowRead {
            payload_offset,
            bytes_read: got,
            mode,
        })
    }

    /// Read `[off, off + out.len())` into `out` (any alignment) through an aligned window
    /// in a temporary buffer; returns how it was served.
    pub fn read_at(&self, off: u64, out: &mut [u8]) -> io::Result<ReadMode> {
        let (_, wlen) = window(off, out.len() as u64).ok_or_else(|| {
            self.err(
                io::ErrorKind::InvalidInput,
                off,
                out.len() as u64,
                "offset + length overflows",
            )
        })?;
        let mut scratch = AlignedBuf::new(wlen as usize);
        self.read_at_with(off, out, &mut scratch)
    }

    /// As [`read_at`](Self::read_at), reusing `scratch` (grown if too small).
    pub fn read_at_with(
        &self,
        off: u64,
        out: &mut [u8],
        scratch: &mut AlignedBuf,
    ) -> io::Result<ReadMode> {
        let len = out.len() as u64;
        let (_, wlen) = window(off, len).ok_or_else(|| {
            self.err(
                io::ErrorKind::InvalidInput,
                off,
                len,
                "offset + length overflows",
            )
        })?;
        if (scratch.len() as u64) < wlen {
            *scratch = AlignedBuf::new(wlen as usize);
        }
        let r = self.read_window_into(off, len, scratch.as_mut_slice())?;
        out.copy_from_slice(&scratch.as_slice()[r.payload_offset..r.payload_offset + out.len()]);
        Ok(r.mode)
    }

    fn err(&self, kind: io::ErrorKind, off: u64, len: u64, msg: &str) -> io::Error {
        io::Error::new(
            kind,
            format!("{}: read [{off}, {off}+{len}): {msg}", self.path.display()),
        )
    }
}

fn with_path(e: io::Error, path: &Path, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {what}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An O_DIRECT read refused with EINVAL (here provoked with a misaligned buffer, which
    /// the kernel refuses exactly like a filesystem without O_DIRECT) is retried buffered,
    /// reported as Buffered, and the file stays buffered.
    #[test]
    fn einval_on_read_falls_back_to_buffered() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.bin");
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let f = DirectFile::open(&p).unwrap();
        if f.mode() != ReadMode::Direct {
            return; // this filesystem already refused O_DIRECT at open
        }
        let mut buf = AlignedBuf::new(3 * 4096);
        let r = f
            .read_window_raw(4100, 10, 4096, &mut buf.as_mut_slice()[1..4097], 4)
            .unwrap();
        assert_eq!(r.mode, ReadMode::Buffered);
        assert_eq!(&buf.as_slice()[1 + 4..1 + 14], &data[4100..4110]);
        assert_eq!(f.mode(), ReadMode::Buffered);
        let mut out = [0u8; 3];
        assert_eq!(f.read_at(9997, &mut out).unwrap(), ReadMode::Buffered);
        assert_eq!(out, data[9997..]);
    }
}
