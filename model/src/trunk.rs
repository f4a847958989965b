//! The packed trunk: `trunk.json`, the manifest of `trunk.bin` (written by
//! `k3-orch pack-trunk`, read by the trunk-loader stage).
//!
//! `trunk.bin` holds each decoder layer's non-expert tensors ("trunk") as one run copied
//! byte for byte from its shard. Every run starts at a multiple of [`TRUNK_ALIGN`] and is
//! followed by zero padding to the next multiple, so a layer is one aligned O_DIRECT read of
//! `[offset, offset + padded_length)` that never runs past the file. Inside a run the
//! tensors keep their shard order; each tensor's `offset` is relative to the run start.
//!
//! The manifest also records the identity of the checkpoint it was packed from (payload
//! total and every shard's file size) so a trunk packed from another checkpoint, or from
//! one that changed since, is detected ([`TrunkManifest::check_source`]), and a sha256 per
//! layer so `pack-trunk --verify` can prove the bytes.
//!
//! ```no_run
//! use k3_model::trunk::TrunkManifest;
//! let m = TrunkManifest::load_dir("k3trunk").unwrap();
//! let l0 = &m.layers[0];
//! println!("layer 0: {} bytes at {}", l0.length, l0.offset);
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::tensor::Dtype;

/// The `format` string of the current manifest version.
pub const TRUNK_FORMAT: &str = "k3-trunk/1";
/// Alignment of every run's start and padded length in `trunk.bin`.
pub const TRUNK_ALIGN: u64 = 4096;
/// File name of the manifest inside the trunk directory.
pub const TRUNK_JSON: &str = "trunk.json";
/// File name of the packed data inside the trunk directory.
pub const TRUNK_BIN: &str = "trunk.bin";

/// `trunk.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrunkManifest {
    /// [`TRUNK_FORMAT`].
    pub format: String,
    /// [`TRUNK_ALIGN`] (4096).
    pub align: u64,
    /// The data file, relative to the manifest's directory ([`TRUNK_BIN`]).
    pub file: String,
    /// Exact size of the data file in bytes.
    pub file_size: u64,
    /// Sum of every layer's `length` (payload bytes, without padding).
    pub total_bytes: u64,
    /// The largest `length` of any layer (the size a streaming slot must hold).
    pub max_run: u64,
    /// The layer with that largest run.
    pub max_run_layer: usize,
    /// The checkpoint this trunk was packed from.
    pub source: SourceIdentity,
    /// One entry per decoder layer, in layer order 0..n.
    pub layers: Vec<TrunkLayer>,
}

/// What identifies the source checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceIdentity {
    /// `metadata.total_size` of the index (tensor payload bytes of the whole checkpoint).
    pub total_size: u64,
    /// Every shard file of the checkpoint with its size in bytes, sorted by file name.
    pub shards: Vec<ShardIdentity>,
}

/// One shard file and its size.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ShardIdentity {
    pub file: String,
    pub size: u64,
}

/// One layer's run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrunkLayer {
    /// Decoder layer index (0-based).
    pub layer: usize,
    /// Byte offset of the run in `trunk.bin` (a multiple of `align`).
    pub offset: u64,
    /// Payload bytes of the run.
    pub length: u64,
    /// `length` rounded up to `align`; the bytes after `length` are zero.
    pub padded_length: u64,
    /// Shard file the run was copied from.
    pub shard: String,
    /// Absolute byte offset of the run in that shard file.
    pub source_offset: u64,
    /// sha256 of the `length` payload bytes, lower-case hex.
    pub sha256: String,
    /// The layer's tensors, in run order.
    pub tensors: Vec<TrunkTensor>,
}

/// One tensor inside a run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrunkTensor {
    /// Full released name (`language_model.model.layers.<l>....`).
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte offset relative to the start of the run.
    pub offset: u64,
    /// Byte length (= dtype size × shape product).
    pub len: u64,
}

/// A manifest that cannot be used: the file and every problem found, one per line.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {}", problems.join("\n  "))]
pub struct TrunkError {
    pub path: PathBuf,
    pub problems: Vec<String>,
}

/// Round `x` up to a multiple of `a` (a power of two).
pub fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

impl TrunkManifest {
    /// Read and validate `<dir>/trunk.json`, and check `trunk.bin` has `file_size` bytes.
    pub fn load_dir(dir: impl AsRef<Path>) -> Result<TrunkManifest, TrunkError> {
        let dir = dir.as_ref();
        let path = dir.join(TRUNK_JSON);
        let err = |p: String| TrunkError {
            path: path.clone(),
            problems: vec![p],
        };
        let text = std::fs::read_to_string(&path).map_err(|e| {
            err(format!(
                "cannot read ({e}); a packed trunk directory holds trunk.json and trunk.bin \
                 (k3-orch pack-trunk MODEL_DIR TRUNK_DIR)"
            ))
        })?;
        let m = TrunkManifest::from_json_str(&text).map_err(|mut e| {
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
                 pack-trunk)",
                bin.display(),
                m.file_size
            )));
        }
        Ok(m)
    }

    /// Parse and validate a manifest (no file access).
    pub fn from_json_str(text: &str) -> Result<TrunkManifest, TrunkError> {
        let m: TrunkManifest = serde_json::from_str(text).map_err(|e| TrunkError {
            path: PathBuf::from(TRUNK_JSON),
            problems: vec![format!("not a valid trunk manifest: {e}")],
        })?;
        let problems = m.problems();
        if problems.is_empty() {
            Ok(m)
        } else {
            Err(TrunkError {
                path: PathBuf::from(TRUNK_JSON),
                problems,
            })
        }
    }

    /// Every inconsistency in the manifest (empty when it is valid).
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.format != TRUNK_FORMAT {
            p.push(format!(
                "format is {:?}, this build reads {TRUNK_FORMAT:?}",
                self.format
            ));
        }
        if self.align == 0 || !self.align.is_power_of_two() {
            p.push(format!("align {} is not a power of two", self.align));
            return p;
        }
        if self.file.is_empty() || self.file.contains('/') {
            p.push(format!("file {:?} is not a plain file name", self.file));
        }
        let mut end = 0u64;
        let mut total = 0u64;
        let mut max = (0u64, 0usize);
        for (i, l) in self.layers.iter().enumerate() {
            let who = format!("layer {}", l.layer);
            if l.layer != i {
                p.push(format!(
                    "{who} is entry {i}; layers must be listed 0, 1, 2, ..."
                ));
            }
            if l.offset % self.align != 0 {
                p.push(format!(
                    "{who}: offset {} is not {}-aligned",
                    l.offset, self.align
                ));
            }
            if l.padded_length != align_up(l.length, self.align) {
                p.push(format!(
                    "{who}: padded_length {} is not length {} rounded up to {}",
                    l.padded_length, l.length, self.align
                ));
            }
            if l.offset < end {
                p.push(format!(
                    "{who}: offset {} overlaps the previous run (ends {end})",
                    l.offset
                ));
            }
            end = l.offset.saturating_add(l.padded_length);
            if end > self.file_size {
                p.push(format!(
                    "{who}: run ends at {end}, past file_size {}",
                    self.file_size
                ));
            }
            if l.sha256.len() != 64 || !l.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                p.push(format!("{who}: sha256 is not 64 hex digits"));
            }
            total = total.saturating_add(l.length);
            if l.length > max.0 {
                max = (l.length, l.layer);
            }
            let mut t_end = 0u64;
            let mut covered = 0u64;
            for t in &l.tensors {
                let numel = t
                    .shape
                    .iter()
                    .try_fold(1u64, |a, &d| a.checked_mul(d as u64));
                let want = numel.and_then(|n| n.checked_mul(t.dtype.size() as u64));
                if want != Some(t.len) {
                    p.push(format!(
                        "{who}: tensor {}: len {} is not {} × {:?}",
                        t.name, t.len, t.dtype, t.shape
                    ));
                }
                if t.offset < t_end {
                    p.push(format!(
                        "{who}: tensor {} overlaps the tensor before it",
                        t.name
                    ));
                }
                t_end = t.offset.saturating_add(t.len);
                covered = covered.saturating_add(t.len);
                if t_end > l.length {
                    p.push(format!(
                        "{who}: tensor {} ends at {t_end}, past the run length {}",
                        t.name, l.length
                    ));
                }
            }
            if covered != l.length {
                p.push(format!(
                    "{who}: tensors cover {covered} of the run's {} bytes",
                    l.length
                ));
            }
        }
        if end != self.file_size && !self.layers.is_empty() {
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
        if !self.layers.is_empty() && (max.0 != self.max_run || max.1 != self.max_run_layer) {
            p.push(format!(
                "max_run {} (layer {}) is not the largest run {} (layer {})",
                self.max_run, self.max_run_layer, max.0, max.1
            ));
        }
        p
    }

    /// Number of layers packed.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Refuse a trunk packed from another checkpoint: `current` is the identity of the
    /// checkpoint about to be used (see [`SourceIdentity`]). The error names what differs.
    pub fn check_source(&self, current: &SourceIdentity) -> Result<(), String> {
        let mut diffs = Vec::new();
        if self.source.total_size != current.total_size {
            diffs.push(format!(
                "index total_size {} now, {} when packed",
                current.total_size, self.source.total_size
            ));
        }
        let was: BTreeMap<&str, u64> = self
            .source
            .shards
            .iter()
            .map(|s| (s.file.as_str(), s.size))
            .collect();
        let now: BTreeMap<&str, u64> = current
            .shards
            .iter()
            .map(|s| (s.file.as_str(), s.size))
            .collect();
        for (f, sz) in &now {
            match was.get(f) {
                None => diffs.push(format!("{f} was not in the packed checkpoint")),
                Some(w) if w != sz => diffs.push(format!("{f} is {sz} bytes, was {w}")),
                _ => {}
            }
        }
        for f in was.keys() {
            if !now.contains_key(f) {
                diffs.push(format!("{f} is gone"));
            }
        }
        if diffs.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "the trunk is stale (packed from another checkpoint): {}; re-run pack-trunk",
                diffs.join("; ")
            ))
        }
    }

    /// The tensor `name` of layer `layer`, if packed.
    pub fn tensor(&self, layer: usize, name: &str) -> Option<&TrunkTensor> {
        self.layers
            .get(layer)?
            .tensors
            .iter()
            .find(|t| t.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> TrunkManifest {
        let t = |name: &str, off: u64| TrunkTensor {
            name: name.into(),
            dtype: Dtype::BF16,
            shape: vec![2, 3],
            offset: off,
            len: 12,
        };
        TrunkManifest {
            format: TRUNK_FORMAT.into(),
            align: 4096,
            file: TRUNK_BIN.into(),
            file_size: 8192,
            total_bytes: 36,
            max_run: 24,
            max_run_layer: 0,
            source: SourceIdentity {
                total_size: 100,
                shards: vec![ShardIdentity {
                    file: "a".into(),
                    size: 10,
                }],
            },
            layers: vec![
                TrunkLayer {
                    layer: 0,
                    offset: 0,
                    length: 24,
                    padded_length: 4096,
                    shard: "a".into(),
                    source_offset: 8,
                    sha256: "0".repeat(64),
                    tensors: vec![t("x", 0), t("y", 12)],
                },
                TrunkLayer {
                    layer: 1,
                    offset: 4096,
                    length: 12,
                    padded_length: 4096,
                    shard: "a".into(),
                    source_offset: 8,
                    sha256: "0".repeat(64),
                    tensors: vec![t("z", 0)],
                },
            ],
        }
    }

    #[test]
    fn valid_manifest_round_trips() {
        let m = sample();
        let text = serde_json::to_string(&m).unwrap();
        assert_eq!(TrunkManifest::from_json_str(&text).unwrap(), m);
    }

    /// Each corruption a careless writer could make is named.
    #[test]
    fn inconsistencies_are_named() {
        let mut m = sample();
        m.layers[1].offset = 100; // unaligned and overlapping
        let p = m.problems().join("\n");
        assert!(p.contains("not 4096-aligned"), "{p}");
        assert!(p.contains("overlaps the previous run"), "{p}");

        let mut m = sample();
        m.layers[0].tensors[1].len = 10;
        let p = m.problems().join("\n");
        assert!(p.contains("tensor y: len 10"), "{p}");

        let mut m = sample();
        m.max_run = 12;
        assert!(m.problems().join("\n").contains("max_run"));

        let mut m = sample();
        m.file_size = 4096;
        assert!(m.problems().join("\n").contains("past file_size"));
    }

    #[test]
    fn stale_source_is_detected() {
        let m = sample();
        assert!(m.check_source(&m.source.clone()).is_ok());
        let mut other = m.source.clone();
        other.shards[0].size = 11;
        let e = m.check_source(&other).unwrap_err();
        assert!(e.contains("a is 11 bytes, was 10"), "{e}");
    }
}
