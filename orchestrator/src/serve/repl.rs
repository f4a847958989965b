//! `k3-orch chat MODEL_DIR --tok DIR`: a multi-turn chat on the warm engine. Each stdin line
//! is one user turn (so it works from a pipe as well as a terminal); the reply streams to
//! stdout as it decodes. Commands: `/reset`, `/save FILE`, `/load FILE` (the conversation
//! as JSON), `/exit`. Follow-up turns reuse the previous turns' state (prefix reuse).

use std::ffi::OsString;
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::Parser;
use serde_json::{json, Value};

use super::engine::{Event, Job};
use super::ModelFlags;
use crate::error::{EXIT_FAILED, EXIT_OK, EXIT_USAGE};

/// Command line of `k3-orch chat`.
#[derive(Parser, Debug)]
#[command(
    name = "k3-orch chat",
    about = "Interactive multi-turn chat (one stdin line per turn; /reset /save FILE /load FILE /exit)"
)]
struct ChatArgs {
    #[command(flatten)]
    model: ModelFlags,
    /// A system message at the start of the conversation
    #[arg(long)]
    system: Option<String>,
    /// Tokens per reply at most
    #[arg(long = "gen", short = 'n', default_value_t = 256)]
    gen: usize,
    /// Thinking mode (the reply opens a think block); off by default
    #[arg(long)]
    thinking: bool,
    /// Sampling temperature (greedy by default)
    #[arg(long, alias = "temp")]
    temperature: Option<f32>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    min_p: Option<f32>,
    #[arg(long, alias = "repetition-penalty")]
    repeat_penalty: Option<f32>,
    #[arg(long, short = 's')]
    seed: Option<u64>,
    /// Print token counts and speed after each reply (stderr)
    #[arg(long)]
    stats: bool,
}

pub fn chat_main(argv: Vec<OsString>) -> i32 {
    let a = match crate::tools::parse_args::<ChatArgs>(argv) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let engine = match a.model.engine() {
        Ok(e) => e,
        Err(e) => {
            tracing::error!("k3-orch chat: {e}");
            return EXIT_USAGE;
        }
    };
    if let Err(e) = engine.wait_ready() {
        tracing::error!("k3-orch chat: {e}");
        return EXIT_FAILED;
    }
    let lim = a.model.limits();
    let tty = std::io::stdin().is_terminal();
    let mut messages: Vec<Value> = Vec::new();
    let reset = |m: &mut Vec<Value>| {
        m.clear();
        if let Some(s) = &a.system {
            m.push(json!({"role": "system", "content": s}));
        }
    };
    reset(&mut messages);
    if tty {
        eprintln!("k3-orch chat: type a message; /reset /save FILE /load FILE /exit");
    }
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if tty {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
        let line = match lines.next() {
            None => break,
            Some(Ok(l)) => l,
            Some(Err(e)) => {
                tracing::error!("k3-orch chat: reading stdin: {e}");
                return EXIT_FAILED;
            }
        };
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        if let Some(cmd) = line.strip_prefix('/') {
            let (name, arg) = cmd.split_once(' ').unwrap_or((cmd, ""));
            match (name, arg.trim()) {
                ("exit" | "quit", _) => break,
                ("reset", _) => {
                    reset(&mut messages);
                    eprintln!("(conversation reset)");
                }
                ("save", f) if !f.is_empty() => {
                    let body = json!({"k3_chat": 1, "messages": messages});
                    match std::fs::write(f, serde_json::to_vec_pretty(&body).unwrap_or_default()) {
                        Ok(()) => eprintln!("(saved {} messages to {f})", messages.len()),
                        Err(e) => eprintln!("(cannot save {f}: {e})"),
                    }
                }
                ("load", f) if !f.is_empty() => match load(f) {
                    Ok(m) => {
                        eprintln!("(loaded {} messages from {f})", m.len());
                        messages = m;
                    }
                    Err(e) => eprintln!("(cannot load {f}: {e})"),
                },
                _ => eprintln!("(commands: /reset, /save FILE, /load FILE, /exit)"),
            }
            continue;
        }
        messages.push(json!({"role": "user", "content": line}));
        let mut body = json!({
            "messages": messages, "max_tokens": a.gen.min(lim.max_tokens), "thinking": a.thinking,
            "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p, "min_p": a.min_p,
            "repetition_penalty": a.repeat_penalty, "seed": a.seed,
        });
        if a.thinking {
            body["reasoning_effort"] = json!("max");
        }
        let p = match super::api::chat(&engine.tok, &body, &lim) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("(refused: {})", e.message);
                messages.pop();
                continue;
            }
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        engine
            .stats
            .queue
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if let Err(e) = engine.submit(Job {
            prompt: p.prompt,
            snapshot_at: p.snapshot_at,
            max_tokens: p.max_tokens,
            sampler: p.sampler,
            stop: p.stop,
            cancel: Arc::new(AtomicBool::new(false)),
            events: tx,
        }) {
            tracing::error!("k3-orch chat: {e}");
            return EXIT_FAILED;
        }
        let mut reply = String::new();
        let mut out = std::io::stdout().lock();
        loop {
            match rx.blocking_recv() {
                Some(Event::Started { .. }) => {}
                Some(Event::Text(t)) => {
                    reply.push_str(&t);
                    let _ = out.write_all(t.as_bytes());
                    let _ = out.flush();
                }
                Some(Event::Done(d)) => {
                    let _ = writeln!(out);
                    let _ = out.flush();
                    if a.stats {
                        eprintln!(
                            "({} prompt tokens, {} reused; {} generated in {:.2} s; {})",
                            d.prompt_tokens,
                            d.cached_tokens,
                            d.completion_tokens,
                            d.seconds,
                            d.finish.as_str()
                        );
                    }
                    break;
                }
                Some(Event::Error(e)) => {
                    let _ = writeln!(out);
                    tracing::error!("k3-orch chat: {e}");
                    messages.pop();
                    break;
                }
                None => {
                    tracing::error!("k3-orch chat: the engine stopped");
                    return EXIT_FAILED;
                }
            }
        }
        if messages.last().and_then(|m| m.get("role")) == Some(&json!("user")) {
            messages.push(json!({"role": "assistant", "content": reply}));
        }
    }
    engine.shutdown();
    EXIT_OK
}

fn load(f: &str) -> Result<Vec<Value>, String> {
    let b = std::fs::read(f).map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_slice(&b).map_err(|e| format!("not JSON: {e}"))?;
    if v.get("k3_chat").and_then(Value::as_u64) != Some(1) {
        return Err("not a conversation saved by k3-orch chat (k3_chat: 1)".into());
    }
    v.get("messages")
        .and_then(Value::as_array)
        .cloned()
        .ok_or_else(|| "no messages list".into())
}
