//! The k3-layer-compute integration tests: the kernels bit for bit, the ops and the tiny
//! models against the oracles, the decode loop, batching, weights and saved states. One
//! test binary (each one links the crate and all it depends on, so one per file cost
//! minutes of linking; issue 31), one module per file.
//!
//! [`support`] holds the helpers (fixtures, the .npy reader, the model loader, the ISA
//! cap); [`conformance`] the `Weights` conformance suite; [`unit`] the tests of the
//! library's private workings (the crate has no `#[cfg(test)]` unit tests: `test = false`
//! on its lib, so `cargo test` does not compile it twice).

mod conformance;
mod support;
mod unit;

mod batch_forward;
mod batch_scheduler;
mod decode_loop;
mod fuzz_state;
mod gates_tiny;
mod kernels_bitexact;
mod ops_seed;
mod sampler_dist;
mod state_prefix;
mod trace_k3ref;
mod weights_conformance;
mod weights_contract;
