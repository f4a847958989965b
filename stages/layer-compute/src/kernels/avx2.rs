//! AVX2+FMA product kernels (ymm), bit-identical to the portable twin in
//! [`super::portable`]. This is the x86-64 baseline path.
//!
//! Two parts:
//! - **[`Avx2`]**, this instruction set's [`Ops`]: a group's 32 lanes in four ymm registers
//!   (lanes 0..7, 8..15: the even columns; 16..23, 24..31: the odd ones). Per group each
//!   lane performs one f32 `vfmadd` of the decoded weight and the permuted activation,
//!   exactly the `mul_add` of the twin; every 1024 columns the lanes are widened to f64
//!   (exact) and added to 32 f64 lane sums; the final halving tree is the shared scalar
//!   one. The decoders (BF16 by shift and mask, F32 by `vshufps` + `vpermpd`, MXFP4 by a
//!   `vpshufb` table lookup and one exact multiply) are documented on the methods.
//! - **The drivers** (register-tile shapes), reached through [`super::format::rows`] with
//!   the weight format's view: one token in tiles of 2 rows; up to [`PASS_TOKENS`] tokens
//!   row by row in 1 row × 2 token tiles ([`tile`]); more in panels of 4 rows taken block
//!   by block, tokens in passes of 4 so that a pass's activations stay in L1 for the
//!   panel's rows, MXFP4 staged once per block in lane order ([`panel`]). Per-format
//!   settings are the [`TUNE`] table. Blocking never changes what one (row, token) lane
//!   computes.
//!
//! Why these drivers are not AVX-512's: with 16 ymm registers a group takes 4 of them,
//! so the AVX-512 tile of 4 rows × 2 tokens (16 group accumulators) cannot be held, and
//! the shapes here were measured on their own (docs/measurements.md, "Kernel notes moved
//! out of the code"). They use only [`Avx2`]'s operations and the format views.

use std::arch::x86_64::*;

use super::format::stage_partial;
use super::format::{self, Driver, Format};
use super::matmul::Mat;
use super::ops::{prefetch_l1, Ops};
use super::portable::{groups, reduce_lanes, x_stride, BLOCK_GROUPS, E8M0, GROUP_COLS, LANES};
use super::tuning::{DriverTuning, WeightStaging};

/// The AVX2+FMA operations: a group is four ymm (lanes 0..7, 8..15, 16..23, 24..31).
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

impl Ops for Avx2 {
    type Lanes = [__m256; 4];

    #[inline(always)]
    unsafe fn zero() -> [__m256; 4] {
        // SAFETY: register-only AVX operation (the caller enables AVX2).
        unsafe { [_mm256_setzero_ps(); 4] }
    }

    #[inline(always)]
    unsafe fn load(p: *const f32) -> [__m256; 4] {
        // SAFETY: 128 readable bytes at p (caller); AVX enabled in the caller.
        unsafe {
            [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ]
        }
    }

    #[inline(always)]
    unsafe fn fma(w: [__m256; 4], x: [__m256; 4], acc: [__m256; 4]) -> [__m256; 4] {
        // SAFETY: register-only FMA operations (the caller enables FMA).
        unsafe {
            [
                _mm256_fmadd_ps(w[0], x[0], acc[0]),
                _mm256_fmadd_ps(w[1], x[1], acc[1]),
                _mm256_fmadd_ps(w[2], x[2], acc[2]),
                _mm256_fmadd_ps(w[3], x[3], acc[3]),
            ]
        }
    }

    /// A 32-byte load gives 8 dwords, each an even and an odd column.
    #[inline(always)]
    unsafe fn bf16(p: *const u8) -> [__m256; 4] {
        // SAFETY: 64 readable bytes at p (caller); AVX2 enabled in the caller.
        unsafe {
            let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            let v0 = _mm256_loadu_si256(p as *const __m256i);
            let v1 = _mm256_loadu_si256(p.add(32) as *const __m256i);
            [
                _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)),
                _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)),
                _mm256_castsi256_ps(_mm256_and_si256(v0, mask)),
                _mm256_castsi256_ps(_mm256_and_si256(v1, mask)),
            ]
        }
    }

    /// `vshufps` + `vpermpd` split 32 floats into even and odd columns.
    #[inline(always)]
    unsafe fn f32(p: *const u8) -> [__m256; 4] {
        // SAFETY: 128 readable bytes at p (caller); AVX2 enabled in the caller.
        unsafe {
            let f = p as *const f32;
            let a0 = _mm256_loadu_ps(f);
            let a1 = _mm256_loadu_ps(f.add(8));
            let a2 = _mm256_loadu_ps(f.add(16));
            let a3 = _mm256_loadu_ps(f.add(24));
            [
                sort(_mm256_shuffle_ps(a0, a1, 0x88)),
                sort(_mm256_shuffle_ps(a2, a3, 0x88)),
                sort(_mm256_shuffle_ps(a0, a1, 0xDD)),
                sort(_mm256_shuffle_ps(a2, a3, 0xDD)),
            ]
        }
    }

    /// `vpshufb` maps each nibble through a 16-entry table to `2·E2M1[code]` (−12..12),
    /// widened to an exact f32 and multiplied once by `2^(s−128)`: the same real number
    /// as the twin's `E2M1[code] · 2^(s−127)`, rounded once (exact but for overflow).
    #[inline(always)]
    unsafe fn mxfp4(p: *const u8, s: u8) -> [__m256; 4] {
        // SAFETY: 16 readable bytes at p (caller); AVX2 enabled in the caller.
        unsafe {
            let tbl = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
            let low4 = _mm_set1_epi8(0x0F);
            let b = _mm_loadu_si128(p as *const __m128i);
            let lo = _mm_shuffle_epi8(tbl, _mm_and_si128(b, low4));
            let hi = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(b, 4), low4));
            // 2^(s-128): exact (E8M0 is a power of two or 0, halving it is exact).
            let hs = _mm256_set1_ps(E8M0[s as usize] * 0.5);
            [
                widen_i8(lo, hs),
                widen_i8(_mm_srli_si128(lo, 8), hs),
                widen_i8(hi, hs),
                widen_i8(_mm_srli_si128(hi, 8), hs),
            ]
        }
    }

    #[inline(always)]
    unsafe fn promote(a: &[__m256; 4], acc: &mut [f64; LANES]) {
        // SAFETY: acc has 32 f64; each load/store covers 4 of them at 8k and 8k+4 (k < 4).
        unsafe {
            for (k, v) in a.iter().enumerate() {
                let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(*v));
                let hi = _mm256_cvtps_pd(_mm256_extractf128_ps(*v, 1));
                let p = acc.as_mut_ptr().add(8 * k);
                _mm256_storeu_pd(p, _mm256_add_pd(_mm256_loadu_pd(p), lo));
                _mm256_storeu_pd(p.add(4), _mm256_add_pd(_mm256_loadu_pd(p.add(4)), hi));
            }
        }
    }

    /// The shared scalar tree.
    #[inline(always)]
    unsafe fn reduce(acc: &mut [f64; LANES]) -> f64 {
        reduce_lanes(acc)
    }
}

/// Where a driver reads a row's groups, with this driver's settings for the format.
trait Fmt: Copy {
    /// Start of group `q` of row `r` and its scale byte.
    ///
    /// # Safety
    /// `r` and `q` must address a full group inside the matrix.
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8);
    /// Decode one full group at `p` into lanes 0..7, 8..15, 16..23, 24..31.
    ///
    /// # Safety
    /// `p` must point to the group's bytes; the CPU must support AVX2 and FMA (callers
    /// are inlined into the `#[target_feature]` entry point).
    unsafe fn dec(p: *const u8, s: u8) -> [__m256; 4];
    /// Software prefetch distance in bytes ahead of the group being decoded.
    const PF: usize;
    /// Whether [`panel`] decodes a block once into lane order ([`Lanes`]) for
    /// [`STAGE_TOKENS`] tokens or more, instead of once per token tile.
    const STAGE: bool = false;
}

/// This driver's per-format settings (its column of the format table).
struct Tune {
    /// [`Fmt::PF`].
    pf: usize,
    /// [`Fmt::STAGE`].
    stage: bool,
}

/// [`Tune`] by [`format::FormatKind`]. Prefetch: BF16 rows two KiB ahead (one-token rows
/// read faster than at 1 KiB; 512 B was slower and 4-8 KiB no better), F32 1 KiB, MXFP4
/// 512 B. Staging: MXFP4 only; its decode (two `vpshufb`, four widenings and multiplies
/// per group) is dearer than the staged loads, while BF16's is two ALU operations per
/// register and staging it was slower. Measurements: docs/measurements.md, "Kernel
/// notes moved out of the code".
const TUNE: [Tune; 3] = [
    Tune {
        pf: 2048,
        stage: false,
    },
    Tune {
        pf: 1024,
        stage: false,
    },
    Tune {
        pf: 512,
        stage: true,
    },
];

impl<F: Format> Fmt for F {
    const PF: usize = TUNE[F::KIND as usize].pf;
    const STAGE: bool = TUNE[F::KIND as usize].stage;
    #[inline(always)]
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8) {
        // SAFETY: forwarded.
        unsafe { Format::at(self, r, q) }
    }
    #[inline(always)]
    unsafe fn dec(p: *const u8, s: u8) -> [__m256; 4] {
        // SAFETY: forwarded.
        unsafe { F::decode::<Avx2>(p, s) }
    }
}

/// A block of one row already decoded into lane order ([`panel`] stages it once for all
/// the panel's token tiles): group `q` is 4 aligned ymm (lanes 0..7, 8..15, 16..23,
/// 24..31) at `base + 128 q`.
#[derive(Clone, Copy)]
struct Lanes {
    base: *const u8,
}

impl Fmt for Lanes {
    /// Staged in L1: nothing to prefetch.
    const PF: usize = 0;
    /// # Safety
    /// `q` is a group of the staged block (`base` is set so that its address is inside).
    #[inline(always)]
    unsafe fn at(&self, _r: usize, q: usize) -> (*const u8, u8) {
        (self.base.wrapping_add(128 * q), 0)
    }
    /// # Safety
    /// `p` points to a staged group (128 bytes, 32-byte aligned); AVX2 enabled.
    #[inline(always)]
    unsafe fn dec(p: *const u8, _s: u8) -> [__m256; 4] {
        // SAFETY: the caller's guarantees.
        unsafe {
            let p = p as *const f32;
            [
                _mm256_load_ps(p),
                _mm256_load_ps(p.add(8)),
                _mm256_load_ps(p.add(16)),
                _mm256_load_ps(p.add(24)),
            ]
        }
    }
}

/// Columns `[0,2,8,10 | 4,6,12,14]` (a `vshufps` result) sorted to `[0,2,4,..,14]`.
///
/// # Safety
/// AVX2 must be enabled in the caller.
#[inline(always)]
unsafe fn sort(v: __m256) -> __m256 {
    // SAFETY: register-only AVX2 operations (caller enables AVX2).
    unsafe { _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0b11_01_10_00)) }
}

/// The low 8 signed bytes of `v` as exact f32, times `hs`.
///
/// # Safety
/// AVX2 must be enabled in the caller.
#[inline(always)]
unsafe fn widen_i8(v: __m128i, hs: __m256) -> __m256 {
    // SAFETY: register-only AVX2 operations (caller enables AVX2).
    unsafe { _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), hs) }
}

/// One f32 block (groups `q0..qe`) of rows `r..r+R` × tokens `t0..t0+T`: the lanes'
/// f32 partials, promoted into `acc[j*ntok + t0 + t]` at the end.
///
/// # Safety
/// Rows `r..r+R` exist in `m` and `f` describes `m`; groups below `qf` are full, a group
/// `qf` (if `< qe`) is the staged partial one in `pbuf`/`psc`; `xp` holds `ntok` permuted
/// tokens at stride `stride`, `t0 + T <= ntok`, `acc.len() >= R*ntok`; AVX2 and FMA enabled
/// in the caller.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn seg<F: Fmt, const R: usize, const T: usize>(
    f: F,
    r: usize,
    (q0, qe, qf): (usize, usize, usize),
    (pbuf, psc): (&[[u8; 128]; R], &[u8; R]),
    xp: *const f32,
    stride: usize,
    (t0, ntok): (usize, usize),
    acc: &mut [[f64; LANES]],
) {
    // SAFETY (whole body): groups < qf are read in place, the partial one from pbuf; x
    // reads stay inside token t0+t (32 values at 32q < stride); acc indices < R*ntok.
    unsafe {
        let mut a = [[Avx2::zero(); T]; R];
        let mut q = q0;
        while q < qe {
            let mut w = [Avx2::zero(); R];
            if q < qf {
                for (j, wj) in w.iter_mut().enumerate() {
                    let (p, s) = f.at(r + j, q);
                    // Software prefetch PF bytes ahead in the row's stream (a hint: it
                    // never faults; wrapping_add keeps the pointer arithmetic defined).
                    if F::PF != 0 {
                        prefetch_l1(p.wrapping_add(F::PF));
                    }
                    *wj = F::dec(p, s);
                }
            } else {
                for (j, wj) in w.iter_mut().enumerate() {
                    *wj = F::dec(pbuf[j].as_ptr(), psc[j]);
                }
            }
            for t in 0..T {
                let x = Avx2::load(xp.add((t0 + t) * stride + GROUP_COLS * q));
                for j in 0..R {
                    a[j][t] = Avx2::fma(w[j], x, a[j][t]);
                }
            }
            q += 1;
        }
        for j in 0..R {
            for t in 0..T {
                Avx2::promote(&a[j][t], &mut acc[j * ntok + t0 + t]);
            }
        }
    }
}

/// Rows `r..r+R` × all `ntok` tokens: block by block (so the block's slice of every token
/// and the f64 lane sums stay in L1), tokens in register blocks of `T` (then one by one).
/// Sums into `out[(r - r0 + j)*ntok + t]`.
///
/// # Safety
/// As [`seg`]; `out` has room for rows `r - r0 .. r - r0 + R`.
#[inline(always)]
unsafe fn tile<F: Fmt, const R: usize, const T: usize>(
    f: F,
    m: &Mat<'_>,
    r: usize,
    xp: *const f32,
    ntok: usize,
    acc: &mut Vec<[f64; LANES]>,
    out: &mut [f64],
) {
    let ng = groups(m.cols);
    let full = m.cols / GROUP_COLS;
    let stride = x_stride(m.cols);
    let mut pbuf = [[0u8; 128]; R];
    let mut psc = [0u8; R];
    if full < ng {
        for j in 0..R {
            psc[j] = stage_partial(m, r + j, full, &mut pbuf[j]);
        }
    }
    acc.clear();
    acc.resize(R * ntok, [0f64; LANES]);
    let mut q = 0;
    // SAFETY: the caller's guarantees, passed on to seg with q ranges inside 0..ng.
    unsafe {
        while q < ng {
            let qe = (q + BLOCK_GROUPS).min(ng);
            let qs = (q, qe, qe.min(full));
            let mut t0 = 0;
            while t0 + T <= ntok {
                seg::<F, R, T>(f, r, qs, (&pbuf, &psc), xp, stride, (t0, ntok), acc);
                t0 += T;
            }
            while t0 < ntok {
                seg::<F, R, 1>(f, r, qs, (&pbuf, &psc), xp, stride, (t0, ntok), acc);
                t0 += 1;
            }
            q = qe;
        }
    }
    for j in 0..R {
        for t in 0..ntok {
            // SAFETY: AVX2 is enabled in the caller.
            out[j * ntok + t] = unsafe { Avx2::reduce(&mut acc[j * ntok + t]) };
        }
    }
}

/// Rows per panel of the several-token path ([`panel`]).
const PANEL_ROWS: usize = 4;
/// Tokens per pass of the several-token path: one pass's slice of one block of the
/// activations (`4 × 1024` f32, 16 KiB) stays in L1 while every row of the panel reads it.
/// Up to this many tokens the rows go one at a time over all blocks instead ([`tile`]):
/// their activations fit L1 already, and the panel's order was slower there.
const PASS_TOKENS: usize = 4;
/// Tokens from which [`panel`] stages a block for formats with [`Fmt::STAGE`] (at 4
/// tokens staging MXFP4 was slower).
const STAGE_TOKENS: usize = 8;

/// Rows `r..r+rows` (`rows <= PANEL_ROWS`) × all `ntok` tokens (more than
/// [`PASS_TOKENS`]), block-major: per block, for formats with [`Fmt::STAGE`] and at least
/// [`STAGE_TOKENS`] tokens the panel's rows are first decoded once into lane order
/// (`stage`, 16 KiB); then tokens go in passes of [`PASS_TOKENS`], and inside a pass every
/// row of the panel in turn, in 1 row × 2 token register tiles (then one by one). Each
/// (row, token) lane still sees its blocks in increasing order and its groups in
/// increasing order inside a block, so the order of passes and rows changes no bit. Why
/// not one row at a time over all tokens (the former loop): its activations for one block
/// (16 tokens, 64 KiB) did not fit L1, and every row streamed them again from L2.
///
/// # Safety
/// As [`seg`]; `out` has room for `rows * ntok` sums.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn panel<F: Fmt>(
    f: F,
    m: &Mat<'_>,
    r: usize,
    rows: usize,
    xp: *const f32,
    ntok: usize,
    (acc, stage): (&mut Vec<[f64; LANES]>, &mut Vec<[__m256; 4]>),
    out: &mut [f64],
) {
    let ng = groups(m.cols);
    let full = m.cols / GROUP_COLS;
    let stride = x_stride(m.cols);
    let mut pbuf = [[[0u8; 128]; 1]; PANEL_ROWS];
    let mut psc = [[0u8; 1]; PANEL_ROWS];
    if full < ng {
        for j in 0..rows {
            psc[j][0] = stage_partial(m, r + j, full, &mut pbuf[j][0]);
        }
    }
    acc.clear();
    acc.resize(rows * ntok, [0f64; LANES]);
    let staged = F::STAGE && ntok >= STAGE_TOKENS;
    if staged {
        // SAFETY: AVX2 is enabled in the caller.
        stage.resize(PANEL_ROWS * BLOCK_GROUPS, unsafe { Avx2::zero() });
    }
    let mut q = 0;
    // SAFETY: the caller's guarantees: groups below `full` are read in place, the partial
    // one from pbuf; rows r + j < r + rows are inside the matrix; the staged groups q..qe
    // of row j sit at stage[j * BLOCK_GROUPS + (g - q)], which `Lanes` addresses (seg is
    // called with qf = qe, so it reads only those); each row's sums have their own slice.
    unsafe {
        while q < ng {
            let qe = (q + BLOCK_GROUPS).min(ng);
            if staged {
                // The panel's block, decoded once into lane order.
                for j in 0..rows {
                    for g in q..qe {
                        let (p, s) = if g < full {
                            let (p, s) = f.at(r + j, g);
                            prefetch_l1(p.wrapping_add(F::PF));
                            (p, s)
                        } else {
                            (pbuf[j][0].as_ptr(), psc[j][0])
                        };
                        stage[j * BLOCK_GROUPS + g - q] = F::dec(p, s);
                    }
                }
            }
            let mut p0 = 0;
            while p0 < ntok {
                let p1 = (p0 + PASS_TOKENS).min(ntok);
                for j in 0..rows {
                    let aj = &mut acc[j * ntok..(j + 1) * ntok];
                    let x = (xp, stride, p0, p1, ntok);
                    if staged {
                        let lanes = Lanes {
                            base: (stage.as_ptr().add(j * BLOCK_GROUPS) as *const u8)
                                .wrapping_sub(128 * q),
                        };
                        let none = (&[[0u8; 128]; 1], &[0u8; 1]);
                        row_pass(lanes, 0, (q, qe, qe), none, x, aj);
                    } else {
                        let part = (&pbuf[j], &psc[j]);
                        row_pass(f, r + j, (q, qe, qe.min(full)), part, x, aj);
                    }
                }
                p0 = p1;
            }
            q = qe;
        }
    }
    for (o, a) in out[..rows * ntok].iter_mut().zip(acc.iter_mut()) {
        // SAFETY: AVX2 is enabled in the caller.
        *o = unsafe { Avx2::reduce(a) };
    }
}

/// One row's block for tokens `t0..t1` of a pass, in 1 row × 2 token tiles (then one):
/// [`panel`]'s inner step, on the row in place or staged.
///
/// # Safety
/// As [`seg`] with `R = 1`; `x` is (`xp`, its stride, `t0`, `t1`, `ntok`) with
/// `t1 <= ntok`, and `acc` the row's `ntok` sums.
#[inline(always)]
unsafe fn row_pass<F: Fmt>(
    f: F,
    r: usize,
    qs: (usize, usize, usize),
    part: (&[[u8; 128]; 1], &[u8; 1]),
    (xp, stride, t0, t1, ntok): (*const f32, usize, usize, usize, usize),
    acc: &mut [[f64; LANES]],
) {
    let mut t = t0;
    // SAFETY: the caller's guarantees, passed on for tokens t..t+T <= t1 <= ntok.
    unsafe {
        while t + 2 <= t1 {
            seg::<F, 1, 2>(f, r, qs, part, xp, stride, (t, ntok), acc);
            t += 2;
        }
        if t < t1 {
            seg::<F, 1, 1>(f, r, qs, part, xp, stride, (t, ntok), acc);
        }
    }
}

impl Driver for Avx2 {
    /// Rows `r0..r1` × all tokens with the f32-block contract: one token in tiles of 2
    /// rows, up to [`PASS_TOKENS`] tokens row by row in 1 × 2 tiles, more in panels.
    #[inline(always)]
    unsafe fn drive<F: Format>(
        f: F,
        m: &Mat<'_>,
        (r0, r1): (usize, usize),
        xp: &[f32],
        ntok: usize,
        out: &mut [f64],
        _tuning: &DriverTuning,
    ) {
        let stride = x_stride(m.cols);
        assert!(xp.len() >= ntok * stride);
        assert!(out.len() >= (r1 - r0) * ntok);
        assert!(r1 <= m.rows);
        let x = xp.as_ptr();
        let mut acc = Vec::new();
        let mut stage = Vec::new();
        let mut r = r0;
        // SAFETY: every tile's rows lie in r0..r1 <= m.rows and its outputs in out
        // (asserted); AVX2 and FMA are enabled in the caller.
        unsafe {
            if ntok == 1 {
                while r + 2 <= r1 {
                    tile::<F, 2, 1>(f, m, r, x, 1, &mut acc, &mut out[r - r0..]);
                    r += 2;
                }
                if r < r1 {
                    tile::<F, 1, 1>(f, m, r, x, 1, &mut acc, &mut out[r - r0..]);
                }
            } else if ntok <= PASS_TOKENS {
                while r < r1 {
                    tile::<F, 1, 2>(f, m, r, x, ntok, &mut acc, &mut out[(r - r0) * ntok..]);
                    r += 1;
                }
            } else {
                while r < r1 {
                    let rows = PANEL_ROWS.min(r1 - r);
                    let bufs = (&mut acc, &mut stage);
                    panel(f, m, r, rows, x, ntok, bufs, &mut out[(r - r0) * ntok..]);
                    r += rows;
                }
            }
        }
    }
}

/// The AVX2 drivers have no run-time tuning.
const NO_TUNING: DriverTuning = DriverTuning {
    decode_rows: None,
    decode_prefetch: None,
    staging: WeightStaging::Bf16,
};

/// Sums of rows `r0..r1` × `ntok` permuted f32 tokens (f32-block contract) into
/// `out[(r-r0)*ntok + t]`.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn rows_f32(
    m: &Mat<'_>,
    r0: usize,
    r1: usize,
    xp: &[f32],
    ntok: usize,
    out: &mut [f64],
) {
    // SAFETY: the features are enabled on this function (the caller checked the CPU).
    unsafe { format::rows::<Avx2>(m, (r0, r1), xp, ntok, out, &NO_TUNING) }
}
