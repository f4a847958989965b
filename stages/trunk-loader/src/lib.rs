//! `k3-trunk-loader`: the dense trunk as a dial.
//!
//! - [`plan`](mod@plan): the fixed-point sizing of a pinned prefix plus a ring of slots for a budget,
//!   over whole layers or, below one slot for the largest layer, over the layers' parts
//!   (the tensors the forward uses together; [`plan_streams`]); a coded trunk's layers may
//!   also be kept coded in memory and decoded on each use ([`TrunkResident`]).
//! - [`loader`]: the reader thread that loads the pinned prefix once and streams the other
//!   layers through the ring, in layer order, as far ahead as free slots allow.
//! - [`presets`]: `--preset` / `--trunk-gb` / `--cache-gb` / `auto` budgets.
//! - [`stage`]: the trunk-loader stage's process loop (arena in shared memory, `LayerReady`
//!   / `LayerDone` with layer-compute).
//!
//! Reads and the arena come from `k3_io` (O_DIRECT with buffered fallback; 4096-aligned
//! memory, which the stage backs with a shared-memory region).

pub mod loader;
pub mod plan;
pub mod presets;
pub mod stage;

pub use loader::{
    runs_from_manifest, LayerGuard, LayerHandle, LoadError, LoaderError, Piece, TrunkLoader,
    TrunkStats, Unit, UnitReadError,
};
pub use plan::{
    decode_cores, decode_cost, decode_rate, decode_weight_ppm, plan, plan_streams,
    plan_streams_with, LayerRun, PlanError, RingPolicy, StreamPlan, Streams, TrunkPlan,
    TrunkResident,
};
pub use presets::{auto, mem_available, Budgets, Preset, Presets, PresetsError};
