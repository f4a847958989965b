//! `k3-orch`: the orchestrator and every tool of k3 (the `k3-orch` binary is a thin
//! `main` over [`dispatch`]).
//!
//! `k3-orch <MODEL_DIR> [flags]` generates; `k3-orch <subcommand> ...` runs a tool (see
//! `docs/cli.md`). Every subcommand lives in `cmd/<name>.rs`, parses its own arguments and
//! returns the process exit code (0 ok, 1 failure, 2 usage or refused request, 4 unsound ids).

use std::ffi::OsString;

pub mod cmd;
pub mod gen;
pub mod pipeline;

/// Subcommands and the module that runs each.
/// A subcommand's entry point: argv (its name first) to exit code.
type SubMain = fn(Vec<OsString>) -> i32;

const SUBCOMMANDS: &[(&str, SubMain, &str)] = &[
    (
        "demo",
        cmd::demo::main,
        "staged run of the bundled tiny model, checked against the oracle",
    ),
    (
        "score",
        cmd::score::main,
        "one forward over --ids: teacher-forced argmax (and logits)",
    ),
    (
        "inspect",
        cmd::inspect::main,
        "config summary, tensor census, memory per preset",
    ),
    (
        "verify",
        cmd::verify::main,
        "shards, headers, index and sizes are consistent",
    ),
    (
        "pack-trunk",
        cmd::pack_trunk::main,
        "trunk.bin + trunk.json, one run per layer",
    ),
    (
        "synth",
        cmd::synth::main,
        "a random model in the released multi-shard layout",
    ),
    (
        "ladder",
        cmd::ladder::main,
        "the same run at several budgets; the ids must not change",
    ),
    (
        "sim-cache",
        cmd::sim_cache::main,
        "replay an expert trace against cache policies",
    ),
    (
        "devbw",
        cmd::devbw::main,
        "O_DIRECT random reads at queue depth 1 and 16",
    ),
    (
        "doctor",
        cmd::doctor::main,
        "machine check, preset advice, next command",
    ),
    (
        "replay",
        cmd::replay::main,
        "re-run one stage from a recording, compare outputs",
    ),
    (
        "tokenize",
        cmd::tokenize::main,
        "print the ids of a text, comma-separated",
    ),
    (
        "detokenize",
        cmd::tokenize::detokenize_main,
        "print the text of --ids",
    ),
    (
        "stage",
        cmd::stage::main,
        "(internal) run one pipeline stage; started by k3-orch",
    ),
];

/// Run `k3-orch` with `args` (argv, program name first); returns the exit code.
pub fn dispatch(args: Vec<OsString>) -> i32 {
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
        _ => cmd::generate::main(args),
    }
}

fn print_help() {
    println!(
        "k3-orch {}: run Kimi K3 as a staged pipeline on one CPU machine\n",
        env!("CARGO_PKG_VERSION")
    );
    println!("usage: k3-orch <MODEL_DIR> [prompt] [memory] [generation] [diagnostics]");
    println!("       k3-orch <subcommand> ...\n");
    println!("generate (see `k3-orch <MODEL_DIR> --help` for every flag):");
    println!(
        "  prompt      --prompt TEXT | --prompt-file PATH | --ids 1,2,3   [--chat] [--tok DIR]"
    );
    println!("  memory      --preset NAME | --trunk DIR | --trunk-gb X | --cache-gb X");
    println!("  generation  --gen N  --incremental  --temperature T --top-p P --top-k K --seed S");
    println!("  diagnostics --config PATH --layers N --out FILE --dump-logits PATH");
    println!(
        "              --dump-cache-trace DIR --record DIR --threads N --numa SPEC --inproc\n"
    );
    println!("subcommands:");
    for (name, _, what) in SUBCOMMANDS {
        if *name != "stage" {
            println!("  {name:<12} {what}");
        }
    }
    println!("\n  --help | --version | --list-presets");
    println!("\nexit codes: 0 ok; 1 bind/forward failure or a stage died; 2 usage, config or refused request;");
    println!("            4 finished but a routed expert failed to load (ids unsound)");
}
