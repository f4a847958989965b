//! A CI-sized run of the mutation fuzzer in `examples/fuzz_parsers` (20,000 cases per
//! reader, a few seconds), so the harness keeps compiling and keeps reaching the readers'
//! accepting paths; the long runs (≥ 10^7 cases each) are in docs/fuzzing.md.

#[allow(dead_code)]
#[path = "../examples/fuzz_parsers/harness.rs"]
mod harness;

use harness::{check_header_invariants, run, Target};
use k3_model::catalog::check_safetensors_bytes;
use std::path::Path;

/// Every reader: no panics, no broken invariants, and a share of accepted mutants (a
/// harness whose mutants never parse tests only the first byte of the readers).
#[test]
fn mutation_fuzz_finds_nothing_and_reaches_acceptance() {
    for t in Target::ALL {
        let rep = run(t, 20_261_201, fuzzkit::ci_execs(), 0, |_| {});
        rep.assert_ci(fuzzkit::ci_execs(), |b| {
            format!("{:?}", String::from_utf8_lossy(b))
        });
    }
}

/// The header oracle can fail: a correct verdict passes it, a tampered one does not.
#[test]
fn header_oracle_flags_a_wrong_geometry() {
    let f = std::fs::read(harness::fixtures().join("seed/st/model-00002-of-00002.safetensors"))
        .unwrap();
    let info = check_safetensors_bytes(Path::new("x"), &f).unwrap();
    check_header_invariants(&f, &info).unwrap();
    let mut bad = info.clone();
    bad.data_end += 1;
    assert!(check_header_invariants(&f, &bad).is_err());
    let mut bad = info;
    bad.n_tensors += 1;
    assert!(check_header_invariants(&f, &bad).is_err());
}
