//! The streaming tools through the real `k3-orch` binary: `sim-cache` reprints the seed's
//! published table from the seed's recorded trace (the oracle is that table, transcribed),
//! `devbw` and `doctor` run and report, and usage errors exit 2.

use std::io::Write;

use crate::tools_common::{fixture, k3_cmd as k3};

/// Rows of the seed's section 13 table: size, slots, LRU, BELADY, PIN+LRU, GB/tok, s/tok.
/// A simulator with GB as GiB, a wrong Belady, or PIN+LRU hits on first touch fails here.
#[test]
fn sim_cache_reprints_the_seed_table() {
    let out = k3()
        .arg("sim-cache")
        .arg(fixture("seed/expert_trace.bin"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let rows = [
        "8 GB 455 36.24% 39.42% 37.82% 16.47 13.35",
        "16 GB 911 36.24% 42.61% 39.42% 16.47 13.35",
        "32 GB 1823 36.24% 48.99% 42.57% 16.47 13.35",
        "64 GB 3647 36.24% 61.74% 48.66% 16.47 13.35",
        "128 GB 7294 49.19% 84.59% 62.86% 13.12 10.64",
        "192 GB 10941 90.00% 90.00% 90.00% 2.58 2.09",
        "1450 GB 82633 90.00% 90.00% 90.00% 2.58 2.09",
    ];
    let lines: Vec<String> = text
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    for r in rows {
        assert!(lines.iter().any(|l| l == r), "missing row {r:?} in\n{text}");
    }
    assert!(text.contains("trace: 100096 requests, 10010 distinct experts"));
    assert!(text.contains("90.00% hit rate for ANY policy"));
}

/// `--other-read-gb` adds the plan's trunk + lm_head reads to every row: at 8 GB the seed's
/// 16.47 GB/token of expert misses plus 2.5 GB is 18.97 GB, 15.38 s at 1233.6 MB/s.
#[test]
fn sim_cache_adds_the_plans_other_reads() {
    let out = k3()
        .args(["sim-cache", "--sizes-gb", "8", "--other-read-gb", "2.5"])
        .arg(fixture("seed/expert_trace.bin"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<String> = text
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    assert!(rows.iter().any(|l| l == "8 GB 16.47 18.97 15.38"), "{text}");
    let bad = k3()
        .args(["sim-cache", "--other-read-gb", "-1"])
        .arg(fixture("seed/expert_trace.bin"))
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

#[test]
fn sim_cache_extra_policies_and_errors() {
    let out = k3()
        .args(["sim-cache", "--policy", "s3fifo,lfu", "--sizes-gb", "8"])
        .arg(fixture("seed/expert_trace.bin"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("S3-FIFO") && text.contains("LFU"), "{text}");
    let bad = k3()
        .args(["sim-cache", "--policy", "mru"])
        .arg(fixture("seed/expert_trace.bin"))
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let missing = k3()
        .args(["sim-cache", "/nonexistent/trace.bin"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
    let usage = k3().args(["sim-cache"]).output().unwrap();
    assert_eq!(usage.status.code(), Some(2));
}

#[test]
fn devbw_measures_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("blob");
    std::fs::File::create(&p)
        .unwrap()
        .write_all(&vec![1u8; 20 << 20])
        .unwrap();
    let out = k3()
        .args(["devbw", "--seconds", "0"])
        .arg(&p)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("16 MiB") && text.contains("17547264 B"),
        "{text}"
    );
    assert_eq!(
        text.lines().filter(|l| l.contains(" 16 ")).count(),
        2,
        "{text}"
    );
    // Too small for one read: a clear error, exit 1.
    let small = dir.path().join("small");
    std::fs::write(&small, [0u8; 100]).unwrap();
    let out = k3()
        .args(["devbw", "--seconds", "0"])
        .arg(&small)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn doctor_reports_every_check() {
    let out = k3()
        .args(["doctor", "--seconds", "0"])
        .arg(fixture("tiny-seed"))
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    for key in [
        "cpu ", "memory ", "preset ", "disk ", "cgroups ", "numa ", "next ",
    ] {
        assert!(text.contains(key), "no {key:?} line in\n{text}");
    }
    // The tiny model fits whole on any machine that can run the tests.
    assert!(out.status.success(), "{text}");
    // It names the product path a run gets, and why (issue 32): the portable cap gives
    // the exact path's portable kernels whatever the CPU. Catches a path line that names
    // the CPU's best kernels instead of what K3_SIMD selects.
    let capped = k3()
        .env("K3_SIMD", "exact,portable")
        .args(["doctor", "--seconds", "0"])
        .arg(fixture("tiny-seed"))
        .output()
        .unwrap();
    let capped = String::from_utf8(capped.stdout).unwrap();
    assert!(
        capped.contains(
            "path       : exact/portable (the product path K3_SIMD asks for; instruction \
             sets capped at portable by K3_SIMD)"
        ),
        "{capped}"
    );
    let bad = k3()
        .args(["doctor", "/nonexistent/model"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    // A directory that is not a checkpoint gets no pack-trunk advice that would fail (it
    // used to suggest `pack-trunk DIR DIR-trunk`), and exit 2.
    let empty = tempfile::tempdir().unwrap();
    let out = k3()
        .args(["doctor", "--seconds", "0"])
        .arg(empty.path())
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("is not a checkpoint"), "{text}");
    assert!(!text.contains("pack-trunk"), "{text}");
}
