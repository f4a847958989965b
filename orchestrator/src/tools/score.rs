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
use k3_layer_compute::sampler::argmax;
use k3_layer_compute::{Model, ModelOptions, SourceWeights};
use k3_model::config::ModelConfig;
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

pub fn main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    match run(&a) {
        Ok(code) => code,
        Err((code, msg)) => {
            tracing::error!("k3-orch score: {msg}");
            code
        }
    }
}

fn run(a: &Args) -> Result<i32, (i32, String)> {
    if a.ids.is_empty() {
        return Err((2, "--ids is empty".into()));
    }
    // One forward holds every position's activations and KV: the same prompt limit as a
    // generation (65,000 ids once ran until memory ran out).
    let max = k3_protocol::conf::MAX_PROMPT_IDS;
    if a.ids.len() > max {
        return Err((
            2,
            format!(
                "--ids: {} ids, over the {max}-id limit of one forward",
                a.ids.len()
            ),
        ));
    }
    if a.threads == 0 {
        return Err((2, "--threads must be at least 1".into()));
    }
    let cfg_path = a
        .config
        .clone()
        .unwrap_or_else(|| a.model_dir.join("config.json"));
    let cfg = ModelConfig::load(&cfg_path).map_err(|e| (2, e.to_string()))?;
    if let Some(&bad) = a.ids.iter().find(|&&i| i as usize >= cfg.vocab_size) {
        return Err((
            2,
            format!(
                "token id {bad} is outside the vocabulary 0..{}",
                cfg.vocab_size
            ),
        ));
    }
    if let Some(n) = a.layers {
        if n == 0 || n > cfg.n_layers() {
            return Err((
                2,
                format!("--layers {n}: the model has layers 1..={}", cfg.n_layers()),
            ));
        }
    }
    k3_layer_compute::kernels::tuning::install(k3_layer_compute::kernels::tuning::from_env());
    let weights = MmapWeights::open(&a.model_dir).map_err(|e| (1, e.to_string()))?;
    let model = Model::new(
        cfg,
        SourceWeights::new(weights),
        ModelOptions {
            threads: a.threads,
            layers: a.layers,
            eps: None,
        },
    )
    .map_err(|e| (2, e.to_string()))?;
    model.check_binding().map_err(|e| (1, e.to_string()))?;
    let out = model.forward_all(&a.ids).map_err(|e| (1, e.to_string()))?;
    let vocab = model.vocab();
    for (i, row) in out.logits.chunks(vocab).enumerate() {
        k3_layer_compute::decode::check_finite(row)
            .map_err(|e| (1, format!("position {i}: {e}")))?;
    }
    let tf_pred: Vec<u32> = out.logits.chunks(vocab).map(|r| argmax(r) as u32).collect();
    let json = serde_json::json!({ "ids": a.ids, "tf_pred": tf_pred });
    k3_io::output::write_atomic(&a.out, format!("{json}\n").as_bytes())
        .map_err(|e| (1, format!("{}: {e}", a.out.display())))?;
    if let Some(l) = &a.logits {
        let mut bytes = Vec::with_capacity(out.logits.len() * 4);
        for v in &out.logits {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        k3_io::output::write_atomic(l, &bytes).map_err(|e| (1, format!("{}: {e}", l.display())))?;
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
