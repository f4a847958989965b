//! The tests of the library's private workings, one module per source file (`trunk.rs`
//! tests `src/trunk.rs`, ...). They were the library's `#[cfg(test)]` unit tests; here, in
//! the one test binary, `cargo test` no longer compiles the whole library a second time for
//! them (`test = false` on the library). The items they need that are not the API are
//! `#[doc(hidden)] pub`.

mod classify;
mod experts;
mod mapfault;
mod released;
mod trunk;
