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
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::input::kind_name;

/// Why `path` cannot take an output file, in words, checked before any work is done (a
/// run refuses it up front instead of failing, or hanging, after generating):
///
/// - an empty path, a directory, a missing directory;
/// - a dangling symbolic link (its target is never created) or a symbolic link loop;
/// - a socket or a block device;
/// - a FIFO (opening it for writing waits for a reader, forever if none comes), unless it
///   is this process's own stdout or stderr;
/// - a file of the kernel's pseudo file systems (`/proc`, `/sys`, cgroups), which takes no
///   report (`/proc/self/status`).
///
/// A regular file (or a symlink or hard link to one), a missing file in an existing
/// directory, a character device (`/dev/null`, a terminal) and the process's own stdout or
/// stderr (`/dev/stdout` piped into another program) are accepted.
pub fn check_target(path: &Path) -> Result<(), String> {
    const LOOP: &str = "a symbolic link loop";
    if path.as_os_str().is_empty() {
        return Err("an empty path".into());
    }
    let lm = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(LOOP.into()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            return match std::fs::metadata(dir) {
                Ok(m) if m.is_dir() => Ok(()),
                Ok(m) => Err(format!("{} is {}", dir.display(), kind_name(m.file_type()))),
                Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Err(LOOP.into()),
                Err(_) => Err(format!("the directory {} does not exist", dir.display())),
            };
        }
        Err(e) => return Err(e.to_string()),
    };
    let m = if lm.file_type().is_symlink() {
        match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(LOOP.into()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(
                    "a dangling symbolic link (its target does not exist, and an \
                            output never creates it)"
                        .into(),
                )
            }
            Err(e) => return Err(e.to_string()),
        }
    } else {
        lm
    };
    let t = m.file_type();
    if t.is_dir() {
        return Err("is a directory".into());
    }
    if t.is_socket() || t.is_block_device() {
        return Err(format!("{} (an output must be a file)", kind_name(t)));
    }
    if t.is_fifo() && !is_own_stdio(&m) {
        // Opening it for writing waits for a reader (forever, if none comes); probing with
        // a non-blocking open would hand a waiting reader an end of file.
        return Err(
            "a FIFO (an output must be a file or a device; opening a FIFO waits for \
                    a reader)"
                .into(),
        );
    }
    if t.is_file() && pseudo_fs(path) {
        return Err(
            "a file of the kernel's pseudo file systems (/proc, /sys), not an \
                    output file"
                .into(),
        );
    }
    Ok(())
}

/// Whether `m` is this process's own stdout or stderr (`/dev/stdout` when it is a pipe into
/// another program: its reader is there).
fn is_own_stdio(m: &std::fs::Metadata) -> bool {
    [io::stdout().as_raw_fd(), io::stderr().as_raw_fd()]
        .into_iter()
        .any(|fd| {
            // SAFETY: fstat on a descriptor number into a zeroed stat that the call fills; a
            // closed descriptor only makes the call fail.
            let st = unsafe {
                let mut st: libc::stat = std::mem::zeroed();
                if libc::fstat(fd, &mut st) != 0 {
                    return false;
                }
                st
            };
            #[allow(clippy::unnecessary_cast)]
            let same = st.st_dev as u64 == m.dev() && st.st_ino as u64 == m.ino();
            same
        })
}

/// Whether `path` is on procfs, sysfs, a cgroup file system, debugfs or tracefs.
#[allow(clippy::unnecessary_cast)] // the magic numbers' type differs between targets
fn pseudo_fs(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a zeroed statfs that the call
    // fills; neither outlives the call.
    let st = unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        if libc::statfs(c.as_ptr(), &mut st) != 0 {
            return false;
        }
        st
    };
    let magic = st.f_type as i64;
    [
        libc::PROC_SUPER_MAGIC,
        libc::SYSFS_MAGIC,
        libc::CGROUP_SUPER_MAGIC,
        libc::CGROUP2_SUPER_MAGIC,
        libc::DEBUGFS_MAGIC,
        libc::TRACEFS_MAGIC,
    ]
    .iter()
    .any(|&m| m as i64 == magic)
}

/// `path` opened for writing without creating it, with `O_NONBLOCK` for the open only (a
/// FIFO with no reader fails at once with ENXIO instead of waiting); writes then block as
/// usual.
fn open_nonblocking(path: &Path) -> io::Result<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    // SAFETY: fcntl on a descriptor this function owns; F_GETFL/F_SETFL take no pointers.
    unsafe {
        let fl = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(f.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK);
        }
    }
    Ok(f)
}

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
    // Never waits on a FIFO that no one reads (ENXIO at once).
    let mut f = open_nonblocking(path)?;
    // A regular file behind a symlink or with several links is truncated and rewritten; a
    // device or FIFO is simply written.
    if f.metadata()?.file_type().is_file() {
        f.set_len(0)?;
    }
    f.write_all(bytes)?;
    f.flush()
}
