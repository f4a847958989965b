//! The run loop of a mutation fuzzer: build a case, judge it under `catch_unwind`, keep the
//! accepted ones as corpus, count and keep findings, report progress.
//!
//! A harness implements [`Harness`]; [`run`] drives it. A finding is a panic (the panic hook
//! is silenced for the run and restored after) or a [`Verdict::Broken`]: an input the
//! reader accepted or refused against what the harness's oracle says.

use std::collections::BTreeMap;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

/// Most findings kept (with their inputs) per run; later ones are only counted.
pub const KEEP_FINDINGS: usize = 16;

/// The readers a harness can fuzz, named on the command line.
pub trait Target: Copy + 'static {
    /// Every target, in `--target all` order.
    fn all() -> &'static [Self];
    /// The command-line name.
    fn name(self) -> &'static str;
    /// The target called `s`.
    fn parse(s: &str) -> Option<Self> {
        Self::all().iter().copied().find(|t| t.name() == s)
    }
}

/// Declares a harness's targets: a `Copy` enum with one variant per reader, its `ALL`
/// (every target, in `--target all` order), its inherent `name` (the command-line name) and
/// its [`Target`] impl, from one line per variant:
///
/// ```
/// fuzzkit::targets! {
///     /// The readers under test.
///     pub enum Target {
///         Header => "header",
///         Index => "index",
///     }
/// }
/// assert_eq!(Target::ALL, [Target::Header, Target::Index]);
/// assert_eq!(Target::Index.name(), "index");
/// assert_eq!(<Target as fuzzkit::Target>::parse("header"), Some(Target::Header));
/// ```
#[macro_export]
macro_rules! targets {
    (
        $(#[$meta:meta])*
        $vis:vis enum $ty:ident { $($variant:ident => $name:literal),+ $(,)? }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        $vis enum $ty {
            $($variant),+
        }

        impl $ty {
            /// Every target, in `--target all` order.
            pub const ALL: [$ty; [$($name),+].len()] = [$($ty::$variant),+];

            /// The command-line name.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl $crate::Target for $ty {
            fn all() -> &'static [$ty] {
                &$ty::ALL
            }
            fn name(self) -> &'static str {
                $ty::name(self)
            }
        }
    };
}

/// What an oracle found wrong: with the reader's result, or with the input (one sentence).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation(pub String);

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Violation {}

impl From<String> for Violation {
    fn from(s: String) -> Violation {
        Violation(s)
    }
}

impl From<&str> for Violation {
    fn from(s: &str) -> Violation {
        Violation(s.to_string())
    }
}

/// `Err(Violation(msg))`, for an oracle's early returns.
pub fn violation<T>(msg: String) -> Result<T, Violation> {
    Err(Violation(msg))
}

/// How a case went.
pub enum Verdict {
    /// The reader refused the input (as it may).
    Rejected,
    /// The reader accepted the input, and the oracle agrees with what it made of it.
    Accepted,
    /// A finding.
    Broken(Violation),
}

impl Verdict {
    /// A finding described by `msg`.
    pub fn broken(msg: String) -> Verdict {
        Verdict::Broken(Violation(msg))
    }
}

/// One finding: the case number, what went wrong, and the input that did it.
#[derive(Clone, Debug)]
pub struct Finding {
    pub case: u64,
    pub what: String,
    pub input: Vec<u8>,
}

/// What one run did.
#[derive(Clone, Debug)]
pub struct FuzzReport {
    /// The target's name.
    pub target: &'static str,
    pub seed: u64,
    pub execs: u64,
    pub accepted: u64,
    pub n_findings: u64,
    /// The first of each kind of finding, at most [`KEEP_FINDINGS`].
    pub findings: Vec<Finding>,
    pub secs: f64,
}

impl FuzzReport {
    /// Cases per second.
    pub fn rate(&self) -> f64 {
        self.execs as f64 / self.secs.max(1e-9)
    }

    /// The one-line summary (progress lines and the end of a run).
    pub fn line(&self) -> String {
        format!(
            "{}: {} execs, {} accepted, {} findings, seed {}, {:.1} s, {:.0} execs/s",
            self.target,
            self.execs,
            self.accepted,
            self.n_findings,
            self.seed,
            self.secs,
            self.rate()
        )
    }
}

impl FuzzReport {
    /// The verdict of a CI-sized run (the `tests/fuzz_*.rs` of every harness): `execs`
    /// cases ran, none was a finding (each is printed first, its input through `show`), and
    /// some but not all mutants were accepted (at least 1%: a harness whose mutants never
    /// parse tests only the readers' first checks).
    pub fn assert_ci(&self, execs: u64, show: impl Fn(&[u8]) -> String) {
        eprintln!("{}", self.line());
        for f in &self.findings {
            eprintln!("  case {}: {}\n  input: {}", f.case, f.what, show(&f.input));
        }
        assert_eq!(self.n_findings, 0, "{}", self.line());
        assert_eq!(self.execs, execs);
        assert!(
            self.accepted * 100 >= self.execs && self.accepted < self.execs,
            "{}: accepted share out of range",
            self.line()
        );
    }
}

/// Cases per reader of a CI-sized run: `K3_FUZZ_EXECS`, else 20,000. 0 is refused, so a run
/// that fuzzed nothing cannot pass.
pub fn ci_execs() -> u64 {
    let n = std::env::var("K3_FUZZ_EXECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    assert!(n > 0, "K3_FUZZ_EXECS=0 would fuzz nothing");
    n
}

/// One fuzzer: its corpus and how it builds, judges and keeps cases.
pub trait Harness {
    /// One built input.
    type Case;

    /// Build the next case from the corpus.
    fn case(&mut self) -> Self::Case;

    /// Run the reader under test on `case` and judge the result. The only code that runs
    /// inside `catch_unwind`.
    fn judge(case: &Self::Case) -> Verdict;

    /// The bytes a finding reports.
    fn input(case: &Self::Case) -> &[u8];

    /// An accepted case: feed it back into the corpus.
    fn keep(&mut self, case: Self::Case);

    /// Findings with the same key are one kind: only the first is kept. By default the
    /// whole text.
    fn finding_key(what: &str) -> String {
        what.to_string()
    }
}

/// Run `execs` cases of `h` (fuzzing `target`, from `seed`, both for the report).
/// `progress` is called about every `every` cases (never with 0).
pub fn run<H: Harness>(
    h: &mut H,
    target: &'static str,
    seed: u64,
    execs: u64,
    every: u64,
    mut progress: impl FnMut(&FuzzReport),
) -> FuzzReport {
    let mut rep = FuzzReport {
        target,
        seed,
        execs: 0,
        accepted: 0,
        n_findings: 0,
        findings: Vec::new(),
        secs: 0.0,
    };
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let t0 = Instant::now();
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    for case in 0..execs {
        let c = h.case();
        rep.execs += 1;
        let what = match catch_unwind(AssertUnwindSafe(|| H::judge(&c))) {
            Ok(Verdict::Rejected) => None,
            Ok(Verdict::Accepted) => {
                rep.accepted += 1;
                h.keep(c);
                report_progress(&mut rep, case, every, &t0, &mut progress);
                continue;
            }
            Ok(Verdict::Broken(e)) => Some(format!("invariant: {e}")),
            Err(p) => Some(format!("panic: {}", panic_msg(&*p))),
        };
        if let Some(what) = what {
            rep.n_findings += 1;
            let n = seen.entry(H::finding_key(&what)).or_insert(0);
            *n += 1;
            if *n == 1 && rep.findings.len() < KEEP_FINDINGS {
                rep.findings.push(Finding {
                    case,
                    what,
                    input: H::input(&c).to_vec(),
                });
            }
        }
        report_progress(&mut rep, case, every, &t0, &mut progress);
    }
    rep.secs = t0.elapsed().as_secs_f64();
    std::panic::set_hook(prev);
    rep
}

/// The message of a caught panic.
pub fn panic_msg(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic with a non-string payload".into())
}

fn report_progress(
    rep: &mut FuzzReport,
    case: u64,
    every: u64,
    t0: &Instant,
    progress: &mut impl FnMut(&FuzzReport),
) {
    if every > 0 && (case + 1).is_multiple_of(every) {
        rep.secs = t0.elapsed().as_secs_f64();
        progress(rep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Numbers 0, 1, 2, ...: accepts evens, panics on multiples of 5, breaks on 7.
    struct Counting {
        next: u64,
        kept: Vec<u64>,
    }

    impl Harness for Counting {
        type Case = (u64, [u8; 8]);
        fn case(&mut self) -> Self::Case {
            self.next += 1;
            (self.next - 1, (self.next - 1).to_le_bytes())
        }
        fn judge(c: &Self::Case) -> Verdict {
            match c.0 {
                n if n % 5 == 0 => panic!("five divides {n}"),
                7 => Verdict::broken("seven".into()),
                n if n % 2 == 0 => Verdict::Accepted,
                _ => Verdict::Rejected,
            }
        }
        fn input(c: &Self::Case) -> &[u8] {
            &c.1
        }
        fn keep(&mut self, c: Self::Case) {
            self.kept.push(c.0);
        }
        fn finding_key(what: &str) -> String {
            what.chars().take_while(|c| !c.is_ascii_digit()).collect()
        }
    }

    /// Panics and broken verdicts are findings (the first of each kind kept, with its
    /// input), accepted cases are kept as corpus, progress comes every `every` cases.
    #[test]
    fn the_loop_counts_keeps_and_reports() {
        let mut h = Counting {
            next: 0,
            kept: Vec::new(),
        };
        let mut calls = 0;
        let rep = run(&mut h, "count", 9, 20, 4, |r| {
            calls += 1;
            assert_eq!(r.execs % 4, 0);
        });
        assert_eq!((rep.execs, calls), (20, 5));
        // 0, 5, 10, 15 panic; 7 is broken; 2, 4, 6, 8, 12, 14, 16, 18 are accepted.
        assert_eq!(rep.n_findings, 5);
        assert_eq!(rep.accepted, 8);
        assert_eq!(h.kept, vec![2, 4, 6, 8, 12, 14, 16, 18]);
        let cases: Vec<u64> = rep.findings.iter().map(|f| f.case).collect();
        assert_eq!(
            cases,
            vec![0, 7],
            "one finding per kind: {:?}",
            rep.findings
        );
        assert_eq!(rep.findings[1].what, "invariant: seven");
        assert_eq!(rep.findings[1].input, 7u64.to_le_bytes());
        assert!(rep.findings[0].what.starts_with("panic: five divides"));
        assert!(rep
            .line()
            .starts_with("count: 20 execs, 8 accepted, 5 findings, seed 9"));
    }
}
