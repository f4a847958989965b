//! `k3-expert-fetcher`: the routed-expert stage.
//!
//! - [`arena`]: the slot memory (4096-aligned, owned for now, shared memory later).
//! - [`devbw`]: random O_DIRECT read bandwidth at a queue depth (`k3-orch devbw`, bench).
//! - [`fetcher`]: the LRU expert cache and its batch fetch (reserve serially, read in disk
//!   order at queue depth >= 16, publish each expert as it lands, report failures).
//! - [`io`]: positioned reads with O_DIRECT where possible, and a fault-injecting wrapper.
//! - [`locate`]: where each expert's bytes are (an interim table built from safetensors
//!   headers until `k3_protocol::locator` is used).
//! - [`sim`]: offline cache-policy simulator for `k3-orch sim-cache`.
//! - [`trace`]: `--dump-cache-trace` writer.

pub mod arena;
pub mod devbw;
pub mod fetcher;
pub mod io;
pub mod locate;
pub mod sim;
pub mod trace;

pub use arena::{ArenaMemory, OwnedArena};
pub use fetcher::{
    slot_bytes_for, slots_for_budget, Arrival, BatchSummary, Event, ExpertFetcher, FetchError,
    FetchStats, FetcherConfig, SetupError, SlotState,
};
pub use io::{DirectFiles, FaultyReader, ReadAt};
pub use locate::{ExpertLocation, ExpertTable, Extent, Locate};
