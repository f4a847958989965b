//! `k3-orch stage <name>`: the body of a stage process, started by k3-orch with its control
//! socket. Binds to its NUMA node (if k3-orch named one), then runs that stage crate's
//! `stage::run`.

use std::ffi::OsString;

use k3_protocol::control::ControlSocket;
use k3_protocol::messages::Stage;

use crate::error::{EXIT_FAILED, EXIT_OK, EXIT_USAGE};
use crate::supervise::{numa, stage_main};

const USAGE: &str =
    "usage: k3-orch stage <tokenizer|trunk-loader|expert-fetcher|layer-compute> (started by k3-orch, not by hand)";

pub fn main(args: Vec<OsString>) -> i32 {
    let name = match args.get(1).and_then(|a| a.to_str()) {
        Some("--help" | "-h") => {
            println!("{USAGE}");
            return EXIT_OK;
        }
        Some(name) => name.to_string(),
        None => {
            tracing::error!("{USAGE}");
            return EXIT_USAGE;
        }
    };
    let Some(stage) = Stage::parse(&name).filter(|s| *s != Stage::Orchestrator) else {
        tracing::error!("k3-orch stage: unknown stage '{name}' (tokenizer, trunk-loader, expert-fetcher, layer-compute)");
        return EXIT_USAGE;
    };
    let control = match ControlSocket::from_env() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(
                "k3-orch stage {name}: {e} (stages are started by k3-orch, not by hand)"
            );
            return EXIT_USAGE;
        }
    };
    if let Err(e) = numa::apply_numa_from_env() {
        tracing::error!("k3-orch stage {name}: numa: {e}");
        return EXIT_FAILED;
    }
    match stage_main(stage, control) {
        Ok(()) => EXIT_OK,
        Err(e) => {
            tracing::error!("{e}");
            crate::error::failure_exit_code(e.kind)
        }
    }
}
