//! The tokenizer (`src/tokenizer.rs`): Python's `isspace`, Kimi's run guard.

use k3_tokenizer::tokenizer::*;

#[test]
fn isspace_matches_python_list() {
    // The list Python 3 prints for [c for c in range(0x110000) if chr(c).isspace()].
    let py: Vec<u32> = vec![
        0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000, 0x2001,
        0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028, 0x2029,
        0x202f, 0x205f, 0x3000,
    ];
    let ours: Vec<u32> = (0..0x11_0000u32)
        .filter(|&c| char::from_u32(c).is_some_and(py_isspace))
        .collect();
    assert_eq!(ours, py);
}

#[test]
fn split_runs_cuts_like_kimi() {
    let mut parts = Vec::new();
    split_runs("aaaaa  bbbbbbb", 3, |p| parts.push(p.to_string()));
    // Expected from tools/tokenizer/kimi_pat.py::_split_ws_runs (the Python guard).
    assert_eq!(parts, ["aaa", "aa  bbb", "bbb", "b"]);
    let mut parts = Vec::new();
    split_runs("", 3, |p| parts.push(p.to_string()));
    assert_eq!(parts, [""]);
}
