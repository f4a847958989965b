//! The per-ISA operations the SIMD product drivers are written over ([`Ops`]), and the
//! software prefetch they share.
//!
//! A 32-column group occupies 32 f32 lanes in the contract's order (lanes 0..15 the even
//! columns, 16..31 the odd ones: [`super::portable::lane_col`]). An instruction set holds
//! one group in [`Ops::Lanes`]: four ymm registers on AVX2 (lanes 0..7, 8..15, 16..23,
//! 24..31), two zmm on AVX-512 (0..15, 16..31). Everything a driver does to a lane is one
//! of these operations, and each performs, lane by lane, what the portable twin does to
//! that lane: the same fused multiply-add, the same exact widening, the same promotion and
//! tree. So any driver over any implementation gives the portable twin's bits.
//!
//! Implementations: `avx2::Avx2` and `avx512::Avx512`. Every method is `#[inline(always)]`
//! and has no `#[target_feature]` of its own: it is inlined into the drivers, which are
//! inlined into the ISA's one `#[target_feature]` entry point (`rows_f32`), so the
//! compiled loops hold the instructions themselves and no call. A new instruction set (or
//! a new product path's kernels, e.g. a bf16 dot-product family) implements this trait
//! and picks a driver; the format dispatch ([`super::format::rows`]) is shared.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};

use super::portable::LANES;

/// The operations of one instruction set on a group's 32 lanes.
///
/// # Safety (every method)
/// The CPU must support the instruction set, and the caller must be compiled with it
/// enabled (inlined into its `#[target_feature]` entry point). Pointer arguments must be
/// valid for the bytes each method names.
pub(crate) trait Ops: Copy {
    /// One group's 32 f32 lanes in registers.
    type Lanes: Copy;

    /// +0 in every lane.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn zero() -> Self::Lanes;

    /// The 32 f32 at `p` (a group of one permuted token, or a group staged in lane order),
    /// any alignment.
    ///
    /// # Safety
    /// 128 readable bytes at `p`; see the trait.
    unsafe fn load(p: *const f32) -> Self::Lanes;

    /// `acc + w·x` in every lane, rounded once (a fused multiply-add: `f32::mul_add`).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn fma(w: Self::Lanes, x: Self::Lanes, acc: Self::Lanes) -> Self::Lanes;

    /// A BF16 group (64 bytes, 32 columns in order) widened exactly to f32 lanes: each
    /// dword holds an even column (low half: `dword << 16`) and an odd one (high half:
    /// `dword & 0xFFFF0000`).
    ///
    /// # Safety
    /// 64 readable bytes at `p`; see the trait.
    unsafe fn bf16(p: *const u8) -> Self::Lanes;

    /// An F32 group (128 bytes, 32 columns in order) split into lane order.
    ///
    /// # Safety
    /// 128 readable bytes at `p`; see the trait.
    unsafe fn f32(p: *const u8) -> Self::Lanes;

    /// An MXFP4 group (16 packed bytes, low nibble = even column) with scale byte `s`:
    /// lane values `E2M1[code] · 2^(s−127)`, exactly the portable twin's f32 (only the
    /// sign of a zero weight may differ, which no sum can see: a lane's partial reaches
    /// the result only through an f64 sum that starts at +0).
    ///
    /// # Safety
    /// 16 readable bytes at `p`; see the trait.
    unsafe fn mxfp4(p: *const u8, s: u8) -> Self::Lanes;

    /// Widen the lanes to f64 (exact) and add them into the 32 f64 lane sums.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn promote(a: &Self::Lanes, acc: &mut [f64; LANES]);

    /// The shared halving tree ([`super::portable::reduce_lanes`]: 16, 8, 4, 2, 1) over
    /// the 32 f64 lane sums, bit for bit.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn reduce(acc: &mut [f64; LANES]) -> f64;
}

/// Software prefetch of the line at `p` into L1 (`T0`). A hint: it never faults, so `p`
/// may point anywhere (form it with wrapping arithmetic).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_l1(p: *const u8) {
    // SAFETY: a prefetch is a hint that never faults, whatever the address; SSE is part
    // of the x86-64 baseline.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
}

/// Software prefetch of the line at `p` into L2 (`T1`); a hint, as [`prefetch_l1`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_l2(p: *const u8) {
    // SAFETY: as in prefetch_l1.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) };
}

/// Most bytes of weights in a one- or few-token row tile (`avx512::tile`, the `bf16x3`
/// kernel's `tiles_direct`) for which the tile, while it runs, prefetches the next tile's
/// bytes into L1 in order, `R` lines for each of its own (`avx512::seg` with `NX_SPAN`),
/// instead of each of its rows' line `PF` bytes ahead. A routed expert's MXFP4 rows are
/// short (1536-1792 bytes; 4 rows side by side, 6-7 KiB): a distance that hides the
/// memory's latency runs off the end of a row into the next one, whose lines the tile reads
/// at the same time, so the tile waited for nearly every line, and its decode and its reads
/// took turns instead of overlapping. Zen 4, one thread, from DRAM, a C replica of the
/// one-token MXFP4 loop (`tools/probes/mxfp4_dram.c`): 14.8-15.0 GMAC/s with no prefetch,
/// 12.9-18.3 with a row's own line ahead at any distance, 21.2-23.6 with the next tile's
/// rows group by group and 24.8-25.3 with its bytes in order (29.9 in L2). `gemv_bench
/// --only expert` (the one-token expert products, alternated 3 rounds): 15.8-16.9 →
/// 19.1-20.8 GMAC/s on one thread, 23.4-30.9 → 32.3-38.5 on two; the slice's decode step
/// spent 54.8-59.4 → 40.2-46.4 ms in the routed experts (docs/measurements.md, "Short rows
/// prefetch the next tile"). 16 KiB is half of L1, so the next tile's lines stay there
/// until it reads them; long rows (the BF16 trunk products) keep the line ahead, which
/// reads them at the memory's rate.
const AHEAD_BYTES: usize = 16 << 10;

/// Whether a one- or few-token tile of `rows` rows of `row_bytes` bytes each prefetches
/// the next tile's bytes in order rather than each row's line ahead ([`AHEAD_BYTES`]):
/// the rule every AVX-512 kernel follows.
#[inline(always)]
pub(crate) fn short_tile(rows: usize, row_bytes: usize) -> bool {
    rows * row_bytes <= AHEAD_BYTES
}

/// Software prefetch (`T0`) of the lines covering `bytes` bytes from `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_lines(p: *const u8, bytes: usize) {
    let mut off = 0;
    while off < bytes {
        prefetch_l1(p.wrapping_add(off));
        off += 64;
    }
}
