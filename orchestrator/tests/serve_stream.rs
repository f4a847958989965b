//! `k3-orch serve`'s streams checked strictly (issue 36, items 6, 7 and 9): SSE framing
//! event by event, stop strings over HTTP (streamed and not), the text streamer against a
//! naive search over random token splits, and four different prompts at once each equal
//! to its serial greedy reply.

use proptest::prelude::*;
use serde_json::{json, Value};

use crate::serve_http::{post, start, Server};
use k3_orch::run::stream::TextStream;

/// A streamed request's events, checked strictly: every event is one `data:` line ended
/// by a blank line, `[DONE]` comes last and once; the payloads before it, in order.
fn strict_sse(s: &Server, path: &str, body: &Value) -> Vec<Value> {
    let r = ureq::post(&format!("{}{path}", s.base))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .unwrap();
    assert!(r.content_type().starts_with("text/event-stream"));
    let text = r.into_string().unwrap();
    assert!(
        text.ends_with("\n\n"),
        "the last event is not ended: {text:?}"
    );
    let events: Vec<&str> = text[..text.len() - 2].split("\n\n").collect();
    let mut out = Vec::new();
    for (k, e) in events.iter().enumerate() {
        let data = e
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("event {k} is not one data line: {e:?}"));
        assert!(!data.contains('\n'), "event {k} spans lines: {e:?}");
        if data == "[DONE]" {
            assert_eq!(k, events.len() - 1, "[DONE] is not last: {text}");
            return out;
        }
        out.push(serde_json::from_str(data).unwrap_or_else(|_| panic!("event {k}: {e:?}")));
    }
    panic!("no [DONE]: {text}");
}

/// The checks every streamed reply of one choice passes (chat when `chat`): the role in
/// the first delta only, exactly one finish_reason, the usage chunk (when asked) with
/// `choices: []` after it and total = prompt + completion. (content, finish, usage).
fn check_stream(events: &[Value], chat: bool) -> (String, String, Value) {
    let (mut content, mut finish, mut usage) = (String::new(), Vec::new(), Value::Null);
    for (k, e) in events.iter().enumerate() {
        if !e["usage"].is_null() {
            assert_eq!(k, events.len() - 1, "the usage chunk is not last: {e}");
            assert_eq!(e["choices"], json!([]), "{e}");
            usage = e["usage"].clone();
            continue;
        }
        let c = &e["choices"][0];
        if chat {
            assert_eq!(
                c["delta"].get("role").is_some(),
                k == 0,
                "the role must come in the first delta only: event {k}: {e}"
            );
            content.push_str(c["delta"]["content"].as_str().unwrap_or(""));
        } else {
            content.push_str(c["text"].as_str().unwrap_or(""));
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish.push(f.to_string());
        }
    }
    assert_eq!(finish.len(), 1, "finish_reason {finish:?} in {events:?}");
    if !usage.is_null() {
        let (p, c, t) = (
            usage["prompt_tokens"].as_u64().unwrap(),
            usage["completion_tokens"].as_u64().unwrap(),
            usage["total_tokens"].as_u64().unwrap(),
        );
        assert_eq!(t, p + c, "{usage}");
    }
    (content, finish.remove(0), usage)
}

// SSE framing, strictly, for chat and completions: each event one `data:` line and a blank
// line, the role in the first delta, exactly one finish_reason, the usage chunk with
// `choices: []` last before `[DONE]`, total = prompt + completion, and the streamed
// usage and text equal to the non-streamed ones. Catches loose framing a lenient parser
// accepts (an unterminated event, a second finish_reason, usage inside a choice, a
// streamed prompt count that differs from the non-streamed one).
#[test]
fn sse_framing_is_strict_and_streamed_usage_equals_non_streamed() {
    let s = start(&["--max-tokens", "16", "--ctx", "256"]);
    let chat = json!({"messages": [{"role": "user", "content": "Hello there"}],
                      "max_tokens": 8});
    let comp = json!({"prompt": "Once upon a time", "max_tokens": 8});
    for (path, body, is_chat) in [
        ("/v1/chat/completions", chat, true),
        ("/v1/completions", comp, false),
    ] {
        let (st, whole, _) = post(&s, path, &body.to_string());
        assert_eq!(st, 200, "{whole}");
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        sb["stream_options"] = json!({"include_usage": true});
        let (text, finish, usage) = check_stream(&strict_sse(&s, path, &sb), is_chat);
        let want = if is_chat {
            &whole["choices"][0]["message"]["content"]
        } else {
            &whole["choices"][0]["text"]
        };
        assert_eq!(text, want.as_str().unwrap(), "{path}");
        assert_eq!(finish, whole["choices"][0]["finish_reason"], "{path}");
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(
                usage[k], whole["usage"][k],
                "{path} {k}: {usage} vs {whole}"
            );
        }
        // Without include_usage: no usage chunk, the same framing.
        sb["stream_options"] = json!({"include_usage": false});
        let (_, _, usage) = check_stream(&strict_sse(&s, path, &sb), is_chat);
        assert!(usage.is_null(), "{path}: {usage}");
    }
}

/// A greedy completion's tokens' texts (`logprobs: 0`) for `prompt`.
fn token_texts(s: &Server, prompt: &str, n: usize) -> Vec<String> {
    let body = json!({"prompt": prompt, "max_tokens": n, "logprobs": 0});
    let (st, v, _) = post(s, "/v1/completions", &body.to_string());
    assert_eq!(st, 200, "{v}");
    v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect()
}

// A stop string that begins inside one token and ends inside the next ends the reply with
// finish_reason "stop", streamed or not, and the text is cut just before it: no SSE delta
// ever carries the held-back start of the stop string (the streamed deltas add up to the
// cut text exactly, and none contains any of it). Catches a server that streams the
// held-back bytes before it knows they begin a stop string, one that reports "length",
// and one that keeps the stop string in the text.
#[test]
fn a_stop_string_across_tokens_cuts_the_reply_streamed_and_not() {
    let s = start(&["--max-tokens", "24", "--ctx", "256"]);
    let prompt = "Once upon a time there was";
    let toks = token_texts(&s, prompt, 24);
    let clean = |t: &str| !t.is_empty() && !t.contains('\u{fffd}');
    // Token i's last character and token i+1's first: a stop string across a boundary.
    let i = (2..toks.len() - 1)
        .find(|&i| clean(&toks[i]) && clean(&toks[i + 1]))
        .unwrap_or_else(|| panic!("no two clean neighbours in {toks:?}"));
    let stop = format!(
        "{}{}",
        toks[i].chars().last().unwrap(),
        toks[i + 1].chars().next().unwrap()
    );
    let (st, v, _) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 24}).to_string(),
    );
    assert_eq!(st, 200, "{v}");
    let full = v["choices"][0]["text"].as_str().unwrap().to_string();
    let want = &full[..full.find(&stop).unwrap()];
    let body = json!({"prompt": prompt, "max_tokens": 24, "stop": stop});
    let (st, v, _) = post(&s, "/v1/completions", &body.to_string());
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want, "stop {stop:?}: {v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let events = strict_sse(&s, "/v1/completions", &sb);
    let (text, finish, _) = check_stream(&events, false);
    assert_eq!(text, want, "stop {stop:?}");
    assert_eq!(finish, "stop");
    for e in &events {
        let t = e["choices"][0]["text"].as_str().unwrap_or("");
        assert!(!t.contains(&stop), "a delta carries the stop string: {e}");
    }
    // Chat, streamed and not: the same cut (the response's content).
    let chat = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 24});
    let (st, v, _) = post(&s, "/v1/chat/completions", &chat.to_string());
    assert_eq!(st, 200, "{v}");
    let reply = v["choices"][0]["message"]["content"].as_str().unwrap();
    let Some(stop) = reply
        .char_indices()
        .map(|(k, _)| k)
        .filter(|&k| k > 0)
        .map(|k| reply[k..].chars().take(2).collect::<String>())
        .find(|w| w.chars().count() == 2 && !w.contains('\u{fffd}'))
    else {
        panic!("no stop string to take from {reply:?}");
    };
    let want = &reply[..reply.find(&stop).unwrap()];
    let mut cb = chat.clone();
    cb["stop"] = json!([stop]);
    let (st, v, _) = post(&s, "/v1/chat/completions", &cb.to_string());
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    cb["stream"] = json!(true);
    let (text, finish, _) = check_stream(&strict_sse(&s, "/v1/chat/completions", &cb), true);
    assert_eq!(text, want);
    assert_eq!(finish, "stop");
}

// Four different prompts at once (two streamed, two sharing a long prefix) each get the
// reply they get alone, served one after another. Catches state leaking between slots
// (a shared prefix's KV reused across requests running together, a stream's text given
// to another request), which a count of tokens does not see.
#[test]
fn four_prompts_at_once_each_equal_their_serial_greedy_reply() {
    let s = start(&[
        "--parallel",
        "4",
        "--max-tokens",
        "12",
        "--ctx",
        "256",
        "--cache-entries",
        "0",
    ]);
    let system = "You are a careful assistant who answers in one short sentence.";
    let prompts = [
        json!([{"role": "system", "content": system}, {"role": "user", "content": "Name a sea."}]),
        json!([{"role": "system", "content": system}, {"role": "user", "content": "Name a tree."}]),
        json!([{"role": "user", "content": "Count to three."}]),
        json!([{"role": "user", "content": "What is a kettle?"}]),
    ];
    let body = |m: &Value, stream: bool| json!({"messages": m, "max_tokens": 12, "stream": stream});
    let reply = |s: &Server, m: &Value, stream: bool| -> String {
        if stream {
            check_stream(&strict_sse(s, "/v1/chat/completions", &body(m, true)), true).0
        } else {
            let (st, v, _) = post(s, "/v1/chat/completions", &body(m, false).to_string());
            assert_eq!(st, 200, "{v}");
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    let serial: Vec<String> = prompts.iter().map(|m| reply(&s, m, false)).collect();
    let together: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(k, m)| {
                let s = &s;
                sc.spawn(move || reply(s, m, k % 2 == 1))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, serial);
}

/// What stop strings leave of a text generated token by token, found naively: the
/// generation ends at the first token after which some stop string occurs in the text so
/// far, and the text is cut where the earliest occurrence begins. (cut text, stopped)
fn naive_cut(pieces: &[&[u8]], stops: &[String]) -> (Vec<u8>, bool) {
    let mut text = Vec::new();
    for p in pieces {
        text.extend_from_slice(p);
        let first = stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.windows(s.len()).position(|w| w == s.as_bytes()))
            .min();
        if let Some(at) = first {
            text.truncate(at);
            return (text, true);
        }
    }
    (text, false)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    // The text streamer against a naive `find`: for any text (multi-byte characters
    // included), cut into tokens at any byte (so inside characters too), and stop strings
    // taken from it or not, the text shown piece by piece is the text before the first
    // stop string, no piece holds bytes past the cut, and each piece is whole UTF-8 (a
    // character split across tokens waits for its last byte). Catches a stop string missed
    // across a token boundary, held-back text shown early, and a split character shown
    // as replacement characters.
    #[test]
    fn the_text_streamer_matches_a_naive_find(
        chars in proptest::collection::vec(
            prop_oneof![Just('a'), Just('b'), Just('é'), Just('界'), Just('🙂'), Just(' ')],
            0..40,
        ),
        cuts in proptest::collection::vec(0usize..200, 0..12),
        picks in proptest::collection::vec((0usize..200, 1usize..6), 0..3),
        extra in proptest::option::of("[ab]{1,3}"),
    ) {
        let text: String = chars.iter().collect();
        let bytes = text.as_bytes();
        let mut stops: Vec<String> = picks
            .iter()
            .filter_map(|&(at, len)| {
                let cs: Vec<char> = text.chars().collect();
                let at = at % cs.len().max(1);
                (at < cs.len()).then(|| cs[at..(at + len).min(cs.len())].iter().collect())
            })
            .collect();
        stops.extend(extra);
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        points.push(0);
        points.push(bytes.len());
        points.sort_unstable();
        points.dedup();
        let pieces: Vec<&[u8]> = points.windows(2).map(|w| &bytes[w[0]..w[1]]).collect();
        let (want, stopped) = naive_cut(&pieces, &stops);
        let mut st = TextStream::new(&stops);
        let mut shown = String::new();
        for p in &pieces {
            let piece = st.push(p);
            prop_assert!(!piece.contains('\u{fffd}'), "{piece:?}");
            shown.push_str(&piece);
            prop_assert!(want.starts_with(shown.as_bytes()), "{shown:?} past {want:?}");
        }
        shown.push_str(&st.finish());
        prop_assert_eq!(shown.as_bytes(), &want[..], "stops {:?}", stops);
        prop_assert_eq!(st.stopped(), stopped);
    }
}
