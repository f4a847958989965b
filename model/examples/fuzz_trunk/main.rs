//! Long mutation-fuzzing runs of the packed trunk's readers: the manifest
//! (`TrunkManifest::from_json_str` / `load_dir`, raw `k3-trunk/3` and coded
//! `k3-trunk-coded/1`) and the trunk codec's chunk decoder (`codec::decode`,
//! `codec_trunk::decode_chunk`): see `harness.rs` for what is mutated and checked, and
//! docs/fuzzing.md for how to run it.
//!
//! ```text
//! cargo run --release -p k3-model --example fuzz_trunk -- \
//!     [--target trunk|codec|all] [--execs N] [--seed S] [--findings DIR]
//! ```
//!
//! Prints a progress line about every 10 s and one summary line per reader; exit 1 when
//! any reader had a finding (its first inputs are written to `--findings DIR`), 2 on a
//! usage error (the command line is `fuzzkit::cli`'s).

mod harness;

use std::process::ExitCode;

fn main() -> ExitCode {
    fuzzkit::cli::main(
        "fuzz_trunk",
        "mutation fuzzing of trunk.json and the trunk codec's chunk decoder",
        &|t, seed, execs, every, progress| harness::run(t, seed, execs, every, progress),
    )
}
