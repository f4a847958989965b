//! The packed routed experts: `experts.json` + `experts.bin` in each of one or more
//! directories, each meant to be on its own drive (written by `k3-orch pack-experts`, read
//! by the expert-fetcher stage with `--experts DIR...`).
//!
//! Every routed expert of the checkpoint is one run in one directory's `experts.bin`: its
//! tensors (the codes and scales of w1, w2 and w3, or the three plain matrices) copied byte
//! for byte from the shard where they already sit back to back, so the expert keeps the
//! layout the catalog gives it (each tensor's offset from the expert's first byte is the
//! same in the pack as in the shard, and compute binds it unchanged). Each run starts at a
//! multiple of [`EXPERTS_ALIGN`] and is zero-padded to the next one, so an expert is one
//! aligned O_DIRECT read. The experts are striped over the directories balanced by bytes
//! ([`stripe`]: in (layer, expert) order, each to the directory holding the fewest bytes so
//! far), so the experts of one router decision spread over every drive. A pack may hold
//! each expert in several directories (`pack-experts --copies N`, [`stripe_copies`]): the
//! fetcher then reads each expert from whichever of its drives is least busy with the
//! layer's reads, so no drive reads much more than its share of a layer (twice the space
//! for two copies). Or a pack may split every expert over the directories
//! (`pack-experts --split`, [`split_runs`], format [`EXPERTS_FORMAT_SPLIT`]): part `k` of
//! the `n` page-aligned parts of expert `j` goes to directory `(j + k) mod n`, so every
//! expert is read from every drive at once and each drive reads its share of each layer
//! (whole experts striped leave the busiest drive about 1.2 times its share of a layer's 16,
//! and a layer waits for its last expert), in the same space as plain stripes.
//!
//! Each directory's manifest lists its own experts (layer, expert, offset, length, where
//! they came from, a sha256 for `--verify`), its place among the directories (`stripe` of
//! `stripes`), the copies of each expert, the pack's id (one digest of the whole plan, the
//! same in every directory of one pack) and the identity of the checkpoint
//! ([`SourceIdentity`]). [`PackedExperts::open`] reads every directory given, in any order,
//! and refuses a set that is not exactly one whole pack; [`PackedExperts::check_against`]
//! refuses a pack of another checkpoint, or whose expert table does not match the
//! checkpoint's headers.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::catalog::Catalog;
use crate::trunk::{align_up, SourceError, SourceIdentity};

/// The `format` string of a pack of whole experts (striped, or with copies).
pub const EXPERTS_FORMAT: &str = "k3-experts/1";
/// The `format` string of a pack whose experts are split over the directories (`split`):
/// a build that knows only whole experts refuses it by this string.
pub const EXPERTS_FORMAT_SPLIT: &str = "k3-experts/2";
/// Alignment of every run's start and padded length in `experts.bin`.
pub const EXPERTS_ALIGN: u64 = 4096;
/// File name of the manifest inside each packed directory (the pack's commit marker).
pub const EXPERTS_JSON: &str = "experts.json";
/// File name of the packed data inside each packed directory.
pub const EXPERTS_BIN: &str = "experts.bin";

/// One directory's `experts.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertsManifest {
    /// [`EXPERTS_FORMAT`].
    pub format: String,
    /// [`EXPERTS_ALIGN`].
    pub align: u64,
    /// The pack's id: a sha256 over the format, the source identity and the whole plan
    /// (every directory's experts and offsets), the same in every directory of one pack.
    pub pack_id: String,
    /// This directory's place among the pack's directories (0-based).
    pub stripe: usize,
    /// How many directories the pack has.
    pub stripes: usize,
    /// Distinct experts in the whole pack (every directory together).
    pub total_experts: usize,
    /// In how many directories each expert is (its copies, in distinct directories; 1 when
    /// the field is absent, as in packs written before copies existed).
    #[serde(default = "one_copy")]
    pub copies: usize,
    /// Every expert split into page-aligned parts, one per directory (`pack-experts
    /// --split`): each entry of `experts` is then one part (`part_offset`). Absent: whole
    /// experts.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub split: bool,
    /// The data file, relative to the manifest's directory ([`EXPERTS_BIN`]).
    pub file: String,
    /// Exact size of the data file in bytes.
    pub file_size: u64,
    /// Payload bytes of this directory's runs (without padding).
    pub total_bytes: u64,
    /// The checkpoint the experts were packed from.
    pub source: SourceIdentity,
    /// This directory's experts, in file order.
    pub experts: Vec<PackedExpert>,
}

fn one_copy() -> usize {
    1
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One expert's run in `experts.bin`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackedExpert {
    pub layer: usize,
    pub expert: usize,
    /// Byte offset of the run in `experts.bin` (a multiple of `align`).
    pub offset: u64,
    /// Payload bytes of the run (the expert's tensors back to back); the bytes after it up
    /// to the next multiple of `align` are zero.
    pub length: u64,
    /// Shard file the run was copied from.
    pub shard: String,
    /// Absolute byte offset of the run in that shard file.
    pub source_offset: u64,
    /// sha256 of the `length` payload bytes, lower-case hex (`pack-experts --verify`).
    pub sha256: String,
    /// In a split pack, where this part starts in the expert's bytes (a multiple of
    /// [`EXPERTS_ALIGN`]; `source_offset` is already the part's own). 0 for whole experts.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub part_offset: u64,
}

impl PackedExpert {
    /// `length` rounded up to the alignment: the bytes one aligned read takes.
    pub fn padded_length(&self) -> u64 {
        align_up(self.length, EXPERTS_ALIGN)
    }
}

/// One routed expert of a checkpoint as one run of a shard (see [`expert_runs`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertRun {
    pub layer: usize,
    pub expert: usize,
    /// Index into [`Catalog::shards`].
    pub shard: usize,
    /// Absolute byte offset of the run in the shard.
    pub source_offset: u64,
    pub length: u64,
}

/// A checkpoint whose experts cannot be packed as runs.
#[derive(Debug, thiserror::Error)]
pub enum ExpertRunError {
    #[error("{}: no routed-expert tensors (...experts.<e>.w1...) found", model.display())]
    NoExperts { model: PathBuf },
    #[error("layer {layer} expert {expert}: its tensors are in {count} shards ({names}); it cannot be one run")]
    Shards {
        layer: usize,
        expert: usize,
        count: usize,
        names: String,
    },
    #[error(
        "layer {layer} expert {expert} is not contiguous in {shard}: {gap} bytes of gap or \
         overlap inside its {span}-byte span; copying the span would drag other tensors along"
    )]
    Gap {
        layer: usize,
        expert: usize,
        shard: String,
        gap: u64,
        span: u64,
    },
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Every routed expert of `cat` as one run, sorted by (layer, expert). An expert whose
/// tensors are in two shards, or leave a gap (or overlap), is refused and named.
pub fn expert_runs(cat: &Catalog) -> Result<Vec<ExpertRun>, ExpertRunError> {
    // Per (layer, expert): each tensor's (shard, offset, length).
    type Parts = Vec<(usize, u64, u64)>;
    let mut parts: BTreeMap<(usize, usize), Parts> = BTreeMap::new();
    for (name, e) in cat.iter() {
        if let Some((l, x, _)) = crate::classify::split_expert(&name) {
            parts
                .entry((l, x))
                .or_default()
                .push((e.shard, e.offset, e.len));
        }
    }
    if parts.is_empty() {
        return Err(ExpertRunError::NoExperts {
            model: cat.source().to_path_buf(),
        });
    }
    let shards = cat.shards();
    let mut out = Vec::with_capacity(parts.len());
    for ((layer, expert), mut ts) in parts {
        let mut sh: Vec<usize> = ts.iter().map(|t| t.0).collect();
        sh.sort_unstable();
        sh.dedup();
        if sh.len() != 1 {
            let names: Vec<String> = sh.iter().map(|&s| file_name(&shards[s].path)).collect();
            return Err(ExpertRunError::Shards {
                layer,
                expert,
                count: sh.len(),
                names: names.join(", "),
            });
        }
        ts.sort_by_key(|t| t.1);
        let lo = ts[0].1;
        let hi = ts.iter().map(|t| t.1 + t.2).max().unwrap_or(lo);
        let covered: u64 = ts.iter().map(|t| t.2).sum();
        let tiles = ts.windows(2).all(|w| w[0].1 + w[0].2 == w[1].1);
        if !tiles || covered != hi - lo {
            return Err(ExpertRunError::Gap {
                layer,
                expert,
                shard: file_name(&shards[sh[0]].path),
                gap: (hi - lo).abs_diff(covered),
                span: hi - lo,
            });
        }
        out.push(ExpertRun {
            layer,
            expert,
            shard: sh[0],
            source_offset: lo,
            length: hi - lo,
        });
    }
    Ok(out)
}

/// Stripe `runs` (in their order) over `n` directories balanced by bytes: each run goes to
/// the directory holding the fewest bytes so far (the first of those on a tie), so equal
/// experts go round-robin and consecutive experts of a layer land on different drives.
/// Returns, per directory, the indices into `runs` in file order.
pub fn stripe(runs: &[ExpertRun], n: usize) -> Vec<Vec<usize>> {
    let n = n.max(1);
    let mut out = vec![Vec::new(); n];
    let mut bytes = vec![0u64; n];
    for (i, r) in runs.iter().enumerate() {
        let d = (0..n).min_by_key(|&d| (bytes[d], d)).unwrap_or(0);
        bytes[d] += align_up(r.length, EXPERTS_ALIGN);
        out[d].push(i);
    }
    out
}

/// Lay `runs` (in their order) out over `n` directories with each run in `copies` of them
/// (distinct directories; `copies` is clamped to 1..=n): per directory, the indices into
/// `runs` in file order. One copy is [`stripe`]. With more, run `i` goes to the set of
/// `copies` directories holding the fewest bytes together, a tie going to the set that comes
/// first counting from set `i` in the sets' lexicographic cycle. Equal runs thus take every
/// set in turn: each directory holds the same bytes within a run, and every pair of
/// directories shares experts, so a layer's reads can be spread over all the drives
/// (`k3_expert_fetcher` reads each expert from whichever of its drives has the fewest of the
/// batch's bytes). Two copies over four directories cycle through all six pairs.
pub fn stripe_copies(runs: &[ExpertRun], n: usize, copies: usize) -> Vec<Vec<usize>> {
    let n = n.max(1);
    let c = copies.clamp(1, n);
    if c == 1 {
        return stripe(runs, n);
    }
    let sets = subsets(n, c);
    let mut out = vec![Vec::new(); n];
    let mut bytes = vec![0u64; n];
    for (i, r) in runs.iter().enumerate() {
        let k = sets.len();
        let pick = (0..k)
            .min_by_key(|&j| {
                let held: u64 = sets[j].iter().map(|&d| bytes[d]).sum();
                (held, (j + k - i % k) % k)
            })
            .unwrap_or(0);
        for &d in &sets[pick] {
            bytes[d] += align_up(r.length, EXPERTS_ALIGN);
            out[d].push(i);
        }
    }
    out
}

/// Every `c`-element subset of `0..n`, ascending, in lexicographic order.
fn subsets(n: usize, c: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let mut cur: Vec<usize> = (0..c).collect();
    loop {
        out.push(cur.clone());
        // The rightmost element that can still move right, then the rest right after it.
        let Some(i) = (0..c).rev().find(|&i| cur[i] < n - c + i) else {
            return out;
        };
        cur[i] += 1;
        for j in i + 1..c {
            cur[j] = cur[j - 1] + 1;
        }
    }
}

/// One part of an expert in a split pack ([`split_runs`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunPart {
    /// Index into the runs.
    pub run: usize,
    /// Where the part starts in the expert's bytes (a multiple of [`EXPERTS_ALIGN`]).
    pub from: u64,
    /// Payload bytes of the part.
    pub length: u64,
}

/// Split every run (in their order) into `n` page-aligned parts of nearly equal size (the
/// last shorter; fewer parts for an expert under `n` pages), part `k` of run `j` to
/// directory `(j + k) mod n`, so the shorter last parts rotate over the directories. Returns,
/// per directory, its parts in file order.
pub fn split_runs(runs: &[ExpertRun], n: usize) -> Vec<Vec<RunPart>> {
    let n = n.max(1);
    let mut out = vec![Vec::new(); n];
    for (j, r) in runs.iter().enumerate() {
        let part = align_up(r.length.div_ceil(n as u64), EXPERTS_ALIGN).max(EXPERTS_ALIGN);
        for k in 0..n {
            let from = k as u64 * part;
            if from >= r.length {
                break;
            }
            out[(j + k) % n].push(RunPart {
                run: j,
                from,
                length: part.min(r.length - from),
            });
        }
    }
    out
}

/// A manifest that cannot be used: the file and every problem found.
#[derive(Debug, thiserror::Error)]
#[error("{}: {}", path.display(), problems.join("; "))]
pub struct ManifestError {
    pub path: PathBuf,
    pub problems: Vec<String>,
}

/// Why a set of packed directories cannot serve this model.
#[derive(Debug, thiserror::Error)]
pub enum ExpertsError {
    #[error("{}: no such directory", dir.display())]
    NoDir { dir: PathBuf },
    #[error(
        "{}: no {EXPERTS_JSON}: not a packed experts directory, or its pack did not finish \
         (run k3-orch pack-experts MODEL_DIR --to DIR...)",
        dir.display()
    )]
    NoManifest { dir: PathBuf },
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error(
        "{} and {} are from different packs (pack ids {} and {}); give the directories of one \
         pack-experts run",
        a.display(), b.display(), short(a_id), short(b_id)
    )]
    OtherPack {
        a: PathBuf,
        a_id: String,
        b: PathBuf,
        b_id: String,
    },
    #[error("{} and {} hold the same stripe {stripe} of the pack", a.display(), b.display())]
    SameStripe {
        stripe: usize,
        a: PathBuf,
        b: PathBuf,
    },
    #[error(
        "the pack has {stripes} directories; {} {} not given (each holds its share of the \
         experts: give every directory of the pack)",
        if missing.len() == 1 { "stripe" } else { "stripes" },
        missing.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", ")
    )]
    MissingStripes { stripes: usize, missing: Vec<usize> },
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(
        "the packed experts were packed from another checkpoint (or this one changed since): \
         {}; re-run k3-orch pack-experts --force",
        diffs.join("; ")
    )]
    OtherCheckpoint { diffs: Vec<String> },
    #[error(
        "the packed experts' table does not match the checkpoint's headers ({count} \
         difference(s)): {}; re-run k3-orch pack-experts --force",
        diffs.join("; ")
    )]
    TableDiffers { count: usize, diffs: Vec<String> },
}

/// What is wrong with a split expert's parts `xs` against its run `r` (named `who`, from
/// the shard file `shard`): they must tile the run's bytes in order, each part's source
/// being the run's at the part's offset.
fn split_differs(who: &str, r: &ExpertRun, shard: &str, xs: &mut [&PackedExpert]) -> Vec<String> {
    xs.sort_by_key(|x| x.part_offset);
    let mut at = 0u64;
    for x in xs.iter() {
        if x.part_offset != at
            || x.shard != shard
            || x.source_offset != r.source_offset + x.part_offset
        {
            return vec![format!(
                "{who}: its part at {} ({} bytes at {}+{}) does not continue its {}-byte run \
                 at {shard}+{} from byte {at}",
                x.part_offset, x.length, x.shard, x.source_offset, r.length, r.source_offset
            )];
        }
        at += x.length;
    }
    if at != r.length {
        return vec![format!(
            "{who}: its parts hold {at} bytes of its {}-byte run",
            r.length
        )];
    }
    Vec::new()
}

fn short(h: &str) -> &str {
    h.get(..12).unwrap_or(h)
}

impl ExpertsManifest {
    /// Read and validate `<dir>/experts.json`, and check `experts.bin` has `file_size` bytes.
    pub fn load_dir(dir: impl AsRef<Path>) -> Result<ExpertsManifest, ExpertsError> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(ExpertsError::NoDir {
                dir: dir.to_path_buf(),
            });
        }
        let path = dir.join(EXPERTS_JSON);
        let err = |p: String| ManifestError {
            path: path.clone(),
            problems: vec![p],
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ExpertsError::NoManifest {
                    dir: dir.to_path_buf(),
                })
            }
            Err(e) => return Err(err(format!("cannot read ({e})")).into()),
        };
        let m = ExpertsManifest::from_json_str(&text).map_err(|mut e| {
            e.path = path.clone();
            e
        })?;
        let bin = dir.join(&m.file);
        let size = std::fs::metadata(&bin)
            .map_err(|e| err(format!("{}: {e}", bin.display())))?
            .len();
        if size != m.file_size {
            return Err(err(format!(
                "{} is {size} bytes but the manifest says {} (truncated or replaced; re-run \
                 pack-experts)",
                bin.display(),
                m.file_size
            ))
            .into());
        }
        Ok(m)
    }

    /// Parse and validate a manifest (no file access). A manifest of another format
    /// version is refused by its `format` alone, before its fields are read.
    pub fn from_json_str(text: &str) -> Result<ExpertsManifest, ManifestError> {
        #[derive(Deserialize)]
        struct Format {
            format: Option<serde_json::Value>,
        }
        let err = |problems| ManifestError {
            path: PathBuf::from(EXPERTS_JSON),
            problems,
        };
        if let Ok(Format { format: Some(f) }) = serde_json::from_str::<Format>(text) {
            if f.as_str() != Some(EXPERTS_FORMAT) && f.as_str() != Some(EXPERTS_FORMAT_SPLIT) {
                return Err(err(vec![format!(
                    "these experts were packed in format {f}, this build reads \
                     {EXPERTS_FORMAT:?} and {EXPERTS_FORMAT_SPLIT:?} only: re-run k3-orch \
                     pack-experts --force"
                )]));
            }
        }
        let m: ExpertsManifest = serde_json::from_str(text)
            .map_err(|e| err(vec![format!("not a valid experts manifest: {e}")]))?;
        let problems = m.problems();
        if problems.is_empty() {
            Ok(m)
        } else {
            Err(err(problems))
        }
    }

    /// Every inconsistency in the manifest (empty when it is valid; at most a few per kind).
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        let want = if self.split {
            EXPERTS_FORMAT_SPLIT
        } else {
            EXPERTS_FORMAT
        };
        if self.format != want {
            p.push(format!(
                "format is {:?}, a {} pack is {want:?}",
                self.format,
                if self.split { "split" } else { "whole-expert" }
            ));
        }
        if self.split && self.copies != 1 {
            p.push(format!("a split pack has one copy, not {}", self.copies));
        }
        if self.align != EXPERTS_ALIGN {
            p.push(format!("align {} is not {EXPERTS_ALIGN}", self.align));
            return p;
        }
        if !crate::trunk::plain_file_name(&self.file) {
            p.push(format!("file {:?} is not a plain file name", self.file));
        }
        if self.stripes == 0 || self.stripe >= self.stripes {
            p.push(format!(
                "stripe {} of {} is not a place among the directories",
                self.stripe, self.stripes
            ));
        }
        if self.copies == 0 || self.copies > self.stripes.max(1) {
            p.push(format!(
                "copies {} is not between 1 and the {} directories",
                self.copies, self.stripes
            ));
        }
        if !crate::trunk::hex_sha256(&self.pack_id) {
            p.push("pack_id is not 64 hex digits".into());
        }
        if self.experts.len() > self.total_experts {
            p.push(format!(
                "{} experts listed, more than the pack's {}",
                self.experts.len(),
                self.total_experts
            ));
        }
        let mut end = 0u64;
        let mut total = 0u64;
        let mut seen = std::collections::HashSet::new();
        let mut bad = Vec::new();
        for x in &self.experts {
            let who = format!("layer {} expert {}", x.layer, x.expert);
            if !seen.insert((x.layer, x.expert)) {
                bad.push(format!("{who} is listed twice"));
            }
            if x.offset % self.align != 0 {
                bad.push(format!("{who}: offset {} is not aligned", x.offset));
            }
            if x.part_offset % self.align != 0 || (x.part_offset != 0 && !self.split) {
                bad.push(format!(
                    "{who}: part_offset {} in a {} pack",
                    x.part_offset,
                    if self.split {
                        "split, not aligned,"
                    } else {
                        "whole-expert"
                    }
                ));
            }
            if x.offset < end {
                bad.push(format!(
                    "{who}: offset {} overlaps the run before it (ends {end})",
                    x.offset
                ));
            }
            if x.length == 0 {
                bad.push(format!("{who}: empty run"));
            }
            if !crate::trunk::hex_sha256(&x.sha256) {
                bad.push(format!("{who}: sha256 is not 64 hex digits"));
            }
            end = x.offset.saturating_add(x.padded_length());
            total = total.saturating_add(x.length);
        }
        let n = bad.len();
        p.extend(bad.into_iter().take(3));
        if n > 3 {
            p.push(format!("{} more expert problems", n - 3));
        }
        if end != self.file_size {
            p.push(format!(
                "file_size {} is not the end of the last run ({end})",
                self.file_size
            ));
        }
        if total != self.total_bytes {
            p.push(format!(
                "total_bytes {} is not the sum of the runs ({total})",
                self.total_bytes
            ));
        }
        p
    }
}

/// Where one packed expert is: the directory (by stripe) and its run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedLoc {
    pub stripe: usize,
    pub offset: u64,
    pub length: u64,
    /// Where the run starts in the expert's bytes: 0, except for the parts of a split pack.
    pub part_offset: u64,
}

/// Every directory of one pack, by stripe (see [`PackedExperts::open`]).
#[derive(Clone, Debug)]
pub struct PackedExperts {
    /// The directories, indexed by stripe.
    pub dirs: Vec<PathBuf>,
    /// Their manifests, indexed by stripe.
    pub manifests: Vec<ExpertsManifest>,
}

impl PackedExperts {
    /// Read the manifest of every directory in `dirs` (any order) and check they are the
    /// whole of one pack: one pack id, every stripe exactly once.
    pub fn open(dirs: &[PathBuf]) -> Result<PackedExperts, ExpertsError> {
        let mut by: BTreeMap<usize, (PathBuf, ExpertsManifest)> = BTreeMap::new();
        let mut first: Option<(PathBuf, String, usize)> = None;
        for d in dirs {
            let m = ExpertsManifest::load_dir(d)?;
            match &first {
                Some((a, id, n)) if *id != m.pack_id || *n != m.stripes => {
                    return Err(ExpertsError::OtherPack {
                        a: a.clone(),
                        a_id: id.clone(),
                        b: d.clone(),
                        b_id: m.pack_id,
                    })
                }
                Some(_) => {}
                None => first = Some((d.clone(), m.pack_id.clone(), m.stripes)),
            }
            if let Some((a, _)) = by.get(&m.stripe) {
                return Err(ExpertsError::SameStripe {
                    stripe: m.stripe,
                    a: a.clone(),
                    b: d.clone(),
                });
            }
            by.insert(m.stripe, (d.clone(), m));
        }
        let stripes = first.as_ref().map_or(0, |f| f.2);
        let missing: Vec<usize> = (0..stripes).filter(|s| !by.contains_key(s)).collect();
        if !missing.is_empty() || stripes == 0 {
            return Err(ExpertsError::MissingStripes { stripes, missing });
        }
        let (dirs, manifests) = by.into_values().unzip();
        Ok(PackedExperts { dirs, manifests })
    }

    /// The data files, indexed by stripe.
    pub fn files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .zip(&self.manifests)
            .map(|(d, m)| d.join(&m.file))
            .collect()
    }

    /// Every packed expert and where its copies are, by stripe (one location each when
    /// the pack has one copy), or in a split pack its parts, in the expert's byte order.
    pub fn locations(&self) -> HashMap<(usize, usize), Vec<PackedLoc>> {
        let mut out: HashMap<(usize, usize), Vec<PackedLoc>> = HashMap::new();
        for (stripe, m) in self.manifests.iter().enumerate() {
            for x in &m.experts {
                out.entry((x.layer, x.expert)).or_default().push(PackedLoc {
                    stripe,
                    offset: x.offset,
                    length: x.length,
                    part_offset: x.part_offset,
                });
            }
        }
        for locs in out.values_mut() {
            locs.sort_by_key(|l| (l.part_offset, l.stripe));
        }
        out
    }

    /// Whether every expert is split over the directories (`pack-experts --split`).
    pub fn split(&self) -> bool {
        self.manifests[0].split
    }

    /// In how many directories each expert is.
    pub fn copies(&self) -> usize {
        self.manifests[0].copies
    }

    /// Payload bytes in each directory, by stripe.
    pub fn stripe_bytes(&self) -> Vec<u64> {
        self.manifests.iter().map(|m| m.total_bytes).collect()
    }

    /// Check the pack against the checkpoint in `cat` before using it: the checkpoint's
    /// identity ([`SourceIdentity::of`]: reads every shard's header and a few samples of
    /// its data), then [`check_layout`](Self::check_layout).
    pub fn check_against(&self, cat: &Catalog) -> Result<(), ExpertsError> {
        let now = SourceIdentity::of(cat)?;
        let diffs = self.manifests[0].source.diffs(&now);
        if !diffs.is_empty() {
            return Err(ExpertsError::OtherCheckpoint { diffs });
        }
        self.check_layout(cat)
    }

    /// Check the expert table against the checkpoint's headers alone (no data read): every
    /// routed expert of the checkpoint packed exactly `copies` times (in as many
    /// directories: a directory lists an expert once), each copy with its run's length and
    /// source, and nothing else. Every stripe must also name the same source and copies.
    pub fn check_layout(&self, cat: &Catalog) -> Result<(), ExpertsError> {
        let mut diffs = Vec::new();
        let first = &self.manifests[0];
        for (s, m) in self.manifests.iter().enumerate().skip(1) {
            if m.source != first.source || m.copies != first.copies || m.split != first.split {
                diffs.push(format!(
                    "{} names another source checkpoint or copy count than {}",
                    self.dirs[s].display(),
                    self.dirs[0].display()
                ));
            }
        }
        let copies = first.copies;
        let total: usize = self.manifests.iter().map(|m| m.experts.len()).sum();
        if !first.split && total != first.total_experts * copies {
            diffs.push(format!(
                "the directories list {total} experts, the pack says {} x {copies} copies",
                first.total_experts
            ));
        }
        let mut packed: HashMap<(usize, usize), Vec<&PackedExpert>> = HashMap::new();
        for m in &self.manifests {
            for x in &m.experts {
                packed.entry((x.layer, x.expert)).or_default().push(x);
            }
        }
        match expert_runs(cat) {
            Ok(runs) => {
                for r in &runs {
                    let shard = file_name(&cat.shards()[r.shard].path);
                    let who = format!("layer {} expert {}", r.layer, r.expert);
                    let mut xs = packed.remove(&(r.layer, r.expert)).unwrap_or_default();
                    if first.split {
                        diffs.extend(split_differs(&who, r, &shard, &mut xs));
                        continue;
                    }
                    if xs.len() != copies {
                        diffs.push(format!(
                            "{who} is in {} of the directories, the pack says {copies}",
                            xs.len()
                        ));
                    }
                    for x in xs.into_iter().filter(|x| {
                        x.length != r.length
                            || x.shard != shard
                            || x.source_offset != r.source_offset
                    }) {
                        diffs.push(format!(
                            "{who} is {} bytes at {shard}+{} in the checkpoint, the pack says \
                             {} bytes at {}+{}",
                            r.length, r.source_offset, x.length, x.shard, x.source_offset
                        ));
                    }
                }
                let mut extra: Vec<_> = packed.keys().copied().collect();
                extra.sort_unstable();
                for (l, e) in extra {
                    diffs.push(format!(
                        "layer {l} expert {e} is in the pack, not in the checkpoint"
                    ));
                }
            }
            Err(e) => diffs.push(e.to_string()),
        }
        if diffs.is_empty() {
            return Ok(());
        }
        let count = diffs.len();
        diffs.truncate(5);
        Err(ExpertsError::TableDiffers { count, diffs })
    }
}
