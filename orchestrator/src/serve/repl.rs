//! `k3-orch chat MODEL_DIR --tok DIR`: a multi-turn chat on the warm engine. Each stdin line
//! is one user turn (so it works from a pipe as well as a terminal); the reply streams to
//! stdout as it decodes. Commands: `/reset`, `/save FILE`, `/load FILE`, `/exit`.
//! Follow-up turns reuse the previous turns' state (prefix reuse).
//!
//! `/save FILE` saves the session in two files: FILE, the conversation as JSON
//! (`{"k3_chat": 1, "messages": [...]}`), and FILE.state, the model state kept for it (MLA
//! KV, KDA state, conv tails) in the `--save-state` format (versioned, checksummed, with the
//! model's fingerprint; see `k3_layer_compute::state`). `/load FILE` reads both: the next
//! turn then prefills only its new tokens. A FILE.state that is missing, corrupt, for
//! another model or configuration, or for another conversation is not used (the message
//! says why); the conversation is loaded all the same.

use std::ffi::OsString;
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::Parser;
use serde_json::{json, Value};

use super::api::Limits;
use super::engine::{Engine, Event, Job};
use super::ModelFlags;
use crate::error::{EXIT_FAILED, EXIT_OK, EXIT_USAGE};

/// Requests `chat` lets wait for its one slot.
const CHAT_QUEUE: usize = 4;

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
    /// Thinking mode (the reply opens a think block, at effort max); off by default, as in
    /// `k3-orch MODEL --chat` and `serve` (docs/run-k3.md: what thinking costs)
    #[arg(long)]
    thinking: bool,
    /// Softmax temperature (--temp); 0 is greedy. Greedy when no sampling flag is given
    #[arg(long, alias = "temp")]
    temperature: Option<f32>,
    /// Keep the K most likely ids (without --temperature: samples at temperature 1)
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the smallest set of ids with probability >= P, in (0, 1]
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop ids below P times the most likely id's probability, in [0, 1]
    #[arg(long)]
    min_p: Option<f32>,
    /// Divide the logits of ids in the last 64 tokens by R (--repetition-penalty; 1 = off;
    /// applies to greedy too)
    #[arg(long, alias = "repetition-penalty")]
    repeat_penalty: Option<f32>,
    /// Seed of the draw (a random one when sampling without it)
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
    if a.model.tok.is_none() {
        tracing::error!("k3-orch chat: --tok DIR is required (the chat template and the text)");
        return EXIT_USAGE;
    }
    // One conversation: one slot (a turn's slot may still be freeing when the next turn
    // comes: a few may wait).
    let engine = match a.model.engine(1, CHAT_QUEUE) {
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
    let tty = std::io::stdin().is_terminal();
    let mut s = Session {
        a: &a,
        engine: &engine,
        lim: a.model.limits(),
        messages: Vec::new(),
    };
    s.reset();
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
            if s.command(cmd) {
                break;
            }
            continue;
        }
        if let Err(code) = s.turn(line) {
            return code;
        }
    }
    engine.shutdown();
    EXIT_OK
}

/// One chat session: the conversation so far, on the warm engine.
struct Session<'a> {
    a: &'a ChatArgs,
    engine: &'a Engine,
    lim: Limits,
    messages: Vec<Value>,
}

impl Session<'_> {
    /// Back to the start: the system message alone, when there is one.
    fn reset(&mut self) {
        self.messages.clear();
        if let Some(s) = &self.a.system {
            self.messages.push(json!({"role": "system", "content": s}));
        }
    }

    /// A `/command` line (without its slash); true for `/exit`.
    fn command(&mut self, cmd: &str) -> bool {
        let (name, arg) = cmd.split_once(' ').unwrap_or((cmd, ""));
        let (engine, a) = (self.engine, self.a);
        match (name, arg.trim()) {
            ("exit" | "quit", _) => return true,
            ("reset", _) => {
                self.reset();
                eprintln!("(conversation reset)");
            }
            ("save", f) if !f.is_empty() => {
                let body = json!({"k3_chat": 1, "messages": self.messages});
                let bytes = serde_json::to_vec_pretty(&body).unwrap_or_default();
                match k3_io::output::write_atomic(std::path::Path::new(f), &bytes) {
                    Ok(()) => eprintln!(
                        "(saved {} messages to {f}; {})",
                        self.messages.len(),
                        save_state(engine, a, &self.messages, f)
                    ),
                    Err(e) => eprintln!("(cannot save {f}: {e})"),
                }
            }
            ("load", f) if !f.is_empty() => match load(f) {
                Ok(m) => {
                    eprintln!(
                        "(loaded {} messages from {f}; {})",
                        m.len(),
                        load_state(engine, a, &m, f)
                    );
                    self.messages = m;
                }
                Err(e) => eprintln!("(cannot load {f}: {e})"),
            },
            _ => eprintln!("(commands: /reset, /save FILE, /load FILE, /exit)"),
        }
        false
    }

    /// One user turn: the reply streams to stdout and joins the conversation. A refused
    /// or failed turn leaves the conversation as it was; Err: the exit code when the
    /// engine is gone.
    fn turn(&mut self, line: &str) -> Result<(), i32> {
        let a = self.a;
        self.messages.push(json!({"role": "user", "content": line}));
        let mut body = chat_body(a, &self.messages);
        for (k, v) in [
            ("max_tokens", json!(a.gen.min(self.lim.max_tokens))),
            ("temperature", json!(a.temperature)),
            ("top_k", json!(a.top_k)),
            ("top_p", json!(a.top_p)),
            ("min_p", json!(a.min_p)),
            ("repetition_penalty", json!(a.repeat_penalty)),
            ("seed", json!(a.seed)),
        ] {
            body[k] = v;
        }
        let p = match super::api::chat(self.engine.tok.as_deref(), &body, &self.lim) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("(refused: {})", e.message);
                self.messages.pop();
                return Ok(());
            }
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        if let Err(e) = self
            .engine
            .try_submit(Job::new(&p, Arc::new(AtomicBool::new(false)), tx))
        {
            tracing::error!("k3-orch chat: {e}");
            return Err(EXIT_FAILED);
        }
        let (reply, done) = stream_reply(rx, a.stats)?;
        if !done {
            self.messages.pop();
        }
        if self.messages.last().and_then(|m| m.get("role")) == Some(&json!("user")) {
            self.messages
                .push(json!({"role": "assistant", "content": reply}));
        }
        Ok(())
    }
}

/// Print a job's text to stdout as it arrives: the reply so far and whether the job finished
/// (a failure is said on stderr), or Err(exit code) when the engine stopped.
fn stream_reply(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    stats: bool,
) -> Result<(String, bool), i32> {
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
                if stats {
                    eprintln!(
                        "({} prompt tokens, {} reused; {} generated in {:.2} s; {})",
                        d.prompt_tokens,
                        d.cached_tokens,
                        d.completion_tokens,
                        d.seconds,
                        d.finish.as_str()
                    );
                }
                return Ok((reply, true));
            }
            Some(Event::Error(e)) => {
                let _ = writeln!(out);
                tracing::error!("k3-orch chat: {e}");
                return Ok((reply, false));
            }
            None => {
                tracing::error!("k3-orch chat: the engine stopped");
                return Err(EXIT_FAILED);
            }
        }
    }
}

/// A chat body with the conversation and the thinking flags (the template options).
fn chat_body(a: &ChatArgs, messages: &[Value]) -> Value {
    let mut body = json!({"messages": messages, "thinking": a.thinking});
    if a.thinking {
        body["reasoning_effort"] = json!("max");
    }
    body
}

/// Where `/save FILE` puts the session state: FILE.state.
fn state_path(f: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("{f}.state"))
}

/// `/save`'s second half: the kept state for the conversation to FILE.state. What happened,
/// for the message (a state that cannot be saved leaves no stale FILE.state behind).
fn save_state(engine: &Engine, a: &ChatArgs, messages: &[Value], f: &str) -> String {
    let p = state_path(f);
    let res = super::api::conversation_tokens(engine.tok.as_deref(), &chat_body(a, messages))
        .map_err(|e| e.message)
        .and_then(|conv| engine.save_state(&p, &conv));
    match res {
        Ok(n) => format!("session state ({n} tokens) to {}", p.display()),
        Err(e) => {
            let _ = std::fs::remove_file(&p);
            format!("the session state was not saved: {e}")
        }
    }
}

/// `/load`'s second half: FILE.state back into the prefix cache, when it fits.
fn load_state(engine: &Engine, a: &ChatArgs, messages: &[Value], f: &str) -> String {
    let p = state_path(f);
    let res = super::api::conversation_tokens(engine.tok.as_deref(), &chat_body(a, messages))
        .map_err(|e| e.message)
        .and_then(|conv| engine.load_state(&p, &conv));
    match res {
        Ok(n) => format!("session state ({n} tokens) from {}", p.display()),
        Err(e) => format!("the session state was not reused: {e}"),
    }
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
