//! Identical files on several drives read as one ([`Spread`]): copies of the packed trunk
//! (`--trunk DIR,COPY,...`), read by the trunk-loader for the trunk's parts and by compute
//! for the coded lm_head the trunk carries.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use crate::direct::{ReadAt, READ_CHUNK};

/// Identical files read as one: a read at `offset` goes to file `(offset / READ_CHUNK) %
/// n`. [`crate::direct::read_parallel`] cuts a read into [`READ_CHUNK`] pieces read side by
/// side, so consecutive pieces go to consecutive files: copies on several drives read each
/// span at their summed rate. The caller checks the bytes as before (the trunk's CRCs),
/// whichever copy they came from. A piece whose read fails (an I/O error, or fewer bytes
/// than another copy holds there) is read from the other copies in turn, with a warning
/// naming the copy the first time; the error is returned only when every copy fails. A
/// caller whose bytes fail their check calls [`ReadAt::next_copy`] and reads them again:
/// every piece then comes from another copy than before.
pub struct Spread {
    inner: Arc<dyn ReadAt>,
    files: u32,
    /// What the files are, for the warnings ("trunk copy", "coded lm_head: trunk copy").
    what: &'static str,
    /// Copies that failed a read (warned once each).
    failed: Mutex<Vec<u32>>,
    /// Added to each piece's copy ([`ReadAt::next_copy`]: after a piece failed its check).
    turn: AtomicU32,
}

impl Spread {
    /// Over files `0..files` of `inner` (at least one), copies of `what`.
    pub fn new(inner: Arc<dyn ReadAt>, files: u32, what: &'static str) -> Spread {
        Spread {
            inner,
            files: files.max(1),
            what,
            failed: Mutex::new(Vec::new()),
            turn: AtomicU32::new(0),
        }
    }

    fn warn(&self, file: u32, offset: u64, why: &str) {
        let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if !f.contains(&file) {
            f.push(file);
            tracing::warn!(
                "{} {file} (in --trunk's order, from 0): {why} at byte {offset}; reading its \
                 pieces from the other copies",
                self.what
            );
        }
    }
}

impl ReadAt for Spread {
    fn copies(&self) -> u32 {
        self.files
    }

    fn next_copy(&self) {
        self.turn.fetch_add(1, Ordering::Relaxed);
    }

    fn read_at(&self, _file: u32, offset: u64, dst: &mut [u8]) -> std::io::Result<usize> {
        let turn = self.turn.load(Ordering::Relaxed) as u64;
        let first = ((offset / READ_CHUNK as u64 + turn) % self.files as u64) as u32;
        // The longest short read so far (a file's true end, or a copy that lost its tail),
        // the copy `dst` holds now, and the first error.
        let (mut short, mut held, mut err) = (None::<(u32, usize)>, None::<u32>, None);
        for k in 0..self.files {
            let f = (first + k) % self.files;
            match self.inner.read_at(f, offset, dst) {
                Ok(n) if n == dst.len() => {
                    if let Some((g, m)) = short {
                        self.warn(g, offset, &format!("a short read ({m} of {n} bytes)"));
                    }
                    return Ok(n);
                }
                Ok(n) => {
                    held = Some(f);
                    if short.is_none_or(|(_, m)| n > m) {
                        short = Some((f, n));
                    }
                }
                Err(e) => {
                    self.warn(f, offset, &e.to_string());
                    err.get_or_insert(e);
                }
            }
        }
        match (short, err) {
            // Every copy ends here (or the longest is the best there is): its bytes.
            (Some((f, n)), _) if held == Some(f) => Ok(n),
            (Some((f, _)), _) => self.inner.read_at(f, offset, dst),
            (None, Some(e)) => Err(e),
            (None, None) => Err(std::io::Error::other(format!("no {}", self.what))),
        }
    }
}

/// The reader of one file and its copies on other drives: the file itself, or a [`Spread`]
/// over all of them.
pub fn open_copies(
    paths: &[std::path::PathBuf],
    what: &'static str,
) -> std::io::Result<Arc<dyn ReadAt>> {
    let direct = crate::DirectFiles::open(paths)?;
    Ok(match paths.len() {
        1 => Arc::new(direct),
        n => Arc::new(Spread::new(Arc::new(direct), n as u32, what)),
    })
}
