//! A CI-sized run of the mutation fuzzer in `examples/fuzz_protocol` (message decode and
//! the recording reader, 20,000 cases each, a few seconds), so the harness keeps compiling
//! and keeps reaching the readers' accepting paths; the long runs (≥ 10^7 cases each) are
//! in docs/fuzzing.md.

#[allow(dead_code)]
#[path = "../examples/fuzz_protocol/harness.rs"]
mod harness;

use harness::{run, Target};

/// Both readers: no panics, no verdict the oracles disagree with, and a share of accepted
/// mutants (a harness whose mutants never parse tests only the readers' first checks).
#[test]
fn protocol_fuzz_finds_nothing_and_reaches_acceptance() {
    for t in Target::ALL {
        let rep = run(t, 20_261_205, fuzzkit::ci_execs(), 0, |_| {});
        rep.assert_ci(fuzzkit::ci_execs(), |b| format!("{b:?}"));
    }
}

/// The corpus holds the fixture recordings' frames, and every one of them is a whole
/// message (the `@region` entries, JSON, are not frames of a link and are left out):
/// catches a corpus that silently lost its real inputs, and a recorder that logs a frame
/// that is not one message.
#[test]
fn fixture_frames_are_whole_messages() {
    let frames = harness::fixture_frames();
    assert!(frames.len() >= 20, "{} fixture frames", frames.len());
    for f in &frames {
        if let Err(e) = k3_protocol::messages::decode(f) {
            panic!(
                "a recorded frame of {} bytes is not a message: {e}",
                f.len()
            );
        }
    }
}

/// The recording oracle can fail: it refuses a changed byte under `verify` and a stale end
/// marker, and accepts the fixture as it is.
#[test]
fn recording_oracle_refuses_what_it_must() {
    let p = harness::fixtures().join("recordings/tiny-mxfp4/tokenizer.k3rec");
    let b = std::fs::read(p).unwrap();
    assert!(harness::oracle_accepts(&b, true));
    let mut bad = b.clone();
    let i = bad.len() - 40;
    bad[i] ^= 1;
    assert!(!harness::oracle_accepts(&bad, true));
    assert!(!harness::oracle_accepts(&b[..5], false));
    let mut extra = b;
    extra.push(0);
    assert!(!harness::oracle_accepts(&extra, false));
}
