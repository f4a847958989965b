//! One generation, `k3-orch <MODEL_DIR> ...`, top to bottom:
//!
//! 1. [`sizes`]: read the config and the checkpoint headers;
//! 2. [`plan`]: resolve the memory flags and add up the memory plan, refusing up front what
//!    cannot fit (exit 2);
//! 3. [`launch`]: generate through the staged pipeline (default), the same stages as threads
//!    (`--inproc`), or the forward called directly (`--single-process`) — all three run
//!    layer-compute's one decode loop;
//! 4. [`report`]: the step table, the summary and the JSON report (`--out`).
//!
//! [`floor`] is the opt-in read floor of `--single-process` decode steps (`K3_FLOOR=1`).
//!
//! The flags themselves are [`args`]; what a run takes when they do not say (thinking, the
//! tokenizer directory, the sampling of `generation_config.json`) is [`defaults`], shared
//! with `chat` and `serve`; what ends a generation is [`GenError`].

pub mod args;
pub mod defaults;
pub mod disk;
pub mod error;
pub mod floor;
pub mod launch;
pub mod plan;
pub mod report;
pub mod sizes;
pub mod stream;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use k3_model::catalog::Catalog;
use k3_model::config::ModelConfig;
use k3_protocol::conf::SamplerConfig;

use crate::error::{RunError, EXIT_OK, EXIT_UNSOUND};
use args::{GenArgs, Prompt};
pub use error::GenError;
use launch::{Common, Generated};
use report::{Report, StepReport, Totals};

/// The config file a generation reads: `--config`, or the model dir's `config.json`.
pub(crate) fn config_path(a: &GenArgs) -> std::path::PathBuf {
    a.config
        .clone()
        .unwrap_or_else(|| a.model_dir.join("config.json"))
}

/// The model a generation runs: its config (`--config` or the model dir's), the shard
/// catalog, and the layer count (`--layers`, refused past the model's); a `--trunk` and an
/// `--experts` pack are checked against the catalog, the test hooks checked (`launch::check_test_hooks`). Shared
/// by the one-shot run and the warm pipeline of `serve`/`chat`.
pub(crate) fn open_model(a: &GenArgs) -> Result<(ModelConfig, Catalog, usize), GenError> {
    launch::check_test_hooks()?;
    let config_path = config_path(a);
    let cfg = ModelConfig::load(&config_path)?;
    if let Some(n) = a.layers {
        if n > cfg.num_hidden_layers {
            return Err(GenError::Layers {
                want: n,
                have: cfg.num_hidden_layers,
            });
        }
    }
    let layers = a.layers.unwrap_or(cfg.num_hidden_layers);
    let cat = Catalog::open(&a.model_dir)?;
    if let Some(dir) = &a.trunk {
        let m = k3_model::trunk::TrunkManifest::load_dir(dir)?;
        m.check_against(&cat)
            .map_err(|source| GenError::TrunkSource {
                dir: dir.clone(),
                source,
            })?;
    }
    if !a.experts.is_empty() {
        let pack = k3_model::experts::PackedExperts::open(&a.experts).map_err(GenError::Experts)?;
        pack.check_against(&cat).map_err(GenError::Experts)?;
    }
    Ok((cfg, cat, layers))
}

/// Run a generation; the exit code (0, or 4 for unsound ids), or the error that ended it
/// in its final form (`crate::error`).
pub fn run(a: &GenArgs) -> Result<i32, RunError> {
    if a.prompts.is_some() {
        // Many prompts at once, on the serve engine, after the same checks.
        checked_model(a)?;
        return crate::serve::prompts::run(a);
    }
    generate(a).map_err(RunError::from)
}

/// Refused up front (exit 2) unless `dir` is a directory: missing ([`GenError::NoModelDir`]),
/// or there but not one or not readable ([`GenError::ModelDir`]: a file, a symlink loop,
/// permission denied on it or above it). The run and `serve` both check with it.
pub fn check_model_dir(dir: &std::path::Path) -> Result<(), GenError> {
    let bad = |why: String| GenError::ModelDir {
        path: dir.to_path_buf(),
        why,
    };
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) => Err(bad(format!(
            "{}, not a directory",
            k3_io::input::kind_name(m.file_type())
        ))),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Err(bad("a symbolic link loop".into())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(GenError::NoModelDir(dir.to_path_buf()))
        }
        Err(e) => Err(bad(e.to_string())),
    }
}

/// The model `a` names, opened, and the flags checked against it.
fn checked_model(a: &GenArgs) -> Result<(ModelConfig, Catalog, usize), GenError> {
    check_model_dir(&a.model_dir)?;
    let (cfg, cat, layers) = open_model(a)?;
    preflight(a, &cfg)?;
    Ok((cfg, cat, layers))
}

/// [`run`], with its typed error.
fn generate(a: &GenArgs) -> Result<i32, GenError> {
    let (cfg, cat, layers) = checked_model(a)?;
    let config_path = config_path(a);
    let sizes = sizes::model_sizes(&cfg, &cat, layers);
    let plan = plan::plan_run(a, &cfg, &sizes, layers)?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let sampler = sampler_of(a);
    // Stop ids come from the tokenizer (its special slots follow its ranks); a run without
    // one (ids in, ids out, the tiny models) never stops early.
    let tok = load_tokenizer(a)?;
    let stop_ids: Vec<u32> = tok.as_ref().map_or_else(Vec::new, |t| t.stop_ids());
    if !a.quiet {
        log_header(a, &cfg, layers, &plan);
    }
    let common = Common {
        args: a,
        cfg: &cfg,
        config_path: &config_path,
        layers,
        plan: &plan,
        threads,
        sampler,
        stop_ids,
        tok,
    };
    let t0 = Instant::now();
    // One process in the in-process modes: its own peak RSS is the run's peak, and walking
    // its page tables would only cost time (5% of a slice prefill at 200 ms).
    let pss_sampler = (!a.single_process && !a.inproc).then(report::PssSampler::start);
    let (mode, g) = if a.single_process {
        ("single-process", launch::single_process(&common)?)
    } else {
        (
            if a.inproc { "inproc" } else { "multi-process" },
            launch::staged(&common)?,
        )
    };
    let seconds = t0.elapsed().as_secs_f64();
    let pss = pss_sampler.and_then(report::PssSampler::finish);
    let failures = g.expert_failures;
    let rep = build_report(a, mode, g, plan, seconds, &sampler, pss);
    print_outcome(a, &rep);
    if let Some(out) = &a.out {
        rep.write(out).map_err(|source| GenError::Report {
            path: out.clone(),
            source,
        })?;
    }
    if failures > 0 {
        tracing::error!(
            "k3-orch: {failures} routed expert load(s) failed; the ids are unsound (exit 4)"
        );
        return Ok(EXIT_UNSOUND);
    }
    Ok(EXIT_OK)
}

/// The run's sampler; a sampled run's seed is logged even with `--quiet` (without it the
/// run could not be repeated).
fn sampler_of(a: &GenArgs) -> SamplerConfig {
    let sampler: SamplerConfig = a.sampling.resolve(args::random_seed);
    if !sampler.is_greedy() {
        let from_file = a
            .sampling_sources
            .0
            .iter()
            .any(|(_, s)| *s == defaults::Source::GenerationConfig);
        tracing::warn!(
            "k3-orch: sampling with seed {}{} (repeat with --seed {}){}",
            sampler.seed,
            if a.sampling.seed.is_none() {
                " (random)"
            } else {
                ""
            },
            sampler.seed,
            if from_file {
                "; defaults from the model's generation_config.json (--temp 0 for greedy)"
            } else {
                ""
            }
        );
    }
    sampler
}

/// The `--tok` tokenizer, loaded once here: the stop ids, and single-process mode's
/// encoding and text.
fn load_tokenizer(a: &GenArgs) -> Result<Option<Arc<k3_tokenizer::Tokenizer>>, GenError> {
    let Some(dir) = &a.tok else {
        return Ok(None);
    };
    // The directory is the user's (`--tok`, or the model directory's files): a tokenizer
    // that does not load is a usage error, refused before anything starts.
    let t = k3_tokenizer::Tokenizer::from_dir(dir).map_err(|source| GenError::Tokenizer {
        dir: dir.clone(),
        source,
    })?;
    if a.ctx_size.is_some() && !matches!(a.prompt, Prompt::Ids(_)) {
        let n = launch::encode_locally(a, &t)?.len();
        args::check_ctx_size(a.ctx_size, n, a.gen).map_err(GenError::CtxSize)?;
    }
    Ok(Some(Arc::new(t)))
}

/// The lines before the run: the model bound, the preset, the memory plan and its notes.
fn log_header(a: &GenArgs, cfg: &ModelConfig, layers: usize, plan: &plan::RunPlan) {
    tracing::info!(
        "k3-orch {}: {}",
        env!("CARGO_PKG_VERSION"),
        a.model_dir.display()
    );
    tracing::info!(
        "  model  : {} layers bound of {}, hidden {}, vocab {}, {} experts top-{}",
        layers,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        cfg.num_experts,
        cfg.num_experts_per_token
    );
    if let Some(p) = &plan.preset {
        tracing::info!("  preset : {p}");
    }
    tracing::info!("{}", plan.memory.render().trim_end());
    for n in &plan.notes {
        tracing::info!("  {n}");
    }
}

/// The run's output: the text was streamed to stdout as it decoded; without a tokenizer
/// the ids are the output. The rest is diagnostics (stderr, dropped by --quiet).
fn print_outcome(a: &GenArgs, rep: &Report) {
    let ids_line = rep
        .generated_ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    if rep.text.is_none() {
        println!("ids: {ids_line}");
    }
    if !a.quiet {
        for n in &rep.notes {
            tracing::info!("{n}");
        }
        tracing::info!("{}", report::summary(rep).trim_end());
        if rep.text.is_some() {
            tracing::info!("ids: {ids_line}");
        }
    }
}

/// What can be refused before any stage starts (exit 2): a packed trunk of another
/// checkpoint, prompt ids outside the vocabulary, output paths that cannot take a file
/// (`k3_io::output::check_target`: a missing directory, a directory, a dangling symlink or
/// a loop, a FIFO no one reads, `/proc`), a `--record` that is not a directory.
fn preflight(a: &GenArgs, cfg: &ModelConfig) -> Result<(), GenError> {
    if let Prompt::Ids(ids) = &a.prompt {
        let vocab = cfg.vocab_size;
        let bad: Vec<String> = ids
            .iter()
            .filter(|&&i| i as u64 >= vocab as u64)
            .take(5)
            .map(|i| i.to_string())
            .collect();
        if !bad.is_empty() {
            return Err(GenError::IdsOutside {
                bad: bad.join(", "),
                vocab,
            });
        }
    }
    for (flag, p) in [
        ("--out", &a.out),
        ("--dump-logits", &a.dump_logits),
        ("--record-routes", &a.record_routes),
        ("--save-state", &a.save_state),
    ] {
        if let Some(p) = p {
            k3_io::output::check_target(p).map_err(|why| GenError::OutputRefused {
                flag,
                path: p.clone(),
                why,
            })?;
        }
    }
    // Directories the run creates: only their last component (never `mkdir -p`).
    for (flag, d) in [
        ("--record", &a.record),
        ("--dump-cache-trace", &a.dump_cache_trace),
    ] {
        let Some(d) = d else { continue };
        match std::fs::symlink_metadata(d) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(GenError::RecordNotDir {
                    flag,
                    path: d.clone(),
                })
            }
            Err(_) => {
                let parent = parent_dir(d);
                if !parent.is_dir() {
                    return Err(GenError::RecordDirMissing {
                        flag,
                        path: d.clone(),
                        dir: parent.to_path_buf(),
                    });
                }
            }
        }
    }
    Ok(())
}

/// The directory a path's file goes in (`.` for a bare name).
fn parent_dir(p: &std::path::Path) -> &std::path::Path {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    }
}

/// The JSON report of a finished generation.
fn build_report(
    a: &GenArgs,
    mode: &str,
    g: Generated,
    plan: plan::RunPlan,
    seconds: f64,
    sampler: &SamplerConfig,
    pss: Option<u64>,
) -> Report {
    let mut step_reports: Vec<StepReport> = g.steps.iter().map(report::to_step_report).collect();
    for (r, b) in step_reports.iter_mut().zip(&g.disk_busy) {
        r.disk_busy_seconds = *b;
    }
    let mut totals = Totals {
        tokens: g.generated.len(),
        seconds,
        s_per_token: if g.generated.is_empty() {
            0.0
        } else {
            seconds / g.generated.len() as f64
        },
        ..Default::default()
    };
    for s in &g.steps {
        totals.trunk_read_bytes += s.trunk_read_bytes;
        totals.expert_read_bytes += s.expert_read_bytes;
        totals.expert_requests += s.expert_requests;
        totals.resident_hits += s.resident_hits;
        totals.io_seconds += s.io_wait_seconds;
    }
    totals.io_share = if seconds > 0.0 {
        totals.io_seconds / seconds
    } else {
        0.0
    };
    totals.experts_failed = g.expert_failures;
    totals.disk_busy = report::disk_busy_totals(&step_reports, g.disks.clone());
    totals.speculation = g
        .summaries
        .get("expert-fetcher")
        .map(|f| f["speculation"].clone())
        .filter(|v| !v.is_null());
    let mut peaks: BTreeMap<String, u64> = BTreeMap::new();
    for st in &g.stages {
        peaks.insert(st.name.clone(), st.peak_rss_bytes);
    }
    let own = crate::supervise::spawn::self_peak_rss();
    peaks.insert("orchestrator".into(), own);
    totals.peak_rss_bytes = peaks;
    // In-process modes have one process: its peak RSS is the run's peak.
    let (peak, source) = if g.stages.is_empty() || mode == "inproc" {
        (Some(own), "the one process's peak RSS".to_string())
    } else {
        report::true_peak(&g.stages, own, pss)
    };
    totals.peak_bytes = peak;
    totals.peak_source = source;
    totals.peak_pss_bytes = pss;
    let text = g
        .text
        .as_ref()
        .map(|t| String::from_utf8_lossy(t).into_owned());
    let mut notes = g.notes;
    notes.extend(plan.notes);
    let path = k3_layer_compute::kernels::simd::Kernel::selected(
        &k3_layer_compute::kernels::tuning::from_env(),
    )
    .name();
    let prefill = match (&a.load_state, step_reports.first()) {
        (None, Some(first)) => Some(report::PrefillReport::of(first, g.prompt_ids.len(), path)),
        _ => None,
    };
    Report {
        engine: format!("k3-orch {}", env!("CARGO_PKG_VERSION")),
        model_dir: a.model_dir.display().to_string(),
        mode: mode.to_string(),
        incremental: a.incremental,
        sampling: report::sampling_json(sampler, &a.sampling, &a.sampling_sources),
        prompt_ids: g.prompt_ids,
        generated_ids: g.generated,
        text,
        steps: step_reports,
        prefill,
        totals,
        plan: Some(plan.memory),
        stages: g.stages,
        stage_summaries: g.summaries,
        notes,
    }
}
