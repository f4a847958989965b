//! Request validation shared by the HTTP server and the REPL: OpenAI-style JSON bodies to a
//! tokenized [`Prepared`] job, or an [`ApiError`] (an OpenAI error object with its status).

use serde_json::{json, Value};

use k3_protocol::conf::SamplerConfig;
use k3_tokenizer::chat::ChatOptions;
use k3_tokenizer::Tokenizer;

/// An error for the client: HTTP status plus OpenAI's error object.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: 400,
            kind: "invalid_request_error",
            message: message.into(),
            param: param.map(str::to_string),
        }
    }
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
        }
    }
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status,
        }})
    }
}

/// Roles the chat format renders.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// Limits the server enforces.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest `max_tokens`.
    pub max_tokens: usize,
    /// Prompt plus completion tokens (the KV budget).
    pub ctx: usize,
    /// `max_tokens` when the request gives none.
    pub default_max_tokens: usize,
    /// Requests may ask for every step's logits (`"k3_logits": true`; `serve
    /// --debug-logits`).
    pub debug_logits: bool,
}

/// A validated request.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub snapshot_at: Option<usize>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Give the generated ids with the reply (`"return_token_ids": true`).
    pub return_token_ids: bool,
    /// Give every step's logits row with the reply (`"k3_logits": true`, a debug endpoint).
    pub keep_logits: bool,
    /// Give each generated id's log-probability and this many top alternatives (chat:
    /// `logprobs: true` with `top_logprobs`; completions: `logprobs: k`).
    pub logprobs: Option<usize>,
    /// Choices to generate (`n`): choice `i` runs as a request of its own with seed
    /// `seed + i`.
    pub n: usize,
    /// A chat reply in K3's chat format, to split into `reasoning_content`, `content` and
    /// `tool_calls`: Some(whether the prompt opened the think block).
    pub split: Option<bool>,
}

/// Most choices one request may ask for (`n`).
pub const MAX_N: usize = 16;

/// Most `top_logprobs` a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generated id's log-probability and the most likely ids at its step.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub id: u32,
    pub logprob: f64,
    /// The `top` most likely ids, most likely first (ties: the lower id first).
    pub top: Vec<(u32, f64)>,
}

/// Log-probabilities of a step's raw logits row (before any penalty or temperature: the
/// model's own distribution), log-softmax in f64: `id`'s and the `top` largest.
pub fn logprobs_of(row: &[f32], id: u32, top: usize) -> TokenLogprobs {
    let m = row
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = row
        .iter()
        .filter(|x| x.is_finite())
        .map(|&x| (x as f64 - m).exp())
        .sum();
    let lse = m + z.ln();
    let lp = |i: usize| row.get(i).map_or(f64::NEG_INFINITY, |&x| x as f64 - lse);
    // The `top` largest, by a bounded insertion (top is at most MAX_TOP_LOGPROBS).
    let mut best: Vec<usize> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &x) in row.iter().enumerate() {
            if !x.is_finite() {
                continue;
            }
            if best.len() == top && x <= row[best[top - 1]] {
                continue;
            }
            let at = best.partition_point(|&j| row[j] >= x);
            best.insert(at, i);
            best.truncate(top);
        }
    }
    TokenLogprobs {
        id,
        logprob: lp(id as usize),
        top: best.into_iter().map(|i| (i as u32, lp(i))).collect(),
    }
}

/// The `logprobs` fields: chat takes `logprobs: true` and `top_logprobs: k`, completions
/// `logprobs: k`.
fn logprobs_field(v: &Value, chat: bool) -> Result<Option<usize>, ApiError> {
    let bad = |k: &str| {
        ApiError::bad(
            format!("'{k}' must be an integer from 0 to {MAX_TOP_LOGPROBS}"),
            Some(k),
        )
    };
    let top = |k: &str| -> Result<Option<usize>, ApiError> {
        match v.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => match x.as_u64() {
                Some(n) if n as usize <= MAX_TOP_LOGPROBS => Ok(Some(n as usize)),
                _ => Err(bad(k)),
            },
        }
    };
    if !chat {
        return top("logprobs");
    }
    let on = opt_bool(v, "logprobs")?;
    match (on, top("top_logprobs")?) {
        (true, k) => Ok(Some(k.unwrap_or(0))),
        (false, Some(_)) => Err(ApiError::bad(
            "'top_logprobs' needs 'logprobs': true",
            Some("top_logprobs"),
        )),
        (false, None) => Ok(None),
    }
}

fn opt_f32(v: &Value, key: &str, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => {
            let f = x
                .as_f64()
                .ok_or_else(|| ApiError::bad(format!("'{key}' must be a number"), Some(key)))?
                as f32;
            if !(f.is_finite() && f >= lo && f <= hi) {
                return Err(ApiError::bad(
                    format!("'{key}' must be between {lo} and {hi}"),
                    Some(key),
                ));
            }
            Ok(Some(f))
        }
    }
}

fn opt_u64(v: &Value, key: &str) -> Result<Option<u64>, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_u64().map(Some).ok_or_else(|| {
            ApiError::bad(format!("'{key}' must be a non-negative integer"), Some(key))
        }),
    }
}

/// The request fields both endpoints take.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "n",
    "stop",
    "stream",
    "stream_options",
    "return_token_ids",
    "k3_logits",
];

/// Fields only `/v1/chat/completions` takes.
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "thinking",
    "reasoning_effort",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
];

/// Fields only `/v1/completions` takes.
const COMPLETION_FIELDS: &[&str] = &["prompt", "logprobs"];

/// Fields accepted and ignored: they do not change the reply (docs/serve.md).
pub const HARMLESS_FIELDS: &[&str] = &["user", "metadata", "service_tier"];

/// Fields accepted when they ask for what the server does anyway (OpenAI's default).
fn is_default_value(key: &str, v: &Value) -> bool {
    match key {
        "echo" | "store" => v == &Value::Bool(false),
        "best_of" => v.as_u64() == Some(1),
        "logit_bias" => v.as_object().is_some_and(|o| o.is_empty()),
        "modalities" => v == &json!(["text"]),
        // Several calls in one reply are allowed, as the chat format has them.
        "parallel_tool_calls" => v == &Value::Bool(true),
        "response_format" => v == &json!({"type": "text"}),
        _ => false,
    }
}

/// Keys of a message the chat format renders.
const MESSAGE_FIELDS: &[&str] = &[
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "reasoning_content",
];

/// Refuse every field the endpoint does not support (none is silently ignored): a 400
/// naming it. A field whose value is null, a harmless one ([`HARMLESS_FIELDS`]) or one that
/// asks for the default passes.
pub fn check_fields(v: &Value, chat: bool) -> Result<(), ApiError> {
    let Some(o) = v.as_object() else {
        return Ok(());
    };
    let own = if chat { CHAT_FIELDS } else { COMPLETION_FIELDS };
    for (k, x) in o {
        let k = k.as_str();
        if COMMON_FIELDS.contains(&k) || own.contains(&k) || HARMLESS_FIELDS.contains(&k) {
            continue;
        }
        if x.is_null() || is_default_value(k, x) {
            continue;
        }
        let why = if k == "response_format" {
            let ty = x.get("type").and_then(Value::as_str).unwrap_or("?");
            format!(
                "'response_format' {ty:?} is not supported: only {{\"type\": \"text\"}} (JSON \
                 output needs constrained decoding, which this server does not have)"
            )
        } else if (CHAT_FIELDS.contains(&k) || COMPLETION_FIELDS.contains(&k)) && !own.contains(&k)
        {
            format!(
                "'{k}' belongs to /v1/{}",
                if chat {
                    "completions"
                } else {
                    "chat/completions"
                }
            )
        } else {
            format!(
                "'{k}' is not supported by this server (docs/serve.md lists the fields it takes)"
            )
        };
        return Err(ApiError::bad(why, Some(k)));
    }
    if let Some(so) = o.get("stream_options").filter(|x| !x.is_null()) {
        let Some(so) = so.as_object() else {
            return Err(ApiError::bad(
                "'stream_options' must be an object",
                Some("stream_options"),
            ));
        };
        for (k, x) in so {
            match (k.as_str(), x) {
                ("include_usage", Value::Bool(_) | Value::Null) => {}
                ("include_usage", _) => {
                    return Err(ApiError::bad(
                        "'stream_options.include_usage' must be a boolean",
                        Some("stream_options.include_usage"),
                    ))
                }
                // Padding against length side channels: nothing to pad here.
                ("include_obfuscation", _) => {}
                (k, _) => {
                    let p = format!("stream_options.{k}");
                    return Err(ApiError::bad(
                        format!("'{p}' is not supported by this server"),
                        Some(&p),
                    ));
                }
            }
        }
    }
    if let Some(Value::Array(msgs)) = o.get("messages").filter(|_| chat) {
        for (i, m) in msgs.iter().enumerate() {
            for (k, x) in m.as_object().into_iter().flatten() {
                if !MESSAGE_FIELDS.contains(&k.as_str()) && !x.is_null() {
                    let p = format!("messages[{i}].{k}");
                    return Err(ApiError::bad(
                        format!("'{p}' is not supported by this server"),
                        Some(&p),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// `stop`: a string or up to 4 non-empty strings.
fn stop_field(v: &Value) -> Result<Vec<String>, ApiError> {
    let stop: Vec<String> = match v.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str().map(str::to_string).ok_or_else(|| {
                    ApiError::bad("'stop' must be a string or a list of strings", Some("stop"))
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::bad(
                "'stop' must be a string or a list of strings",
                Some("stop"),
            ))
        }
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(ApiError::bad(
            "'stop' takes at most 4 non-empty strings",
            Some("stop"),
        ));
    }
    Ok(stop)
}

/// `n`: 1 to [`MAX_N`] choices.
fn n_field(v: &Value) -> Result<usize, ApiError> {
    match opt_u64(v, "n")? {
        None => Ok(1),
        Some(n) if (1..=MAX_N as u64).contains(&n) => Ok(n as usize),
        Some(_) => Err(ApiError::bad(
            format!("'n' must be from 1 to {MAX_N}"),
            Some("n"),
        )),
    }
}

/// Sampling, stop and length fields common to both endpoints.
fn common(v: &Value, lim: &Limits, prompt_len: usize, chat: bool) -> Result<Prepared, ApiError> {
    let max_tokens = match opt_u64(v, "max_completion_tokens")?.or(opt_u64(v, "max_tokens")?) {
        None => lim.default_max_tokens.min(lim.max_tokens),
        Some(0) => {
            return Err(ApiError::bad(
                "'max_tokens' must be at least 1",
                Some("max_tokens"),
            ))
        }
        Some(n) if n as usize > lim.max_tokens => {
            return Err(ApiError::bad(
                format!("'max_tokens' {n} is over the limit of {}", lim.max_tokens),
                Some("max_tokens"),
            ))
        }
        Some(n) => n as usize,
    };
    if prompt_len + max_tokens > lim.ctx {
        return Err(ApiError::bad(
            format!(
                "the prompt is {prompt_len} tokens; with max_tokens {max_tokens} that is over \
                 the {}-token context (KV budget)",
                lim.ctx
            ),
            Some("messages"),
        ));
    }
    let temperature = opt_f32(v, "temperature", 0.0, 100.0)?;
    let top_p = opt_f32(v, "top_p", 0.0, 1.0)?.filter(|p| *p < 1.0);
    let min_p = opt_f32(v, "min_p", 0.0, 1.0)?.filter(|p| *p > 0.0);
    let repetition_penalty = opt_f32(v, "repetition_penalty", 0.0, 10.0)?
        .or(opt_f32(v, "repeat_penalty", 0.0, 10.0)?)
        .filter(|p| *p > 0.0 && *p != 1.0);
    if top_p == Some(0.0) {
        return Err(ApiError::bad("'top_p' must be above 0", Some("top_p")));
    }
    let top_k = match opt_u64(v, "top_k")? {
        None | Some(0) => None,
        Some(k) => Some(k as usize),
    };
    let stop = stop_field(v)?;
    let stream = match v.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad("'stream' must be a boolean", Some("stream"))),
    };
    let include_usage = v
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let return_token_ids = opt_bool(v, "return_token_ids")?;
    let keep_logits = opt_bool(v, "k3_logits")?;
    if keep_logits && !lim.debug_logits {
        return Err(ApiError::bad(
            "'k3_logits' needs a server started with --debug-logits",
            Some("k3_logits"),
        ));
    }
    if keep_logits && stream {
        return Err(ApiError::bad(
            "'k3_logits' comes with the whole reply: it needs 'stream': false",
            Some("k3_logits"),
        ));
    }
    // Greedy unless asked: a filter without a temperature samples at temperature 1, as on
    // the command line; a sampled request without a seed gets a random one.
    let filtered = top_k.is_some() || top_p.is_some() || min_p.is_some();
    let args = crate::run::args::Sampling {
        temperature: temperature.or(if filtered { Some(1.0) } else { None }),
        top_p,
        top_k,
        min_p,
        repetition_penalty,
        seed: opt_u64(v, "seed")?,
        stop: stop.clone(),
    };
    let mut sampler = args.resolve(crate::run::args::random_seed);
    // OpenAI's penalties over the generated ids (0 = off, as absent).
    sampler.presence_penalty = opt_f32(v, "presence_penalty", -2.0, 2.0)?.filter(|p| *p != 0.0);
    sampler.frequency_penalty = opt_f32(v, "frequency_penalty", -2.0, 2.0)?.filter(|p| *p != 0.0);
    Ok(Prepared {
        prompt: Vec::new(),
        snapshot_at: None,
        max_tokens,
        sampler,
        stop,
        stream,
        include_usage,
        return_token_ids,
        keep_logits,
        logprobs: logprobs_field(v, chat)?,
        split: None,
        n: n_field(v)?,
    })
}

fn opt_bool(v: &Value, key: &str) -> Result<bool, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad(
            format!("'{key}' must be a boolean"),
            Some(key),
        )),
    }
}

/// The tokenizer, or the refusal of a server started without one (ids in, ids out).
fn need_tok<'a>(
    tok: Option<&'a Tokenizer>,
    what: &str,
    param: &str,
) -> Result<&'a Tokenizer, ApiError> {
    tok.ok_or_else(|| {
        ApiError::bad(
            format!(
                "{what} needs a tokenizer and this server has none (--tok); give the prompt \
                 as a list of token ids to /v1/completions"
            ),
            Some(param),
        )
    })
}

/// Token ids from JSON numbers, each inside the vocabulary (never truncated: an id past
/// `u32` or the vocabulary is named in the refusal).
pub fn token_ids(a: &[Value], vocab: usize, param: &str) -> Result<Vec<u32>, ApiError> {
    a.iter()
        .map(|x| {
            let bad = || {
                ApiError::bad(
                    format!("token id {x} is not an id of the vocabulary 0..{vocab}"),
                    Some(param),
                )
            };
            let n = x.as_u64().ok_or_else(bad)?;
            match u32::try_from(n) {
                Ok(id) if (id as usize) < vocab => Ok(id),
                _ => Err(bad()),
            }
        })
        .collect()
}

/// Text of a message's `content`: a string, or a list of `{"type": "text", "text": ...}`.
fn content_text(c: &Value, i: usize) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match c {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut s = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => s.push_str(t),
                    _ => {
                        return Err(ApiError::bad(
                            "only text content parts are supported",
                            Some(&param),
                        ))
                    }
                }
            }
            Ok(s)
        }
        _ => Err(ApiError::bad(
            "'content' must be a string or a list of text parts",
            Some(&param),
        )),
    }
}

/// A chat body's messages, checked, and the template options it asks for.
fn chat_messages(v: &Value) -> Result<(Vec<Value>, ChatOptions), ApiError> {
    let msgs = match v.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(ApiError::bad("'messages' is empty", Some("messages")))
        }
        Some(_) => return Err(ApiError::bad("'messages' must be a list", Some("messages"))),
        None => {
            return Err(ApiError::bad(
                "missing required field 'messages'",
                Some("messages"),
            ))
        }
    };
    let mut clean = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad(
                format!("messages[{i}] has no 'role'"),
                Some(&format!("messages[{i}].role")),
            )
        })?;
        if !ROLES.contains(&role) {
            return Err(ApiError::bad(
                format!("messages[{i}]: unknown role '{role}' (system, user, assistant, tool)"),
                Some(&format!("messages[{i}].role")),
            ));
        }
        let content = content_text(m.get("content").unwrap_or(&Value::Null), i)?;
        let mut o = json!({"role": role, "content": content});
        if let Some(n) = m.get("name").and_then(Value::as_str) {
            o["name"] = json!(n);
        }
        // What the chat format renders of tool use and thinking (checked there).
        for k in ["tool_calls", "tool_call_id", "reasoning_content"] {
            if let Some(x) = m.get(k).filter(|x| !x.is_null()) {
                o[k] = x.clone();
            }
        }
        clean.push(o);
    }
    // Thinking is off unless asked for (`"thinking": true` or a `reasoning_effort`).
    let effort = match v.get("reasoning_effort").and_then(Value::as_str) {
        None => None,
        Some(e) if k3_tokenizer::chat::EFFORTS.contains(&e) => Some(e.to_string()),
        Some(e) => {
            return Err(ApiError::bad(
                format!("'reasoning_effort' {e:?}: expected low, high or max"),
                Some("reasoning_effort"),
            ))
        }
    };
    let thinking = v
        .get("thinking")
        .and_then(Value::as_bool)
        .unwrap_or(effort.is_some());
    let opts = ChatOptions {
        thinking,
        thinking_effort: effort,
        add_generation_prompt: true,
        tool_choice: tool_choice(v)?,
        ..ChatOptions::default()
    };
    Ok((clean, opts))
}

/// `tools`: a list of `{"type": "function", "function": {"name", ...}}` (None when absent
/// or empty), rendered as the release's chat template declares them.
fn tools(v: &Value) -> Result<Option<Value>, ApiError> {
    let t = match v.get("tools") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) if a.is_empty() => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::bad("'tools' must be a list", Some("tools"))),
    };
    for (i, x) in t.iter().enumerate() {
        let ok = x.get("type").and_then(Value::as_str) == Some("function")
            && x.pointer("/function/name").is_some_and(Value::is_string);
        if !ok {
            return Err(ApiError::bad(
                format!(
                    "tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                ),
                Some(&format!("tools[{i}]")),
            ));
        }
    }
    Ok(Some(Value::Array(t.clone())))
}

/// `tool_choice`: "auto" (the default), "none" or "required" (rendered into the prompt as
/// the release's template does); naming one function cannot be enforced without
/// constrained decoding and is refused.
fn tool_choice(v: &Value) -> Result<Option<String>, ApiError> {
    match v.get("tool_choice") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s == "auto" => Ok(None),
        Some(Value::String(s)) if s == "none" || s == "required" => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad(
            "'tool_choice' takes \"auto\", \"none\" or \"required\" (forcing one \
             function needs constrained decoding, which this server does not have)",
            Some("tool_choice"),
        )),
    }
}

/// The tokens of a chat body's messages as a finished conversation (no generation prompt):
/// what the next turn's prompt starts with (`k3-orch chat`'s `/save` and `/load`).
pub fn conversation_tokens(tok: Option<&Tokenizer>, v: &Value) -> Result<Vec<u32>, ApiError> {
    let tok = need_tok(tok, "a chat", "messages")?;
    let (clean, opts) = chat_messages(v)?;
    tok.encode_chat(
        &clean,
        None,
        &ChatOptions {
            add_generation_prompt: false,
            ..opts
        },
    )
    .map_err(|e| ApiError::bad(format!("messages: {e}"), Some("messages")))
}

/// `POST /v1/chat/completions` body to a job.
pub fn chat(tok: Option<&Tokenizer>, v: &Value, lim: &Limits) -> Result<Prepared, ApiError> {
    check_fields(v, true)?;
    let tok = need_tok(tok, "a chat", "messages")?;
    let (clean, opts) = chat_messages(v)?;
    let tools = tools(v)?;
    let prompt = tok
        .encode_chat(&clean, tools.as_ref(), &opts)
        .map_err(|e| ApiError::bad(format!("messages: {e}"), Some("messages")))?;
    let history = tok
        .encode_chat(
            &clean,
            tools.as_ref(),
            &ChatOptions {
                add_generation_prompt: false,
                ..opts
            },
        )
        .ok()
        .filter(|h| !h.is_empty() && h.len() < prompt.len() && prompt.starts_with(h))
        .map(|h| h.len());
    let mut p = common(v, lim, prompt.len(), true)?;
    p.prompt = prompt;
    p.snapshot_at = history;
    p.split = Some(opts.thinking);
    Ok(p)
}

/// `POST /v1/completions` body to a job (`prompt`: a string, or a list of token ids).
pub fn completion(
    tok: Option<&Tokenizer>,
    v: &Value,
    lim: &Limits,
    vocab: usize,
) -> Result<Prepared, ApiError> {
    check_fields(v, false)?;
    let prompt: Vec<u32> = match v.get("prompt") {
        Some(Value::String(s)) => need_tok(tok, "a text prompt", "prompt")?.encode(s, false),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => token_ids(a, vocab, "prompt")?,
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            need_tok(tok, "a text prompt", "prompt")?.encode(a[0].as_str().unwrap_or(""), false)
        }
        Some(_) => {
            return Err(ApiError::bad(
                "'prompt' must be a string or a list of token ids",
                Some("prompt"),
            ))
        }
        None => {
            return Err(ApiError::bad(
                "missing required field 'prompt'",
                Some("prompt"),
            ))
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::bad(
            "the prompt encodes to no tokens",
            Some("prompt"),
        ));
    }
    let mut p = common(v, lim, prompt.len(), false)?;
    p.prompt = prompt;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> Tokenizer {
        let d =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer");
        Tokenizer::from_dir(&d).unwrap()
    }

    const LIM: Limits = Limits {
        max_tokens: 64,
        ctx: 512,
        default_max_tokens: 16,
        debug_logits: false,
    };

    #[test]
    fn chat_requests_are_validated() {
        let t = tok();
        let ok = chat(
            Some(&t),
            &json!({"messages": [{"role": "user", "content": "hi"}]}),
            &LIM,
        )
        .unwrap();
        assert_eq!(ok.max_tokens, 16);
        assert!(ok.sampler.is_greedy());
        // The history snapshot ends before the generation prompt.
        let b = ok.snapshot_at.unwrap();
        assert!(b > 0 && b < ok.prompt.len());
        for (body, needle) in [
            (json!({}), "missing required field 'messages'"),
            (json!({"messages": []}), "empty"),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                "unknown role",
            ),
            (json!({"messages": [{"content": "x"}]}), "no 'role'"),
            (
                json!({"messages": [{"role": "user", "content": 5}]}),
                "content",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
                "at least 1",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 65}),
                "over the limit",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                "number",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
                "boolean",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x".repeat(3000)}], "max_tokens": 60}),
                "context",
            ),
        ] {
            let e = chat(Some(&t), &body, &LIM).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
        // top_k alone samples, with a random seed.
        let s = chat(
            Some(&t),
            &json!({"messages": [{"role": "user", "content": "x"}], "top_k": 4}),
            &LIM,
        )
        .unwrap();
        assert!(!s.sampler.is_greedy());
    }

    #[test]
    fn no_field_is_silently_ignored() {
        let t = tok();
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let with = |k: &str, x: Value| {
            let mut b = json!({"messages": msgs});
            b[k] = x;
            b
        };
        // Unknown or unsupported fields are refused, naming the field.
        for (k, x) in [
            ("logit_bias", json!({"5": 10})),
            ("echo", json!(true)),
            ("best_of", json!(3)),
            ("store", json!(true)),
            ("suffix", json!("x")),
            ("frobnicate", json!(1)),
            ("prompt", json!("x")),
        ] {
            let e = chat(Some(&t), &with(k, x.clone()), &LIM).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some(k)), "{k}: {x}");
            assert!(e.message.contains(k), "{}", e.message);
        }
        // Harmless fields, nulls and values that ask for the default pass.
        for (k, x) in [
            ("user", json!("u1")),
            ("metadata", json!({"a": "b"})),
            ("frobnicate", Value::Null),
            ("logit_bias", json!({})),
            ("echo", json!(false)),
            ("n", json!(1)),
            ("response_format", json!({"type": "text"})),
            ("model", json!("k3")),
        ] {
            assert!(
                chat(Some(&t), &with(k, x.clone()), &LIM).is_ok(),
                "{k}: {x}"
            );
        }
        // Inside stream_options and the messages too.
        let e = chat(
            Some(&t),
            &with(
                "stream_options",
                json!({"include_usage": true, "chunk_size": 3}),
            ),
            &LIM,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options.chunk_size"));
        let e = chat(
            Some(&t),
            &json!({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}),
            &LIM,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].audio"));
        // /v1/completions: the chat-only fields belong elsewhere.
        let e = completion(
            Some(&t),
            &json!({"prompt": [1], "messages": msgs}),
            &LIM,
            4000,
        )
        .unwrap_err();
        assert!(e.message.contains("/v1/chat/completions"), "{}", e.message);
        assert!(completion(Some(&t), &json!({"prompt": [1], "user": "u"}), &LIM, 4000).is_ok());
    }

    #[test]
    fn presence_and_frequency_penalties_reach_the_sampler() {
        let t = tok();
        let b = json!({"messages": [{"role": "user", "content": "x"}],
                       "presence_penalty": 0.5, "frequency_penalty": -1.5});
        let p = chat(Some(&t), &b, &LIM).unwrap();
        assert_eq!(p.sampler.presence_penalty, Some(0.5));
        assert_eq!(p.sampler.frequency_penalty, Some(-1.5));
        // They do not make a request sampled.
        assert!(p.sampler.is_greedy());
        // 0 is off, as absent: the greedy config is the plain one.
        let b = json!({"prompt": [1], "presence_penalty": 0, "frequency_penalty": 0.0});
        let p = completion(Some(&t), &b, &LIM, 4000).unwrap();
        assert_eq!(p.sampler, SamplerConfig::default());
        for k in ["presence_penalty", "frequency_penalty"] {
            let e = completion(Some(&t), &json!({"prompt": [1], k: 2.5}), &LIM, 4000).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(k));
            assert!(e.message.contains("between -2 and 2"), "{}", e.message);
        }
    }

    #[test]
    fn logprobs_are_a_log_softmax_in_f64() {
        let row = [1.0f32, 3.0, 3.0, -2.0, f32::NEG_INFINITY];
        let lse = (1f64.exp() + 2.0 * 3f64.exp() + (-2f64).exp()).ln();
        let l = logprobs_of(&row, 0, 3);
        assert_eq!(l.id, 0);
        assert!((l.logprob - (1.0 - lse)).abs() < 1e-12, "{l:?}");
        // Most likely first, ties by the lower id.
        let ids: Vec<u32> = l.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 2, 0]);
        assert!((l.top[0].1 - (3.0 - lse)).abs() < 1e-12);
        // The probabilities sum to 1.
        let all = logprobs_of(&row, 3, 5);
        assert_eq!(all.top.len(), 4, "-inf is never a candidate");
        let sum: f64 = all.top.iter().map(|t| t.1.exp()).sum();
        assert!((sum - 1.0).abs() < 1e-12);
        assert_eq!(logprobs_of(&row, 4, 0).logprob, f64::NEG_INFINITY);
        assert!(logprobs_of(&row, 1, 0).top.is_empty());
    }

    #[test]
    fn n_choices_are_bounded() {
        let t = tok();
        let b = |n: Value| json!({"prompt": [1], "n": n});
        assert_eq!(completion(Some(&t), &b(json!(3)), &LIM, 4000).unwrap().n, 3);
        assert_eq!(
            completion(Some(&t), &json!({"prompt": [1]}), &LIM, 4000)
                .unwrap()
                .n,
            1
        );
        for bad in [json!(0), json!(MAX_N + 1), json!(1.5), json!("2")] {
            let e = completion(Some(&t), &b(bad.clone()), &LIM, 4000).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("n"), "{bad}");
        }
    }

    #[test]
    fn logprobs_fields_per_endpoint() {
        let t = tok();
        let m = json!([{"role": "user", "content": "x"}]);
        let c = |b: Value| chat(Some(&t), &b, &LIM);
        assert_eq!(c(json!({"messages": m})).unwrap().logprobs, None);
        assert_eq!(
            c(json!({"messages": m, "logprobs": false}))
                .unwrap()
                .logprobs,
            None
        );
        assert_eq!(
            c(json!({"messages": m, "logprobs": true}))
                .unwrap()
                .logprobs,
            Some(0)
        );
        let p = c(json!({"messages": m, "logprobs": true, "top_logprobs": 5})).unwrap();
        assert_eq!(p.logprobs, Some(5));
        let e = c(json!({"messages": m, "top_logprobs": 5})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = c(json!({"messages": m, "logprobs": true, "top_logprobs": 21})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = c(json!({"messages": m, "logprobs": 3})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        let p = completion(Some(&t), &json!({"prompt": [1], "logprobs": 2}), &LIM, 4000);
        assert_eq!(p.unwrap().logprobs, Some(2));
        let p = completion(Some(&t), &json!({"prompt": [1], "logprobs": 0}), &LIM, 4000);
        assert_eq!(p.unwrap().logprobs, Some(0));
        let e = completion(
            Some(&t),
            &json!({"prompt": [1], "logprobs": true}),
            &LIM,
            4000,
        );
        assert_eq!(e.unwrap_err().param.as_deref(), Some("logprobs"));
        let e = completion(
            Some(&t),
            &json!({"prompt": [1], "top_logprobs": 2}),
            &LIM,
            4000,
        );
        assert_eq!(e.unwrap_err().param.as_deref(), Some("top_logprobs"));
    }

    #[test]
    fn completion_prompts_as_text_or_ids() {
        let t = tok();
        let p = completion(
            Some(&t),
            &json!({"prompt": [1, 2, 3], "max_tokens": 2}),
            &LIM,
            4000,
        )
        .unwrap();
        assert_eq!(p.prompt, vec![1, 2, 3]);
        assert!(completion(Some(&t), &json!({"prompt": [99999]}), &LIM, 4000).is_err());
        // Never truncated to 32 bits: 2^32 + 5 is not id 5.
        let e = completion(Some(&t), &json!({"prompt": [4294967301u64]}), &LIM, 4000).unwrap_err();
        assert!(e.message.contains("4294967301"), "{}", e.message);
        assert!(completion(Some(&t), &json!({"prompt": [1.5]}), &LIM, 4000).is_err());
        // Without a tokenizer: ids only.
        assert_eq!(
            completion(None, &json!({"prompt": [1, 2]}), &LIM, 4000)
                .unwrap()
                .prompt,
            vec![1, 2]
        );
        let e = completion(None, &json!({"prompt": "hi"}), &LIM, 4000).unwrap_err();
        assert!(e.message.contains("--tok"), "{}", e.message);
        assert!(chat(
            None,
            &json!({"messages": [{"role": "user", "content": "x"}]}),
            &LIM
        )
        .is_err());
        // The logits are a debug endpoint: refused unless the server allows them.
        let e = completion(
            Some(&t),
            &json!({"prompt": [1], "k3_logits": true}),
            &LIM,
            4000,
        )
        .unwrap_err();
        assert!(e.message.contains("--debug-logits"), "{}", e.message);
        let dbg = Limits {
            debug_logits: true,
            ..LIM
        };
        assert!(
            completion(
                Some(&t),
                &json!({"prompt": [1], "k3_logits": true}),
                &dbg,
                4000
            )
            .unwrap()
            .keep_logits
        );
        assert!(completion(Some(&t), &json!({"prompt": 7}), &LIM, 4000).is_err());
        assert!(
            !completion(Some(&t), &json!({"prompt": "hello"}), &LIM, 4000)
                .unwrap()
                .prompt
                .is_empty()
        );
    }
}
