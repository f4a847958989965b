//! Byte counts as people read them (decimal units, as the seed prints them).

/// Bytes in a GB as the seed counts them (10^9).
pub const GB: f64 = 1e9;

/// Human-readable size in decimal units: `1.23 GB`, `456.70 MB`, `789.00 KB`, `12 B`.
pub fn human(b: u64) -> String {
    let x = b as f64;
    if x >= GB {
        format!("{:.2} GB", x / GB)
    } else if x >= 1e6 {
        format!("{:.2} MB", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.2} KB", x / 1e3)
    } else {
        format!("{b} B")
    }
}
