//! `k3-layer-compute`: every Kimi K3 kernel and the whole forward pass.
//!
//! - [`kernels`]: the kernels: a portable reference beside AVX2 and AVX-512 paths, all
//!   bit-identical (the path is chosen at run time from the CPU's features).
//! - [`modules`]: one file per module (KDA, MLA, latent MoE, dense MLP, AttnRes), each with
//!   its forward over a token batch and its weight binding.
//! - [`weights`]: the [`weights::Weights`] trait through which the forward receives its
//!   weights (single-process mmap or the staged pipeline's shared-memory handles).
//! - [`forward`]: [`forward::Model`] and [`forward::Session`] (full recompute, incremental
//!   decode with KV cache and KDA state, one pass over several sessions).
//! - [`batch`]: [`batch::Scheduler`], several requests decoding together (slots, a bounded
//!   queue, chunked prefill interleaved with decode, one pass per step).
//! - [`decode`]: the ONE decode loop every mode runs, and greedy [`decode::generate`].
//! - [`error`]: the stage's errors ([`error::ComputeError`]) and the failure kind each
//!   reports.
//! - [`sampler`]: greedy argmax and seeded sampling from a logits row.
//! - [`links`]: [`links::StagedWeights`], the [`Weights`] over the loaders' links.
//! - [`membw`]: the memory read probe (the floor kernels are measured against).
//! - [`model_stream`]: the embedding one row per token on demand, the lm_head in chunks.
//! - [`pool`]: the compute worker pool (rayon), sized by `--threads`.
//! - [`predict`]: the next layer's routed experts guessed before its router runs
//!   (`--speculate on`).
//! - [`profile`]: the opt-in per-phase wall-time profile (`K3_PROFILE=1`).
//! - [`routes`]: the route log `--record-routes` keeps while the model runs.
//! - [`stage`]: the layer-compute stage's process loop.
//! - [`state`]: saved session states (`--save-state` / `--load-state`).

pub mod batch;
pub mod decode;
pub mod error;
pub mod forward;
// Kernels spell out their loops by index on purpose (the index order IS the documented
// reduction order), and a kernel entry point takes its operands and strides as plain
// arguments.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
pub mod kernels;
pub mod links;
pub mod membw;
pub mod model_stream;
pub mod modules;
pub mod pool;
pub mod predict;
pub mod profile;
pub mod routes;
pub mod sampler;
pub mod scratch;
pub mod stage;
pub mod state;
pub mod weights;

pub use decode::{
    decode_loop, generate, DecodeError, GenStep, Generation, LoopOptions, Step, StepHooks,
};
pub use error::{ComputeError, PeerError};
pub use forward::{
    BatchOutput, ForwardError, ForwardOutput, ForwardStats, Group, GroupOutput, Model,
    ModelOptions, Session, Want,
};
pub use weights::{Delivery, ExpertProj, ExpertRef, SourceWeights, Weights};
