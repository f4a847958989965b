//! How a trunk budget is spent: a pinned prefix of layers plus a ring of streaming slots.
//!
//! The layers are used in the same order 0..L-1 on every token: a cyclic scan. Under LRU a
//! cyclic scan of L layers through fewer than L slots never hits (by the time layer 0 comes
//! round again it is the least recently used, so it was just evicted; see the test
//! `lru_over_a_cyclic_scan_hits_nothing`). Pinning the first P layers instead hits P of L
//! binds per token, deterministically. The rest stream through ring slots, each of which
//! must hold the largest layer that is not pinned.
//!
//! Pinned count and slot size depend on each other (pinning a big layer shrinks the slot),
//! so the plan takes the largest prefix P with `pinned(P) + ring_min x slot(P) <= budget`,
//! where `slot(P)` is the largest footprint among layers P..L-1, and then as many ring slots
//! as the rest of the budget holds (at most `ring_max`, at most L-P). A budget that cannot
//! hold even one slot for the largest layer is refused with the shortfall.
//!
//! Parts (a trunk streamed below layer granularity, [`plan_streams`]) need not pin a
//! prefix: the slot only has to hold the largest *streamed* part, so pinning the large
//! attention parts and streaming the small MoE parts can free a big slot's worth of memory
//! for more pinning. `pin_order` picks such a set; the loader's units are then put in the
//! order pinned-first (`StreamPlan::order`), streamed ones in stream order, and the prefix
//! rule above applies to that order unchanged.
//!
//! A sink ([`plan_streams_with`]) is memory outside the trunk that takes whatever the trunk
//! plan leaves of its budget and saves one read byte per byte it holds: the rows of a
//! streamed lm_head. With one, every byte the trunk does not spend on its slot is either
//! pinned trunk or held sink, so the plan that reads least is the one with the smallest
//! slot that still fits beside the parts too big to stream through it.
//!
//! Footprints are in whole pages: a layer at file offset `o` of `n` bytes occupies
//! `align_up(o % 4096 + n)` bytes of arena, so O_DIRECT reads land page-aligned.

use k3_io::arena::{align_up, ALIGN};

/// One layer's bytes in the trunk file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerRun {
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to read (for a packed trunk, the padded length).
    pub len: u64,
}

impl LayerRun {
    /// Arena bytes this layer needs (page-mirrored).
    pub fn footprint(&self) -> u64 {
        align_up(self.offset % ALIGN as u64 + self.len)
    }
}

/// How many ring slots the plan may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingPolicy {
    /// Slots to keep even at the cost of a pinned layer (1: the seed's rule; 2 lets the
    /// reader load layer L+1 while layer L is computed). Lowered to 1 if the budget needs it.
    pub min: usize,
    /// Never more slots than this.
    pub max: usize,
}

impl Default for RingPolicy {
    fn default() -> Self {
        RingPolicy { min: 1, max: 4 }
    }
}

/// The result of [`plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TrunkPlan {
    /// Layers in the trunk.
    pub layers: usize,
    /// Layers 0..pinned stay resident.
    pub pinned: usize,
    /// Arena bytes of the pinned layers.
    pub pinned_bytes: u64,
    /// Ring slots (0 when every layer is pinned).
    pub ring_slots: usize,
    /// Bytes per ring slot: the largest footprint of layers pinned..layers.
    pub slot_bytes: u64,
    /// The budget it was made for.
    pub budget: u64,
}

impl TrunkPlan {
    /// Arena bytes the plan allocates.
    pub fn bytes(&self) -> u64 {
        self.pinned_bytes + self.ring_slots as u64 * self.slot_bytes
    }

    /// Layers that stream every token.
    pub fn streamed(&self) -> usize {
        self.layers - self.pinned
    }

    /// Steady-state trunk hit rate per token: pinned / layers.
    pub fn hit_rate(&self) -> f64 {
        if self.layers == 0 {
            1.0
        } else {
            self.pinned as f64 / self.layers as f64
        }
    }
}

/// A budget too small for any plan.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the trunk budget of {budget} bytes cannot hold one streaming slot for the largest layer \
     (or, streamed in parts, the largest part: {need} bytes): a shortfall of {shortfall} bytes. \
     Options: a larger --trunk-gb, or fewer --layers"
)]
pub struct PlanError {
    pub budget: u64,
    pub need: u64,
    pub shortfall: u64,
}

/// Plan a budget over layer runs (see the module documentation).
pub fn plan(budget: u64, runs: &[LayerRun], ring: RingPolicy) -> Result<TrunkPlan, PlanError> {
    let l = runs.len();
    let fp: Vec<u64> = runs.iter().map(LayerRun::footprint).collect();
    // prefix[p] = footprint of layers 0..p; suffix_max[p] = largest footprint of p..l.
    let mut prefix = vec![0u64; l + 1];
    for i in 0..l {
        prefix[i + 1] = prefix[i] + fp[i];
    }
    let mut suffix_max = vec![0u64; l + 1];
    for i in (0..l).rev() {
        suffix_max[i] = suffix_max[i + 1].max(fp[i]);
    }
    let fits = |p: usize, n: usize| -> bool {
        let n = n.min(l - p) as u64;
        prefix[p]
            .checked_add(n * suffix_max[p])
            .is_some_and(|b| b <= budget)
    };
    let ring_max = ring.max.max(1);
    let mut min = ring.min.clamp(1, ring_max);
    let pinned = loop {
        if let Some(p) = (0..=l).rev().find(|&p| fits(p, min)) {
            break p;
        }
        if min == 1 {
            let need = suffix_max[0];
            return Err(PlanError {
                budget,
                need,
                shortfall: need - budget,
            });
        }
        min -= 1;
    };
    let slot_bytes = suffix_max[pinned];
    let ring_slots = if pinned == l {
        0
    } else {
        let left = budget - prefix[pinned];
        ((left / slot_bytes) as usize).min(ring_max).min(l - pinned)
    };
    Ok(TrunkPlan {
        layers: l,
        pinned,
        pinned_bytes: prefix[pinned],
        ring_slots,
        slot_bytes: if ring_slots == 0 { 0 } else { slot_bytes },
        budget,
    })
}

/// A packed trunk's two ways to stream: whole layers, or the layers' parts (the tensors the
/// forward uses together, `k3_model::trunk::layer_parts_of`), both in stream order.
///
/// What streaming a unit costs is the bytes it reads from disk: its footprint for a raw
/// trunk; for a coded one (`pack-trunk --codec`) the stored bytes of the chunks it covers
/// (`layer_reads`, `part_reads`), while its arena footprint stays the decoded size (a pinned
/// unit is decoded once at load, a ring slot holds decoded bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Streams {
    /// One run per layer (its padded length).
    pub layers: Vec<LayerRun>,
    /// One run per part, layer by layer (the bytes its pieces take).
    pub parts: Vec<LayerRun>,
    /// Bytes streaming each layer reads (a coded trunk's stored bytes); empty: the
    /// footprints.
    pub layer_reads: Vec<u64>,
    /// Bytes streaming each part reads; empty: the footprints.
    pub part_reads: Vec<u64>,
}

impl Streams {
    /// The streams of these layers of a packed trunk (or of a trunk laid out as `pack-trunk`
    /// would lay it out, for `inspect`), read raw.
    pub fn of_layers(layers: &[k3_model::trunk::TrunkLayer]) -> Streams {
        Streams {
            layers: layers
                .iter()
                .map(|l| LayerRun {
                    offset: l.offset,
                    len: l.padded_length,
                })
                .collect(),
            parts: layers
                .iter()
                .flat_map(k3_model::trunk::layer_parts_of)
                .map(|p| LayerRun {
                    offset: 0,
                    len: p.bytes(),
                })
                .collect(),
            layer_reads: Vec::new(),
            part_reads: Vec::new(),
        }
    }

    /// The streams of the first `layers` layers of packed trunk `m`: for a coded trunk each
    /// unit reads the stored bytes of the chunks its pieces touch (a chunk two parts or two
    /// pieces share is read by both), what the trunk-loader's `CodedReader` reads.
    pub fn of_manifest(m: &k3_model::trunk::TrunkManifest, layers: usize) -> Streams {
        let layers = layers.min(m.layers.len());
        let mut s = Streams::of_layers(&m.layers[..layers]);
        let Some(c) = &m.codec else { return s };
        let chunk = c.chunk.max(1);
        for (l, cl) in m.layers[..layers].iter().zip(&c.layers) {
            s.layer_reads
                .push(cl.chunks.iter().map(|ch| ch.stored).sum());
            for part in k3_model::trunk::layer_parts_of(l) {
                // Each piece is read on its own: a chunk two pieces touch is read twice.
                let mut read = 0u64;
                for p in &part.pieces {
                    let end = (p.at + p.len).min(l.length);
                    if end > p.at {
                        let (a, b) = ((p.at / chunk) as usize, ((end - 1) / chunk) as usize);
                        read += cl
                            .chunks
                            .iter()
                            .take(b + 1)
                            .skip(a)
                            .map(|ch| ch.stored)
                            .sum::<u64>();
                    }
                }
                s.part_reads.push(read);
            }
        }
        s
    }

    /// The same layout read `ratio` of its bytes per unit (`inspect --codec-ratio`: a coded
    /// trunk projected before it is packed).
    pub fn with_read_ratio(mut self, ratio: f64) -> Streams {
        let scale = |r: &[LayerRun]| -> Vec<u64> {
            r.iter()
                .map(|u| (u.footprint() as f64 * ratio).ceil() as u64)
                .collect()
        };
        self.layer_reads = scale(&self.layers);
        self.part_reads = scale(&self.parts);
        self
    }

    /// Arena bytes of the whole trunk pinned (whole layers).
    pub fn pinned_bytes(&self) -> u64 {
        self.layers.iter().map(LayerRun::footprint).sum()
    }

    /// Bytes the whole trunk reads from disk (its stored size when coded).
    pub fn stored_bytes(&self) -> u64 {
        if self.layer_reads.is_empty() {
            self.pinned_bytes()
        } else {
            self.layer_reads.iter().sum()
        }
    }
}

/// What streaming each of `runs` reads: `reads` when given (one per run), else footprints.
fn read_costs(runs: &[LayerRun], reads: &[u64]) -> Vec<u64> {
    if reads.len() == runs.len() {
        reads.to_vec()
    } else {
        runs.iter().map(LayerRun::footprint).collect()
    }
}

/// What [`plan_streams`] chose.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StreamPlan {
    /// Over layers, or over parts when `parts` (then `pinned`, `layers`, `ring_slots` count
    /// parts). Its units are in `order`: the loader's unit `i` is stream unit `order[i]`.
    pub plan: TrunkPlan,
    pub parts: bool,
    /// Trunk bytes read per token: the streamed units' bytes (a coded trunk's stored
    /// bytes).
    pub read_per_token: u64,
    /// The loader's units in terms of the stream's (`order[i]`: the stream unit the loader's
    /// unit `i` is): the pinned units first, then the streamed ones, each group in stream
    /// order, so the ring still reads the streamed units in the order the forward uses
    /// them. `None`: the stream's own order (the pinned units are its prefix).
    #[serde(skip)]
    pub order: Option<Vec<usize>>,
}

impl StreamPlan {
    /// What the trunk's budget leaves unspent.
    pub fn left(&self) -> u64 {
        self.plan.budget.saturating_sub(self.plan.bytes())
    }

    /// Whether the unit each pass uses first (stream unit 0) is pinned: then a pass starts
    /// with compute that no trunk read holds up, which a read held until the pass starts
    /// (`TrunkLoader::hold_wrap`) can overlap.
    pub fn starts_pinned(&self) -> bool {
        match &self.order {
            Some(order) => order[..self.plan.pinned].contains(&0),
            None => self.plan.pinned > 0,
        }
    }

    /// Bytes the trunk and a sink of `sink` bytes read per token together: the trunk's
    /// reads plus the sink's bytes that the budget left cannot hold.
    pub fn read_with(&self, sink: u64) -> u64 {
        self.read_per_token + sink.saturating_sub(self.left())
    }
}

/// Which units to pin when the pinned ones need not be a prefix (parts: a layer's small
/// MoE part can be pinned while its large attention part streams, so the ring slot is
/// sized for the largest streamed unit only). For every candidate slot size `s` (each
/// distinct footprint): the units larger than `s` must be pinned; of the rest, the largest
/// that still fit beside one slot of `s` are pinned too (every pinned byte saves one byte
/// read per token). The candidate that streams the fewest bytes wins (the smallest slot on
/// a tie). Returns the order (pinned first, then streamed, each in stream order), or None
/// when no candidate fits or every unit fits pinned.
///
/// With a `sink` (see the module documentation) a candidate's bytes are its streamed bytes
/// plus the sink's bytes that its unspent budget cannot hold. A streamed unit costs its
/// `cost` (its footprint, or a coded trunk's stored bytes).
fn pin_order(budget: u64, runs: &[LayerRun], cost: &[u64], sink: u64) -> Option<Vec<usize>> {
    let fp: Vec<u64> = runs.iter().map(LayerRun::footprint).collect();
    let total: u64 = fp.iter().sum();
    if total <= budget {
        return None;
    }
    let mut sizes = fp.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let mut by_size: Vec<usize> = (0..runs.len()).collect();
    // The largest first (each pinned byte is one byte less of slot or stream); of equal
    // ones, the one that costs most to stream (a coded trunk's least compressed).
    by_size.sort_by_key(|&i| (std::cmp::Reverse(fp[i]), std::cmp::Reverse(cost[i])));
    let mut best: Option<(u64, Vec<bool>)> = None;
    for &slot in &sizes {
        let forced: u64 = fp.iter().filter(|&&f| f > slot).sum();
        // What one slot and the units that cannot stream through it leave.
        let Some(mut cap) = budget.checked_sub(slot).and_then(|c| c.checked_sub(forced)) else {
            continue;
        };
        let mut pin = vec![false; runs.len()];
        for &i in &by_size {
            if fp[i] > slot {
                pin[i] = true;
            } else if fp[i] <= cap {
                pin[i] = true;
                cap -= fp[i];
            }
        }
        let streamed: u64 = (0..runs.len()).filter(|&i| !pin[i]).map(|i| cost[i]).sum();
        let streamed = streamed + sink.saturating_sub(cap);
        if best.as_ref().is_none_or(|(b, _)| streamed < *b) {
            best = Some((streamed, pin));
        }
    }
    let (_, pin) = best?;
    let order: Vec<usize> = (0..runs.len())
        .filter(|&i| pin[i])
        .chain((0..runs.len()).filter(|&i| !pin[i]))
        .collect();
    Some(order)
}

/// Plan a budget both ways, whole layers and parts, and take the one that reads fewer bytes
/// per token (whole layers on a tie, and whenever there are no parts): a budget below one
/// slot for the largest layer streams in parts, whose slot is the largest part. Refused
/// with the shortfall when not even one slot for the largest part fits. The trunk-loader
/// and the orchestrator's plan both call this, so they agree.
pub fn plan_streams(budget: u64, s: &Streams, ring: RingPolicy) -> Result<StreamPlan, PlanError> {
    plan_streams_with(budget, s, ring, 0)
}

/// [`plan_streams`] beside a sink of `sink` bytes (see the module documentation): the
/// candidates are weighed by their reads less what the budget they leave lets the sink
/// hold ([`StreamPlan::read_with`]). A sink of 0 is [`plan_streams`].
pub fn plan_streams_with(
    budget: u64,
    s: &Streams,
    ring: RingPolicy,
    sink: u64,
) -> Result<StreamPlan, PlanError> {
    // Bytes read per token: the streamed units' costs (`cost` in the units' order).
    let read = |cost: &[u64], p: &TrunkPlan| -> u64 { cost[p.pinned..].iter().sum() };
    let net = |p: &StreamPlan| p.read_with(sink);
    let layer_cost = read_costs(&s.layers, &s.layer_reads);
    let whole = plan(budget, &s.layers, ring).map(|p| StreamPlan {
        plan: p,
        parts: false,
        read_per_token: read(&layer_cost, &p),
        order: None,
    });
    if s.parts.is_empty() {
        return whole;
    }
    let part_cost = read_costs(&s.parts, &s.part_reads);
    let prefix = plan(budget, &s.parts, ring).map(|p| StreamPlan {
        plan: p,
        parts: true,
        read_per_token: read(&part_cost, &p),
        order: None,
    });
    // Parts may also pin a set that is not a prefix (see `pin_order`); the prefix plan
    // stays on a tie.
    let chosen = pin_order(budget, &s.parts, &part_cost, sink).and_then(|order| {
        let runs: Vec<LayerRun> = order.iter().map(|&i| s.parts[i]).collect();
        let cost: Vec<u64> = order.iter().map(|&i| part_cost[i]).collect();
        plan(budget, &runs, ring).ok().map(|p| StreamPlan {
            plan: p,
            parts: true,
            read_per_token: read(&cost, &p),
            order: Some(order),
        })
    });
    let parts = match (prefix, chosen) {
        (Ok(a), Some(b)) if net(&b) < net(&a) => Ok(b),
        (Err(_), Some(b)) => Ok(b),
        (a, _) => a,
    };
    match (whole, parts) {
        (Ok(w), Ok(p)) if net(&p) < net(&w) => Ok(p),
        (Ok(w), _) => Ok(w),
        (Err(_), Ok(p)) => Ok(p),
        (Err(_), Err(e)) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 4096;

    fn runs(pages: &[u64]) -> Vec<LayerRun> {
        let mut off = 0;
        pages
            .iter()
            .map(|&n| {
                let r = LayerRun {
                    offset: off,
                    len: n * P,
                };
                off += n * P;
                r
            })
            .collect()
    }

    /// Independent brute force over every (pinned, slots) pair.
    fn brute(budget: u64, pages: &[u64], ring: RingPolicy) -> Option<(usize, usize)> {
        let l = pages.len();
        for min in (1..=ring.min).rev() {
            let mut best = None;
            for p in 0..=l {
                let pinned: u64 = pages[..p].iter().sum::<u64>() * P;
                let slot = pages[p..].iter().copied().max().unwrap_or(0) * P;
                let n_min = min.min(l - p) as u64;
                if pinned + n_min * slot <= budget {
                    let n = if p == l {
                        0
                    } else {
                        (((budget - pinned) / slot) as usize)
                            .min(ring.max)
                            .min(l - p)
                    };
                    best = Some((p, n));
                }
            }
            if best.is_some() {
                return best;
            }
        }
        None
    }

    #[test]
    fn pinning_a_big_layer_shrinks_the_slot() {
        // A big first layer: the slot is the largest layer NOT pinned. A wrong rule that sizes
        // the slot by the largest layer overall pins nothing here (10 + 10 > 13).
        let r = runs(&[10, 1, 1, 1]);
        let p = plan(13 * P, &r, RingPolicy::default()).unwrap();
        assert_eq!((p.pinned, p.ring_slots, p.slot_bytes), (4, 0, 0));
        let p = plan(12 * P, &r, RingPolicy::default()).unwrap();
        assert_eq!((p.pinned, p.ring_slots, p.slot_bytes), (2, 1, P));
        assert_eq!(p.bytes(), 12 * P);
    }

    #[test]
    fn refuses_with_the_shortfall() {
        let r = runs(&[3, 5, 2]);
        let e = plan(4 * P, &r, RingPolicy::default()).unwrap_err();
        assert_eq!(e.need, 5 * P);
        assert_eq!(e.shortfall, P);
        let p = plan(5 * P, &r, RingPolicy::default()).unwrap();
        assert_eq!((p.pinned, p.ring_slots), (0, 1));
    }

    #[test]
    fn ring_min_trades_a_pinned_layer_for_overlap() {
        let r = runs(&[2, 2, 2, 2, 2]);
        let one = plan(8 * P, &r, RingPolicy { min: 1, max: 4 }).unwrap();
        assert_eq!((one.pinned, one.ring_slots), (3, 1));
        let two = plan(8 * P, &r, RingPolicy { min: 2, max: 4 }).unwrap();
        assert_eq!((two.pinned, two.ring_slots), (2, 2));
        // Too tight for two slots: falls back to one rather than refusing.
        let r = runs(&[4, 4]);
        let p = plan(5 * P, &r, RingPolicy { min: 2, max: 4 }).unwrap();
        assert_eq!((p.pinned, p.ring_slots), (0, 1));
    }

    #[test]
    fn matches_brute_force() {
        let mut seed = 12345u64;
        for _ in 0..400 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let l = 1 + (seed >> 33) as usize % 9;
            let pages: Vec<u64> = (0..l).map(|i| 1 + ((seed >> (i * 5 % 50)) & 7)).collect();
            let budget = ((seed >> 20) % 60) * P;
            let ring = RingPolicy {
                min: 1 + (seed >> 40) as usize % 3,
                max: 1 + (seed >> 44) as usize % 4,
            };
            let ring = RingPolicy {
                min: ring.min.min(ring.max),
                ..ring
            };
            let got = plan(budget, &runs(&pages), ring)
                .ok()
                .map(|p| (p.pinned, p.ring_slots));
            assert_eq!(
                got,
                brute(budget, &pages, ring),
                "{pages:?} budget {budget} {ring:?}"
            );
        }
    }

    #[test]
    fn unaligned_runs_are_counted_in_pages() {
        let r = LayerRun {
            offset: 4000,
            len: 200,
        };
        assert_eq!(r.footprint(), 2 * P);
        let r = LayerRun {
            offset: 8192,
            len: 1,
        };
        assert_eq!(r.footprint(), P);
    }

    /// Parts of the slice (4 layers at the released dims), in 4 KiB pages scaled by a
    /// million bytes: layer 0 attention, gate+up, down; layers 1-2 attention, MoE; layer 3
    /// (MLA) attention, MoE.
    const SLICE: [u64; 9] = [888, 969, 484, 888, 368, 888, 368, 464, 368];

    fn streams_of(pages: &[u64]) -> Streams {
        Streams {
            layers: runs(&[pages.iter().sum()]),
            parts: runs(pages),
            ..Default::default()
        }
    }

    // A coded trunk (each unit reads its stored bytes) plans the same memory and reads the
    // stored bytes of what it streams; a unit whose bytes do not compress weighs more, so
    // the set pinned can change. Catches a plan that counts a coded trunk's reads at the
    // decoded size (the read per token, and the choice of lm_head pinned or streamed that
    // depends on it, would be the raw trunk's).
    #[test]
    fn a_coded_trunk_reads_its_stored_bytes() {
        let ring = RingPolicy::default();
        let raw = plan_streams(4833 * P, &streams_of(&SLICE), ring).unwrap();
        let half = streams_of(&SLICE).with_read_ratio(0.5);
        assert_eq!(half.stored_bytes(), SLICE.iter().sum::<u64>() * P / 2);
        let sp = plan_streams(4833 * P, &half, ring).unwrap();
        assert_eq!((sp.plan, sp.parts), (raw.plan, raw.parts));
        assert_eq!(sp.read_per_token, 1568 * P / 2);
        // Three equal parts and a budget for one pinned beside one slot: the one that
        // would read most (stores most) is pinned, wherever it is.
        let mut s = streams_of(&[10, 10, 10]);
        for reads in [[2, 9, 5], [9, 2, 5], [2, 5, 9]] {
            s.part_reads = reads.iter().map(|r| r * P).collect();
            let sp = plan_streams(20 * P, &s, ring).unwrap();
            assert_eq!(sp.read_per_token, 7 * P, "{reads:?}: {sp:?}");
        }
    }

    // Catches: a plan that pins only a prefix (at 4833 pages the slice's prefix plan pins
    // layers 0-1 and streams 2088 pages through an 888-page slot; pinning the three large
    // attention parts instead streams 1568 through a 464-page slot), a streamed order that
    // is not the forward's (the ring reads units in order), and a plan over its budget.
    #[test]
    fn parts_pin_a_set_not_only_a_prefix() {
        let ring = RingPolicy::default();
        let s = streams_of(&SLICE);
        let prefix = plan(4833 * P, &s.parts, ring).unwrap();
        assert_eq!((prefix.pinned, prefix.slot_bytes), (5, 888 * P));
        let sp = plan_streams(4833 * P, &s, ring).unwrap();
        assert!(sp.parts);
        assert_eq!(sp.read_per_token, 1568 * P);
        assert_eq!(sp.plan.slot_bytes, 464 * P);
        let order = sp.order.clone().expect("a set that is not a prefix");
        assert_eq!(order, vec![0, 1, 2, 3, 5, 4, 6, 7, 8]);
        assert!(sp.plan.bytes() <= 4833 * P);
    }

    /// A xorshift generator from `seed`: `next(m)` is in `0..m`.
    fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
        move |m| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        }
    }

    /// The fewest bytes any pinned set and a sink of `sink` pages can read together (with no
    /// sink: the fewest any pinned set can stream): the
    /// streamed pages plus the sink's pages that the budget left beside the pinned set and
    /// one slot cannot hold (exhaustive over subsets).
    fn best_with_sink(budget: u64, pages: &[u64], sink: u64) -> u64 {
        let n = pages.len();
        let total: u64 = pages.iter().sum();
        (0u32..1 << n)
            .filter_map(|m| {
                let pinned: u64 = (0..n).filter(|&i| m >> i & 1 == 1).map(|i| pages[i]).sum();
                let slot = (0..n)
                    .filter(|&i| m >> i & 1 == 0)
                    .map(|i| pages[i])
                    .max()
                    .unwrap_or(0);
                let left = budget.checked_sub(pinned + slot)?;
                Some(total - pinned + sink.saturating_sub(left))
            })
            .min()
            .unwrap_or(u64::MAX)
    }

    // Catches: a plan that ignores the sink (at 4833 pages beside a 2350-page lm_head it
    // must still pick the 464-page slot and give the sink the 252 pages it leaves), and a
    // chooser that is not the exhaustive best when
    // every unspent byte goes to the sink (then only the slot's size matters).
    #[test]
    fn a_sink_takes_what_the_trunk_leaves() {
        let ring = RingPolicy::default();
        let s = streams_of(&SLICE);
        let sp = plan_streams_with(4833 * P, &s, ring, 2350 * P).unwrap();
        assert_eq!(sp.read_per_token, 1568 * P);
        assert_eq!((sp.plan.slot_bytes, sp.plan.ring_slots), (464 * P, 1));
        assert_eq!(sp.left(), 252 * P);
        assert_eq!(sp.read_with(2350 * P), (1568 + 2350 - 252) * P);
        let mut next = xorshift(0xfeed_u64);
        for _ in 0..300 {
            let n = 2 + next(8) as usize;
            let pages: Vec<u64> = (0..n).map(|_| 1 + next(40)).collect();
            let total: u64 = pages.iter().sum();
            let budget = 1 + next(total + 10);
            let sink = budget + next(50);
            let Ok(sp) = plan_streams_with(budget * P, &streams_of(&pages), ring, sink * P) else {
                continue;
            };
            assert!(sp.plan.bytes() <= budget * P, "{pages:?} {budget}");
            assert_eq!(
                sp.read_with(sink * P),
                best_with_sink(budget, &pages, sink) * P,
                "{pages:?} budget {budget} sink {sink}"
            );
        }
    }

    // Catches: a chooser worse than the prefix plan, a plan over budget, or streamed units
    // out of forward order, on random part lists (and how far it is from the exhaustive best).
    #[test]
    fn chosen_sets_fit_and_never_stream_more_than_the_prefix() {
        let mut next = xorshift(0x5eed_u64);
        for _ in 0..400 {
            let n = 2 + next(9) as usize;
            let pages: Vec<u64> = (0..n).map(|_| 1 + next(40)).collect();
            let total: u64 = pages.iter().sum();
            let budget = 1 + next(total + 10);
            let s = streams_of(&pages);
            let ring = RingPolicy::default();
            let Ok(sp) = plan_streams(budget * P, &s, ring) else {
                continue;
            };
            assert!(sp.plan.bytes() <= budget * P, "{pages:?} {budget}");
            if let Ok(pre) = plan(budget * P, &s.parts, ring) {
                let pre_read: u64 = s.parts[pre.pinned..].iter().map(LayerRun::footprint).sum();
                assert!(
                    sp.read_per_token <= pre_read.min(total * P),
                    "{pages:?} {budget}"
                );
            }
            if let Some(o) = &sp.order {
                let streamed = &o[sp.plan.pinned..];
                assert!(streamed.windows(2).all(|w| w[0] < w[1]), "{o:?}");
                let mut all = o.clone();
                all.sort_unstable();
                assert_eq!(all, (0..n).collect::<Vec<_>>());
            }
            if sp.parts {
                assert!(sp.read_per_token >= best_with_sink(budget, &pages, 0) * P);
            }
        }
    }
}
