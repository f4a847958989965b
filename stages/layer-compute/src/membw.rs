//! The memory read probe: how fast this machine streams bytes from RAM with vector loads,
//! on the current rayon pool. It is the floor the product kernels are measured against.
//!
//! - `gemv_bench --membw` reads a 1 GiB buffer of its own ([`read_seconds`] over one span).
//! - A `--single-process` run with `K3_FLOOR=1` in its environment reads, right before
//!   each decode step, the very weight bytes one decode token multiplies (the bound
//!   trunk, the lm_head, and top-k routed experts of every MoE layer; see the
//!   orchestrator's `run::floor`), and prints one `k3 floor:` line per step on stderr.
//!   The step's time over its own floor is then taken over the same mappings (the same
//!   page size and placement) and within the same second. On a shared host whose read
//!   bandwidth moves by a third within a minute, a floor probed once per run is not a
//!   measure of one step.
//!
//! The probe only loads and adds integers (zmm loads where the CPU has AVX-512F, ymm on
//! the AVX2 baseline, else a loop the compiler vectorises): no result depends on it, and
//! nothing it reads is written.

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;

use crate::kernels::simd;

/// Bytes per row of the interleaved streams: one bf16 row of the released hidden size
/// (7168 columns), the stream length a GEMV row tile reads.
pub const ROW: usize = 14336;
/// Bytes per rayon task (the kernels' task scale).
pub const TASK: usize = 57344 * 4;

/// Sum `k` (1..=8) interleaved streams over `chunk`: rows of [`ROW`] bytes, `k` rows side
/// by side, 64 bytes from each row in turn (like a `k`-row GEMV tile); what is left after
/// the whole tiles is summed straight. Returns a checksum (wrapping u64 sums) so the
/// loads cannot be optimised away.
pub fn sum_streams(chunk: &[u8], k: usize) -> u64 {
    let k = k.clamp(1, 8);
    #[cfg(target_arch = "x86_64")]
    {
        if simd::avx512_available() {
            // SAFETY: AVX-512F detected at run time.
            return unsafe { sum_streams_512(chunk, k) };
        }
        if simd::avx2_available() {
            // SAFETY: AVX2 detected at run time.
            return unsafe { sum_streams_256(chunk, k) };
        }
    }
    let _ = k;
    sum_portable(chunk)
}

/// Sixteen u64 lanes per 128 bytes (auto-vectorised), then the last bytes one at a time.
#[doc(hidden)]
pub fn sum_portable(chunk: &[u8]) -> u64 {
    let mut acc = [0u64; 16];
    let mut blocks = chunk.chunks_exact(128);
    for blk in &mut blocks {
        for (i, a) in acc.iter_mut().enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(&blk[8 * i..8 * i + 8]);
            *a = a.wrapping_add(u64::from_le_bytes(w));
        }
    }
    let tail = blocks
        .remainder()
        .iter()
        .fold(0u64, |a, &b| a.wrapping_add(b as u64));
    acc.iter().fold(tail, |a, b| a.wrapping_add(*b))
}

/// The walk both vector loops share: whole tiles of `k` rows of [`ROW`] bytes, 64 bytes
/// from each row in turn, row `i`'s lines folded into `s[i]` by `add(s[i], line)`.
/// Returns where the whole tiles end (a multiple of 128 bytes: a tile is 112 such blocks).
/// `add` is only ever given the start of 64 readable bytes of `chunk`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn walk<V: Copy>(chunk: &[u8], k: usize, s: &mut [V; 8], add: impl Fn(V, *const u8) -> V) -> usize {
    let tile = k * ROW;
    let p = chunk.as_ptr();
    let mut r = 0;
    while r + tile <= chunk.len() {
        let mut c = 0;
        while c < ROW {
            for (i, si) in s.iter_mut().enumerate().take(k) {
                // r + i*ROW + c + 64 <= r + tile <= chunk.len().
                *si = add(*si, p.wrapping_add(r + i * ROW + c));
            }
            c += 64;
        }
        r += tile;
    }
    r
}

/// [`sum_streams`] with 64-byte zmm loads.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_streams_512(chunk: &[u8], k: usize) -> u64 {
    use std::arch::x86_64::*;
    let mut s = [_mm512_setzero_si512(); 8];
    // SAFETY: `walk` passes the start of 64 readable bytes; AVX-512F is enabled here.
    let r = walk(chunk, k, &mut s, |v, q| unsafe {
        _mm512_add_epi64(v, _mm512_loadu_si512(q as *const _))
    });
    let mut t = s[0];
    for v in &s[1..] {
        t = _mm512_add_epi64(t, *v);
    }
    (_mm512_reduce_add_epi64(t) as u64).wrapping_add(sum_portable(&chunk[r..]))
}

/// [`sum_streams`] with two 32-byte ymm loads per 64 bytes (the users' AVX2 baseline).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[doc(hidden)]
pub unsafe fn sum_streams_256(chunk: &[u8], k: usize) -> u64 {
    use std::arch::x86_64::*;
    let mut s = [_mm256_setzero_si256(); 8];
    // SAFETY: `walk` passes the start of 64 readable bytes; AVX2 is enabled here.
    let r = walk(chunk, k, &mut s, |v, q| unsafe {
        let a = _mm256_loadu_si256(q as *const __m256i);
        let b = _mm256_loadu_si256(q.add(32) as *const __m256i);
        _mm256_add_epi64(v, _mm256_add_epi64(a, b))
    });
    let mut lanes = [0u64; 4];
    for v in &s {
        let mut w = [0u64; 4];
        // SAFETY: `w` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(w.as_mut_ptr() as *mut __m256i, *v) };
        for (l, x) in lanes.iter_mut().zip(w) {
            *l = l.wrapping_add(x);
        }
    }
    let t = lanes.iter().fold(0u64, |a, &b| a.wrapping_add(b));
    t.wrapping_add(sum_portable(&chunk[r..]))
}

/// Read every byte of `spans` once on the current rayon pool (tasks of about [`TASK`]
/// bytes, `k` interleaved streams each) and return the wall seconds it took.
pub fn read_seconds(spans: &[&[u8]], k: usize) -> f64 {
    let task = (TASK / (k.max(1) * ROW)).max(1) * k.max(1) * ROW;
    let t0 = Instant::now();
    let total: u64 = spans
        .par_iter()
        .flat_map(|s| s.par_chunks(task))
        .map(|c| sum_streams(c, k))
        .reduce(|| 0, u64::wrapping_add);
    black_box(total);
    t0.elapsed().as_secs_f64()
}
