//! XTML chat rendering (`src/chat.rs`): the spec's example turn, the streamed output parser
//! against the whole-text one, Python's JSON and float formatting.

use k3_tokenizer::chat::*;
use k3_tokenizer::tokenizer::Segment;
use serde_json::json;

fn flat(segs: &[Segment]) -> String {
    segs.iter().map(|s| s.text.as_str()).collect()
}

#[test]
fn spec_example_one_user_turn() {
    // Spec §5.5's example (thinking on, no effort message).
    let opts = ChatOptions {
        thinking_effort: None,
        ..ChatOptions::default()
    };
    let segs =
        build_chat_segments(&[json!({"role": "user", "content": "Hi"})], None, &opts).unwrap();
    assert_eq!(
        flat(&segs),
        "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>\
         <|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"
    );
    // Control tokens allow specials, everything else does not.
    for s in &segs {
        assert_eq!(
            s.allow_special,
            [OPEN, CLOSE, SEP, END_OF_MSG].contains(&s.text.as_str()),
            "{s:?}"
        );
    }
}

#[test]
fn output_stream_gives_what_parse_output_gives_piece_by_piece() {
    let out =
        "Let me check.<|close|>think<|sep|><|open|>response<|sep|>Checking<|close|>response<|sep|>\
               <|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
               <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>\
               <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";
    let whole = parse_output(out, true);
    // Every split into pieces (a piece per char, of 3 and of 7 chars) gives the same.
    for size in [1usize, 3, 7] {
        let chars: Vec<char> = out.chars().collect();
        let mut s = OutputStream::new(true);
        let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::new());
        let mut seen_open = false;
        for piece in chars.chunks(size) {
            let piece: String = piece.iter().collect();
            let d = s.push(&piece);
            // Never any of a control token's text.
            assert!(
                !d.reasoning.contains("<|") && !d.content.contains("<|"),
                "{d:?}"
            );
            r.push_str(&d.reasoning);
            c.push_str(&d.content);
            calls.extend(d.tool_calls);
            seen_open |= !calls.is_empty();
        }
        let d = s.finish();
        r.push_str(&d.reasoning);
        c.push_str(&d.content);
        calls.extend(d.tool_calls);
        assert!(seen_open, "the call came before the end ({size})");
        assert_eq!(
            (r.as_str(), c.as_str()),
            (whole.reasoning.as_str(), whole.content.as_str())
        );
        assert_eq!(calls, whole.tool_calls);
    }
    // A call cut by the end of the stream comes out at finish.
    let mut s = OutputStream::new(false);
    let d = s.push(
        "Hi<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>",
    );
    assert_eq!((d.content.as_str(), d.tool_calls.len()), ("Hi", 0));
    assert_eq!(s.finish().tool_calls.len(), 1);
    // Text that only looks like the start of a tag is held, then given.
    let mut s = OutputStream::new(false);
    assert_eq!(s.push("a <|").content, "a ");
    assert_eq!(s.push("x").content, "<|x");
}

#[test]
fn py_json_matches_python() {
    // Expected strings printed by Python 3's json.dumps(..., ensure_ascii=False).
    let v = json!({"b": [1, 2.5, 1e-7, 1e20, true, null], "a": "é\n\u{1}\"", "c": {}});
    assert_eq!(
        py_json(&v, false),
        r#"{"b": [1, 2.5, 1e-07, 1e+20, true, null], "a": "é\n\u0001\"", "c": {}}"#
    );
    assert_eq!(
        py_json(&deep_sort(&v), true),
        r#"{"a":"é\n\u0001\"","b":[1,2.5,1e-07,1e+20,true,null],"c":{}}"#
    );
    assert_eq!(py_float(100.0), "100.0");
    assert_eq!(py_float(0.0001), "0.0001");
    assert_eq!(py_float(1234567890123456.0), "1234567890123456.0");
    assert_eq!(py_float(1e16), "1e+16");
    assert_eq!(py_float(-0.5), "-0.5");
}
