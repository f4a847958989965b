//! Where each routed expert's bytes live: a file number and one or more byte extents.
//!
//! This is the fetcher's input type. The stage fills it with
//! [`ExpertTable::from_safetensors`], which reads the shard headers directly (every
//! `...layers.L....experts.E.<tensor>` entry grouped per `(L, E)`, in any shard layout), or
//! with [`ExpertTable::from_packed`] for experts packed over several drive directories
//! (`--experts DIR...`, `k3_model::experts`): one file per directory, one aligned run per
//! expert, in each directory that holds a copy of it ([`Locate::copies`]), or one part of
//! every expert in each directory of a split pack ([`ExpertExtents::parts`]).
//! [`ExpertTable::from_catalog`] builds the same table from `k3_model::locator` (the
//! checkpoint's verified contiguous run per expert, else one read per tensor) for given
//! layers and expert counts; the tests check the two agree.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// An expert table that could not be built: the file or the expert at fault.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error(transparent)]
    Locate(#[from] k3_model::locator::LocateError),
    #[error("layer {layer} expert {expert}: its tensors are in two shards")]
    SplitExpert { layer: usize, expert: usize },
    #[error("{}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Reading the header (`what`: its length, or the header itself).
    #[error("{}: {what}: {source}", path.display())]
    Read {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: header length {len} does not fit the file ({size} bytes)", path.display())]
    HeaderLength { path: PathBuf, len: u64, size: u64 },
    #[error("{}: header JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{}: header is not a JSON object", path.display())]
    NotAnObject { path: PathBuf },
    #[error("{}: tensor {name}: bad data_offsets", path.display())]
    BadOffsets { path: PathBuf, name: String },
    #[error(
        "layer {layer} expert {expert} spans two shards ({} and {})",
        first.display(),
        second.display()
    )]
    TwoShards {
        layer: u32,
        expert: u32,
        first: PathBuf,
        second: PathBuf,
    },
}

/// A byte range of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
}

/// One expert: the file it is in and its extents, ascending and non-overlapping. One extent
/// when the expert's tensors are contiguous (the released checkpoint), several otherwise.
/// An expert split over several files (a split pack) has one extent in `file`'s
/// coordinates, as if it were whole there, and `parts` say where each range of it really is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertExtents {
    pub file: u32,
    pub extents: Vec<Extent>,
    /// Empty: every extent is in `file`. Otherwise the expert's ranges, ascending and
    /// covering its extents, each read from its own file.
    pub parts: Vec<Part>,
}

/// A range `[from, to)` of a split expert (in its [`ExpertExtents`]' coordinates), stored
/// in `file` from byte `offset` on. `from` and `offset` are page-aligned, so a range is
/// read straight into its place in the slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    pub file: u32,
    pub from: u64,
    pub to: u64,
    pub offset: u64,
}

impl ExpertExtents {
    /// A contiguous expert.
    pub fn contiguous(file: u32, offset: u64, len: u64) -> Self {
        ExpertExtents {
            file,
            extents: vec![Extent { offset, len }],
            parts: Vec::new(),
        }
    }

    /// Every file the expert is read from (`file` first).
    pub fn files(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::once(self.file).chain(
            self.parts
                .iter()
                .map(|p| p.file)
                .filter(|&f| f != self.file),
        )
    }

    /// First byte.
    pub fn start(&self) -> u64 {
        self.extents.first().map_or(0, |e| e.offset)
    }

    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.extents.last().map_or(0, |e| e.offset + e.len)
    }

    /// Bytes from the first to the last byte (what a slot must hold, before alignment).
    pub fn span(&self) -> u64 {
        self.end() - self.start()
    }

    /// Bytes that belong to the expert.
    pub fn bytes(&self) -> u64 {
        self.extents.iter().map(|e| e.len).sum()
    }
}

/// Maps `(layer, expert)` to its location.
pub trait Locate: Send + Sync {
    /// The location, or `None` for an expert the model does not have.
    fn locate(&self, layer: u32, expert: u32) -> Option<ExpertExtents>;
    /// Every copy of the expert, [`locate`](Self::locate)'s first (empty for an expert the
    /// model does not have). Copies hold the same bytes in other files (a pack written with
    /// `--copies`), each laid out as the first: the same extents relative to its start, and
    /// the same start within a page.
    fn copies(&self, layer: u32, expert: u32) -> Vec<ExpertExtents> {
        self.locate(layer, expert).into_iter().collect()
    }
    /// The files locations refer to, by number.
    fn files(&self) -> &[PathBuf];
    /// The largest span of any expert (sizes the slots).
    fn max_span(&self) -> u64;
}

/// Tensors of one expert: (name suffix, offset from the expert's first byte, length).
pub type TensorList = Vec<(String, u64, u64)>;

/// A location table in memory.
#[derive(Clone, Debug, Default)]
pub struct ExpertTable {
    files: Vec<PathBuf>,
    map: HashMap<(u32, u32), ExpertExtents>,
    /// Per expert, its tensors: name suffix (e.g. `w1.weight_packed`) -> (offset from the
    /// expert's first byte, length). Filled by `from_safetensors`.
    tensors: HashMap<(u32, u32), TensorList>,
    /// Per expert, its copies after the first ([`Locate::copies`]; `from_packed`).
    more: HashMap<(u32, u32), Vec<ExpertExtents>>,
}

impl ExpertTable {
    /// An empty table over `files`.
    pub fn new(files: Vec<PathBuf>) -> Self {
        ExpertTable {
            files,
            ..Default::default()
        }
    }

    /// Add or replace one expert (dropping its other copies); extents are sorted and
    /// adjacent ones merged.
    pub fn insert(&mut self, layer: u32, expert: u32, mut loc: ExpertExtents) {
        loc.extents.sort_by_key(|e| e.offset);
        let mut merged: Vec<Extent> = Vec::with_capacity(loc.extents.len());
        for e in loc.extents {
            match merged.last_mut() {
                Some(m) if m.offset + m.len == e.offset => m.len += e.len,
                _ => merged.push(e),
            }
        }
        loc.extents = merged;
        self.map.insert((layer, expert), loc);
        self.more.remove(&(layer, expert));
    }

    /// Add another copy of an expert already in the table; refused (false) unless it is
    /// laid out as the first copy (the same extents from its start, the same start within a
    /// page: a slot holds either copy's read the same way).
    pub fn insert_copy(&mut self, layer: u32, expert: u32, loc: ExpertExtents) -> bool {
        let Some(first) = self.map.get(&(layer, expert)) else {
            return false;
        };
        let shape = |l: &ExpertExtents| -> (u64, Vec<(u64, u64)>) {
            let s = l.start();
            let rel = l.extents.iter().map(|e| (e.offset - s, e.len)).collect();
            (s % k3_io::arena::ALIGN as u64, rel)
        };
        if shape(first) != shape(&loc) {
            return false;
        }
        self.more.entry((layer, expert)).or_default().push(loc);
        true
    }

    /// Experts in the table.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when there are no experts.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Every `(layer, expert)` in the table, sorted.
    pub fn keys(&self) -> Vec<(u32, u32)> {
        let mut k: Vec<_> = self.map.keys().copied().collect();
        k.sort_unstable();
        k
    }

    /// The tensors of one expert as `(name suffix, offset from the expert's first byte, len)`,
    /// sorted by offset (only for tables read from safetensors).
    pub fn tensors(&self, layer: u32, expert: u32) -> &[(String, u64, u64)] {
        self.tensors
            .get(&(layer, expert))
            .map_or(&[], |v| v.as_slice())
    }

    /// Every routed expert of `layers` x `0..n_experts` of a catalogued checkpoint, located by
    /// `k3_model::locator`. File numbers are the catalog's shard numbers; the per-tensor
    /// list ([`tensors`](Self::tensors)) holds each part's suffix and offset from the
    /// expert's first byte.
    pub fn from_catalog(
        catalog: &k3_model::catalog::Catalog,
        layers: std::ops::Range<usize>,
        n_experts: usize,
    ) -> Result<ExpertTable, TableError> {
        let files: Vec<PathBuf> = catalog.shards().iter().map(|s| s.path.clone()).collect();
        let mut t = ExpertTable::new(files);
        for layer in layers {
            for expert in 0..n_experts {
                let loc = k3_model::locator::locate_expert(catalog, layer, expert)?;
                let reads = loc.reads();
                let shard = reads[0].shard;
                if reads.iter().any(|r| r.shard != shard) {
                    return Err(TableError::SplitExpert { layer, expert });
                }
                let start = reads.iter().map(|r| r.offset).min().unwrap_or(0);
                let mut parts: TensorList = loc
                    .parts
                    .iter()
                    .map(|p| (p.suffix.to_string(), p.at.offset - start, p.at.len))
                    .collect();
                parts.sort_by_key(|p| p.1);
                let (l, e) = (layer as u32, expert as u32);
                t.tensors.insert((l, e), parts);
                t.insert(
                    l,
                    e,
                    ExpertExtents {
                        file: shard as u32,
                        extents: reads
                            .iter()
                            .map(|r| Extent {
                                offset: r.offset,
                                len: r.len,
                            })
                            .collect(),
                        parts: Vec::new(),
                    },
                );
            }
        }
        Ok(t)
    }

    /// The experts of a pack (`k3_model::experts`): file `s` is stripe `s`'s `experts.bin`,
    /// each expert one contiguous run in it, in every directory that holds a copy (the
    /// lowest stripe's first). Every run starts at an aligned offset, so copies of one
    /// expert are laid out alike. In a split pack each expert is its parts, in the first
    /// part's file's coordinates ([`Part`]).
    pub fn from_packed(p: &k3_model::experts::PackedExperts) -> ExpertTable {
        let mut t = ExpertTable::new(p.files());
        for ((l, e), locs) in p.locations() {
            let (l, e) = (l as u32, e as u32);
            if p.split() {
                // locations() orders the parts by their offset in the expert.
                let Some(first) = locs.first() else {
                    continue;
                };
                let start = first.offset;
                let len: u64 = locs.iter().map(|x| x.length).sum();
                let mut loc = ExpertExtents::contiguous(first.stripe as u32, start, len);
                loc.parts = (locs.iter())
                    .map(|x| Part {
                        file: x.stripe as u32,
                        from: start + x.part_offset,
                        to: start + x.part_offset + x.length,
                        offset: x.offset,
                    })
                    .collect();
                t.insert(l, e, loc);
                continue;
            }
            let mut locs = locs
                .into_iter()
                .map(|x| ExpertExtents::contiguous(x.stripe as u32, x.offset, x.length));
            if let Some(first) = locs.next() {
                t.insert(l, e, first);
            }
            for other in locs {
                t.insert_copy(l, e, other);
            }
        }
        t
    }

    /// Read the headers of safetensors shards and collect every routed expert tensor
    /// (`...layers.<L>....experts.<E>.<rest>`; `shared_experts` are not routed and skipped).
    /// An expert whose tensors sit in two shards is an error naming it.
    pub fn from_safetensors(paths: &[PathBuf]) -> Result<ExpertTable, TableError> {
        let mut t = ExpertTable::new(paths.to_vec());
        type Parts = (u32, Vec<(String, Extent)>);
        let mut parts: HashMap<(u32, u32), Parts> = HashMap::new();
        for (fi, p) in paths.iter().enumerate() {
            let (data_start, header) = read_header(p)?;
            let obj = header
                .as_object()
                .ok_or_else(|| TableError::NotAnObject { path: p.clone() })?;
            for (name, v) in obj {
                if name == "__metadata__" {
                    continue;
                }
                let Some((layer, expert, rest)) = parse_expert_name(name) else {
                    continue;
                };
                let offs = v
                    .get("data_offsets")
                    .and_then(|o| o.as_array())
                    .filter(|a| a.len() == 2)
                    .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
                    .filter(|(a, b)| a <= b)
                    .ok_or_else(|| TableError::BadOffsets {
                        path: p.clone(),
                        name: name.clone(),
                    })?;
                let entry = parts
                    .entry((layer, expert))
                    .or_insert_with(|| (fi as u32, Vec::new()));
                if entry.0 != fi as u32 {
                    return Err(TableError::TwoShards {
                        layer,
                        expert,
                        first: paths[entry.0 as usize].clone(),
                        second: p.clone(),
                    });
                }
                entry.1.push((
                    rest,
                    Extent {
                        offset: data_start + offs.0,
                        len: offs.1 - offs.0,
                    },
                ));
            }
        }
        for ((l, e), (fi, mut ts)) in parts {
            ts.sort_by_key(|(_, x)| x.offset);
            let start = ts[0].1.offset;
            t.tensors.insert(
                (l, e),
                ts.iter()
                    .map(|(n, x)| (n.clone(), x.offset - start, x.len))
                    .collect(),
            );
            t.insert(
                l,
                e,
                ExpertExtents {
                    file: fi,
                    extents: ts.into_iter().map(|(_, x)| x).collect(),
                    parts: Vec::new(),
                },
            );
        }
        Ok(t)
    }
}

impl Locate for ExpertTable {
    fn locate(&self, layer: u32, expert: u32) -> Option<ExpertExtents> {
        self.map.get(&(layer, expert)).cloned()
    }
    fn copies(&self, layer: u32, expert: u32) -> Vec<ExpertExtents> {
        let mut out: Vec<ExpertExtents> = self.locate(layer, expert).into_iter().collect();
        if let Some(more) = self.more.get(&(layer, expert)) {
            out.extend(more.iter().cloned());
        }
        out
    }
    fn files(&self) -> &[PathBuf] {
        &self.files
    }
    fn max_span(&self) -> u64 {
        self.map.values().map(|l| l.span()).max().unwrap_or(0)
    }
}

/// `(layer, expert, rest)` of a routed-expert tensor name.
#[doc(hidden)]
pub fn parse_expert_name(name: &str) -> Option<(u32, u32, String)> {
    let (l, e, rest) = k3_model::classify::split_expert(name)?;
    Some((l as u32, e as u32, rest.to_string()))
}

/// `(absolute offset of the data section, header JSON)` of a safetensors file.
fn read_header(p: &Path) -> Result<(u64, serde_json::Value), TableError> {
    let path = || p.to_path_buf();
    let read = |what| {
        move |source| TableError::Read {
            path: path(),
            what,
            source,
        }
    };
    let mut f = std::fs::File::open(p).map_err(|source| TableError::Open {
        path: path(),
        source,
    })?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(read("header length"))?;
    let n = u64::from_le_bytes(n);
    let size = f.metadata().map(|m| m.len()).unwrap_or(0);
    if n > 100 << 20 || 8 + n > size {
        return Err(TableError::HeaderLength {
            path: path(),
            len: n,
            size,
        });
    }
    let mut h = vec![0u8; n as usize];
    f.read_exact(&mut h).map_err(read("header"))?;
    let v = serde_json::from_slice(&h).map_err(|source| TableError::Json {
        path: path(),
        source,
    })?;
    Ok((8 + n, v))
}
