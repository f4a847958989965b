//! The tiktoken vocabulary file (`src/vocab.rs`): lookups, errors naming the line.

use std::path::Path;

use base64::Engine as _;
use k3_tokenizer::vocab::*;

fn file(extra: &str) -> String {
    let mut s = String::new();
    for b in 0..=255u8 {
        s.push_str(&format!(
            "{} {}\n",
            base64::engine::general_purpose::STANDARD.encode([b]),
            b
        ));
    }
    s + extra
}

fn err(s: &str) -> String {
    match Vocab::parse(s.as_bytes(), Path::new("t.model")) {
        Ok(_) => "ok".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn good_file_and_lookups() {
    let v = Vocab::parse(file("YWI= 256\r\n\n").as_bytes(), Path::new("x")).unwrap();
    assert_eq!(v.len(), 257);
    assert_eq!(v.get(b"ab"), Some(256));
    assert_eq!(v.get(b"ba"), None);
    assert_eq!(v.bytes(256), Some(&b"ab"[..]));
}

#[test]
fn errors_name_the_line() {
    assert_eq!(
        err(&file("YWI=256\n")),
        "t.model:257: expected '<base64 token> <rank>', got \"YWI=256\""
    );
    assert!(err(&file("YWI= x\n")).starts_with("t.model:257: rank \"x\""));
    assert!(err(&file("!!! 256\n")).starts_with("t.model:257: token \"!!!\" is not valid base64"));
    assert!(err(&file("YWI= 300\n")).starts_with("t.model:257: rank 300 out of range"));
    assert_eq!(
        err(&file("YWI= 5\n")),
        "t.model:257: rank 5 already given on line 6"
    );
    assert!(
        err(&file("AA== 256\n")).starts_with("t.model:257: ranks 0 and 256 have the same bytes")
    );
    assert!(err("AA== 0\n").contains("no rank for the single byte 0x01"));
    assert_eq!(err(""), "t.model: no ranks");
}
