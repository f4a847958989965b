//! `k3-orch <MODEL_DIR> [flags]`: parse the generation flags and run [`crate::run::run`].

use std::ffi::OsString;

use crate::error::{EXIT_OK, EXIT_USAGE};
use crate::run::args::{self, Parsed};

/// Entry point of `k3-orch <MODEL_DIR> ...` (argv, program name first).
pub fn main(argv: Vec<OsString>) -> i32 {
    let mut args = Vec::with_capacity(argv.len());
    for a in argv.into_iter().skip(1) {
        match a.into_string() {
            Ok(s) => args.push(s),
            Err(bad) => {
                tracing::error!(
                    "k3-orch: argument {bad:?} is not valid UTF-8 (put such text in a --prompt-file)"
                );
                return EXIT_USAGE;
            }
        }
    }
    match args::parse(&args) {
        Err(e) => {
            tracing::error!("k3-orch: {e}\n(see k3-orch --help)");
            EXIT_USAGE
        }
        Ok(Parsed::Help) => {
            print!("{}", args::HELP);
            EXIT_OK
        }
        Ok(Parsed::ListPresets) => {
            print!("{}", crate::tools::project::presets_text());
            EXIT_OK
        }
        Ok(Parsed::Run(a)) => match crate::run::run(&a) {
            Ok(code) => code,
            Err(e) => e.report(),
        },
    }
}
