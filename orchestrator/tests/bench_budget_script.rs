//! `scripts/bench-budget.sh`'s argument handling, through its dry run (`DRY_RUN=1`: the runs
//! it would make, in order, then exit; no root, no k3-orch, no cgroup): the codec rows
//! beside the raw ones, alternated from round to round, and the ids it compares against
//! taken from the resident rung (or EXPECT) instead of a hard-coded list.

use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/bench-budget.sh")
}

/// (exit code, stdout, stderr) of a dry run with `env` and `args`.
fn dry(env: &[(&str, &str)], args: &[&str]) -> (i32, String, String) {
    let mut c = Command::new("/bin/bash");
    c.arg(script())
        .args(args)
        .env("DRY_RUN", "1")
        .env("K3", "/nonexistent/k3-orch");
    for v in [
        "EXPECT",
        "CODED_TRUNK",
        "CODED_RESIDENT",
        "ROUNDS",
        "IDS",
        "GEN",
    ] {
        c.env_remove(v);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn runs(out: &str) -> Vec<&str> {
    out.lines()
        .filter_map(|l| l.strip_prefix("run: "))
        .collect()
}

/// The script parses as bash.
#[test]
fn parses() {
    let o = Command::new("/bin/bash")
        .arg("-n")
        .arg(script())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// With CODED_TRUNK every numeric rung runs raw and coded back to back, the order swapped
/// in the second round, the resident rung first (its ids are the expectation). Catches
/// codec rows that all run after the raw ones (a warmer disk or cache for one side), a
/// resident rung run last (its ids would come too late to compare), or rounds ignored.
#[test]
fn coded_rows_alternate_and_the_resident_rung_comes_first() {
    let (code, out, err) = dry(
        &[("CODED_TRUNK", "/tmp/coded"), ("ROUNDS", "2")],
        &["/tmp/w", "1.5,5.5,resident"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("EXPECT=from the resident rung"), "{out}");
    assert_eq!(
        runs(&out),
        [
            "resident resident",
            "1.5 raw",
            "1.5 coded",
            "5.5 raw",
            "5.5 coded",
            "1.5 coded",
            "1.5 raw",
            "5.5 coded",
            "5.5 raw"
        ]
    );
    let (code, out, _) = dry(&[], &["/tmp/w", "5.5,resident"]);
    assert_eq!(code, 0);
    assert_eq!(runs(&out), ["resident resident", "5.5 raw"]);
}

/// CODED_RESIDENT runs the coded trunk once per `--trunk-resident` mode beside the raw
/// trunk, the order reversed in the second round; a mode it does not know, or the modes
/// without a coded trunk, are refused with exit 2. Catches modes that are ignored (one
/// coded row), rows that do not alternate, and a bad mode passed on to k3-orch.
#[test]
fn coded_resident_modes_each_get_a_row() {
    let (code, out, err) = dry(
        &[
            ("CODED_TRUNK", "/tmp/coded"),
            ("CODED_RESIDENT", "raw,coded,auto"),
            ("ROUNDS", "2"),
            ("EXPECT", "1"),
        ],
        &["/tmp/w", "5.5"],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        runs(&out),
        [
            "5.5 raw",
            "5.5 coded-raw",
            "5.5 coded-coded",
            "5.5 coded-auto",
            "5.5 coded-auto",
            "5.5 coded-coded",
            "5.5 coded-raw",
            "5.5 raw"
        ]
    );
    refuses_bad_modes("CODED_RESIDENT", "raw,zip");
}

/// The modes variable `var` is refused (exit 2, naming it) with an unknown mode in `bad`
/// beside a coded trunk, and with a good mode but no coded trunk.
fn refuses_bad_modes(var: &str, bad: &str) {
    for env in [
        vec![("CODED_TRUNK", "/tmp/coded"), (var, bad)],
        vec![(var, "coded")],
    ] {
        let mut env = env;
        env.push(("EXPECT", "1"));
        let (code, _, err) = dry(&env, &["/tmp/w", "5.5"]);
        assert_eq!(code, 2, "{env:?}: {err}");
        assert!(err.contains(var), "{err}");
    }
}

/// CODED_HEAD runs the coded trunk once per `--lm-head-read` mode (after the
/// CODED_RESIDENT modes when both are given), alternating like them; a mode it does not
/// know, or the modes without a coded trunk, are refused with exit 2. Catches head modes
/// that replace the resident modes' rows, and a bad mode passed on to k3-orch.
#[test]
fn coded_head_modes_each_get_a_row() {
    let (code, out, err) = dry(
        &[
            ("CODED_TRUNK", "/tmp/coded"),
            ("CODED_RESIDENT", "raw"),
            ("CODED_HEAD", "raw,auto"),
            ("ROUNDS", "2"),
            ("EXPECT", "1"),
        ],
        &["/tmp/w", "5.5"],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        runs(&out),
        [
            "5.5 raw",
            "5.5 coded-raw",
            "5.5 head-raw",
            "5.5 head-auto",
            "5.5 head-auto",
            "5.5 head-raw",
            "5.5 coded-raw",
            "5.5 raw"
        ]
    );
    refuses_bad_modes("CODED_HEAD", "zip");
}

/// No stale default ids: without a resident rung EXPECT is required (exit 2), and a given
/// one is used; bad limits, rounds or ids are refused with exit 2. Catches the old
/// hard-coded ids of the legacy slice (gaussian slices have other ids).
#[test]
fn expect_is_required_or_taken_from_the_resident_rung() {
    let (code, _, err) = dry(&[], &["/tmp/w", "5.5"]);
    assert_eq!(code, 2);
    assert!(err.contains("EXPECT"), "{err}");
    let (code, out, err) = dry(&[("EXPECT", "1,2,3")], &["/tmp/w", "5.5"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("EXPECT=1,2,3"), "{out}");
    assert_eq!(runs(&out), ["5.5 raw"]);
    for (env, args) in [
        (vec![], vec!["/tmp/w", "5.5,foo,resident"]),
        (vec![], vec!["/tmp/w", "0,resident"]),
        (vec![("ROUNDS", "0")], vec!["/tmp/w", "resident"]),
        (vec![("EXPECT", "a,b")], vec!["/tmp/w", "1.5"]),
    ] {
        let (code, _, err) = dry(&env, &args);
        assert_eq!(code, 2, "{env:?} {args:?}: {err}");
    }
}
