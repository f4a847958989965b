//! The rank table: `tiktoken.model` loading and a byte-keyed hash table (spec §5.1).
//!
//! Keys are raw bytes, never code points: a token whose bytes happen to be valid UTF-8 is
//! still looked up as bytes. Ranks come from the file (rank = id = merge priority).

use crate::error::{Result, TokError};
use base64::Engine as _;
use std::path::Path;

/// All ranked tokens: their bytes, and a hash table from bytes to rank.
pub struct Vocab {
    data: Vec<u8>,
    /// `offsets[r]..offsets[r + 1]` are the bytes of rank `r`.
    offsets: Vec<u32>,
    /// Open addressing, linear probing: 0 = empty, else rank + 1.
    table: Vec<u32>,
    mask: usize,
    byte_rank: [u32; 256],
    /// Rank of every two-byte token, `u32::MAX` where absent (256 KiB).
    pair_rank: Vec<u32>,
}

/// A fast multiplicative hash of a byte string (FxHash-style, 8 bytes at a time).
#[inline(always)]
fn hash(b: &[u8]) -> u64 {
    const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;
    let mut h: u64 = b.len() as u64;
    let mut chunks = b.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        h = (h.rotate_left(5) ^ w).wrapping_mul(K);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        h = (h.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
    }
    h ^ (h >> 29)
}

impl Vocab {
    /// Build from tokens indexed by rank. Errors if a token is empty or repeated, or a
    /// single byte is missing; `what` names the source in messages.
    pub fn from_tokens(tokens: Vec<Vec<u8>>, what: &Path) -> Result<Vocab> {
        let n = tokens.len();
        if n == 0 {
            return Err(TokError::RankFile {
                path: what.to_path_buf(),
                msg: "no ranks".into(),
            });
        }
        if n >= (u32::MAX as usize) - 512 {
            return Err(TokError::RankFile {
                path: what.to_path_buf(),
                msg: format!("{n} ranks is too many"),
            });
        }
        let mut data = Vec::new();
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0u32);
        for t in &tokens {
            data.extend_from_slice(t);
            if data.len() > u32::MAX as usize {
                return Err(TokError::RankFile {
                    path: what.to_path_buf(),
                    msg: "token bytes exceed 4 GiB".into(),
                });
            }
            offsets.push(data.len() as u32);
        }
        let cap = (n * 2).next_power_of_two().max(1024);
        let mut v = Vocab {
            data,
            offsets,
            table: vec![0; cap],
            mask: cap - 1,
            byte_rank: [u32::MAX; 256],
            pair_rank: vec![u32::MAX; 65536],
        };
        for (r, t) in tokens.iter().enumerate() {
            if let Some(prev) = v.get(t) {
                return Err(TokError::RankFile {
                    path: what.to_path_buf(),
                    msg: format!("ranks {prev} and {r} have the same bytes {t:02x?}"),
                });
            }
            let mut slot = hash(t) as usize & v.mask;
            while v.table[slot] != 0 {
                slot = (slot + 1) & v.mask;
            }
            v.table[slot] = r as u32 + 1;
            if t.len() == 1 {
                v.byte_rank[t[0] as usize] = r as u32;
            }
            if t.len() == 2 {
                v.pair_rank[(t[0] as usize) << 8 | t[1] as usize] = r as u32;
            }
        }
        if let Some(b) = (0..256).find(|&b| v.byte_rank[b] == u32::MAX) {
            return Err(TokError::RankFile {
                path: what.to_path_buf(),
                msg: format!(
                    "no rank for the single byte 0x{b:02x} (byte-level BPE needs all 256)"
                ),
            });
        }
        Ok(v)
    }

    /// Parse the text of a `tiktoken.model` file: `<base64> <rank>` per line (split on the
    /// last space; ASCII only; blank lines, of ASCII whitespace, skipped; the same whitespace
    /// trimmed around the fields; `\r\n` accepted). Ranks must be unique and cover
    /// `0..n` exactly (any order). Errors name the 1-based line.
    pub fn parse(contents: &[u8], path: &Path) -> Result<Vocab> {
        let line_err = |line: usize, msg: String| TokError::RankLine {
            path: path.to_path_buf(),
            line,
            msg,
        };
        let mut entries: Vec<(u32, Vec<u8>, usize)> = Vec::new();
        for (i, raw) in contents.split(|&b| b == b'\n').enumerate() {
            let lineno = i + 1;
            let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
            if raw.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            // ASCII only, and trimmed of the ASCII whitespace that makes a line blank: `trim`
            // would also drop Unicode spaces (U+00A0, U+3000, ...) and U+000B.
            let line = std::str::from_utf8(raw)
                .ok()
                .filter(|_| raw.is_ascii())
                .ok_or_else(|| line_err(lineno, "line is not ASCII text".into()))?;
            let line = line.trim_ascii();
            let (tok, rank) = line.rsplit_once(' ').ok_or_else(|| {
                line_err(
                    lineno,
                    format!("expected '<base64 token> <rank>', got {line:?}"),
                )
            })?;
            let tok = tok.trim_ascii_end();
            let rank: u32 = rank.parse().map_err(|_| {
                line_err(
                    lineno,
                    format!("rank {rank:?} is not a non-negative integer"),
                )
            })?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(tok)
                .map_err(|e| line_err(lineno, format!("token {tok:?} is not valid base64: {e}")))?;
            if bytes.is_empty() {
                return Err(line_err(lineno, "empty token".into()));
            }
            entries.push((rank, bytes, lineno));
        }
        let n = entries.len();
        let mut by_rank: Vec<Option<(Vec<u8>, usize)>> = vec![None; n];
        for (rank, bytes, lineno) in entries {
            let r = rank as usize;
            if r >= n {
                return Err(line_err(
                    lineno,
                    format!("rank {rank} out of range: the file has {n} entries, so ranks must be 0..{n} (contiguous)"),
                ));
            }
            if let Some((_, first)) = &by_rank[r] {
                return Err(line_err(
                    lineno,
                    format!("rank {rank} already given on line {first}"),
                ));
            }
            by_rank[r] = Some((bytes, lineno));
        }
        // n entries, all distinct and < n: every rank is present.
        let mut tokens = Vec::with_capacity(n);
        let mut lines = Vec::with_capacity(n);
        for e in by_rank.into_iter().flatten() {
            tokens.push(e.0);
            lines.push(e.1);
        }
        Vocab::from_tokens(tokens, path).map_err(|e| match e {
            TokError::RankFile { path, msg } if msg.starts_with("ranks ") => {
                // Name the lines of duplicated bytes too.
                let second: Option<usize> =
                    msg.split_whitespace().nth(3).and_then(|s| s.parse().ok());
                match second {
                    Some(r) if r < lines.len() => TokError::RankLine {
                        path,
                        line: lines[r],
                        msg,
                    },
                    _ => TokError::RankFile { path, msg },
                }
            }
            e => e,
        })
    }

    /// Read and parse a `tiktoken.model` file.
    pub fn load(path: &Path) -> Result<Vocab> {
        let contents =
            k3_io::input::read_capped(path, k3_io::input::TOKENIZER_CAP).map_err(|source| {
                TokError::Io {
                    path: path.to_path_buf(),
                    source,
                }
            })?;
        Vocab::parse(&contents, path)
    }

    /// Number of ranks.
    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Always false (a vocabulary has at least the 256 single bytes).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rank of a byte string, if it is a token.
    #[inline(always)]
    pub fn get(&self, key: &[u8]) -> Option<u32> {
        match key.len() {
            1 => return Some(self.byte_rank[key[0] as usize]).filter(|&r| r != u32::MAX),
            2 => return Some(self.pair(key[0], key[1])).filter(|&r| r != u32::MAX),
            _ => {}
        }
        let mut slot = hash(key) as usize & self.mask;
        loop {
            let e = self.table[slot];
            if e == 0 {
                return None;
            }
            let r = (e - 1) as usize;
            let (a, b) = (self.offsets[r] as usize, self.offsets[r + 1] as usize);
            if &self.data[a..b] == key {
                return Some(r as u32);
            }
            slot = (slot + 1) & self.mask;
        }
    }

    /// Rank of the two-byte token `[a, b]`, `u32::MAX` when it is not a token.
    #[inline(always)]
    pub fn pair(&self, a: u8, b: u8) -> u32 {
        self.pair_rank[(a as usize) << 8 | b as usize]
    }

    /// Rank of a single byte (always present).
    #[inline(always)]
    pub fn byte(&self, b: u8) -> u32 {
        self.byte_rank[b as usize]
    }

    /// Bytes of rank `r` (`r < len()`).
    #[inline(always)]
    pub fn bytes(&self, r: u32) -> Option<&[u8]> {
        let r = r as usize;
        if r >= self.len() {
            return None;
        }
        Some(&self.data[self.offsets[r] as usize..self.offsets[r + 1] as usize])
    }
}
