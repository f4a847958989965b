//! End-to-end: the memory ladder on the tiny model. Four budgets from the streaming floor
//! (one ring slot, nothing pinned, the smallest expert arena) to everything resident, each a
//! separate staged run with per-stage cgroups: every rung must produce the oracle's ids.
//!
//! Catches any budget-dependent result: a ring slot recycled while compute still reads it,
//! an expert slot evicted mid-batch, a pinned prefix published out of order.

use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_k3-orch")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

#[test]
fn four_rungs_same_ids_as_the_oracle() {
    let model = fixtures().join("tiny-mxfp4/sharded");
    let v: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("tiny-mxfp4/expected-k3ref.json")).unwrap(),
    )
    .unwrap();
    let ids = |k: &str| -> Vec<u64> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    let (prompt, full) = (ids("prompt_ids"), ids("full_ids"));
    let n = 8;
    let want: Vec<String> = full[prompt.len()..prompt.len() + n]
        .iter()
        .map(|x| x.to_string())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let trunk = dir.path().join("trunk");
    let o = Command::new(bin())
        .arg("pack-trunk")
        .arg(&model)
        .arg(&trunk)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Each rung is a total for the whole run (--mem-gb). The tiny run holds about 21.5 MB
    // whatever the budget (state, scratch, four stage processes); its trunk is 2.89 MB in 13
    // runs of <= 229,376 bytes: 0.0229 GB (less the 5% reserve) leaves one ring slot and nothing pinned (the
    // floor); 0.0315 GB pins all 13 layers and leaves a cache.
    let out = dir.path().join("ladder");
    let o = Command::new(bin())
        .arg("ladder")
        .arg(&model)
        .arg("--trunk")
        .arg(&trunk)
        .args([
            "--ids",
            &prompt
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(","),
            "--gen",
            &n.to_string(),
            "--rungs-gb",
            "0.0229,0.0236,0.0242,0.0315",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let tsv = std::fs::read_to_string(out.join("ladder.tsv")).unwrap();
    let rows: Vec<&str> = tsv.lines().skip(1).collect();
    assert_eq!(rows.len(), 4, "{tsv}");
    let pinned: Vec<u64> = rows
        .iter()
        .map(|r| r.split('\t').nth(3).unwrap().parse().unwrap())
        .collect();
    // The floor holds one slot for the largest part; what is left beside it may pin a
    // small part (parts pin a set, not a prefix), so the floor is told by its reads: every
    // larger rung reads fewer bytes per token, and the top one pins every layer.
    let read: Vec<f64> = rows
        .iter()
        .map(|r| r.split('\t').nth(7).unwrap().parse().unwrap())
        .collect();
    assert!(
        read.windows(2).all(|w| w[1] < w[0]),
        "reads must fall rung by rung: {tsv}"
    );
    assert!(
        pinned[0] <= 1,
        "the floor pins at most one small part: {tsv}"
    );
    assert_eq!(pinned[3], 13, "the top rung pins every layer: {tsv}");
    for r in rows {
        assert_eq!(r.rsplit('\t').next().unwrap(), want.join(","), "{tsv}");
    }
}
