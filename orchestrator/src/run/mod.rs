//! One generation, `k3-orch <MODEL_DIR> ...`, top to bottom:
//!
//! 1. [`census`]: read the config and the checkpoint headers;
//! 2. [`plan`]: resolve the memory flags and add up the memory plan, refusing up front what
//!    cannot fit (exit 2);
//! 3. [`launch`]: generate through the staged pipeline (default), the same stages as threads
//!    (`--inproc`), or the forward called directly (`--single-process`) — all three run
//!    layer-compute's one decode loop;
//! 4. [`report`]: the step table, the summary and the JSON report (`--out`).
//!
//! The flags themselves are [`args`].

pub mod args;
pub mod census;
pub mod launch;
pub mod plan;
pub mod report;

use std::collections::BTreeMap;
use std::time::Instant;

use k3_model::catalog::Catalog;
use k3_model::config::ModelConfig;
use k3_protocol::conf::SamplerConfig;

use crate::error::{RunError, EXIT_OK, EXIT_UNSOUND};
use args::{GenArgs, Prompt};
use launch::{Common, Generated};
use report::{Report, StepReport, Totals};

/// Run a generation; the exit code (0, or 4 for unsound ids), or the error that ended it.
pub fn run(a: &GenArgs) -> Result<i32, RunError> {
    let usage = |m: String| RunError::usage(format!("k3-orch: {m}"));
    if !a.model_dir.is_dir() {
        return Err(usage(format!(
            "model directory {} does not exist",
            a.model_dir.display()
        )));
    }
    let config_path = a
        .config
        .clone()
        .unwrap_or_else(|| a.model_dir.join("config.json"));
    let cfg = ModelConfig::load(&config_path).map_err(|e| usage(e.to_string()))?;
    if let Some(n) = a.layers {
        if n > cfg.num_hidden_layers {
            return Err(usage(format!(
                "--layers {n}: the model has {} layers",
                cfg.num_hidden_layers
            )));
        }
    }
    let layers = a.layers.unwrap_or(cfg.num_hidden_layers);
    let cat = Catalog::open(&a.model_dir).map_err(|e| RunError::failed(format!("k3-orch: {e}")))?;
    let cen = census::census(&cfg, &cat, layers);
    let plan = plan::plan_run(a, &cfg, &cen, layers)?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let sampler = SamplerConfig {
        temperature: a.sampling.temperature,
        top_p: a.sampling.top_p,
        top_k: a.sampling.top_k,
        seed: a.sampling.seed.unwrap_or(0),
    };
    // Stop ids come from the tokenizer (its special slots follow its ranks); a run without
    // one (ids in, ids out, the tiny models) never stops early.
    let stop_ids: Vec<u32> = match &a.tok {
        Some(dir) => k3_tokenizer::Tokenizer::from_dir(dir)
            .map_err(|e| RunError::failed(format!("k3-orch: --tok {}: {e}", dir.display())))?
            .stop_ids(),
        None => Vec::new(),
    };
    if !a.quiet {
        println!(
            "k3-orch {}: {}",
            env!("CARGO_PKG_VERSION"),
            a.model_dir.display()
        );
        println!(
            "  model  : {} layers bound of {}, hidden {}, vocab {}, {} experts top-{}",
            layers,
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.vocab_size,
            cfg.num_experts,
            cfg.num_experts_per_token
        );
        if let Some(p) = &plan.preset {
            println!("  preset : {p}");
        }
        print!("{}", plan.memory.render());
        for n in &plan.notes {
            println!("  {n}");
        }
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
    };
    let t0 = Instant::now();
    let pss_sampler = report::PssSampler::start();
    let (mode, g) = if a.single_process {
        ("single-process", launch::single_process(&common)?)
    } else {
        (
            if a.inproc { "inproc" } else { "multi-process" },
            launch::staged(&common)?,
        )
    };
    let seconds = t0.elapsed().as_secs_f64();
    let pss = pss_sampler.finish();
    let failures = g.expert_failures;
    let rep = build_report(a, mode, g, plan, seconds, pss);
    if !a.quiet {
        if let Some(t) = &rep.text {
            println!("--- generated text ---\n{t}\n----------------------");
        }
        for n in &rep.notes {
            println!("{n}");
        }
        print!("{}", report::summary(&rep));
        println!(
            "ids: {}",
            rep.generated_ids
                .iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    rep.write(&a.out).map_err(|e| {
        RunError::failed(format!(
            "k3-orch: writing the report {}: {e}",
            a.out.display()
        ))
    })?;
    if failures > 0 {
        tracing::error!(
            "k3-orch: {failures} routed expert load(s) failed; the ids are unsound (exit 4)"
        );
        return Ok(EXIT_UNSOUND);
    }
    Ok(EXIT_OK)
}

/// The JSON report of a finished generation.
fn build_report(
    a: &GenArgs,
    mode: &str,
    g: Generated,
    plan: plan::RunPlan,
    seconds: f64,
    pss: Option<u64>,
) -> Report {
    let step_reports: Vec<StepReport> = g.steps.iter().map(report::to_step_report).collect();
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
    let text = match (&a.prompt, &g.text) {
        (Prompt::Ids(_), _) | (_, None) => None,
        (_, Some(t)) => Some(String::from_utf8_lossy(t).into_owned()),
    };
    let mut notes = g.notes;
    notes.extend(plan.notes);
    Report {
        engine: format!("k3-orch {}", env!("CARGO_PKG_VERSION")),
        model_dir: a.model_dir.display().to_string(),
        mode: mode.to_string(),
        incremental: a.incremental,
        prompt_ids: g.prompt_ids,
        generated_ids: g.generated,
        text,
        steps: step_reports,
        totals,
        plan: Some(plan.memory),
        stages: g.stages,
        stage_summaries: g.summaries,
        notes,
    }
}
