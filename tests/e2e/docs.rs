//! Docs that cannot go stale: every path and every Rust name that `docs/architecture.md`
//! puts in backticks exists in the project, every path the README puts in backticks too,
//! and the orchestrator's crate doc names each of its modules.
//!
//! The rules, for a backticked span outside code blocks:
//! - a path (it has a `/`, or ends in `.rs`, `.md`, `.toml`, `.json` or `.sh`) exists on
//!   disk, as a file or directory of the project whose path ends with it (`cli/mod.rs`,
//!   `kernels/`); `{a,b}` alternatives each, a `*` in a name at least once; nothing outside
//!   the project (`../`) exists for a clone (absolute paths are the machine's, not
//!   checked);
//! - a Rust name (`run_layer`, `Model::step`, `ComputeConf.prefill_chunk`,
//!   `k3_model::trunk::layer_parts_of`, `LayerReady{handle}`) is defined in the workspace's
//!   `.rs` files: its last segment as an item (`fn`, `struct`, `enum`, `trait`, `type`,
//!   `const`, `static`, `mod`, a module file, a crate), an enum variant or a field, or
//!   else inside a string literal (tensor names, environment variables); every other
//!   segment as a module (a `mod`, a module file or directory, a crate) when it is
//!   lower-case, as a defined name when it is not; every name in a `{..}`/`(..)` payload as
//!   a defined name. Comments do not count: a renamed function whose old name lives on in
//!   a comment still fails;
//! - a crate (`k3-io`) is a workspace member's package;
//! - anything else (a flag, a command line, an expression) is not checked.

use crate::scan;
use std::collections::HashSet;
use std::path::Path;

/// What the workspace defines and holds.
struct Index {
    /// Every file and directory of the project, relative, `/`-separated; directories end
    /// with `/`.
    paths: Vec<String>,
    /// Names defined as items, variants or fields, module files and crates.
    defined: HashSet<String>,
    /// Modules: `mod` names, module files and directories, crates.
    modules: HashSet<String>,
    /// Every identifier-like word inside a string literal.
    in_strings: HashSet<String>,
    /// The members' package names (`k3-io`).
    packages: HashSet<String>,
}

fn idents(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'))
}

/// Names lexed code defines (items after their keyword, an enum variant `Name {`,
/// `Name(`, `Name,`, a field `name: Type`) into `out`, its `mod` names into `mods`.
fn definitions(code: &str, out: &mut HashSet<String>, mods: &mut HashSet<String>) {
    const KEYWORDS: [&str; 10] = [
        "fn",
        "struct",
        "enum",
        "trait",
        "type",
        "const",
        "static",
        "mod",
        "union",
        "macro_rules!",
    ];
    let toks: Vec<&str> = code
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '!'))
        .filter(|t| !t.is_empty())
        .collect();
    for w in toks.windows(2) {
        if KEYWORDS.contains(&w[0]) {
            out.insert(w[1].trim_end_matches('!').to_string());
        }
        if w[0] == "mod" {
            mods.insert(w[1].to_string());
        }
    }
    for line in code.lines() {
        let mut l = line.trim_start();
        if let Some(rest) = l.strip_prefix("pub") {
            l = rest.trim_start();
            if l.starts_with('(') {
                l = l[l.find(')').map_or(l.len(), |p| p + 1)..].trim_start();
            }
        }
        let name: String = l
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            continue;
        }
        let rest = l[name.len()..].trim_start();
        let variant = name.starts_with(|c: char| c.is_ascii_uppercase())
            && (rest.is_empty() || rest.starts_with(['{', '(', ',', '=']));
        let field = name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && rest.starts_with(':')
            && !rest.starts_with("::");
        if variant || field {
            out.insert(name);
        }
    }
}

fn index() -> Index {
    let root = scan::root();
    let mut paths = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name();
            if name == "target" || name == ".git" {
                continue;
            }
            let rel = scan::rel(&p);
            if p.is_dir() {
                paths.push(format!("{rel}/"));
                stack.push(p);
            } else {
                paths.push(rel);
            }
        }
    }
    let (mut defined, mut modules, mut in_strings, mut packages) = (
        HashSet::new(),
        HashSet::new(),
        HashSet::new(),
        HashSet::new(),
    );
    for p in &paths {
        // A module's file or directory defines it.
        let name = Path::new(p.trim_end_matches('/')).file_stem().unwrap();
        modules.insert(name.to_string_lossy().to_string());
        // This file's own examples of stale names are not definitions.
        if !p.ends_with(".rs") || p == "tests/e2e/docs.rs" {
            continue;
        }
        let text = std::fs::read_to_string(root.join(p)).unwrap();
        let lx = scan::lex(&text);
        definitions(&lx.code, &mut defined, &mut modules);
        for s in &lx.strings {
            in_strings.extend(idents(s).map(str::to_string));
        }
    }
    for member in scan::members() {
        let manifest = std::fs::read_to_string(root.join(&member).join("Cargo.toml")).unwrap();
        if let Some(name) = manifest
            .lines()
            .find_map(|l| l.strip_prefix("name = \""))
            .and_then(|l| l.strip_suffix('"'))
        {
            modules.insert(name.replace('-', "_"));
            packages.insert(name.to_string());
        }
    }
    defined.extend(modules.iter().cloned());
    Index {
        paths,
        defined,
        modules,
        in_strings,
        packages,
    }
}

/// The backticked spans of a markdown text, outside fenced code blocks.
fn code_spans(md: &str) -> Vec<String> {
    let mut prose = String::new();
    let mut fenced = false;
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            prose.push_str(line);
            prose.push('\n');
        }
    }
    prose
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|s| s.replace('\n', " ").trim().to_string())
        .collect()
}

/// `a/{x,y}.rs` as `a/x.rs`, `a/y.rs`.
fn expand_braces(p: &str) -> Vec<String> {
    match (p.find('{'), p.find('}')) {
        (Some(o), Some(c)) if o < c => p[o + 1..c]
            .split(',')
            .flat_map(|alt| expand_braces(&format!("{}{}{}", &p[..o], alt.trim(), &p[c + 1..])))
            .collect(),
        _ => vec![p.to_string()],
    }
}

/// Whether `name` matches `pattern`, where `*` is any run of characters.
fn glob(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || !name.ends_with(last) || name.len() < first.len() + last.len() {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// A path of the project: `/`-separated or a file name with a project extension; an
/// absolute or home path (`/proc/meminfo`, `~/k3model`) or a chat command (`/save`) is not
/// one.
fn is_path(span: &str) -> bool {
    !span.contains(char::is_whitespace)
        && !span.starts_with(['/', '~'])
        && !span.contains("::")
        && (span.contains('/')
            || [".rs", ".md", ".toml", ".json", ".sh"]
                .iter()
                .any(|x| span.ends_with(x)))
}

/// Why a path span names nothing in the project (None: it exists).
fn path_problem(ix: &Index, span: &str) -> Option<String> {
    if span.starts_with("../") {
        return Some("is outside the project (a clone does not have it)".into());
    }
    let span = span.strip_prefix("./").unwrap_or(span);
    for p in expand_braces(span) {
        let dir = p.ends_with('/');
        let found = ix.paths.iter().any(|have| {
            if have.ends_with('/') != dir {
                return false;
            }
            // A suffix of whole path segments.
            let segs = p.trim_end_matches('/').split('/').count();
            let tail: Vec<&str> = have.trim_end_matches('/').rsplit('/').take(segs).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            let want: Vec<&str> = p.trim_end_matches('/').split('/').collect();
            tail.len() == want.len() && tail.iter().zip(&want).all(|(h, w)| glob(w, h))
        });
        if !found {
            return Some(format!("{p}: no such file or directory in the project"));
        }
    }
    None
}

/// A Rust name: segments joined by `::` or `.`, maybe with a `{..}` or `(..)` payload.
/// None when the span is not one (a flag, a command, an expression).
fn rust_name(span: &str) -> Option<(Vec<&str>, Vec<&str>)> {
    let (head, payload) = match span.find(['{', '(']) {
        Some(i) if span.ends_with(['}', ')']) => (&span[..i], &span[i + 1..span.len() - 1]),
        Some(_) => return None,
        None => (span, ""),
    };
    let segs: Vec<&str> = head.split("::").flat_map(|s| s.split('.')).collect();
    let ok_seg = |s: &&str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '*')
            && !s.starts_with(|c: char| c.is_ascii_digit())
    };
    if head.is_empty() || !segs.iter().all(ok_seg) {
        return None;
    }
    let payload_ok = payload
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ',' || c == ' ');
    if !payload_ok {
        return None;
    }
    Some((segs, idents(payload).collect()))
}

/// A crate's package name: `k3-` and lower-case words.
fn is_crate(span: &str) -> bool {
    span.strip_prefix("k3-").is_some_and(|r| {
        !r.is_empty()
            && r.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    })
}

/// Why a Rust name span names nothing in the workspace (None: it exists).
fn name_problem(ix: &Index, segs: &[&str], payload: &[&str]) -> Option<String> {
    let known = |s: &str| ix.defined.contains(s) || ix.in_strings.contains(s);
    let (last, path) = segs.split_last().expect("at least one segment");
    if !last.contains('*') && !known(last) {
        return Some(format!("{last} is not defined in any .rs file"));
    }
    let lower = |s: &str| s.starts_with(|c: char| c.is_ascii_lowercase() || c == '_');
    for s in path.iter().filter(|s| !s.contains('*')) {
        if lower(s) && !ix.modules.contains(*s) {
            return Some(format!("{s} is not a module"));
        }
        if !lower(s) && !ix.defined.contains(*s) {
            return Some(format!("{s} is not defined in any .rs file"));
        }
    }
    if let Some(p) = payload.iter().find(|p| !known(p)) {
        return Some(format!("{p} is not defined in any .rs file"));
    }
    None
}

/// Every problem of a markdown text: `(span, why)`; `names`: check Rust names too.
fn problems(ix: &Index, md: &str, names: bool) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for span in code_spans(md) {
        let why = if is_path(&span) {
            path_problem(ix, &span)
        } else if let (true, Some((segs, payload))) = (names, rust_name(&span)) {
            name_problem(ix, &segs, &payload)
        } else if names && is_crate(&span) {
            (!ix.packages.contains(&span)).then(|| "is not a package of the workspace".into())
        } else {
            None
        };
        if let Some(w) = why {
            out.push((span, w));
        }
    }
    out
}

fn report(doc: &str, p: &[(String, String)]) -> String {
    let lines: Vec<String> = p.iter().map(|(s, w)| format!("  `{s}`: {w}")).collect();
    format!(
        "{doc} names what the project does not have (fix the doc, or the name):\n{}",
        lines.join("\n")
    )
}

#[test]
fn architecture_names_only_what_exists() {
    let ix = index();
    let md = std::fs::read_to_string(scan::root().join("docs/architecture.md")).unwrap();
    // The check must see the doc's names (an empty parse would pass everything).
    let spans = code_spans(&md);
    assert!(spans.len() > 200, "only {} spans", spans.len());
    assert!(spans.iter().filter(|s| rust_name(s).is_some()).count() > 100);
    let p = problems(&ix, &md, true);
    assert!(p.is_empty(), "{}", report("docs/architecture.md", &p));
}

#[test]
fn readme_paths_exist() {
    let ix = index();
    let md = std::fs::read_to_string(scan::root().join("README.md")).unwrap();
    assert!(code_spans(&md).iter().filter(|s| is_path(s)).count() > 10);
    let p = problems(&ix, &md, false);
    assert!(p.is_empty(), "{}", report("README.md", &p));
}

/// `orchestrator/src/lib.rs` lists the modules, top to bottom: each `pub mod` is named
/// there as a link (it once left out `serve`).
#[test]
fn the_orchestrator_doc_names_every_module() {
    let text = std::fs::read_to_string(scan::root().join("orchestrator/src/lib.rs")).unwrap();
    let doc: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join("\n");
    let mods: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod ")?.strip_suffix(';'))
        .collect();
    assert!(mods.len() >= 6, "{mods:?}");
    for m in mods {
        assert!(
            doc.contains(&format!("[`{m}`]")),
            "orchestrator/src/lib.rs: the crate doc does not name module `{m}`"
        );
    }
}

/// The rules catch what a stale doc says: a name that is gone, one that lives on only in
/// comments, a path outside the project or not there, a payload field that is not one.
#[test]
fn the_rules_catch_stale_names() {
    let ix = index();
    let stale = "the `moe_forward_announced` call, `run::census::census`, \
                 `../shared/docs/design.md`, `orchestrator/src/nowhere.rs`, `modules/{kda,nope}.rs`, \
                 `LayerReady{no_such_field}`, `Model::no_such_method`, `k3-nowhere`";
    let p = problems(&ix, stale, true);
    let spans: Vec<&str> = p.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(
        spans,
        [
            "moe_forward_announced",
            "run::census::census",
            "../shared/docs/design.md",
            "orchestrator/src/nowhere.rs",
            "modules/{kda,nope}.rs",
            "LayerReady{no_such_field}",
            "Model::no_such_method",
            "k3-nowhere",
        ]
    );
    let fine = "`run_layer`, `Model::step`, `k3_model::trunk::layer_parts_of`, \
                `ComputeConf.prefill_chunk`, `LayerReady{handle}`, `cli/mod.rs`, `kernels/`, \
                `modules/{kda,mla}.rs`, `modules/*.rs`, `K3_FLOOR`, `--inproc`, \
                `k3-orch stage <name>`, `{region, offset, len, generation}`, `k3-io`, `k3-orch`";
    assert_eq!(problems(&ix, fine, true), Vec::<(String, String)>::new());
}

/// No doc of the project points outside it: a clone has no `../shared/` (the design notes
/// the project was built from) and no sibling checkout, so a link or path there is dead
/// (issue 34). Every Markdown file outside `target/` and `.git/`, links and plain text.
#[test]
fn no_doc_points_outside_the_project() {
    let root = scan::root();
    let mut stack = vec![root.clone()];
    let mut docs = 0;
    let mut bad = Vec::new();
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name();
            if name == "target" || name == ".git" {
                continue;
            }
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "md") {
                continue;
            }
            docs += 1;
            let text = std::fs::read_to_string(&p).unwrap();
            for (i, line) in text.lines().enumerate() {
                let outside = line.contains("../shared/")
                    || line.contains("/work/shared")
                    || line
                        .split("](")
                        .skip(1)
                        .any(|t| escapes(&root, &p, t.split([')', '#']).next().unwrap_or("")));
                if outside {
                    bad.push(format!("{}:{}: {}", scan::rel(&p), i + 1, line.trim()));
                }
            }
        }
    }
    assert!(docs >= 8, "only {docs} Markdown files found");
    assert!(
        bad.is_empty(),
        "docs point outside the project:\n{}",
        bad.join("\n")
    );
}

/// Whether a relative link `target` in the file `doc` leads out of `root` (lexically).
fn escapes(root: &Path, doc: &Path, target: &str) -> bool {
    if target.contains("://") || target.starts_with('/') || target.is_empty() {
        return false;
    }
    let mut depth = doc
        .parent()
        .unwrap()
        .strip_prefix(root)
        .map_or(0, |d| d.components().count() as i64);
    for part in target.split('/') {
        match part {
            ".." => depth -= 1,
            "." | "" => {}
            _ => depth += 1,
        }
        if depth < 0 {
            return true;
        }
    }
    false
}
