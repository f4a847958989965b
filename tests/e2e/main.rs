//! The end-to-end tests: one test binary (each one links the whole workspace, so one per
//! area cost minutes of linking; issue 31), one module per area. They run the built
//! `k3-orch` against the bundled fixtures.
//!
//! - [`pipeline`], [`modes`], [`text`], [`ladder`], [`golden`]: the ids against the oracles,
//!   in every process mode and at every budget;
//! - [`replay`]: the committed recordings replay identically;
//! - [`faults`], [`limits`]: killed stages, hung stages, memory limits;
//! - [`weights_conformance`]: staged weights against mmapped ones;
//! - [`speculate`]: `--speculate on` keeps every bit, and its precision and recall;
//! - [`layout`], [`docs`]: the sources themselves (import rules, function length, docs that
//!   name only what exists).
//!
//! [`common`] holds the helpers, [`scan`] the Rust lexer the source checks share.

mod common;
mod scan;

mod codec;
mod docs;
mod faults;
mod golden;
mod ladder;
mod layout;
mod limits;
mod modes;
mod pipeline;
mod replay;
mod speculate;
mod text;
mod weights_conformance;
