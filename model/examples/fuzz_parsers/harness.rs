//! A seeded mutation fuzzer for the three model readers that take untrusted bytes: the
//! safetensors shard header parser ([`check_safetensors_bytes`]), the
//! `model.safetensors.index.json` reader ([`Catalog::from_index_bytes`], the in-memory twin
//! of `Catalog::open_index`) and the `config.json` reader ([`ModelConfig::from_json_str`]).
//!
//! cargo-fuzz needs a nightly toolchain and proptest runs about 1,500 cases/s here, so this
//! is a plain, fast, coverage-blind fuzzer: a splitmix64 PRNG, a corpus of valid inputs
//! (the fixtures under `tests/fixtures` plus synthesized headers, indexes and configs),
//! stacked mutations (bit flips, byte insert/delete/overwrite, interesting integers in the
//! length prefix, splices between corpus entries, truncation, duplicated ranges, and
//! JSON-aware ones: numbers → huge/negative/float, strings → long/escaped, duplicate
//! members, deep nesting, structural edits of the parsed tree), and accepted mutants fed
//! back into the corpus. Every case runs under `catch_unwind` with a 1 MiB input cap; a
//! panic, or an accepted input that breaks an invariant checked by an independent oracle
//! (serde_json's own tree of the same bytes), is a finding.
//!
//! The machinery (PRNG, JSON text edits, the run loop and its report) is `fuzzkit`'s; this
//! file holds the readers' corpus, mutations and oracles. Shared by the `fuzz_parsers`
//! example (long runs, docs/fuzzing.md) and `tests/fuzz_harness.rs` (a CI-sized run, so
//! the harness cannot rot).

use k3_model::catalog::{check_safetensors_bytes, Catalog, ShardInfo};
use k3_model::config::{LayerKind, ModelConfig};
use k3_model::tensor::Dtype;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fuzzkit::json::{find_from, JsonEdits};
use fuzzkit::runner::violation;
pub use fuzzkit::{n_edits, FuzzReport, Harness, Rng, Verdict, Violation};

/// Largest input one case may build (bytes).
pub const MAX_INPUT: usize = 1 << 20;
/// Most accepted mutants kept as extra corpus entries.
const MAX_GROWN: usize = 256;

fuzzkit::targets! {
    /// The readers under test.
    pub enum Target {
        Header => "header",
        Index => "index",
        Config => "config",
    }
}

/// The stream of this harness's [`Rng`]s (so its cases differ from another harness's with
/// the same seed).
const STREAM: u64 = 0x6b33_5f66_757a_7a21;

/// The fixtures directory of this repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

// ---------------------------------------------------------------------------------------
// Interesting values.

const INT_STRS: &[&str] = &[
    "0",
    "1",
    "2",
    "-1",
    "-0",
    "7",
    "255",
    "256",
    "65535",
    "65536",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "9007199254740993",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "-9223372036854775809",
    "340282366920938463463374607431768211456",
    "1.5",
    "0.5",
    "-0.0",
    "1e3",
    "1E-7",
    "1e308",
    "1e309",
    "-1e309",
    "2.5e-324",
    "00",
    "01",
    "1.",
    ".5",
    "+1",
    "NaN",
    "Infinity",
];

const U64S: &[u64] = &[
    0,
    1,
    7,
    8,
    255,
    256,
    1022,
    1023,
    1024,
    4095,
    4096,
    65535,
    65536,
    (1 << 20) - 1,
    1 << 20,
    (256 << 20) - 1,
    256 << 20,
    (256 << 20) + 1,
    u32::MAX as u64,
    1 << 32,
    i64::MAX as u64,
    1 << 63,
    u64::MAX - 8,
    u64::MAX - 7,
    u64::MAX,
];

const STR_SUBS: &[&str] = &[
    "",
    "a",
    "__metadata__",
    "F32",
    "BF16",
    "U8",
    "bf16",
    "F8_E4M3",
    "\\u0000",
    "\\ud800",
    "\\udc00\\ud800",
    "\\\"",
    "\\\\",
    "\\u002e",
    "a.0",
    "a.00",
    "a.4294967296",
    "layers.-1.w",
    "language_model.model.layers.0.self_attn.q_a_proj.weight",
    "language_model.model.layers.3.block_sparse_moe.experts.7.w1.weight_packed",
    "../model-00001-of-00002.safetensors",
    "model-00001-of-00002.safetensors",
    "/etc/passwd",
    ".",
    "..",
    "a/b",
    "a\\\\b",
    "\u{7f}\u{80}",
    "\u{10ffff}",
    "é",
];

/// A random JSON value, mostly small, sometimes pathological.
fn random_value(rng: &mut Rng) -> Value {
    match rng.below(14) {
        0 => Value::Null,
        1 => Value::Bool(rng.one_in(2)),
        2 | 3 => {
            let s = *rng.pick(INT_STRS);
            serde_json::from_str(s).unwrap_or(Value::from(-1))
        }
        4 => Value::from(*rng.pick(U64S)),
        5 => Value::from(rng.next_u64() as i64),
        6 => serde_json::Number::from_f64(f64::from_bits(rng.next_u64()))
            .map_or(Value::Null, Value::Number),
        7 => Value::String(
            serde_json::from_str::<String>(&format!("\"{}\"", rng.pick(STR_SUBS)))
                .unwrap_or_default(),
        ),
        8 => Value::String("x".repeat(rng.below(8_000))),
        9 => Value::Array((0..rng.below(6)).map(|i| Value::from(i as u64)).collect()),
        10 => Value::Array(
            (0..rng.below(300))
                .map(|_| Value::from(rng.below(100) as u64))
                .collect(),
        ),
        11 => json!({}),
        12 => json!([]),
        _ => {
            let mut v = Value::from(1);
            for _ in 0..rng.below(200) {
                v = Value::Array(vec![v]);
            }
            v
        }
    }
}

/// A numeric neighbour of `n`: off by one, doubled, negated, a float, zero or huge.
fn neighbour(n: &serde_json::Number, rng: &mut Rng) -> Value {
    let x = n.as_i64().unwrap_or(1);
    match rng.below(8) {
        0 => Value::from(x.wrapping_add(1)),
        1 => Value::from(x.wrapping_sub(1)),
        2 => Value::from(x.wrapping_mul(2)),
        3 => Value::from(x.wrapping_neg()),
        4 => serde_json::Number::from_f64(x as f64 + 0.5).map_or(Value::Null, Value::Number),
        5 => Value::from(0),
        6 => Value::from(u64::MAX / (1 + rng.below(4) as u64)),
        _ => Value::from(x / 2),
    }
}

/// One structural edit at a random node of `v`: replace, delete, duplicate, add, nudge.
fn mutate_value(v: &mut Value, rng: &mut Rng, depth: usize) {
    if depth > 64 {
        *v = random_value(rng);
        return;
    }
    match v {
        Value::Object(m) if !m.is_empty() && !rng.one_in(4) => {
            let Some(k) = m.keys().nth(rng.below(m.len())).cloned() else {
                return;
            };
            match rng.below(10) {
                0 => {
                    m.remove(&k);
                }
                1 => {
                    m.insert(format!("{k}_"), random_value(rng));
                }
                _ => {
                    if let Some(child) = m.get_mut(&k) {
                        mutate_value(child, rng, depth + 1);
                    }
                }
            }
        }
        Value::Array(a) if !a.is_empty() && !rng.one_in(4) => {
            let i = rng.below(a.len());
            match rng.below(10) {
                0 => {
                    a.remove(i);
                }
                1 => {
                    let x = a[i].clone();
                    a.insert(i, x);
                }
                2 => a.push(random_value(rng)),
                3 => a.reverse(),
                _ => mutate_value(&mut a[i], rng, depth + 1),
            }
        }
        Value::Number(n) if !rng.one_in(3) => *v = neighbour(n, rng),
        _ => *v = random_value(rng),
    }
}

// ---------------------------------------------------------------------------------------
// Byte- and token-level mutations.

/// The JSON text edits of this harness: its interesting numbers and strings.
const JSON_EDITS: JsonEdits<'static> = JsonEdits {
    ints: INT_STRS,
    strs: STR_SUBS,
    numeric_keys: false,
};

fn mutate_json_text(b: &mut Vec<u8>, rng: &mut Rng, corpus_text: &[u8]) -> bool {
    fuzzkit::json::mutate_json_text(b, rng, corpus_text, &JSON_EDITS)
}

/// A position in `b`, biased towards `0..hot` (the part where parsing happens).
fn pos(b: &[u8], hot: usize, rng: &mut Rng) -> usize {
    if b.is_empty() {
        return 0;
    }
    if hot > 0 && !rng.one_in(8) {
        rng.below(hot.min(b.len()))
    } else {
        rng.below(b.len())
    }
}

/// A generic byte-level edit of `b` (positions biased to `0..hot`).
fn mutate_bytes(b: &mut Vec<u8>, hot: usize, rng: &mut Rng, other: &[u8]) {
    match rng.below(10) {
        0 => {
            if !b.is_empty() {
                let i = pos(b, hot, rng);
                b[i] ^= 1 << rng.below(8);
            }
        }
        1 => {
            if !b.is_empty() {
                let i = pos(b, hot, rng);
                b[i] = rng.next_u64() as u8;
            }
        }
        2 => {
            let i = pos(b, hot, rng).min(b.len());
            let n = 1 + rng.below(16);
            let ins: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            b.splice(i..i, ins);
        }
        3 => {
            if !b.is_empty() {
                let i = pos(b, hot, rng);
                let n = (1 + rng.below(32)).min(b.len() - i);
                b.drain(i..i + n);
            }
        }
        4 => {
            // An interesting integer, little-endian, 4 or 8 bytes.
            let v = *rng.pick(U64S);
            let bytes = if rng.one_in(2) {
                v.to_le_bytes().to_vec()
            } else {
                (v as u32).to_le_bytes().to_vec()
            };
            if b.len() >= bytes.len() {
                let i = pos(b, hot, rng).min(b.len() - bytes.len());
                b[i..i + bytes.len()].copy_from_slice(&bytes);
            }
        }
        5 => {
            // Splice: a chunk of another corpus entry, inserted or overwriting.
            if !other.is_empty() {
                let s = rng.below(other.len());
                let n = (1 + rng.below(64)).min(other.len() - s);
                let i = pos(b, hot, rng).min(b.len());
                if rng.one_in(2) {
                    b.splice(i..i, other[s..s + n].iter().copied());
                } else {
                    let e = (i + n).min(b.len());
                    b.splice(i..e, other[s..s + n].iter().copied());
                }
            }
        }
        6 => {
            // Duplicate a range.
            if !b.is_empty() {
                let s = pos(b, hot, rng);
                let n = (1 + rng.below(128)).min(b.len() - s);
                let chunk = b[s..s + n].to_vec();
                let i = pos(b, hot, rng).min(b.len());
                b.splice(i..i, chunk);
            }
        }
        7 => {
            let n = pos(b, hot, rng);
            b.truncate(n);
        }
        8 => {
            // An ASCII digit run → an interesting number.
            if let Some(i) = find_from(b, rng, |b, i| b[i].is_ascii_digit()) {
                let mut e = i;
                while e < b.len() && b[e].is_ascii_digit() {
                    e += 1;
                }
                b.splice(i..e, rng.pick(INT_STRS).bytes());
            }
        }
        _ => {
            // Overwrite with a JSON structural byte.
            if !b.is_empty() {
                let i = pos(b, hot, rng);
                b[i] = *rng.pick(b"{}[]\",:\\ 0-.e");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Synthesized valid inputs.

const DTYPES: &[(&str, u64)] = &[
    ("F64", 8),
    ("F32", 4),
    ("F16", 2),
    ("BF16", 2),
    ("I64", 8),
    ("I32", 4),
    ("I16", 2),
    ("I8", 1),
    ("U8", 1),
    ("BOOL", 1),
];

fn random_name(rng: &mut Rng, i: usize) -> String {
    let l = rng.below(13);
    match rng.below(6) {
        0 => format!("language_model.model.layers.{l}.self_attn.t{i}.weight"),
        1 => format!(
            "language_model.model.layers.{l}.block_sparse_moe.experts.{}.w{}.weight_packed",
            rng.below(300),
            i
        ),
        2 => format!("language_model.model.t{i}.weight"),
        3 => format!("a.{i}.b.{}", rng.below(5)),
        4 => format!("x{i}"),
        _ => format!("layers.{}.t{i}", rng.below(100_000)),
    }
}

/// A valid safetensors file for `names` (shapes, dtypes, gaps and metadata random).
fn synth_shard(rng: &mut Rng, names: &[String]) -> Vec<u8> {
    let mut h = Map::new();
    if rng.one_in(3) {
        h.insert("__metadata__".into(), json!({"format": "pt"}));
    }
    let mut off = 0u64;
    for n in names {
        let (dt, size) = *rng.pick(DTYPES);
        let shape: Vec<u64> = (0..rng.below(4)).map(|_| rng.below(6) as u64).collect();
        let len = shape.iter().product::<u64>() * size;
        if rng.one_in(4) {
            off += rng.below(8) as u64;
        }
        h.insert(
            n.clone(),
            json!({"dtype": dt, "shape": shape, "data_offsets": [off, off + len]}),
        );
        off += len;
    }
    let mut text = serde_json::to_vec(&Value::Object(h)).unwrap_or_default();
    // The released writer pads the header with spaces to a multiple of 8.
    if rng.one_in(2) {
        while !text.len().is_multiple_of(8) {
            text.push(b' ');
        }
    }
    let mut f = (text.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(&text);
    f.resize(f.len() + off as usize + rng.below(3), 0);
    f
}

/// Split a safetensors file into (header JSON, data length); None if not one.
fn split_shard(f: &[u8]) -> Option<(Vec<u8>, usize)> {
    let n = u64::from_le_bytes(f.get(..8)?.try_into().ok()?) as usize;
    let json = f.get(8..8usize.checked_add(n)?)?.to_vec();
    Some((json, f.len() - 8 - n))
}

// ---------------------------------------------------------------------------------------
// Oracles: independent re-checks of an accepted input against serde_json's tree.

/// The oracle's reading of one header entry (unknown fields ignored, as safetensors does).
#[derive(Deserialize)]
struct OracleTensor {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: Vec<u64>,
}

/// A JSON object's members in order, duplicates kept; a value of type `T`, except that
/// `__metadata__` (in a header) is skipped as `None` when `T` is an `Option`.
struct Pairs<T>(Vec<(String, T)>);

impl<'de, T: Deserialize<'de> + MaybeSkip> Deserialize<'de> for Pairs<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de> + MaybeSkip> Visitor<'de> for V<T> {
            type Value = Pairs<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Pairs<T>, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    let v = match T::skipped(&k) {
                        Some(v) => {
                            map.next_value::<IgnoredAny>()?;
                            v
                        }
                        None => map.next_value::<T>()?,
                    };
                    out.push((k, v));
                }
                Ok(Pairs(out))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// Values the oracle skips without reading.
trait MaybeSkip: Sized {
    fn skipped(key: &str) -> Option<Self>;
}

impl MaybeSkip for Option<OracleTensor> {
    fn skipped(key: &str) -> Option<Self> {
        (key == "__metadata__").then_some(None)
    }
}

impl MaybeSkip for String {
    fn skipped(_: &str) -> Option<Self> {
        None
    }
}

/// The oracle's reading of an index: the weight_map's members (duplicates kept) and the
/// last `metadata.total_size`; other members skipped.
struct OracleIndex {
    weight_map: Option<Vec<(String, String)>>,
    total_size: Option<u64>,
}

impl<'de> Deserialize<'de> for OracleIndex {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OracleIndex;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an index object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OracleIndex, A::Error> {
                let mut o = OracleIndex {
                    weight_map: None,
                    total_size: None,
                };
                while let Some(k) = map.next_key::<String>()? {
                    match k.as_str() {
                        "weight_map" => {
                            if o.weight_map.is_some() {
                                return Err(de::Error::custom("weight_map twice"));
                            }
                            o.weight_map = Some(map.next_value::<Pairs<String>>()?.0);
                        }
                        "metadata" => {
                            let m: Value = map.next_value()?;
                            o.total_size = m.get("total_size").and_then(Value::as_u64);
                        }
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(o)
            }
        }
        d.deserialize_map(V)
    }
}

/// An accepted shard must satisfy the safetensors rules as serde_json reads them.
pub fn check_header_invariants(file: &[u8], info: &ShardInfo) -> Result<(), Violation> {
    let n = u64::from_le_bytes(
        file.get(..8)
            .ok_or("accepted a file under 8 bytes")?
            .try_into()
            .map_err(|_| "prefix")?,
    );
    let size = file.len() as u64;
    if n > size - 8 {
        return violation(format!("accepted header length {n} past the file end"));
    }
    let text = std::str::from_utf8(&file[8..8 + n as usize])
        .map_err(|e| format!("accepted a header that is not UTF-8: {e}"))?;
    let entries = serde_json::from_str::<Pairs<Option<OracleTensor>>>(text)
        .map_err(|e| format!("accepted a header serde_json rejects: {e}"))?
        .0;
    let mut names = BTreeSet::new();
    for (k, _) in &entries {
        if k != "__metadata__" && !names.insert(k.as_str()) {
            return violation(format!("accepted the tensor {k:?} twice"));
        }
    }
    let data_start = 8 + n;
    let data_len = size - data_start;
    let mut spans = Vec::new();
    let mut data_end = data_start;
    let mut count = 0;
    for (name, t) in &entries {
        if name == "__metadata__" {
            continue;
        }
        count += 1;
        let t = t.as_ref().ok_or(format!("{name}: accepted a non-tensor"))?;
        let dt = t.dtype.as_str();
        let esize = DTYPES
            .iter()
            .find(|(d, _)| *d == dt)
            .map(|x| x.1)
            .ok_or(format!("{name}: accepted dtype {dt:?}"))?;
        let mut numel: u128 = 1;
        for &d in &t.shape {
            numel *= d as u128;
            if numel > u64::MAX as u128 {
                return violation(format!("{name}: accepted a shape over 2^64 elements"));
            }
        }
        let (b, e) = match t.data_offsets.as_slice() {
            [b, e] => (*b, *e),
            offs => return violation(format!("{name}: accepted offsets {offs:?}")),
        };
        if e < b || (e - b) as u128 != numel * esize as u128 {
            return violation(format!(
                "{name}: accepted offsets [{b}, {e}] for {numel} x {esize}"
            ));
        }
        if e > data_len {
            return violation(format!(
                "{name}: accepted offsets [{b}, {e}] past data {data_len}"
            ));
        }
        if e > b {
            spans.push((b, e));
        }
        data_end = data_end.max(data_start + e);
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return violation(format!("accepted overlapping spans {w:?}"));
        }
    }
    let want = (size, n, data_start, data_end, count);
    let got = (
        info.file_size,
        info.header_len,
        info.data_start,
        info.data_end,
        info.n_tensors,
    );
    if want != got {
        return violation(format!(
            "geometry (size, header, start, end, tensors) {got:?}, oracle {want:?}"
        ));
    }
    Ok(())
}

/// An accepted catalog: every tensor inside its shard's data section, len = numel × dtype
/// size, no overlaps, lookups round-trip.
fn check_catalog(c: &Catalog) -> Result<(), Violation> {
    let mut spans: Vec<(usize, u64, u64)> = Vec::new();
    for (name, e) in c.iter() {
        let s = c.shards().get(e.shard).ok_or("shard index out of range")?;
        if e.offset < s.data_start || e.end() > s.file_size || e.end() > s.data_end {
            return violation(format!(
                "{name}: [{}, {}) outside its shard",
                e.offset,
                e.end()
            ));
        }
        if e.len != e.numel() * e.dtype.size() as u64 {
            return violation(format!("{name}: len {} != numel x size", e.len));
        }
        if c.get(&name) != Some(e) {
            return violation(format!("{name:?}: lookup does not round-trip"));
        }
        if e.len > 0 {
            spans.push((e.shard, e.offset, e.end()));
        }
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[0].0 == w[1].0 && w[1].1 < w[0].2 {
            return violation(format!("overlap {w:?}"));
        }
    }
    Ok(())
}

/// An accepted index: the catalog holds exactly the weight_map's names, each in the shard
/// the map names; the shards are the map's distinct files; total_size as written.
fn check_index_invariants(json: &[u8], c: &Catalog) -> Result<(), Violation> {
    check_catalog(c)?;
    let text = std::str::from_utf8(json)
        .map_err(|e| format!("accepted an index that is not UTF-8: {e}"))?;
    let idx: OracleIndex = serde_json::from_str(text)
        .map_err(|e| format!("accepted an index serde_json rejects: {e}"))?;
    let wm = idx
        .weight_map
        .ok_or("accepted an index with no weight_map object")?;
    if wm.len() != c.len() {
        return violation(format!(
            "weight_map has {} names, catalog {}",
            wm.len(),
            c.len()
        ));
    }
    let mut files = BTreeSet::new();
    let mut seen = BTreeSet::new();
    for (name, f) in &wm {
        if !seen.insert(name.as_str()) {
            return violation(format!("accepted {name:?} listed twice"));
        }
        let f = f.as_str();
        files.insert(f);
        let e = c
            .get(name)
            .ok_or(format!("{name:?} mapped but not catalogued"))?;
        let path = &c.shards()[e.shard].path;
        if path.file_name().and_then(|x| x.to_str()) != Some(f) {
            return violation(format!("{name:?}: in {} but mapped to {f}", path.display()));
        }
    }
    let shard_files: Vec<&str> = c
        .shards()
        .iter()
        .filter_map(|s| s.path.file_name().and_then(|x| x.to_str()))
        .collect();
    if shard_files != files.iter().copied().collect::<Vec<_>>() {
        return violation(format!("shards {shard_files:?}, map files {files:?}"));
    }
    if c.index_total_size() != idx.total_size {
        return violation(format!("total_size {:?}", c.index_total_size()));
    }
    Ok(())
}

/// An accepted config: the reader's documented invariants, and every accessor runs.
fn check_config_invariants(c: &ModelConfig) -> Result<(), Violation> {
    if c.layer_kinds().len() != c.n_layers() {
        return violation("layer_kinds length".into());
    }
    if !(c.num_experts_per_token <= c.num_experts && c.num_experts_per_token > 0) {
        return violation(format!(
            "top-k {} of {} experts",
            c.num_experts_per_token, c.num_experts
        ));
    }
    let kda = c
        .layer_kinds()
        .iter()
        .filter(|&&k| k == LayerKind::Kda)
        .count();
    if kda != c.linear_attn.kda_layers.len() {
        return violation("kda layer count".into());
    }
    if !(c.rms_norm_eps > 0.0 && c.rms_norm_eps.is_finite()) {
        return violation(format!("rms_norm_eps {}", c.rms_norm_eps));
    }
    if c.kda_layer_indices().len() + c.mla_layer_indices().len() != c.n_layers() {
        return violation("kda + mla != layers".into());
    }
    for l in 0..c.n_layers() {
        let _ = (c.is_moe(l), c.is_attn_res_boundary(l), c.layer_kind(l));
    }
    let _ = (
        c.moe_layer_indices(),
        c.mla_qk_head_dim(),
        c.kda_dim(),
        c.shared_expert_width(),
        c.expert_format(),
    );
    for d in [Dtype::BF16, Dtype::F32] {
        let ts = c.expert_tensors(d);
        let sum: u64 = ts.iter().map(|t| t.bytes()).sum();
        if sum != c.expert_bytes(d) {
            return violation(format!("expert_bytes {} != sum {sum}", c.expert_bytes(d)));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Corpora and the per-target case builders.

/// One index corpus entry: the index text and the shard files it may name.
#[derive(Clone)]
struct Checkpoint {
    index: Vec<u8>,
    shards: Vec<(String, Arc<Vec<u8>>)>,
}

fn index_text(rng: &mut Rng, map: &[(String, String)], total: Option<u64>) -> Vec<u8> {
    let mut s = String::from("{");
    if let Some(t) = total {
        s.push_str(&format!("\"metadata\": {{\"total_size\": {t}}}, "));
    }
    s.push_str("\"weight_map\": {");
    for (i, (n, f)) in map.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&format!(
            "{}: {}",
            serde_json::to_string(n).unwrap_or_default(),
            serde_json::to_string(f).unwrap_or_default()
        ));
    }
    s.push_str("}}");
    if rng.one_in(3) {
        s.push('\n');
    }
    s.into_bytes()
}

fn synth_checkpoint(rng: &mut Rng) -> Checkpoint {
    let k = 1 + rng.below(4);
    let mut shards = Vec::new();
    let mut map = Vec::new();
    let mut i = 0;
    for s in 0..k {
        let file = format!("model-{:05}-of-{k:05}.safetensors", s + 1);
        let names: Vec<String> = (0..rng.below(6))
            .map(|_| {
                i += 1;
                random_name(rng, i)
            })
            .collect();
        for n in &names {
            map.push((n.clone(), file.clone()));
        }
        shards.push((file, Arc::new(synth_shard(rng, &names))));
    }
    if rng.one_in(2) {
        map.sort();
    }
    let total = (!rng.one_in(4)).then(|| rng.below(1 << 20) as u64);
    Checkpoint {
        index: index_text(rng, &map, total),
        shards,
    }
}

/// A checkpoint from real shard files, with an index written from their headers.
fn checkpoint_from_files(rng: &mut Rng, files: &[PathBuf]) -> Option<Checkpoint> {
    let mut shards = Vec::new();
    let mut map = Vec::new();
    for p in files {
        let bytes = std::fs::read(p).ok()?;
        let name = p.file_name()?.to_str()?.to_string();
        let (json, _) = split_shard(&bytes)?;
        let v: Value = serde_json::from_slice(&json).ok()?;
        for k in v.as_object()?.keys() {
            if k != "__metadata__" {
                map.push((k.clone(), name.clone()));
            }
        }
        shards.push((name, Arc::new(bytes)));
    }
    Some(Checkpoint {
        index: index_text(rng, &map, Some(1234)),
        shards,
    })
}

struct Fuzzer {
    target: Target,
    rng: Rng,
    /// Header: whole shard files. Config: config texts.
    files: Vec<Vec<u8>>,
    /// Index: checkpoints.
    checkpoints: Vec<Checkpoint>,
    /// Index: the real 14-shard tiny-mxfp4 checkpoint (used for 1 case in 256: it is slow).
    big: Option<Checkpoint>,
    /// Config: parsed trees of `files`.
    trees: Vec<Value>,
    grown: usize,
    fixed: usize,
}

impl Fuzzer {
    fn new(target: Target, seed: u64) -> Fuzzer {
        let mut rng = Rng::new(seed, STREAM);
        let fx = fixtures();
        let mut f = Fuzzer {
            target,
            rng: Rng::new(seed.wrapping_add(1), STREAM),
            files: Vec::new(),
            checkpoints: Vec::new(),
            big: None,
            trees: Vec::new(),
            grown: 0,
            fixed: 0,
        };
        match target {
            Target::Header => {
                let mut paths = vec![
                    fx.join("seed/st/model-00001-of-00002.safetensors"),
                    fx.join("seed/st/model-00002-of-00002.safetensors"),
                ];
                for i in [1, 2, 4, 11, 14] {
                    paths.push(fx.join(format!(
                        "tiny-mxfp4/sharded/model-{i:05}-of-000014.safetensors"
                    )));
                }
                f.files
                    .extend(paths.iter().filter_map(|p| std::fs::read(p).ok()));
                for _ in 0..48 {
                    let names: Vec<String> = (0..rng.below(8))
                        .map(|i| random_name(&mut rng, i))
                        .collect();
                    f.files.push(synth_shard(&mut rng, &names));
                }
            }
            Target::Index => {
                let seed_st = [
                    fx.join("seed/st/model-00001-of-00002.safetensors"),
                    fx.join("seed/st/model-00002-of-00002.safetensors"),
                ];
                f.checkpoints
                    .extend(checkpoint_from_files(&mut rng, &seed_st));
                for _ in 0..48 {
                    f.checkpoints.push(synth_checkpoint(&mut rng));
                }
                let dir = fx.join("tiny-mxfp4/sharded");
                let real = std::fs::read(dir.join("model.safetensors.index.json")).ok();
                let shards: Option<Vec<(String, Arc<Vec<u8>>)>> = (1..=14)
                    .map(|i| {
                        let n = format!("model-{i:05}-of-000014.safetensors");
                        std::fs::read(dir.join(&n)).ok().map(|b| (n, Arc::new(b)))
                    })
                    .collect();
                if let (Some(index), Some(shards)) = (real, shards) {
                    f.big = Some(Checkpoint { index, shards });
                }
            }
            Target::Config => {
                for p in [
                    "released/config.json",
                    "tiny-mxfp4/config.json",
                    "tiny-seed/config.json",
                ] {
                    if let Ok(b) = std::fs::read(fx.join(p)) {
                        if let Ok(v) = serde_json::from_slice(&b) {
                            f.trees.push(v);
                        }
                        f.files.push(b);
                    }
                }
            }
        }
        f.fixed = f.files.len().max(f.checkpoints.len());
        f
    }

    /// Keep an accepted mutant as a corpus entry (bounded; replaces an older one).
    fn grow_files(&mut self, input: Vec<u8>) {
        if self.grown < MAX_GROWN {
            self.files.push(input);
            self.grown += 1;
        } else {
            let i = self.fixed + self.rng.below(MAX_GROWN);
            if let Some(slot) = self.files.get_mut(i) {
                *slot = input;
            }
        }
    }

    /// Build one case.
    fn case(&mut self) -> Case {
        match self.target {
            Target::Header => self.header_case(),
            Target::Index => self.index_case(),
            Target::Config => self.config_case(),
        }
    }

    fn mutate_header(&mut self, base: &[u8]) -> Vec<u8> {
        let rng = &mut self.rng;
        let other = &self.files[rng.below(self.files.len())];
        let other_json = split_shard(other).map(|x| x.0).unwrap_or_default();
        let Some((mut json, mut data_len)) = split_shard(base) else {
            let mut b = base.to_vec();
            mutate_bytes(&mut b, 64, rng, other);
            return b;
        };
        for _ in 0..n_edits(rng) {
            match rng.below(10) {
                0..=3 => {
                    if !mutate_json_text(&mut json, rng, &other_json) {
                        mutate_bytes(&mut json, 0, rng, &other_json);
                    }
                }
                4..=6 => mutate_bytes(&mut json, 0, rng, &other_json),
                7 => {
                    // Structural edit of the parsed header.
                    if let Ok(mut v) = serde_json::from_slice::<Value>(&json) {
                        mutate_value(&mut v, rng, 0);
                        json = serde_json::to_vec(&v).unwrap_or_default();
                    }
                }
                8 => {
                    data_len = match rng.below(4) {
                        0 => data_len.saturating_sub(1 + rng.below(8)),
                        1 => data_len + 1 + rng.below(8),
                        2 => 0,
                        _ => rng.below(4096),
                    }
                }
                _ => {
                    // Spaces (the writer's padding) or a BOM / NUL at either end.
                    let pads: [&[u8]; 4] = [b"   ", b"\xef\xbb\xbf", b"\0", b"\n"];
                    let pad = *rng.pick(&pads);
                    if rng.one_in(2) {
                        json.extend_from_slice(pad);
                    } else {
                        json.splice(0..0, pad.iter().copied());
                    }
                }
            }
        }
        json.truncate(MAX_INPUT / 2);
        data_len = data_len.min(MAX_INPUT / 2);
        let prefix = match rng.below(12) {
            0 => *rng.pick(U64S),
            1 => (json.len() as u64)
                .wrapping_add(rng.below(3) as u64)
                .wrapping_sub(1),
            _ => json.len() as u64,
        };
        let mut f = prefix.to_le_bytes().to_vec();
        f.extend_from_slice(&json);
        f.resize(f.len() + data_len, 0);
        if rng.one_in(8) {
            // Raw edits of the whole file, the length prefix included.
            for _ in 0..n_edits(rng) {
                mutate_bytes(&mut f, 16, rng, other);
            }
        }
        f.truncate(MAX_INPUT);
        f
    }

    fn header_case(&mut self) -> Case {
        let i = self.rng.below(self.files.len());
        let base = std::mem::take(&mut self.files[i]);
        let f = self.mutate_header(&base);
        self.files[i] = base;
        Case::Header(f)
    }

    fn index_case(&mut self) -> Case {
        let use_big = self.big.is_some() && self.rng.one_in(256);
        let mut ck = if use_big {
            self.big
                .clone()
                .unwrap_or_else(|| self.checkpoints[0].clone())
        } else {
            self.checkpoints[self.rng.below(self.checkpoints.len())].clone()
        };
        let rng = &mut self.rng;
        let other = self.checkpoints[rng.below(self.checkpoints.len())]
            .index
            .clone();
        for _ in 0..n_edits(rng) {
            match rng.below(12) {
                0..=3 => {
                    if !mutate_json_text(&mut ck.index, rng, &other) {
                        mutate_bytes(&mut ck.index, 0, rng, &other);
                    }
                }
                4..=5 => mutate_bytes(&mut ck.index, 0, rng, &other),
                6..=8 => {
                    // Structural: edit the weight_map (drop, duplicate, reassign, rename).
                    if let Ok(mut v) = serde_json::from_slice::<Value>(&ck.index) {
                        if let Some(m) = v.get_mut("weight_map").and_then(|m| m.as_object_mut()) {
                            let files: Vec<String> =
                                ck.shards.iter().map(|s| s.0.clone()).collect();
                            let keys: Vec<String> = m.keys().cloned().collect();
                            let k = keys.get(rng.below(keys.len())).cloned();
                            match (rng.below(6), k) {
                                (0, Some(k)) => {
                                    m.remove(&k);
                                }
                                (1, Some(k)) => {
                                    let f = files.get(rng.below(files.len())).cloned();
                                    m.insert(k, Value::from(f.unwrap_or_default()));
                                }
                                (2, Some(k)) => {
                                    m.insert(
                                        k,
                                        Value::from(
                                            serde_json::from_str::<String>(&format!(
                                                "\"{}\"",
                                                rng.pick(STR_SUBS)
                                            ))
                                            .unwrap_or_default(),
                                        ),
                                    );
                                }
                                (3, Some(k)) => {
                                    let f = m.remove(&k).unwrap_or(Value::Null);
                                    m.insert(format!("{k}.x"), f);
                                }
                                (4, _) => {
                                    let f = files.get(rng.below(files.len())).cloned();
                                    m.insert(
                                        random_name(rng, 7),
                                        Value::from(f.unwrap_or_default()),
                                    );
                                }
                                _ => mutate_value(&mut v, rng, 0),
                            }
                        } else {
                            mutate_value(&mut v, rng, 0);
                        }
                        ck.index = serde_json::to_vec(&v).unwrap_or_default();
                    }
                }
                9 => {
                    // Escape a key's characters (the same name, spelled differently).
                    if let Some(i) = find_from(&ck.index, rng, |b, i| {
                        b[i].is_ascii_alphanumeric() && i > 0 && b[i - 1] != b'\\'
                    }) {
                        let esc = format!("\\u{:04x}", ck.index[i]);
                        ck.index.splice(i..i + 1, esc.bytes());
                    }
                }
                10 => {
                    // Break one shard: drop it, or mutate its header.
                    if !ck.shards.is_empty() {
                        let s = rng.below(ck.shards.len());
                        if rng.one_in(3) {
                            ck.shards.remove(s);
                        } else {
                            let b = Arc::make_mut(&mut ck.shards[s].1);
                            for _ in 0..n_edits(rng) {
                                mutate_bytes(b, 64, rng, &other);
                            }
                        }
                    }
                }
                _ => {
                    // Splice another checkpoint's index in whole or in part.
                    let s = rng.below(other.len().max(1));
                    ck.index.truncate(rng.below(ck.index.len() + 1));
                    ck.index
                        .extend_from_slice(other.get(s..).unwrap_or_default());
                }
            }
        }
        ck.index.truncate(MAX_INPUT);
        Case::Index(ck, use_big)
    }

    fn config_case(&mut self) -> Case {
        let rng = &mut self.rng;
        let text = if !self.trees.is_empty() && rng.below(2) == 0 {
            // Structural edits of a fixture config, then maybe text edits.
            let mut v = self.trees[rng.below(self.trees.len())].clone();
            for _ in 0..n_edits(rng) {
                // Most of the checking happens under text_config: aim there 3 times in 4.
                match v.get_mut("text_config") {
                    Some(tc) if !rng.one_in(4) => mutate_value(tc, rng, 0),
                    _ => mutate_value(&mut v, rng, 0),
                }
            }
            let mut t = if rng.one_in(2) {
                serde_json::to_vec(&v)
            } else {
                serde_json::to_vec_pretty(&v)
            }
            .unwrap_or_default();
            if rng.one_in(4) {
                let other = &self.files[rng.below(self.files.len())];
                mutate_json_text(&mut t, rng, other);
            }
            t
        } else {
            let mut t = self.files[rng.below(self.files.len())].clone();
            let other = &self.files[rng.below(self.files.len())];
            for _ in 0..n_edits(rng) {
                if rng.below(3) != 0 {
                    if !mutate_json_text(&mut t, rng, other) {
                        mutate_bytes(&mut t, 0, rng, other);
                    }
                } else {
                    mutate_bytes(&mut t, 0, rng, other);
                }
            }
            t
        };
        let mut text = text;
        text.truncate(MAX_INPUT);
        Case::Config(text)
    }

    /// Keep an accepted case as a corpus entry, one time in 16.
    fn keep(&mut self, case: Case) {
        if !self.rng.one_in(16) {
            return;
        }
        match case {
            Case::Header(f) => self.grow_files(f),
            Case::Index(_, true) => {}
            Case::Index(ck, false) => {
                if self.checkpoints.len() < self.fixed + MAX_GROWN {
                    self.checkpoints.push(ck);
                } else {
                    let i = self.fixed + self.rng.below(MAX_GROWN);
                    self.checkpoints[i] = ck;
                }
            }
            Case::Config(text) => {
                if let Ok(v) = serde_json::from_slice::<Value>(&text) {
                    if self.trees.len() < 3 + MAX_GROWN {
                        self.trees.push(v);
                    } else {
                        let i = 3 + self.rng.below(MAX_GROWN);
                        self.trees[i] = v;
                    }
                }
                self.grow_files(text);
            }
        }
    }
}

/// One built input.
enum Case {
    /// A whole safetensors file.
    Header(Vec<u8>),
    /// An index and its shards; true for the big real checkpoint.
    Index(Checkpoint, bool),
    /// config.json bytes.
    Config(Vec<u8>),
}

impl Case {
    /// The bytes a finding reports (for an index: the index text).
    fn input(&self) -> &[u8] {
        match self {
            Case::Header(b) | Case::Config(b) => b,
            Case::Index(ck, _) => &ck.index,
        }
    }
}

/// Run the reader under test on `case` and judge the result. This is the only code that
/// runs inside `catch_unwind`.
fn judge(case: &Case) -> Verdict {
    match case {
        Case::Header(f) => {
            let path = Path::new("fuzz.safetensors");
            match check_safetensors_bytes(path, f) {
                Ok(info) => match check_header_invariants(f, &info) {
                    Ok(()) => Verdict::Accepted,
                    Err(e) => Verdict::Broken(e),
                },
                Err(e) if e.msg.is_empty() || e.file != path => {
                    Verdict::broken(format!("error without a message or file: {e:?}"))
                }
                Err(_) => Verdict::Rejected,
            }
        }
        Case::Index(ck, _) => {
            let path = Path::new("/fuzz/model.safetensors.index.json");
            let shards = &ck.shards;
            let r = Catalog::from_index_bytes(path, &ck.index, |name: &str| {
                shards
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, b)| b.as_slice())
            });
            match r {
                Ok(c) => match check_index_invariants(&ck.index, &c) {
                    Ok(()) => Verdict::Accepted,
                    Err(e) => Verdict::Broken(e),
                },
                Err(e) if e.msg.is_empty() => {
                    Verdict::broken(format!("error without a message: {e:?}"))
                }
                Err(_) => Verdict::Rejected,
            }
        }
        // `ModelConfig::load` refuses non-UTF-8 before parsing; so does this.
        Case::Config(text) => match std::str::from_utf8(text) {
            Err(_) => Verdict::Rejected,
            Ok(s) => match ModelConfig::from_json_str(s) {
                Ok(c) => match check_config_invariants(&c) {
                    Ok(()) => Verdict::Accepted,
                    Err(e) => Verdict::Broken(e),
                },
                Err(e) if e.problems.is_empty() || e.problems.iter().any(|p| p.is_empty()) => {
                    Verdict::broken("error without problems".into())
                }
                Err(_) => Verdict::Rejected,
            },
        },
    }
}

impl Harness for Fuzzer {
    type Case = Case;

    fn case(&mut self) -> Case {
        Fuzzer::case(self)
    }

    fn judge(case: &Case) -> Verdict {
        judge(case)
    }

    fn input(case: &Case) -> &[u8] {
        case.input()
    }

    fn keep(&mut self, case: Case) {
        Fuzzer::keep(self, case)
    }
}

/// Run `execs` cases of `target` from `seed`. `progress` is called about every `every`
/// cases. Panics inside a case are caught and counted (the panic hook is silenced for the
/// run and restored after).
pub fn run(
    target: Target,
    seed: u64,
    execs: u64,
    every: u64,
    progress: impl FnMut(&FuzzReport),
) -> FuzzReport {
    let mut fz = Fuzzer::new(target, seed);
    fuzzkit::run(&mut fz, target.name(), seed, execs, every, progress)
}
