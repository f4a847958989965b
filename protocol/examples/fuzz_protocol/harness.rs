//! A seeded mutation fuzzer for the protocol's two readers of untrusted bytes:
//!
//! - `message`: [`messages::decode`], which every stage runs on every frame it receives
//!   (and `k3-orch replay` on every recorded one). Corpus: every frame of the fixture
//!   recordings (`tests/fixtures/recordings`) that is a message, and 64 messages of every
//!   kind made by a generator and encoded by [`messages::encode`]. Mutations: bit flips,
//!   byte insert/delete/overwrite, bincode varint markers (251..=254) with short, long and
//!   non-canonical values, interesting little-endian integers, splices from other frames,
//!   duplicated ranges, truncation, a changed enum tag. Verdict, a round-trip oracle: what
//!   decodes re-encodes, and those bytes decode to the same message (compared by its
//!   `Debug` text, so NaN payloads compare) and re-encode to the same bytes; an error must
//!   have a message.
//! - `recording`: [`record::parse_recording`] (the in-memory twin of `read_recording`),
//!   with and without `verify`. Corpus: the six small fixture recordings (the two
//!   layer-compute ones, 0.7 and 1.3 MB, in one case of 256), and 48 recordings written by
//!   [`Recorder`] (generated frames, shared-buffer reads with and without their bytes,
//!   `@region` entries, finished or cut short). Mutations: entries dropped, duplicated,
//!   swapped, re-kinded, their payloads edited, their chain hashes recomputed (most of the
//!   time, so the edits reach the payload decoding) or left stale; the header's name
//!   length and flags; then byte edits of the whole file. Verdict: an independent reader
//!   written from the format in `record.rs`'s module doc must agree both ways (same
//!   recording when both accept, both refuse otherwise), errors have messages, and every
//!   frame of an accepted recording goes through [`messages::decode`] (frames on the
//!   `@region` pseudo-channel are the JSON region descriptions `link.rs` writes, not
//!   messages, and go through serde_json) without a panic.
//!
//! Every case runs under `catch_unwind`; a finding is a panic, an error with no message or
//! a verdict the oracle disagrees with. The machinery is `fuzzkit`'s; shared by the
//! `fuzz_protocol` example (long runs, docs/fuzzing.md) and `tests/fuzz_harness.rs` (a
//! CI-sized run).

use std::path::{Path, PathBuf};

use fuzzkit::{n_edits, FuzzReport, Harness, Rng, Verdict};
use k3_model::tensor::Dtype;
use k3_protocol::conf::SamplerConfig;
use k3_protocol::failure::{FailureKind, StageFailure};
use k3_protocol::link::REGION_META;
use k3_protocol::messages::{
    self, CodecError, GenRequest, Msg, PassStats, RegionRole, Stage, StepStats, TensorSpan,
    TokenMsg,
};
use k3_protocol::record::{self, parse_recording, Entry, Recorder, Recording};
use k3_protocol::shm::Handle;
use k3_protocol::transport::Side;

/// Largest message one case builds (bytes).
const MAX_MESSAGE: usize = 1 << 16;
/// Largest recording one case builds, the big fixtures aside (bytes).
const MAX_RECORDING: usize = 1 << 20;
/// Most accepted mutants kept as extra corpus entries.
const MAX_GROWN: usize = 256;
/// The stream of this harness's [`Rng`]s.
const STREAM: u64 = 0x6b33_5f70_726f_746f;

fuzzkit::targets! {
    /// The readers under test.
    pub enum Target {
        Message => "message",
        Recording => "recording",
    }
}

/// The fixtures directory of this repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

// ---------------------------------------------------------------------------------------
// Generated messages.

const U64S: &[u64] = &[
    0,
    1,
    7,
    127,
    128,
    250,
    251,
    255,
    256,
    65_535,
    65_536,
    163_839,
    u32::MAX as u64,
    1 << 32,
    i64::MAX as u64,
    u64::MAX,
];

fn u64v(rng: &mut Rng) -> u64 {
    if rng.one_in(2) {
        *rng.pick(U64S)
    } else {
        rng.next_u64() >> rng.below(64)
    }
}

fn u32v(rng: &mut Rng) -> u32 {
    u64v(rng) as u32
}

fn f64v(rng: &mut Rng) -> f64 {
    *rng.pick(&[
        0.0,
        -0.0,
        0.25,
        1e300,
        f64::NAN,
        f64::INFINITY,
        f64::MIN_POSITIVE,
    ])
}

fn f32v(rng: &mut Rng) -> f32 {
    *rng.pick(&[0.0, -0.0, 0.7, 1e30, f32::NAN, -f32::INFINITY, 1e-45])
}

fn text(rng: &mut Rng) -> String {
    match rng.below(6) {
        0 => String::new(),
        1 => "x".repeat(rng.below(600)),
        2 => "é中\u{10ffff}\u{0}".into(),
        3 => "/tmp/chat.json.state".into(),
        4 => "[{\"role\":\"user\",\"content\":\"hi\"}]".into(),
        _ => "layer-compute: sending to trunk-loader: the peer died".into(),
    }
}

fn ids(rng: &mut Rng) -> Vec<u32> {
    (0..rng.below(40)).map(|_| u32v(rng)).collect()
}

fn stage(rng: &mut Rng) -> Stage {
    *rng.pick(&[
        Stage::Orchestrator,
        Stage::Tokenizer,
        Stage::TrunkLoader,
        Stage::ExpertFetcher,
        Stage::LayerCompute,
    ])
}

fn handle(rng: &mut Rng) -> Handle {
    Handle {
        region: u32v(rng),
        offset: u64v(rng),
        len: u64v(rng),
        generation: u64v(rng),
    }
}

fn spans(rng: &mut Rng) -> Vec<TensorSpan> {
    (0..rng.below(6))
        .map(|i| TensorSpan {
            name: format!("language_model.model.layers.{i}.mlp.gate.weight"),
            dtype: *rng.pick(&[Dtype::BF16, Dtype::F32, Dtype::U8, Dtype::BOOL, Dtype::I64]),
            shape: (0..rng.below(4)).map(|_| u64v(rng)).collect(),
            handle: handle(rng),
        })
        .collect()
}

fn opt<T>(rng: &mut Rng, f: impl FnOnce(&mut Rng) -> T) -> Option<T> {
    if rng.one_in(2) {
        Some(f(rng))
    } else {
        None
    }
}

fn sampler(rng: &mut Rng) -> SamplerConfig {
    SamplerConfig {
        temperature: opt(rng, f32v),
        top_p: opt(rng, f32v),
        top_k: opt(rng, |r| u64v(r) as usize),
        seed: u64v(rng),
        min_p: opt(rng, f32v),
        repetition_penalty: opt(rng, f32v),
        presence_penalty: opt(rng, f32v),
        frequency_penalty: opt(rng, f32v),
    }
}

/// A random message of one of the first kinds (`random_msg` has the rest).
fn random_msg_a(rng: &mut Rng, k: usize) -> Msg {
    match k {
        0 => Msg::Hello {
            stage: stage(rng),
            pid: u32v(rng),
            version: u32v(rng),
        },
        1 => Msg::Configure { json: text(rng) },
        2 => Msg::Region {
            id: u32v(rng),
            role: if rng.one_in(2) {
                RegionRole::Link {
                    peer: stage(rng),
                    side: if rng.one_in(2) { Side::A } else { Side::B },
                    peer_pid: u32v(rng),
                }
            } else {
                RegionRole::Data { name: text(rng) }
            },
        },
        3 => Msg::Ready { stage: stage(rng) },
        4 => Msg::Ping { nonce: u64v(rng) },
        5 => Msg::Pong { nonce: u64v(rng) },
        6 => Msg::Shutdown,
        7 => {
            let mut f = StageFailure::new(
                *rng.pick(&[
                    FailureKind::Config,
                    FailureKind::PeerDied,
                    FailureKind::Protocol,
                ]),
                text(rng),
            );
            if rng.one_in(2) {
                f = f.with_peer(stage(rng));
            }
            Msg::Error {
                stage: stage(rng),
                failure: f,
            }
        }
        8 => Msg::EncodeText {
            req: u64v(rng),
            text: text(rng),
            allow_specials: rng.one_in(2),
        },
        9 => Msg::EncodeBytes {
            req: u64v(rng),
            bytes: text(rng).into_bytes(),
            allow_specials: rng.one_in(2),
        },
        10 => Msg::EncodeChat {
            req: u64v(rng),
            chat_json: text(rng),
        },
        11 => Msg::Ids {
            req: u64v(rng),
            ids: ids(rng),
        },
        12 => Msg::DecodeId { id: u32v(rng) },
        13 => Msg::Text {
            bytes: vec![0xe4, 0xbd],
        },
        14 => Msg::StartPass {
            pass: u64v(rng),
            start: u32v(rng),
            len: u32v(rng),
        },
        15 => Msg::LayerReady {
            pass: u64v(rng),
            layer: u32v(rng),
            handle: handle(rng),
            tensors: spans(rng),
        },
        16 => Msg::LayerDone {
            pass: u64v(rng),
            layer: u32v(rng),
        },
        17 => Msg::Experts {
            pass: u64v(rng),
            layer: u32v(rng),
            ids: ids(rng),
        },
        18 => Msg::ExpertReady {
            pass: u64v(rng),
            layer: u32v(rng),
            id: u32v(rng),
            handle: handle(rng),
        },
        19 => Msg::ExpertFailed {
            pass: u64v(rng),
            layer: u32v(rng),
            id: u32v(rng),
            error: text(rng),
        },
        _ => Msg::ExpertsDone {
            pass: u64v(rng),
            layer: u32v(rng),
            ids: ids(rng),
        },
    }
}

/// Kinds [`random_msg`] draws from.
const MSG_KINDS: usize = 42;

/// A random message of kind `k` (every variant of [`Msg`] is one of `0..MSG_KINDS`).
fn random_msg(rng: &mut Rng, k: usize) -> Msg {
    match k {
        0..=20 => random_msg_a(rng, k),
        21 => Msg::TrunkPassDone {
            pass: u64v(rng),
            binds: u64v(rng),
            hits: u64v(rng),
            read_bytes: u64v(rng),
            io_seconds: f64v(rng),
        },
        22 => Msg::ExpertBatchDone {
            pass: u64v(rng),
            layer: u32v(rng),
            requests: u64v(rng),
            resident_hits: u64v(rng),
            failed: u64v(rng),
            read_bytes: u64v(rng),
            io_seconds: f64v(rng),
        },
        23 => Msg::Summary {
            stage: stage(rng),
            json: text(rng),
        },
        24 => Msg::StepStats(StepStats {
            step: u32v(rng),
            token: u32v(rng),
            seconds: f64v(rng),
            trunk_read_bytes: u64v(rng),
            io_wait_seconds: f64v(rng),
            ..Default::default()
        }),
        25 => Msg::Finished {
            generated: ids(rng),
        },
        26 => Msg::Generate(GenRequest {
            req: u64v(rng),
            prompt: ids(rng),
            gen: u32v(rng),
            sampler: sampler(rng),
            stop_ids: ids(rng),
            snapshot_at: opt(rng, u32v),
            cache_entries: u32v(rng),
            keep_logits: rng.one_in(2),
        }),
        27 => Msg::RequestStarted {
            req: u64v(rng),
            cached_tokens: u32v(rng),
        },
        28 => Msg::StopRequest { req: u64v(rng) },
        29 => Msg::RequestDone {
            req: u64v(rng),
            generated: ids(rng),
        },
        30 => Msg::Progress {
            stage: stage(rng),
            phase: text(rng),
            done: u64v(rng),
            total: u64v(rng),
        },
        31 => Msg::PartReady {
            pass: u64v(rng),
            layer: u32v(rng),
            part: u32v(rng),
            parts: u32v(rng),
            tensors: spans(rng),
        },
        32 => Msg::PartDone {
            pass: u64v(rng),
            layer: u32v(rng),
            part: u32v(rng),
        },
        33 => Msg::SaveState {
            req: u64v(rng),
            path: text(rng).into(),
            fingerprint: text(rng),
            tokens: ids(rng),
        },
        34 => Msg::LoadState {
            req: u64v(rng),
            path: text(rng).into(),
            fingerprint: text(rng),
            tokens: ids(rng),
            cache_entries: u32v(rng),
        },
        35 => Msg::StateDone {
            req: u64v(rng),
            tokens: u32v(rng),
            error: opt(rng, text),
        },
        36 => Msg::Token(TokenMsg {
            req: u64v(rng),
            index: u32v(rng),
            token: u32v(rng),
            expert_failures: u64v(rng),
            logits: opt(rng, |r| (0..r.below(20)).map(|_| f32v(r)).collect()),
        }),
        37 => Msg::PassStats(PassStats {
            rows: u32v(rng),
            seconds: f64v(rng),
            expert_requests: u64v(rng),
            ..Default::default()
        }),
        38 => Msg::RequestFailed {
            req: u64v(rng),
            error: text(rng),
        },
        39 => Msg::Guess {
            pass: u64v(rng),
            layer: u32v(rng),
            experts: ids(rng),
        },
        40 => Msg::Text {
            bytes: (0..rng.below(300)).map(|_| rng.next_u64() as u8).collect(),
        },
        _ => Msg::Ids {
            req: 0,
            ids: vec![0, 163_839, u32::MAX],
        },
    }
}

// ---------------------------------------------------------------------------------------
// Byte-level edits.

/// bincode varints: a marker byte (251: u16, 252: u32, 253: u64, 254: u128) and a value,
/// canonical, non-canonical (a small value in a long form) or huge.
fn varint(rng: &mut Rng) -> Vec<u8> {
    let v = u64v(rng);
    match rng.below(6) {
        0 => vec![v as u8],
        1 => [&[251u8][..], &(v as u16).to_le_bytes()].concat(),
        2 => [&[252u8][..], &(v as u32).to_le_bytes()].concat(),
        3 => [&[253u8][..], &v.to_le_bytes()].concat(),
        4 => [&[254u8][..], &(v as u128).to_le_bytes()].concat(),
        _ => vec![*rng.pick(&[251u8, 252, 253, 254, 255])],
    }
}

/// One byte-level edit of `b` (`other`: another corpus entry, for splices).
fn mutate_bytes(b: &mut Vec<u8>, rng: &mut Rng, other: &[u8]) {
    let pos = |b: &[u8], rng: &mut Rng| rng.below(b.len() + 1).min(b.len());
    match rng.below(11) {
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
            let n = 1 + rng.below(8);
            let ins: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            b.splice(i..i, ins);
        }
        3 if !b.is_empty() => {
            let i = rng.below(b.len());
            let n = (1 + rng.below(16)).min(b.len() - i);
            b.drain(i..i + n);
        }
        4 | 5 => {
            // A varint in place of one byte (or inserted).
            let i = pos(b, rng);
            let e = if rng.one_in(2) {
                (i + 1).min(b.len())
            } else {
                i
            };
            b.splice(i..e, varint(rng));
        }
        6 => {
            let v = *rng.pick(U64S);
            let w: Vec<u8> = if rng.one_in(2) {
                v.to_le_bytes().to_vec()
            } else {
                (v as u32).to_le_bytes().to_vec()
            };
            if b.len() >= w.len() {
                let i = rng.below(b.len() - w.len() + 1);
                b[i..i + w.len()].copy_from_slice(&w);
            }
        }
        7 if !other.is_empty() => {
            let s = rng.below(other.len());
            let n = (1 + rng.below(64)).min(other.len() - s);
            let i = pos(b, rng);
            if rng.one_in(2) {
                b.splice(i..i, other[s..s + n].iter().copied());
            } else {
                let e = (i + n).min(b.len());
                b.splice(i..e, other[s..s + n].iter().copied());
            }
        }
        8 if !b.is_empty() => {
            let s = rng.below(b.len());
            let n = (1 + rng.below(32)).min(b.len() - s);
            let chunk = b[s..s + n].to_vec();
            let i = pos(b, rng);
            b.splice(i..i, chunk);
        }
        9 => {
            let n = pos(b, rng);
            b.truncate(n);
        }
        _ if !b.is_empty() => {
            // The enum tag: another variant, in or out of range.
            b[0] = rng.below(MSG_KINDS + 3) as u8;
        }
        _ => b.push(rng.next_u64() as u8),
    }
}

// ---------------------------------------------------------------------------------------
// The message verdict.

/// The round-trip oracle: whatever decodes re-encodes to bytes that decode to an equal
/// message and re-encode to the same bytes.
fn judge_message(b: &[u8]) -> Verdict {
    let m = match messages::decode(b) {
        Ok(m) => m,
        Err(CodecError::Decode(why)) if why.trim().is_empty() => {
            return Verdict::broken("decode error without a message".into())
        }
        Err(_) => return Verdict::Rejected,
    };
    let y = match messages::encode(&m) {
        Ok(y) => y,
        Err(e) => return Verdict::broken(format!("a decoded message does not encode: {e}")),
    };
    match messages::decode(&y) {
        Ok(m2) if format!("{m2:?}") != format!("{m:?}") => Verdict::broken(format!(
            "re-encoded message decodes to another: {m:?} vs {m2:?}"
        )),
        Ok(m2) => match messages::encode(&m2) {
            Ok(y2) if y2 == y => Verdict::Accepted,
            _ => Verdict::broken("re-encoding is not stable".into()),
        },
        Err(e) => Verdict::broken(format!("a re-encoded message does not decode: {e}")),
    }
}

// ---------------------------------------------------------------------------------------
// Recordings: the oracle reader and the structured form the mutations edit.

/// A recording split into its parts, chain hashes dropped (they are recomputed or left
/// stale when it is written back).
#[derive(Clone)]
struct RawRec {
    /// Everything before the first entry.
    header: Vec<u8>,
    /// (kind, payload, stored chain hash).
    entries: Vec<(u8, Vec<u8>, [u8; 32])>,
    /// Bytes after the last whole entry.
    tail: Vec<u8>,
}

fn chain_next(prev: &[u8; 32], kind: u8, payload: &[u8]) -> [u8; 32] {
    let mut b = Vec::with_capacity(37 + payload.len());
    b.extend_from_slice(prev);
    b.push(kind);
    b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    b.extend_from_slice(payload);
    record::sha256(&b)
}

/// Split `data` as the format says, without judging the payloads (None: no header).
fn split_rec(data: &[u8]) -> Option<RawRec> {
    let nl = u16::from_le_bytes(data.get(8..10)?.try_into().ok()?) as usize;
    let h = 11 + nl;
    if data.len() < h {
        return None;
    }
    let mut r = RawRec {
        header: data[..h].to_vec(),
        entries: Vec::new(),
        tail: Vec::new(),
    };
    let mut at = h;
    while data.len() - at >= 5 {
        let len = u32::from_le_bytes(data[at + 1..at + 5].try_into().ok()?) as usize;
        if data.len() - at - 5 < len.saturating_add(32) {
            break;
        }
        let p = data[at + 5..at + 5 + len].to_vec();
        let c = data[at + 5 + len..at + 37 + len].try_into().ok()?;
        r.entries.push((data[at], p, c));
        at += 37 + len;
    }
    r.tail = data[at..].to_vec();
    Some(r)
}

/// Write `r` back; `fresh`: the chain hashes recomputed.
fn join_rec(r: &RawRec, fresh: bool) -> Vec<u8> {
    let mut out = r.header.clone();
    let mut chain = record::sha256(&r.header);
    for (kind, p, stored) in &r.entries {
        chain = chain_next(&chain, *kind, p);
        out.push(*kind);
        out.extend_from_slice(&(p.len() as u32).to_le_bytes());
        out.extend_from_slice(p);
        out.extend_from_slice(if fresh { &chain } else { stored });
    }
    out.extend_from_slice(&r.tail);
    out
}

/// The oracle's reading of one entry's payload: Some(entry), None for the end marker.
fn oracle_entry(kind: u8, p: &[u8], count: usize) -> Result<Option<Entry>, String> {
    match kind {
        1 | 2 => {
            let cl = *p.first().ok_or("empty frame entry")? as usize;
            let name = p.get(1..1 + cl).ok_or("channel cut short")?;
            let channel = String::from_utf8(name.to_vec()).map_err(|_| "channel not UTF-8")?;
            let frame = p[1 + cl..].to_vec();
            Ok(Some(if kind == 1 {
                Entry::Inbound { channel, frame }
            } else {
                Entry::Outbound { channel, frame }
            }))
        }
        3 => {
            if p.len() < 61 {
                return Err("short buffer entry".into());
            }
            let u = |o: usize| u64::from_le_bytes(p[o..o + 8].try_into().unwrap_or_default());
            let handle = Handle {
                region: u32::from_le_bytes(p[..4].try_into().unwrap_or_default()),
                offset: u(4),
                len: u(12),
                generation: u(20),
            };
            let sha: [u8; 32] = p[28..60].try_into().unwrap_or_default();
            let bytes = match (p[60], p.len()) {
                (0, 61) => None,
                (1, n) if (n - 61) as u64 == handle.len && record::sha256(&p[61..]) == sha => {
                    Some(p[61..].to_vec())
                }
                _ => return Err("bad kept bytes".into()),
            };
            Ok(Some(Entry::BufferRead {
                handle,
                sha256: sha,
                bytes,
            }))
        }
        255 if p.len() == 8 && p == (count as u64).to_le_bytes() => Ok(None),
        _ => Err(format!("entry kind {kind} with {} bytes", p.len())),
    }
}

/// The recording `data` holds, read from the format's description alone.
fn oracle_recording(data: &[u8], verify: bool) -> Result<Recording, String> {
    if data.len() < 11 || &data[..8] != b"K3REC001" {
        return Err("magic".into());
    }
    let r = split_rec(data).ok_or("header cut short")?;
    let nl = r.header.len() - 11;
    let stage = String::from_utf8(r.header[10..10 + nl].to_vec()).map_err(|_| "stage name")?;
    let mut chain = record::sha256(&r.header);
    let mut rec = Recording {
        stage,
        bytes_kept: r.header[10 + nl] & 1 == 1,
        entries: Vec::new(),
        complete: false,
    };
    for (kind, p, stored) in &r.entries {
        if rec.complete {
            return Err("data after the end marker".into());
        }
        if p.len() > record::MAX_ENTRY {
            return Err("entry too long".into());
        }
        chain = chain_next(&chain, *kind, p);
        if verify && *stored != chain {
            return Err("chain".into());
        }
        match oracle_entry(*kind, p, rec.entries.len())? {
            Some(e) => rec.entries.push(e),
            None => rec.complete = true,
        }
    }
    // A tail of 5 or more bytes whose length field is over the limit is refused; a shorter
    // or cut-short one is a crash's leftover.
    if rec.complete && !r.tail.is_empty() {
        return Err("data after the end marker".into());
    }
    if r.tail.len() >= 5 {
        let len = u32::from_le_bytes(r.tail[1..5].try_into().unwrap_or_default()) as usize;
        if len > record::MAX_ENTRY {
            return Err("tail entry too long".into());
        }
    }
    Ok(rec)
}

/// Reader and oracle agree; the frames of an accepted recording go through their readers.
fn judge_recording(data: &[u8], verify: bool) -> Verdict {
    let got = parse_recording(Path::new("fuzz.k3rec"), data, verify);
    let want = oracle_recording(data, verify);
    match (got, want) {
        (Ok(g), Ok(w)) if g == w => {
            for e in &g.entries {
                match e {
                    Entry::Inbound { channel, frame } | Entry::Outbound { channel, frame }
                        if channel == REGION_META =>
                    {
                        let _ = serde_json::from_slice::<serde_json::Value>(frame);
                    }
                    Entry::Inbound { frame, .. } | Entry::Outbound { frame, .. } => {
                        if let Err(e) = messages::decode(frame) {
                            if e.to_string().is_empty() {
                                return Verdict::broken("frame error without a message".into());
                            }
                        }
                    }
                    Entry::BufferRead { .. } => {}
                }
            }
            Verdict::Accepted
        }
        (Ok(g), Ok(w)) => Verdict::broken(format!(
            "verify {verify}: the reader's recording differs from the oracle's ({} vs {} \
             entries, complete {} vs {})",
            g.entries.len(),
            w.entries.len(),
            g.complete,
            w.complete
        )),
        (Ok(_), Err(why)) => Verdict::broken(format!(
            "verify {verify}: accepted, the oracle refuses it: {why}"
        )),
        (Err(e), Ok(_)) => Verdict::broken(format!(
            "verify {verify}: refused ({e}), the oracle accepts it"
        )),
        (Err(e), Err(_)) if e.to_string().ends_with(": ") => {
            Verdict::broken(format!("error without a message: {e:?}"))
        }
        (Err(_), Err(_)) => Verdict::Rejected,
    }
}

// ---------------------------------------------------------------------------------------
// The fuzzer.

/// A recording written by [`Recorder`] (generated frames, buffer reads, region entries).
fn synth_recording(rng: &mut Rng, dir: &Path, i: usize) -> Option<Vec<u8>> {
    let name = format!("stage{i}");
    let mut r = Recorder::create(dir, &name, rng.one_in(2)).ok()?;
    for _ in 0..rng.below(12) {
        match rng.below(5) {
            0 => {
                let meta = format!(
                    "{{\"id\":{},\"name\":\"experts\",\"slot_size\":4096,\"nslots\":2}}",
                    rng.below(9)
                );
                r.inbound(REGION_META, meta.as_bytes()).ok()?;
            }
            1 => {
                let bytes: Vec<u8> = (0..rng.below(200)).map(|_| rng.next_u64() as u8).collect();
                let mut h = handle(rng);
                h.len = bytes.len() as u64;
                r.buffer_read(&h, &bytes).ok()?;
            }
            k => {
                let kind = rng.below(MSG_KINDS);
                let m = messages::encode(&random_msg(rng, kind)).ok()?;
                let ch = *rng.pick(&["control", "trunk-loader", "layer-compute", ""]);
                if k == 2 {
                    r.inbound(ch, &m).ok()?;
                } else {
                    r.outbound(ch, &m).ok()?;
                }
            }
        }
    }
    let path = r.path().to_path_buf();
    if rng.one_in(4) {
        drop(r); // cut short: no end marker
    } else {
        r.finish().ok()?;
    }
    std::fs::read(path).ok()
}

struct Fuzzer {
    target: Target,
    rng: Rng,
    /// Messages, or recordings.
    files: Vec<Vec<u8>>,
    /// The layer-compute recordings (recording target; used one case in 256).
    big: Vec<Vec<u8>>,
    fixed: usize,
    grown: usize,
}

/// The fixture recordings: (small ones, layer-compute ones).
fn fixture_recordings() -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let (mut small, mut big) = (Vec::new(), Vec::new());
    for m in ["tiny-mxfp4", "tiny-seed"] {
        for s in [
            "tokenizer",
            "trunk-loader",
            "expert-fetcher",
            "layer-compute",
        ] {
            let p = fixtures().join(format!("recordings/{m}/{s}.k3rec"));
            if let Ok(b) = std::fs::read(p) {
                (if s == "layer-compute" {
                    &mut big
                } else {
                    &mut small
                })
                .push(b);
            }
        }
    }
    (small, big)
}

/// Every frame of the fixture recordings that is a message (not an `@region` entry).
pub fn fixture_frames() -> Vec<Vec<u8>> {
    let (small, big) = fixture_recordings();
    let mut out: Vec<Vec<u8>> = Vec::new();
    for b in small.iter().chain(&big) {
        let Ok(r) = parse_recording(Path::new("fixture"), b, true) else {
            continue;
        };
        for e in r.entries {
            if let Entry::Inbound { channel, frame } | Entry::Outbound { channel, frame } = e {
                if channel != REGION_META && frame.len() <= MAX_MESSAGE && !out.contains(&frame) {
                    out.push(frame);
                }
            }
        }
    }
    out
}

impl Fuzzer {
    fn new(target: Target, seed: u64) -> Fuzzer {
        let mut rng = Rng::new(seed, STREAM);
        let mut f = Fuzzer {
            target,
            rng: Rng::new(seed.wrapping_add(1), STREAM),
            files: Vec::new(),
            big: Vec::new(),
            fixed: 0,
            grown: 0,
        };
        match target {
            Target::Message => {
                f.files = fixture_frames();
                for k in 0..MSG_KINDS {
                    for _ in 0..64 {
                        if let Ok(b) = messages::encode(&random_msg(&mut rng, k)) {
                            f.files.push(b);
                        }
                    }
                }
            }
            Target::Recording => {
                let (small, big) = fixture_recordings();
                f.files = small;
                f.big = big;
                let dir =
                    std::env::temp_dir().join(format!("k3-fuzz-rec-{}-{seed}", std::process::id()));
                for i in 0..48 {
                    f.files.extend(synth_recording(&mut rng, &dir, i));
                }
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        f.fixed = f.files.len();
        f
    }

    fn pick_other(&mut self) -> Vec<u8> {
        let i = self.rng.below(self.files.len());
        self.files[i].clone()
    }

    fn message_case(&mut self) -> Case {
        let mut b = self.pick_other();
        let other = self.pick_other();
        for _ in 0..n_edits(&mut self.rng) {
            mutate_bytes(&mut b, &mut self.rng, &other);
        }
        b.truncate(MAX_MESSAGE);
        Case::Message(b)
    }

    /// One structured edit of a recording's entries.
    fn edit_entries(&mut self, r: &mut RawRec) {
        let rng = &mut self.rng;
        let n = r.entries.len();
        match rng.below(9) {
            0 if n > 0 => {
                r.entries.remove(rng.below(n));
            }
            1 if n > 0 => {
                let e = r.entries[rng.below(n)].clone();
                r.entries.insert(rng.below(n + 1), e);
            }
            2 if n > 1 => r.entries.swap(rng.below(n), rng.below(n)),
            3 if n > 0 => {
                let i = rng.below(n);
                r.entries[i].0 = *rng.pick(&[0u8, 1, 2, 3, 4, 254, 255]);
            }
            4 => {
                // An end marker, counting right or wrong, anywhere.
                let c = (n as u64).wrapping_add(rng.below(3) as u64).wrapping_sub(1);
                let at = rng.below(n + 1);
                r.entries
                    .insert(at, (255, c.to_le_bytes().to_vec(), [0; 32]));
            }
            5 => {
                let t: Vec<u8> = (0..rng.below(40)).map(|_| rng.next_u64() as u8).collect();
                r.tail = t;
            }
            6 => {
                // The header: its name length, its flags.
                let h = &mut r.header;
                if rng.one_in(2) {
                    let last = h.len() - 1;
                    h[last] = rng.next_u64() as u8;
                } else {
                    let v = (h.len() as u16)
                        .wrapping_sub(11)
                        .wrapping_add(rng.below(5) as u16);
                    h[8..10].copy_from_slice(&(v.wrapping_sub(2)).to_le_bytes());
                }
            }
            _ if n > 0 => {
                let i = rng.below(n);
                let other = self.files[self.rng.below(self.files.len())].clone();
                let p = &mut r.entries[i].1;
                for _ in 0..n_edits(&mut self.rng) {
                    mutate_bytes(p, &mut self.rng, &other);
                }
            }
            _ => {}
        }
    }

    fn recording_case(&mut self) -> Case {
        let big = !self.big.is_empty() && self.rng.one_in(256);
        let base = if big {
            self.big[self.rng.below(self.big.len())].clone()
        } else {
            self.pick_other()
        };
        let verify = !self.rng.one_in(4);
        let mut data = match split_rec(&base) {
            Some(mut r) if !self.rng.one_in(8) => {
                for _ in 0..n_edits(&mut self.rng) {
                    self.edit_entries(&mut r);
                }
                join_rec(&r, !self.rng.one_in(8))
            }
            _ => base,
        };
        if self.rng.one_in(4) {
            let other = self.pick_other();
            for _ in 0..n_edits(&mut self.rng) {
                mutate_bytes(&mut data, &mut self.rng, &other);
            }
        }
        if !big {
            data.truncate(MAX_RECORDING);
        }
        Case::Recording(data, verify, big)
    }

    fn keep(&mut self, c: Case) {
        if !self.rng.one_in(16) {
            return;
        }
        let b = match c {
            Case::Message(b) => b,
            Case::Recording(b, _, false) => b,
            Case::Recording(_, _, true) => return,
        };
        if self.grown < MAX_GROWN {
            self.files.push(b);
            self.grown += 1;
        } else {
            let i = self.fixed + self.rng.below(MAX_GROWN);
            self.files[i] = b;
        }
    }
}

/// One built input.
pub enum Case {
    Message(Vec<u8>),
    /// The bytes, `verify`, and whether it is one of the big fixtures.
    Recording(Vec<u8>, bool, bool),
}

/// Run the reader under test on `case` and judge it (the only code run under
/// `catch_unwind`).
pub fn judge(case: &Case) -> Verdict {
    match case {
        Case::Message(b) => judge_message(b),
        Case::Recording(b, verify, _) => judge_recording(b, *verify),
    }
}

impl Harness for Fuzzer {
    type Case = Case;

    fn case(&mut self) -> Case {
        match self.target {
            Target::Message => self.message_case(),
            Target::Recording => self.recording_case(),
        }
    }

    fn judge(case: &Case) -> Verdict {
        judge(case)
    }

    fn input(case: &Case) -> &[u8] {
        match case {
            Case::Message(b) | Case::Recording(b, _, _) => b,
        }
    }

    fn keep(&mut self, case: Case) {
        Fuzzer::keep(self, case)
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

/// The oracle reader, for the CI test that checks it can fail.
#[allow(dead_code)] // the CI test's
pub fn oracle_accepts(data: &[u8], verify: bool) -> bool {
    oracle_recording(data, verify).is_ok()
}
