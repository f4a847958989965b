//! `k3-orch` subcommand `devbw` (not yet built).

use std::ffi::OsString;

pub fn main(_args: Vec<OsString>) -> i32 {
    eprintln!("k3-orch: 'devbw' is not implemented yet");
    1
}
