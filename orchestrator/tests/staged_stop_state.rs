//! The staged CLI: a stop string ends generation in the layer-compute stage too, not only
//! on stdout (tiny-chat model); `--save-state` / `--load-state` continue a generation with
//! the oracle's ids and refuse a foreign or damaged state (tiny fixtures); the progress
//! line during the trunk load and the prefill.

use std::process::Command;

use crate::tools_common::{bin, fixture, tiny_chat_model as model};
use serde_json::Value;

/// Run a generation; (exit code, stdout, stderr, report if written).
fn gen(extra: &[&str]) -> (i32, String, String, Option<Value>) {
    let m = model().to_str().unwrap();
    let out = tempfile::NamedTempFile::new().unwrap();
    let o = Command::new(bin())
        .args([m, "--tok", m, "--incremental", "--threads", "1"])
        .args(["--out", out.path().to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    let rep = std::fs::read(out.path())
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8(o.stdout).unwrap(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        rep,
    )
}

fn ids(r: &Value) -> Vec<u64> {
    r["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

#[test]
fn a_stop_string_stops_the_compute_stage_too() {
    let (code, full, err, rep) = gen(&["--prompt", "Hello there", "--gen", "8"]);
    assert_eq!(code, 0, "{err}");
    let rep = rep.unwrap();
    let full = full.trim_end_matches('\n').to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 8, "{full:?}");
    let stop: String = chars[3..5].iter().collect();
    let at = full.find(&stop).unwrap();
    // Without the stop, this run would take 400 steps.
    let (code, t, err, r) = gen(&["--prompt", "Hello there", "--gen", "400", "--stop", &stop]);
    assert_eq!(code, 0, "{err}");
    let r = r.unwrap();
    assert_eq!(t, format!("{}\n", &full[..at]));
    let n = ids(&r).len();
    assert_eq!(ids(&r)[..], ids(&rep)[..n]);
    let note = r["notes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .find(|s| s.contains("layer-compute stopped after"))
        .unwrap_or_else(|| panic!("no stop note in {}", r["notes"]))
        .to_string();
    let steps: usize = note
        .split("layer-compute stopped after ")
        .nth(1)
        .and_then(|x| x.split(' ').next())
        .and_then(|x| x.parse().ok())
        .unwrap();
    assert!(
        steps >= n && steps < 100,
        "compute ran {steps} steps for {n} kept tokens of --gen 400: {note}"
    );
}

/// The k3ref oracle of tiny-mxfp4: its prompt and its greedy continuation.
fn oracle() -> (Vec<u64>, Vec<u64>) {
    let v: Value =
        serde_json::from_slice(&std::fs::read(fixture("tiny-mxfp4/expected-k3ref.json")).unwrap())
            .unwrap();
    let full: Vec<u64> = v["full_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    let n = v["n_prompt"].as_u64().unwrap() as usize;
    (full[..n].to_vec(), full[n..].to_vec())
}

/// A run on a fixture model without a tokenizer; (exit code, stderr, report).
fn run_ids(model: &str, extra: &[&str]) -> (i32, String, Option<Value>) {
    let out = tempfile::NamedTempFile::new().unwrap();
    let o = Command::new(bin())
        .arg(fixture(model))
        .args([
            "--threads",
            "1",
            "-q",
            "--out",
            out.path().to_str().unwrap(),
        ])
        .args(extra)
        .output()
        .unwrap();
    let rep = std::fs::read(out.path())
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        rep,
    )
}

/// Generate N with --save-state, then --load-state and generate M: the N+M ids are the
/// k3ref oracle's greedy continuation (an oracle test, not a comparison with our own
/// uninterrupted run), in the staged pipeline and in --single-process, across the two
/// modes too (a state saved by one continues in the other).
#[test]
fn save_then_load_continues_with_the_oracle_ids() {
    let (prompt, want) = oracle();
    let ids = prompt
        .iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let dir = tempfile::tempdir().unwrap();
    let (n, m) = (7usize, 13usize);
    assert!(n + m <= want.len());
    for (save_mode, load_mode) in [
        (&[][..], &[][..]),
        (&["--single-process"][..], &["--single-process"][..]),
        (&["--single-process"][..], &[][..]),
    ] {
        let f = dir.path().join("s.k3state");
        let fs = f.to_str().unwrap();
        let mut a = vec!["--ids", &ids, "--gen", "7", "--save-state", fs];
        a.extend_from_slice(save_mode);
        let (code, err, r1) = run_ids("tiny-mxfp4/sharded", &a);
        assert_eq!(code, 0, "{save_mode:?}: {err}");
        let mut b = vec!["--gen", "13", "--load-state", fs];
        b.extend_from_slice(load_mode);
        let (code, err, r2) = run_ids("tiny-mxfp4/sharded", &b);
        assert_eq!(code, 0, "{load_mode:?}: {err}");
        let mut got = ids_of(&r1.unwrap());
        got.extend(ids_of(&r2.unwrap()));
        assert_eq!(got.len(), n + m);
        assert_eq!(got[..], want[..n + m], "{save_mode:?} then {load_mode:?}");
    }
}

fn ids_of(r: &Value) -> Vec<u64> {
    ids(r)
}

/// A state is refused (exit 2, a clear message) for another model, another configuration
/// (--layers), a wrong version and a bad checksum; nothing runs.
#[test]
fn a_state_of_another_model_version_or_checksum_is_refused() {
    let (prompt, _) = oracle();
    let ids = prompt
        .iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("s.k3state");
    let fs = f.to_str().unwrap();
    let (code, err, _) = run_ids(
        "tiny-mxfp4/sharded",
        &[
            "--ids",
            &ids,
            "--gen",
            "3",
            "--save-state",
            fs,
            "--single-process",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let good = std::fs::read(&f).unwrap();
    let refuse = |model: &str, extra: &[&str], needle: &str| {
        let mut a = vec!["--gen", "2", "--load-state", fs, "--single-process"];
        a.extend_from_slice(extra);
        let (code, err, _) = run_ids(model, &a);
        assert_eq!(code, 2, "{model} {extra:?}: {err}");
        assert!(err.contains(needle), "{model} {extra:?}: {err}");
    };
    refuse("tiny-seed/sharded", &[], "another model or configuration");
    refuse(
        "tiny-mxfp4/sharded",
        &["--layers", "3"],
        "another model or configuration",
    );
    let mut bad = good.clone();
    bad[8] = 99; // the version field
    std::fs::write(&f, &bad).unwrap();
    refuse("tiny-mxfp4/sharded", &[], "version 99");
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0x40; // one payload bit
    std::fs::write(&f, &bad).unwrap();
    refuse("tiny-mxfp4/sharded", &[], "checksum");
    std::fs::write(&f, &good[..good.len() / 2]).unwrap();
    refuse("tiny-mxfp4/sharded", &[], "truncated");
    std::fs::write(&f, b"hello").unwrap();
    refuse("tiny-mxfp4/sharded", &[], "not a k3 state file");
    // The good file still loads.
    std::fs::write(&f, &good).unwrap();
    let (code, err, _) = run_ids(
        "tiny-mxfp4/sharded",
        &["--gen", "2", "--load-state", fs, "--single-process"],
    );
    assert_eq!(code, 0, "{err}");
}

/// The progress of the trunk load and of the prefill reaches stderr (plain lines: stderr is
/// not a terminal here), and `--quiet` drops it.
#[test]
fn progress_lines_for_the_load_and_the_prefill() {
    let (prompt, _) = oracle();
    let ids = prompt
        .iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let m = fixture("tiny-mxfp4/sharded");
    let o = Command::new(bin())
        .arg(&m)
        .args([
            "--ids",
            &ids,
            "--gen",
            "2",
            "--threads",
            "1",
            "--incremental",
        ])
        .args(["--out", "/dev/null"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("trunk-loader: loading the trunk") && err.contains("(100%)"),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "prefill of {} tokens: layer 13 of 13 (100%)",
            prompt.len()
        )),
        "{err}"
    );
    assert!(
        !err.contains('\r'),
        "no carriage returns when stderr is not a terminal"
    );
    let o = Command::new(bin())
        .arg(&m)
        .args(["--ids", &ids, "--gen", "2", "--threads", "1", "-q"])
        .args(["--out", "/dev/null"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        !err.contains("loading the trunk") && !err.contains("prefill"),
        "{err}"
    );
}
