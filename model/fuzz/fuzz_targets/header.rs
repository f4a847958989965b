//! libFuzzer target: any bytes as a whole safetensors file must give a shard or an error
//! from `check_safetensors_bytes`, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = k3_model::catalog::check_safetensors_bytes(
        std::path::Path::new("fuzz.safetensors"),
        data,
    );
});
