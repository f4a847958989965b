//! The memory plan: everything a run will hold, added up before anything is allocated.
//!
//! One total budget (`--mem-gb`, or by default and with `--preset auto` what is available:
//! MemAvailable capped by the room in k3's own cgroup, minus a 5% reserve) is spent to read
//! the fewest bytes per token ([`choose`], [`spend`]): what every run holds first (state,
//! KV, scratch, one embedding row per token: the embedding is never resident), then the
//! trunk and the lm_head pinned by bytes saved per token (the lm_head streams in chunks when
//! pinning it would read more), the expert cache last. A coded trunk's streamed parts also
//! cost their decoding on every token, weighed as the bytes the disk reads in that time
//! ([`DecodeTerms`]: the drive's rate and the decoder's, measured at the start or given),
//! so pinning is ranked by time saved per byte of RAM, not by stored bytes alone.
//! `--preset NAME`, `--trunk-gb` and `--cache-gb` override parts, left to right
//! ([`resolve`]).
//!
//! The plan is a forecast; the report's measured true peak (the stage cgroups' peaks, or
//! the sampled PSS) is the number to quote. A plan that does not fit its total or what is
//! available is refused up front (exit 2) with the shortfall and the options, and so is an
//! incremental run whose KV cache alone would not fit.

use serde::Serialize;

use k3_model::config::ModelConfig;
// What this run may still take: MemAvailable capped by the room left in the memory cgroup
// k3 itself runs in (one copy, in k3-io: the presets and `doctor` read it too).
use k3_io::sysmem::mem_available;

use super::args::{GenArgs, HeadRead, MemFlag, Prompt, MAX_PROMPT};
use super::sizes::ModelSizes;

pub use crate::units::{human, GB};

/// Why a run's memory plan cannot be made or is refused (every one is refused up front).
/// The refusals ([`BudgetError::is_refusal`]) are complete messages; the others are the
/// flag or file at fault.
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    /// The plan needs more than the whole run's budget.
    #[error(
        "REFUSING TO START: this needs {} and the budget is {}, a shortfall of {}.\n\
         Options: a larger --mem-gb, smaller --trunk-gb/--cache-gb, fewer --layers.",
        human(*need),
        human(*budget),
        human(need - budget)
    )]
    OverBudget { need: u64, budget: u64 },
    /// The plan needs more than the machine has available (less the reserve).
    #[error(
        "REFUSING TO START: this needs {} and the machine has {} available (MemAvailable, \
         capped by\nthe memory limit of the cgroup k3 runs in), a shortfall of {}.\n\
         Options: a smaller --cache-gb or --trunk-gb (or a smaller --preset), --trunk DIR to \
         stream the\ntrunk instead of loading it whole, fewer --layers, or a machine with \
         more memory.",
        human(*need),
        human(*have),
        human(*shortfall)
    )]
    OverAvailable {
        need: u64,
        have: u64,
        shortfall: u64,
    },
    /// An incremental run's KV cache alone does not fit.
    #[error(
        "REFUSING: the KV cache for {positions} positions needs {} but only {} is \
         available.\nThis is a MEMORY limit, not an engine ceiling: the MLA layers cache {} \
         per position\nwhatever the budget. Shorten the request, or pass --full-recompute \
         (full recompute\ncarries no KV cache at all).",
        human(*positions as u64 * per_pos),
        human(*have),
        human(*per_pos)
    )]
    KvCache {
        positions: usize,
        per_pos: u64,
        have: u64,
    },
    /// A total cannot hold what every run holds.
    #[error(
        "a total of {} cannot hold what every run needs: {} (state, KV, embedding rows, \
         norms, scratch, stage processes), the lm_head {} and the expert slots a batch \
         streams through {}: a shortfall of {}",
        human(*total),
        human(*fixed),
        human(*lm_head),
        human(*min_cache),
        human(fixed + lm_head + min_cache - total)
    )]
    TotalTooSmall {
        total: u64,
        fixed: u64,
        lm_head: u64,
        min_cache: u64,
    },
    /// The trunk's share cannot stream the packed trunk.
    #[error(transparent)]
    Trunk(#[from] k3_trunk_loader::PlanError),
    /// The split of a budget was refused: where the budget came from, and why.
    #[error(
        "REFUSING TO START ({budget}): {why}.\nOptions: a larger --mem-gb, fewer --layers, \
         --trunk DIR to stream the trunk, or a machine with more memory."
    )]
    Refused {
        budget: String,
        #[source]
        why: Box<BudgetError>,
    },
    #[error("cannot read MemAvailable from /proc/meminfo; give the budget with --mem-gb")]
    NoMemAvailable,
    #[error("--preset: unknown preset '{name}' ({known})")]
    UnknownPreset { name: String, known: String },
    /// `--trunk DIR`'s manifest.
    #[error(transparent)]
    Manifest(#[from] k3_model::trunk::TrunkError),
    #[error(
        "--trunk {}: not a copy of the packed trunk in {}: {why} (copy the whole directory, \
         e.g. `cp -r`)",
        copy.display(),
        dir.display()
    )]
    TrunkCopy {
        dir: std::path::PathBuf,
        copy: std::path::PathBuf,
        why: String,
    },
    #[error("--trunk {}: it holds {have} layers, the run binds {want}", dir.display())]
    TrunkLayers {
        dir: std::path::PathBuf,
        have: usize,
        want: usize,
    },
    #[error("--parallel, --ctx and --prefill-chunk must be at least 1")]
    ServeZero,
    #[error(
        "--lm-head-read coded: {} holds no coded lm_head (`k3-orch pack-trunk MODEL DIR \
         --codec bf16-zstd` codes it, also into a trunk coded before)",
        match dir { Some(d) => format!("--trunk {}", d.display()), None => "no --trunk".into() }
    )]
    NoCodedHead { dir: Option<std::path::PathBuf> },
    /// `--parallel N` slots do not fit: why the plan for N was refused, what the slots
    /// hold, and the largest N that fits (0: not even one).
    #[error(
        "{cause}\nREFUSING --parallel {slots}: {slots} slot(s) at --ctx {ctx} hold {} of KV \
         cache and recurrent state ({} each), a pass of up to {rows} rows {} of scratch, and \
         the prefix cache {}; {}.",
        human(slot.saturating_mul(*slots as u64)),
        human(*slot),
        human(*scratch),
        human(*prefix),
        largest_fit(*largest)
    )]
    Slots {
        #[source]
        cause: Box<BudgetError>,
        slots: usize,
        ctx: usize,
        slot: u64,
        rows: usize,
        scratch: u64,
        prefix: u64,
        largest: usize,
    },
}

/// The end of a `--parallel` refusal: the largest N that fits, if any.
fn largest_fit(largest: usize) -> String {
    if largest == 0 {
        "not even --parallel 1 fits: lower --ctx, --cache-entries or --prefix-gb, or give \
         more memory"
            .to_string()
    } else {
        format!("the largest --parallel that fits is {largest}")
    }
}

impl BudgetError {
    /// A refusal of the plan (a complete message, said as it is), not a flag or file at
    /// fault.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            BudgetError::OverBudget { .. }
                | BudgetError::OverAvailable { .. }
                | BudgetError::KvCache { .. }
                | BudgetError::Refused { .. }
                | BudgetError::Slots { .. }
        )
    }
}

/// One line of the plan.
#[derive(Clone, Debug, Serialize)]
pub struct PlanItem {
    pub what: String,
    pub stage: String,
    pub bytes: u64,
}

/// The whole plan, with the budgets it came from.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryPlan {
    pub trunk_budget_bytes: u64,
    pub cache_budget_bytes: u64,
    pub trunk_streamed: bool,
    pub items: Vec<PlanItem>,
    pub total_bytes: u64,
    pub available_bytes: Option<u64>,
    /// The whole run's budget (`--mem-gb`, `auto` or the default), when there is one.
    pub total_budget_bytes: Option<u64>,
    /// Bytes read per token outside the expert cache: trunk layers not pinned and a streamed
    /// lm_head (0 when both are held).
    pub streamed_bytes_per_token: u64,
    /// Layers of a coded trunk kept coded in the trunk-loader's memory
    /// (`--trunk-resident`), and the arena bytes their stored runs take (in the items).
    pub trunk_kept_layers: usize,
    pub trunk_kept_bytes: u64,
}

impl MemoryPlan {
    pub fn new(trunk_budget_bytes: u64, cache_budget_bytes: u64, trunk_streamed: bool) -> Self {
        MemoryPlan {
            trunk_budget_bytes,
            cache_budget_bytes,
            trunk_streamed,
            items: Vec::new(),
            total_bytes: 0,
            available_bytes: None,
            total_budget_bytes: None,
            streamed_bytes_per_token: 0,
            trunk_kept_layers: 0,
            trunk_kept_bytes: 0,
        }
    }

    pub fn add(&mut self, what: &str, stage: &str, bytes: u64) {
        self.items.push(PlanItem {
            what: what.to_string(),
            stage: stage.to_string(),
            bytes,
        });
        self.total_bytes += bytes;
    }

    /// Bytes the plan gives one stage (its cgroup budget before headroom).
    pub fn stage_bytes(&self, stage: &str) -> u64 {
        self.items
            .iter()
            .filter(|i| i.stage == stage)
            .map(|i| i.bytes)
            .sum()
    }

    /// Refuse when the plan exceeds 95% of what the machine has available.
    pub fn check(&self) -> Result<(), BudgetError> {
        if let Some(b) = self.total_budget_bytes {
            if self.total_bytes > b {
                return Err(BudgetError::OverBudget {
                    need: self.total_bytes,
                    budget: b,
                });
            }
        }
        let Some(have) = self.available_bytes else {
            return Ok(());
        };
        // A total already left its reserve; otherwise keep 5% of what is available.
        let limit = if self.total_budget_bytes.is_some() {
            have as f64
        } else {
            have as f64 * 0.95
        };
        if self.total_bytes as f64 > limit {
            return Err(BudgetError::OverAvailable {
                need: self.total_bytes,
                have,
                shortfall: (self.total_bytes as f64 - limit).max(0.0) as u64,
            });
        }
        Ok(())
    }

    /// The plan as the report prints it.
    pub fn render(&self) -> String {
        let mut s = String::from("memory plan\n");
        for it in &self.items {
            s.push_str(&format!(
                "  {:<22} {:>10}   ({})\n",
                it.what,
                human(it.bytes),
                it.stage
            ));
        }
        s.push_str(&format!(
            "  {:<22} {:>10}\n",
            "TOTAL",
            human(self.total_bytes)
        ));
        if let Some(b) = self.total_budget_bytes {
            s.push_str(&format!("  {:<22} {:>10}\n", "budget", human(b)));
        }
        if let Some(a) = self.available_bytes {
            s.push_str(&format!("  {:<22} {:>10}\n", "available", human(a)));
        }
        s
    }
}

/// The staged run's worker processes (tokenizer, trunk-loader, expert-fetcher, compute).
pub const STAGE_PROCESSES: usize = 4;

/// The fewest expert arena slots a run keeps (fewer when top-k is smaller,
/// [`min_expert_slots`]): a batch's experts stream through them, each slot reused as soon
/// as compute is done with its expert (`ExpertFetcher::fetch_batch_io`), so a batch of any
/// size fits. Only a total too small for more gets so few: the cache keeps 16 whenever
/// there is room (see `cache_keep`). On the slice at `--mem-gb 5.5` four slots decoded
/// slower than sixteen; six matched sixteen once expert reads went in pieces
/// (docs/measurements.md, 2026-12-02), not yet shown to pay, so 16 stay the rule.
pub const MIN_EXPERT_SLOTS: u64 = 4;

/// The fewest expert slots for a model routing `top_k` experts per token.
pub fn min_expert_slots(top_k: u64) -> u64 {
    top_k.clamp(1, MIN_EXPERT_SLOTS)
}
/// What one stage process holds before any plan item: its heap, stacks, page tables and the
/// pages of the binary it touches. Measured as a stage cgroup's peak minus its plan items on
/// the tiny model: 1.0 to 2.5 MB; 4 MiB leaves room. Negligible on a real model, but a run
/// in a small cgroup that ignored it was OOM-killed at start instead of refused.
pub const STAGE_PROCESS_BYTES: u64 = 4 << 20;

/// Positions an incremental run caches: the prompt, the generated tokens, and one more.
pub fn kv_positions(prompt_tokens: usize, gen: usize) -> usize {
    prompt_tokens + gen + 1
}

/// The room the KV cache may take: what is available, capped by the run's limit
/// (`--mem-gb`) when there is one.
fn kv_room(limit: Option<u64>, available: Option<u64>) -> Option<u64> {
    match (limit, available) {
        (Some(l), Some(a)) => Some(l.min(a)),
        (l, a) => l.or(a),
    }
}

/// KV-cache refusal: an incremental run holds `per_pos` bytes for each of `positions`.
pub fn check_kv(positions: usize, per_pos: u64, available: Option<u64>) -> Result<(), BudgetError> {
    let Some(have) = available else {
        return Ok(());
    };
    let need = positions as u64 * per_pos;
    if need as f64 > have as f64 * 0.9 {
        return Err(BudgetError::KvCache {
            positions,
            per_pos,
            have,
        });
    }
    Ok(())
}

/// The reserve a total leaves unplanned: 5% of what is available (default, `auto`) or of
/// `--mem-gb`, for the page tables, allocator slack, page cache and the kernel.
pub const RESERVE_SHARE: f64 = 0.05;

/// What a total budget is spent on, and what is fixed before it is spent.
#[derive(Clone, Debug)]
pub struct Spend {
    /// The whole run's budget (`--mem-gb`, or available minus the reserve).
    pub total: u64,
    /// Everything the trunk, the lm_head and the cache do not cover: state, KV, embedding
    /// rows, norms, scratch, the stage processes.
    pub fixed: u64,
    /// Bytes the whole trunk takes pinned (its packed, page-rounded runs; resident: its
    /// region).
    pub trunk_need: u64,
    /// The lm_head's bytes (always held by compute), and one row's.
    pub lm_head: u64,
    pub lm_head_row: u64,
    /// One expert arena slot; the fewest slots a run needs; the most it can use.
    pub expert_slot: u64,
    pub min_slots: u64,
    pub max_slots: u64,
    /// The smallest trunk budget a plan runs with (one ring slot for the largest streamed
    /// part or layer, [`trunk_min`]; 0 for a resident trunk).
    pub trunk_min: u64,
    /// The expert reads in flight the cache keeps a slot for when there is room
    /// ([`read_slots`]: the fetcher's queue depth on every drive the experts sit on).
    pub read_slots: u64,
    /// The coded trunk's coded lm_head, which a streamed lm_head may be read from (None:
    /// raw only).
    pub head_coded: Option<HeadCoding>,
    /// What one byte of the raw lm_head streamed from its checkpoint shard weighs in bytes
    /// read from the trunk's drives, per million ([`HeadDrive::ppm`]): 1 000 000 where the
    /// shard shares a drive with the trunk, or nothing was measured. Streaming the raw
    /// lm_head is then weighed by read time against pinning it and against the coded one.
    pub head_raw_ppm: u64,
}

impl Spend {
    /// The cost of `bytes` of the raw lm_head streamed from its shard, in bytes read from
    /// the trunk's drives ([`Spend::head_raw_ppm`]; weighed as the trunk-loader weighs
    /// decoding, [`k3_trunk_loader::decode_cost`]).
    pub fn raw_head_cost(&self, bytes: u64) -> u64 {
        k3_trunk_loader::decode_cost(bytes, self.head_raw_ppm)
    }
}

/// What streaming the lm_head from its coded copy costs (`--lm-head-read`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadCoding {
    /// Stored bytes of the whole coded lm_head.
    pub stored: u64,
    /// Rows per coded chunk (held rows and stream chunks are whole chunks of them).
    pub chunk_rows: u64,
    /// A decoded byte's weight in read bytes, per million ([`DecodeTerms::head_ppm`]).
    pub ppm: u64,
    /// Compute's span buffers and decoders
    /// (`k3_layer_compute::model_stream::coded_head_buffer_bytes`).
    pub buffers: u64,
    /// `--lm-head-read coded`: a streamed lm_head is always read coded.
    pub only: bool,
}

/// The raw lm_head's drive against the trunk's, where its checkpoint shard sits on a drive
/// the packed trunk and its copies are not on ([`head_drive`]): both rates, measured.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadDrive {
    /// The shard's drive, bytes/s (devbw).
    pub head_bps: f64,
    /// The trunk's drives, their rates summed, bytes/s, and how that was found.
    pub trunk_bps: f64,
    pub trunk_source: String,
}

impl HeadDrive {
    /// What one raw lm_head byte weighs in bytes read from the trunk's drives, per
    /// million: their rate over the shard drive's ([`Spend::head_raw_ppm`]).
    pub fn ppm(&self) -> u64 {
        (self.trunk_bps / self.head_bps * 1e6).clamp(1.0, 1e12) as u64
    }

    /// The note's words: both rates and a raw byte's weight.
    pub fn describe(&self) -> String {
        format!(
            "the raw lm_head's shard is on a drive of its own ({:.2} GB/s, measured with \
             devbw) and the trunk's drives read {:.2} GB/s ({}): a raw byte weighed {:.2} \
             read bytes",
            self.head_bps / GB,
            self.trunk_bps / GB,
            self.trunk_source,
            self.ppm() as f64 / 1e6
        )
    }
}

impl HeadCoding {
    /// A projection's coded lm_head (`inspect`/`project --codec-ratio`): `lm_head` bytes of
    /// rows of `row` coded at `ratio`, in `pack-trunk`'s chunks, read by compute's span
    /// buffers and decoders as a run holds them, its decoding weighed `ppm`.
    pub fn projected(lm_head: u64, row: u64, ratio: f64, ppm: u64) -> HeadCoding {
        let chunk_rows = k3_model::codec_trunk::head_chunk_rows(row, k3_model::trunk::CODEC_CHUNK);
        let raw_chunk = chunk_rows * row;
        HeadCoding {
            stored: (lm_head as f64 * ratio) as u64,
            chunk_rows,
            ppm,
            buffers: k3_layer_compute::model_stream::coded_head_buffer_bound(
                (raw_chunk as f64 * ratio) as u64,
                raw_chunk,
                lm_head_chunk(lm_head),
            ),
            only: false,
        }
    }

    /// What compute holds to stream the lm_head (`lm_head` bytes, rows of `row`) coded: two
    /// chunk buffers of whole coded chunks, and the readers' buffers.
    pub fn stream_bytes(&self, lm_head: u64, row: u64) -> u64 {
        let chunk = k3_layer_compute::model_stream::head_stream_chunk_bytes(
            lm_head_chunk(lm_head),
            row,
            Some(self.chunk_rows),
        );
        2 * k3_io::slot_bytes_for(chunk) + self.buffers
    }

    /// Stored bytes read per token for the rows past the first `held` bytes (of `lm_head`).
    pub fn read_past(&self, lm_head: u64, held: u64) -> u64 {
        let left = lm_head.saturating_sub(held) as u128;
        (self.stored as u128 * left).div_ceil(lm_head.max(1) as u128) as u64
    }
}

/// The expert reads a cache keeps slots for when there is room: the fetcher's readers
/// (`k3_expert_fetcher::fetcher::DEFAULT_READERS`, 16, the queue depth of one drive) on
/// each of `drives` drives, each with its own reader pool (`devices::DeviceMap`): a read in
/// flight holds its slot, so fewer slots would leave the drives' queues short.
pub fn read_slots(drives: usize) -> u64 {
    (k3_expert_fetcher::fetcher::DEFAULT_READERS * drives.max(1)) as u64
}

/// How many drives a run's routed experts are read from: the drives of `--experts`' packs,
/// else of the checkpoint's shards (symlinks followed; `devices::drives_of`).
pub fn expert_drives(a: &GenArgs) -> usize {
    let files: Vec<std::path::PathBuf> = if a.experts.is_empty() {
        std::fs::read_dir(&a.model_dir)
            .map(|d| {
                d.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                    .collect()
            })
            .unwrap_or_default()
    } else {
        a.experts
            .iter()
            .map(|d| d.join(k3_model::experts::EXPERTS_BIN))
            .collect()
    };
    k3_expert_fetcher::devices::drives_of(&files)
}

/// The smallest budget a streamed trunk runs with: one ring slot for its largest part
/// (or layer, when it has no parts).
pub fn trunk_min(r: &k3_trunk_loader::Streams) -> u64 {
    let units = if r.parts.is_empty() {
        &r.layers
    } else {
        &r.parts
    };
    units
        .iter()
        .map(k3_trunk_loader::LayerRun::footprint)
        .max()
        .unwrap_or(0)
}

/// A total budget spent to read the fewest bytes per token: the fixed part and the lm_head
/// first (compute holds them), the trunk next (a pinned GB removes a GB of certain reads per
/// token), the expert cache last (it pays only past its knee), keeping at least the slots
/// a batch streams through ([`MIN_EXPERT_SLOTS`]; 16 when there is room). An explicit
/// `--trunk-gb`/`--cache-gb` fixes its part and the other gets what is left. Returns
/// (trunk, cache) or why it cannot fit.
pub fn spend(
    s: &Spend,
    trunk_over: Option<u64>,
    cache_over: Option<u64>,
) -> Result<(u64, u64), BudgetError> {
    let held = s.fixed + s.lm_head;
    let min_cache = s.min_slots.max(1) * s.expert_slot;
    let left = s
        .total
        .checked_sub(held + min_cache)
        .ok_or(BudgetError::TotalTooSmall {
            total: s.total,
            fixed: s.fixed,
            lm_head: s.lm_head,
            min_cache,
        })?;
    let left = left + min_cache;
    let (t, c) = match (trunk_over, cache_over) {
        (Some(t), Some(c)) => (t, c),
        (Some(t), None) => (t, left.saturating_sub(t)),
        (None, Some(c)) => (left.saturating_sub(c), c),
        (None, None) => {
            let t = left.saturating_sub(cache_keep(s, left)).min(s.trunk_need);
            (t, left - t)
        }
    };
    // The cache never needs more slots than there are experts.
    let c = c.min(s.max_slots.max(1) * s.expert_slot).max(min_cache);
    Ok((t, c))
}

/// What the expert cache keeps of `left` (the total less the fixed part and the lm_head)
/// when nothing fixes it: the fewest slots, or the reads in flight ([`Spend::read_slots`]:
/// 16 per drive the experts sit on) when there is room for them beside the whole trunk or
/// for twice as many (and the trunk can still run beside them).
fn cache_keep(s: &Spend, left: u64) -> u64 {
    let min_cache = s.min_slots.max(1) * s.expert_slot;
    let keep = s.read_slots.max(1);
    let room = left >= s.trunk_need + keep * s.expert_slot || left >= 2 * keep * s.expert_slot;
    // Never so many that the trunk cannot run: near the floor the few slots are kept.
    if room && left >= s.trunk_min + keep * s.expert_slot {
        (keep.min(s.max_slots.max(1)) * s.expert_slot).max(min_cache)
    } else {
        min_cache
    }
}

/// Arena bytes compute allocates to hold `rows` rows of `row` bytes read O_DIRECT
/// ([`k3_io::slot_bytes_for`], as compute sizes it).
pub fn held_rows_bytes(rows: u64, row: u64) -> u64 {
    k3_io::slot_bytes_for(rows * row)
}

/// The most lm_head rows (of `row` bytes, at most `rows`) whose arena fits in `room`.
fn rows_fitting(room: u64, row: u64, rows: u64) -> u64 {
    if room < 2 * 4096 || row == 0 {
        return 0;
    }
    (((room - 4096) / 4096 * 4096) / row).min(rows)
}

/// A total spent: the parts, whether the lm_head is pinned, and the bytes read per token
/// outside the expert cache (streamed trunk layers, a streamed lm_head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    pub trunk: u64,
    pub cache: u64,
    pub head_pinned: bool,
    /// A streamed lm_head's leading rows held for the whole run (their payload bytes;
    /// 0 when it is pinned or nothing is left to hold them).
    pub head_held: u64,
    /// The sink the trunk was planned beside (`k3_trunk_loader::plan_streams_with`): the
    /// streamed lm_head's bytes, 0 when it is pinned.
    pub sink: u64,
    pub read_per_token: u64,
    /// Bytes a coded trunk's streamed parts decode per token (0: raw or nothing streams).
    pub decode_per_token: u64,
    /// What the choice weighs: the bytes read plus the decoding weighed as bytes read
    /// (`k3_trunk_loader::StreamPlan::cost_per_token`); `read_per_token` for a raw trunk.
    pub cost_per_token: u64,
    /// The streamed lm_head is read from the coded lm_head ([`HeadCoding`]).
    pub head_coded: bool,
    /// The lm_head's part of `cost_per_token` (0 when it is pinned).
    pub head_cost: u64,
}

/// How a way of [`choose`] holds the lm_head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HeadWay {
    Pinned,
    /// Streamed raw from the checkpoint.
    Streamed,
    /// Streamed from the coded lm_head.
    Coded,
}

/// Spend a total every way — lm_head pinned (held whole), streamed raw (two chunk buffers)
/// or, with a coded lm_head, streamed coded (two chunk buffers and the readers') — and take
/// the one that reads the fewest bytes per token (with a coded trunk or lm_head: that costs
/// least, the decoding weighed as reads, and the raw lm_head's bytes weighed by its drive's
/// rate, [`Spend::head_raw_ppm`]; [`Choice::cost_per_token`]), pinned on a tie, raw before
/// coded. `runs`: the packed trunk (None: resident, its bytes fixed by
/// `trunk_over`).
///
/// A streamed lm_head's rows are pinned like trunk bytes (each held byte is one byte less
/// read per token): the trunk is planned with the lm_head as its sink, and what the trunk
/// plan leaves of its share, with what the cache has beyond its keep when `--cache-gb`
/// does not fix it, holds the lm_head's leading rows. The cache gets the rest. (A coded
/// lm_head's held byte saves its stored bytes and its decoding, which the sink counts as
/// one read byte: near enough to rank it against trunk parts, whose own weights are alike.)
pub fn choose(
    s: &Spend,
    runs: Option<&k3_trunk_loader::Streams>,
    trunk_over: Option<u64>,
    cache_over: Option<u64>,
) -> Result<Choice, BudgetError> {
    // Pinned first: a streamed way replaces it only when it costs strictly less; when
    // none fits, the pinned way's refusal is the one said.
    let way = |w| choose_way(s, runs, trunk_over, cache_over, w);
    let mut best = way(HeadWay::Pinned);
    let mut ways = vec![HeadWay::Streamed, HeadWay::Coded];
    match s.head_coded {
        None => ways.retain(|w| *w != HeadWay::Coded),
        Some(h) if h.only => ways.retain(|w| *w != HeadWay::Streamed),
        Some(_) => {}
    }
    for w in ways {
        best = match (best, way(w)) {
            (Ok(b), Ok(c)) if c.cost_per_token < b.cost_per_token => Ok(c),
            (Ok(b), _) => Ok(b),
            (Err(_), Ok(c)) => Ok(c),
            (Err(e), Err(_)) => Err(e),
        };
    }
    best
}

/// [`choose`] one way.
fn choose_way(
    s: &Spend,
    runs: Option<&k3_trunk_loader::Streams>,
    trunk_over: Option<u64>,
    cache_over: Option<u64>,
    way: HeadWay,
) -> Result<Choice, BudgetError> {
    let pinned = way == HeadWay::Pinned;
    let coding = s.head_coded.filter(|_| way == HeadWay::Coded);
    let sp = Spend {
        lm_head: match (way, coding) {
            (HeadWay::Pinned, _) => s.lm_head,
            (_, Some(h)) => h.stream_bytes(s.lm_head, s.lm_head_row),
            _ => lm_head_stream_bytes(s.lm_head),
        },
        ..s.clone()
    };
    let (t, c) = spend(&sp, trunk_over, cache_over)?;
    let sink = if pinned { 0 } else { s.lm_head };
    let (trunk_read, trunk_decode, trunk_cost, trunk_left) = match runs {
        Some(r) => {
            let sp = k3_trunk_loader::plan_streams_with(
                t,
                r,
                k3_trunk_loader::RingPolicy::default(),
                sink,
            )?;
            (
                sp.read_per_token,
                sp.decode_per_token,
                sp.cost_per_token,
                sp.left(),
            )
        }
        None => (0, 0, 0, 0),
    };
    // The trunk plan's leftover, and (when no flag fixes the cache) what the cache
    // would hold beyond its keep, hold lm_head rows; the cache gets what they leave.
    let left = sp.total.saturating_sub(sp.fixed + sp.lm_head);
    let (head_held, cache) = match (pinned, cache_over) {
        (true, None) => (0, c + trunk_left),
        (true, Some(_)) => (0, c),
        (false, _) => {
            let spare = match cache_over {
                Some(_) => 0,
                None => left.saturating_sub(t).saturating_sub(cache_keep(&sp, left)),
            };
            let all = s.lm_head / s.lm_head_row.max(1);
            // Coded: whole coded chunks, as compute holds them.
            let rows = k3_layer_compute::model_stream::head_held_rows(
                rows_fitting(trunk_left + spare, s.lm_head_row, all),
                all,
                coding.map(|h| h.chunk_rows),
            );
            let alloc = if rows == 0 {
                0
            } else {
                held_rows_bytes(rows, s.lm_head_row)
            };
            let cache = match cache_over {
                Some(_) => c,
                None => (left.saturating_sub(t) + trunk_left - alloc)
                    .min(s.max_slots.max(1) * s.expert_slot)
                    .max(s.min_slots.max(1) * s.expert_slot),
            };
            (rows * s.lm_head_row, cache)
        }
    };
    let (head_read, head_decode, head_cost) = match (way, coding) {
        (HeadWay::Pinned, _) => (0, 0, 0),
        (_, Some(h)) => {
            let read = h.read_past(s.lm_head, head_held);
            let decode = s.lm_head - head_held;
            (
                read,
                decode,
                read + k3_trunk_loader::decode_cost(decode, h.ppm),
            )
        }
        // Raw: weighed by the drive it is read from.
        _ => {
            let read = s.lm_head - head_held;
            (read, 0, s.raw_head_cost(read))
        }
    };
    Ok(Choice {
        trunk: t,
        cache,
        head_pinned: pinned,
        head_held,
        sink,
        read_per_token: trunk_read + head_read,
        decode_per_token: trunk_decode + head_decode,
        cost_per_token: trunk_cost + head_cost,
        head_coded: coding.is_some(),
        head_cost,
    })
}

/// The memory flags, resolved left to right.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// A total to spend (`--mem-gb`, `--preset auto`, or the default); None after a named
    /// preset.
    pub total: Option<u64>,
    pub trunk: Option<u64>,
    pub cache: Option<u64>,
    pub preset: Option<String>,
    /// Where the total came from, for the plan's first line.
    pub source: String,
    /// The limit before the reserve (`--mem-gb`, or what is available).
    pub limit: Option<u64>,
}

/// Memory the default and `auto` spend: available (MemAvailable capped by the cgroup k3
/// runs in) minus the reserve.
pub fn default_total() -> Result<(u64, u64), BudgetError> {
    let avail = mem_available().ok_or(BudgetError::NoMemAvailable)?;
    Ok((avail - (avail as f64 * RESERVE_SHARE) as u64, avail))
}

/// Resolve the memory flags left to right: `--mem-gb` and `--preset auto` set a total (and
/// clear earlier part budgets), a named preset sets both parts (and clears the total),
/// `--trunk-gb`/`--cache-gb` fix one part. No flag: the default total.
pub fn resolve(
    flags: &[MemFlag],
    default_total: impl Fn() -> Result<(u64, u64), BudgetError>,
) -> Result<Resolved, BudgetError> {
    let presets = k3_trunk_loader::Presets::builtin();
    let gb = |x: f64| k3_trunk_loader::presets::gb_to_bytes(x);
    let mut r = Resolved {
        total: None,
        trunk: None,
        cache: None,
        preset: None,
        source: String::new(),
        limit: None,
    };
    let from_available = |r: &mut Resolved, what: &str| -> Result<(), BudgetError> {
        let (t, avail) = default_total()?;
        r.total = Some(t);
        r.limit = Some(avail);
        r.source = format!(
            "{what}: {} available (MemAvailable, capped by the cgroup k3 runs in) minus a {:.0}% reserve",
            human(avail),
            100.0 * RESERVE_SHARE
        );
        Ok(())
    };
    // Part budgets alone override parts of the default total; without MemAvailable they
    // fall back on the seed's fixed defaults.
    if !flags
        .iter()
        .any(|f| matches!(f, MemFlag::MemGb(_) | MemFlag::Preset(_)))
        && from_available(&mut r, "default").is_err()
    {
        r.source = format!(
            "the fixed defaults ({DEFAULT_TRUNK_GB} GB trunk, {DEFAULT_CACHE_GB} GB cache): MemAvailable is unreadable"
        );
    }
    for f in flags {
        match f {
            MemFlag::MemGb(x) => {
                // The reserve comes out of the total, so `--mem-gb L` runs inside a cgroup
                // of L: the plan spends L minus the reserve.
                r.total = Some(gb(*x) - (gb(*x) as f64 * RESERVE_SHARE) as u64);
                r.limit = Some(gb(*x));
                r.source = format!("--mem-gb {x} minus a {:.0}% reserve", 100.0 * RESERVE_SHARE);
                (r.trunk, r.cache, r.preset) = (None, None, None);
            }
            MemFlag::Preset(p) if p == "auto" => {
                from_available(&mut r, "--preset auto")?;
                (r.trunk, r.cache) = (None, None);
                r.preset = Some("auto".into());
            }
            MemFlag::Preset(p) => {
                let b = presets
                    .get(p)
                    .ok_or_else(|| BudgetError::UnknownPreset {
                        name: p.clone(),
                        known: presets.names(),
                    })?
                    .budgets();
                (r.trunk, r.cache, r.total) = (Some(b.trunk_bytes), Some(b.cache_bytes), None);
                r.limit = None;
                r.preset = Some(p.clone());
                r.source = format!("--preset {p}");
            }
            MemFlag::TrunkGb(x) => r.trunk = Some(gb(*x)),
            MemFlag::CacheGb(x) => r.cache = Some(gb(*x)),
        }
    }
    Ok(r)
}

/// Budgets of the seed's default, used when only one part is given without a total.
pub const DEFAULT_TRUNK_GB: f64 = 16.0;
pub const DEFAULT_CACHE_GB: f64 = 64.0;

/// A run's plan: the memory plan and what the stages are sized by.
pub struct RunPlan {
    pub memory: MemoryPlan,
    pub trunk_budget: u64,
    pub cache_budget: u64,
    pub preset: Option<String>,
    /// Expert arena slots the fetcher must have at least (what a batch streams through).
    pub min_slots: usize,
    /// Experts in the bound layers (more slots would never be used).
    pub max_slots: usize,
    /// The whole run's budget when one was given or derived (`--mem-gb`, auto, default).
    pub total_budget: Option<u64>,
    /// The whole run's limit the total came from (`--mem-gb`, or what is available), its
    /// reserve included: the stages' cgroup headroom comes out of `limit - plan`.
    pub limit: Option<u64>,
    /// Stream the lm_head in chunks of this many bytes (None: pinned, held by compute).
    pub lm_head_chunk_bytes: Option<u64>,
    /// A streamed lm_head's leading rows held for the whole run (payload bytes; 0: none).
    pub lm_head_held_bytes: u64,
    /// The streamed lm_head is read from the coded trunk's coded lm_head.
    pub lm_head_coded: bool,
    /// The sink the trunk-loader plans its budget beside (`plan_streams_with`).
    pub trunk_sink: u64,
    /// A coded trunk's decoding weighed against reading, which the trunk-loader plans with
    /// too (`TrunkConf::decode_weight_ppm`; 0: raw).
    pub trunk_decode_ppm: u64,
    /// The trunk-loader reads each token's first streamed part when the token starts, not
    /// while the previous token's lm_head streams (`TrunkConf::hold_wrap`).
    pub trunk_hold_wrap: bool,
    /// Feed the prompt in passes of at most this many tokens (their experts fit the arena,
    /// the whole prompt's would not); None: one pass.
    pub prefill_chunk: Option<usize>,
    /// Lines printed under the plan.
    pub notes: Vec<String>,
}

/// What a run asks for, for [`run_read_estimate`].
#[derive(Clone, Copy, Debug)]
pub struct RunShape {
    /// Prompt tokens and tokens to generate.
    pub prompt: u64,
    pub gen: u64,
    /// MoE layers bound, routed experts per token per layer, bytes of one expert read.
    pub moe_layers: u64,
    pub top_k: u64,
    pub expert_bytes: u64,
}

/// Bytes an incremental run reads with the prompt fed in passes of `pass` tokens under
/// plan `c`: each pass reads the streamed trunk and its batch of
/// `batch` experts per MoE layer; the last pass also the streamed lm_head; each of the
/// other `gen - 1` tokens reads the streamed trunk, the streamed lm_head and `top_k`
/// experts per MoE layer. No cache hit is counted (the plan does not guess them). A coded
/// trunk's decoding counts as the bytes read in its time ([`Choice::cost_per_token`]).
pub fn run_read_estimate(r: &RunShape, pass: u64, batch: u64, c: &Choice) -> u64 {
    let head = c.head_cost;
    let trunk = c.cost_per_token.saturating_sub(head);
    let passes = r.prompt.max(1).div_ceil(pass.max(1));
    let prefill = passes * (trunk + r.moe_layers * batch * r.expert_bytes) + head;
    let decode =
        r.gen.saturating_sub(1) * (c.cost_per_token + r.moe_layers * r.top_k * r.expert_bytes);
    prefill + decode
}

/// Bytes a run reads with passes of `t` tokens under a plan (for [`pass_size`]).
pub type PassCost<'a> = dyn Fn(u64, &Choice) -> u64 + 'a;

/// What [`pass_size`] chose.
pub struct PassSize {
    /// The plan for passes of `tokens` tokens (or why not even one token fits).
    pub choice: Result<Choice, BudgetError>,
    pub tokens: u64,
    /// Whether a pass of the whole prompt fits at all.
    pub whole_fits: bool,
}

/// Tokens per pass for a prompt (or prefix) of `whole` tokens. `plan(t)` plans passes of
/// `t` tokens (what a pass holds grows with `t`: its batch of experts, its scratch), and
/// `batch(t)` is its batch of experts per layer. `forced` (a test hook) fixes the size. The
/// largest size that fits is kept, or, with `cost` (bytes the run reads with passes of `t`
/// under a plan), the size that reads least among it and the smaller ones whose batch is
/// smaller (the only ones that leave more memory to the rest), the larger on a tie. When
/// not even one token fits, the result is that refusal (the real shortfall).
pub fn pass_size(
    whole: u64,
    forced: Option<u64>,
    plan: &dyn Fn(u64) -> Result<Choice, BudgetError>,
    batch: &dyn Fn(u64) -> u64,
    cost: Option<&PassCost<'_>>,
) -> PassSize {
    let whole = whole.max(1);
    let start = forced.map_or(whole, |n| n.clamp(1, whole));
    let first = plan(start);
    let whole_fits = if start == whole {
        first.is_ok()
    } else {
        plan(whole).is_ok()
    };
    let (fit, tokens) = match first {
        Ok(c) => (c, start),
        Err(e) if start == 1 => {
            return PassSize {
                choice: Err(e),
                tokens: 1,
                whole_fits,
            }
        }
        Err(_) => match plan(1) {
            Err(e) => {
                return PassSize {
                    choice: Err(e),
                    tokens: 1,
                    whole_fits,
                }
            }
            Ok(one) => {
                // Fits at 1, not at `start`: the largest that fits.
                let (mut lo, mut hi, mut at_lo) = (1u64, start, one);
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    match plan(mid) {
                        Ok(c) => (lo, at_lo) = (mid, c),
                        Err(_) => hi = mid,
                    }
                }
                (at_lo, lo)
            }
        },
    };
    let Some(cost) = cost else {
        return PassSize {
            choice: Ok(fit),
            tokens,
            whole_fits,
        };
    };
    let mut best = (cost(tokens, &fit), tokens, fit);
    for t in (1..tokens).rev() {
        if batch(t) >= batch(tokens) {
            continue;
        }
        if let Ok(c) = plan(t) {
            let b = cost(t, &c);
            if b < best.0 {
                best = (b, t, c);
            }
        }
    }
    PassSize {
        choice: Ok(best.2),
        tokens: best.1,
        whole_fits,
    }
}

/// Scratch compute allocates beside the plan items for a CLI pass of `pass_tokens` rows:
/// activations (a few dozen hidden-size rows per token), the logits of the one row a pass
/// wants (the last: a prompt chunk's earlier rows never reach the lm_head, and the CLI
/// never asks for every row's logits) and the worker threads' stacks (4 MiB).
///
/// Counting a logits row per token over-reserved 335 MB for a 512-token prompt of the
/// released vocabulary: the slice's compute cgroup peaked at 0.43 GB of its planned 1.08 GB
/// at `--mem-gb 5.5` (docs/measurements.md, "The prompt's logits in the plan").
pub fn compute_scratch(cfg: &ModelConfig, pass_tokens: u64) -> u64 {
    serve_scratch(cfg, pass_tokens, 1)
}

/// Scratch of a server's pass of `rows` rows of which `logit_rows` want logits (one per
/// slot: a prompt chunk wants only its last row's): the activations of every row, the
/// logits of the wanted ones, the worker threads' stacks.
pub fn serve_scratch(cfg: &ModelConfig, rows: u64, logit_rows: u64) -> u64 {
    rows.max(1) * cfg.hidden_size as u64 * 4 * 32
        + logit_rows.max(1) * cfg.vocab_size as u64 * 4
        + (4 << 20)
}

/// The lm_head chunk when it streams: a sixteenth of it, at most 32 MiB, at least a page.
/// Compute holds two (one multiplied while the next is read).
pub fn lm_head_chunk(lm_head: u64) -> u64 {
    (lm_head / 16).clamp(4096, 32 << 20).min(lm_head.max(1))
}

/// What compute holds for a streamed lm_head: two chunk buffers, page-rounded, plus a page.
pub fn lm_head_stream_bytes(lm_head: u64) -> u64 {
    2 * k3_io::slot_bytes_for(lm_head_chunk(lm_head))
}

/// Test hook: `K3_LM_HEAD_CHUNK_BYTES=N` (with `K3_TEST_HOOKS=1`) streams the lm_head in
/// chunks of N bytes whatever the plan decides.
pub const LM_HEAD_CHUNK_ENV: &str = "K3_LM_HEAD_CHUNK_BYTES";

/// Test hook: `K3_PREFILL_CHUNK=N` (with `K3_TEST_HOOKS=1`) feeds prompts in passes of at
/// most N tokens whatever the plan decides.
pub const PREFILL_CHUNK_ENV: &str = "K3_PREFILL_CHUNK";

/// Test hook: `K3_LM_HEAD_HELD_BYTES=N` (with `K3_TEST_HOOKS=1`) holds N bytes of a
/// streamed lm_head's leading rows (whole rows) whatever the plan decides.
pub const LM_HEAD_HELD_ENV: &str = "K3_LM_HEAD_HELD_BYTES";

/// Each of `copies` holds the packed trunk in `dir`: the same manifest, byte for byte, and
/// data files of the sizes it gives (`TrunkManifest::load_dir`'s check, on the copy); their
/// bytes are checked by the trunk's CRCs as they are read.
fn check_trunk_copies(
    dir: &std::path::Path,
    copies: &[std::path::PathBuf],
) -> Result<(), BudgetError> {
    let name = k3_model::trunk::TRUNK_JSON;
    let ours = std::fs::read(dir.join(name));
    for copy in copies {
        let fail = |why: String| BudgetError::TrunkCopy {
            dir: dir.to_path_buf(),
            copy: copy.clone(),
            why,
        };
        let theirs = std::fs::read(copy.join(name)).map_err(|e| fail(format!("{name}: {e}")))?;
        match &ours {
            Ok(o) if *o == theirs => {}
            Ok(_) => return Err(fail(format!("its {name} differs"))),
            Err(e) => return Err(fail(format!("{name} of the first: {e}"))),
        }
        k3_model::trunk::TrunkManifest::load_dir(copy).map_err(|e| fail(e.to_string()))?;
    }
    Ok(())
}

/// The streams of a packed trunk (whole layers and their parts), for the bound layers.
fn packed_runs(
    dir: &std::path::Path,
    layers: usize,
) -> Result<(k3_trunk_loader::Streams, u64), BudgetError> {
    let m = k3_model::trunk::TrunkManifest::load_dir(dir)?;
    if m.layers.len() < layers {
        return Err(BudgetError::TrunkLayers {
            dir: dir.to_path_buf(),
            have: m.layers.len(),
            want: layers,
        });
    }
    Ok((
        k3_trunk_loader::Streams::of_manifest(&m, layers),
        k3_trunk_loader::loader::decode_buffer_bytes(&m),
    ))
}

/// The drive rate a coded trunk's decoding is weighed against when the drive cannot be
/// measured (a PCIe 4 NVMe drive, as `project`'s reference machine).
pub const ASSUMED_DRIVE_BPS: f64 = 7e9;
/// The decoder's rate per core when it cannot be measured: `bf16-zstd` at level 19 on
/// Gaussian BF16 (docs/measurements.md, issue 37: 2.11 GB/s under load).
pub const ASSUMED_DECODE_BPS: f64 = 2e9;
/// Chunks the decode probe decodes (4 MiB of BF16 each), and seconds the drive is read.
const DECODE_PROBE_CHUNKS: usize = 8;
const DRIVE_PROBE_SECONDS: f64 = 0.25;

/// How a coded trunk's decoding is weighed against its reads
/// (`k3_trunk_loader::Streams::decode_ppm`): the drive's rate as the trunk-loader reads
/// it and one core's decoding rate, each with where it came from, and the cores: the
/// machine's and compute's threads. The decoding runs on the trunk-loader's reader threads
/// and counts on the cores compute leaves, at least one (`k3_trunk_loader::decode_cores`:
/// counted spread over the cores compute runs on, it kept layers coded that measured
/// slower than reading them).
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeTerms {
    pub disk_bps: f64,
    pub disk_source: String,
    pub decode_bps: f64,
    pub decode_source: String,
    pub cores: usize,
    /// Compute's threads (`--threads`; all the cores by default).
    pub compute_threads: usize,
}

impl DecodeTerms {
    /// The weight: disk bytes read in the time one decoded byte takes, per million.
    pub fn ppm(&self) -> u64 {
        k3_trunk_loader::decode_weight_ppm(self.disk_bps, self.decode_bps, self.decoders())
    }

    /// The weight of the coded lm_head's decoding: every core decodes it. While the
    /// lm_head streams, compute only multiplies each chunk as it lands, far faster than
    /// the chunks are read, so its readers' decoding has the cores (measured:
    /// docs/measurements.md, "The coded lm_head").
    pub fn head_ppm(&self) -> u64 {
        k3_trunk_loader::decode_weight_ppm(self.disk_bps, self.decode_bps, self.cores)
    }

    /// The cores the decoding counts on (`k3_trunk_loader::decode_cores`).
    pub fn decoders(&self) -> usize {
        k3_trunk_loader::decode_cores(self.cores, self.compute_threads)
    }

    /// One line: what a decoded byte weighs and why.
    pub fn describe(&self) -> String {
        format!(
            "a decoded byte weighs {:.2} read bytes = drive {:.2} GB/s ({}) / ({:.2} GB/s \
             decoded per core ({}) x {} core(s): of {} core(s), compute runs on {})",
            self.ppm() as f64 / 1e6,
            self.disk_bps / GB,
            self.disk_source,
            self.decode_bps / GB,
            self.decode_source,
            self.decoders(),
            self.cores,
            self.compute_threads.min(self.cores),
        )
    }

    /// The terms of a run's coded trunk (None: raw, or no `--trunk`): `--drive-gbps` and
    /// `--decode-gbps` when given, else measured here, once per plan: the drives with devbw
    /// (O_DIRECT) on the stored file and its copies, read at once as the trunk-loader reads
    /// them, the decoder on a few of the trunk's own chunks (`k3_trunk_loader::decode_rate`);
    /// a figure that cannot be measured is assumed, and the plan's note says so. The cores
    /// are this machine's.
    pub fn of_run(a: &GenArgs) -> Result<Option<DecodeTerms>, BudgetError> {
        let Some(dir) = &a.trunk else { return Ok(None) };
        let m = k3_model::trunk::TrunkManifest::load_dir(dir)?;
        let Some(c) = &m.codec else { return Ok(None) };
        let (disk_bps, disk_source) = match a.drive_gbps {
            Some(g) => (g * GB, "--drive-gbps".to_string()),
            None => {
                let files: Vec<_> = a.trunk_dirs().map(|d| d.join(&c.file)).collect();
                measure_trunk_drives(&files)
            }
        };
        let (decode_bps, decode_source) = match a.decode_gbps {
            Some(g) => (g * GB, "--decode-gbps".to_string()),
            None => match k3_trunk_loader::decode_rate(dir, &m, DECODE_PROBE_CHUNKS) {
                Some(r) => (r, "measured on the trunk's chunks".to_string()),
                None => (ASSUMED_DECODE_BPS, "ASSUMED: no chunk decoded".to_string()),
            },
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(Some(DecodeTerms {
            disk_bps,
            disk_source,
            decode_bps,
            decode_source,
            cores,
            compute_threads: a.threads.unwrap_or(cores),
        }))
    }
}

/// The drives holding `files` (the stored file and its copies) as the trunk-loader reads
/// them: every copy at once, each at the loader's piece size and queue depth (O_DIRECT),
/// their rates summed, since the loader spreads its reads over the copies. A copy that
/// cannot be measured makes the whole figure [`ASSUMED_DRIVE_BPS`] per copy, with the
/// reason.
fn measure_trunk_drives(files: &[std::path::PathBuf]) -> (f64, String) {
    let got: Vec<(f64, String)> = std::thread::scope(|s| {
        let probes: Vec<_> = files
            .iter()
            .map(|f| s.spawn(move || measure_trunk_drive(f)))
            .collect();
        probes
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| (ASSUMED_DRIVE_BPS, "ASSUMED: the probe panicked".into()))
            })
            .collect()
    });
    if let Some((_, why)) = got.iter().find(|(_, why)| why.starts_with("ASSUMED")) {
        return (ASSUMED_DRIVE_BPS * files.len() as f64, why.clone());
    }
    let sum = got.iter().map(|(bps, _)| bps).sum();
    match files.len() {
        1 => (sum, "measured with devbw".into()),
        n => (
            sum,
            format!("measured with devbw, its {n} copies read at once"),
        ),
    }
}

/// The drive holding `file` as the trunk-loader reads it (its pieces at its queue depth,
/// O_DIRECT), or [`ASSUMED_DRIVE_BPS`] with the reason it could not be measured.
fn measure_trunk_drive(file: &std::path::Path) -> (f64, String) {
    use k3_io::devbw::{direct_bytes_per_s, DevbwError};
    let read = k3_io::direct::READ_CHUNK as u64;
    match direct_bytes_per_s(file, read, k3_io::direct::READ_QD, DRIVE_PROBE_SECONDS) {
        Ok(bps) if bps > 0.0 => (bps, "measured with devbw".into()),
        Ok(_) => (ASSUMED_DRIVE_BPS, "ASSUMED: no read finished".into()),
        Err(DevbwError::TooSmall { .. }) => (
            ASSUMED_DRIVE_BPS,
            "ASSUMED: the stored file is too small to measure".into(),
        ),
        Err(DevbwError::NotDirect { .. }) => {
            (ASSUMED_DRIVE_BPS, "ASSUMED: O_DIRECT refused".into())
        }
        Err(e) => (ASSUMED_DRIVE_BPS, format!("ASSUMED: {e}")),
    }
}

/// A test hook's value: `name=N` (N > 0) with `K3_TEST_HOOKS=1`, else None.
fn test_hook(name: &str) -> Option<u64> {
    std::env::var(name)
        .ok()
        .filter(|_| std::env::var("K3_TEST_HOOKS").as_deref() == Ok("1"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&n| n > 0)
}

/// What the request and the model fix before any budget is spent (the first step of
/// [`plan_run`]): the trunk's streams, the largest pass, the expert slots, the lm_head.
struct Bounds {
    /// The packed trunk (None: resident).
    runs: Option<k3_trunk_loader::Streams>,
    /// The checkpoint shard a raw streamed lm_head is read from.
    head_file: Option<std::path::PathBuf>,
    /// That shard's drive against the trunk's, when they differ ([`head_drive`]).
    head_drive: Option<HeadDrive>,
    /// A coded trunk's decode buffers in the trunk-loader (0: raw or resident).
    trunk_decode: u64,
    /// How a coded trunk's decoding is weighed (None: raw or resident).
    decode: Option<DecodeTerms>,
    /// What pinning the whole trunk takes.
    trunk_need: u64,
    /// The smallest trunk budget a plan runs with ([`trunk_min`]).
    trunk_min: u64,
    /// One expert arena slot; routed experts per token; the fewest and most slots.
    expert_slot: u64,
    top_k: u64,
    min_slots: u64,
    max_slots: u64,
    /// The expert reads in flight the cache keeps slots for ([`read_slots`]).
    read_slots: u64,
    /// Routed experts of the model per MoE layer; MoE layers bound.
    experts_per_layer: u64,
    moe_layers: u64,
    /// Tokens of the largest pass (the prompt; the whole prefix when recomputing), >= 1.
    max_pass_tokens: u64,
    /// Positions an incremental run caches.
    positions: usize,
    /// The lm_head's bytes, and one row's.
    lm_head: u64,
    lm_head_row: u64,
    /// The coded lm_head a streamed lm_head may be read from.
    head_coded: Option<HeadCoding>,
    /// `serve`'s slots (None: one CLI run).
    serve: Option<ServeShape>,
}

impl Bounds {
    /// A pass of `t` tokens asks for the union of their routes at once.
    fn batch_of(&self, t: u64) -> u64 {
        (t * self.top_k).min(self.experts_per_layer).max(self.top_k)
    }
}

/// An upper bound of the prompt's tokens. For a text prompt the token count is not known
/// before the tokenizer runs: it has at most one token per byte (plus the chat wrapper's few
/// hundred), so a request that passes the plan fits.
fn prompt_bound(a: &GenArgs) -> usize {
    let chat = if a.chat { 512 } else { 0 };
    match &a.prompt {
        Prompt::Ids(ids) => ids.len(),
        Prompt::Text(t) => t.len() + chat,
        Prompt::File(p) => {
            std::fs::metadata(p)
                .map(|m| m.len() as usize)
                .unwrap_or(MAX_PROMPT)
                + chat
        }
    }
    .min(MAX_PROMPT)
}

/// What a plan measures once, before any [`bound`] (a server's plan bounds many shapes, and
/// each figure here takes a probe of a drive or of the decoder): the coded trunk's
/// [`DecodeTerms`] and the raw lm_head's drive against the trunk's ([`head_drive`]).
struct Measured {
    decode: Option<DecodeTerms>,
    head_drive: Option<HeadDrive>,
}

impl Measured {
    fn of_run(a: &GenArgs, sizes: &ModelSizes) -> Result<Measured, BudgetError> {
        let decode = DecodeTerms::of_run(a)?;
        let head_drive = head_drive(a, decode.as_ref(), sizes.lm_head_file.as_deref())?;
        Ok(Measured { decode, head_drive })
    }
}

/// [`Bounds`] of a request on the model's first `layers` layers (`m`: what the plan
/// measured, once).
fn bound(
    a: &GenArgs,
    cfg: &ModelConfig,
    sizes: &ModelSizes,
    layers: usize,
    serve: Option<&ServeShape>,
    m: &Measured,
) -> Result<Bounds, BudgetError> {
    let decode = m.decode.as_ref();
    let (runs, trunk_decode) = match &a.trunk {
        Some(dir) => {
            let (r, d) = packed_runs(dir, layers)?;
            check_trunk_copies(dir, &a.trunk_copies)?;
            let ppm = decode.map_or(0, DecodeTerms::ppm);
            let r = r.with_decode_weight(ppm).with_resident(a.trunk_resident);
            (Some(r), d)
        }
        None => (None, 0),
    };
    // What pinning the whole trunk takes: the packed, page-rounded runs the trunk-loader
    // allocates (not the sum of tensor bytes, which is smaller: `--preset auto` sized from
    // it pinned 11 of 13 layers of a tiny model with gigabytes free), or the resident
    // region's layout.
    let trunk_need: u64 = match &runs {
        Some(r) => r.pinned_bytes(),
        None => sizes.layer_resident_bytes.iter().sum(),
    };
    let top_k = cfg.num_experts_per_token as u64;
    // One request batch (the union of a layer's experts over the tokens of a pass) must fit
    // in the arena at once: the fetcher publishes a batch's experts into distinct slots and
    // compute reads them in place, so a smaller arena would recycle a slot still being read.
    let prompt_bound = prompt_bound(a);
    // A server's pass: up to `chunk` prompt tokens beside the other slots' decode rows
    // (`FixedCosts::extra_rows`).
    let max_pass_tokens = match serve {
        Some(s) => s.chunk.unwrap_or(SERVE_CHUNK).max(1),
        None if a.incremental => prompt_bound,
        None => prompt_bound + a.gen,
    } as u64;
    let lm_head = sizes.lm_head_bytes;
    let lm_head_row = lm_head / (cfg.vocab_size as u64).max(1);
    Ok(Bounds {
        head_coded: head_coding(a, decode, lm_head)?,
        head_drive: m.head_drive.clone(),
        head_file: sizes.lm_head_file.clone(),
        trunk_min: runs.as_ref().map_or(0, trunk_min),
        runs,
        trunk_decode,
        decode: decode.cloned(),
        trunk_need,
        expert_slot: k3_io::slot_bytes_for(sizes.max_expert_span.max(1)),
        top_k,
        // The fewest slots: a batch of any size streams through them (see MIN_EXPERT_SLOTS).
        min_slots: min_expert_slots(top_k),
        max_slots: sizes.n_experts.max(top_k),
        read_slots: read_slots(expert_drives(a)),
        experts_per_layer: cfg.num_experts as u64,
        moe_layers: sizes.n_experts / (cfg.num_experts as u64).max(1),
        max_pass_tokens: max_pass_tokens.max(1),
        // Every prompt position and every generated one is cached (a server's slot: at
        // most `--ctx` of them).
        positions: serve.map_or(kv_positions(prompt_bound, a.gen), |s| s.ctx),
        lm_head,
        lm_head_row,
        serve: serve.copied(),
    })
}

/// The coded lm_head a streamed lm_head may be read from (`--lm-head-read` not `raw`, a
/// coded `--trunk` that codes it), with its decoding weighed by `decode`
/// ([`DecodeTerms::head_ppm`]); `--lm-head-read coded` without one is refused.
fn head_coding(
    a: &GenArgs,
    decode: Option<&DecodeTerms>,
    lm_head: u64,
) -> Result<Option<HeadCoding>, BudgetError> {
    if a.lm_head_read == HeadRead::Raw {
        return Ok(None);
    }
    // Decode terms exist only for a coded trunk: a raw one's manifest is not read again.
    let head = match (&a.trunk, decode) {
        (Some(dir), Some(d)) => k3_model::trunk::TrunkManifest::load_dir(dir)?
            .codec
            .and_then(|c| c.head)
            .map(|h| (h, d)),
        _ => None,
    };
    let Some((h, d)) = head else {
        return match a.lm_head_read {
            HeadRead::Coded => Err(BudgetError::NoCodedHead {
                dir: a.trunk.clone(),
            }),
            _ => Ok(None),
        };
    };
    let chunk = k3_layer_compute::model_stream::head_stream_chunk_bytes(
        lm_head_chunk(lm_head),
        h.row_bytes(),
        Some(h.chunk_rows),
    );
    Ok(Some(HeadCoding {
        stored: h.stored_bytes,
        chunk_rows: h.chunk_rows,
        ppm: d.head_ppm(),
        buffers: k3_layer_compute::model_stream::coded_head_buffer_bytes(&h, chunk),
        only: a.lm_head_read == HeadRead::Coded,
    }))
}

/// The raw lm_head's drive against the packed trunk's, where the plan may stream it raw
/// from `head_file` (its checkpoint shard) and that shard shares no drive with the trunk's
/// directories ([`head_shares_trunk_drive`]): the shard's drive measured as the trunk's are
/// (devbw, O_DIRECT, the loader's pieces and queue depth), and the trunk's drives' rate,
/// its copies read at once (a coded trunk's is `decode`'s, measured for its decoding
/// weight). A raw lm_head on a drive five times faster than the trunk's then costs a fifth
/// of its bytes, one on a slower drive more than its bytes. None (a raw byte weighs one
/// read byte, the ranking by bytes) without a packed trunk, when the lm_head is never read
/// raw (`--lm-head-read coded`), when `--drive-gbps` gives every drive one rate, or when
/// the shard shares a trunk drive or a drive cannot be told or measured.
fn head_drive(
    a: &GenArgs,
    decode: Option<&DecodeTerms>,
    head_file: Option<&std::path::Path>,
) -> Result<Option<HeadDrive>, BudgetError> {
    let (Some(dir), Some(file)) = (&a.trunk, head_file) else {
        return Ok(None);
    };
    if a.lm_head_read == HeadRead::Coded
        || a.drive_gbps.is_some()
        || head_shares_trunk_drive(a, Some(file))
    {
        return Ok(None);
    }
    let (trunk_bps, trunk_source) = match decode {
        Some(d) => (d.disk_bps, d.disk_source.clone()),
        None => {
            let m = k3_model::trunk::TrunkManifest::load_dir(dir)?;
            let files: Vec<_> = a.trunk_dirs().map(|d| d.join(m.data_file().0)).collect();
            measure_trunk_drives(&files)
        }
    };
    let (head_bps, head_source) = measure_trunk_drive(file);
    let measured = |bps: f64, why: &str| bps > 0.0 && !why.starts_with("ASSUMED");
    Ok(
        (measured(head_bps, &head_source) && measured(trunk_bps, &trunk_source)).then_some(
            HeadDrive {
                head_bps,
                trunk_bps,
                trunk_source,
            },
        ),
    )
}

/// What every run holds whatever the budget (the second step of [`plan_run`]), part of it
/// by the tokens of a pass: state, KV, embedding rows, norms, scratch, the stage processes.
struct FixedCosts<'a> {
    cfg: &'a ModelConfig,
    embed_row: u64,
    norms: u64,
    kda_state: u64,
    kv: u64,
    /// The staged run's worker processes (0 in one process).
    processes: u64,
    /// Rows every pass carries beside its `t` prompt tokens: a server's other slots'
    /// decode rows (`slots - 1`; 0 for a CLI run).
    extra_rows: u64,
    /// A server's kept prefix states, at most (0 for a CLI run).
    prefix: u64,
    /// A coded trunk's decode buffers in the trunk-loader (0: raw or resident).
    trunk_decode: u64,
}

impl FixedCosts<'_> {
    /// The embedding is never resident: compute reads the rows a pass needs on demand.
    fn embed_rows(&self, t: u64) -> u64 {
        ((t.max(1) + self.extra_rows) * self.embed_row).div_ceil(4096) * 4096
    }

    /// A pass wants one logits row per slot (a CLI run's one), whatever its prompt rows:
    /// [`compute_scratch`] when `extra_rows` is 0.
    fn scratch(&self, t: u64) -> u64 {
        serve_scratch(self.cfg, t + self.extra_rows, self.extra_rows + 1)
    }

    /// Everything fixed for passes of `t` tokens.
    fn fixed(&self, t: u64) -> u64 {
        self.embed_rows(t)
            + self.norms
            + self.kda_state
            + self.kv
            + self.processes
            + self.scratch(t)
            + self.prefix
            + self.trunk_decode
    }
}

/// The [`FixedCosts`] of a request.
fn fixed_costs<'a>(
    a: &GenArgs,
    cfg: &'a ModelConfig,
    sizes: &ModelSizes,
    b: &Bounds,
) -> FixedCosts<'a> {
    let slots = b.serve.map_or(1, |s| s.slots.max(1) as u64);
    let kv = if a.incremental || b.serve.is_some() {
        (sizes.kv_per_pos.saturating_mul(b.positions as u64)).saturating_mul(slots)
    } else {
        0
    };
    let processes = if staged(a) {
        STAGE_PROCESSES as u64 * STAGE_PROCESS_BYTES
    } else {
        0
    };
    FixedCosts {
        cfg,
        embed_row: sizes.embed_row_bytes,
        norms: sizes
            .model_bytes
            .saturating_sub(sizes.embed_bytes + sizes.lm_head_bytes),
        kda_state: sizes.kda_state_bytes.saturating_mul(slots),
        kv,
        processes,
        extra_rows: slots - 1,
        prefix: b.serve.map_or(0, |s| s.prefix_bytes(sizes)),
        trunk_decode: b.trunk_decode,
    }
}

/// Whether the run is a staged one (worker processes).
fn staged(a: &GenArgs) -> bool {
    !a.inproc && !a.single_process
}

/// A total spent on passes of the size that fits and reads least ([`pass_size`]).
fn spend_total(a: &GenArgs, res: &Resolved, b: &Bounds, f: &FixedCosts, total: u64) -> PassSize {
    let trunk_over = if b.runs.is_none() {
        Some(b.trunk_need)
    } else {
        res.trunk
    };
    let try_pass = |t: u64| {
        choose(
            &Spend {
                total,
                fixed: f.fixed(t),
                trunk_need: b.trunk_need,
                lm_head: b.lm_head,
                expert_slot: b.expert_slot,
                min_slots: b.min_slots,
                max_slots: b.max_slots,
                lm_head_row: b.lm_head_row,
                trunk_min: b.trunk_min,
                read_slots: b.read_slots,
                head_coded: b.head_coded,
                head_raw_ppm: b.head_drive.as_ref().map_or(1_000_000, HeadDrive::ppm),
            },
            b.runs.as_ref(),
            trunk_over,
            res.cache,
        )
    };
    let shape = RunShape {
        prompt: b.max_pass_tokens,
        gen: a.gen as u64,
        moe_layers: b.moe_layers,
        top_k: b.top_k,
        expert_bytes: b.expert_slot,
    };
    let cost = |t: u64, c: &Choice| run_read_estimate(&shape, t, b.batch_of(t), c);
    let forced = test_hook(PREFILL_CHUNK_ENV);
    pass_size(
        b.max_pass_tokens,
        forced,
        &try_pass,
        &|t| b.batch_of(t),
        // Recomputing runs feed the whole prefix every step: only the fit counts; so does
        // a server's chunk (the largest that fits, up to the one asked for).
        (a.incremental && forced.is_none() && b.serve.is_none()).then_some(&cost as _),
    )
}

/// Named budgets without a total: the parts as given (the seed's defaults for a part not
/// given), the lm_head held, as before.
fn named_parts(res: &Resolved, b: &Bounds) -> PassSize {
    let gb = k3_trunk_loader::presets::gb_to_bytes;
    PassSize {
        choice: Ok(Choice {
            trunk: res.trunk.unwrap_or(gb(DEFAULT_TRUNK_GB)),
            cache: res.cache.unwrap_or(gb(DEFAULT_CACHE_GB)),
            head_pinned: true,
            head_held: 0,
            sink: 0,
            read_per_token: 0,
            decode_per_token: 0,
            cost_per_token: 0,
            head_coded: false,
            head_cost: 0,
        }),
        tokens: test_hook(PREFILL_CHUNK_ENV)
            .map_or(b.max_pass_tokens, |n| n.clamp(1, b.max_pass_tokens)),
        whole_fits: true,
    }
}

/// The split a budget picked, and the pass size it was picked for.
struct Picked {
    choice: Choice,
    /// Tokens per pass, and whether a pass of the whole prompt (or prefix) fits at all.
    pass_tokens: u64,
    whole_fits: bool,
}

/// The split the budget is spent on (the third step of [`plan_run`]), or the refusal.
fn choose_parts(
    a: &GenArgs,
    res: &Resolved,
    b: &Bounds,
    f: &FixedCosts,
) -> Result<Picked, BudgetError> {
    let p = match res.total {
        Some(total) => spend_total(a, res, b, f, total),
        None => named_parts(res, b),
    };
    let choice = p.choice.map_err(|e| BudgetError::Refused {
        budget: if res.source.is_empty() {
            "--trunk-gb/--cache-gb".to_string()
        } else {
            res.source.clone()
        },
        why: Box::new(e),
    })?;
    Ok(Picked {
        choice,
        pass_tokens: p.tokens,
        whole_fits: p.whole_fits,
    })
}

/// The note on a prompt fed in passes (None: one pass).
fn pass_note(a: &GenArgs, b: &Bounds, f: &FixedCosts, p: &Picked) -> Option<String> {
    let (t, whole) = (p.pass_tokens, b.max_pass_tokens);
    if let Some(s) = &b.serve {
        return Some(format!(
            "{} slot(s) of at most {} tokens; prompts fed in chunks of at most {t} token(s) \
             per pass beside the other slots' decode rows (a pass of at most {} rows){}",
            s.slots,
            s.ctx,
            t + f.extra_rows,
            if t < whole {
                format!(" ({whole} asked: a larger chunk does not fit)")
            } else {
                String::new()
            }
        ));
    }
    (t < whole).then(|| {
        format!(
            "prompt fed in passes of at most {t} token(s): a pass holds {} of \
             activations and embedding rows; the whole {whole}-token {} in one pass \
             would hold {}, {}",
            human(f.scratch(t) + f.embed_rows(t)),
            if a.incremental { "prompt" } else { "prefix" },
            human(f.scratch(whole) + f.embed_rows(whole)),
            if p.whole_fits {
                "which fits but leaves less for the trunk and lm_head that every one of \
                 --gen's tokens reads: more read over the run"
            } else {
                "which does not fit"
            }
        )
    })
}

/// The trunk's line of the plan and its notes; whether the ring holds its wrap read.
fn add_trunk(
    mp: &mut MemoryPlan,
    notes: &mut Vec<String>,
    a: &GenArgs,
    b: &Bounds,
    sink: u64,
    head_coded: Option<bool>,
) -> Result<bool, BudgetError> {
    let Some(runs) = &b.runs else {
        mp.add("trunk (resident)", "trunk-loader", b.trunk_need);
        if a.mem.iter().any(|f| !matches!(f, MemFlag::MemGb(_))) {
            notes.push(
                "--trunk was not given: the trunk is loaded whole, whatever --trunk-gb says".into(),
            );
        }
        return Ok(false);
    };
    if !a.trunk_copies.is_empty() {
        let all: Vec<String> = a.trunk_dirs().map(|d| d.display().to_string()).collect();
        notes.push(format!(
            "trunk read from {} copies ({}): each unit's 8 MiB pieces from them in turn",
            all.len(),
            all.join(", ")
        ));
    }
    // The trunk-loader plans the same budget beside the same sink (what the plan leaves of
    // its share went to the lm_head's rows and the cache in `choose`).
    let sp = k3_trunk_loader::plan_streams_with(
        mp.trunk_budget_bytes,
        runs,
        k3_trunk_loader::RingPolicy::default(),
        sink,
    )?;
    let tp = sp.plan;
    let unit = if sp.parts { "layer parts" } else { "layers" };
    mp.add(
        &format!("trunk ({}/{} pinned)", tp.pinned, tp.layers),
        "trunk-loader",
        tp.kept_at(),
    );
    if tp.kept > 0 {
        mp.add(
            &format!("trunk {} kept coded", tp.kept),
            "trunk-loader",
            tp.kept_bytes,
        );
    }
    (mp.trunk_kept_layers, mp.trunk_kept_bytes) = (tp.kept, tp.kept_bytes);
    if b.trunk_decode > 0 {
        mp.add("trunk decode buffers", "trunk-loader", b.trunk_decode);
    }
    let streamed = sp.read_per_token;
    mp.streamed_bytes_per_token = streamed;
    notes.push(format!(
        "trunk streamed: {}/{} {unit} pinned, ring {} x {}; deterministic hit rate {:.1}%; {} read per token{}",
        tp.pinned,
        tp.layers,
        tp.ring_slots,
        human(tp.slot_bytes),
        100.0 * tp.hit_rate(),
        human(streamed),
        if b.trunk_decode > 0 {
            " (stored bytes of the coded trunk; pinned parts decoded once at load)"
        } else {
            ""
        }
    ));
    if let Some(d) = &b.decode {
        notes.push(format!(
            "coded trunk: {} decoded per token by the trunk-loader's readers, pinned parts \
             ranked by read + decode time saved per byte of RAM: {}",
            human(sp.decode_per_token),
            d.describe()
        ));
        notes.push(placement_note(runs, &sp, a.trunk_resident));
    }
    // When the lm_head streams from a drive the trunk is read from, a ring that read the
    // next token's first part between tokens would share that drive with it, while the
    // token starts with pinned parts whose compute that read can overlap instead. From a
    // drive of its own, the trunk's drives would sit idle while it streams.
    let wrap_matters = tp.ring_slots > 0 && sp.starts_pinned();
    let hold_wrap = match head_coded {
        Some(coded) if wrap_matters => {
            let shared = coded || head_shares_trunk_drive(a, b.head_file.as_deref());
            if !shared {
                notes.push(
                    "trunk ring: the next token's first streamed part is read while the \
                     lm_head streams (the lm_head is on a drive the trunk is not)"
                        .into(),
                );
            }
            shared
        }
        _ => false,
    };
    if hold_wrap {
        notes.push(
            "trunk ring: each token's first streamed part is read when the token \
             starts (its pinned parts come first), not while the lm_head streams"
                .into(),
        );
    }
    Ok(hold_wrap)
}

/// Whether the raw lm_head, streamed from `head_file` (its checkpoint shard), shares a
/// drive (a whole disk, partitions and symlinks resolved) with the packed trunk's
/// directories. A file or directory whose drive cannot be told counts as shared.
fn head_shares_trunk_drive(a: &GenArgs, head_file: Option<&std::path::Path>) -> bool {
    use k3_expert_fetcher::devices::device_of;
    let Some(head) = head_file.and_then(device_of) else {
        return true;
    };
    a.trunk_dirs()
        .any(|d| device_of(d).is_none_or(|t| t == head))
}

/// The note that says where a coded trunk's layers are (`--trunk-resident`): how many
/// layers, and their bytes, pinned raw, kept coded in memory, and streamed from disk (a
/// layer counts as pinned raw when all its units are, as streamed when none is kept or
/// pinned, and as partly pinned otherwise).
fn placement_note(
    runs: &k3_trunk_loader::Streams,
    sp: &k3_trunk_loader::StreamPlan,
    resident: k3_protocol::conf::TrunkResident,
) -> String {
    let n = runs.layers.len();
    let units: Vec<usize> = match &sp.order {
        Some(o) => o[..sp.plan.pinned].to_vec(),
        None => (0..sp.plan.pinned).collect(),
    };
    // Units pinned raw of each layer, against its units.
    let (mut pinned, mut of) = (vec![0usize; n], vec![0usize; n]);
    let layer_of = |i: usize| if sp.parts { runs.part_layer[i] } else { i };
    for i in 0..if sp.parts { runs.parts.len() } else { n } {
        of[layer_of(i)] += 1;
    }
    for &i in &units {
        pinned[layer_of(i)] += 1;
    }
    let raw = (0..n).filter(|&l| of[l] > 0 && pinned[l] == of[l]).count();
    let partly = (0..n)
        .filter(|&l| pinned[l] > 0 && pinned[l] < of[l] && !sp.kept.contains(&l))
        .count();
    let streamed = n - raw - partly - sp.kept.len();
    format!(
        "trunk placement (--trunk-resident {}): {raw} layer(s) pinned raw ({} with the \
         pinned parts of {partly} more), {} kept coded ({} of RAM, decoded on each use), \
         {streamed} streamed ({} read per token)",
        resident.name(),
        human(sp.plan.pinned_bytes),
        sp.kept.len(),
        human(sp.plan.kept_bytes),
        human(sp.read_per_token)
    )
}

/// The lm_head's lines of the plan and its note: pinned, or streamed in chunks of `chunk`
/// with `held` bytes of its leading rows held.
fn add_lm_head(
    mp: &mut MemoryPlan,
    notes: &mut Vec<String>,
    b: &Bounds,
    chunk: Option<u64>,
    held: u64,
    coding: Option<HeadCoding>,
) {
    let (lm, row) = (b.lm_head, b.lm_head_row);
    let Some(c) = chunk else {
        mp.add("lm_head (pinned)", "layer-compute", lm);
        if let Some(d) = &b.head_drive {
            notes.push(format!(
                "lm_head pinned: streaming it would cost more, its bytes weighed by the drive \
                 they are read from; {}",
                d.describe()
            ));
        }
        return;
    };
    mp.add(
        "lm_head (streamed)",
        "layer-compute",
        2 * k3_io::slot_bytes_for(c),
    );
    let head_read = match coding {
        Some(h) => h.read_past(lm, held),
        None => lm - held,
    };
    mp.streamed_bytes_per_token += head_read;
    let drives = b
        .head_drive
        .as_ref()
        .map_or(String::new(), |d| format!("; {}", d.describe()));
    let how = match coding {
        Some(h) => {
            mp.add("lm_head decoders", "layer-compute", h.buffers);
            format!(
                ", read coded: {} stored for {} decoded, a decoded byte weighed {:.2} read \
                 bytes on every core{drives}",
                human(head_read),
                human(lm - held),
                h.ppm as f64 / 1e6
            )
        }
        None if b.head_coded.is_some() => format!(
            ", read raw: the coded lm_head weighs more (--lm-head-read coded reads it){drives}"
        ),
        None => drives,
    };
    if held > 0 {
        mp.add(
            "lm_head rows held",
            "layer-compute",
            held_rows_bytes(held / row.max(1), row),
        );
        notes.push(format!(
            "lm_head: {} of its leading rows held, the rest streamed in chunks of {} ({} read per token){how}",
            human(held),
            human(c),
            human(head_read)
        ));
    } else {
        notes.push(format!(
            "lm_head streamed in chunks of {} ({} read per token){how}",
            human(c),
            human(head_read)
        ));
    }
}

/// The plan of a chosen split (the last step of [`plan_run`]): its lines and notes, the
/// test hooks applied, refused when it does not fit.
fn assemble(
    a: &GenArgs,
    res: Resolved,
    b: &Bounds,
    f: &FixedCosts,
    p: Picked,
) -> Result<RunPlan, BudgetError> {
    let Choice {
        trunk: trunk_budget,
        cache: cache_budget,
        head_pinned,
        head_held,
        sink: trunk_sink,
        head_coded,
        ..
    } = p.choice;
    // `--lm-head-read coded` reads a streamed lm_head coded however it came to stream.
    let coding = b.head_coded.filter(|h| head_coded || h.only);
    let (lm, row) = (b.lm_head, b.lm_head_row);
    let head_held = match test_hook(LM_HEAD_HELD_ENV) {
        Some(n) => {
            let (rows, all) = (n.min(lm) / row.max(1), lm / row.max(1));
            // Coded: whole coded chunks, as compute holds them.
            let chunk_rows = coding.map(|h| h.chunk_rows);
            k3_layer_compute::model_stream::head_held_rows(rows, all, chunk_rows) * row
        }
        None => head_held,
    };
    let lm_head_chunk_bytes = match test_hook(LM_HEAD_CHUNK_ENV) {
        Some(n) => Some(n),
        None if head_pinned => None,
        None => Some(lm_head_chunk(lm)),
    }
    .map(|c| {
        let rows = coding.map(|h| h.chunk_rows);
        k3_layer_compute::model_stream::head_stream_chunk_bytes(c, row, rows)
    });
    let mut notes: Vec<String> = pass_note(a, b, f, &p).into_iter().collect();
    if !res.source.is_empty() {
        notes.push(format!("budget from {}", res.source));
    }
    let mut mp = MemoryPlan::new(trunk_budget, cache_budget, a.trunk.is_some());
    let streams = lm_head_chunk_bytes.is_some();
    let head = streams.then_some(coding.is_some());
    let trunk_hold_wrap = add_trunk(&mut mp, &mut notes, a, b, trunk_sink, head)?;
    // Never more slots than there are experts to hold.
    let slots = (cache_budget / b.expert_slot)
        .min(b.max_slots)
        .max(b.min_slots);
    mp.add("expert cache", "expert-fetcher", slots * b.expert_slot);
    add_lm_head(
        &mut mp,
        &mut notes,
        b,
        lm_head_chunk_bytes,
        head_held,
        coding,
    );
    let t = p.pass_tokens;
    mp.add("embedding rows", "layer-compute", f.embed_rows(t));
    mp.add("norms", "layer-compute", f.norms);
    mp.add("recurrent state", "layer-compute", f.kda_state);
    mp.add("scratch", "layer-compute", f.scratch(t));
    if staged(a) {
        mp.add("stage processes", "processes", f.processes);
    }
    match &b.serve {
        Some(s) => {
            mp.add(
                &format!("KV cache ({} x {})", s.slots, s.ctx),
                "layer-compute",
                f.kv,
            );
            mp.add("prefix cache", "layer-compute", f.prefix);
        }
        None => mp.add("KV cache", "layer-compute", f.kv),
    }
    mp.available_bytes = mem_available();
    mp.total_budget_bytes = res.total;
    mp.check()?;
    Ok(RunPlan {
        memory: mp,
        trunk_budget,
        cache_budget,
        preset: res.preset,
        min_slots: slots as usize,
        max_slots: b.max_slots as usize,
        total_budget: res.total,
        limit: res.limit,
        lm_head_chunk_bytes,
        lm_head_held_bytes: if streams { head_held } else { 0 },
        lm_head_coded: streams && coding.is_some(),
        trunk_sink,
        trunk_decode_ppm: b.decode.as_ref().map_or(0, DecodeTerms::ppm),
        trunk_hold_wrap,
        prefill_chunk: (t < b.max_pass_tokens || b.serve.is_some()).then_some(t as usize),
        notes,
    })
}

/// Add up everything the run will hold and refuse up front what cannot fit: bound the
/// request, add up what every run holds, choose the split of the budget, assemble the plan.
pub fn plan_run(
    a: &GenArgs,
    cfg: &ModelConfig,
    sizes: &ModelSizes,
    layers: usize,
) -> Result<RunPlan, BudgetError> {
    let measured = Measured::of_run(a, sizes)?;
    let b = bound(a, cfg, sizes, layers, None, &measured)?;
    let res = resolve(&a.mem, default_total)?;
    let f = fixed_costs(a, cfg, sizes, &b);
    // The KV cache alone not fitting is said as such, before the whole plan is weighed.
    if a.incremental {
        check_kv(
            b.positions,
            sizes.kv_per_pos,
            kv_room(res.limit, mem_available()),
        )?;
    }
    let p = choose_parts(a, &res, &b, &f)?;
    assemble(a, res, &b, &f, p)
}

/// Prompt tokens per pass a server feeds when `--prefill-chunk` is not given (fewer when
/// that does not fit).
pub const SERVE_CHUNK: usize = 256;

/// What `serve` (and `k3-orch MODEL --prompts F --parallel N`) holds beside one run's plan:
/// `slots` requests at once, each with its own KV cache (up to `ctx` positions) and
/// recurrent state, passes of `slots - 1` decode rows plus a prompt chunk, and kept
/// prefix states.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ServeShape {
    pub slots: usize,
    /// Prompt plus generated tokens of one request, at most (`--ctx`).
    pub ctx: usize,
    /// Prompt tokens per pass asked for (`--prefill-chunk`; None: [`SERVE_CHUNK`]); the
    /// plan gives the largest that fits, up to it.
    pub chunk: Option<usize>,
    /// Session states kept for prefix reuse (`--cache-entries`).
    pub prefix_entries: usize,
    /// Their bytes, at most (`--prefix-gb`; None: `prefix_entries` states of `ctx`
    /// positions, the most that many can hold).
    pub prefix_bytes: Option<u64>,
}

impl ServeShape {
    /// One slot's state at `ctx` positions: its KV cache and its recurrent state.
    pub fn slot_bytes(&self, sizes: &ModelSizes) -> u64 {
        sizes
            .kv_per_pos
            .saturating_mul(self.ctx as u64)
            .saturating_add(sizes.kda_state_bytes)
    }

    /// The kept prefix states' bytes, at most.
    pub fn prefix_bytes(&self, sizes: &ModelSizes) -> u64 {
        if self.prefix_entries == 0 {
            return 0;
        }
        self.prefix_bytes.unwrap_or_else(|| {
            self.slot_bytes(sizes)
                .saturating_mul(self.prefix_entries as u64)
        })
    }
}

/// What [`plan_serve`] fixed besides the memory plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ServePlan {
    /// Prompt tokens per pass (as asked, or the largest that fits).
    pub chunk: usize,
    /// Bytes of kept prefix states, at most.
    pub prefix_bytes: u64,
}

/// The plan of a server's `s.slots` slots (a refusal, exit 2, says what they need and the
/// largest `--parallel` that fits).
pub fn plan_serve(
    a: &GenArgs,
    s: &ServeShape,
    cfg: &ModelConfig,
    sizes: &ModelSizes,
    layers: usize,
) -> Result<(RunPlan, ServePlan), BudgetError> {
    if s.slots == 0 || s.ctx == 0 || s.chunk == Some(0) {
        return Err(BudgetError::ServeZero);
    }
    let res = resolve(&a.mem, default_total)?;
    let measured = Measured::of_run(a, sizes)?;
    let one = |shape: &ServeShape| -> Result<(RunPlan, ServePlan), BudgetError> {
        let b = bound(a, cfg, sizes, layers, Some(shape), &measured)?;
        let f = fixed_costs(a, cfg, sizes, &b);
        let p = choose_parts(a, &res, &b, &f)?;
        let chunk = p.pass_tokens as usize;
        let plan = assemble(a, res.clone(), &b, &f, p)?;
        Ok((
            plan,
            ServePlan {
                chunk,
                prefix_bytes: f.prefix,
            },
        ))
    };
    // The largest chunk (up to the one asked) whose whole plan fits: the split is chosen
    // per chunk, and a plan can still exceed the budget once assembled (a resident trunk
    // past what the split left), so the assembled plan decides.
    let want = s.chunk.unwrap_or(SERVE_CHUNK).max(1);
    let fit = |n: usize| -> Result<(RunPlan, ServePlan), BudgetError> {
        let shape = ServeShape { slots: n, ..*s };
        let first = one(&shape);
        if first.is_ok() || want == 1 {
            return first;
        }
        let (mut lo, mut hi, mut best) = (0usize, want, None);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            match one(&ServeShape {
                chunk: Some(mid),
                ..shape
            }) {
                Ok(x) => (lo, best) = (mid, Some(x)),
                Err(_) => hi = mid,
            }
        }
        match best {
            Some(x) => Ok(x),
            None => one(&ServeShape {
                chunk: Some(1),
                ..shape
            }),
        }
    };
    let err = match fit(s.slots) {
        Ok(x) => return Ok(x),
        Err(e) => e,
    };
    // The largest number of slots that fits (fewer slots never need more).
    let (mut lo, mut hi) = (0usize, s.slots);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fit(mid).is_ok() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let rows = (s.slots - 1) + s.chunk.unwrap_or(SERVE_CHUNK);
    Err(BudgetError::Slots {
        cause: Box::new(err),
        slots: s.slots,
        ctx: s.ctx,
        slot: s.slot_bytes(sizes),
        rows,
        scratch: serve_scratch(cfg, rows as u64, s.slots as u64),
        prefix: s.prefix_bytes(sizes),
        largest: lo,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // A CLI pass computes only its last row's logits (a prompt chunk's other rows stop
    // before the lm_head: `batch_forward::dead_prompt_rows_skip_the_last_layer_and_change_
    // no_bit` checks the one row it returns), so its scratch grows by activation rows
    // alone, as a server pass's with one logits row. Catches a logits row reserved per
    // prompt token: 335 MB too many for a 512-token prompt of the released vocabulary,
    // which split that prompt into two passes at 1.5 GB (docs/measurements.md, "The
    // prompt's logits in the plan").
    #[test]
    fn a_cli_pass_reserves_logits_for_one_row() {
        let released = include_str!("../../../tests/fixtures/released/config.json");
        let cfg = ModelConfig::from_json_str(released).unwrap();
        let row = cfg.hidden_size as u64 * 4 * 32;
        let logits = cfg.vocab_size as u64 * 4;
        assert_eq!(compute_scratch(&cfg, 1), row + logits + (4 << 20));
        assert_eq!(
            compute_scratch(&cfg, 512) - compute_scratch(&cfg, 1),
            511 * row
        );
        assert_eq!(compute_scratch(&cfg, 512), serve_scratch(&cfg, 512, 1));
    }

    // The run's reads with the prompt in passes: each pass reads the streamed trunk and its
    // batch, the last the streamed lm_head too; each later token the streamed trunk and
    // lm_head and top-k experts per MoE layer. Numbers by hand: trunk 10, lm_head 100 of
    // which 30 held (70 streamed), 2 MoE layers, top-2, experts of 3 bytes.
    // Catches a lm_head read per pass (not once), experts read per token instead of per
    // pass's batch, the first generated token counted twice, and a pinned lm_head read.
    #[test]
    fn run_reads_of_a_prompt_in_passes() {
        let c = Choice {
            trunk: 0,
            cache: 0,
            head_pinned: false,
            head_held: 30,
            sink: 100,
            read_per_token: 80,
            decode_per_token: 0,
            cost_per_token: 80,
            head_coded: false,
            head_cost: 70,
        };
        let r = RunShape {
            prompt: 5,
            gen: 4,
            moe_layers: 2,
            top_k: 2,
            expert_bytes: 3,
        };
        // Passes of 2 tokens: 3 passes x (10 + 2 x 4 x 3) + 70, then 3 x (80 + 2 x 2 x 3).
        assert_eq!(run_read_estimate(&r, 2, 4, &c), 3 * 34 + 70 + 3 * 92);
        // One pass of 5 (a batch of 10 experts).
        assert_eq!(run_read_estimate(&r, 5, 10, &c), 70 + 70 + 3 * 92);
        // A pinned lm_head is never read.
        let pinned = Choice {
            head_pinned: true,
            head_held: 0,
            read_per_token: 10,
            cost_per_token: 10,
            head_cost: 0,
            ..c
        };
        assert_eq!(run_read_estimate(&r, 5, 10, &pinned), 70 + 3 * 22);
    }

    // The pass size: the whole prompt when it fits; the largest that fits when it does not
    // (found by bisection over a plan that fits up to 37 tokens of 100); the refusal of one
    // token when nothing fits; with a cost, the cheapest among the sizes whose batch is
    // smaller, the larger on a tie. Catches a bisection that stops one short or one past,
    // a refusal reported for the whole prompt instead of one token, sizes with the same
    // batch weighed (they hold the same memory), and a tie that takes more passes.
    #[test]
    fn the_pass_size_is_the_largest_that_fits_or_the_cheapest() {
        let c = |read: u64| Choice {
            trunk: 0,
            cache: 0,
            head_pinned: true,
            head_held: 0,
            sink: 0,
            read_per_token: read,
            decode_per_token: 0,
            cost_per_token: read,
            head_coded: false,
            head_cost: 0,
        };
        let upto = |n: u64| {
            move |t: u64| {
                if t <= n {
                    Ok(c(t))
                } else {
                    Err(BudgetError::TotalTooSmall {
                        total: t,
                        fixed: t,
                        lm_head: 0,
                        min_cache: 1,
                    })
                }
            }
        };
        let batch = |t: u64| (t * 4).min(64);
        let p = pass_size(100, None, &upto(100), &batch, None);
        assert_eq!(
            (p.tokens, p.whole_fits, p.choice.unwrap()),
            (100, true, c(100))
        );
        let p = pass_size(100, None, &upto(37), &batch, None);
        assert_eq!(
            (p.tokens, p.whole_fits, p.choice.unwrap()),
            (37, false, c(37))
        );
        let p = pass_size(100, None, &upto(0), &batch, None);
        assert!(
            matches!(p.choice, Err(BudgetError::TotalTooSmall { total: 1, .. })),
            "{:?}",
            p.choice
        );
        // A forced size is kept when it fits, bisected below it when it does not.
        let p = pass_size(100, Some(5), &upto(100), &batch, None);
        assert_eq!((p.tokens, p.whole_fits), (5, true));
        let p = pass_size(100, Some(50), &upto(20), &batch, None);
        assert_eq!((p.tokens, p.whole_fits), (20, false));
        // Costs: only sizes with a batch under batch(37) = 64, i.e. 1..=15, are weighed
        // against 37; the cheapest of them is 6 and 7 (a tie: the larger).
        let weighed = std::cell::RefCell::new(Vec::new());
        let cost = |t: u64, _: &Choice| {
            weighed.borrow_mut().push(t);
            if t == 6 || t == 7 {
                10
            } else {
                20 + t
            }
        };
        let p = pass_size(100, None, &upto(37), &batch, Some(&cost));
        assert_eq!((p.tokens, p.choice.unwrap()), (7, c(7)));
        let mut w = weighed.into_inner();
        w.sort_unstable();
        assert_eq!(w, [(1..=15).collect::<Vec<u64>>(), vec![37]].concat());
        // The largest stays when nothing smaller reads less.
        let p = pass_size(
            100,
            None,
            &upto(37),
            &batch,
            Some(&|t: u64, _: &Choice| 100 - t),
        );
        assert_eq!(p.tokens, 37);
    }

    #[test]
    fn refuses_with_the_shortfall() {
        let mut p = MemoryPlan::new(3_000_000_000, 1_000_000_000, true);
        p.add("trunk", "trunk-loader", 3_000_000_000);
        p.add("expert cache", "expert-fetcher", 1_000_000_000);
        p.available_bytes = Some(4_000_000_000);
        let e = p.check().unwrap_err().to_string();
        // 4 GB needed against 0.95 x 4 GB usable: 0.2 GB short.
        assert!(e.contains("shortfall of 200.00 MB"), "{e}");
        p.available_bytes = Some(8_000_000_000);
        assert!(p.check().is_ok());
        assert_eq!(p.stage_bytes("trunk-loader"), 3_000_000_000);
    }

    #[test]
    fn kv_refusal_names_the_per_position_cost() {
        let e = check_kv(1000, 2_370_000, Some(1_000_000_000))
            .unwrap_err()
            .to_string();
        assert!(e.contains("2.37 MB per position"), "{e}");
        assert!(check_kv(10, 2_370_000, Some(1_000_000_000)).is_ok());
    }

    fn sp(total: u64) -> Spend {
        Spend {
            total,
            fixed: 100,
            trunk_need: 1_000,
            lm_head: 50,
            lm_head_row: 5,
            expert_slot: 10,
            min_slots: 2,
            max_slots: 40,
            trunk_min: 0,
            read_slots: read_slots(1),
            head_coded: None,
            head_raw_ppm: 1_000_000,
        }
    }

    // Trunk first, then the cache (16 slots kept when there is room), and never more cache
    // than the experts fill. Catches a split that starves the trunk for the cache.
    #[test]
    fn a_total_feeds_the_trunk_first() {
        // Room for all: the trunk whole, the cache capped at 40 slots.
        assert_eq!(spend(&sp(10_000), None, None).unwrap(), (1_000, 400));
        // Tight: the trunk gets all but 16 slots.
        assert_eq!(spend(&sp(150 + 500), None, None).unwrap(), (340, 160));
        // Tighter: all but one batch.
        assert_eq!(spend(&sp(150 + 200), None, None).unwrap(), (180, 20));
        // Overrides fix their part; the other gets the rest.
        assert_eq!(spend(&sp(650), None, Some(100)).unwrap(), (400, 100));
        assert_eq!(spend(&sp(650), Some(300), None).unwrap(), (300, 200));
        // Below what every run holds: refused, naming the parts.
        let e = spend(&sp(169), None, None).unwrap_err().to_string();
        assert!(e.contains("lm_head") && e.contains("expert slots"), "{e}");
    }

    // Experts on two drives: the cache keeps a slot for each of the 32 reads in flight
    // (16 per drive's reader pool) when there is room, and still gives the trunk first
    // what it needs. Catches a plan that keeps one drive's 16 slots whatever the drives
    // (half of each drive's queue left empty: a read in flight holds its slot).
    #[test]
    fn the_cache_keeps_every_drives_reads_in_flight() {
        assert_eq!((read_slots(0), read_slots(1), read_slots(2)), (16, 16, 32));
        let two = |total| Spend {
            read_slots: read_slots(2),
            max_slots: 100,
            ..sp(total)
        };
        // Room beside the whole trunk: 32 slots, not 16.
        assert_eq!(
            spend(&two(150 + 1_000 + 320), None, None).unwrap(),
            (1_000, 320)
        );
        assert_eq!(
            spend(&sp(150 + 1_000 + 320), None, None).unwrap(),
            (1_000, 320),
            "the rest goes to the cache either way"
        );
        // Tight: the trunk gets all but 32 slots (all but 16 on one drive).
        assert_eq!(spend(&two(150 + 1_000), None, None).unwrap(), (680, 320));
        assert_eq!(spend(&sp(150 + 1_000), None, None).unwrap(), (840, 160));
    }

    // Left to right: --mem-gb clears earlier parts, a named preset clears the total, the
    // -gb flags override parts; no flag (or only parts) uses the available total.
    #[test]
    fn memory_flags_resolve_left_to_right() {
        let avail = || Ok((9_500u64, 10_000u64));
        let r = resolve(&[], avail).unwrap();
        assert_eq!((r.total, r.trunk, r.cache), (Some(9_500), None, None));
        assert!(r.source.contains("5% reserve"), "{}", r.source);
        let r = resolve(&[MemFlag::TrunkGb(1.0), MemFlag::MemGb(2.0)], avail).unwrap();
        assert_eq!((r.total, r.trunk), (Some(1_900_000_000), None));
        let r = resolve(&[MemFlag::MemGb(2.0), MemFlag::CacheGb(0.5)], avail).unwrap();
        assert_eq!((r.total, r.cache), (Some(1_900_000_000), Some(500_000_000)));
        let r = resolve(
            &[MemFlag::MemGb(2.0), MemFlag::Preset("laptop".into())],
            avail,
        )
        .unwrap();
        assert_eq!(
            (r.total, r.trunk, r.cache),
            (None, Some(3_000_000_000), Some(1_000_000_000))
        );
        let r = resolve(&[MemFlag::Preset("auto".into())], avail).unwrap();
        assert_eq!((r.total, r.preset.as_deref()), (Some(9_500), Some("auto")));
        let r = resolve(&[MemFlag::CacheGb(1.0)], avail).unwrap();
        assert_eq!((r.total, r.cache), (Some(9_500), Some(1_000_000_000)));
        // Without MemAvailable, parts alone fall back on the fixed defaults; auto refuses.
        let none = || Err(BudgetError::NoMemAvailable);
        assert_eq!(resolve(&[MemFlag::TrunkGb(1.0)], none).unwrap().total, None);
        assert!(resolve(&[MemFlag::Preset("auto".into())], none).is_err());
    }

    // A plan over the total budget is refused with the shortfall.
    #[test]
    fn refuses_over_the_total_budget() {
        let mut p = MemoryPlan::new(0, 0, true);
        p.add("trunk", "trunk-loader", 3_000);
        p.total_budget_bytes = Some(2_000);
        let e = p.check().unwrap_err().to_string();
        assert!(
            e.contains("budget is 2.00 KB") && e.contains("shortfall"),
            "{e}"
        );
        p.total_budget_bytes = Some(3_000);
        assert!(p.check().is_ok());
    }

    const P: u64 = 4096;

    /// Four 10-page layers (no parts), a 50-page lm_head of 1-page rows, 1-page expert
    /// slots: the budget `total`, at most `max_slots` slots.
    fn four_layers(total: u64, max_slots: u64) -> (k3_trunk_loader::Streams, Spend) {
        let runs = k3_trunk_loader::Streams {
            layers: (0..4)
                .map(|i| k3_trunk_loader::LayerRun {
                    offset: i * 10 * P,
                    len: 10 * P,
                })
                .collect(),
            ..Default::default()
        };
        let s = Spend {
            total,
            fixed: 0,
            trunk_need: 40 * P,
            lm_head: 50 * P,
            lm_head_row: P,
            expert_slot: P,
            min_slots: 1,
            max_slots,
            trunk_min: 0,
            read_slots: read_slots(1),
            head_coded: None,
            head_raw_ppm: 1_000_000,
        };
        (runs, s)
    }

    // The lm_head is pinned when that reads least, streamed when only streaming fits (a
    // 1.5 GB run of the slice cannot hold its 2.35 GB lm_head).
    #[test]
    fn the_lm_head_streams_only_when_that_reads_less_or_alone_fits() {
        let runs = four_layers(0, 1).0;
        let s = |total| four_layers(total, 1).1;
        assert_eq!(lm_head_stream_bytes(50 * P), 10 * P);
        let c = choose(&s(62 * P), Some(&runs), None, None).unwrap();
        assert!(c.head_pinned, "{c:?}");
        assert_eq!(c.read_per_token, 40 * P);
        // Streamed: the trunk's 34-page share pins 2 layers beside a 10-page slot; the
        // 4 pages it leaves hold 3 lm_head rows (and the page a held window may need).
        let c = choose(&s(45 * P), Some(&runs), None, None).unwrap();
        assert!(!c.head_pinned, "{c:?}");
        assert_eq!(
            (c.trunk, c.head_held, c.cache, c.read_per_token),
            (34 * P, 3 * P, P, 20 * P + 47 * P)
        );
        assert_eq!(c.sink, 50 * P);
        assert!(choose(&s(20 * P), Some(&runs), None, None).is_err());
    }

    /// The coded lm_head of [`four_layers`]' 50-page lm_head: 33 pages stored, 2 rows per
    /// chunk, its decoding weighed `ppm`; `only`: `--lm-head-read coded`.
    fn coded_head(ppm: u64, only: bool) -> HeadCoding {
        HeadCoding {
            stored: 33 * P,
            chunk_rows: 2,
            ppm,
            buffers: 0,
            only,
        }
    }

    // A coded lm_head (33 of 50 pages stored, 2 rows per chunk) where the lm_head streams:
    // read coded when its stored pages plus its decoding weighed cost less than the raw
    // read (a weight of 0.2: about 33 + 10 = 43 pages against 50 per token), raw when they
    // cost more (0.5: 33 + 25 = 58), coded whatever the weight with `--lm-head-read coded`;
    // its held rows whole chunks. Catches a plan that reads the coded lm_head by stored
    // bytes alone (always coded), a weight that does not reach the head's cost, `only`
    // ignored, and held rows that split a coded chunk.
    #[test]
    fn a_streamed_lm_head_is_read_coded_only_where_that_costs_less() {
        let (runs, raw) = four_layers(45 * P, 1);
        let with = |ppm, only| Spend {
            head_coded: Some(coded_head(ppm, only)),
            ..raw.clone()
        };
        let r = choose(&raw, Some(&runs), None, None).unwrap();
        assert!(!r.head_pinned && !r.head_coded, "{r:?}");
        let cheap = choose(&with(200_000, false), Some(&runs), None, None).unwrap();
        assert!(cheap.head_coded && !cheap.head_pinned, "{cheap:?}");
        assert!(cheap.cost_per_token < r.cost_per_token, "{cheap:?} {r:?}");
        assert_eq!(cheap.head_held % (2 * P), 0, "{cheap:?}");
        let left = 50 * P - cheap.head_held;
        let read = (33 * left).div_ceil(50);
        assert_eq!(cheap.head_cost, read + left / 5, "{cheap:?}");
        assert_eq!(cheap.decode_per_token, left, "{cheap:?}");
        let dear = choose(&with(500_000, false), Some(&runs), None, None).unwrap();
        assert_eq!(dear, r, "a raw read costs less: the raw plan");
        let forced = choose(&with(500_000, true), Some(&runs), None, None).unwrap();
        assert!(forced.head_coded, "{forced:?}");
    }

    // The raw lm_head's shard on a drive of its own. Beside the coded lm_head above: ten
    // times faster than the trunk's drives (a raw byte weighs 0.1), 5 pages a token
    // against the coded way's 43, so it streams raw where by bytes it is read coded; a third
    // as fast (3.0), 150 pages raw against 58 coded, so it is read coded where by bytes raw
    // costs less. With a raw trunk alone, at the total where by bytes the lm_head is pinned
    // (40 trunk pages a token, against 40 of the lm_head streamed beside the whole trunk
    // pinned: a tie, and pinned wins ties): streamed from a drive ten times faster its 40
    // pages cost 4, and it streams. `read_per_token` stays the bytes read. Catches
    // a plan that ranks by bytes alone when the lm_head and the trunk sit on different
    // drives, and a weight applied to the coded way or to the bytes read.
    #[test]
    fn a_raw_lm_head_on_its_own_drive_is_weighed_by_that_drives_rate() {
        let (runs, raw) = four_layers(45 * P, 1);
        let with = |ppm, head_raw_ppm| Spend {
            head_coded: Some(coded_head(ppm, false)),
            head_raw_ppm,
            ..raw.clone()
        };
        let by_bytes = choose(&raw, Some(&runs), None, None).unwrap();
        let fast = choose(&with(200_000, 100_000), Some(&runs), None, None).unwrap();
        assert!(!fast.head_coded && !fast.head_pinned, "{fast:?}");
        let left = 50 * P - fast.head_held;
        assert_eq!(fast.head_cost, left / 10, "{fast:?}");
        assert_eq!(fast.read_per_token, by_bytes.read_per_token, "{fast:?}");
        let slow = choose(&with(500_000, 3_000_000), Some(&runs), None, None).unwrap();
        assert!(slow.head_coded, "{slow:?}");
        let left = 50 * P - slow.head_held;
        assert_eq!(
            slow.head_cost,
            (33 * left).div_ceil(50) + left / 2,
            "{slow:?}"
        );
        // One drive (weight one): the ranking by bytes, as before.
        let one = choose(&with(500_000, 1_000_000), Some(&runs), None, None).unwrap();
        assert_eq!(one, by_bytes);
        // A raw trunk alone.
        let (runs, s) = four_layers(62 * P, 1);
        let pinned = choose(&s, Some(&runs), None, None).unwrap();
        assert!(pinned.head_pinned, "{pinned:?}");
        let fast = Spend {
            head_raw_ppm: 100_000,
            ..s.clone()
        };
        let c = choose(&fast, Some(&runs), None, None).unwrap();
        assert!(!c.head_pinned, "{c:?}");
        let left = 50 * P - c.head_held;
        assert_eq!(c.head_cost, left / 10, "{c:?}");
        assert_eq!(
            c.read_per_token,
            c.cost_per_token - c.head_cost + left,
            "{c:?}"
        );
        assert!(c.cost_per_token < pinned.cost_per_token, "{c:?} {pinned:?}");
    }

    // Catches: a plan that gives what the trunk leaves to a cache that cannot use it (the
    // slice at 5.5 GB gave 14 expert slots, 0.25 GB, for a 0.5% hit rate) instead of
    // lm_head rows, which save their bytes on every token; and held rows over the total.
    #[test]
    fn what_the_trunk_leaves_holds_lm_head_rows_before_the_cache() {
        let runs = four_layers(0, 100).0;
        let s = |total| four_layers(total, 100).1;
        // The whole trunk fits beside a streamed lm_head but not beside a pinned one: the
        // 29 pages beyond the 16 kept slots hold 28 rows, not 29 more slots.
        let c = choose(&s(95 * P), Some(&runs), None, None).unwrap();
        assert!(!c.head_pinned, "{c:?}");
        assert_eq!((c.trunk, c.head_held, c.cache), (40 * P, 28 * P, 16 * P));
        assert_eq!(c.read_per_token, 22 * P);
        let held = held_rows_bytes(c.head_held / P, P);
        assert!(10 * P + c.trunk + held + c.cache <= 95 * P, "{c:?}");
        // --cache-gb fixes the cache: only the trunk's leftover holds rows.
        let c = choose(&s(95 * P), Some(&runs), None, Some(40 * P)).unwrap();
        assert_eq!((c.trunk, c.head_held, c.cache), (45 * P, 4 * P, 40 * P));
    }

    // A coded trunk (each 10-page layer stores 7 pages and decodes 10) at a total that
    // holds the 50-page lm_head beside one trunk slot, or the whole trunk beside a streamed
    // lm_head. By stored bytes (today's ranking, and a weight of 0) pinning the raw lm_head
    // reads least (28 pages of coded trunk against 40 of lm_head), as the slice at 5.5 GB
    // pinned its lm_head and 3 of 17 coded parts (docs/measurements.md). With decoding
    // weighed at 0.7 read bytes per decoded byte (a 2.8 GB/s disk, 2 cores decoding 2 GB/s
    // each) streaming the trunk costs 28 + 28 = 56 pages a token: the coded layers are
    // pinned before the lm_head, which streams. A raw trunk's choice does not move with the
    // weight. Catches `choose` comparing the two ways by bytes read instead of cost, a
    // weight that does not reach the trunk's plan, and a plan over its total.
    #[test]
    fn a_coded_trunk_is_pinned_before_the_raw_lm_head() {
        let (raw, s) = four_layers(62 * P, 1);
        let coded = |ppm| {
            let mut c = raw.clone().with_decode_weight(ppm);
            c.layer_reads = vec![7 * P; 4];
            c.layer_decoded = vec![10 * P; 4];
            c
        };
        let by_stored = choose(&s, Some(&coded(0)), None, None).unwrap();
        assert!(by_stored.head_pinned, "{by_stored:?}");
        assert_eq!(
            (by_stored.read_per_token, by_stored.decode_per_token),
            (28 * P, 40 * P)
        );
        let weighed = choose(&s, Some(&coded(700_000)), None, None).unwrap();
        assert!(!weighed.head_pinned, "{weighed:?}");
        assert_eq!(weighed.trunk, 40 * P, "every coded layer pinned");
        assert_eq!(
            (
                weighed.read_per_token,
                weighed.decode_per_token,
                weighed.cost_per_token
            ),
            (40 * P, 0, 40 * P)
        );
        let held = held_rows_bytes(weighed.head_held / P, P);
        let head = lm_head_stream_bytes(50 * P);
        assert!(
            head + weighed.trunk + held + weighed.cache <= 62 * P,
            "{weighed:?}"
        );
        for ppm in [0, 700_000, 3_000_000] {
            let c = choose(&s, Some(&raw.clone().with_decode_weight(ppm)), None, None).unwrap();
            assert!(c.head_pinned, "{c:?}");
            assert_eq!((c.read_per_token, c.cost_per_token), (40 * P, 40 * P));
        }
    }
}
