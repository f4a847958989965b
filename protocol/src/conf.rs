//! Typed stage configuration: what the orchestrator tells each stage in its `Configure`
//! message (JSON payload), and the region ids the stages agree on.
//!
//! One struct per stage role. Everything a stage needs to do its job is here or arrives as a
//! region on its control socket, so a stage process never reads the command line.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Region id of the trunk arena (owned by trunk-loader, mapped read-only by layer-compute).
pub const TRUNK_REGION: u32 = 10;
/// Region id of the expert arena (owned by expert-fetcher, mapped read-only by layer-compute).
pub const EXPERT_REGION: u32 = 20;

/// Longest prompt a run accepts, in tokens.
pub const MAX_PROMPT_IDS: usize = 32768;

/// Sampling options of a generation; `temperature` None or 0 means greedy. The sampler
/// itself is `k3_layer_compute::sampler`. `min_p`, `repetition_penalty` and the presence and
/// frequency penalties were added after the first protocol version; they default to off
/// when absent (serde default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplerConfig {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: u64,
    /// Drop candidates whose probability is below `min_p` times the top candidate's.
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Divide positive (multiply negative) logits of ids seen in the last
    /// [`REPEAT_WINDOW`] tokens by this factor (1 = off); applies to greedy too.
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// OpenAI's `presence_penalty`: subtracted from the logit of every id the generation
    /// has produced so far (the prompt does not count); None or 0 = off; applies to greedy
    /// too.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// OpenAI's `frequency_penalty`: times the number of times the generation has produced
    /// the id so far, subtracted from its logit; None or 0 = off; applies to greedy too.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
}

/// How many of the most recent tokens (prompt included) the repetition penalty looks at.
pub const REPEAT_WINDOW: usize = 64;

impl SamplerConfig {
    /// True when this configuration is plain argmax (a repetition penalty may still apply).
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_none_or(|t| t == 0.0)
    }
}

/// tokenizer stage.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TokenizerConf {
    /// Directory with tiktoken.model + tokenizer_config.json; None: a byte vocabulary
    /// (id = byte), which is what the tiny models use.
    pub tok_dir: Option<PathBuf>,
    /// Stop ids the decoder marks (informational).
    pub record_dir: Option<PathBuf>,
}

/// trunk-loader stage.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrunkConf {
    pub model_dir: PathBuf,
    /// Packed trunk directory (trunk.json + trunk.bin); None: every layer resident, read
    /// tensor by tensor from the shards.
    pub trunk_dir: Option<PathBuf>,
    /// Copies of `trunk_dir` (the same trunk.json, checked by the orchestrator), each on a
    /// drive of its own: the loader's reads alternate over all of them piece by piece.
    #[serde(default)]
    pub trunk_copies: Vec<PathBuf>,
    /// Bytes for pinned layers plus ring slots (streaming mode only).
    pub budget_bytes: u64,
    /// Layers bound (`--layers`), i.e. served per pass.
    pub layers: usize,
    pub record_dir: Option<PathBuf>,
    /// Bytes outside the trunk that hold what its plan leaves of the budget (a streamed
    /// lm_head's rows): the plan is made beside this sink
    /// (`k3_trunk_loader::plan_streams_with`), as the orchestrator's was. 0: none.
    #[serde(default)]
    pub sink_bytes: u64,
    /// A coded trunk's decoding weighed against reading, as the orchestrator's plan weighed
    /// it (`k3_trunk_loader::Streams::decode_ppm`): the loader plans the same units. 0: by
    /// stored bytes alone.
    #[serde(default)]
    pub decode_weight_ppm: u64,
    /// Read each pass's first streamed unit only once compute starts that pass
    /// (`StartPass`), not as soon as a ring slot frees: set when the lm_head streams from
    /// the same disk between passes and the pass starts with pinned units.
    #[serde(default)]
    pub hold_wrap: bool,
    /// Where a coded trunk's resident layers are kept (`--trunk-resident`): the loader
    /// plans the same placements as the orchestrator's plan did.
    #[serde(default)]
    pub trunk_resident: TrunkResident,
}

/// `--trunk-resident`: how a coded trunk's resident layers are held (issue 37). Every
/// placement serves compute the same decoded bytes; only memory and time differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrunkResident {
    /// Resident layers are decoded once at load and kept raw (the only way for a raw
    /// trunk).
    Raw,
    /// No layer is kept raw: resident layers stay compressed in the loader's memory and
    /// are decoded into a ring slot on each use.
    Coded,
    /// Each coded layer raw-pinned, kept coded or streamed, whichever the plan weighs
    /// cheapest under the budget.
    #[default]
    Auto,
}

impl TrunkResident {
    /// The flag's value: `raw`, `coded` or `auto`.
    pub fn name(self) -> &'static str {
        match self {
            TrunkResident::Raw => "raw",
            TrunkResident::Coded => "coded",
            TrunkResident::Auto => "auto",
        }
    }

    /// The placement a flag value names (None: not one of them).
    pub fn from_name(s: &str) -> Option<TrunkResident> {
        [
            TrunkResident::Raw,
            TrunkResident::Coded,
            TrunkResident::Auto,
        ]
        .into_iter()
        .find(|r| r.name() == s)
    }
}

/// expert-fetcher stage.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FetcherConf {
    pub model_dir: PathBuf,
    /// Arena bytes (`--cache-gb`); at least one batch of top-k slots is always allocated.
    pub cache_bytes: u64,
    /// Smallest useful arena: top-k experts of one layer.
    pub min_slots: usize,
    /// Experts in the bound layers: more slots than this would never be used.
    pub max_slots: usize,
    /// Reads in flight.
    pub readers: usize,
    /// (layer, expert) pairs whose reads fail on purpose (tests of exit 4).
    pub inject_failures: Vec<(u32, u32)>,
    /// Directories whose files' reads all fail on purpose, as if the drive holding them
    /// failed (tests of exit 4 naming the drive).
    #[serde(default)]
    pub inject_drive_failures: Vec<PathBuf>,
    /// `--experts DIR...`: read the routed experts from this pack (`k3_model::experts`,
    /// written by `pack-experts`) instead of the shards; empty: the shards.
    #[serde(default)]
    pub experts_dirs: Vec<PathBuf>,
    /// Write expert_hist.json + expert_trace.bin here at the end.
    pub trace_dir: Option<PathBuf>,
    pub record_dir: Option<PathBuf>,
}

/// layer-compute stage.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ComputeConf {
    pub model_dir: PathBuf,
    pub config_path: PathBuf,
    pub layers: Option<usize>,
    pub prompt_ids: Vec<u32>,
    pub gen: usize,
    pub incremental: bool,
    pub sampler: SamplerConfig,
    pub threads: usize,
    pub dump_logits: Option<PathBuf>,
    /// Seconds to wait for a loader before declaring it hung.
    pub io_timeout_s: f64,
    /// Stop generation at these ids (empty for the tiny models, which have no tokenizer).
    pub stop_ids: Vec<u32>,
    pub record_dir: Option<PathBuf>,
    /// Stream the lm_head in chunks of about this many bytes (the memory plan did not pin
    /// it); None: it stays mapped and held. The embedding is always read row by row.
    #[serde(default)]
    pub lm_head_chunk_bytes: Option<u64>,
    /// With a streamed lm_head: hold its leading rows, this many bytes of them, for the
    /// whole run (read once, on first use) and stream only the rest. 0: none.
    #[serde(default)]
    pub lm_head_held_bytes: u64,
    /// With a streamed lm_head: read the streamed rows from the coded lm_head of the coded
    /// trunk in this directory (`pack-trunk --codec`) instead of raw from the shards.
    #[serde(default)]
    pub lm_head_coded: Option<PathBuf>,
    /// With `lm_head_coded`: copies of that trunk on other drives (`--trunk DIR,COPY,...`);
    /// the coded lm_head's reads are spread over all of them, as the trunk's are.
    #[serde(default)]
    pub lm_head_coded_copies: Vec<PathBuf>,
    /// Serve a sequence of requests (`Msg::Generate` on the control socket) until
    /// `Shutdown`, instead of one generation of `prompt_ids` (`serve`, `chat`).
    #[serde(default)]
    pub warm: bool,
    /// Continue from this saved session state (`--load-state`; checked by k3-orch first).
    #[serde(default)]
    pub load_state: Option<PathBuf>,
    /// Write the session state here after the run (`--save-state`).
    #[serde(default)]
    pub save_state: Option<PathBuf>,
    /// The model's fingerprint for state files (`k3_layer_compute::state::fingerprint`).
    #[serde(default)]
    pub state_fingerprint: String,
    /// Feed prompts in passes of at most this many tokens (the memory plan's expert arena
    /// holds one such pass's experts, not the whole prompt's); None: one pass.
    #[serde(default)]
    pub prefill_chunk: Option<usize>,
    /// The product kernels' settings, parsed from the `K3_*` kernel variables once by
    /// k3-orch (`k3_layer_compute::kernels::tuning::from_env`) and installed by the stage
    /// at its start. Absent (an older `Configure`): every setting automatic.
    #[serde(default)]
    pub tuning: KernelTuning,
    /// A warm compute's slots (`serve --parallel N`): how many requests it runs together
    /// and its bounds. Absent: one slot, as before.
    #[serde(default)]
    pub slots: WarmSlots,
    /// `--speculate on`: while a layer computes, guess the next layer's routed experts
    /// and send the fetcher a `Guess` (ids never change). Absent: off.
    #[serde(default)]
    pub speculate: bool,
    /// Write every token's routed experts per layer here at the end of the run
    /// (`--record-routes`, [`crate::routes`]). Absent: nothing is recorded.
    #[serde(default)]
    pub record_routes: Option<PathBuf>,
}

/// A warm compute's requests at once (`k3_layer_compute::batch::Scheduler`'s options): the
/// memory plan counted each slot's KV at `ctx` and its state, a pass of `slots - 1 +
/// prefill_chunk` rows, and `prefix_bytes` of kept states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct WarmSlots {
    /// Requests decoding together (at least 1).
    pub slots: usize,
    /// Requests waiting for a slot, at most.
    pub max_queue: usize,
    /// Prompt plus generated tokens of one request, at most.
    pub ctx: usize,
    /// Bytes of session states kept for prefix reuse, at most.
    pub prefix_bytes: u64,
}

impl Default for WarmSlots {
    /// One slot, a queue of 16, 4,096 tokens, no byte bound on the kept states.
    fn default() -> Self {
        WarmSlots {
            slots: 1,
            max_queue: 16,
            ctx: 4096,
            prefix_bytes: u64::MAX,
        }
    }
}

/// Settings of layer-compute's product kernels (`k3_layer_compute::kernels::tuning`). Only
/// `product` (the numerics contract, design.md "Product paths") and, under `bf16x3` on a
/// CPU with AMX, `amx` (the hardware kernel, whose bits differ) change results: every
/// instruction set of a path gives the same bits, and the other settings choose loop
/// shapes and prefetch distances. Every field is optional; None (and a field
/// absent from the JSON) means automatic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct KernelTuning {
    /// The widest instruction set the kernels may use (`K3_SIMD`; `K3_FORCE_PORTABLE=1`
    /// is `portable`); None: the best the CPU has.
    pub max_isa: Option<Isa>,
    /// Rows the one-token AVX-512 product streams side by side: 2, 4, 6 or 8
    /// (`K3_GEMV_ROWS`); None or another value: the weight format's default.
    pub decode_rows: Option<u8>,
    /// Software prefetch distance of the one-token AVX-512 product, in bytes (the nearest
    /// compiled distance is used; `K3_GEMV_PF`); None: the weight format's default.
    pub decode_prefetch: Option<u32>,
    /// The form the AVX-512 batched product stages its weights in
    /// (`K3_WEIGHT_STAGING`); None: by CPU vendor.
    pub weight_staging: Option<WeightStaging>,
    /// The product path every matrix product of the run follows (`K3_SIMD=exact` or
    /// `K3_SIMD=bf16x3`); None: chosen from the CPU's features.
    pub product: Option<ProductPath>,
    /// Whether the `bf16x3` path runs on the AMX kernel where the CPU has it (`K3_AMX=0`
    /// keeps the AVX512-BF16 kernel there; its bits differ); None: AMX where available.
    pub amx: Option<bool>,
}

/// The numerics contract of the matrix products (design.md, "Product paths"): one per run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProductPath {
    /// f32 FMA inside fixed 1024-column blocks, promoted to f64 between blocks, fixed
    /// tree: the same bits on every instruction set and every machine.
    Exact,
    /// Activations split into three exact bf16 parts, multiplied on the CPU's bf16
    /// dot-product hardware with f32 accumulation in the hardware's order.
    Bf16x3,
}

impl ProductPath {
    /// Every product path.
    pub const ALL: [ProductPath; 2] = [ProductPath::Exact, ProductPath::Bf16x3];

    /// Name for reports and the `K3_SIMD` value that selects it.
    pub fn name(self) -> &'static str {
        match self {
            ProductPath::Exact => "exact",
            ProductPath::Bf16x3 => "bf16x3",
        }
    }

    /// The product path named `s` ([`ProductPath::name`]).
    pub fn from_name(s: &str) -> Option<ProductPath> {
        ProductPath::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// An instruction set of layer-compute's kernels, narrowest first (every one gives the
/// same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isa {
    /// Scalar Rust (`mul_add`), the reference twin.
    Portable = 1,
    /// AVX2 + FMA (the x86-64 baseline of this engine).
    Avx2 = 2,
    /// AVX-512F.
    Avx512 = 3,
}

impl Isa {
    /// Every instruction set, narrowest first.
    pub const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    /// Name for reports and the `K3_SIMD` value that selects it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The instruction set named `s` ([`Isa::name`]).
    pub fn from_name(s: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == s)
    }
}

/// How the AVX-512 batched product stages a row group's weights before its register
/// tiles run over them (both forms hold the same exact f32 weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightStaging {
    /// Bf16 pairs (BF16 copied, MXFP4 decoded once), widened in every tile pass.
    Bf16,
    /// Widened once into lane-ordered f32.
    F32,
}
