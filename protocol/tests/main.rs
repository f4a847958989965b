//! The k3-protocol integration tests: the recording format, shared regions across
//! processes, and the transport conformance suite. One test binary (each one links the
//! crate and all it depends on, so one per file cost minutes of linking; issue 31), one
//! module per file; [`unit`] the tests of the library's private workings (it has no
//! `#[cfg(test)]` tests, so `cargo test` compiles it once).

mod fuzz_harness;
mod record;
mod shm;
mod transport;
mod unit;
