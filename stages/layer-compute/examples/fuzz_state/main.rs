//! Long mutation-fuzzing runs of the saved-state reader (`--load-state`, chat's `/load`:
//! `state::read`, `state::decode`, `state::decode_prefix`) against the tiny-mxfp4 model:
//! see `harness.rs` for what is mutated and checked, and docs/fuzzing.md for how to run it.
//!
//! ```text
//! cargo run --release -p k3-layer-compute --example fuzz_state -- \
//!     [--target state] [--execs N] [--seed S] [--findings DIR]
//! ```
//!
//! Prints a progress line about every 10 s and one summary line; exit 1 on a finding (its
//! first inputs are written to `--findings DIR`), 2 on a usage error (the command line is
//! `fuzzkit::cli`'s).

mod harness;

use std::process::ExitCode;

fn main() -> ExitCode {
    fuzzkit::cli::main(
        "fuzz_state",
        "mutation fuzzing of the saved-state reader",
        &|t, seed, execs, every, progress| harness::run(t, seed, execs, every, progress),
    )
}
