//! Reads before the router decides (`--speculate on`, issue 35): the guesses never change
//! a bit of the result, and the report's precision and recall are what an independent
//! count from `--dump-cache-trace` (the real requests, and `guess_trace.bin`) gives.
//!
//! Tiny-mxfp4, staged, with a small expert cache (experts stream, and there is room for
//! guess reads), and the prompt in passes of two tokens: the routers are learned in the
//! first pass, so the pass whose logits `--dump-logits` writes runs with guesses. Also at
//! the tightest budget, a cache of one decode request (2 slots, top-2: what the slice at
//! `--mem-gb 5.5` is with 16 slots and top-16), where guesses read into the slots of the
//! layer just passed and a request may take over a wrong guess read in flight.

use std::collections::{BTreeMap, BTreeSet};

use crate::common::*;

const MODEL: &str = "tiny-mxfp4/sharded";

/// `--cache-gb` for 16 slots of tiny-mxfp4's experts (12,288 bytes each).
const ROOMY: &str = "0.0002";
/// `--cache-gb` for 2 slots: one decode request (top-2).
const TIGHT: &str = "0.000025";

/// One staged run with `--speculate on|off` and `--cache-gb cache`, its trace in
/// `dir/trace`; returns the report and the dumped logits.
fn run_spec(on: bool, cache: &str, dir: &std::path::Path) -> (serde_json::Value, Vec<f32>) {
    let (prompt, _) = oracle("tiny-mxfp4/expected-k3ref.json");
    let m = fixtures().join(MODEL);
    let out = dir.join("run.json");
    let logits = dir.join("logits.f32");
    let trace = dir.join("trace");
    let ids = join(&prompt);
    let args = [
        m.to_str().unwrap(),
        "--ids",
        &ids,
        "--gen",
        "8",
        "--quiet",
        "--cache-gb",
        cache,
        "--speculate",
        if on { "on" } else { "off" },
        "--out",
        out.to_str().unwrap(),
        "--dump-logits",
        logits.to_str().unwrap(),
        "--dump-cache-trace",
        trace.to_str().unwrap(),
    ];
    // The prompt in passes of two tokens (the plan's test hook; `--prefill-chunk` is
    // `--prompts`' only).
    let o = std::process::Command::new(bin())
        .args(args)
        .env("K3_TEST_HOOKS", "1")
        .env("K3_PREFILL_CHUNK", "2")
        .output()
        .expect("run k3-orch");
    assert!(o.status.success(), "--speculate {on}: {}", text(&o));
    (json(&out), f32s(&std::fs::read(&logits).unwrap()))
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Catches: a guess read that lands somewhere a request later reads from (another slot,
/// another offset in its slot, a slot still held), or that the forward waits for and
/// reads, changing a bit of the logits or an id; and a `--speculate on` that guesses
/// nothing in the pass whose logits are compared (the comparison would then prove
/// nothing).
#[test]
fn speculation_keeps_ids_and_logits_bit_identical() {
    let (d_off, d_on) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (r_off, l_off) = run_spec(false, ROOMY, d_off.path());
    let (r_on, l_on) = run_spec(true, ROOMY, d_on.path());
    assert_eq!(
        u32s(&r_on["generated_ids"]),
        u32s(&r_off["generated_ids"]),
        "ids"
    );
    assert_bits_eq("first-step logits, speculate on vs off", &l_on, &l_off);
    assert!(r_off["totals"].get("speculation").is_none(), "off guessed");
    let g = &r_on["totals"]["speculation"];
    assert!(g["guesses"].as_u64().unwrap() > 0, "{g}");
    assert!(g["reads"].as_u64().unwrap() > 0, "no guess was read: {g}");
    // The prompt's last pass (the one whose logits are dumped) was guessed in.
    let (prompt, _) = oracle("tiny-mxfp4/expected-k3ref.json");
    let last_prompt_pass = prompt.len().div_ceil(2) as i32;
    let guesses = i32s(&std::fs::read(d_on.path().join("trace/guess_trace.bin")).unwrap());
    assert!(
        guesses.chunks_exact(3).any(|t| t[0] == last_prompt_pass),
        "no guess in pass {last_prompt_pass}"
    );
}

/// Catches: precision or recall counted over other sets than "the guess of a layer
/// against that layer's request in the same pass" (e.g. against the next request
/// whatever its layer, or counting duplicates), and a report whose counters do not match
/// the guesses and requests the fetcher saw.
#[test]
fn speculation_precision_recall_match_the_cache_trace() {
    let d = tempfile::tempdir().unwrap();
    let (r, _) = run_spec(true, ROOMY, d.path());
    let trace = i32s(&std::fs::read(d.path().join("trace/expert_trace.bin")).unwrap());
    let guesses = i32s(&std::fs::read(d.path().join("trace/guess_trace.bin")).unwrap());
    // The requests by (pass, layer): a batch's requests are consecutive and within a pass
    // the layers only go up, so a pass starts where the layer goes down (passes count
    // from 1, as compute numbers them, and every pass asks for layer 1's experts).
    let mut asked: BTreeMap<(i32, i32), BTreeSet<i32>> = BTreeMap::new();
    let (mut pass, mut prev) = (0, i32::MAX);
    for pair in trace.chunks_exact(2) {
        if pair[0] < prev {
            pass += 1;
        }
        prev = pair[0];
        asked.entry((pass, pair[0])).or_default().insert(pair[1]);
    }
    let mut guessed: BTreeMap<(i32, i32), BTreeSet<i32>> = BTreeMap::new();
    for t in guesses.chunks_exact(3) {
        guessed.entry((t[0], t[1])).or_default().insert(t[2]);
    }
    let (mut n_guessed, mut correct, mut actual) = (0u64, 0u64, 0u64);
    for (key, g) in &guessed {
        n_guessed += g.len() as u64;
        if let Some(a) = asked.get(key) {
            actual += a.len() as u64;
            correct += g.intersection(a).count() as u64;
        }
    }
    let s = &r["totals"]["speculation"];
    let got = |k: &str| s[k].as_u64().unwrap();
    assert_eq!(got("guesses"), guessed.len() as u64, "{s}");
    assert_eq!(
        (got("guessed"), got("correct"), got("actual")),
        (n_guessed, correct, actual),
        "{s}"
    );
    assert!(
        correct > 0 && correct < n_guessed,
        "a degenerate count: {s}"
    );
    let precision = correct as f64 / n_guessed as f64;
    let recall = correct as f64 / actual as f64;
    assert!(
        (s["precision"].as_f64().unwrap() - precision).abs() < 1e-12,
        "{s}"
    );
    assert!(
        (s["recall"].as_f64().unwrap() - recall).abs() < 1e-12,
        "{s}"
    );
}

/// At a cache of one decode request (2 slots, top-2), where a reserve of the largest
/// request seen read no guess at all. Catches: no guess read there (`reads` 0), a guess
/// that evicts a held expert or lands where a request reads from, or a taken-over slot
/// read into while its guess read still writes it (a bit of the logits or an id would
/// change), and a request that fails for want of a slot.
#[test]
fn speculation_reads_guesses_in_a_cache_of_one_request_with_the_same_bits() {
    let (d_off, d_on) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (r_off, l_off) = run_spec(false, TIGHT, d_off.path());
    let (r_on, l_on) = run_spec(true, TIGHT, d_on.path());
    let slots = &r_on["stage_summaries"]["expert-fetcher"]["slots"];
    assert_eq!(slots.as_u64(), Some(2), "not the tight cache: {slots}");
    assert_eq!(
        u32s(&r_on["generated_ids"]),
        u32s(&r_off["generated_ids"]),
        "ids"
    );
    assert_bits_eq("first-step logits, speculate on vs off", &l_on, &l_off);
    let g = &r_on["totals"]["speculation"];
    assert!(g["reads"].as_u64().unwrap() > 0, "no guess was read: {g}");
    assert!(
        g["saved"].as_u64().unwrap() > 0,
        "no guess served a request: {g}"
    );
}
