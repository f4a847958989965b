//! Helpers shared by the orchestrator's integration tests (`tools_*`, `hardening`,
//! `generate_cli`, `defaults_cli`, `budget_cli`, `serve_http`, `staged_stop_state`,
//! `streaming_cli`, `browser_chat`): run the built `k3-orch`, make the tiny chat model once
//! per test binary, read a safetensors header, find the fixtures and copy their models,
//! skip a privileged test visibly. The test modules (one binary, `tests/main.rs`) use them
//! through `crate::tools_common`.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The built `k3-orch`.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_k3-orch")
}

/// A command for the built `k3-orch`, to add arguments to.
pub fn k3_cmd() -> Command {
    Command::new(bin())
}

/// One `k3-orch synth --shape tiny-chat` model (weights and tokenizer) for every test in
/// this test binary, made on first use under Cargo's per-target scratch directory
/// (`CARGO_TARGET_TMPDIR`), named after the test binary: the next run of the binary
/// replaces it and `cargo clean` removes it. (It was `/tmp/k3-tiny-chat-<pid>`, 85 MB
/// left behind per binary and run.)
pub fn tiny_chat_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary's path");
        let name = exe.file_stem().and_then(|s| s.to_str()).unwrap_or("tests");
        let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("k3-tiny-chat-{name}"));
        let _ = std::fs::remove_dir_all(&d);
        let o = k3_cmd()
            .args(["synth", "--shape", "tiny-chat", d.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        d
    })
}

/// A test that cannot run here (no per-stage cgroups: not root) says so on the real stderr
/// (`SKIPPED:`, which .ci/run collects), and fails instead under
/// K3_REQUIRE_PRIVILEGED_TESTS=1 (CI, as root), as tests/e2e does.
pub fn skip(test: &str, why: &str) {
    if std::env::var("K3_REQUIRE_PRIVILEGED_TESTS").as_deref() == Ok("1") {
        panic!("{test} cannot run ({why}) and K3_REQUIRE_PRIVILEGED_TESTS=1");
    }
    let _ = writeln!(std::io::stderr(), "SKIPPED: {test}: {why}");
}

/// Exit code, stdout and stderr of `k3-orch <args>`.
pub fn k3(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_k3-orch"))
        .args(args)
        .output()
        .expect("run k3-orch");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Exit code and stdout followed by stderr of `k3-orch <args>`.
pub fn k3_text(args: &[&str]) -> (i32, String) {
    let (code, out, err) = k3(args);
    (code, format!("{out}{err}"))
}

/// Stdout followed by stderr of a finished command.
pub fn output_text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A JSON file, parsed (panics with the path when it is not).
pub fn read_json(p: &Path) -> serde_json::Value {
    let b = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_slice(&b).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Like [`k3`] but panics (with the output) unless the exit code is 0.
pub fn k3_ok(args: &[&str]) -> String {
    let (code, out, err) = k3(args);
    assert_eq!(
        code, 0,
        "k3-orch {args:?} failed\nstdout:\n{out}\nstderr:\n{err}"
    );
    out
}

/// The repository's `tests/fixtures`.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// `tests/fixtures/<rel>`.
pub fn fixture(rel: &str) -> PathBuf {
    fixtures().join(rel)
}

/// The sharded tiny-mxfp4 checkpoint (14 shards and their index).
pub fn tiny_sharded() -> PathBuf {
    fixtures().join("tiny-mxfp4/sharded")
}

/// A copy of the model files `names` of `src` in `to` (created), for a test that corrupts,
/// moves or adds to them.
pub fn copy_model_files(src: &Path, to: &Path, names: &[&str]) {
    std::fs::create_dir_all(to).unwrap_or_else(|e| panic!("{}: {e}", to.display()));
    for n in names {
        let (a, b) = (src.join(n), to.join(n));
        std::fs::copy(&a, &b).unwrap_or_else(|e| panic!("{} to {}: {e}", a.display(), b.display()));
    }
}

/// A copy of every file of the fixture model directory `src` in `to` (created).
pub fn copy_model(src: &Path, to: &Path) {
    let names: Vec<String> = std::fs::read_dir(src)
        .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    copy_model_files(src, to, &names);
}

/// The released 96-shard set as sparse header-only files in `to` (written by the model
/// crate's generator from k3-spec §2/§7, not by the code under test), with the released
/// config.
pub fn released_headers(to: &Path) -> k3_model::released::HeaderOnlySet {
    let set = k3_model::released::write_header_only_set(to).unwrap();
    copy_model_files(&fixtures().join("released"), to, &["config.json"]);
    set
}

/// Header length and parsed JSON of a safetensors file.
pub fn header(path: &Path) -> (u64, serde_json::Value) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let v = serde_json::from_slice(&bytes[8..8 + n as usize]).unwrap();
    (n, v)
}

/// Bytes of tensor `name` in the safetensors file `path`.
pub fn tensor_bytes(path: &Path, name: &str) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap();
    let (n, h) = header(path);
    let off = &h[name]["data_offsets"];
    let a = off[0].as_u64().unwrap() as usize + 8 + n as usize;
    let b = off[1].as_u64().unwrap() as usize + 8 + n as usize;
    bytes[a..b].to_vec()
}

/// Sorted `.safetensors` file names in `dir`.
pub fn shard_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    v.sort();
    v
}

/// Write a safetensors file with the given (name, dtype, shape, data offsets) entries and
/// `data_len` bytes of data (byte i = i % 251), header in the given order.
pub fn write_safetensors(
    path: &Path,
    entries: &[(&str, &str, Vec<usize>, [u64; 2])],
    data_len: usize,
) {
    let mut m = serde_json::Map::new();
    for (n, d, s, o) in entries {
        m.insert(
            n.to_string(),
            serde_json::json!({"dtype": d, "shape": s, "data_offsets": o}),
        );
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(m)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend((0..data_len).map(|i| (i % 251) as u8));
    std::fs::write(path, out).unwrap();
}
