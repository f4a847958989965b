//! K3's XTML chat format (spec §5.5): rendering a conversation into segments, and parsing
//! model output back into reasoning, response and tool calls.
//!
//! The renderer follows the behaviour of `encoding_k3.py` (as carried by vLLM's derived
//! copy): structural control tokens (`<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>`) are
//! segments encoded with specials allowed; everything else (tag names, each attribute
//! ` key="value"` as ONE segment, content) is encoded with specials off, each as its own
//! segment, so BPE never merges across them. Messages are OpenAI-style JSON values.
//! Deliberate differences: an unknown role or an image part is an error here (the reference
//! skips unknown roles and substitutes an image placeholder); this is a text-only engine.

use crate::error::{Result, TokError};
use crate::tokenizer::Segment;
use serde_json::{Map, Value};

pub const OPEN: &str = "<|open|>";
pub const CLOSE: &str = "<|close|>";
pub const SEP: &str = "<|sep|>";
pub const END_OF_MSG: &str = "<|end_of_msg|>";
/// Accepted `thinking_effort` values ("medium" is rejected, as the official encoder does).
pub const EFFORTS: [&str; 3] = ["low", "high", "max"];

/// Rendering options (the keyword arguments of the reference encoder).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ChatOptions {
    /// Thinking mode (assistant turns carry a `think` block; the prompt opens `think`).
    pub thinking: bool,
    /// `low`, `high` or `max`; `None` = no thinking-effort system message.
    pub thinking_effort: Option<String>,
    /// End with `<|open|>message role="assistant"<|sep|>` + open think/response.
    pub add_generation_prompt: bool,
    /// `"required"` or `"none"` adds a tool-choice system message.
    pub tool_choice: Option<String>,
    /// `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {...}}`.
    pub response_format: Option<Value>,
}

impl Default for ChatOptions {
    /// Thinking on with effort "max" (what `apply_chat_template` defaults to), generation
    /// prompt on.
    fn default() -> Self {
        ChatOptions {
            thinking: true,
            thinking_effort: Some("max".into()),
            add_generation_prompt: true,
            tool_choice: None,
            response_format: None,
        }
    }
}

/// A whole chat request: messages, optional tool declarations, options (flattened).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Value>,
    #[serde(default)]
    pub tools: Option<Value>,
    #[serde(flatten)]
    pub options: ChatOptions,
}

fn chat_err<T>(msg: impl Into<String>) -> Result<T> {
    Err(TokError::Chat(msg.into()))
}

/// Python's `str.strip()` (whitespace as `str.isspace` defines it).
fn py_strip(s: &str) -> &str {
    s.trim_matches(|c: char| {
        matches!(c, '\t'..='\r' | '\u{1c}'..='\u{20}' | '\u{85}' | '\u{a0}' | '\u{1680}'
            | '\u{2000}'..='\u{200a}' | '\u{2028}' | '\u{2029}' | '\u{202f}' | '\u{205f}' | '\u{3000}')
    })
}

/// Python's `repr(float)` (shortest round-trip digits; exponent form outside 1e-4..1e16).
#[doc(hidden)]
pub fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let e = format!("{:e}", f); // e.g. "-1.2345e-5", shortest round-trip digits
    let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mant) = match mant.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mant),
    };
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!(
                "{sign}{digits}{}.0",
                "0".repeat(point as usize - digits.len())
            )
        } else {
            let (a, b) = digits.split_at(point as usize);
            format!("{sign}{a}.{b}")
        }
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let es = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{es}{:02}", exp.abs())
    }
}

fn py_json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `json.dumps(v, ensure_ascii=False)`; `compact` = `separators=(",", ":")`.
pub fn py_json(v: &Value, compact: bool) -> String {
    let mut out = String::new();
    py_json_into(v, compact, &mut out);
    out
}

fn py_json_into(v: &Value, compact: bool, out: &mut String) {
    let (item, key) = if compact { (",", ":") } else { (", ", ": ") };
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if n.is_f64() {
                out.push_str(&py_float(n.as_f64().unwrap_or(f64::NAN)))
            } else {
                out.push_str(&n.to_string())
            }
        }
        Value::String(s) => py_json_str(s, out),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item);
                }
                py_json_into(x, compact, out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(item);
                }
                py_json_str(k, out);
                out.push_str(key);
                py_json_into(x, compact, out);
            }
            out.push('}');
        }
    }
}

/// Keys sorted recursively (code point order, as Python's `sorted`).
pub fn deep_sort(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let mut out = Map::new();
            for k in keys {
                out.insert(k.clone(), deep_sort(&m[k]));
            }
            Value::Object(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(deep_sort).collect()),
        x => x.clone(),
    }
}

/// Python truthiness of a JSON value.
fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
    }
}

/// `str(value)` for attribute values and names.
fn py_str(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        other => py_json(other, false),
    }
}

/// Rendered segments of one conversation.
struct Out {
    segs: Vec<Segment>,
}

impl Out {
    fn seg(&mut self, text: &str, allow_special: bool) {
        if !text.is_empty() {
            self.segs.push(Segment {
                text: text.to_string(),
                allow_special,
            });
        }
    }
    fn control(&mut self, t: &str) {
        self.seg(t, true)
    }
    fn text(&mut self, t: &str) {
        self.seg(t, false)
    }
    fn open(&mut self, tag: &str, attrs: &[(&str, String)]) {
        self.control(OPEN);
        self.text(tag);
        for (k, v) in attrs {
            let esc = v.replace('&', "&amp;").replace('"', "&quot;");
            self.text(&format!(" {k}=\"{esc}\""));
        }
        self.control(SEP);
    }
    fn close(&mut self, tag: &str) {
        self.control(CLOSE);
        self.text(tag);
        self.control(SEP);
    }
    fn system(&mut self, kind: &str, body: &str) {
        self.open(
            "message",
            &[("role", "system".into()), ("type", kind.into())],
        );
        self.text(py_strip(body));
        self.close("message");
        self.control(END_OF_MSG);
    }
    fn content(&mut self, content: Option<&Value>) -> Result<()> {
        match content {
            None | Some(Value::Null) => Ok(()),
            Some(Value::String(s)) => {
                self.text(s);
                Ok(())
            }
            Some(Value::Array(parts)) => {
                for p in parts {
                    let ty = p.get("type").and_then(Value::as_str).unwrap_or("");
                    if ty == "image" || ty == "image_url" {
                        return chat_err("image content parts are not supported (text model only)");
                    }
                    match p.get("text") {
                        Some(Value::String(s)) => self.text(s),
                        Some(other) => self.text(&py_str(other)),
                        None => {
                            return chat_err(format!(
                                "content part without \"text\": {}",
                                py_json(p, true)
                            ))
                        }
                    }
                }
                Ok(())
            }
            Some(other) => chat_err(format!(
                "content must be a string or a list of parts, got {}",
                py_json(other, true)
            )),
        }
    }
}

fn xtml_type(v: &Value) -> &'static str {
    match v {
        Value::Bool(_) => "boolean",
        Value::Null => "null",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Object(_) => "object",
        Value::Array(_) => "array",
    }
}

/// `call.get("function", call)`
fn function_of(call: &Value) -> &Value {
    call.get("function").unwrap_or(call)
}

/// Arguments normalised: `(arguments object, unparsable JSON text)`.
fn normalize_arguments(args: Option<&Value>) -> Result<(Map<String, Value>, Option<String>)> {
    match args {
        None | Some(Value::Null) => Ok((Map::new(), None)),
        Some(Value::Object(m)) => Ok((m.clone(), None)),
        Some(Value::String(s)) => {
            if py_strip(s).is_empty() {
                return Ok((Map::new(), None));
            }
            match serde_json::from_str::<Value>(s) {
                Ok(Value::Object(m)) => Ok((m, None)),
                Ok(_) => chat_err("tool call arguments must be a JSON object"),
                Err(_) => Ok((Map::new(), Some(s.clone()))),
            }
        }
        Some(_) => chat_err("tool call arguments must be an object or a JSON object string"),
    }
}

/// Re-order each run of tool results to the assistant's call order when every result's
/// `tool_call_id` resolves, and fill in the tool name from the call.
fn reorder_tool_results(messages: &[Value]) -> Vec<Value> {
    let mut out = Vec::new();
    let mut call_index: std::collections::HashMap<String, (usize, Option<String>)> =
        Default::default();
    let mut i = 0;
    let role = |m: &Value| m.get("role").and_then(Value::as_str).map(str::to_string);
    while i < messages.len() {
        let m = &messages[i];
        if role(m).as_deref() == Some("assistant") {
            call_index.clear();
            if let Some(Value::Array(calls)) = m.get("tool_calls") {
                for (pos, call) in calls.iter().enumerate() {
                    let name = function_of(call)
                        .get("name")
                        .and_then(Value::as_str)
                        .map(str::to_string);
                    if let Some(id) = call.get("id").filter(|v| !v.is_null()) {
                        call_index.entry(py_str(id)).or_insert((pos + 1, name));
                    }
                }
            }
            out.push(m.clone());
            i += 1;
            continue;
        }
        if role(m).as_deref() != Some("tool") {
            out.push(m.clone());
            i += 1;
            continue;
        }
        let mut run: Vec<(usize, Value)> = Vec::new();
        let mut unresolved = false;
        while i < messages.len() && role(&messages[i]).as_deref() == Some("tool") {
            let tm = &messages[i];
            let id = tm
                .get("tool_call_id")
                .or_else(|| tm.get("id"))
                .filter(|v| !v.is_null());
            match id.and_then(|id| call_index.get(&py_str(id))) {
                None => {
                    unresolved = true;
                    run.push((0, tm.clone()));
                }
                Some((pos, name)) => {
                    let mut r = tm.clone();
                    if let (Some(name), Value::Object(o)) = (name, &mut r) {
                        o.insert("tool".into(), Value::String(name.clone()));
                        if o.contains_key("name") {
                            o.insert("name".into(), Value::String(name.clone()));
                        }
                    }
                    run.push((*pos, r));
                }
            }
            i += 1;
        }
        if !unresolved {
            run.sort_by_key(|(p, _)| *p); // stable, like Python's sorted
        }
        out.extend(run.into_iter().map(|(_, m)| m));
    }
    out
}

fn tool_declare(out: &mut Out, tools: &Value, dynamic: bool) {
    let json = py_json(tools, true);
    let body = if dynamic {
        format!(
            "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n\
             You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n\
             ```json\n{json}\n```"
        )
    } else {
        format!("# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{json}\n```")
    };
    out.system("tool-declare", &body);
}

fn render_assistant(out: &mut Out, m: &Value, thinking: bool) -> Result<()> {
    if thinking {
        out.open("think", &[]);
        let r = m
            .get("reasoning_content")
            .filter(|v| truthy(Some(v)))
            .or_else(|| m.get("reasoning"));
        if let Some(r) = r.filter(|v| !v.is_null()) {
            let s = py_str(r);
            if !py_strip(&s).is_empty() {
                out.text(&s);
            }
        }
        out.close("think");
    }
    out.open("response", &[]);
    out.content(m.get("content"))?;
    out.close("response");
    let calls = match m.get("tool_calls") {
        Some(Value::Array(c)) if !c.is_empty() => c,
        None | Some(Value::Null) | Some(Value::Array(_)) => return Ok(()),
        Some(_) => return chat_err("tool_calls must be a list"),
    };
    out.open("tools", &[]);
    for (index, call) in calls.iter().enumerate() {
        let f = function_of(call);
        let name = match f.get("name") {
            Some(n) if !n.is_null() => py_str(n),
            _ => return chat_err(format!("tool call {} has no function name", index + 1)),
        };
        out.open(
            "call",
            &[("tool", name), ("index", (index + 1).to_string())],
        );
        let (args, block) = normalize_arguments(f.get("arguments"))?;
        if let Some(block) = block {
            out.open("json", &[("type", "object".into())]);
            out.text(&block);
            out.close("json");
        } else {
            for (k, v) in &args {
                out.open(
                    "argument",
                    &[("key", k.clone()), ("type", xtml_type(v).into())],
                );
                match v {
                    Value::String(s) => out.text(s),
                    other => out.text(&py_json(other, false)),
                }
                out.close("argument");
            }
        }
        out.close("call");
    }
    out.close("tools");
    Ok(())
}

/// Render a conversation into segments (the reference's `build_chat_segments`).
pub fn build_chat_segments(
    messages: &[Value],
    tools: Option<&Value>,
    opts: &ChatOptions,
) -> Result<Vec<Segment>> {
    let messages = reorder_tool_results(messages);
    let mut out = Out { segs: Vec::new() };
    if let Some(t) = tools {
        if truthy(Some(t)) {
            tool_declare(&mut out, &deep_sort(t), false);
        }
    }
    render_effort(&mut out, opts)?;
    render_messages(&mut out, &messages, opts.thinking)?;
    render_tool_choice(&mut out, opts);
    if let Some(rf) = &opts.response_format {
        render_response_format(&mut out, rf);
    }
    if opts.add_generation_prompt {
        out.open("message", &[("role", "assistant".into())]);
        out.open(if opts.thinking { "think" } else { "response" }, &[]);
    }
    Ok(out.segs)
}

/// The thinking-effort system message (thinking on and an effort given).
fn render_effort(out: &mut Out, opts: &ChatOptions) -> Result<()> {
    let effort = opts.thinking_effort.as_deref();
    if opts.thinking {
        if let Some(e) = effort {
            if !EFFORTS.contains(&e) {
                return chat_err(format!(
                    "unsupported thinking_effort={e:?}; supported values are {EFFORTS:?}"
                ));
            }
            out.system(
                "thinking-effort",
                &format!(
                    "`thinking_effort` guides on how much to think in your thinking channel (not including the \
                     response channel), supported values include `low`, `medium`, `high`, and `max`.\n\
                     Now the system is invoked with `thinking_effort={e}`."
                ),
            );
        }
    }
    Ok(())
}

/// Every message of the conversation, in order (tool results already next to their call).
fn render_messages(out: &mut Out, messages: &[Value], thinking: bool) -> Result<()> {
    let mut prior_calls: Option<Vec<Value>> = None;
    let mut tool_index = 0usize;
    for (mi, m) in messages.iter().enumerate() {
        if !m.is_object() {
            continue;
        }
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r) => r,
            None => return chat_err(format!("message {mi} has no \"role\" string")),
        };
        match role {
            "system" if truthy(m.get("tools")) => {
                tool_declare(out, &deep_sort(&m["tools"]), true);
            }
            "user" | "system" => {
                let mut attrs = vec![("role", role.to_string())];
                if truthy(m.get("name")) {
                    attrs.push(("name", py_str(&m["name"])));
                }
                out.open("message", &attrs);
                out.content(m.get("content"))?;
                out.close("message");
                out.control(END_OF_MSG);
            }
            "assistant" => {
                prior_calls = match m.get("tool_calls") {
                    Some(Value::Array(c)) => Some(c.clone()),
                    _ => None,
                };
                tool_index = 0;
                out.open("message", &[("role", "assistant".into())]);
                render_assistant(out, m, thinking)?;
                out.close("message");
                out.control(END_OF_MSG);
            }
            "tool" => {
                tool_index += 1;
                let mut name = match m.get("tool") {
                    Some(v) => Some(v),
                    None => m.get("name"),
                }
                .filter(|v| !v.is_null())
                .map(py_str);
                if name.is_none() {
                    if let Some(calls) = &prior_calls {
                        if tool_index <= calls.len() {
                            name = function_of(&calls[tool_index - 1]).get("name").map(py_str);
                        }
                    }
                }
                let Some(name) = name else {
                    return chat_err(format!("tool message {mi} has no resolvable tool name"));
                };
                out.open(
                    "message",
                    &[
                        ("role", "tool".into()),
                        ("tool", name),
                        ("index", tool_index.to_string()),
                    ],
                );
                out.content(m.get("content"))?;
                out.close("message");
                out.control(END_OF_MSG);
            }
            other => return chat_err(format!("message {mi} has unknown role {other:?}")),
        }
    }
    Ok(())
}

/// The tool-choice system message (`required` or `none`).
fn render_tool_choice(out: &mut Out, opts: &ChatOptions) {
    if let Some(tc @ ("required" | "none")) = opts.tool_choice.as_deref() {
        let req = if tc == "required" {
            "call tools"
        } else {
            "NOT call any tools"
        };
        out.system(
            "tool-choice",
            &format!("The system is invoked with `tool_choice={tc}`.\nYou MUST {req} in the next message."),
        );
    }
}

/// The response-format system message (`json_object` or `json_schema`).
fn render_response_format(out: &mut Out, rf: &Value) {
    let ty = match rf {
        Value::Object(o) => o.get("type").and_then(Value::as_str),
        Value::String(s) => Some(s.as_str()),
        _ => None,
    };
    let base = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting.";
    match ty {
        Some("json_object") => out.system(
            "response-format",
            &format!("The system is invoked with `response_format=json_object`.\n{base}"),
        ),
        Some("json_schema") => {
            let js = rf.get("json_schema");
            let schema = match js {
                None | Some(Value::Null) => Value::Null,
                Some(j) => j
                    .get("schema")
                    .or_else(|| j.get("json_schema"))
                    .cloned()
                    .unwrap_or_else(|| j.clone()),
            };
            out.system(
                "response-format",
                &format!(
                    "The system is invoked with `response_format=json_schema`.\n{base}\n\
                     The JSON data must match the following schema:\n```json\n{}\n```",
                    py_json(&deep_sort(&schema), true)
                ),
            );
        }
        _ => {}
    }
}

impl crate::tokenizer::Tokenizer {
    /// Render a conversation (spec §5.5) and encode its segments.
    pub fn encode_chat(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        opts: &ChatOptions,
    ) -> Result<Vec<u32>> {
        Ok(self.encode_segments(&build_chat_segments(messages, tools, opts)?))
    }
}

/// `text` as the content of one user message (what `--chat` wraps a prompt in).
pub fn one_user_turn(text: &str) -> Vec<Value> {
    vec![serde_json::json!({"role": "user", "content": text})]
}

/// One tool call parsed from model output.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ParsedToolCall {
    pub name: String,
    /// The `index` attribute (1-based), when present and numeric.
    pub index: Option<u32>,
    /// Arguments in emission order; non-string types parsed as JSON (kept as a string when
    /// the model wrote invalid JSON for them).
    pub arguments: Map<String, Value>,
    /// The body of a `json` block (unstructured arguments), verbatim.
    pub raw_json: Option<String>,
}

/// Model output split into its channels.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ParsedOutput {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ParsedToolCall>,
    /// `<|end_of_msg|>` or the closing of the message was seen.
    pub finished: bool,
}

fn unescape_attr(s: &str) -> String {
    s.replace("&quot;", "\"").replace("&amp;", "&")
}

/// `name attr="v" ...` of an open tag.
fn parse_header(h: &str) -> (String, Vec<(String, String)>) {
    let (name, mut rest) = match h.find(' ') {
        Some(i) => (&h[..i], &h[i..]),
        None => (h, ""),
    };
    let mut attrs = Vec::new();
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim().to_string();
        let after = &rest[eq + 2..];
        let Some(endq) = after.find('"') else { break };
        attrs.push((key, unescape_attr(&after[..endq])));
        rest = &after[endq + 1..];
    }
    (name.to_string(), attrs)
}

#[derive(Clone, Copy, PartialEq)]
enum Chan {
    Think,
    Response,
    Argument,
    Json,
    Other,
}

/// Parse decoded model output (special tokens as their names). `started_in_think`: the
/// prompt ended by opening `think` (thinking mode) rather than `response`.
pub fn parse_output(text: &str, started_in_think: bool) -> ParsedOutput {
    let mut p = ParsedOutput::default();
    let mut chan = if started_in_think {
        Chan::Think
    } else {
        Chan::Response
    };
    let mut arg: Option<(String, String, String)> = None; // key, type, value
    let mut json = String::new();
    let mut rest = text;
    let emit = |p: &mut ParsedOutput,
                chan: Chan,
                arg: &mut Option<(String, String, String)>,
                json: &mut String,
                s: &str| match chan {
        Chan::Think => p.reasoning.push_str(s),
        Chan::Response => p.content.push_str(s),
        Chan::Argument => {
            if let Some(a) = arg {
                a.2.push_str(s)
            }
        }
        Chan::Json => json.push_str(s),
        Chan::Other => {}
    };
    while !rest.is_empty() {
        let next = [OPEN, CLOSE, END_OF_MSG]
            .iter()
            .filter_map(|t| rest.find(t).map(|i| (i, *t)))
            .min();
        let Some((i, tok)) = next else {
            emit(&mut p, chan, &mut arg, &mut json, rest);
            break;
        };
        emit(&mut p, chan, &mut arg, &mut json, &rest[..i]);
        let after = &rest[i + tok.len()..];
        if tok == END_OF_MSG {
            p.finished = true;
            break;
        }
        let Some(sep) = after.find(SEP) else {
            // An unterminated tag at the end of the stream: keep it as text.
            emit(&mut p, chan, &mut arg, &mut json, &rest[i..]);
            break;
        };
        let tag_text = &rest[i..i + tok.len() + sep + SEP.len()];
        let (name, attrs) = parse_header(&after[..sep]);
        let get = |k: &str| attrs.iter().find(|(a, _)| a == k).map(|(_, v)| v.clone());
        rest = &after[sep + SEP.len()..];
        match (tok, name.as_str()) {
            (OPEN, "think") => chan = Chan::Think,
            (OPEN, "response") => chan = Chan::Response,
            (CLOSE, "think")
            | (CLOSE, "response")
            | (OPEN, "tools")
            | (CLOSE, "call")
            | (CLOSE, "tools") => chan = Chan::Other,
            (OPEN, "call") => {
                p.tool_calls.push(ParsedToolCall {
                    name: get("tool").unwrap_or_default(),
                    index: get("index").and_then(|s| s.parse().ok()),
                    arguments: Map::new(),
                    raw_json: None,
                });
                chan = Chan::Other;
            }
            (OPEN, "argument") => {
                arg = Some((
                    get("key").unwrap_or_default(),
                    get("type").unwrap_or_default(),
                    String::new(),
                ));
                chan = Chan::Argument;
            }
            (CLOSE, "argument") => {
                if let (Some((k, ty, v)), Some(call)) = (arg.take(), p.tool_calls.last_mut()) {
                    let val = if ty == "string" {
                        Value::String(v)
                    } else {
                        serde_json::from_str(&v).unwrap_or(Value::String(v))
                    };
                    call.arguments.insert(k, val);
                }
                chan = Chan::Other;
            }
            (OPEN, "json") => {
                json.clear();
                chan = Chan::Json;
            }
            (CLOSE, "json") => {
                if let Some(call) = p.tool_calls.last_mut() {
                    if let Ok(Value::Object(m)) = serde_json::from_str::<Value>(&json) {
                        call.arguments = m;
                    }
                    call.raw_json = Some(std::mem::take(&mut json));
                }
                chan = Chan::Other;
            }
            (CLOSE, "message") => {
                p.finished = true;
                chan = Chan::Other;
            }
            _ => {
                // Unknown tag: literal text of the current channel.
                emit(&mut p, chan, &mut arg, &mut json, tag_text);
            }
        }
    }
    p
}

/// What [`OutputStream::push`] hands out: the new reasoning and response text, and the
/// tool calls completed since the last call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OutputDelta {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ParsedToolCall>,
}

impl OutputDelta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.tool_calls.is_empty()
    }
}

/// [`parse_output`] over a stream of decoded text pieces: each piece gives the reasoning
/// and response text that is now certain (a tag still being spelled out is held back until
/// it completes) and each tool call once its `<|close|>call<|sep|>` arrives.
#[derive(Debug, Clone)]
pub struct OutputStream {
    text: String,
    started_in_think: bool,
    reasoning: usize,
    content: usize,
    calls: usize,
}

impl OutputStream {
    /// `started_in_think`: the prompt ended by opening `think` (thinking mode).
    pub fn new(started_in_think: bool) -> OutputStream {
        OutputStream {
            text: String::new(),
            started_in_think,
            reasoning: 0,
            content: 0,
            calls: 0,
        }
    }

    /// Where the certain text ends: before a tag whose `<|sep|>` has not come yet, or a
    /// tail that may be the start of a control token.
    fn safe_end(&self) -> usize {
        let t = &self.text;
        let mut end = t.len();
        for tok in [OPEN, CLOSE] {
            if let Some(i) = t.rfind(tok) {
                if !t[i..].contains(SEP) {
                    end = end.min(i);
                }
            }
        }
        for tok in [OPEN, CLOSE, END_OF_MSG] {
            for k in (1..tok.len()).rev() {
                if t.ends_with(&tok[..k]) {
                    end = end.min(t.len() - k);
                    break;
                }
            }
        }
        end
    }

    /// What `upto` bytes of the text give beyond what was handed out; `all`: every tool
    /// call, complete or not (the end of the stream).
    fn take(&mut self, upto: usize, all: bool) -> OutputDelta {
        let t = &self.text[..upto];
        let p = parse_output(t, self.started_in_think);
        let complete = if all {
            p.tool_calls.len()
        } else {
            t.matches(&format!("{CLOSE}call{SEP}"))
                .count()
                .min(p.tool_calls.len())
        };
        let d = OutputDelta {
            reasoning: p.reasoning.get(self.reasoning..).unwrap_or("").to_string(),
            content: p.content.get(self.content..).unwrap_or("").to_string(),
            tool_calls: p
                .tool_calls
                .get(self.calls..complete)
                .unwrap_or_default()
                .to_vec(),
        };
        self.reasoning = self.reasoning.max(p.reasoning.len());
        self.content = self.content.max(p.content.len());
        self.calls = self.calls.max(complete);
        d
    }

    /// One more piece of decoded text.
    pub fn push(&mut self, piece: &str) -> OutputDelta {
        self.text.push_str(piece);
        let end = self.safe_end();
        self.take(end, false)
    }

    /// The end of the stream: everything not handed out yet.
    pub fn finish(&mut self) -> OutputDelta {
        self.take(self.text.len(), true)
    }

    /// The whole output parsed so far.
    pub fn parsed(&self) -> ParsedOutput {
        parse_output(&self.text, self.started_in_think)
    }
}

/// Parse a chat request JSON text, render it and encode the segments. Accepts a
/// [`ChatRequest`] object (`{"messages": [...], "tools": ..., "thinking": ..., ...}`) or a
/// bare JSON list of messages (rendered with [`ChatOptions::default`]: thinking on,
/// effort "max", generation prompt).
pub fn encode_chat_json(tok: &crate::tokenizer::Tokenizer, request_json: &str) -> Result<Vec<u32>> {
    let bad = |what: &'static str| move |source| TokError::ChatRequest { what, source };
    let v: serde_json::Value = serde_json::from_str(request_json).map_err(bad("valid JSON"))?;
    let req: ChatRequest = match v {
        serde_json::Value::Array(messages) => ChatRequest {
            messages,
            tools: None,
            options: ChatOptions::default(),
        },
        v => serde_json::from_value(v).map_err(bad("valid"))?,
    };
    let segs = build_chat_segments(&req.messages, req.tools.as_ref(), &req.options)?;
    Ok(tok.encode_segments(&segs))
}
