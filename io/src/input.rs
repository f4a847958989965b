//! Reading user-named input files with a stated size cap: regular files only (a FIFO, a
//! device or `/dev/zero` is refused up front instead of being read until memory runs out),
//! and at most `cap` bytes (checked against the file's size first, and again while
//! reading, in case it grows).

use std::fs::{File, FileType};
use std::io::{Error, ErrorKind, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// config.json, tokenizer_config.json, a safetensors index, `synth --shape FILE`,
/// trunk.json (the released files are a few hundred KB at most).
pub const JSON_CAP: u64 = 64 << 20;
/// tiktoken.model (the released one is ~2.8 MB for 163,584 ranks).
pub const TOKENIZER_CAP: u64 = 256 << 20;
/// `--prompt-file` and `tokenize --file`: 512 bytes for each of the 32,768 prompt tokens a
/// run accepts.
pub const PROMPT_CAP: u64 = 16 << 20;
/// An expert trace for `sim-cache` (8 bytes per routed expert request).
pub const TRACE_CAP: u64 = 8 << 30;

/// How the refusal of a file that is not a regular file begins ([`open_regular`],
/// [`read_capped`]).
pub const NOT_REGULAR: &str = "not a regular file";

/// What a file system node is, in words ("a FIFO", "a character device", ...).
pub fn kind_name(t: FileType) -> &'static str {
    if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

/// `path` opened for reading, refused (`InvalidInput`, naming what it is) unless it is a
/// regular file. The open never blocks: a FIFO with no writer would hang a plain open, so
/// it is opened with `O_NONBLOCK` (no effect on a regular file) and its type checked on the
/// opened descriptor.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let t = f.metadata()?.file_type();
    if !t.is_file() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{NOT_REGULAR} ({}; only regular files are read)",
                kind_name(t)
            ),
        ));
    }
    // Back to blocking reads (O_NONBLOCK has no effect on a regular file; cleared anyway).
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a descriptor this function owns; F_GETFL/F_SETFL take no pointers.
    unsafe {
        let fl = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(f.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK);
        }
    }
    Ok(f)
}

/// The bytes of `path`, refused unless it is a regular file of at most `cap` bytes.
pub fn read_capped(path: &Path, cap: u64) -> std::io::Result<Vec<u8>> {
    let m = std::fs::metadata(path)?;
    if !m.is_file() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{NOT_REGULAR} ({}; a device, FIFO or directory is not read)",
                kind_name(m.file_type())
            ),
        ));
    }
    if m.len() > cap {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{} bytes, more than the {cap}-byte limit for this kind of file",
                m.len()
            ),
        ));
    }
    let mut v = Vec::with_capacity(m.len() as usize);
    open_regular(path)?.take(cap + 1).read_to_end(&mut v)?;
    if v.len() as u64 > cap {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("grew past the {cap}-byte limit while being read"),
        ));
    }
    Ok(v)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_capped_string(path: &Path, cap: u64) -> std::io::Result<String> {
    String::from_utf8(read_capped(path, cap)?)
        .map_err(|_| Error::new(ErrorKind::InvalidData, "not UTF-8 text"))
}
