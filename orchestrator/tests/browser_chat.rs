//! The chat page (`GET /`) in a real browser: Debian's `chromium` driven through
//! `chromedriver` (package `chromium-driver`) over WebDriver with fantoccini. The test types
//! a message, waits for the streamed reply, checks it equals the non-streamed greedy reply
//! for the same prompt over plain HTTP, checks the page shows per-stage memory from
//! `/metrics`, and saves a screenshot under `target/tmp/`.
//!
//! Without chromium or chromedriver it prints a visible `SKIPPED:` line and passes, unless
//! `K3_REQUIRE_BROWSER_TESTS=1` (set by `.ci/run` after installing them), which makes a
//! missing browser a failure.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::tools_common::{bin, tiny_chat_model};
use serde_json::{json, Value};

/// A child process killed when dropped.
struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn find(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for n in names {
        for d in std::env::split_paths(&path).chain([
            PathBuf::from("/usr/bin"),
            PathBuf::from("/usr/lib/chromium"),
        ]) {
            let p = d.join(n);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_server(model: &Path) -> (Kill, String) {
    let m = model.to_str().unwrap();
    let mut child = Command::new(bin())
        .args(["serve", m, "--tok", m, "--port", "0", "--threads", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = format!(
        "http://{}",
        line.trim().rsplit("http://").next().unwrap_or_default()
    );
    let t0 = Instant::now();
    while ureq::get(&format!("{base}/health"))
        .call()
        .map(|r| r.status())
        .unwrap_or(0)
        != 200
    {
        assert!(t0.elapsed() < Duration::from_secs(30), "server never ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    (Kill(child), base)
}

#[test]
fn the_chat_page_streams_the_greedy_reply_in_a_real_browser() {
    let required = std::env::var("K3_REQUIRE_BROWSER_TESTS").as_deref() == Ok("1");
    let (Some(chromium), Some(driver)) = (
        find(&["chromium", "chromium-browser"]),
        find(&["chromedriver"]),
    ) else {
        let why = "chromium and chromedriver are not installed (apt-get install chromium chromium-driver)";
        if required {
            panic!("K3_REQUIRE_BROWSER_TESTS=1 but {why}");
        }
        eprintln!("SKIPPED: browser_chat: {why}");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_server, base) = start_server(tiny_chat_model());

    let port = free_port();
    let _driver = Kill(
        Command::new(&driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let wd = format!("http://127.0.0.1:{port}");
    let t0 = Instant::now();
    while ureq::get(&format!("{wd}/status")).call().is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "chromedriver never answered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let prompt = "Hello, who are you?";
    let profile = dir.path().join("profile");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (reply, stats, png) = rt.block_on(async {
        use fantoccini::{ClientBuilder, Locator};
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1000,700",
                         format!("--user-data-dir={}", profile.display())],
            }),
        );
        let c = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&wd)
            .await
            .expect("a WebDriver session");
        c.goto(&format!("{base}/")).await.unwrap();
        let input = c.find(Locator::Css("#input")).await.unwrap();
        input.send_keys(prompt).await.unwrap();
        c.find(Locator::Css("#send"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        // The reply is done when the page marks it so (after the stream's [DONE]).
        let t0 = Instant::now();
        loop {
            let done = c
                .execute(
                    "const e = document.getElementById('reply-1'); return e ? (e.dataset.done || '') : '';",
                    vec![],
                )
                .await
                .unwrap();
            if done.as_str() == Some("1") {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "no streamed reply within 60 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let reply = c
            .execute(
                "const e = document.getElementById('reply-1'); return [e.className, e.textContent];",
                vec![],
            )
            .await
            .unwrap();
        // The stats line is refreshed after each reply (from /metrics).
        let t0 = Instant::now();
        let stats = loop {
            let s = c
                .find(Locator::Css("#stats"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            if s.contains("layer-compute") || t0.elapsed() > Duration::from_secs(10) {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let png = c.screenshot().await.unwrap();
        c.close().await.unwrap();
        (reply, stats, png)
    });
    let class = reply[0].as_str().unwrap_or_default().to_string();
    let text = reply[1].as_str().unwrap_or_default().to_string();
    assert_eq!(class, "msg assistant", "the page shows an error: {text}");
    assert!(!text.is_empty(), "empty streamed reply");
    // The same prompt, not streamed, over HTTP: greedy, so the same text.
    let v: Value = ureq::post(&format!("{base}/v1/chat/completions"))
        .send_json(json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 64}))
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"].as_str().unwrap(),
        text,
        "the browser's streamed reply must equal the non-streamed greedy reply"
    );
    assert!(
        stats.contains("ready") && stats.contains("layer-compute"),
        "the page shows per-stage memory: {stats}"
    );
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chat-page.png");
    std::fs::write(&shot, &png).unwrap();
    assert!(png.starts_with(b"\x89PNG"), "not a PNG screenshot");
    eprintln!("browser_chat: screenshot at {}", shot.display());
}
