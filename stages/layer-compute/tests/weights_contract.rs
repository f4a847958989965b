//! The `Weights` contract as the forward uses it: tensors that do not bind are named,
//! `--layers N` binds only a prefix and brackets each layer with begin/end, expert arrival
//! order never changes a bit, and failed expert loads are counted, not silently dropped.

use std::cell::RefCell;

use crate::support::*;
use k3_layer_compute::weights::{expert_from_source, Delivery, ExpertRef, Weights};
use k3_layer_compute::{ForwardError, Model, ModelOptions, SourceWeights};
use k3_model::config::ModelConfig;
use k3_model::mmap_weights::MmapWeights;
use k3_model::tensor::{TensorRef, WeightError, WeightSource};

fn cfg(rel: &str) -> ModelConfig {
    ModelConfig::load_dir(fixtures().join(rel)).unwrap()
}

fn seed_ids() -> Vec<u32> {
    ids(
        &read_json(&fixtures().join("tiny-mxfp4/expected-k3ref.json")),
        "full_ids",
    )
}

/// A wrapper that logs lifecycle calls and delivers experts in a chosen order, optionally
/// failing some ids.
struct Wrapped {
    src: MmapWeights,
    log: RefCell<Vec<String>>,
    reverse: bool,
    fail_id: Option<u32>,
    hide: Option<&'static str>,
    /// `announce L ids` and `experts L ids`, in call order.
    expert_log: RefCell<Vec<String>>,
}

impl Weights for Wrapped {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        if self.hide.is_some_and(|h| name.ends_with(h)) {
            return Err(WeightError::Missing(name.into()));
        }
        self.src.tensor(name)
    }
    fn begin_layer(&self, l: usize) -> Result<(), WeightError> {
        self.log.borrow_mut().push(format!("begin {l}"));
        Ok(())
    }
    fn end_layer(&self, l: usize) {
        self.log.borrow_mut().push(format!("end {l}"));
    }
    fn announce_experts(&self, layer: usize, ids: &[u32]) {
        self.expert_log
            .borrow_mut()
            .push(format!("announce {layer} {ids:?}"));
    }
    fn experts(&self, layer: usize, ids: &[u32], deliver: &mut dyn for<'b> FnMut(Delivery<'b>)) {
        self.expert_log
            .borrow_mut()
            .push(format!("experts {layer} {ids:?}"));
        let mut order: Vec<usize> = (0..ids.len()).collect();
        if self.reverse {
            order.reverse();
        }
        let one = |slot: usize| -> Result<ExpertRef<'_>, WeightError> {
            if Some(ids[slot]) == self.fail_id {
                Err(WeightError::Io {
                    name: format!("expert {}", ids[slot]),
                    msg: "injected".into(),
                })
            } else {
                expert_from_source(&self.src, layer, ids[slot])
            }
        };
        // Reversed: in deliveries of up to 3 (uneven groups); else one at a time.
        let group = if self.reverse { 3 } else { 1 };
        for g in order.chunks(group) {
            deliver(g.iter().map(|&slot| (slot, one(slot))).collect());
        }
    }
}

fn wrapped(reverse: bool, fail_id: Option<u32>, hide: Option<&'static str>) -> Wrapped {
    Wrapped {
        src: MmapWeights::open(fixtures().join("tiny-mxfp4")).unwrap(),
        log: RefCell::new(Vec::new()),
        reverse,
        fail_id,
        hide,
        expert_log: RefCell::new(Vec::new()),
    }
}

// Every MoE layer announces its routed experts (the same ids, in the same order) before it
// asks for them, exactly once per layer and pass, and the logits are the plain source's bit
// for bit (the MoE computes the router alone, then the shared experts, then the routed
// ones). Catches a forward that never announces (no overlap of the reads with the shared
// experts), announces other ids than it fetches, or changes a value by the reordering.
#[test]
fn experts_are_announced_before_they_are_fetched() {
    let _kernels = kernels_shared();
    let full = seed_ids();
    let a = load("tiny-mxfp4", 1).forward_all(&full).unwrap();
    let m = Model::new(
        cfg("tiny-mxfp4"),
        wrapped(false, None, None),
        ModelOptions::default(),
    )
    .unwrap();
    let b = m.forward_all(&full).unwrap();
    assert_bits_eq("announced experts", &a.logits, &b.logits);
    let log = m.weights().expert_log.borrow().clone();
    assert!(!log.is_empty());
    assert_eq!(log.len() % 2, 0, "{log:?}");
    for pair in log.chunks(2) {
        let fetched = pair[1]
            .strip_prefix("experts ")
            .expect("experts after announce");
        assert_eq!(pair[0], format!("announce {fetched}"), "{log:?}");
    }
    let moe_layers = (0..cfg("tiny-mxfp4").n_layers())
        .filter(|&l| cfg("tiny-mxfp4").is_moe(l))
        .count();
    assert_eq!(log.len(), 2 * moe_layers, "{log:?}");
}

// Experts delivered in reverse order, several per delivery: per-slot outputs summed in
// top-k order, so the logits are bitwise identical (catches summing in arrival order, or
// a delivery of several experts that loses or swaps one).
#[test]
fn expert_arrival_order_does_not_matter() {
    let _kernels = kernels_shared();
    let full = seed_ids();
    let a = load("tiny-mxfp4", 1).forward_all(&full).unwrap();
    let m = Model::new(
        cfg("tiny-mxfp4"),
        wrapped(true, None, None),
        ModelOptions::default(),
    )
    .unwrap();
    let b = m.forward_all(&full).unwrap();
    assert_bits_eq("reverse arrival order", &a.logits, &b.logits);
    assert_eq!(b.stats.expert_failures, 0);
    assert!(b.stats.expert_requests > 0);
}

// A failed expert load is counted and reported (exit 4 upstream), never silent.
#[test]
fn failed_expert_is_counted() {
    let _kernels = kernels_shared();
    let m = Model::new(
        cfg("tiny-mxfp4"),
        wrapped(false, Some(3), None),
        ModelOptions::default(),
    )
    .unwrap();
    let out = m.forward_all(&seed_ids()).unwrap();
    assert!(out.stats.expert_failures > 0);
    assert!(out
        .stats
        .failure_msgs
        .iter()
        .any(|m| m.contains("injected")));
}

// --layers N binds only the prefix: layers 0..N begin and end in order, nothing beyond.
#[test]
fn layers_prefix_binds_only_the_prefix() {
    let _kernels = kernels_shared();
    let m = Model::new(
        cfg("tiny-mxfp4"),
        wrapped(false, None, None),
        ModelOptions {
            layers: Some(4),
            ..Default::default()
        },
    )
    .unwrap();
    let out = m.forward_all(&[1, 2, 3]).unwrap();
    assert_eq!(out.rows, 3);
    let log = m.weights().log.borrow().clone();
    let want: Vec<String> = (0..4)
        .flat_map(|l| [format!("begin {l}"), format!("end {l}")])
        .collect();
    assert_eq!(log, want);
    assert!(Model::new(
        cfg("tiny-mxfp4"),
        wrapped(false, None, None),
        ModelOptions {
            layers: Some(14),
            ..Default::default()
        }
    )
    .is_err());
}

// A tensor that does not bind is an error naming it (exit 1 upstream).
#[test]
fn missing_tensor_is_named() {
    let _kernels = kernels_shared();
    let m = Model::new(
        cfg("tiny-mxfp4"),
        wrapped(false, None, Some("layers.7.self_attn.kv_b_proj.weight")),
        ModelOptions::default(),
    )
    .unwrap();
    let e = m.check_binding().unwrap_err();
    assert!(matches!(e, ForwardError::Bind(_)));
    assert!(
        e.to_string()
            .contains("language_model.model.layers.7.self_attn.kv_b_proj.weight"),
        "{e}"
    );
    let e = m.forward_all(&[1]).unwrap_err();
    assert!(
        e.to_string()
            .contains("layers.7.self_attn.kv_b_proj.weight"),
        "{e}"
    );
    // Wrong shape: tiny-seed's shared experts (width 2 x 48) do not fit tiny-mxfp4's
    // config (2 x 64); the error names the tensor and both shapes.
    let m = Model::new(
        cfg("tiny-mxfp4"),
        SourceWeights::new(MmapWeights::open(fixtures().join("tiny-seed")).unwrap()),
        ModelOptions::default(),
    )
    .unwrap();
    let e = m.forward_all(&[1, 2]).unwrap_err().to_string();
    assert!(
        e.contains("shared_experts.gate_proj.weight") && e.contains("[96, 128]"),
        "{e}"
    );
}

// Token ids outside the vocabulary are refused, not indexed.
#[test]
fn bad_token_is_refused() {
    let _kernels = kernels_shared();
    let m = load("tiny-seed", 1);
    assert!(matches!(m.forward_all(&[256]), Err(ForwardError::Input(_))));
    assert!(matches!(m.forward_all(&[]), Err(ForwardError::Input(_))));
}

// The WeightSource adapter sees the MXFP4 experts of the released layout.
#[test]
fn source_adapter_finds_mxfp4_experts() {
    let _kernels = kernels_shared();
    let w = MmapWeights::open(fixtures().join("tiny-mxfp4/sharded")).unwrap();
    assert!(w.contains("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"));
    let e = expert_from_source(&w, 1, 0).unwrap();
    assert!(matches!(e.w1, k3_layer_compute::ExpertProj::Mxfp4 { .. }));
}

/// Delivers the source's experts, with the w1 scales of every expert of the first MoE layer
/// replaced by a copy holding an E8M0 0xFF (NaN) byte while `corrupt` is set (the first
/// layer only: its routes are the same pass after pass, where a later layer's follow what
/// the zeroed group changed).
struct NanScales {
    src: MmapWeights,
    corrupt: std::cell::Cell<bool>,
    copies: std::collections::HashMap<(usize, u32), Vec<u8>>,
}

impl NanScales {
    fn new() -> NanScales {
        let src = MmapWeights::open(fixtures().join("tiny-mxfp4")).unwrap();
        let c = cfg("tiny-mxfp4");
        let mut copies = std::collections::HashMap::new();
        for l in 0..c.n_layers() {
            for id in 0..c.num_experts as u32 {
                let name = k3_model::classify::expert_tensor(l, id as usize, "w1.weight_scale");
                if src.contains(&name) && copies.keys().all(|&(cl, _)| cl == l) {
                    let mut b = src.tensor(&name).unwrap().bytes.to_vec();
                    let mid = b.len() / 2;
                    b[mid] = 0xFF;
                    copies.insert((l, id), b);
                }
            }
        }
        assert!(!copies.is_empty(), "tiny-mxfp4 has MXFP4 experts");
        NanScales {
            src,
            corrupt: std::cell::Cell::new(false),
            copies,
        }
    }
}

impl Weights for NanScales {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        self.src.tensor(name)
    }
    fn experts(&self, layer: usize, ids: &[u32], deliver: &mut dyn for<'b> FnMut(Delivery<'b>)) {
        use k3_layer_compute::weights::ExpertProj;
        let one = |id: u32| -> Result<ExpertRef<'_>, WeightError> {
            let mut e = expert_from_source(&self.src, layer, id)?;
            if let (true, Some(b), ExpertProj::Mxfp4 { packed, scale }) =
                (self.corrupt.get(), self.copies.get(&(layer, id)), e.w1)
            {
                let scale = TensorRef { bytes: b, ..scale };
                e.w1 = ExpertProj::Mxfp4 { packed, scale };
            }
            Ok(e)
        };
        deliver(
            ids.iter()
                .enumerate()
                .map(|(s, &id)| (s, one(id)))
                .collect(),
        );
    }
}

// A model scans a routed expert's scales for NaN (E8M0 0xFF) the first time it binds it and
// not again once they were clean (`modules::ScaleChecks`: 1.4-1.5% of a decode's time);
// an expert whose scan failed is refused at every bind, and another model scans again.
// Catches: a memo marked whatever the scan found (the second pass over NaN scales would
// then run), one shared by every model, and one that never skips (the third pass fails).
#[test]
fn nan_scales_are_refused_at_every_bind_and_clean_ones_scanned_once() {
    let _kernels = kernels_shared();
    let ids = seed_ids();
    let nan = |r: Result<k3_layer_compute::ForwardOutput, ForwardError>| matches!(r, Err(ForwardError::NonFinite(ref m)) if m.contains("0xFF"));
    let m = Model::new(cfg("tiny-mxfp4"), NanScales::new(), ModelOptions::default()).unwrap();
    m.weights().corrupt.set(true);
    assert!(nan(m.forward_all(&ids)), "first pass over NaN scales");
    assert!(nan(m.forward_all(&ids)), "second pass over NaN scales");
    let clean = Model::new(cfg("tiny-mxfp4"), NanScales::new(), ModelOptions::default()).unwrap();
    let a = clean.forward_all(&ids).unwrap();
    // Its experts are known clean now: the same tensors are not scanned again.
    clean.weights().corrupt.set(true);
    assert!(
        clean.forward_all(&ids).is_ok(),
        "scales scanned once per model"
    );
    // Another model over the same weights scans them.
    let other = Model::new(cfg("tiny-mxfp4"), NanScales::new(), ModelOptions::default()).unwrap();
    other.weights().corrupt.set(true);
    assert!(nan(other.forward_all(&ids)), "a fresh model scans");
    assert!(a.logits.iter().all(|v| v.is_finite()));
}

// The memo's bounds: a layer or expert past the model's is never known, whatever was
// marked (catches an index that wraps into another layer's bits).
#[test]
fn scale_checks_bounds() {
    use k3_layer_compute::modules::ScaleChecks;
    let c = ScaleChecks::new(2, 4);
    c.mark(1, 3);
    c.mark(5, 0);
    c.mark(1, 9);
    c.mark(0, 7);
    assert!(c.known(1, 3));
    assert!(!c.known(5, 0) && !c.known(1, 9) && !c.known(0, 7) && !c.known(2, 1));
    assert!(!ScaleChecks::new(0, 0).known(0, 0));
}
