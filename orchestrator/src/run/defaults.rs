//! What a generation takes when the command line does not say, in one place for the one-shot
//! run, `chat` and `serve` (they import it from here: `run` is below both):
//!
//! - thinking ([`thinking`]): off unless asked for, with the release template's effort
//!   ("max") when it is turned on without one;
//! - the tokenizer directory ([`tokenizer_dir`]): the model directory when it holds
//!   `tiktoken.model` and `tokenizer_config.json`, as the release does;
//! - the sampling ([`GenerationDefaults`]): the release's `generation_config.json` when the
//!   model directory has one, else greedy; a flag always wins, and each value says where it
//!   came from ([`Source`]).

use std::path::{Path, PathBuf};

/// Thinking when neither a flag nor a request field asks for it. Off: at the seconds per
/// token a streamed K3 runs at, a reasoning block of hundreds to thousands of tokens is
/// minutes to hours before the answer starts (docs/run-k3.md, "What thinking costs").
pub const THINKING_BY_DEFAULT: bool = false;

/// The thinking effort when thinking is on and no effort was given: the release's chat
/// template (`apply_chat_template`) defaults to "max" (k3-spec §5.5).
pub const EFFORT_WHEN_THINKING: &str = "max";

/// The one thinking rule of run, chat and serve: `thinking` is an explicit on/off (a flag,
/// a request's `thinking` field), `effort` an explicit effort (`Some(None)`: "none", no
/// effort message). An effort alone turns thinking on; an explicit off wins over an
/// effort (which then has nothing to shape). Returns (thinking, effort message).
pub fn thinking(thinking: Option<bool>, effort: Option<Option<String>>) -> (bool, Option<String>) {
    let on = thinking.unwrap_or(effort.is_some() || THINKING_BY_DEFAULT);
    if !on {
        return (false, None);
    }
    let effort = effort.unwrap_or_else(|| Some(EFFORT_WHEN_THINKING.to_string()));
    (true, effort)
}

/// The files a tokenizer directory holds.
pub const TOKENIZER_FILES: [&str; 2] = ["tiktoken.model", "tokenizer_config.json"];

/// The tokenizer files missing from `dir` (empty: it is a tokenizer directory).
pub fn missing_tokenizer_files(dir: &Path) -> Vec<&'static str> {
    TOKENIZER_FILES
        .iter()
        .copied()
        .filter(|f| !dir.join(f).is_file())
        .collect()
}

/// The tokenizer directory of a run: `given` (`--tok DIR`), checked to hold the tokenizer
/// files (Err: the usage message), or else the model directory when it holds them (the
/// release ships them beside the shards), or None.
pub fn tokenizer_dir(given: Option<&Path>, model_dir: &Path) -> Result<Option<PathBuf>, String> {
    match given {
        Some(d) => {
            if !d.is_dir() {
                return Err(format!(
                    "--tok {}: not a directory (it names the directory with {})",
                    d.display(),
                    TOKENIZER_FILES.join(" and ")
                ));
            }
            let missing = missing_tokenizer_files(d);
            if !missing.is_empty() {
                return Err(format!(
                    "--tok {}: no {} there (a tokenizer directory holds {})",
                    d.display(),
                    missing.join(" or "),
                    TOKENIZER_FILES.join(" and ")
                ));
            }
            Ok(Some(d.to_path_buf()))
        }
        None if missing_tokenizer_files(model_dir).is_empty() => Ok(Some(model_dir.to_path_buf())),
        None => Ok(None),
    }
}

/// Where a sampling value came from (the report's `sampling.sources`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A command-line flag (or a request field).
    Flag,
    /// The model directory's `generation_config.json`.
    GenerationConfig,
    /// k3's own default (greedy, no filter, a random seed when sampling).
    BuiltIn,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Flag => "flag",
            Source::GenerationConfig => "generation_config",
            Source::BuiltIn => "built-in",
        }
    }
}

/// The file a release's sampling defaults are read from.
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// The sampling values of a `generation_config.json` (Hugging Face's format): each `None`
/// when the file does not set it. `do_sample: false` makes the file greedy: its values are
/// then not used (as transformers does); without `do_sample` they are (as vLLM does).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl GenerationDefaults {
    /// The defaults of `model_dir`: empty without a `generation_config.json`; Err (the
    /// usage message, naming the file and key) when it is unreadable or a value is out of
    /// range.
    pub fn of_model_dir(model_dir: &Path) -> Result<GenerationDefaults, String> {
        let p = model_dir.join(GENERATION_CONFIG);
        if !p.is_file() {
            return Ok(GenerationDefaults::default());
        }
        let text = k3_io::input::read_capped_string(&p, 1 << 20)
            .map_err(|e| format!("{}: {e}", p.display()))?;
        GenerationDefaults::parse(&text).map_err(|e| format!("{}: {e}", p.display()))
    }

    /// Parse the text of a `generation_config.json`.
    pub fn parse(text: &str) -> Result<GenerationDefaults, String> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let Some(obj) = v.as_object() else {
            return Err("not a JSON object".into());
        };
        if obj.get("do_sample").and_then(|d| d.as_bool()) == Some(false) {
            return Ok(GenerationDefaults::default());
        }
        let f = |k: &str| -> Result<Option<f32>, String> {
            match obj.get(k) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .filter(|x| x.is_finite())
                    .map(|x| Some(x as f32))
                    .ok_or_else(|| format!("'{k}' is not a number")),
            }
        };
        let range = |k: &str, x: Option<f32>, ok: fn(f32) -> bool, want: &str| match x {
            Some(v) if !ok(v) => Err(format!("'{k}' {v} must be {want}")),
            _ => Ok(x),
        };
        let top_k = match f("top_k")? {
            None => None,
            // transformers' "no top-k" is 0.
            Some(0.0) => None,
            Some(k) if k >= 1.0 && k.fract() == 0.0 => Some(k as usize),
            Some(k) => return Err(format!("'top_k' {k} must be a whole number >= 0")),
        };
        Ok(GenerationDefaults {
            temperature: range("temperature", f("temperature")?, |t| t >= 0.0, ">= 0")?,
            top_p: range("top_p", f("top_p")?, |p| p > 0.0 && p <= 1.0, "in (0, 1]")?,
            top_k,
            min_p: range(
                "min_p",
                f("min_p")?,
                |p| (0.0..=1.0).contains(&p),
                "in [0, 1]",
            )?,
            repetition_penalty: range(
                "repetition_penalty",
                f("repetition_penalty")?,
                |r| r > 0.0,
                "> 0 (1 = off)",
            )?,
        })
    }

    /// Whether the file set any sampling value.
    pub fn is_empty(&self) -> bool {
        *self == GenerationDefaults::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinking_is_off_unless_asked() {
        assert_eq!(thinking(None, None), (false, None));
        assert_eq!(thinking(Some(true), None), (true, Some("max".into())));
        // An effort turns it on; "none" keeps it on without the effort message.
        assert_eq!(
            thinking(None, Some(Some("low".into()))),
            (true, Some("low".into()))
        );
        assert_eq!(thinking(None, Some(None)), (true, None));
        // An explicit off wins.
        assert_eq!(
            thinking(Some(false), Some(Some("low".into()))),
            (false, None)
        );
    }

    #[test]
    fn generation_config_values_and_refusals() {
        let g = GenerationDefaults::parse(
            r#"{"eos_token_id": 163586, "temperature": 0.6, "top_p": 0.95, "top_k": 0}"#,
        )
        .unwrap();
        assert_eq!(g.temperature, Some(0.6));
        assert_eq!(g.top_p, Some(0.95));
        assert_eq!(g.top_k, None, "top_k 0 is transformers' 'off'");
        // The release's file as the spec describes it: no sampling keys.
        assert!(GenerationDefaults::parse(r#"{"eos_token_id": 163586}"#)
            .unwrap()
            .is_empty());
        // do_sample false: greedy, whatever else it says.
        assert!(
            GenerationDefaults::parse(r#"{"do_sample": false, "temperature": 0.6}"#)
                .unwrap()
                .is_empty()
        );
        assert!(GenerationDefaults::parse(r#"{"top_p": 1.5}"#)
            .unwrap_err()
            .contains("top_p"));
        assert!(GenerationDefaults::parse(r#"{"temperature": "hot"}"#)
            .unwrap_err()
            .contains("temperature"));
        assert!(GenerationDefaults::parse(r#"{"top_k": 2.5}"#).is_err());
        assert!(GenerationDefaults::parse("[1]").is_err());
        assert!(GenerationDefaults::parse("{").is_err());
    }

    #[test]
    fn tokenizer_dir_defaults_to_the_model_dir() {
        let m = tempfile::tempdir().unwrap();
        assert_eq!(tokenizer_dir(None, m.path()).unwrap(), None);
        let e = tokenizer_dir(Some(m.path()), m.path()).unwrap_err();
        assert!(e.contains("tiktoken.model or tokenizer_config.json"), "{e}");
        assert!(tokenizer_dir(Some(&m.path().join("nope")), m.path())
            .unwrap_err()
            .contains("not a directory"));
        for f in TOKENIZER_FILES {
            std::fs::write(m.path().join(f), "x").unwrap();
        }
        assert_eq!(
            tokenizer_dir(None, m.path()).unwrap().as_deref(),
            Some(m.path())
        );
    }
}
