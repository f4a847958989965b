//! Why a generation (`k3-orch <MODEL_DIR> ...`) did not run or did not finish:
//! [`GenError`]. `crate::error` turns it into the exit code (by variant: refused up front,
//! failed, or the pipeline's own [`SuperviseError`]) and the message.

use std::path::PathBuf;

use k3_layer_compute::decode::DecodeError;
use k3_layer_compute::error::PoolError;
use k3_layer_compute::state::StateError;
use k3_layer_compute::ForwardError;
use k3_model::catalog::CatalogError;
use k3_model::config::ConfigError;
use k3_model::trunk::{SourceError, TrunkError};
use k3_tokenizer::error::TokError;

use super::launch::{BUDGET_OVERRIDE_ENV, TEST_HOOKS_ENV};
use super::plan::BudgetError;
use crate::supervise::SuperviseError;

/// What ended a generation. Each message is complete without the `k3-orch: ` prefix the
/// CLI adds.
#[derive(Debug, thiserror::Error)]
pub enum GenError {
    // Refused up front (exit 2).
    #[error("model directory {} does not exist", .0.display())]
    NoModelDir(PathBuf),
    /// The model directory is there but cannot be one (a file, a symlink loop) or cannot
    /// be looked at (permission denied).
    #[error("model directory {}: {why}", path.display())]
    ModelDir { path: PathBuf, why: String },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("--layers {want}: the model has {have} layers")]
    Layers { want: usize, have: usize },
    /// `--trunk DIR`'s manifest cannot be read.
    #[error(transparent)]
    TrunkManifest(#[from] TrunkError),
    /// `--trunk DIR` was packed from another checkpoint.
    #[error("--trunk {}: {source}", dir.display())]
    TrunkSource {
        dir: PathBuf,
        #[source]
        source: SourceError,
    },
    /// `--experts DIR,...` is not one whole pack of this checkpoint.
    #[error("--experts: {0}")]
    Experts(#[source] k3_model::experts::ExpertsError),
    /// The memory plan (its refusals, or a flag or file it cannot use).
    #[error(transparent)]
    Budget(#[from] BudgetError),
    #[error(
        "--ids: {bad} outside the model's vocabulary (vocab_size {vocab}: ids 0..={})",
        vocab.saturating_sub(1)
    )]
    IdsOutside { bad: String, vocab: usize },
    /// `--out`, `--dump-logits` or `--save-state` cannot take a file
    /// (`k3_io::output::check_target` says why).
    #[error("{flag} {}: {why}", path.display())]
    OutputRefused {
        flag: &'static str,
        path: PathBuf,
        why: String,
    },
    /// `--record` or `--dump-cache-trace` names something other than a directory.
    #[error(
        "{flag} {}: not a directory (it names the directory the run's files go in)",
        path.display()
    )]
    RecordNotDir { flag: &'static str, path: PathBuf },
    /// Only the last component of `--record` / `--dump-cache-trace` is created.
    #[error("{flag} {}: its directory {} does not exist", path.display(), dir.display())]
    RecordDirMissing {
        flag: &'static str,
        path: PathBuf,
        dir: PathBuf,
    },
    #[error("--prompt-file {}: {source}", path.display())]
    PromptFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `what` is the prompt, or the file it came from.
    #[error("{what} is not UTF-8, which --chat needs")]
    NotUtf8 { what: String },
    #[error("--chat: {0}")]
    Chat(#[source] TokError),
    #[error("a text prompt needs --tok")]
    NeedsTok,
    /// `-c/--ctx-size` cannot hold the prompt plus the tokens to generate.
    #[error("{0}")]
    CtxSize(String),
    /// `--load-state FILE` cannot be used (its errors name the flag and the file).
    #[error(transparent)]
    LoadState(StateError),
    #[error("--save-state {}: not a file in an existing directory", .0.display())]
    SaveStatePath(PathBuf),
    /// A test hook's variable (`K3_STAGE_BUDGET_OVERRIDE`, `K3_INJECT_EXPERT_FAILURES`,
    /// `K3_PREFILL_CHUNK`, `K3_LM_HEAD_*`) without `K3_TEST_HOOKS=1`.
    #[error(
        "{0} is a test hook (it changes how the run works); it is honoured only with \
         {TEST_HOOKS_ENV}=1 (unset it for a normal run)"
    )]
    HookNotArmed(&'static str),
    /// A numeric test hook whose value is not a positive integer.
    #[error("{name}={value:?}: not a positive integer")]
    BadHookValue { name: &'static str, value: String },
    #[error(
        "{BUDGET_OVERRIDE_ENV}: {0:?} is not stage=bytes (stages: tokenizer, trunk-loader, \
         expert-fetcher, layer-compute)"
    )]
    BadBudgetOverride(String),
    #[error(
        "K3_INJECT_EXPERT_FAILURES={value:?}: {part:?} is not LAYER:EXPERT (a comma-separated \
         list, e.g. 1:0,2:3)"
    )]
    BadInjection { value: String, part: String },

    /// `--tok DIR` (or the model directory's tokenizer files) does not load.
    #[error("tokenizer {}: {source}", dir.display())]
    Tokenizer {
        dir: PathBuf,
        #[source]
        source: TokError,
    },

    // Failed (exit 1).
    /// The checkpoint's shards.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("model fingerprint: {0}")]
    Fingerprint(#[source] StateError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// Binding the model (`--single-process`).
    #[error(transparent)]
    Model(#[from] ForwardError),
    /// A state file while generating (`--single-process`: loading, or `--save-state`).
    #[error(transparent)]
    State(#[from] StateError),
    /// The decode loop (`--single-process`).
    #[error(transparent)]
    Decode(#[from] DecodeError<std::convert::Infallible>),
    /// `--record-routes` (`--single-process`): a route that does not fit, or the file.
    #[error("--record-routes: {0}")]
    Routes(#[from] k3_protocol::routes::RoutesError),
    #[error("writing the report {}: {source}", path.display())]
    Report {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The staged pipeline (its own exit codes; its messages carry their prefix).
    #[error(transparent)]
    Supervise(#[from] SuperviseError),
}
