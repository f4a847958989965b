//! The command line: argv to a command and its exit code.
//!
//! `k3-orch <MODEL_DIR> [flags]` generates ([`generate`], flags in [`crate::run::args`]);
//! `k3-orch <subcommand> ...` runs a tool from `tools/` (see `docs/cli.md`), which parses its
//! own arguments; `k3-orch stage NAME` is a stage process ([`stage`]). Every command returns
//! the process exit code (0 ok, 1 failure, 2 usage or refused request, 4 unsound ids).
//!
//! Diagnostics go through `tracing` to stderr ([`init_logging`]): `-v` (debug) or `-vv`
//! (trace) anywhere on the command line, or `K3_LOG` (an env-filter, e.g.
//! `K3_LOG=k3_expert_fetcher=debug`); `--quiet` keeps warnings and errors only. User output
//! (generated text, the step table, the report) is plain stdout.

use std::ffi::OsString;

use crate::tools;

pub mod generate;
pub mod stage;

/// Subcommands and the module that runs each.
/// A subcommand's entry point: argv (its name first) to exit code.
type SubMain = fn(Vec<OsString>) -> i32;

const SUBCOMMANDS: &[(&str, SubMain, &str)] = &[
    (
        "demo",
        tools::demo::main,
        "staged run of the bundled tiny model, checked against the oracle",
    ),
    (
        "score",
        tools::score::main,
        "one forward over --ids: teacher-forced argmax (and logits)",
    ),
    (
        "inspect",
        tools::inspect::main,
        "config summary, tensor census, memory per preset",
    ),
    (
        "verify",
        tools::verify::main,
        "shards, headers, index and sizes are consistent",
    ),
    (
        "pack-experts",
        tools::pack_experts::main,
        "experts.bin + experts.json per drive directory, one run per expert",
    ),
    (
        "pack-trunk",
        tools::pack_trunk::main,
        "trunk.bin + trunk.json, one run per layer",
    ),
    (
        "synth",
        tools::synth::main,
        "a random model in the released multi-shard layout",
    ),
    (
        "ladder",
        tools::ladder::main,
        "the same run at several budgets; the ids must not change",
    ),
    (
        "sim-cache",
        tools::sim_cache::main,
        "replay an expert trace against cache policies",
    ),
    (
        "devbw",
        tools::devbw::main,
        "O_DIRECT random reads at queue depth 1 and 16",
    ),
    (
        "project",
        tools::project::main,
        "projected s/token for a model on a machine (from headers; not a measurement)",
    ),
    (
        "doctor",
        tools::doctor::main,
        "machine check, projected s/token, the --mem-gb to use, next command",
    ),
    (
        "replay",
        tools::replay::main,
        "re-run one stage from a recording, compare outputs",
    ),
    (
        "tokenize",
        tools::tokenize::main,
        "print the ids of a text, comma-separated",
    ),
    (
        "detokenize",
        tools::tokenize::detokenize_main,
        "print the text of --ids",
    ),
    (
        "serve",
        crate::serve::serve_main,
        "OpenAI-compatible HTTP server with a chat page (docs/serve.md)",
    ),
    (
        "chat",
        crate::serve::repl::chat_main,
        "interactive multi-turn chat, streamed (one stdin line per turn)",
    ),
    (
        "stage",
        stage::main,
        "(internal) run one pipeline stage; started by k3-orch",
    ),
];

/// Environment variable with the log filter (tracing-subscriber's env-filter syntax). Stage
/// processes inherit it, so `-v` reaches them too.
pub const LOG_ENV: &str = "K3_LOG";

/// Set up the log: `verbosity` 0 = info (messages only, as before), 1 = debug, 2+ = trace
/// (with level and module); `quiet` = warnings and errors only. `K3_LOG`, when set, wins.
pub fn init_logging(verbosity: usize, quiet: bool) {
    use tracing_subscriber::EnvFilter;
    let level = match (quiet, verbosity) {
        (true, 0) => "warn",
        (_, 0) => "info",
        (_, 1) => "debug",
        _ => "trace",
    };
    let filter = std::env::var(LOG_ENV)
        .ok()
        .and_then(|v| EnvFilter::try_new(v).ok())
        .unwrap_or_else(|| EnvFilter::new(level));
    let detailed = verbosity > 0 || std::env::var_os(LOG_ENV).is_some();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .without_time()
        .with_ansi(false)
        .with_target(detailed)
        .with_level(detailed)
        .try_init();
}

/// Take `-v`, `-vv` and `--verbose` out of argv; returns how verbose.
fn take_verbosity(args: &mut Vec<OsString>) -> usize {
    let mut v = 0;
    args.retain(|a| match a.to_str() {
        Some("-v" | "--verbose") => {
            v += 1;
            false
        }
        Some("-vv") => {
            v += 2;
            false
        }
        _ => true,
    });
    v
}

/// Run `k3-orch` with `args` (argv, program name first); returns the exit code.
pub fn dispatch(mut args: Vec<OsString>) -> i32 {
    let verbosity = take_verbosity(&mut args);
    let quiet = args.iter().any(|a| a == "--quiet" || a == "-q");
    if verbosity > 0 && std::env::var_os(LOG_ENV).is_none() {
        // Stage processes inherit the environment; set before any thread starts.
        std::env::set_var(LOG_ENV, if verbosity == 1 { "debug" } else { "trace" });
    }
    init_logging(verbosity, quiet);
    let first = args.get(1).and_then(|a| a.to_str()).unwrap_or("");
    if let Some((name, run, _)) = SUBCOMMANDS.iter().find(|(n, _, _)| *n == first) {
        // Subcommand parsers see `k3-orch <name> ...` with the name as argv[0].
        let sub: Vec<OsString> = std::iter::once(OsString::from(format!("k3-orch {name}")))
            .chain(args.into_iter().skip(2))
            .collect();
        return run(sub);
    }
    match first {
        "--version" | "-V" => {
            println!("k3-orch {}", env!("CARGO_PKG_VERSION"));
            0
        }
        "" | "--help" | "-h" | "help" => {
            print_help();
            if first.is_empty() {
                2
            } else {
                0
            }
        }
        _ => {
            // A word that is not a directory but is close to a subcommand's name is a typo
            // ("k3-orch inpsect DIR"), not a model directory.
            let names: Vec<&str> = SUBCOMMANDS.iter().map(|(n, _, _)| *n).collect();
            if !first.starts_with('-') && !std::path::Path::new(first).exists() {
                if let Some(n) = crate::run::args::nearest(first, &names) {
                    tracing::error!(
                        "k3-orch: unknown subcommand '{first}'; did you mean '{n}'? (see k3-orch --help)"
                    );
                    return crate::error::EXIT_USAGE;
                }
            }
            generate::main(args)
        }
    }
}

fn print_help() {
    println!(
        "k3-orch {}: run Kimi K3 as a staged pipeline on one CPU machine\n",
        env!("CARGO_PKG_VERSION")
    );
    print!("{}", crate::run::args::HELP);
    println!("\nsubcommands (k3-orch <subcommand> --help for each):");
    for (name, _, what) in SUBCOMMANDS {
        if *name != "stage" {
            println!("  {name:<12} {what}");
        }
    }
}
