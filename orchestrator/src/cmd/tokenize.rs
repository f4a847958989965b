//! `k3-orch tokenize` and `k3-orch detokenize` (not yet built).

use std::ffi::OsString;

pub fn main(_args: Vec<OsString>) -> i32 {
    eprintln!("k3-orch: 'tokenize' is not implemented yet");
    1
}

pub fn detokenize_main(_args: Vec<OsString>) -> i32 {
    eprintln!("k3-orch: 'detokenize' is not implemented yet");
    1
}
