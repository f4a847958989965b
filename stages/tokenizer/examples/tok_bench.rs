//! Encode-speed benchmark (placeholder, filled in below).
fn main() {}
