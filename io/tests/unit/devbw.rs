//! The drive-bandwidth probe (`src/devbw.rs`).

use k3_io::devbw::*;
use std::io::Write;

/// A file of three pages and 100 bytes in `dir`.
fn three_pages_and_a_bit(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("f");
    std::fs::File::create(&p)
        .unwrap()
        .write_all(&vec![7u8; 3 * 4096 + 100])
        .unwrap();
    p
}

#[test]
fn measures_and_refuses_small_files() {
    let dir = tempfile::tempdir().unwrap();
    let p = three_pages_and_a_bit(dir.path());
    let r = measure(&p, 8192, 2, 0.0).unwrap();
    assert_eq!(r.read_bytes, 8192);
    assert!(r.reads >= 2);
    assert_eq!(r.bytes, r.reads * 8192);
    assert!(measure(&p, 1 << 20, 1, 0.0).is_err());
    assert!(measure(&dir.path().join("missing"), 4096, 1, 0.0).is_err());
    assert!(render(&p, &[r]).contains("8192 B"));
}

/// `direct_bytes_per_s` cuts its reads to the file's whole pages (a 1 MiB read of a file of
/// three pages measures 12 KiB reads instead of refusing), refuses a file under one page,
/// and reports O_DIRECT refused rather than measuring the page cache. Catches a probe that
/// passes the stage's read size through (TooSmall on any small trunk) or that returns a
/// buffered rate as the drive's.
#[test]
fn the_direct_rate_fits_its_reads_to_the_file() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempfile::tempdir().unwrap();
    let p = three_pages_and_a_bit(dir.path());
    let direct = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
        .is_ok();
    match direct_bytes_per_s(&p, 1 << 20, 2, 0.0) {
        Ok(bps) => assert!(direct && bps > 0.0, "{bps}"),
        Err(DevbwError::NotDirect { .. }) => assert!(!direct, "O_DIRECT opens here"),
        Err(e) => panic!("{e}"),
    }
    let small = dir.path().join("small");
    std::fs::write(&small, [1u8; 100]).unwrap();
    let e = direct_bytes_per_s(&small, 1 << 20, 1, 0.0).unwrap_err();
    assert!(matches!(e, DevbwError::TooSmall { size: 100, .. }), "{e}");
}
