//! Up-front refusals and memory limits through the CLI (issue 13, item 7 and "untested
//! paths"): the memory plan counts the cgroup k3 itself runs in, so inside a small cgroup
//! the tiny model is refused (exit 2) or fits and gives the oracle's ids, never OOM-killed;
//! the KV-cache refusal counts a text prompt's positions; `--preset auto` sizes the budgets
//! from the memory really available.
//!
//! The cgroup tests make a memory cgroup (root, or a delegated cgroup); where that is not
//! possible they print `SKIPPED:` (and fail under K3_REQUIRE_PRIVILEGED_TESTS=1).

use crate::common::*;

const MODEL: &str = "tiny-mxfp4/sharded";
const ORACLE: &str = "tiny-mxfp4/expected-k3ref.json";
const MB: u64 = 1 << 20;

/// Args of a greedy run of the oracle prompt, report to `out`.
fn args<'a>(model: &'a str, ids: &'a str, gen: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![model, "--ids", ids, "--gen", gen, "--quiet", "--out", out]
}

/// Inside a memory cgroup of 8 to 24 MB the run is either refused up front (exit 2, the
/// plan's REFUSING line) or fits and gives the oracle's ids; at 64 MB it fits. Catches a
/// plan that reads only MemAvailable (the host's memory): at 8 MB that run was OOM-killed
/// (exit 1, "killed by the kernel OOM killer"), since four stage processes do not fit; and
/// a plan that over-refuses (the 64 MB run).
#[test]
fn small_cgroup_refuses_up_front_or_fits() {
    let (prompt, want) = oracle(ORACLE);
    let m = fixtures().join(MODEL);
    let ids = join(&prompt);
    for mb in [8u64, 12, 16, 24, 64] {
        let cg = match TestCgroup::new(&format!("limit{mb}"), mb * MB) {
            Ok(cg) => cg,
            Err(why) => return skip("small_cgroup_refuses_up_front_or_fits", &why),
        };
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run.json");
        let o = cg.run(&args(m.to_str().unwrap(), &ids, "4", out.to_str().unwrap()));
        let t = text(&o);
        println!("{mb} MB: exit {:?}", o.status.code());
        assert!(!t.contains("OOM killer"), "{mb} MB: OOM-killed:\n{t}");
        assert_eq!(cg.oom_kills(), 0, "{mb} MB: OOM kill in the cgroup:\n{t}");
        match o.status.code() {
            Some(0) => {
                assert_eq!(u32s(&json(&out)["generated_ids"]), want[..4], "{mb} MB");
            }
            Some(2) if mb < 64 => {
                assert!(t.contains("REFUSING TO START"), "{mb} MB:\n{t}");
                assert!(!out.exists(), "{mb} MB: a refused run wrote a report");
            }
            _ => panic!("{mb} MB: neither refused (exit 2) nor a clean run:\n{t}"),
        }
    }
}

/// The plan refusal through the CLI: in an 8 MB cgroup the tiny model (four stage processes
/// and 4.2 MB of plan items) cannot fit; the refusal comes before any stage starts, names
/// the need, what is available and the shortfall, and offers the options. Catches a plan
/// check that is skipped, or one that compares against the host instead of the cgroup.
#[test]
fn plan_refusal_names_the_shortfall() {
    let cg = match TestCgroup::new("refuse", 8 * MB) {
        Ok(cg) => cg,
        Err(why) => return skip("plan_refusal_names_the_shortfall", &why),
    };
    let (prompt, _) = oracle(ORACLE);
    let m = fixtures().join(MODEL);
    let ids = join(&prompt);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run.json");
    let t0 = std::time::Instant::now();
    let o = cg.run(&args(m.to_str().unwrap(), &ids, "4", out.to_str().unwrap()));
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    for want in ["REFUSING TO START", "shortfall of", "Options:", "cgroup"] {
        assert!(t.contains(want), "missing {want:?}:\n{t}");
    }
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(20),
        "a refusal must come up front"
    );
}

/// The KV-cache refusal counts the prompt: a 30,000-byte --prompt-file with --gen 1
/// --incremental needs up to 30,002 cached positions (3.2 KB each on the tiny model, 96 MB)
/// and a 64 MB cgroup cannot hold them. Catches the old wiring (positions = gen + 1 for
/// --prompt/--prompt-file, ignoring the prompt), which accepted it. The same prompt given as
/// --ids is refused the same way, and a short prompt is not refused.
#[test]
fn kv_refusal_counts_the_prompt() {
    let cg = match TestCgroup::new("kv", 64 * MB) {
        Ok(cg) => cg,
        Err(why) => return skip("kv_refusal_counts_the_prompt", &why),
    };
    let m = fixtures().join(MODEL);
    let tok = fixtures().join("tokenizer");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run.json");
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, "[".repeat(30_000)).unwrap();
    let common = [
        "--gen",
        "1",
        "--incremental",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ];
    let mut a = vec![
        m.to_str().unwrap(),
        "--tok",
        tok.to_str().unwrap(),
        "--prompt-file",
        file.to_str().unwrap(),
    ];
    a.extend_from_slice(&common);
    let o = cg.run(&a);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "--prompt-file:\n{t}");
    assert!(
        t.contains("REFUSING: the KV cache for 30002 positions"),
        "--prompt-file:\n{t}"
    );
    let ids = join(&vec![58u32; 30_000]);
    let mut a = vec![m.to_str().unwrap(), "--ids", &ids];
    a.extend_from_slice(&common);
    let o = cg.run(&a);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "--ids:\n{t}");
    assert!(
        t.contains("REFUSING: the KV cache for 30002 positions"),
        "--ids:\n{t}"
    );
    let (prompt, want) = oracle(ORACLE);
    let ids = join(&prompt);
    let mut a = vec![m.to_str().unwrap(), "--ids", &ids];
    a.extend_from_slice(&common);
    let o = cg.run(&a);
    assert!(o.status.success(), "short prompt:\n{}", text(&o));
    assert_eq!(u32s(&json(&out)["generated_ids"]), want[..1]);
}

/// `--preset auto` through the CLI sizes trunk + cache from the memory available to the
/// run: on this machine it runs and gives the oracle's ids with budgets within
/// MemAvailable; inside a 64 MB cgroup its budgets stay within the cgroup. Catches an auto
/// preset sized from the host's MemAvailable inside a container (gigabytes in 64 MB), and
/// an auto that fails or changes the ids.
#[test]
fn preset_auto_sizes_from_available_memory() {
    let (prompt, want) = oracle(ORACLE);
    let m = fixtures().join(MODEL);
    let ids = join(&prompt);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run.json");
    let mut a = args(m.to_str().unwrap(), &ids, "4", out.to_str().unwrap());
    a.extend_from_slice(&["--preset", "auto"]);
    let o = run(&a);
    assert!(o.status.success(), "{}", text(&o));
    let r = json(&out);
    assert_eq!(u32s(&r["generated_ids"]), want[..4]);
    let budget = |r: &serde_json::Value| {
        r["plan"]["trunk_budget_bytes"].as_u64().unwrap()
            + r["plan"]["cache_budget_bytes"].as_u64().unwrap()
    };
    let avail = r["plan"]["available_bytes"].as_u64().unwrap();
    assert!(
        budget(&r) <= avail,
        "auto budgets {} > available {avail}",
        budget(&r)
    );
    // The default budgets (16 + 64 GB) are not what auto gives.
    assert_ne!(
        budget(&r),
        80_000_000_000,
        "--preset auto left the default budgets"
    );

    let cg = match TestCgroup::new("auto", 64 * MB) {
        Ok(cg) => cg,
        Err(why) => {
            return skip(
                "preset_auto_sizes_from_available_memory (cgroup part)",
                &why,
            )
        }
    };
    std::fs::remove_file(&out).unwrap();
    let o = cg.run(&a);
    assert!(o.status.success(), "64 MB cgroup:\n{}", text(&o));
    let r = json(&out);
    assert_eq!(u32s(&r["generated_ids"]), want[..4]);
    assert!(
        budget(&r) <= 64 * MB,
        "auto budgets {} exceed the 64 MB cgroup",
        budget(&r)
    );
}

// Issue 36 (test item 4): the KV-cache refusal without root. `--mem-gb` caps the room the
// KV cache may take, so a 30,000-token prompt whose cache (about 96 MB on this model) fits
// the machine but not a 0.05 GB budget is refused as a KV cache that does not fit (exit 2),
// before the rest of the plan is weighed; the oracle prompt runs at 1 GB.
// Catches a KV check against the machine's memory only (then the refusal is the whole
// plan's, "REFUSING TO START", which hides the cause) and a cache sized for `--gen` without
// the prompt (positions = prompt + gen + 1).
#[test]
fn the_kv_cache_refusal_honours_mem_gb() {
    let m = fixtures().join(MODEL);
    let long = join(&vec![58u32; 30_000]);
    let o = run(&[
        m.to_str().unwrap(),
        "--ids",
        &long,
        "--gen",
        "1",
        "--incremental",
        "--quiet",
        "--mem-gb",
        "0.05",
    ]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(
        t.contains("REFUSING: the KV cache for 30002 positions"),
        "{t}"
    );
    let (prompt, want) = oracle(ORACLE);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run.json");
    let o = run(&[
        m.to_str().unwrap(),
        "--ids",
        &join(&prompt),
        "--gen",
        "1",
        "--incremental",
        "--quiet",
        "--mem-gb",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "short prompt:\n{}", text(&o));
    assert_eq!(u32s(&json(&out)["generated_ids"]), want[..1]);
}

/// Layers kept coded (`--trunk-resident coded`) live in the trunk-loader's arena, which
/// its cgroup pays for: inside a 128 MB cgroup (a coded trunk's decode buffers alone take
/// about 50 MB) a run that keeps every layer of a coded trunk coded fits, is never
/// OOM-killed and gives the oracle's ids, and its plan gives the trunk-loader exactly its
/// arena: pinned, ring and the kept bytes (the loader's own count). Catches kept runs
/// allocated outside the plan (the loader's share would not hold them) or a plan that
/// counts them at their decoded size.
#[test]
fn kept_coded_layers_fit_a_small_cgroup() {
    let cg = match TestCgroup::new("kept", 128 * MB) {
        Ok(cg) => cg,
        Err(why) => return skip("kept_coded_layers_fit_a_small_cgroup", &why),
    };
    let (prompt, want) = oracle(ORACLE);
    let m = fixtures().join(MODEL);
    let dir = tempfile::tempdir().unwrap();
    let coded = dir.path().join("coded");
    let o = run(&[
        "pack-trunk",
        m.to_str().unwrap(),
        coded.to_str().unwrap(),
        "--codec",
        "bf16-zstd",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = dir.path().join("run.json");
    let ids = join(&prompt);
    let mut a = args(m.to_str().unwrap(), &ids, "4", out.to_str().unwrap());
    a.extend_from_slice(&[
        "--trunk",
        coded.to_str().unwrap(),
        "--trunk-resident",
        "coded",
    ]);
    let o = cg.run(&a);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert_eq!(cg.oom_kills(), 0, "OOM kill in the cgroup:\n{t}");
    let r = json(&out);
    assert_eq!(u32s(&r["generated_ids"]), want[..4]);
    let c = &r["stage_summaries"]["trunk-loader"]["codec"];
    assert_eq!(c["kept_layers"].as_u64(), Some(13), "{c}");
    let kept = c["kept_bytes"].as_u64().unwrap();
    let stored = json(&coded.join("trunk.json"))["codec"]["file_size"]
        .as_u64()
        .unwrap();
    assert_eq!(kept, stored, "every layer's stored run, padded");
    // The plan's trunk lines (its decode buffers apart) are the loader's arena: pinned,
    // ring and kept runs.
    let plan = &r["plan"];
    let lines: u64 = plan["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["stage"] == "trunk-loader" && i["what"] != "trunk decode buffers")
        .map(|i| i["bytes"].as_u64().unwrap())
        .sum();
    let p = &r["stage_summaries"]["trunk-loader"]["plan"];
    let arena = p["pinned_bytes"].as_u64().unwrap()
        + p["ring_slots"].as_u64().unwrap() * p["slot_bytes"].as_u64().unwrap()
        + kept;
    assert_eq!(
        lines, arena,
        "the plan's trunk lines against the loader's arena: {plan}"
    );
    assert_eq!(plan["trunk_kept_bytes"].as_u64(), Some(kept));
}
