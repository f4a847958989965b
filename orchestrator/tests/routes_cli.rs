//! `--record-routes FILE` and what reads it: the same ids with and without it, staged and
//! `--single-process` writing the same file, every (position, MoE layer) recorded once;
//! `sim-cache` and `project --trace` taking the trace; `project` on the tiny model's
//! directory printing the bytes a token touches as the tensor catalog adds them up.

use std::collections::BTreeSet;
use std::path::Path;

use crate::tools_common::{k3_ok, read_json, tiny_sharded as tiny};
use k3_protocol::routes::RouteTrace;

const IDS: &str = "77,198,74";
const GEN: usize = 4;

/// Run the tiny model (`extra` flags) and return its generated ids.
fn ids_of(dir: &Path, name: &str, extra: &[&str]) -> serde_json::Value {
    let out = dir.join(format!("{name}.json"));
    let t = tiny();
    let gen = GEN.to_string();
    let mut args = vec![
        t.to_str().unwrap(),
        "--ids",
        IDS,
        "--gen",
        &gen,
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    k3_ok(&args);
    read_json(&out)["generated_ids"].clone()
}

/// Recording routes changes no id (staged and single-process); both modes write the same
/// bytes (same fingerprint, same routes in the same order); every position of the run
/// has exactly one record in every MoE layer, except the prompt rows the last layer skips
/// (only the last prompt row's logits are wanted), each a top-k of distinct experts of the
/// model. Catches positions taken from the pass instead of the session, a layer recorded
/// twice or not at all, and routes recorded in one mode only.
#[test]
fn record_routes_keeps_the_ids_and_records_every_route_once() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = ids_of(tmp.path(), "plain", &[]);
    let staged = tmp.path().join("staged.routes");
    let single = tmp.path().join("single.routes");
    assert_eq!(
        ids_of(
            tmp.path(),
            "staged",
            &["--record-routes", staged.to_str().unwrap()]
        ),
        plain
    );
    assert_eq!(
        ids_of(
            tmp.path(),
            "single",
            &[
                "--single-process",
                "--record-routes",
                single.to_str().unwrap()
            ]
        ),
        plain
    );
    assert_eq!(
        std::fs::read(&staged).unwrap(),
        std::fs::read(&single).unwrap(),
        "staged and single-process routes differ"
    );
    let t = RouteTrace::read(&staged).unwrap();
    let cfg = k3_model::config::ModelConfig::load_dir(tiny()).unwrap();
    let moe: Vec<u32> = cfg
        .moe_layer_indices()
        .into_iter()
        .map(|l| l as u32)
        .collect();
    assert!(!moe.is_empty());
    assert_eq!(t.header.moe_layers, moe);
    assert_eq!(t.header.experts as usize, cfg.num_experts);
    assert_eq!(t.header.top_k as usize, cfg.num_experts_per_token);
    assert_eq!(t.header.layers as usize, cfg.num_hidden_layers);
    assert_eq!(t.header.fingerprint.len(), 64, "{}", t.header.fingerprint);
    let prompt = IDS.split(',').count() as u32;
    let positions = prompt + GEN as u32 - 1;
    let last = cfg.num_hidden_layers as u32 - 1;
    let mut seen = BTreeSet::new();
    for r in t.routes() {
        assert!(seen.insert((r.position, r.layer)), "{r:?} twice");
        let distinct: BTreeSet<_> = r.ids.iter().collect();
        assert_eq!(distinct.len(), r.ids.len(), "{r:?}");
    }
    let mut want = BTreeSet::new();
    for &l in &moe {
        let first = if l == last { prompt - 1 } else { 0 };
        for p in first..positions {
            want.insert((p, l));
        }
    }
    assert_eq!(seen, want);
}

/// `sim-cache` reads a route trace (its header gives the pool and top-k) and reports LRU,
/// S3-FIFO and pinned-hot; `project --trace` takes its hit rate from the trace and says
/// so. A cache trace (`--dump-cache-trace`) still replays.
#[test]
fn sim_cache_and_project_take_a_route_trace() {
    let tmp = tempfile::tempdir().unwrap();
    let routes = tmp.path().join("r.routes");
    let cache = tmp.path().join("cache");
    ids_of(
        tmp.path(),
        "rec",
        &[
            "--record-routes",
            routes.to_str().unwrap(),
            "--dump-cache-trace",
            cache.to_str().unwrap(),
        ],
    );
    let r = routes.to_str().unwrap();
    let out = k3_ok(&["sim-cache", r, "--pool-pct", "25,50,100"]);
    for key in [
        "route trace:",
        "LRU",
        "S3-FIFO",
        "PINNED",
        "25.0% pool",
        "top-2",
    ] {
        assert!(out.contains(key), "no {key:?} in\n{out}");
    }
    let bin = cache.join("expert_trace.bin");
    let out = k3_ok(&["sim-cache", bin.to_str().unwrap(), "--pool-pct", "50"]);
    assert!(!out.contains("route trace:"), "{out}");
    let t = tiny();
    let out = k3_ok(&[
        "project",
        t.to_str().unwrap(),
        "--ram-gb",
        "0.026",
        "--trace",
        r,
        "--drive-gbps",
        "7",
        "--mem-gbps",
        "50",
        "--gmacs-per-core",
        "10",
        "--cores",
        "4",
    ]);
    assert!(out.contains("LRU on the route trace"), "{out}");
}

/// `project` on the tiny model's directory with every machine figure given: the bytes a
/// token reads from RAM are the trunk (every layer tensor but the routed experts), the
/// lm_head, one embedding row and top-k experts in every MoE layer, summed here from the
/// safetensors headers; with the whole model in memory nothing is read from disk; at the
/// streaming floor the experts read from disk are the misses of a flat cache. Catches
/// bytes counted from a different catalog walk than the plan's (an expert's scales left
/// out, the embedding counted whole, the shared experts counted as routed).
#[test]
fn project_on_the_tiny_model_adds_up_its_catalog() {
    let t = tiny();
    let cat = k3_model::catalog::Catalog::open(&t).unwrap();
    let cfg = k3_model::config::ModelConfig::load_dir(&t).unwrap();
    let (mut trunk, mut lm_head, mut embed_row) = (0u64, 0u64, 0u64);
    let mut expert0 = 0u64;
    let mut any_expert = false;
    for (name, e) in cat.iter() {
        let routed = name.contains(".block_sparse_moe.experts.");
        if routed {
            any_expert = true;
            if name.contains(".layers.1.block_sparse_moe.experts.0.") {
                expert0 += e.len;
            }
        } else if name == "language_model.lm_head.weight" {
            lm_head = e.len;
        } else if name == "language_model.model.embed_tokens.weight" {
            embed_row = e.len / e.shape[0] as u64;
        } else if name.contains(".layers.") {
            trunk += e.len;
        }
    }
    assert!(any_expert && expert0 > 0 && lm_head > 0);
    let routed = (cfg.moe_layer_indices().len() * cfg.num_experts_per_token) as u64;
    let touched = trunk + lm_head + embed_row + routed * expert0;
    let run = |gb: &str| -> serde_json::Value {
        let out = k3_ok(&[
            "project",
            t.to_str().unwrap(),
            "--ram-gb",
            gb,
            "--json",
            "--drive-gbps",
            "7",
            "--mem-gbps",
            "50",
            "--gmacs-per-core",
            "10",
            "--cores",
            "4",
        ]);
        serde_json::from_str(out.lines().next().unwrap()).unwrap()
    };
    let big = run("4");
    assert_eq!(big["ram_bytes_per_token"].as_f64().unwrap(), touched as f64);
    assert_eq!(big["disk_bytes_per_token"].as_f64().unwrap(), 0.0, "{big}");
    let small = run("0.024");
    assert!(small.get("refused").is_none(), "{small}");
    let experts = (cfg.moe_layer_indices().len() * cfg.num_experts) as f64;
    let slots = small["cache_slots"].as_f64().unwrap();
    let miss = routed as f64 * (1.0 - (slots / experts).min(1.0)) * expert0 as f64;
    assert_eq!(
        small["expert_disk_bytes_per_token"].as_f64().unwrap(),
        miss,
        "{small}"
    );
}
