//! The Kimi pre-tokenizer (spec §5.2): splits text into pieces that BPE encodes separately.
//!
//! Two implementations of the same pattern live here:
//! * [`split`]: a hand-written matcher. Each alternative is simulated exactly as a
//!   backtracking regex engine explores it (greedy quantifiers try the longest first and give
//!   back one character at a time; alternatives are tried in order; the first success wins),
//!   over character classes taken from the pattern text itself ([`crate::classes`]).
//! * [`RegexPreTokenizer`]: the pattern compiled by `fancy-regex`, the engine tiktoken uses.
//!   It is the reference the matcher is tested against (differential property tests over
//!   strings built from every class boundary, plus the tiktoken fixtures).
//!
//! Like tiktoken's `find_iter`, characters no alternative matches would be dropped; with this
//! pattern that never happens (every character is Han, a letter, a digit, whitespace, or in
//! `[^\s\p{L}\p{N}]`, and each has an alternative that matches it alone).

use crate::classes::{Classes, CRLF, HAN, LO, NUM, PRE, PUNCT, UP, WS};

/// The pre-tokenizer pattern of spec §5.2 (tiktoken / fancy-regex syntax).
pub const PAT_STR: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// A cursor over valid UTF-8 that knows each character's class flags.
struct Text<'a> {
    b: &'a [u8],
    cls: &'static Classes,
}

impl Text<'_> {
    /// Flags and byte length of the character starting at `i` (`i < len`).
    #[inline(always)]
    fn at(&self, i: usize) -> (u8, usize) {
        let b0 = self.b[i];
        if b0 < 0x80 {
            return (self.cls.of(b0 as u32), 1);
        }
        let (cp, n) = if b0 < 0xE0 {
            (((b0 as u32 & 0x1F) << 6) | (self.b[i + 1] as u32 & 0x3F), 2)
        } else if b0 < 0xF0 {
            (
                ((b0 as u32 & 0x0F) << 12)
                    | ((self.b[i + 1] as u32 & 0x3F) << 6)
                    | (self.b[i + 2] as u32 & 0x3F),
                3,
            )
        } else {
            (
                ((b0 as u32 & 0x07) << 18)
                    | ((self.b[i + 1] as u32 & 0x3F) << 12)
                    | ((self.b[i + 2] as u32 & 0x3F) << 6)
                    | (self.b[i + 3] as u32 & 0x3F),
                4,
            )
        };
        (self.cls.of(cp), n)
    }

    /// Flags at `i`, or 0 at the end of the text.
    #[inline(always)]
    fn flags(&self, i: usize) -> u8 {
        if i < self.b.len() {
            self.at(i).0
        } else {
            0
        }
    }

    /// Start of the character before byte `i` (`i > 0`).
    #[inline(always)]
    fn prev(&self, mut i: usize) -> usize {
        i -= 1;
        while self.b[i] & 0xC0 == 0x80 {
            i -= 1;
        }
        i
    }

    /// End of the longest run of characters in `mask` starting at `i`.
    #[inline(always)]
    fn run(&self, mut i: usize, mask: u8) -> usize {
        while i < self.b.len() {
            let (f, n) = self.at(i);
            if f & mask == 0 {
                break;
            }
            i += n;
        }
        i
    }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)?` at `i`: the length it matches (0 when absent).
    /// Case folding as regex-syntax does it: `s` also matches U+017F (long s), others only
    /// their ASCII upper/lower forms (checked against the regex in tests).
    #[inline(always)]
    fn contraction(&self, i: usize) -> usize {
        let b = self.b;
        if i >= b.len() || b[i] != b'\'' {
            return 0;
        }
        let c1 = b.get(i + 1).map(|c| c.to_ascii_lowercase());
        let c2 = b.get(i + 2).map(|c| c.to_ascii_lowercase());
        match c1 {
            Some(b's') | Some(b't') | Some(b'm') | Some(b'd') => 2,
            Some(b'r') | Some(b'v') if c2 == Some(b'e') => 3,
            Some(b'l') if c2 == Some(b'l') => 3,
            // U+017F LATIN SMALL LETTER LONG S = C5 BF
            Some(0xC5) if b.get(i + 2) == Some(&0xBF) => 3,
            _ => 0,
        }
    }

    /// Alternatives 2 and 3: `P? X Y C?` with (X, Y, X needs one) = (UP*, LO+) or (UP+, LO*).
    fn letters(&self, i: usize, upper_plus: bool) -> Option<usize> {
        let (f0, n0) = self.at(i);
        // `P?` is greedy: first with the prefix character consumed, then without.
        let starts: [Option<usize>; 2] = [if f0 & PRE != 0 { Some(i + n0) } else { None }, Some(i)];
        for j in starts.into_iter().flatten() {
            let k = self.run(j, UP);
            if upper_plus {
                // UP+ then LO* (LO* always succeeds, greedy): the first success is the
                // longest UP run followed by the longest LO run.
                if k > j {
                    let e = self.run(k, LO);
                    return Some(e + self.contraction(e));
                }
            } else {
                // UP* gives back one character at a time until LO+ can match.
                let mut m = k;
                loop {
                    if self.flags(m) & LO != 0 {
                        let e = self.run(m, LO);
                        return Some(e + self.contraction(e));
                    }
                    if m == j {
                        break;
                    }
                    m = self.prev(m);
                }
            }
        }
        None
    }

    /// Length of the match at `i`, trying the eight alternatives in order.
    fn match_at(&self, i: usize) -> Option<usize> {
        let len = self.b.len();
        let (f0, n0) = self.at(i);
        // 1: [\p{Han}]+
        if f0 & HAN != 0 {
            return Some(self.run(i, HAN));
        }
        // 2, 3: letters (the prefix class PRE overlaps WS/PUNCT/marks, so always try).
        if f0 & (PRE | UP | LO) != 0 {
            if let Some(e) = self.letters(i, false) {
                return Some(e);
            }
            if let Some(e) = self.letters(i, true) {
                return Some(e);
            }
        }
        // 4: \p{N}{1,3}
        if f0 & NUM != 0 {
            let mut e = i;
            for _ in 0..3 {
                if e < len {
                    let (f, n) = self.at(e);
                    if f & NUM != 0 {
                        e += n;
                        continue;
                    }
                }
                break;
            }
            return Some(e);
        }
        // 5: ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let p = if self.b[i] == b' ' { i + 1 } else { i };
        if self.flags(p) & PUNCT != 0 {
            let e = self.run(p, PUNCT);
            return Some(self.run(e, CRLF));
        }
        if f0 & WS == 0 {
            return None;
        }
        // 6: \s*[\r\n]+ : the longest whitespace run is given back until a [\r\n] ends it;
        // the match ends right after the last \r or \n of the run.
        let k = self.run(i, WS);
        let mut m = k;
        while m > i {
            m = self.prev(m);
            if self.b[m] == b'\r' || self.b[m] == b'\n' {
                return Some(m + 1);
            }
        }
        // 7: \s+(?!\S) : the run to the end of text, or all but its last character.
        if k == len {
            return Some(k);
        }
        let last = self.prev(k);
        if last > i {
            return Some(last);
        }
        // 8: \s+
        let _ = n0;
        Some(k)
    }
}

/// Split `text` into pre-tokens, appending their byte ranges `(start, end)` to `out`.
pub fn split(text: &str, out: &mut Vec<(usize, usize)>) {
    for_each_piece(text, |a, b| out.push((a, b)));
}

/// Call `f(start, end)` for each pre-token of `text`, in order.
#[inline]
pub fn for_each_piece(text: &str, mut f: impl FnMut(usize, usize)) {
    let t = Text {
        b: text.as_bytes(),
        cls: Classes::get(),
    };
    let mut i = 0;
    while i < t.b.len() {
        match t.match_at(i) {
            Some(e) if e > i => {
                f(i, e);
                i = e;
            }
            // No alternative matches here (cannot happen with this pattern, see the module
            // doc): like a regex search, skip the character.
            _ => i += t.at(i).1,
        }
    }
}

/// The pattern compiled by `fancy-regex` (the engine tiktoken uses): the reference.
pub struct RegexPreTokenizer {
    re: fancy_regex::Regex,
}

impl RegexPreTokenizer {
    /// Compile [`PAT_STR`].
    pub fn new() -> Result<Self, Box<fancy_regex::Error>> {
        Ok(RegexPreTokenizer {
            re: fancy_regex::Regex::new(PAT_STR).map_err(Box::new)?,
        })
    }

    /// Same contract as [`split`]; fails only if the regex engine gives up (backtrack limit).
    pub fn split(
        &self,
        text: &str,
        out: &mut Vec<(usize, usize)>,
    ) -> Result<(), Box<fancy_regex::Error>> {
        for m in self.re.find_iter(text) {
            let m = m.map_err(Box::new)?;
            out.push((m.start(), m.end()));
        }
        Ok(())
    }
}
