//! `k3-orch inspect MODEL_DIR`: what a checkpoint is and what it would cost to run.
//!
//! Prints the config summary (when `config.json` reads), a tensor census by class (routed
//! expert, shared expert, attention, embedding/lm_head, other, vision: count and bytes, see
//! `k3_model::classify`), the routed-expert set (count × bytes per expert), the per-layer
//! trunk (what `pack-trunk` packs; its largest run), the resident floor with and without a
//! streamed trunk, and what each preset of `configs/presets.json` would use: the trunk plan
//! of `k3_trunk_loader::plan` (pinned prefix + ring slots) over this checkpoint's layer runs
//! as they would be packed, and the expert cache slots of `k3_expert_fetcher`.
//!
//! `--codec-ratio R` projects a coded trunk (`pack-trunk --codec`) before it is packed: every
//! streamed unit reads `R` of its bytes, pinned units still take their decoded size (decoded
//! once at load), and the decode buffers join what every run holds; the budget table then
//! shows the coded plan beside the raw one. A packed coded trunk's own stored sizes are what
//! a run with `--trunk` plans with. Its streamed units are also decoded on every token, and
//! the plan weighs that decoding as reads, as a run's does (`run::plan::DecodeTerms`): for
//! a machine given by `--drive-gbps`, `--decode-gbps` and `--cores`, by default `project`'s
//! reference machine (one 7 GB/s drive, 16 cores) decoding 2 GB/s per core (nothing is
//! measured: only headers are read).
//!
//! Only headers are read. GB = 10^9 bytes, TB = 10^12 (the seed's units).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;

use clap::Parser;

use k3_expert_fetcher::fetcher::slots_for_budget;
use k3_io::slot_bytes_for;
use k3_model::catalog::Catalog;
use k3_model::classify::{classify, expert_of, layer_of, TensorClass};
use k3_model::config::{ConfigError, ExpertFormat, LayerKind, ModelConfig};
use k3_model::trunk::{align_up, TRUNK_ALIGN};
use k3_protocol::conf::TrunkResident;
use k3_trunk_loader::{plan_streams, plan_streams_with, Presets, RingPolicy, Streams};

/// Command line of `k3-orch inspect`.
#[derive(Parser, Debug)]
#[command(
    name = "k3-orch inspect",
    about = "Config summary, tensor census by class, resident floor, memory per preset"
)]
struct Args {
    /// The checkpoint directory (index + shards, or model.safetensors).
    model_dir: PathBuf,
    /// Project a coded trunk that stores this share of its bytes (0 < R <= 1; measured:
    /// 0.662 for Gaussian BF16 with `pack-trunk --codec bf16-zstd`).
    #[arg(long = "codec-ratio", value_parser = parse_ratio)]
    codec_ratio: Option<f64>,
    /// With --codec-ratio: the trunk drive's read rate in GB/s (default 7, the reference
    /// machine's)
    #[arg(long = "drive-gbps", value_parser = parse_rate)]
    drive_gbps: Option<f64>,
    /// With --codec-ratio: GB/s of BF16 one core decodes (default 2, as measured at level 19)
    #[arg(long = "decode-gbps", value_parser = parse_rate)]
    decode_gbps: Option<f64>,
    /// With --codec-ratio: the machine's cores (default 16, the reference machine's).
    /// Compute runs on all of them, so the decoding counts on one core's rate
    /// (`k3_trunk_loader::decode_cores`)
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    cores: Option<u32>,
    /// With --codec-ratio: how resident layers are held, as `k3-orch --trunk-resident`
    /// (raw, coded or auto; default auto)
    #[arg(long = "trunk-resident", value_parser = parse_resident, default_value = "auto")]
    trunk_resident: TrunkResident,
}

/// What a plan's pinned count gets for the layers it keeps coded: ` +N kept`, or nothing.
pub(crate) fn kept_suffix(kept: usize) -> String {
    match kept {
        0 => String::new(),
        k => format!(" +{k} kept"),
    }
}

/// A `--trunk-resident` placement: raw, coded or auto.
pub(crate) fn parse_resident(s: &str) -> Result<TrunkResident, String> {
    TrunkResident::from_name(s.trim()).ok_or_else(|| format!("{s:?} is not raw, coded or auto"))
}

/// A rate in GB/s: a positive number.
fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("{s:?} is not a positive number of GB/s")),
    }
}

/// A `--codec-ratio`: a number in (0, 1].
pub(crate) fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if r > 0.0 && r <= 1.0 => Ok(r),
        _ => Err(format!("{s:?} is not a share in (0, 1]")),
    }
}

pub fn main(args: Vec<OsString>) -> i32 {
    let args = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let cat = match Catalog::open(&args.model_dir) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("k3-orch inspect: {e}");
            return 1;
        }
    };
    let cfg = ModelConfig::load_dir(&args.model_dir);
    print!("{}", report(&cat, cfg.as_ref()));
    if let Ok(c) = &cfg {
        let codec = args.codec_ratio.map(|r| {
            let given = |x: Option<f64>, what: &str| match x {
                Some(_) => what.to_string(),
                None => "reference".to_string(),
            };
            let terms = crate::run::plan::DecodeTerms {
                disk_bps: args.drive_gbps.unwrap_or(7.0) * crate::units::GB,
                disk_source: given(args.drive_gbps, "--drive-gbps"),
                decode_bps: args
                    .decode_gbps
                    .map_or(crate::run::plan::ASSUMED_DECODE_BPS, |g| {
                        g * crate::units::GB
                    }),
                decode_source: given(args.decode_gbps, "--decode-gbps"),
                cores: args.cores.unwrap_or(16) as usize,
                compute_threads: args.cores.unwrap_or(16) as usize,
            };
            (r, terms, args.trunk_resident)
        });
        print!("{}", budget_table(&cat, c, codec.as_ref()));
    }
    0
}

/// `1234567` -> `1,234,567`.
/// The trunk of layers `0..layers` (all when `None`) as `pack-trunk` would lay it out (each
/// layer's tensors in shard order, one page-aligned run per layer), as [`Streams`]: whole
/// layers and their parts. Headers only.
pub fn packed_streams(cat: &Catalog, layers: Option<usize>) -> Streams {
    use k3_model::trunk::{TrunkLayer, TrunkTensor};
    let mut by_layer: BTreeMap<usize, Vec<TrunkTensor>> = BTreeMap::new();
    for (name, e) in cat.iter() {
        if !k3_model::classify::is_layer_trunk(&name) {
            continue;
        }
        let Some(l) = layer_of(&name) else { continue };
        if layers.is_some_and(|n| l >= n) {
            continue;
        }
        by_layer.entry(l).or_default().push(TrunkTensor {
            name,
            dtype: e.dtype,
            shape: e.shape.to_vec(),
            offset: e.offset,
            len: e.len,
            crc32: Vec::new(),
        });
    }
    let mut at = 0u64;
    let mut out = Vec::with_capacity(by_layer.len());
    for (l, mut ts) in by_layer {
        ts.sort_by_key(|t| t.offset);
        let lo = ts.first().map_or(0, |t| t.offset);
        let hi = ts.iter().map(|t| t.offset + t.len).max().unwrap_or(lo);
        for t in &mut ts {
            t.offset -= lo;
        }
        let length = hi - lo;
        out.push(TrunkLayer {
            layer: l,
            offset: at,
            length,
            padded_length: align_up(length, TRUNK_ALIGN),
            shard: String::new(),
            source_offset: lo,
            sha256: String::new(),
            crc32: Vec::new(),
            tensors: ts,
        });
        at += align_up(length, TRUNK_ALIGN);
    }
    Streams::of_layers(&out)
}

fn commas(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// GB with two decimals; small amounts (under 10 MB) in bytes.
fn gb(b: u64) -> String {
    if b < 10_000_000 {
        format!("{} bytes", commas(b))
    } else {
        format!("{:.2} GB", b as f64 / 1e9)
    }
}

/// Census figures of a catalog.
#[derive(Debug, Default, Clone)]
pub struct Census {
    /// Per class: (tensors, bytes).
    pub classes: BTreeMap<TensorClass, (u64, u64)>,
    /// Per (layer, expert): (bytes, span from first to last byte).
    pub experts: BTreeMap<(usize, usize), (u64, u64, u64)>,
    /// Per decoder layer: bytes of its trunk (non-routed-expert tensors).
    pub layer_trunk: BTreeMap<usize, u64>,
    /// Resident tensors outside any layer (embed, lm_head, final norms).
    pub model_level: u64,
    /// Of which embed_tokens + lm_head.
    pub embedding: u64,
}

/// Count a catalog by class, expert and layer.
pub fn census(cat: &Catalog) -> Census {
    let mut c = Census::default();
    for (name, e) in cat.iter() {
        let class = classify(&name);
        let slot = c.classes.entry(class).or_insert((0, 0));
        slot.0 += 1;
        slot.1 += e.len;
        match class {
            TensorClass::RoutedExpert => {
                if let Some(k) = expert_of(&name) {
                    let x = c.experts.entry(k).or_insert((0, u64::MAX, 0));
                    x.0 += e.len;
                    x.1 = x.1.min(e.offset);
                    x.2 = x.2.max(e.end());
                }
            }
            TensorClass::Vision => {}
            _ => match layer_of(&name) {
                Some(l) => *c.layer_trunk.entry(l).or_insert(0) += e.len,
                None => {
                    c.model_level += e.len;
                    if class == TensorClass::Embedding {
                        c.embedding += e.len;
                    }
                }
            },
        }
    }
    c
}

/// The whole report as text.
fn report(cat: &Catalog, cfg: Result<&ModelConfig, &ConfigError>) -> String {
    let c = census(cat);
    let runs = packed_streams(cat, None);
    let mut o = model_lines(cat, cfg);
    o += &class_table(&c);
    o += "\n";
    o += &expert_line(&c);
    o += &trunk_lines(&c, &runs);
    o += &preset_lines(&c, &runs);
    o
}

/// The model line and the config summary.
fn model_lines(cat: &Catalog, cfg: Result<&ModelConfig, &ConfigError>) -> String {
    let disk: u64 = cat.shards().iter().map(|s| s.file_size).sum();
    let mut o = format!(
        "model          : {} ({} shards, {} tensors, {} bytes on disk)\n",
        cat.source().display(),
        cat.shards().len(),
        commas(cat.len() as u64),
        commas(disk)
    );
    let c = match cfg {
        Ok(c) => c,
        Err(e) => return o + &format!("config         : not read ({e})\n"),
    };
    let kda = c
        .layer_kinds()
        .iter()
        .filter(|k| **k == LayerKind::Kda)
        .count();
    let moe = c.moe_layer_indices();
    o += &format!(
        "config         : hidden {}, {} layers ({} KDA + {} MLA; {} dense, {} MoE), vocab {}\n",
        c.hidden_size,
        c.num_hidden_layers,
        kda,
        c.num_hidden_layers - kda,
        c.num_hidden_layers - moe.len(),
        moe.len(),
        c.vocab_size
    );
    o += &format!(
        "                 {} routed experts, top-{}, latent {}, expert FFN {}, shared width {}; experts {}\n",
        c.num_experts,
        c.num_experts_per_token,
        c.routed_expert_hidden_size,
        c.moe_intermediate_size,
        c.shared_expert_width(),
        match c.expert_format() {
            ExpertFormat::Mxfp4 { group_size } =>
                format!("MXFP4 (compressed-tensors, group {group_size})"),
            ExpertFormat::Unquantized => "unquantized".to_string(),
        }
    );
    o
}

/// The census by class: tensors and bytes per class, and the total.
fn class_table(c: &Census) -> String {
    let mut o = String::from("\ncensus by class:\n");
    o += &format!(
        "  {:<20} {:>10} {:>22} {:>12}\n",
        "class", "tensors", "bytes", "GB"
    );
    let (mut nt, mut nb) = (0u64, 0u64);
    for class in TensorClass::ALL {
        if let Some(&(n, b)) = c.classes.get(&class) {
            o += &format!(
                "  {:<20} {:>10} {:>22} {:>12.3}\n",
                class.label(),
                commas(n),
                commas(b),
                b as f64 / 1e9
            );
            nt += n;
            nb += b;
        }
    }
    o += &format!(
        "  {:<20} {:>10} {:>22} {:>12.3}\n",
        "total",
        commas(nt),
        commas(nb),
        nb as f64 / 1e9
    );
    o
}

impl Census {
    /// The arena slot of the largest routed expert's file span (what one expert occupies).
    fn expert_slot(&self) -> u64 {
        let max_span = self
            .experts
            .values()
            .map(|x| x.2.saturating_sub(x.1))
            .max()
            .unwrap_or(0);
        slot_bytes_for(max_span)
    }
}

/// The routed experts' line: how many, in how many layers, their sizes.
fn expert_line(c: &Census) -> String {
    let n_exp = c.experts.len() as u64;
    if n_exp == 0 {
        return "routed experts : none\n".into();
    }
    let exp_bytes: u64 = c.experts.values().map(|x| x.0).sum();
    let min = c.experts.values().map(|x| x.0).min().unwrap_or(0);
    let max = c.experts.values().map(|x| x.0).max().unwrap_or(0);
    let layers_with_experts = c
        .experts
        .keys()
        .map(|k| k.0)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let per = if min == max {
        format!("{} bytes", commas(min))
    } else {
        format!("{}..{} bytes", commas(min), commas(max))
    };
    format!(
        "routed experts : {} ({} MoE layers) x {} = {} bytes ({:.4} TB; streamed, never resident)\n",
        commas(n_exp),
        layers_with_experts,
        per,
        commas(exp_bytes),
        exp_bytes as f64 / 1e12
    )
}

/// The trunk as pack-trunk would lay it out, the model-level tensors, the resident floor.
fn trunk_lines(c: &Census, runs: &Streams) -> String {
    let trunk: u64 = c.layer_trunk.values().sum();
    let (largest_layer, largest) =
        c.layer_trunk.iter().fold(
            (0usize, 0u64),
            |m, (&l, &b)| if b > m.1 { (l, b) } else { m },
        );
    let mut o = format!(
        "trunk          : {} ({} bytes, {} layers, non-routed-expert tensors; largest run {:.3} GB at layer {})\n",
        gb(trunk),
        commas(trunk),
        c.layer_trunk.len(),
        largest as f64 / 1e9,
        largest_layer
    );
    o += &format!(
        "embed+lm_head  : {} ({} bytes)\n",
        gb(c.embedding),
        commas(c.embedding)
    );
    let others = c.model_level - c.embedding;
    if others > 0 {
        o += &format!(
            "model-level    : {} bytes (final norm, output AttnRes)\n",
            commas(others)
        );
    }
    let resident = trunk + c.model_level;
    let exp_slot = c.expert_slot();
    o += &format!(
        "resident floor : {} with the trunk resident (trunk + embed/lm_head + model-level)\n",
        gb(resident)
    );
    let first_slot = runs.parts.iter().map(|r| r.footprint()).max().unwrap_or(0);
    if !c.experts.is_empty() {
        o += &format!(
            "                 {} streaming the trunk in parts with embed/lm_head held (embed/lm_head + model-level + one ring slot {} for the largest layer part + one expert slot {}; the budget table below streams the lm_head too)\n",
            gb(c.model_level + first_slot + exp_slot),
            gb(first_slot),
            gb(exp_slot)
        );
    }
    o
}

/// What each preset pins, streams and caches over this checkpoint's packed runs.
fn preset_lines(c: &Census, runs: &Streams) -> String {
    let n_exp = c.experts.len() as u64;
    let exp_slot = c.expert_slot();
    let presets = Presets::builtin();
    let mut o = String::from(
        "\npresets (budgets trunk / expert cache GB; plan over this checkpoint's packed runs):\n",
    );
    for p in &presets.presets {
        let b = p.budgets();
        let line = match plan_streams(b.trunk_bytes, runs, RingPolicy::default()) {
            Ok(sp) => {
                let tp = sp.plan;
                // The arena never needs more slots than there are experts.
                let slots = if n_exp > 0 {
                    slots_for_budget(b.cache_bytes, exp_slot).min(n_exp as usize)
                } else {
                    0
                };
                let cache = slots as u64 * exp_slot;
                let pct = if n_exp > 0 {
                    100.0 * slots as f64 / n_exp as f64
                } else {
                    0.0
                };
                format!(
                    "pinned {:>3}/{} {}, ring {} x {}; cache {} experts ({:.2}% of the pool); uses {}",
                    tp.pinned,
                    tp.layers,
                    if sp.parts { "layer parts" } else { "layers" },
                    tp.ring_slots,
                    gb(tp.slot_bytes),
                    slots,
                    pct,
                    gb(tp.bytes() + cache + c.model_level)
                )
            }
            Err(e) => format!("refused: {e}"),
        };
        o += &format!(
            "  {:<12} {:>6.1} / {:>6.1}  {}\n",
            p.name, p.trunk_gb, p.cache_gb, line
        );
    }
    o
}

/// Positions of context the budget table assumes (KV cache of the MLA layers).
pub const TABLE_CONTEXT: usize = 64;

/// The smallest total [`crate::run::plan::choose`] accepts (None: not even everything).
pub fn floor_of(s: &crate::run::plan::Spend, runs: &Streams) -> Option<u64> {
    use crate::run::plan::{choose, Spend};
    let ok = |t: u64| {
        choose(
            &Spend {
                total: t,
                ..s.clone()
            },
            Some(runs),
            None,
            None,
        )
        .is_ok()
    };
    let mut hi = s.fixed
        + s.lm_head
        + runs.pinned_bytes()
        + s.max_slots.max(s.min_slots) * s.expert_slot
        + (1 << 30);
    if !ok(hi) {
        return None;
    }
    let mut lo = 0u64;
    while hi - lo > 4096 {
        let mid = lo + (hi - lo) / 2;
        if ok(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi)
}

/// One row of the budget table: what a total pins and reads.
struct Row {
    /// Units pinned of the trunk's (`12/93 parts`), and the layers kept coded (`+40 kept`).
    pinned: String,
    /// Arena bytes of the pinned trunk (decoded) and of the layers kept coded (stored).
    resident: u64,
    head: String,
    slots: u64,
    read: u64,
    /// Bytes a coded trunk's streamed units decode per token.
    decoded: u64,
}

/// What `total` pins and reads over `runs` by the run's own plan, or why it is refused.
fn row(base: &crate::run::plan::Spend, runs: &Streams, total: u64) -> Result<Row, String> {
    use crate::run::plan::{choose, Spend};
    let sp = Spend {
        total,
        ..base.clone()
    };
    let c = choose(&sp, Some(runs), None, None).map_err(|e| e.to_string())?;
    let tp = plan_streams_with(c.trunk, runs, RingPolicy::default(), c.sink).ok();
    Ok(Row {
        pinned: tp
            .as_ref()
            .map(|p| {
                let parts = if p.parts { " parts" } else { "" };
                let kept = kept_suffix(p.plan.kept);
                format!("{}/{}{parts}{kept}", p.plan.pinned, p.plan.layers)
            })
            .unwrap_or_default(),
        resident: tp.map_or(0, |p| p.plan.pinned_bytes + p.plan.kept_bytes),
        head: if c.head_pinned {
            "pinned".to_string()
        } else if c.head_held > 0 {
            format!(
                "{} held{}",
                gb(c.head_held),
                if c.head_coded { ", coded" } else { "" }
            )
        } else if c.head_coded {
            "streamed coded".to_string()
        } else {
            "streamed".to_string()
        },
        slots: (c.cache / base.expert_slot.max(1)).min(base.max_slots),
        read: c.read_per_token,
        decoded: c.decode_per_token,
    })
}

/// The floor line of a plan over `runs`.
fn floor_line(
    base: &crate::run::plan::Spend,
    runs: &Streams,
    floor: Option<u64>,
    topk: u64,
) -> String {
    use crate::run::plan::{choose, Spend};
    let Some(f) = floor else {
        return "none (the plan refuses every total)".into();
    };
    let sp = choose(
        &Spend {
            total: f,
            ..base.clone()
        },
        Some(runs),
        None,
        None,
    )
    .ok()
    .and_then(|c| plan_streams_with(c.trunk, runs, RingPolicy::default(), c.sink).ok());
    let (slot, what) = match sp {
        Some(sp) if sp.parts => (sp.plan.slot_bytes, "the largest layer part"),
        Some(sp) => (sp.plan.slot_bytes, "the largest layer"),
        None => (0, "the trunk"),
    };
    format!(
        "{} (one ring slot of {} for {what}, {} expert slots that a layer's top-{} streams through)",
        gb(f),
        gb(slot),
        base.min_slots,
        topk
    )
}

/// The [`crate::run::plan::Spend`] of every total of the budget table, and the streams.
fn table_base(cat: &Catalog, cfg: &ModelConfig) -> (crate::run::plan::Spend, Streams, u64, u64) {
    use crate::run::plan::{compute_scratch, Spend};
    let layers = cfg.num_hidden_layers;
    let sizes = crate::run::sizes::model_sizes(cfg, cat, layers);
    let runs = packed_streams(cat, Some(layers));
    let topk = cfg.num_experts_per_token as u64;
    let expert_slot = slot_bytes_for(sizes.max_expert_span.max(1));
    let norms = sizes
        .model_bytes
        .saturating_sub(sizes.embed_bytes + sizes.lm_head_bytes);
    let fixed = sizes.embed_row_bytes.div_ceil(4096) * 4096
        + norms
        + sizes.kda_state_bytes
        + sizes.kv_per_pos * TABLE_CONTEXT as u64
        + crate::run::plan::STAGE_PROCESSES as u64 * crate::run::plan::STAGE_PROCESS_BYTES
        + compute_scratch(cfg, 1);
    let base = Spend {
        total: 0,
        fixed,
        trunk_need: runs.pinned_bytes(),
        lm_head: sizes.lm_head_bytes,
        lm_head_row: sizes.lm_head_bytes / (cfg.vocab_size as u64).max(1),
        expert_slot,
        min_slots: crate::run::plan::min_expert_slots(topk),
        max_slots: sizes.n_experts.max(topk),
        trunk_min: crate::run::plan::trunk_min(&runs),
        read_slots: crate::run::plan::read_slots(1),
        head_coded: None,
        head_raw_ppm: 1_000_000,
    };
    (base, runs, sizes.lm_head_bytes, topk)
}

/// "one total budget": what `--mem-gb X` (the staged run, a packed trunk, incremental
/// decode at a context of [`TABLE_CONTEXT`]) would hold and read per token, from the
/// streaming floor up, by the run's own plan ([`crate::run::plan::choose`]); with a
/// `codec` (a ratio and the machine's decoding terms), the same for a coded trunk that
/// stores that share of its bytes, its decoding weighed as the run weighs it.
pub fn budget_table(
    cat: &Catalog,
    cfg: &ModelConfig,
    codec: Option<&(f64, crate::run::plan::DecodeTerms, TrunkResident)>,
) -> String {
    use crate::run::plan::lm_head_stream_bytes;
    let (base, runs, lm_head, topk) = table_base(cat, cfg);
    let coded = codec.map(|(r, terms, resident)| {
        let decode = k3_trunk_loader::loader::decode_buffer_bound(k3_model::trunk::CODEC_CHUNK);
        // The lm_head coded at the same ratio (pack-trunk --codec codes it too).
        let head = crate::run::plan::HeadCoding::projected(
            base.lm_head,
            base.lm_head_row,
            *r,
            terms.head_ppm(),
        );
        let spend = crate::run::plan::Spend {
            fixed: base.fixed + decode,
            head_coded: Some(head),
            ..base.clone()
        };
        let streams = runs
            .clone()
            .with_read_ratio(*r)
            .with_decode_weight(terms.ppm())
            .with_resident(*resident);
        (*r, spend, streams, decode, terms)
    });
    let mut o = String::new();
    o += &format!(
        "\none total budget (--mem-gb; staged, packed trunk, incremental at {TABLE_CONTEXT} positions):\n"
    );
    o += &format!(
        "  held whatever the budget: {} (embedding row, norms, recurrent state, KV, scratch, processes); \
         the embedding is never resident, the lm_head ({}) is pinned or streamed ({} of chunk buffers)\n",
        gb(base.fixed),
        gb(lm_head),
        gb(lm_head_stream_bytes(lm_head))
    );
    let floor = floor_of(&base, &runs);
    o += &format!(
        "  streaming floor: {}\n",
        floor_line(&base, &runs, floor, topk)
    );
    if let Some((r, cb, cr, decode, terms)) = &coded {
        o += &format!(
            "  coded trunk (--codec-ratio {r}): {} stored of {} (read at the stored size when streamed, \
             pinned at the decoded size); {} of decode buffers\n",
            gb(cr.stored_bytes()),
            gb(runs.pinned_bytes()),
            gb(*decode)
        );
        o += &format!(
            "  coded trunk decoded on every token it streams, weighed as reads: {}\n",
            terms.describe()
        );
        o += &format!(
            "  coded lm_head (pack-trunk --codec codes it too, here at the same ratio): {} \
             stored; when it streams, read coded where that weighs less (\"coded\" in the \
             lm_head column), its decoding on every core: a decoded byte weighs {:.2} read bytes\n",
            gb(cb.head_coded.map_or(0, |h| h.stored)),
            terms.head_ppm() as f64 / 1e6
        );
        o += &format!(
            "  coded trunk placed with --trunk-resident {}: \"+N kept\" layers stay coded in RAM \
             (their stored bytes resident), decoded on each use\n",
            cr.resident.name()
        );
        o += &format!(
            "  coded streaming floor: {}\n",
            floor_line(cb, cr, floor_of(cb, cr), topk)
        );
    }
    let all = base.fixed + base.lm_head + base.trunk_need + base.max_slots * base.expert_slot;
    let mut totals: Vec<u64> = floor.into_iter().collect();
    for g in [1.5, 2.0, 5.5, 8.0, 16.0, 64.0, 128.0, 256.0] {
        let b = (g * 1e9) as u64;
        if floor.is_none_or(|f| b > f) && b < all {
            totals.push(b);
        }
    }
    totals.push(all);
    o += &table_rows(&base, &runs, coded.as_ref().map(|c| (&c.1, &c.2)), &totals);
    o +=
        "  * trunk layers and lm_head read per token; routed experts come on top (see sim-cache)\n";
    o
}

/// The budget table's header and one row per total (raw, and coded beside it when given).
fn table_rows(
    base: &crate::run::plan::Spend,
    runs: &Streams,
    coded: Option<(&crate::run::plan::Spend, &Streams)>,
    totals: &[u64],
) -> String {
    let mut o = format!(
        "  {:>10}  {:>14}  {:>12}  {:>15}  {:>11}  {:>12}",
        "total", "trunk pinned", "resident", "lm_head", "cache slots", "read/token*"
    );
    if coded.is_some() {
        o += &format!(
            "  {:>14}  {:>14}  {:>15}  {:>18}  {:>14}",
            "coded pinned", "coded resident", "coded lm_head", "coded read/token*", "decoded/token"
        );
    }
    o += "\n";
    for &t in totals {
        match row(base, runs, t) {
            Ok(r) => {
                o += &format!(
                    "  {:>10}  {:>14}  {:>12}  {:>15}  {:>11}  {:>12}",
                    gb(t),
                    r.pinned,
                    gb(r.resident),
                    r.head,
                    r.slots,
                    gb(r.read)
                );
                if let Some((cb, cr)) = coded {
                    o += &match row(cb, cr, t) {
                        Ok(c) => format!(
                            "  {:>14}  {:>14}  {:>15}  {:>18}  {:>14}",
                            c.pinned,
                            gb(c.resident),
                            c.head,
                            gb(c.read),
                            gb(c.decoded)
                        ),
                        Err(_) => format!("  {:>14}", "refused"),
                    };
                }
                o += "\n";
            }
            Err(e) => o += &format!("  {:>10}  refused: {e}\n", gb(t)),
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands() {
        assert_eq!(commas(0), "0");
        assert_eq!(commas(999), "999");
        assert_eq!(commas(17547264), "17,547,264");
        assert_eq!(commas(1446456066048), "1,446,456,066,048");
    }
}
