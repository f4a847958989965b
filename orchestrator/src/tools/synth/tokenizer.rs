//! Tokenizer files for `synth --shape tiny-chat`: a `tiktoken.model` with the released
//! rank count (163,584, so the special ids are Kimi's: `[BOS]` 163584, `[EOS]` 163585,
//! `<|end_of_msg|>` 163586, ...) and its `tokenizer_config.json`.
//!
//! The first 3,261 ranks are the test fixture's (`tests/fixtures/tokenizer`, cut from the
//! released file: bytes and common merges), so ordinary text encodes as the real tokenizer
//! would for those merges. The rest are made up: each is the concatenation of two earlier
//! merges, drawn from a fixed ChaCha stream, so every id decodes to word-like bytes and the
//! file is the same on every run.

use std::collections::HashSet;
use std::fmt::Write as _;

use anyhow::{anyhow, Result};
use base64::Engine as _;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const FIXTURE_MODEL: &str = include_str!("../../../../tests/fixtures/tokenizer/tiktoken.model");
const FIXTURE_CONFIG: &str =
    include_str!("../../../../tests/fixtures/tokenizer/tokenizer_config.json");

/// Ordinary ranks in the released vocabulary (the 256 special slots follow).
pub const RELEASED_RANKS: usize = 163_584;

/// `(tiktoken.model, tokenizer_config.json)` contents.
pub fn files() -> Result<(String, String)> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut tokens: Vec<Vec<u8>> = Vec::with_capacity(RELEASED_RANKS);
    for (n, line) in FIXTURE_MODEL.lines().enumerate() {
        let (tok, rank) = line
            .split_once(' ')
            .ok_or_else(|| anyhow!("fixture tiktoken.model line {}: no rank", n + 1))?;
        if rank.trim().parse::<usize>().ok() != Some(n) {
            return Err(anyhow!(
                "fixture tiktoken.model line {}: ranks out of order",
                n + 1
            ));
        }
        tokens.push(b64.decode(tok)?);
    }
    let base = tokens.len();
    let mut seen: HashSet<Vec<u8>> = tokens.iter().cloned().collect();
    // Merges (multi-byte ranks) of the fixture are the parts.
    let parts: Vec<usize> = (0..base).filter(|&i| tokens[i].len() >= 2).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(0x6b33_6368_6174); // "k3chat"
    while tokens.len() < RELEASED_RANKS {
        let a = &tokens[parts[rng.gen_range(0..parts.len())]];
        let b = &tokens[parts[rng.gen_range(0..parts.len())]];
        let mut t = a.clone();
        t.extend_from_slice(b);
        if seen.insert(t.clone()) {
            tokens.push(t);
        }
    }
    let mut model = String::with_capacity(RELEASED_RANKS * 16);
    for (r, t) in tokens.iter().enumerate() {
        let _ = writeln!(model, "{} {r}", b64.encode(t));
    }
    // The fixture's special ids follow its 3,261 ranks; move them after the released count.
    let shift = RELEASED_RANKS - base;
    let mut cfg: serde_json::Value = serde_json::from_str(FIXTURE_CONFIG)?;
    let added = cfg
        .get("added_tokens_decoder")
        .and_then(|v| v.as_object())
        .ok_or_else(|| anyhow!("fixture tokenizer_config.json: no added_tokens_decoder"))?;
    let mut moved = serde_json::Map::new();
    for (k, v) in added {
        let id: usize = k
            .parse()
            .map_err(|_| anyhow!("fixture tokenizer_config.json: special id {k:?}"))?;
        moved.insert((id + shift).to_string(), v.clone());
    }
    cfg["added_tokens_decoder"] = serde_json::Value::Object(moved);
    Ok((model, serde_json::to_string_pretty(&cfg)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_chat_tokenizer_has_kimis_special_ids() {
        let dir = tempfile::tempdir().unwrap();
        let (m, c) = files().unwrap();
        std::fs::write(dir.path().join("tiktoken.model"), m).unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), c).unwrap();
        let tok = k3_tokenizer::Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.n_ranks() as usize, RELEASED_RANKS);
        assert_eq!(tok.n_vocab(), 163_840);
        assert_eq!(tok.special_id("[BOS]"), Some(163_584));
        assert_eq!(tok.special_id("[EOS]"), Some(163_585));
        assert_eq!(tok.special_id("<|end_of_msg|>"), Some(163_586));
        // Made-up ranks decode to bytes, and text round-trips.
        assert!(tok.token_bytes(100_000).unwrap().len() >= 4);
        let ids = tok.encode("Hello, world!", false);
        assert_eq!(tok.decode_bytes(&ids).unwrap(), b"Hello, world!");
        // Deterministic.
        assert_eq!(files().unwrap().0.len(), files().unwrap().0.len());
    }
}
