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
//! A coded trunk's streamed unit costs more than its read: the reader threads decode it on
//! every token, on the cores compute uses. Its cost is its stored bytes plus its decoded
//! bytes weighed by [`Streams::decode_ppm`] (the disk bytes read in the time the decoders
//! take for one decoded byte, per million: [`decode_weight_ppm`]), so the plan ranks
//! pinning by time saved per byte of RAM: a coded part whose read and decode take longer
//! than the raw lm_head's read of the same bytes is pinned before it. A pinned unit is
//! decoded once at load and costs nothing per token. [`decode_rate`] is the short probe of
//! the decoder's rate on a trunk's own chunks.
//!
//! A coded trunk's layer has a third placement beside pinned raw and streamed: **kept
//! coded** (`--trunk-resident`, [`Streams::resident`]): its stored run stays in the loader's
//! memory (after the ring in its arena, counted at its stored size, [`TrunkPlan::kept_bytes`])
//! and is decoded into a ring slot on each use, as a streamed unit but without the read. It
//! costs its stored bytes of RAM and its decoding per token; pinned raw costs its decoded
//! bytes and nothing per token; streamed costs a slot, the read and the decoding. With
//! `auto` [`plan_streams_with`] weighs every raw-pinned prefix (and, in parts, every set the
//! slot size forces) with the layers it can still keep coded, greedily by reads saved per
//! byte kept, beside the sink, and keeps a layer coded only where that costs less than
//! what the raw plan does; `coded` keeps nothing raw.
//!
//! Footprints are in whole pages: a layer at file offset `o` of `n` bytes occupies
//! `align_up(o % 4096 + n)` bytes of arena, so O_DIRECT reads land page-aligned.

use k3_io::arena::{align_up, ALIGN};
pub use k3_protocol::conf::TrunkResident;

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
    /// Layers of a coded trunk kept coded in memory (see the module documentation).
    pub kept: usize,
    /// Arena bytes of their stored runs (after the ring, [`TrunkPlan::kept_at`]).
    pub kept_bytes: u64,
}

impl TrunkPlan {
    /// Arena bytes the plan allocates: the pinned units, the ring, the layers kept coded.
    pub fn bytes(&self) -> u64 {
        self.kept_at() + self.kept_bytes
    }

    /// Where the kept layers' stored runs start in the arena: after the ring.
    pub fn kept_at(&self) -> u64 {
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
        kept: 0,
        kept_bytes: 0,
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
    /// Bytes streaming each layer decodes (a coded trunk: the decoded bytes of the chunks
    /// its reads cover); empty: none (a raw trunk).
    pub layer_decoded: Vec<u64>,
    /// Bytes streaming each part decodes; empty: none.
    pub part_decoded: Vec<u64>,
    /// What decoding costs against reading: the bytes the disk reads in the time the
    /// trunk-loader's decoders take for a million decoded bytes ([`decode_weight_ppm`]).
    /// 0: decoding is free, streamed units are ranked by their stored bytes alone.
    pub decode_ppm: u64,
    /// The layer each part belongs to (one per part).
    pub part_layer: Vec<usize>,
    /// Arena bytes keeping each layer coded takes (a coded trunk's stored run, padded);
    /// empty: a raw trunk, nothing can be kept coded.
    pub layer_kept: Vec<u64>,
    /// Which placements a coded trunk's layers may take (`--trunk-resident`).
    pub resident: TrunkResident,
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
            layer_decoded: Vec::new(),
            part_decoded: Vec::new(),
            decode_ppm: 0,
            part_layer: layers
                .iter()
                .enumerate()
                .flat_map(|(i, l)| std::iter::repeat_n(i, k3_model::trunk::layer_parts_of(l).len()))
                .collect(),
            layer_kept: Vec::new(),
            resident: TrunkResident::default(),
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
            s.layer_decoded
                .push(cl.chunks.iter().map(|ch| ch.raw).sum());
            s.layer_kept.push(cl.padded_length);
            for part in k3_model::trunk::layer_parts_of(l) {
                // Each piece is read on its own: a chunk two pieces touch is read (and
                // decoded) twice.
                let (mut read, mut decoded) = (0u64, 0u64);
                for p in &part.pieces {
                    let end = (p.at + p.len).min(l.length);
                    if end > p.at {
                        let (a, b) = ((p.at / chunk) as usize, ((end - 1) / chunk) as usize);
                        for ch in cl.chunks.iter().take(b + 1).skip(a) {
                            read += ch.stored;
                            decoded += ch.raw;
                        }
                    }
                }
                s.part_reads.push(read);
                s.part_decoded.push(decoded);
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
        self.layer_decoded = self.layers.iter().map(|u| u.len).collect();
        self.part_decoded = self.parts.iter().map(|u| u.len).collect();
        self.layer_kept = self.layer_reads.iter().map(|&r| align_up(r)).collect();
        self
    }

    /// The same streams with the placements `resident` allows ([`Streams::resident`]).
    pub fn with_resident(mut self, resident: TrunkResident) -> Streams {
        self.resident = resident;
        self
    }

    /// The same streams with decoding weighed at `ppm` ([`Streams::decode_ppm`]).
    pub fn with_decode_weight(mut self, ppm: u64) -> Streams {
        self.decode_ppm = ppm;
        self
    }

    /// Whether streaming decodes (a coded trunk).
    pub fn is_coded(&self) -> bool {
        !self.layer_decoded.is_empty()
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

/// What streaming each of `runs` decodes: `decoded` when given (one per run), else 0.
fn decode_sizes(runs: &[LayerRun], decoded: &[u64]) -> Vec<u64> {
    if decoded.len() == runs.len() {
        decoded.to_vec()
    } else {
        vec![0; runs.len()]
    }
}

/// `decoded` bytes' decoding in disk bytes read in the same time, at `ppm`
/// ([`Streams::decode_ppm`]).
pub fn decode_cost(decoded: u64, ppm: u64) -> u64 {
    (decoded as u128 * ppm as u128 / 1_000_000).min(u64::MAX as u128) as u64
}

/// The weight of decoding against reading ([`Streams::decode_ppm`]) on a machine whose
/// disk reads the trunk at `disk_bps` bytes per second while `cores` cores each decode
/// `decode_bps` bytes per second: the time one decoded byte takes on those cores over the
/// time one byte takes to read, per million. `cores` is what the decoding has to itself,
/// [`decode_cores`]: not the cores compute runs on. 0 when a rate is not a positive number
/// (decoding then weighs nothing, the stored-bytes ranking).
pub fn decode_weight_ppm(disk_bps: f64, decode_bps: f64, cores: usize) -> u64 {
    let ok = |x: f64| x.is_finite() && x > 0.0;
    if !ok(disk_bps) || !ok(decode_bps) {
        return 0;
    }
    let w = disk_bps / (decode_bps * cores.max(1) as f64) * 1e6;
    w.round().min(1e12) as u64
}

/// The cores a coded trunk's decoding counts on ([`decode_weight_ppm`]): those of the
/// machine's `cores` that compute's `compute_threads` leave, at least one.
///
/// Measured (docs/measurements.md, "The coded trunk's literals"; 2 vCPU, compute on both):
/// counting the decoding as spread over every core made `--trunk-resident auto` keep
/// layers coded that ran slower than reading them. With one layer kept, 0.84 GB more
/// decoded per token cost 0.20-0.29 s; with all four kept, 5.82 GB decoded per token cost
/// about 1.5 s, against 0.8 s at 3.5 GB/s on each of two cores: the decoding of a kept
/// layer is on the token's path (compute waits for its slot) and shares the cores and the
/// memory with compute, so it runs at no more than one core's probed rate.
pub fn decode_cores(cores: usize, compute_threads: usize) -> usize {
    cores.saturating_sub(compute_threads).max(1)
}

/// Bytes per second one core decodes the coded trunk of manifest `m` in `dir` at: up to
/// `chunks` of its chunks, spread over the trunk, are read (buffered: the disk is not what
/// is measured) and decoded by one [`k3_model::codec::Decoder`] reused from chunk to chunk,
/// with their CRCs checked, as the trunk-loader's pooled decoders do; only the decoding is
/// timed, the faster of two passes. None for a raw trunk, or when a chunk cannot be read or
/// decoded (the run's own checks then say why).
pub fn decode_rate(
    dir: &std::path::Path,
    m: &k3_model::trunk::TrunkManifest,
    chunks: usize,
) -> Option<f64> {
    use k3_model::codec::{Codec, Decoder};
    use std::os::unix::fs::FileExt;
    let c = m.codec.as_ref()?;
    let codec = Codec::from_name(&c.name)?;
    let all: Vec<(usize, usize)> = c
        .layers
        .iter()
        .enumerate()
        .flat_map(|(l, cl)| (0..cl.chunks.len()).map(move |k| (l, k)))
        .collect();
    if all.is_empty() || chunks == 0 {
        return None;
    }
    let file = std::fs::File::open(dir.join(&c.file)).ok()?;
    let step = all.len().div_ceil(chunks).max(1);
    let mut picked = Vec::new();
    for &(l, k) in all.iter().step_by(step) {
        let (cl, ch) = (&c.layers[l], &c.layers[l].chunks[k]);
        let mut stored = vec![0u8; usize::try_from(ch.stored).ok()?];
        file.read_exact_at(&mut stored, cl.offset + ch.offset)
            .ok()?;
        picked.push((cl.layer, k, *ch, stored));
    }
    let mut dec = Decoder::new();
    let mut out = Vec::new();
    let (mut best, mut bytes) = (f64::MAX, 0u64);
    for _ in 0..2 {
        let t = std::time::Instant::now();
        bytes = 0;
        for (layer, k, ch, stored) in &picked {
            out.resize(usize::try_from(ch.raw).ok()?, 0);
            k3_model::codec_trunk::decode_chunk(&mut dec, codec, *layer, *k, ch, stored, &mut out)
                .ok()?;
            bytes += ch.raw;
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    (bytes > 0).then(|| bytes as f64 / best.max(1e-9))
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
    /// Bytes the streamed units decode per token (0 for a raw trunk).
    pub decode_per_token: u64,
    /// What the plan weighs: the bytes read plus the decoding weighed as bytes read
    /// ([`decode_cost`] at [`Streams::decode_ppm`]); the bytes read for a raw trunk.
    pub cost_per_token: u64,
    /// The layers kept coded in memory, ascending (their streamed units read nothing, they
    /// decode from memory): `plan.kept` of them, `plan.kept_bytes` of arena.
    pub kept: Vec<usize>,
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

    /// What the plan weighs beside a sink of `sink` bytes: the trunk's cost (reads and
    /// decoding, [`StreamPlan::cost_per_token`]) plus the sink's bytes the budget left cannot
    /// hold (each read raw).
    pub fn cost_with(&self, sink: u64) -> u64 {
        self.cost_per_token + sink.saturating_sub(self.left())
    }
}

/// Which units to pin when the pinned ones need not be a prefix (parts: a layer's small
/// MoE part can be pinned while its large attention part streams, so the ring slot is
/// sized for the largest streamed unit only). For every candidate slot size `s` (each
/// distinct footprint): the units larger than `s` must be pinned; of the rest, the largest
/// that still fit beside `slots` slots of `s` (the ring's minimum) are pinned too (every
/// pinned byte saves one byte read per token). The candidate that streams the fewest bytes wins (the smallest slot on
/// a tie). Returns the order (pinned first, then streamed, each in stream order), or None
/// when no candidate fits or every unit fits pinned.
///
/// With a `sink` (see the module documentation) a candidate's bytes are its streamed bytes
/// plus the sink's bytes that its unspent budget cannot hold. A streamed unit costs its
/// `cost` (its footprint, or a coded trunk's stored bytes plus its decoding weighed as
/// reads).
fn pin_order(
    budget: u64,
    runs: &[LayerRun],
    cost: &[u64],
    sink: u64,
    slots: usize,
) -> Option<Vec<usize>> {
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
        let Some(mut cap) = budget
            .checked_sub(slot.saturating_mul(slots as u64))
            .and_then(|c| c.checked_sub(forced))
        else {
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
/// candidates are weighed by their cost (reads, and a coded trunk's decoding at
/// [`Streams::decode_ppm`]) plus the sink's bytes the budget they leave cannot hold
/// ([`StreamPlan::cost_with`]). A sink of 0 is [`plan_streams`]. A coded trunk's layers
/// may also be kept coded ([`Streams::resident`], see the module documentation): with
/// `auto` only when that plan costs less than the raw one, with `coded` always.
pub fn plan_streams_with(
    budget: u64,
    s: &Streams,
    ring: RingPolicy,
    sink: u64,
) -> Result<StreamPlan, PlanError> {
    let net = |p: &StreamPlan| p.cost_with(sink);
    let layers = UnitCosts::of(&s.layers, &s.layer_reads, &s.layer_decoded, s.decode_ppm);
    let whole = plan(budget, &s.layers, ring).map(|p| layers.stream_plan(p, false, None));
    let raw = if s.parts.is_empty() {
        whole
    } else {
        raw_parts_or_whole(budget, s, ring, sink, whole)
    };
    if s.layer_kept.len() != s.layers.len() || s.resident == TrunkResident::Raw {
        return raw;
    }
    // Kept coded only where it costs less than the raw plan (`auto`), or always (`coded`).
    match (raw, plan_kept(budget, s, ring, sink)) {
        (Ok(r), Some(k)) if s.resident == TrunkResident::Auto && net(&k) >= net(&r) => Ok(r),
        (_, Some(k)) => Ok(k),
        (r, None) => r,
    }
}

/// The raw plan over parts (the prefix plan, or a pinned set `pin_order` picks) against
/// `whole`, the plan over whole layers: whichever costs less beside `sink`.
fn raw_parts_or_whole(
    budget: u64,
    s: &Streams,
    ring: RingPolicy,
    sink: u64,
    whole: Result<StreamPlan, PlanError>,
) -> Result<StreamPlan, PlanError> {
    let net = |p: &StreamPlan| p.cost_with(sink);
    let parts = UnitCosts::of(&s.parts, &s.part_reads, &s.part_decoded, s.decode_ppm);
    let prefix = plan(budget, &s.parts, ring).map(|p| parts.stream_plan(p, true, None));
    // Parts may also pin a set that is not a prefix (see `pin_order`); the prefix plan
    // stays on a tie.
    let chosen =
        pin_order(budget, &s.parts, &parts.cost, sink, ring.min.max(1)).and_then(|order| {
            let runs: Vec<LayerRun> = order.iter().map(|&i| s.parts[i]).collect();
            plan(budget, &runs, ring)
                .ok()
                .map(|p| parts.stream_plan(p, true, Some(order)))
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

/// The cheapest plan ([`StreamPlan::cost_with`] beside `sink`) that keeps layers of a coded
/// trunk coded, over whole layers and over parts: each raw-pinned set of
/// [`raw_pinned_sets`] with one slot for the largest unit it streams, filled by
/// [`keep_coded`]. With `coded` ([`Streams::resident`]) nothing is pinned raw and every
/// layer that fits is kept, whatever the sink; None when no plan fits (or, with `auto`,
/// none keeps a layer).
fn plan_kept(budget: u64, s: &Streams, ring: RingPolicy, sink: u64) -> Option<StreamPlan> {
    let whole: Vec<usize> = (0..s.layers.len()).collect();
    let kinds = [
        (false, &s.layers, &s.layer_reads, &s.layer_decoded, &whole),
        (
            true,
            &s.parts,
            &s.part_reads,
            &s.part_decoded,
            &s.part_layer,
        ),
    ];
    let mut best: Option<StreamPlan> = None;
    for (parts, runs, reads, decoded, layer_of) in kinds {
        if runs.is_empty() || layer_of.len() != runs.len() {
            continue;
        }
        let units = KeepUnits {
            fp: runs.iter().map(LayerRun::footprint).collect(),
            costs: UnitCosts::of(runs, reads, decoded, s.decode_ppm),
            layer_of,
            parts,
        };
        for pin in raw_pinned_sets(&units.fp, s.resident) {
            let Some(sp) = keep_coded(budget, s, ring, sink, &units, &pin) else {
                continue;
            };
            if best
                .as_ref()
                .is_none_or(|b| sp.cost_with(sink) < b.cost_with(sink))
            {
                best = Some(sp);
            }
        }
    }
    best
}

/// One kind of unit (layers or parts) as [`keep_coded`] weighs them.
struct KeepUnits<'a> {
    fp: Vec<u64>,
    costs: UnitCosts,
    /// The layer of each unit.
    layer_of: &'a [usize],
    parts: bool,
}

/// The raw-pinned sets a plan that keeps layers coded starts from: none with `coded`;
/// with `auto` every prefix of the units, and for each unit size the units larger than it
/// (those a slot of that size forces pinned).
fn raw_pinned_sets(fp: &[u64], resident: TrunkResident) -> Vec<Vec<bool>> {
    let n = fp.len();
    if resident == TrunkResident::Coded {
        return vec![vec![false; n]];
    }
    let mut sets: Vec<Vec<bool>> = (0..=n).map(|p| (0..n).map(|i| i < p).collect()).collect();
    let mut sizes = fp.to_vec();
    sizes.sort_unstable();
    sizes.dedup();
    for slot in sizes {
        sets.push(fp.iter().map(|&f| f > slot).collect());
    }
    sets
}

/// The plan that pins `pin` raw, keeps ring.min slots for the largest unit it streams, then
/// keeps layers coded in what is left, greedily by reads saved per byte kept (with `auto`
/// only a layer that lowers the cost beside `sink`: each byte the sink cannot hold is
/// read), then adds ring slots (up to ring.max) with the rest, as [`plan`] does. None when
/// it does not fit, streams nothing, or (with `auto`) keeps no layer.
fn keep_coded(
    budget: u64,
    s: &Streams,
    ring: RingPolicy,
    sink: u64,
    u: &KeepUnits,
    pin: &[bool],
) -> Option<StreamPlan> {
    let n = u.fp.len();
    let streamed: Vec<usize> = (0..n).filter(|&i| !pin[i]).collect();
    let slot = streamed.iter().map(|&i| u.fp[i]).max()?;
    let pinned_bytes: u64 = (0..n).filter(|&i| pin[i]).map(|i| u.fp[i]).sum();
    let ring_max = ring.max.max(1);
    let min = ring.min.clamp(1, ring_max).min(streamed.len());
    let mut left = budget
        .checked_sub(pinned_bytes)?
        .checked_sub(min as u64 * slot)?;
    // Reads each layer's streamed units would no longer make.
    let mut saved = vec![0u64; s.layer_kept.len()];
    for &i in &streamed {
        saved[u.layer_of[i]] += u.costs.read[i];
    }
    let mut order: Vec<usize> = (0..saved.len())
        .filter(|&l| saved[l] > 0 && s.layer_kept[l] > 0)
        .collect();
    // By reads saved per byte kept, the best first (cross-multiplied: no rounding).
    order.sort_by(|&a, &b| {
        let (ka, kb) = (s.layer_kept[a] as u128, s.layer_kept[b] as u128);
        (saved[b] as u128 * ka).cmp(&(saved[a] as u128 * kb))
    });
    let mut cost: u64 = streamed.iter().map(|&i| u.costs.cost[i]).sum();
    let mut kept = vec![false; saved.len()];
    let mut kept_bytes = 0u64;
    for l in order {
        let k = s.layer_kept[l];
        if k > left {
            continue;
        }
        let better = cost.saturating_sub(saved[l]) + sink.saturating_sub(left - k)
            < cost + sink.saturating_sub(left);
        if s.resident == TrunkResident::Coded || better {
            kept[l] = true;
            left -= k;
            kept_bytes += k;
            cost = cost.saturating_sub(saved[l]);
        }
    }
    if kept_bytes == 0 && s.resident != TrunkResident::Coded {
        return None;
    }
    let extra = ((left / slot) as usize).min(ring_max.min(streamed.len()) - min);
    let plan = TrunkPlan {
        layers: n,
        pinned: n - streamed.len(),
        pinned_bytes,
        ring_slots: min + extra,
        slot_bytes: slot,
        budget,
        kept: kept.iter().filter(|&&k| k).count(),
        kept_bytes,
    };
    let is_kept = |i: usize| kept[u.layer_of[i]];
    let prefix = (0..n).all(|i| pin[i] == (i < plan.pinned));
    Some(StreamPlan {
        plan,
        parts: u.parts,
        read_per_token: streamed
            .iter()
            .filter(|&&i| !is_kept(i))
            .map(|&i| u.costs.read[i])
            .sum(),
        decode_per_token: streamed.iter().map(|&i| u.costs.decoded[i]).sum(),
        cost_per_token: cost,
        kept: (0..kept.len()).filter(|&l| kept[l]).collect(),
        order: (!prefix).then(|| (0..n).filter(|&i| pin[i]).chain(streamed).collect()),
    })
}

/// What streaming each unit of one kind (layers or parts, in stream order) reads, decodes
/// and costs.
struct UnitCosts {
    read: Vec<u64>,
    decoded: Vec<u64>,
    /// `read` plus the decoding weighed as reads ([`decode_cost`]).
    cost: Vec<u64>,
}

impl UnitCosts {
    fn of(runs: &[LayerRun], reads: &[u64], decoded: &[u64], ppm: u64) -> UnitCosts {
        let read = read_costs(runs, reads);
        let decoded = decode_sizes(runs, decoded);
        let cost = read
            .iter()
            .zip(&decoded)
            .map(|(&r, &d)| r.saturating_add(decode_cost(d, ppm)))
            .collect();
        UnitCosts {
            read,
            decoded,
            cost,
        }
    }

    /// The [`StreamPlan`] of trunk plan `p` over these units in `order` (None: stream
    /// order): the units past the pinned ones stream.
    fn stream_plan(&self, p: TrunkPlan, parts: bool, order: Option<Vec<usize>>) -> StreamPlan {
        let sum = |v: &[u64]| -> u64 {
            match &order {
                Some(o) => o[p.pinned..].iter().map(|&i| v[i]).sum(),
                None => v[p.pinned..].iter().sum(),
            }
        };
        StreamPlan {
            plan: p,
            parts,
            read_per_token: sum(&self.read),
            decode_per_token: sum(&self.decoded),
            cost_per_token: sum(&self.cost),
            kept: Vec::new(),
            order,
        }
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

    /// A ring of several slots takes its pinned set for that many slots, so the loader's
    /// streamed units stay in stream order (the loader streams them cyclically). Catches
    /// a pinned set chosen for one slot and then cut for two: the units it unpinned came
    /// before earlier streamed ones, and the staged run failed "acquired out of order"
    /// (the slice at 5.5 GB with two slots, 2026-12-05).
    #[test]
    fn a_ring_of_several_slots_keeps_the_streamed_units_in_order() {
        let s = streams_of(&SLICE);
        let total: u64 = s.parts.iter().map(LayerRun::footprint).sum();
        let mut checked = 0;
        for min in 1..=3 {
            for budget in (1000..total / P).step_by(97).map(|b| b * P) {
                let ring = RingPolicy { min, max: 4 };
                let Ok(sp) = plan_streams(budget, &s, ring) else {
                    continue;
                };
                assert!(sp.plan.bytes() <= budget, "min {min}, budget {budget}");
                let Some(order) = &sp.order else { continue };
                let (pinned, streamed) = order.split_at(sp.plan.pinned);
                for part in [pinned, streamed] {
                    assert!(
                        part.windows(2).all(|w| w[0] < w[1]),
                        "min {min}, budget {budget}: order {order:?}, {} pinned",
                        sp.plan.pinned
                    );
                }
                checked += 1;
            }
        }
        assert!(checked > 10, "only {checked} plans had a pinned set");
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

    // Three parts of the same size: one raw (reads 10 pages, decodes nothing), one coded
    // (reads 7, decodes 10), one coded and small to stream (reads 2, decodes 2), and room to
    // pin one beside a slot. By stored bytes the raw one is pinned (streaming it reads
    // most); once decoding weighs half a read byte per decoded byte, streaming the first
    // coded one costs 7 + 5 = 12 and it is pinned instead. Catches a plan that ranks
    // pinning by stored bytes alone (today's: the coded part streams whatever the
    // decoder's rate), a decode weight applied to raw units, and a cost that is not what
    // the plan reports.
    #[test]
    fn decoding_weighs_coded_units_toward_pinning() {
        let ring = RingPolicy::default();
        let mut s = streams_of(&[10, 10, 10]);
        s.part_reads = vec![10 * P, 7 * P, 2 * P];
        s.part_decoded = vec![0, 10 * P, 2 * P];
        let pinned = |sp: &StreamPlan| -> Vec<usize> {
            let all = [0, 1, 2];
            sp.order.as_deref().unwrap_or(&all)[..sp.plan.pinned].to_vec()
        };
        let sp = plan_streams(20 * P, &s, ring).unwrap();
        assert_eq!(pinned(&sp), [0]);
        assert_eq!((sp.read_per_token, sp.decode_per_token), (9 * P, 12 * P));
        assert_eq!(sp.cost_per_token, 9 * P, "no weight: decoding is free");
        let w = s.clone().with_decode_weight(500_000);
        let sp = plan_streams(20 * P, &w, ring).unwrap();
        assert_eq!(pinned(&sp), [1]);
        assert_eq!((sp.read_per_token, sp.decode_per_token), (12 * P, 2 * P));
        assert_eq!(sp.cost_per_token, 13 * P);
        assert!(sp.plan.bytes() <= 20 * P);
        // A raw trunk plans the same at any weight.
        let raw = streams_of(&SLICE);
        let a = plan_streams_with(4833 * P, &raw, ring, 2350 * P).unwrap();
        let b = plan_streams_with(4833 * P, &raw.with_decode_weight(3_000_000), ring, 2350 * P)
            .unwrap();
        assert_eq!(a, b);
    }

    // The weight by hand: a 2.8 GB/s disk against 2 cores decoding 2 GB/s each is 0.7 of a
    // read byte per decoded byte; one core, 1.4. Catches the cores left out (decoding
    // counted as if compute did not share them) or the ratio upside down, and a bad rate
    // turned into an infinite weight.
    #[test]
    fn the_decode_weight_is_disk_over_decoders() {
        // The decoding gets the cores compute leaves, at least one: catches every core
        // counted while compute runs on them (the weight that kept slower layers coded).
        assert_eq!(decode_cores(2, 2), 1);
        assert_eq!(decode_cores(16, 16), 1);
        assert_eq!(decode_cores(16, 12), 4);
        assert_eq!(decode_cores(1, 4), 1);
        assert_eq!(decode_weight_ppm(2.8e9, 2e9, 2), 700_000);
        assert_eq!(decode_weight_ppm(2.8e9, 2e9, 1), 1_400_000);
        assert_eq!(decode_weight_ppm(7e9, 2e9, 16), 218_750);
        assert_eq!(decode_weight_ppm(0.0, 2e9, 2), 0);
        assert_eq!(decode_weight_ppm(2e9, f64::NAN, 2), 0);
        assert_eq!(decode_cost(10 * P, 700_000), 7 * P);
        assert_eq!(decode_cost(u64::MAX, 2_000_000), u64::MAX);
    }

    /// Four 10-page layers, each storing 6 pages (and keeping 6 pages of arena coded) and
    /// decoding 10, with decoding weighed at `ppm`, under `resident`.
    fn coded_layers(ppm: u64, resident: TrunkResident) -> Streams {
        Streams {
            layers: runs(&[10; 4]),
            layer_reads: vec![6 * P; 4],
            layer_decoded: vec![10 * P; 4],
            layer_kept: vec![6 * P; 4],
            ..Default::default()
        }
        .with_decode_weight(ppm)
        .with_resident(resident)
    }

    // At 34 pages the raw plan pins 2 layers and streams 2: 12 pages read plus 20 decoded a
    // token, 12 + 20w. Keeping all 4 coded beside one slot (24 + 10 pages) reads nothing and
    // decodes 40: 40w. So keeping wins below w = 0.6 and the raw plan from there on (a tie
    // stays raw). Catches a plan that never keeps (or always does), one that ignores the
    // decoding a kept layer still costs, a kept layer counted as read, and kept bytes left
    // out of the arena (the plan over its budget).
    #[test]
    fn keeping_coded_flips_where_decoding_costs_more_than_the_reads_it_saves() {
        let ring = RingPolicy::default();
        for (ppm, keeps) in [
            (0, true),
            (550_000, true),
            (600_000, false),
            (1_000_000, false),
        ] {
            let sp = plan_streams(34 * P, &coded_layers(ppm, TrunkResident::Auto), ring).unwrap();
            assert!(sp.plan.bytes() <= 34 * P, "{ppm}: {sp:?}");
            if keeps {
                assert_eq!(sp.kept, [0, 1, 2, 3], "{ppm}: {sp:?}");
                assert_eq!((sp.plan.pinned, sp.plan.kept), (0, 4));
                assert_eq!((sp.plan.kept_bytes, sp.plan.kept_at()), (24 * P, 10 * P));
                assert_eq!((sp.read_per_token, sp.decode_per_token), (0, 40 * P));
                assert_eq!(sp.cost_per_token, decode_cost(40 * P, ppm));
            } else {
                assert!(sp.kept.is_empty(), "{ppm}: {sp:?}");
                assert_eq!((sp.plan.pinned, sp.plan.kept_bytes), (2, 0));
                assert_eq!(sp.read_per_token, 12 * P);
            }
        }
    }

    // `raw` never keeps a layer coded (today's plan, whatever the weight); `coded` pins
    // nothing raw and keeps every layer that fits beside one slot, even where it costs
    // more, streaming the rest. Catches a flag that is not obeyed either way, and kept
    // layers past the budget.
    #[test]
    fn the_flag_forces_raw_or_coded() {
        let ring = RingPolicy::default();
        let raw = plan_streams(34 * P, &coded_layers(0, TrunkResident::Raw), ring).unwrap();
        assert!(raw.kept.is_empty());
        assert_eq!(raw.plan.pinned, 2);
        let mut bare = coded_layers(0, TrunkResident::Auto);
        bare.layer_kept.clear();
        assert_eq!(raw, plan_streams(34 * P, &bare, ring).unwrap());
        let forced = coded_layers(1_000_000, TrunkResident::Coded);
        let sp = plan_streams(34 * P, &forced, ring).unwrap();
        assert_eq!((sp.plan.pinned, sp.kept.len()), (0, 4));
        let sp = plan_streams(25 * P, &forced, ring).unwrap();
        assert_eq!(
            (sp.plan.pinned, sp.kept.len(), sp.plan.ring_slots),
            (0, 2, 1)
        );
        assert_eq!(sp.read_per_token, 12 * P, "two layers kept, two streamed");
        assert!(sp.plan.bytes() <= 25 * P);
    }

    // Random coded streams (layers and parts, a sink, any weight): `auto` never weighs more
    // than the raw plan, fits its budget, keeps only layers with a streamed unit, and
    // reports the reads, decoding and cost of what it streams and keeps. Catches a kept
    // plan that is worse than the raw one it replaces, kept bytes over the budget, and
    // per-token figures that count a kept unit as read (or a pinned one at all).
    #[test]
    fn auto_fits_and_never_weighs_more_than_raw() {
        let ring = RingPolicy::default();
        let mut next = xorshift(0xc0de_u64);
        for _ in 0..300 {
            let layers = 1 + next(5) as usize;
            let mut pages = Vec::new();
            let mut part_layer = Vec::new();
            for l in 0..layers {
                for _ in 0..1 + next(3) {
                    pages.push(1 + next(20));
                    part_layer.push(l);
                }
            }
            let mut s = streams_of(&pages);
            s.layers = runs(
                &(0..layers)
                    .map(|l| {
                        (0..pages.len())
                            .filter(|&i| part_layer[i] == l)
                            .map(|i| pages[i])
                            .sum()
                    })
                    .collect::<Vec<u64>>(),
            );
            s.part_layer = part_layer.clone();
            s.part_decoded = pages.iter().map(|&p| p * P).collect();
            s.part_reads = pages.iter().map(|&p| (p * P).div_ceil(3) * 2).collect();
            s.layer_decoded = s.layers.iter().map(|r| r.len).collect();
            s.layer_reads = (0..layers)
                .map(|l| {
                    (0..pages.len())
                        .filter(|&i| part_layer[i] == l)
                        .map(|i| s.part_reads[i])
                        .sum()
                })
                .collect();
            s.layer_kept = s.layer_reads.iter().map(|&r| align_up(r)).collect();
            let s = s.with_decode_weight(next(1_500_000));
            let total: u64 = pages.iter().sum();
            let budget = (1 + next(total + 10)) * P;
            let sink = next(2) * next(30) * P;
            let raw = plan_streams_with(
                budget,
                &s.clone().with_resident(TrunkResident::Raw),
                ring,
                sink,
            );
            let Ok(sp) = plan_streams_with(budget, &s, ring, sink) else {
                assert!(raw.is_err());
                continue;
            };
            assert!(sp.plan.bytes() <= budget, "{pages:?} {budget}: {sp:?}");
            if let Ok(r) = &raw {
                assert!(
                    sp.cost_with(sink) <= r.cost_with(sink),
                    "{pages:?} {budget}"
                );
            }
            let kept_bytes: u64 = sp.kept.iter().map(|&l| s.layer_kept[l]).sum();
            assert_eq!(
                (sp.plan.kept, sp.plan.kept_bytes),
                (sp.kept.len(), kept_bytes)
            );
            let (runs_, reads, decoded, layer_of): (_, _, _, Vec<usize>) = if sp.parts {
                (&s.parts, &s.part_reads, &s.part_decoded, part_layer.clone())
            } else {
                (
                    &s.layers,
                    &s.layer_reads,
                    &s.layer_decoded,
                    (0..layers).collect(),
                )
            };
            let all: Vec<usize> = (0..runs_.len()).collect();
            let order = sp.order.as_deref().unwrap_or(&all);
            let streamed = &order[sp.plan.pinned..];
            for &l in &sp.kept {
                assert!(streamed.iter().any(|&i| layer_of[i] == l), "{sp:?}");
            }
            let read: u64 = streamed
                .iter()
                .filter(|&&i| !sp.kept.contains(&layer_of[i]))
                .map(|&i| reads[i])
                .sum();
            let dec: u64 = streamed.iter().map(|&i| decoded[i]).sum();
            assert_eq!(
                (sp.read_per_token, sp.decode_per_token),
                (read, dec),
                "{sp:?}"
            );
        }
    }
}
