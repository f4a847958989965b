//! The one reader on a temporary file: unaligned offsets and lengths widened to aligned
//! windows (O_DIRECT where allowed), windows that run past EOF, reads past EOF, and the
//! buffered path.

use k3_io::{window, DirectFiles, OwnedArena};
use std::path::Path;

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 7 + 3) % 251) as u8).collect()
}

fn make_file(dir: &Path, n: usize) -> (std::path::PathBuf, Vec<u8>) {
    let p = dir.join("data.bin");
    let data = pattern(n);
    std::fs::write(&p, &data).unwrap();
    (p, data)
}

#[test]
fn window_math() {
    assert_eq!(window(0, 0), Some((0, 0)));
    assert_eq!(window(1, 1), Some((0, 4096)));
    assert_eq!(window(4095, 2), Some((0, 8192)));
    assert_eq!(window(4096, 4096), Some((4096, 4096)));
    assert_eq!(window(5000, 10_000), Some((4096, 12_288)));
    assert_eq!(window(u64::MAX - 10, 100), None);
}

/// Odd offsets and lengths, with O_DIRECT and buffered, give exactly the file's bytes. An
/// implementation that returned the window start instead of the payload, or that demanded
/// the whole last window be inside the file, fails here.
#[test]
fn odd_offsets_and_lengths() {
    let d = tempfile::tempdir().unwrap();
    let size = 3 * 4096 + 123;
    let (p, data) = make_file(d.path(), size);
    let direct = DirectFiles::open(std::slice::from_ref(&p)).unwrap();
    let buffered = DirectFiles::open(std::slice::from_ref(&p)).unwrap();
    buffered.disable_direct();
    let cases: &[(usize, usize)] = &[
        (0, 1),
        (1, 4095),
        (4095, 2),
        (17, 9000),
        (4096, 4096),
        (size - 1, 1),       // last byte: window runs past EOF
        (size - 123, 123),   // the tail after the last full block
        (5000, size - 5000), // up to EOF exactly
        (777, 0),
        (0, size),
    ];
    let mut scratch: Option<OwnedArena> = None;
    for &(off, len) in cases {
        for f in [&direct, &buffered] {
            let mut out = vec![0xEEu8; len];
            f.read_exact_unaligned(0, off as u64, &mut out, &mut scratch)
                .unwrap();
            assert_eq!(out, &data[off..off + len], "off {off} len {len}");
        }
    }
    assert_eq!(buffered.direct_reads(), 0);
    // Whichever mode served the reads, the reader says which (O_DIRECT on filesystems that
    // accept it, like ext4/xfs; buffered on ones that refuse it).
    eprintln!(
        "O_DIRECT on {}: {} direct, {} buffered reads",
        p.display(),
        direct.direct_reads(),
        direct.buffered_reads()
    );
}

/// Reading past EOF is an error naming the file, even when the window would be partly
/// inside the file.
#[test]
fn past_eof_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    let size = 2 * 4096 + 10;
    let (p, _) = make_file(d.path(), size);
    let f = DirectFiles::open(std::slice::from_ref(&p)).unwrap();
    let mut scratch = None;
    let mut out = vec![0u8; 11];
    let e = f
        .read_exact_unaligned(0, size as u64 - 10, &mut out, &mut scratch)
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
    assert!(e.to_string().contains("data.bin"), "{e}");
    let mut out = vec![0u8; 1];
    let e = f
        .read_exact_unaligned(0, size as u64 + 5000, &mut out, &mut scratch)
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
}

/// On tmpfs (/dev/shm), O_DIRECT may be refused; either way the bytes are right.
#[test]
fn tmpfs_falls_back_or_works() {
    let Ok(d) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("SKIPPED: tmpfs_falls_back_or_works: no /dev/shm");
        return;
    };
    let (p, data) = make_file(d.path(), 10_000);
    let f = DirectFiles::open(std::slice::from_ref(&p)).unwrap();
    let mut out = vec![0u8; 5000];
    f.read_exact_unaligned(0, 3333, &mut out, &mut None)
        .unwrap();
    assert_eq!(out, &data[3333..8333]);
}
