//! `k3-tokenizer`: Kimi K3's tokenizer (spec §5), byte for byte with tiktoken.
pub mod bpe;
pub mod classes;
pub mod error;
pub mod pretok;
pub mod specials;
pub mod tokenizer;
pub mod vocab;

pub use error::{Result, TokError};
pub use tokenizer::{Segment, Tokenizer, K3_END_OF_MSG, K3_EOS, K3_STOP_IDS};
