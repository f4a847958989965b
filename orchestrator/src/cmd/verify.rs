//! `k3-orch` subcommand `verify` (not yet built).

use std::ffi::OsString;

pub fn main(_args: Vec<OsString>) -> i32 {
    eprintln!("k3-orch: 'verify' is not implemented yet");
    1
}
