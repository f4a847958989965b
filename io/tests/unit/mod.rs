//! The tests of the library's private workings, one module per source file (`arena.rs`
//! tests `src/arena.rs`, ...). They were the library's `#[cfg(test)]` unit tests; here, in
//! the one test binary, `cargo test` no longer compiles the whole library a second time for
//! them (`test = false` on the library). The items they need that are not the API are
//! `#[doc(hidden)] pub`.

mod arena;
mod devbw;
mod input;
mod output;
mod sysmem;
