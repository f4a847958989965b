//! `k3-orch project [MODEL_DIR]`: a projection of what a model would cost on a machine, from
//! the model's headers (no weights) and the machine's figures. It is arithmetic over a plan,
//! not a measurement; issue 35 calibrates it against measured runs.
//!
//! The model: a checkpoint's headers (`synth --shape released --headers-only DIR` writes the
//! release's, 130 MB; a downloaded release works as well), or without MODEL_DIR the released
//! geometry built in memory from `k3_model::released` ([`ModelShape::released`]; a test holds
//! the two equal).
//!
//! The machine: the memory k3 may use (`--ram-gb`, as `--mem-gb`: the plan spends it less
//! the run's 5% reserve), drives × GB/s, cores, the rate k3's products stream weights from
//! RAM and a per-core MAC rate. Each is measured here unless given, the way the engine
//! uses it (issue 35's calibration: the raw probes overstated what the engine reaches):
//! - the drive with `devbw` (O_DIRECT) on `--probe-file` or the model's largest shard when
//!   it holds data, twice: as the expert-fetcher reads (its 4 MiB pieces at its queue
//!   depth, 16) and as the trunk-loader reads (`k3_io::direct::READ_CHUNK` pieces at
//!   `READ_QD`); a drive that cannot be measured (a header-only set is sparse) is assumed at
//!   [`REFERENCE`]'s speed, and the output says so; with `--experts DIR,..` (a pack striped
//!   over several drives) each drive's `experts.bin` is measured as the fetcher reads it
//!   and the experts are read at the drives' sum ([`with_expert_drives`], as `doctor`);
//! - the memory with the engine's own GEMV over a bf16 matrix far larger than the caches
//!   and over 16 routed experts of the model's shape run side by side as a decode step runs
//!   them ([`measure_products`], the median pass): the bytes per second the products reach,
//!   which is about half what a bare read probe gives on the machines measured so far;
//! - the MAC rate with the same GEMV on a cache-resident bf16 and MXFP4 matrix.
//!
//! The arithmetic ([`per_token`], [`Times`]): the run's own memory plan
//! (`run::plan::choose`, as `inspect`'s budget table) says what is pinned, streamed and
//! cached at the budget; per token the disk reads the streamed trunk and lm_head plus the
//! routed experts the cache misses (flat routing by default: the hit rate is cache slots
//! over experts, [`flat_hit_rate`]; with `--trace FILE`, a route trace from
//! `--record-routes`, the engine's LRU replayed on it at the same share of the pool,
//! [`Hits`]); RAM is read for every weight the token multiplies, bf16 and MXFP4 at their
//! measured rates; the MACs run at the measured rate. The terms combine as the pipeline
//! runs ([`Times::s_per_token`]): the trunk-loader reads ahead while compute works, but a
//! layer's experts are asked for only once its router has run and its products wait for
//! them, and with a ring of one slot the loader cannot read the next streamed unit while
//! compute works on the current one. So s/token is the larger of
//! - the disk's time (trunk and experts) plus the compute it cannot overlap (the products
//!   over streamed trunk units, when the ring holds one), and
//! - the compute (products, or MACs where those are slower) plus the expert reads,
//!
//! and the floor named is the first (disk) or the slower part of the second.
//!
//! `--codec-ratio R` projects a coded trunk (`pack-trunk --codec`) storing `R` of its bytes
//! ([`ModelShape::with_codec_ratio`]): its streamed parts are read at the stored size and
//! decoded on every token by the trunk-loader's reader threads, on the cores compute uses.
//! The plan weighs that decoding against the reads (`run::plan::DecodeTerms`, as a run
//! does), and the decoding's time, its decoded bytes over one core's rate
//! (`--decode-gbps`, else measured on Gaussian BF16 coded as `pack-trunk` codes it,
//! [`measure_decode`]) times the cores compute leaves (one: compute runs on all), is added
//! to the compute side (docs/measurements.md, "The coded trunk's literals": spread over
//! every core, a kept layer's decoding measured 2.7-3x dearer than projected).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::Parser;

use k3_io::slot_bytes_for;
use k3_model::catalog::Catalog;
use k3_model::classify::{classify, TensorClass, LM_HEAD};
use k3_model::config::{ExpertFormat, ModelConfig};
use k3_model::trunk::{align_up, TrunkLayer, TrunkTensor, TRUNK_ALIGN};
use k3_trunk_loader::{plan_streams_with, RingPolicy, Streams};

use crate::run::plan::{self, choose, Choice, Spend};
use crate::units::{human, GB};

/// Command line of `k3-orch project`.
#[derive(Parser, Debug)]
#[command(
    name = "k3-orch project",
    about = "Project s/token for a model on a machine (a projection from the headers, not a measurement)"
)]
struct Args {
    /// A checkpoint's directory (headers are enough: `synth --shape released --headers-only
    /// DIR`); without it, the released Kimi K3 geometry
    model_dir: Option<PathBuf>,
    /// Memory k3 may use, in GB, as `--mem-gb` (a list gives one row each; default: this
    /// machine's available memory, as a run's default budget)
    #[arg(long = "ram-gb", value_delimiter = ',')]
    ram_gb: Vec<f64>,
    /// Drives the routed experts are read from (a list gives one row each; default 1)
    #[arg(long, value_delimiter = ',')]
    drives: Vec<u32>,
    /// Drives the trunk's reads spread over: 1, the `--trunk` directory on one drive
    /// (default), or N for N copies given to a run's `--trunk DIR,COPY,..` (or an md RAID 0
    /// of N drives under it)
    #[arg(
        long = "trunk-drives",
        default_value_t = 1,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    trunk_drives: u32,
    /// Read bandwidth of one drive in GB/s (default: measured with devbw on --probe-file or
    /// the model's largest shard; else assumed 7.0, a PCIe 4 NVMe drive)
    #[arg(long = "drive-gbps")]
    drive_gbps: Option<f64>,
    /// A large file on the drive to measure (default: the model's largest shard)
    #[arg(long = "probe-file")]
    probe_file: Option<PathBuf>,
    /// Packed experts' directories (`pack-experts --to`, as a run's `--experts`), one per
    /// drive: each drive's `experts.bin` is measured as the fetcher reads it and the
    /// experts are projected at the drives' summed bandwidth (`--drives` defaults to the
    /// number of drives they sit on)
    #[arg(long, value_delimiter = ',')]
    experts: Vec<PathBuf>,
    /// Copies of each routed expert over the drives (`pack-experts --copies`; default: the
    /// --experts pack's, else 1): each read from the least busy drive holding it
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    copies: Option<u32>,
    /// Every routed expert split over the drives (`pack-experts --split`; default: the
    /// --experts pack's layout): each drive reads its share of every layer
    #[arg(long, conflicts_with = "copies")]
    split: bool,
    /// Memory read bandwidth in GB/s (default: measured here with the read probe)
    #[arg(long = "mem-gbps")]
    mem_gbps: Option<f64>,
    /// Cores computing (default: this machine's)
    #[arg(long)]
    cores: Option<usize>,
    /// Multiply-adds per second of one core, in G (default: measured here with the
    /// engine's GEMV, bf16 and MXFP4 apart; this value is used for both)
    #[arg(long = "gmacs-per-core")]
    gmacs_per_core: Option<f64>,
    /// Seconds the drive measurement reads for
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Tokens of a reply, for the reply-time line
    #[arg(long, default_value_t = 256)]
    reply: u64,
    /// A route trace (`--record-routes FILE`) to take the expert hit rate from: the
    /// engine's LRU replayed on it with the plan's cache at the same share of the trace's
    /// expert pool (default: flat routing)
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Print one JSON object per budget and drive count instead of the text
    #[arg(long)]
    json: bool,
    /// Project a coded trunk that stores this share of its bytes (0 < R <= 1; measured:
    /// 0.662 at level 19, 0.68 at level 1 on Gaussian BF16)
    #[arg(long = "codec-ratio", value_parser = crate::tools::inspect::parse_ratio)]
    codec_ratio: Option<f64>,
    /// With --codec-ratio: GB/s of BF16 one core decodes (default: measured here)
    #[arg(long = "decode-gbps")]
    decode_gbps: Option<f64>,
    /// With --codec-ratio: how resident layers are held, as `k3-orch --trunk-resident`
    /// (raw, coded or auto; default auto)
    #[arg(long = "trunk-resident", value_parser = crate::tools::inspect::parse_resident, default_value = "auto")]
    trunk_resident: k3_protocol::conf::TrunkResident,
}

/// Where the expected expert hit rate comes from.
pub enum Hits {
    /// Flat routing: cache slots over experts ([`flat_hit_rate`]).
    Flat,
    /// A recorded route trace, replayed under the engine's policy (LRU) with the cache at
    /// the same share of the trace's pool (its MoE layers x experts) as the plan's cache
    /// is of the model's experts: exact when the trace is of this model, a scaled estimate
    /// when it is of another (a tiny model's routes for the released one).
    Trace {
        trace: k3_expert_fetcher::sim::DenseTrace,
        pool: u64,
        label: String,
    },
}

impl Hits {
    /// The share of routed-expert requests a cache of `slots` serves among `experts`.
    pub fn rate(&self, slots: u64, experts: u64) -> f64 {
        match self {
            Hits::Flat => flat_hit_rate(slots, experts),
            Hits::Trace { .. } if experts == 0 || slots >= experts => 1.0,
            Hits::Trace { trace, pool, .. } => {
                let share = slots as f64 / experts as f64;
                let cap = (share * *pool as f64).round() as usize;
                let hits = k3_expert_fetcher::sim::simulate(
                    k3_expert_fetcher::sim::Policy::Lru,
                    trace,
                    cap,
                );
                hits as f64 / trace.requests().max(1) as f64
            }
        }
    }

    /// Where the rate comes from, for the output.
    pub fn label(&self) -> &str {
        match self {
            Hits::Flat => "flat routing",
            Hits::Trace { label, .. } => label,
        }
    }

    /// The hit rates of a route trace file.
    pub fn from_trace(path: &Path) -> Result<Hits, ProjectError> {
        let t = k3_protocol::routes::RouteTrace::read(path)?;
        let keys = k3_expert_fetcher::sim::keys_of_routes(&t);
        if keys.is_empty() {
            return Err(ProjectError::NoRoutes(path.to_path_buf()));
        }
        Ok(Hits::Trace {
            trace: k3_expert_fetcher::sim::DenseTrace::new(&keys),
            pool: t.header.moe_layers.len() as u64 * t.header.experts as u64,
            label: format!(
                "LRU on the route trace {} ({} routes)",
                path.display(),
                t.header.records
            ),
        })
    }
}

/// Why a model cannot be projected (its config, headers or route trace), a budget is
/// refused (the memory plan's reason), or a drive cannot be measured.
#[derive(Debug, thiserror::Error)]
pub enum ProjectError {
    #[error(transparent)]
    Config(#[from] k3_model::config::ConfigError),
    #[error(transparent)]
    Catalog(#[from] k3_model::catalog::CatalogError),
    #[error(transparent)]
    Routes(#[from] k3_protocol::routes::RoutesError),
    #[error("{}: the trace has no routes", .0.display())]
    NoRoutes(PathBuf),
    /// The memory plan refuses the budget.
    #[error(transparent)]
    Budget(#[from] plan::BudgetError),
    /// The trunk's streams do not fit what the plan gave them.
    #[error(transparent)]
    Streams(#[from] k3_trunk_loader::PlanError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Devbw(#[from] k3_io::devbw::DevbwError),
}

/// Positions of context the plan assumes (the KV cache of the MLA layers), as `inspect`'s
/// budget table.
pub const CONTEXT: u64 = crate::tools::inspect::TABLE_CONTEXT as u64;

/// A model as the projection sees it: the plan's inputs and what a token touches.
#[derive(Clone, Debug)]
pub struct ModelShape {
    /// Where the shape came from (a directory, or the released geometry).
    pub label: String,
    pub layers: usize,
    pub moe_layers: u64,
    pub experts_per_layer: u64,
    pub top_k: u64,
    pub experts_mxfp4: bool,
    /// Bytes of the checkpoint on disk (its shards).
    pub checkpoint_bytes: u64,
    /// Trunk bytes (every layer's non-expert tensors) and their multiply-adds per token.
    pub trunk_bytes: u64,
    pub trunk_macs: u64,
    pub lm_head_bytes: u64,
    pub lm_head_macs: u64,
    /// One embedding row (the embedding is read a row per token).
    pub embed_row_bytes: u64,
    /// One routed expert's file span (what a miss reads) and its multiply-adds.
    pub expert_bytes: u64,
    pub expert_macs: u64,
    /// One routed expert's matrices: w1 and w3 are `.0 x .1` (moe_intermediate x latent),
    /// w2 the other way round (what [`measure_products`] times them as).
    pub expert_dims: (usize, usize),
    /// The memory plan's inputs (total 0) and the trunk's packed runs.
    pub spend: Spend,
    pub runs: Streams,
    /// A coded trunk's stored share (None: raw).
    pub codec_ratio: Option<f64>,
}

/// What [`ModelShape`] is built from: the tensors a token touches, tallied.
#[derive(Default)]
struct Tally {
    trunk_bytes: u64,
    trunk_macs: u64,
    lm_head_bytes: u64,
    lm_head_macs: u64,
    embed_row_bytes: u64,
    /// Model-level bytes that are neither the embedding nor the lm_head (final norms).
    norms_bytes: u64,
    expert_span: u64,
    expert_macs_total: u64,
    n_experts: u64,
    checkpoint_bytes: u64,
}

/// Multiply-adds of one token through a weight: a matrix's elements (an MXFP4 `packed`
/// tensor holds two per byte; scales and 1-D gains add none).
fn macs_of(name: &str, shape: &[usize]) -> u64 {
    if shape.len() < 2 || name.ends_with("weight_scale") {
        return 0;
    }
    let n: u64 = shape.iter().map(|&d| d as u64).product();
    if name.ends_with("weight_packed") {
        2 * n
    } else {
        n
    }
}

impl Tally {
    /// One tensor outside the vision tower.
    fn add(&mut self, name: &str, shape: &[usize], len: u64) {
        let macs = macs_of(name, shape);
        match classify(name) {
            TensorClass::Vision => {}
            TensorClass::RoutedExpert => self.expert_macs_total += macs,
            _ if name == LM_HEAD => {
                self.lm_head_bytes += len;
                self.lm_head_macs += macs;
            }
            _ if name == k3_model::classify::model_tensor("embed_tokens.weight") => {
                let rows = shape.first().copied().unwrap_or(1).max(1) as u64;
                self.embed_row_bytes = len / rows;
            }
            _ if k3_model::classify::layer_of(name).is_some() => {
                self.trunk_bytes += len;
                self.trunk_macs += macs;
            }
            _ if name.starts_with("language_model.") => self.norms_bytes += len,
            _ => {}
        }
    }
}

impl ModelShape {
    /// The shape of a checkpoint directory, from its config and headers.
    pub fn from_dir(dir: &Path) -> Result<ModelShape, ProjectError> {
        let cfg = ModelConfig::load_dir(dir)?;
        let cat = Catalog::open(dir)?;
        let layers = cfg.num_hidden_layers;
        let sizes = crate::run::sizes::model_sizes(&cfg, &cat, layers);
        let mut t = Tally::default();
        for (name, e) in cat.iter() {
            t.add(&name, e.shape, e.len);
        }
        t.expert_span = sizes.max_expert_span;
        t.n_experts = sizes.n_experts;
        t.checkpoint_bytes = cat.shards().iter().map(|s| s.file_size).sum();
        let runs = crate::tools::inspect::packed_streams(&cat, Some(layers));
        Ok(ModelShape::of(&cfg, t, runs, dir.display().to_string()))
    }

    /// The released Kimi K3, from its tensor list and config (no files).
    pub fn released() -> ModelShape {
        use k3_model::released as r;
        let cfg = ModelConfig::from_json_str(crate::tools::synth::RELEASED_CONFIG)
            .expect("the released config parses (tested)");
        let mut t = Tally::default();
        let mut layers = Vec::with_capacity(r::N_LAYERS);
        let mut at = 0u64;
        for l in 0..r::N_LAYERS {
            let mut ts = r::layer_trunk_tensors(l);
            r::sort_in_file_order(&mut ts);
            let mut off = 0u64;
            let mut tensors = Vec::with_capacity(ts.len());
            for x in &ts {
                t.add(&x.name, &x.shape, x.bytes());
                tensors.push(TrunkTensor {
                    name: x.name.clone(),
                    dtype: x.dtype,
                    shape: x.shape.clone(),
                    offset: off,
                    len: x.bytes(),
                    crc32: Vec::new(),
                });
                off += x.bytes();
            }
            layers.push(packed_layer(l, at, off, tensors));
            at += align_up(off, TRUNK_ALIGN);
        }
        for x in r::model_tensors() {
            t.add(&x.name, &x.shape, x.bytes());
        }
        let one: Vec<_> = r::expert_tensors(1, 0);
        t.expert_span = one.iter().map(|x| x.bytes()).sum();
        t.n_experts = cfg.moe_layer_indices().len() as u64 * r::N_EXPERTS as u64;
        t.expert_macs_total =
            t.n_experts * one.iter().map(|x| macs_of(&x.name, &x.shape)).sum::<u64>();
        t.checkpoint_bytes = r::RELEASED_BYTES;
        let runs = Streams::of_layers(&layers);
        ModelShape::of(
            &cfg,
            t,
            runs,
            "the released Kimi K3 (its tensor list)".into(),
        )
    }

    /// The shape from a tally: the plan's inputs as `inspect`'s budget table makes them.
    fn of(cfg: &ModelConfig, t: Tally, runs: Streams, label: String) -> ModelShape {
        let layers = cfg.num_hidden_layers;
        let top_k = cfg.num_experts_per_token as u64;
        let (kda_state, kv_per_pos) = crate::run::sizes::state_bytes(cfg, layers);
        let fixed = t.embed_row_bytes.div_ceil(4096) * 4096
            + t.norms_bytes
            + kda_state
            + kv_per_pos * CONTEXT
            + plan::STAGE_PROCESSES as u64 * plan::STAGE_PROCESS_BYTES
            + plan::compute_scratch(cfg, 1);
        let spend = Spend {
            total: 0,
            fixed,
            trunk_need: runs.pinned_bytes(),
            lm_head: t.lm_head_bytes,
            lm_head_row: t.lm_head_bytes / (cfg.vocab_size as u64).max(1),
            expert_slot: slot_bytes_for(t.expert_span.max(1)),
            min_slots: plan::min_expert_slots(top_k),
            max_slots: t.n_experts.max(top_k),
            trunk_min: plan::trunk_min(&runs),
            read_slots: plan::read_slots(1),
            head_coded: None,
            head_raw_ppm: 1_000_000,
        };
        ModelShape {
            label,
            layers,
            moe_layers: cfg.moe_layer_indices().len() as u64,
            experts_per_layer: cfg.num_experts as u64,
            top_k,
            experts_mxfp4: matches!(cfg.expert_format(), ExpertFormat::Mxfp4 { .. }),
            checkpoint_bytes: t.checkpoint_bytes,
            trunk_bytes: t.trunk_bytes,
            trunk_macs: t.trunk_macs,
            lm_head_bytes: t.lm_head_bytes,
            lm_head_macs: t.lm_head_macs,
            embed_row_bytes: t.embed_row_bytes,
            expert_bytes: t.expert_span,
            expert_macs: t.expert_macs_total / t.n_experts.max(1),
            expert_dims: (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size),
            spend,
            runs,
            codec_ratio: None,
        }
    }

    /// The same model with its trunk coded at `ratio` (`inspect --codec-ratio`'s
    /// projection): every streamed unit reads `ratio` of its bytes and decodes them all,
    /// pinned units keep their decoded size, and the trunk-loader's decode buffers join
    /// what every run holds.
    pub fn with_codec_ratio(mut self, ratio: f64) -> ModelShape {
        self.runs = self.runs.with_read_ratio(ratio);
        self.spend.fixed +=
            k3_trunk_loader::loader::decode_buffer_bound(k3_model::trunk::CODEC_CHUNK);
        self.codec_ratio = Some(ratio);
        self
    }

    /// The same model with a coded trunk's resident layers held as `resident` says
    /// (`--trunk-resident`).
    pub fn with_resident(mut self, resident: k3_protocol::conf::TrunkResident) -> ModelShape {
        self.runs = self.runs.with_resident(resident);
        self
    }

    /// Every routed expert of the model.
    pub fn experts(&self) -> u64 {
        self.spend.max_slots
    }
}

/// One layer's run as `pack-trunk` lays it out (offset `at`, `len` payload bytes).
fn packed_layer(layer: usize, at: u64, len: u64, tensors: Vec<TrunkTensor>) -> TrunkLayer {
    TrunkLayer {
        layer,
        offset: at,
        length: len,
        padded_length: align_up(len, TRUNK_ALIGN),
        shard: String::new(),
        source_offset: 0,
        sha256: String::new(),
        crc32: Vec::new(),
        tensors,
    }
}

/// A machine's figures, each with where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    pub drives: u32,
    /// In how many drives each routed expert is (`pack-experts --copies`; at most `drives`
    /// counts).
    pub copies: u32,
    /// Every expert split over the drives, one part on each (`pack-experts --split`): each
    /// drive reads its share of every expert, so of every layer.
    pub split: bool,
    /// Bytes per second of one drive, read as the expert-fetcher reads (4 MiB pieces, 16
    /// in flight).
    pub drive_bps: f64,
    /// Bytes per second of one drive, read as the trunk-loader reads (8 MiB pieces, 8 in
    /// flight).
    pub trunk_drive_bps: f64,
    /// Drives the trunk's reads spread over: 1, the `--trunk` directory on a drive (the
    /// routed experts' drives do not read it), or N copies of it (`--trunk DIR,COPY,..`, or
    /// an md RAID 0 of N drives under it; `project --trunk-drives`).
    pub trunk_drives: u32,
    pub drive_source: String,
    /// Bytes per second k3's products stream bf16 weights from RAM (its GEMV over a matrix
    /// larger than the caches).
    pub mem_bps: f64,
    /// The same for MXFP4 weights (the routed experts).
    pub mxfp4_mem_bps: f64,
    pub mem_source: String,
    pub cores: usize,
    /// Multiply-adds per second of one core, through bf16 and MXFP4 weights.
    pub bf16_macs_per_core: f64,
    pub mxfp4_macs_per_core: f64,
    pub compute_source: String,
    /// Bytes per second of BF16 one core decodes from a coded trunk, and where from.
    pub decode_bps: f64,
    pub decode_source: String,
}

/// The machine the preset table and docs/run-k3.md project for when no machine is named:
/// one PCIe 4 NVMe drive (7 GB/s), 16 cores, 50 GB/s of memory bandwidth (a desktop or
/// small workstation with two to four DDR5 channels), 10 G multiply-adds per second per
/// core (AVX2/AVX-512 at 2-3 GHz; the decode kernels are far from compute-bound).
pub const REFERENCE: Machine = Machine {
    drives: 1,
    copies: 1,
    split: false,
    drive_bps: 7e9,
    trunk_drive_bps: 7e9,
    trunk_drives: 1,
    drive_source: String::new(),
    mem_bps: 50e9,
    mxfp4_mem_bps: 50e9,
    mem_source: String::new(),
    cores: 16,
    bf16_macs_per_core: 10e9,
    mxfp4_macs_per_core: 10e9,
    compute_source: String::new(),
    decode_bps: plan::ASSUMED_DECODE_BPS,
    decode_source: String::new(),
};

impl Machine {
    /// The reference machine with `drives` drives, its sources filled in.
    pub fn reference(drives: u32) -> Machine {
        Machine {
            drives,
            drive_source: "reference".into(),
            mem_source: "reference".into(),
            compute_source: "reference".into(),
            decode_source: "reference".into(),
            ..REFERENCE
        }
    }

    /// How a coded trunk's decoding is weighed against its reads on this machine, as a
    /// run's plan weighs it: the trunk's reads at its drives' trunk rate, the decoding at
    /// one core's rate on the cores compute leaves (a run's default compute takes them all,
    /// so one).
    pub fn decode_terms(&self) -> plan::DecodeTerms {
        plan::DecodeTerms {
            disk_bps: self.trunk_bps(),
            disk_source: self.drive_source.clone(),
            decode_bps: self.decode_bps,
            decode_source: self.decode_source.clone(),
            cores: self.cores,
            compute_threads: self.cores,
        }
    }

    /// The cores a coded trunk's decoding counts on here: those compute leaves, and a run's
    /// default compute takes them all (`k3_trunk_loader::decode_cores`), so one.
    pub fn decoders(&self) -> usize {
        k3_trunk_loader::decode_cores(self.cores, self.cores)
    }

    /// Bytes per second the trunk is read at: one drive's trunk rate on each of its drives.
    pub fn trunk_bps(&self) -> f64 {
        self.trunk_drives.max(1) as f64 * self.trunk_drive_bps
    }

    /// The copies of each expert that count: at most one per drive.
    pub fn copies_used(&self) -> u32 {
        self.copies.clamp(1, self.drives.max(1))
    }

    /// The busiest of `drives` drives' reads of a layer's `misses` (of `experts`) over an
    /// equal share: [`drive_balance`] for whole experts, 1 for split ones (each drive reads
    /// one part of each, the parts equal to a page).
    pub fn balance(&self, drives: u32, experts: u64, misses: f64) -> f64 {
        if self.split && drives > 1 {
            1.0
        } else {
            drive_balance(experts, misses, drives, self.copies)
        }
    }

    /// One line describing it.
    pub fn describe(&self) -> String {
        let on = match self.trunk_drives.max(1) {
            1 => "one drive".to_string(),
            n => format!("{n} drives"),
        };
        let trunk = if self.trunk_drive_bps == self.drive_bps {
            String::new()
        } else {
            format!(" (trunk reads {:.2} GB/s)", self.trunk_drive_bps / GB)
        };
        let mem = if self.mxfp4_mem_bps == self.mem_bps {
            format!("{:.1} GB/s", self.mem_bps / GB)
        } else {
            format!(
                "{:.1} / {:.1} GB/s bf16 / MXFP4",
                self.mem_bps / GB,
                self.mxfp4_mem_bps / GB
            )
        };
        format!(
            "{} drive{} x {:.2} GB/s{trunk} ({}), the trunk on {on}; memory {mem} ({}); {} cores \
             x {:.1} / {:.1} G MAC/s bf16 / MXFP4 ({})",
            self.drives,
            if self.drives == 1 { "" } else { "s" },
            self.drive_bps / GB,
            self.drive_source,
            self.mem_source,
            self.cores,
            self.bf16_macs_per_core / 1e9,
            self.mxfp4_macs_per_core / 1e9,
            self.compute_source
        )
    }
}

/// The expected share of routed-expert requests the cache serves under flat routing (every
/// expert equally likely, as K3's router is trained for): cache slots over experts, at most
/// all of them.
pub fn flat_hit_rate(cache_slots: u64, experts: u64) -> f64 {
    if experts == 0 {
        return 1.0;
    }
    (cache_slots as f64 / experts as f64).min(1.0)
}

/// What one decode token touches under a plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PerToken {
    /// Read from disk: the streamed trunk and lm_head, and the experts the cache misses.
    pub trunk_disk_bytes: f64,
    pub expert_disk_bytes: f64,
    /// Read from RAM: every weight the token multiplies (and its embedding row); of them,
    /// the MXFP4 ones (the routed experts of an MXFP4 checkpoint).
    pub ram_bytes: f64,
    pub ram_mxfp4_bytes: f64,
    /// Of the bf16 ones, those compute multiplies while the disk has nothing to read: the
    /// streamed trunk units when the ring holds one slot (the loader reads the next only
    /// once compute gives the slot back). 0 when the ring reads ahead.
    pub serial_ram_bytes: f64,
    pub bf16_macs: f64,
    pub mxfp4_macs: f64,
    /// Bytes a coded trunk's streamed parts decode (0: raw, or nothing streams).
    pub decode_bytes: f64,
    /// Bytes the coded lm_head decodes when it streams coded (on every core).
    pub head_decode_bytes: f64,
    /// The experts one MoE layer misses (its top-k less the cache's hits) and the routed
    /// experts a layer has: what [`stripe_balance`] needs (0 misses: not modelled).
    pub layer_misses: f64,
    pub layer_experts: u64,
}

impl PerToken {
    pub fn disk_bytes(&self) -> f64 {
        self.trunk_disk_bytes + self.expert_disk_bytes
    }
}

/// One token of `m` under plan `c`, the cache hitting `hit` of its expert requests.
pub fn per_token(m: &ModelShape, c: &Choice, hit: f64) -> PerToken {
    let routed = (m.moe_layers * m.top_k) as f64;
    let expert_macs = routed * m.expert_macs as f64;
    let (bf16_experts, mxfp4) = if m.experts_mxfp4 {
        (0.0, expert_macs)
    } else {
        (expert_macs, 0.0)
    };
    let expert_ram = routed * m.expert_bytes as f64;
    let head_decode = head_decode(m, c);
    PerToken {
        trunk_disk_bytes: c.read_per_token as f64,
        expert_disk_bytes: routed * (1.0 - hit) * m.expert_bytes as f64,
        ram_bytes: (m.trunk_bytes + m.lm_head_bytes + m.embed_row_bytes) as f64 + expert_ram,
        ram_mxfp4_bytes: if m.experts_mxfp4 { expert_ram } else { 0.0 },
        serial_ram_bytes: 0.0,
        bf16_macs: (m.trunk_macs + m.lm_head_macs) as f64 + bf16_experts,
        mxfp4_macs: mxfp4,
        decode_bytes: (c.decode_per_token - head_decode) as f64,
        head_decode_bytes: head_decode as f64,
        layer_misses: m.top_k as f64 * (1.0 - hit),
        layer_experts: m.experts_per_layer,
    }
}

/// How much longer one MoE layer's expert reads take over `drives` drives than if every
/// drive read an equal share: the expected largest number of the layer's `misses` (rounded,
/// at least 1) that fall on one drive, over `misses / drives`. `pack-experts` stripes a
/// layer's `experts` round-robin (drive sizes differ by at most one), routing is taken as
/// flat (every set of `misses` experts alike), and a layer's products wait for all of its
/// reads, so the busiest drive sets the layer's read time. 1 for one drive, no misses or
/// no experts. Exact: P(largest <= m) counts the sets with at most m on every drive (the
/// coefficient of x^k in the product over drives of sum_{j<=m} C(n_d, j) x^j) over
/// C(experts, k). The slice (64 experts, 16 misses, 2 drives): 9.36 / 8 = 1.17; the
/// released model (896, 16) over 4 drives: 1.53 (1.19 over 2, 2.09 over 8).
pub fn stripe_balance(experts: u64, misses: f64, drives: u32) -> f64 {
    let d = drives.max(1) as usize;
    let n = experts as usize;
    if d == 1 || n == 0 || misses <= 0.0 {
        return 1.0;
    }
    let k = (misses.round() as usize).clamp(1, n);
    let sizes: Vec<usize> = (0..d).map(|i| n / d + usize::from(i < n % d)).collect();
    let binom = |a: usize, b: usize| -> f64 {
        if b > a {
            return 0.0;
        }
        (0..b.min(a - b)).fold(1.0, |c, i| c * (a - i) as f64 / (i + 1) as f64)
    };
    let all = binom(n, k);
    // E[largest] = sum over m of P(largest > m).
    let mut expect = 0.0;
    for m in 0..k {
        let mut poly = vec![0.0f64; k + 1];
        poly[0] = 1.0;
        for &nd in &sizes {
            let mut next = vec![0.0f64; k + 1];
            for (i, &c) in poly.iter().enumerate().filter(|(_, c)| **c != 0.0) {
                for j in 0..=m.min(nd).min(k - i) {
                    next[i + j] += c * binom(nd, j);
                }
            }
            poly = next;
        }
        expect += 1.0 - poly[k] / all;
    }
    expect / (k as f64 / d as f64)
}

/// [`stripe_balance`] for a pack holding each expert on `copies` of the `drives` drives
/// (`pack-experts --copies`, laid out by `k3_model::experts::stripe_copies`), the misses'
/// copies chosen as the fetcher chooses them (`k3_expert_fetcher::devices::assign_copies`:
/// the least busy drive read by read, then moves until the busiest is as low as it can be):
/// the expected busiest drive's reads over an equal share, estimated over
/// [`BALANCE_TRIALS`] layers of `misses` experts drawn flat with a fixed seed, so the same
/// arguments always give the same figure. One copy is [`stripe_balance`], exact. With
/// every expert on every drive a layer's reads differ by at most one between drives: 16
/// misses over 2 drives give exactly 1.
pub fn drive_balance(experts: u64, misses: f64, drives: u32, copies: u32) -> f64 {
    use k3_model::experts::{stripe_copies, ExpertRun, EXPERTS_ALIGN};
    use rand::SeedableRng;
    let d = drives.max(1) as usize;
    let c = (copies as usize).clamp(1, d);
    let n = experts as usize;
    if c == 1 || n == 0 || misses <= 0.0 {
        return stripe_balance(experts, misses, drives);
    }
    let k = (misses.round() as usize).clamp(1, n);
    let runs: Vec<ExpertRun> = (0..n)
        .map(|expert| ExpertRun {
            layer: 0,
            expert,
            shard: 0,
            source_offset: 0,
            length: EXPERTS_ALIGN,
        })
        .collect();
    let mut holders = vec![Vec::new(); n];
    for (dir, idx) in stripe_copies(&runs, d, c).into_iter().enumerate() {
        for i in idx {
            holders[i].push(dir);
        }
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x6b33_6472_6976_6573);
    let mut busiest = 0u64;
    let unit = vec![1u64; k];
    for _ in 0..BALANCE_TRIALS {
        let mut load = vec![0u64; d];
        let on: Vec<Vec<usize>> = (rand::seq::index::sample(&mut rng, n, k).iter())
            .map(|i| holders[i].clone())
            .collect();
        k3_expert_fetcher::devices::assign_copies(&on, &unit, &mut load);
        busiest += load.iter().copied().max().unwrap_or(0);
    }
    busiest as f64 / BALANCE_TRIALS as f64 / (k as f64 / d as f64)
}

/// Layers [`drive_balance`] draws (its estimate's standard error is under 0.5% at 4000).
pub const BALANCE_TRIALS: u32 = 4000;

/// Bytes the lm_head decodes per token under `c`: its streamed rows when read coded.
fn head_decode(m: &ModelShape, c: &Choice) -> u64 {
    if c.head_coded {
        m.spend.lm_head.saturating_sub(c.head_held)
    } else {
        0
    }
}

/// Seconds per token each resource needs on its own, and the parts the pipeline cannot
/// overlap.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Times {
    /// The disk's busy time: trunk and lm_head reads, and expert reads, over every drive.
    pub disk: f64,
    /// Of it, the expert reads: asked for after the router, waited for by the products; over
    /// several drives, the busiest drive's share of each layer ([`drive_balance`]).
    pub expert_disk: f64,
    /// That busiest drive's reads over an equal share (1 on one drive).
    pub balance: f64,
    /// The products streaming their weights from RAM at the rates k3's GEMV reaches.
    pub memory: f64,
    /// The multiply-adds at the cache-resident rate.
    pub compute: f64,
    /// The compute the disk idles through (`PerToken::serial_ram_bytes`' products).
    pub exposed: f64,
    /// A coded trunk's decoding: its bytes at one core's rate on the cores compute leaves
    /// (`k3_trunk_loader::decode_cores`; compute runs on every core, so one), and the coded
    /// lm_head's on every core (compute waits for it), on the compute side.
    pub decode: f64,
}

impl Times {
    /// The resources' times for `t` on `m`: trunk bytes over the trunk's drives' trunk-read
    /// rate ([`Machine::trunk_bps`]) and expert bytes over the expert drives' expert-read
    /// rate; bf16 and MXFP4 RAM bytes over the products' rates; MACs over every core's
    /// rate; the serial products' share of the compute.
    pub fn of(t: &PerToken, m: &Machine) -> Times {
        let cores = m.cores.max(1) as f64;
        let drives = m.drives.max(1) as f64;
        let balance = m.balance(m.drives, t.layer_experts, t.layer_misses);
        let expert_disk = t.expert_disk_bytes * balance / (drives * m.drive_bps);
        let memory =
            (t.ram_bytes - t.ram_mxfp4_bytes) / m.mem_bps + t.ram_mxfp4_bytes / m.mxfp4_mem_bps;
        let compute = t.bf16_macs / (cores * m.bf16_macs_per_core)
            + t.mxfp4_macs / (cores * m.mxfp4_macs_per_core);
        let share = if t.ram_bytes > 0.0 {
            (t.serial_ram_bytes / t.ram_bytes).min(1.0)
        } else {
            0.0
        };
        Times {
            disk: t.trunk_disk_bytes / m.trunk_bps() + expert_disk,
            expert_disk,
            balance,
            memory,
            compute,
            exposed: share * memory.max(compute),
            decode: if t.decode_bytes + t.head_decode_bytes > 0.0 {
                t.decode_bytes / (m.decoders() as f64 * m.decode_bps)
                    + t.head_decode_bytes / (cores * m.decode_bps)
            } else {
                0.0
            },
        }
    }

    /// The compute side: the products, or the MACs where those are slower.
    pub fn cpu(&self) -> f64 {
        self.memory.max(self.compute)
    }

    /// The projected seconds per token, as the pipeline overlaps the terms (see the module
    /// documentation): the larger of the disk's time plus the compute it idles through,
    /// and the compute (with a coded trunk's decoding, which takes the same cores) plus the
    /// expert reads it waits for.
    pub fn s_per_token(&self) -> f64 {
        (self.disk + self.exposed).max(self.cpu() + self.decode + self.expert_disk)
    }

    /// The resource that sets it: the disk when its side is the larger, else the slower
    /// of memory and compute (named "disk" too when the expert reads outweigh both).
    pub fn floor(&self) -> &'static str {
        if self.disk + self.exposed >= self.cpu() + self.decode + self.expert_disk
            || self.expert_disk > self.cpu() + self.decode
        {
            "disk"
        } else if self.decode > self.cpu() {
            "decode"
        } else if self.memory >= self.compute {
            "memory"
        } else {
            "compute"
        }
    }

    /// The formula with its terms, for the output.
    pub fn explain(&self) -> String {
        let decode = if self.decode > 0.0 {
            format!(" + trunk decoding {}", duration(self.decode))
        } else {
            String::new()
        };
        format!(
            "max(disk {} + compute it idles through {}, products {} (memory {}, MACs {}){decode} + \
             expert reads after the router {})",
            duration(self.disk),
            duration(self.exposed),
            duration(self.cpu()),
            duration(self.memory),
            duration(self.compute),
            duration(self.expert_disk)
        )
    }
}

/// The projection of one budget on one machine.
#[derive(Clone, Debug)]
pub struct Projection {
    /// The budget (`--mem-gb`) and what the plan spends (less the run's reserve).
    pub budget: u64,
    pub total: u64,
    pub choice: Choice,
    /// Arena bytes the trunk's plan allocates (its pinned units and ring slots: what the
    /// trunk's share holds, the rest of which went to lm_head rows or the cache).
    pub trunk_bytes: u64,
    /// "12/373 parts", "93/93 layers".
    pub pinned: String,
    pub cache_slots: u64,
    pub hit: f64,
    pub per_token: PerToken,
    pub times: Times,
}

impl Projection {
    /// What the plan holds: everything it adds up, as a run's memory plan does (fixed,
    /// lm_head or its buffers and held rows' arena, the trunk's plan, cache).
    pub fn held_bytes(&self, m: &ModelShape) -> u64 {
        let head = if self.choice.head_pinned {
            m.spend.lm_head
        } else {
            let row = m.spend.lm_head_row.max(1);
            let rows = self.choice.head_held / row;
            let held = if rows == 0 {
                0
            } else {
                plan::held_rows_bytes(rows, row)
            };
            plan::lm_head_stream_bytes(m.spend.lm_head) + held
        };
        m.spend.fixed + head + self.trunk_bytes + self.choice.cache
    }
}

/// Project `m` at a budget of `budget` bytes (as `--mem-gb`: the plan spends it less the
/// run's reserve) on `machine`; Err when the plan refuses the budget.
pub fn project(m: &ModelShape, budget: u64, machine: &Machine) -> Result<Projection, ProjectError> {
    project_hits(m, budget, machine, &Hits::Flat)
}

/// [`project`] with the hit rate from `hits`.
pub fn project_hits(
    m: &ModelShape,
    budget: u64,
    machine: &Machine,
    hits: &Hits,
) -> Result<Projection, ProjectError> {
    let total = budget - (budget as f64 * plan::RESERVE_SHARE) as u64;
    project_parts(m, budget, total, None, machine, hits)
}

/// Project `m` with explicit trunk and cache budgets (a preset) on `machine`.
pub fn project_preset(
    m: &ModelShape,
    trunk: u64,
    cache: u64,
    machine: &Machine,
) -> Result<Projection, ProjectError> {
    let total = m.spend.fixed + m.spend.lm_head + trunk + cache;
    project_parts(m, total, total, Some((trunk, cache)), machine, &Hits::Flat)
}

fn project_parts(
    m: &ModelShape,
    budget: u64,
    total: u64,
    parts: Option<(u64, u64)>,
    machine: &Machine,
    hits: &Hits,
) -> Result<Projection, ProjectError> {
    // Experts striped over the machine's drives: the cache keeps every drive's reads in
    // flight, as a run's plan does.
    // A coded trunk's lm_head coded at the same ratio (`pack-trunk --codec` codes it).
    let head_coded = m.codec_ratio.map(|r| {
        let ppm = machine.decode_terms().head_ppm();
        plan::HeadCoding::projected(m.spend.lm_head, m.spend.lm_head_row, r, ppm)
    });
    let sp = Spend {
        total,
        read_slots: plan::read_slots(machine.drives as usize),
        head_coded,
        ..m.spend.clone()
    };
    // A coded trunk's decoding weighed as this machine's reads, as a run's plan weighs it.
    let runs = match m.codec_ratio {
        Some(_) => m
            .runs
            .clone()
            .with_decode_weight(machine.decode_terms().ppm()),
        None => m.runs.clone(),
    };
    let c = choose(&sp, Some(&runs), parts.map(|p| p.0), parts.map(|p| p.1))?;
    let sp = plan_streams_with(c.trunk, &runs, RingPolicy::default(), c.sink)?;
    let pinned = format!(
        "{}/{} {}{}",
        sp.plan.pinned,
        sp.plan.layers,
        if sp.parts { "parts" } else { "layers" },
        crate::tools::inspect::kept_suffix(sp.plan.kept)
    );
    let cache_slots = (c.cache / m.spend.expert_slot.max(1)).min(m.experts());
    let hit = hits.rate(cache_slots, m.experts());
    let mut pt = per_token(m, &c, hit);
    // A ring of one slot: the loader reads the next streamed unit only once compute gives
    // the slot back, so the products over the streamed units run with the disk idle.
    if sp.plan.ring_slots <= 1 {
        pt.serial_ram_bytes = sp.read_per_token as f64;
    }
    Ok(Projection {
        budget,
        total,
        choice: c,
        trunk_bytes: sp.plan.bytes(),
        pinned,
        cache_slots,
        hit,
        per_token: pt,
        times: Times::of(&pt, machine),
    })
}

/// Seconds as people read them: `12 ms`, `0.84 s`, `12.3 s`, `4.1 min`, `3.2 h`.
pub fn duration(s: f64) -> String {
    if s < 0.1 {
        format!("{:.0} ms", s * 1e3)
    } else if s < 10.0 {
        format!("{s:.2} s")
    } else if s < 120.0 {
        format!("{s:.1} s")
    } else if s < 7200.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

/// The plan and the per-token figures of one projection, as `project` prints them.
pub fn detail(
    m: &ModelShape,
    p: &Projection,
    machine: &Machine,
    reply: u64,
    hits: &Hits,
) -> String {
    let pt = &p.per_token;
    let t = &p.times;
    let mut o = format!(
        "plan at --mem-gb {:.1} ({} spent after the 5% reserve):\n",
        p.budget as f64 / GB,
        human(p.total)
    );
    o += &format!(
        "  pinned   : {} of the trunk ({}), lm_head {}\n",
        p.pinned,
        human(p.choice.trunk),
        if p.choice.head_pinned {
            "pinned".to_string()
        } else if p.choice.head_held > 0 {
            format!("streamed, {} of it held", human(p.choice.head_held))
        } else {
            "streamed".to_string()
        }
    );
    o += &format!(
        "  streamed : {} of trunk and lm_head read per token\n",
        human(p.choice.read_per_token)
    );
    o += &format!(
        "  cached   : {} expert slots of {} experts: expected hit rate {:.2}% ({})\n",
        p.cache_slots,
        m.experts(),
        100.0 * p.hit,
        hits.label()
    );
    o += &format!("  holds    : {}\n", human(p.held_bytes(m)));
    o += "per token:\n";
    let drives = machine.drives as f64;
    o += &format!(
        "  disk     : {} trunk/lm_head at {:.2} GB/s + {} experts missed at {:.2} GB/s = {} \
         in {}\n",
        human(pt.trunk_disk_bytes as u64),
        machine.trunk_bps() / GB,
        human(pt.expert_disk_bytes as u64),
        drives * machine.drive_bps / GB,
        human(pt.disk_bytes() as u64),
        duration(t.disk)
    );
    if machine.drives > 1 {
        o += &format!(
            "  stripes  : a layer's {:.0} expert reads over {} drives: the busiest reads {:.2}x \
             an equal share ({}, flat routing), counted in the experts' time\n",
            pt.layer_misses.round().max(1.0),
            machine.drives,
            t.balance,
            layout(machine)
        );
    }
    o += &format!(
        "  memory   : {} of weights read from RAM ({} MXFP4) at {:.1} / {:.1} GB/s = {}\n",
        human(pt.ram_bytes as u64),
        human(pt.ram_mxfp4_bytes as u64),
        machine.mem_bps / GB,
        machine.mxfp4_mem_bps / GB,
        duration(t.memory)
    );
    o += &format!(
        "  compute  : {:.1} G multiply-adds on {} cores = {}\n",
        (pt.bf16_macs + pt.mxfp4_macs) / 1e9,
        machine.cores,
        duration(t.compute)
    );
    o += &format!(
        "  serial   : {} of streamed trunk multiplied with the disk idle (a one-slot ring) = {}\n",
        human(pt.serial_ram_bytes as u64),
        duration(t.exposed)
    );
    if m.codec_ratio.is_some() {
        o += &format!(
            "  decode   : {} of coded trunk decoded by the trunk-loader's readers at {:.2} GB/s \
             per core x {} core(s) compute leaves, and {} of coded lm_head on all {} = {} (on \
             compute's side); the plan: {}\n",
            human(pt.decode_bytes as u64),
            machine.decode_bps / GB,
            machine.decoders(),
            human(pt.head_decode_bytes as u64),
            machine.cores,
            duration(t.decode),
            machine.decode_terms().describe()
        );
    }
    o += &format!("  model    : s/token = {}\n", t.explain());
    o += &format!(
        "projected: {} per token, {}-bound; a {reply}-token reply in {} (a projection, not a measurement)\n",
        duration(t.s_per_token()),
        t.floor(),
        duration(t.s_per_token() * reply as f64)
    );
    o
}

/// The table of several budgets × drive counts.
pub fn table(m: &ModelShape, budgets: &[u64], machines: &[Machine], hits: &Hits) -> String {
    let coded = m.codec_ratio.is_some();
    let mut o = format!(
        "  {:>8}  {:>6}  {:>14}  {:>9}  {:>12}  {:>8}  {:>8}  {:>8}  {:>10}  {}{}\n",
        "--mem-gb",
        "drives",
        "trunk pinned",
        "hit rate",
        "disk/token",
        "disk s",
        "memory s",
        "compute",
        "s/token",
        "floor",
        if coded {
            "   lm_head   decoded/token  decode s"
        } else {
            ""
        }
    );
    for &b in budgets {
        for mach in machines {
            match project_hits(m, b, mach, hits) {
                Ok(p) => {
                    o += &format!(
                        "  {:>8.1}  {:>6}  {:>14}  {:>8.2}%  {:>12}  {:>8.2}  {:>8.2}  {:>8.2}  {:>10.2}  {:<6}",
                        b as f64 / GB,
                        mach.drives,
                        p.pinned,
                        100.0 * p.hit,
                        human(p.per_token.disk_bytes() as u64),
                        p.times.disk,
                        p.times.memory,
                        p.times.compute,
                        p.times.s_per_token(),
                        p.times.floor()
                    );
                    if coded {
                        o += &format!(
                            "  {:>8}  {:>14}  {:>8.2}",
                            if p.choice.head_pinned {
                                "pinned"
                            } else {
                                "streamed"
                            },
                            human(p.per_token.decode_bytes as u64),
                            p.times.decode
                        );
                    }
                    o = o.trim_end().to_string() + "\n";
                }
                Err(e) => {
                    o += &format!(
                        "  {:>8.1}  {:>6}  refused: {e}\n",
                        b as f64 / GB,
                        mach.drives
                    )
                }
            }
        }
    }
    o
}

/// The `--list-presets` text: each preset's budgets, what k3's plan holds with them and its
/// projected s/token for the released model on the [`REFERENCE`] machine.
pub fn presets_text() -> String {
    let presets = k3_trunk_loader::Presets::builtin();
    let m = ModelShape::released();
    let mach = Machine::reference(1);
    let mut s = String::from(
        "presets (trunk / expert-cache budgets in GB), with what k3's plan holds for the released\n\
         model and its PROJECTED s/token on a reference machine (k3-orch project; not measured):\n",
    );
    s += &format!("  reference machine: {}\n", mach.describe());
    for p in &presets.presets {
        let b = p.budgets();
        let what = match project_preset(&m, b.trunk_bytes, b.cache_bytes, &mach) {
            Ok(x) => format!(
                "holds {:>9}, reads {:>9}/token, ~{} s/token ({}-bound)",
                human(x.held_bytes(&m)),
                human(x.per_token.disk_bytes() as u64),
                round_s(x.times.s_per_token()),
                x.times.floor()
            ),
            Err(e) => format!("refused: {e}"),
        };
        s += &format!(
            "  {:<12} {:>6.1} / {:>6.1}  {what}\n               {}\n",
            p.name, p.trunk_gb, p.cache_gb, p.description
        );
    }
    s += "  auto           from MemAvailable: the trunk first until fully pinned, then the cache\n";
    s += &format!("\n{}\n", presets.note);
    s += "`k3-orch doctor MODEL_DIR` projects for this machine; `k3-orch project --ram-gb X` for any budget.\n";
    s
}

/// Bytes in TB from a TB up, else as [`human`].
fn size(b: u64) -> String {
    if b as f64 >= 1e12 {
        format!("{:.2} TB", b as f64 / 1e12)
    } else {
        human(b)
    }
}

/// Seconds rounded for a table: one decimal under 10, whole above.
fn round_s(s: f64) -> String {
    if s < 10.0 {
        format!("{s:.1}")
    } else {
        format!("{s:.0}")
    }
}

pub fn main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    if let Err(e) = check_args(&a) {
        tracing::error!("k3-orch project: {e}");
        return 2;
    }
    let shape = match &a.model_dir {
        Some(d) => match ModelShape::from_dir(d) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("k3-orch project: {}: {e}", d.display());
                return 2;
            }
        },
        None => ModelShape::released(),
    };
    let shape = match a.codec_ratio {
        Some(r) => shape.with_codec_ratio(r).with_resident(a.trunk_resident),
        None => shape,
    };
    let budgets = match budgets(&a) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!("k3-orch project: {e}");
            return 2;
        }
    };
    let hits = match &a.trace {
        Some(t) => match Hits::from_trace(t) {
            Ok(h) => h,
            Err(e) => {
                tracing::error!("k3-orch project: --trace {e}");
                return 2;
            }
        },
        None => Hits::Flat,
    };
    let probe = a
        .probe_file
        .clone()
        .or_else(|| a.model_dir.as_deref().and_then(largest_data_file));
    let machine = measure_machine(
        &shape,
        &MachineFlags {
            drives: 1,
            copies: 1,
            split: false,
            drive_gbps: a.drive_gbps,
            probe: probe.as_deref(),
            mem_gbps: a.mem_gbps,
            cores: a.cores,
            gmacs_per_core: a.gmacs_per_core,
            seconds: a.seconds,
        },
    );
    let mut machine = Machine {
        trunk_drives: a.trunk_drives,
        ..machine
    };
    if a.codec_ratio.is_some() {
        (machine.decode_bps, machine.decode_source) = match a.decode_gbps {
            Some(g) => (g * GB, "given".to_string()),
            None => (
                measure_decode(),
                "measured: Gaussian BF16 coded at level 1, one core".to_string(),
            ),
        };
    }
    let (mut machine, drives) = match (a.experts.is_empty() || a.drive_gbps.is_some(), a.drives) {
        (true, drives) => (machine, drives),
        (false, drives) => {
            let (m, n) = with_expert_drives(machine, &a.experts, &shape, a.seconds);
            (m, if drives.is_empty() { vec![n] } else { drives })
        }
    };
    let (copies, split) = pack_layout(&a.experts);
    machine.copies = a.copies.unwrap_or(copies);
    machine.split = a.split || split;
    if a.json {
        print!("{}", json_rows(&shape, &budgets, &drives, &machine, &hits));
    } else {
        print!(
            "{}",
            report(&shape, &budgets, &drives, &machine, a.reply, &hits)
        );
    }
    0
}

/// `--experts DIR,..`: each drive the directories' `experts.bin` sit on (a drive counted
/// once, however many directories it holds) measured as the fetcher reads it; the machine
/// with one drive's share of their sum (so `drives` of them read the sum) and how many
/// drives were measured. A drive that cannot be measured with O_DIRECT adds nothing; when
/// none can, the machine is left as it was (its drive figure says where it came from).
pub fn with_expert_drives(
    machine: Machine,
    dirs: &[PathBuf],
    shape: &ModelShape,
    seconds: f64,
) -> (Machine, u32) {
    let mut seen: Vec<k3_expert_fetcher::devices::DevNum> = Vec::new();
    let mut files = Vec::new();
    for d in dirs {
        let f = d.join(k3_model::experts::EXPERTS_BIN);
        match k3_expert_fetcher::devices::device_of(&f) {
            Some(dev) if seen.contains(&dev) => {}
            Some(dev) => {
                seen.push(dev);
                files.push(f);
            }
            None => files.push(f),
        }
    }
    let read = EXPERT_READ.0.min(shape.expert_bytes).max(1 << 20);
    let (mut sum, mut n, mut why) = (0.0, 0u32, Vec::new());
    for f in &files {
        match measure_drive(f, read, EXPERT_READ.1, seconds) {
            Ok(bps) => {
                sum += bps;
                n += 1;
            }
            Err(e) => why.push(e.to_string()),
        }
    }
    if n == 0 {
        let mut m = machine;
        m.drive_source = format!(
            "{}; --experts not measured: {}",
            m.drive_source,
            why.join("; ")
        );
        return (m, 1);
    }
    let source = format!(
        "measured: devbw on the experts of {n} drive{} as the fetcher reads ({:.1} MiB x QD{}), \
         {:.2} GB/s together{}",
        if n == 1 { "" } else { "s" },
        read as f64 / (1u64 << 20) as f64,
        EXPERT_READ.1,
        sum / GB,
        if why.is_empty() {
            String::new()
        } else {
            format!(" ({} not measured: {})", why.len(), why.join("; "))
        }
    );
    let m = Machine {
        drive_bps: sum / n as f64,
        drive_source: format!("{source}; trunk: {}", machine.drive_source),
        ..machine
    };
    (m, n)
}

/// How the pack in `dirs` lays the experts over its directories, from one reading of its
/// manifests: the copies of each expert, and whether each is split over them (1 and false
/// for no directories, or a pack that does not open: the run refuses it, naming why).
pub fn pack_layout(dirs: &[PathBuf]) -> (u32, bool) {
    if dirs.is_empty() {
        return (1, false);
    }
    k3_model::experts::PackedExperts::open(dirs)
        .map_or((1, false), |p| (p.copies() as u32, p.split()))
}

/// The machines of `--drives` (one drive when none is given).
fn with_drives(drives: &[u32], machine: &Machine) -> Vec<Machine> {
    let drives: &[u32] = if drives.is_empty() { &[1] } else { drives };
    drives
        .iter()
        .map(|&d| Machine {
            drives: d,
            ..machine.clone()
        })
        .collect()
}

/// `--json`: one line per budget and drive count, for scripts (`bench-project.sh`).
fn json_rows(
    shape: &ModelShape,
    budgets: &[u64],
    drives: &[u32],
    machine: &Machine,
    hits: &Hits,
) -> String {
    let mut o = String::new();
    for &b in budgets {
        for mach in with_drives(drives, machine) {
            let v = match project_hits(shape, b, &mach, hits) {
                Ok(p) => serde_json::json!({
                    "mem_gb": b as f64 / GB,
                    "drives": mach.drives,
                    "copies": mach.copies_used(),
                    "drive_gbps": mach.drive_bps / GB,
                    "pinned": p.pinned,
                    "cache_slots": p.cache_slots,
                    "hit_rate": p.hit,
                    "hits_from": hits.label(),
                    "disk_bytes_per_token": p.per_token.disk_bytes(),
                    "trunk_disk_bytes_per_token": p.per_token.trunk_disk_bytes,
                    "head_decode_bytes_per_token": p.per_token.head_decode_bytes,
                    "expert_disk_bytes_per_token": p.per_token.expert_disk_bytes,
                    "ram_bytes_per_token": p.per_token.ram_bytes,
                    "disk_s": p.times.disk,
                    "expert_disk_s": p.times.expert_disk,
                    "stripe_balance": p.times.balance,
                    "memory_s": p.times.memory,
                    "compute_s": p.times.compute,
                    "exposed_s": p.times.exposed,
                    "decode_bytes_per_token": p.per_token.decode_bytes,
                    "decode_s": p.times.decode,
                    "head_pinned": p.choice.head_pinned,
                    "model": p.times.explain(),
                    "trunk_drive_gbps": mach.trunk_drive_bps / GB,
                    "trunk_drives": mach.trunk_drives,
                    "s_per_token": p.times.s_per_token(),
                    "floor": p.times.floor(),
                    "machine": mach.describe(),
                }),
                Err(e) => serde_json::json!({
                    "mem_gb": b as f64 / GB,
                    "drives": mach.drives,
                    "refused": e.to_string(),
                }),
            };
            o += &format!("{v}\n");
        }
    }
    o
}

/// The whole output of `project`.
fn report(
    shape: &ModelShape,
    budgets: &[u64],
    drives: &[u32],
    machine: &Machine,
    reply: u64,
    hits: &Hits,
) -> String {
    let mut o = String::from(
        "k3-orch project: a PROJECTION from the model's headers and the machine's figures, \
         not a measurement\n",
    );
    o += &format!(
        "model   : {} ({} layers, {} MoE x {} experts, top-{}; checkpoint {}; trunk {}; one expert {})\n",
        shape.label,
        shape.layers,
        shape.moe_layers,
        shape.experts_per_layer,
        shape.top_k,
        size(shape.checkpoint_bytes),
        human(shape.trunk_bytes),
        human(shape.expert_bytes)
    );
    o += &format!("machine : {}\n", machine.describe());
    if let Some(r) = shape.codec_ratio {
        o += &format!(
            "codec   : a coded trunk storing {r} of its bytes; decoding {:.2} GB/s per core ({})\n",
            machine.decode_bps / GB,
            machine.decode_source
        );
    }
    let machines = with_drives(drives, machine);
    if budgets.len() == 1 && machines.len() == 1 {
        match project_hits(shape, budgets[0], &machines[0], hits) {
            Ok(p) => o += &detail(shape, &p, &machines[0], reply, hits),
            Err(e) => o += &format!("refused at --mem-gb {:.1}: {e}\n", budgets[0] as f64 / GB),
        }
    } else {
        o += &format!("expected hit rate from: {}\n", hits.label());
        o += &table(shape, budgets, &machines, hits);
    }
    if machines.iter().any(|m| m.drives > 1) {
        let packed = match machine.copies {
            _ if machine.split => "split over them (pack-experts --split --to DIR,..".to_string(),
            1 => "striped over them (pack-experts --to DIR,..".to_string(),
            c => format!("on {c} of them each (pack-experts --copies {c} --to DIR,.."),
        };
        o += &format!(
            "note    : more than one drive assumes the experts {packed} and a run's --experts \
             DIR,..), read at their summed bandwidth; a layer's reads take as long as its \
             busiest drive's (flat routing, every expert of a layer's top-"
        );
        o += &format!("{} missed: ", shape.top_k);
        let counts: std::collections::BTreeSet<u32> = machines
            .iter()
            .map(|m| m.drives)
            .filter(|&d| d > 1)
            .collect();
        let shares: Vec<String> = counts
            .iter()
            .map(|&d| {
                let (e, k) = (shape.experts_per_layer, shape.top_k as f64);
                let b = machine.balance(d, e, k);
                format!("{b:.2}x an equal share over {d} drives")
            })
            .collect();
        o += &format!("{})\n", shares.join(", "));
    }
    o
}

/// How the experts lie over the drives, for the stripes line.
fn layout(m: &Machine) -> String {
    if m.split {
        return "every expert split, one part a drive".into();
    }
    match m.copies_used() {
        1 => "round-robin stripes".into(),
        c => format!("{c} copies of each expert, each read from the least busy"),
    }
}

/// Usage errors the parser cannot see.
fn check_args(a: &Args) -> Result<(), String> {
    let positive = |x: Option<f64>, flag: &str| match x {
        Some(v) if !(v.is_finite() && v > 0.0) => Err(format!("{flag} {v}: must be > 0")),
        _ => Ok(()),
    };
    positive(a.drive_gbps, "--drive-gbps")?;
    positive(a.mem_gbps, "--mem-gbps")?;
    positive(a.gmacs_per_core, "--gmacs-per-core")?;
    positive(a.decode_gbps, "--decode-gbps")?;
    if a.ram_gb.iter().any(|g| !(g.is_finite() && *g > 0.0)) {
        return Err("--ram-gb: every value must be > 0".into());
    }
    if a.drives.contains(&0) {
        return Err("--drives: at least 1".into());
    }
    if a.cores == Some(0) {
        return Err("--cores: at least 1".into());
    }
    if let Some(p) = &a.probe_file {
        if !p.is_file() {
            return Err(format!("--probe-file {}: not a file", p.display()));
        }
    }
    for d in &a.experts {
        if !d.join(k3_model::experts::EXPERTS_BIN).is_file() {
            return Err(format!(
                "--experts {}: no {} there (pack-experts --to DIR writes it)",
                d.display(),
                k3_model::experts::EXPERTS_BIN
            ));
        }
    }
    Ok(())
}

/// The budgets to project: `--ram-gb`, or this machine's default total.
fn budgets(a: &Args) -> Result<Vec<u64>, plan::BudgetError> {
    if !a.ram_gb.is_empty() {
        return Ok(a.ram_gb.iter().map(|g| (g * GB) as u64).collect());
    }
    let (_, avail) = plan::default_total()?;
    Ok(vec![avail])
}

/// The largest shard of a model directory that holds data (a header-only file is sparse:
/// reading it measures nothing).
pub fn largest_data_file(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.ends_with(".safetensors") || n == "trunk.bin"
        })
        .filter_map(|e| e.metadata().ok().map(|m| (e.path(), m)))
        .filter(|(_, m)| m.is_file() && m.blocks() * 512 >= m.len() / 2)
        .max_by_key(|(_, m)| m.len())
        .map(|(p, _)| p)
}

/// What the machine's figures come from: given values, else measured here.
pub struct MachineFlags<'a> {
    pub drives: u32,
    /// Copies of each routed expert over the drives (`pack-experts --copies`).
    pub copies: u32,
    /// Every routed expert split over the drives (`pack-experts --split`).
    pub split: bool,
    pub drive_gbps: Option<f64>,
    /// A file on the drive to measure.
    pub probe: Option<&'a Path>,
    pub mem_gbps: Option<f64>,
    pub cores: Option<usize>,
    pub gmacs_per_core: Option<f64>,
    pub seconds: f64,
}

/// The machine: each figure given, or measured here (the drive on `probe`, reads of one of
/// `shape`'s experts), or for a drive that cannot be measured the reference's, said so.
pub fn measure_machine(shape: &ModelShape, f: &MachineFlags) -> Machine {
    let here = std::thread::available_parallelism().map_or(1, |n| n.get());
    // A smaller expert is read in one piece (devbw reads at least 1 MiB).
    let expert_read = EXPERT_READ.0.min(shape.expert_bytes).max(1 << 20);
    let (drive_bps, trunk_drive_bps, drive_source) = match (f.drive_gbps, f.probe) {
        (Some(g), _) => (g * GB, g * GB, "given".to_string()),
        (None, Some(p)) => match measure_drives(p, expert_read, f.seconds) {
            Ok((e, t)) => (
                e,
                t,
                format!(
                    "measured: devbw on {}, as the fetcher reads ({:.1} MiB x QD{}) and as the \
                     trunk-loader reads ({} MiB x QD{})",
                    p.display(),
                    expert_read as f64 / (1u64 << 20) as f64,
                    EXPERT_READ.1,
                    TRUNK_READ.0 >> 20,
                    TRUNK_READ.1
                ),
            ),
            Err(e) => (
                REFERENCE.drive_bps,
                REFERENCE.trunk_drive_bps,
                format!("ASSUMED: {e}"),
            ),
        },
        (None, None) => (
            REFERENCE.drive_bps,
            REFERENCE.trunk_drive_bps,
            "ASSUMED: no file with data to measure (give --drive-gbps)".into(),
        ),
    };
    let (mem_bps, mxfp4_mem_bps, mem_source) = match f.mem_gbps {
        Some(g) => (g * GB, g * GB, "given".to_string()),
        None => {
            let (b, x) = measure_products(here, shape.expert_dims);
            (
                b,
                x,
                format!(
                    "measured: k3's GEMV over weights larger than the caches, the experts at \
                     their shape side by side, {here} threads"
                ),
            )
        }
    };
    let (bf16, mxfp4, compute_source) = match f.gmacs_per_core {
        Some(g) => (g * 1e9, g * 1e9, "given".to_string()),
        None => {
            let (b, x) = measure_compute(here);
            (b, x, format!("measured: k3's GEMV on {here} threads"))
        }
    };
    Machine {
        drives: f.drives,
        copies: f.copies.max(1),
        split: f.split,
        drive_bps,
        trunk_drive_bps,
        trunk_drives: 1,
        drive_source,
        mem_bps,
        mxfp4_mem_bps,
        mem_source,
        cores: f.cores.unwrap_or(here),
        bf16_macs_per_core: bf16,
        mxfp4_macs_per_core: mxfp4,
        compute_source,
        decode_bps: plan::ASSUMED_DECODE_BPS,
        decode_source: "ASSUMED (no coded trunk projected)".into(),
    }
}

/// How the expert-fetcher reads a drive: its pieces, at its default queue depth.
pub const EXPERT_READ: (u64, usize) = (
    k3_expert_fetcher::fetcher::PIECE,
    k3_expert_fetcher::fetcher::DEFAULT_READERS,
);
/// How the trunk-loader reads a drive: `read_parallel`'s pieces and depth.
pub const TRUNK_READ: (u64, usize) = (k3_io::direct::READ_CHUNK as u64, k3_io::direct::READ_QD);

/// Bytes per second of O_DIRECT random reads of `read_bytes` at `depth` on `file`.
pub fn measure_drive(
    file: &Path,
    read_bytes: u64,
    depth: usize,
    seconds: f64,
) -> Result<f64, ProjectError> {
    let rb = read_bytes.max(1 << 20);
    Ok(k3_io::devbw::direct_bytes_per_s(file, rb, depth, seconds)?)
}

/// One drive's bytes per second read as the expert-fetcher reads (`expert_read`-byte
/// pieces at [`EXPERT_READ`]'s depth) and as the trunk-loader reads ([`TRUNK_READ`]),
/// `seconds` each.
pub fn measure_drives(
    file: &Path,
    expert_read: u64,
    seconds: f64,
) -> Result<(f64, f64), ProjectError> {
    let e = measure_drive(file, expert_read, EXPERT_READ.1, seconds)?;
    let t = measure_drive(file, TRUNK_READ.0, TRUNK_READ.1, seconds)?;
    Ok((e, t))
}

/// Bytes per second k3's products stream bf16 and MXFP4 weights from RAM, each the median
/// pass of about 0.5 s of passes, after one that warms up. What the products reach, not
/// what a bare read reaches (issue 35: decode reached about half the read probe):
/// - bf16: the engine's GEMV on `threads` threads over a 224 MiB matrix (16,384 rows of
///   the released model's 7,168 columns: far larger than any cache), as the trunk's and the
///   lm_head's products run;
/// - MXFP4: 16 routed experts of `expert` (w1 and w3 `expert.0 x expert.1`, w2 the
///   other way round; 280 MB at the released shape), side by side as a decode step runs
///   its experts (`modules::moe`: one expert's three products on one thread, the threads
///   taking the next expert as they finish).
///
/// The median, not the fastest pass: a decode step streams its weights at the rate the
/// memory keeps up, which on a shared host ran 5-10% below the fastest of 30-40 passes.
/// The expert-shaped MXFP4 probe: rows of 1.8 KB (3,584 columns) ran at 0.6-0.7 of the
/// rate of one 32,768 x 7,168 matrix on both threads (docs/measurements.md, "The
/// projection calibrated").
pub fn measure_products(threads: usize, expert: (usize, usize)) -> (f64, f64) {
    use k3_layer_compute::kernels::matmul::{gemv, Mat};
    let cols = 7168usize;
    let x: Vec<f32> = (0..cols.max(expert.0).max(expert.1))
        .map(|i| (i % 7) as f32 * 0.125)
        .collect();
    let rows = 16_384usize;
    let bf16: Vec<u8> = (0..rows * cols * 2)
        .map(|i| if i % 2 == 1 { 0x3f } else { (i % 251) as u8 })
        .collect();
    let b = Mat::bf16(&bf16, rows, cols).map(|m| {
        let mut y = vec![0f32; m.rows];
        median_rate(bf16.len(), &mut || gemv(&m, &x[..cols], &mut y, threads))
    });
    drop(bf16);
    let q = measure_experts(threads, expert, &x);
    (
        b.unwrap_or(REFERENCE.mem_bps),
        q.unwrap_or(REFERENCE.mxfp4_mem_bps),
    )
}

/// `bytes` over the median time of `pass`, run for about 0.5 s after one warm-up pass.
fn median_rate(bytes: usize, pass: &mut dyn FnMut()) -> f64 {
    pass();
    let t0 = std::time::Instant::now();
    let mut passes = Vec::new();
    while t0.elapsed().as_secs_f64() < 0.5 {
        let t = std::time::Instant::now();
        pass();
        passes.push(t.elapsed().as_secs_f64());
    }
    passes.sort_by(f64::total_cmp);
    bytes as f64 / passes[passes.len() / 2].max(1e-9)
}

/// [`measure_products`]' MXFP4 part: 16 routed experts of `(f, lat)`, their products side
/// by side on `threads` threads; None when that is not a shape MXFP4 can hold.
fn measure_experts(threads: usize, (f, lat): (usize, usize), x: &[f32]) -> Option<f64> {
    use k3_layer_compute::kernels::matmul::{gemv, Mat};
    use std::sync::atomic::{AtomicUsize, Ordering};
    const EXPERTS: usize = 16;
    // One matrix's packed codes and scales (32 values a scale byte), distinct per seed.
    let matrix = |rows: usize, cols: usize, seed: usize| {
        let packed: Vec<u8> = (0..rows * cols / 2)
            .map(|i| ((i + seed) % 255) as u8)
            .collect();
        (packed, vec![127u8; rows * cols / 32], rows, cols)
    };
    let experts: Vec<[_; 3]> = (0..EXPERTS)
        .map(|e| {
            [
                matrix(f, lat, 3 * e),
                matrix(lat, f, 3 * e + 1),
                matrix(f, lat, 3 * e + 2),
            ]
        })
        .collect();
    let mats: Vec<[Mat<'_>; 3]> = experts
        .iter()
        .map(|ms| {
            let [a, b, c] = ms
                .each_ref()
                .map(|(p, s, r, c)| Mat::mxfp4(p, s, *r, *c).ok());
            Some([a?, b?, c?])
        })
        .collect::<Option<_>>()?;
    let bytes: usize = experts
        .iter()
        .flatten()
        .map(|(p, s, _, _)| p.len() + s.len())
        .sum();
    let next = AtomicUsize::new(0);
    Some(median_rate(bytes, &mut || {
        next.store(0, Ordering::Relaxed);
        std::thread::scope(|sc| {
            for _ in 0..threads.max(1) {
                sc.spawn(|| {
                    let mut y = vec![0f32; f.max(lat)];
                    while let Some(ms) = mats.get(next.fetch_add(1, Ordering::Relaxed)) {
                        for m in ms {
                            gemv(m, &x[..m.cols], &mut y[..m.rows], 1);
                        }
                    }
                });
            }
        });
    }))
}

/// Bytes per second of BF16 one core decodes from a coded trunk: two chunks of Gaussian
/// BF16 (sigma 1/sqrt(7168), drawn as `synth --weights gaussian` draws a released matrix:
/// [`gaussian_bf16`](crate::tools::synth::gaussian_bf16)) coded with `bf16-zstd` at the
/// effort `pack-trunk --codec` uses by default ([`k3_model::codec::DEFAULT_EFFORT`]),
/// decoded by one reused `Decoder` as the trunk-loader's readers
/// decode, the fastest of three passes. [`plan::ASSUMED_DECODE_BPS`] when coding fails.
pub fn measure_decode() -> f64 {
    use k3_model::codec::{encode, Codec, Decoder};
    let chunk = k3_model::trunk::CODEC_CHUNK as usize;
    let raw: Vec<Vec<u8>> = (0..2)
        .map(|i| crate::tools::synth::gaussian_bf16(i, "decode-probe", chunk / 2, 7168))
        .collect();
    let Ok(coded) = raw
        .iter()
        .map(|r| encode(Codec::Bf16Zstd, r))
        .collect::<Result<Vec<_>, _>>()
    else {
        return plan::ASSUMED_DECODE_BPS;
    };
    let mut dec = Decoder::new();
    let mut out = vec![0u8; chunk];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        for c in &coded {
            if dec.decode(Codec::Bf16Zstd, c, &mut out).is_err() {
                return plan::ASSUMED_DECODE_BPS;
            }
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    (2 * chunk) as f64 / best.max(1e-9)
}

/// Multiply-adds per second of one core through bf16 and MXFP4 weights: the engine's GEMV
/// over a 1024 x 2048 matrix small enough to stay in cache, on `threads` threads, for
/// about 0.2 s each.
pub fn measure_compute(threads: usize) -> (f64, f64) {
    use k3_layer_compute::kernels::matmul::{gemv, Mat};
    let (rows, cols) = (1024usize, 2048usize);
    let bf16: Vec<u8> = (0..rows * cols * 2)
        .map(|i| if i % 2 == 1 { 0x3f } else { (i % 251) as u8 })
        .collect();
    let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i % 255) as u8).collect();
    let scales: Vec<u8> = vec![127; rows * cols / 32];
    let x: Vec<f32> = (0..cols).map(|i| (i % 7) as f32 * 0.125).collect();
    let mut y = vec![0f32; rows];
    let rate = |m: &Mat<'_>, y: &mut [f32]| {
        let t0 = std::time::Instant::now();
        let mut n = 0u64;
        while t0.elapsed().as_secs_f64() < 0.2 {
            gemv(m, &x, y, threads);
            n += 1;
        }
        n as f64 * (rows * cols) as f64 / t0.elapsed().as_secs_f64() / threads.max(1) as f64
    };
    let b = Mat::bf16(&bf16, rows, cols).map(|m| rate(&m, &mut y));
    let q = Mat::mxfp4(&packed, &scales, rows, cols).map(|m| rate(&m, &mut y));
    (
        b.unwrap_or(REFERENCE.bf16_macs_per_core),
        q.unwrap_or(REFERENCE.mxfp4_macs_per_core),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_protocol::conf::TrunkResident;

    fn machine() -> Machine {
        Machine {
            drives: 2,
            copies: 1,
            split: false,
            drive_bps: 5e9,
            trunk_drive_bps: 10e9,
            // The trunk on an md RAID 0 of the two drives.
            trunk_drives: 2,
            drive_source: "given".into(),
            mem_bps: 40e9,
            mxfp4_mem_bps: 20e9,
            mem_source: "given".into(),
            cores: 8,
            bf16_macs_per_core: 10e9,
            mxfp4_macs_per_core: 5e9,
            compute_source: "given".into(),
            decode_bps: 2e9,
            decode_source: "given".into(),
        }
    }

    /// One token's terms for the pipeline tests: 60 + 40 GB from disk, 200 GB from RAM (40
    /// of it MXFP4, 50 after the router), 400 G bf16 and 80 G MXFP4 MACs, nothing decoded.
    fn token_terms() -> PerToken {
        PerToken {
            trunk_disk_bytes: 60e9,
            expert_disk_bytes: 40e9,
            ram_bytes: 200e9,
            ram_mxfp4_bytes: 40e9,
            serial_ram_bytes: 50e9,
            bf16_macs: 400e9,
            mxfp4_macs: 80e9,
            decode_bytes: 0.0,
            head_decode_bytes: 0.0,
            layer_misses: 0.0,
            layer_experts: 0,
        }
    }

    /// The terms by hand: 60 GB of trunk over a RAID 0 of 2 drives of 10 GB/s (trunk
    /// reads) is 3 s and 40 GB of experts over 2 of 5 GB/s (the fetcher's reads) 4 s: the
    /// disk 7 s; 160 GB of bf16 from RAM at 40 GB/s and 40 GB of MXFP4 at 20 GB/s: memory
    /// 6 s; 400 G bf16 MACs on 8 cores of 10 G plus 80 G MXFP4 at 5 G: compute 7 s; a
    /// quarter of the RAM bytes multiplied with the disk idle: 1.75 s exposed. s/token =
    /// max(7 + 1.75, 7 + 4) = 11, compute-bound: the experts' reads wait for the router, so
    /// they add to compute. Catches one drive's bandwidth used for all of them, the trunk
    /// and expert rates swapped, the MXFP4 bytes at the bf16 rate, the cores left out, and
    /// the old max of the three (7 s), which put reads after the router in parallel with
    /// compute.
    #[test]
    fn the_pipeline_combines_the_terms() {
        let t = token_terms();
        let x = Times::of(&t, &machine());
        assert_eq!((x.disk, x.expert_disk), (7.0, 4.0));
        assert_eq!(x.memory, 6.0);
        assert_eq!(x.compute, 7.0);
        assert_eq!(x.exposed, 1.75);
        assert_eq!(x.s_per_token(), 11.0);
        assert_eq!(x.floor(), "compute");
        // The trunk on one of them (its own directory): its 60 GB take 6 s, whatever reads
        // the experts; the disk's side (10 + 1.75) sets it. Catches the trunk read at the
        // expert drives' sum.
        let one = Times::of(
            &t,
            &Machine {
                trunk_drives: 1,
                ..machine()
            },
        );
        assert_eq!(
            (one.disk, one.s_per_token(), one.floor()),
            (10.0, 11.75, "disk")
        );
        // Half the drives' speed: the disk's side (14 + 1.75) sets it.
        let slow_disk = Machine {
            drive_bps: 2.5e9,
            trunk_drive_bps: 5e9,
            ..machine()
        };
        let w = Times::of(&t, &slow_disk);
        assert_eq!((w.s_per_token(), w.floor()), (15.75, "disk"));
        // Fast drives: compute sets it, plus what is left of the expert reads.
        let fast_disk = Machine {
            drive_bps: 50e9,
            trunk_drive_bps: 50e9,
            ..machine()
        };
        let y = Times::of(&t, &fast_disk);
        assert_eq!((y.s_per_token(), y.floor()), (7.4, "compute"));
        let slow_ram = Machine {
            drive_bps: 50e9,
            trunk_drive_bps: 50e9,
            mem_bps: 10e9,
            ..machine()
        };
        assert_eq!(Times::of(&t, &slow_ram).floor(), "memory");
        // No expert reads, no serial products: the larger of disk and compute.
        let u = PerToken {
            expert_disk_bytes: 0.0,
            serial_ram_bytes: 0.0,
            ..t
        };
        let z = Times::of(&u, &machine());
        assert_eq!((z.s_per_token(), z.floor()), (7.0, "compute"));
        assert!(z.explain().contains("expert reads after the router"));
    }

    /// The released model at 64 GB streams its trunk through a ring of one part: the
    /// products over the streamed parts run with the disk idle and add to it; at 128 GB
    /// nothing streams and nothing is serial. Catches a serial share that ignores the ring,
    /// or that is not the streamed units' share of the products.
    #[test]
    fn a_one_slot_ring_leaves_the_disk_idle_through_its_products() {
        let m = ModelShape::released();
        let mach = Machine::reference(1);
        let p = project(&m, (64.0 * GB) as u64, &mach).unwrap();
        let pt = &p.per_token;
        assert!(pt.serial_ram_bytes > 0.0, "{pt:?}");
        assert_eq!(
            pt.serial_ram_bytes, pt.trunk_disk_bytes,
            "the lm_head is pinned"
        );
        let share = pt.serial_ram_bytes / pt.ram_bytes;
        assert_eq!(p.times.exposed, share * p.times.cpu());
        assert!(p.times.s_per_token() >= p.times.disk + p.times.exposed);
        let q = project(&m, (128.0 * GB) as u64, &mach).unwrap();
        assert_eq!((q.per_token.serial_ram_bytes, q.times.exposed), (0.0, 0.0));
    }

    /// Copies of each expert (`pack-experts --copies`), each miss read from the least busy
    /// drive: with every expert on every drive a layer's reads split exactly (16 over 2
    /// drives: 8 and 8; 15: 8 and 7), two copies over four drives come within 5% of that,
    /// and one copy is the stripes. Catches copies ignored (the stripes' 1.17 for two
    /// mirrored drives), copies chosen read by read only (1.16 over four), and a figure
    /// that changes from call to call.
    /// A split pack's flag reaches the machine `doctor` and `project` measure
    /// (`MachineFlags` to `Machine`), whose busiest drive then reads its equal share of a
    /// layer where whole experts striped read more. Catches the flag dropped on the way
    /// (`doctor` had projected a split pack as plain stripes).
    #[test]
    fn split_experts_spread_a_layers_reads() {
        let flags = |split| MachineFlags {
            drives: 2,
            copies: 1,
            split,
            drive_gbps: Some(1.0),
            probe: None,
            mem_gbps: Some(10.0),
            cores: Some(2),
            gmacs_per_core: Some(1.0),
            seconds: 0.1,
        };
        let shape = ModelShape::released();
        let (split, whole) = (
            measure_machine(&shape, &flags(true)),
            measure_machine(&shape, &flags(false)),
        );
        assert!(split.split && !whole.split);
        assert_eq!(split.balance(2, 896, 16.0), 1.0);
        assert_eq!(whole.balance(2, 896, 16.0), stripe_balance(896, 16.0, 2));
        assert!(whole.balance(2, 896, 16.0) > 1.1);
    }

    #[test]
    fn copies_spread_a_layers_reads() {
        assert_eq!(drive_balance(64, 16.0, 2, 2), 1.0);
        assert!((drive_balance(64, 15.0, 2, 2) - 8.0 / 7.5).abs() < 1e-12);
        assert_eq!(drive_balance(896, 16.0, 4, 4), 1.0);
        assert_eq!(drive_balance(64, 16.0, 2, 1), stripe_balance(64, 16.0, 2));
        // More copies than drives count as every drive.
        assert_eq!(drive_balance(64, 16.0, 2, 3), 1.0);
        let two = drive_balance(896, 16.0, 4, 2);
        assert_eq!(two, drive_balance(896, 16.0, 4, 2));
        // Read by read alone, the least busy drive leaves 1.16 here; the fetcher's moves
        // bring the busiest to the least it can be.
        assert!(two > 1.0 && two < 1.05, "{two}");
        assert!(two < stripe_balance(896, 16.0, 4) - 0.25, "{two}");
        let mut t = PerToken {
            layer_misses: 16.0,
            layer_experts: 64,
            ..token_terms()
        };
        t.expert_disk_bytes = 40e9;
        let mirrored = Machine {
            copies: 2,
            ..machine()
        };
        assert_eq!(Times::of(&t, &mirrored).balance, 1.0);
        assert!(Times::of(&t, &machine()).balance > 1.1);
    }

    /// A layer's misses over round-robin drives: the expected busiest drive over an equal
    /// share. The oracle for two drives is the hypergeometric sum written out (k of one
    /// drive's 32 among 64, the other drive 16 - k), not the product of per-drive
    /// polynomials the function computes. Catches the mean share taken for the busiest
    /// (1.0), drive sizes that drop a remainder, and more drives splitting a single read.
    #[test]
    fn the_busiest_drive_sets_a_layers_reads() {
        let c = |a: u64, b: u64| (0..b).fold(1.0, |x, i| x * (a - i) as f64 / (i + 1) as f64);
        let largest: f64 = (0..=16u64)
            .map(|k| k.max(16 - k) as f64 * c(32, k) * c(32, 16 - k))
            .sum::<f64>()
            / c(64, 16);
        assert!((largest - 9.3588).abs() < 1e-3, "{largest}");
        let b = stripe_balance(64, 16.0, 2);
        assert!((b - largest / 8.0).abs() < 1e-9, "{b}");
        assert_eq!(stripe_balance(64, 16.0, 1), 1.0);
        assert_eq!(stripe_balance(896, 0.0, 4), 1.0);
        // One read a layer: more drives do not split it.
        assert!((stripe_balance(896, 1.0, 4) - 4.0).abs() < 1e-12);
        // Every expert read: 65 over two drives are 33 and 32, the busiest reads 33.
        assert!((stripe_balance(65, 65.0, 2) - 33.0 / 32.5).abs() < 1e-12);
        // The released model over 4 drives: a simulation of 200,000 layers gave 1.53.
        let r = stripe_balance(896, 16.0, 4);
        assert!((1.50..1.56).contains(&r), "{r}");
        // Times: the experts' reads over the test machine's 2 drives take the busiest's.
        let t = PerToken {
            layer_misses: 16.0,
            layer_experts: 64,
            ..token_terms()
        };
        let x = Times::of(&t, &machine());
        assert!((x.expert_disk - 4.0 * b).abs() < 1e-9, "{x:?}");
        assert_eq!(x.balance, b);
    }

    /// The text output names the busiest drive's share, from the model's own geometry: the
    /// detail's `stripes` line for one row, the note for a table. Catches a share written
    /// as a literal (the released model's 1.19x where 64 experts a layer give 1.17x) and a
    /// line continuation dropped from the message (a run of spaces inside the sentence).
    #[test]
    fn the_text_names_the_busiest_drives_share() {
        let released = ModelShape::released();
        let one = report(
            &released,
            &[(128.0 * GB) as u64],
            &[2],
            &Machine::reference(1),
            256,
            &Hits::Flat,
        );
        assert!(
            one.contains("the busiest reads 1.19x an equal share (round-robin stripes"),
            "{one}"
        );
        let mut slice_like = ModelShape::released();
        slice_like.experts_per_layer = 64;
        let budgets = [(128.0 * GB) as u64, (256.0 * GB) as u64];
        let table = report(
            &slice_like,
            &budgets,
            &[1, 2, 4, 2],
            &Machine::reference(1),
            256,
            &Hits::Flat,
        );
        let note = table
            .lines()
            .find(|l| l.starts_with("note"))
            .unwrap_or_default();
        assert!(
            note.ends_with(
                "(flat routing, every expert of a layer's top-16 missed: 1.17x an equal share \
                 over 2 drives, 1.46x an equal share over 4 drives)"
            ),
            "{note}"
        );
        // The lines' text after their aligned labels has no run of spaces.
        let stripes = one
            .lines()
            .find(|l| l.starts_with("  stripes  : "))
            .unwrap_or_default();
        for line in [
            note.strip_prefix("note    : ").unwrap_or_default(),
            stripes.strip_prefix("  stripes  : ").unwrap_or_default(),
        ] {
            assert!(!line.is_empty() && !line.contains("  "), "{line}");
        }
    }

    /// Flat routing: the cache serves slots / experts of the requests, never more than all.
    #[test]
    fn flat_routing_hits_the_cached_share() {
        assert_eq!(flat_hit_rate(0, 82_432), 0.0);
        assert_eq!(flat_hit_rate(8_243, 82_432), 8_243.0 / 82_432.0);
        assert_eq!(flat_hit_rate(100_000, 82_432), 1.0);
        assert_eq!(flat_hit_rate(5, 0), 1.0);
    }

    /// Per token, by hand: 3 MoE layers x top-2 = 6 routed experts of 10 bytes, half of them
    /// hit: 30 bytes of experts from disk beside the plan's 100 streamed; RAM reads every
    /// weight a token multiplies (trunk 1000 + lm_head 50 + a 7-byte embedding row + 6
    /// experts); MXFP4 experts' MACs are counted apart. Catches misses counted per layer
    /// instead of per routed expert, and cached experts left out of the RAM bytes.
    #[test]
    fn per_token_bytes_and_macs() {
        let mut m = ModelShape::released();
        m.moe_layers = 3;
        m.top_k = 2;
        m.expert_bytes = 10;
        m.expert_macs = 4;
        m.trunk_bytes = 1000;
        m.trunk_macs = 500;
        m.lm_head_bytes = 50;
        m.lm_head_macs = 25;
        m.embed_row_bytes = 7;
        let c = Choice {
            trunk: 0,
            cache: 0,
            head_pinned: true,
            head_held: 0,
            sink: 0,
            read_per_token: 100,
            decode_per_token: 0,
            cost_per_token: 100,
            head_coded: false,
            head_cost: 0,
        };
        let t = per_token(&m, &c, 0.5);
        assert_eq!(t.trunk_disk_bytes, 100.0);
        assert_eq!(t.expert_disk_bytes, 30.0);
        assert_eq!(t.disk_bytes(), 130.0);
        assert_eq!(t.ram_bytes, 1000.0 + 50.0 + 7.0 + 60.0);
        assert_eq!(t.ram_mxfp4_bytes, 60.0);
        assert_eq!(t.bf16_macs, 525.0);
        assert_eq!(t.mxfp4_macs, 24.0);
        m.experts_mxfp4 = false;
        assert_eq!(per_token(&m, &c, 0.5).bf16_macs, 549.0);
        assert_eq!(per_token(&m, &c, 0.5).ram_mxfp4_bytes, 0.0);
    }

    /// The released shape: the census `inspect` prints (trunk 108.81 GB, 82,432 experts of
    /// 17,547,264 bytes), MACs of the released matrices (an expert is 3 x 3072 x 3584).
    #[test]
    fn the_released_shape() {
        let m = ModelShape::released();
        assert_eq!(m.trunk_bytes, 108_811_877_376);
        assert_eq!(m.expert_bytes, 17_547_264);
        assert_eq!(m.experts(), 82_432);
        assert_eq!(m.expert_macs, 3 * 3072 * 3584);
        assert_eq!(m.lm_head_macs, 163_840 * 7168);
        assert_eq!(m.moe_layers, 92);
        assert_eq!(m.top_k, 16);
        assert!(m.experts_mxfp4);
        assert_eq!(m.checkpoint_bytes, 1_560_936_091_448);
    }

    /// More memory never projects slower, and everything pinned and cached reads nothing
    /// from disk; a budget below the streaming floor is refused.
    #[test]
    fn more_memory_is_never_slower() {
        let m = ModelShape::released();
        let mach = Machine::reference(1);
        let mut last = f64::MAX;
        for gb in [2.0, 8.0, 64.0, 128.0, 256.0, 512.0, 2000.0] {
            let p = project(&m, (gb * GB) as u64, &mach).unwrap();
            let s = p.times.s_per_token();
            assert!(s <= last, "{gb} GB: {s} after {last}");
            last = s;
        }
        let all = project(&m, (2000.0 * GB) as u64, &mach).unwrap();
        assert_eq!(all.per_token.disk_bytes(), 0.0);
        assert_eq!(all.hit, 1.0);
        assert!(project(&m, (0.5 * GB) as u64, &mach).is_err());
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(duration(0.012), "12 ms");
        assert_eq!(duration(0.5), "0.50 s");
        assert_eq!(duration(42.0), "42.0 s");
        assert_eq!(duration(600.0), "10.0 min");
        assert_eq!(duration(3.0 * 3600.0), "3.0 h");
    }

    /// A coded trunk's decoding by hand: 4 GB decoded at 2 GB/s on the one core compute
    /// (on all 8) leaves is 2 s, added to the compute side (7 s of MACs + 2 s + 4 s of
    /// expert reads = 13 s, over the disk's 8.75 s). Catches the decoding left out of
    /// s/token, spread over the cores compute runs on (0.25 s, as it was before the
    /// measurement in docs/measurements.md, "The coded trunk's literals"), or put on the
    /// disk's side (where it would hide under the compute side).
    #[test]
    fn a_coded_trunks_decoding_takes_computes_cores() {
        let t = PerToken {
            decode_bytes: 4e9,
            head_decode_bytes: 0.0,
            ..token_terms()
        };
        let x = Times::of(&t, &machine());
        assert_eq!(x.decode, 2.0);
        assert_eq!(x.s_per_token(), 13.0);
        assert!(
            x.explain().contains("trunk decoding 2.00 s"),
            "{}",
            x.explain()
        );
        let slow = Machine {
            decode_bps: 0.5e9,
            ..machine()
        };
        let y = Times::of(&t, &slow);
        assert_eq!(
            (y.decode, y.s_per_token(), y.floor()),
            (8.0, 19.0, "decode")
        );
        // The coded lm_head's 8 GB more decode on all 8 cores: 0.5 s, not 4 s on one.
        // Catches the lm_head's decoding counted at the trunk's one core.
        let h = PerToken {
            head_decode_bytes: 8e9,
            ..t
        };
        assert_eq!(Times::of(&h, &machine()).decode, 2.5);
    }

    /// The released model with its trunk (and lm_head) coded at 0.662, at 64 GB: with a
    /// decoder of 40 GB/s a core decoding weighs little against a 7 GB/s drive and the
    /// lm_head streams coded (its decoding on all 16 cores: 0.01 read bytes a byte); at the
    /// reference 2 GB/s a trunk part's decoded byte weighs 3.5 read bytes (one core's rate:
    /// compute runs on all 16), so the plan pins coded parts before the lm_head (which
    /// streams coded, 0.22) and decodes less of the trunk per token than the stored-bytes
    /// ranking (decoding free, the lm_head pinned) would on the same machine, and projects
    /// faster for it. Catches a projection whose plan ignores the machine's decoding (the
    /// reference plan would be the stored-bytes one), or counts the trunk's decoding on the
    /// cores compute runs on (16 cores would keep the lm_head pinned).
    #[test]
    fn a_coded_trunk_plans_by_the_machines_decoding() {
        let m = ModelShape::released()
            .with_codec_ratio(0.662)
            .with_resident(TrunkResident::Raw);
        let b = (64.0 * GB) as u64;
        let light = Machine {
            decode_bps: 40e9,
            ..Machine::reference(1)
        };
        let fast = project(&m, b, &light).unwrap();
        // The lm_head's decoding, on every core, weighs 0.01: it streams coded.
        assert!(fast.choice.head_coded, "{:?}", fast.choice);
        let two = Machine::reference(1);
        let small = Machine {
            cores: 2,
            ..Machine::reference(1)
        };
        // Two cores weigh a trunk part's decoding as sixteen do (compute runs on all), but
        // the lm_head's on two cores at 1.75 read bytes a byte: it streams raw there.
        assert_eq!(small.decode_terms().ppm(), two.decode_terms().ppm());
        let on_two = project(&m, b, &small).unwrap().choice;
        assert!(!on_two.head_pinned && !on_two.head_coded, "{on_two:?}");
        assert!(project(&m, b, &two).unwrap().choice.head_coded);
        let free = Machine {
            decode_bps: 1e18,
            ..two.clone()
        };
        let weighed = project(&m, b, &two).unwrap();
        let by_stored = project(&m, b, &free).unwrap();
        assert!(by_stored.choice.head_pinned, "{:?}", by_stored.choice);
        assert!(!weighed.choice.head_pinned, "{:?}", weighed.choice);
        assert!(
            weighed.per_token.decode_bytes < by_stored.per_token.decode_bytes,
            "{} {}",
            weighed.per_token.decode_bytes,
            by_stored.per_token.decode_bytes
        );
        assert!(weighed.times.decode > 0.0);
        assert!(weighed.times.s_per_token() < Times::of(&by_stored.per_token, &two).s_per_token());
    }

    /// `--trunk-resident auto` at 64 GB with a 40 GB/s decoder (a decoded byte weighs 0.17
    /// read bytes) keeps layers coded in RAM ("+N kept") where the raw plan pins them
    /// decoded, and its plan weighs less and reads less per token; at the reference 2 GB/s
    /// (3.5) it keeps none and is the raw plan. Catches a projection that never plans kept
    /// layers, or keeps them where decoding costs more than the reads they save.
    #[test]
    fn auto_keeps_coded_layers_where_decoding_is_cheap() {
        let b = (64.0 * GB) as u64;
        let coded = ModelShape::released().with_codec_ratio(0.662);
        let raw = coded.clone().with_resident(TrunkResident::Raw);
        let wide = Machine {
            decode_bps: 40e9,
            ..Machine::reference(1)
        };
        let (a, r) = (
            project(&coded, b, &wide).unwrap(),
            project(&raw, b, &wide).unwrap(),
        );
        assert!(
            a.pinned.contains(" kept") && !r.pinned.contains("kept"),
            "{} {}",
            a.pinned,
            r.pinned
        );
        assert!(a.choice.cost_per_token < r.choice.cost_per_token);
        assert!(a.choice.read_per_token < r.choice.read_per_token);
        let two = Machine::reference(1);
        let (a, r) = (
            project(&coded, b, &two).unwrap(),
            project(&raw, b, &two).unwrap(),
        );
        assert!(!a.pinned.contains("kept"), "{}", a.pinned);
        assert_eq!(a.choice.cost_per_token, r.choice.cost_per_token);
    }

    /// What a projection says it holds fits what it spends: the trunk counted as its plan
    /// allocates it and a streamed lm_head's held rows as their arena, as a run's memory
    /// plan adds them up. Catches the trunk's share counted whole (what the trunk plan
    /// leaves of it holds lm_head rows or cache: counted twice, 60.81 GB "held" of 60.80 on
    /// the coded 64 GB projection on 2 cores).
    #[test]
    fn what_a_projection_holds_fits_what_it_spends() {
        let raw = ModelShape::released();
        let coded = ModelShape::released().with_codec_ratio(0.662);
        let two = Machine {
            cores: 2,
            ..Machine::reference(1)
        };
        for m in [&raw, &coded] {
            for mach in [&Machine::reference(1), &two] {
                for gb in [2.0, 5.5, 64.0, 128.0, 256.0] {
                    let p = project(m, (gb * GB) as u64, mach).unwrap();
                    assert!(
                        p.held_bytes(m) <= p.total,
                        "{gb} GB: holds {} of {}",
                        p.held_bytes(m),
                        p.total
                    );
                }
            }
        }
    }
}
