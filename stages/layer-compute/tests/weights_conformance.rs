//! The `Weights` conformance suite (tests/conformance/mod.rs) against `SourceWeights` over
//! mmapped shards, on both tiny models; `tests/e2e/weights_conformance.rs` runs the same
//! suite against `StagedWeights` over live stages.

use crate::conformance;
use crate::support::*;
use k3_layer_compute::SourceWeights;
use k3_model::config::ModelConfig;
use k3_model::mmap_weights::MmapWeights;

fn run(model: &str) {
    let dir = fixtures().join(model).join("sharded");
    let cfg = ModelConfig::load_dir(&dir).unwrap();
    let src = MmapWeights::open(&dir).unwrap();
    let w = SourceWeights::new(MmapWeights::open(&dir).unwrap());
    conformance::check_pass(&w, &src, &cfg, cfg.n_layers());
    conformance::check_pass(&w, &src, &cfg, cfg.n_layers());
    // The oracle's greedy continuation (k3ref) through the same implementation.
    let oracle = read_json(&fixtures().join(model).join("expected-k3ref.json"));
    let (prompt, full) = (ids(&oracle, "prompt_ids"), ids(&oracle, "full_ids"));
    let got = conformance::greedy_ids(&w, &cfg, &prompt, full.len() - prompt.len());
    assert_eq!(got, &full[prompt.len()..], "{model}: ids vs k3ref");
}

#[test]
fn source_weights_conform_tiny_mxfp4() {
    let _kernels = kernels_shared();
    run("tiny-mxfp4");
}

#[test]
fn source_weights_conform_tiny_seed() {
    let _kernels = kernels_shared();
    run("tiny-seed");
}
