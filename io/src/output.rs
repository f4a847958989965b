//! Writing user-named output files (reports, dumped logits) so that a reader never sees half
//! a file.

use std::path::Path;

/// Write `bytes` to `path` through a temporary name in the same directory, then rename it
/// over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
