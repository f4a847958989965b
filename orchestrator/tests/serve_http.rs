//! `k3-orch serve` and `k3-orch chat` end to end: the real binary on 127.0.0.1 with a
//! `synth --shape tiny-chat` model, driven over real HTTP by a Rust client (ureq).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::tools_common::{self, bin, skip, tiny_chat_model as model};
use serde_json::{json, Value};

pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn start(extra: &[&str]) -> Server {
    start_with(extra, &[], None)
}

/// [`start`] with environment variables (test hooks), stderr to `log` when given.
pub(crate) fn start_with(extra: &[&str], envs: &[(&str, &str)], log: Option<&Path>) -> Server {
    let m = model().to_str().unwrap();
    let mut args = vec!["serve", m, "--tok", m, "--port", "0", "--threads", "1"];
    args.extend_from_slice(extra);
    spawn(&args, envs, log)
}

/// `k3-orch ARGS` (a `serve` command line with `--port 0`), once it is ready (`/health`
/// 200 within 30 s), with environment variables and stderr to `log` when given.
pub(crate) fn spawn(args: &[&str], envs: &[(&str, &str)], log: Option<&Path>) -> Server {
    let s = spawn_listening(args, envs, log);
    let t0 = Instant::now();
    loop {
        if let Ok(r) = ureq::get(&format!("{}/health", s.base)).call() {
            if r.status() == 200 {
                return s;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "server never became ready"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// [`spawn`] once the server prints the address it listens on, before it is ready.
fn spawn_listening(args: &[&str], envs: &[(&str, &str)], log: Option<&Path>) -> Server {
    let stderr = match log {
        Some(p) => Stdio::from(std::fs::File::create(p).unwrap()),
        None => Stdio::null(),
    };
    let mut child = Command::new(bin())
        .args(args)
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    Server {
        child,
        base: format!("http://{addr}"),
    }
}

/// POST JSON; (status, body as JSON, Retry-After).
pub(crate) fn post(s: &Server, path: &str, body: &str) -> (u16, Value, Option<String>) {
    let r = ureq::post(&format!("{}{path}", s.base))
        .set("Content-Type", "application/json")
        .send_string(body);
    answer(path, r)
}

/// A response, an error status included: (status, body as JSON or else as a string,
/// Retry-After). A transport error fails the test, naming `path`.
fn answer(path: &str, r: Result<ureq::Response, ureq::Error>) -> (u16, Value, Option<String>) {
    let resp = match r {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{path}: {e}"),
    };
    let status = resp.status();
    let retry = resp.header("retry-after").map(str::to_string);
    let text = resp.into_string().unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
        retry,
    )
}

pub(crate) fn chat_body(msgs: Value, n: usize, stream: bool) -> String {
    json!({"model": "k3", "messages": msgs, "max_tokens": n, "stream": stream,
           "stream_options": {"include_usage": true}})
    .to_string()
}

/// A streamed request: (concatenated content, finish_reason, usage, saw [DONE]).
fn stream(s: &Server, body: &str) -> (String, String, Value, bool) {
    let r = ureq::post(&format!("{}/v1/chat/completions", s.base))
        .set("Content-Type", "application/json")
        .send_string(body)
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.content_type().starts_with("text/event-stream"));
    let mut text = String::new();
    r.into_reader().read_to_string(&mut text).unwrap();
    let (mut content, mut finish, mut usage, mut done) =
        (String::new(), String::new(), Value::Null, false);
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(c) = v
            .pointer("/choices/0/delta/content")
            .and_then(Value::as_str)
        {
            content.push_str(c);
        }
        if let Some(f) = v
            .pointer("/choices/0/finish_reason")
            .and_then(Value::as_str)
        {
            finish = f.to_string();
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (content, finish, usage, done)
}

#[test]
fn streamed_text_equals_non_streamed_and_follow_ups_reuse_the_prefix() {
    let s = start(&[]);
    let turn1 = json!([{"role": "user", "content": "Hello, who are you?"}]);
    let (st, full, _) = post(
        &s,
        "/v1/chat/completions",
        &chat_body(turn1.clone(), 12, false),
    );
    assert_eq!(st, 200, "{full}");
    let text = full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(full["usage"]["completion_tokens"], 12);
    assert!(!text.is_empty());
    let (streamed, finish, usage, done) = stream(&s, &chat_body(turn1, 12, true));
    assert_eq!(
        streamed, text,
        "greedy: streamed text must equal the non-streamed text"
    );
    assert_eq!(finish, "length");
    assert!(done, "no data: [DONE]");
    assert_eq!(usage["completion_tokens"], 12);
    // A follow-up turn extends the conversation: its history prefix is reused.
    let turn2 = json!([
        {"role": "user", "content": "Hello, who are you?"},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Tell me more."}
    ]);
    let (st, r2, _) = post(
        &s,
        "/v1/chat/completions",
        &chat_body(turn2.clone(), 4, false),
    );
    assert_eq!(st, 200, "{r2}");
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = r2["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached > 0 && cached < prompt, "cached {cached} of {prompt}");
    // Reuse does not change the answer: a server without a prefix cache says the same.
    let cold = start(&["--cache-entries", "0"]);
    let (_, r3, _) = post(&cold, "/v1/chat/completions", &chat_body(turn2, 4, false));
    assert_eq!(r3["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        r3["choices"][0]["message"]["content"],
        r2["choices"][0]["message"]["content"]
    );
    // The warm stages and the in-process engine give the same text (a consistency check
    // between modes; the tiny-chat model has no oracle).
    let single = start(&["--single-process"]);
    let (_, r4, _) = post(
        &single,
        "/v1/chat/completions",
        &chat_body(
            json!([{"role": "user", "content": "Hello, who are you?"}]),
            12,
            false,
        ),
    );
    assert_eq!(r4["choices"][0]["message"]["content"], text.as_str());
    // A seeded sampled request is repeatable.
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                      "temperature": 0.9, "top_k": 40, "seed": 5})
    .to_string();
    let a = post(&s, "/v1/chat/completions", &body).1;
    let b = post(&cold, "/v1/chat/completions", &body).1;
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    assert_eq!(a["seed"], 5);
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let s = start(&["--max-tokens", "64", "--ctx", "256"]);
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(String, &str)> = vec![
        ("{not json".into(), "not valid JSON"),
        ("[1,2]".into(), "JSON object"),
        (json!({"max_tokens": 3}).to_string(), "messages"),
        (json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string(), "unknown role"),
        (json!({"messages": user, "max_tokens": 0}).to_string(), "at least 1"),
        (json!({"messages": user, "max_tokens": 65}).to_string(), "over the limit"),
        (json!({"messages": user, "temperature": "warm"}).to_string(), "temperature"),
        (
            json!({"messages": [{"role": "user", "content": "word ".repeat(400)}], "max_tokens": 8})
                .to_string(),
            "context",
        ),
    ];
    for (body, needle) in &cases {
        let (st, v, _) = post(&s, "/v1/chat/completions", body);
        assert_eq!(st, 400, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{body}: {msg}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let (st, v, _) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": [999999]}).to_string(),
    );
    assert_eq!(st, 400, "{v}");
    let (st, _, _) = post(&s, "/v1/nope", "{}");
    assert_eq!(st, 404);
    // Still serving.
    let (st, v, _) = post(&s, "/v1/chat/completions", &chat_body(user, 2, false));
    assert_eq!(st, 200, "{v}");
    // Tokenize and detokenize round-trip; models lists one model; metrics count.
    let (_, t, _) = post(
        &s,
        "/tokenize",
        &json!({"content": "Hello, world"}).to_string(),
    );
    let (_, d, _) = post(
        &s,
        "/detokenize",
        &json!({"tokens": t["tokens"]}).to_string(),
    );
    assert_eq!(d["content"], "Hello, world");
    let m: Value = ureq::get(&format!("{}/v1/models", s.base))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(m["data"][0]["id"], "k3");
    let metrics = ureq::get(&format!("{}/metrics", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(metrics.contains("k3_requests_total 1"), "{metrics}");
    assert!(
        metrics.contains("k3_completion_tokens_total 2"),
        "{metrics}"
    );
    // Warm stages: memory per stage process (cgroup usage), and the orchestrator's own.
    for stage in [
        "orchestrator",
        "tokenizer",
        "trunk-loader",
        "expert-fetcher",
        "layer-compute",
    ] {
        assert!(
            metrics.contains(&format!("k3_stage_rss_bytes{{stage=\"{stage}\"}}")),
            "{metrics}"
        );
    }
    assert!(metrics.contains("k3_stage_restarts_total 0"), "{metrics}");
    let page = ureq::get(&format!("{}/", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(page.contains("/v1/chat/completions") && page.contains("/metrics"));
}

#[test]
fn concurrent_requests_are_all_answered_and_a_full_queue_gets_429() {
    let s = start(&["--max-queue", "4"]);
    let base = s.base.clone();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let b = base.clone();
            std::thread::spawn(move || {
                let body = json!({"messages": [{"role": "user", "content": format!("request {i}")}],
                                  "max_tokens": 5});
                let v: Value = ureq::post(&format!("{b}/v1/chat/completions"))
                    .send_json(body)
                    .unwrap()
                    .into_json()
                    .unwrap();
                v["usage"]["completion_tokens"].as_u64().unwrap()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 5);
    }
    // One slot, held by a long request, and no room to wait: the next one is refused with
    // Retry-After.
    let s1 = start(&["--parallel", "1", "--max-queue", "0"]);
    let b1 = s1.base.clone();
    let long = std::thread::spawn(move || {
        ureq::post(&format!("{b1}/v1/completions"))
            .send_json(json!({"prompt": "Once upon a time", "max_tokens": 400}))
            .map(|r| r.status())
            .unwrap_or(0)
    });
    // Wait until the long request holds the slot (queue depth 1), then ask again.
    wait_for_one_in_flight(&s1.base, "the long request");
    let (st, v, refused) = post(
        &s1,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 1}).to_string(),
    );
    assert_eq!(st, 429, "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(refused.as_deref(), Some("1"));
    assert_eq!(long.join().unwrap(), 200);
}

#[test]
fn sigterm_drains_and_exits_0_within_5_s() {
    let mut s = start(&["--parallel", "4"]);
    // Four requests in flight, two streamed: each gets a whole answer (a finish reason,
    // `[DONE]` for a stream).
    let inflight: Vec<_> = (0..4)
        .map(|i| {
            let b = s.base.clone();
            std::thread::spawn(move || {
                let body = json!({"prompt": format!("Hello {i}"), "max_tokens": 2000,
                                  "stream": i % 2 == 1});
                let r = ureq::post(&format!("{b}/v1/completions")).send_json(body);
                let Ok(r) = r else { return (0, String::new()) };
                (r.status(), r.into_string().unwrap_or_default())
            })
        })
        .collect();
    wait_for_busy(&s.base, 4, "the four requests");
    let stages = wait_for_stages(s.child.id());
    let cgroups: Vec<PathBuf> = stages
        .iter()
        .filter_map(|(_, p)| k3_cgroup_of(*p))
        .collect();
    if cgroups.len() != stages.len() {
        skip(
            "sigterm_drains_and_exits_0_within_5_s (its cgroup check)",
            "the stages run without per-stage cgroups (needs root)",
        );
    }
    let shm_before = k3_shm_entries();
    let t0 = Instant::now();
    let pid = s.child.id() as i32;
    // SAFETY: a signal to the server this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = exit_within_5_s(&mut s.child, t0, || {});
    assert_eq!(status.code(), Some(0));
    // The requests in flight were answered, not dropped.
    for (i, h) in inflight.into_iter().enumerate() {
        let (code, body) = h.join().unwrap();
        assert_eq!(code, 200, "request {i}: {body}");
        assert!(
            body.contains("\"finish_reason\":\"cancelled\"")
                || body.contains("\"finish_reason\":\"length\""),
            "request {i}: {body}"
        );
        if i % 2 == 1 {
            assert!(
                body.trim_end().ends_with("data: [DONE]"),
                "request {i}: {body}"
            );
        }
    }
    // Nothing is left behind: no stage process, no cgroup, no shared memory of the run.
    std::thread::sleep(Duration::from_millis(100));
    for (name, p) in &stages {
        assert!(
            !Path::new(&format!("/proc/{p}")).exists()
                || std::fs::read_to_string(format!("/proc/{p}/stat"))
                    .map_or(true, |st| st.contains(") Z ")),
            "stage {name} (pid {p}) outlived the server"
        );
    }
    for d in &cgroups {
        assert!(!d.exists(), "cgroup {} outlived the server", d.display());
    }
    let shm_after = k3_shm_entries();
    assert!(
        shm_after.iter().all(|e| shm_before.contains(e)),
        "shared memory left behind: {shm_after:?}"
    );
}

/// The server's exit status, once it exits within 5 s of `t0` (when it was sent SIGTERM).
/// Past that, `on_timeout` runs (to let go of a stage the test stopped, so nothing outlives
/// the test) and the test fails.
fn exit_within_5_s(child: &mut Child, t0: Instant, on_timeout: impl FnOnce()) -> ExitStatus {
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if t0.elapsed() >= Duration::from_secs(5) {
            on_timeout();
            panic!("still running 5 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM while layer-compute does not answer (stopped with SIGSTOP mid-generation, so the
/// drain's cut at 2.5 s is never honoured): the deadline path still exits 0 within 5 s and
/// leaves no stage process and no cgroup behind (it used to exit at 4.5 s past the cleanup,
/// leaving the run's cgroups).
#[test]
fn sigterm_with_a_stage_that_does_not_answer_still_cleans_up_within_5_s() {
    let mut s = start(&[]);
    let b = s.base.clone();
    let inflight = std::thread::spawn(move || {
        let _ = ureq::post(&format!("{b}/v1/completions"))
            .send_json(json!({"prompt": "Hello", "max_tokens": 2000}));
    });
    wait_for_one_in_flight(&s.base, "the request");
    let stages = wait_for_stages(s.child.id());
    let cgroups: Vec<PathBuf> = stages
        .iter()
        .filter_map(|(_, p)| k3_cgroup_of(*p))
        .collect();
    if cgroups.len() != stages.len() {
        skip(
            "sigterm_with_a_stage_that_does_not_answer_still_cleans_up_within_5_s",
            "the stages run without per-stage cgroups (needs root)",
        );
        return;
    }
    let run_dirs: Vec<PathBuf> = cgroups
        .iter()
        .filter_map(|d| d.parent().map(Path::to_path_buf))
        .collect();
    let compute = stages.iter().find(|(n, _)| n == "layer-compute").unwrap().1;
    // SAFETY: signals to processes this test started (its stage, then the server).
    assert_eq!(unsafe { libc::kill(compute as i32, libc::SIGSTOP) }, 0);
    let t0 = Instant::now();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) }, 0);
    let status = exit_within_5_s(&mut s.child, t0, || {
        // SAFETY: a signal to the stage this test started (and stopped).
        unsafe { libc::kill(compute as i32, libc::SIGKILL) };
    });
    let took = t0.elapsed();
    assert_eq!(status.code(), Some(0), "after {took:?}");
    std::thread::sleep(Duration::from_millis(200));
    let alive: Vec<&(String, u32)> = stages
        .iter()
        .filter(|(_, p)| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|st| !st.contains(") Z "))
        })
        .collect();
    for (_, p) in &alive {
        // SAFETY: a stage of the server this test started, which outlived it.
        unsafe { libc::kill(*p as i32, libc::SIGKILL) };
    }
    assert!(alive.is_empty(), "stages outlived the server: {alive:?}");
    for d in cgroups.iter().chain(&run_dirs) {
        assert!(!d.exists(), "cgroup {} outlived the server", d.display());
    }
    let _ = inflight.join();
}

/// The stage processes of a server: (stage name, pid), from /proc (children of `pid`).
pub(crate) fn stage_pids(pid: u32) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        for c in children
            .split_whitespace()
            .filter_map(|c| c.parse::<u32>().ok())
        {
            let cmd = std::fs::read(format!("/proc/{c}/cmdline")).unwrap_or_default();
            let args: Vec<String> = cmd
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            if args.len() >= 3 && args[1] == "stage" {
                out.push((args[2].clone(), c));
            }
        }
    }
    out
}

/// The cgroup directory a process is in (cgroup v2 unified hierarchy), if it is a k3 one.
pub(crate) fn k3_cgroup_of(pid: u32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|l| {
        let path = l.splitn(3, ':').nth(2)?;
        let base = if l.starts_with("0::") {
            "/sys/fs/cgroup".to_string()
        } else {
            let ctl = l.split(':').nth(1)?;
            if !ctl.split(',').any(|c| c == "memory") {
                return None;
            }
            format!("/sys/fs/cgroup/{ctl}")
        };
        path.contains("k3")
            .then(|| PathBuf::from(format!("{base}{path}")))
    })
}

/// Entries in /dev/shm that look like ours (the links and arenas are memfds, so none
/// are expected at all).
fn k3_shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains("k3"))
                .collect()
        })
        .unwrap_or_default()
}

/// Wait until the server lists its 4 stage processes.
pub(crate) fn wait_for_stages(pid: u32) -> Vec<(String, u32)> {
    let t0 = Instant::now();
    loop {
        let s = stage_pids(pid);
        if s.len() == 4 {
            return s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "stages never started: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_sigkilled_stage_fails_its_request_with_a_5xx_and_the_next_request_succeeds() {
    let s = start(&[]);
    let user = json!([{"role": "user", "content": "Hello"}]);
    let (st, good, _) = post(
        &s,
        "/v1/chat/completions",
        &chat_body(user.clone(), 6, false),
    );
    assert_eq!(st, 200, "{good}");
    for victim in ["layer-compute", "expert-fetcher", "tokenizer"] {
        let stages = wait_for_stages(s.child.id());
        let pid = stages.iter().find(|(n, _)| n == victim).unwrap().1;
        let b = s.base.clone();
        let inflight = std::thread::spawn(move || {
            let body =
                json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2000});
            match ureq::post(&format!("{b}/v1/chat/completions")).send_json(body) {
                Ok(r) => (r.status(), r.into_json::<Value>().unwrap_or(Value::Null)),
                Err(ureq::Error::Status(c, r)) => {
                    (c, r.into_json::<Value>().unwrap_or(Value::Null))
                }
                Err(e) => panic!("transport error: {e}"),
            }
        });
        // Kill the stage once the request is generating.
        wait_for_one_in_flight(&s.base, "the request");
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: a signal to a stage of the server this test started.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
        let (code, v) = inflight.join().unwrap();
        assert!((500..600).contains(&code), "{victim}: {code} {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains(victim) && msg.contains("SIGKILL"),
            "{victim}: the error names the stage and the cause: {msg}"
        );
        // The next request is served by fresh stages, with the same greedy answer.
        let (st, again, _) = post(
            &s,
            "/v1/chat/completions",
            &chat_body(user.clone(), 6, false),
        );
        assert_eq!(st, 200, "{victim}: {again}");
        assert_eq!(
            again["choices"][0]["message"]["content"],
            good["choices"][0]["message"]["content"]
        );
        let after = wait_for_stages(s.child.id());
        assert!(!after.iter().any(|(_, p)| *p == pid), "{after:?}");
    }
    let m = ureq::get(&format!("{}/metrics", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(m.contains("k3_stage_restarts_total 3"), "{m}");
}

#[test]
fn chat_repl_works_from_a_pipe() {
    let m = model().to_str().unwrap();
    let mut child = Command::new(bin())
        .args([
            "chat",
            m,
            "--tok",
            m,
            "-n",
            "6",
            "--threads",
            "1",
            "--stats",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Hello there\nAnd then?\n/reset\nHello there\n/exit\nnever read\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8(o.stdout).unwrap();
    let replies: Vec<&str> = out.lines().collect();
    assert_eq!(replies.len(), 3, "{out:?}");
    // After /reset the same first message gets the same (greedy) reply.
    assert_eq!(replies[0], replies[2]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("(conversation reset)"), "{err}");
    // The second turn reused the first turn's state.
    let reused: Vec<u64> = err
        .lines()
        .filter_map(|l| {
            l.split(" prompt tokens, ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(reused.len(), 3, "{err}");
    assert!(reused[1] > 0, "{err}");
}

/// `k3-orch chat` on the tiny model with `extra` flags, `input` on stdin; (stdout, stderr),
/// after checking it exited 0.
fn chat_pipe(extra: &[&str], input: &str) -> (String, String) {
    let m = model().to_str().unwrap();
    let mut child = Command::new(bin())
        .args([
            "chat",
            m,
            "--tok",
            m,
            "-n",
            "8",
            "--threads",
            "1",
            "--stats",
        ])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{extra:?} {input:?}: {err}");
    (String::from_utf8(o.stdout).unwrap(), err)
}

/// The "N reused" counts of the `--stats` lines, in order.
fn reused_counts(err: &str) -> Vec<u64> {
    err.lines()
        .filter_map(|l| {
            l.split(" prompt tokens, ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// `/save` in one process and `/load` in another continue the session: the second turn
/// prefills only its new tokens (reused > 0) and replies exactly as an uninterrupted
/// session does, greedy and seeded-sampled (the sampled reply depends on the whole logits
/// row, so a state that were off would show), on warm stages and in one process. A state
/// for another configuration, a corrupt one, one for another conversation and a missing one
/// are not used (and say so);
/// the conversation is loaded anyway and the REPL keeps going.
#[test]
fn chat_save_and_load_continue_the_session_in_a_new_process() {
    let dir = std::env::temp_dir().join(format!("k3-chat-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let modes: [&[&str]; 4] = [
        &[],
        &["--temperature", "1.5", "--seed", "7"],
        &["--single-process"],
        &["--single-process", "--temperature", "1.5", "--seed", "7"],
    ];
    for (i, flags) in modes.iter().enumerate() {
        let f = dir.join(format!("s{i}.json"));
        let f = f.to_str().unwrap();
        let (whole, err) = chat_pipe(flags, "Hello there\nAnd then?\n");
        assert_eq!(reused_counts(&err).len(), 2, "{flags:?}: {err}");
        let (first, err) = chat_pipe(flags, &format!("Hello there\n/save {f}\n"));
        assert!(err.contains("session state ("), "{flags:?}: {err}");
        assert!(Path::new(&format!("{f}.state")).is_file());
        let (second, err) = chat_pipe(flags, &format!("/load {f}\nAnd then?\n"));
        assert!(err.contains("(loaded 2 messages from"), "{flags:?}: {err}");
        let reused = reused_counts(&err);
        assert_eq!(reused.len(), 1, "{flags:?}: {err}");
        assert!(reused[0] > 0, "{flags:?}: the state was not reused: {err}");
        // Replies can hold newlines: compare the whole transcripts.
        assert!(!second.trim().is_empty(), "{flags:?}");
        assert_eq!(
            format!("{first}{second}"),
            whole,
            "{flags:?}: the loaded session replied otherwise than the uninterrupted one"
        );
    }
    let f = dir.join("s0.json");
    let f = f.to_str().unwrap();
    // Another configuration (fewer layers: another fingerprint): refused, clearly.
    let (out, err) = chat_pipe(&["--layers", "1"], &format!("/load {f}\nAnd then?\n"));
    assert!(
        err.contains("not reused") && err.contains("another model or configuration"),
        "{err}"
    );
    assert_eq!(reused_counts(&err), [0], "{err}");
    assert!(!out.trim().is_empty());
    // A corrupt state: one payload byte changed.
    let bad = dir.join("bad.json");
    std::fs::copy(f, &bad).unwrap();
    let mut st = std::fs::read(format!("{f}.state")).unwrap();
    let n = st.len();
    st[n - 5] ^= 0x40;
    std::fs::write(dir.join("bad.json.state"), &st).unwrap();
    let bad = bad.to_str().unwrap();
    let (_, err) = chat_pipe(&[], &format!("/load {bad}\nAnd then?\n"));
    assert!(
        err.contains("(loaded 2 messages from") && err.contains("not reused"),
        "{err}"
    );
    assert!(err.contains("corrupt"), "{err}");
    assert_eq!(reused_counts(&err), [0], "{err}");
    // A state for another conversation (the saved one with its first message changed).
    let other = dir.join("other.json");
    let conv = std::fs::read_to_string(f).unwrap();
    assert!(conv.contains("Hello there"), "{conv}");
    std::fs::write(&other, conv.replace("Hello there", "Hello world")).unwrap();
    std::fs::copy(format!("{f}.state"), dir.join("other.json.state")).unwrap();
    let (_, err) = chat_pipe(&[], &format!("/load {}\nAnd then?\n", other.display()));
    assert!(
        err.contains("not reused") && err.contains("another conversation"),
        "{err}"
    );
    assert_eq!(reused_counts(&err), [0], "{err}");
    // A missing state: the conversation alone.
    std::fs::remove_file(dir.join("bad.json.state")).unwrap();
    let (_, err) = chat_pipe(&[], &format!("/load {bad}\nAnd then?\n"));
    assert!(
        err.contains("(loaded 2 messages from") && err.contains("not reused"),
        "{err}"
    );
    assert_eq!(reused_counts(&err), [0], "{err}");
    // Nothing to save yet: the conversation is saved, no state file is left.
    let empty = dir.join("empty.json");
    let empty = empty.to_str().unwrap();
    let (_, err) = chat_pipe(&[], &format!("/save {empty}\n"));
    assert!(err.contains("not saved"), "{err}");
    assert!(Path::new(empty).is_file());
    assert!(!Path::new(&format!("{empty}.state")).exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Wait (at most 20 s) until `/metrics` at `base` shows one request holding a slot;
/// `what` names the request in the failure message.
fn wait_for_one_in_flight(base: &str, what: &str) {
    wait_for_busy(base, 1, what);
}

/// Wait (at most 20 s) until `/metrics` at `base` shows `n` slots busy.
pub(crate) fn wait_for_busy(base: &str, n: usize, what: &str) {
    let t0 = Instant::now();
    loop {
        let m = ureq::get(&format!("{base}/metrics"))
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        if m.contains(&format!("\nk3_slots_busy {n}\n")) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{what} never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Routed experts that fail to load end the request with an error, never with text
/// computed without them (a CLI run exits 4 for the same). And a budget whose expert arena
/// holds fewer slots than a layer has experts answers a long prompt, fed in passes, with the
/// text a roomy budget gives, its passes' experts streaming through fewer slots than they
/// route to. Catches a server that answers 200 over failed experts (it did, for a prompt
/// whose experts outnumbered the slots: "every slot is pinned"), a pass whose experts
/// outnumber the slots answering anything else than the roomy text, and a warm plan that
/// cuts prompts to the slots' top-k batches (one token per pass at the slice's 5.5 GB).
#[test]
fn failed_experts_fail_the_request_and_a_small_arena_feeds_prompts_in_passes() {
    let m = model().to_str().unwrap();
    // The tokenizer's cgroup share at the smallest totals is below what the released
    // vocabulary needs; the hook gives it room (the point here is the expert arena).
    let hooks = [
        ("K3_TEST_HOOKS", "1"),
        ("K3_STAGE_BUDGET_OVERRIDE", "tokenizer=300000000"),
    ];
    let long = json!([{"role": "user", "content":
        "Tell me a long story about the sea, the ships, the sailors and the storms they met."}]);
    let body = json!({"model": "k3", "messages": long, "max_tokens": 4}).to_string();
    // 503 while the stages (re)start: retried for 60 s at most, then the test fails
    // instead of hanging (issue 36, item 13).
    let answer = |s: &Server| {
        let t0 = Instant::now();
        loop {
            let (st, v, _) = post(s, "/v1/chat/completions", &body);
            if st != 503 {
                break (st, v);
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "still 503 after 60 s: {v}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let roomy = start_with(&["--mem-gb", "0.1"], &hooks, None);
    let (st, want) = answer(&roomy);
    assert_eq!(st, 200, "{want}");
    drop(roomy);
    // The smallest total that plans at all, 100 KB at a time: it leaves the arena the
    // fewest slots. A CLI run of 257 positions plans what one serving slot of 256 does.
    let mut step = 250u32;
    let (code, _, err) =
        tools_common::k3(&[m, "--ids", "0", "--incremental", "--mem-gb", "0.0250"]);
    assert_eq!(code, 2, "25 MB planned: {err}");
    let tight = loop {
        step += 1;
        assert!(step <= 500, "nothing up to 50 MB plans");
        let gb = format!("{:.4}", step as f64 / 1e4);
        let out = std::env::temp_dir().join(format!("k3-serve-plan-{}.json", std::process::id()));
        let (code, _, err) = tools_common::k3(&[
            m,
            "--ids",
            "0",
            "--gen",
            "255",
            "--incremental",
            "--mem-gb",
            &gb,
            "--out",
            out.to_str().unwrap(),
        ]);
        let _ = std::fs::remove_file(&out);
        if code == 0 {
            break gb;
        }
        assert_eq!(code, 2, "{gb}: {err}");
    };
    let log = std::env::temp_dir().join(format!("k3-serve-tight-{}.log", std::process::id()));
    let one_slot = ["--parallel", "1", "--cache-entries", "0", "--ctx", "256"];
    let s = start_with(
        &[&one_slot[..], &["--mem-gb", &tight]].concat(),
        &hooks,
        Some(&log),
    );
    let (st, got) = answer(&s);
    drop(s);
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    // The prompt's chunk is the plan's, not cut to the top-k batches the slots hold: its
    // rows route to more experts than the arena has slots, and they stream through them
    // (a plan that fed one token per pass at this budget re-read every weight per token).
    let (chunk, slots) = text
        .split("prompts are fed in passes of at most ")
        .nth(1)
        .and_then(|t| {
            let (n, rest) = t.split_once(" token(s) (")?;
            let s = rest.split_once(' ')?.0;
            Some((n.parse::<usize>().ok()?, s.parse::<usize>().ok()?))
        })
        .unwrap_or_else(|| panic!("--mem-gb {tight}: no chunk in the log: {text}"));
    let topk = 2; // tiny-mxfp4's num_experts_per_token
    assert!(
        chunk * topk > slots && slots < 8,
        "--mem-gb {tight}: a chunk of {chunk} fits the {slots} slots: {text}"
    );
    assert_eq!(st, 200, "--mem-gb {tight}: {got}\n{text}");
    assert_eq!(
        got["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"],
        "--mem-gb {tight}"
    );
    // Every expert of layer 1 fails to load: the request fails, naming why.
    let all: Vec<String> = (0..8).map(|e| format!("1:{e}")).collect();
    let inject = all.join(",");
    let mut env = hooks.to_vec();
    env.push(("K3_INJECT_EXPERT_FAILURES", &inject));
    let s = start_with(&["--mem-gb", "0.1"], &env, None);
    let (st, v) = answer(&s);
    assert!(st >= 500, "{st}: {v}");
    assert!(
        v.to_string().contains("failed to load"),
        "the error does not say why: {v}"
    );
}

/// `serve` on a port in use exits 2 at once, before it starts a stage or reads a weight
/// (issue 34 item 6, issue 36's "failed listen"). Catches: binding after the engine
/// started (exit 1 once the stages were up, seconds later).
#[test]
fn a_busy_port_exits_2_at_once_before_loading() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    let m = model().to_str().unwrap();
    let t0 = Instant::now();
    let mut child = Command::new(bin())
        .args(["serve", m, "--tok", m, "--port", &port, "--threads", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stages_seen = false;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        stages_seen |= !stage_pids(child.id()).is_empty();
        if t0.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("serve on a busy port still running after 10 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = t0.elapsed();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        !stages_seen,
        "a stage started before the bind failed: {err}"
    );
    assert!(took < Duration::from_secs(2), "took {took:?}: {err}");
    assert!(
        err.contains(&format!("cannot listen on 127.0.0.1:{port}")) && err.contains("--port"),
        "{err}"
    );
    drop(held);
}

/// One log line per request as it ends (issue 34 item 12): its id, prompt, cached and
/// completion tokens, prefill seconds, tokens/s and finish reason, on stderr. Catches: a
/// server that logs nothing per request (a long request looked like a hang).
#[test]
fn each_request_logs_one_line_when_it_ends() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let s = start_with(&[], &[], Some(&log));
    let user = json!([{"role": "user", "content": "Hello"}]);
    let (st, first, _) = post(&s, "/v1/chat/completions", &chat_body(user, 5, false));
    assert_eq!(st, 200, "{first}");
    let reply = first["choices"][0]["message"]["content"].clone();
    let more = json!([{"role": "user", "content": "Hello"},
                      {"role": "assistant", "content": reply},
                      {"role": "user", "content": "And then?"}]);
    let (st, second, _) = post(&s, "/v1/chat/completions", &chat_body(more, 3, false));
    assert_eq!(st, 200, "{second}");
    // A line may lag its answer by a moment.
    let t0 = Instant::now();
    let lines = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<String> = text
            .lines()
            .filter(|l| l.contains("request ") && l.contains(" prompt tokens ("))
            .map(str::to_string)
            .collect();
        if lines.len() >= 2 || t0.elapsed() > Duration::from_secs(5) {
            break lines;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(lines.len(), 2, "{lines:?}");
    let usage = |v: &Value, k: &str| v["usage"][k].as_u64().unwrap();
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    let expect_first = format!(
        "{} prompt tokens ({} cached), {} completion tokens, prefill ",
        usage(&first, "prompt_tokens"),
        cached(&first).unwrap(),
        usage(&first, "completion_tokens"),
    );
    assert!(
        lines[0].contains(&expect_first),
        "{lines:?} vs {expect_first}"
    );
    let finish = |v: &Value| {
        format!(
            "finish {}",
            v["choices"][0]["finish_reason"].as_str().unwrap()
        )
    };
    assert!(lines[0].trim_end().ends_with(&finish(&first)), "{lines:?}");
    let expect_second = format!(
        "{} prompt tokens ({} cached), {} completion tokens, prefill ",
        usage(&second, "prompt_tokens"),
        cached(&second).unwrap(),
        usage(&second, "completion_tokens"),
    );
    assert!(
        lines[1].contains(&expect_second),
        "{lines:?} vs {expect_second}"
    );
    assert!(lines[1].trim_end().ends_with(&finish(&second)), "{lines:?}");
    assert!(
        !lines[1].contains("(0 cached)"),
        "the follow-up reused: {lines:?}"
    );
    for l in &lines {
        let prefill: f64 = l
            .split("prefill ")
            .nth(1)
            .and_then(|r| r.split(" s, ").next())
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("no prefill seconds in {l}"));
        let tps: f64 = l
            .split(" s, ")
            .nth(1)
            .and_then(|r| r.split(" tokens/s").next())
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("no tokens/s in {l}"));
        let one = l.contains(" 1 completion tokens") || l.contains(" 0 completion tokens");
        assert!(prefill >= 0.0 && (tps > 0.0 || one), "{l}");
    }
    let ids: Vec<&str> = lines
        .iter()
        .map(|l| {
            l.split("request ")
                .nth(1)
                .unwrap()
                .split(':')
                .next()
                .unwrap()
        })
        .collect();
    assert_ne!(ids[0], ids[1], "{lines:?}");
}

/// `method path` with `key` as the bearer key (none: no Authorization header); the status.
fn status_with_key(s: &Server, method: &str, path: &str, body: &str, key: Option<&str>) -> u16 {
    let url = format!("{}{path}", s.base);
    let mut req = ureq::request(method, &url).set("Content-Type", "application/json");
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    let r = if method == "GET" {
        req.call()
    } else {
        req.send_string(body)
    };
    match r {
        Ok(r) => r.status(),
        Err(ureq::Error::Status(code, _)) => code,
        Err(e) => panic!("{method} {path}: {e}"),
    }
}

// Issue 36 (test item 5, hostile 13): with `--api-key`, every /v1/* route (the model list
// and one model included), /tokenize and /detokenize answer 401 without the key and with a
// wrong one (one of the same length too: the comparison is by bytes), and serve with the
// right one; an empty key is refused at start (exit 2). Catches a route left unchecked
// (`GET /v1/models` answered without the key), a prefix match of the key, and an empty
// key that would let every request through.
#[test]
fn api_key_guards_every_api_route_and_an_empty_key_is_refused() {
    let s = start(&["--api-key", "s3cret"]);
    let routes = [
        ("GET", "/v1/models", String::new()),
        ("GET", "/v1/models/k3", String::new()),
        (
            "POST",
            "/v1/chat/completions",
            chat_body(json!([{"role": "user", "content": "Hi"}]), 2, false),
        ),
        (
            "POST",
            "/v1/completions",
            json!({"model": "k3", "prompt": [1, 2, 3], "max_tokens": 2}).to_string(),
        ),
        ("POST", "/tokenize", json!({"content": "Hi"}).to_string()),
        ("POST", "/detokenize", json!({"tokens": [1, 2]}).to_string()),
    ];
    for (method, path, body) in &routes {
        for bad in [None, Some("wrong"), Some("s3creT"), Some("s3cret-and-more")] {
            assert_eq!(
                status_with_key(&s, method, path, body, bad),
                401,
                "{method} {path} with {bad:?}"
            );
        }
        assert_eq!(
            status_with_key(&s, method, path, body, Some("s3cret")),
            200,
            "{method} {path} with the key"
        );
    }
    drop(s);
    let m = model().to_str().unwrap();
    let out = Command::new(bin())
        .args(["serve", m, "--tok", m, "--port", "0", "--api-key", ""])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The finish reasons in a reply's body (streamed or not), in order.
fn finish_reasons(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(k) = rest.find("\"finish_reason\":\"") {
        rest = &rest[k + 17..];
        out.push(rest.split('"').next().unwrap_or_default().to_string());
    }
    out
}

/// SIGTERM with requests that cannot finish in the drain's 2.5 s (layer-compute is held
/// with SIGSTOP, then let go at 2.7 s, before the 3.5 s kill): each request is cut at the
/// next pass and answered with `finish_reason: "cancelled"` (a stream: exactly one, then
/// `[DONE]`), and the server exits 0 within 5 s. Catches a drain that lets requests run on
/// to the kill (they got an error, or nothing), and a cut reported as "length" or "stop"
/// (the sigterm test above accepts "length", as its requests may finish in time).
#[test]
fn sigterm_cuts_requests_in_flight_with_finish_reason_cancelled() {
    let mut s = start(&["--parallel", "2"]);
    let inflight: Vec<_> = [false, true]
        .into_iter()
        .map(|stream| {
            let b = s.base.clone();
            std::thread::spawn(move || {
                let body = json!({"prompt": "Hello", "max_tokens": 2000, "stream": stream});
                match ureq::post(&format!("{b}/v1/completions")).send_json(body) {
                    Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
                    Err(e) => (0, e.to_string()),
                }
            })
        })
        .collect();
    wait_for_busy(&s.base, 2, "the two requests");
    let compute = wait_for_stages(s.child.id())
        .into_iter()
        .find(|(n, _)| n == "layer-compute")
        .unwrap()
        .1 as i32;
    // SAFETY: signals to processes this test started (the server and its stage).
    assert_eq!(unsafe { libc::kill(compute, libc::SIGSTOP) }, 0);
    let t0 = Instant::now();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) }, 0);
    std::thread::sleep(Duration::from_millis(2700));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(compute, libc::SIGCONT) }, 0);
    let status = exit_within_5_s(&mut s.child, t0, || {});
    assert_eq!(status.code(), Some(0));
    for (i, h) in inflight.into_iter().enumerate() {
        let (code, body) = h.join().unwrap();
        assert_eq!(code, 200, "request {i}: {body}");
        assert_eq!(finish_reasons(&body), ["cancelled"], "request {i}: {body}");
        if i == 1 {
            assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
        }
    }
}

/// A streaming client that goes away after its first tokens cancels its generation: the
/// request ends at once (its log line says `finish cancelled`, with far fewer than its
/// 2000 tokens) and its slot is free within 5 s. Catches a generation that runs on to its
/// `max_tokens` for nobody: the engine learns it both from the handler's drop (the cancel
/// flag) and from a text event it cannot deliver; with both removed this fails (checked).
#[test]
fn a_client_that_disconnects_cancels_its_generation() {
    let log = std::env::temp_dir().join(format!("k3-serve-gone-{}.log", std::process::id()));
    let s = start_with(&["--parallel", "1"], &[], Some(&log));
    let addr = s.base.trim_start_matches("http://").to_string();
    let body = json!({"prompt": "Hello", "max_tokens": 2000, "stream": true}).to_string();
    let mut c = std::net::TcpStream::connect(&addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Read until a few events have come, then go away.
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while seen.windows(6).filter(|w| w == b"data: ").count() < 3 {
        let n = c.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    drop(c);
    let t0 = Instant::now();
    let line = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(l) = text.lines().find(|l| l.contains("completion tokens")) {
            break l.to_string();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "no request line 5 s after the client left:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = std::fs::remove_file(&log);
    assert!(line.contains("finish cancelled"), "{line}");
    let n: u64 = line
        .split(" completion tokens")
        .next()
        .and_then(|h| h.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no token count in {line}"));
    assert!(n < 2000, "{line}");
    wait_for_busy(&s.base, 0, "the freed slot");
}

/// GET; (status, body as JSON, Retry-After).
fn get(s: &Server, path: &str) -> (u16, Value, Option<String>) {
    answer(path, ureq::get(&format!("{}{path}", s.base)).call())
}

/// Issue 36 ("Also"): 503 while loading, as docs/serve.md documents it. The test hook
/// `K3_TEST_LOAD_DELAY_MS` holds the trunk-loader's ready 4 s after its load, so the
/// server is listening while its stages still load: `/health` answers 503
/// `{"status":"loading"}` with `Retry-After: 1`, and `/v1/completions` 503 with
/// `Retry-After: 1` and an OpenAI error object; the server turns ready only after the delay
/// (so the window seen is the load, not a race), and then both answer 200. Catches a server
/// that says ready or takes requests before its stages are wired (checked by setting
/// `ready` before the stages start: the first `/health` was 200), one that answers 503
/// without Retry-After, and a hook that does not hold the load (checked by removing it:
/// ready before the delay).
#[test]
fn health_and_requests_answer_503_while_the_stages_load() {
    const DELAY_MS: u64 = 4000;
    let m = model().to_str().unwrap();
    let t0 = Instant::now();
    let delay = DELAY_MS.to_string();
    let s = spawn_listening(
        &["serve", m, "--tok", m, "--port", "0", "--threads", "1"],
        &[("K3_TEST_HOOKS", "1"), ("K3_TEST_LOAD_DELAY_MS", &delay)],
        None,
    );
    let (st, v, retry) = get(&s, "/health");
    assert_eq!(st, 503, "{v}");
    assert_eq!(v, json!({"status": "loading"}));
    assert_eq!(retry.as_deref(), Some("1"));
    let body = json!({"model": "k3", "prompt": "Hello", "max_tokens": 2}).to_string();
    let (st, v, retry) = post(&s, "/v1/completions", &body);
    assert_eq!(st, 503, "{v}");
    assert_eq!(retry.as_deref(), Some("1"), "{v}");
    assert_eq!(v["error"]["type"], "unavailable_error", "{v}");
    assert_eq!(v["error"]["code"], 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("still loading")),
        "{v}"
    );
    loop {
        let (st, v, _) = get(&s, "/health");
        if st == 200 {
            assert_eq!(v, json!({"status": "ok"}));
            break;
        }
        assert_eq!(st, 503, "{v}");
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "still loading after 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(DELAY_MS),
        "ready after {:?}, before the hook's {DELAY_MS} ms",
        t0.elapsed()
    );
    let (st, v, _) = post(&s, "/v1/completions", &body);
    assert_eq!(st, 200, "{v}");
    assert!(v["choices"][0]["text"].is_string(), "{v}");
}
