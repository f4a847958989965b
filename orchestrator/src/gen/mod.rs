//! The generation command: arguments, memory plan, the decode loop, the report.
//!
//! `run` is `k3-orch <MODEL_DIR> ...`: it reads the config and the checkpoint headers, adds
//! up the memory plan (refusing up front what cannot fit), then generates through the staged
//! pipeline (default), the same stages as threads (`--inproc`), or the forward pass called
//! directly (`--single-process`). All three share [`decode_loop`], so they produce the same
//! ids by construction of the code as well as by the determinism contract.

pub mod args;
pub mod plan;
pub mod report;
pub mod sampler;

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Instant;

use k3_layer_compute::forward::{ForwardError, Model, ModelOptions, StepOutput};
use k3_layer_compute::weights::{SourceWeights, Weights};
use k3_model::catalog::Catalog;
use k3_model::config::{LayerKind, ModelConfig};
use k3_protocol::messages::{Msg, Stage, StepStats};
use k3_model::mmap_weights::MmapWeights;

use crate::pipeline::{self, conf, Launch, Mode};
use args::{GenArgs, MemFlag, Parsed, Prompt};
use plan::MemoryPlan;
use report::{Report, StageReport, StepReport, Totals};

/// Default budgets when no memory flag is given (the seed's defaults).
pub const DEFAULT_TRUNK_GB: f64 = 16.0;
pub const DEFAULT_CACHE_GB: f64 = 64.0;

/// Write `bytes` to `path` through a temporary name, so a reader never sees half a file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// A step as the report shows it.
pub fn to_step_report(s: &StepStats) -> StepReport {
    StepReport {
        step: s.step as usize,
        token: s.token,
        seconds: s.seconds,
        trunk_read_bytes: s.trunk_read_bytes,
        expert_read_bytes: s.expert_read_bytes,
        expert_requests: s.expert_requests,
        resident_hits: s.resident_hits,
        trunk_hits: 0,
        trunk_binds: 0,
        io_seconds: s.io_wait_seconds,
    }
}

/// What one forward of the decode loop needs to know.
pub struct LoopOptions<'a> {
    pub prompt: &'a [u32],
    pub gen: usize,
    pub incremental: bool,
    pub sampler: sampler::SamplerConfig,
    pub stop_ids: &'a [u32],
    pub dump_logits: Option<&'a Path>,
}

/// Greedy (or seeded) decoding: `gen` tokens after `prompt`, full recompute or incremental.
/// `on_step(step, token, output, seconds)` sees every step; an error from it stops the loop.
pub fn decode_loop<W: Weights>(
    model: &Model<W>,
    o: &LoopOptions<'_>,
    mut on_step: impl FnMut(usize, u32, &StepOutput, f64) -> Result<(), String>,
) -> Result<Vec<u32>, String> {
    let vocab = model.vocab();
    let mut seq = o.prompt.to_vec();
    let mut sess = model.new_session();
    let mut generated = Vec::with_capacity(o.gen);
    for step in 0..o.gen {
        let t0 = Instant::now();
        let res: Result<StepOutput, ForwardError> = if o.incremental {
            if step == 0 {
                model.prefill(&mut sess, o.prompt)
            } else {
                model.step(&mut sess, *seq.last().expect("non-empty sequence"))
            }
        } else {
            let mut s = model.new_session();
            model.forward(&mut s, &seq, false, None)
        };
        let out = res.map_err(|e| format!("forward pass failed at generation step {step}: {e}"))?;
        let row = &out.logits[(out.rows - 1) * vocab..out.rows * vocab];
        let token = sampler::sample(row, &o.sampler, step as u64) as u32;
        if step == 0 {
            if let Some(p) = o.dump_logits {
                let bytes: Vec<u8> = row.iter().flat_map(|x| x.to_le_bytes()).collect();
                write_atomic(p, &bytes)
                    .map_err(|e| format!("--dump-logits {}: {e}", p.display()))?;
            }
        }
        on_step(step, token, &out, t0.elapsed().as_secs_f64())?;
        generated.push(token);
        seq.push(token);
        if o.stop_ids.contains(&token) {
            break;
        }
    }
    Ok(generated)
}

/// Entry point of `k3-orch <MODEL_DIR> ...`.
pub fn main(argv: Vec<OsString>) -> i32 {
    let mut args = Vec::with_capacity(argv.len());
    for a in argv.into_iter().skip(1) {
        match a.into_string() {
            Ok(s) => args.push(s),
            Err(bad) => {
                eprintln!("k3-orch: argument {bad:?} is not valid UTF-8 (put such text in a --prompt-file)");
                return 2;
            }
        }
    }
    match args::parse(&args) {
        Err(e) => {
            eprintln!("k3-orch: {e}\n(see k3-orch --help)");
            2
        }
        Ok(Parsed::Help) => {
            print!("{}", args::HELP);
            0
        }
        Ok(Parsed::ListPresets) => {
            print!("{}", k3_trunk_loader::Presets::builtin().list_text());
            0
        }
        Ok(Parsed::Run(a)) => match run(&a) {
            Ok(code) => code,
            Err((code, msg)) => {
                eprintln!("{msg}");
                code
            }
        },
    }
}

/// Sizes the plan needs, read from the config and the headers.
struct Census {
    /// Per bound layer, bytes of its trunk tensors.
    layer_bytes: Vec<u64>,
    model_bytes: u64,
    max_expert_span: u64,
    /// Routed experts in the bound layers.
    n_experts: u64,
    kda_state_bytes: u64,
    kv_per_pos: u64,
}

fn census(cfg: &ModelConfig, cat: &Catalog, layers: usize) -> Census {
    let mut layer_bytes = vec![0u64; layers];
    let mut model_bytes = 0u64;
    let mut spans: HashMap<(usize, usize), (u64, u64)> = HashMap::new();
    for (name, e) in cat.iter() {
        if let Some(rest) = name.strip_prefix("language_model.model.layers.") {
            let Some((l, tail)) = rest.split_once('.') else {
                continue;
            };
            let Ok(l) = l.parse::<usize>() else { continue };
            if l >= layers {
                continue;
            }
            if let Some(t) = tail.strip_prefix("block_sparse_moe.experts.") {
                if let Some(Ok(x)) = t.split_once('.').map(|(x, _)| x.parse::<usize>()) {
                    let s = spans.entry((l, x)).or_insert((u64::MAX, 0));
                    s.0 = s.0.min(e.offset);
                    s.1 = s.1.max(e.end());
                }
            } else {
                layer_bytes[l] += e.len;
            }
        } else if name.starts_with("language_model.") {
            model_bytes += e.len;
        }
    }
    let max_expert_span = spans.values().map(|(a, b)| b - a).max().unwrap_or(0);
    let la = &cfg.linear_attn;
    let kda_layers = (0..layers)
        .filter(|&l| cfg.layer_kind(l) == LayerKind::Kda)
        .count() as u64;
    let mla_layers = layers as u64 - kda_layers;
    let p = (la.num_heads * la.head_dim) as u64;
    let kda_state_bytes = kda_layers
        * 4
        * ((la.num_heads * la.head_dim * la.head_dim) as u64
            + 3 * (la.short_conv_kernel_size.saturating_sub(1)) as u64 * p);
    let h = cfg.num_attention_heads as u64;
    let kv_per_pos = mla_layers
        * 4
        * (cfg.kv_lora_rank as u64
            + cfg.qk_rope_head_dim as u64
            + h * (cfg.qk_nope_head_dim + cfg.v_head_dim) as u64);
    Census {
        layer_bytes,
        model_bytes,
        max_expert_span,
        n_experts: spans.len() as u64,
        kda_state_bytes,
        kv_per_pos,
    }
}

/// Resolve the memory flags left to right into (trunk, cache) bytes.
fn budgets(
    a: &GenArgs,
    trunk_total: u64,
    expert_size: u64,
    other: u64,
) -> Result<(u64, u64, Option<String>), String> {
    let presets = k3_trunk_loader::Presets::builtin();
    let gb = |x: f64| (x * plan::GB) as u64;
    let (mut t, mut c) = (gb(DEFAULT_TRUNK_GB), gb(DEFAULT_CACHE_GB));
    let mut preset = None;
    for f in &a.mem {
        match f {
            MemFlag::Preset(p) if p == "auto" => {
                let b =
                    k3_trunk_loader::presets::auto_from_meminfo(other, trunk_total, expert_size)
                        .ok_or("--preset auto: cannot read MemAvailable from /proc/meminfo")?;
                t = b.trunk_bytes;
                c = b.cache_bytes;
                preset = Some("auto".to_string());
            }
            MemFlag::Preset(p) => {
                let b = presets
                    .get(p)
                    .ok_or_else(|| format!("--preset: unknown preset '{p}' ({})", presets.names()))?
                    .budgets();
                t = b.trunk_bytes;
                c = b.cache_bytes;
                preset = Some(p.clone());
            }
            MemFlag::TrunkGb(x) => t = gb(*x),
            MemFlag::CacheGb(x) => c = gb(*x),
        }
    }
    Ok((t, c, preset))
}

type RunError = (i32, String);

/// Run a generation; the exit code, or an exit code and a message.
pub fn run(a: &GenArgs) -> Result<i32, RunError> {
    let usage = |m: String| (2, format!("k3-orch: {m}"));
    let bind = |m: String| (1, format!("k3-orch: {m}"));
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
    let cat = Catalog::open(&a.model_dir).map_err(|e| bind(e.to_string()))?;
    let cen = census(&cfg, &cat, layers);
    let trunk_total: u64 = cen.layer_bytes.iter().sum();
    let expert_slot = k3_io::slot_bytes_for(cen.max_expert_span.max(1));
    let topk = cfg.num_experts_per_token;
    let other = cen.model_bytes + cen.kda_state_bytes;
    let (trunk_budget, cache_budget, preset) =
        budgets(a, trunk_total, expert_slot, other).map_err(usage)?;

    // The memory plan.
    let mut notes = Vec::new();
    let mut mp = MemoryPlan::new(trunk_budget, cache_budget, a.trunk.is_some());
    match &a.trunk {
        Some(dir) => {
            let m = k3_model::trunk::TrunkManifest::load_dir(dir)
                .map_err(|e| usage(e.to_string()))?;
            if m.layers.len() < layers {
                return Err(usage(format!(
                    "--trunk {}: it holds {} layers, the run binds {layers}",
                    dir.display(),
                    m.layers.len()
                )));
            }
            let runs: Vec<k3_trunk_loader::LayerRun> = m.layers[..layers]
                .iter()
                .map(|l| k3_trunk_loader::LayerRun {
                    offset: l.offset,
                    len: l.padded_length,
                })
                .collect();
            let tp =
                k3_trunk_loader::plan(trunk_budget, &runs, k3_trunk_loader::RingPolicy::default())
                    .map_err(|e| usage(e.to_string()))?;
            mp.add(
                &format!("trunk ({}/{} pinned)", tp.pinned, tp.layers),
                "trunk-loader",
                tp.bytes(),
            );
            notes.push(format!(
                "trunk streamed: {}/{} layers pinned, ring {} x {}; deterministic hit rate {:.1}%",
                tp.pinned,
                tp.layers,
                tp.ring_slots,
                plan::human(tp.slot_bytes),
                100.0 * tp.hit_rate()
            ));
        }
        None => {
            mp.add("trunk (resident)", "trunk-loader", trunk_total);
            if !a.mem.is_empty() {
                notes.push(
                    "--trunk was not given: the trunk is loaded whole, whatever --trunk-gb says"
                        .into(),
                );
            }
        }
    }
    // One request batch (the union of a layer's experts over the tokens of a pass) must fit
    // in the arena at once: the fetcher publishes a batch's experts into distinct slots and
    // compute reads them in place, so a smaller arena would recycle a slot still being read.
    // A text prompt has at most one token per byte (plus the chat wrapper's few hundred).
    let prompt_bound = match &a.prompt {
        Prompt::Ids(ids) => ids.len(),
        Prompt::Text(t) => t.len() + if a.chat { 512 } else { 0 },
        Prompt::File(p) => {
            std::fs::metadata(p)
                .map(|m| m.len() as usize)
                .unwrap_or(args::MAX_PROMPT)
                + if a.chat { 512 } else { 0 }
        }
    }
    .min(args::MAX_PROMPT);
    let max_pass_tokens = if a.incremental {
        prompt_bound
    } else {
        prompt_bound + a.gen
    } as u64;
    let batch_slots = (max_pass_tokens * topk as u64)
        .min(cfg.num_experts as u64)
        .max(topk as u64);
    // Never more slots than there are experts to hold.
    let slots = (cache_budget / expert_slot)
        .min(cen.n_experts)
        .max(batch_slots);
    mp.add("expert cache", "expert-fetcher", slots * expert_slot);
    mp.add("embed + lm_head + norms", "layer-compute", cen.model_bytes);
    mp.add("recurrent state", "layer-compute", cen.kda_state_bytes);
    let positions = match &a.prompt {
        Prompt::Ids(ids) => ids.len() + a.gen + 1,
        _ => a.gen + 1,
    };
    let kv = if a.incremental {
        cen.kv_per_pos * positions as u64
    } else {
        0
    };
    mp.add("KV cache", "layer-compute", kv);
    mp.available_bytes = plan::mem_available();
    if a.incremental {
        plan::check_kv(positions, cen.kv_per_pos, mp.available_bytes).map_err(|m| (2, m))?;
    }
    mp.check().map_err(|m| (2, m))?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let sampler = sampler::SamplerConfig {
        temperature: a.sampling.temperature,
        top_p: a.sampling.top_p,
        top_k: a.sampling.top_k,
        seed: a.sampling.seed.unwrap_or(0),
    };
    // Stop ids come from the tokenizer (its special slots follow its ranks); a run without
    // one (ids in, ids out, the tiny models) never stops early.
    let stop_ids: Vec<u32> = match &a.tok {
        Some(dir) => k3_tokenizer::Tokenizer::from_dir(dir)
            .map_err(|e| (1, format!("k3-orch: --tok {}: {e}", dir.display())))?
            .stop_ids(),
        None => Vec::new(),
    };
    let inject: Vec<(u32, u32)> = std::env::var("K3_INJECT_EXPERT_FAILURES")
        .ok()
        .map(|v| {
            v.split(',')
                .filter_map(|p| {
                    let (l, e) = p.split_once(':')?;
                    Some((l.trim().parse().ok()?, e.trim().parse().ok()?))
                })
                .collect()
        })
        .unwrap_or_default();

    if !a.quiet {
        println!(
            "k3-orch {}: {}",
            env!("CARGO_PKG_VERSION"),
            a.model_dir.display()
        );
        println!(
            "  model  : {} layers bound of {}, hidden {}, vocab {}, {} experts top-{}",
            layers, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_experts, topk
        );
        if let Some(p) = &preset {
            println!("  preset : {p}");
        }
        print!("{}", mp.render());
        for n in &notes {
            println!("  {n}");
        }
    }

    let mode = if a.single_process {
        "single-process"
    } else if a.inproc {
        "inproc"
    } else {
        "multi-process"
    };
    let t0 = Instant::now();
    let (prompt_ids, generated, steps, text, stages, mut run_notes, failures, summaries) = if a
        .single_process
    {
        single_process(a, &cfg, &config_path, threads, sampler, &stop_ids)?
    } else {
        let prompt_msg = match &a.prompt {
            Prompt::Ids(_) => None,
            Prompt::Text(t) if a.chat => Some(Msg::EncodeChat {
                req: 1,
                chat_json: serde_json::json!([{"role": "user", "content": t}]).to_string(),
            }),
            Prompt::Text(t) => Some(Msg::EncodeText {
                req: 1,
                text: t.clone(),
                allow_specials: false,
            }),
            Prompt::File(p) => {
                let bytes = std::fs::read(p)
                    .map_err(|e| usage(format!("--prompt-file {}: {e}", p.display())))?;
                if a.chat {
                    let t = String::from_utf8(bytes).map_err(|_| {
                        usage(format!(
                            "--prompt-file {} is not UTF-8, which --chat needs",
                            p.display()
                        ))
                    })?;
                    Some(Msg::EncodeChat {
                        req: 1,
                        chat_json: serde_json::json!([{"role": "user", "content": t}]).to_string(),
                    })
                } else {
                    Some(Msg::EncodeBytes {
                        req: 1,
                        bytes,
                        allow_specials: false,
                    })
                }
            }
        };
        let prompt_ids = match &a.prompt {
            Prompt::Ids(ids) => ids.clone(),
            _ => Vec::new(),
        };
        let mut budgets = HashMap::new();
        let headroom = 256u64 << 20;
        budgets.insert(
            Stage::TrunkLoader,
            mp.stage_bytes("trunk-loader") + headroom,
        );
        budgets.insert(
            Stage::ExpertFetcher,
            mp.stage_bytes("expert-fetcher") + headroom,
        );
        budgets.insert(
            Stage::LayerCompute,
            mp.stage_bytes("layer-compute") + headroom + (512u64 << 20),
        );
        budgets.insert(Stage::Tokenizer, headroom + (256u64 << 20));
        // Test hook (tests/e2e/faults.rs, OOM): `K3_STAGE_BUDGET_OVERRIDE=stage=bytes,...`
        // replaces a stage's cgroup budget.
        if let Ok(v) = std::env::var("K3_STAGE_BUDGET_OVERRIDE") {
            for (s, b) in v.split(',').filter_map(|x| x.split_once('=')) {
                if let (Some(s), Ok(b)) = (Stage::parse(s.trim()), b.trim().parse::<u64>()) {
                    budgets.insert(s, b);
                }
            }
        }
        let launch = Launch {
            mode: if a.inproc {
                Mode::Threads
            } else {
                Mode::Processes
            },
            tokenizer: conf::TokenizerConf {
                tok_dir: a.tok.clone(),
                record_dir: a.record.clone(),
            },
            trunk: conf::TrunkConf {
                model_dir: a.model_dir.clone(),
                trunk_dir: a.trunk.clone(),
                budget_bytes: trunk_budget,
                layers,
                record_dir: a.record.clone(),
            },
            fetcher: conf::FetcherConf {
                model_dir: a.model_dir.clone(),
                cache_bytes: cache_budget,
                min_slots: slots as usize,
                max_slots: cen.n_experts.max(topk as u64) as usize,
                readers: 16,
                inject_failures: inject,
                trace_dir: a.dump_cache_trace.clone(),
                record_dir: a.record.clone(),
            },
            compute: conf::ComputeConf {
                model_dir: a.model_dir.clone(),
                config_path: config_path.clone(),
                layers: a.layers,
                prompt_ids,
                gen: a.gen,
                incremental: a.incremental,
                sampler,
                threads,
                dump_logits: a.dump_logits.clone(),
                io_timeout_s: a.stage_timeout_s,
                stop_ids: stop_ids.clone(),
                record_dir: a.record.clone(),
            },
            prompt: prompt_msg,
            stage_timeout: std::time::Duration::from_secs_f64(a.stage_timeout_s),
            budgets: budgets.clone(),
            require_cgroups: a.require_cgroups,
            numa: a.numa.clone(),
            quiet: a.quiet,
        };
        let out = pipeline::run(&launch).map_err(|f| (f.code, f.msg))?;
        let failures: u64 = out.steps.iter().map(|s| s.expert_failures).sum();
        let stages = Stage::WORKERS
            .iter()
            .map(|s| {
                let n = s.name().to_string();
                StageReport {
                    name: n.clone(),
                    pid: out.pids.get(&n).copied().unwrap_or(0),
                    budget_bytes: budgets.get(s).copied(),
                    cgroup: out.cgroups.get(&n).map(|c| c.0.clone()),
                    peak_rss_bytes: out.peak_rss.get(&n).copied().unwrap_or(0),
                    cgroup_peak_bytes: out.cgroups.get(&n).and_then(|c| c.2),
                    numa: out.numa.get(&n).map(|x| format!("node {x}")),
                }
            })
            .collect();
        let mut notes = out.notes.clone();
        for (k, v) in &out.summaries {
            if let Some(r) = v.get("report").and_then(|r| r.as_str()) {
                notes.push(format!("{k}: {r}"));
            }
        }
        (
            out.prompt_ids,
            out.generated,
            out.steps,
            Some(out.text),
            stages,
            notes,
            failures,
            out.summaries,
        )
    };
    let seconds = t0.elapsed().as_secs_f64();
    run_notes.extend(notes);
    let step_reports: Vec<StepReport> = steps.iter().map(to_step_report).collect();
    let mut totals = Totals {
        tokens: generated.len(),
        seconds,
        s_per_token: if generated.is_empty() {
            0.0
        } else {
            seconds / generated.len() as f64
        },
        ..Default::default()
    };
    for s in &steps {
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
    totals.experts_failed = failures;
    let mut peaks: BTreeMap<String, u64> = BTreeMap::new();
    for st in &stages {
        peaks.insert(st.name.clone(), st.peak_rss_bytes);
    }
    let own = pipeline::supervisor::self_peak_rss();
    peaks.insert("orchestrator".into(), own);
    let total: u64 = peaks.values().sum();
    peaks.insert("total".into(), total);
    totals.peak_rss_bytes = peaks;
    let text_str = match (&a.prompt, &text) {
        (Prompt::Ids(_), _) | (_, None) => None,
        (_, Some(t)) => Some(String::from_utf8_lossy(t).into_owned()),
    };
    let rep = Report {
        engine: format!("k3-orch {}", env!("CARGO_PKG_VERSION")),
        model_dir: a.model_dir.display().to_string(),
        mode: mode.to_string(),
        incremental: a.incremental,
        prompt_ids,
        generated_ids: generated.clone(),
        text: text_str.clone(),
        steps: step_reports,
        totals,
        plan: Some(mp),
        stages,
        stage_summaries: summaries,
        notes: run_notes.clone(),
    };
    if !a.quiet {
        if let Some(t) = &text_str {
            println!("--- generated text ---\n{t}\n----------------------");
        }
        for n in &run_notes {
            println!("{n}");
        }
        print!("{}", report::summary(&rep));
        println!(
            "ids: {}",
            generated
                .iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    rep.write(&a.out).map_err(|e| {
        (
            1,
            format!("k3-orch: writing the report {}: {e}", a.out.display()),
        )
    })?;
    if failures > 0 {
        eprintln!("k3-orch: {failures} routed expert load(s) failed; the ids are unsound (exit 4)");
        return Ok(4);
    }
    Ok(0)
}

type RunParts = (
    Vec<u32>,
    Vec<u32>,
    Vec<StepStats>,
    Option<Vec<u8>>,
    Vec<StageReport>,
    Vec<String>,
    u64,
    BTreeMap<String, serde_json::Value>,
);

/// `--single-process`: the forward called directly over mmapped shards.
fn single_process(
    a: &GenArgs,
    cfg: &ModelConfig,
    _config_path: &Path,
    threads: usize,
    sampler: sampler::SamplerConfig,
    stop_ids: &[u32],
) -> Result<RunParts, RunError> {
    let prompt: Vec<u32> = match &a.prompt {
        Prompt::Ids(ids) => ids.clone(),
        other => {
            let dir = a
                .tok
                .as_ref()
                .ok_or((2, "k3-orch: a text prompt needs --tok".to_string()))?;
            let tok =
                k3_tokenizer::Tokenizer::from_dir(dir).map_err(|e| (1, format!("k3-orch: {e}")))?;
            match other {
                Prompt::Text(t) => tok.encode(t, false),
                Prompt::File(p) => {
                    let b = std::fs::read(p)
                        .map_err(|e| (2, format!("k3-orch: {}: {e}", p.display())))?;
                    tok.encode_bytes(&b, false)
                }
                Prompt::Ids(_) => unreachable!("handled above"),
            }
        }
    };
    let mw = MmapWeights::open(&a.model_dir).map_err(|e| (1, format!("k3-orch: {e}")))?;
    let model = Model::new(
        cfg.clone(),
        SourceWeights::new(mw),
        ModelOptions {
            threads,
            layers: a.layers,
            eps: None,
        },
    )
    .map_err(|e| (1, format!("k3-orch: {e}")))?;
    let mut steps = Vec::new();
    let mut failures = 0u64;
    if !a.quiet {
        println!("{}", report::step_header());
    }
    let generated = decode_loop(
        &model,
        &LoopOptions {
            prompt: &prompt,
            gen: a.gen,
            incremental: a.incremental,
            sampler,
            stop_ids,
            dump_logits: a.dump_logits.as_deref(),
        },
        |step, token, out, secs| {
            failures += out.stats.expert_failures as u64;
            let st = StepStats {
                step: step as u32,
                token,
                seconds: secs,
                expert_requests: out.stats.expert_requests as u64,
                expert_failures: out.stats.expert_failures as u64,
                ..Default::default()
            };
            if !a.quiet {
                println!("{}", report::step_line(&to_step_report(&st)));
            }
            steps.push(st);
            Ok(())
        },
    )
    .map_err(|e| (1, format!("k3-orch: {e}")))?;
    let text = a.tok.as_ref().and_then(|d| {
        let tok = k3_tokenizer::Tokenizer::from_dir(d).ok()?;
        tok.decode_bytes(&generated).ok()
    });
    Ok((
        prompt,
        generated,
        steps,
        text,
        Vec::new(),
        Vec::new(),
        failures,
        BTreeMap::new(),
    ))
}

/// `k3-orch demo`.
pub fn demo(argv: Vec<OsString>) -> i32 {
    let mut extra: Vec<String> = Vec::new();
    for a in argv.into_iter().skip(1) {
        match a.into_string() {
            Ok(s) if s == "--help" || s == "-h" => {
                println!("usage: k3-orch demo [--inproc|--single-process] [--keep DIR] [generation flags]");
                println!("runs the bundled tiny model (tiny-mxfp4) through the staged pipeline and checks");
                println!("its greedy ids against the k3ref and llama.cpp oracles; the last line is a VERDICT.");
                return 0;
            }
            Ok(s) => extra.push(s),
            Err(_) => {
                eprintln!("k3-orch demo: arguments must be UTF-8");
                return 2;
            }
        }
    }
    let mut keep: Option<PathBuf> = None;
    if let Some(i) = extra.iter().position(|x| x == "--keep") {
        if i + 1 >= extra.len() {
            eprintln!("k3-orch demo: --keep needs a directory");
            return 2;
        }
        keep = Some(PathBuf::from(extra.remove(i + 1)));
        extra.remove(i);
    }
    let tmp = match &keep {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("k3-demo-{}", std::process::id())),
    };
    let dir = match crate::cmd::demo::extract_bundled(&tmp) {
        Ok(d) => d,
        Err(e) => {
            eprintln!(
                "k3-orch demo: writing the bundled model to {}: {e}",
                tmp.display()
            );
            return 1;
        }
    };
    let (prompt, k3ref_full) = crate::cmd::demo::oracle_ids(crate::cmd::demo::EXPECTED_K3REF)
        .expect("bundled oracle parses");
    let (_, llama_full) = crate::cmd::demo::oracle_ids(crate::cmd::demo::EXPECTED_LLAMACPP)
        .expect("bundled oracle parses");
    let n_new = k3ref_full.len() - prompt.len();
    let out = tmp.join("k3_run.json");
    let mut args: Vec<String> = vec![
        dir.display().to_string(),
        "--ids".into(),
        prompt
            .iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(","),
        "--gen".into(),
        n_new.to_string(),
        "--incremental".into(),
        "--out".into(),
        out.display().to_string(),
    ];
    args.extend(extra);
    println!(
        "k3-orch demo: the bundled tiny-mxfp4 model (13 layers, MXFP4 experts, released layout)"
    );
    println!("              through tokenizer, trunk-loader, expert-fetcher and layer-compute\n");
    let parsed = match args::parse(&args) {
        Ok(Parsed::Run(a)) => a,
        Ok(_) => return 0,
        Err(e) => {
            eprintln!("k3-orch demo: {e}");
            return 2;
        }
    };
    let code = match run(&parsed) {
        Ok(c) => c,
        Err((c, m)) => {
            eprintln!("{m}");
            c
        }
    };
    if code != 0 {
        println!("VERDICT: FAILED (the run exited {code})");
        return code;
    }
    let got: Vec<u32> = std::fs::read(&out)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| {
            v.get("generated_ids")?
                .as_array()?
                .iter()
                .map(|x| x.as_u64().map(|n| n as u32))
                .collect()
        })
        .unwrap_or_default();
    if keep.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let want = &k3ref_full[prompt.len()..];
    let want_llama = &llama_full[prompt.len()..];
    let same = got.iter().zip(want).filter(|(a, b)| a == b).count();
    if got == want && got == want_llama {
        println!(
            "VERDICT: PASS - {same}/{} generated ids identical to k3ref (float64 numpy reference) and to llama.cpp's kimi-k3 graph",
            want.len()
        );
        0
    } else {
        println!(
            "VERDICT: MISMATCH - {same}/{} generated ids match k3ref\n  got  {got:?}\n  want {want:?}",
            want.len()
        );
        1
    }
}
