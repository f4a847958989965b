//! A small Rust lexer and function finder for the checks on the sources themselves (no
//! function over the length limit, docs that name only what exists): it tells code from
//! comments and literals, so that a brace or a name inside a string, a char literal or a
//! comment never counts. Not a parser: it needs only braces, brackets and the `fn`, `mod`
//! and `#[cfg(test)]` tokens to be where the code has them.

#![allow(dead_code)] // each test module uses part of it

use std::ops::Range;
use std::path::{Path, PathBuf};

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A source file split into code and literals.
pub struct Lexed {
    /// The source with every comment and literal (string, raw string, byte string, char)
    /// blanked to spaces, newlines kept: offsets and line numbers are the source's.
    pub code: String,
    /// The text of every string literal, as written (escapes not undone).
    pub strings: Vec<String>,
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80
}

/// Blank `s[from..to]` into `out`, newlines kept.
fn blank(out: &mut Vec<u8>, s: &[u8], from: usize, to: usize) {
    out.extend(
        s[from..to]
            .iter()
            .map(|&b| if b == b'\n' { b'\n' } else { b' ' }),
    );
}

/// The end of a raw string whose `r` is at `i` (`r"…"`, `r#"…"#`), or None when `i` does
/// not start one (a raw identifier `r#type`, or plain code).
fn raw_string_end(s: &[u8], i: usize) -> Option<(usize, usize)> {
    let mut j = i + 1;
    while j < s.len() && s[j] == b'#' {
        j += 1;
    }
    if s.get(j) != Some(&b'"') {
        return None;
    }
    let hashes = j - i - 1;
    let body = j + 1;
    let mut k = body;
    while k < s.len() {
        if s[k] == b'"'
            && s[k + 1..]
                .iter()
                .take(hashes)
                .filter(|&&c| c == b'#')
                .count()
                == hashes
        {
            return Some((body, k));
        }
        k += 1;
    }
    Some((body, s.len()))
}

/// The end (exclusive) of a quoted string whose opening quote is at `i`.
fn string_end(s: &[u8], i: usize) -> usize {
    let mut k = i + 1;
    while k < s.len() {
        match s[k] {
            b'\\' => k += 2,
            b'"' => return k + 1,
            _ => k += 1,
        }
    }
    s.len()
}

/// The end (exclusive) of a char literal whose quote is at `i`, or None for a lifetime or
/// a label (`'a`, `'outer:`).
fn char_end(s: &[u8], i: usize) -> Option<usize> {
    let mut k = i + 1;
    match *s.get(k)? {
        b'\\' => {
            k += 1;
            if s.get(k) == Some(&b'u') {
                while k < s.len() && s[k] != b'}' {
                    k += 1;
                }
            }
            k += 1;
        }
        b => {
            // One UTF-8 character.
            k += match b {
                0xf0.. => 4,
                0xe0.. => 3,
                0xc0.. => 2,
                _ => 1,
            };
        }
    }
    (s.get(k) == Some(&b'\'')).then_some(k + 1)
}

/// Split `src` into code and literals.
pub fn lex(src: &str) -> Lexed {
    let s = src.as_bytes();
    let mut code = Vec::with_capacity(s.len());
    let mut strings = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let prev_ident = i > 0 && is_ident(s[i - 1]);
        let b = s[i];
        if s[i..].starts_with(b"//") {
            let end = s[i..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(s.len(), |p| i + p);
            blank(&mut code, s, i, end);
            i = end;
        } else if s[i..].starts_with(b"/*") {
            let (mut depth, mut k) = (0usize, i);
            while k < s.len() {
                if s[k..].starts_with(b"/*") {
                    depth += 1;
                    k += 2;
                } else if s[k..].starts_with(b"*/") {
                    depth -= 1;
                    k += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    k += 1;
                }
            }
            blank(&mut code, s, i, k);
            i = k;
        } else if !prev_ident && (b == b'r' || (b == b'b' && s.get(i + 1) == Some(&b'r'))) {
            let r = if b == b'r' { i } else { i + 1 };
            match raw_string_end(s, r) {
                Some((body, close)) => {
                    strings.push(String::from_utf8_lossy(&s[body..close]).into_owned());
                    let end = (close + 1 + (body - r - 2)).min(s.len());
                    blank(&mut code, s, i, end);
                    i = end;
                }
                None => {
                    code.push(b);
                    i += 1;
                }
            }
        } else if b == b'"' || (!prev_ident && b == b'b' && s.get(i + 1) == Some(&b'"')) {
            let q = if b == b'"' { i } else { i + 1 };
            let end = string_end(s, q);
            strings.push(String::from_utf8_lossy(&s[q + 1..end.saturating_sub(1)]).into_owned());
            blank(&mut code, s, i, end);
            i = end;
        } else if b == b'\'' {
            match char_end(s, i) {
                Some(end) => {
                    blank(&mut code, s, i, end);
                    i = end;
                }
                None => {
                    code.push(b);
                    i += 1;
                }
            }
        } else {
            code.push(b);
            i += 1;
        }
    }
    Lexed {
        code: String::from_utf8(code).expect("blanking keeps UTF-8"),
        strings,
    }
}

/// The offset of the `}` matching the `{` at `open` in lexed code.
pub fn matching_brace(code: &[u8], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, &c) in code.iter().enumerate().skip(open) {
        match c {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
    }
    None
}

/// From `from`, the first `{` or `;` outside parentheses and brackets (an item's body or
/// its end: `fn f() -> [u8; 4] {` opens at the brace).
fn body_or_end(code: &[u8], from: usize) -> Option<(usize, u8)> {
    let mut depth = 0i32;
    for (k, &c) in code.iter().enumerate().skip(from) {
        match c {
            b'(' | b'[' => depth += 1,
            b')' | b']' => depth -= 1,
            b'{' | b';' if depth <= 0 => return Some((k, c)),
            _ => {}
        }
    }
    None
}

/// The identifier starting at `i` (empty when none does).
fn ident_at(code: &[u8], i: usize) -> &str {
    let n = code[i..].iter().take_while(|&&c| is_ident(c)).count();
    std::str::from_utf8(&code[i..i + n]).unwrap_or("")
}

/// Offsets of the keyword `word` as a whole token in lexed code.
fn keyword_at(code: &[u8], word: &str) -> Vec<usize> {
    let w = word.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(p) = code[i..].windows(w.len()).position(|x| x == w) {
        let at = i + p;
        let before = at == 0 || !is_ident(code[at - 1]);
        let after = code.get(at + w.len()).is_none_or(|&c| !is_ident(c));
        if before && after {
            out.push(at);
        }
        i = at + w.len();
    }
    out
}

/// Byte ranges of the items under `#[cfg(test)]` (a test module, a test-only function),
/// attribute included. An out-of-line `#[cfg(test)] mod tests;` excludes only its line.
pub fn test_only(code: &str) -> Vec<Range<usize>> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(p) = code[i..].find("#[cfg(test)]") {
        let at = i + p;
        let mut k = at + "#[cfg(test)]".len();
        // Further attributes on the same item.
        loop {
            while k < b.len() && b[k].is_ascii_whitespace() {
                k += 1;
            }
            if b[k..].starts_with(b"#[") {
                let close = b[k..]
                    .iter()
                    .position(|&c| c == b']')
                    .map_or(b.len(), |q| k + q);
                k = close + 1;
            } else {
                break;
            }
        }
        let end = match body_or_end(b, k) {
            Some((open, b'{')) => matching_brace(b, open).map_or(b.len(), |c| c + 1),
            Some((semi, _)) => semi + 1,
            None => b.len(),
        };
        out.push(at..end);
        i = end;
    }
    out
}

/// One function with a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FnSpan {
    pub name: String,
    /// 1-based line of `fn`.
    pub line: usize,
    /// Lines from the `fn` line to the closing brace's, both included.
    pub lines: usize,
    /// Byte offset of `fn`.
    pub at: usize,
}

fn line_of(code: &str, at: usize) -> usize {
    code[..at].bytes().filter(|&c| c == b'\n').count() + 1
}

/// Every function with a body in lexed code (nested ones too; a declaration without a body
/// and a `fn(..)` pointer type are not functions here).
pub fn functions(code: &str) -> Vec<FnSpan> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    for at in keyword_at(b, "fn") {
        let mut k = at + 2;
        while k < b.len() && b[k].is_ascii_whitespace() {
            k += 1;
        }
        let name = ident_at(b, k);
        if name.is_empty() {
            continue;
        }
        let Some((open, b'{')) = body_or_end(b, k + name.len()) else {
            continue;
        };
        let Some(close) = matching_brace(b, open) else {
            continue;
        };
        let line = line_of(code, at);
        out.push(FnSpan {
            name: name.to_string(),
            line,
            lines: line_of(code, close) - line + 1,
            at,
        });
    }
    out
}

/// Every function of a source text outside `#[cfg(test)]` items.
pub fn non_test_functions(src: &str) -> Vec<FnSpan> {
    let lx = lex(src);
    let tests = test_only(&lx.code);
    functions(&lx.code)
        .into_iter()
        .filter(|f| !tests.iter().any(|r| r.contains(&f.at)))
        .collect()
}

/// The workspace's member directories, from the root Cargo.toml.
pub fn members() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let start = text.find("members = [").expect("a members list");
    let list = &text[start..start + text[start..].find(']').unwrap()];
    list.split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// Every `.rs` file under `dir`, sorted, skipping `target`.
pub fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target" && n != ".git") {
                    stack.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// `p` relative to the workspace root, with `/`.
pub fn rel(p: &Path) -> String {
    let root = root().canonicalize().unwrap();
    let p = p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    p.strip_prefix(&root)
        .unwrap_or(&p)
        .to_string_lossy()
        .replace('\\', "/")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(src: &str) -> Vec<(String, usize)> {
        non_test_functions(src)
            .into_iter()
            .map(|f| (f.name, f.lines))
            .collect()
    }

    #[test]
    fn braces_in_literals_and_comments_do_not_count() {
        let src = r####"
fn a() {
    let s = "}}} {";
    let r = r#"}" { "#;
    let rr = r##"a "# } "##;
    let b = b"}";
    let c = '}';
    let d = '{';
    let e = b'}';
    let q = '"';
    let esc = '\'';
    let uni = '\u{7d}';
    // } a comment {
    /* } /* nested { */ } */
}
fn b<'a>(x: &'a str) -> &'a str {
    'outer: loop {
        break 'outer;
    }
    x
}
"####;
        assert_eq!(
            names(src),
            vec![("a".to_string(), 14), ("b".to_string(), 6)]
        );
        let lx = lex(src);
        assert!(lx.strings.iter().any(|s| s == "}}} {"));
        assert!(lx.strings.iter().any(|s| s == "}\" { "));
        assert!(!lx.code.contains("nested"));
        assert_eq!(lx.code.len(), src.len());
    }

    #[test]
    fn signatures_declarations_and_pointers() {
        let src =
            "trait T { fn decl(&self) -> [u8; 4]; fn with_body(&self) -> [u8; 4] { [0; 4] } }\n\
                   fn takes(f: fn(u8) -> u8) -> u8 where u8: Copy {\n f(1)\n}\n\
                   fn outer() {\n fn inner() {\n }\n}\n\
                   let r#type = 1; fn after_raw_ident() {}\n";
        assert_eq!(
            names(src),
            vec![
                ("with_body".to_string(), 1),
                ("takes".to_string(), 3),
                ("outer".to_string(), 4),
                ("inner".to_string(), 2),
                ("after_raw_ident".to_string(), 1),
            ]
        );
    }

    #[test]
    fn test_modules_and_test_functions_are_left_out() {
        let src = "fn kept() {}\n\
                   #[cfg(test)]\n#[allow(unused)]\nmod tests {\n fn helper() { let s = \"}\"; }\n #[test]\n fn t() {}\n}\n\
                   #[cfg(test)]\nfn test_only_helper() {}\n\
                   fn also_kept() {\n}\n";
        assert_eq!(
            names(src),
            vec![("kept".to_string(), 1), ("also_kept".to_string(), 2)]
        );
    }
}
