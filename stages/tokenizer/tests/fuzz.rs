//! Property tests (proptest) over the fixture vocabulary: no panics, exact round trips, the
//! hand-written pre-tokenizer equals fancy-regex, the heap BPE equals the scan BPE, the
//! streaming decoder equals a one-shot lossy decode, and malformed files never panic.
//!
//! Case counts follow PROPTEST_CASES (default below); each test prints its executions.

use k3_tokenizer::{bpe, pretok, specials::Specials, vocab::Vocab, StreamDecoder, Tokenizer};
use proptest::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer");
        Tokenizer::from_dir(&d).expect("fixture tokenizer")
    })
}

fn regex() -> &'static pretok::RegexPreTokenizer {
    static R: OnceLock<pretok::RegexPreTokenizer> = OnceLock::new();
    R.get_or_init(|| pretok::RegexPreTokenizer::new().expect("pattern compiles"))
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Characters at every class boundary of the pattern: Han (incl. non-letter Han), each
/// letter category, marks, digits of several scripts, Unicode and Python-only whitespace,
/// the apostrophe and contraction letters (incl. long s), punctuation, emoji, ZWJ.
fn tricky_char() -> impl Strategy<Value = char> {
    prop::sample::select(vec![
        'a',
        'Z',
        's',
        'S',
        'l',
        'L',
        'd',
        'D',
        'r',
        'e',
        'v',
        'm',
        't',
        'T',
        '\'',
        'ſ',
        'é',
        'ǅ',
        'ʰ',
        'ª',
        '\u{301}',
        '\u{903}',
        '中',
        '文',
        '〇',
        '々',
        '⺀',
        'カ',
        'ｶ',
        '한',
        'Я',
        'я',
        'ع',
        '1',
        '١',
        'Ⅻ',
        '½',
        ' ',
        '\t',
        '\n',
        '\r',
        '\u{b}',
        '\u{c}',
        '\u{1c}',
        '\u{85}',
        '\u{a0}',
        '\u{2003}',
        '\u{2028}',
        '\u{3000}',
        '\u{200d}',
        '\u{200b}',
        '!',
        '.',
        ',',
        '"',
        '<',
        '|',
        '>',
        '[',
        ']',
        '😀',
        '🏽',
        '\u{fe0f}',
        '\u{0}',
        '\u{7f}',
        '\u{10ffff}',
    ])
}

fn tricky_string() -> impl Strategy<Value = String> {
    prop::collection::vec(tricky_char(), 0..48).prop_map(|v| v.into_iter().collect())
}

fn with_specials() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            3 => tricky_string(),
            1 => prop::sample::select(vec!["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|sep|>", "[PAD]", "<|open|", "[BOS"])
                .prop_map(String::from),
        ],
        0..6,
    )
    .prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(1500), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn pretokenizer_equals_fancy_regex(s in prop_oneof![tricky_string(), any::<String>()]) {
        let mut a = Vec::new();
        pretok::split(&s, &mut a);
        let mut b = Vec::new();
        regex().split(&s, &mut b).expect("regex runs");
        prop_assert_eq!(a, b);
    }

    #[test]
    fn encode_decode_round_trip(s in prop_oneof![tricky_string(), any::<String>(), with_specials()], allow in any::<bool>()) {
        let t = tok();
        let ids = t.encode(&s, allow);
        prop_assert!(ids.iter().all(|&i| i < t.n_vocab()));
        prop_assert_eq!(t.decode_bytes(&ids).unwrap(), s.as_bytes());
        prop_assert_eq!(&t.encode_bytes(s.as_bytes(), allow), &ids);
        if !allow {
            prop_assert!(ids.iter().all(|&i| i < t.n_ranks()), "no special id without allow_special");
        }
    }

    #[test]
    fn bytes_round_trip(b in prop::collection::vec(any::<u8>(), 0..200), allow in any::<bool>()) {
        let t = tok();
        let ids = t.encode_bytes(&b, allow);
        prop_assert_eq!(t.decode_bytes(&ids).unwrap(), b);
    }

    #[test]
    fn heap_bpe_equals_scan_bpe(b in prop::collection::vec(prop::sample::select(b" aeinst\xe4\xb8\xad!q".to_vec()), 2..400)) {
        let v = tok().vocab();
        let (mut x, mut y) = (Vec::new(), Vec::new());
        bpe::merge_scan(v, &b, &mut x);
        bpe::merge_heap(v, &b, &mut y);
        prop_assert_eq!(x, y);
    }

    #[test]
    fn stream_decoder_equals_lossy(ids in prop::collection::vec(0u32..3261 + 256, 0..60)) {
        let t = tok();
        let mut d = StreamDecoder::new();
        let mut text = String::new();
        for &id in &ids {
            text.push_str(&d.push(t, id).unwrap());
            prop_assert!(d.pending().len() < 4);
        }
        text.push_str(&d.finish());
        prop_assert_eq!(text, t.decode(&ids).unwrap());
    }

    #[test]
    fn rank_file_garbage_never_panics(lines in prop::collection::vec(
        prop_oneof![
            Just("IQ== 0".to_string()),
            "[A-Za-z0-9+/=]{0,12} [0-9]{1,4}",
            ".{0,20}",
            Just("".to_string()),
        ], 0..20)) {
        let text = lines.join("\n");
        let _ = Vocab::parse(text.as_bytes(), Path::new("fuzz.model"));
    }

    #[test]
    fn config_garbage_never_panics(s in prop_oneof![
        ".{0,60}",
        "\\{\"added_tokens_decoder\": \\{\"[0-9]{1,5}\": \\{\"content\": \"[a-z<>|]{0,6}\"\\}\\}\\}",
    ]) {
        let _ = Specials::parse_config(s.as_bytes(), 3261, Path::new("fuzz.json"));
    }
}

#[test]
fn report_executions() {
    // The 7 properties above each run cases(1500) generated inputs (PROPTEST_CASES overrides).
    println!(
        "proptest: 7 properties x {} cases = {} executions",
        cases(1500),
        7 * cases(1500)
    );
}

/// Found by `examples/fuzz_tokfiles`: a rank line padded with a Unicode space (U+00A0,
/// U+0085, U+3000, ...) or U+000B was trimmed and accepted, though the file is ASCII and a
/// blank line is one of ASCII whitespace. Such a line is refused, and named.
#[test]
fn a_rank_line_with_unicode_or_vt_whitespace_is_refused() {
    let mut base = String::new();
    for b in 0..=255u8 {
        let t = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [b]);
        base.push_str(&format!("{t} {b}\n"));
    }
    assert!(Vocab::parse(base.as_bytes(), Path::new("t.model")).is_ok());
    // ASCII whitespace around the fields is still trimmed.
    let ok = base.replacen("AA== 0\n", "\t AA==  \t 0 \r\n", 1);
    assert!(Vocab::parse(ok.as_bytes(), Path::new("t.model")).is_ok());
    for (bad, what) in [
        ("AA==\u{a0} 0", "not ASCII"),
        ("AA== 0\u{3000}", "not ASCII"),
        ("\u{85}AA== 0", "not ASCII"),
        ("AA== 0\u{b}", "rank \"0\\u{b}\""),
        ("AA==\u{b} 0", "not valid base64"),
    ] {
        let text = base.replacen("AA== 0", bad, 1);
        let e = Vocab::parse(text.as_bytes(), Path::new("t.model"))
            .err()
            .map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.starts_with("t.model:1: ") && e.contains(what)),
            "{bad:?}: {e:?}"
        );
    }
}
