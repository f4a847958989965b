//! Offline expert-cache simulator: replay a `(layer, expert)` request trace against cache
//! policies at several capacities.
//!
//! Routing does not depend on the cache, so one recorded trace (`--dump-cache-trace`,
//! [`crate::trace`]) can be replayed at any capacity under any policy. Policies:
//!
//! - `lru`: least recently used (what the fetcher runs).
//! - `belady`: evict the key whose next use is furthest away (an offline ceiling, not a policy).
//! - `pin-lru`: half the slots (`cap / 2`) pinned to the experts requested most often over the
//!   whole trace (ties: the one first requested earlier), the other half an LRU. A pinned
//!   expert still misses the first time it is requested. This is the seed's PIN+LRU column.
//! - `s3fifo`: S3-FIFO (small FIFO 10%, main FIFO with 2-bit frequency, ghost FIFO).
//! - `lfu`: least frequently used since insertion, ties to the least recently used.
//! - `pin`: pinned-hot, static pinning with no dynamic part: every slot holds one of the
//!   most requested experts, counted over the first `pin_learn` share of the trace or
//!   given (`--pin-file`). Learned pins are scored on the REST of the trace only (the part
//!   they never saw; its rate scaled to the whole trace's requests), given ones on the
//!   whole. A pinned expert misses once in that window (its read); an unpinned one always
//!   misses.
//!
//! Every policy but `pin` always admits a missed key (no bypass), like the fetcher.
//!
//! A trace is either `--dump-cache-trace`'s `(layer, expert)` pairs (the fetcher's
//! requests: a prompt pass's union once per layer) or a route trace (`--record-routes`,
//! `k3_protocol::routes`: every row's top-k, [`keys_of_routes`]).

use std::collections::{BTreeSet, BinaryHeap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::path::Path;

/// One request: `(layer, expert)`.
pub type Key = (u32, u32);

/// A trace that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error(transparent)]
    Routes(#[from] k3_protocol::routes::RoutesError),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{path}: {len} bytes is not a whole number of int32 (layer, expert) pairs (8 bytes each)"
    )]
    Length { path: String, len: usize },
    #[error("{path}: request {index} has a negative field (layer {layer}, expert {expert})")]
    Negative {
        path: String,
        index: usize,
        layer: i32,
        expert: i32,
    },
}

/// Parse int32 little-endian `(layer, expert)` pairs. `name` is used in error messages.
pub fn parse_trace(bytes: &[u8], name: &str) -> Result<Vec<Key>, TraceError> {
    if !bytes.len().is_multiple_of(8) {
        return Err(TraceError::Length {
            path: name.to_string(),
            len: bytes.len(),
        });
    }
    let mut out = Vec::with_capacity(bytes.len() / 8);
    for (index, c) in bytes.chunks_exact(8).enumerate() {
        let layer = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        let expert = i32::from_le_bytes([c[4], c[5], c[6], c[7]]);
        if layer < 0 || expert < 0 {
            return Err(TraceError::Negative {
                path: name.to_string(),
                index,
                layer,
                expert,
            });
        }
        out.push((layer as u32, expert as u32));
    }
    Ok(out)
}

/// Read a trace file (see [`parse_trace`]).
pub fn read_trace(path: &Path) -> Result<Vec<Key>, TraceError> {
    Ok(read_any(path)?.0)
}

/// The requests of a route trace: each record's top-k in order, `(layer, expert)` each.
/// Two rows of one prompt pass that share an expert make two requests (the second a hit
/// for any cache that admitted the first, as the fetcher's held slot is).
pub fn keys_of_routes(t: &k3_protocol::routes::RouteTrace) -> Vec<Key> {
    t.routes()
        .flat_map(|r| {
            let l = r.layer;
            r.ids.into_iter().map(move |e| (l, e))
        })
        .collect()
}

/// Read either kind of trace: a route trace (by its magic; its header too) or
/// `--dump-cache-trace`'s pairs.
pub fn read_any(
    path: &Path,
) -> Result<(Vec<Key>, Option<k3_protocol::routes::RouteHeader>), TraceError> {
    use k3_protocol::routes::RouteTrace;
    let name = path.display().to_string();
    let bytes = k3_io::input::read_capped(path, k3_io::input::TRACE_CAP).map_err(|source| {
        TraceError::Io {
            path: name.clone(),
            source,
        }
    })?;
    if RouteTrace::is_route_trace(&bytes) {
        let t = RouteTrace::parse(&bytes, &name)?;
        return Ok((keys_of_routes(&t), Some(t.header)));
    }
    Ok((parse_trace(&bytes, &name)?, None))
}

/// A replacement policy the simulator knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    Lru,
    Belady,
    PinLru,
    S3Fifo,
    Lfu,
    PinHot,
}

impl Policy {
    /// Every policy, in the order `--policy` documents them.
    pub const ALL: [Policy; 6] = [
        Policy::Lru,
        Policy::Belady,
        Policy::PinLru,
        Policy::S3Fifo,
        Policy::Lfu,
        Policy::PinHot,
    ];

    /// The command-line spelling (`lru`, `belady`, `pin-lru`, `s3fifo`, `lfu`).
    pub fn name(self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Belady => "belady",
            Policy::PinLru => "pin-lru",
            Policy::S3Fifo => "s3fifo",
            Policy::Lfu => "lfu",
            Policy::PinHot => "pin",
        }
    }

    /// The table column heading.
    pub fn heading(self) -> &'static str {
        match self {
            Policy::Lru => "LRU",
            Policy::Belady => "BELADY",
            Policy::PinLru => "PIN+LRU",
            Policy::S3Fifo => "S3-FIFO",
            Policy::Lfu => "LFU",
            Policy::PinHot => "PINNED",
        }
    }

    /// Parse one policy name.
    pub fn parse(s: &str) -> Option<Policy> {
        let s = s.trim().to_ascii_lowercase();
        Policy::ALL.into_iter().find(|p| {
            p.name() == s
                || (s == "pinlru" && *p == Policy::PinLru)
                || (s == "s3-fifo" && *p == Policy::S3Fifo)
                || (s == "pinned-hot" && *p == Policy::PinHot)
        })
    }
}

/// A trace with its keys renumbered densely (0..distinct) for the policies.
pub struct DenseTrace {
    /// Dense id of each request.
    pub ids: Vec<u32>,
    /// The key of each dense id.
    pub keys: Vec<Key>,
    /// For request i, the index of the next request of the same key (`usize::MAX`: none).
    next_use: Vec<usize>,
    /// Requests per dense id over the whole trace.
    counts: Vec<u64>,
}

impl DenseTrace {
    /// Renumber a trace. Dense ids are assigned in order of first request.
    pub fn new(trace: &[Key]) -> DenseTrace {
        let mut map: HashMap<Key, u32> = HashMap::new();
        let mut keys = Vec::new();
        let mut ids = Vec::with_capacity(trace.len());
        for &k in trace {
            let id = *map.entry(k).or_insert_with(|| {
                keys.push(k);
                (keys.len() - 1) as u32
            });
            ids.push(id);
        }
        let mut next_use = vec![usize::MAX; ids.len()];
        let mut last = vec![usize::MAX; keys.len()];
        for i in (0..ids.len()).rev() {
            let id = ids[i] as usize;
            next_use[i] = last[id];
            last[id] = i;
        }
        let mut counts = vec![0u64; keys.len()];
        for &id in &ids {
            counts[id as usize] += 1;
        }
        DenseTrace {
            ids,
            keys,
            next_use,
            counts,
        }
    }

    /// Requests in the trace.
    pub fn requests(&self) -> usize {
        self.ids.len()
    }

    /// Distinct keys in the trace (the compulsory misses of any policy).
    pub fn distinct(&self) -> usize {
        self.keys.len()
    }
}

/// Where pinned-hot's pin set comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum Pins {
    /// The most requested over the first share (0 < share <= 1) of the trace.
    Learn(f64),
    /// These, most important first (the first `capacity` are pinned).
    Given(Vec<Key>),
}

impl Default for Pins {
    fn default() -> Self {
        Pins::Learn(DEFAULT_PIN_LEARN)
    }
}

/// The share of a trace pinned-hot learns its pins on by default.
pub const DEFAULT_PIN_LEARN: f64 = 0.25;

/// Hits of `policy` over the trace with a cache of `capacity` experts (pinned-hot learning
/// its pins on the default share, [`DEFAULT_PIN_LEARN`]).
pub fn simulate(policy: Policy, t: &DenseTrace, capacity: usize) -> u64 {
    simulate_with(policy, t, capacity, &Pins::default())
}

/// [`simulate`] with pinned-hot's pins from `pins`.
pub fn simulate_with(policy: Policy, t: &DenseTrace, capacity: usize, pins: &Pins) -> u64 {
    if capacity == 0 {
        return 0;
    }
    match policy {
        Policy::PinHot => pin_hot(t, &pin_set(t, capacity, pins), learn_len(t, pins)),
        Policy::Lru => lru(t, capacity, &[]),
        Policy::Belady => belady(t, capacity),
        Policy::PinLru => pin_lru(t, capacity),
        Policy::S3Fifo => s3fifo(t, capacity),
        Policy::Lfu => lfu(t, capacity),
    }
}

/// LRU over `capacity` slots; ids with `pinned[id]` bypass it (see [`pin_lru`]).
fn lru(t: &DenseTrace, capacity: usize, pinned: &[bool]) -> u64 {
    let n = t.distinct();
    let mut stamp_of = vec![u64::MAX; n]; // u64::MAX: not resident
    let mut order: BTreeSet<(u64, u32)> = BTreeSet::new();
    let mut pinned_loaded = vec![false; if pinned.is_empty() { 0 } else { n }];
    let mut hits = 0u64;
    for (i, &id) in t.ids.iter().enumerate() {
        let u = id as usize;
        if !pinned.is_empty() && pinned[u] {
            if pinned_loaded[u] {
                hits += 1;
            } else {
                pinned_loaded[u] = true;
            }
            continue;
        }
        let now = i as u64;
        if stamp_of[u] != u64::MAX {
            hits += 1;
            order.remove(&(stamp_of[u], id));
        } else if capacity == 0 {
            continue;
        } else if order.len() >= capacity {
            let (_, victim) = order.pop_first().expect("non-empty at capacity");
            stamp_of[victim as usize] = u64::MAX;
        }
        stamp_of[u] = now;
        order.insert((now, id));
    }
    hits
}

/// Belady's MIN with lazy deletion in a max-heap of next-use positions.
fn belady(t: &DenseTrace, capacity: usize) -> u64 {
    const NEVER: usize = usize::MAX;
    let mut next_of = vec![None::<usize>; t.distinct()];
    let mut heap: BinaryHeap<(usize, u32)> = BinaryHeap::new();
    let mut resident = 0usize;
    let mut hits = 0u64;
    for (i, &id) in t.ids.iter().enumerate() {
        let u = id as usize;
        let nu = if t.next_use[i] == usize::MAX {
            NEVER
        } else {
            t.next_use[i]
        };
        if next_of[u].is_some() {
            hits += 1;
        } else {
            if resident >= capacity {
                loop {
                    let (n, v) = heap.pop().expect("a resident key is in the heap");
                    if next_of[v as usize] == Some(n) {
                        next_of[v as usize] = None;
                        resident -= 1;
                        break;
                    }
                }
            }
            resident += 1;
        }
        next_of[u] = Some(nu);
        heap.push((nu, id));
    }
    hits
}

/// PIN+LRU: `capacity / 2` most requested experts pinned, the rest an LRU.
fn pin_lru(t: &DenseTrace, capacity: usize) -> u64 {
    let npin = capacity / 2;
    // Most requested first; ties to the earlier first request (dense ids are first-request order).
    let mut by_count: Vec<u32> = (0..t.distinct() as u32).collect();
    by_count.sort_by(|&a, &b| {
        t.counts[b as usize]
            .cmp(&t.counts[a as usize])
            .then(a.cmp(&b))
    });
    let mut pinned = vec![false; t.distinct()];
    for &id in by_count.iter().take(npin) {
        pinned[id as usize] = true;
    }
    if t.distinct() == 0 {
        return 0;
    }
    lru(t, capacity - npin, &pinned)
}

/// Requests pinned-hot learns its pins on (0: given pins, or a share of 1, scored on the
/// whole trace).
fn learn_len(t: &DenseTrace, pins: &Pins) -> usize {
    match pins {
        Pins::Learn(share) if *share < 1.0 => {
            ((t.requests() as f64 * share.max(0.0)).ceil() as usize).min(t.requests())
        }
        _ => 0,
    }
}

/// Pinned-hot's pin set over `t`'s dense ids: at most `capacity` of them.
pub fn pin_set(t: &DenseTrace, capacity: usize, pins: &Pins) -> Vec<bool> {
    let mut pinned = vec![false; t.distinct()];
    match pins {
        Pins::Given(keys) => {
            let dense: HashMap<Key, usize> =
                t.keys.iter().enumerate().map(|(i, &k)| (k, i)).collect();
            // A given key the trace never requests still takes its slot.
            for k in keys.iter().take(capacity) {
                if let Some(&i) = dense.get(k) {
                    pinned[i] = true;
                }
            }
        }
        Pins::Learn(_) => {
            let n = match learn_len(t, pins) {
                0 => t.requests(),
                n => n,
            };
            let mut counts = vec![0u64; t.distinct()];
            for &id in &t.ids[..n] {
                counts[id as usize] += 1;
            }
            // Most requested first; ties to the earlier first request (dense id order).
            let mut by: Vec<usize> = (0..t.distinct()).filter(|&i| counts[i] > 0).collect();
            by.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
            for &i in by.iter().take(capacity) {
                pinned[i] = true;
            }
        }
    }
    pinned
}

/// Static pinning scored on the requests from `from` on: a pinned id misses its first
/// request there and hits every later one; an unpinned id always misses (nothing else is
/// cached). The hits are scaled to the whole trace (hits × requests / scored requests), so
/// the rate is the scored window's.
fn pin_hot(t: &DenseTrace, pinned: &[bool], from: usize) -> u64 {
    let mut loaded = vec![false; pinned.len()];
    let mut hits = 0u64;
    for &id in &t.ids[from..] {
        let u = id as usize;
        if pinned[u] {
            if loaded[u] {
                hits += 1;
            }
            loaded[u] = true;
        }
    }
    let scored = (t.requests() - from) as u64;
    if scored == 0 {
        return 0;
    }
    ((hits as u128 * t.requests() as u128 + scored as u128 / 2) / scored as u128) as u64
}

/// Where an id sits in S3-FIFO.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Q {
    Out,
    Small,
    Main,
}

/// S3-FIFO (Yang et al., SOSP 2023, Algorithm 1): a small probationary FIFO (10% of the
/// slots, at least one), a main FIFO with a 2-bit frequency and reinsertion, and a ghost
/// FIFO of keys evicted from the small queue (as many entries as the main queue has
/// slots). A hit adds one to the key's frequency, capped at 3. A miss makes room first
/// (from the small queue while it holds at least its 10%, else from the main), then
/// inserts into the main queue if the key is in the ghost, else into the small one, with
/// frequency 0. The small queue's tail moves to the main queue when its frequency is above
/// 1 (the paper's `t.freq > 1`), its bits cleared on the move (the authors' description),
/// else it leaves for the ghost; the main queue's tail is reinserted with one less while
/// its frequency is above 0, else evicted.
fn s3fifo(t: &DenseTrace, capacity: usize) -> u64 {
    let n = t.distinct();
    let small_cap = (capacity / 10).max(1);
    let main_cap = capacity.saturating_sub(small_cap);
    let ghost_cap = main_cap.max(1);
    let mut where_ = vec![Q::Out; n];
    let mut freq = vec![0u8; n];
    let mut small: VecDeque<u32> = VecDeque::new();
    let mut main: VecDeque<u32> = VecDeque::new();
    let mut ghost: VecDeque<(u32, u64)> = VecDeque::new();
    let mut ghost_gen = vec![0u64; n]; // 0: not in ghost; else the generation of its entry
    let mut gen = 0u64;
    let mut hits = 0u64;

    // Evict one from main (with reinsertion of recently used keys).
    fn evict_main(main: &mut VecDeque<u32>, where_: &mut [Q], freq: &mut [u8]) {
        while let Some(v) = main.pop_front() {
            let u = v as usize;
            if freq[u] > 0 {
                freq[u] -= 1;
                main.push_back(v);
            } else {
                where_[u] = Q::Out;
                return;
            }
        }
    }

    for &id in &t.ids {
        let u = id as usize;
        if where_[u] != Q::Out {
            hits += 1;
            freq[u] = (freq[u] + 1).min(3);
            continue;
        }
        // Make room.
        while small.len() + main.len() >= capacity {
            if small.len() >= small_cap || main.is_empty() {
                // Evict from small: promote keys used while on probation.
                let mut evicted = false;
                while !evicted {
                    let Some(v) = small.pop_front() else { break };
                    let vu = v as usize;
                    if freq[vu] > 1 {
                        where_[vu] = Q::Main;
                        freq[vu] = 0;
                        main.push_back(v);
                        if main.len() > main_cap {
                            evict_main(&mut main, &mut where_, &mut freq);
                            evicted = true;
                        }
                    } else {
                        where_[vu] = Q::Out;
                        gen += 1;
                        ghost_gen[vu] = gen;
                        ghost.push_back((v, gen));
                        while ghost.len() > ghost_cap {
                            let (g, gg) = ghost.pop_front().expect("non-empty");
                            if ghost_gen[g as usize] == gg {
                                ghost_gen[g as usize] = 0;
                            }
                        }
                        evicted = true;
                    }
                }
            } else {
                evict_main(&mut main, &mut where_, &mut freq);
            }
        }
        freq[u] = 0;
        if ghost_gen[u] != 0 {
            ghost_gen[u] = 0;
            where_[u] = Q::Main;
            main.push_back(id);
        } else {
            where_[u] = Q::Small;
            small.push_back(id);
        }
    }
    hits
}

/// LFU: evict the fewest requests since insertion, ties to the least recently used.
fn lfu(t: &DenseTrace, capacity: usize) -> u64 {
    let n = t.distinct();
    let mut state: Vec<Option<(u64, u64)>> = vec![None; n]; // (freq, last use)
    let mut order: BTreeSet<(u64, u64, u32)> = BTreeSet::new();
    let mut hits = 0u64;
    for (i, &id) in t.ids.iter().enumerate() {
        let u = id as usize;
        let now = i as u64;
        let f = match state[u] {
            Some((f, last)) => {
                hits += 1;
                order.remove(&(f, last, id));
                f + 1
            }
            None => {
                if order.len() >= capacity {
                    let (_, _, v) = order.pop_first().expect("non-empty at capacity");
                    state[v as usize] = None;
                }
                1
            }
        };
        state[u] = Some((f, now));
        order.insert((f, now, id));
    }
    hits
}

/// Parameters of the report.
#[derive(Clone, Debug)]
pub struct SimOptions {
    /// Policies, one column each, in this order; the first one drives GB READ/TOK and SEC/TOK.
    pub policies: Vec<Policy>,
    /// Cache sizes in GB (10^9 bytes); slots = floor(gb * 1e9 / expert_bytes).
    pub sizes_gb: Vec<f64>,
    /// Bytes of one routed expert (17,547,264 for Kimi K3).
    pub expert_bytes: u64,
    /// Routed experts per layer (896 for Kimi K3), for the pool size.
    pub experts_per_layer: u64,
    /// Experts per layer per token (16 for Kimi K3), for the token estimate.
    pub top_k: u64,
    /// Disk bandwidth in MB/s (10^6 bytes/s) that turns GB READ/TOK into SEC/TOK. The seed's
    /// published table implies about 1233.6 MB/s; pass the `devbw` figure of your disk.
    pub disk_mbps: f64,
    /// Capacities in slots; when not empty they replace `sizes_gb` (a row's size is then
    /// `slots × expert_bytes`).
    pub slots: Vec<usize>,
    /// Pinned-hot's pins.
    pub pins: Pins,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            policies: vec![Policy::Lru, Policy::Belady, Policy::PinLru],
            sizes_gb: vec![8.0, 16.0, 32.0, 64.0, 128.0, 192.0, 1450.0],
            expert_bytes: 17_547_264,
            experts_per_layer: 896,
            top_k: 16,
            disk_mbps: 1233.6,
            slots: Vec::new(),
            pins: Pins::default(),
        }
    }
}

/// One row of the table: a capacity and each policy's hits.
#[derive(Clone, Debug)]
pub struct SimRow {
    pub size_gb: f64,
    pub slots: usize,
    /// Hits per policy, in `SimOptions::policies` order.
    pub hits: Vec<u64>,
}

/// The whole simulation result.
#[derive(Clone, Debug)]
pub struct SimReport {
    pub requests: u64,
    pub distinct: u64,
    /// Distinct layers that appear in the trace.
    pub layers: u64,
    pub rows: Vec<SimRow>,
    pub options: SimOptions,
}

/// Slots a cache of `gb` GB (10^9 bytes) holds.
pub fn slots_for_gb(gb: f64, expert_bytes: u64) -> usize {
    if expert_bytes == 0 || gb <= 0.0 {
        return 0;
    }
    (gb * 1e9 / expert_bytes as f64).floor() as usize
}

/// Run every policy at every size.
pub fn run(trace: &[Key], options: &SimOptions) -> SimReport {
    let t = DenseTrace::new(trace);
    let mut layers: Vec<u32> = t.keys.iter().map(|k| k.0).collect();
    layers.sort_unstable();
    layers.dedup();
    let sizes: Vec<(f64, usize)> = if options.slots.is_empty() {
        options
            .sizes_gb
            .iter()
            .map(|&gb| (gb, slots_for_gb(gb, options.expert_bytes)))
            .collect()
    } else {
        options
            .slots
            .iter()
            .map(|&s| (s as f64 * options.expert_bytes as f64 / 1e9, s))
            .collect()
    };
    let rows = sizes
        .into_iter()
        .map(|(gb, slots)| SimRow {
            size_gb: gb,
            slots,
            hits: options
                .policies
                .iter()
                .map(|&p| simulate_with(p, &t, slots, &options.pins))
                .collect(),
        })
        .collect();
    SimReport {
        requests: t.requests() as u64,
        distinct: t.distinct() as u64,
        layers: layers.len() as u64,
        rows,
        options: options.clone(),
    }
}

fn pct(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        100.0 * num as f64 / den as f64
    }
}

fn gb_label(gb: f64) -> String {
    if gb.fract() == 0.0 {
        format!("{gb:.0} GB")
    } else {
        format!("{gb} GB")
    }
}

impl SimReport {
    /// Requests one token makes (`top_k` x layers in the trace).
    pub fn requests_per_token(&self) -> u64 {
        self.options.top_k * self.layers
    }

    /// Tokens the trace covers, estimated as requests / requests per token.
    pub fn tokens(&self) -> f64 {
        let per = self.requests_per_token();
        if per == 0 {
            0.0
        } else {
            self.requests as f64 / per as f64
        }
    }

    /// The hit-rate ceiling of any policy at any size: 1 - distinct / requests.
    pub fn ceiling_pct(&self) -> f64 {
        pct(self.requests - self.distinct, self.requests)
    }

    /// Render the report as text (the seed's table layout).
    pub fn render(&self) -> String {
        let o = &self.options;
        let eb = o.expert_bytes as f64;
        let pool = self.layers * o.experts_per_layer;
        let tokens = self.tokens();
        let gb_tok_cold = self.requests_per_token() as f64 * eb / 1e9;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "trace: {} requests, {} distinct experts, about {:.0} token(s)",
            self.requests, self.distinct, tokens
        );
        let _ = writeln!(
            s,
            "distinct experts touched: {} of {} ({:.2}% of the pool)",
            self.distinct,
            pool,
            pct(self.distinct, pool)
        );
        let _ = writeln!(s, "if nothing were cached: {gb_tok_cold:.2} GB per token");
        let _ = writeln!(
            s,
            "total reuse: {} of {} requests are repeats ({:.1}%)",
            self.requests - self.distinct,
            self.requests,
            self.ceiling_pct()
        );
        let _ = writeln!(s);
        let mut head = format!("{:<12}{:>6}", "CACHE", "SLOTS");
        for p in &o.policies {
            let _ = write!(head, "{:>10}", p.heading());
        }
        let _ = write!(head, "{:>13}{:>12}", "GB READ/TOK", "SEC/TOK");
        let _ = writeln!(s, "{head}");
        let _ = writeln!(s, "{}", "-".repeat(head.len()));
        for r in &self.rows {
            let label = if o.slots.is_empty() {
                gb_label(r.size_gb)
            } else {
                format!("{:.1}% pool", pct(r.slots as u64, pool))
            };
            let mut line = format!("{label:<12}{:>6}", r.slots);
            for &h in &r.hits {
                let _ = write!(line, "{:>9.2}%", pct(h, self.requests));
            }
            let first = r.hits.first().copied().unwrap_or(0);
            let misses = self.requests - first;
            let gb_tok = if tokens > 0.0 {
                misses as f64 * eb / 1e9 / tokens
            } else {
                0.0
            };
            let sec_tok = if o.disk_mbps > 0.0 {
                gb_tok * 1e3 / o.disk_mbps
            } else {
                0.0
            };
            let _ = write!(line, "{gb_tok:>13.2}{sec_tok:>12.2}");
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s);
        if let Some(p) = o.policies.first() {
            let _ = writeln!(
                s,
                "GB READ/TOK and SEC/TOK are for {} at {} MB/s (--disk-mbps).",
                p.heading(),
                o.disk_mbps
            );
        }
        let _ = writeln!(
            s,
            "compulsory misses: {} (every expert must be read at least once), a ceiling of\n\
             {:.2}% hit rate for ANY policy at ANY size on this trace.",
            self.distinct,
            self.ceiling_pct()
        );
        s
    }
}

/// A synthetic route trace: `tokens` tokens through `layers` MoE layers of `experts`, each
/// taking `top_k` distinct experts drawn with Zipf weights of exponent `zipf` (0: flat, the
/// router K3 is trained for; 1: a strongly skewed one), each layer's popularity order a
/// different permutation. Tokens are independent (no temporal correlation: a real trace's
/// recency is exactly what this leaves out). Deterministic in `seed`.
pub fn synthetic_routes(
    tokens: u32,
    layers: u32,
    experts: u32,
    top_k: u32,
    zipf: f64,
    seed: u64,
) -> k3_protocol::routes::RouteTrace {
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut cdf = Vec::with_capacity(experts as usize);
    let mut acc = 0.0;
    for r in 0..experts {
        acc += 1.0 / ((r + 1) as f64).powf(zipf);
        cdf.push(acc);
    }
    let perms: Vec<Vec<u32>> = (0..layers)
        .map(|_| {
            let mut p: Vec<u32> = (0..experts).collect();
            for i in (1..p.len()).rev() {
                p.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            p
        })
        .collect();
    let mut t = k3_protocol::routes::RouteTrace::new(
        format!("synthetic zipf {zipf} seed {seed}"),
        layers,
        (0..layers).collect(),
        experts,
        top_k,
    );
    let k = top_k.min(experts) as usize;
    let mut ids = Vec::with_capacity(k);
    for pos in 0..tokens {
        for (l, perm) in perms.iter().enumerate() {
            ids.clear();
            while ids.len() < k {
                let u = (next() >> 11) as f64 / (1u64 << 53) as f64 * acc;
                let r = cdf.partition_point(|&c| c <= u).min(experts as usize - 1);
                let id = perm[r];
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
            t.push(pos, l as u32, &ids)
                .expect("synthetic ids fit the format (experts < 65536)");
        }
    }
    t
}
