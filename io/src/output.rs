//! Writing user-named output files (reports, dumped logits, traces) so that a reader never
//! sees half a file, and so that an output path never replaces something that is not a
//! plain file.
//!
//! [`write_atomic`]: when the target is absent, or a regular file with one link, the bytes
//! go to a fresh temporary file in the target's own directory (`tempfile`: a random name
//! created with `O_CREAT|O_EXCL`, mode 0600, never a predictable `<name>.tmp` that another
//! user could plant a symlink at), are fsynced, and the temporary is renamed over the target.
//! Anything else (a device such as `/dev/null`, a FIFO, a symlink such as `/dev/stdout`, a
//! hard-linked file) is opened as it is, without creating it, and written in place: renaming
//! over it would replace the device or the link with a regular file (as root, `--out
//! /dev/null` used to replace the machine's `/dev/null`). A directory is refused.

use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Write `bytes` to `path` (see the module documentation for what "write" means for each
/// kind of target).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => replace(path, bytes),
        Err(e) => Err(e),
        Ok(m) if m.file_type().is_file() && m.nlink() == 1 => replace(path, bytes),
        Ok(m) if m.is_dir() => Err(io::Error::new(
            io::ErrorKind::IsADirectory,
            "is a directory",
        )),
        Ok(_) => in_place(path, bytes),
    }
}

/// Temporary file in the same directory, fsync, rename over `path`, fsync the directory.
fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Open the existing target (following a symlink, never creating) and write it in place.
fn in_place(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
    // A regular file behind a symlink or with several links is truncated and rewritten; a
    // device or FIFO is simply written.
    if f.metadata()?.file_type().is_file() {
        f.set_len(0)?;
    }
    f.write_all(bytes)?;
    f.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
