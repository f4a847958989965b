//! The orchestrator's integration tests: one test binary (each one links the whole
//! workspace; issue 31), one module per file. They run the built `k3-orch`: its tools, the
//! generation CLI and its budgets, `serve` and `chat`, and the hardening of its inputs.
//!
//! [`tools_common`] holds the helpers (the tiny chat model is made once for all of them).

mod tools_common;

mod bench_budget_script;
mod browser_chat;
mod budget_cli;
mod defaults_cli;
mod download_script;
mod generate_cli;
mod hardening;
mod repl_pty;
mod routes_cli;
mod serve_batch;
mod serve_hostile;
mod serve_http;
mod serve_openai;
mod serve_stream;
mod staged_stop_state;
mod streaming_cli;
mod tools_inspect;
mod tools_pack_experts;
mod tools_pack_trunk;
mod tools_project;
mod tools_synth;
mod tools_verify;
