//! `k3-orch` subcommand `pack_trunk` (not yet built).

use std::ffi::OsString;

pub fn main(_args: Vec<OsString>) -> i32 {
    eprintln!("k3-orch: 'pack_trunk' is not implemented yet");
    1
}
