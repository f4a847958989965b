//! The tests of the library's private workings, one module per source file (`sampler.rs`
//! tests `src/sampler.rs`, `act.rs` `src/kernels/act.rs`, ...). They were the library's
//! `#[cfg(test)]` unit tests; here, in the one test binary, `cargo test` no longer compiles
//! the whole library a second time for them (it was the largest unit of CI's build). The
//! items they need that are not the API are `#[doc(hidden)] pub`.

mod act;
mod bf16x3;
mod error;
mod kda;
mod matmul;
mod membw;
mod mla;
mod mxfp4;
mod profile;
mod sampler;
mod simd;
mod tuning;
