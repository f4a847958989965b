//! `k3-tokenizer`: Kimi K3's tokenizer (spec §5), byte for byte with tiktoken.
//!
//! * [`Tokenizer`]: load `tiktoken.model` + `tokenizer_config.json`
//!   ([`Tokenizer::from_dir`]), [`Tokenizer::encode`] (text, specials on/off),
//!   [`Tokenizer::encode_bytes`] (arbitrary bytes), [`Tokenizer::encode_segments`],
//!   [`Tokenizer::decode`] / [`Tokenizer::decode_bytes`], [`Tokenizer::stop_ids`].
//! * [`StreamDecoder`]: incremental decoding that only emits complete UTF-8.
//! * [`chat`]: the XTML chat renderer ([`chat::build_chat_segments`]) and output parser
//!   ([`chat::parse_output`]).
//! * [`stage`]: the tokenizer stage's process loop ([`stage::run`]).
//!
//! Special-token layout: the 256 special slots follow the ranks (`n_ranks + k`), which is
//! 163584..163839 for the released 163,584-rank file and right after the last rank for the
//! small test vocabularies (see [`specials`]).

pub mod bpe;
pub mod chat;
pub mod classes;
pub mod error;
pub mod pretok;
pub mod specials;
pub mod stage;
pub mod stream;
pub mod tokenizer;
pub mod vocab;

pub use chat::{
    build_chat_segments, encode_chat_json, parse_output, ChatOptions, ChatRequest, OutputDelta,
    OutputStream, ParsedOutput, ParsedToolCall,
};
pub use error::{Result, TokError};
pub use stream::StreamDecoder;
pub use tokenizer::{Segment, Tokenizer, K3_END_OF_MSG, K3_EOS, K3_STOP_IDS};
