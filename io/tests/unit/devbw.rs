//! The drive-bandwidth probe (`src/devbw.rs`).

use k3_io::devbw::*;
use std::io::Write;

#[test]
fn measures_and_refuses_small_files() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("f");
    std::fs::File::create(&p)
        .unwrap()
        .write_all(&vec![7u8; 3 * 4096 + 100])
        .unwrap();
    let r = measure(&p, 8192, 2, 0.0).unwrap();
    assert_eq!(r.read_bytes, 8192);
    assert!(r.reads >= 2);
    assert_eq!(r.bytes, r.reads * 8192);
    assert!(measure(&p, 1 << 20, 1, 0.0).is_err());
    assert!(measure(&dir.path().join("missing"), 4096, 1, 0.0).is_err());
    assert!(render(&p, &[r]).contains("8192 B"));
}
