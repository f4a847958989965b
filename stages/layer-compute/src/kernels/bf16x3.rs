//! The `bf16x3` product path (numerics contract v2, design.md "Product paths"): every f32
//! activation split into three bf16 parts that add up to it exactly, each part multiplied
//! by the bf16 weights on the CPU's bf16 dot-product hardware (`vdpbf16ps`, AVX512_BF16),
//! with f32 accumulation in the hardware's order. This module is the contract, written
//! once: the split ([`split`]), the hardware's step as a scalar model ([`dp_step`]), the
//! weight parts of each format ([`weight_parts`]) and the portable twin ([`rows_portable`])
//! that the AVX512-BF16 kernel ([`super::avx512bf16`]) reproduces bit for bit
//! (`tests/kernels_bitexact.rs`).
//!
//! # The split
//!
//! `hi = x & 0xFFFF0000`, `r = x − hi`, `mid = r & 0xFFFF0000`, `lo = r − mid` (bit masks
//! on the f32 encoding: truncation toward zero). Both subtractions are exact, `hi` keeps
//! the top 8 significant bits of `x`, `mid` the next 8 and `lo` the last 8 (or fewer), so
//! each part is a bf16 and `hi + mid + lo = x` exactly, all three of the sign of `x`
//! (no cancellation), `|mid + lo| < 2^-7·|x|`. Exceptions:
//! - **Tiny values.** The hardware reads a subnormal bf16 as zero (DAZ). A part below
//!   2^-126 therefore counts as zero: `x` loses less than 2^-126 in absolute value (all
//!   of it when `x` itself is below 2^-126; `mid`/`lo` when `|x| < 2^-103` or so).
//! - **Non-finite values.** ±∞ gives `hi = ±∞`, `mid = lo = 0` (so `∞ · w` is ±∞ and
//!   `∞ · 0` NaN, as on the `exact` path). A NaN gives a NaN `hi` (quiet bit set, so
//!   truncating the payload cannot turn it into ∞) and `mid = lo = 0`.
//!
//! # Weights (used as shipped)
//!
//! - **BF16**: one part, the shipped bits (no widening, no staging on one token).
//! - **MXFP4**: `E2M1[code] · 2^(s−127)` has at most two significant bits, so it is one
//!   exact bf16 ([`E2M1_BF16`], the f32 table's top halves), decoded per 32-column group in
//!   registers (one `vpermw` lookup in the scale byte's row) or into the batched kernel's
//!   L1 tile, never into RAM. Scale byte 255 zeroes the group (as on `exact`). Scale bytes
//!   0 and 1 make some weights subnormal (`{0.5, 1, 1.5}·2^-127` at 0, `0.5·2^-126` at 1):
//!   the hardware reads those as zero (DAZ), an error below `1.5·2^-127·|x|` per weight.
//!   Scale bytes 253 and 254 give ±∞ for the largest codes (`4·2^126` and up overflow f32
//!   and bf16 alike), as on `exact`.
//! - **F32** (no shipped matrix; the seed's tiny model and the op fixtures): split into
//!   three parts like an activation, and all nine part products are summed (each exact),
//!   so the path stays exact-product for them too, at three times the work.
//!
//! # The hardware step (probed: `tools/probes/dpbf16_special.c`)
//!
//! `vdpbf16ps` lane `j` of a group takes columns `2j` (element 0) and `2j + 1` (element 1)
//! of weights and one activation part, and computes, odd element first,
//! `acc = ftz(fma(a₁, b₁, daz(acc)))`, then `acc = ftz(fma(a₀, b₀, acc))`, with
//! `a, b = daz(bf16)`: every product exact inside a fused multiply-add rounded to nearest
//! even, DAZ on every input (bf16 and the accumulator), and FTZ after each of the two
//! steps, a result counting as tiny when it lies below 2^-126 after rounding (to 24 bits,
//! exponent unbounded), flushed to a zero of its sign. On the Zen 5 host (2026-12) the
//! probe found this model bit-exact on 16.4 M lanes: normal, subnormal inputs,
//! subnormal accumulators, subnormal results, products below 2^-149, results at
//! 2^-126 ± an ulp (where tininess before rounding disagrees on 25% of the lanes),
//! overflow, NaN/∞ and signed zeros; dropping any one ingredient (DAZ on bf16, DAZ on the
//! accumulator, either FTZ, the order, tininess after rounding) fails some category.
//! [`dp_step`] is that model; the kernel test compares it with the instruction directly
//! (`unit::bf16x3::dp_step_is_the_instruction`). A NaN result is NaN; which NaN
//! (payload, sign) is not part of the contract, as on `exact`.
//!
//! # Reduction contract
//!
//! For each output `y[t][r]`, every path (the AVX512-BF16 kernel, this twin), every thread
//! count, batch size and tile shape performs exactly:
//! 1. **Parts.** Columns in groups of 32 (`q = c / 32`, the last group padded with zero
//!    weights and zero activations); weight parts `w₀` (and `w₁, w₂` for F32), activation
//!    parts `x₀, x₁, x₂` (hi, mid, lo) in column order. Lane `j` (0..16) of a group takes
//!    the column pair `(32q + 2j, 32q + 2j + 1)`.
//! 2. **f32 blocks of [`BLOCK_COLS`] (512) columns.** Two f32 accumulators per lane, `h`
//!    (the hi part) and `s` (the small parts), both starting at +0. Per group, in
//!    increasing `q`: `h = dp(h, w₀, x₀)`; `s = dp(s, w₀, x₁)`, `s = dp(s, w₀, x₂)`; for
//!    F32 weights then `s = dp(s, wᵢ, xₖ)` for `i = 1, 2`, `k = 0, 1, 2` in that order;
//!    `dp` being the hardware's two steps above.
//! 3. **f64 promotion.** At the end of each block each lane adds `(f64(h) + f64(s))` to
//!    its f64 lane sum (starting at +0).
//! 4. **Tree.** The 16 f64 lane sums are combined by the fixed halving tree (8, 4, 2, 1)
//!    ([`reduce16`]); `gemm` rounds the result once to f32, `gemm64` returns it.
//! 5. Rows and tokens are independent (threads split rows, batching only shares weight
//!    reads and decode), so results are bitwise independent of thread count, batch
//!    composition, chunking and fusion; one token is the same path as a batch.
//!
//! # Error budget (u32 = 2^-24, A = Σ|w·x|, n = cols)
//!
//! - **E_block**: `h` takes 2 steps a group, 32 per 512-column block, each rounding once:
//!   ≤ 32·u32·A (the `exact` path's E_block, whose lanes take one step a group over
//!   1024 columns). `s` sums terms below 2^-7·|w·x| (2^-6 with F32 weights) in 64 steps
//!   (256 with F32): ≤ 0.5·u32·A (4·u32·A with F32 weights).
//! - **E_promote**, **E_tree** (f64): ≤ (n/512 + 5)·2^-53·A, negligible.
//! - **E_tiny**: DAZ/FTZ drop values below 2^-126: at most 2^-126 per activation part
//!   (times |w|), 1.5·2^-127 per subnormal MXFP4 weight (times |x|) and 2^-126 per flushed
//!   step; nothing the gates can see unless the activations are about 1e-38.
//! - **E_round**: u32·|y|.
//! - Total: |y − exact| ≤ 33·u32·A + u32·|y| + E_tiny (37·u32·A with F32 weights): the
//!   `exact` path's budget (`kernels_bitexact::error_within_documented_budget` holds both
//!   paths to it).
//!
//! Across machines the bits may differ from `exact` and between hardware kinds (an AMX
//! tile sums in another order); within a machine every determinism property holds.

use super::format::{stage_partial, with_format, Format, FormatFn, FormatKind};
use super::matmul::Mat;
use super::portable::{groups, lane_col, AlignedBuf, E2M1_SCALED, GROUP_COLS, LANES};

/// Activation parts per value (hi, mid, lo).
pub const PARTS: usize = 3;
/// Accumulator lanes: one per column pair of a 32-column group.
pub const PAIR_LANES: usize = 16;
/// Groups per f32 block.
pub const BLOCK_GROUPS: usize = 16;
/// Columns per f32 block (512): 32 hardware steps per lane, as the `exact` path's 1024.
pub const BLOCK_COLS: usize = BLOCK_GROUPS * GROUP_COLS;
/// bf16 values of one token's group: its three parts, 32 columns each, one after the
/// other (192 bytes: three 64-byte lines).
pub const GROUP_VALUES: usize = PARTS * GROUP_COLS;

/// Distance (in bf16 values) between consecutive split tokens: the groups' parts plus one
/// 64-byte line, so the same column of consecutive tokens does not share an L1 set.
#[inline]
pub const fn token_stride(cols: usize) -> usize {
    groups(cols) * GROUP_VALUES + 32
}

/// The three bf16 parts (hi, mid, lo) of `x` as bit patterns; see the module doc, "The
/// split". Branch-free, so a loop over it vectorises.
#[inline(always)]
pub fn split(x: f32) -> [u16; PARTS] {
    let b = x.to_bits();
    let nonfinite = b & 0x7F80_0000 == 0x7F80_0000;
    let nan = b & 0x7FFF_FFFF > 0x7F80_0000;
    let hi = (b | if nan { 0x0040_0000 } else { 0 }) & 0xFFFF_0000;
    let r = if nonfinite {
        0.0
    } else {
        x - f32::from_bits(hi)
    };
    let mid = r.to_bits() & 0xFFFF_0000;
    let lo = r - f32::from_bits(mid);
    [
        (hi >> 16) as u16,
        (mid >> 16) as u16,
        (lo.to_bits() >> 16) as u16,
    ]
}

/// `ntok` tokens of `cols` activations split into parts: token `t` at `t *
/// token_stride(cols)`, group `q` at `q * GROUP_VALUES` in it, part `k` at `k * 32` in the
/// group, columns in order; a partial last group zero-padded. Every token starts on a
/// 64-byte boundary.
pub fn split_tokens(xs: &[f32], cols: usize, ntok: usize) -> AlignedBuf<u16> {
    let stride = token_stride(cols);
    let mut out = AlignedBuf::<u16>::new(ntok * stride);
    for t in 0..ntok {
        let x = &xs[t * cols..(t + 1) * cols];
        let dst = &mut out[t * stride..(t + 1) * stride];
        for (q, g) in dst[..groups(cols) * GROUP_VALUES]
            .chunks_exact_mut(GROUP_VALUES)
            .enumerate()
        {
            let c0 = q * GROUP_COLS;
            for (i, &v) in x[c0..cols.min(c0 + GROUP_COLS)].iter().enumerate() {
                let [h, m, l] = split(v);
                g[i] = h;
                g[GROUP_COLS + i] = m;
                g[2 * GROUP_COLS + i] = l;
            }
        }
    }
    out
}

/// A bf16 bit pattern as the f32 it is.
#[inline(always)]
pub fn bf16_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `v`, or a zero of its sign when it is subnormal (DAZ).
#[inline(always)]
fn daz(v: f32) -> f32 {
    if v.is_subnormal() {
        0f32.copysign(v)
    } else {
        v
    }
}

/// One step of the hardware: `acc + a·b` (the product exact, one rounding to nearest
/// even), DAZ on all three inputs, the result flushed to a zero of its sign when it is
/// tiny after rounding (module doc, "The hardware step").
#[inline]
pub fn dp_step(acc: f32, a: f32, b: f32) -> f32 {
    let (acc, a, b) = (daz(acc), daz(a), daz(b));
    let r = a.mul_add(b, acc);
    let m = r.abs();
    // Not tiny (also ±∞ and NaN), or an exact zero (the fused result's sign is IEEE's).
    if m > f32::MIN_POSITIVE || m.is_nan() || m == 0.0 {
        return r;
    }
    if m < f32::MIN_POSITIVE {
        // Below 2^-126 after rounding to the subnormal grid: below it with an unbounded
        // exponent as well.
        return 0f32.copysign(r);
    }
    // Rounded to exactly 2^-126: tiny iff the exact value lies below 2^-126 − 2^-151 (the
    // midpoint between 2^-126 and the largest 24-bit value below it; a tie rounds to the
    // even 2^-126). The exact value as an unevaluated f64 sum (two-sum; the product of
    // two bf16 is exact in f64).
    let (c, p) = (acc as f64, a as f64 * b as f64);
    let s = c + p;
    let bb = s - c;
    let e = (c - (s - bb)) + (p - bb);
    let (s, e) = if s < 0.0 { (-s, -e) } else { (s, e) };
    let t = f32::MIN_POSITIVE as f64 - f64::powi(2.0, -151);
    if s < t || (s == t && e < 0.0) {
        0f32.copysign(r)
    } else {
        r
    }
}

/// `vdpbf16ps` on one lane: weights `(w₀, w₁)` and activations `(x₀, x₁)` of a column
/// pair (element 0 the even column), odd element first.
#[inline]
pub fn dp_pair(acc: f32, w: [f32; 2], x: [f32; 2]) -> f32 {
    dp_step(dp_step(acc, w[1], x[1]), w[0], x[0])
}

/// 64-byte aligned rows of 32 bf16 (one zmm each).
#[repr(C, align(64))]
pub struct Bf16Table(pub [[u16; 32]; 256]);

/// `E2M1[code] · 2^(s−127)` as bf16 bits for every scale byte `s` and code, each row's 16
/// values twice (entry `c` and `c + 16`), so that a `vpermw` index may carry a fifth bit:
/// the top halves of [`E2M1_SCALED`]'s exact f32 (their low halves are zero,
/// `kernels_bitexact::every_mxfp4_weight_is_an_exact_bf16`).
pub static E2M1_BF16: Bf16Table = {
    let mut t = [[0u16; 32]; 256];
    let mut s = 0;
    while s < 256 {
        let mut c = 0;
        while c < 32 {
            t[s][c] = (E2M1_SCALED.0[s][c % 16].to_bits() >> 16) as u16;
            c += 1;
        }
        s += 1;
    }
    Bf16Table(t)
};

/// Weight parts of a format: 1 (BF16, MXFP4: exact bf16) or [`PARTS`] (F32, split).
pub const fn weight_parts(kind: FormatKind) -> usize {
    match kind {
        FormatKind::F32 => PARTS,
        FormatKind::Bf16 | FormatKind::Mxfp4 => 1,
    }
}

/// Group `q` of row `r` of `f` (a view of `m`) as weight parts in column order: `out[i][c]`
/// (part `i`, column `c` of the group), a partial group zero-padded as every path pads it
/// ([`stage_partial`]). The twin's decode.
pub(super) fn group_parts<F: Format>(
    f: F,
    m: &Mat<'_>,
    r: usize,
    q: usize,
    out: &mut [[f32; 32]; PARTS],
) {
    let mut lanes = [0f32; LANES];
    if (q + 1) * GROUP_COLS <= m.cols {
        let (bytes, s) = f.group_bytes(r, q);
        F::decode_portable(bytes, s, &mut lanes);
    } else {
        let mut buf = [0u8; 128];
        let s = stage_partial(m, r, q, &mut buf);
        F::decode_portable(&buf, s, &mut lanes);
    }
    for (l, &w) in lanes.iter().enumerate() {
        let c = lane_col(l);
        if F::KIND == FormatKind::F32 {
            let [h, mi, lo] = split(w);
            out[0][c] = bf16_f32(h);
            out[1][c] = bf16_f32(mi);
            out[2][c] = bf16_f32(lo);
        } else {
            // Exact bf16 already (BF16 widened, MXFP4 decoded): one part.
            out[0][c] = w;
        }
    }
}

/// The fixed halving tree over the 16 f64 lane sums (8, 4, 2, 1).
#[inline]
pub fn reduce16(acc: &mut [f64; PAIR_LANES]) -> f64 {
    let mut w = PAIR_LANES / 2;
    while w > 0 {
        for j in 0..w {
            acc[j] += acc[j + w];
        }
        w /= 2;
    }
    acc[0]
}

/// `acc = dp(acc, w, x)` on every lane of a group: weights and activation parts as f32,
/// columns in order.
#[inline]
fn dp_group(acc: &mut [f32; PAIR_LANES], w: &[f32; 32], x: &[f32; 32]) {
    for (j, a) in acc.iter_mut().enumerate() {
        *a = dp_pair(*a, [w[2 * j], w[2 * j + 1]], [x[2 * j], x[2 * j + 1]]);
    }
}

/// Row `r` of `f` (a view of `m`) · one split token `x` under the reduction contract;
/// the unrounded f64 result of the tree.
fn dot<F: Format>(f: F, m: &Mat<'_>, r: usize, x: &[u16]) -> f64 {
    let ng = groups(m.cols);
    let np = weight_parts(F::KIND);
    let mut sums = [0f64; PAIR_LANES];
    let mut w = [[0f32; 32]; PARTS];
    let mut xv = [[0f32; 32]; PARTS];
    let mut q = 0;
    while q < ng {
        let qe = (q + BLOCK_GROUPS).min(ng);
        let (mut h, mut s) = ([0f32; PAIR_LANES], [0f32; PAIR_LANES]);
        while q < qe {
            group_parts(f, m, r, q, &mut w);
            for (k, xk) in xv.iter_mut().enumerate() {
                let at = q * GROUP_VALUES + k * GROUP_COLS;
                for (c, v) in xk.iter_mut().enumerate() {
                    *v = bf16_f32(x[at + c]);
                }
            }
            dp_group(&mut h, &w[0], &xv[0]);
            dp_group(&mut s, &w[0], &xv[1]);
            dp_group(&mut s, &w[0], &xv[2]);
            for wi in &w[1..np] {
                for xk in &xv {
                    dp_group(&mut s, wi, xk);
                }
            }
            q += 1;
        }
        for j in 0..PAIR_LANES {
            sums[j] += h[j] as f64 + s[j] as f64;
        }
    }
    reduce16(&mut sums)
}

/// The portable twin: sums of rows `r0..r1` × `ntok` split tokens `xs` ([`split_tokens`])
/// into `out[(r - r0) * ntok + t]`.
pub fn rows_portable(m: &Mat<'_>, r0: usize, r1: usize, xs: &[u16], ntok: usize, out: &mut [f64]) {
    struct Rows<'x> {
        r0: usize,
        r1: usize,
        xs: &'x [u16],
        ntok: usize,
        out: &'x mut [f64],
    }
    impl FormatFn for Rows<'_> {
        type Out = ();
        fn call<F: Format>(self, f: F, m: &Mat<'_>) {
            let stride = token_stride(m.cols);
            assert!(self.xs.len() >= self.ntok * stride, "split input length");
            for r in self.r0..self.r1 {
                for t in 0..self.ntok {
                    let x = &self.xs[t * stride..(t + 1) * stride];
                    self.out[(r - self.r0) * self.ntok + t] = dot(f, m, r, x);
                }
            }
        }
    }
    with_format(
        m,
        Rows {
            r0,
            r1,
            xs,
            ntok,
            out,
        },
    );
}
