//! The k3-expert-fetcher integration tests: the fetcher against the seed's cache fixture
//! and trace. One test binary (each one links the crate and all it depends on, so one per
//! file cost minutes of linking; issue 31), one module per file; [`unit`] the tests of the
//! library's private workings (it has no `#[cfg(test)]` tests, so `cargo test` compiles
//! it once).

mod devices;
mod fetch_fixture;
mod sim_seed_trace;
mod unit;
