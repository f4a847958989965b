//! The k3-model integration tests: the checkpoint reader: catalog, config, locator, the
//! released tensor list, and the fuzzing of its untrusted inputs. One test binary (each one
//! links the crate and all it depends on, so one per file cost minutes of linking; issue
//! 31), one module per file; [`unit`] the tests of the library's private workings (it has
//! no `#[cfg(test)]` tests, so `cargo test` compiles it once).

mod catalog;
mod catalog_released;
mod codec;
mod config;
mod fuzz;
mod fuzz_harness;
mod fuzz_trunk;
mod locator;
mod unit;
