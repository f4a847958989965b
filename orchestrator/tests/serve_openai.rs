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

/// The generated ids and every step's raw logits row of a non-streamed request (a server
/// started with `--debug-logits`).
fn ids_and_logits(s: &Server, path: &str, mut body: Value) -> (Vec<u32>, Vec<Vec<f32>>, Value) {
    body["return_token_ids"] = json!(true);
    body["k3_logits"] = json!(true);
    // Rows of 163,840 logits: past what `post` reads into a string.
    let v: Value = ureq::post(&format!("{}{path}", s.base))
        .send_json(body.clone())
        .unwrap_or_else(|e| panic!("{body}: {e}"))
        .into_json()
        .unwrap();
    let c = &v["choices"][0];
    let ids = c["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let rows = c["k3_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|b| f32::from_bits(b.as_u64().unwrap() as u32))
                .collect()
        })
        .collect();
    (ids, rows, v)
}

/// Index of the largest value; the lowest index wins a tie (the sampler's argmax).
fn argmax(r: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in r.iter().enumerate() {
        if x > r[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn presence_and_frequency_penalties_steer_greedy_decoding_exactly() {
    let s = start(&["--max-tokens", "24", "--ctx", "256", "--debug-logits"]);
    let prompt = json!([5, 9, 2, 7]);
    let base = json!({"prompt": prompt, "max_tokens": 24});
    let (plain, _, _) = ids_and_logits(&s, "/v1/completions", base.clone());
    // Zero penalties change nothing.
    let mut zero = base.clone();
    zero["presence_penalty"] = json!(0.0);
    zero["frequency_penalty"] = json!(0);
    assert_eq!(ids_and_logits(&s, "/v1/completions", zero).0, plain);
    // Each step picks argmax(logits - count·f - [count>0]·p) over the ids generated before
    // it (the raw rows come back with k3_logits), and the penalties change the reply
    // (negative ones: this model's greedy reply repeats no id, so they pull repeats in).
    let (pres, freq) = (-1.5f32, -0.75f32);
    let mut pen = base.clone();
    pen["presence_penalty"] = json!(pres);
    pen["frequency_penalty"] = json!(freq);
    let (ids, rows, _) = ids_and_logits(&s, "/v1/completions", pen);
    assert_eq!(ids.len(), rows.len());
    for (step, row) in rows.iter().enumerate() {
        let mut r = row.clone();
        let mut counts = std::collections::BTreeMap::<u32, u32>::new();
        for &id in &ids[..step] {
            *counts.entry(id).or_default() += 1;
        }
        for (id, c) in counts {
            r[id as usize] -= c as f32 * freq + pres;
        }
        assert_eq!(ids[step], argmax(&r), "step {step}: {ids:?}");
    }
    assert_ne!(ids, plain, "the penalties changed nothing: {plain:?}");
}
