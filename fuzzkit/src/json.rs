//! JSON text as the fuzzers edit it: strings, values and object members found by scanning
//! the bytes (no parse, so it works on text that is no longer valid JSON), and the
//! JSON-aware edits built on them: a number becomes an interesting one, a string an
//! interesting, long or escaped one, a member is duplicated (a duplicate key) or deleted, a
//! value is wrapped in nesting (sometimes deeper than serde_json's limit), or a member is
//! replaced by one from another corpus entry.

use crate::rng::Rng;

/// End (exclusive) of the JSON string starting at `b[i] == '"'`.
pub fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
    None
}

/// End (exclusive) of the JSON value starting at `b[i]` (no validation).
pub fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let mut j = i;
            while j < b.len() && !b",}] \n\t\r:".contains(&b[j]) {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// The first position from `i` on that is not JSON whitespace.
pub fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b" \n\t\r".contains(&b[i]) {
        i += 1;
    }
    i
}

/// The first position of `b` where `pred` holds, searched from a random start (wrapping).
pub fn find_from(b: &[u8], rng: &mut Rng, pred: impl Fn(&[u8], usize) -> bool) -> Option<usize> {
    if b.is_empty() {
        return None;
    }
    let start = rng.below(b.len());
    (start..b.len()).chain(0..start).find(|&i| pred(b, i))
}

/// The span of an object member `"key": value` starting at a random member.
pub fn random_member(b: &[u8], rng: &mut Rng) -> Option<(usize, usize)> {
    let at = find_from(b, rng, |b, i| {
        (b[i] == b'{' || b[i] == b',') && b.get(skip_ws(b, i + 1)) == Some(&b'"')
    })?;
    let s = skip_ws(b, at + 1);
    let k_end = string_end(b, s)?;
    let colon = skip_ws(b, k_end);
    if b.get(colon) != Some(&b':') {
        return None;
    }
    let v = skip_ws(b, colon + 1);
    Some((s, value_end(b, v)?))
}

/// What a harness's JSON text edits put in.
pub struct JsonEdits<'a> {
    /// Numbers (as text) a number becomes: huge, negative, float, malformed.
    pub ints: &'a [&'a str],
    /// Strings a string's contents become, or are extended with.
    pub strs: &'a [&'a str],
    /// Numbers are also looked for right after a quote (object keys that are numbers, as
    /// in `{"163584": ...}`), and a number is its first character and the digits, signs,
    /// dots and exponents after it. Otherwise a number never follows a quote and ends
    /// where its JSON value ends.
    pub numeric_keys: bool,
}

/// A JSON-aware edit of text `b` (`corpus_text`: another entry's text, for splices);
/// false when none applied.
pub fn mutate_json_text(
    b: &mut Vec<u8>,
    rng: &mut Rng,
    corpus_text: &[u8],
    edits: &JsonEdits<'_>,
) -> bool {
    match rng.below(9) {
        // A number (or, with numeric keys, a key's digits) → an interesting number.
        0 | 1 => {
            let Some(i) = find_from(b, rng, |b, i| {
                (b[i].is_ascii_digit() || b[i] == b'-')
                    && (i == 0
                        || !b[i - 1].is_ascii_alphanumeric()
                            && (edits.numeric_keys || b[i - 1] != b'"'))
            }) else {
                return false;
            };
            let e = if edits.numeric_keys {
                let mut e = i + 1;
                while e < b.len() && (b[e].is_ascii_digit() || b".eE+-".contains(&b[e])) {
                    e += 1;
                }
                e
            } else {
                let Some(e) = value_end(b, i) else {
                    return false;
                };
                e
            };
            b.splice(i..e, rng.pick(edits.ints).bytes());
        }
        // A string's contents → an interesting, long or escaped string.
        2 | 3 => {
            let Some(i) = find_from(b, rng, |b, i| b[i] == b'"') else {
                return false;
            };
            let Some(e) = string_end(b, i) else {
                return false;
            };
            let new: Vec<u8> = match rng.below(4) {
                0 => "y".repeat(rng.below(5000)).into_bytes(),
                1 => {
                    // Keep the string, append an escape.
                    let mut s = b[i + 1..e - 1].to_vec();
                    s.extend_from_slice(rng.pick(edits.strs).as_bytes());
                    s
                }
                _ => rng.pick(edits.strs).as_bytes().to_vec(),
            };
            let mut q = vec![b'"'];
            q.extend_from_slice(&new);
            q.push(b'"');
            b.splice(i..e, q);
        }
        // Duplicate an object member (a duplicate key).
        4 | 5 => {
            let Some((s, e)) = random_member(b, rng) else {
                return false;
            };
            let mut m = b[s..e].to_vec();
            m.push(b',');
            b.splice(s..s, m);
        }
        // Delete an object member.
        6 => {
            let Some((s, e)) = random_member(b, rng) else {
                return false;
            };
            let e = if b.get(skip_ws(b, e)) == Some(&b',') {
                skip_ws(b, e) + 1
            } else {
                e
            };
            b.drain(s..e);
        }
        // Wrap a value in deep nesting.
        7 => {
            let Some(i) = find_from(b, rng, |b, i| b[i] == b':') else {
                return false;
            };
            let v = skip_ws(b, i + 1);
            let Some(e) = value_end(b, v) else {
                return false;
            };
            let deep = rng.one_in(4);
            let d = 1 + rng.below(if deep { 200 } else { 8 });
            let (open, close) = if rng.one_in(2) {
                ("[", "]")
            } else {
                ("{\"k\":", "}")
            };
            b.splice(e..e, close.repeat(d).into_bytes());
            b.splice(v..v, open.repeat(d).into_bytes());
        }
        // Replace a value by a member from another corpus entry's text.
        _ => {
            let Some((s, e)) = random_member(b, rng) else {
                return false;
            };
            let Some((s2, e2)) = random_member(corpus_text, rng) else {
                return false;
            };
            b.splice(s..e, corpus_text[s2..e2].iter().copied());
        }
    }
    true
}
