//! `k3-expert-fetcher`: the routed-expert stage.
//!
//! - [`fetcher`]: the LRU expert cache and its batch fetch (reserve serially, read in disk
//!   order at queue depth >= 16, publish each expert as it lands, report failures); its
//!   child `guess.rs` reads compute's guesses (`--speculate on`) into slots nobody needs.
//! - [`devices`]: which drive holds each file (`st_dev` through symlinks, partitions
//!   widened to their disk), so each drive gets its own reader pool and queue depth.
//! - [`locate`]: where each expert's bytes are ([`ExpertTable`]): read from the shards'
//!   safetensors headers (what the stage does), or through `k3_model::locator` (the same
//!   table, checked to agree with it by the tests).
//! - [`sim`]: offline cache-policy simulator for `k3-orch sim-cache`.
//! - [`trace`]: `--dump-cache-trace` writer.
//! - [`stage`]: the expert-fetcher stage's process loop (arena in shared memory, `Experts`
//!   in, `ExpertReady` / `ExpertFailed` out as each read lands).
//!
//! Reads and the arena come from `k3_io`.

pub mod devices;
pub mod fetcher;
pub mod locate;
pub mod sim;
pub mod stage;
pub mod trace;

pub use devices::DeviceMap;
pub use fetcher::{
    slots_for_budget, Arrival, BatchEvent, BatchIo, BatchSummary, ExpertCacheConfig, ExpertFetcher,
    FetchError, FetchStats, GuessStats, ReadFailure, ReaderGone, SetupError, SlotState,
};
pub use locate::{ExpertExtents, ExpertTable, Extent, Locate, TableError};
pub use stage::FetcherStageError;
pub use trace::TraceWriteError;
