//! `k3-orch` subcommand `synth` (not yet built).

use std::ffi::OsString;

pub fn main(_args: Vec<OsString>) -> i32 {
    eprintln!("k3-orch: 'synth' is not implemented yet");
    1
}
