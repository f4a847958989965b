//! The four stage roles. Each `run` takes a configured [`super::link::StageCtx`] and
//! serves until the pipeline shuts down.

pub mod compute;
pub mod fetcher;
pub mod tokenizer;
pub mod trunk;
