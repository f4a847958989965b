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
/// and name the first of them, `<|open|>` (3264), never answer with exit 0. Catches a
/// --chat that is ignored (plain text would run and exit 0) and ids silently clamped into
/// the vocabulary.
#[test]
fn chat_ids_outside_the_vocabulary_are_refused() {
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
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(
        t.contains("token id 3264 is outside the vocabulary 0..256"),
        "the refusal must name <|open|> and the vocabulary:\n{t}"
    );
}

/// `--chat --thinking --effort none --prompt Hi` reaches the model as the whole rendered
/// turn: the report's prompt ids are the chat oracle's (`tokenizer/chat_cases.jsonl`,
/// `chat_one_turn_no_effort`, rendered and encoded by the release's Python template and
/// tokenizer), on `synth --shape tiny-chat`, whose vocabulary holds them (its ranks start
/// with the fixture's 3,261, its 256 specials start at the released 163,584, so fixture
/// special `3261 + k` is `163584 + k` there). Catches a --chat that sends the bare text, a
/// template that drops or reorders a block (the role, `<|end_of_msg|>`, the assistant's
/// open `think`), and special names encoded as plain text.
#[test]
fn chat_prompt_reaches_the_model_wrapped() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("tiny-chat");
    let o = run(&["synth", "--shape", "tiny-chat", m.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let cases = std::fs::read_to_string(fixtures().join("tokenizer/chat_cases.jsonl")).unwrap();
    let case: serde_json::Value = cases
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["name"] == "chat_one_turn_no_effort")
        .expect("the chat_one_turn_no_effort case");
    assert_eq!(case["request"]["messages"][0]["content"], "Hi");
    let want: Vec<u32> = u32s(&case["ids"])
        .into_iter()
        .map(|i| if i < 3261 { i } else { i - 3261 + 163_584 })
        .collect();
    assert!(
        want.iter().any(|&i| i >= 163_584),
        "no specials in {want:?}"
    );
    let out = dir.path().join("run.json");
    let ms = m.to_str().unwrap();
    let o = run(&[
        ms,
        "--tok",
        ms,
        "--prompt",
        "Hi",
        "--chat",
        "--thinking",
        "--effort",
        "none",
        "--gen",
        "1",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        u32s(&json(&out)["prompt_ids"]),
        want,
        "the rendered chat turn"
    );
}
