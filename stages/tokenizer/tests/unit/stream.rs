//! Streaming decode (`src/stream.rs`): partial UTF-8 characters are held back.

use k3_tokenizer::stream::*;

#[test]
fn holds_partial_characters() {
    let mut d = StreamDecoder::new();
    let zhong = "中".as_bytes();
    assert_eq!(d.push_bytes(&zhong[..1]), "");
    assert_eq!(d.push_bytes(&zhong[1..2]), "");
    assert_eq!(d.push_bytes(&zhong[2..]), "中");
    // 0xFF can never start a character: replaced at once, not held.
    assert_eq!(d.push_bytes(b"a\xffb"), "a\u{FFFD}b");
    // E4 followed by 'x' can never complete: one U+FFFD, then 'x'.
    assert_eq!(d.push_bytes(b"\xe4"), "");
    assert_eq!(d.push_bytes(b"x"), "\u{FFFD}x");
    assert_eq!(d.push_bytes(b"\xf0\x9f"), "");
    assert_eq!(d.finish(), "\u{FFFD}");
    assert!(d.pending().is_empty());
}
