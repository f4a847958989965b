//! The tools: one module per subcommand; each exposes `main(args) -> exit code`.

pub mod demo;
pub mod devbw;
pub mod doctor;
pub mod inspect;
pub mod ladder;
pub mod pack_trunk;
pub mod replay;
pub mod score;
pub mod sim_cache;
pub mod synth;
pub mod tokenize;
pub mod verify;

/// Parse a subcommand's arguments with clap: the parsed value, or the exit code after clap
/// printed its message (0 for `--help`/`--version`, 2 for a usage error).
pub fn parse_args<T: clap::Parser>(args: Vec<std::ffi::OsString>) -> Result<T, i32> {
    T::try_parse_from(args).map_err(|e| {
        let _ = e.print();
        if e.use_stderr() {
            2
        } else {
            0
        }
    })
}

/// Read a small text file the user names: a regular file only (not a FIFO or device, which
/// could block or never end) of at most `cap` bytes; the error says which rule it broke.
pub fn read_capped(path: &std::path::Path, cap: u64) -> std::io::Result<String> {
    use std::io::{Error, ErrorKind, Read};
    let m = std::fs::metadata(path)?;
    if !m.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "not a regular file"));
    }
    if m.len() > cap {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{} bytes, more than the {cap}-byte limit for this file",
                m.len()
            ),
        ));
    }
    let mut s = String::new();
    std::fs::File::open(path)?
        .take(cap + 1)
        .read_to_string(&mut s)?;
    if s.len() as u64 > cap {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("grew past the {cap}-byte limit"),
        ));
    }
    Ok(s)
}
