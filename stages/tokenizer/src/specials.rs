//! The 256 special-token slots (spec §5.4) and `tokenizer_config.json`.
//!
//! Slot k (0..256) has id `n_ranks + k`: with the released 163,584-rank file that is
//! 163584..163839; with a smaller rank file (our test vocabularies) the specials start right
//! after its last rank, exactly as `tokenization_kimi.py` numbers them
//! (`num_base_tokens + i`). `added_tokens_decoder` keys are absolute ids and must fall in
//! that window; every other slot is named `<|reserved_token_<id>|>` (absolute id).

use crate::error::{Result, TokError};
use std::collections::HashMap;
use std::path::Path;

/// Number of special slots after the ranks.
pub const NUM_SPECIAL: u32 = 256;

/// Names of K3's named slots, by offset from the first special id (spec §5.4 table).
pub const K3_NAMED: [(u32, &str); 16] = [
    (0, "[BOS]"),
    (1, "[EOS]"),
    (2, "<|end_of_msg|>"),
    (3, "<|open|>"),
    (4, "<|close|>"),
    (5, "<|sep|>"),
    (6, "[start_header_id]"),
    (7, "[end_header_id]"),
    (9, "[EOT]"),
    (18, "<|media_begin|>"),
    (19, "<|media_content|>"),
    (20, "<|media_end|>"),
    (21, "<|media_pad|>"),
    (65, "<osagent_mode>"),
    (254, "[UNK]"),
    (255, "[PAD]"),
];

/// The special tokens of one tokenizer: names by slot, and a matcher for allowed text.
pub struct Specials {
    base: u32,
    names: Vec<String>,
    by_name: HashMap<String, u32>,
    matcher: aho_corasick::AhoCorasick,
}

impl Specials {
    /// Slots named from `(absolute id, name)` pairs; unnamed ones get reserved names.
    pub fn new(base: u32, named: &[(u32, String)], what: &Path) -> Result<Specials> {
        let cfg_err = |msg: String| TokError::Config {
            path: what.to_path_buf(),
            msg,
        };
        let mut names: Vec<Option<String>> = vec![None; NUM_SPECIAL as usize];
        for (id, name) in named {
            if *id < base || *id >= base + NUM_SPECIAL {
                return Err(cfg_err(format!(
                    "added_tokens_decoder: id {id} ({name:?}) is outside the special slots {base}..{} \
                     (specials follow the {base} ranks of the rank file)",
                    base + NUM_SPECIAL
                )));
            }
            if name.is_empty() {
                return Err(cfg_err(format!(
                    "added_tokens_decoder: id {id} has an empty content"
                )));
            }
            names[(id - base) as usize] = Some(name.clone());
        }
        let names: Vec<String> = names
            .into_iter()
            .enumerate()
            .map(|(k, n)| n.unwrap_or_else(|| format!("<|reserved_token_{}|>", base + k as u32)))
            .collect();
        let mut by_name = HashMap::new();
        for (k, n) in names.iter().enumerate() {
            if let Some(prev) = by_name.insert(n.clone(), base + k as u32) {
                return Err(cfg_err(format!(
                    "special name {n:?} is used by ids {prev} and {}",
                    base + k as u32
                )));
            }
        }
        let matcher = aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(&names)
            .map_err(|e| cfg_err(format!("cannot build the special-token matcher: {e}")))?;
        Ok(Specials {
            base,
            names,
            by_name,
            matcher,
        })
    }

    /// K3's names (no config file), for tests and tools.
    pub fn k3_default(base: u32) -> Specials {
        let named: Vec<(u32, String)> = K3_NAMED
            .iter()
            .map(|&(k, n)| (base + k, n.to_string()))
            .collect();
        Specials::new(base, &named, Path::new("<built-in K3 names>"))
            .expect("built-in names are valid")
    }

    /// Parse `tokenizer_config.json` text: `added_tokens_decoder` maps id strings to objects
    /// with a `content` string.
    pub fn parse_config(text: &[u8], base: u32, path: &Path) -> Result<Specials> {
        let cfg_err = |msg: String| TokError::Config {
            path: path.to_path_buf(),
            msg,
        };
        let v: serde_json::Value =
            serde_json::from_slice(text).map_err(|e| cfg_err(format!("not valid JSON: {e}")))?;
        let dec = v
            .get("added_tokens_decoder")
            .ok_or_else(|| cfg_err("no \"added_tokens_decoder\" object".into()))?
            .as_object()
            .ok_or_else(|| cfg_err("\"added_tokens_decoder\" is not an object".into()))?;
        let mut named = Vec::new();
        for (k, entry) in dec {
            let id: u32 = k.parse().map_err(|_| {
                cfg_err(format!("added_tokens_decoder: key {k:?} is not a token id"))
            })?;
            let content = entry
                .get("content")
                .and_then(|c| c.as_str())
                .ok_or_else(|| {
                    cfg_err(format!(
                        "added_tokens_decoder[{k:?}]: no \"content\" string"
                    ))
                })?;
            named.push((id, content.to_string()));
        }
        Specials::new(base, &named, path)
    }

    /// Read and parse `tokenizer_config.json`.
    pub fn load(path: &Path, base: u32) -> Result<Specials> {
        let text = k3_io::input::read_capped(path, k3_io::input::JSON_CAP).map_err(|source| {
            TokError::Io {
                path: path.to_path_buf(),
                source,
            }
        })?;
        Specials::parse_config(&text, base, path)
    }

    /// First special id (= number of ranks).
    pub fn base(&self) -> u32 {
        self.base
    }

    /// Name of special id `id`, if it is one.
    pub fn name(&self, id: u32) -> Option<&str> {
        id.checked_sub(self.base)
            .and_then(|k| self.names.get(k as usize))
            .map(|s| s.as_str())
    }

    /// Id of a special name.
    pub fn id(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    /// Leftmost (longest on equal starts) special names in `text`: `(start, end, id)`.
    pub fn find_iter<'a>(
        &'a self,
        text: &'a str,
    ) -> impl Iterator<Item = (usize, usize, u32)> + 'a {
        self.matcher
            .find_iter(text)
            .map(move |m| (m.start(), m.end(), self.base + m.pattern().as_u32()))
    }
}
