//! Long mutation-fuzzing runs of the model readers (safetensors header, index, config):
//! see `harness.rs` for what is mutated and checked, and docs/fuzzing.md for how to run it.
//!
//! ```text
//! cargo run --release -p k3-model --example fuzz_parsers -- \
//!     [--target header|index|config|all] [--execs N] [--seed S] [--findings DIR]
//! ```
//!
//! Prints a progress line about every 10 s and one summary line per reader; exit 1 when
//! any reader had a finding (its first inputs are written to `--findings DIR`), 2 on a
//! usage error (the command line is `fuzzkit::cli`'s).

mod harness;

use std::process::ExitCode;

fn main() -> ExitCode {
    fuzzkit::cli::main(
        "fuzz_parsers",
        "mutation fuzzing of the model readers",
        &|t, seed, execs, every, progress| harness::run(t, seed, execs, every, progress),
    )
}
