//! `k3-io`: reading the checkpoint from disk, shared by the I/O stages and the tools.
//!
//! - [`arena`]: 4096-aligned memory ([`arena::ArenaMemory`]) that reads land in, the one
//!   [`arena::ALIGN`] constant, and slot sizing for expert spans.
//! - [`direct`]: the one positioned reader: O_DIRECT where the file system allows it,
//!   buffered otherwise ([`direct::DirectFiles`] behind the [`direct::ReadAt`] trait), and the
//!   fault-injection hook ([`direct::FaultyReader`]).
//! - [`devbw`]: random-read bandwidth at a queue depth (`k3-orch devbw`, `doctor`).
//! - [`spread`]: one file and its copies on other drives read as one, at their summed rate
//!   ([`spread::Spread`]: copies of the packed trunk).
//! - [`input`]: reading user-named input files with a stated size cap, regular files only.
//! - [`output`]: writing user-named output files without leaving half a file.
//! - [`sysmem`]: the memory this process may still take (MemAvailable capped by its memory
//!   cgroup), the one `mem_available` of the workspace.

pub mod arena;
pub mod devbw;
pub mod direct;
pub mod input;
pub mod output;
pub mod spread;
pub mod sysmem;

pub use arena::{align_down, align_up, slot_bytes_for, ArenaMemory, OwnedArena, ALIGN};
pub use direct::{window, DirectFiles, FaultyReader, MemFile, ReadAt};
pub use spread::{open_copies, Spread};
