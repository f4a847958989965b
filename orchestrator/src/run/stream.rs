//! Streaming generated text: bytes of each decoded token in, complete UTF-8 out, with stop
//! strings.
//!
//! A token's bytes may end inside a multi-byte character; [`TextStream`] holds such a tail
//! back until the character completes. With stop strings it also holds back any tail that
//! could be the start of one, so text that is later cut never reaches the reader. When a
//! stop string appears the stream ends: the text is cut before it, and the ids end with the
//! token that completed it ([`TextStream::stopped_at`]).

/// Incremental UTF-8 text with stop strings.
#[derive(Debug, Default)]
pub struct TextStream {
    bytes: Vec<u8>,
    /// Bytes already handed out.
    emitted: usize,
    stops: Vec<Vec<u8>>,
    /// Tokens pushed so far.
    tokens: usize,
    /// (tokens when the stop string completed, byte offset where the text is cut).
    stop: Option<(usize, usize)>,
}

impl TextStream {
    pub fn new(stops: &[String]) -> TextStream {
        TextStream {
            stops: stops
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| s.as_bytes().to_vec())
                .collect(),
            ..Default::default()
        }
    }

    /// Whether a stop string has ended the stream.
    pub fn stopped(&self) -> bool {
        self.stop.is_some()
    }

    /// How many tokens the generation keeps: all of them, or up to and including the one
    /// that completed a stop string.
    pub fn stopped_at(&self) -> Option<usize> {
        self.stop.map(|(t, _)| t)
    }

    /// The bytes of one more token; returns the text that is now safe to show (possibly
    /// empty). After a stop, nothing more is taken.
    pub fn push(&mut self, token_bytes: &[u8]) -> String {
        if self.stopped() {
            return String::new();
        }
        self.tokens += 1;
        let from = self.bytes.len();
        self.bytes.extend_from_slice(token_bytes);
        // A stop string can only end inside the new bytes: search from where one could begin.
        let longest = self.stops.iter().map(Vec::len).max().unwrap_or(0);
        let search_from = from.saturating_sub(longest.saturating_sub(1));
        let mut cut: Option<usize> = None;
        for s in &self.stops {
            if let Some(p) = find(&self.bytes[search_from..], s) {
                let at = search_from + p;
                cut = Some(cut.map_or(at, |c: usize| c.min(at)));
            }
        }
        if let Some(at) = cut {
            let at = at.max(self.emitted);
            self.stop = Some((self.tokens, at));
            return self.take_to(at, true);
        }
        // Hold back a tail that could begin a stop string.
        let mut safe = self.bytes.len();
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if self.bytes.len() >= k && self.bytes.ends_with(&s[..k]) {
                    safe = safe.min(self.bytes.len() - k);
                    break;
                }
            }
        }
        self.take_to(safe, false)
    }

    /// Everything not yet shown (invalid UTF-8 replaced), at the end of generation.
    pub fn finish(&mut self) -> String {
        let end = match self.stop {
            Some((_, at)) => at,
            None => self.bytes.len(),
        };
        self.take_to(end, true)
    }

    /// The whole text (cut at the stop string, if any).
    pub fn text(&self) -> String {
        let end = self.stop.map_or(self.bytes.len(), |(_, at)| at);
        String::from_utf8_lossy(&self.bytes[..end]).into_owned()
    }

    /// Hand out bytes up to `end`; unless `all`, only whole characters (an incomplete
    /// sequence at the end waits for the next token; invalid bytes are replaced).
    fn take_to(&mut self, end: usize, all: bool) -> String {
        if end <= self.emitted {
            return String::new();
        }
        let chunk = &self.bytes[self.emitted..end];
        let upto = if all {
            chunk.len()
        } else {
            match std::str::from_utf8(chunk) {
                Ok(_) => chunk.len(),
                Err(e) if e.error_len().is_none() => e.valid_up_to(),
                Err(_) => chunk.len(),
            }
        };
        let out = String::from_utf8_lossy(&chunk[..upto]).into_owned();
        self.emitted += upto;
        out
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_characters_wait_for_their_last_byte() {
        let mut s = TextStream::new(&[]);
        let e = "é".as_bytes();
        assert_eq!(s.push(b"a"), "a");
        assert_eq!(s.push(&e[..1]), "");
        assert_eq!(s.push(&e[1..]), "é");
        assert_eq!(s.finish(), "");
        assert_eq!(s.text(), "aé");
    }

    #[test]
    fn stop_strings_cut_the_text_and_the_ids() {
        let mut s = TextStream::new(&["END".to_string()]);
        let mut shown = String::new();
        for t in ["he", "llo E", "N", "Dxx", "more"] {
            shown += &s.push(t.as_bytes());
        }
        shown += &s.finish();
        assert_eq!(shown, "hello ");
        assert_eq!(s.text(), "hello ");
        // The 4th token completed "END"; the 5th was never taken.
        assert_eq!(s.stopped_at(), Some(4));
        // A held-back partial match that does not complete is shown later.
        let mut s = TextStream::new(&["END".to_string()]);
        assert_eq!(s.push(b"a E"), "a ");
        assert_eq!(s.push(b"x"), "Ex");
        assert_eq!(s.stopped_at(), None);
    }

    #[test]
    fn invalid_bytes_are_replaced_not_lost() {
        let mut s = TextStream::new(&[]);
        assert_eq!(s.push(&[0xff, b'a']), "\u{fffd}a");
        assert_eq!(s.push(&[0xe2, 0x82]), "");
        assert_eq!(s.finish(), "\u{fffd}");
    }
}
