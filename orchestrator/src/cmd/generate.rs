//! `k3-orch` subcommand `generate` (not yet built).

use std::ffi::OsString;

pub fn main(_args: Vec<OsString>) -> i32 {
    eprintln!("k3-orch: 'generate' is not implemented yet");
    1
}
