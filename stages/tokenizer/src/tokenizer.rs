//! The tokenizer: encoding (specials, long-input guards, pre-tokenizer, rank BPE) and
//! decoding (spec §5.2-§5.4).

use crate::bpe;
use crate::error::{Result, TokError};
use crate::pretok;
use crate::specials::{Specials, NUM_SPECIAL};
use crate::vocab::Vocab;
use std::path::Path;

/// Encode in slices of at most this many characters (Kimi's guard).
pub const MAX_ENCODE_CHARS: usize = 400_000;
/// Cut runs of more than this many consecutive whitespace / non-whitespace characters.
pub const MAX_RUN_CHARS: usize = 25_000;

/// `<|end_of_msg|>` in the released vocabulary (the chat turn terminator; config EOS).
pub const K3_END_OF_MSG: u32 = 163_586;
/// `[EOS]` in the released vocabulary (tokenizer_config's eos_token).
pub const K3_EOS: u32 = 163_585;
/// Stop ids of the released vocabulary: stop on both (spec §5.4).
pub const K3_STOP_IDS: [u32; 2] = [K3_END_OF_MSG, K3_EOS];

/// One piece of text to encode on its own, with or without special-token recognition.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Segment {
    pub text: String,
    pub allow_special: bool,
}

/// Python's `str.isspace()` (what Kimi's run guard uses; not the regex's `\s`).
#[doc(hidden)]
pub fn py_isspace(c: char) -> bool {
    matches!(
        c,
        '\t' | '\n'
            | '\u{0b}'
            | '\u{0c}'
            | '\r'
            | '\u{1c}'..='\u{1f}'
            | ' '
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

/// Kimi's guard: split `s` before any character that would make a run of same-kind
/// (whitespace or not) characters longer than `max` characters. Calls `f` per part.
#[doc(hidden)]
pub fn split_runs(s: &str, max: usize, mut f: impl FnMut(&str)) {
    let mut chars = s.char_indices();
    let Some((_, c0)) = chars.clone().next() else {
        f(s);
        return;
    };
    let mut cur_space = py_isspace(c0);
    let mut cur_len = 0usize;
    let mut start = 0usize;
    for (i, c) in &mut chars {
        let now = py_isspace(c);
        if cur_space != now {
            cur_len = 1;
            cur_space = now;
        } else {
            cur_len += 1;
            if cur_len > max {
                f(&s[start..i]);
                start = i;
                cur_len = 1;
            }
        }
    }
    f(&s[start..]);
}

/// Kimi K3's tokenizer: ranks plus 256 special slots.
pub struct Tokenizer {
    vocab: Vocab,
    specials: Specials,
}

impl Tokenizer {
    /// Load `DIR/tiktoken.model` and `DIR/tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        Tokenizer::from_files(
            &dir.join("tiktoken.model"),
            &dir.join("tokenizer_config.json"),
        )
    }

    /// Load a rank file and a tokenizer config.
    pub fn from_files(model: &Path, config: &Path) -> Result<Tokenizer> {
        let vocab = Vocab::load(model)?;
        let specials = Specials::load(config, vocab.len() as u32)?;
        Ok(Tokenizer { vocab, specials })
    }

    /// From parts already built (tests, tools).
    pub fn from_parts(vocab: Vocab, specials: Specials) -> Result<Tokenizer> {
        if specials.base() as usize != vocab.len() {
            return Err(TokError::Chat(format!(
                "specials start at {} but the vocabulary has {} ranks",
                specials.base(),
                vocab.len()
            )));
        }
        Ok(Tokenizer { vocab, specials })
    }

    /// Number of ranks (ordinary tokens).
    pub fn n_ranks(&self) -> u32 {
        self.vocab.len() as u32
    }

    /// Ranks plus the 256 special slots.
    pub fn n_vocab(&self) -> u32 {
        self.n_ranks() + NUM_SPECIAL
    }

    /// The rank table.
    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }

    /// The special slots.
    pub fn specials(&self) -> &Specials {
        &self.specials
    }

    /// Id of a special token name.
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.specials.id(name)
    }

    /// Whether `id` is one of the 256 special slots.
    pub fn is_special(&self, id: u32) -> bool {
        id >= self.n_ranks() && id < self.n_vocab()
    }

    /// Ids that end generation: `<|end_of_msg|>` then `[EOS]` (163586, 163585 in the
    /// released vocabulary), whichever the config names.
    pub fn stop_ids(&self) -> Vec<u32> {
        ["<|end_of_msg|>", "[EOS]"]
            .iter()
            .filter_map(|n| self.specials.id(n))
            .collect()
    }

    /// Encode text. With `allow_special`, occurrences of the 256 special names become their
    /// ids; without, they are ordinary text. Never fails: every byte has a rank.
    pub fn encode(&self, text: &str, allow_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_into(text, allow_special, &mut out);
        out
    }

    /// `encode(text, false)`.
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        self.encode(text, false)
    }

    /// [`Tokenizer::encode`], appending to `out`.
    pub fn encode_into(&self, text: &str, allow_special: bool, out: &mut Vec<u32>) {
        if text.len() <= MAX_RUN_CHARS {
            // At most 25,000 bytes: fewer characters than either guard's limit.
            return self.encode_slice(text, allow_special, out);
        }
        let mut rest = text;
        while !rest.is_empty() {
            let cut = rest
                .char_indices()
                .nth(MAX_ENCODE_CHARS)
                .map_or(rest.len(), |(i, _)| i);
            let (slice, tail) = rest.split_at(cut);
            split_runs(slice, MAX_RUN_CHARS, |part| {
                self.encode_slice(part, allow_special, out)
            });
            rest = tail;
        }
    }

    /// One guarded slice: specials (if allowed), then ordinary text.
    fn encode_slice(&self, text: &str, allow_special: bool, out: &mut Vec<u32>) {
        if !allow_special {
            return self.encode_plain(text, out);
        }
        let mut pos = 0;
        for (s, e, id) in self.specials.find_iter(text) {
            self.encode_plain(&text[pos..s], out);
            out.push(id);
            pos = e;
        }
        self.encode_plain(&text[pos..], out);
    }

    /// Pre-tokenize and BPE-encode text with no special handling.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        let b = text.as_bytes();
        let mut scratch = Vec::new();
        pretok::for_each_piece(text, |s, e| {
            bpe::encode_piece_with(&self.vocab, &b[s..e], out, &mut scratch)
        });
    }

    /// Encode arbitrary bytes, e.g. a file read verbatim: each maximal valid UTF-8 run is
    /// encoded as text (guards, specials if allowed, pre-tokenizer), and each invalid
    /// sequence (a maximal subpart, as `str::utf8_chunks` and Python's decoder both cut
    /// them) is one BPE piece of its raw bytes. Valid UTF-8 gives exactly `encode`'s ids;
    /// `decode_bytes` returns the input unchanged.
    pub fn encode_bytes(&self, bytes: &[u8], allow_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(bytes.len() / 3 + 4);
        for chunk in bytes.utf8_chunks() {
            if !chunk.valid().is_empty() {
                self.encode_into(chunk.valid(), allow_special, &mut out);
            }
            if !chunk.invalid().is_empty() {
                bpe::encode_piece(&self.vocab, chunk.invalid(), &mut out);
            }
        }
        out
    }

    /// Encode segments independently (BPE never merges across a boundary) and concatenate.
    pub fn encode_segments(&self, segments: &[Segment]) -> Vec<u32> {
        let mut out = Vec::new();
        for s in segments {
            self.encode_into(&s.text, s.allow_special, &mut out);
        }
        out
    }

    /// Bytes of one id: a rank's bytes or a special's name.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        if let Some(b) = self.vocab.bytes(id) {
            return Ok(b);
        }
        self.specials
            .name(id)
            .map(|n| n.as_bytes())
            .ok_or(TokError::UnknownId {
                id,
                vocab: self.n_vocab(),
            })
    }

    /// Concatenated bytes of `ids` (special ids as their names).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(out)
    }

    /// `decode_bytes` as UTF-8, invalid sequences replaced by U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }
}
