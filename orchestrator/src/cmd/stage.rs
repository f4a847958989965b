//! `k3-orch stage <name>`: one pipeline stage, started by k3-orch with its control socket.

use std::ffi::OsString;

pub fn main(args: Vec<OsString>) -> i32 {
    match args.get(1).and_then(|a| a.to_str()) {
        Some(name) => crate::pipeline::stage_process(name),
        None => {
            eprintln!("usage: k3-orch stage <tokenizer|trunk-loader|expert-fetcher|layer-compute> (started by k3-orch)");
            2
        }
    }
}
