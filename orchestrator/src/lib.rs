//! `k3-orch`: the orchestrator and every tool of k3 (the `k3-orch` binary is a thin `main`
//! over [`cli::dispatch`]).
//!
//! Modules, top to bottom (imports only go down, never up, no cycles):
//! - [`cli`]: argv to a command: the subcommand table, help, the generation flags, logging
//!   set-up, `k3-orch stage NAME` (a stage process's entry);
//! - [`tools`]: one module per subcommand (demo, score, inspect, verify, pack-trunk, synth,
//!   ladder, sim-cache, devbw, doctor, replay, tokenize);
//! - [`run`]: one generation: census, memory plan, launch (staged or single-process), report;
//! - [`supervise`]: the stage processes: spawn, drive, cgroups, NUMA, faults;
//! - [`error`] and [`units`]: the one error type with its exit code; byte formatting.

pub mod cli;
pub mod error;
pub mod run;
pub mod serve;
pub mod supervise;
pub mod tools;
pub mod units;

pub use cli::dispatch;
