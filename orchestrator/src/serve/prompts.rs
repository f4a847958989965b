//! `k3-orch MODEL --prompts F.jsonl --parallel N`: many prompts through one engine (the
//! serve engine: warm stages, or `--single-process`), `N` of them decoding together
//! (continuous batching). F holds one JSON string per line (so a prompt may hold newlines;
//! blank lines are skipped); each is one prompt, tokenized (and wrapped with `--chat`) as
//! `--prompt` would be, and generated with the run's `--gen`, sampling and `--stop`.
//! Batch invariance makes each output the one a run of that prompt alone gives.
//!
//! Output: one JSON line per prompt on stdout, in F's order as they finish
//! (`{"index", "prompt_tokens", "ids", "text", "finish_reason"}`, or `"error"`); the
//! report (`--out`) holds them all with the plan's slots and chunk and the totals. Exit 0,
//! or 1 when any prompt failed.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::mpsc::UnboundedReceiver;

use super::api::Prepared;
use super::engine::{Done, Engine, EngineOptions, Event, Job, Refusal, SlotOptions};
use crate::error::{RunError, EXIT_FAILED, EXIT_OK};
use crate::run::args::GenArgs;
use crate::run::error::GenError;
use crate::run::plan::ServeShape;

/// Requests handed to the engine beyond its slots (the rest wait here, in order).
const WAITING: usize = 4;

/// How one prompt ended.
enum Outcome {
    Done(Done, String),
    Failed(String),
}

/// Run every prompt of `a.prompts`; the exit code.
pub fn run(a: &GenArgs) -> Result<i32, RunError> {
    let usage = |m: String| RunError::usage(format!("k3-orch: {m}"));
    let Some(path) = &a.prompts else {
        return Err(usage("--prompts was not given".into()));
    };
    if a.inproc {
        return Err(usage(
            "--prompts runs on the warm stages or --single-process, not --inproc".into(),
        ));
    }
    if a.dump_logits.is_some()
        || a.record.is_some()
        || a.dump_cache_trace.is_some()
        || a.record_routes.is_some()
    {
        return Err(usage(
            "--dump-logits, --record, --dump-cache-trace and --record-routes are one run's; \
             --prompts does not take them"
                .into(),
        ));
    }
    let texts = read_prompts(path).map_err(usage)?;
    let tok_dir = a
        .tok
        .clone()
        .ok_or_else(|| usage("--prompts needs --tok".into()))?;
    let tok = k3_tokenizer::Tokenizer::from_dir(&tok_dir)
        .map_err(|e| RunError::failed(format!("k3-orch: --tok {}: {e}", tok_dir.display())))?;
    let prompts = encode(a, &tok, &texts).map_err(usage)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let sampler = a.sampling.resolve(crate::run::args::random_seed);
    if !sampler.is_greedy() {
        tracing::warn!(
            "k3-orch: sampling with seed {} (repeat with --seed {0})",
            sampler.seed
        );
    }
    let engine = start_engine(a, longest + a.gen).map_err(|e| {
        if e.starts_with("REFUSING") || e.contains("\nREFUSING") {
            RunError::usage(format!("k3-orch: {e}"))
        } else {
            RunError::failed(format!("k3-orch: {e}"))
        }
    })?;
    engine
        .wait_ready()
        .map_err(|e| RunError::failed(format!("k3-orch: loading the model: {e}")))?;
    let t0 = Instant::now();
    let outcomes = run_all(&engine, a, sampler, &prompts);
    let seconds = t0.elapsed().as_secs_f64();
    engine.shutdown();
    let failed = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Failed(_)))
        .count();
    write_report(a, &engine, &prompts, &outcomes, seconds, &sampler)?;
    if failed > 0 {
        tracing::error!("k3-orch: {failed} of {} prompt(s) failed", prompts.len());
        return Ok(EXIT_FAILED);
    }
    Ok(EXIT_OK)
}

/// The prompts of a JSON-lines file: one JSON string per non-blank line.
fn read_prompts(path: &std::path::Path) -> Result<Vec<String>, String> {
    let text = k3_io::input::read_capped_string(path, k3_io::input::PROMPT_CAP)
        .map_err(|e| format!("--prompts {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(Value::String(s)) => out.push(s),
            _ => {
                return Err(format!(
                    "--prompts {}: line {} is not a JSON string (one prompt per line, as \
                     \"text\")",
                    path.display(),
                    i + 1
                ))
            }
        }
    }
    if out.is_empty() {
        return Err(format!("--prompts {}: no prompt in it", path.display()));
    }
    Ok(out)
}

/// Each prompt's ids, as `--prompt TEXT` (with `--chat`: its chat wrapping) gives them.
fn encode(
    a: &GenArgs,
    tok: &k3_tokenizer::Tokenizer,
    texts: &[String],
) -> Result<Vec<Vec<u32>>, String> {
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let ids = if a.chat {
                let req = crate::run::launch::chat_request_json(a, t);
                k3_tokenizer::chat::encode_chat_json(tok, &req)
                    .map_err(|e| format!("--prompts: prompt {i}: --chat: {e}"))?
            } else {
                tok.encode(t, false)
            };
            if ids.is_empty() {
                return Err(format!("--prompts: prompt {i} encodes to no tokens"));
            }
            if ids.len() > crate::run::args::MAX_PROMPT {
                return Err(format!(
                    "--prompts: prompt {i} is {} tokens, over the {}-token limit",
                    ids.len(),
                    crate::run::args::MAX_PROMPT
                ));
            }
            Ok(ids)
        })
        .collect()
}

/// The engine for `a`'s `--parallel` slots of `ctx` tokens, after their memory plan.
fn start_engine(a: &GenArgs, ctx: usize) -> Result<Engine, String> {
    let plan_err = |e: GenError| e.to_string();
    let shape = ServeShape {
        slots: a.parallel,
        ctx,
        chunk: a.prefill_chunk,
        prefix_entries: 0,
        prefix_bytes: None,
    };
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let (warm, plan) = if a.single_process {
        (
            None,
            crate::run::launch::serve_plan(a, &shape).map_err(plan_err)?,
        )
    } else {
        let (l, p) = crate::run::launch::warm_launch(a, &shape, WAITING).map_err(plan_err)?;
        (Some(l), p)
    };
    tracing::info!(
        "k3-orch: {} prompt(s) at once, prompts fed {} tokens per pass",
        a.parallel,
        plan.chunk
    );
    Engine::start(EngineOptions {
        model_dir: a.model_dir.clone(),
        config_path: crate::run::config_path(a),
        tok_dir: a.tok.clone(),
        threads,
        layers: a.layers,
        cache_entries: 0,
        slots: SlotOptions {
            slots: a.parallel,
            max_queue: WAITING,
            prefill_chunk: plan.chunk,
            ctx,
            prefix_bytes: plan.prefix_bytes,
        },
        warm,
    })
    .map_err(|e| e.to_string())
}

/// Hand every prompt to the engine (as its slots and queue allow) and collect each one's
/// outcome; each line goes to stdout as soon as it and the ones before it are done.
fn run_all(
    engine: &Engine,
    a: &GenArgs,
    sampler: k3_protocol::conf::SamplerConfig,
    prompts: &[Vec<u32>],
) -> Vec<Outcome> {
    let mut next = 0usize;
    let mut running: BTreeMap<usize, (UnboundedReceiver<Event>, String)> = BTreeMap::new();
    let mut done: BTreeMap<usize, Outcome> = BTreeMap::new();
    let mut printed = 0usize;
    let mut out = Vec::with_capacity(prompts.len());
    while printed < prompts.len() {
        // Hand over what the engine takes.
        while next < prompts.len() {
            let p = Prepared {
                prompt: prompts[next].clone(),
                snapshot_at: None,
                max_tokens: a.gen,
                sampler,
                stop: a.sampling.stop.clone(),
                stream: false,
                include_usage: false,
                return_token_ids: true,
                keep_logits: false,
                logprobs: None,
                n: 1,
                split: None,
            };
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            match engine.try_submit(Job::new(&p, Arc::new(AtomicBool::new(false)), tx)) {
                Ok(()) => {
                    running.insert(next, (rx, String::new()));
                    next += 1;
                }
                Err(Refusal::QueueFull(_)) => break,
                Err(e) => {
                    done.insert(next, Outcome::Failed(e.to_string()));
                    next += 1;
                }
            }
        }
        collect(&mut running, &mut done);
        while let Some(o) = done.remove(&printed) {
            println!("{}", line(printed, &prompts[printed], &o));
            out.push(o);
            printed += 1;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    out
}

/// Move the events that arrived to the running prompts' text, and the finished ones to
/// `done`.
fn collect(
    running: &mut BTreeMap<usize, (UnboundedReceiver<Event>, String)>,
    done: &mut BTreeMap<usize, Outcome>,
) {
    let mut ended = Vec::new();
    for (&i, (rx, text)) in running.iter_mut() {
        loop {
            match rx.try_recv() {
                Ok(Event::Started { .. }) => {}
                Ok(Event::Text(t)) => text.push_str(&t),
                Ok(Event::Done(d)) => {
                    ended.push((i, Outcome::Done(d, std::mem::take(text))));
                    break;
                }
                Ok(Event::Error(e)) => {
                    ended.push((i, Outcome::Failed(e)));
                    break;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    ended.push((i, Outcome::Failed("the engine stopped".into())));
                    break;
                }
            }
        }
    }
    for (i, o) in ended {
        running.remove(&i);
        done.insert(i, o);
    }
}

/// One prompt's JSON.
fn entry(i: usize, prompt: &[u32], o: &Outcome) -> Value {
    match o {
        Outcome::Done(d, text) => json!({
            "index": i,
            "prompt_tokens": prompt.len(),
            "ids": d.ids,
            "text": text,
            "finish_reason": d.finish.as_str(),
        }),
        Outcome::Failed(e) => json!({"index": i, "prompt_tokens": prompt.len(), "error": e}),
    }
}

/// One prompt's stdout line.
fn line(i: usize, prompt: &[u32], o: &Outcome) -> String {
    entry(i, prompt, o).to_string()
}

/// The JSON report (only with `--out`): every prompt with its ids, the slots, the chunk, the totals.
fn write_report(
    a: &GenArgs,
    engine: &Engine,
    prompts: &[Vec<u32>],
    outcomes: &[Outcome],
    seconds: f64,
    sampler: &k3_protocol::conf::SamplerConfig,
) -> Result<(), RunError> {
    let Some(out) = &a.out else {
        return Ok(());
    };
    let tokens: usize = outcomes
        .iter()
        .map(|o| match o {
            Outcome::Done(d, _) => d.ids.len(),
            Outcome::Failed(_) => 0,
        })
        .sum();
    let entries: Vec<Value> = outcomes
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let mut v = entry(i, &prompts[i], o);
            v["prompt_ids"] = json!(prompts[i]);
            v
        })
        .collect();
    let rep = json!({
        "engine": format!("k3-orch {}", env!("CARGO_PKG_VERSION")),
        "model_dir": a.model_dir.display().to_string(),
        "mode": if a.single_process { "single-process" } else { "multi-process" },
        "parallel": engine.slots.slots,
        "prefill_chunk": engine.slots.prefill_chunk,
        "sampling": crate::run::report::sampling_json(sampler, &a.sampling, &a.sampling_sources),
        "prompts": entries,
        "totals": {
            "prompts": prompts.len(),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_second": if seconds > 0.0 { tokens as f64 / seconds } else { 0.0 },
        },
    });
    let mut bytes = serde_json::to_vec_pretty(&rep)
        .map_err(|e| RunError::failed(format!("k3-orch: the report: {e}")))?;
    bytes.push(b'\n');
    k3_io::output::write_atomic(out, &bytes).map_err(|e| {
        RunError::failed(format!(
            "k3-orch: writing the report {}: {e}",
            out.display()
        ))
    })
}
