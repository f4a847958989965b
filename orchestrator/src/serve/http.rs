//! The HTTP side of `k3-orch serve` (axum on tokio): OpenAI-compatible endpoints, SSE
//! streaming, errors as OpenAI error objects, the chat page, health and metrics.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};

use super::api::{self, ApiError, Limits, Prepared, TokenLogprobs};
use super::engine::{Done, Engine, Event, Job, Refusal};
use crate::supervise::warm::StageMemory;
use k3_tokenizer::chat::{parse_output, OutputDelta, OutputStream, ParsedOutput, ParsedToolCall};

/// Shared server state.
pub struct App {
    pub engine: Arc<Engine>,
    pub limits: Limits,
    pub api_key: Option<String>,
    pub draining: Arc<AtomicBool>,
    pub next_id: AtomicU64,
}

type AppState = Arc<App>;

const CHAT_PAGE: &str = include_str!("chat.html");

pub fn router(app: AppState) -> Router {
    Router::new()
        .route("/", get(|| async { Html(CHAT_PAGE) }))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(|| async { err(ApiError::new(404, "not_found_error", "no such endpoint")) })
        .with_state(app)
}

fn err(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, axum::Json(e.body())).into_response();
    if matches!(e.status, 429 | 503) {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(ApiError::bad("the body must be a JSON object", None));
    }
    Ok(v)
}

/// The `--api-key` check of every `/v1/*`, `/tokenize` and `/detokenize` route.
fn check_key(app: &App, h: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.api_key else {
        return Ok(());
    };
    let given = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|g| same_key(g.as_bytes(), key.as_bytes())) {
        Ok(())
    } else {
        Err(ApiError::new(
            401,
            "authentication_error",
            "missing or wrong API key (Authorization: Bearer KEY)",
        ))
    }
}

/// Whether two keys are equal, in a time that depends on their lengths only (not on where
/// they first differ).
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Sets the job's cancel flag when dropped (the handler's future is dropped when the client
/// goes away).
struct CancelOnDrop(Arc<AtomicBool>);
impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What one queued choice reports: its events, and its log-probabilities when asked.
struct Queued {
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    logprobs: Option<tokio::sync::mpsc::UnboundedReceiver<TokenLogprobs>>,
    guard: CancelOnDrop,
}

/// Queue a prepared request (one choice).
fn enqueue(app: &App, p: &Prepared) -> Result<Queued, ApiError> {
    let st = &app.engine.stats;
    if app.draining.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            503,
            "unavailable_error",
            "the server is shutting down",
        ));
    }
    if !st.ready.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            503,
            "unavailable_error",
            "the model is still loading",
        ));
    }
    // Bounded by the engine: `--parallel` slots plus `--max-queue` waiting; each job's
    // events are at most its max_tokens text pieces plus three (and as many
    // log-probabilities).
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let mut job = Job::new(p, cancel.clone(), tx);
    let logprobs = p.logprobs.map(|k| {
        let (ltx, lrx) = tokio::sync::mpsc::unbounded_channel();
        job.logprobs = Some((k, ltx));
        lrx
    });
    match app.engine.try_submit(job) {
        Ok(()) => Ok(Queued {
            rx,
            logprobs,
            guard: CancelOnDrop(cancel),
        }),
        Err(e @ Refusal::QueueFull(_)) => {
            Err(ApiError::new(429, "rate_limit_error", e.to_string()))
        }
        Err(e) => Err(ApiError::new(503, "unavailable_error", e.to_string())),
    }
}

/// Usage over every choice: the prompt counts once, the completions add up.
fn usage(done: &[&Done]) -> Value {
    let prompt = done.first().map_or(0, |d| d.prompt_tokens);
    let cached = done.first().map_or(0, |d| d.cached_tokens);
    let completion: usize = done.iter().map(|d| d.completion_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat_completions(State(app): State<AppState>, h: HeaderMap, body: Bytes) -> Response {
    generate(app, h, body, Kind::Chat).await
}

async fn completions(State(app): State<AppState>, h: HeaderMap, body: Bytes) -> Response {
    generate(app, h, body, Kind::Completion).await
}

/// A log-probability for JSON (OpenAI gives -9999 for an impossible id, never -inf).
fn lp_json(lp: f64) -> Value {
    json!(lp.max(-9999.0))
}

/// Formats one request's chunks and log-probabilities.
struct Fmt {
    app: AppState,
    kind: Kind,
    id: String,
    object: &'static str,
    created: u64,
    model: String,
}

impl Fmt {
    /// An id's text and bytes.
    fn token(&self, id: u32) -> (String, Vec<u8>) {
        let b = super::engine::id_bytes(self.app.engine.tok.as_deref(), id);
        (String::from_utf8_lossy(&b).into_owned(), b)
    }

    /// OpenAI's `logprobs` object of these ids: chat's `{"content": [...]}`, or the
    /// completions' token lists (`offset`: the text's length in bytes before them, moved on).
    fn logprobs(&self, ls: &[TokenLogprobs], offset: &mut usize) -> Value {
        match self.kind {
            Kind::Chat => {
                let entry = |id: u32, lp: f64| {
                    let (t, b) = self.token(id);
                    json!({"token": t, "logprob": lp_json(lp), "bytes": b})
                };
                let content: Vec<Value> = ls
                    .iter()
                    .map(|l| {
                        let mut e = entry(l.id, l.logprob);
                        e["top_logprobs"] =
                            Value::Array(l.top.iter().map(|&(i, lp)| entry(i, lp)).collect());
                        e
                    })
                    .collect();
                json!({"content": content})
            }
            Kind::Completion => {
                let (mut tokens, mut lps, mut tops, mut offs) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for l in ls {
                    let (t, b) = self.token(l.id);
                    offs.push(*offset);
                    *offset += b.len();
                    tokens.push(t);
                    lps.push(lp_json(l.logprob));
                    let mut m = serde_json::Map::new();
                    for &(i, lp) in &l.top {
                        m.insert(self.token(i).0, lp_json(lp));
                    }
                    tops.push(Value::Object(m));
                }
                json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                       "text_offset": offs})
            }
        }
    }

    /// OpenAI's `tool_calls` entries of choice `index`, numbered on from `first`.
    fn tool_calls(&self, index: usize, first: usize, calls: &[ParsedToolCall]) -> Vec<Value> {
        calls
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let args = match &c.raw_json {
                    Some(raw) if c.arguments.is_empty() => raw.clone(),
                    _ => Value::Object(c.arguments.clone()).to_string(),
                };
                json!({"index": first + k, "id": format!("call_{}_{index}_{}", self.id, first + k),
                       "type": "function", "function": {"name": c.name, "arguments": args}})
            })
            .collect()
    }

    /// A chat reply's message: the think block's text as `reasoning_content`, the tool
    /// calls as `tool_calls`, the response as `content`.
    fn message(&self, index: usize, p: &ParsedOutput) -> Value {
        let mut m = json!({"role": "assistant", "content": p.content});
        if !p.reasoning.is_empty() {
            m["reasoning_content"] = json!(p.reasoning);
        }
        if !p.tool_calls.is_empty() {
            m["tool_calls"] = json!(self.tool_calls(index, 0, &p.tool_calls));
        }
        m
    }

    /// One streamed chunk of choice `index`.
    fn chunk(&self, index: usize, delta: Value, finish: Option<&str>, lp: Option<Value>) -> Value {
        let mut choice = match self.kind {
            Kind::Chat => json!({"index": index, "delta": delta, "finish_reason": finish}),
            Kind::Completion => json!({
                "index": index,
                "text": delta.get("content").cloned().unwrap_or(json!("")),
                "finish_reason": finish,
            }),
        };
        if let Some(lp) = lp {
            choice["logprobs"] = lp;
        }
        json!({"id": self.id, "object": self.object, "created": self.created,
               "model": self.model, "choices": [choice]})
    }
}

/// Everything a receiver holds now (the engine sends an id's log-probability before its
/// text, so a `Text` finds its ids' entries here).
fn drain<T>(rx: &mut Option<tokio::sync::mpsc::UnboundedReceiver<T>>) -> Vec<T> {
    let mut v = Vec::new();
    if let Some(rx) = rx {
        while let Ok(x) = rx.try_recv() {
            v.push(x);
        }
    }
    v
}

async fn generate(app: AppState, h: HeaderMap, body: Bytes, kind: Kind) -> Response {
    let prepared = check_key(&app, &h).and_then(|_| {
        let v = parse_body(&body)?;
        match kind {
            Kind::Chat => api::chat(app.engine.tok.as_deref(), &v, &app.limits),
            Kind::Completion => {
                api::completion(app.engine.tok.as_deref(), &v, &app.limits, app.engine.vocab)
            }
        }
    });
    let p = match prepared {
        Ok(p) => p,
        Err(e) => return err(e),
    };
    // `n` choices, each a request of its own with seed `seed + i`; all queued, or none
    // (the ones queued are cancelled when their guards drop).
    let mut queued = Vec::with_capacity(p.n);
    for i in 0..p.n {
        let mut pi = p.clone();
        pi.sampler.seed = p.sampler.seed.wrapping_add(i as u64);
        match enqueue(&app, &pi) {
            Ok(q) => queued.push(q),
            Err(e) => return err(e),
        }
    }
    let n = app.next_id.fetch_add(1, Ordering::Relaxed);
    let (id, object) = match kind {
        Kind::Chat => (format!("chatcmpl-{n}"), "chat.completion"),
        Kind::Completion => (format!("cmpl-{n}"), "text_completion"),
    };
    let seed = p.sampler.seed;
    let mut fmt = Fmt {
        app: app.clone(),
        kind,
        id,
        object,
        created: now(),
        model: app.engine.model_name.clone(),
    };
    if !p.stream {
        let mut choices = Vec::with_capacity(queued.len());
        let mut dones = Vec::with_capacity(queued.len());
        for (index, q) in queued.iter_mut().enumerate() {
            let mut text = String::new();
            let done = loop {
                match q.rx.recv().await {
                    Some(Event::Started { .. }) => {}
                    Some(Event::Text(t)) => text.push_str(&t),
                    Some(Event::Done(d)) => break d,
                    Some(Event::Error(e)) => {
                        return err(ApiError::new(
                            500,
                            "server_error",
                            format!("generation failed: {e}"),
                        ))
                    }
                    None => {
                        return err(ApiError::new(
                            500,
                            "server_error",
                            "the engine stopped during the request",
                        ))
                    }
                }
            };
            let mut choice = match (kind, p.split) {
                (Kind::Chat, Some(think)) => {
                    let parsed = parse_output(&text, think);
                    json!({
                        "index": index,
                        "message": fmt.message(index, &parsed),
                        "finish_reason": finish_reason(&done, parsed.tool_calls.len()),
                    })
                }
                (Kind::Chat, None) => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": done.finish.as_str(),
                }),
                (Kind::Completion, _) => json!({
                    "index": index, "text": text, "finish_reason": done.finish.as_str(),
                }),
            };
            if q.logprobs.is_some() {
                choice["logprobs"] = fmt.logprobs(&drain(&mut q.logprobs), &mut 0);
            }
            if p.return_token_ids {
                choice["token_ids"] = json!(done.ids);
            }
            if p.keep_logits {
                // Bit patterns (f32::to_bits): the exact values, NaN and signed zeros included.
                let rows: Vec<Vec<u32>> = done
                    .logits
                    .iter()
                    .map(|r| r.iter().map(|x| x.to_bits()).collect())
                    .collect();
                choice["k3_logits"] = json!(rows);
            }
            choices.push(choice);
            dones.push(done);
        }
        drop(queued);
        let u = usage(&dones.iter().collect::<Vec<_>>());
        return axum::Json(json!({
            "id": fmt.id, "object": fmt.object, "created": fmt.created, "model": fmt.model,
            "choices": choices, "usage": u, "seed": seed,
        }))
        .into_response();
    }
    // Streaming: OpenAI chunks as server-sent events, then `data: [DONE]`.
    fmt.object = match kind {
        Kind::Chat => "chat.completion.chunk",
        Kind::Completion => "text_completion",
    };
    let split = if kind == Kind::Chat { p.split } else { None };
    Sse::new(sse_stream(queued, fmt, p.include_usage, split)).into_response()
}

/// OpenAI's `finish_reason`: "tool_calls" when a reply that stopped by itself called tools.
fn finish_reason(d: &Done, calls: usize) -> &'static str {
    if calls > 0 && d.finish == super::engine::Finish::Stop {
        "tool_calls"
    } else {
        d.finish.as_str()
    }
}

/// One choice of a streamed request.
struct Choice {
    logprobs: Option<tokio::sync::mpsc::UnboundedReceiver<TokenLogprobs>>,
    offset: usize,
    _guard: CancelOnDrop,
    done: Option<Done>,
    /// The chat reply's channels, when it is split.
    output: Option<OutputStream>,
    /// Tool calls streamed so far.
    calls: usize,
}

/// The log-probabilities a choice has received (entries for the ids whose text a chunk
/// brings), when it asked for them.
fn choice_logprobs(fmt: &Fmt, c: &mut Choice) -> Option<Value> {
    let ls = drain(&mut c.logprobs);
    c.logprobs
        .is_some()
        .then(|| fmt.logprobs(&ls, &mut c.offset))
}

/// The last chunks of choice `i`: what its split reply still holds, the log-probabilities
/// of ids whose text never showed (held back, or none), then its `finish_reason`.
fn done_chunks(fmt: &Fmt, i: usize, c: &mut Choice, d: &Done) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(rest) = c.output.as_mut().map(OutputStream::finish) {
        out.extend(split_chunks(fmt, i, c, &rest));
    }
    if c.logprobs.as_ref().is_some_and(|r| !r.is_empty()) {
        let l = choice_logprobs(fmt, c);
        out.push(fmt.chunk(i, json!({"content": ""}), None, l).to_string());
    }
    let finish = finish_reason(d, c.calls);
    out.push(fmt.chunk(i, json!({}), Some(finish), None).to_string());
    out
}

/// The chunks of one piece of a split chat reply: reasoning, then content, then the tool
/// calls completed by it; the log-probabilities so far go with the first. Nothing when the
/// piece gave nothing yet (its log-probabilities wait for the next).
fn split_chunks(fmt: &Fmt, i: usize, c: &mut Choice, d: &OutputDelta) -> Vec<String> {
    let mut deltas = Vec::new();
    if !d.reasoning.is_empty() {
        deltas.push(json!({"reasoning_content": d.reasoning}));
    }
    if !d.content.is_empty() {
        deltas.push(json!({"content": d.content}));
    }
    if !d.tool_calls.is_empty() {
        deltas.push(json!({"tool_calls": fmt.tool_calls(i, c.calls, &d.tool_calls)}));
        c.calls += d.tool_calls.len();
    }
    let mut out = Vec::with_capacity(deltas.len());
    for (k, delta) in deltas.into_iter().enumerate() {
        let l = if k == 0 {
            choice_logprobs(fmt, c)
        } else {
            None
        };
        out.push(fmt.chunk(i, delta, None, l).to_string());
    }
    out
}

/// The SSE event stream of one streamed request, its choices interleaved as they come.
/// Dropping it (the client went away) drops the guards, which cancels the generations.
fn sse_stream(
    queued: Vec<Queued>,
    fmt: Fmt,
    include_usage: bool,
    split: Option<bool>,
) -> impl futures_util::Stream<Item = Result<SseEvent, Infallible>> + Send + 'static {
    use futures_util::StreamExt;
    struct St<S> {
        events: S,
        choices: Vec<Choice>,
        out: std::collections::VecDeque<String>,
        fin: bool,
    }
    let mut streams = Vec::with_capacity(queued.len());
    let mut choices = Vec::with_capacity(queued.len());
    for (i, q) in queued.into_iter().enumerate() {
        streams.push(
            futures_util::stream::unfold(
                q.rx,
                |mut rx| async move { rx.recv().await.map(|e| (e, rx)) },
            )
            .map(move |e| (i, Some(e)))
            // A choice whose events end without Done or Error: the engine stopped.
            .chain(futures_util::stream::iter([(i, None)]))
            .boxed(),
        );
        choices.push(Choice {
            logprobs: q.logprobs,
            offset: 0,
            _guard: q.guard,
            done: None,
            output: split.map(OutputStream::new),
            calls: 0,
        });
    }
    let st = St {
        events: futures_util::stream::select_all(streams),
        choices,
        out: Default::default(),
        fin: false,
    };
    let fmt = Arc::new(fmt);
    futures_util::stream::unfold(st, move |mut s| {
        let fmt = fmt.clone();
        async move {
            loop {
                if let Some(x) = s.out.pop_front() {
                    return Some((Ok(SseEvent::default().data(x)), s));
                }
                if s.fin {
                    return None;
                }
                let fail = |m: String| ApiError::new(500, "server_error", m).body().to_string();
                let Some((i, ev)) = s.events.next().await else {
                    s.fin = true;
                    continue;
                };
                let c = &mut s.choices[i];
                if c.done.is_some() {
                    continue;
                }
                match ev {
                    Some(Event::Started { .. }) => s.out.push_back(
                        fmt.chunk(i, json!({"role": "assistant", "content": ""}), None, None)
                            .to_string(),
                    ),
                    Some(Event::Text(t)) => match c.output.as_mut().map(|o| o.push(&t)) {
                        None => {
                            let l = choice_logprobs(&fmt, c);
                            s.out
                                .push_back(fmt.chunk(i, json!({"content": t}), None, l).to_string())
                        }
                        Some(d) => {
                            s.out.extend(split_chunks(&fmt, i, c, &d));
                        }
                    },
                    Some(Event::Done(d)) => {
                        s.out.extend(done_chunks(&fmt, i, c, &d));
                        c.done = Some(d);
                        if s.choices.iter().all(|c| c.done.is_some()) {
                            if include_usage {
                                let dones: Vec<&Done> =
                                    s.choices.iter().filter_map(|c| c.done.as_ref()).collect();
                                let mut u = fmt.chunk(0, json!({}), None, None);
                                u["choices"] = json!([]);
                                u["usage"] = usage(&dones);
                                s.out.push_back(u.to_string());
                            }
                            s.out.push_back("[DONE]".into());
                            s.fin = true;
                        }
                    }
                    Some(Event::Error(e)) => {
                        s.out.push_back(fail(format!("generation failed: {e}")));
                        s.out.push_back("[DONE]".into());
                        s.fin = true;
                    }
                    None => {
                        s.out
                            .push_back(fail("the engine stopped during the request".into()));
                        s.out.push_back("[DONE]".into());
                        s.fin = true;
                    }
                }
            }
        }
    })
}

/// Resident bytes of this process (/proc/self/statm).
fn self_rss() -> u64 {
    statm_rss("/proc/self/statm")
}

/// RSS of a stage process (when it has no cgroup); 0 when unknown.
fn pid_rss(pid: u32) -> u64 {
    if pid == 0 {
        return 0;
    }
    statm_rss(&format!("/proc/{pid}/statm"))
}

fn statm_rss(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

async fn health(State(app): State<AppState>) -> Response {
    let st = &app.engine.stats;
    if let Some(e) = st.load_error.lock().ok().and_then(|g| g.clone()) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(json!({"status": "error", "error": e})),
        )
            .into_response();
    }
    if st.ready.load(Ordering::SeqCst) {
        axum::Json(json!({"status": "ok"})).into_response()
    } else {
        let mut r = (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "loading"})),
        )
            .into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        r
    }
}

/// The one model this server serves, as OpenAI's model object.
fn model_object(app: &App) -> Value {
    json!({"id": app.engine.model_name, "object": "model", "created": now(), "owned_by": "k3"})
}

async fn models(State(app): State<AppState>, h: HeaderMap) -> Response {
    if let Err(e) = check_key(&app, &h) {
        return err(e);
    }
    axum::Json(json!({"object": "list", "data": [model_object(&app)]})).into_response()
}

/// `GET /v1/models/{id}`: the model, or a 404 OpenAI error for another id.
async fn model(
    State(app): State<AppState>,
    h: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if let Err(e) = check_key(&app, &h) {
        return err(e);
    }
    if id == app.engine.model_name {
        return axum::Json(model_object(&app)).into_response();
    }
    let mut e = ApiError::new(
        404,
        "invalid_request_error",
        format!(
            "the model '{id}' does not exist; this server serves '{}'",
            app.engine.model_name
        ),
    );
    e.param = Some("model".into());
    let mut body = e.body();
    body["error"]["code"] = json!("model_not_found");
    (StatusCode::NOT_FOUND, axum::Json(body)).into_response()
}

/// Memory per stage for `/metrics`: each stage's cgroup usage (or RSS), this process's
/// RSS (`rss`), and the per-stage peak, limit and pid gauges.
fn stage_metrics(stages: &[StageMemory], rss: u64) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let own = if stages.is_empty() {
        "server"
    } else {
        "orchestrator"
    };
    let _ = writeln!(out, "k3_stage_rss_bytes{{stage=\"{own}\"}} {rss}");
    for m in stages {
        let b = m.usage_bytes.unwrap_or_else(|| pid_rss(m.pid));
        let _ = writeln!(out, "k3_stage_rss_bytes{{stage=\"{}\"}} {b}", m.stage);
    }
    if stages.is_empty() {
        return out;
    }
    // One per-stage gauge: its help and type lines, then a line per stage that has a value.
    let mut gauge = |name: &str, help: &str, value: &dyn Fn(&StageMemory) -> Option<u64>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for m in stages {
            if let Some(v) = value(m) {
                let _ = writeln!(out, "{name}{{stage=\"{}\"}} {v}", m.stage);
            }
        }
    };
    gauge(
        "k3_stage_memory_peak_bytes",
        "Peak memory of each stage's cgroup.",
        &|m| m.peak_bytes,
    );
    gauge(
        "k3_stage_memory_limit_bytes",
        "Memory limit of each stage's cgroup.",
        &|m| m.limit_bytes,
    );
    gauge("k3_stage_pid", "Process id of each stage.", &|m| {
        Some(u64::from(m.pid))
    });
    out
}

/// The engine's histograms for `/metrics`.
fn histograms(st: &super::engine::Stats, body: &mut String) {
    st.rows.render(
        body,
        "k3_batch_rows",
        "Rows per forward pass: one per decoding request plus prompt tokens.",
    );
    st.decode_rows.render(
        body,
        "k3_batch_decode_rows",
        "Decode rows per forward pass: the requests decoding together in it.",
    );
    st.ttft.render(
        body,
        "k3_time_to_first_token_seconds",
        "Seconds from a request's arrival to its first token.",
    );
    st.itl.render(
        body,
        "k3_inter_token_seconds",
        "Seconds between two tokens of one request.",
    );
    st.request_tps.render(
        body,
        "k3_request_tokens_per_second",
        "Each finished request's decode speed (tokens after its first, per second).",
    );
}

async fn metrics(State(app): State<AppState>) -> Response {
    let st = &app.engine.stats;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let rss = self_rss();
    let stages = st.stages.lock().map(|g| g.clone()).unwrap_or_default();
    let hit_rate = if stages.is_empty() {
        1.0
    } else {
        let req = g(&st.expert_requests);
        if req == 0 {
            0.0
        } else {
            g(&st.resident_hits) as f64 / req as f64
        }
    };
    let stage_lines = stage_metrics(&stages, rss);
    let slots = app.engine.slots;
    let mut body = format!(
        "# HELP k3_requests_total Generation requests accepted.\n# TYPE k3_requests_total counter\n\
         k3_requests_total {}\n\
         # HELP k3_requests_failed_total Generation requests that failed in the engine.\n# TYPE k3_requests_failed_total counter\n\
         k3_requests_failed_total {}\n\
         # HELP k3_prompt_tokens_total Prompt tokens received.\n# TYPE k3_prompt_tokens_total counter\n\
         k3_prompt_tokens_total {}\n\
         # HELP k3_cached_tokens_total Prompt tokens served from the prefix cache.\n# TYPE k3_cached_tokens_total counter\n\
         k3_cached_tokens_total {}\n\
         # HELP k3_completion_tokens_total Tokens generated.\n# TYPE k3_completion_tokens_total counter\n\
         k3_completion_tokens_total {}\n\
         # HELP k3_tokens_per_second Tokens generated per second over every request, the last 10 s.\n# TYPE k3_tokens_per_second gauge\n\
         k3_tokens_per_second {:.3}\n\
         # HELP k3_slots Requests that decode together (--parallel).\n# TYPE k3_slots gauge\n\
         k3_slots {}\n\
         # HELP k3_slots_busy Slots holding a request.\n# TYPE k3_slots_busy gauge\n\
         k3_slots_busy {}\n\
         # HELP k3_queue_depth Requests waiting for a slot.\n# TYPE k3_queue_depth gauge\n\
         k3_queue_depth {}\n\
         # HELP k3_max_queue Requests that may wait for a slot (--max-queue); more get 429.\n# TYPE k3_max_queue gauge\n\
         k3_max_queue {}\n\
         # HELP k3_prefill_chunk_tokens Prompt tokens per forward pass over the slots still prefilling (--prefill-chunk, as planned).\n# TYPE k3_prefill_chunk_tokens gauge\n\
         k3_prefill_chunk_tokens {}\n\
         # HELP k3_passes_total Forward passes.\n# TYPE k3_passes_total counter\n\
         k3_passes_total {}\n\
         # HELP k3_expert_requests_total Routed-expert lookups.\n# TYPE k3_expert_requests_total counter\n\
         k3_expert_requests_total {}\n\
         # HELP k3_expert_hit_rate Share of routed-expert lookups served from experts already resident (the in-process engine maps every expert: 1).\n# TYPE k3_expert_hit_rate gauge\n\
         k3_expert_hit_rate {}\n\
         # HELP k3_stage_restarts_total Times the stages were started again after a fault.\n# TYPE k3_stage_restarts_total counter\n\
         k3_stage_restarts_total {}\n\
         # HELP k3_stage_rss_bytes Memory per stage: the stage's cgroup usage (RSS without cgroups); the orchestrator's own RSS.\n# TYPE k3_stage_rss_bytes gauge\n\
         {}\
         # HELP k3_ready 1 when the model is loaded.\n# TYPE k3_ready gauge\n\
         k3_ready {}\n",
        g(&st.requests),
        g(&st.failed),
        g(&st.prompt_tokens),
        g(&st.cached_tokens),
        g(&st.completion_tokens),
        st.rate.per_second(),
        slots.slots,
        st.busy.load(Ordering::SeqCst),
        st.waiting.load(Ordering::SeqCst),
        slots.max_queue,
        slots.prefill_chunk,
        g(&st.passes),
        g(&st.expert_requests),
        hit_rate,
        g(&st.restarts),
        stage_lines,
        u8::from(st.ready.load(Ordering::SeqCst)),
    );
    histograms(st, &mut body);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn tokenize(State(app): State<AppState>, h: HeaderMap, body: Bytes) -> Response {
    let r = check_key(&app, &h)
        .and_then(|_| parse_body(&body))
        .and_then(|v| {
            let text = v
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad("'content' must be a string", Some("content")))?;
            let specials = v
                .get("add_special")
                .and_then(Value::as_bool)
                .unwrap_or(false)
                || v.get("parse_special")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
            let tok = app.engine.tok.as_deref().ok_or_else(|| {
                ApiError::bad("this server has no tokenizer (--tok)", Some("content"))
            })?;
            Ok(json!({"tokens": tok.encode(text, specials)}))
        });
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => err(e),
    }
}

async fn detokenize(State(app): State<AppState>, h: HeaderMap, body: Bytes) -> Response {
    let r = check_key(&app, &h)
        .and_then(|_| parse_body(&body))
        .and_then(|v| {
            let ids: Vec<u32> = match v.get("tokens") {
                Some(Value::Array(a)) => api::token_ids(a, app.engine.vocab, "tokens")?,
                _ => {
                    return Err(ApiError::bad(
                        "'tokens' must be a list of token ids",
                        Some("tokens"),
                    ))
                }
            };
            let tok = app.engine.tok.as_deref().ok_or_else(|| {
                ApiError::bad("this server has no tokenizer (--tok)", Some("tokens"))
            })?;
            let bytes = tok
                .decode_bytes(&ids)
                .map_err(|e| ApiError::bad(format!("tokens: {e}"), Some("tokens")))?;
            Ok(json!({"content": String::from_utf8_lossy(&bytes)}))
        });
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => err(e),
    }
}

/// When the server started (for logs).
pub fn uptime(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64()
}
