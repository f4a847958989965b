//! `K3_FLOOR=1` (observation only, `--single-process`): before each decode step, read the
//! weight bytes one decode token multiplies with vector loads ([`k3_layer_compute::membw`])
//! and print the time as a `k3 floor:` line on stderr. `scripts/bench-slice.sh` divides
//! each step's time by the floor read just before it.
//!
//! The bytes: every tensor of the bound layers but the routed experts and the token
//! embedding (one row per token is read of it), the lm_head, and top-k routed experts of
//! every bound MoE layer. Which experts a token will route to is not known before its
//! forward, so step `s` reads experts `s·k .. s·k + k` (mod the expert count) of each
//! layer: the same byte count, different experts each step, from the same mappings.

use k3_layer_compute::membw;
use k3_model::classify::{classify, layer_of, split_expert, TensorClass};
use k3_model::mmap_weights::MmapWeights;

/// The spans one decode token's floor reads.
pub struct Floor<'a> {
    /// The trunk tensors of the bound layers and the lm_head.
    fixed: Vec<&'a [u8]>,
    /// Per bound MoE layer, per expert: its tensors.
    experts: Vec<Vec<Vec<&'a [u8]>>>,
    top_k: usize,
}

impl<'a> Floor<'a> {
    /// The floor of `mw`'s model bound to its first `layers` layers, when `K3_FLOOR` is
    /// set (to anything but empty or `0`).
    pub fn from_env(mw: &'a MmapWeights, layers: usize, top_k: usize) -> Option<Floor<'a>> {
        let on = std::env::var("K3_FLOOR").is_ok_and(|v| !v.is_empty() && v != "0");
        on.then(|| Floor::new(mw, layers, top_k))
    }

    fn new(mw: &'a MmapWeights, layers: usize, top_k: usize) -> Floor<'a> {
        let mut fixed = Vec::new();
        // (layer, expert) -> spans, in a map so the layers and experts come out in order.
        let mut ex: std::collections::BTreeMap<(usize, usize), Vec<&'a [u8]>> = Default::default();
        for (name, e) in mw.catalog().iter() {
            if e.len == 0 || layer_of(&name).is_some_and(|l| l >= layers) {
                continue;
            }
            match classify(&name) {
                TensorClass::Vision => {}
                TensorClass::Embedding if !name.contains("lm_head") => {}
                TensorClass::RoutedExpert => {
                    if let Some((l, x, _)) = split_expert(&name) {
                        ex.entry((l, x)).or_default().push(mw.bytes(&e));
                    }
                }
                _ => fixed.push(mw.bytes(&e)),
            }
        }
        let mut experts: Vec<Vec<Vec<&'a [u8]>>> = Vec::new();
        let mut last = None;
        for ((l, _), spans) in ex {
            if last != Some(l) {
                experts.push(Vec::new());
                last = Some(l);
            }
            experts.last_mut().expect("pushed above").push(spans);
        }
        Floor {
            fixed,
            experts,
            top_k,
        }
    }

    /// The spans of step `step`'s floor.
    fn spans(&self, step: usize) -> Vec<&'a [u8]> {
        let mut v = self.fixed.clone();
        for layer in &self.experts {
            let n = layer.len();
            for j in 0..self.top_k.min(n) {
                v.extend(layer[(step * self.top_k + j) % n].iter().copied());
            }
        }
        v
    }

    /// Read step `step`'s floor on the current rayon pool and print it.
    pub fn probe(&self, step: usize) {
        let spans = self.spans(step);
        let bytes: usize = spans.iter().map(|s| s.len()).sum();
        // Four interleaved streams per task: a GEMV row tile's shape.
        let secs = membw::read_seconds(&spans, 4);
        eprintln!(
            "k3 floor: step {step} read {bytes} bytes in {:.2} ms ({:.2} GB/s)",
            secs * 1e3,
            bytes as f64 / secs / 1e9
        );
    }
}
