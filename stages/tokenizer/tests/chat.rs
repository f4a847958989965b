//! XTML chat rendering against the oracle (tools/tokenizer/chat_cases.py: expected segments
//! written out literally from the spec, ids from tiktoken), and output parsing.
//!
//! Wrong implementations these catch: attributes split into several segments or glued to
//! the tag name, specials recognised inside message text ("Say <|open|> hi"), unsorted or
//! ASCII-escaped tool JSON, compact JSON for argument values (Python's json.dumps default
//! uses ", " and ": "), tool results left in arrival order, an effort message when thinking
//! is off, missing `&quot;`/`&amp;` escaping, a stripped-away empty think block.

use k3_tokenizer::{build_chat_segments, parse_output, ChatRequest, Segment, Tokenizer};
use std::path::PathBuf;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer")
}

#[test]
fn chat_oracle_cases() {
    let tok = Tokenizer::from_dir(&fixture_dir()).unwrap();
    let text = std::fs::read_to_string(fixture_dir().join("chat_cases.jsonl")).unwrap();
    let mut n = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let case: serde_json::Value = serde_json::from_str(line).unwrap();
        let name = case["name"].as_str().unwrap();
        let req: ChatRequest = serde_json::from_value(case["request"].clone()).unwrap();
        let want: Vec<Segment> = case["segments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| Segment {
                text: s[0].as_str().unwrap().to_string(),
                allow_special: s[1].as_bool().unwrap(),
            })
            .collect();
        let got = build_chat_segments(&req.messages, req.tools.as_ref(), &req.options).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{name}: segment {i}");
        }
        assert_eq!(got.len(), want.len(), "{name}: segment count");
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode_segments(&got), ids, "{name}: ids");
        let via_stage =
            k3_tokenizer::chat::encode_chat_json(&tok, &case["request"].to_string()).unwrap();
        assert_eq!(via_stage, ids, "{name}: stage JSON path");
        n += 1;
    }
    println!("chat oracle: {n} conversations match segment for segment and id for id");
    assert!(n >= 5);
}

#[test]
fn chat_rejects_bad_requests() {
    let bad = [
        r#"{"messages": [{"role": "user", "content": "x"}], "thinking_effort": "medium"}"#,
        r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
        r#"{"messages": [{"content": "x"}]}"#,
        r#"{"messages": [{"role": "tool", "content": "x"}]}"#,
        r#"{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]}"#,
        r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
        r#"{"messages": 3}"#,
    ];
    let tok = Tokenizer::from_dir(&fixture_dir()).unwrap();
    for b in bad {
        assert!(
            k3_tokenizer::chat::encode_chat_json(&tok, b).is_err(),
            "{b}"
        );
    }
    // A bare list of messages gets the default options (thinking on, effort "max").
    let list = k3_tokenizer::chat::encode_chat_json(&tok, r#"[{"role": "user", "content": "x"}]"#)
        .unwrap();
    let full = k3_tokenizer::chat::encode_chat_json(
        &tok,
        r#"{"messages": [{"role": "user", "content": "x"}], "thinking": true, "thinking_effort": "max"}"#,
    )
    .unwrap();
    assert_eq!(list, full);
    // "medium" is fine when thinking is off: the effort is not used.
    let ok = r#"{"messages": [{"role": "user", "content": "x"}], "thinking": false, "thinking_effort": "medium"}"#;
    assert!(k3_tokenizer::chat::encode_chat_json(&tok, ok).is_ok());
}

#[test]
fn parse_model_output() {
    // Output after a thinking-mode prompt (which ended with `<|open|>think<|sep|>`).
    let out = "Let me check.<|close|>think<|sep|><|open|>response<|sep|>Checking<|close|>response<|sep|>\
               <|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
               <|open|>argument key=\"city\" type=\"string\"<|sep|>東京 &quot;x&quot;<|close|>argument<|sep|>\
               <|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|>\
               <|open|>argument key=\"o\" type=\"object\"<|sep|>{\"k\": [1]}<|close|>argument<|sep|>\
               <|close|>call<|sep|><|open|>call tool=\"a&amp;b\" index=\"2\"<|sep|>\
               <|open|>json type=\"object\"<|sep|>{\"q\": 1}<|close|>json<|sep|><|close|>call<|sep|>\
               <|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";
    let p = parse_output(out, true);
    assert_eq!(p.reasoning, "Let me check.");
    assert_eq!(p.content, "Checking");
    assert!(p.finished);
    assert_eq!(p.tool_calls.len(), 2);
    let c = &p.tool_calls[0];
    assert_eq!((c.name.as_str(), c.index), ("get_weather", Some(1)));
    // Argument bodies are raw text (not attribute-escaped).
    assert_eq!(c.arguments["city"], serde_json::json!("東京 &quot;x&quot;"));
    assert_eq!(c.arguments["days"], serde_json::json!(2));
    assert_eq!(c.arguments["o"], serde_json::json!({"k": [1]}));
    let c = &p.tool_calls[1];
    assert_eq!(c.name, "a&b");
    assert_eq!(c.arguments["q"], serde_json::json!(1));
    assert_eq!(c.raw_json.as_deref(), Some("{\"q\": 1}"));

    // Thinking off, plain answer, stream cut before the end.
    let p = parse_output("Hello<|close|>resp", false);
    assert_eq!(p.content, "Hello<|close|>resp");
    assert!(!p.finished);
    let p = parse_output(
        "Hi there<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
        false,
    );
    assert_eq!(
        (p.content.as_str(), p.reasoning.as_str(), p.finished),
        ("Hi there", "", true)
    );
}

/// What the tokenizer stage does with the generated stream: complete UTF-8 only (a
/// multi-byte character split over ids is held until complete), a stop id ends the stream,
/// and an id outside the vocabulary is an error, not a panic. (Was a test of the unused
/// in-process `TokenizerStage`; the stage process now uses these pieces directly.)
#[test]
fn stream_decodes_and_stop_ids_stop() {
    use k3_tokenizer::StreamDecoder;
    let tok = Tokenizer::from_dir(&fixture_dir()).unwrap();
    let ids = tok.encode("中文 ok", false);
    let eom = tok.special_id("<|end_of_msg|>").unwrap();
    assert!(tok.stop_ids().contains(&eom));
    let mut stream: Vec<u32> = ids.clone();
    stream.push(eom);
    stream.extend_from_slice(&ids); // ignored after the stop id
    let mut dec = StreamDecoder::new();
    let mut text = String::new();
    let mut stopped = false;
    for &id in &stream {
        if tok.stop_ids().contains(&id) {
            stopped = true;
            break;
        }
        text.push_str(&dec.push(&tok, id).unwrap());
    }
    assert!(stopped);
    assert_eq!(text, "中文 ok");
    assert_eq!(tok.encode("中文 ok", false), ids);
    assert!(StreamDecoder::new().push(&tok, u32::MAX).is_err());
}

/// The release's tool-call token sequence as a fixed input: the assistant turn of the
/// oracle case `chat_tools_calls_results` (ids from tiktoken and the reference encoder),
/// fed id by id, as a server decodes a reply, to [`k3_tokenizer::OutputStream`]: the think
/// block becomes the reasoning, each call comes out once complete, with its arguments typed
/// as the template wrote them.
#[test]
fn tool_calls_parse_from_the_release_token_sequence_id_by_id() {
    let tok = Tokenizer::from_dir(&fixture_dir()).unwrap();
    let text = std::fs::read_to_string(fixture_dir().join("chat_cases.jsonl")).unwrap();
    let case: serde_json::Value = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|c| c["name"] == "chat_tools_calls_results")
        .unwrap();
    let ids: Vec<u32> = case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    // The model's part: after the assistant's `<|open|>think<|sep|>`, up to its
    // `<|end_of_msg|>` (the stop id).
    let eom = tok.stop_ids()[0];
    let mut seen = Vec::new();
    let mut start = None;
    for (i, &id) in ids.iter().enumerate() {
        seen.extend_from_slice(tok.token_bytes(id).unwrap());
        if seen.ends_with(b"role=\"assistant\"<|sep|><|open|>think<|sep|>") {
            start = Some(i + 1);
            break;
        }
    }
    let start = start.expect("an assistant turn in thinking mode");
    let end = start + ids[start..].iter().position(|&x| x == eom).unwrap();
    let mut out = k3_tokenizer::OutputStream::new(true);
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
    let mut pending: Vec<u8> = Vec::new();
    let mut calls_at = Vec::new();
    for (k, &id) in ids[start..end].iter().enumerate() {
        pending.extend_from_slice(tok.token_bytes(id).unwrap());
        let ok = match std::str::from_utf8(&pending) {
            Ok(_) => pending.len(),
            Err(e) => e.valid_up_to(),
        };
        let piece = String::from_utf8(pending.drain(..ok).collect()).unwrap();
        let d = out.push(&piece);
        reasoning.push_str(&d.reasoning);
        content.push_str(&d.content);
        for c in d.tool_calls {
            calls_at.push(k);
            calls.push(c);
        }
    }
    let d = out.finish();
    assert!(
        d.tool_calls.is_empty(),
        "every call closed before the end: {d:?}"
    );
    reasoning.push_str(&d.reasoning);
    content.push_str(&d.content);
    assert_eq!((reasoning.as_str(), content.as_str()), ("Two cities.", ""));
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(
        calls_at[0] < calls_at[1],
        "the first call streams before the second"
    );
    assert_eq!(
        (calls[0].name.as_str(), calls[0].index),
        ("get_weather", Some(1))
    );
    assert_eq!(
        serde_json::Value::Object(calls[0].arguments.clone()),
        serde_json::json!({"city": "東京", "unit": "c", "days": 2, "ok": true, "x": null,
                           "o": {"k": [1, 2.5]}})
    );
    assert_eq!(
        (calls[1].name.as_str(), calls[1].index),
        ("get_weather", Some(2))
    );
    assert_eq!(
        serde_json::Value::Object(calls[1].arguments.clone()),
        serde_json::json!({"city": "Paris"})
    );
    // The same as parsing the whole text at once.
    let whole = tok.decode(&ids[start..end]).unwrap();
    assert_eq!(out.parsed(), parse_output(&whole, true));
}
