//! `k3-orch`: the orchestrator and every tool of k3 (the `k3-orch` binary is a thin `main`
//! over [`cli::dispatch`]).
//!
//! Modules, top to bottom (imports only go down, never up, no cycles; `tests/e2e/layout.rs`
//! checks it, and `tests/e2e/docs.rs` that this list names every module):
//! - [`cli`]: argv to a command: the subcommand table, help, the generation flags, logging
//!   set-up, `k3-orch stage NAME` (a stage process's entry);
//! - [`serve`]: `k3-orch serve` (the OpenAI-compatible server) and `k3-orch chat` (the
//!   REPL), one warm pipeline for every request;
//! - [`tools`]: one module per subcommand (demo, score, inspect, verify, pack-trunk, synth,
//!   ladder, sim-cache, devbw, project, doctor, replay, tokenize);
//! - [`run`]: one generation: its flags and the defaults run, chat and serve share, model
//!   sizes, memory plan, launch (staged or single-process), report;
//! - [`supervise`]: the stage processes: spawn, drive, cgroups, NUMA, faults, the warm
//!   pipeline;
//! - [`error`] and [`units`]: the one error type with its exit code; byte formatting.

pub mod cli;
pub mod error;
pub mod run;
pub mod serve;
pub mod supervise;
pub mod tools;
pub mod units;

pub use cli::dispatch;
