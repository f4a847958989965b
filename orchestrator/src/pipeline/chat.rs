//! `--chat`: the prompt as one user turn of K3's XTML chat format, via the tokenizer crate.

use k3_tokenizer::Tokenizer;

/// Encode `chat_json` (a JSON list of `{role, content}` messages) with the generation
/// prompt appended.
pub fn encode_user_turn(_tok: &Tokenizer, _chat_json: &str) -> Result<Vec<u32>, String> {
    Err("tokenizer: the XTML chat encoder is not wired yet".into())
}
