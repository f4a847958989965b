//! The k3-io integration tests: the one O_DIRECT reader. One test binary (each one links
//! the crate and all it depends on, so one per file cost minutes of linking; issue 31), one
//! module per file; [`unit`] the tests of the library's private workings (it has no
//! `#[cfg(test)]` tests, so `cargo test` compiles it once).

mod direct;
mod spread;
mod unit;
