//! A seeded mutation fuzzer for the tokenizer's two file readers: the `tiktoken.model` rank
//! file ([`Vocab::parse`]) and `tokenizer_config.json` ([`Specials::parse_config`]).
//!
//! The same design as the model readers' fuzzer (`model/examples/fuzz_parsers`): a
//! splitmix64 PRNG, a corpus of valid inputs (the fixtures under `tests/fixtures/tokenizer`
//! plus synthesized small rank files and configs), 1 to 8 stacked mutations, accepted
//! mutants fed back into the corpus, and every case under `catch_unwind` with a 1 MiB cap.
//!
//! - **Rank files** are mutated line by line (drop, duplicate, swap ranks or lines, ranks out
//!   of range, negative, huge, signed, zero-padded or not digits, CRLF, blank lines of every
//!   kind of whitespace, tabs, several spaces, Unicode spaces), token by token (invalid
//!   base64 characters, padding removed, added or misplaced, non-canonical trailing bits,
//!   empty tokens, another line's bytes, fresh bytes, new merges, a rank removed and the
//!   rest renumbered) and byte by byte (flips, inserts, deletes, truncation, non-UTF-8).
//!   Most cases start from a small synthesized file (the 256 single bytes and up to 300
//!   merges, ranks in any line order), so that one case takes tens of microseconds; the
//!   3,261-rank fixture is used one time in 64.
//! - **Configs** are mutated as JSON text (numbers, strings, duplicate or deleted members,
//!   deep nesting, splices) and structurally at the `added_tokens_decoder` level: ids
//!   outside the specials window (just below, just above, 0, huge, beyond u32), ids spelled
//!   differently (`+`, leading zeros) or given twice, names duplicated or equal to a
//!   reserved name, empty, long or of the wrong type, entries that are not objects, and the
//!   decoder removed, replaced or nested. The specials window starts at the case's base (the
//!   rank count): mostly the fixture's 3261, sometimes 256, 1000, 163584 or `u32::MAX - 513`
//!   (the largest rank count [`Vocab`] accepts).
//!
//! A finding is a panic, an error with an empty message (or of the wrong kind, or naming
//! another file), or a verdict that an independent oracle contradicts. The oracles are
//! re-implementations of the documented rules (spec §5.1 and §5.4, the doc comments of
//! `Vocab::parse` and `Specials`), written without calling the readers:
//!
//! - rank file: lines split on `\n`; a line of ASCII whitespace only is blank; any other
//!   line must be ASCII; with the ASCII whitespace at its ends trimmed, it splits on its
//!   last space into a token (trailing whitespace trimmed) that is canonical standard
//!   base64 of at least one byte and a rank that is a decimal integer (an optional `+`, as
//!   both Rust and Python read integers); the ranks are exactly `0..n` and the tokens'
//!   bytes distinct, with all 256 single bytes among them. An accepted vocabulary must give
//!   `len() == n`, `get(bytes) == rank` and `bytes(rank) == bytes` for every line, the
//!   single-byte and pair tables, and `None` for some byte strings that are not tokens. A
//!   refusal must name a line when some line is malformed, and the line it names must be
//!   faulty and not after the first malformed one.
//! - config: valid JSON (serde_json's reading, as the reader's); the top level an object
//!   with an `added_tokens_decoder` object; its members read as Python's `json` and
//!   `tokenization_kimi.py` read them (a repeated key keeps its first position and last
//!   value; later ids overwrite earlier ones); each key a decimal id (optional `+`) in
//!   `base..base + 256`, each value an object whose `content` is a non-empty string; the
//!   256 names (unnamed slots `<|reserved_token_<id>|>`) distinct. An accepted config must
//!   name every slot as the oracle does, both ways (`name`, `id`), nothing outside the
//!   window, and its matcher must find each given name.
//!
//! The machinery (PRNG, JSON text edits, the run loop and its report) is `fuzzkit`'s; this
//! file holds the readers' corpus, mutations and oracles. Shared by the `fuzz_tokfiles`
//! example (long runs, docs/fuzzing.md) and `tests/fuzz_harness.rs` (a CI-sized run, so
//! the harness cannot rot).

use base64::Engine as _;
use k3_tokenizer::specials::{Specials, K3_NAMED, NUM_SPECIAL};
use k3_tokenizer::vocab::Vocab;
use k3_tokenizer::TokError;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use fuzzkit::json::JsonEdits;
use fuzzkit::runner::violation;
pub use fuzzkit::{n_edits, FuzzReport, Harness, Rng, Verdict, Violation};

/// Largest input one case may build (bytes).
pub const MAX_INPUT: usize = 1 << 20;
/// Most accepted mutants kept as extra corpus entries.
const MAX_GROWN: usize = 256;

fuzzkit::targets! {
    /// The readers under test.
    pub enum Target {
        Tiktoken => "tiktoken",
        Tokconfig => "tokconfig",
    }
}

/// The stream of this harness's [`Rng`]s (so its cases differ from another harness's with
/// the same seed).
const STREAM: u64 = 0x6b33_5f74_6f6b_656e;

/// The fixtures directory of this repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The fixture rank file's rank count (= its config's first special id).
pub const FIXTURE_BASE: u32 = 3261;

/// Rank counts the config cases use as the specials base.
const BASES: &[u32] = &[FIXTURE_BASE, 256, 1000, 163_584, u32::MAX - 513];

fn b64(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

// ---------------------------------------------------------------------------------------
// Interesting values.

const INT_STRS: &[&str] = &[
    "0",
    "1",
    "2",
    "-1",
    "-0",
    "+0",
    "+1",
    "00",
    "01",
    "007",
    "255",
    "256",
    "257",
    "3260",
    "3261",
    "3262",
    "3516",
    "3517",
    "65535",
    "65536",
    "163583",
    "163584",
    "163839",
    "163840",
    "2147483647",
    "2147483648",
    "4294966782",
    "4294967039",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "340282366920938463463374607431768211456",
    "1.5",
    "1.0",
    "-0.0",
    "1e3",
    "1E-7",
    "1e308",
    "1e309",
    "2.5e-324",
    "1.",
    ".5",
    "0x10",
    "1_0",
    "NaN",
    "Infinity",
    "",
];

const STR_SUBS: &[&str] = &[
    "",
    "a",
    "[BOS]",
    "[EOS]",
    "<|end_of_msg|>",
    "<|open|>",
    "[PAD]",
    "<|reserved_token_3261|>",
    "<|reserved_token_3262|>",
    "<|reserved_token_3516|>",
    "<|reserved_token_256|>",
    "<|reserved_token_163584|>",
    "added_tokens_decoder",
    "content",
    "3261",
    "\\u0000",
    "\\ud800",
    "\\udc00\\ud800",
    "\\\"",
    "\\\\",
    "\\u005b",
    "\u{7f}\u{80}",
    "\u{10ffff}",
    "é",
    " ",
    "<|",
    "|>",
];

/// Whitespace and look-alikes for rank-file lines.
const SPACES: &[&str] = &[
    " ", "  ", "\t", " \t", "\r", "\x0c", "\x0b", "\u{a0}", "\u{85}", "\u{2003}", "\u{3000}",
    "\u{feff}", "\u{200b}",
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
        4 => Value::from(rng.next_u64() >> rng.below(64)),
        5 => Value::from(rng.next_u64() as i64),
        6 => serde_json::Number::from_f64(f64::from_bits(rng.next_u64()))
            .map_or(Value::Null, Value::Number),
        7 => Value::String(
            serde_json::from_str::<String>(&format!("\"{}\"", rng.pick(STR_SUBS)))
                .unwrap_or_default(),
        ),
        8 => Value::String("x".repeat(rng.below(8_000))),
        9 => Value::Array((0..rng.below(6)).map(|i| Value::from(i as u64)).collect()),
        10 => json!({"content": "z"}),
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

/// One structural edit at a random node of `v`: replace, delete, add, or recurse.
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
            match rng.below(6) {
                0 => {
                    a.remove(i);
                }
                1 => a.push(random_value(rng)),
                _ => mutate_value(&mut a[i], rng, depth + 1),
            }
        }
        _ => *v = random_value(rng),
    }
}

// ---------------------------------------------------------------------------------------
// Byte- and JSON-text-level mutations (as in the model readers' fuzzer).

/// The JSON text edits of this harness: its interesting numbers and strings; numbers are
/// also the ids that key `added_tokens_decoder`.
const JSON_EDITS: JsonEdits<'static> = JsonEdits {
    ints: INT_STRS,
    strs: STR_SUBS,
    numeric_keys: true,
};

fn mutate_json_text(b: &mut Vec<u8>, rng: &mut Rng, corpus_text: &[u8]) -> bool {
    fuzzkit::json::mutate_json_text(b, rng, corpus_text, &JSON_EDITS)
}

/// A generic byte-level edit of `b`.
fn mutate_bytes(b: &mut Vec<u8>, rng: &mut Rng, other: &[u8]) {
    let pos = |b: &[u8], rng: &mut Rng| rng.below(b.len());
    match rng.below(9) {
        0 => {
            if !b.is_empty() {
                let i = pos(b, rng);
                b[i] ^= 1 << rng.below(8);
            }
        }
        1 => {
            if !b.is_empty() {
                let i = pos(b, rng);
                b[i] = rng.next_u64() as u8;
            }
        }
        2 => {
            let i = pos(b, rng);
            let n = 1 + rng.below(8);
            let ins: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            b.splice(i..i, ins);
        }
        3 => {
            if !b.is_empty() {
                let i = pos(b, rng);
                let n = (1 + rng.below(32)).min(b.len() - i);
                b.drain(i..i + n);
            }
        }
        4 => {
            // Splice: a chunk of another corpus entry, inserted or overwriting.
            if !other.is_empty() {
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
        }
        5 => {
            // Duplicate a range.
            if !b.is_empty() {
                let s = pos(b, rng);
                let n = (1 + rng.below(128)).min(b.len() - s);
                let chunk = b[s..s + n].to_vec();
                let i = pos(b, rng);
                b.splice(i..i, chunk);
            }
        }
        6 => {
            let n = pos(b, rng);
            b.truncate(n);
        }
        7 => {
            // Bytes that are not UTF-8 (or start a sequence that is cut short).
            let bad: [&[u8]; 6] = [
                b"\xff",
                b"\x80",
                b"\xc3",
                b"\xe2\x82",
                b"\xed\xa0\x80",
                b"\xc0\xaf",
            ];
            let i = pos(b, rng);
            b.splice(i..i, rng.pick(&bad).iter().copied());
        }
        _ => {
            // Overwrite with a structural byte of either format.
            if !b.is_empty() {
                let i = pos(b, rng);
                b[i] = *rng.pick(b"{}[]\",:\\ 0-.e=+/\n\r\t");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Rank files: synthesis, line-level mutations, and the oracle.

/// A valid rank file: the 256 single bytes at random ranks below 256 and `merges` distinct
/// longer tokens after them; lines in rank order or shuffled, sometimes CRLF or with blank
/// lines.
fn synth_rank_file(rng: &mut Rng, merges: usize) -> Vec<u8> {
    let mut singles: Vec<u8> = (0..=255).collect();
    if !rng.one_in(4) {
        rng.shuffle(&mut singles);
    }
    let mut tokens: Vec<Vec<u8>> = singles.iter().map(|&b| vec![b]).collect();
    let mut seen: BTreeSet<Vec<u8>> = tokens.iter().cloned().collect();
    while tokens.len() < 256 + merges {
        let long = rng.one_in(8);
        let len = 2 + rng.below(if long { 40 } else { 6 });
        let t: Vec<u8> = if rng.one_in(2) {
            (0..len).map(|_| b"etaoin shrdlu"[rng.below(13)]).collect()
        } else {
            (0..len).map(|_| rng.next_u64() as u8).collect()
        };
        if seen.insert(t.clone()) {
            tokens.push(t);
        }
    }
    let mut lines: Vec<String> = tokens
        .iter()
        .enumerate()
        .map(|(r, t)| format!("{} {r}", b64(t)))
        .collect();
    if rng.one_in(3) {
        rng.shuffle(&mut lines);
    }
    if rng.one_in(8) {
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(lines.len() + 1);
            lines.insert(i, String::new());
        }
    }
    let eol = if rng.one_in(6) { "\r\n" } else { "\n" };
    let mut s = lines.join(eol);
    if !rng.one_in(8) {
        s.push_str(eol);
    }
    s.into_bytes()
}

/// The ASCII whitespace of `u8::is_ascii_whitespace` (the rank file's blank-line rule).
fn is_ws(b: u8) -> bool {
    b.is_ascii_whitespace()
}

fn trim_ws(mut b: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = b {
        if !is_ws(*first) {
            break;
        }
        b = rest;
    }
    while let [rest @ .., last] = b {
        if !is_ws(*last) {
            break;
        }
        b = rest;
    }
    b
}

/// Canonical standard base64 (RFC 4648 §4, padded, zero trailing bits), written here from
/// the RFC and not taken from the base64 crate: appends the bytes to `out`; false (with
/// `out` partly written) when `s` is not that, or empty.
pub fn oracle_b64(s: &[u8], out: &mut Vec<u8>) -> bool {
    decode_b64(s, out).is_some()
}

fn decode_b64(s: &[u8], out: &mut Vec<u8>) -> Option<()> {
    fn val(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    if s.is_empty() || !s.len().is_multiple_of(4) {
        return None;
    }
    let last = s.len() / 4 - 1;
    for (q, quad) in s.chunks_exact(4).enumerate() {
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && q != last) {
            return None;
        }
        let mut n = 0u32;
        for &c in &quad[..4 - pad] {
            n = n << 6 | val(c)?;
        }
        match pad {
            0 => out.extend_from_slice(&[(n >> 16) as u8, (n >> 8) as u8, n as u8]),
            1 => {
                if n & 0x3 != 0 {
                    return None;
                }
                out.extend_from_slice(&[(n >> 10) as u8, (n >> 2) as u8]);
            }
            _ => {
                if n & 0xf != 0 {
                    return None;
                }
                out.push((n >> 4) as u8);
            }
        }
    }
    Some(())
}

/// A small FxHash-style hasher for the oracle's tables (SipHash dominated the run time).
#[derive(Default)]
struct Fx(u64);

impl std::hash::Hasher for Fx {
    fn write(&mut self, b: &[u8]) {
        for c in b.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(w))
                .wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
}

type FxMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<Fx>>;

/// One valid line as the oracle reads it.
#[derive(Clone, Copy)]
pub struct OracleEntry {
    /// The token's bytes: `bytes[start..end]` of the oracle's buffer.
    pub start: usize,
    pub end: usize,
    pub rank: u64,
    pub line: usize,
}

/// The oracle's reading of a rank file.
pub enum RankOracle {
    /// Valid: the decoded bytes of all tokens, and the lines in file order.
    Valid(Vec<u8>, Vec<OracleEntry>),
    /// Invalid: why, the first malformed line (if any) and every faulty line.
    Invalid {
        why: String,
        first_malformed: Option<usize>,
        faulty: BTreeSet<usize>,
    },
}

/// The documented rank-file rules (module docs), from scratch.
pub fn oracle_rank_file(text: &[u8]) -> RankOracle {
    let mut bytes: Vec<u8> = Vec::with_capacity(text.len());
    let mut entries: Vec<OracleEntry> = Vec::new();
    let mut first_malformed = None;
    let mut faulty = BTreeSet::new();
    let mut why = String::new();
    for (i, raw) in text.split(|&b| b == b'\n').enumerate() {
        let lineno = i + 1;
        if raw.iter().all(|&b| is_ws(b)) {
            continue;
        }
        let problem = if !raw.is_ascii() {
            Some("not ASCII")
        } else {
            let line = trim_ws(raw);
            match line.iter().rposition(|&b| b == b' ') {
                None => Some("no space"),
                Some(sp) => {
                    let tok = trim_ws(&line[..sp]);
                    let rank = &line[sp + 1..];
                    let digits = rank.strip_prefix(b"+").unwrap_or(rank);
                    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                        Some("rank is not a decimal integer")
                    } else {
                        let start = bytes.len();
                        if oracle_b64(tok, &mut bytes) {
                            let rank = if digits.len() > 18 {
                                u64::MAX
                            } else {
                                digits
                                    .iter()
                                    .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'))
                            };
                            entries.push(OracleEntry {
                                start,
                                end: bytes.len(),
                                rank,
                                line: lineno,
                            });
                            None
                        } else {
                            bytes.truncate(start);
                            Some("token is not canonical base64 of at least one byte")
                        }
                    }
                }
            }
        };
        if let Some(p) = problem {
            faulty.insert(lineno);
            if first_malformed.is_none() {
                first_malformed = Some(lineno);
                why = format!("line {lineno}: {p}");
            }
        }
    }
    let n = entries.len() as u64;
    // The line of each rank (0: none yet).
    let mut rank_line: Vec<usize> = vec![0; entries.len()];
    let mut byte_lines: FxMap<&[u8], usize> = FxMap::default();
    byte_lines.reserve(entries.len());
    let mut singles = [false; 256];
    let problem = |m: String, why: &mut String| {
        if why.is_empty() {
            *why = m;
        }
    };
    for e in &entries {
        let (rank, lineno) = (e.rank, e.line);
        if rank >= n {
            problem(
                format!("line {lineno}: rank {rank} not below {n}"),
                &mut why,
            );
            faulty.insert(lineno);
        } else if rank_line[rank as usize] != 0 {
            let first = rank_line[rank as usize];
            problem(
                format!("line {lineno}: rank {rank} also on line {first}"),
                &mut why,
            );
            faulty.insert(lineno);
        } else {
            rank_line[rank as usize] = lineno;
        }
        let b = &bytes[e.start..e.end];
        if let Some(first) = byte_lines.insert(b, lineno) {
            problem(
                format!("lines {first} and {lineno} have the same bytes"),
                &mut why,
            );
            faulty.insert(first);
            faulty.insert(lineno);
        }
        if let [one] = b {
            singles[*one as usize] = true;
        }
    }
    if let Some(b) = singles.iter().position(|&s| !s) {
        problem(format!("no single byte {b:#04x}"), &mut why);
    }
    drop(byte_lines);
    if why.is_empty() && first_malformed.is_none() {
        RankOracle::Valid(bytes, entries)
    } else {
        RankOracle::Invalid {
            why,
            first_malformed,
            faulty,
        }
    }
}

/// An accepted vocabulary must hold exactly the oracle's entries.
pub fn check_vocab(v: &Vocab, bytes: &[u8], entries: &[OracleEntry]) -> Result<(), Violation> {
    if v.len() != entries.len() || v.is_empty() {
        return violation(format!("len {} for {} lines", v.len(), entries.len()));
    }
    for e in entries {
        let b = &bytes[e.start..e.end];
        let (r, rank, line) = (e.rank as u32, e.rank, e.line);
        if v.get(b) != Some(r) {
            return violation(format!(
                "line {line}: get({b:02x?}) = {:?}, want {rank}",
                v.get(b)
            ));
        }
        if v.bytes(r) != Some(b) {
            return violation(format!("bytes({rank}) = {:02x?}", v.bytes(r)));
        }
        match b {
            [x] if v.byte(*x) != r => return violation(format!("byte({x}) = {}", v.byte(*x))),
            [x, y] if v.pair(*x, *y) != r => {
                return violation(format!("pair({x}, {y}) = {}", v.pair(*x, *y)))
            }
            _ => {}
        }
    }
    if v.bytes(entries.len() as u32).is_some() || v.bytes(u32::MAX).is_some() {
        return violation("bytes() past the last rank".into());
    }
    // Byte strings that are mostly not tokens (a token with a byte appended, the empty
    // string): a rank returned must be a rank of exactly those bytes.
    if v.get(b"").is_some() {
        return violation("get(empty) is a rank".into());
    }
    let mut k = Vec::new();
    for e in entries.iter().step_by(7) {
        k.clear();
        k.extend_from_slice(&bytes[e.start..e.end]);
        k.push(0xa7);
        if let Some(r) = v.get(&k) {
            if v.bytes(r) != Some(k.as_slice()) {
                return violation(format!("get({k:02x?}) = {r}, whose bytes differ"));
            }
        }
    }
    Ok(())
}

/// A random line of `t`: its span without the `\n`.
fn line_at(t: &[u8], rng: &mut Rng) -> (usize, usize) {
    let p = rng.below(t.len() + 1);
    let s = t[..p]
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    let e = t[s..]
        .iter()
        .position(|&b| b == b'\n')
        .map_or(t.len(), |i| s + i);
    (s, e)
}

/// The (token, rank) halves of a line, split on its last space.
fn halves(l: &[u8]) -> Option<(&[u8], &[u8])> {
    let sp = l.iter().rposition(|&b| b == b' ')?;
    Some((&l[..sp], &l[sp + 1..]))
}

fn rank_of(l: &[u8]) -> Option<u64> {
    let (_, r) = halves(l)?;
    std::str::from_utf8(trim_ws(r)).ok()?.parse().ok()
}

fn with_rank(l: &[u8], rank: &[u8]) -> Vec<u8> {
    match halves(l) {
        Some((t, _)) => [t, b" ", rank].concat(),
        None => [l, b" ", rank].concat(),
    }
}

fn with_token(l: &[u8], tok: &[u8]) -> Vec<u8> {
    match halves(l) {
        Some((_, r)) => [tok, b" ", r].concat(),
        None => [tok, b" 0"].concat(),
    }
}

/// Replace two lines (`a` and `b` spans, distinct) by new contents.
fn replace_two(t: &mut Vec<u8>, a: (usize, usize), na: Vec<u8>, b: (usize, usize), nb: Vec<u8>) {
    if a.0 == b.0 {
        return;
    }
    let ((first, nf), (second, ns)) = if a.0 < b.0 {
        ((a, na), (b, nb))
    } else {
        ((b, nb), (a, na))
    };
    t.splice(second.0..second.1, ns);
    t.splice(first.0..first.1, nf);
}

/// Insert a line (a `\n` added) at the start of a random line.
fn insert_line(t: &mut Vec<u8>, rng: &mut Rng, mut l: Vec<u8>) {
    let (s, _) = line_at(t, rng);
    l.push(b'\n');
    t.splice(s..s, l);
}

/// One line- or token-level edit of a rank file's text.
fn mutate_rank_lines(t: &mut Vec<u8>, rng: &mut Rng, other: &[u8]) {
    let (s, e) = line_at(t, rng);
    match rng.below(26) {
        k @ 0..=12 => edit_lines_and_ranks(t, rng, k, (s, e)),
        k @ 13..=18 => edit_tokens(t, rng, k, (s, e)),
        k => edit_file(t, rng, other, k, (s, e)),
    }
}

/// Edits `0..=12` of [`mutate_rank_lines`] on the line at `s..e`: lines dropped,
/// duplicated or swapped, ranks swapped or made bad, CRs, blank lines and whitespace.
fn edit_lines_and_ranks(t: &mut Vec<u8>, rng: &mut Rng, k: usize, (s, e): (usize, usize)) {
    let line = t[s..e].to_vec();
    let set = |t: &mut Vec<u8>, new: Vec<u8>| {
        t.splice(s..e, new);
    };
    match k {
        // Drop a line.
        0 => {
            t.drain(s..(e + 1).min(t.len()));
        }
        // Duplicate a line (a repeated rank and repeated bytes).
        1 => insert_line(t, rng, line),
        // Swap the ranks of two lines (still valid).
        2 | 3 => {
            let b = line_at(t, rng);
            let other_line = t[b.0..b.1].to_vec();
            if let (Some((ti, ri)), Some((tj, rj))) = (halves(&line), halves(&other_line)) {
                let na = [ti, b" ", rj].concat();
                let nb = [tj, b" ", ri].concat();
                replace_two(t, (s, e), na, b, nb);
            }
        }
        // Swap two lines (still valid).
        4 => {
            let b = line_at(t, rng);
            let other_line = t[b.0..b.1].to_vec();
            replace_two(t, (s, e), other_line, b, line);
        }
        // A rank out of range: the entry count or just past it.
        5 => {
            let n = t.iter().filter(|&&b| b == b'\n').count();
            let r = (n + rng.below(3)).saturating_sub(1);
            set(t, with_rank(&line, r.to_string().as_bytes()));
        }
        // An interesting rank: negative, huge, signed, padded, a float, empty.
        6 => set(t, with_rank(&line, rng.pick(INT_STRS).as_bytes())),
        // A rank that is not digits: a letter in it, a suffix, a prefix.
        7 => {
            let junk = *rng.pick(&["x", "a", "-", ".", "_", "e", "٣", "\0", "#"]);
            if let Some((tok, r)) = halves(&line) {
                let k = rng.below(r.len() + 1);
                set(t, [tok, b" ", &r[..k], junk.as_bytes(), &r[k..]].concat());
            }
        }
        // CRLF, or a lone CR inside the line.
        8 => {
            let k = if rng.one_in(3) {
                s + rng.below(e - s + 1)
            } else {
                e
            };
            t.insert(k, b'\r');
        }
        // A blank line of some whitespace (or of a look-alike).
        9 | 10 => {
            let mut b = Vec::new();
            for _ in 0..rng.below(3) {
                b.extend_from_slice(rng.pick(SPACES).as_bytes());
            }
            insert_line(t, rng, b);
        }
        // Whitespace at the start, the end or the separator.
        _ => {
            let w = rng.pick(SPACES).as_bytes();
            match (rng.below(4), halves(&line)) {
                (0, _) => set(t, [w, &line].concat()),
                (1, _) => set(t, [&line, w].concat()),
                (2, Some((tok, r))) => set(t, [tok, w, r].concat()),
                (_, Some((tok, r))) => set(t, [tok, w, b" ", r].concat()),
                _ => {}
            }
        }
    }
}

/// Edits `13..=18` of [`mutate_rank_lines`] on the line at `s..e`: bad base64, padding
/// and trailing bits, empty, repeated or fresh tokens.
fn edit_tokens(t: &mut Vec<u8>, rng: &mut Rng, k: usize, (s, e): (usize, usize)) {
    let line = t[s..e].to_vec();
    let set = |t: &mut Vec<u8>, new: Vec<u8>| {
        t.splice(s..e, new);
    };
    match k {
        // An invalid base64 character in the token.
        13 => {
            if let Some((tok, r)) = halves(&line) {
                let mut tok = tok.to_vec();
                let k = rng.below(tok.len() + 1);
                let c = *rng.pick(&["!", "-", "_", ".", " ", "\0", "*", "=", "\\", "é"]);
                if rng.one_in(2) && k < tok.len() {
                    tok.splice(k..k + 1, c.bytes());
                } else {
                    tok.splice(k..k, c.bytes());
                }
                set(t, [tok.as_slice(), b" ", r].concat());
            }
        }
        // Padding removed, added, or moved inside.
        14 => {
            if let Some((tok, r)) = halves(&line) {
                let mut tok = tok.to_vec();
                match rng.below(4) {
                    0 => {
                        while tok.last() == Some(&b'=') {
                            tok.pop();
                        }
                    }
                    1 => tok.push(b'='),
                    2 => tok.extend_from_slice(b"===="),
                    _ => {
                        let k = rng.below(tok.len() + 1);
                        tok.insert(k, b'=');
                    }
                }
                set(t, [tok.as_slice(), b" ", r].concat());
            }
        }
        // Non-canonical trailing bits: the last data character before the padding moves.
        15 => {
            if let Some((tok, r)) = halves(&line) {
                let mut tok = tok.to_vec();
                if let Some(k) = tok.iter().rposition(|&c| c != b'=' && !is_ws(c)) {
                    let table = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
                    if let Some(p) = table.iter().position(|&c| c == tok[k]) {
                        tok[k] = table[(p + 1 + rng.below(3)) % 64];
                    }
                }
                set(t, [tok.as_slice(), b" ", r].concat());
            }
        }
        // An empty token (or only padding).
        16 => {
            let tok = *rng.pick(&["", "=", "==", "===="]);
            set(t, with_token(&line, tok.as_bytes()));
        }
        // Another line's token: repeated bytes.
        17 => {
            let b = line_at(t, rng);
            if let Some((tok, _)) = halves(&t[b.0..b.1]) {
                let new = with_token(&line, tok);
                set(t, new);
            }
        }
        // Fresh token bytes (mostly a new token, so still valid).
        _ => {
            let len = 1 + rng.below(12);
            let tok: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            set(t, with_token(&line, b64(&tok).as_bytes()));
        }
    }
}

/// Edits `19..` of [`mutate_rank_lines`] on the line at `s..e`: new merges, a rank removed,
/// a line from `other`, bytes that are not ASCII, signed ranks, a truncated file.
fn edit_file(t: &mut Vec<u8>, rng: &mut Rng, other: &[u8], k: usize, (s, e): (usize, usize)) {
    let line = t[s..e].to_vec();
    let set = |t: &mut Vec<u8>, new: Vec<u8>| {
        t.splice(s..e, new);
    };
    match k {
        // A new merge at the next rank (still valid unless its bytes exist).
        19 | 20 => {
            let count = t
                .split(|&b| b == b'\n')
                .filter(|l| !l.iter().all(|&b| is_ws(b)))
                .count();
            let len = 2 + rng.below(10);
            let tok: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            let l = format!("{} {count}", b64(&tok)).into_bytes();
            insert_line(t, rng, l);
        }
        // Remove one rank and renumber the ranks above it (valid unless it was a byte).
        21 => {
            if let Some(r) = rank_of(&line) {
                t.drain(s..(e + 1).min(t.len()));
                let mut out = Vec::with_capacity(t.len());
                for (i, l) in t.split(|&b| b == b'\n').enumerate() {
                    if i > 0 {
                        out.push(b'\n');
                    }
                    match rank_of(l) {
                        Some(q) if q > r => {
                            out.extend(with_rank(l, (q - 1).to_string().as_bytes()))
                        }
                        _ => out.extend_from_slice(l),
                    }
                }
                *t = out;
            }
        }
        // A line from another file.
        22 => {
            let (os, oe) = line_at(other, rng);
            let l = other[os..oe].to_vec();
            if rng.one_in(2) {
                set(t, l);
            } else {
                insert_line(t, rng, l);
            }
        }
        // A byte that is not ASCII (some not UTF-8) in a line.
        23 => {
            let bad: [&[u8]; 7] = [
                b"\xff",
                b"\x80",
                b"\xc3\xa9",
                b"\xc2\xa0",
                b"\xe3\x80\x80",
                b"\xc2\x85",
                b"\xed\xa0\x80",
            ];
            let b = *rng.pick(&bad);
            let k = match rng.below(3) {
                0 => s,
                1 => e,
                _ => s + rng.below(e - s + 1),
            };
            t.splice(k..k, b.iter().copied());
        }
        // A signed or zero-padded rank (the same number).
        24 => {
            if let Some(r) = rank_of(&line) {
                let n = match rng.below(3) {
                    0 => format!("+{r}"),
                    1 => format!("0{r}"),
                    _ => format!("00{r}"),
                };
                set(t, with_rank(&line, n.as_bytes()));
            }
        }
        // Keep only the lines before this one.
        _ => t.truncate(s),
    }
}

// ---------------------------------------------------------------------------------------
// Configs: synthesis, structural mutations, and the oracle.

/// A config as a list of `added_tokens_decoder` members (duplicates possible) and the other
/// top-level members around it.
#[derive(Clone)]
struct Cfg {
    base: u32,
    pre: Vec<(String, Value)>,
    dec: Vec<(String, Value)>,
    post: Vec<(String, Value)>,
}

impl Cfg {
    fn from_text(text: &[u8], base: u32) -> Option<Cfg> {
        let v: Value = serde_json::from_slice(text).ok()?;
        let top = v.as_object()?;
        let mut cfg = Cfg {
            base,
            pre: Vec::new(),
            dec: Vec::new(),
            post: Vec::new(),
        };
        let mut seen_dec = false;
        for (k, v) in top {
            if k == "added_tokens_decoder" {
                if let Some(d) = v.as_object() {
                    cfg.dec = d.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                    seen_dec = true;
                    continue;
                }
            }
            if seen_dec {
                cfg.post.push((k.clone(), v.clone()));
            } else {
                cfg.pre.push((k.clone(), v.clone()));
            }
        }
        Some(cfg)
    }

    fn to_text(&self, rng: &mut Rng) -> Vec<u8> {
        let pretty = rng.one_in(3);
        let sep: &[u8] = if pretty { b",\n  " } else { b"," };
        let mut out = b"{".to_vec();
        let mut first = true;
        let member = |out: &mut Vec<u8>, first: &mut bool, k: &str, v: &[u8]| {
            if !*first {
                out.extend_from_slice(sep);
            }
            *first = false;
            out.extend_from_slice(&serde_json::to_vec(k).unwrap_or_default());
            out.extend_from_slice(b": ");
            out.extend_from_slice(v);
        };
        for (k, v) in &self.pre {
            member(
                &mut out,
                &mut first,
                k,
                &serde_json::to_vec(v).unwrap_or_default(),
            );
        }
        let mut d = b"{".to_vec();
        for (i, (k, v)) in self.dec.iter().enumerate() {
            if i > 0 {
                d.extend_from_slice(sep);
            }
            d.extend_from_slice(&serde_json::to_vec(k).unwrap_or_default());
            d.extend_from_slice(b": ");
            d.extend_from_slice(&serde_json::to_vec(v).unwrap_or_default());
        }
        d.push(b'}');
        member(&mut out, &mut first, "added_tokens_decoder", &d);
        for (k, v) in &self.post {
            member(
                &mut out,
                &mut first,
                k,
                &serde_json::to_vec(v).unwrap_or_default(),
            );
        }
        out.push(b'}');
        out
    }
}

fn entry(content: Value, rng: &mut Rng) -> Value {
    if rng.one_in(2) {
        json!({"content": content, "lstrip": false, "normalized": false, "rstrip": false,
               "single_word": false, "special": rng.one_in(2)})
    } else {
        json!({ "content": content })
    }
}

/// A valid config for `base`: some of K3's names and some made-up ones, in any order.
fn synth_config(rng: &mut Rng, base: u32) -> Cfg {
    let mut dec = Vec::new();
    for &(k, name) in K3_NAMED.iter() {
        if !rng.one_in(3) {
            let e = entry(Value::from(name), rng);
            dec.push(((base + k).to_string(), e));
        }
    }
    let used: BTreeSet<u32> = dec.iter().filter_map(|(k, _)| k.parse().ok()).collect();
    for _ in 0..rng.below(12) {
        let k = base + rng.below(NUM_SPECIAL as usize) as u32;
        if !used.contains(&k) {
            let name = format!("<|made_up_{}_{}|>", k, rng.below(1000));
            let e = entry(Value::from(name), rng);
            dec.push((k.to_string(), e));
        }
    }
    // Repeated ids would overwrite each other; the made-up ones are the only ones that can
    // repeat, with different names, so the last one wins and all are still distinct.
    rng.shuffle(&mut dec);
    let mut pre = Vec::new();
    if rng.one_in(2) {
        pre.push(("bos_token".to_string(), Value::from("[BOS]")));
    }
    let mut post = Vec::new();
    if rng.one_in(2) {
        post.push(("model_max_length".to_string(), Value::from(1_048_576)));
    }
    Cfg {
        base,
        pre,
        dec,
        post,
    }
}

/// An id key near, inside or far outside the window of `base`.
fn interesting_key(rng: &mut Rng, base: u32) -> String {
    let b = u64::from(base);
    match rng.below(12) {
        0 => (b + rng.below(256) as u64).to_string(),
        1 => b.saturating_sub(1).to_string(),
        2 => (b + 256).to_string(),
        3 => (b + 255).to_string(),
        4 => format!("+{}", b + rng.below(256) as u64),
        5 => format!("0{}", b + rng.below(256) as u64),
        6 => (b + (1u64 << 32)).to_string(),
        7 => format!("-{}", rng.below(3)),
        8 => rng.pick(INT_STRS).to_string(),
        9 => format!(" {b}"),
        10 => format!("{b}.0"),
        _ => rng.pick(STR_SUBS).to_string(),
    }
}

/// One structural edit of a config.
fn mutate_cfg(c: &mut Cfg, rng: &mut Rng) {
    let n = c.dec.len();
    let i = rng.below(n);
    let base = c.base;
    match rng.below(20) {
        // A key → an interesting id (outside the window, spelled differently, not a number).
        0..=2 if n > 0 => c.dec[i].0 = interesting_key(rng, base),
        // A member repeated: the same key, or the same id spelled differently.
        3 if n > 0 => {
            let m = c.dec[i].clone();
            c.dec.insert(rng.below(n + 1), m);
        }
        4 if n > 0 => {
            let mut m = c.dec[i].clone();
            m.0 = format!("0{}", m.0);
            c.dec.insert(rng.below(n + 1), m);
        }
        // Two ids with the same name.
        5 if n > 1 => {
            let j = rng.below(n);
            let v = c.dec[j].1.clone();
            c.dec[i].1 = v;
        }
        // A name that is another slot's reserved name (or its own).
        6 if n > 0 => {
            let id = u64::from(base) + rng.below(258) as u64;
            let name = format!("<|reserved_token_{}|>", id.saturating_sub(1));
            c.dec[i].1 = entry(Value::from(name), rng);
        }
        // A content that is empty, long, odd or of the wrong type.
        7 | 8 if n > 0 => {
            let content = match rng.below(6) {
                0 => Value::from(""),
                1 => Value::from("L".repeat(rng.below(20_000))),
                2 => Value::from(*rng.pick(STR_SUBS)),
                _ => random_value(rng),
            };
            c.dec[i].1 = entry(content, rng);
        }
        // An entry without content, or not an object.
        9 if n > 0 => {
            c.dec[i].1 = match rng.below(3) {
                0 => json!({"special": true}),
                1 => Value::from("[BOS]"),
                _ => random_value(rng),
            }
        }
        // A structural edit inside an entry.
        10 if n > 0 => mutate_value(&mut c.dec[i].1, rng, 0),
        // A member dropped.
        11 if n > 0 => {
            c.dec.remove(i);
        }
        // A new valid name at a free slot (still valid).
        12..=14 => {
            let k = base + rng.below(NUM_SPECIAL as usize) as u32;
            let name = format!("<|new_{}|>", rng.next_u64() % 100_000);
            let e = entry(Value::from(name), rng);
            c.dec.push((k.to_string(), e));
        }
        // Two members swap ids (still valid).
        15 if n > 1 => {
            let j = rng.below(n);
            let k = c.dec[i].0.clone();
            c.dec[i].0 = std::mem::replace(&mut c.dec[j].0, k);
        }
        // Top level: another member, a repeated decoder, or the decoder gone.
        16 => c
            .pre
            .push((rng.pick(STR_SUBS).to_string(), random_value(rng))),
        17 => {
            let d: serde_json::Map<String, Value> = c.dec.iter().cloned().collect();
            let v = if rng.one_in(2) {
                Value::Object(d)
            } else {
                random_value(rng)
            };
            let m = ("added_tokens_decoder".to_string(), v);
            if rng.one_in(2) {
                c.pre.push(m);
            } else {
                c.post.push(m);
            }
        }
        18 => c.dec.clear(),
        _ => {
            let j = rng.below(n);
            if n > 1 {
                c.dec.swap(i, j);
            }
        }
    }
}

/// A JSON object's members in order, repeated keys kept, or a note that the value is not an
/// object.
enum Members {
    Object(Vec<(String, Value)>),
    Other,
}

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Members, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = m.next_key::<String>()? {
                    out.push((k, m.next_value::<Value>()?));
                }
                Ok(Members::Object(out))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Members, A::Error> {
                while s.next_element::<Value>()?.is_some() {}
                Ok(Members::Other)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Members, E> {
                Ok(Members::Other)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Members, E> {
                Ok(Members::Other)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Members, E> {
                Ok(Members::Other)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Members, E> {
                Ok(Members::Other)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Members, E> {
                Ok(Members::Other)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Members, E> {
                Ok(Members::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// The top level of a config: its `added_tokens_decoder` members as they are written
/// (repeated top-level members: the last one counts, as in Python's `json`).
struct OracleTop(Option<Members>);

impl<'de> Deserialize<'de> for OracleTop {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OracleTop;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<OracleTop, A::Error> {
                let mut dec = None;
                while let Some(k) = m.next_key::<String>()? {
                    if k == "added_tokens_decoder" {
                        dec = Some(m.next_value::<Members>()?);
                    } else {
                        // Read (not skipped), so that the whole text is checked as JSON.
                        m.next_value::<Value>()?;
                    }
                }
                Ok(OracleTop(dec))
            }
        }
        d.deserialize_map(V)
    }
}

/// The reserved name of slot id `id`.
fn reserved(id: u128) -> String {
    format!("<|reserved_token_{id}|>")
}

/// The documented config rules (module docs), from scratch: the names given per slot (the
/// others are reserved names), or why the config is refused.
pub fn oracle_config(text: &[u8], base: u32) -> Result<Vec<Option<String>>, Violation> {
    // JSON validity is serde_json's (as the reader's); every member is read.
    let top: OracleTop =
        serde_json::from_slice(text).map_err(|e| format!("not a JSON object: {e}"))?;
    let members = match top.0 {
        None => return violation("no added_tokens_decoder".into()),
        Some(Members::Other) => return violation("added_tokens_decoder is not an object".into()),
        Some(Members::Object(m)) => m,
    };
    // Python dict semantics: a repeated key keeps its first position, takes the last value.
    let mut dict: Vec<(String, Value)> = Vec::new();
    for (k, v) in members {
        match dict.iter_mut().find(|(k2, _)| *k2 == k) {
            Some(slot) => slot.1 = v,
            None => dict.push((k, v)),
        }
    }
    let lo = u128::from(base);
    let hi = lo + u128::from(NUM_SPECIAL);
    let mut names: Vec<Option<String>> = vec![None; NUM_SPECIAL as usize];
    for (k, v) in &dict {
        let digits = k.strip_prefix('+').unwrap_or(k);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return violation(format!("key {k:?} is not an id"));
        }
        let id: u128 = if digits.len() > 30 {
            u128::MAX
        } else {
            digits.parse().unwrap_or(u128::MAX)
        };
        let Some(content) = v.as_object().and_then(|o| o.get("content")) else {
            return violation(format!("{k}: no content"));
        };
        let Some(content) = content.as_str() else {
            return violation(format!("{k}: content is not a string"));
        };
        if !(lo..hi).contains(&id) {
            return violation(format!("id {id} outside {lo}..{hi}"));
        }
        if content.is_empty() {
            return violation(format!("{k}: empty content"));
        }
        names[(id - lo) as usize] = Some(content.to_string());
    }
    // All 256 names distinct: the given ones among themselves, and none the reserved name of
    // another slot that keeps it.
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (k, n) in names.iter().enumerate() {
        let Some(n) = n else { continue };
        if let Some(j) = seen.insert(n.as_str(), k) {
            return violation(format!("name {n:?} at slots {j} and {k}"));
        }
        if n.starts_with("<|reserved_token_") {
            if let Some(j) =
                (0..names.len()).find(|&j| names[j].is_none() && *n == reserved(lo + j as u128))
            {
                return violation(format!(
                    "name {n:?} at slot {k} is slot {j}'s reserved name"
                ));
            }
        }
    }
    Ok(names)
}

/// Whether `name` is exactly `<|reserved_token_<id>|>`, without building the string.
fn is_reserved_name(name: &str, id: u32) -> bool {
    let Some(d) = name
        .strip_prefix("<|reserved_token_")
        .and_then(|r| r.strip_suffix("|>"))
    else {
        return false;
    };
    !d.is_empty()
        && d.bytes().all(|b| b.is_ascii_digit())
        && (d == "0" || !d.starts_with('0'))
        && d.parse::<u32>() == Ok(id)
}

/// An accepted config must name the slots as the oracle does.
pub fn check_specials(s: &Specials, base: u32, names: &[Option<String>]) -> Result<(), Violation> {
    if s.base() != base {
        return violation(format!("base {} for {base}", s.base()));
    }
    for (k, want) in names.iter().enumerate() {
        let id = base + k as u32;
        let got = s.name(id);
        let Some(got) = got else {
            return violation(format!("name({id}) is None"));
        };
        match want {
            Some(want) if got != want => {
                return violation(format!("name({id}) = {got:?}, want {want:?}"));
            }
            None if !is_reserved_name(got, id) => {
                return violation(format!("name({id}) = {got:?}, want the reserved name"));
            }
            _ => {}
        }
        if s.id(got) != Some(id) {
            return violation(format!("id({got:?}) = {:?}, want {id}", s.id(got)));
        }
        // The matcher finds a given name where the text is that name (leftmost-longest:
        // any other name starting at 0 is shorter).
        if want.is_some() || k == 0 {
            let m = s.find_iter(got).next();
            if m != Some((0, got.len(), id)) {
                return violation(format!("find_iter({got:?}) = {m:?}, want (0, _, {id})"));
            }
        }
    }
    let end = base + NUM_SPECIAL;
    if s.name(end).is_some() || (base > 0 && s.name(base - 1).is_some()) {
        return violation("a name outside the window".into());
    }
    if s.id("<|not_a_special|>").is_some() {
        return violation("id() of a name that is not one".into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The fuzzer.

struct Fuzzer {
    target: Target,
    rng: Rng,
    /// Rank files (tiktoken) or config texts with their base (tokconfig).
    files: Vec<(Vec<u8>, u32)>,
    /// Tiktoken: the fixture file (1 case in 64, and a source of lines).
    fixture: Vec<u8>,
    /// Tokconfig: structured configs.
    cfgs: Vec<Cfg>,
    grown: usize,
    fixed: usize,
}

impl Fuzzer {
    fn new(target: Target, seed: u64) -> Fuzzer {
        let mut rng = Rng::new(seed, STREAM);
        let dir = fixtures().join("tokenizer");
        let mut f = Fuzzer {
            target,
            rng: Rng::new(seed.wrapping_add(1), STREAM),
            files: Vec::new(),
            fixture: Vec::new(),
            cfgs: Vec::new(),
            grown: 0,
            fixed: 0,
        };
        match target {
            Target::Tiktoken => {
                f.fixture = std::fs::read(dir.join("tiktoken.model")).unwrap_or_default();
                for i in 0..48 {
                    let merges = match i % 4 {
                        0 => 0,
                        1 => rng.below(10),
                        2 => rng.below(40),
                        _ => rng.below(300),
                    };
                    f.files.push((synth_rank_file(&mut rng, merges), 0));
                }
            }
            Target::Tokconfig => {
                if let Ok(b) = std::fs::read(dir.join("tokenizer_config.json")) {
                    if let Some(c) = Cfg::from_text(&b, FIXTURE_BASE) {
                        f.cfgs.push(c);
                    }
                    f.files.push((b, FIXTURE_BASE));
                }
                for i in 0..48 {
                    let base = BASES[i % BASES.len()];
                    let c = synth_config(&mut rng, base);
                    f.files.push((c.to_text(&mut rng), base));
                    f.cfgs.push(c);
                }
            }
        }
        f.fixed = f.files.len();
        f
    }

    /// Keep an accepted input as a corpus entry (bounded; replaces an older one).
    fn grow(&mut self, input: Vec<u8>, base: u32) {
        if self.grown < MAX_GROWN {
            self.files.push((input, base));
            self.grown += 1;
        } else {
            let i = self.fixed + self.rng.below(MAX_GROWN);
            if let Some(slot) = self.files.get_mut(i) {
                *slot = (input, base);
            }
        }
    }

    fn case(&mut self) -> Case {
        match self.target {
            Target::Tiktoken => self.tiktoken_case(),
            Target::Tokconfig => self.config_case(),
        }
    }

    fn tiktoken_case(&mut self) -> Case {
        let rng = &mut self.rng;
        let use_fixture = !self.fixture.is_empty() && rng.one_in(64);
        let mut text = if use_fixture {
            self.fixture.clone()
        } else {
            self.files[rng.below(self.files.len())].0.clone()
        };
        let other = if rng.one_in(4) && !self.fixture.is_empty() {
            &self.fixture
        } else {
            &self.files[rng.below(self.files.len())].0
        };
        for _ in 0..n_edits(rng) {
            mutate_rank_lines(&mut text, rng, other);
        }
        if rng.one_in(5) {
            for _ in 0..n_edits(rng) {
                mutate_bytes(&mut text, rng, other);
            }
        }
        text.truncate(MAX_INPUT);
        Case::Tiktoken(text, use_fixture)
    }

    fn config_case(&mut self) -> Case {
        let rng = &mut self.rng;
        let (mut text, mut base) = if !self.cfgs.is_empty() && rng.one_in(2) {
            // Structural edits, then maybe text edits.
            let mut c = self.cfgs[rng.below(self.cfgs.len())].clone();
            for _ in 0..n_edits(rng) {
                mutate_cfg(&mut c, rng);
            }
            let mut t = c.to_text(rng);
            if rng.one_in(4) {
                let other = &self.files[rng.below(self.files.len())].0;
                mutate_json_text(&mut t, rng, other);
            }
            (t, c.base)
        } else {
            let (t, base) = &self.files[rng.below(self.files.len())];
            let mut t = t.clone();
            let other = &self.files[rng.below(self.files.len())].0;
            for _ in 0..n_edits(rng) {
                if rng.below(3) != 0 {
                    if !mutate_json_text(&mut t, rng, other) {
                        mutate_bytes(&mut t, rng, other);
                    }
                } else {
                    mutate_bytes(&mut t, rng, other);
                }
            }
            (t, *base)
        };
        if rng.one_in(16) {
            base = *rng.pick(BASES);
        }
        text.truncate(MAX_INPUT);
        Case::Tokconfig(text, base)
    }

    /// Keep an accepted case as a corpus entry, one time in 16.
    fn keep(&mut self, case: Case) {
        if !self.rng.one_in(16) {
            return;
        }
        match case {
            Case::Tiktoken(_, true) => {}
            Case::Tiktoken(t, false) => self.grow(t, 0),
            Case::Tokconfig(t, base) => {
                if let Some(c) = Cfg::from_text(&t, base) {
                    if self.cfgs.len() < self.fixed + MAX_GROWN {
                        self.cfgs.push(c);
                    } else {
                        let i = self.fixed + self.rng.below(MAX_GROWN);
                        self.cfgs[i] = c;
                    }
                }
                self.grow(t, base);
            }
        }
    }
}

/// One built input.
enum Case {
    /// Rank-file bytes; true when built from the 3,261-rank fixture.
    Tiktoken(Vec<u8>, bool),
    /// Config bytes and the base (rank count) to read them with.
    Tokconfig(Vec<u8>, u32),
}

impl Case {
    fn input(&self) -> &[u8] {
        match self {
            Case::Tiktoken(b, _) | Case::Tokconfig(b, _) => b,
        }
    }
}

/// Judge a rank-file refusal against the oracle's reading.
fn judge_rank_error(e: &TokError, path: &Path, oracle: &RankOracle) -> Verdict {
    let RankOracle::Invalid {
        first_malformed,
        faulty,
        ..
    } = oracle
    else {
        return Verdict::broken(format!("a valid file refused: {e}"));
    };
    match e {
        TokError::RankLine { path: p, line, msg } => {
            if msg.is_empty() || p != path {
                return Verdict::broken(format!("error without a message or file: {e:?}"));
            }
            if first_malformed.is_some_and(|m| *line > m) {
                return Verdict::broken(format!(
                    "error names line {line}, after the first malformed line {first_malformed:?}: {e}"
                ));
            }
            if !faulty.contains(line) {
                return Verdict::broken(format!("error names line {line}, a good one: {e}"));
            }
            Verdict::Rejected
        }
        TokError::RankFile { path: p, msg } => {
            if msg.is_empty() || p != path {
                return Verdict::broken(format!("error without a message or file: {e:?}"));
            }
            if let Some(m) = first_malformed {
                return Verdict::broken(format!("line {m} is malformed, error names none: {e}"));
            }
            Verdict::Rejected
        }
        _ => Verdict::broken(format!("an error of another kind: {e:?}")),
    }
}

/// Run the reader under test on `case` and judge the result. This is the only code that
/// runs inside `catch_unwind`.
fn judge(case: &Case) -> Verdict {
    match case {
        Case::Tiktoken(text, _) => {
            let path = Path::new("fuzz/tiktoken.model");
            let got = Vocab::parse(text, path);
            let oracle = oracle_rank_file(text);
            match (got, &oracle) {
                (Ok(v), RankOracle::Valid(bytes, entries)) => match check_vocab(&v, bytes, entries)
                {
                    Ok(()) => Verdict::Accepted,
                    Err(e) => Verdict::Broken(e),
                },
                (Ok(_), RankOracle::Invalid { why, .. }) => {
                    Verdict::broken(format!("accepted, the oracle refuses: {why}"))
                }
                (Err(e), _) => judge_rank_error(&e, path, &oracle),
            }
        }
        Case::Tokconfig(text, base) => {
            let path = Path::new("fuzz/tokenizer_config.json");
            let got = Specials::parse_config(text, *base, path);
            let oracle = oracle_config(text, *base);
            match (got, oracle) {
                (Ok(s), Ok(names)) => match check_specials(&s, *base, &names) {
                    Ok(()) => Verdict::Accepted,
                    Err(e) => Verdict::Broken(e),
                },
                (Ok(_), Err(why)) => {
                    Verdict::broken(format!("accepted, the oracle refuses: {why}"))
                }
                (Err(e), Ok(_)) => Verdict::broken(format!("a valid config refused: {e}")),
                (Err(TokError::Config { path: p, msg }), Err(_)) => {
                    if msg.is_empty() || p != path {
                        Verdict::broken(format!("error without a message or file: {msg:?}"))
                    } else {
                        Verdict::Rejected
                    }
                }
                (Err(e), Err(_)) => Verdict::broken(format!("an error of another kind: {e:?}")),
            }
        }
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

    /// Findings are grouped by their text up to the first digit (line numbers differ).
    fn finding_key(what: &str) -> String {
        what.chars().take_while(|c| !c.is_ascii_digit()).collect()
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
