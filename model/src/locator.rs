//! Expert locator: where the tensors of one routed expert live, and whether they can be
//! read with a single read.
//!
//! A routed expert (layer ℓ, expert e) is six tensors
//! `language_model.model.layers.{ℓ}.block_sparse_moe.experts.{e}.w{1,2,3}.weight_{packed,scale}`
//! (MXFP4), or three `w{1,2,3}.weight` tensors (BF16/F32, unquantised checkpoints such as
//! the seed's tiny model). In the released files the tensors of one expert are adjacent, so
//! one read covers them — but that is *verified* from the catalog for every expert, never
//! assumed: when they are in one shard and tile one byte range without gaps the expert gets
//! a [`Run`], otherwise the caller reads each part on its own. Experts are not in id order
//! inside a shard (the writer orders them by name: 0, 1, 10, 100, ...), so every location
//! comes from the header.

use std::fmt;

use crate::catalog::Catalog;
use crate::classify::expert_tensor;
use crate::tensor::Dtype;

/// Tensor suffixes of an MXFP4 expert, in released (name) order.
pub const MXFP4_SUFFIXES: [&str; 6] = [
    "w1.weight_packed",
    "w1.weight_scale",
    "w2.weight_packed",
    "w2.weight_scale",
    "w3.weight_packed",
    "w3.weight_scale",
];

/// Tensor suffixes of an unquantised expert.
pub const PLAIN_SUFFIXES: [&str; 3] = ["w1.weight", "w2.weight", "w3.weight"];

/// One byte range of one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Run {
    /// Index into [`Catalog::shards`].
    pub shard: usize,
    /// Absolute file offset.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One tensor of an expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertPart {
    /// Suffix after `experts.<e>.`, e.g. `w2.weight_scale`.
    pub suffix: &'static str,
    /// Where it is (absolute).
    pub at: Run,
    /// Offset inside the expert's [`Run`] when it has one (else 0).
    pub run_offset: u64,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

/// Where one expert's tensors are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLoc {
    pub layer: usize,
    pub expert: usize,
    /// The parts in suffix order ([`MXFP4_SUFFIXES`] or [`PLAIN_SUFFIXES`]).
    pub parts: Vec<ExpertPart>,
    /// `Some` when all parts are in one shard and exactly tile `[offset, offset + len)`:
    /// one read fetches the expert. `None`: read each part separately.
    pub run: Option<Run>,
}

impl ExpertLoc {
    /// Total bytes of the expert.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.at.len).sum()
    }

    /// Whether the expert is stored as MXFP4 (six parts) rather than plain weights.
    pub fn is_mxfp4(&self) -> bool {
        self.parts.len() == MXFP4_SUFFIXES.len()
    }

    /// The reads that fetch the expert: its run, or one read per part (in offset order).
    pub fn reads(&self) -> Vec<Run> {
        match self.run {
            Some(r) => vec![r],
            None => {
                let mut v: Vec<Run> = self.parts.iter().map(|p| p.at).collect();
                v.sort_by_key(|r| (r.shard, r.offset));
                v
            }
        }
    }

    /// The part with `suffix`.
    pub fn part(&self, suffix: &str) -> Option<&ExpertPart> {
        self.parts.iter().find(|p| p.suffix == suffix)
    }
}

/// Why an expert could not be located.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocateError {
    pub layer: usize,
    pub expert: usize,
    /// The missing tensor's full name, when one is missing.
    pub tensor: Option<String>,
    pub msg: String,
}

impl fmt::Display for LocateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "expert (layer {}, expert {})", self.layer, self.expert)?;
        if let Some(t) = &self.tensor {
            write!(f, " tensor {t:?}")?;
        }
        write!(f, ": {}", self.msg)
    }
}

impl std::error::Error for LocateError {}

/// Locate expert `expert` of layer `layer`: MXFP4 when `w1.weight_packed` exists, else
/// plain `w1.weight`; every part must exist.
pub fn locate_expert(
    catalog: &Catalog,
    layer: usize,
    expert: usize,
) -> Result<ExpertLoc, LocateError> {
    let suffixes: &'static [&'static str] =
        if catalog.contains(&expert_tensor(layer, expert, MXFP4_SUFFIXES[0])) {
            &MXFP4_SUFFIXES
        } else if catalog.contains(&expert_tensor(layer, expert, PLAIN_SUFFIXES[0])) {
            &PLAIN_SUFFIXES
        } else {
            return Err(LocateError {
                layer,
                expert,
                tensor: Some(expert_tensor(layer, expert, MXFP4_SUFFIXES[0])),
                msg: format!(
                    "not in the checkpoint (neither {} nor {} exists)",
                    MXFP4_SUFFIXES[0], PLAIN_SUFFIXES[0]
                ),
            });
        };
    let mut parts = Vec::with_capacity(suffixes.len());
    for &suffix in suffixes {
        let name = expert_tensor(layer, expert, suffix);
        let e = catalog.get(&name).ok_or_else(|| LocateError {
            layer,
            expert,
            tensor: Some(name.clone()),
            msg: "missing from the checkpoint (the expert's other tensors exist)".into(),
        })?;
        parts.push(ExpertPart {
            suffix,
            at: Run {
                shard: e.shard,
                offset: e.offset,
                len: e.len,
            },
            run_offset: 0,
            dtype: e.dtype,
            shape: e.shape.to_vec(),
        });
    }
    let run = contiguous_run(&parts);
    if let Some(r) = run {
        for p in &mut parts {
            p.run_offset = p.at.offset - r.offset;
        }
    }
    Ok(ExpertLoc {
        layer,
        expert,
        parts,
        run,
    })
}

/// The single run the parts tile exactly, if they do (same shard, no gap, no overlap).
fn contiguous_run(parts: &[ExpertPart]) -> Option<Run> {
    let first = parts.first()?;
    if parts.iter().any(|p| p.at.shard != first.at.shard) {
        return None;
    }
    let mut spans: Vec<(u64, u64)> = parts.iter().map(|p| (p.at.offset, p.at.len)).collect();
    spans.sort_unstable();
    let start = spans[0].0;
    let mut end = start;
    for (off, len) in spans {
        if off != end {
            return None;
        }
        end = off + len;
    }
    Some(Run {
        shard: first.at.shard,
        offset: start,
        len: end - start,
    })
}

/// Locate experts `0..n_experts` of `layer`.
pub fn locate_layer(
    catalog: &Catalog,
    layer: usize,
    n_experts: usize,
) -> Result<Vec<ExpertLoc>, LocateError> {
    (0..n_experts)
        .map(|e| locate_expert(catalog, layer, e))
        .collect()
}
