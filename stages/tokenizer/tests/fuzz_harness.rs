//! A CI-sized run of the mutation fuzzer in `examples/fuzz_tokfiles` (20,000 cases per
//! reader, a few seconds), so the harness keeps compiling and keeps reaching the readers'
//! accepting paths; the long runs (≥ 10^7 cases each) are in docs/fuzzing.md.

#[allow(dead_code)]
#[path = "../examples/fuzz_tokfiles/harness.rs"]
mod harness;

use harness::{
    check_specials, check_vocab, oracle_b64, oracle_config, oracle_rank_file, run, RankOracle,
    Target,
};
use k3_tokenizer::specials::Specials;
use k3_tokenizer::vocab::Vocab;
use std::path::Path;

/// Both readers: no panics, no verdict the oracles contradict, and a share of accepted
/// mutants (a harness whose mutants never parse tests only the first line of the readers).
#[test]
fn mutation_fuzz_finds_nothing_and_reaches_acceptance() {
    for t in Target::ALL {
        let rep = run(t, 20_261_201, fuzzkit::ci_execs(), 0, |_| {});
        rep.assert_ci(fuzzkit::ci_execs(), |b| {
            format!("{:?}", String::from_utf8_lossy(b))
        });
    }
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(harness::fixtures().join("tokenizer").join(name)).unwrap()
}

/// The base64 oracle is canonical standard base64, as the reader's engine is.
#[test]
fn base64_oracle_is_canonical() {
    let dec = |s: &str| {
        let mut out = Vec::new();
        oracle_b64(s.as_bytes(), &mut out).then_some(out)
    };
    assert_eq!(dec("IQ=="), Some(b"!".to_vec()));
    assert_eq!(dec("YWI="), Some(b"ab".to_vec()));
    assert_eq!(dec("YWJj"), Some(b"abc".to_vec()));
    assert_eq!(dec("//4="), Some(vec![0xff, 0xfe]));
    for bad in [
        "", "IQ", "IQ=", "IR==", "YWJ=", "I===", "IQ==IQ==", "I Q=", "IQ=A", "-_==",
    ] {
        assert_eq!(dec(bad), None, "{bad:?}");
    }
}

/// The rank-file oracle accepts the fixture, and its checks fail on a wrong vocabulary.
#[test]
fn rank_oracle_accepts_the_fixture_and_flags_a_wrong_vocab() {
    let text = fixture("tiktoken.model");
    let RankOracle::Valid(bytes, entries) = oracle_rank_file(&text) else {
        panic!("the oracle refuses the fixture");
    };
    let v = Vocab::parse(&text, Path::new("f")).unwrap();
    check_vocab(&v, &bytes, &entries).unwrap();
    // The same file with two ranks swapped is another (valid) vocabulary.
    let mut swapped = entries.clone();
    let (a, b) = (swapped[300].rank, swapped[301].rank);
    swapped[300].rank = b;
    swapped[301].rank = a;
    assert!(check_vocab(&v, &bytes, &swapped).is_err());
    assert!(check_vocab(&v, &bytes, &entries[1..]).is_err());
    // A line that is not ASCII is faulty, and named.
    let mut bad = text.clone();
    bad.splice(0..0, "IQ==\u{a0} 0\n".bytes());
    match oracle_rank_file(&bad) {
        RankOracle::Invalid {
            first_malformed, ..
        } => assert_eq!(first_malformed, Some(1)),
        RankOracle::Valid(..) => panic!("oracle accepts a non-ASCII line"),
    }
}

/// The config oracle accepts the fixture with its base, and its checks fail on another base.
#[test]
fn config_oracle_accepts_the_fixture_and_flags_a_wrong_base() {
    let text = fixture("tokenizer_config.json");
    let names = oracle_config(&text, harness::FIXTURE_BASE).unwrap();
    let s = Specials::parse_config(&text, harness::FIXTURE_BASE, Path::new("c")).unwrap();
    check_specials(&s, harness::FIXTURE_BASE, &names).unwrap();
    assert!(oracle_config(&text, harness::FIXTURE_BASE + 1).is_err());
    let mut shifted = names.clone();
    shifted.rotate_left(1);
    assert!(check_specials(&s, harness::FIXTURE_BASE, &shifted).is_err());
}
