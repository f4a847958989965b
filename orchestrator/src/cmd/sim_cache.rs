//! `k3-orch` subcommand `sim_cache` (not yet built).

use std::ffi::OsString;

pub fn main(_args: Vec<OsString>) -> i32 {
    eprintln!("k3-orch: 'sim_cache' is not implemented yet");
    1
}
