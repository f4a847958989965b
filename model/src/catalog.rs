//! The checkpoint catalog: every tensor of a safetensors set, from the headers alone.
//!
//! A safetensors file is an 8-byte little-endian header length `N`, `N` bytes of JSON
//! (`{"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...}`, with an
//! optional `__metadata__` entry that is skipped), then the data section; `data_offsets` are
//! relative to byte `8 + N`. A model directory holds either `model.safetensors.index.json`
//! (a `weight_map` from tensor name to shard file) or a single `model.safetensors`.
//!
//! [`Catalog::open`] reads only the headers (never tensor data) and validates them: the
//! header fits in the file, every tensor's bytes lie inside the data section, no two
//! tensors overlap, dtype × shape = byte length, names are unique across shards, and the
//! index's `weight_map` names exactly the tensors each shard holds. Every error names the
//! file and, where there is one, the tensor.
//!
//! The catalog is compact (about 32 bytes per tensor for the released 497,220 names): a
//! name is stored as a key into a small table of *templates* — the name with up to two
//! numeric components replaced by placeholders, e.g.
//! `language_model.model.layers.#.block_sparse_moe.experts.#.w1.weight_packed` — plus the
//! two numbers; names that do not fit that pattern are interned whole. Keys are kept sorted
//! for binary search; shapes are interned too.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;

use crate::tensor::Dtype;

/// File name of a sharded checkpoint's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Largest header this reader accepts (the released shards' headers are ~0.8 MB).
pub const MAX_HEADER_BYTES: u64 = 256 << 20;

/// A catalog error: the file, the tensor when one is concerned, and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogError {
    /// The file the problem is in (a shard, the index, or the model directory).
    pub file: PathBuf,
    /// The tensor concerned, if any.
    pub tensor: Option<String>,
    /// What is wrong.
    pub msg: String,
}

impl CatalogError {
    /// Whether the file is not a regular file (a FIFO, a device, a socket): refused before
    /// it is read, a usage error rather than a damaged checkpoint.
    pub fn is_not_regular(&self) -> bool {
        self.tensor.is_none() && self.msg.starts_with(k3_io::input::NOT_REGULAR)
    }

    fn new(file: &Path, tensor: Option<&str>, msg: impl Into<String>) -> Self {
        CatalogError {
            file: file.to_path_buf(),
            tensor: tensor.map(str::to_string),
            msg: msg.into(),
        }
    }
}

impl fmt::Display for CatalogError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.tensor {
            Some(t) => write!(f, "{}: tensor {:?}: {}", self.file.display(), t, self.msg),
            None => write!(f, "{}: {}", self.file.display(), self.msg),
        }
    }
}

impl std::error::Error for CatalogError {}

/// One shard file of the set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardInfo {
    /// Path as opened (model directory joined with the file name).
    pub path: PathBuf,
    /// File size in bytes when the catalog was built.
    pub file_size: u64,
    /// JSON header length `N` (the file's first 8 bytes).
    pub header_len: u64,
    /// Absolute offset of the data section, `8 + N`.
    pub data_start: u64,
    /// Absolute offset one past the last tensor byte (`data_start` when it holds none).
    pub data_end: u64,
    /// Number of tensors in this shard.
    pub n_tensors: usize,
}

/// Where one tensor lives. `offset` is an absolute file offset in shard `shard`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorEntry<'a> {
    /// Index into [`Catalog::shards`].
    pub shard: usize,
    /// Absolute byte offset in the shard file.
    pub offset: u64,
    /// Byte length (= numel × dtype size).
    pub len: u64,
    pub dtype: Dtype,
    /// Shape (empty for a rank-0 scalar).
    pub shape: &'a [usize],
}

impl TensorEntry<'_> {
    /// One past the last byte (absolute).
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }

    /// Element count (1 for rank 0).
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

const DTYPES: [Dtype; 10] = [
    Dtype::BF16,
    Dtype::F16,
    Dtype::F32,
    Dtype::F64,
    Dtype::U8,
    Dtype::I8,
    Dtype::I16,
    Dtype::I32,
    Dtype::I64,
    Dtype::BOOL,
];

fn dtype_code(d: Dtype) -> u8 {
    DTYPES.iter().position(|&x| x == d).unwrap_or(0) as u8
}

/// Compact name key: template/literal id plus up to two numeric components.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Key {
    id: u32,
    a: u32,
    b: u32,
}

/// Compact location record (16 bytes).
#[derive(Clone, Copy, Debug)]
struct Rec {
    offset: u64,
    shape: u32,
    shard: u16,
    dtype: u8,
}

/// A small fast hasher (FxHash) for the build-time string maps; inputs are tensor names
/// and templates, and a collision-heavy input only costs time.
#[derive(Default, Clone, Copy)]
struct FxHasher(u64);

impl std::hash::Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(K);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(K);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type FxBuild = std::hash::BuildHasherDefault<FxHasher>;

/// Placeholder for a numeric component inside a template. Names containing it are interned
/// whole, so a template can never be confused with a literal name.
const PH: char = '\0';

/// Split `name` into a template (numeric components replaced by [`PH`]) and up to two
/// numbers. Returns `None` when the name must be interned whole.
fn templatize(name: &str, buf: &mut String) -> Option<(u32, u32)> {
    if name.contains(PH) {
        return None;
    }
    buf.clear();
    let mut nums = [0u32; 2];
    let mut n = 0;
    for (i, comp) in name.split('.').enumerate() {
        if i > 0 {
            buf.push('.');
        }
        match canonical_u32(comp) {
            Some(v) => {
                if n == 2 {
                    return None;
                }
                nums[n] = v;
                n += 1;
                buf.push(PH);
            }
            None => buf.push_str(comp),
        }
    }
    Some((nums[0], nums[1]))
}

/// `s` as a u32 if it is its canonical decimal spelling ("0", "12"; not "012", "+1", "").
fn canonical_u32(s: &str) -> Option<u32> {
    let b = s.as_bytes();
    if b.is_empty()
        || b.len() > 10
        || !b.iter().all(u8::is_ascii_digit)
        || (b.len() > 1 && b[0] == b'0')
    {
        return None;
    }
    s.parse().ok()
}

/// Templates and whole names, by id, with sorted id lists for lookup.
#[derive(Default)]
struct NameTable {
    strings: Vec<Box<str>>,
    /// Ids of templates, sorted by string.
    templates: Vec<u32>,
    /// Ids of whole (literal) names, sorted by string.
    literals: Vec<u32>,
    /// Per id: whether it is a whole name (else a template).
    literal: Vec<bool>,
}

impl NameTable {
    fn find(&self, sorted: &[u32], s: &str) -> Option<u32> {
        sorted
            .binary_search_by(|&id| (*self.strings[id as usize]).cmp(s))
            .ok()
            .map(|i| sorted[i])
    }

    fn key_of(&self, name: &str) -> Option<Key> {
        self.key_of_with(name, &mut String::with_capacity(name.len()))
    }

    fn key_of_with(&self, name: &str, buf: &mut String) -> Option<Key> {
        match templatize(name, buf) {
            Some((a, b)) => self.find(&self.templates, buf).map(|id| Key { id, a, b }),
            None => self
                .find(&self.literals, name)
                .map(|id| Key { id, a: 0, b: 0 }),
        }
    }

    fn name_of(&self, k: Key) -> String {
        let s = &self.strings[k.id as usize];
        if self.literal[k.id as usize] {
            return s.to_string();
        }
        let mut out = String::with_capacity(s.len() + 8);
        let mut nums = [k.a, k.b].into_iter();
        for ch in s.chars() {
            if ch == PH {
                out.push_str(&nums.next().unwrap_or(0).to_string());
            } else {
                out.push(ch);
            }
        }
        out
    }

    fn heap_bytes(&self) -> usize {
        self.strings.iter().map(|s| s.len()).sum::<usize>()
            + self.strings.capacity() * std::mem::size_of::<Box<str>>()
            + (self.templates.capacity() + self.literals.capacity()) * 4
            + self.literal.capacity()
    }
}

/// Entries of the index's `weight_map` checked per parallel chunk.
const INDEX_CHUNK: usize = 8192;

/// The distinct shard file names of a `weight_map`, sorted; each must be a plain file name
/// in the model directory, and at most 65536 of them.
fn index_shards<'a>(
    index: &Path,
    weight_map: &'a [(Cow<'_, str>, Cow<'_, str>)],
) -> Result<Vec<&'a str>, CatalogError> {
    // Distinct shard names (the weight_map is usually grouped, so skip repeats cheaply).
    let mut files: Vec<&str> = Vec::new();
    let mut last: Option<&str> = None;
    for (_, f) in weight_map {
        if last != Some(&**f) {
            files.push(f);
            last = Some(f);
        }
    }
    files.sort_unstable();
    files.dedup();
    for f in &files {
        if f.is_empty() || f.contains('/') || f.contains('\\') || *f == "." || *f == ".." {
            let t = weight_map.iter().find(|(_, x)| x == f).map(|(n, _)| &**n);
            return Err(CatalogError::new(
                index,
                t,
                format!("weight_map shard {f:?} is not a plain file name in the model directory"),
            ));
        }
    }
    if files.len() > u16::MAX as usize + 1 {
        return Err(CatalogError::new(
            index,
            None,
            format!("{} shards is more than 65536", files.len()),
        ));
    }
    Ok(files)
}

/// Per shard (`files`, sorted), the digest of the tensor names `wm` assigns to it.
fn index_digests(wm: &[(Cow<'_, str>, Cow<'_, str>)], files: &[&str]) -> Vec<NameDigest> {
    let n_chunks = wm.len().div_ceil(INDEX_CHUNK);
    let per_chunk = par_map(n_chunks, |c| {
        let mut d = vec![NameDigest::default(); files.len()];
        let mut last: Option<(&str, usize)> = None;
        for (name, f) in &wm[c * INDEX_CHUNK..((c + 1) * INDEX_CHUNK).min(wm.len())] {
            let s = match last {
                Some((lf, s)) if lf == &**f => Some(s),
                _ => files.binary_search(&&**f).ok(),
            };
            if let Some(s) = s {
                last = Some((f, s));
                d[s].add(name);
            }
        }
        d
    });
    let mut index_digests = vec![NameDigest::default(); files.len()];
    for d in &per_chunk {
        for (acc, x) in index_digests.iter_mut().zip(d) {
            acc.merge(x);
        }
    }
    index_digests
}

/// Builds a [`NameTable`] while the catalog is read.
#[derive(Default)]
struct NameBuilder {
    strings: Vec<Box<str>>,
    literal: Vec<bool>,
    templates: HashMap<Box<str>, u32, FxBuild>,
    literals: HashMap<Box<str>, u32, FxBuild>,
    buf: String,
}

/// More distinct tensor names than a `u32` id numbers.
#[derive(Debug)]
struct TooManyNames;

impl fmt::Display for TooManyNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("too many distinct tensor names")
    }
}

impl NameBuilder {
    fn key(&mut self, name: &str) -> Result<Key, TooManyNames> {
        let mut buf = std::mem::take(&mut self.buf);
        let r = match templatize(name, &mut buf) {
            Some((a, b)) => self.intern(&buf, false).map(|id| Key { id, a, b }),
            None => self.intern(name, true).map(|id| Key { id, a: 0, b: 0 }),
        };
        self.buf = buf;
        r
    }

    /// Id of template (or, with `literal`, whole name) `s`, adding it if new.
    fn intern(&mut self, s: &str, literal: bool) -> Result<u32, TooManyNames> {
        let map = if literal {
            &mut self.literals
        } else {
            &mut self.templates
        };
        if let Some(&id) = map.get(s) {
            return Ok(id);
        }
        let id = u32::try_from(self.strings.len()).map_err(|_| TooManyNames)?;
        self.strings.push(s.into());
        self.literal.push(literal);
        map.insert(s.into(), id);
        Ok(id)
    }

    fn finish(self) -> NameTable {
        let sort = |m: HashMap<Box<str>, u32, FxBuild>| {
            let mut v: Vec<(Box<str>, u32)> = m.into_iter().collect();
            v.sort_unstable();
            let mut ids: Vec<u32> = v.into_iter().map(|(_, id)| id).collect();
            ids.shrink_to_fit();
            ids
        };
        let mut strings = self.strings;
        strings.shrink_to_fit();
        let mut literal = self.literal;
        literal.shrink_to_fit();
        NameTable {
            strings,
            templates: sort(self.templates),
            literals: sort(self.literals),
            literal,
        }
    }
}

/// The catalog of a safetensors set. See the module docs.
pub struct Catalog {
    source: PathBuf,
    shards: Vec<ShardInfo>,
    names: NameTable,
    /// Sorted keys; `recs[i]` belongs to `keys[i]`.
    keys: Vec<Key>,
    recs: Vec<Rec>,
    /// Positions into `keys`/`recs` in file order (shard, then offset).
    order: Vec<u32>,
    shapes: Vec<Box<[usize]>>,
    index_total_size: Option<u64>,
}

impl fmt::Debug for Catalog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Catalog")
            .field("source", &self.source)
            .field("shards", &self.shards.len())
            .field("tensors", &self.keys.len())
            .finish()
    }
}

/// One tensor as parsed from a header, before it is made compact.
struct RawTensor<'a> {
    name: Cow<'a, str>,
    dtype: Cow<'a, str>,
    shape: ShapeBuf,
    begin: u64,
    end: u64,
}

#[derive(Deserialize)]
struct RawInfo<'a> {
    #[serde(borrow)]
    dtype: Cow<'a, str>,
    shape: ShapeBuf,
    data_offsets: (u64, u64),
}

/// A shape read without a heap allocation for rank <= 6.
enum ShapeBuf {
    Inline([u64; 6], u8),
    Heap(Vec<u64>),
}

impl ShapeBuf {
    fn as_slice(&self) -> &[u64] {
        match self {
            ShapeBuf::Inline(a, n) => &a[..*n as usize],
            ShapeBuf::Heap(v) => v,
        }
    }
}

impl<'de> Deserialize<'de> for ShapeBuf {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ShapeBuf;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a shape: an array of non-negative integers")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<ShapeBuf, A::Error> {
                let mut a = [0u64; 6];
                let mut n = 0usize;
                while let Some(d) = seq.next_element::<u64>()? {
                    if n == 6 {
                        let mut v = a.to_vec();
                        v.push(d);
                        while let Some(d) = seq.next_element::<u64>()? {
                            v.push(d);
                        }
                        return Ok(ShapeBuf::Heap(v));
                    }
                    a[n] = d;
                    n += 1;
                }
                Ok(ShapeBuf::Inline(a, n as u8))
            }
        }
        d.deserialize_seq(V)
    }
}

/// A map key as a borrowed string when it has no escapes.
struct CowStr<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for CowStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CowStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// Visits a header object, collecting tensors; remembers the tensor whose value failed.
struct HeaderSeed<'s> {
    failing: &'s RefCell<Option<String>>,
}

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = Vec<RawTensor<'de>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_> {
    type Value = Vec<RawTensor<'de>>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a safetensors header object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(CowStr(name)) = map.next_key::<CowStr<'de>>()? {
            if name == "__metadata__" {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            match map.next_value::<RawInfo<'de>>() {
                Ok(info) => out.push(RawTensor {
                    name,
                    dtype: info.dtype,
                    shape: info.shape,
                    begin: info.data_offsets.0,
                    end: info.data_offsets.1,
                }),
                Err(e) => {
                    *self.failing.borrow_mut() = Some(name.into_owned());
                    return Err(e);
                }
            }
        }
        Ok(out)
    }
}

/// `json` as UTF-8 text, or an error naming the first bad byte. The safetensors format (and
/// its reference reader) requires the whole header to be UTF-8, and serde_json does not
/// check the strings it skips (`__metadata__`, unknown fields).
fn utf8<'a>(file: &Path, what: &str, json: &'a [u8]) -> Result<&'a str, CatalogError> {
    std::str::from_utf8(json).map_err(|e| {
        CatalogError::new(
            file,
            None,
            format!("{what} is not UTF-8 text (bad byte at {})", e.valid_up_to()),
        )
    })
}

/// Parse a header's JSON bytes into raw tensors (no validation beyond JSON structure).
fn parse_header<'a>(file: &Path, json: &'a [u8]) -> Result<Vec<RawTensor<'a>>, CatalogError> {
    let failing = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_str(utf8(file, "header", json)?);
    let res = HeaderSeed { failing: &failing }
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|_| v));
    res.map_err(|e| {
        let t = failing.borrow().clone();
        let msg = match &t {
            Some(_) => format!("bad header entry: {e}"),
            None => format!("header is not a valid safetensors JSON object: {e}"),
        };
        CatalogError::new(file, t.as_deref(), msg)
    })
}

/// Read a shard's length prefix and header bytes.
fn read_header_bytes(path: &Path) -> Result<(u64, u64, Vec<u8>), CatalogError> {
    let io = |e: std::io::Error| CatalogError::new(path, None, format!("cannot read: {e}"));
    // A FIFO or a device is refused, never opened blocking (a FIFO's open waits for a
    // writer forever).
    let mut f = k3_io::input::open_regular(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::InvalidInput {
            CatalogError::new(path, None, e.to_string())
        } else {
            io(e)
        }
    })?;
    let file_size = f.metadata().map_err(io)?.len();
    if file_size < 8 {
        return Err(CatalogError::new(
            path,
            None,
            format!("file is {file_size} bytes, too short for the 8-byte header length"),
        ));
    }
    let mut len8 = [0u8; 8];
    f.read_exact(&mut len8).map_err(io)?;
    let n = check_header_len(path, file_size, len8)?;
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf).map_err(io)?;
    Ok((file_size, n, buf))
}

/// Validate the 8-byte header length against the file size.
fn check_header_len(path: &Path, file_size: u64, len8: [u8; 8]) -> Result<u64, CatalogError> {
    let n = u64::from_le_bytes(len8);
    if n > file_size - 8 {
        return Err(CatalogError::new(
            path,
            None,
            format!("header length {n} runs past the end of the file ({file_size} bytes)"),
        ));
    }
    if n > MAX_HEADER_BYTES {
        return Err(CatalogError::new(
            path,
            None,
            format!("header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit"),
        ));
    }
    Ok(n)
}

/// Validate a whole safetensors file held in memory exactly as [`Catalog::open`] validates
/// a shard (header length, JSON, dtypes, shapes, offsets, overlaps, duplicate names);
/// `path` only names the file in errors. Returns the shard's geometry. For tools and
/// fuzzing.
pub fn check_safetensors_bytes(path: &Path, file: &[u8]) -> Result<ShardInfo, CatalogError> {
    let file_size = file.len() as u64;
    if file_size < 8 {
        return Err(CatalogError::new(
            path,
            None,
            format!("file is {file_size} bytes, too short for the 8-byte header length"),
        ));
    }
    let part = parse_shard_bytes(path, file)?;
    let mut keys: Vec<Key> = part.items.iter().map(|(k, _)| *k).collect();
    keys.sort_unstable();
    if let Some(w) = keys.windows(2).find(|w| w[0] == w[1]) {
        let names = part.names.finish();
        let name = names.name_of(w[0]);
        return Err(CatalogError::new(
            path,
            Some(&name),
            format!("tensor name appears twice (also in {})", path.display()),
        ));
    }
    Ok(part.info)
}

/// Validate one shard held in memory (the in-memory twin of [`parse_shard`]).
fn parse_shard_bytes(path: &Path, file: &[u8]) -> Result<ShardPart, CatalogError> {
    let file_size = file.len() as u64;
    if file_size < 8 {
        return Err(CatalogError::new(
            path,
            None,
            format!("file is {file_size} bytes, too short for the 8-byte header length"),
        ));
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&file[..8]);
    let n = check_header_len(path, file_size, len8)?;
    parse_shard_json(path, file_size, n, &file[8..8 + n as usize])
}

/// Interns shapes during the build.
#[derive(Default)]
struct ShapeBuilder {
    ids: HashMap<Vec<usize>, u32, FxBuild>,
    shapes: Vec<Box<[usize]>>,
}

impl ShapeBuilder {
    fn id(&mut self, shape: &[usize]) -> u32 {
        if let Some(&id) = self.ids.get(shape) {
            return id;
        }
        let id = self.shapes.len() as u32;
        self.shapes.push(shape.into());
        self.ids.insert(shape.to_vec(), id);
        id
    }
}

/// One shard parsed on its own, with shard-local name and shape ids (merged later).
struct ShardPart {
    info: ShardInfo,
    names: NameBuilder,
    shapes: ShapeBuilder,
    items: Vec<(Key, Rec)>,
    digest: NameDigest,
}

/// Two independently seeded 64-bit hashes of `bytes` in one pass (one multiply-xorshift
/// per 8-byte word and lane, murmur3's finaliser at the end); not for adversarial inputs.
fn mix_hash2(bytes: &[u8]) -> (u64, u64) {
    const K1: u64 = 0x9e37_79b9_7f4a_7c15;
    const K2: u64 = 0xc2b2_ae3d_27d4_eb4f;
    let fmix = |mut h: u64| {
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    };
    let n = bytes.len() as u64;
    let (mut a, mut b) = (
        0x6b33_6361_7461_6c31 ^ n,
        0x243f_6a88_85a3_08d3 ^ n.rotate_left(17),
    );
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        a = (a ^ w).wrapping_mul(K1);
        a ^= a >> 29;
        b = (b ^ w.rotate_left(31)).wrapping_mul(K2);
        b ^= b >> 31;
    }
    let mut tail = [0u8; 8];
    tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    let w = u64::from_le_bytes(tail);
    (fmix(a ^ w), fmix(b ^ w.rotate_left(31) ^ K1))
}

/// An order-independent digest of a multiset of names: count and two wrapping sums of
/// independently seeded 64-bit hashes. Equal digests mean equal multisets except with
/// probability about 2^-128 for non-adversarial names; used to skip the per-name index
/// check when the index and the shards agree (a mismatch falls back to the exact check).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct NameDigest {
    count: u64,
    s1: u64,
    s2: u64,
}

impl NameDigest {
    fn add(&mut self, name: &str) {
        self.count += 1;
        let (h1, h2) = mix_hash2(name.as_bytes());
        self.s1 = self.s1.wrapping_add(h1);
        self.s2 = self.s2.wrapping_add(h2);
    }

    fn merge(&mut self, o: &NameDigest) {
        self.count += o.count;
        self.s1 = self.s1.wrapping_add(o.s1);
        self.s2 = self.s2.wrapping_add(o.s2);
    }
}

/// Read and validate one shard's header.
fn parse_shard(path: &Path) -> Result<ShardPart, CatalogError> {
    let (file_size, n, json) = read_header_bytes(path)?;
    parse_shard_json(path, file_size, n, &json)
}

/// Validate one shard's header JSON (`n` bytes; the file is `file_size` bytes).
fn parse_shard_json(
    path: &Path,
    file_size: u64,
    n: u64,
    json: &[u8],
) -> Result<ShardPart, CatalogError> {
    let raw = parse_header(path, json)?;
    let data_start = 8 + n;
    let data_len = file_size - data_start;
    let mut names = NameBuilder::default();
    let mut shapes = ShapeBuilder::default();
    let mut items = Vec::with_capacity(raw.len());
    let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(raw.len());
    let mut dims: Vec<usize> = Vec::with_capacity(8);
    let mut data_end = data_start;
    let mut digest = NameDigest::default();
    for (i, t) in raw.iter().enumerate() {
        let err = |msg: String| CatalogError::new(path, Some(&t.name), msg);
        let dtype =
            Dtype::parse(&t.dtype).ok_or_else(|| err(format!("unknown dtype {:?}", t.dtype)))?;
        dims.clear();
        let mut numel: u64 = 1;
        for &d in t.shape.as_slice() {
            numel = numel.checked_mul(d).ok_or_else(|| {
                err(format!(
                    "shape {:?} has too many elements",
                    t.shape.as_slice()
                ))
            })?;
            dims.push(usize::try_from(d).map_err(|_| err(format!("dimension {d} too large")))?);
        }
        let bytes = numel
            .checked_mul(dtype.size() as u64)
            .ok_or_else(|| err(format!("shape {:?} is too large", t.shape.as_slice())))?;
        if t.end < t.begin {
            return Err(err(format!(
                "data_offsets [{}, {}] end before they begin",
                t.begin, t.end
            )));
        }
        if t.end - t.begin != bytes {
            return Err(err(format!(
                "data_offsets [{}, {}] hold {} bytes but {dtype} {:?} needs {bytes}",
                t.begin,
                t.end,
                t.end - t.begin,
                t.shape.as_slice()
            )));
        }
        if t.end > data_len {
            return Err(err(format!(
                "data_offsets [{}, {}] run past the end of the data section ({data_len} bytes \
                 after the {n}-byte header; file is {file_size} bytes)",
                t.begin, t.end
            )));
        }
        data_end = data_end.max(data_start + t.end);
        spans.push((t.begin, t.end, i));
        digest.add(&t.name);
        let key = names.key(&t.name).map_err(|e| err(e.to_string()))?;
        let shape = shapes.id(&dims);
        items.push((
            key,
            Rec {
                offset: data_start + t.begin,
                shape,
                shard: 0,
                dtype: dtype_code(dtype),
            },
        ));
    }
    // Overlap check: sort by begin; a non-empty tensor must start at or after every
    // earlier tensor's end.
    spans.sort_unstable();
    let mut prev: Option<(u64, usize)> = None; // (max end so far, who)
    for &(b, e, i) in &spans {
        if let Some((pend, who)) = prev {
            if e > b && b < pend {
                return Err(CatalogError::new(
                    path,
                    Some(&raw[i].name),
                    format!(
                        "data_offsets [{b}, {e}] overlap tensor {:?} which ends at {pend}",
                        raw[who].name
                    ),
                ));
            }
        }
        if e > b && prev.is_none_or(|(pend, _)| e > pend) {
            prev = Some((e, i));
        }
    }
    Ok(ShardPart {
        info: ShardInfo {
            path: path.to_path_buf(),
            file_size,
            header_len: n,
            data_start,
            data_end,
            n_tensors: raw.len(),
        },
        names,
        shapes,
        items,
        digest,
    })
}

/// Compute `f(0..n)` on up to 16 threads (dynamic scheduling), results in index order.
fn par_map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism()
        .map(|t| t.get())
        .unwrap_or(1)
        .min(16)
        .min(n);
    if threads <= 1 {
        return (0..n).map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let slots: Vec<Mutex<Option<R>>> = (0..n).map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let r = f(i);
                *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            });
        }
    });
    slots
        .into_iter()
        .map(|m| {
            m.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .expect("every index computed")
        })
        .collect()
}

/// Parse `paths` (in parallel, with `parse`: [`parse_shard`] for files) and merge them
/// into one catalog; shard `i` is `paths[i]`.
fn build(
    paths: &[PathBuf],
    source: PathBuf,
    index_total_size: Option<u64>,
    parse: &(dyn Fn(&Path) -> Result<ShardPart, CatalogError> + Sync),
) -> Result<(Catalog, Vec<NameDigest>), CatalogError> {
    if paths.len() > u16::MAX as usize + 1 {
        return Err(CatalogError::new(
            &source,
            None,
            format!("{} shards is more than 65536", paths.len()),
        ));
    }
    let parts: Vec<Result<ShardPart, CatalogError>> = par_map(paths.len(), |i| parse(&paths[i]));
    let total: usize = parts
        .iter()
        .map(|p| p.as_ref().map_or(0, |p| p.items.len()))
        .sum();
    let mut names = NameBuilder::default();
    let mut shapes = ShapeBuilder::default();
    let mut items: Vec<(Key, Rec)> = Vec::with_capacity(total);
    let mut shards = Vec::with_capacity(paths.len());
    let mut digests = Vec::with_capacity(paths.len());
    for (si, part) in parts.into_iter().enumerate() {
        let part = part?;
        digests.push(part.digest);
        let path = &part.info.path;
        let mut name_map = Vec::with_capacity(part.names.strings.len());
        for (id, st) in part.names.strings.iter().enumerate() {
            name_map.push(
                names
                    .intern(st, part.names.literal[id])
                    .map_err(|e| CatalogError::new(path, None, e.to_string()))?,
            );
        }
        let shape_map: Vec<u32> = part.shapes.shapes.iter().map(|s| shapes.id(s)).collect();
        for (k, mut r) in part.items {
            r.shard = si as u16;
            r.shape = shape_map[r.shape as usize];
            items.push((
                Key {
                    id: name_map[k.id as usize],
                    ..k
                },
                r,
            ));
        }
        shards.push(part.info);
    }
    items.sort_unstable_by_key(|&(k, _)| k);
    let names = names.finish();
    for w in items.windows(2) {
        if w[0].0 == w[1].0 {
            let (a, b) = (w[0].1.shard as usize, w[1].1.shard as usize);
            let name = names.name_of(w[0].0);
            let (first, second) = if a <= b { (a, b) } else { (b, a) };
            return Err(CatalogError::new(
                &shards[second].path,
                Some(&name),
                format!(
                    "tensor name appears twice (also in {})",
                    shards[first].path.display()
                ),
            ));
        }
    }
    let mut keys = Vec::with_capacity(items.len());
    let mut recs = Vec::with_capacity(items.len());
    for (k, r) in items {
        keys.push(k);
        recs.push(r);
    }
    let mut order: Vec<u32> = (0..keys.len() as u32).collect();
    order.sort_unstable_by_key(|&i| {
        let r = &recs[i as usize];
        (r.shard, r.offset, i)
    });
    let mut shapes_v = shapes.shapes;
    shapes_v.shrink_to_fit();
    let cat = Catalog {
        source,
        shards,
        names,
        keys,
        recs,
        order,
        shapes: shapes_v,
        index_total_size,
    };
    Ok((cat, digests))
}

/// The parsed index file.
struct Index<'a> {
    weight_map: Vec<(Cow<'a, str>, Cow<'a, str>)>,
    total_size: Option<u64>,
}

struct IndexVisitor;

impl<'de> Visitor<'de> for IndexVisitor {
    type Value = Index<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an index object with a weight_map")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut weight_map = None;
        let mut total_size = None;
        while let Some(CowStr(k)) = map.next_key::<CowStr<'de>>()? {
            match &*k {
                "weight_map" => {
                    if weight_map.is_some() {
                        return Err(de::Error::custom("weight_map appears twice"));
                    }
                    weight_map = Some(map.next_value::<WeightMap<'de>>()?.0);
                }
                "metadata" => {
                    let m: serde_json::Value = map.next_value()?;
                    total_size = m.get("total_size").and_then(|t| t.as_u64());
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let weight_map = weight_map.ok_or_else(|| de::Error::custom("missing weight_map"))?;
        Ok(Index {
            weight_map,
            total_size,
        })
    }
}

struct WeightMap<'a>(Vec<(Cow<'a, str>, Cow<'a, str>)>);

impl<'de> Deserialize<'de> for WeightMap<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WeightMap<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a weight_map object of tensor name -> shard file name")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut v = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some((CowStr(k), CowStr(f))) =
                    map.next_entry::<CowStr<'de>, CowStr<'de>>()?
                {
                    v.push((k, f));
                }
                Ok(WeightMap(v))
            }
        }
        d.deserialize_map(V)
    }
}

fn parse_index<'a>(file: &Path, json: &'a [u8]) -> Result<Index<'a>, CatalogError> {
    let mut de = serde_json::Deserializer::from_str(utf8(file, "index", json)?);
    de.deserialize_map(IndexVisitor)
        .and_then(|v| de.end().map(|_| v))
        .map_err(|e| CatalogError::new(file, None, format!("not a valid safetensors index: {e}")))
}

/// Words for a file type that is not a regular file or directory.
fn kind_of(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else {
        "special file"
    }
}

impl Catalog {
    /// Open a checkpoint: a directory with `model.safetensors.index.json` (sharded; the
    /// shards are the distinct files its `weight_map` names, in file-name order), else a
    /// directory with `model.safetensors`, or the path of one `.safetensors` file.
    pub fn open(path: impl AsRef<Path>) -> Result<Catalog, CatalogError> {
        let path = path.as_ref();
        if path.is_file() {
            return Self::from_files(&[path.to_path_buf()]);
        }
        let index = path.join(INDEX_FILE);
        if index.is_file() {
            return Self::open_index(&index);
        }
        let single = path.join(SINGLE_FILE);
        if single.is_file() {
            let mut c = Self::from_files(&[single])?;
            c.source = path.to_path_buf();
            return Ok(c);
        }
        Err(CatalogError::new(
            path,
            None,
            match std::fs::metadata(path) {
                Ok(m) if m.is_dir() => {
                    format!("no {INDEX_FILE} or {SINGLE_FILE} in this directory")
                }
                Ok(m) => format!(
                    "not a checkpoint: a {}, not a directory or a .safetensors file",
                    kind_of(&m.file_type())
                ),
                Err(e) => e.to_string(),
            },
        ))
    }

    /// Catalog an explicit list of shard files (no index); shard `i` is `paths[i]`.
    pub fn from_files(paths: &[PathBuf]) -> Result<Catalog, CatalogError> {
        let source = if paths.len() == 1 {
            paths[0].clone()
        } else {
            PathBuf::new()
        };
        build(paths, source, None, &parse_shard).map(|(c, _)| c)
    }

    /// Catalog the set an index file describes (shards relative to its directory).
    pub fn open_index(index: &Path) -> Result<Catalog, CatalogError> {
        let json = k3_io::input::read_capped(index, k3_io::input::JSON_CAP).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidInput {
                CatalogError::new(index, None, e.to_string())
            } else {
                CatalogError::new(index, None, format!("cannot read: {e}"))
            }
        })?;
        Self::index_with(index, &json, &parse_shard)
    }

    /// In-memory twin of [`Catalog::open_index`], for tools and fuzzing: `json` is the
    /// index file's bytes and `shard(name)` the whole file `name` of the model directory
    /// (`None`: no such file). Every check is the same code as for files; only the reading
    /// differs (a missing shard's error says "cannot read: no such file").
    pub fn from_index_bytes<'b>(
        index: &Path,
        json: &[u8],
        shard: impl Fn(&str) -> Option<&'b [u8]> + Sync,
    ) -> Result<Catalog, CatalogError> {
        Self::index_with(index, json, &|p: &Path| match p
            .file_name()
            .and_then(|f| f.to_str())
            .and_then(&shard)
        {
            Some(bytes) => parse_shard_bytes(p, bytes),
            None => Err(CatalogError::new(p, None, "cannot read: no such file")),
        })
    }

    /// [`Catalog::open_index`] on the index bytes `json`, reading shards with `parse`.
    fn index_with(
        index: &Path,
        json: &[u8],
        parse: &(dyn Fn(&Path) -> Result<ShardPart, CatalogError> + Sync),
    ) -> Result<Catalog, CatalogError> {
        let dir = index.parent().unwrap_or(Path::new("."));
        let idx = parse_index(index, json)?;
        let files = index_shards(index, &idx.weight_map)?;
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        let (cat, digests) = build(&paths, dir.to_path_buf(), idx.total_size, parse)?;
        // Every weight_map entry must be in the shard it names, once, and the weight_map
        // must cover every tensor. Fast path: per shard, the digest of the names the index
        // assigns to it equals the digest of the names its header holds.
        if index_digests(&idx.weight_map, &files) == digests {
            return Ok(cat);
        }
        // Exact check, to name the first offending tensor (index order).
        cat.check_weight_map(index, &idx.weight_map, &files)?;
        // Unreachable unless two different name sets collide in the digest; the exact
        // check passed, so the catalog is consistent.
        Ok(cat)
    }

    /// Check every `weight_map` entry exactly: in the shard it names, listed once, and
    /// every tensor listed; the error names the first offending tensor in index order.
    fn check_weight_map(
        &self,
        index: &Path,
        wm: &[(Cow<'_, str>, Cow<'_, str>)],
        files: &[&str],
    ) -> Result<(), CatalogError> {
        let n_chunks = wm.len().div_ceil(INDEX_CHUNK);
        let chunks = par_map(n_chunks, |c| -> Result<Vec<u32>, CatalogError> {
            let mut buf = String::new();
            let mut out = Vec::with_capacity(INDEX_CHUNK);
            for (name, f) in &wm[c * INDEX_CHUNK..((c + 1) * INDEX_CHUNK).min(wm.len())] {
                let shard = files.binary_search(&&**f).unwrap_or(usize::MAX);
                let pos = self
                    .names
                    .key_of_with(name, &mut buf)
                    .and_then(|k| self.keys.binary_search(&k).ok());
                match pos {
                    Some(p) if self.recs[p].shard as usize == shard => out.push(p as u32),
                    Some(p) => {
                        return Err(CatalogError::new(
                            index,
                            Some(name),
                            format!(
                                "weight_map names shard {f} but the tensor is in {}",
                                self.shards[self.recs[p].shard as usize].path.display()
                            ),
                        ));
                    }
                    None => {
                        return Err(CatalogError::new(
                            index,
                            Some(name),
                            format!("weight_map names shard {f} but that shard has no such tensor"),
                        ));
                    }
                }
            }
            Ok(out)
        });
        let mut seen = vec![false; self.keys.len()];
        for chunk in chunks {
            for p in chunk? {
                if std::mem::replace(&mut seen[p as usize], true) {
                    let name = self.names.name_of(self.keys[p as usize]);
                    return Err(CatalogError::new(
                        index,
                        Some(&name),
                        "listed twice in weight_map",
                    ));
                }
            }
        }
        if let Some(p) = seen.iter().position(|s| !s) {
            let name = self.names.name_of(self.keys[p]);
            return Err(CatalogError::new(
                index,
                Some(&name),
                format!(
                    "tensor in {} is missing from the weight_map",
                    self.shards[self.recs[p].shard as usize].path.display()
                ),
            ));
        }
        Ok(())
    }

    fn position(&self, name: &str) -> Option<usize> {
        let k = self.names.key_of(name)?;
        self.keys.binary_search(&k).ok()
    }

    fn entry_at(&self, p: usize) -> TensorEntry<'_> {
        let r = self.recs[p];
        let dtype = DTYPES[r.dtype as usize];
        let shape: &[usize] = &self.shapes[r.shape as usize];
        let numel: u64 = shape.iter().map(|&d| d as u64).product();
        TensorEntry {
            shard: r.shard as usize,
            offset: r.offset,
            len: numel * dtype.size() as u64,
            dtype,
            shape,
        }
    }

    /// The tensor called `name`, if present.
    pub fn get(&self, name: &str) -> Option<TensorEntry<'_>> {
        self.position(name).map(|p| self.entry_at(p))
    }

    /// Whether `name` is in the catalog.
    pub fn contains(&self, name: &str) -> bool {
        self.position(name).is_some()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the set holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The shard files, in shard-index order.
    pub fn shards(&self) -> &[ShardInfo] {
        &self.shards
    }

    /// The directory (or single file) the catalog was opened from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// `metadata.total_size` of the index, when there is an index and it has one.
    pub fn index_total_size(&self) -> Option<u64> {
        self.index_total_size
    }

    /// Sum of all tensors' byte lengths.
    pub fn payload_bytes(&self) -> u64 {
        (0..self.keys.len()).map(|p| self.entry_at(p).len).sum()
    }

    /// Every tensor, in file order (shard index, then offset), with its name.
    pub fn iter(&self) -> impl Iterator<Item = (String, TensorEntry<'_>)> + '_ {
        self.order.iter().map(move |&p| {
            (
                self.names.name_of(self.keys[p as usize]),
                self.entry_at(p as usize),
            )
        })
    }

    /// The tensors of shard `shard`, in offset order, with their names.
    pub fn shard_entries(
        &self,
        shard: usize,
    ) -> impl Iterator<Item = (String, TensorEntry<'_>)> + '_ {
        let lo = self
            .order
            .partition_point(|&p| (self.recs[p as usize].shard as usize) < shard);
        let hi = self
            .order
            .partition_point(|&p| (self.recs[p as usize].shard as usize) <= shard);
        self.order[lo..hi].iter().map(move |&p| {
            (
                self.names.name_of(self.keys[p as usize]),
                self.entry_at(p as usize),
            )
        })
    }

    /// Approximate heap bytes this catalog holds (its arrays and tables; the allocator's
    /// own overhead is not counted).
    pub fn heap_bytes(&self) -> usize {
        self.keys.capacity() * std::mem::size_of::<Key>()
            + self.recs.capacity() * std::mem::size_of::<Rec>()
            + self.order.capacity() * 4
            + self.names.heap_bytes()
            + self.shapes.iter().map(|s| s.len() * 8 + 16).sum::<usize>()
            + self
                .shards
                .iter()
                .map(|s| std::mem::size_of::<ShardInfo>() + s.path.as_os_str().len())
                .sum::<usize>()
    }
}
