//! The pre-tokenizer (`src/pretok.rs`): the hand matcher against the regex it replaces.

use k3_tokenizer::pretok::*;

fn both(s: &str) -> (Vec<&str>, Vec<&str>) {
    let mut a = Vec::new();
    split(s, &mut a);
    let mut b = Vec::new();
    RegexPreTokenizer::new().unwrap().split(s, &mut b).unwrap();
    (
        a.iter().map(|&(x, y)| &s[x..y]).collect(),
        b.iter().map(|&(x, y)| &s[x..y]).collect(),
    )
}

#[test]
fn fancy_regex_handles_class_intersection() {
    // A wrong engine that ignored `&&[^\p{Han}]` would let Han into alternative 2/3
    // and glue "中文" to the Latin letters that follow.
    let re = fancy_regex::Regex::new(r"^[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]$").unwrap();
    assert!(re.is_match("A").unwrap());
    assert!(re.is_match("カ").unwrap());
    assert!(!re.is_match("中").unwrap());
    assert!(!re.is_match("a").unwrap());
}

#[test]
fn hand_matcher_equals_regex_on_samples() {
    for s in [
        "Hello world",
        "中文English混合",
        "I'M here they'Ve 'LL x'ſ",
        "  \n\n  x \r\n\r\n ",
        "1234567890 ١٢٣ Ⅻ",
        "e\u{301}\u{301}abc ABCdef abcDEF ǅa ʰʰ",
        "a   ",
        "a \u{a0} b\u{3000}中",
        "!!! ...\n\n",
        "\u{301}",
        " \u{301}",
    ] {
        let (a, b) = both(s);
        assert_eq!(a, b, "input {s:?}");
    }
}
