//! The tokenizer stage: text to ids for the prompt, ids to text for the output stream.
//!
//! Before generation starts the orchestrator asks it to encode the prompt (`EncodeText`,
//! `EncodeBytes` or `EncodeChat` on the control socket, answered with `Ids`). During
//! generation compute sends each new id (`DecodeId`) over their link and this stage sends
//! the id's bytes to the orchestrator (`Text`), which prints them as they come. Without a
//! tokenizer directory the vocabulary is bytes (id = byte), which is what the tiny models
//! were built with.
//!
//! A failure ([`TokenizerStageError`]) is reported to the orchestrator once, as a
//! `StageFailure` of its kind (`k3_protocol::failure`).

use k3_protocol::conf::TokenizerConf;
use k3_protocol::failure::{FailureKind, StageFailure};
use k3_protocol::link::{recv_from, LinkError, ProtocolError, StageCtx};
use k3_protocol::messages::{Msg, Stage};

use crate::{TokError, Tokenizer};

/// Why the tokenizer stage stopped. Every message starts with `tokenizer:`.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerStageError {
    #[error("tokenizer: bad Configure: {0}")]
    Configure(#[source] serde_json::Error),
    /// The tokenizer files could not be loaded.
    #[error("tokenizer: {0}")]
    Load(#[source] TokError),
    /// A chat request could not be rendered.
    #[error("tokenizer: chat: {0}")]
    Chat(#[source] TokError),
    #[error("tokenizer: --chat needs a Kimi tokenizer (--tok)")]
    ChatNeedsKimi,
    /// A message the stage does not serve (its debug form).
    #[error("tokenizer: unexpected {0}")]
    Unexpected(String),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error(transparent)]
    Link(#[from] LinkError),
}

impl From<TokenizerStageError> for StageFailure {
    fn from(e: TokenizerStageError) -> StageFailure {
        use TokenizerStageError as E;
        let kind = match e {
            E::Protocol(p) => return p.into(),
            E::Link(l) => return l.into(),
            E::Configure(_) | E::Load(_) | E::Chat(_) | E::ChatNeedsKimi => FailureKind::Config,
            E::Unexpected(_) => FailureKind::Protocol,
        };
        StageFailure::new(kind, e.to_string())
    }
}

/// How this stage turns text into ids and ids into bytes: a real Kimi tokenizer, or the
/// tiny models' byte vocabulary (id = byte).
pub enum TextCodec {
    Kimi(Box<Tokenizer>),
    Bytes,
}

impl TextCodec {
    pub fn load(conf: &TokenizerConf) -> Result<TextCodec, TokError> {
        match &conf.tok_dir {
            Some(d) => Tokenizer::from_dir(d).map(|t| TextCodec::Kimi(Box::new(t))),
            None => Ok(TextCodec::Bytes),
        }
    }

    fn encode_text(&self, text: &str, allow_specials: bool) -> Vec<u32> {
        match self {
            TextCodec::Kimi(t) => t.encode(text, allow_specials),
            TextCodec::Bytes => text.bytes().map(u32::from).collect(),
        }
    }

    fn encode_bytes(&self, b: &[u8], allow_specials: bool) -> Vec<u32> {
        match self {
            TextCodec::Kimi(t) => t.encode_bytes(b, allow_specials),
            TextCodec::Bytes => b.iter().map(|&x| u32::from(x)).collect(),
        }
    }

    fn id_bytes(&self, id: u32) -> Vec<u8> {
        match self {
            TextCodec::Kimi(t) => t
                .token_bytes(id)
                .map(|b| b.to_vec())
                .unwrap_or_else(|_| format!("<|bad_id_{id}|>").into_bytes()),
            TextCodec::Bytes => {
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
            TextCodec::Kimi(t) => t.stop_ids(),
            TextCodec::Bytes => Vec::new(),
        }
    }
}

/// Run the tokenizer stage until shutdown; a failure is also reported to the orchestrator.
pub fn run(mut ctx: StageCtx) -> Result<(), StageFailure> {
    serve(&mut ctx).map_err(|e| ctx.fail(e))
}

fn serve(ctx: &mut StageCtx) -> Result<(), TokenizerStageError> {
    use TokenizerStageError as E;
    ctx.wait_configure()?;
    let conf: TokenizerConf = serde_json::from_str(&ctx.conf_json).map_err(E::Configure)?;
    let codec = TextCodec::load(&conf).map_err(E::Load)?;
    tracing::debug!(
        kimi = matches!(codec, TextCodec::Kimi(_)),
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
                ids: codec.encode_text(&text, allow_specials),
            },
            Msg::EncodeBytes {
                req,
                bytes,
                allow_specials,
            } => Msg::Ids {
                req,
                ids: codec.encode_bytes(&bytes, allow_specials),
            },
            Msg::EncodeChat { req, chat_json } => match &codec {
                TextCodec::Kimi(t) => Msg::Ids {
                    req,
                    ids: crate::chat::encode_chat_json(t, &chat_json).map_err(E::Chat)?,
                },
                TextCodec::Bytes => return Err(E::ChatNeedsKimi),
            },
            other => return Err(E::Unexpected(format!("{other:?}"))),
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
                    bytes: codec.id_bytes(id),
                })?;
            }
            Msg::Shutdown => break,
            other => return Err(E::Unexpected(format!("{other:?}"))),
        }
    }
    ctx.send_control(&Msg::Summary {
        stage: Stage::Tokenizer,
        json: serde_json::json!({ "decoded": decoded }).to_string(),
    })?;
    Ok(ctx.finish_recording()?)
}
