//! Streaming decoder: turns an id stream into text that only ever contains complete UTF-8.
//!
//! Bytes of a character split across tokens are held until the character completes.
//! U+FFFD is emitted only for bytes that can never become valid (a maximal invalid
//! subpart, as `String::from_utf8_lossy` cuts them), or for an incomplete tail at
//! [`StreamDecoder::finish`]. So the concatenation of everything emitted equals
//! `String::from_utf8_lossy` of all the bytes, however the stream was cut.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Incremental UTF-8 assembly over token bytes.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// An empty decoder.
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Append the bytes of `id`; return the text that became complete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        let b = tok.token_bytes(id)?;
        Ok(self.push_bytes(b))
    }

    /// Append raw bytes; return the text that became complete.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    out.push_str(&String::from_utf8_lossy(good));
                    match e.error_len() {
                        // Can never complete: one replacement character, go on.
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &bad[n..];
                        }
                        // A valid prefix of a character: hold it.
                        None => {
                            rest = bad;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Bytes held back (an incomplete character, at most 3 bytes).
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// End of stream: a held incomplete character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
