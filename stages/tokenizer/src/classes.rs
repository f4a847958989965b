//! Per-code-point character classes used by the hand-written Kimi pre-tokenizer.
//!
//! The sets are not hand-copied tables: each is obtained by parsing the very character-class
//! text of spec §5.2 with `regex-syntax` (the parser `fancy-regex` delegates classes to, so
//! the `&&` intersections mean exactly what they mean to tiktoken) and flattened into a
//! two-level lookup table (256 code points per block, identical blocks shared).

use regex_syntax::hir::{Class, HirKind};
use std::collections::HashMap;
use std::sync::OnceLock;

/// `[\p{Han}]`
pub const HAN: u8 = 1;
/// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]` ("upper-ish")
pub const UP: u8 = 2;
/// `[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]` ("lower-ish")
pub const LO: u8 = 4;
/// `[^\r\n\p{L}\p{N}]` (the optional one-char prefix of the letter alternatives)
pub const PRE: u8 = 8;
/// `\p{N}`
pub const NUM: u8 = 16;
/// `\s` (Unicode White_Space)
pub const WS: u8 = 32;
/// `[^\s\p{L}\p{N}]` (punctuation/symbol run)
pub const PUNCT: u8 = 64;
/// `[\r\n]`
pub const CRLF: u8 = 128;

/// The class texts, exactly as they appear in the pattern.
pub const CLASS_TEXT: [(u8, &str); 8] = [
    (HAN, r"[\p{Han}]"),
    (UP, r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"),
    (LO, r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"),
    (PRE, r"[^\r\n\p{L}\p{N}]"),
    (NUM, r"\p{N}"),
    (WS, r"\s"),
    (PUNCT, r"[^\s\p{L}\p{N}]"),
    (CRLF, r"[\r\n]"),
];

/// Two-level table: `blocks[index[cp >> 8] * 256 + (cp & 255)]` is the flag byte of `cp`.
pub struct Classes {
    index: Vec<u16>,
    #[doc(hidden)]
    pub blocks: Vec<u8>,
}

fn ranges_of(pattern: &str) -> Vec<(u32, u32)> {
    // The patterns are compile-time constants; a parse failure is a programming error that
    // the unit tests catch, so it is reported as an empty class only in release builds.
    let hir = regex_syntax::Parser::new()
        .parse(pattern)
        .expect("constant class pattern parses");
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => c
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        other => panic!("class pattern {pattern} parsed to {other:?}"),
    }
}

impl Classes {
    fn build() -> Classes {
        let mut flat = vec![0u8; 0x11_0000];
        for (bit, text) in CLASS_TEXT {
            for (lo, hi) in ranges_of(text) {
                for f in &mut flat[lo as usize..=hi as usize] {
                    *f |= bit;
                }
            }
        }
        let mut index = Vec::with_capacity(0x1100);
        let mut blocks: Vec<u8> = Vec::new();
        let mut seen: HashMap<&[u8], u16> = HashMap::new();
        for chunk in flat.chunks(256) {
            let id = match seen.get(chunk) {
                Some(&id) => id,
                None => {
                    let id = (blocks.len() / 256) as u16;
                    blocks.extend_from_slice(chunk);
                    seen.insert(chunk, id);
                    id
                }
            };
            index.push(id);
        }
        Classes { index, blocks }
    }

    /// The shared table (built once, a few milliseconds).
    pub fn get() -> &'static Classes {
        static CLASSES: OnceLock<Classes> = OnceLock::new();
        CLASSES.get_or_init(Classes::build)
    }

    /// Flag byte of a code point.
    #[inline(always)]
    pub fn of(&self, cp: u32) -> u8 {
        let blk = self.index[(cp >> 8) as usize] as usize;
        self.blocks[blk * 256 + (cp & 255) as usize]
    }
}
