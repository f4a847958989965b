//! The text path end to end (issue 13, "untested paths"): `--tok` with `--prompt`,
//! `--prompt-file` and `--chat` through the tokenizer stage, and the report's `text`.
//!
//! Oracles: the prompt ids come from the tokenizer fixture (`cases.jsonl`, tiktoken's own
//! output), the decoded text from the fixture's rank table (`tiktoken.model`), read here
//! independently of k3's tokenizer. The tiny models have a 256-id vocabulary, so the prompt
//! is a fixture case whose ids all fall below 256. (Stop ids cannot end a tiny-model run:
//! the tokenizer's stop ids follow its 3,261 ranks. The stop rule is tested on the decode
//! loop in stages/layer-compute/tests/decode_loop.rs, against the oracle's ids.)

use crate::common::*;
use base64::Engine as _;

const MODEL: &str = "tiny-mxfp4/sharded";

/// (input bytes, ids) of the named case in tokenizer/cases.jsonl.
fn case(name: &str) -> (Vec<u8>, Vec<u32>) {
    let s = std::fs::read_to_string(fixtures().join("tokenizer/cases.jsonl")).unwrap();
    for l in s.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        if v["name"] == name {
            let b = base64::engine::general_purpose::STANDARD
                .decode(v["input_b64"].as_str().unwrap())
                .unwrap();
            return (b, u32s(&v["ids"]));
        }
    }
    panic!("no case {name}");
}

/// The bytes of rank ids, from the fixture's tiktoken.model (`base64 rank` per line).
fn decode(ids: &[u32]) -> Vec<u8> {
    let s = std::fs::read_to_string(fixtures().join("tokenizer/tiktoken.model")).unwrap();
    let mut ranks = std::collections::HashMap::new();
    for l in s.lines() {
        let (b, r) = l.split_once(' ').unwrap();
        let b = base64::engine::general_purpose::STANDARD.decode(b).unwrap();
        ranks.insert(r.trim().parse::<u32>().unwrap(), b);
    }
    ids.iter().flat_map(|i| ranks[i].clone()).collect()
}

/// One run; returns the report.
fn gen(extra: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run.json");
    let m = fixtures().join(MODEL);
    let mut a = vec![
        m.to_str().unwrap(),
        "--gen",
        "6",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ];
    a.extend_from_slice(extra);
    let o = run(&a);
    assert!(o.status.success(), "{extra:?}: {}", text(&o));
    json(&out)
}

/// `--prompt` and `--prompt-file` through the tokenizer stage: the report's prompt ids are
/// tiktoken's, the generated ids are those of the same ids given with `--ids` (the text path
/// only changes how the prompt arrives), and the report's `text` is the generated ids'
/// bytes. Catches: specials honoured in plain text ("[BOS]" must stay text), a prompt
/// tokenized with the wrong ranks or truncated, --prompt-file read as anything but its
/// bytes, a text that is missing, doubled or decoded from the wrong ids, and the staged and
/// --inproc text paths differing.
#[test]
fn prompt_and_prompt_file_through_the_tokenizer() {
    let (input, want_prompt) = case("spec_ref_8_nospecial");
    assert_eq!(input, b"[BOS][EOS]");
    assert!(want_prompt.iter().all(|&i| i < 256));
    let tok = fixtures().join("tokenizer");
    let tok = tok.to_str().unwrap();
    let by_ids = gen(&["--ids", &join(&want_prompt), "--single-process"]);
    let want_gen = u32s(&by_ids["generated_ids"]);
    let want_text = String::from_utf8_lossy(&decode(&want_gen)).into_owned();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, &input).unwrap();
    let prompt = std::str::from_utf8(&input).unwrap();
    for (what, extra) in [
        ("--prompt", vec!["--tok", tok, "--prompt", prompt]),
        (
            "--prompt --inproc",
            vec!["--tok", tok, "--prompt", prompt, "--inproc"],
        ),
        (
            "--prompt-file",
            vec!["--tok", tok, "--prompt-file", file.to_str().unwrap()],
        ),
    ] {
        let r = gen(&extra);
        assert_eq!(u32s(&r["prompt_ids"]), want_prompt, "{what}: prompt ids");
        assert_eq!(u32s(&r["generated_ids"]), want_gen, "{what}: generated ids");
        assert_eq!(
            r["text"].as_str(),
            Some(want_text.as_str()),
            "{what}: the report's text"
        );
    }
}

/// `--chat` wraps the prompt in K3's chat format, whose control tokens (ids from 3,261 in
/// the fixture tokenizer) lie outside a tiny model's 256-id vocabulary: the run must fail
/// and say so, never answer with exit 0. Catches a --chat that is ignored (plain text would
/// run and exit 0) and ids silently clamped into the vocabulary.
#[test]
fn chat_prompt_reaches_the_model_wrapped() {
    let tok = fixtures().join("tokenizer");
    let m = fixtures().join(MODEL);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run.json");
    let o = run(&[
        m.to_str().unwrap(),
        "--tok",
        tok.to_str().unwrap(),
        "--prompt",
        "[BOS]",
        "--chat",
        "--gen",
        "2",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("vocabulary"),
        "the refusal must name the vocabulary:\n{t}"
    );
}
