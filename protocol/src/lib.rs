//! `k3-protocol`: the only place the stages agree.
//!
//! - the model and its files: `config` (strict config.json reader), `catalog` (safetensors
//!   headers and indexes), `mmap_weights`, `tensor` (dtypes, borrowed tensor views, the
//!   `WeightSource` trait), `classify`, `locator` (routed-expert runs), `released` (the released
//!   tensor list), `trunk` (the packed-trunk format), `direct_io` (aligned O_DIRECT reads);
//! - the pipeline: `shm` (memfd regions and handles), `ring` (the cross-process SPSC ring),
//!   `transport`, `messages`, `control` (control sockets with fd passing), `record`
//!   (recordings for `--record` and `k3-orch replay`).

pub mod catalog;
pub mod classify;
pub mod config;
pub mod control;
pub mod direct_io;
pub mod locator;
pub mod messages;
pub mod mmap_weights;
pub mod record;
pub mod released;
pub mod ring;
pub mod shm;
pub mod tensor;
pub mod transport;
pub mod trunk;
