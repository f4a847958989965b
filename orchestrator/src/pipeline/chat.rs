//! `--chat`: the prompt as one user turn of K3's XTML chat format (spec §5.5), rendered and
//! encoded by the tokenizer crate with its defaults (thinking on, effort "max", generation
//! prompt appended).

use k3_tokenizer::chat::ChatOptions;
use k3_tokenizer::Tokenizer;

/// Encode `chat_json` (a JSON list of `{role, content, ...}` messages) with the generation
/// prompt appended.
pub fn encode_user_turn(tok: &Tokenizer, chat_json: &str) -> Result<Vec<u32>, String> {
    let messages: Vec<serde_json::Value> = serde_json::from_str(chat_json)
        .map_err(|e| format!("tokenizer: chat request is not a JSON list of messages: {e}"))?;
    tok.encode_chat(&messages, None, &ChatOptions::default())
        .map_err(|e| format!("tokenizer: chat: {e}"))
}
