//! The k3-tokenizer integration tests: parity with tiktoken, chat rendering, and the
//! fuzzing of its input files. One test binary (each one links the crate and all it depends
//! on, so one per file cost minutes of linking; issue 31), one module per file; [`unit`] the
//! tests of the library's private workings (it has no `#[cfg(test)]` tests, so `cargo test`
//! compiles it once).

mod chat;
mod fuzz;
mod fuzz_harness;
mod parity;
mod unit;
