//! `k3-orch score MODEL_DIR --ids 1,2,3 --out F [--logits L]`: one forward over the ids
//! (teacher forcing). Writes JSON `{ids, tf_pred}` to F, where `tf_pred[i]` is the argmax
//! of logits row `i` (the prediction for `ids[i+1]`), and optionally every row's logits
//! (T × vocab float32 little-endian) to L.
//!
//! Exit codes: 0 success; 2 usage error or unreadable config; 1 a tensor that does not
//! bind (named) or a failed forward; 4 the forward finished but a routed expert failed to
//! load (the predictions are unsound).

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Parser;
use k3_layer_compute::decode::NonFiniteLogits;
use k3_layer_compute::sampler::argmax;
use k3_layer_compute::{ForwardError, Model, ModelOptions, SourceWeights};
use k3_model::catalog::CatalogError;
use k3_model::config::{ConfigError, ModelConfig};
use k3_model::mmap_weights::MmapWeights;

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[derive(Parser, Debug)]
#[command(
    name = "k3-orch score",
    about = "one forward over --ids: teacher-forced argmax at every position (and logits)"
)]
struct Args {
    /// Model directory (config.json + model.safetensors or an index and shards)
    model_dir: PathBuf,
    /// Token ids, comma-separated
    #[arg(long, value_delimiter = ',', required = true)]
    ids: Vec<u32>,
    /// JSON output: {"ids": [...], "tf_pred": [...]}
    #[arg(long)]
    out: PathBuf,
    /// All-position logits, T x vocab float32 little-endian
    #[arg(long)]
    logits: Option<PathBuf>,
    /// Worker threads for the matrix products (default: all cores, as generation)
    #[arg(long, short = 't', default_value_t = default_threads())]
    threads: usize,
    /// Bind only layers 0..N-1
    #[arg(long)]
    layers: Option<usize>,
    /// Config file (default MODEL_DIR/config.json)
    #[arg(long)]
    config: Option<PathBuf>,
}

/// Why `score` did not score: a request refused up front, or a failure while running
/// (`crate::error::score_exit_code` says which).
#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    #[error("--ids is empty")]
    EmptyIds,
    #[error("--ids: {n} ids, over the {max}-id limit of one forward")]
    TooManyIds { n: usize, max: usize },
    #[error("--threads must be at least 1")]
    NoThreads,
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("token id {id} is outside the vocabulary 0..{vocab}")]
    IdOutside { id: u32, vocab: usize },
    #[error("--layers {n}: the model has layers 1..={have}")]
    Layers { n: usize, have: usize },
    #[error(transparent)]
    Checkpoint(#[from] CatalogError),
    /// The model cannot be built for these options.
    #[error("{0}")]
    Model(#[source] ForwardError),
    /// A tensor of the bound layers does not bind.
    #[error("{0}")]
    Binding(#[source] ForwardError),
    #[error("{0}")]
    Forward(#[source] ForwardError),
    #[error("position {position}: {source}")]
    NonFinite {
        position: usize,
        #[source]
        source: NonFiniteLogits,
    },
    #[error("{}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub fn main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    match run(&a) {
        Ok(code) => code,
        Err(e) => {
            tracing::error!("k3-orch score: {e}");
            crate::error::score_exit_code(&e)
        }
    }
}

fn run(a: &Args) -> Result<i32, ScoreError> {
    if a.ids.is_empty() {
        return Err(ScoreError::EmptyIds);
    }
    // One forward holds every position's activations and KV: the same prompt limit as a
    // generation (65,000 ids once ran until memory ran out).
    let max = k3_protocol::conf::MAX_PROMPT_IDS;
    if a.ids.len() > max {
        return Err(ScoreError::TooManyIds {
            n: a.ids.len(),
            max,
        });
    }
    if a.threads == 0 {
        return Err(ScoreError::NoThreads);
    }
    let cfg_path = a
        .config
        .clone()
        .unwrap_or_else(|| a.model_dir.join("config.json"));
    let cfg = ModelConfig::load(&cfg_path)?;
    if let Some(&bad) = a.ids.iter().find(|&&i| i as usize >= cfg.vocab_size) {
        return Err(ScoreError::IdOutside {
            id: bad,
            vocab: cfg.vocab_size,
        });
    }
    if let Some(n) = a.layers {
        if n == 0 || n > cfg.n_layers() {
            return Err(ScoreError::Layers {
                n,
                have: cfg.n_layers(),
            });
        }
    }
    k3_layer_compute::kernels::tuning::install(k3_layer_compute::kernels::tuning::from_env());
    let weights = MmapWeights::open(&a.model_dir)?;
    let model = Model::new(
        cfg,
        SourceWeights::new(weights),
        ModelOptions {
            threads: a.threads,
            layers: a.layers,
            eps: None,
        },
    )
    .map_err(ScoreError::Model)?;
    model.check_binding().map_err(ScoreError::Binding)?;
    let out = model.forward_all(&a.ids).map_err(ScoreError::Forward)?;
    let vocab = model.vocab();
    for (i, row) in out.logits.chunks(vocab).enumerate() {
        k3_layer_compute::decode::check_finite(row).map_err(|source| ScoreError::NonFinite {
            position: i,
            source,
        })?;
    }
    let tf_pred: Vec<u32> = out.logits.chunks(vocab).map(|r| argmax(r) as u32).collect();
    let json = serde_json::json!({ "ids": a.ids, "tf_pred": tf_pred });
    k3_io::output::write_atomic(&a.out, format!("{json}\n").as_bytes()).map_err(|source| {
        ScoreError::Write {
            path: a.out.clone(),
            source,
        }
    })?;
    if let Some(l) = &a.logits {
        let mut bytes = Vec::with_capacity(out.logits.len() * 4);
        for v in &out.logits {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        k3_io::output::write_atomic(l, &bytes).map_err(|source| ScoreError::Write {
            path: l.clone(),
            source,
        })?;
    }
    if out.stats.expert_failures > 0 {
        for m in &out.stats.failure_msgs {
            tracing::error!("k3-orch score: {m}");
        }
        tracing::error!(
            "k3-orch score: RUN INVALID: {} routed expert load(s) failed; the predictions are unsound",
            out.stats.expert_failures
        );
        return Ok(4);
    }
    Ok(0)
}
