//! The k3-io integration tests: the one O_DIRECT reader. One test binary (each one links
//! the crate and all it depends on, so one per file cost minutes of linking; issue 31), one
//! module per file.

mod direct;
