//! Single-process weight reader: every shard memory-mapped read-only, tensors borrowed
//! straight from the mappings. Implements [`WeightSource`] for the forward pass when no
//! staged pipeline is in use (tests, tiny models, the `generate` path on a machine whose
//! page cache can hold what it touches).

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use crate::catalog::{Catalog, CatalogError, TensorEntry};
use crate::tensor::{TensorRef, WeightError, WeightSource};

/// A [`Catalog`] plus a read-only mapping of each of its shards.
pub struct MmapWeights {
    catalog: Catalog,
    /// Each mapping watched for SIGBUS (dropped before the mappings).
    _watched: Vec<crate::mapfault::Watched>,
    maps: Vec<Mmap>,
}

impl std::fmt::Debug for MmapWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmapWeights")
            .field("catalog", &self.catalog)
            .finish()
    }
}

impl MmapWeights {
    /// Catalog `path` (see [`Catalog::open`]) and map its shards.
    pub fn open(path: impl AsRef<Path>) -> Result<MmapWeights, CatalogError> {
        Self::from_catalog(Catalog::open(path)?)
    }

    /// Map the shards of an existing catalog.
    pub fn from_catalog(catalog: Catalog) -> Result<MmapWeights, CatalogError> {
        let mut maps = Vec::with_capacity(catalog.shards().len());
        let mut watched = Vec::with_capacity(catalog.shards().len());
        for s in catalog.shards() {
            let err = |m: String| CatalogError {
                file: s.path.clone(),
                tensor: None,
                msg: m,
            };
            let f = File::open(&s.path).map_err(|e| err(format!("cannot open: {e}")))?;
            // SAFETY: the mapping is read-only and private to this process. Checkpoint files
            // are treated as immutable while the engine runs; if another process truncated
            // or rewrote a shard meanwhile, reads could fault or see new bytes. We check the
            // size now so a shard already shorter than its header promises is an error, not
            // a SIGBUS. A shard that shrinks later is reported by `mapfault`'s SIGBUS
            // handler (the file named, exit 1) instead of ending the process silently.
            let m = unsafe { Mmap::map(&f) }.map_err(|e| err(format!("cannot mmap: {e}")))?;
            if (m.len() as u64) < s.data_end {
                return Err(err(format!(
                    "file is {} bytes now but its tensors end at {}",
                    m.len(),
                    s.data_end
                )));
            }
            watched.push(crate::mapfault::watch(m.as_ptr(), m.len(), &s.path));
            maps.push(m);
        }
        Ok(MmapWeights {
            catalog,
            _watched: watched,
            maps,
        })
    }

    /// The catalog behind the mappings.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// The bytes of a catalog entry (which must come from this reader's catalog).
    pub fn bytes(&self, e: &TensorEntry<'_>) -> &[u8] {
        &self.maps[e.shard][e.offset as usize..e.end() as usize]
    }

    /// Prefault the page tables of the tensors `keep` selects (by name), shard by shard in
    /// file order, with `MADV_POPULATE_READ` (Linux 5.14+): what llama.cpp gets from
    /// `MAP_POPULATE`, for only the tensors a run multiplies every token. A tensor that is
    /// not in the page cache is read from disk here. Without it the first forward takes a
    /// page fault per 64 KiB of weights it touches (the slice's 16-token prompt spent about
    /// 0.2 s of its 1.2 s in them). Returns the bytes covered; an error (an older kernel
    /// without the advice) leaves the mapping as it was, so callers may ignore it.
    pub fn populate(&self, keep: impl Fn(&str) -> bool) -> std::io::Result<u64> {
        const PAGE: u64 = 4096;
        // Page-aligned ranges per shard, adjacent ones merged.
        let mut ranges: Vec<Vec<(u64, u64)>> = vec![Vec::new(); self.maps.len()];
        for (name, e) in self.catalog.iter() {
            if e.len == 0 || !keep(&name) {
                continue;
            }
            let (a, b) = (e.offset / PAGE * PAGE, e.end().div_ceil(PAGE) * PAGE);
            let b = b.min(self.maps[e.shard].len() as u64);
            ranges[e.shard].push((a, b));
        }
        let mut total = 0;
        for (shard, rs) in ranges.iter_mut().enumerate() {
            rs.sort_unstable();
            let mut merged: Vec<(u64, u64)> = Vec::new();
            for &(a, b) in rs.iter() {
                match merged.last_mut() {
                    Some(last) if a <= last.1 => last.1 = last.1.max(b),
                    _ => merged.push((a, b)),
                }
            }
            for (a, b) in merged {
                self.maps[shard].advise_range(
                    memmap2::Advice::PopulateRead,
                    a as usize,
                    (b - a) as usize,
                )?;
                total += b - a;
            }
        }
        Ok(total)
    }

    /// The bytes of shard `shard` in `[offset, offset + len)`, or `None` when out of range.
    pub fn shard_bytes(&self, shard: usize, offset: u64, len: u64) -> Option<&[u8]> {
        let m = self.maps.get(shard)?;
        let end = offset.checked_add(len)?;
        m.get(usize::try_from(offset).ok()?..usize::try_from(end).ok()?)
    }
}

impl WeightSource for MmapWeights {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        let e = self
            .catalog
            .get(name)
            .ok_or_else(|| WeightError::Missing(name.to_string()))?;
        Ok(TensorRef {
            dtype: e.dtype,
            shape: e.shape,
            bytes: self.bytes(&e),
        })
    }

    fn contains(&self, name: &str) -> bool {
        self.catalog.contains(name)
    }
}
