//! The `k3-orch` binary: see the `k3_orch` library for everything it does.
//!
//! Its one concern of its own: a closed stdout or stderr (`k3-orch tokenize ... | head -c
//! 10`). Rust ignores SIGPIPE, so a print to a closed pipe panics; here that panic ends the
//! process quietly, as Unix tools end: killed by SIGPIPE, with no message. On the main
//! thread the panic first unwinds (the run's guards clean up: stages, cgroups); on any
//! other thread the process ends at once (the stages die with it, `PR_SET_PDEATHSIG`).

use std::any::Any;

fn main() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !is_broken_pipe(info.payload()) {
            return default(info);
        }
        if std::thread::current().name() != Some("main") {
            die_of_sigpipe();
        }
        // The main thread unwinds to `main`, which ends quietly.
    }));
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match std::panic::catch_unwind(move || k3_orch::dispatch(args)) {
        Ok(code) => std::process::exit(code),
        Err(p) if is_broken_pipe(p.as_ref()) => die_of_sigpipe(),
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// Whether a panic's payload is the standard library's "failed printing to stdout/stderr"
/// on a closed pipe (EPIPE).
fn is_broken_pipe(payload: &(dyn Any + Send)) -> bool {
    let msg = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("");
    msg.starts_with("failed printing to std")
        && msg.contains(&format!("(os error {})", libc::EPIPE))
}

/// End the process as a Unix tool does when its reader went away: by SIGPIPE.
fn die_of_sigpipe() -> ! {
    // SAFETY: restoring the default action of SIGPIPE and raising it in this process; no
    // pointer is passed and no Rust state is touched (the process ends here).
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    // Unreachable in practice (the default action of SIGPIPE ends the process).
    std::process::exit(1)
}
