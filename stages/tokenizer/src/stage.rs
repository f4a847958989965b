//! The tokenizer stage: text to ids for the prompt, ids to text for the output stream.
//!
//! Before generation starts the orchestrator asks it to encode the prompt (`EncodeText`,
//! `EncodeBytes` or `EncodeChat` on the control socket, answered with `Ids`). During
//! generation compute sends each new id (`DecodeId`) over their link and this stage sends
//! the id's bytes to the orchestrator (`Text`), which prints them as they come. Without a
//! tokenizer directory the vocabulary is bytes (id = byte), which is what the tiny models
//! were built with.

use k3_protocol::conf::TokenizerConf;
use k3_protocol::failure::{FailureKind, StageFailure};
use k3_protocol::link::{recv_from, StageCtx};
use k3_protocol::messages::{Msg, Stage};

use crate::Tokenizer;

/// Either a real Kimi tokenizer or the tiny models' byte vocabulary.
pub enum Vocab {
    Kimi(Box<Tokenizer>),
    Bytes,
}

impl Vocab {
    pub fn load(conf: &TokenizerConf) -> Result<Vocab, String> {
        match &conf.tok_dir {
            Some(d) => Tokenizer::from_dir(d)
                .map(|t| Vocab::Kimi(Box::new(t)))
                .map_err(|e| format!("tokenizer: {e}")),
            None => Ok(Vocab::Bytes),
        }
    }

    fn encode_text(&self, text: &str, allow_specials: bool) -> Vec<u32> {
        match self {
            Vocab::Kimi(t) => t.encode(text, allow_specials),
            Vocab::Bytes => text.bytes().map(u32::from).collect(),
        }
    }

    fn encode_bytes(&self, b: &[u8], allow_specials: bool) -> Vec<u32> {
        match self {
            Vocab::Kimi(t) => t.encode_bytes(b, allow_specials),
            Vocab::Bytes => b.iter().map(|&x| u32::from(x)).collect(),
        }
    }

    fn id_bytes(&self, id: u32) -> Vec<u8> {
        match self {
            Vocab::Kimi(t) => t
                .token_bytes(id)
                .map(|b| b.to_vec())
                .unwrap_or_else(|_| format!("<|bad_id_{id}|>").into_bytes()),
            Vocab::Bytes => {
                if id < 256 {
                    vec![id as u8]
                } else {
                    format!("<|{id}|>").into_bytes()
                }
            }
        }
    }

    /// Ids that end generation (the Kimi stop ids; none for a byte vocabulary).
    pub fn stop_ids(&self) -> Vec<u32> {
        match self {
            Vocab::Kimi(t) => t.stop_ids(),
            Vocab::Bytes => Vec::new(),
        }
    }
}

/// Run the tokenizer stage until shutdown.
pub fn run(mut ctx: StageCtx) -> Result<(), StageFailure> {
    ctx.wait_configure()?;
    let conf: TokenizerConf = serde_json::from_str(&ctx.conf_json)
        .map_err(|e| ctx.fail(failed(format!("tokenizer: bad Configure: {e}"))))?;
    let vocab = Vocab::load(&conf).map_err(|e| ctx.fail(failed(e)))?;
    tracing::debug!(
        kimi = matches!(vocab, Vocab::Kimi(_)),
        "tokenizer: vocabulary loaded"
    );
    ctx.ready()?;
    ctx.serve_control(|ctx, m| {
        let reply = match m {
            Msg::Ready {
                stage: Stage::Orchestrator,
            } => return Ok(true),
            Msg::EncodeText {
                req,
                text,
                allow_specials,
            } => Msg::Ids {
                req,
                ids: vocab.encode_text(&text, allow_specials),
            },
            Msg::EncodeBytes {
                req,
                bytes,
                allow_specials,
            } => Msg::Ids {
                req,
                ids: vocab.encode_bytes(&bytes, allow_specials),
            },
            Msg::EncodeChat { req, chat_json } => match &vocab {
                Vocab::Kimi(t) => Msg::Ids {
                    req,
                    ids: crate::chat::encode_chat_json(t, &chat_json)
                        .map_err(|e| failed(format!("tokenizer: chat: {e}")))?,
                },
                Vocab::Bytes => {
                    return Err(ctx.fail(failed(
                        "tokenizer: --chat needs a Kimi tokenizer (--tok)".into(),
                    )))
                }
            },
            other => return Err(ctx.fail(failed(format!("tokenizer: unexpected {other:?}")))),
        };
        ctx.send_control(&reply)?;
        Ok(false)
    })?;
    let mut link = ctx.take_link(Stage::LayerCompute)?;
    let mut decoded = 0u64;
    loop {
        match recv_from(&mut *link, Stage::Tokenizer, Stage::LayerCompute, None)? {
            Msg::DecodeId { id } => {
                decoded += 1;
                ctx.send_control(&Msg::Text {
                    bytes: vocab.id_bytes(id),
                })?;
            }
            Msg::Shutdown => break,
            other => return Err(ctx.fail(failed(format!("tokenizer: unexpected {other:?}")))),
        }
    }
    ctx.send_control(&Msg::Summary {
        stage: Stage::Tokenizer,
        json: serde_json::json!({ "decoded": decoded }).to_string(),
    })?;
    Ok(ctx.finish_recording()?)
}

/// Interim: a failure from a message (typed errors come next).
fn failed(msg: String) -> StageFailure {
    StageFailure::new(FailureKind::Config, msg)
}
