//! The tokenizer stage entry: a pure, in-process request/response API.
//!
//! The pipeline wraps [`TokRequest`] / [`TokResponse`] in its protocol messages and runs
//! [`TokenizerStage::handle`] in the tokenizer process (or in-process with `--inproc`). Both
//! types are plain serde data (no `serde_json::Value`), so any serde format (bincode 2,
//! JSON) carries them. The stage keeps one piece of state: the streaming decoder for the
//! generated id stream.

use crate::chat::{self, ChatRequest, ParsedOutput};
use crate::stream::StreamDecoder;
use crate::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};

/// What the stage is asked to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TokRequest {
    /// Encode UTF-8 text; `allow_special` recognises the 256 special names.
    EncodeText { text: String, allow_special: bool },
    /// Encode raw bytes (e.g. a prompt file read verbatim; invalid UTF-8 allowed).
    EncodeBytes { bytes: Vec<u8>, allow_special: bool },
    /// Render and encode a chat: `request_json` is a [`ChatRequest`] as JSON
    /// (`{"messages": [...], "tools": [...], "thinking": true, "thinking_effort": "max", ...}`).
    EncodeChat { request_json: String },
    /// Start a new generated stream (drops held bytes and the stop flag).
    DecodeReset,
    /// Next generated ids: returns the newly complete text. A stop id (`<|end_of_msg|>`,
    /// `[EOS]`) is not rendered; it sets `stopped`, and ids after it are ignored until
    /// `DecodeReset`.
    DecodeIds { ids: Vec<u32> },
    /// End of the generated stream: flush held bytes (an incomplete character is U+FFFD).
    DecodeFinish,
    /// Split decoded model output into reasoning, response and tool calls.
    ParseOutput {
        text: String,
        started_in_think: bool,
    },
}

/// The stage's answer to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TokResponse {
    Ids { ids: Vec<u32> },
    Text { text: String, stopped: bool },
    Parsed { output: ParsedOutputWire },
    Error { message: String },
}

/// [`ParsedOutput`] with tool-call arguments as JSON text (serde-format independent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParsedOutputWire {
    pub reasoning: String,
    pub content: String,
    /// `(name, index, arguments as a JSON object text, raw json block)` per call.
    pub tool_calls: Vec<(String, Option<u32>, String, Option<String>)>,
    pub finished: bool,
}

impl From<ParsedOutput> for ParsedOutputWire {
    fn from(p: ParsedOutput) -> Self {
        ParsedOutputWire {
            reasoning: p.reasoning,
            content: p.content,
            tool_calls: p
                .tool_calls
                .into_iter()
                .map(|c| {
                    let args = serde_json::Value::Object(c.arguments).to_string();
                    (c.name, c.index, args, c.raw_json)
                })
                .collect(),
            finished: p.finished,
        }
    }
}

/// The tokenizer stage: a loaded tokenizer plus the generated-stream decoder.
pub struct TokenizerStage {
    tok: Tokenizer,
    stream: StreamDecoder,
    stopped: bool,
    stop_ids: Vec<u32>,
}

impl TokenizerStage {
    /// Wrap a loaded tokenizer.
    pub fn new(tok: Tokenizer) -> TokenizerStage {
        let stop_ids = tok.stop_ids();
        TokenizerStage {
            tok,
            stream: StreamDecoder::new(),
            stopped: false,
            stop_ids,
        }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// Handle one request. Never panics; bad input is a `TokResponse::Error`.
    pub fn handle(&mut self, req: TokRequest) -> TokResponse {
        match req {
            TokRequest::EncodeText {
                text,
                allow_special,
            } => TokResponse::Ids {
                ids: self.tok.encode(&text, allow_special),
            },
            TokRequest::EncodeBytes {
                bytes,
                allow_special,
            } => TokResponse::Ids {
                ids: self.tok.encode_bytes(&bytes, allow_special),
            },
            TokRequest::EncodeChat { request_json } => {
                match encode_chat_json(&self.tok, &request_json) {
                    Ok(ids) => TokResponse::Ids { ids },
                    Err(message) => TokResponse::Error { message },
                }
            }
            TokRequest::DecodeReset => {
                self.stream = StreamDecoder::new();
                self.stopped = false;
                TokResponse::Text {
                    text: String::new(),
                    stopped: false,
                }
            }
            TokRequest::DecodeIds { ids } => {
                let mut text = String::new();
                for id in ids {
                    if self.stopped {
                        break;
                    }
                    if self.stop_ids.contains(&id) {
                        self.stopped = true;
                        break;
                    }
                    match self.stream.push(&self.tok, id) {
                        Ok(s) => text.push_str(&s),
                        Err(e) => {
                            return TokResponse::Error {
                                message: e.to_string(),
                            }
                        }
                    }
                }
                TokResponse::Text {
                    text,
                    stopped: self.stopped,
                }
            }
            TokRequest::DecodeFinish => TokResponse::Text {
                text: self.stream.finish(),
                stopped: self.stopped,
            },
            TokRequest::ParseOutput {
                text,
                started_in_think,
            } => TokResponse::Parsed {
                output: chat::parse_output(&text, started_in_think).into(),
            },
        }
    }
}

/// Parse a chat request JSON text, render it and encode the segments. Accepts a
/// [`ChatRequest`] object (`{"messages": [...], "tools": ..., "thinking": ..., ...}`) or a
/// bare JSON list of messages (rendered with [`chat::ChatOptions::default`]: thinking on,
/// effort "max", generation prompt).
pub fn encode_chat_json(tok: &Tokenizer, request_json: &str) -> Result<Vec<u32>, String> {
    let v: serde_json::Value = serde_json::from_str(request_json)
        .map_err(|e| format!("chat request is not valid JSON: {e}"))?;
    let req: ChatRequest = match v {
        serde_json::Value::Array(messages) => ChatRequest {
            messages,
            tools: None,
            options: chat::ChatOptions::default(),
        },
        v => serde_json::from_value(v).map_err(|e| format!("chat request is not valid: {e}"))?,
    };
    let segs = chat::build_chat_segments(&req.messages, req.tools.as_ref(), &req.options)
        .map_err(|e| e.to_string())?;
    Ok(tok.encode_segments(&segs))
}
