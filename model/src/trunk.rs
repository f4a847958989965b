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
//! total, every shard's file size and the sha256 of every shard's header bytes) so a trunk
//! packed from another checkpoint, or from one that changed since, is detected
//! ([`TrunkManifest::check_source`], [`TrunkManifest::check_against`]); a sha256 per layer
//! so `pack-trunk --verify` can prove the bytes; and a CRC-32C per [`CHECK_CHUNK`] bytes of
//! every run, which the trunk-loader checks on every read ([`RunCheck`]).
//!
//! A **coded** trunk (`pack-trunk --codec NAME`, format [`TRUNK_CODED_FORMAT`]) keeps this
//! manifest as it is, describing the runs as a raw `trunk.bin` would hold them (the
//! layout the loader plans its slots for), and adds [`TrunkManifest::codec`]: the codec,
//! the stored file (`trunk.k3z`, which replaces `trunk.bin`) and, per layer, its stored
//! extent and its chunks of [`CODEC_CHUNK`] decoded bytes, each independently decodable,
//! with the CRC-32C of its stored and of its decoded bytes ([`TrunkCodec`],
//! `k3_model::codec_trunk` reads it). A build that predates codecs reads only
//! [`TRUNK_FORMAT`] and refuses the coded format by name; this one refuses a codec in a
//! manifest of the raw format.
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
/// (`k3-trunk/2`: shard header digests in `source`, per-chunk CRC-32 in every layer;
/// `k3-trunk/3`: also a CRC-32C per [`CHECK_CHUNK`] of every tensor, so a part of a layer
/// read on its own is checked too.)
pub const TRUNK_FORMAT: &str = "k3-trunk/3";
/// The `format` string of a coded trunk's manifest (one with a [`TrunkManifest::codec`]).
pub const TRUNK_CODED_FORMAT: &str = "k3-trunk-coded/1";
/// Decoded bytes per chunk of a coded trunk (the last chunk of a run may be shorter): a
/// multiple of [`CHECK_CHUNK`] that divides the loader's read pieces.
pub const CODEC_CHUNK: u64 = 4 << 20;
/// File name of a coded trunk's stored data.
pub const CODED_BIN: &str = "trunk.k3z";
/// Bytes covered by one entry of [`TrunkLayer::crc32`] (the last chunk of a run may be
/// shorter).
pub const CHECK_CHUNK: u64 = 1 << 20;
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
    /// A coded trunk: how its runs are stored (absent in a raw trunk, whose manifest is
    /// byte for byte what it was before codecs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub codec: Option<TrunkCodec>,
}

/// How a coded trunk stores its runs: `file` holds each layer's chunks, each chunk's
/// stored bytes starting on an `align` boundary (so every chunk is one O_DIRECT read).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrunkCodec {
    /// The codec's name (`k3_model::codec::Codec::name`).
    pub name: String,
    /// Decoded bytes per chunk ([`CODEC_CHUNK`]).
    pub chunk: u64,
    /// The stored data file, relative to the manifest ([`CODED_BIN`]).
    pub file: String,
    /// Exact size of that file.
    pub file_size: u64,
    /// Sum of every chunk's stored bytes (without the alignment padding).
    pub stored_bytes: u64,
    /// One per layer, in layer order (the same layers as [`TrunkManifest::layers`]).
    pub layers: Vec<CodedLayer>,
    /// The checkpoint's lm_head coded too, for a run that streams it (absent: the lm_head is
    /// read raw from the checkpoint; a reader that does not know this field reads it so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<CodedHead>,
}

/// File name of a coded trunk's lm_head.
pub const CODED_HEAD_BIN: &str = "lm_head.k3z";

/// The checkpoint's lm_head (a `[rows, cols]` BF16 matrix), coded in chunks of whole rows
/// in a file of its own ([`CODED_HEAD_BIN`]), so that a run which streams the lm_head every
/// token reads its stored bytes instead of the raw ones. Chunk `i` decodes to rows
/// `[i * chunk_rows, min((i + 1) * chunk_rows, rows))`, each chunk's stored bytes on an
/// `align` boundary of the file (one O_DIRECT read each).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodedHead {
    /// The checkpoint tensor (`classify::LM_HEAD`), its dtype and `[rows, cols]` shape.
    pub tensor: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Rows per chunk (their bytes at most [`CODEC_CHUNK`]).
    pub chunk_rows: u64,
    /// The stored data file, relative to the manifest ([`CODED_HEAD_BIN`]).
    pub file: String,
    /// Exact size of that file.
    pub file_size: u64,
    /// Sum of every chunk's stored bytes (without the alignment padding).
    pub stored_bytes: u64,
    /// sha256 of the raw tensor bytes (what `--verify` compares the decoded chunks with).
    pub sha256: String,
    /// The chunks, `offset` relative to the start of `file`.
    pub chunks: Vec<CodedChunk>,
}

impl CodedHead {
    /// Bytes of one row (saturating: the manifest check refuses a row that large).
    pub fn row_bytes(&self) -> u64 {
        let cols = self.shape.get(1).map_or(0, |&c| c as u64);
        cols.saturating_mul(self.dtype.size() as u64)
    }

    /// Rows of the matrix.
    pub fn rows(&self) -> u64 {
        self.shape.first().map_or(0, |&r| r as u64)
    }

    /// The chunks covering rows `[r0, r1)` (`r0` a multiple of `chunk_rows`).
    pub fn chunks_of(&self, r0: u64, r1: u64) -> std::ops::Range<usize> {
        let cr = self.chunk_rows.max(1);
        (r0 / cr) as usize..(r1.div_ceil(cr) as usize).min(self.chunks.len())
    }

    /// Stored bytes of the chunks covering rows `[r0, rows)`.
    pub fn stored_from(&self, r0: u64) -> u64 {
        let k = self.chunks_of(r0, self.rows());
        self.chunks[k].iter().map(|c| c.stored).sum()
    }
}

/// One layer's stored run: raw `length` (its [`TrunkLayer`]) in, `stored_length` out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodedLayer {
    pub layer: usize,
    /// Offset of the layer's first chunk in the stored file (a multiple of `align`).
    pub offset: u64,
    /// Bytes from `offset` to the end of the last chunk.
    pub stored_length: u64,
    /// `stored_length` rounded up to `align` (zero padding).
    pub padded_length: u64,
    /// The chunks: chunk `i` decodes to bytes `[i * chunk, i * chunk + raw)` of the run.
    pub chunks: Vec<CodedChunk>,
}

/// One independently decodable chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodedChunk {
    /// Its first stored byte, relative to the layer's `offset` (a multiple of `align`).
    pub offset: u64,
    /// Stored bytes.
    pub stored: u64,
    /// Decoded bytes.
    pub raw: u64,
    /// CRC-32C of the stored bytes (checked before decoding).
    pub crc32_stored: u32,
    /// CRC-32C of the decoded bytes (checked after).
    pub crc32_raw: u32,
}

/// What identifies the source checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceIdentity {
    /// `metadata.total_size` of the index (tensor payload bytes of the whole checkpoint).
    pub total_size: u64,
    /// Every shard file of the checkpoint with its size in bytes, sorted by file name.
    pub shards: Vec<ShardIdentity>,
}

/// One shard file: its size, the sha256 of its header bytes (the 8-byte length and the JSON
/// header: every tensor's name, dtype, shape and offsets) and the sha256 of a sample of its
/// data (two checkpoints of one layout have identical headers), lower-case hex.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ShardIdentity {
    pub file: String,
    pub size: u64,
    pub header_sha256: String,
    /// sha256 of [`SAMPLES`] reads of [`SAMPLE_BYTES`] spread evenly over the data region
    /// (the whole region when it is smaller than that).
    pub sample_sha256: String,
}

/// Data samples per shard in [`ShardIdentity::sample_sha256`].
pub const SAMPLES: u64 = 16;
/// Bytes per data sample.
pub const SAMPLE_BYTES: u64 = 4096;

impl SourceIdentity {
    /// The identity of the checkpoint `cat` was opened from: reads every shard's header
    /// bytes (`data_start` bytes per shard; kilobytes to a few megabytes in all).
    pub fn of(cat: &crate::catalog::Catalog) -> Result<SourceIdentity, SourceError> {
        use sha2::{Digest, Sha256};
        use std::io::Read;
        let mut shards = Vec::with_capacity(cat.shards().len());
        for s in cat.shards() {
            let file = s
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let mut head = Vec::new();
            let io = |what: &'static str| {
                let path = s.path.clone();
                move |source| SourceError::Io { path, what, source }
            };
            std::fs::File::open(&s.path)
                .and_then(|f| f.take(s.data_start).read_to_end(&mut head))
                .map_err(io("reading its header"))?;
            if head.len() as u64 != s.data_start {
                return Err(SourceError::ShortHeader {
                    path: s.path.clone(),
                    header: s.data_start,
                    read: head.len(),
                });
            }
            let sample_sha256 = sample_digest(&s.path, s.data_start, s.file_size)
                .map_err(io("reading a data sample"))?;
            shards.push(ShardIdentity {
                file,
                size: s.file_size,
                header_sha256: hex(&Sha256::digest(&head)),
                sample_sha256,
            });
        }
        shards.sort();
        Ok(SourceIdentity {
            total_size: cat
                .index_total_size()
                .unwrap_or_else(|| cat.payload_bytes()),
            shards,
        })
    }

    /// What differs between this identity (a checkpoint when something was packed from it)
    /// and `current` (the checkpoint now), at most three items and a count of the rest;
    /// empty when they are the same checkpoint.
    pub fn diffs(&self, current: &SourceIdentity) -> Vec<String> {
        let mut diffs = Vec::new();
        if self.total_size != current.total_size {
            diffs.push(format!(
                "index total_size {} now, {} when packed",
                current.total_size, self.total_size
            ));
        }
        let was: BTreeMap<&str, &ShardIdentity> =
            self.shards.iter().map(|s| (s.file.as_str(), s)).collect();
        for s in &current.shards {
            match was.get(s.file.as_str()) {
                None => diffs.push(format!("{} was not in the packed checkpoint", s.file)),
                Some(w) if w.size != s.size => {
                    diffs.push(format!("{} is {} bytes, was {}", s.file, s.size, w.size))
                }
                Some(w) if w.header_sha256 != s.header_sha256 => diffs.push(format!(
                    "{}: its header differs (sha256 {} now, {} when packed)",
                    s.file,
                    short(&s.header_sha256),
                    short(&w.header_sha256)
                )),
                Some(w) if w.sample_sha256 != s.sample_sha256 => diffs.push(format!(
                    "{}: same header, other data (sample sha256 {} now, {} when packed)",
                    s.file,
                    short(&s.sample_sha256),
                    short(&w.sample_sha256)
                )),
                _ => {}
            }
        }
        for f in was.keys() {
            if !current.shards.iter().any(|s| s.file == *f) {
                diffs.push(format!("{f} is gone"));
            }
        }
        let n = diffs.len();
        if n > 3 {
            diffs.truncate(3);
            diffs.push(format!("{} more", n - 3));
        }
        diffs
    }
}

/// sha256 of [`SAMPLES`] × [`SAMPLE_BYTES`] of `[start, end)` of the file, evenly spaced
/// (the whole range when it is shorter).
fn sample_digest(path: &Path, start: u64, end: u64) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path)?;
    let len = end.saturating_sub(start);
    let mut h = Sha256::new();
    if len <= SAMPLES * SAMPLE_BYTES {
        let mut buf = vec![0u8; len as usize];
        f.read_exact_at(&mut buf, start)?;
        h.update(&buf);
    } else {
        let mut buf = vec![0u8; SAMPLE_BYTES as usize];
        for k in 0..SAMPLES {
            let off = start + (len - SAMPLE_BYTES) * k / (SAMPLES - 1);
            f.read_exact_at(&mut buf, off)?;
            h.update(&buf);
        }
    }
    Ok(hex(&h.finalize()))
}

fn short(h: &str) -> &str {
    h.get(..12).unwrap_or(h)
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The CRC-32C of every [`CHECK_CHUNK`] bytes of `payload` (what [`TrunkLayer::crc32`]
/// holds), through the `crc32c` crate (the SSE4.2 / ARMv8 CRC instructions where the CPU has
/// them, detected at run time).
pub fn chunk_crcs(payload: &[u8]) -> Vec<u32> {
    payload
        .chunks(CHECK_CHUNK as usize)
        .map(crc32c::crc32c)
        .collect()
}

/// What a reader needs to check one layer's run as it reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunCheck {
    pub layer: usize,
    /// Offset of the run in `trunk.bin` (for the message).
    pub offset: u64,
    /// Payload bytes.
    pub length: u64,
    /// [`TrunkLayer::crc32`], or a tensor's [`TrunkTensor::crc32`].
    pub crc32: Vec<u32>,
    /// `Some(name)`: the check of one tensor (`offset` and the chunks are the tensor's),
    /// not of the layer's whole run.
    pub tensor: Option<String>,
}

impl RunCheck {
    /// Check `payload` (the run's bytes, at least `length` of them) against the CRCs; the
    /// error names the layer and the `trunk.bin` offset of the first chunk that differs.
    pub fn check(&self, payload: &[u8]) -> Result<(), CheckError> {
        if (payload.len() as u64) < self.length {
            return Err(CheckError::Short {
                layer: self.layer,
                read: payload.len(),
                length: self.length,
            });
        }
        self.check_range(0, payload)
    }

    /// Check the bytes of the run from byte `at` on (`at` a multiple of [`CHECK_CHUNK`];
    /// bytes past the run's `length` are ignored), so a reader can check a run piece by
    /// piece as the pieces land. A piece must end on a chunk boundary or at the run's end.
    pub fn check_range(&self, at: u64, bytes: &[u8]) -> Result<(), CheckError> {
        if !at.is_multiple_of(CHECK_CHUNK) {
            return Err(CheckError::Unaligned { at });
        }
        let n = (bytes.len() as u64).min(self.length.saturating_sub(at)) as usize;
        let first = (at / CHECK_CHUNK) as usize;
        for (i, c) in bytes[..n].chunks(CHECK_CHUNK as usize).enumerate() {
            let k = first + i;
            let at = k as u64 * CHECK_CHUNK;
            let whole = (CHECK_CHUNK).min(self.length - at) as usize;
            if c.len() != whole || self.crc32.get(k) != Some(&crc32c::crc32c(c)) {
                return Err(CheckError::Mismatch {
                    offset: self.offset + at,
                    layer: self.layer,
                    bytes: c.len(),
                    at,
                    tensor: self.tensor.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Bytes read from `trunk.bin` that are not what was packed ([`RunCheck`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    #[error("trunk layer {layer}: {read} bytes read, the run has {length}")]
    Short {
        layer: usize,
        read: usize,
        length: u64,
    },
    /// A caller checked from a byte that is not a chunk boundary (a bug, not the file).
    #[error("internal: check at {at}, not a chunk boundary")]
    Unaligned { at: u64 },
    #[error(
        "checksum mismatch at offset {offset} of {TRUNK_BIN} (layer {layer}, the {bytes} bytes \
         from byte {at} of {}): the file changed since it was packed; \
         re-run k3-orch pack-trunk --force",
        match tensor { Some(t) => format!("tensor {t}"), None => "its run".to_string() }
    )]
    Mismatch {
        /// Offset in `trunk.bin` of the first chunk that differs.
        offset: u64,
        layer: usize,
        /// Bytes of that chunk.
        bytes: usize,
        /// Its offset from the start of the run (or tensor).
        at: u64,
        /// The tensor checked, when the check is one tensor's.
        tensor: Option<String>,
    },
}

/// A packed trunk that does not belong to the checkpoint, or a checkpoint whose identity
/// could not be read ([`SourceIdentity::of`], [`TrunkManifest::check_source`],
/// [`TrunkManifest::check_against`]). The differences are listed, at most a few.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{}: {what}: {source}", path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: header is {header} bytes, read {read}", path.display())]
    ShortHeader {
        path: PathBuf,
        header: u64,
        read: usize,
    },
    #[error(
        "the trunk was packed from another checkpoint (or this one changed since): {}; \
         re-run k3-orch pack-trunk --force",
        diffs.join("; ")
    )]
    OtherCheckpoint { diffs: Vec<String> },
    #[error(
        "the trunk's tensor table does not match the checkpoint's headers ({count} \
         difference(s)): {}; re-run k3-orch pack-trunk --force",
        diffs.join("; ")
    )]
    TableDiffers { count: usize, diffs: Vec<String> },
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
    /// sha256 of the `length` payload bytes, lower-case hex (`pack-trunk --verify`).
    pub sha256: String,
    /// CRC-32C of every [`CHECK_CHUNK`] bytes of the payload ([`chunk_crcs`]), checked on
    /// every read.
    pub crc32: Vec<u32>,
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
    /// CRC-32C of every [`CHECK_CHUNK`] bytes of the tensor, from its first byte
    /// ([`chunk_crcs`] of its bytes): checked when the tensor is read as part of a layer's
    /// part rather than with the whole run.
    pub crc32: Vec<u32>,
}

/// A manifest that cannot be used: the file and every problem found, one per line.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {}", problems.join("\n  "))]
pub struct TrunkError {
    pub path: PathBuf,
    pub problems: Vec<String>,
}

/// What is wrong with the tensor table of layer run `l` (`who` names the layer): lengths,
/// overlaps, CRC counts, and whether the tensors cover the run exactly.
fn tensor_problems(l: &TrunkLayer, who: &str, p: &mut Vec<String>) {
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
        if t.crc32.len() as u64 != t.len.div_ceil(CHECK_CHUNK) {
            p.push(format!(
                "{who}: tensor {}: {} crc32 entries, its {} bytes need {}",
                t.name,
                t.crc32.len(),
                t.len,
                t.len.div_ceil(CHECK_CHUNK)
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

/// Whether `name` is a plain file name: not empty, not "." or ".." (directories), no `/`.
pub(crate) fn plain_file_name(name: &str) -> bool {
    !matches!(name, "" | "." | "..") && !name.contains('/')
}

/// Whether `s` is a sha256 in hex: 64 hex digits.
pub(crate) fn hex_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Round `x` up to a multiple of `a` (a power of two).
pub fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

impl TrunkManifest {
    /// The file the trunk's bytes are read from and its size: `trunk.bin`, or a coded
    /// trunk's stored file.
    pub fn data_file(&self) -> (&str, u64) {
        match &self.codec {
            Some(c) => (&c.file, c.file_size),
            None => (&self.file, self.file_size),
        }
    }

    /// Read and validate `<dir>/trunk.json`, and check `trunk.bin` has `file_size` bytes
    /// (a coded trunk: its stored file, and its coded lm_head's, theirs).
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
        let head = m.codec.as_ref().and_then(|c| c.head.as_ref());
        let files =
            std::iter::once(m.data_file()).chain(head.map(|h| (h.file.as_str(), h.file_size)));
        for (file, want) in files {
            let bin = dir.join(file);
            let size = std::fs::metadata(&bin)
                .map_err(|e| err(format!("{}: {e}", bin.display())))?
                .len();
            if size != want {
                return Err(err(format!(
                    "{} is {size} bytes but the manifest says {want} (truncated or replaced; \
                     re-run pack-trunk)",
                    bin.display(),
                )));
            }
        }
        Ok(m)
    }

    /// Parse and validate a manifest (no file access). A manifest of another format
    /// version (an older k3's `k3-trunk/1`, say, whose fields differ) is refused by its
    /// `format` alone, with what to do, before its fields are read.
    pub fn from_json_str(text: &str) -> Result<TrunkManifest, TrunkError> {
        #[derive(Deserialize)]
        struct Format {
            format: Option<serde_json::Value>,
        }
        if let Ok(Format { format: Some(f) }) = serde_json::from_str::<Format>(text) {
            if f.as_str() != Some(TRUNK_FORMAT) && f.as_str() != Some(TRUNK_CODED_FORMAT) {
                return Err(TrunkError {
                    path: PathBuf::from(TRUNK_JSON),
                    problems: vec![format!(
                        "this trunk was packed in format {f}, this build reads \
                         {TRUNK_FORMAT:?} and {TRUNK_CODED_FORMAT:?} only: re-run k3-orch \
                         pack-trunk --force MODEL_DIR TRUNK_DIR to repack it"
                    )],
                });
            }
        }
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
        let want = match self.codec {
            None => TRUNK_FORMAT,
            Some(_) => TRUNK_CODED_FORMAT,
        };
        if self.format != want {
            p.push(format!(
                "format is {:?}; a trunk {} a codec is {want:?}",
                self.format,
                if self.codec.is_some() {
                    "with"
                } else {
                    "without"
                }
            ));
        }
        if self.align == 0 || !self.align.is_power_of_two() {
            p.push(format!("align {} is not a power of two", self.align));
            return p;
        }
        // "." and ".." name directories (`load_dir` took the trunk directory itself as a
        // data file of 4096 bytes; found by `examples/fuzz_trunk`).
        if !plain_file_name(&self.file) {
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
            // Checked: a length within 4095 of 2^64 has no aligned padded length (a plain
            // `align_up` overflows; found by `examples/fuzz_trunk`).
            if Some(l.padded_length) != l.length.checked_next_multiple_of(self.align) {
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
            // Checked: a run that ends past 2^64 saturated to a file_size of 2^64 - 1 and
            // passed (found by `examples/fuzz_trunk`).
            end = l.offset.checked_add(l.padded_length).unwrap_or_else(|| {
                p.push(format!("{who}: offset + padded_length overflows 64 bits"));
                u64::MAX
            });
            if end > self.file_size {
                p.push(format!(
                    "{who}: run ends at {end}, past file_size {}",
                    self.file_size
                ));
            }
            let chunks = l.length.div_ceil(CHECK_CHUNK);
            if l.crc32.len() as u64 != chunks {
                p.push(format!(
                    "{who}: {} crc32 entries, its {} bytes need {chunks}",
                    l.crc32.len(),
                    l.length
                ));
            }
            if !hex_sha256(&l.sha256) {
                p.push(format!("{who}: sha256 is not 64 hex digits"));
            }
            total = total.saturating_add(l.length);
            if l.length > max.0 {
                max = (l.length, l.layer);
            }
            tensor_problems(l, &who, &mut p);
        }
        if end != self.file_size && !self.layers.is_empty() {
            p.push(format!(
                "file_size {} is not the end of the last run ({end})",
                self.file_size
            ));
        }
        if let Some(c) = &self.codec {
            crate::codec_trunk::codec_problems(self, c, &mut p);
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
    /// checkpoint about to be used (see [`SourceIdentity::of`]). The error names what differs.
    pub fn check_source(&self, current: &SourceIdentity) -> Result<(), SourceError> {
        let diffs = self.source.diffs(current);
        if diffs.is_empty() {
            return Ok(());
        }
        Err(SourceError::OtherCheckpoint { diffs })
    }

    /// Check the trunk against the checkpoint in `cat` before using it: the source identity
    /// ([`check_source`](Self::check_source)), and every layer's tensor table against the
    /// checkpoint's headers (same names, dtypes, shapes, shard and offsets, and no trunk
    /// tensor of the checkpoint missing), so a manifest whose tensor names were swapped is
    /// refused too. Reads the shards' headers only.
    pub fn check_against(&self, cat: &crate::catalog::Catalog) -> Result<(), SourceError> {
        self.check_source(&SourceIdentity::of(cat)?)?;
        let mut diffs = Vec::new();
        let shard_of = |i: usize| {
            cat.shards()
                .get(i)
                .and_then(|s| s.path.file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        let mut packed = std::collections::BTreeSet::new();
        for l in &self.layers {
            for t in &l.tensors {
                packed.insert(t.name.as_str());
                let Some(e) = cat.get(&t.name) else {
                    diffs.push(format!(
                        "layer {}: {} is not in the checkpoint",
                        l.layer, t.name
                    ));
                    continue;
                };
                if crate::classify::layer_of(&t.name) != Some(l.layer) {
                    diffs.push(format!(
                        "layer {}: {} belongs to another layer",
                        l.layer, t.name
                    ));
                }
                if e.dtype != t.dtype
                    || e.shape != t.shape.as_slice()
                    || shard_of(e.shard) != l.shard
                    || e.offset != l.source_offset.saturating_add(t.offset)
                    || e.len != t.len
                {
                    diffs.push(format!(
                        "layer {}: {} is {} {:?} at {}+{} in the checkpoint, the manifest says \
                         {} {:?} at {}+{}",
                        l.layer,
                        t.name,
                        e.dtype,
                        e.shape,
                        shard_of(e.shard),
                        e.offset,
                        t.dtype,
                        t.shape,
                        l.shard,
                        l.source_offset.saturating_add(t.offset)
                    ));
                }
            }
        }
        for (name, _) in cat.iter() {
            let Some(layer) = crate::classify::layer_of(&name) else {
                continue;
            };
            if layer < self.layers.len()
                && crate::classify::is_layer_trunk(&name)
                && !packed.contains(name.as_str())
            {
                diffs.push(format!("layer {layer}: {name} is not in the manifest"));
            }
        }
        if let Some(h) = self.codec.as_ref().and_then(|c| c.head.as_ref()) {
            match cat.get(&h.tensor) {
                Some(e) if e.dtype == h.dtype && e.shape == h.shape.as_slice() => {}
                Some(e) => diffs.push(format!(
                    "the coded {} is {} {:?}, the checkpoint's is {} {:?}",
                    h.tensor, h.dtype, h.shape, e.dtype, e.shape
                )),
                None => diffs.push(format!("the coded {} is not in the checkpoint", h.tensor)),
            }
        }
        if diffs.is_empty() {
            return Ok(());
        }
        let count = diffs.len();
        diffs.truncate(5);
        Err(SourceError::TableDiffers { count, diffs })
    }

    /// The per-read checks of every layer.
    pub fn run_checks(&self) -> Vec<RunCheck> {
        self.layers
            .iter()
            .map(|l| RunCheck {
                layer: l.layer,
                offset: l.offset,
                length: l.length,
                crc32: l.crc32.clone(),
                tensor: None,
            })
            .collect()
    }

    /// The check of tensor `i` of layer `layer` on its own (its CRCs, from its first byte;
    /// `offset` is its byte in `trunk.bin`).
    pub fn tensor_check(&self, layer: usize, i: usize) -> Option<RunCheck> {
        let l = self.layers.get(layer)?;
        let t = l.tensors.get(i)?;
        Some(RunCheck {
            layer,
            offset: l.offset + t.offset,
            length: t.len,
            crc32: t.crc32.clone(),
            tensor: Some(t.name.clone()),
        })
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

/// Every tensor's CRC-32C per `CHECK_CHUNK` of its own bytes, fed with the run's bytes in
/// order as they are copied (the tensors cover the run back to back).
pub struct TensorCrcs {
    /// (run offset, length) of each tensor, in the order given.
    spans: Vec<(u64, u64)>,
    /// Tensor indices by offset.
    order: Vec<usize>,
    next: usize,
    cur: u32,
    out: Vec<Vec<u32>>,
}

impl TensorCrcs {
    /// For the tensors `ts` of one run.
    pub fn new(ts: &[TrunkTensor]) -> Self {
        let spans: Vec<(u64, u64)> = ts.iter().map(|t| (t.offset, t.len)).collect();
        let mut order: Vec<usize> = (0..ts.len()).filter(|&i| ts[i].len > 0).collect();
        order.sort_by_key(|&i| spans[i].0);
        TensorCrcs {
            spans,
            order,
            next: 0,
            cur: 0,
            out: vec![Vec::new(); ts.len()],
        }
    }

    /// Bytes `[at, at + buf.len())` of the run, fed in order.
    pub fn feed(&mut self, at: u64, buf: &[u8]) {
        const C: u64 = CHECK_CHUNK;
        let mut at = at;
        let mut b = buf;
        while !b.is_empty() {
            // The tensor that holds `at` (bytes outside every tensor are skipped).
            while self.next < self.order.len() && {
                let (o, l) = self.spans[self.order[self.next]];
                at >= o + l
            } {
                self.next += 1;
            }
            let Some(&i) = self.order.get(self.next) else {
                return;
            };
            let (o, l) = self.spans[i];
            if at < o {
                let skip = ((o - at) as usize).min(b.len());
                at += skip as u64;
                b = &b[skip..];
                continue;
            }
            let inside = at - o;
            let chunk_end = ((inside / C + 1) * C).min(l);
            let n = ((chunk_end - inside) as usize).min(b.len());
            self.cur = crc32c::crc32c_append(self.cur, &b[..n]);
            if inside + n as u64 == chunk_end {
                self.out[i].push(self.cur);
                self.cur = 0;
            }
            at += n as u64;
            b = &b[n..];
        }
    }
}

impl TensorCrcs {
    /// Each tensor's CRCs ([`TrunkTensor::crc32`]), in the order given to `new`.
    pub fn finish(self) -> Vec<Vec<u32>> {
        self.out
    }
}

/// When the forward uses a decoder-layer trunk tensor, by its suffix after
/// `layers.<l>.`: 0 the attention up to its output projection (its AttnRes mix,
/// `input_layernorm`, every `self_attn.*` but `o_proj`), 1 the attention's output
/// projection (`self_attn.o_proj.*`, used last, so the larger phase 0 is given back before
/// it is read), 2 the FFN's input side (the pre-MLP mix, `post_attention_layernorm`, a dense
/// FFN's gate, a latent MoE's router, latent down-projection and shared experts), 3 a dense
/// FFN's up-projection, 4 what the FFN uses last (a dense FFN's down-projection; a latent
/// MoE's `routed_expert_norm` and `routed_expert_up_proj`, used after the routed experts,
/// so the much larger phase 2 is given back while they are computed), 5 anything else
/// (never asked for; read and let go). The forward binds and releases the tensors of one
/// phase together, so a trunk streamed in parts ([`TrunkManifest::layer_parts`]) never
/// needs more than one phase of a layer in memory at once.
pub fn use_phase(suffix: &str) -> u8 {
    if suffix.starts_with("self_attn.o_proj.") {
        1
    } else if suffix.starts_with("self_attn.")
        || suffix.starts_with("self_attention_res_")
        || suffix == "input_layernorm.weight"
    {
        0
    } else if suffix.starts_with("mlp.up_proj.") {
        3
    } else if suffix.starts_with("mlp.down_proj.")
        || suffix.starts_with("block_sparse_moe.routed_expert_up_proj.")
        || suffix.starts_with("block_sparse_moe.routed_expert_norm.")
    {
        4
    } else if suffix.starts_with("mlp_res_")
        || suffix == "post_attention_layernorm.weight"
        || suffix.starts_with("block_sparse_moe.")
        || suffix.starts_with("mlp.gate_proj.")
    {
        2
    } else {
        5
    }
}

/// One piece of a [`TrunkPart`]: `[at, at + len)` of its layer's run, `at` a multiple of
/// [`TRUNK_ALIGN`] (so the piece is read page-aligned); it ends on a page or at the end of
/// the run's padding. Its tensors are checked by their own CRCs ([`TrunkTensor::crc32`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartPiece {
    pub at: u64,
    pub len: u64,
}

/// The tensors of one layer that the forward uses together ([`use_phase`]), as the pieces
/// of the run that hold them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrunkPart {
    pub phase: u8,
    pub pieces: Vec<PartPiece>,
    /// (index into the layer's `tensors`, byte of the tensor inside the part's pieces laid
    /// back to back, index of the piece that holds it).
    pub tensors: Vec<(usize, u64, usize)>,
}

impl TrunkPart {
    /// Bytes the part's pieces hold back to back (each a whole number of pages).
    pub fn bytes(&self) -> u64 {
        self.pieces
            .iter()
            .map(|p| align_up(p.len, TRUNK_ALIGN))
            .sum()
    }
}

/// The parts of one layer's run (see [`TrunkManifest::layer_parts`]).
pub fn layer_parts_of(l: &TrunkLayer) -> Vec<TrunkPart> {
    let mut out = Vec::new();
    for phase in 0..=5u8 {
        let mut idx: Vec<usize> = (0..l.tensors.len())
            .filter(|&i| {
                let n = &l.tensors[i].name;
                let suffix = crate::classify::split_layer(n).map_or(n.as_str(), |(_, s)| s);
                use_phase(suffix) == phase
            })
            .collect();
        if idx.is_empty() {
            continue;
        }
        idx.sort_by_key(|&i| l.tensors[i].offset);
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for &i in &idx {
            let t = &l.tensors[i];
            let a = t.offset / TRUNK_ALIGN * TRUNK_ALIGN;
            let b = align_up(t.offset + t.len, TRUNK_ALIGN).min(l.padded_length.max(l.length));
            match ranges.last_mut() {
                Some(r) if a <= r.1 => r.1 = r.1.max(b),
                _ => ranges.push((a, b)),
            }
        }
        let pieces: Vec<PartPiece> = ranges
            .iter()
            .map(|&(a, b)| PartPiece { at: a, len: b - a })
            .collect();
        let mut tensors = Vec::with_capacity(idx.len());
        for &i in &idx {
            let t = &l.tensors[i];
            let mut base = 0u64;
            for (k, p) in pieces.iter().enumerate() {
                if t.offset >= p.at && t.offset + t.len <= p.at + p.len {
                    tensors.push((i, base + t.offset - p.at, k));
                    break;
                }
                base += align_up(p.len, TRUNK_ALIGN);
            }
        }
        out.push(TrunkPart {
            phase,
            pieces,
            tensors,
        });
    }
    out
}

impl TrunkManifest {
    /// The parts of layer `layer`, in use order (phases with no tensor are left out): each
    /// phase's tensors widened to whole pages of the run, overlapping or touching ranges
    /// merged. Two parts may share the page where one tensor ends and the next begins (read
    /// twice, at most 4 KiB each).
    pub fn layer_parts(&self, layer: usize) -> Vec<TrunkPart> {
        self.layers
            .get(layer)
            .map(layer_parts_of)
            .unwrap_or_default()
    }

    /// The largest part of any layer in bytes ([`TrunkPart::bytes`]): the slot a trunk
    /// streamed in parts needs.
    pub fn max_part(&self) -> u64 {
        (0..self.layers.len())
            .flat_map(|l| self.layer_parts(l))
            .map(|p| p.bytes())
            .max()
            .unwrap_or(0)
    }
}
