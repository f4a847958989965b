//! [`Spread`]: identical files (copies of the packed trunk on several drives) read as one,
//! each piece from the next copy, a failing copy read around.

use std::sync::{Arc, Mutex};

use k3_io::direct::{read_parallel, READ_CHUNK};
use k3_io::{MemFile as Mem, ReadAt, Spread};

/// Every piece accepted.
fn none(_: usize, _: &[u8]) -> Result<(), std::convert::Infallible> {
    Ok(())
}

/// Files in memory that log which file each read went to.
struct Files(Vec<Mem>, Mutex<Vec<(u32, u64)>>);

impl ReadAt for Files {
    fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> std::io::Result<usize> {
        self.1.lock().unwrap().push((file, offset));
        self.0[file as usize].read_at(0, offset, dst)
    }
}

// Copies of the trunk (`--trunk DIR,COPY`): a span's READ_CHUNK pieces alternate over
// the copies, each landing in place. Catches every piece read from the first copy (no
// spread), a piece asked of a file that is not there, and a piece read at the wrong
// offset.
#[test]
fn copies_share_a_units_pieces() {
    let len = 3 * READ_CHUNK + 12_345;
    let a: Vec<u8> = (0..len).map(|i| (i / 4096) as u8).collect();
    let files = Arc::new(Files(
        vec![Mem(a.clone()), Mem(a.clone())],
        Mutex::new(Vec::new()),
    ));
    let spread = Spread::new(files.clone(), 2, "copy");
    // Through the trait object the loader holds (an `Arc` forwards every method).
    let held: Arc<dyn ReadAt> = Arc::new(Spread::new(files.clone(), 2, "copy"));
    assert_eq!(
        held.copies(),
        2,
        "an Arc<dyn ReadAt> answered for the copies"
    );
    let mut dst = vec![0u8; len];
    let got = read_parallel(&spread, 0, 0, &mut dst, &none).unwrap();
    assert_eq!(got, len);
    assert!(dst == a, "the pieces did not land in place");
    let mut log = files.1.lock().unwrap().clone();
    log.sort_by_key(|&(_, o)| o);
    let chunk = READ_CHUNK as u64;
    assert_eq!(
        log,
        vec![(0, 0), (1, chunk), (0, 2 * chunk), (1, 3 * chunk)],
        "pieces by copy"
    );
}

/// A copy whose reads all fail.
struct Dead;

impl ReadAt for Dead {
    fn read_at(&self, _: u32, _: u64, _: &mut [u8]) -> std::io::Result<usize> {
        Err(std::io::Error::other("EIO"))
    }
}

/// Copy 0 in memory, copy 1 the given reader.
struct Pair(Mem, Box<dyn ReadAt>);

impl ReadAt for Pair {
    fn read_at(&self, file: u32, offset: u64, dst: &mut [u8]) -> std::io::Result<usize> {
        match file {
            0 => self.0.read_at(0, offset, dst),
            _ => self.1.read_at(0, offset, dst),
        }
    }
}

// A copy that fails (every read an I/O error) or lost its tail (a file cut short) is
// read around: every piece comes whole from the other copy. Both failing is an error.
// Catches a failing copy's error passed on while another holds the bytes, a short
// copy's count taken as the file's end, and a piece left holding the short copy's
// bytes after the other copy was read.
#[test]
fn a_failing_or_short_copy_is_read_around() {
    let len = 3 * READ_CHUNK + 12_345;
    let a: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let short = Mem(a[..READ_CHUNK + 100].to_vec());
    for (what, other) in [
        ("a dead copy", Box::new(Dead) as Box<dyn ReadAt>),
        ("a short copy", Box::new(short)),
    ] {
        let spread = Spread::new(Arc::new(Pair(Mem(a.clone()), other)), 2, "copy");
        let mut dst = vec![0u8; len];
        let got = read_parallel(&spread, 0, 0, &mut dst, &none).unwrap();
        assert_eq!(got, len, "{what}");
        assert!(dst == a, "{what}: wrong bytes");
    }
    let both = Spread::new(Arc::new(Dead), 2, "copy");
    let mut dst = vec![0u8; 4096];
    assert!(both.read_at(0, READ_CHUNK as u64, &mut dst).is_err());
}
