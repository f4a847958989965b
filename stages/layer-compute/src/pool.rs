//! The compute worker pool: one rayon pool per process, sized by `--threads`.
//!
//! Threads spawned here inherit the calling thread's CPU affinity and memory policy, so a
//! pool built after k3-orch placed the stage (NUMA, `--numa`) stays on the stage's CPUs.
//! The kernels split output rows over the current pool; no reduction is split, so the ids
//! do not depend on the pool size.

pub use crate::error::PoolError;

/// The pool type (a caller that keeps one names it without depending on rayon).
pub use rayon::ThreadPool;

/// A pool of `threads` workers (at least 1), named `k3-compute-N`. Also keeps the
/// process's freed scratch for reuse ([`crate::scratch::keep_freed_scratch`]).
pub fn build(threads: usize) -> Result<rayon::ThreadPool, PoolError> {
    crate::scratch::keep_freed_scratch();
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("k3-compute-{i}"))
        .build()
        .map_err(|source| PoolError { threads, source })
}
