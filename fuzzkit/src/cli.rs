//! The command line of a long fuzzing run, the same for every harness:
//!
//! ```text
//! <prog> [--target <name>|...|all] [--execs N] [--seed S] [--findings DIR]
//! ```
//!
//! Prints a progress line about every 10 s (stderr) and one summary line per target
//! (stdout), then each kept finding; the inputs of the findings are written to
//! `--findings DIR` as `<target>-<seed>-<case>.bin`. Exit 1 when any target had a finding,
//! 2 on a usage error.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use crate::runner::{FuzzReport, Target};

/// Runs `execs` cases of a target from a seed, calling the progress callback about every
/// `every` cases: the harness's `run`.
pub type RunFn<'a, T> = dyn Fn(T, u64, u64, u64, &mut dyn FnMut(&FuzzReport)) -> FuzzReport + 'a;

/// What the command line asked for.
struct Args<T> {
    targets: Vec<T>,
    execs: u64,
    seed: u64,
    findings: Option<PathBuf>,
}

/// Why the command line was not run: `--help`, or what is wrong with it.
#[derive(Debug, PartialEq)]
enum Usage {
    Help,
    Bad(String),
}

impl From<String> for Usage {
    fn from(msg: String) -> Usage {
        Usage::Bad(msg)
    }
}

fn usage<T: Target>(prog: &str, msg: &str) -> ExitCode {
    let names: Vec<&str> = T::all().iter().map(|t| t.name()).collect();
    eprintln!("{prog}: {msg}");
    eprintln!(
        "usage: {prog} [--target {}|all] [--execs N] [--seed S] [--findings DIR]",
        names.join("|")
    );
    ExitCode::from(2)
}

/// Parse the arguments after the program name.
fn parse<T: Target>(args: impl Iterator<Item = String>) -> Result<Args<T>, Usage> {
    let mut a = Args {
        targets: T::all().to_vec(),
        execs: 10_000_000,
        seed: 1,
        findings: None,
    };
    let mut args = args;
    while let Some(arg) = args.next() {
        let mut val = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--target" => {
                let v = val("--target")?;
                a.targets = if v == "all" {
                    T::all().to_vec()
                } else {
                    vec![T::parse(&v).ok_or(format!("unknown target {v:?}"))?]
                };
            }
            "--execs" => {
                a.execs = val("--execs")?
                    .replace('_', "")
                    .parse()
                    .map_err(|_| "--execs needs a whole number".to_string())?;
            }
            "--seed" => {
                a.seed = val("--seed")?
                    .parse()
                    .map_err(|_| "--seed needs a whole number".to_string())?;
            }
            "--findings" => a.findings = Some(PathBuf::from(val("--findings")?)),
            "-h" | "--help" => return Err(Usage::Help),
            _ => return Err(format!("unknown argument {arg:?}").into()),
        }
    }
    Ok(a)
}

/// The whole program: parse `std::env::args`, run each target with `run`, print and save
/// the findings. `about` is what `--help` says the program does.
pub fn main<T: Target>(prog: &str, about: &str, run: &RunFn<'_, T>) -> ExitCode {
    let a = match parse::<T>(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(Usage::Help) => return usage::<T>(prog, about),
        Err(Usage::Bad(msg)) => return usage::<T>(prog, &msg),
    };
    let mut total_findings = 0;
    for t in a.targets {
        let mut last = Instant::now();
        let mut progress = |r: &FuzzReport| {
            if last.elapsed().as_secs() >= 10 {
                last = Instant::now();
                eprintln!("  {}", r.line());
            }
        };
        let rep = run(t, a.seed, a.execs, 10_000, &mut progress);
        println!("{}", rep.line());
        for f in &rep.findings {
            println!("  finding at case {}: {}", f.case, f.what);
            if let Some(dir) = &a.findings {
                let p = dir.join(format!("{}-{}-{}.bin", t.name(), a.seed, f.case));
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

#[cfg(test)]
mod tests {
    use super::*;

    crate::targets! {
        enum T {
            A => "a",
            B => "b",
        }
    }

    fn args(s: &str) -> Result<Args<T>, Usage> {
        parse::<T>(s.split_whitespace().map(String::from))
    }

    fn bad(s: &str) -> Option<Usage> {
        Some(Usage::Bad(s.into()))
    }

    #[test]
    fn arguments_and_their_errors() {
        let a = args("--target b --execs 1_000 --seed 7 --findings /tmp/f").unwrap();
        assert_eq!((a.targets, a.execs, a.seed), (vec![T::B], 1000, 7));
        assert_eq!(a.findings, Some(PathBuf::from("/tmp/f")));
        let a = args("--target all").unwrap();
        assert_eq!(
            (a.targets, a.execs, a.seed),
            (vec![T::A, T::B], 10_000_000, 1)
        );
        assert_eq!(args("--target c").err(), bad("unknown target \"c\""));
        assert_eq!(args("--execs x").err(), bad("--execs needs a whole number"));
        assert_eq!(args("--seed").err(), bad("--seed needs a value"));
        assert_eq!(args("--help").err(), Some(Usage::Help));
        assert_eq!(args("-x").err(), bad("unknown argument \"-x\""));
    }
}
