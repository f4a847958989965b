//! `k3-orch <MODEL_DIR> [flags]`: generation (see `crate::gen`).

use std::ffi::OsString;

pub fn main(args: Vec<OsString>) -> i32 {
    crate::gen::main(args)
}
