//! The character-class table (`src/classes.rs`): spot checks, shared blocks.

use k3_tokenizer::classes::*;

#[test]
fn spot_checks() {
    let c = Classes::get();
    let f = |ch: char| c.of(ch as u32);
    assert_eq!(f('中') & HAN, HAN);
    assert_eq!(
        f('中') & (UP | LO),
        0,
        "Han excluded from the letter classes"
    );
    assert_eq!(f('A') & (UP | LO), UP);
    assert_eq!(f('a') & (UP | LO), LO);
    assert_eq!(f('ǅ') & (UP | LO), UP, "Lt is upper-ish only");
    assert_eq!(f('ʰ') & (UP | LO), UP | LO, "Lm is in both");
    assert_eq!(
        f('\u{301}'),
        UP | LO | PRE | PUNCT,
        "a mark is in both, and not L"
    );
    assert_eq!(f(' '), PRE | WS);
    assert_eq!(f('\n'), WS | CRLF);
    assert_eq!(f('7'), NUM);
    assert_eq!(f('!'), PRE | PUNCT);
    assert!(c.blocks.len() < 400 * 256, "blocks are shared");
}
