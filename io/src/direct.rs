//! Positioned reads for the fetcher: O_DIRECT when the request is aligned and the file
//! system allows it, buffered otherwise, plus a fault-injecting wrapper for tests.
//!
//! The fetcher always asks for page-aligned offsets into page-aligned buffers of whole pages
//! (its slots mirror the file's page layout), so on a local disk every expert read bypasses
//! the page cache. Where O_DIRECT is refused (tmpfs, some network file systems) the reader
//! falls back to buffered reads and counts them, so a report can say so.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::arena::ALIGN;

/// Read bytes of file number `file` at `offset` into `dst`.
pub trait ReadAt: Send + Sync {
    /// Fill `dst` from `offset`, returning how many bytes were read: `dst.len()`, or fewer
    /// only at the end of the file.
    fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> io::Result<usize>;
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
        let aligned = offset % ALIGN as u64 == 0
            && dst.as_ptr() as usize % ALIGN == 0
            && dst.len() % ALIGN == 0;
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
}

impl<R: ReadAt + ?Sized> ReadAt for std::sync::Arc<R> {
    fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        (**self).read_at(file, offset, dst)
    }
}
