//! libFuzzer target: the trunk codec's chunk decoder on any stored bytes, for a declared
//! output size taken from the first two bytes, must fail with a message or fill exactly
//! its slot, never panic or write past it (the slot sits between guard bytes).
#![no_main]

use k3_model::codec::{decode, Codec};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((n, stored)) = data.split_first_chunk::<2>() else {
        return;
    };
    let n = u16::from_le_bytes(*n) as usize;
    let mut buf = vec![0xA5u8; n + 128];
    if let Err(e) = decode(Codec::Bf16Zstd, stored, &mut buf[64..64 + n]) {
        assert!(!e.to_string().is_empty());
    }
    assert!(buf[..64].iter().chain(&buf[64 + n..]).all(|&b| b == 0xA5));
});
