//! `k3-orch tokenize` and `k3-orch detokenize`: the tokenizer stage as a command-line tool.
//!
//! `tokenize --tok DIR [--specials] (--text T | --file F) [--chat [--no-thinking]
//! [--effort low|high|max|none]]` prints the ids comma-separated on one line.
//! `--file` is read verbatim as bytes (invalid UTF-8 allowed; see
//! `Tokenizer::encode_bytes`); `--specials` makes the 256 special names in the text
//! count as special tokens; `--chat` wraps the text as one user turn of K3's XTML chat
//! format (thinking on, effort "max", generation prompt) - the chat's own text is never
//! scanned for specials, so `--specials` is refused with `--chat`.
//!
//! `detokenize --tok DIR --ids 1,2,3` writes the decoded bytes to stdout exactly as
//! decoded (special ids as their names, no newline added, invalid UTF-8 passed through).
//!
//! Exit codes: 0 ok; 1 the tokenizer files (DIR/tiktoken.model,
//! DIR/tokenizer_config.json) cannot be read or are malformed; 2 usage: bad flags, an
//! unreadable --file, non-UTF-8 --file with --chat, malformed or unknown --ids.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;

use clap::Parser;
use k3_tokenizer::{chat, ChatOptions, Tokenizer};

#[derive(Parser, Debug)]
#[command(
    name = "k3-orch tokenize",
    about = "Print the token ids of a text, comma-separated"
)]
struct TokArgs {
    /// Directory with tiktoken.model and tokenizer_config.json
    #[arg(long)]
    tok: PathBuf,
    /// Recognise special-token names ([BOS], <|end_of_msg|>, ...) in the text
    #[arg(long)]
    specials: bool,
    /// The text to encode
    #[arg(long, conflicts_with = "file", required_unless_present = "file")]
    text: Option<String>,
    /// A file whose bytes are encoded verbatim
    #[arg(long)]
    file: Option<PathBuf>,
    /// Wrap the text as one user turn in K3's XTML chat format
    #[arg(long)]
    chat: bool,
    /// With --chat: thinking off (the prompt opens `response` instead of `think`)
    #[arg(long, requires = "chat")]
    no_thinking: bool,
    /// With --chat: thinking effort low, high, max, or none (no effort message)
    #[arg(long, requires = "chat", default_value = "max")]
    effort: String,
}

#[derive(Parser, Debug)]
#[command(name = "k3-orch detokenize", about = "Print the text of token ids")]
struct DetokArgs {
    /// Directory with tiktoken.model and tokenizer_config.json
    #[arg(long)]
    tok: PathBuf,
    /// Token ids, comma-separated
    #[arg(long)]
    ids: String,
}

fn load(dir: &std::path::Path) -> Result<Tokenizer, i32> {
    Tokenizer::from_dir(dir).map_err(|e| {
        tracing::error!("k3-orch: tokenizer: {e}");
        1
    })
}

pub fn main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<TokArgs>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    if a.chat && a.specials {
        tracing::error!("k3-orch tokenize: --specials cannot be used with --chat (chat text is never scanned for specials)");
        return 2;
    }
    let effort = match a.effort.as_str() {
        "none" => None,
        e if chat::EFFORTS.contains(&e) => Some(e.to_string()),
        e => {
            tracing::error!("k3-orch tokenize: --effort {e:?}: expected low, high, max or none");
            return 2;
        }
    };
    let input: Vec<u8> = match (&a.text, &a.file) {
        (Some(t), _) => t.clone().into_bytes(),
        (None, Some(f)) => match k3_io::input::read_capped(f, k3_io::input::PROMPT_CAP) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!("k3-orch tokenize: cannot read --file {}: {e}", f.display());
                return 2;
            }
        },
        (None, None) => {
            tracing::error!("k3-orch tokenize: one of --text or --file is required");
            return 2;
        }
    };
    let tok = match load(&a.tok) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let ids = if a.chat {
        let Ok(text) = std::str::from_utf8(&input) else {
            tracing::error!(
                "k3-orch tokenize: --chat needs UTF-8 text, and the input is not valid UTF-8"
            );
            return 2;
        };
        let opts = ChatOptions {
            thinking: !a.no_thinking,
            thinking_effort: effort,
            ..ChatOptions::default()
        };
        match tok.encode_chat(&chat::one_user_turn(text), None, &opts) {
            Ok(ids) => ids,
            Err(e) => {
                tracing::error!("k3-orch tokenize: {e}");
                return 2;
            }
        }
    } else {
        tok.encode_bytes(&input, a.specials)
    };
    let line = ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    println!("{line}");
    0
}

pub fn detokenize_main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<DetokArgs>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let mut ids = Vec::new();
    for (i, part) in a.ids.split(',').enumerate() {
        let part = part.trim();
        if part.is_empty() && a.ids.trim().is_empty() {
            break; // `--ids ""`: no ids, empty output
        }
        match part.parse::<u32>() {
            Ok(v) => ids.push(v),
            Err(_) => {
                tracing::error!(
                    "k3-orch detokenize: --ids item {} ({part:?}) is not a token id",
                    i + 1
                );
                return 2;
            }
        }
    }
    let tok = match load(&a.tok) {
        Ok(t) => t,
        Err(code) => return code,
    };
    match tok.decode_bytes(&ids) {
        Ok(bytes) => {
            let mut out = std::io::stdout().lock();
            if out.write_all(&bytes).and_then(|_| out.flush()).is_err() {
                return 1;
            }
            0
        }
        Err(e) => {
            tracing::error!("k3-orch detokenize: {e}");
            2
        }
    }
}
