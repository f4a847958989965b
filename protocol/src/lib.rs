//! `k3-protocol`: the only place the stages agree.
//!
//! It holds the model config (`config`), the released checkpoint formats (`catalog` for
//! safetensors headers and indexes, `tensor` for dtypes and borrowed tensor views), and —
//! as the pipeline grows — the shared-memory regions, rings, messages and recording format.

pub mod tensor;
pub mod config;
pub mod control;
pub mod messages;
pub mod record;
pub mod ring;
pub mod shm;
pub mod transport;
pub mod catalog;
pub mod mmap_weights;
pub mod trunk;
pub mod classify;
pub mod released;
pub mod direct_io;
pub mod locator;
