//! Device bandwidth the way the fetcher reads: large random O_DIRECT reads from one file at a
//! given queue depth (that many threads, each with one read outstanding).
//!
//! `dd` measures one sequential stream at queue depth 1; the expert path is random 17.55 MB
//! reads, up to 16 outstanding, and on network storage the two differ several-fold. When the
//! file system refuses O_DIRECT the reads are buffered and the result says so: a buffered
//! figure on a file that is in the page cache measures memory, not the disk.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::arena::{align_down, align_up, ArenaMemory, OwnedArena, ALIGN};

/// Why a measurement failed; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum DevbwError {
    #[error("{}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {size} bytes is smaller than one {read_bytes}-byte read", path.display())]
    TooSmall {
        path: PathBuf,
        size: u64,
        read_bytes: u64,
    },
    #[error("{}: read at {offset}: {source}", path.display())]
    Read {
        path: PathBuf,
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Arena {
        path: PathBuf,
        #[source]
        source: crate::arena::ArenaError,
    },
    #[error("{}: a reader thread panicked", path.display())]
    Panicked { path: PathBuf },
    #[error("{}: O_DIRECT refused, the page cache would be measured", path.display())]
    NotDirect { path: PathBuf },
}

/// One measurement.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct DevbwResult {
    /// Bytes per read (page-rounded).
    pub read_bytes: u64,
    /// Threads, each with one read outstanding.
    pub queue_depth: usize,
    pub reads: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// False when O_DIRECT was refused and the reads went through the page cache.
    pub direct: bool,
}

impl DevbwResult {
    /// MB/s (10^6 bytes per second).
    pub fn mb_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / 1e6 / self.seconds
        } else {
            0.0
        }
    }
}

fn open(path: &Path) -> std::io::Result<(File, bool)> {
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => Ok((f, true)),
        Err(_) => Ok((File::open(path)?, false)),
    }
}

/// The drive under `path` in bytes per second, as a stage reads it: [`measure`] with reads
/// of `read_bytes` cut to the file's whole pages, refused ([`DevbwError::NotDirect`]) when
/// O_DIRECT is (the page cache would be measured instead of the drive), and
/// [`DevbwError::TooSmall`] for a file under one page. What the run's plan (a coded trunk's
/// drive) and `project` (the drives of a model) both measure.
pub fn direct_bytes_per_s(
    path: &Path,
    read_bytes: u64,
    queue_depth: usize,
    seconds: f64,
) -> Result<f64, DevbwError> {
    let size = std::fs::metadata(path)
        .map_err(|source| DevbwError::Open {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    let rb = read_bytes.min(align_down(size));
    if rb == 0 {
        return Err(DevbwError::TooSmall {
            path: path.to_path_buf(),
            size,
            read_bytes: ALIGN as u64,
        });
    }
    let r = measure(path, rb, queue_depth, seconds)?;
    if !r.direct {
        return Err(DevbwError::NotDirect {
            path: path.to_path_buf(),
        });
    }
    Ok(r.mb_per_s() * 1e6)
}

/// Random reads of `read_bytes` at `queue_depth` for about `seconds` (at least one read per
/// thread). Offsets are page-aligned, uniformly spread over the file, and drawn from a fixed
/// seed so two runs read the same places.
pub fn measure(
    path: &Path,
    read_bytes: u64,
    queue_depth: usize,
    seconds: f64,
) -> Result<DevbwResult, DevbwError> {
    let opened = |source| DevbwError::Open {
        path: path.to_path_buf(),
        source,
    };
    let arena = |source| DevbwError::Arena {
        path: path.to_path_buf(),
        source,
    };
    let size = std::fs::metadata(path).map_err(opened)?.len();
    let rb = align_up(read_bytes.max(1));
    if size < rb {
        return Err(DevbwError::TooSmall {
            path: path.to_path_buf(),
            size,
            read_bytes: rb,
        });
    }
    let (probe, mut direct) = open(path).map_err(opened)?;
    // Probe once: some file systems accept O_DIRECT at open and refuse it at read time.
    if direct {
        let buf = OwnedArena::new(ALIGN).map_err(arena)?;
        // SAFETY: the arena owns ALIGN bytes; nothing else touches them.
        let dst = unsafe { std::slice::from_raw_parts_mut(buf.base(), ALIGN) };
        if probe.read_at(dst, 0).is_err() {
            direct = false;
        }
    }
    let file = Arc::new(if direct {
        probe
    } else {
        File::open(path).map_err(opened)?
    });
    let span = align_down(size - rb) / ALIGN as u64 + 1; // possible page-aligned offsets
    let qd = queue_depth.max(1);
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let threads: Vec<_> = (0..qd)
        .map(|t| {
            let file = Arc::clone(&file);
            let stop = Arc::clone(&stop);
            let path = path.to_path_buf();
            std::thread::spawn(move || -> Result<(u64, u64), DevbwError> {
                let buf = OwnedArena::new(rb as usize).map_err(|source| DevbwError::Arena {
                    path: path.clone(),
                    source,
                })?;
                // SAFETY: this thread owns the arena; rb bytes are allocated.
                let dst = unsafe { std::slice::from_raw_parts_mut(buf.base(), rb as usize) };
                let mut x =
                    0x9E37_79B9_7F4A_7C15u64 ^ (t as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                let (mut reads, mut bytes) = (0u64, 0u64);
                loop {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let off = (x % span) * ALIGN as u64;
                    let mut got = 0usize;
                    while got < dst.len() {
                        match file.read_at(&mut dst[got..], off + got as u64) {
                            Ok(0) => break,
                            Ok(n) => got += n,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(source) => {
                                return Err(DevbwError::Read {
                                    path,
                                    offset: off,
                                    source,
                                })
                            }
                        }
                    }
                    reads += 1;
                    bytes += got as u64;
                    if stop.load(Ordering::Relaxed) {
                        return Ok((reads, bytes));
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs_f64(seconds.max(0.0)));
    stop.store(true, Ordering::Relaxed);
    let (mut reads, mut bytes) = (0u64, 0u64);
    let mut err = None;
    for t in threads {
        match t.join() {
            Ok(Ok((r, b))) => {
                reads += r;
                bytes += b;
            }
            Ok(Err(e)) => err = Some(e),
            Err(_) => {
                err = Some(DevbwError::Panicked {
                    path: path.to_path_buf(),
                })
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    if let Some(e) = err {
        return Err(e);
    }
    Ok(DevbwResult {
        read_bytes: rb,
        queue_depth: qd,
        reads,
        bytes,
        seconds: secs,
        direct,
    })
}

/// The standard table: 16 MiB and one Kimi K3 expert (17,547,264 bytes), QD 1 and 16.
pub fn standard_cells() -> Vec<(u64, usize)> {
    vec![
        (16 << 20, 1),
        (16 << 20, 16),
        (17_547_264, 1),
        (17_547_264, 16),
    ]
}

/// Render results as a table.
pub fn render(path: &Path, results: &[DevbwResult]) -> String {
    let mut s = String::new();
    let direct = results.iter().all(|r| r.direct);
    s.push_str(&format!(
        "devbw: {} ({})\n",
        path.display(),
        if direct {
            "O_DIRECT, page cache bypassed"
        } else {
            "BUFFERED: O_DIRECT was refused, so cached pages may inflate these figures"
        }
    ));
    s.push_str(&format!(
        "{:<16}{:>4}{:>8}{:>10}{:>10}\n",
        "READ", "QD", "READS", "SECONDS", "MB/s"
    ));
    for r in results {
        let label = if r.read_bytes % (1 << 20) == 0 {
            format!("{} MiB", r.read_bytes >> 20)
        } else {
            format!("{} B", r.read_bytes)
        };
        s.push_str(&format!(
            "{:<16}{:>4}{:>8}{:>10.2}{:>10.0}\n",
            label,
            r.queue_depth,
            r.reads,
            r.seconds,
            r.mb_per_s()
        ));
    }
    s
}
