//! The import rules of docs/architecture.md, checked on the sources themselves:
//! - no stage crate depends on another stage crate (normal, dev or build dependencies);
//! - `k3-protocol`, `k3-model` and `k3-io` depend on no stage and not on the orchestrator;
//!   `k3-model` only on `k3-io` (it reads files through it), `k3-io` on no k3 crate;
//! - inside the orchestrator, imports only go down: `cli -> serve -> tools -> run ->
//!   supervise`.
//!
//! A stage that reached into another (the trunk-loader once imported the expert-fetcher's
//! arena and reader) or a `supervise` module calling back into `run` fails here.
//!
//! And no function of the workspace's sources is longer than [`MAX_FN_LINES`] outside the
//! kernels, the tests, the examples and `#[cfg(test)]` items (issue 31), but for the ones
//! [`LONG_FN_ALLOWLIST`] names.

use crate::scan;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `k3-*` crate a Cargo.toml names as a dependency, in any dependency section.
fn k3_deps(manifest: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(manifest).unwrap();
    let mut in_deps = false;
    let mut out = Vec::new();
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            in_deps = l.contains("dependencies");
            continue;
        }
        if in_deps && l.starts_with("k3-") {
            let name = l.split(['.', ' ', '=']).next().unwrap().to_string();
            out.push(name);
        }
    }
    out
}

const STAGES: [&str; 4] = [
    "k3-tokenizer",
    "k3-trunk-loader",
    "k3-expert-fetcher",
    "k3-layer-compute",
];

#[test]
fn crates_import_only_downward() {
    let r = root();
    for (dir, name) in [
        ("stages/tokenizer", "k3-tokenizer"),
        ("stages/trunk-loader", "k3-trunk-loader"),
        ("stages/expert-fetcher", "k3-expert-fetcher"),
        ("stages/layer-compute", "k3-layer-compute"),
    ] {
        let deps = k3_deps(&r.join(dir).join("Cargo.toml"));
        for d in &deps {
            assert!(
                !STAGES.contains(&d.as_str()) && d != "k3-orch",
                "{name} depends on {d}: stages meet only through k3-protocol"
            );
        }
    }
    for (dir, allowed) in [
        ("protocol", &["k3-model", "k3-io"][..]),
        ("model", &["k3-io"][..]),
        ("io", &[][..]),
    ] {
        let deps = k3_deps(&r.join(dir).join("Cargo.toml"));
        for d in &deps {
            assert!(
                allowed.contains(&d.as_str()),
                "{dir} depends on {d}; allowed: {allowed:?}"
            );
        }
    }
    // The check itself must see dependencies (an empty parse would pass everything).
    assert!(k3_deps(&r.join("protocol/Cargo.toml")).contains(&"k3-model".to_string()));
    assert!(k3_deps(&r.join("orchestrator/Cargo.toml")).len() >= 6);
}

/// `crate::<module>` paths used by the files under `orchestrator/src/<dir>`.
fn crate_paths(dir: &str) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let base = root().join("orchestrator/src").join(dir);
    let mut stack = vec![base];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                for (i, _) in text.match_indices("crate::") {
                    let rest = &text[i + "crate::".len()..];
                    let m: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    out.push((p.clone(), m));
                }
            }
        }
    }
    out
}

#[test]
fn orchestrator_modules_import_only_downward() {
    for (dir, forbidden) in [
        ("supervise", &["run", "tools", "cli"][..]),
        ("run", &["tools", "cli"][..]),
        ("tools", &["cli", "serve"][..]),
        ("serve", &["cli"][..]),
    ] {
        let paths = crate_paths(dir);
        assert!(!paths.is_empty(), "{dir}: no crate:: paths seen");
        for (file, m) in paths {
            assert!(
                !forbidden.contains(&m.as_str()),
                "{} imports crate::{m}: {dir} may not import {forbidden:?}",
                file.display()
            );
        }
    }
}

/// The longest a function may be, from its `fn` line to its closing brace.
const MAX_FN_LINES: usize = 120;

/// Functions allowed over [`MAX_FN_LINES`], as `(file, function)`: none. The list only
/// shrinks: an entry whose function is no longer over the limit fails the test too.
const LONG_FN_ALLOWLIST: &[(&str, &str)] = &[];

/// Whether a source file is held to the limit: under a member's `src/`, not a kernel.
fn held_to_the_limit(rel: &str) -> bool {
    !rel.split('/')
        .any(|d| matches!(d, "kernels" | "tests" | "examples" | "benches"))
}

#[test]
fn no_function_is_longer_than_the_limit() {
    let mut long = Vec::new();
    let mut seen = 0;
    for member in scan::members() {
        for file in scan::rust_files(&root().join(&member).join("src")) {
            let rel = scan::rel(&file);
            if !held_to_the_limit(&rel) {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            for f in scan::non_test_functions(&text) {
                seen += 1;
                if f.lines > MAX_FN_LINES {
                    long.push((rel.clone(), f.name, f.line, f.lines));
                }
            }
        }
    }
    // The scan itself must see the workspace (an empty walk would pass everything).
    assert!(seen > 1000, "only {seen} functions seen");
    let over: Vec<String> = long
        .iter()
        .filter(|(file, name, ..)| !LONG_FN_ALLOWLIST.contains(&(file.as_str(), name.as_str())))
        .map(|(file, name, line, n)| format!("{file}:{line} {name}: {n} lines"))
        .collect();
    assert!(
        over.is_empty(),
        "functions over {MAX_FN_LINES} lines (split them where the code divides):\n{}",
        over.join("\n")
    );
    let stale: Vec<String> = LONG_FN_ALLOWLIST
        .iter()
        .filter(|(file, name)| !long.iter().any(|(f, n, ..)| f == file && n == name))
        .map(|(file, name)| format!("{file} {name}"))
        .collect();
    assert!(
        stale.is_empty(),
        "LONG_FN_ALLOWLIST names functions no longer over {MAX_FN_LINES} lines; remove them:\n{}",
        stale.join("\n")
    );
}
