//! The SIGBUS message of a shard that shrank under its mapping (`src/mapfault.rs`).

use k3_model::mapfault::*;

#[test]
fn the_message_names_the_file_and_the_offset() {
    let mut buf = [0u8; 4096];
    let n = message(&mut buf, b"/m/model-00003.safetensors", 1_234_567);
    assert_eq!(
        std::str::from_utf8(&buf[..n]).unwrap(),
        "k3-orch: /m/model-00003.safetensors: the file shrank while it was mapped \
         (SIGBUS at byte 1234567): a shard was truncated or rewritten during the run\n"
    );
    let mut small = [0u8; 12];
    assert_eq!(message(&mut small, b"x", 0), 12);
}
