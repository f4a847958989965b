//! Long mutation-fuzzing runs of the protocol's readers of untrusted bytes: message decode
//! (`messages::decode`) and the recording reader (`record::parse_recording`, the in-memory
//! twin of `read_recording`): see `harness.rs` for what is mutated and checked, and
//! docs/fuzzing.md for how to run it.
//!
//! ```text
//! cargo run --release -p k3-protocol --example fuzz_protocol -- \
//!     [--target message|recording|all] [--execs N] [--seed S] [--findings DIR]
//! ```
//!
//! Prints a progress line about every 10 s and one summary line per reader; exit 1 when
//! any reader had a finding (its first inputs are written to `--findings DIR`), 2 on a
//! usage error (the command line is `fuzzkit::cli`'s).

mod harness;

use std::process::ExitCode;

fn main() -> ExitCode {
    fuzzkit::cli::main(
        "fuzz_protocol",
        "mutation fuzzing of message decode and the recording reader",
        &|t, seed, execs, every, progress| harness::run(t, seed, execs, every, progress),
    )
}
