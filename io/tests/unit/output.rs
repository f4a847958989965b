//! Writing user files (`src/output.rs`): plain files replaced atomically, links and devices
//! written in place.

use std::path::Path;

use k3_io::output::*;
use std::os::unix::fs::FileTypeExt;

/// A new file, then a replaced one; no temporary is left behind.
#[test]
fn plain_files_are_replaced_atomically() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("r.json");
    write_atomic(&p, b"one").unwrap();
    write_atomic(&p, b"two").unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), b"two");
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
}

/// A symlink stays a symlink (its target is written), a hard link stays shared, a device
/// stays a device. Failed before: each was replaced by a regular file.
#[test]
fn links_and_devices_are_written_in_place() {
    let d = tempfile::tempdir().unwrap();
    let target = d.path().join("target");
    std::fs::write(&target, b"old contents, longer").unwrap();
    let link = d.path().join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    write_atomic(&link, b"via link").unwrap();
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read(&target).unwrap(), b"via link");

    let hard = d.path().join("hard");
    std::fs::hard_link(&target, &hard).unwrap();
    write_atomic(&hard, b"via hard link").unwrap();
    assert_eq!(std::fs::read(&target).unwrap(), b"via hard link");

    let null = Path::new("/dev/null");
    write_atomic(null, b"x").unwrap();
    assert!(std::fs::metadata(null)
        .unwrap()
        .file_type()
        .is_char_device());

    // A dangling symlink is not followed into creating a file.
    let dangling = d.path().join("dangling");
    std::os::unix::fs::symlink(d.path().join("nowhere"), &dangling).unwrap();
    assert!(write_atomic(&dangling, b"x").is_err());
    assert!(!d.path().join("nowhere").exists());

    assert!(write_atomic(d.path(), b"x").is_err());
}
