//! The defaults a user expects of a one-shot run (issue 34): incremental decoding, nothing
//! written to the current directory, the tokenizer found in the model directory, the
//! release's `generation_config.json` as the default sampling (with the source of each
//! value in the report), `-m`/`-c` as llama.cpp spells them, and the usage code 2 for a
//! wrong `--tok` or a prompt over `--ctx-size`. On the tiny chat model, whose directory holds
//! its tokenizer files as the release does.

use std::path::Path;
use std::process::Command;

use crate::tools_common::{fixtures, k3_cmd, output_text, tiny_chat_model as model};
use serde_json::Value;

/// A run in `cwd` (a fresh directory, so a stray report would show); the command's output.
fn run_in(cwd: &Path, args: &[&str]) -> std::process::Output {
    k3_cmd()
        .current_dir(cwd)
        .args(args)
        .args(["--threads", "1"])
        .output()
        .unwrap()
}

fn report(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// A model directory that is the tiny chat model's files (links) plus `extra` files.
fn model_with(dir: &Path, extra: &[(&str, &str)]) -> String {
    let d = dir.join("model");
    std::fs::create_dir(&d).unwrap();
    for e in std::fs::read_dir(model()).unwrap().flatten() {
        std::os::unix::fs::symlink(e.path(), d.join(e.file_name())).unwrap();
    }
    for (name, text) in extra {
        std::fs::write(d.join(name), text).unwrap();
    }
    d.to_str().unwrap().to_string()
}

/// No `--tok`: the model directory's tokenizer; no `--out`: no file anywhere (the current
/// directory stays empty); no `--incremental`: incremental all the same.
#[test]
fn text_prompt_without_tok_or_out_writes_nothing_and_decodes_incrementally() {
    let m = model().to_str().unwrap();
    let cwd = tempfile::tempdir().unwrap();
    let o = run_in(cwd.path(), &[m, "-p", "Hello there", "-n", "4"]);
    assert!(o.status.success(), "{}", output_text(&o));
    assert!(!o.stdout.is_empty(), "the text streams to stdout");
    let left: Vec<_> = std::fs::read_dir(cwd.path()).unwrap().flatten().collect();
    assert!(
        left.is_empty(),
        "the run wrote {left:?} into the current directory"
    );
    // --out names the report, which says the run was incremental.
    let out = cwd.path().join("r.json");
    let o = run_in(
        cwd.path(),
        &[
            m,
            "--ids",
            "1,2,3",
            "-n",
            "3",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", output_text(&o));
    let r = report(&out);
    assert_eq!(r["incremental"], true, "{r}");
    // --full-recompute keeps the old mode, with the same ids.
    let out2 = cwd.path().join("full.json");
    let o = run_in(
        cwd.path(),
        &[
            m,
            "--ids",
            "1,2,3",
            "-n",
            "3",
            "--full-recompute",
            "--out",
            out2.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", output_text(&o));
    let r2 = report(&out2);
    assert_eq!(r2["incremental"], false);
    assert_eq!(r2["generated_ids"], r["generated_ids"]);
}

/// A `--tok` that is not a tokenizer directory, or whose files do not load, is a usage
/// error (exit 2), refused before anything starts; so is a model directory without the
/// files when a text prompt needs them.
#[test]
fn a_wrong_tok_exits_2() {
    let m = model().to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let o = run_in(dir.path(), &[m, "-p", "hi", "--tok", "/nonexistent/tok"]);
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    assert!(output_text(&o).contains("/nonexistent/tok"));
    // The files are there but not a tokenizer.
    let bad = dir.path().join("badtok");
    std::fs::create_dir(&bad).unwrap();
    std::fs::write(bad.join("tiktoken.model"), "not base64 ranks\n").unwrap();
    std::fs::write(bad.join("tokenizer_config.json"), "{").unwrap();
    let o = run_in(dir.path(), &[m, "-p", "hi", "--tok", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    // A model without tokenizer files and no --tok: a text prompt cannot run.
    let tiny = fixtures().join("tiny-mxfp4/sharded");
    let o = run_in(dir.path(), &[tiny.to_str().unwrap(), "-p", "hi"]);
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    assert!(output_text(&o).contains("--tok"), "{}", output_text(&o));
}

/// `-c/--ctx-size` refuses up front (exit 2) a prompt plus `--gen` over it, for text
/// prompts (counted after tokenizing) and ids alike; `-m` names the model.
#[test]
fn ctx_size_and_model_flags() {
    let m = model().to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let o = run_in(
        dir.path(),
        &["-m", m, "-p", "Hello there", "-n", "8", "-c", "4"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    assert!(
        output_text(&o).contains("--ctx-size 4"),
        "{}",
        output_text(&o)
    );
    let o = run_in(
        dir.path(),
        &["-m", m, "--ids", "1,2,3", "-n", "2", "-c", "4"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    let o = run_in(dir.path(), &["-m", m, "--ids", "1,2", "-n", "2", "-c", "4"]);
    assert!(o.status.success(), "{}", output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).starts_with("ids: "),
        "--ids without --tok stays ids in, ids out"
    );
}

/// The model directory's generation_config.json sets the sampling no flag sets, the run
/// says so, and the report's `sampling.sources` names where each value came from; a flag
/// wins (`--temp 0` is greedy).
#[test]
fn generation_config_sets_the_default_sampling() {
    let dir = tempfile::tempdir().unwrap();
    let m = model_with(
        dir.path(),
        &[(
            "generation_config.json",
            r#"{"eos_token_id": 163586, "temperature": 0.7, "top_k": 5}"#,
        )],
    );
    let out = dir.path().join("r.json");
    let o = run_in(
        dir.path(),
        &[
            &m,
            "--ids",
            "1,2,3",
            "-n",
            "3",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    let text = output_text(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("generation_config.json"), "{text}");
    let s = &report(&out)["sampling"];
    assert_eq!(s["mode"], "sample", "{s}");
    assert_eq!(s["top_k"], 5);
    assert_eq!(s["sources"]["temperature"], "generation_config", "{s}");
    assert_eq!(s["sources"]["top_k"], "generation_config");
    assert_eq!(s["sources"]["top_p"], "built-in");
    assert_eq!(s["sources"]["seed"], "built-in");
    let o = run_in(
        dir.path(),
        &[
            &m,
            "--ids",
            "1,2,3",
            "-n",
            "3",
            "--temp",
            "0",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", output_text(&o));
    let s = &report(&out)["sampling"];
    assert_eq!(s["mode"], "greedy", "{s}");
    assert_eq!(s["sources"]["temperature"], "flag");
    // A file k3 cannot use is refused up front, naming it.
    let bad = tempfile::tempdir().unwrap();
    let mb = model_with(bad.path(), &[("generation_config.json", r#"{"top_p": 7}"#)]);
    let o = run_in(bad.path(), &[&mb, "--ids", "1", "-n", "1"]);
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    assert!(output_text(&o).contains("top_p"), "{}", output_text(&o));
}

/// Every flag is in `--help`, and `chat --help` describes its sampling flags.
#[test]
fn help_lists_the_flags() {
    let o = Command::new(crate::tools_common::bin())
        .arg("--help")
        .output()
        .unwrap();
    let h = String::from_utf8_lossy(&o.stdout);
    for f in [
        "-m DIR",
        "--ctx-size N, -c N",
        "--full-recompute",
        "--thinking",
        "--n-predict",
        "generation_config.json",
        "project",
    ] {
        assert!(h.contains(f), "--help lacks {f}:\n{h}");
    }
    let o = Command::new(crate::tools_common::bin())
        .args(["chat", "--help"])
        .output()
        .unwrap();
    let h = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = h.lines().collect();
    for f in [
        "--top-k",
        "--top-p",
        "--min-p",
        "--repeat-penalty",
        "--seed",
    ] {
        let i = lines
            .iter()
            .position(|l| l.split_whitespace().any(|w| w.trim_end_matches(',') == f))
            .unwrap_or_else(|| panic!("chat --help lacks {f}:\n{h}"));
        // The description follows the flag and its <VALUE>, on its line or the next.
        let same = lines[i].split('>').nth(1).unwrap_or("").trim();
        let next = lines.get(i + 1).map_or("", |l| l.trim());
        let desc = if same.is_empty() && !next.starts_with('-') {
            next
        } else {
            same
        };
        assert!(
            desc.split_whitespace().count() >= 4,
            "chat --help does not describe {f}: {desc:?}\n{h}"
        );
    }
}
