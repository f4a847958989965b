//! `fuzzkit`: what the repository's seeded mutation fuzzers share, so each harness holds
//! only its readers' inputs, mutations and oracles (`model/examples/fuzz_parsers`,
//! `stages/tokenizer/examples/fuzz_tokfiles`; docs/fuzzing.md).
//!
//! - [`rng`]: the splitmix64 PRNG every case draws from (the same sequence on every
//!   machine), and how many edits a case stacks.
//! - [`json`]: finding strings, values and object members in JSON text without parsing
//!   it, and the JSON-aware text edits built on them.
//! - [`runner`]: a harness ([`Harness`]: build a case, judge it, keep accepted mutants),
//!   its verdicts ([`Verdict`], [`Violation`]), and the run loop that catches panics and
//!   keeps findings ([`run`], [`FuzzReport`], [`Finding`]).
//! - [`targets!`]: a harness's target enum (its `ALL`, names and [`Target`] impl) from one
//!   line per reader.
//! - [`cli`]: the command line of a long run (`--target`, `--execs`, `--seed`,
//!   `--findings`), its output and exit codes.
//!
//! It knows nothing about k3 and is no part of the pipeline: the harnesses take it as a
//! dev-dependency, and it is not published.

pub mod cli;
pub mod json;
pub mod rng;
pub mod runner;

pub use rng::{n_edits, Rng};
pub use runner::{ci_execs, run, Finding, FuzzReport, Harness, Target, Verdict, Violation};
