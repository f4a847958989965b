//! Aligned O_DIRECT reads on a temporary file: odd offsets and lengths, windows that run
//! past EOF, reads past EOF, zero-copy window reads, and the buffered path.

use k3_io::window::{window, AlignedBuf, DirectFile, ReadMode, ALIGN};
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

/// Odd offsets and lengths, in both modes, give exactly the file's bytes. An
/// implementation that returned the window start instead of the payload, or that demanded
/// the whole last window be inside the file, fails here.
#[test]
fn odd_offsets_and_lengths() {
    let d = tempfile::tempdir().unwrap();
    let size = 3 * 4096 + 123;
    let (p, data) = make_file(d.path(), size);
    let direct = DirectFile::open(&p).unwrap();
    let buffered = DirectFile::open_buffered(&p).unwrap();
    assert_eq!(direct.len(), size as u64);
    assert_eq!(buffered.mode(), ReadMode::Buffered);
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
    let mut scratch = AlignedBuf::new(4096);
    for &(off, len) in cases {
        for f in [&direct, &buffered] {
            let mut out = vec![0xEEu8; len];
            let mode = f.read_at_with(off as u64, &mut out, &mut scratch).unwrap();
            assert_eq!(
                out,
                &data[off..off + len],
                "off {off} len {len} mode {mode:?}"
            );
            let mut out2 = vec![0u8; len];
            f.read_at(off as u64, &mut out2).unwrap();
            assert_eq!(out2, out);
        }
    }
    // Whichever mode served the reads, the file said which (Direct on filesystems that
    // accept O_DIRECT, like ext4/xfs; Buffered on ones that refuse it).
    eprintln!("O_DIRECT on {}: {:?}", p.display(), direct.mode());
}

/// Reading past EOF is an error naming the file, even when the window would be partly
/// inside the file.
#[test]
fn past_eof_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    let size = 2 * 4096 + 10;
    let (p, _) = make_file(d.path(), size);
    for f in [
        DirectFile::open(&p).unwrap(),
        DirectFile::open_buffered(&p).unwrap(),
    ] {
        let mut out = vec![0u8; 11];
        let e = f.read_at(size as u64 - 10, &mut out).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
        assert!(e.to_string().contains("data.bin"), "{e}");
        let mut out = vec![0u8; 1];
        let e = f.read_at(size as u64 + 5000, &mut out).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
    }
}

/// Zero-copy window reads: payload offset inside the aligned buffer, misaligned or short
/// buffers refused.
#[test]
fn window_into_caller_buffer() {
    let d = tempfile::tempdir().unwrap();
    let size = 5 * 4096 + 1;
    let (p, data) = make_file(d.path(), size);
    let f = DirectFile::open(&p).unwrap();
    let mut buf = AlignedBuf::new(3 * 4096);
    let r = f
        .read_window_into(4096 + 100, 8000, buf.as_mut_slice())
        .unwrap();
    assert_eq!(r.payload_offset, 100);
    assert_eq!(r.bytes_read, 8192);
    assert_eq!(&buf.as_slice()[100..8100], &data[4196..12_196]);
    // Last window past EOF: only 1 byte of the final block exists.
    let r = f
        .read_window_into(size as u64 - 1, 1, buf.as_mut_slice())
        .unwrap();
    assert_eq!((r.payload_offset, r.bytes_read), (0, 1));
    assert_eq!(buf.as_slice()[0], data[size - 1]);
    // Misaligned buffer.
    let e = f
        .read_window_into(0, 10, &mut buf.as_mut_slice()[1..])
        .unwrap_err();
    assert!(e.to_string().contains("not 4096-aligned"), "{e}");
    // Too small for the window.
    let e = f
        .read_window_into(4000, 200, &mut buf.as_mut_slice()[..4096])
        .unwrap_err();
    assert!(e.to_string().contains("window needs 8192"), "{e}");
    assert_eq!(ALIGN, 4096);
}

/// On tmpfs (/dev/shm), O_DIRECT may be refused; either way the bytes are right and the
/// mode is reported.
#[test]
fn tmpfs_falls_back_or_works() {
    let Ok(d) = tempfile::tempdir_in("/dev/shm") else {
        return;
    };
    let (p, data) = make_file(d.path(), 10_000);
    let f = DirectFile::open(&p).unwrap();
    let mut out = vec![0u8; 5000];
    let mode = f.read_at(3333, &mut out).unwrap();
    assert_eq!(out, &data[3333..8333]);
    assert_eq!(mode, f.mode());
    eprintln!("O_DIRECT on /dev/shm: {mode:?}");
}
