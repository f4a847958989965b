//! libFuzzer target: any text as config.json must give a config or an error listing
//! problems, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Err(e) = k3_model::config::ModelConfig::from_json_str(&text) {
        assert!(!e.problems.is_empty());
    }
});
