//! `k3-orch serve` against hostile and careless clients, over raw TCP sockets (issue 36,
//! hostile 2, 13 and 14): header, keep-alive and body timeouts, the connection cap, 413
//! from the declared length, the Host/Origin check of browser requests, and 405, 413 and
//! 431 as OpenAI error objects. Limits are set small by flags so the tests stay fast.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::serve_http::{post, start, Server};

/// The server's `host:port`.
fn addr(s: &Server) -> String {
    s.base.trim_start_matches("http://").to_string()
}

fn connect(s: &Server) -> TcpStream {
    let c = TcpStream::connect(addr(s)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c
}

/// Reads until the server closes the connection (or 10 s pass): the bytes, and whether it
/// closed.
fn read_to_close(c: &mut TcpStream) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return (out, true),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (out, true),
            Err(_) => return (out, false),
        }
    }
}

/// One response read off a connection (the server closes it, or it carries
/// `Content-Length`): (status, headers in lower case, body as JSON or a string).
fn response(c: &mut TcpStream) -> (u16, String, Value) {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            if len.is_some_and(|n| raw.len() >= end + 4 + n) {
                break;
            }
        }
        match c.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = serde_json::from_str(body).unwrap_or_else(|_| Value::String(body.into()));
    (status, head.to_ascii_lowercase(), body)
}

/// Sends `req` on a new connection and reads the answer.
fn exchange(s: &Server, req: &str) -> (u16, String, Value) {
    let mut c = connect(s);
    c.write_all(req.as_bytes()).unwrap();
    response(&mut c)
}

/// The body is an OpenAI error object with this status as its code.
fn assert_openai_error(status: u16, body: &Value, want: u16) {
    assert_eq!(status, want, "{body}");
    assert_eq!(
        body["error"]["code"], want,
        "not an OpenAI error object: {body}"
    );
    assert!(body["error"]["message"].is_string(), "{body}");
    assert!(body["error"]["type"].is_string(), "{body}");
}

// A head trickled byte by byte (slowloris), a socket that sends nothing, and a keep-alive
// connection idle after its response are each closed after `--header-timeout`, while the
// server goes on serving. Catches a server with no header or idle timeout (axum::serve
// held such sockets for 100+ s).
#[test]
fn partial_heads_and_idle_sockets_are_closed_after_the_header_timeout() {
    let s = start(&["--header-timeout", "1"]);
    let mut slow = connect(&s);
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .unwrap();
    let mut silent = connect(&s);
    let mut kept = connect(&s);
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let (st, _, _) = response(&mut kept);
    assert_eq!(st, 200);
    let t0 = Instant::now();
    for (what, c) in [
        ("a partial head", &mut slow),
        ("a silent socket", &mut silent),
        ("an idle keep-alive connection", &mut kept),
    ] {
        let (_, closed) = read_to_close(c);
        assert!(closed, "{what} was held open for 10 s");
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let (st, v, _) = post(&s, "/v1/completions", r#"{"prompt":[1,2],"max_tokens":1}"#);
    assert_eq!(st, 200, "{v}");
}

// A declared `Content-Length` above `--max-body-bytes` gets a 413 (an OpenAI error) before
// a byte of the body is sent, a chunked body that grows past it gets one too, and a body
// that stops arriving gets a 408 after `--body-timeout`. Catches a server that waits for
// the announced 99999999999999 bytes (it did, forever), one that reads a chunked body
// without a bound, and one with no body timeout.
#[test]
fn a_huge_declared_body_gets_413_at_once_and_a_stalled_one_408() {
    let s = start(&["--max-body-bytes", "4096", "--body-timeout", "1"]);
    let t0 = Instant::now();
    let (st, _, v) = exchange(
        &s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Content-Type: application/json\r\nContent-Length: 99999999999999\r\n\r\n",
    );
    assert_openai_error(st, &v, 413);
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let chunk = format!("1000\r\n{}\r\n", "x".repeat(0x1000));
    let (st, _, v) = exchange(
        &s,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\
             Transfer-Encoding: chunked\r\n\r\n{chunk}{chunk}0\r\n\r\n"
        ),
    );
    assert_openai_error(st, &v, 413);
    let t0 = Instant::now();
    let (st, _, v) = exchange(
        &s,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Content-Length: 100\r\n\r\n{\"prompt\":",
    );
    assert_openai_error(st, &v, 408);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // Under the limit, on time: served.
    let (st, v, _) = post(&s, "/v1/completions", r#"{"prompt":[1,2],"max_tokens":1}"#);
    assert_eq!(st, 200, "{v}");
}

/// Open file descriptors of process `pid`.
fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

// More idle sockets than `--max-connections`, with the server's file descriptors nearly
// exhausted (its `ulimit -n` lowered to what it holds plus 24, as the hostile probe did
// with 200), do not stop a real request: at the cap the oldest idle connection is closed
// for the new one. And when every connection runs a request (its body still coming), a
// new one gets 503 with Retry-After (an OpenAI error object) at once. Catches a server
// without a cap (the idle sockets take every descriptor: accept fails and the real request
// hangs) and one whose cap refuses newcomers while idle sockets hold every place.
#[test]
fn idle_sockets_beyond_the_cap_do_not_stop_a_real_request() {
    let s = start(&["--max-connections", "4", "--header-timeout", "60"]);
    let pid = s.child.id();
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit reads the server's limit into `lim` (no new limit given).
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            std::ptr::null(),
            &mut lim,
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    // The soft limit only: the hard one stays (raising it back needs privileges).
    lim.rlim_cur = open_fds(pid) + 24;
    // SAFETY: prlimit with a valid pid, a valid rlimit and no old-limit pointer.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &lim,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    let mut idle: Vec<TcpStream> = (0..40).map(|_| connect(&s)).collect();
    for c in idle.iter_mut().step_by(2) {
        c.write_all(b"GET /health HTTP/1.1\r\n").unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    // On a raw socket with a read timeout: without the cap this is never accepted.
    let body = r#"{"prompt":[1,2],"max_tokens":1}"#;
    let (st, _, v) = exchange(
        &s,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    );
    assert_eq!(st, 200, "{v}");
    drop(idle);
    // Four requests each waiting for its body hold every place: the fifth is refused.
    let busy: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut c = connect(&s);
            c.write_all(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50\r\n\r\n",
            )
            .unwrap();
            c
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let (st, head, v) = exchange(&s, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    assert_openai_error(st, &v, 503);
    assert!(head.contains("retry-after: 1"), "{head}");
    drop(busy);
}

// A wrong method, too many header lines and a body over the limit are answered with
// OpenAI error objects (not axum's empty 405 or hyper's bare 431). Catches the plain
// responses they were.
#[test]
fn wrong_method_and_oversized_headers_get_openai_errors() {
    let s = start(&[]);
    let (st, _, v) = exchange(
        &s,
        "GET /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    );
    assert_openai_error(st, &v, 405);
    let many: String = (0..150).map(|i| format!("X-Filler-{i}: {i}\r\n")).collect();
    let (st, _, v) = exchange(
        &s,
        &format!("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n{many}\r\n"),
    );
    assert_openai_error(st, &v, 431);
    let big = format!("X-Big: {}\r\n", "b".repeat(40 * 1024));
    let (st, _, v) = exchange(
        &s,
        &format!("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n{big}\r\n"),
    );
    assert_openai_error(st, &v, 431);
}

/// A POST of a small tokenize request with these extra header lines; (status, body).
fn tokenize_with(s: &Server, host: &str, extra: &str) -> (u16, Value) {
    let body = json!({"content": "Hi"}).to_string();
    let (st, _, v) = exchange(
        s,
        &format!(
            "POST /tokenize HTTP/1.1\r\nHost: {host}\r\nContent-Type: text/plain\r\n{extra}\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    );
    (st, v)
}

// Browser requests (with Origin, or Sec-Fetch-*) are checked: another site's page (a
// text/plain POST needs no preflight), a `null` origin and a DNS-rebinding page (Host is
// the attacker's name) get a 403 OpenAI error; the served page's own origin, localhost
// pages and names given by --allow-host work; curl-like requests without Origin work
// whatever their Host. Catches a server without the check (any web page could start
// generations on localhost and, by rebinding, read the replies), and one whose check
// also refuses the SDKs or its own chat page.
#[test]
fn browser_requests_from_other_sites_are_refused_with_403() {
    let s = start(&["--allow-host", "k3.test"]);
    let own = addr(&s);
    let port = own.rsplit(':').next().unwrap().to_string();
    let refused = [
        (own.clone(), "Origin: http://evil.example\r\n".to_string()),
        (own.clone(), "Origin: null\r\n".into()),
        (
            own.clone(),
            format!("Origin: http://127.0.0.1.evil.example:{port}\r\n"),
        ),
        (
            format!("evil.example:{port}"),
            format!("Origin: http://evil.example:{port}\r\n"),
        ),
        (
            format!("evil.example:{port}"),
            "Sec-Fetch-Mode: cors\r\n".into(),
        ),
    ];
    for (host, extra) in &refused {
        let (st, v) = tokenize_with(&s, host, extra);
        assert_openai_error(st, &v, 403);
    }
    let allowed = [
        (own.clone(), format!("Origin: http://{own}\r\n")),
        (own.clone(), "Origin: http://localhost:3000\r\n".to_string()),
        (
            format!("localhost:{port}"),
            format!("Origin: http://localhost:{port}\r\n"),
        ),
        (
            format!("k3.test:{port}"),
            format!("Origin: http://k3.test:{port}\r\n"),
        ),
        (
            format!("[::1]:{port}"),
            "Sec-Fetch-Mode: navigate\r\n".into(),
        ),
        // curl, the SDKs: no Origin, whatever Host they name.
        (format!("evil.example:{port}"), String::new()),
    ];
    for (host, extra) in &allowed {
        let (st, v) = tokenize_with(&s, host, extra);
        assert_eq!(st, 200, "Host {host}, {extra:?}: {v}");
    }
}

// Values that were taken silently are refused with a 400 naming the field:
// `repetition_penalty: 0` (and `repeat_penalty`), a null or missing `content` outside an
// assistant message with tool calls, and a `parse_special` that is not a boolean. The
// assistant message with tool calls and null content still works. Catches the silent
// acceptance each had.
#[test]
fn silently_accepted_values_are_refused_naming_the_field() {
    let s = start(&[]);
    let user = json!([{"role": "user", "content": "Hi"}]);
    let cases = [
        (
            "/v1/chat/completions",
            json!({"messages": user, "max_tokens": 2, "repetition_penalty": 0}),
            "repetition_penalty",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2], "max_tokens": 2, "repeat_penalty": 0.0}),
            "repeat_penalty",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": null}], "max_tokens": 2}),
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user"}],
                   "max_tokens": 2}),
            "messages[1].content",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": null}], "max_tokens": 2}),
            "messages[1].content",
        ),
        (
            "/tokenize",
            json!({"content": "Hi", "parse_special": "yes"}),
            "parse_special",
        ),
    ];
    for (path, body, param) in &cases {
        let (st, v, _) = post(&s, path, &body.to_string());
        assert_eq!(st, 400, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], *param, "{path} {body}: {v}");
    }
    let calls = json!([{"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]);
    let (st, v, _) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": calls, "max_tokens": 2}).to_string(),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v, _) = post(&s, "/tokenize", r#"{"content":"Hi","parse_special":true}"#);
    assert_eq!(st, 200, "{v}");
}
