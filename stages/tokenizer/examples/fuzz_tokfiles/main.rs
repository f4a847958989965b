//! Long mutation-fuzzing runs of the tokenizer's file readers (`tiktoken.model` and
//! `tokenizer_config.json`): see `harness.rs` for what is mutated and checked, and docs/fuzzing.md for how to run it.
//!
//! ```text
//! cargo run --release -p k3-tokenizer --example fuzz_tokfiles -- \
//!     [--target tiktoken|tokconfig|all] [--execs N] [--seed S] [--findings DIR]
//! ```
//!
//! Prints a progress line about every 10 s and one summary line per reader; exit 1 when
//! any reader had a finding (its first inputs are written to `--findings DIR`), 2 on a
//! usage error.

mod harness;

use harness::{run, Target};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

fn usage(msg: &str) -> ExitCode {
    eprintln!("fuzz_tokfiles: {msg}");
    eprintln!(
        "usage: fuzz_tokfiles [--target tiktoken|tokconfig|all] [--execs N] [--seed S] \
         [--findings DIR]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut targets = Target::ALL.to_vec();
    let mut execs: u64 = 10_000_000;
    let mut seed: u64 = 1;
    let mut findings_dir: Option<PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--target" => match val("--target") {
                Ok(v) if v == "all" => targets = Target::ALL.to_vec(),
                Ok(v) => match Target::parse(&v) {
                    Some(t) => targets = vec![t],
                    None => return usage(&format!("unknown target {v:?}")),
                },
                Err(e) => return usage(&e),
            },
            "--execs" => match val("--execs").map(|v| v.replace('_', "").parse::<u64>()) {
                Ok(Ok(n)) => execs = n,
                _ => return usage("--execs needs a whole number"),
            },
            "--seed" => match val("--seed").map(|v| v.parse::<u64>()) {
                Ok(Ok(n)) => seed = n,
                _ => return usage("--seed needs a whole number"),
            },
            "--findings" => match val("--findings") {
                Ok(v) => findings_dir = Some(PathBuf::from(v)),
                Err(e) => return usage(&e),
            },
            "-h" | "--help" => return usage("mutation fuzzing of the tokenizer file readers"),
            _ => return usage(&format!("unknown argument {a:?}")),
        }
    }
    let mut total_findings = 0;
    for t in targets {
        let mut last = Instant::now();
        let rep = run(t, seed, execs, 10_000, |r| {
            if last.elapsed().as_secs() >= 10 {
                last = Instant::now();
                eprintln!("  {}", r.line());
            }
        });
        println!("{}", rep.line());
        for f in &rep.findings {
            println!("  finding at case {}: {}", f.case, f.what);
            if let Some(dir) = &findings_dir {
                let p = dir.join(format!("{}-{}-{}.bin", t.name(), seed, f.case));
                match std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&p, &f.input)) {
                    Ok(()) => println!("    input: {}", p.display()),
                    Err(e) => eprintln!("    cannot write {}: {e}", p.display()),
                }
            }
        }
        total_findings += rep.n_findings;
    }
    if total_findings > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
