//! The staged CLI on the tiny-chat model (`synth --shape tiny-chat`): a stop string ends
//! generation in the layer-compute stage too, not only on stdout; `--save-state` /
//! `--load-state` continue a generation.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_k3-orch")
}

fn model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("k3-stopstate-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let o = Command::new(bin())
            .args(["synth", "--shape", "tiny-chat", d.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        d
    })
}

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
