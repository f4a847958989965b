//! User files read with a cap (`src/input.rs`): devices, FIFOs and oversize files refused.

use std::path::Path;

use k3_io::input::*;

/// `/dev/zero` and a FIFO are refused at once (the old plain read never returned from
/// /dev/zero); a file over the cap is refused with its size; one within it is read.
#[test]
fn devices_fifos_and_oversize_files_are_refused() {
    let e = read_capped(Path::new("/dev/zero"), 1 << 20).unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates a file system node.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    assert!(read_capped(&fifo, 1 << 20).is_err());
    let f = d.path().join("f");
    std::fs::write(&f, vec![7u8; 100]).unwrap();
    let e = read_capped(&f, 99).unwrap_err();
    assert!(e.to_string().contains("100 bytes"), "{e}");
    assert_eq!(read_capped(&f, 100).unwrap(), vec![7u8; 100]);
    assert!(read_capped_string(&f, 100).is_ok());
}
