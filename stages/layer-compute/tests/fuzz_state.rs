//! A CI-sized run of the mutation fuzzer in `examples/fuzz_state` (the saved-state reader:
//! `state::decode`, `decode_prefix` and `read` against the tiny-mxfp4 model, 20,000 cases,
//! a few seconds), so the harness keeps compiling and keeps reaching the reader's
//! accepting paths; the long runs (≥ 10^7 cases) are in docs/fuzzing.md.

#[allow(dead_code)]
#[path = "../examples/fuzz_state/harness.rs"]
mod harness;

use crate::support::kernels_shared;
use harness::{run, Target};

/// No panics, no verdict the oracle disagrees with, and a share of accepted mutants (a
/// harness whose mutants never decode tests only the reader's first checks).
#[test]
fn state_fuzz_finds_nothing_and_reaches_acceptance() {
    // The corpus is made by prefilling the model: products run.
    let _kernels = kernels_shared();
    let rep = run(Target::State, 20_261_205, fuzzkit::ci_execs(), 0, |_| {});
    rep.assert_ci(fuzzkit::ci_execs(), |b| format!("{} bytes", b.len()));
}

/// The oracle can fail: it accepts a corpus payload and refuses it with a byte more, a
/// byte less, or the position raised by one.
#[test]
fn state_oracle_refuses_what_it_must() {
    let _kernels = kernels_shared();
    let (p, accepts) = harness::oracle_check(harness::load_model());
    assert!(accepts(&p));
    let mut longer = p.clone();
    longer.push(0);
    assert!(!accepts(&longer));
    assert!(!accepts(&p[..p.len() - 1]));
    let mut pos = p.clone();
    pos[0] = pos[0].wrapping_add(1);
    assert!(!accepts(&pos));
}

/// Found by `examples/fuzz_state` (a panic, "attempt to add with overflow", in a build
/// with overflow checks, in the first cases): a payload whose position is 2^64 - 1.
/// `decode` checked the token count against `pos + 1`, which overflowed. Catches: the
/// unchecked `pos + 1`, which panics with overflow checks and otherwise wraps to 0, so
/// that an empty token list passed the check and the payload was refused later for
/// something else (this test then sees another message).
#[test]
fn a_position_of_2_64_minus_1_is_refused_by_its_token_count() {
    let m = harness::load_model();
    let mut p = Vec::new();
    for v in [u64::MAX, 0, 0] {
        p.extend_from_slice(&v.to_le_bytes()); // pos, steps, no tokens
    }
    p.extend_from_slice(&13u32.to_le_bytes());
    p.extend_from_slice(&[0; 13]);
    let e = k3_layer_compute::state::decode(&p, &m).err().unwrap();
    assert_eq!(
        e.to_string(),
        "the state records 0 tokens for a session of 18446744073709551615 (expected one more)"
    );
}
