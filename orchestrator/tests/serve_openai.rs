//! `k3-orch serve`'s OpenAI compatibility (issue 34) over real HTTP on the tiny chat model:
//! every request field is supported or refused with a 400 naming it, and the supported ones
//! (penalties, logprobs, `n`, reasoning split, tool calls) do what OpenAI's do.

use serde_json::{json, Value};

use crate::serve_http::{post, start, Server};

/// GET a path: (status, body as JSON).
fn get(s: &Server, path: &str) -> (u16, Value) {
    let resp = match ureq::get(&format!("{}{path}", s.base)).call() {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{path}: {e}"),
    };
    (resp.status(), resp.into_json().unwrap_or(Value::Null))
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[test]
fn unsupported_fields_are_refused_by_name_and_the_model_is_listed() {
    let s = start(&["--max-tokens", "16", "--ctx", "256"]);
    for (path, body, field) in [
        (
            "/v1/chat/completions",
            json!({"messages": user("hi"), "logit_bias": {"7": 5}}),
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("hi"), "frobnicate": true}),
            "frobnicate",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2], "echo": true}),
            "echo",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2], "suffix": "x"}),
            "suffix",
        ),
    ] {
        let (st, v, _) = post(&s, path, &body.to_string());
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(field),
            "{v}"
        );
    }
    // Harmless fields pass.
    let body = json!({"messages": user("hi"), "max_tokens": 2, "user": "u-1", "n": 1});
    let (st, v, _) = post(&s, "/v1/chat/completions", &body.to_string());
    assert_eq!(st, 200, "{v}");
    // The model by id; another id is a 404 OpenAI error.
    let (st, m) = get(&s, "/v1/models/k3");
    assert_eq!(
        (st, m["id"].as_str(), m["object"].as_str()),
        (200, Some("k3"), Some("model"))
    );
    let (st, e) = get(&s, "/v1/models/gpt-4");
    assert_eq!(st, 404, "{e}");
    assert_eq!(e["error"]["code"], "model_not_found");
    assert!(e["error"]["message"].as_str().unwrap().contains("gpt-4"));
}
