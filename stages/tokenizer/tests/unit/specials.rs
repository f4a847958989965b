//! The special tokens' config (`src/specials.rs`): its layout and its errors.

use std::path::Path;

use k3_tokenizer::specials::*;

fn err(json: &str) -> String {
    match Specials::parse_config(json.as_bytes(), 1000, Path::new("c.json")) {
        Ok(_) => "ok".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn config_layout_and_errors() {
    let s = Specials::parse_config(
        br#"{"added_tokens_decoder": {"1000": {"content": "[BOS]"}, "1002": {"content": "<|end_of_msg|>"}}}"#,
        1000,
        Path::new("c.json"),
    )
    .unwrap();
    assert_eq!(s.name(1000), Some("[BOS]"));
    assert_eq!(s.name(1001), Some("<|reserved_token_1001|>"));
    assert_eq!(s.name(1255), Some("<|reserved_token_1255|>"));
    assert_eq!(s.name(1256), None);
    assert_eq!(s.id("<|end_of_msg|>"), Some(1002));
    assert!(err("{").starts_with("c.json: not valid JSON"));
    assert_eq!(err("{}"), "c.json: no \"added_tokens_decoder\" object");
    assert!(
        err(r#"{"added_tokens_decoder": {"163584": {"content": "[BOS]"}}}"#)
            .contains("id 163584 (\"[BOS]\") is outside the special slots 1000..1256")
    );
    assert!(err(r#"{"added_tokens_decoder": {"x": {"content": "a"}}}"#)
        .contains("key \"x\" is not a token id"));
    assert!(err(r#"{"added_tokens_decoder": {"1000": {}}}"#).contains("no \"content\" string"));
    assert!(err(
        r#"{"added_tokens_decoder": {"1000": {"content": "a"}, "1001": {"content": "a"}}}"#
    )
    .contains("used by ids 1000 and 1001"));
    assert!(
        err(r#"{"added_tokens_decoder": {"1000": {"content": "<|reserved_token_1001|>"}}}"#)
            .contains("used by ids")
    );
}
