//! The `k3-orch` binary: see the `k3_orch` library for everything it does.

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    std::process::exit(k3_orch::dispatch(args));
}
