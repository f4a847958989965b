//! `k3-orch chat MODEL_DIR --tok DIR`: a multi-turn chat on the warm engine. Each stdin line
//! is one user turn (so it works from a pipe as well as a terminal); the reply streams to
//! stdout as it decodes. Commands: `/reset`, `/stats`, `/save FILE`, `/load FILE`, `/exit`.
//! Follow-up turns reuse the previous turns' state (prefix reuse).
//!
//! Only text is printed ([`ReplyText`]): the chat format's tags are parsed away as
//! `/v1/chat/completions` does, and every other special id is dropped by the engine
//! ([`super::engine::HiddenIds`]), so no control token ever reaches the screen. With
//! `--thinking` the think block is printed first, a blank line before the answer; the
//! conversation keeps the answer as `content` and the think block as `reasoning_content`.
//!
//! Input: a line ending in `\` goes on on the next line, and a `"""` line opens a block
//! that a line ending in `"""` closes; either is one turn, its lines joined with newlines.
//! A line that is not UTF-8 is refused with a message (the session goes on).
//!
//! Signals: Ctrl-C (SIGINT) during a reply stops the reply (the part already written stays
//! in the conversation) and the session goes on; at the prompt it drops a half-typed
//! block, and a second Ctrl-C in a row at an empty prompt ends the session (from a pipe,
//! the first does). SIGTERM and SIGHUP end the session. Every way out stops the stages and
//! removes their cgroups (the stages themselves ignore the terminal's Ctrl-C: they are in
//! its process group, and the orchestrator decides what a Ctrl-C stops).
//!
//! `/save FILE` saves the session in two files: FILE, the conversation as JSON
//! (`{"k3_chat": 1, "messages": [...]}`), and FILE.state, the model state kept for it (MLA
//! KV, KDA state, conv tails) in the `--save-state` format (versioned, checksummed, with the
//! model's fingerprint; see `k3_layer_compute::state`). Both must be regular files (or not
//! exist yet): `/save /dev/null` is refused, not written beside. `/load FILE` reads both
//! (regular files of bounded size only): the next turn then prefills only its new tokens. A
//! FILE.state that is missing, corrupt, for another model or configuration, or for another
//! conversation is not used (the message says why); the conversation is loaded all the
//! same.

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use k3_tokenizer::{OutputDelta, OutputStream};
use serde_json::{json, Value};

use super::api::Limits;
use super::engine::{Done, Engine, Event, Finish, Job};
use super::ModelFlags;
use crate::error::{EXIT_FAILED, EXIT_OK, EXIT_USAGE};

/// Requests `chat` lets wait for its one slot.
const CHAT_QUEUE: usize = 4;

/// Command line of `k3-orch chat`.
#[derive(Parser, Debug)]
#[command(
    name = "k3-orch chat",
    about = "Interactive multi-turn chat (one stdin line per turn; a trailing \\ or a \"\"\" block \
             for several lines; Ctrl-C stops a reply; /reset /stats /save FILE /load FILE /exit)"
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
    // Before the stages start: a Ctrl-C or SIGTERM from here on ends the session through
    // `quit`, which removes the stages' cgroups.
    signals::install();
    // One conversation: one slot (a turn's slot may still be freeing when the next turn
    // comes: a few may wait).
    let engine = match a.model.engine(1, CHAT_QUEUE) {
        Ok(e) => Arc::new(e),
        Err(e) => {
            tracing::error!("k3-orch chat: {e}");
            return EXIT_USAGE;
        }
    };
    match wait_ready(&engine) {
        Ok(true) => {}
        Ok(false) => return quit(&engine, EXIT_OK),
        Err(e) => {
            tracing::error!("k3-orch chat: {e}");
            return quit(&engine, EXIT_FAILED);
        }
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("k3-orch chat: cannot start the runtime: {e}");
            return quit(&engine, EXIT_FAILED);
        }
    };
    let tty = std::io::stdin().is_terminal();
    let mut s = Session {
        a: &a,
        engine: &engine,
        rt: &rt,
        lim: a.model.limits(),
        messages: Vec::new(),
        last: None,
    };
    s.reset();
    if tty {
        eprintln!(
            "k3-orch chat: type a message (end a line with \\ or open a \"\"\" block for \
             several lines; Ctrl-C stops a reply); /reset /stats /save FILE /load FILE /exit"
        );
    }
    let code = repl(&mut s, tty);
    quit(&engine, code)
}

/// The prompt loop: read a turn or a command, answer it; the exit code when it ends.
fn repl(s: &mut Session, tty: bool) -> i32 {
    let mut input = Input::default();
    // A Ctrl-C at an empty prompt: the next one ends the session.
    let mut armed = false;
    loop {
        let text = match read_turn(&mut input, tty) {
            Ok(Turn::Text(t)) => t,
            Ok(Turn::Eof) | Ok(Turn::Terminate) => return EXIT_OK,
            Ok(Turn::Interrupt { dropped }) => {
                if dropped {
                    eprintln!("(input dropped)");
                    armed = false;
                } else if armed || !tty {
                    return EXIT_OK;
                } else {
                    eprintln!("(Ctrl-C again to exit, or /exit)");
                    armed = true;
                }
                continue;
            }
            Ok(Turn::NotUtf8) => {
                eprintln!("(refused: the input is not valid UTF-8 text; nothing was sent)");
                armed = false;
                continue;
            }
            Err(e) => {
                tracing::error!("k3-orch chat: reading stdin: {e}");
                return EXIT_FAILED;
            }
        };
        armed = false;
        if text.trim().is_empty() {
            continue;
        }
        if let Some(cmd) = text.strip_prefix('/') {
            if s.command(cmd) {
                return EXIT_OK;
            }
            continue;
        }
        match s.turn(&text) {
            Ok(true) => {}
            Ok(false) => return EXIT_OK,
            Err(code) => return code,
        }
    }
}

/// Wait for the model to load: Ok(false) when a signal ended the wait.
fn wait_ready(engine: &Engine) -> Result<bool, String> {
    loop {
        if signals::terminated() || signals::take_interrupts() > 0 {
            return Ok(false);
        }
        if engine.stats.ready.load(Ordering::SeqCst) {
            return Ok(true);
        }
        if let Some(e) = engine.stats.load_error.lock().ok().and_then(|g| g.clone()) {
            return Err(e);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// End the session: stop the engine (the stages stop, their cgroups are removed) and return
/// `code`. A stage that does not answer cannot hold the exit up: at 3 s the stages are
/// killed from here, and at 5 s the process exits regardless.
fn quit(engine: &Arc<Engine>, code: i32) -> i32 {
    engine.stats.abort.store(true, Ordering::SeqCst);
    let e = engine.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(3));
        tracing::warn!("k3-orch chat: the stages did not stop within 3 s; stopping them");
        e.stop_stages_now();
        std::thread::sleep(Duration::from_secs(2));
        tracing::warn!("k3-orch chat: still stopping at 5 s; exiting");
        std::process::exit(code);
    });
    engine.shutdown();
    code
}

/// The SIGINT, SIGTERM and SIGHUP handlers: they count Ctrl-Cs and note a termination,
/// which the prompt and the reply loops poll.
mod signals {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    static INTERRUPTS: AtomicUsize = AtomicUsize::new(0);
    static TERMINATED: AtomicBool = AtomicBool::new(false);

    extern "C" fn on_signal(sig: libc::c_int) {
        if sig == libc::SIGINT {
            INTERRUPTS.fetch_add(1, Ordering::SeqCst);
        } else {
            TERMINATED.store(true, Ordering::SeqCst);
        }
    }

    /// Route SIGINT, SIGTERM and SIGHUP to the counters (without SA_RESTART: a blocked
    /// poll returns at once).
    pub fn install() {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: an all-zero sigaction is a valid value (empty mask, no flags); the
            // handler only touches atomics, which is async-signal-safe; sigaction reads
            // `act` and writes nothing back (null old action).
            unsafe {
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = on_signal as *const () as libc::sighandler_t;
                libc::sigemptyset(&mut act.sa_mask);
                libc::sigaction(sig, &act, std::ptr::null_mut());
            }
        }
    }

    /// Ctrl-Cs since the last call.
    pub fn take_interrupts() -> usize {
        INTERRUPTS.swap(0, Ordering::SeqCst)
    }

    /// SIGTERM or SIGHUP came.
    pub fn terminated() -> bool {
        TERMINATED.load(Ordering::SeqCst)
    }
}

/// Stdin read by hand (poll, then read), so that a signal is seen while waiting for input,
/// and so that a line that is not UTF-8 is a refusal rather than a read error.
#[derive(Default)]
struct Input {
    buf: Vec<u8>,
    eof: bool,
}

/// What the prompt read.
enum Line {
    Bytes(Vec<u8>),
    Eof,
    Interrupt,
    Terminate,
}

impl Input {
    /// The next line (without its `\n` or `\r\n`), or what came instead.
    fn line(&mut self) -> std::io::Result<Line> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let mut l: Vec<u8> = self.buf.drain(..=i).collect();
                l.pop();
                if l.last() == Some(&b'\r') {
                    l.pop();
                }
                return Ok(Line::Bytes(l));
            }
            if self.eof {
                return Ok(if self.buf.is_empty() {
                    Line::Eof
                } else {
                    Line::Bytes(std::mem::take(&mut self.buf))
                });
            }
            if signals::terminated() {
                return Ok(Line::Terminate);
            }
            if signals::take_interrupts() > 0 {
                return Ok(Line::Interrupt);
            }
            let mut fds = [libc::pollfd {
                fd: libc::STDIN_FILENO,
                events: libc::POLLIN,
                revents: 0,
            }];
            // SAFETY: `fds` is a valid array of one pollfd for the duration of the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, 100) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                continue;
            }
            let mut chunk = [0u8; 16 << 10];
            // SAFETY: `chunk` is valid for writes of its length for the duration of the call.
            let got =
                unsafe { libc::read(libc::STDIN_FILENO, chunk.as_mut_ptr().cast(), chunk.len()) };
            match got {
                0 => self.eof = true,
                n if n > 0 => self.buf.extend_from_slice(&chunk[..n as usize]),
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted
                        && e.kind() != std::io::ErrorKind::WouldBlock
                    {
                        return Err(e);
                    }
                }
            }
        }
    }
}

/// What one prompt gave: a turn or command's text (its lines joined), or why none.
enum Turn {
    Text(String),
    Eof,
    Terminate,
    /// Ctrl-C; `dropped`: it dropped a half-typed block.
    Interrupt {
        dropped: bool,
    },
    NotUtf8,
}

/// Read one turn: a line, the lines of a `\` continuation, or a `"""` block.
fn read_turn(input: &mut Input, tty: bool) -> std::io::Result<Turn> {
    let prompt = |p: &str| {
        if tty {
            eprint!("{p}");
            let _ = std::io::stderr().flush();
        }
    };
    prompt("> ");
    let mut lines: Vec<String> = Vec::new();
    let mut block = false;
    let mut bad = false;
    loop {
        let raw = match input.line()? {
            Line::Bytes(b) => b,
            Line::Eof if lines.is_empty() => return Ok(Turn::Eof),
            // An unfinished block or continuation at the end of the input is sent as it is.
            Line::Eof => break,
            Line::Terminate => return Ok(Turn::Terminate),
            Line::Interrupt => {
                if tty {
                    eprintln!();
                }
                return Ok(Turn::Interrupt {
                    dropped: !lines.is_empty() || block,
                });
            }
        };
        let line = match String::from_utf8(raw) {
            Ok(l) => l,
            Err(_) => {
                // The rest of a block or continuation is read (and dropped) with it.
                bad = true;
                String::new()
            }
        };
        if block {
            if let Some(head) = line.trim_end().strip_suffix("\"\"\"") {
                // A closing `"""` alone on its line adds no line.
                if !head.trim().is_empty() {
                    lines.push(head.to_string());
                }
                break;
            }
            lines.push(line);
            prompt("... ");
            continue;
        }
        if lines.is_empty() {
            if let Some(rest) = line.trim_start().strip_prefix("\"\"\"") {
                // `"""text"""` on one line is a block of one line.
                if let Some(one) = rest.trim_end().strip_suffix("\"\"\"") {
                    lines.push(one.to_string());
                    break;
                }
                block = true;
                if !rest.trim().is_empty() {
                    lines.push(rest.to_string());
                }
                prompt("... ");
                continue;
            }
        }
        match line.strip_suffix('\\') {
            Some(head) => {
                lines.push(head.to_string());
                prompt("... ");
            }
            None => {
                lines.push(line);
                break;
            }
        }
    }
    if bad {
        return Ok(Turn::NotUtf8);
    }
    Ok(Turn::Text(lines.join("\n")))
}

/// One chat session: the conversation so far, on the warm engine.
struct Session<'a> {
    a: &'a ChatArgs,
    engine: &'a Engine,
    /// Waits for the reply's events with a timeout (to see a Ctrl-C meanwhile).
    rt: &'a tokio::runtime::Runtime,
    lim: Limits,
    messages: Vec<Value>,
    /// The last reply's counts and times, for `/stats`.
    last: Option<Done>,
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
            ("stats", _) => eprintln!("{}", stats_line(self.last.as_ref())),
            ("save", f) if !f.is_empty() => {
                let body = json!({"k3_chat": 1, "messages": self.messages});
                let bytes = serde_json::to_vec_pretty(&body).unwrap_or_default();
                let checked = save_target(Path::new(f))
                    .and_then(|()| save_target(&state_path(f)))
                    .map_err(std::io::Error::other);
                match checked.and_then(|()| k3_io::output::write_atomic(Path::new(f), &bytes)) {
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
            _ => eprintln!("(commands: /reset, /stats, /save FILE, /load FILE, /exit)"),
        }
        false
    }

    /// One user turn: the reply streams to stdout and joins the conversation (a reply
    /// stopped by Ctrl-C with the part already written). A refused or failed turn leaves
    /// the conversation as it was. Ok(false): a SIGTERM came, the session ends; Err: the
    /// exit code when the engine is gone.
    fn turn(&mut self, line: &str) -> Result<bool, i32> {
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
                return Ok(true);
            }
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let mut job = Job::new(&p, cancel.clone(), tx);
        job.text_only = true;
        if let Err(e) = self.engine.try_submit(job) {
            tracing::error!("k3-orch chat: {e}");
            return Err(EXIT_FAILED);
        }
        let mut text = ReplyText::new(a.thinking);
        let r = stream_reply(self.rt, rx, &cancel, a.stats, &mut text)?;
        match &r.done {
            Some(d) => self.last = Some(d.clone()),
            None => {
                self.messages.pop();
            }
        }
        if r.done.is_some()
            && self.messages.last().and_then(|m| m.get("role")) == Some(&json!("user"))
        {
            self.messages.push(text.message());
        }
        Ok(!r.terminated)
    }
}

/// What the REPL prints of a reply's text: the chat format parsed away as
/// `/v1/chat/completions` does ([`OutputStream`]): the think block (thinking mode) and the
/// answer, a blank line between them, never a tag or a control token (the engine already
/// dropped the other special ids, [`super::engine::HiddenIds`]). Tool calls are not shown.
struct ReplyText {
    parse: OutputStream,
    reasoning: String,
    content: String,
}

impl ReplyText {
    /// `thinking`: the prompt opened the think block.
    fn new(thinking: bool) -> ReplyText {
        ReplyText {
            parse: OutputStream::new(thinking),
            reasoning: String::new(),
            content: String::new(),
        }
    }

    /// What to print for one more piece of the reply's text.
    fn push(&mut self, piece: &str) -> String {
        let d = self.parse.push(piece);
        self.take(d)
    }

    /// What to print at the end of the reply (text held back while a tag might begin).
    fn finish(&mut self) -> String {
        let d = self.parse.finish();
        self.take(d)
    }

    fn take(&mut self, d: OutputDelta) -> String {
        let mut out = d.reasoning;
        self.reasoning.push_str(&out);
        if !d.content.is_empty() {
            if self.content.is_empty() && !self.reasoning.is_empty() {
                out.push_str("\n\n");
            }
            self.content.push_str(&d.content);
            out.push_str(&d.content);
        }
        out
    }

    /// The reply as the conversation's assistant message.
    fn message(&self) -> Value {
        let mut m = json!({"role": "assistant", "content": self.content});
        if !self.reasoning.is_empty() {
            m["reasoning_content"] = json!(self.reasoning);
        }
        m
    }
}

/// What [`stream_reply`] saw of one reply.
struct Reply {
    /// The job's end (None: it failed, as said on stderr).
    done: Option<Done>,
    /// A SIGTERM came meanwhile: the session ends.
    terminated: bool,
}

/// Print a job's text to stdout as it arrives (what `text` shows of it), until it ends; a
/// Ctrl-C (or a SIGTERM) meanwhile cancels the job, which then ends at its next step.
/// Err(exit code) when the engine stopped.
fn stream_reply(
    rt: &tokio::runtime::Runtime,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    cancel: &AtomicBool,
    stats: bool,
    text: &mut ReplyText,
) -> Result<Reply, i32> {
    let mut r = Reply {
        done: None,
        terminated: false,
    };
    let mut out = std::io::stdout().lock();
    loop {
        // Looked at before every event, not only when none comes for a while: a fast
        // model's tokens may never leave a gap of 50 ms.
        if signals::terminated() {
            r.terminated = true;
            cancel.store(true, Ordering::SeqCst);
        }
        if signals::take_interrupts() > 0 {
            cancel.store(true, Ordering::SeqCst);
        }
        let ev =
            rt.block_on(async { tokio::time::timeout(Duration::from_millis(50), rx.recv()).await });
        let Ok(ev) = ev else {
            continue;
        };
        match ev {
            Some(Event::Started { .. }) => {}
            Some(Event::Text(t)) => {
                let _ = out.write_all(text.push(&t).as_bytes());
                let _ = out.flush();
            }
            Some(Event::Done(d)) => {
                let _ = writeln!(out, "{}", text.finish());
                let _ = out.flush();
                if d.finish == Finish::Cancelled && !r.terminated {
                    eprintln!(
                        "(stopped after {} tokens; the part written stays in the \
                         conversation, /reset starts over)",
                        d.completion_tokens
                    );
                }
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
                r.done = Some(d);
                return Ok(r);
            }
            Some(Event::Error(e)) => {
                let _ = writeln!(out);
                tracing::error!("k3-orch chat: {e}");
                return Ok(r);
            }
            None => {
                tracing::error!("k3-orch chat: the engine stopped");
                return Err(EXIT_FAILED);
            }
        }
    }
}

/// `/stats`: the last reply's decode speed, prefill time and prompt tokens reused.
fn stats_line(d: Option<&Done>) -> String {
    let Some(d) = d else {
        return "(no reply yet)".into();
    };
    let tps = if d.completion_tokens > 1 && d.seconds > 0.0 {
        format!(
            "{:.2} tokens/s",
            (d.completion_tokens - 1) as f64 / d.seconds
        )
    } else {
        "- tokens/s".into()
    };
    format!(
        "(last reply: {} tokens, {tps} ({:.2} s from the first token to the last); prefill \
         {:.2} s for {} prompt tokens, {} of them cached (reused); finish {})",
        d.completion_tokens,
        d.seconds,
        d.prefill_seconds,
        d.prompt_tokens,
        d.cached_tokens,
        d.finish.as_str()
    )
}

/// `/save` writes only regular files (replaced whole) or new ones: a device, a FIFO or a
/// directory is refused before anything is written (`/save /dev/null` wrote
/// `/dev/null.state`; a FIFO hung the session), and so is whatever `--out` refuses
/// ([`k3_io::output::check_target`]: a dangling symlink, a symlink loop, a missing
/// directory, a /proc file).
fn save_target(p: &Path) -> Result<(), String> {
    match std::fs::metadata(p) {
        Ok(m) if !m.is_file() => Err(format!(
            "{} is not a regular file (a device, FIFO or directory is not written)",
            p.display()
        )),
        _ => k3_io::output::check_target(p).map_err(|why| format!("{}: {why}", p.display())),
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
        .and_then(|conv| engine.save_state(&p, &conv).map_err(|e| e.to_string()));
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
    if std::fs::metadata(&p).is_ok_and(|m| !m.is_file()) {
        return format!(
            "the session state was not reused: {} is not a regular file",
            p.display()
        );
    }
    let res = super::api::conversation_tokens(engine.tok.as_deref(), &chat_body(a, messages))
        .map_err(|e| e.message)
        .and_then(|conv| engine.load_state(&p, &conv).map_err(|e| e.to_string()));
    match res {
        Ok(n) => format!("session state ({n} tokens) from {}", p.display()),
        Err(e) => format!("the session state was not reused: {e}"),
    }
}

/// The conversation saved in FILE (a regular file of bounded size: `/load /dev/zero` is
/// refused, not read until memory runs out).
fn load(f: &str) -> Result<Vec<Value>, String> {
    let b = k3_io::input::read_capped(Path::new(f), k3_io::input::JSON_CAP)
        .map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_slice(&b).map_err(|e| format!("not JSON: {e}"))?;
    if v.get("k3_chat").and_then(Value::as_u64) != Some(1) {
        return Err("not a conversation saved by k3-orch chat (k3_chat: 1)".into());
    }
    v.get("messages")
        .and_then(Value::as_array)
        .cloned()
        .ok_or_else(|| "no messages list".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::stream::TextStream;
    use crate::serve::engine::{id_bytes, HiddenIds};
    use k3_tokenizer::specials::Specials;
    use k3_tokenizer::vocab::Vocab;
    use k3_tokenizer::Tokenizer;

    /// A byte vocabulary (ids 0..256) with K3's special names after it (256..512).
    fn tokenizer() -> Tokenizer {
        let bytes = (0..=255u8).map(|b| vec![b]).collect();
        let v = Vocab::from_tokens(bytes, Path::new("bytes")).unwrap();
        Tokenizer::from_parts(v, Specials::k3_default(256)).unwrap()
    }

    /// The ids of `parts`: text as ordinary tokens, `@NAME` as that special's id.
    fn ids(tok: &Tokenizer, parts: &[&str]) -> Vec<u32> {
        parts
            .iter()
            .flat_map(|p| match p.strip_prefix('@') {
                Some(name) => vec![tok.special_id(name).unwrap()],
                None => tok.encode(p, false),
            })
            .collect()
    }

    /// What `chat` prints for a reply of `ids`, along the engine's path: each id's bytes,
    /// the hidden specials' dropped, the job's text stream, the REPL's reply text; and the
    /// assistant message the conversation keeps.
    fn printed(tok: &Tokenizer, ids: &[u32], thinking: bool) -> (String, Value) {
        let hidden = HiddenIds::of(Some(tok));
        let mut stream = TextStream::new(&[]);
        let mut text = ReplyText::new(thinking);
        let mut out = String::new();
        for &id in ids {
            let bytes = id_bytes(Some(tok), id);
            out += &text.push(&stream.push(hidden.shown(id, &bytes)));
        }
        out += &text.push(&stream.finish());
        out += &text.finish();
        (out, text.message())
    }

    /// Issue 34: the REPL printed the reply's raw text, control tokens and all
    /// (`Hello[EOT] wor<|media_pad|>ld...<|close|>response<|sep|>`). Only text is printed
    /// now, fed ids rather than relying on the tiny model to produce a special. Catches
    /// printing the raw text, dropping every special id (the tag's name `response` would
    /// show), and parsing the chat format without dropping the other specials (`[EOT]`
    /// would show); the reverted fix printed the raw text (checked).
    #[test]
    fn the_repl_prints_text_and_never_a_special() {
        let tok = tokenizer();
        let reply = ids(
            &tok,
            &[
                "Hello",
                "@[EOT]",
                " wor",
                "@<|media_pad|>",
                "ld",
                "@<|reserved_token_300|>",
                "@<|close|>",
                "response",
                "@<|sep|>",
            ],
        );
        let (out, msg) = printed(&tok, &reply, false);
        assert_eq!(out, "Hello world");
        assert_eq!(msg, json!({"role": "assistant", "content": "Hello world"}));
        // Thinking: the think block, a blank line, the answer; kept apart in the message.
        let reply = ids(
            &tok,
            &[
                "Let me see.",
                "@[BOS]",
                "@<|close|>",
                "think",
                "@<|sep|>",
                "@<|open|>",
                "response",
                "@<|sep|>",
                "Hi",
                "@[start_header_id]",
                "!",
            ],
        );
        let (out, msg) = printed(&tok, &reply, true);
        assert_eq!(out, "Let me see.\n\nHi!");
        assert_eq!(
            msg,
            json!({"role": "assistant", "content": "Hi!", "reasoning_content": "Let me see."})
        );
    }
}
