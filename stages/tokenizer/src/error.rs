//! Errors of the tokenizer crate: each names what is at fault (the file, line or field, the
//! id, or the chat request). The stage's own errors are `stage::TokenizerStageError`.

use std::path::PathBuf;

/// Everything that can go wrong loading tokenizer files or encoding/decoding.
#[derive(Debug, thiserror::Error)]
pub enum TokError {
    /// A tokenizer file could not be read at all.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line of a `tiktoken.model` rank file is malformed.
    #[error("{path}:{line}: {msg}")]
    RankLine {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    /// The rank file as a whole is inconsistent (missing ranks, missing single bytes, ...).
    #[error("{path}: {msg}")]
    RankFile { path: PathBuf, msg: String },
    /// `tokenizer_config.json` is malformed or names ids outside the special slots.
    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },
    /// An id that is neither a rank nor one of the 256 special slots.
    #[error("token id {id} is out of range (vocabulary has {vocab} ids)")]
    UnknownId { id: u32, vocab: u32 },
    /// A chat request that cannot be rendered (bad role, bad effort, bad arguments, ...).
    #[error("chat: {0}")]
    Chat(String),
    /// A chat request (JSON) that does not parse, or not into a request.
    #[error("chat request is not {what}: {source}")]
    ChatRequest {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, TokError>;
