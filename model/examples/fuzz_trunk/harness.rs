//! A seeded mutation fuzzer for the packed trunk's readers of untrusted bytes:
//!
//! - `trunk`: `trunk.json`, through [`TrunkManifest::from_json_str`] and, one case in 64,
//!   [`TrunkManifest::load_dir`] on a directory holding the manifest and a (sparse) data
//!   file. Corpus: manifests packed here as `pack-trunk` packs them, from the tiny-mxfp4
//!   and tiny-seed checkpoints (each layer's tensors back to back, their real bytes, CRCs,
//!   SHA-256, the real [`SourceIdentity`]), raw (`k3-trunk/3`) and coded
//!   (`k3-trunk-coded/1`, chunks by [`encode_run`], with a coded lm_head made of layer 0's
//!   first rows by [`encode_head_rows`]), whole (one case in 256: 108 KB of
//!   JSON) and cut to their first 1 to 3 layers of a few tensors each, pretty and compact.
//!   Mutations: the model fuzzer's JSON text edits, byte edits, and structural edits of the parsed tree (a
//!   number nudged by ±1, doubled, zeroed or made huge, near 2^64 included; array entries
//!   dropped, duplicated or swapped; members deleted or added; the codec dropped or moved
//!   to a raw manifest). Verdict: the reader and an oracle must agree both ways. The oracle
//!   reads the same text with serde (the struct's own fields) and checks every documented
//!   rule itself, in 128-bit arithmetic (so a sum or an alignment that overflows 64 bits
//!   is an error, never a wrap or a saturation); an accepted manifest must round-trip
//!   (serialised again, it reads back equal); an error must name the file and have a
//!   problem that is not empty.
//! - `codec`: the chunk decoder, [`codec::decode`] and (one case in 8)
//!   [`decode_chunk`], with arbitrary stored bytes and a declared output size. Corpus:
//!   chunks encoded by [`codec::encode_with`] at levels 1, 3, 19 and fast literals from the tiny
//!   checkpoints' real tensor bytes, Gaussian-like BF16, F32, random and constant bytes,
//!   of 0 to 64 KiB, odd sizes included. Mutations: the header's plane length nudged,
//!   edits inside the zstd frame (its header, its block headers, its literals), the frame
//!   cut, a frame from another chunk spliced in, the planes swapped, byte edits, and the
//!   declared size off by one, two, zero or another chunk's. Verdict: the decoder writes
//!   only its slot (guard bytes on both sides of the output stay as they were); it either
//!   fails with a message, or fills the slot with exactly what an independent decoder
//!   makes of the bytes (zstd's streaming decoder on the exponent plane, the planes joined
//!   by the format's formula), the original bytes when the chunk is unchanged;
//!   `decode_chunk` accepts only what passes both CRCs.
//!
//! Every case runs under `catch_unwind`; a finding is a panic, an error with no message or
//! a verdict the oracle disagrees with. The machinery is `fuzzkit`'s; shared by the
//! `fuzz_trunk` example (long runs, docs/fuzzing.md) and `tests/fuzz_trunk.rs` (a CI-sized
//! run).

use std::path::PathBuf;

use fuzzkit::json::JsonEdits;
use fuzzkit::{n_edits, FuzzReport, Harness, Rng, Verdict};
use k3_model::catalog::Catalog;
use k3_model::codec::{self, Codec, Effort};
use k3_model::codec_trunk::{decode_chunk, encode_head_rows, encode_run};
use k3_model::tensor::Dtype;
use k3_model::trunk::{
    align_up, chunk_crcs, CodedChunk, CodedHead, SourceIdentity, TrunkCodec, TrunkLayer,
    TrunkManifest, TrunkTensor, CHECK_CHUNK, CODEC_CHUNK, CODED_BIN, TRUNK_BIN, TRUNK_CODED_FORMAT,
    TRUNK_FORMAT, TRUNK_JSON,
};
use serde_json::Value;

/// Largest manifest one case builds (bytes).
const MAX_JSON: usize = 1 << 20;
/// Largest manifest kept as corpus (the small ones are a few KiB, the whole ones 108 KB).
const MAX_KEPT_JSON: usize = 32 << 10;
/// Largest chunk (stored bytes) and declared output one case builds.
const MAX_CHUNK: usize = 1 << 17;
/// Guard bytes on each side of the decoder's output slot.
const GUARD: usize = 64;
/// Most accepted mutants kept as extra corpus entries.
const MAX_GROWN: usize = 256;
/// The stream of this harness's [`Rng`]s.
const STREAM: u64 = 0x6b33_5f74_7275_6e6b;

fuzzkit::targets! {
    /// The readers under test.
    pub enum Target {
        Trunk => "trunk",
        Codec => "codec",
    }
}

/// The fixtures directory of this repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

// ---------------------------------------------------------------------------------------
// The corpus: manifests packed as pack-trunk packs them.

fn sha256_hex(b: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// Each decoder layer's run of a checkpoint: its tensors back to back, with their bytes.
fn layer_runs(cat: &Catalog) -> Vec<(Vec<TrunkTensor>, Vec<u8>, String)> {
    let files: Vec<Vec<u8>> = cat
        .shards()
        .iter()
        .map(|s| std::fs::read(&s.path).unwrap_or_default())
        .collect();
    let mut runs = Vec::new();
    for l in 0.. {
        let pre = format!("language_model.model.layers.{l}.");
        let mut ts: Vec<(String, _)> = cat
            .iter()
            .filter(|(n, _)| n.starts_with(&pre) && !n.contains(".experts."))
            .collect();
        if ts.is_empty() {
            break;
        }
        ts.sort_by_key(|(_, e)| (e.shard, e.offset));
        let (mut run, mut tensors) = (Vec::new(), Vec::new());
        for (name, e) in &ts {
            let src = files[e.shard]
                .get(e.offset as usize..e.end() as usize)
                .unwrap_or_default();
            tensors.push(TrunkTensor {
                name: name.clone(),
                dtype: e.dtype,
                shape: e.shape.to_vec(),
                offset: run.len() as u64,
                len: e.len,
                crc32: chunk_crcs(src),
            });
            run.extend_from_slice(src);
        }
        let shard = cat.shards()[ts[0].1.shard]
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        runs.push((tensors, run, shard));
    }
    runs
}

/// A manifest of `runs` (raw, or coded at zstd level 1), as pack-trunk writes it.
fn pack(
    runs: &[(Vec<TrunkTensor>, Vec<u8>, String)],
    src: &SourceIdentity,
    coded: bool,
) -> TrunkManifest {
    let (mut layers, mut coded_layers, mut end, mut cend) = (vec![], vec![], 0u64, 0u64);
    for (l, (tensors, run, shard)) in runs.iter().enumerate() {
        let length = run.len() as u64;
        layers.push(TrunkLayer {
            layer: l,
            offset: end,
            length,
            padded_length: align_up(length, 4096),
            shard: shard.clone(),
            source_offset: 4096 * l as u64,
            sha256: sha256_hex(run),
            crc32: chunk_crcs(run),
            tensors: tensors.clone(),
        });
        end += align_up(length, 4096);
        if coded {
            if let Ok((bytes, mut cl)) = encode_run(Codec::Bf16Zstd, l, run, 4096, Effort::Level(1))
            {
                cl.offset = cend;
                cend += bytes.len() as u64;
                coded_layers.push(cl);
            }
        }
    }
    let max = layers.iter().fold((0, 0), |m, l| {
        if l.length > m.0 {
            (l.length, l.layer)
        } else {
            m
        }
    });
    TrunkManifest {
        format: if coded {
            TRUNK_CODED_FORMAT
        } else {
            TRUNK_FORMAT
        }
        .into(),
        align: 4096,
        file: TRUNK_BIN.into(),
        file_size: end,
        total_bytes: layers.iter().map(|l| l.length).sum(),
        max_run: max.0,
        max_run_layer: max.1,
        source: src.clone(),
        codec: coded.then(|| TrunkCodec {
            name: Codec::Bf16Zstd.name().into(),
            chunk: CODEC_CHUNK,
            file: CODED_BIN.into(),
            file_size: cend,
            stored_bytes: coded_layers
                .iter()
                .flat_map(|c| &c.chunks)
                .map(|c| c.stored)
                .sum(),
            layers: coded_layers,
            head: runs.first().and_then(|r| coded_head(&r.1)),
        }),
        layers,
    }
}

/// A coded lm_head of 128 columns made of `run`'s first whole rows (at most 64), in
/// chunks of 8 rows, as `pack-trunk --codec` codes one.
fn coded_head(run: &[u8]) -> Option<CodedHead> {
    const ROW: usize = 256;
    let rows = (run.len() / ROW).min(64);
    let raw = &run[..rows * ROW];
    let (bytes, chunks) =
        encode_head_rows(Codec::Bf16Zstd, raw, ROW as u64, 8, 4096, Effort::Level(1)).ok()?;
    Some(CodedHead {
        tensor: k3_model::classify::LM_HEAD.into(),
        dtype: Dtype::BF16,
        shape: vec![rows, ROW / 2],
        chunk_rows: 8,
        file: k3_model::trunk::CODED_HEAD_BIN.into(),
        file_size: bytes.len() as u64,
        stored_bytes: chunks.iter().map(|c| c.stored).sum(),
        sha256: sha256_hex(raw),
        chunks,
    })
}

/// Whole manifests, small ones, and raw run bytes.
type Corpus = (Vec<Vec<u8>>, Vec<Vec<u8>>, Vec<Vec<u8>>);

/// The manifests of the corpus (whole ones, then small ones) and the raw bytes the codec
/// corpus starts from.
fn trunk_corpus() -> Corpus {
    let (mut big, mut small, mut raws) = (Vec::new(), Vec::new(), Vec::new());
    for m in ["tiny-mxfp4/sharded", "tiny-seed"] {
        let Ok(cat) = Catalog::open(fixtures().join(m)) else {
            continue;
        };
        let Ok(src) = SourceIdentity::of(&cat) else {
            continue;
        };
        let runs = layer_runs(&cat);
        for (_, run, _) in runs.iter().take(4) {
            raws.push(run.clone());
        }
        for coded in [false, true] {
            big.push(serde_json::to_vec_pretty(&pack(&runs, &src, coded)).unwrap_or_default());
            for k in 1..=3.min(runs.len()) {
                let mut s = src.clone();
                s.shards.truncate(k);
                // Small manifests (fast cases): each layer cut to its first few tensors.
                let cut: Vec<_> = runs[..k]
                    .iter()
                    .enumerate()
                    .map(|(i, (ts, run, shard))| {
                        let ts = ts[..ts.len().min(1 + 2 * i + k)].to_vec();
                        let end = ts.last().map_or(0, |t| (t.offset + t.len) as usize);
                        (ts, run[..end].to_vec(), shard.clone())
                    })
                    .collect();
                let m = pack(&cut, &s, coded);
                small.push(serde_json::to_vec_pretty(&m).unwrap_or_default());
                small.push(serde_json::to_vec(&m).unwrap_or_default());
            }
        }
    }
    (big, small, raws)
}

// ---------------------------------------------------------------------------------------
// Edits.

const INT_STRS: &[&str] = &[
    "0",
    "1",
    "-1",
    "4095",
    "4096",
    "4097",
    "1048576",
    "4194304",
    "4194305",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709547520",
    "18446744073709551615",
    "18446744073709551616",
    "1.5",
    "1e3",
    "-0",
    "null",
];

const STR_SUBS: &[&str] = &[
    "",
    "k3-trunk/3",
    "k3-trunk-coded/1",
    "k3-trunk/2",
    "bf16-zstd",
    "trunk.bin",
    "trunk.k3z",
    "a/b",
    ".",
    "..",
    "../trunk.bin",
    "BF16",
    "F32",
    "U8",
    "F8_E4M3",
    "\\u0000",
    "\\ud800",
    "0000000000000000000000000000000000000000000000000000000000000000",
    "é",
];

const JSON_EDITS: JsonEdits<'static> = JsonEdits {
    ints: INT_STRS,
    strs: STR_SUBS,
    numeric_keys: false,
};

const U64S: &[u64] = &[
    0,
    1,
    4095,
    4096,
    CHECK_CHUNK,
    CODEC_CHUNK,
    CODEC_CHUNK + 1,
    u32::MAX as u64,
    1 << 32,
    1 << 63,
    u64::MAX - 4095,
    u64::MAX - 4096,
    u64::MAX,
];

/// A numeric neighbour of `n`.
fn neighbour(n: &serde_json::Number, rng: &mut Rng) -> Value {
    let x = n.as_u64().unwrap_or(1);
    match rng.below(8) {
        0 => Value::from(x.wrapping_add(1)),
        1 => Value::from(x.wrapping_sub(1)),
        2 => Value::from(x.wrapping_mul(2)),
        3 => Value::from(x.wrapping_add(4096)),
        4 => Value::from(0),
        5 | 6 => Value::from(*rng.pick(U64S)),
        _ => Value::from(x / 2),
    }
}

/// One structural edit at a random node of `v`.
fn mutate_value(v: &mut Value, rng: &mut Rng, depth: usize) {
    match v {
        Value::Object(m) if !m.is_empty() && !rng.one_in(6) && depth < 32 => {
            let Some(k) = m.keys().nth(rng.below(m.len())).cloned() else {
                return;
            };
            match rng.below(12) {
                0 => {
                    m.remove(&k);
                }
                1 => {
                    m.insert(format!("{k}_"), Value::from(1));
                }
                _ => {
                    if let Some(c) = m.get_mut(&k) {
                        mutate_value(c, rng, depth + 1);
                    }
                }
            }
        }
        Value::Array(a) if !a.is_empty() && !rng.one_in(6) && depth < 32 => {
            let i = rng.below(a.len());
            match rng.below(10) {
                0 => {
                    a.remove(i);
                }
                1 => {
                    let x = a[i].clone();
                    a.insert(i, x);
                }
                2 => {
                    let j = rng.below(a.len());
                    a.swap(i, j);
                }
                3 => a.truncate(i),
                _ => mutate_value(&mut a[i], rng, depth + 1),
            }
        }
        Value::Number(n) => *v = neighbour(n, rng),
        Value::String(_) => {
            *v = Value::String(
                serde_json::from_str(&format!("\"{}\"", rng.pick(STR_SUBS))).unwrap_or_default(),
            )
        }
        _ => *v = Value::from(*rng.pick(U64S)),
    }
}

/// A position in `b` (or its end).
fn pos(b: &[u8], rng: &mut Rng) -> usize {
    rng.below(b.len() + 1).min(b.len())
}

/// One byte-level edit of `b` (`other`: another corpus entry, for splices).
fn mutate_bytes(b: &mut Vec<u8>, rng: &mut Rng, other: &[u8]) {
    match rng.below(8) {
        0 if !b.is_empty() => {
            let i = rng.below(b.len());
            b[i] ^= 1 << rng.below(8);
        }
        1 if !b.is_empty() => {
            let i = rng.below(b.len());
            b[i] = rng.next_u64() as u8;
        }
        2 => {
            let i = pos(b, rng);
            let ins: Vec<u8> = (0..1 + rng.below(8))
                .map(|_| rng.next_u64() as u8)
                .collect();
            b.splice(i..i, ins);
        }
        3 if !b.is_empty() => {
            let i = rng.below(b.len());
            let n = (1 + rng.below(16)).min(b.len() - i);
            b.drain(i..i + n);
        }
        4 => {
            let v = *rng.pick(U64S);
            let w = if rng.one_in(2) {
                v.to_le_bytes().to_vec()
            } else {
                (v as u32).to_le_bytes().to_vec()
            };
            if b.len() >= w.len() {
                let i = rng.below(b.len() - w.len() + 1);
                b[i..i + w.len()].copy_from_slice(&w);
            }
        }
        5 if !other.is_empty() => {
            let s = rng.below(other.len());
            let n = (1 + rng.below(64)).min(other.len() - s);
            let i = pos(b, rng);
            let e = if rng.one_in(2) {
                i
            } else {
                (i + n).min(b.len())
            };
            b.splice(i..e, other[s..s + n].iter().copied());
        }
        6 => {
            let n = pos(b, rng);
            b.truncate(n);
        }
        _ if !b.is_empty() => {
            let s = rng.below(b.len());
            let n = (1 + rng.below(64)).min(b.len() - s);
            let chunk = b[s..s + n].to_vec();
            let i = pos(b, rng);
            b.splice(i..i, chunk);
        }
        _ => b.push(rng.next_u64() as u8),
    }
}

// ---------------------------------------------------------------------------------------
// The manifest oracle.

fn up(x: u128, a: u128) -> u128 {
    x.div_ceil(a) * a
}

/// Every documented rule of a manifest's tensor table (layer `l`), in 128-bit arithmetic.
fn oracle_tensors(l: &TrunkLayer) -> Result<(), String> {
    let (mut end, mut covered) = (0u128, 0u128);
    for t in &l.tensors {
        let numel = t
            .shape
            .iter()
            .fold(1u128, |a, &d| a.saturating_mul(d as u128));
        if numel.saturating_mul(t.dtype.size() as u128) != t.len as u128 {
            return Err(format!("tensor {} len", t.name));
        }
        if (t.offset as u128) < end {
            return Err(format!("tensor {} overlaps", t.name));
        }
        if t.crc32.len() as u128 != (t.len as u128).div_ceil(CHECK_CHUNK as u128) {
            return Err(format!("tensor {} crc count", t.name));
        }
        end = t.offset as u128 + t.len as u128;
        covered += t.len as u128;
        if end > l.length as u128 {
            return Err(format!("tensor {} past the run", t.name));
        }
    }
    if covered != l.length as u128 {
        return Err("tensors do not cover the run".into());
    }
    Ok(())
}

/// The codec part's rules.
fn oracle_codec(m: &TrunkManifest, c: &TrunkCodec) -> Result<(), String> {
    let a = m.align as u128;
    let chunk = CODEC_CHUNK as u128;
    if Codec::from_name(&c.name).is_none() || c.chunk != CODEC_CHUNK {
        return Err("codec name or chunk".into());
    }
    if matches!(c.file.as_str(), "" | "." | "..") || c.file.contains('/') || c.file == m.file {
        return Err("codec file".into());
    }
    if c.layers.len() != m.layers.len() {
        return Err("codec layer count".into());
    }
    let (mut end, mut stored) = (0u128, 0u128);
    for (cl, l) in c.layers.iter().zip(&m.layers) {
        let off = cl.offset as u128;
        if cl.layer != l.layer || !off.is_multiple_of(a) || off < end {
            return Err(format!("codec layer {} placement", cl.layer));
        }
        if cl.padded_length as u128 != up(cl.stored_length as u128, a) {
            return Err(format!("codec layer {} padding", cl.layer));
        }
        end = off + cl.padded_length as u128;
        let len = l.length as u128;
        if cl.chunks.len() as u128 != len.div_ceil(chunk) {
            return Err(format!("codec layer {} chunk count", cl.layer));
        }
        let mut at = 0u128;
        for (i, ch) in cl.chunks.iter().enumerate() {
            let raw = chunk.min(len - i as u128 * chunk);
            if ch.raw as u128 != raw
                || !(ch.offset as u128).is_multiple_of(a)
                || (ch.offset as u128) < at
            {
                return Err(format!("codec layer {} chunk {i}", cl.layer));
            }
            at = ch.offset as u128 + ch.stored as u128;
            stored += ch.stored as u128;
        }
        if at != cl.stored_length as u128 {
            return Err(format!("codec layer {} stored_length", cl.layer));
        }
    }
    if end != c.file_size as u128 || stored != c.stored_bytes as u128 {
        return Err("codec file_size or stored_bytes".into());
    }
    match &c.head {
        Some(h) => oracle_head(m, c, h),
        None => Ok(()),
    }
}

/// The oracle's rules of a coded lm_head, in 128-bit arithmetic.
fn oracle_head(m: &TrunkManifest, c: &TrunkCodec, h: &CodedHead) -> Result<(), String> {
    let a = m.align as u128;
    let f = h.file.as_str();
    if matches!(f, "" | "." | "..") || f.contains('/') || f == m.file || f == c.file {
        return Err("head file".into());
    }
    if h.tensor != k3_model::classify::LM_HEAD || h.dtype != Dtype::BF16 || h.shape.len() != 2 {
        return Err("head tensor".into());
    }
    let (rows, row) = (h.shape[0] as u128, h.shape[1] as u128 * 2);
    let cr = h.chunk_rows as u128;
    if row == 0 || cr == 0 || cr.checked_mul(row).is_none_or(|b| b > CODEC_CHUNK as u128) {
        return Err("head rows per chunk".into());
    }
    if h.chunks.len() as u128 != rows.div_ceil(cr) {
        return Err("head chunk count".into());
    }
    if h.sha256.len() != 64 || !h.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("head sha256".into());
    }
    let (mut at, mut stored) = (0u128, 0u128);
    for (i, ch) in h.chunks.iter().enumerate() {
        let raw = cr.min(rows - i as u128 * cr) * row;
        let off = ch.offset as u128;
        if ch.raw as u128 != raw || !off.is_multiple_of(a) || off < at {
            return Err(format!("head chunk {i}"));
        }
        at = off + ch.stored as u128;
        stored += ch.stored as u128;
    }
    if up(at, a) != h.file_size as u128 || stored != h.stored_bytes as u128 {
        return Err("head file_size or stored_bytes".into());
    }
    Ok(())
}

/// The oracle's verdict on manifest text: the manifest, or why not.
fn oracle_manifest(text: &str) -> Result<TrunkManifest, String> {
    let m: TrunkManifest = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let want = if m.codec.is_some() {
        TRUNK_CODED_FORMAT
    } else {
        TRUNK_FORMAT
    };
    if m.format != want {
        return Err("format".into());
    }
    if !m.align.is_power_of_two() {
        return Err("align".into());
    }
    if matches!(m.file.as_str(), "" | "." | "..") || m.file.contains('/') {
        return Err("file".into());
    }
    let a = m.align as u128;
    let (mut end, mut total, mut max) = (0u128, 0u128, (0u64, 0usize));
    for (i, l) in m.layers.iter().enumerate() {
        let off = l.offset as u128;
        if l.layer != i || !off.is_multiple_of(a) || off < end {
            return Err(format!("layer {i} placement"));
        }
        if l.padded_length as u128 != up(l.length as u128, a) {
            return Err(format!("layer {i} padding"));
        }
        end = off + l.padded_length as u128;
        if end > m.file_size as u128 {
            return Err(format!("layer {i} past the file"));
        }
        if l.crc32.len() as u128 != (l.length as u128).div_ceil(CHECK_CHUNK as u128) {
            return Err(format!("layer {i} crc count"));
        }
        if l.sha256.len() != 64 || !l.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("layer {i} sha256"));
        }
        total += l.length as u128;
        if l.length > max.0 {
            max = (l.length, l.layer);
        }
        oracle_tensors(l)?;
    }
    if !m.layers.is_empty() && end != m.file_size as u128 {
        return Err("file_size".into());
    }
    if let Some(c) = &m.codec {
        oracle_codec(&m, c)?;
    }
    if total != m.total_bytes as u128 {
        return Err("total_bytes".into());
    }
    if !m.layers.is_empty() && (max.0 != m.max_run || max.1 != m.max_run_layer) {
        return Err("max_run".into());
    }
    Ok(m)
}

/// Reader and oracle agree; an accepted manifest round-trips.
fn judge_manifest(text: &[u8], on_disk: bool) -> Verdict {
    // `load_dir` reads the file as UTF-8 text; so does this.
    let Ok(s) = std::str::from_utf8(text) else {
        return Verdict::Rejected;
    };
    let want = oracle_manifest(s);
    let got = if on_disk {
        load_from_dir(text, want.as_ref().ok())
    } else {
        TrunkManifest::from_json_str(s)
    };
    match (got, want) {
        (Ok(g), Ok(w)) if g == w => {
            let back = serde_json::to_string(&g).unwrap_or_default();
            match TrunkManifest::from_json_str(&back) {
                Ok(b) if b == g => Verdict::Accepted,
                _ => Verdict::broken("an accepted manifest does not round-trip".into()),
            }
        }
        (Ok(_), Ok(_)) => Verdict::broken("the reader's manifest differs from serde's".into()),
        (Ok(_), Err(why)) => Verdict::broken(format!("accepted, the oracle refuses it: {why}")),
        (Err(e), Ok(_)) => Verdict::broken(format!("refused ({e}), the oracle accepts it")),
        (Err(e), Err(_))
            if e.problems.is_empty() || e.problems.iter().any(|p| p.trim().is_empty()) =>
        {
            Verdict::broken(format!("error without a problem: {e:?}"))
        }
        (Err(e), Err(_)) if !e.path.ends_with(TRUNK_JSON) => {
            Verdict::broken(format!("error without the file: {e:?}"))
        }
        (Err(_), Err(_)) => Verdict::Rejected,
    }
}

/// [`TrunkManifest::load_dir`] on a fresh directory holding `text` and, when the oracle
/// accepts it, a sparse data file of the size it names (none when that is over 1 GiB: the
/// reader must then refuse it).
fn load_from_dir(
    text: &[u8],
    m: Option<&TrunkManifest>,
) -> Result<TrunkManifest, k3_model::trunk::TrunkError> {
    let fail = |why: String| k3_model::trunk::TrunkError {
        path: PathBuf::from(TRUNK_JSON),
        problems: vec![format!("harness: {why}")],
    };
    let dir = tempdir_for_case().map_err(|e| fail(e.to_string()))?;
    std::fs::write(dir.join(TRUNK_JSON), text).map_err(|e| fail(e.to_string()))?;
    // The data file, when the oracle accepts the manifest: made when it can be (at most
    // 1 GiB, sparse, a name a file can have).
    let mut made = true;
    if let Some(m) = m {
        let (file, size) = match &m.codec {
            Some(c) => (&c.file, c.file_size),
            None => (&m.file, m.file_size),
        };
        let head = m.codec.as_ref().and_then(|c| c.head.as_ref());
        for (file, size) in
            std::iter::once((file, size)).chain(head.map(|h| (&h.file, h.file_size)))
        {
            made &= size <= 1 << 30
                && std::fs::File::create(dir.join(file))
                    .and_then(|f| f.set_len(size))
                    .is_ok();
        }
    }
    let r = TrunkManifest::load_dir(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    match (r, m) {
        // Without its data file the manifest must be refused (the oracle's acceptance is
        // then what agrees); accepted, the disagreement is reported.
        (Err(e), Some(m)) if !made && !e.problems.is_empty() => Ok(m.clone()),
        (Ok(_), Some(_)) if !made => Err(fail("accepted without its data file".into())),
        (r, _) => r,
    }
}

fn tempdir_for_case() -> std::io::Result<PathBuf> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "k3-fuzz-trunk-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

// ---------------------------------------------------------------------------------------
// The codec oracle.

/// What an independent decoder makes of `stored` for an output of `n` bytes: zstd's
/// streaming decoder on the exponent plane (`[exp_len u32][frame][sign+mantissa][odd
/// byte]`), the planes joined word by word.
pub fn oracle_decode(stored: &[u8], n: usize) -> Option<Vec<u8>> {
    let zl = u32::from_le_bytes(stored.get(..4)?.try_into().ok()?) as usize;
    let words = n / 2;
    if stored.len() as u128 != 4 + zl as u128 + words as u128 + (n % 2) as u128 {
        return None;
    }
    let frame = &stored[4..4 + zl];
    let mut exp = Vec::new();
    // Known leniency (docs/fuzzing.md): an empty plane stored as no frame at all (zstd's
    // one-shot decoder reads zero bytes as zero frames) is accepted for a chunk of 0 or 1
    // bytes; the streaming decoder wants a frame.
    if zl == 0 && words == 0 {
        return Some(stored[4..].to_vec());
    }
    let mut d = zstd::stream::read::Decoder::with_buffer(frame).ok()?;
    // No window limit: the one-shot decoder under test has none (it writes into the slot).
    d.window_log_max(31).ok()?;
    // Read one byte more than the plane needs: a frame that decodes to more is refused.
    std::io::Read::read_to_end(&mut std::io::Read::take(&mut d, words as u64 + 1), &mut exp)
        .ok()?;
    if exp.len() != words {
        return None;
    }
    let sm = &stored[4 + zl..4 + zl + words];
    let mut out = Vec::with_capacity(n);
    for (e, s) in exp.iter().zip(sm) {
        let w = (u16::from(s & 0x80) << 8) | (u16::from(*e) << 7) | u16::from(s & 0x7f);
        out.extend_from_slice(&w.to_le_bytes());
    }
    if n % 2 == 1 {
        out.push(*stored.last()?);
    }
    Some(out)
}

/// Whether the stored chunk's zstd frame asks for a window over 2^31 bytes (its frame
/// header has a window descriptor, as a frame without a single-segment flag does).
fn needs_big_window(stored: &[u8]) -> bool {
    let (Some(&fhd), Some(&wd)) = (stored.get(8), stored.get(9)) else {
        return false;
    };
    let single_segment = fhd & 0x20 != 0;
    let log = 10 + u32::from(wd >> 3);
    let window = (1u64 << log) + (1u64 << log) / 8 * u64::from(wd & 7);
    stored.get(4..8) == Some(&[0x28, 0xb5, 0x2f, 0xfd][..]) && !single_segment && window > 1 << 31
}

/// One codec case: stored bytes, the declared size, the original raw bytes when the
/// stored ones are unchanged, and whether it goes through `decode_chunk` (with the CRCs
/// of the original raw bytes and of the stored ones as given).
pub struct CodecCase {
    pub stored: Vec<u8>,
    pub n: usize,
    pub raw: Option<Vec<u8>>,
    pub chunk: Option<CodedChunk>,
}

thread_local! {
    static DECODER: std::cell::RefCell<codec::Decoder> =
        std::cell::RefCell::new(codec::Decoder::new());
}

fn judge_codec(c: &CodecCase) -> Verdict {
    let mut buf = vec![0xA5u8; c.n + 2 * GUARD];
    let (lo, hi) = (GUARD, GUARD + c.n);
    let r = match &c.chunk {
        // One decoder for every case of the thread, as the loader pools them: a context
        // left dirty by a failed case must not change a later case's result.
        Some(ch) => DECODER.with(|d| {
            decode_chunk(
                &mut d.borrow_mut(),
                Codec::Bf16Zstd,
                3,
                7,
                ch,
                &c.stored,
                &mut buf[lo..hi],
            )
            .map_err(|e| e.to_string())
        }),
        None => {
            codec::decode(Codec::Bf16Zstd, &c.stored, &mut buf[lo..hi]).map_err(|e| e.to_string())
        }
    };
    if buf[..lo].iter().chain(&buf[hi..]).any(|&b| b != 0xA5) {
        return Verdict::broken("the decoder wrote outside its slot".into());
    }
    let want = oracle_decode(&c.stored, c.n);
    match (r, want) {
        (Ok(()), Some(w)) if buf[lo..hi] == w[..] => match &c.raw {
            Some(raw) if raw[..] != w[..] => {
                Verdict::broken("an unchanged chunk decodes to other bytes".into())
            }
            _ => match &c.chunk {
                Some(ch) if crc32c::crc32c(&w) != ch.crc32_raw => {
                    Verdict::broken("decode_chunk accepted bytes that fail their CRC".into())
                }
                _ => Verdict::Accepted,
            },
        },
        (Ok(()), Some(_)) => Verdict::broken("decoded bytes differ from the oracle's".into()),
        // Known leniency (docs/fuzzing.md): the one-shot decoder writes into the slot and
        // needs no window, so a frame whose window descriptor asks for more than zstd's
        // streaming limit (2^31) is decoded; the streaming oracle refuses it.
        (Ok(()), None) if needs_big_window(&c.stored) => Verdict::Accepted,
        (Ok(()), None) => Verdict::broken("decoded a chunk the oracle refuses".into()),
        (Err(e), _) if e.trim().is_empty() || e.trim_end().ends_with(':') => {
            Verdict::broken(format!("error without a message: {e:?}"))
        }
        // Refusing is always safe, and libzstd's one-shot decoder is stricter than its
        // streaming one (it checks a frame's declared content size against its blocks):
        // a refusal of what the oracle decodes is not a finding.
        (Err(_), _) => Verdict::Rejected,
    }
}

/// Raw buffers for codec chunks: Gaussian-like BF16, F32, random, constant (the real
/// tensor bytes are added by the caller).
fn synth_raw(rng: &mut Rng) -> Vec<u8> {
    let n = *rng.pick(&[
        0usize, 1, 2, 3, 7, 100, 255, 4095, 4096, 10_001, 32_768, 65_536,
    ]);
    match rng.below(4) {
        0 => (0..n)
            .map(|i| {
                if i % 2 == 1 {
                    0x3c + (rng.below(3) as u8)
                } else {
                    rng.next_u64() as u8
                }
            })
            .collect(),
        1 => (0..n / 4 + 1)
            .flat_map(|_| (rng.next_u64() as u32 as f32 * 1e-9).to_le_bytes())
            .take(n)
            .collect(),
        2 => (0..n).map(|_| rng.next_u64() as u8).collect(),
        _ => vec![rng.next_u64() as u8; n],
    }
}

// ---------------------------------------------------------------------------------------
// The fuzzer.

struct Fuzzer {
    target: Target,
    rng: Rng,
    /// Trunk: small manifests. Codec: unused.
    files: Vec<Vec<u8>>,
    /// Trunk: whole manifests (one case in 256).
    big: Vec<Vec<u8>>,
    /// Codec: (raw, stored) chunks.
    chunks: Vec<(Vec<u8>, Vec<u8>)>,
    fixed: usize,
    grown: usize,
}

impl Fuzzer {
    fn new(target: Target, seed: u64) -> Fuzzer {
        let mut rng = Rng::new(seed, STREAM);
        let (big, small, raws) = trunk_corpus();
        let mut f = Fuzzer {
            target,
            rng: Rng::new(seed.wrapping_add(1), STREAM),
            files: Vec::new(),
            big: Vec::new(),
            chunks: Vec::new(),
            fixed: 0,
            grown: 0,
        };
        match target {
            Target::Trunk => {
                f.files = small;
                f.big = big;
                f.fixed = f.files.len();
            }
            Target::Codec => {
                let mut inputs: Vec<Vec<u8>> = Vec::new();
                for r in &raws {
                    for _ in 0..4 {
                        let s = rng.below(r.len().max(1));
                        let n = rng.below(1 << 16).min(r.len() - s.min(r.len()));
                        inputs.push(r[s..s + n].to_vec());
                    }
                }
                for _ in 0..32 {
                    inputs.push(synth_raw(&mut rng));
                }
                for (i, raw) in inputs.into_iter().enumerate() {
                    let effort = [
                        Effort::Level(1),
                        Effort::Level(3),
                        Effort::Level(19),
                        Effort::Literals,
                    ][i % 4];
                    if let Ok(z) = codec::encode_with(Codec::Bf16Zstd, &raw, effort) {
                        f.chunks.push((raw, z));
                    }
                }
                f.fixed = f.chunks.len();
            }
        }
        f
    }

    fn trunk_case(&mut self) -> Case {
        let rng = &mut self.rng;
        let base = if !self.big.is_empty() && rng.one_in(256) {
            &self.big[rng.below(self.big.len())]
        } else {
            &self.files[rng.below(self.files.len())]
        };
        let mut text = base.clone();
        let other = self.files[rng.below(self.files.len())].clone();
        for _ in 0..n_edits(rng) {
            match rng.below(10) {
                0..=2 => {
                    if !fuzzkit::json::mutate_json_text(&mut text, rng, &other, &JSON_EDITS) {
                        mutate_bytes(&mut text, rng, &other);
                    }
                }
                3 => mutate_bytes(&mut text, rng, &other),
                4 => {
                    // Drop the codec (a coded manifest read as raw) or move another's in.
                    if let Ok(mut v) = serde_json::from_slice::<Value>(&text) {
                        let o: Option<Value> = serde_json::from_slice::<Value>(&other)
                            .ok()
                            .and_then(|o| o.get("codec").cloned());
                        if let Some(m) = v.as_object_mut() {
                            match o {
                                Some(c) if rng.one_in(2) => {
                                    m.insert("codec".into(), c);
                                }
                                _ => {
                                    m.remove("codec");
                                }
                            }
                        }
                        text = serde_json::to_vec(&v).unwrap_or_default();
                    }
                }
                _ => {
                    if let Ok(mut v) = serde_json::from_slice::<Value>(&text) {
                        mutate_value(&mut v, rng, 0);
                        text = if rng.one_in(2) {
                            serde_json::to_vec(&v)
                        } else {
                            serde_json::to_vec_pretty(&v)
                        }
                        .unwrap_or_default();
                    }
                }
            }
        }
        text.truncate(MAX_JSON);
        Case::Trunk(text, self.rng.one_in(64))
    }

    fn codec_case(&mut self) -> Case {
        let rng = &mut self.rng;
        let (raw, stored) = &self.chunks[rng.below(self.chunks.len())];
        let (oraw, other) = &self.chunks[rng.below(self.chunks.len())];
        let mut s = stored.clone();
        let mut n = raw.len();
        let mut changed = false;
        for _ in 0..n_edits(rng) {
            changed = true;
            let zl = s
                .get(..4)
                .map(|h| u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize);
            match rng.below(10) {
                0 if s.len() >= 4 => {
                    // The plane length nudged (the sizes then disagree, or a frame is cut).
                    let z = zl.unwrap_or(0) as u32;
                    let v =
                        [z.wrapping_add(1), z.wrapping_sub(1), 0, u32::MAX, z / 2][rng.below(5)];
                    s[..4].copy_from_slice(&v.to_le_bytes());
                }
                1..=3 => {
                    // Inside the zstd frame: its header, block headers, literals.
                    if let Some(zl) = zl.filter(|&z| z > 0 && s.len() >= 4 + z) {
                        let i = 4 + if rng.one_in(2) {
                            rng.below(zl.min(16))
                        } else {
                            rng.below(zl)
                        };
                        match rng.below(3) {
                            0 => s[i] ^= 1 << rng.below(8),
                            1 => s[i] = rng.next_u64() as u8,
                            _ => s[i] = s[i].wrapping_add(1),
                        }
                    }
                }
                4 => {
                    // Another chunk's frame in place of this one's (the header fixed up).
                    let oz = other
                        .get(..4)
                        .map(|h| u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize);
                    if let (Some(zl), Some(oz)) = (zl, oz) {
                        if s.len() >= 4 + zl && other.len() >= 4 + oz {
                            let f = other[4..4 + oz].to_vec();
                            s.splice(4..4 + zl, f);
                            s[..4].copy_from_slice(&(oz as u32).to_le_bytes());
                        }
                    }
                }
                5 => {
                    // The declared size: off by one or two, zero, another chunk's.
                    n = match rng.below(5) {
                        0 => n + 1,
                        1 => n.saturating_sub(1),
                        2 => n.saturating_sub(2),
                        3 => 0,
                        _ => oraw.len(),
                    };
                }
                6 => {
                    // The planes swapped (sizes kept when the frame is as long as a plane).
                    if let Some(zl) = zl.filter(|&z| s.len() >= 4 + z) {
                        let rest = s.split_off(4 + zl);
                        let frame = s.split_off(4);
                        s.extend_from_slice(&rest);
                        s.extend_from_slice(&frame);
                    }
                }
                _ => mutate_bytes(&mut s, rng, other),
            }
            if rng.one_in(3) {
                break;
            }
        }
        s.truncate(MAX_CHUNK);
        let n = n.min(MAX_CHUNK);
        let unchanged = !changed || (s == *stored && n == raw.len());
        let chunk = rng.one_in(8).then(|| CodedChunk {
            offset: 0,
            stored: s.len() as u64,
            raw: n as u64,
            crc32_stored: crc32c::crc32c(&s),
            crc32_raw: crc32c::crc32c(raw),
        });
        Case::Codec(CodecCase {
            raw: unchanged.then(|| raw.clone()),
            stored: s,
            n,
            chunk,
        })
    }

    fn keep(&mut self, c: Case) {
        if !self.rng.one_in(16) {
            return;
        }
        let i = self.fixed + self.rng.below(MAX_GROWN);
        match c {
            // Not the mutants of the whole manifests: fed back, they would make most
            // cases as slow as those (one in 256).
            Case::Trunk(t, _) if t.len() > MAX_KEPT_JSON => return,
            Case::Trunk(t, _) => {
                if self.grown < MAX_GROWN {
                    self.files.push(t);
                } else {
                    self.files[i] = t;
                }
            }
            Case::Codec(c) => {
                // Keep the decoded bytes as the chunk's raw bytes.
                let Some(raw) = oracle_decode(&c.stored, c.n) else {
                    return;
                };
                if self.grown < MAX_GROWN {
                    self.chunks.push((raw, c.stored));
                } else {
                    self.chunks[i] = (raw, c.stored);
                }
            }
        }
        self.grown = (self.grown + 1).min(MAX_GROWN);
    }
}

/// One built input.
pub enum Case {
    /// Manifest text; whether it goes through `load_dir`.
    Trunk(Vec<u8>, bool),
    Codec(CodecCase),
}

/// Run the reader under test on `case` and judge it (the only code run under
/// `catch_unwind`).
pub fn judge(case: &Case) -> Verdict {
    match case {
        Case::Trunk(t, disk) => judge_manifest(t, *disk),
        Case::Codec(c) => judge_codec(c),
    }
}

impl Harness for Fuzzer {
    type Case = Case;

    fn case(&mut self) -> Case {
        match self.target {
            Target::Trunk => self.trunk_case(),
            Target::Codec => self.codec_case(),
        }
    }

    fn judge(case: &Case) -> Verdict {
        judge(case)
    }

    fn input(case: &Case) -> &[u8] {
        match case {
            Case::Trunk(t, _) => t,
            Case::Codec(c) => &c.stored,
        }
    }

    fn keep(&mut self, case: Case) {
        Fuzzer::keep(self, case)
    }

    fn finding_key(what: &str) -> String {
        what.chars().take(60).collect()
    }
}

/// Run `execs` cases of `target` from `seed`; `progress` is called about every `every`
/// cases.
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

/// The oracle's verdict on manifest text (for the CI test that checks it can fail).
#[allow(dead_code)] // the CI test's
pub fn oracle_accepts(text: &str) -> bool {
    oracle_manifest(text).is_ok()
}

/// The corpus's manifests, whole ones first (for the CI test).
#[allow(dead_code)] // the CI test's
pub fn manifests() -> Vec<Vec<u8>> {
    let (mut big, small, _) = trunk_corpus();
    big.extend(small);
    big
}
