//! A seeded mutation fuzzer for the saved-state reader (`--load-state FILE`, chat's
//! `/load FILE`), against the tiny-mxfp4 model (13 layers, KDA and MLA):
//!
//! - **Corpus:** states written by [`state::encode`] and [`state::encode_prefix`] for
//!   sessions of the model after 0 to 12 prompt tokens (a fresh session included), with
//!   random step counts. Accepted mutants are fed back (at most 256).
//! - **Cases**, three kinds:
//!   - 6 in 8 decode a payload ([`state::decode`], and [`state::tokens`]): the payload is
//!     split into its fields and edited: the position, the token count and the ids (in and
//!     out of the vocabulary), the layer count, a layer's tag, its cache length, a vector's
//!     count (by one, to zero, near 2^64) or values (NaN and other bit patterns), layers
//!     dropped, duplicated or swapped, bytes after the end or the end cut; then byte edits
//!     one case in 4.
//!   - 1 in 8 check a whole file ([`state::decode_prefix`], what `/load` runs) against a
//!     conversation that the state starts, or not: the magic, version and header length
//!     fields, the header JSON (the model fuzzer's text edits, and the fingerprint,
//!     payload size and checksum changed), with the checksum and size fixed up after the
//!     payload edits most of the time so that they reach the decoding.
//!   - 1 in 8 read a file ([`state::read`], what `--load-state` runs first) written to a
//!     temporary directory.
//! - **Verdicts**, under `catch_unwind`: an oracle that reads the format from the module
//!   doc of `state.rs`, with the shapes learned from the corpus (what the writer wrote per
//!   layer kind and per position), must agree with the reader both ways; 128-bit
//!   arithmetic, so a count that overflows is a refusal. An accepted payload must
//!   re-encode ([`state::encode`] of the decoded session) to the same bytes, bit for bit.
//!   `read` must return exactly the file's bytes when it accepts. Every error must have a
//!   message.
//!
//! The machinery is `fuzzkit`'s; shared by the `fuzz_state` example (long runs,
//! docs/fuzzing.md) and `tests/fuzz_state.rs` (a CI-sized run).

use std::path::PathBuf;
use std::sync::Arc;

use fuzzkit::json::JsonEdits;
use fuzzkit::{n_edits, FuzzReport, Harness, Rng, Verdict};
use k3_layer_compute::decode::PrefixCache;
use k3_layer_compute::state::{self, StateError};
use k3_layer_compute::{Model, ModelOptions, SourceWeights};
use k3_model::config::{LayerKind, ModelConfig};
use k3_model::mmap_weights::MmapWeights;

/// The model the states are for.
pub type TinyModel = Model<SourceWeights<MmapWeights>>;

/// The fingerprint every corpus state carries.
const FP: &str = "fuzz-fingerprint";
/// Most accepted mutants kept as extra corpus entries.
const MAX_GROWN: usize = 256;
/// The stream of this harness's [`Rng`]s.
const STREAM: u64 = 0x6b33_5f73_7461_7465;

fuzzkit::targets! {
    /// The one reader under test (a target, for the command line).
    pub enum Target {
        State => "state",
    }
}

/// The fixtures directory of this repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The tiny-mxfp4 model's layer kinds, from its config.
fn layer_kinds() -> Vec<LayerKind> {
    let dir = fixtures().join("tiny-mxfp4");
    let cfg = ModelConfig::load_dir(&dir).unwrap_or_else(|e| panic!("{e}"));
    cfg.layer_kinds().to_vec()
}

/// Load the tiny-mxfp4 model (one thread).
pub fn load_model() -> TinyModel {
    let dir = fixtures().join("tiny-mxfp4");
    let cfg = ModelConfig::load_dir(&dir).unwrap_or_else(|e| panic!("{e}"));
    let w = MmapWeights::open(&dir).unwrap_or_else(|e| panic!("{e}"));
    let opts = ModelOptions {
        threads: 1,
        ..Default::default()
    };
    Model::new(cfg, SourceWeights::new(w), opts).unwrap_or_else(|e| panic!("{e}"))
}

// ---------------------------------------------------------------------------------------
// The payload as fields.

/// One layer's entry: its tag, an MLA cache length, and its vectors (declared count and
/// value bytes).
#[derive(Clone, Debug)]
struct LayerEntry {
    tag: u8,
    len: Option<u64>,
    vecs: Vec<(u64, Vec<u8>)>,
}

/// A payload split into its fields (the declared counts kept apart, so they can lie).
#[derive(Clone, Debug)]
struct Payload {
    pos: u64,
    steps: u64,
    nt: u64,
    tokens: Vec<u32>,
    layers: u32,
    entries: Vec<LayerEntry>,
    tail: Vec<u8>,
}

/// A little-endian cursor (None past the end).
struct Cur<'a>(&'a [u8], usize);

impl Cur<'_> {
    fn take(&mut self, n: u128) -> Option<&[u8]> {
        let end = self.1 as u128 + n;
        if end > self.0.len() as u128 {
            return None;
        }
        let s = &self.0[self.1..end as usize];
        self.1 = end as usize;
        Some(s)
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    /// A vector: its count, and `count` f32 values (None when they are not all there).
    fn f32s(&mut self) -> Option<(u64, Vec<u8>)> {
        let n = self.u64()?;
        Some((n, self.take(n as u128 * 4)?.to_vec()))
    }
}

/// Split a payload written by [`state::encode`] (a corpus entry) into its fields.
fn split_payload(p: &[u8]) -> Option<Payload> {
    let mut c = Cur(p, 0);
    let (pos, steps, nt) = (c.u64()?, c.u64()?, c.u64()?);
    let tokens = (0..nt).map(|_| c.u32()).collect::<Option<Vec<u32>>>()?;
    let layers = c.u32()?;
    let mut entries = Vec::new();
    for _ in 0..layers {
        let tag = c.u8()?;
        let len = if tag == 2 { Some(c.u64()?) } else { None };
        let nv = [0, 4, 4][tag.min(2) as usize];
        let vecs = (0..nv).map(|_| c.f32s()).collect::<Option<Vec<_>>>()?;
        entries.push(LayerEntry { tag, len, vecs });
    }
    let tail = p[c.1..].to_vec();
    Some(Payload {
        pos,
        steps,
        nt,
        tokens,
        layers,
        entries,
        tail,
    })
}

fn join_payload(p: &Payload) -> Vec<u8> {
    let mut b = Vec::new();
    for v in [p.pos, p.steps, p.nt] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    for t in &p.tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    b.extend_from_slice(&p.layers.to_le_bytes());
    for e in &p.entries {
        b.push(e.tag);
        if let Some(l) = e.len {
            b.extend_from_slice(&l.to_le_bytes());
        }
        for (n, v) in &e.vecs {
            b.extend_from_slice(&n.to_le_bytes());
            b.extend_from_slice(v);
        }
    }
    b.extend_from_slice(&p.tail);
    b
}

// ---------------------------------------------------------------------------------------
// The oracle.

/// What the oracle knows of the model: layer kinds, vocabulary, and the vector lengths the
/// writer wrote (KDA: per layer; MLA: per position).
#[derive(Clone, Debug)]
pub struct Shapes {
    kinds: Vec<LayerKind>,
    vocab: u64,
    kda: [u64; 4],
    mla: [u64; 4],
}

impl Shapes {
    /// Learn the shapes from a corpus payload of a session of at least one token.
    fn learn(kinds: Vec<LayerKind>, vocab: u64, p: &Payload) -> Option<Shapes> {
        let mut s = Shapes {
            kinds,
            vocab,
            kda: [0; 4],
            mla: [0; 4],
        };
        let (mut kda, mut mla) = (false, false);
        for e in &p.entries {
            let counts: Vec<u64> = e.vecs.iter().map(|v| v.0).collect();
            match (e.tag, e.len) {
                (1, _) => {
                    s.kda = counts.try_into().ok()?;
                    kda = true;
                }
                (2, Some(len)) if len > 0 => {
                    let c: [u64; 4] = counts.try_into().ok()?;
                    s.mla = c.map(|x| x / len);
                    mla = true;
                }
                _ => {}
            }
        }
        (kda && mla).then_some(s)
    }
}

/// The oracle's verdict on a payload: accepted, or why not.
fn oracle_payload(b: &[u8], sh: &Shapes) -> Result<(), String> {
    let mut c = Cur(b, 0);
    let short = || "truncated".to_string();
    let pos = c.u64().ok_or_else(short)? as u128;
    let _steps = c.u64().ok_or_else(short)?;
    let nt = c.u64().ok_or_else(short)? as u128;
    let ids = c.take(nt * 4).ok_or_else(short)?;
    if nt != pos + 1 {
        return Err("token count".into());
    }
    if ids
        .chunks_exact(4)
        .any(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]) as u64 >= sh.vocab)
    {
        return Err("id out of the vocabulary".into());
    }
    if c.u32().ok_or_else(short)? as usize != sh.kinds.len() {
        return Err("layer count".into());
    }
    for (l, kind) in sh.kinds.iter().enumerate() {
        let per: Vec<u128> = match (c.u8().ok_or_else(short)?, kind) {
            (0, _) if pos == 0 => continue,
            (1, LayerKind::Kda) => sh.kda.iter().map(|&x| x as u128).collect(),
            (2, LayerKind::Mla) => {
                if c.u64().ok_or_else(short)? as u128 != pos {
                    return Err(format!("layer {l} cache length"));
                }
                sh.mla.iter().map(|&x| x as u128 * pos).collect()
            }
            (t, k) => return Err(format!("layer {l} ({k:?}) tag {t}")),
        };
        for want in per {
            let n = c.u64().ok_or_else(short)? as u128;
            if n != want {
                return Err(format!("layer {l} vector count"));
            }
            c.take(n * 4).ok_or_else(short)?;
        }
    }
    if c.1 != b.len() {
        return Err("bytes after the last layer".into());
    }
    Ok(())
}

/// The file's payload when its header checks out (magic, version, header, fingerprint,
/// size, checksum), as the module doc describes the file.
fn oracle_file<'a>(b: &'a [u8], fp: &str) -> Result<&'a [u8], String> {
    if b.len() < 16 || &b[..8] != b"K3STATE\n" || b[8..12] != 1u32.to_le_bytes() {
        return Err("magic or version".into());
    }
    let hlen = u32::from_le_bytes([b[12], b[13], b[14], b[15]]) as usize;
    if hlen > 1 << 20 || 16 + hlen > b.len() {
        return Err("header length".into());
    }
    let h: state::Header = serde_json::from_slice(&b[16..16 + hlen]).map_err(|e| e.to_string())?;
    let p = &b[16 + hlen..];
    if h.fingerprint != fp || p.len() as u64 != h.payload_bytes {
        return Err("fingerprint or size".into());
    }
    let sum: String = k3_protocol::record::sha256(p)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect();
    if sum != h.payload_sha256 {
        return Err("checksum".into());
    }
    Ok(p)
}

/// The shared context of every case: the model and what the oracle knows of it.
pub struct Ctx {
    pub model: TinyModel,
    pub shapes: Shapes,
}

/// An accepted payload re-encodes to the same bytes.
fn re_encodes(payload: &[u8], saved: &state::Saved) -> Result<(), String> {
    let file = state::encode(FP, &saved.tokens, saved.steps, &saved.session)
        .map_err(|e| format!("a decoded state does not encode: {e}"))?;
    let hlen = u32::from_le_bytes([file[12], file[13], file[14], file[15]]) as usize;
    if file[16 + hlen..] != *payload {
        return Err("a decoded state re-encodes to other bytes".into());
    }
    Ok(())
}

fn no_message(e: &StateError) -> bool {
    let s = e.to_string();
    s.trim().is_empty() || s.trim_end().ends_with(':')
}

/// Compare the reader's verdict with the oracle's.
fn agree<T>(
    got: Result<T, StateError>,
    want: Result<(), String>,
    ok: impl FnOnce(T) -> Result<(), String>,
) -> Verdict {
    match (got, want) {
        (Ok(v), Ok(())) => match ok(v) {
            Ok(()) => Verdict::Accepted,
            Err(e) => Verdict::broken(e),
        },
        (Ok(_), Err(why)) => Verdict::broken(format!("accepted, the oracle refuses it: {why}")),
        (Err(e), Ok(())) => Verdict::broken(format!("refused ({e}), the oracle accepts it")),
        (Err(e), Err(_)) if no_message(&e) => {
            Verdict::broken(format!("error without a message: {e:?}"))
        }
        (Err(_), Err(_)) => Verdict::Rejected,
    }
}

fn judge_payload(ctx: &Ctx, p: &[u8]) -> Verdict {
    let want = oracle_payload(p, &ctx.shapes);
    // `tokens` reads only the ids: it must not panic, and must agree where it accepts.
    if let (Ok(t), Ok(())) = (state::tokens(p), &want) {
        if t.len() as u64 + 8 > p.len() as u64 || t.is_empty() {
            return Verdict::broken("tokens() of an accepted payload is wrong".into());
        }
    }
    agree(state::decode(p, &ctx.model), want, |s| re_encodes(p, &s))
}

fn judge_file(ctx: &Ctx, b: &[u8], conversation: &[u32]) -> Verdict {
    let want = oracle_file(b, FP).and_then(|p| {
        oracle_payload(p, &ctx.shapes)?;
        let nt = u64::from_le_bytes(p[16..24].try_into().unwrap_or_default()) as usize;
        let ids: Vec<u32> = p[24..24 + 4 * nt]
            .chunks_exact(4)
            .map(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]))
            .collect();
        if conversation.starts_with(&ids) {
            Ok(())
        } else {
            Err("another conversation".into())
        }
    });
    let got = state::decode_prefix(b, FP, &ctx.model, conversation);
    agree(got, want, |(key, _)| {
        let nt = key.len() + 1;
        if conversation.len() < nt || key[..] != conversation[..nt - 1] {
            return Err("the key is not the state's tokens less the pending one".into());
        }
        Ok(())
    })
}

/// `read` of `b` written to a file: the oracle is the file check up to the payload size.
fn judge_read(b: &[u8]) -> Verdict {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "k3-fuzz-state-{}-{}.state",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed) % 4
    ));
    if std::fs::write(&path, b).is_err() {
        return Verdict::Rejected;
    }
    let got = state::read(&path);
    let _ = std::fs::remove_file(&path);
    let want = (|| {
        if b.len() < 16 || &b[..8] != b"K3STATE\n" || b[8..12] != 1u32.to_le_bytes() {
            return Err("magic or version".to_string());
        }
        let hlen = u32::from_le_bytes([b[12], b[13], b[14], b[15]]) as usize;
        if hlen > 1 << 20 || 16 + hlen > b.len() {
            return Err("header length".into());
        }
        let h: state::Header =
            serde_json::from_slice(&b[16..16 + hlen]).map_err(|e| e.to_string())?;
        if (b.len() - 16 - hlen) as u64 != h.payload_bytes {
            return Err("payload size".into());
        }
        Ok(())
    })();
    agree(got, want, |bytes| {
        if bytes != b {
            return Err("read returned other bytes than the file's".into());
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------
// Mutations.

const U64S: &[u64] = &[
    0,
    1,
    2,
    12,
    13,
    255,
    256,
    u32::MAX as u64,
    1 << 32,
    (1 << 62) + 1,
    1 << 63,
    u64::MAX / 4,
    u64::MAX / 4 + 1,
    u64::MAX - 1,
    u64::MAX,
];

fn nudge(x: u64, rng: &mut Rng) -> u64 {
    match rng.below(5) {
        0 => x.wrapping_add(1),
        1 => x.wrapping_sub(1),
        2 => 0,
        _ => *rng.pick(U64S),
    }
}

/// One edit of a payload's fields.
fn edit_payload(p: &mut Payload, rng: &mut Rng) {
    let n = p.entries.len();
    match rng.below(16) {
        0 => p.pos = nudge(p.pos, rng),
        1 => p.steps = nudge(p.steps, rng),
        2 => p.nt = nudge(p.nt, rng),
        3 if !p.tokens.is_empty() => {
            // An id in or out of the vocabulary.
            let i = rng.below(p.tokens.len());
            p.tokens[i] = *rng.pick(&[0, 1, 253, 255, 256, 257, u32::MAX]);
        }
        4 => {
            // A token more or less, the counts kept consistent (or not).
            if rng.one_in(2) {
                p.tokens.push(rng.below(256) as u32);
            } else {
                p.tokens.pop();
            }
            if !rng.one_in(4) {
                p.nt = p.tokens.len() as u64;
                p.pos = p.nt.wrapping_sub(1);
            }
        }
        5 => p.layers = nudge(p.layers as u64, rng) as u32,
        6 if n > 0 => {
            let i = rng.below(n);
            p.entries[i].tag = *rng.pick(&[0, 1, 2, 3, 255]);
        }
        7 if n > 0 => {
            let i = rng.below(n);
            let e = &mut p.entries[i];
            e.len = Some(nudge(e.len.unwrap_or(p.pos), rng));
        }
        8 | 9 if n > 0 => {
            // A vector's count, with or without its values following it.
            let i = rng.below(n);
            let e = &mut p.entries[i];
            if !e.vecs.is_empty() {
                let j = rng.below(e.vecs.len());
                let v = &mut e.vecs[j];
                v.0 = nudge(v.0, rng);
                if rng.one_in(2) && v.0 < 1 << 20 {
                    v.1.resize(v.0 as usize * 4, 0);
                }
            }
        }
        10 if n > 0 => {
            // Values: NaN, infinities, any bit pattern (accepted: the state is data).
            let i = rng.below(n);
            if let Some(v) = p.entries[i].vecs.iter_mut().find(|v| !v.1.is_empty()) {
                let k = rng.below(v.1.len() / 4) * 4;
                let any = rng.next_u64() as u32;
                let x: u32 = *rng.pick(&[0x7fc0_0001, 0xff80_0000, 0x8000_0000, 1, any]);
                v.1[k..k + 4].copy_from_slice(&x.to_le_bytes());
            }
        }
        11 if n > 0 => {
            p.entries.remove(rng.below(n));
        }
        12 if n > 0 => {
            let e = p.entries[rng.below(n)].clone();
            p.entries.insert(rng.below(n + 1), e);
        }
        13 if n > 1 => p.entries.swap(rng.below(n), rng.below(n)),
        14 => p.tail = (0..rng.below(9)).map(|_| rng.next_u64() as u8).collect(),
        _ => {
            // Whole layers' entries from the fresh (pos 0) form: tag 0.
            if n > 0 {
                let i = rng.below(n);
                p.entries[i] = LayerEntry {
                    tag: 0,
                    len: None,
                    vecs: Vec::new(),
                };
            }
        }
    }
}

/// One byte-level edit.
fn mutate_bytes(b: &mut Vec<u8>, rng: &mut Rng) {
    if b.is_empty() {
        b.push(rng.next_u64() as u8);
        return;
    }
    let i = rng.below(b.len());
    match rng.below(5) {
        0 => b[i] ^= 1 << rng.below(8),
        1 => b[i] = rng.next_u64() as u8,
        2 => b.truncate(i),
        3 => {
            let n = (1 + rng.below(16)).min(b.len() - i);
            b.drain(i..i + n);
        }
        _ => {
            let w = rng.pick(U64S).to_le_bytes();
            if b.len() >= 8 {
                let i = rng.below(b.len() - 7);
                b[i..i + 8].copy_from_slice(&w);
            }
        }
    }
}

const JSON_EDITS: JsonEdits<'static> = JsonEdits {
    ints: &[
        "0",
        "1",
        "-1",
        "18446744073709551615",
        "18446744073709551616",
        "1.5",
        "1e3",
        "null",
    ],
    strs: &["", "fuzz-fingerprint", "x", "\\u0000", "\\ud800", "00"],
    numeric_keys: false,
};

/// A whole file around `payload`: the header written as the writer writes it, then edits
/// of the header text and the fixed fields; the size and checksum right unless edited.
fn file_around(payload: &[u8], rng: &mut Rng, steps: u64) -> Vec<u8> {
    let sum: String = k3_protocol::record::sha256(payload)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect();
    let mut h = serde_json::json!({
        "fingerprint": FP,
        "tokens": 1,
        "steps": steps,
        "layers": 13,
        "payload_bytes": payload.len(),
        "payload_sha256": sum,
    });
    match rng.below(8) {
        0 => h["fingerprint"] = "another-model".into(),
        1 => {
            h["payload_bytes"] = (payload.len() as u64)
                .wrapping_add(rng.below(3) as u64)
                .wrapping_sub(1)
                .into()
        }
        2 => h["payload_sha256"] = "0".repeat(64).into(),
        _ => {}
    }
    let mut ht = serde_json::to_vec(&h).unwrap_or_default();
    if rng.one_in(4) {
        let other = ht.clone();
        fuzzkit::json::mutate_json_text(&mut ht, rng, &other, &JSON_EDITS);
    }
    let mut f = b"K3STATE\n".to_vec();
    f.extend_from_slice(&1u32.to_le_bytes());
    f.extend_from_slice(&(ht.len() as u32).to_le_bytes());
    f.extend_from_slice(&ht);
    f.extend_from_slice(payload);
    if rng.one_in(6) {
        // The fixed fields: magic, version, header length.
        let i = *rng.pick(&[0usize, 7, 8, 9, 12, 13, 15]);
        f[i] = f[i].wrapping_add(1 + rng.below(3) as u8);
    }
    f
}

// ---------------------------------------------------------------------------------------
// The fuzzer.

struct Fuzzer {
    ctx: Arc<Ctx>,
    rng: Rng,
    /// (payload fields, the conversation the state starts).
    states: Vec<(Payload, Vec<u32>)>,
    fixed: usize,
    grown: usize,
}

/// One built input.
pub enum Case {
    Payload(Arc<Ctx>, Vec<u8>),
    /// A whole file and the conversation `/load` checks it against.
    File(Arc<Ctx>, Vec<u8>, Vec<u32>),
    Read(Vec<u8>),
}

/// Sessions of the model after 0 to 12 prompt tokens, encoded; the conversation each
/// starts. Prefill runs products: callers in the test binary hold the kernels shared.
fn corpus(model: &TinyModel, rng: &mut Rng) -> Vec<(Vec<u8>, Vec<u32>)> {
    let prompt = [77u32, 198, 74, 205, 17, 84, 54, 149, 142, 220, 25, 79];
    let mut out = Vec::new();
    for k in [0usize, 1, 2, 3, 5, 8, 11] {
        let mut s = model.new_session();
        if k > 0 && model.prefill(&mut s, &prompt[..k]).is_err() {
            continue;
        }
        let tokens = prompt[..=k].to_vec();
        if let Ok(b) = state::encode(FP, &tokens, rng.below(40) as u64, &s) {
            out.push((b, prompt.to_vec()));
        }
    }
    // chat's /save: the kept state for the longest proper prefix.
    let mut cache = PrefixCache::new(2);
    let mut s = model.new_session();
    if model.prefill(&mut s, &prompt[..4]).is_ok() {
        cache.insert(prompt[..4].to_vec(), s);
        if let Ok((b, _)) = state::encode_prefix(&mut cache, &prompt, FP) {
            out.push((b, prompt.to_vec()));
        }
    }
    out
}

fn payload_of(file: &[u8]) -> &[u8] {
    let hlen = u32::from_le_bytes([file[12], file[13], file[14], file[15]]) as usize;
    &file[16 + hlen..]
}

impl Fuzzer {
    fn new(seed: u64) -> Fuzzer {
        let mut rng = Rng::new(seed, STREAM);
        let model = load_model();
        let files = corpus(&model, &mut rng);
        let states: Vec<(Payload, Vec<u32>)> = files
            .iter()
            .filter_map(|(f, c)| Some((split_payload(payload_of(f))?, c.clone())))
            .collect();
        let kinds = layer_kinds();
        let vocab = model.vocab() as u64;
        let shapes = states
            .iter()
            .find_map(|(p, _)| Shapes::learn(kinds.clone(), vocab, p))
            .unwrap_or_else(|| panic!("no corpus state to learn the shapes from"));
        Fuzzer {
            ctx: Arc::new(Ctx { model, shapes }),
            rng: Rng::new(seed.wrapping_add(1), STREAM),
            fixed: states.len(),
            states,
            grown: 0,
        }
    }

    fn case(&mut self) -> Case {
        let rng = &mut self.rng;
        let (mut p, mut conv) = self.states[rng.below(self.states.len())].clone();
        for _ in 0..n_edits(rng) {
            edit_payload(&mut p, rng);
        }
        let mut b = join_payload(&p);
        if rng.one_in(4) {
            for _ in 0..n_edits(rng) {
                mutate_bytes(&mut b, rng);
            }
        }
        match rng.below(8) {
            0 => {
                if rng.one_in(4) {
                    conv = conv[..rng.below(conv.len() + 1)].to_vec();
                } else if rng.one_in(4) {
                    let i = rng
                        .below(conv.len().max(1))
                        .min(conv.len().saturating_sub(1));
                    if let Some(t) = conv.get_mut(i) {
                        *t ^= 1;
                    }
                }
                Case::File(self.ctx.clone(), file_around(&b, rng, p.steps), conv)
            }
            1 => {
                let mut f = file_around(&b, rng, p.steps);
                if rng.one_in(4) {
                    mutate_bytes(&mut f, rng);
                }
                Case::Read(f)
            }
            _ => Case::Payload(self.ctx.clone(), b),
        }
    }

    fn keep(&mut self, c: Case) {
        if !self.rng.one_in(16) {
            return;
        }
        let (b, conv) = match c {
            Case::Payload(_, b) => (b, self.states[0].1.clone()),
            Case::File(_, f, conv) => (payload_of(&f).to_vec(), conv),
            Case::Read(_) => return,
        };
        let Some(p) = split_payload(&b) else { return };
        if self.grown < MAX_GROWN {
            self.states.push((p, conv));
            self.grown += 1;
        } else {
            let i = self.fixed + self.rng.below(MAX_GROWN);
            self.states[i] = (p, conv);
        }
    }
}

/// Run the reader under test on `case` and judge it (the only code run under
/// `catch_unwind`).
pub fn judge(case: &Case) -> Verdict {
    match case {
        Case::Payload(ctx, b) => judge_payload(ctx, b),
        Case::File(ctx, f, conv) => judge_file(ctx, f, conv),
        Case::Read(f) => judge_read(f),
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
        match case {
            Case::Payload(_, b) | Case::File(_, b, _) | Case::Read(b) => b,
        }
    }

    fn keep(&mut self, case: Case) {
        Fuzzer::keep(self, case)
    }

    fn finding_key(what: &str) -> String {
        what.chars().take(50).collect()
    }
}

/// Run `execs` cases from `seed`; `progress` is called about every `every` cases.
pub fn run(
    target: Target,
    seed: u64,
    execs: u64,
    every: u64,
    progress: impl FnMut(&FuzzReport),
) -> FuzzReport {
    let mut fz = Fuzzer::new(seed);
    fuzzkit::run(&mut fz, target.name(), seed, execs, every, progress)
}

/// The oracle's verdict on a payload, as a function.
pub type Accepts = Arc<dyn Fn(&[u8]) -> bool>;

/// Whether the oracle accepts a payload (for the CI test that checks it can fail), and a
/// corpus payload to try it on.
#[allow(dead_code)] // the CI test's
pub fn oracle_check(model: TinyModel) -> (Vec<u8>, Accepts) {
    let mut rng = Rng::new(1, STREAM);
    let files = corpus(&model, &mut rng);
    let (f, _) = files
        .iter()
        .find(|(f, _)| payload_of(f).len() > 1000)
        .cloned()
        .unwrap_or_default();
    let p = payload_of(&f).to_vec();
    let fields = split_payload(&p).unwrap_or_else(|| panic!("corpus payload does not split"));
    let shapes = Shapes::learn(layer_kinds(), model.vocab() as u64, &fields)
        .unwrap_or_else(|| panic!("no shapes"));
    (
        p,
        Arc::new(move |b: &[u8]| oracle_payload(b, &shapes).is_ok()),
    )
}
