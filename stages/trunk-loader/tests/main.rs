//! The k3-trunk-loader integration tests: the loader over a generated trunk file. One test
//! binary (each one links the crate and all it depends on, so one per file cost minutes of
//! linking; issue 31), one module per file.

mod coded;
mod loader;
