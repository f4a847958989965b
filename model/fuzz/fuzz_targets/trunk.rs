//! libFuzzer target: any text as trunk.json (raw or coded) must give a manifest or an
//! error listing problems, never a panic; an accepted manifest has no problems.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match k3_model::trunk::TrunkManifest::from_json_str(&text) {
        Ok(m) => assert!(m.problems().is_empty()),
        Err(e) => assert!(!e.problems.is_empty()),
    }
});
