//! AVX-512F product kernels (zmm), bit-identical to the portable twin in
//! [`super::portable`].
//!
//! The 32 lanes of a dot product live in two zmm registers (lanes 0..15: the even columns
//! of a 32-column group; lanes 16..31: the odd ones). Per group each lane performs one f32
//! `vfmadd` of the decoded weight and the permuted activation, exactly the `mul_add` of the
//! twin; every 1024 columns the lanes are widened to f64 (`vcvtps2pd`, exact) and added to
//! 32 f64 lane sums; the final halving tree is the shared scalar one. Weight decode:
//! - BF16: one 64-byte load gives 16 dwords, each holding an even and an odd column:
//!   `dword << 16` is the even weight, `dword & 0xFFFF0000` the odd one (exact widening);
//! - MXFP4: the 16 packed bytes are zero-extended to dwords; `vpermps` (a 16-entry table
//!   lookup on the low 4 bits) of `dword` and of `dword >> 4` gives the low and high
//!   nibbles' values from the row of [`E2M1_SCALED`] for the group's scale byte, i.e.
//!   `E2M1[code] × 2^(scale−127)`, exact (the same f32 multiply the twin performs, done at
//!   compile time). Per group and row: 1 zero-extension, 1 shift, 2 table lookups and the
//!   FMAs, nothing else;
//! - F32: `vpermt2ps` splits 32 floats into even and odd columns.
//!
//! Register blocking: one token uses 4 rows per pass; several tokens use 2 rows × 4
//! tokens, so each decoded weight feeds 4 FMAs, and the loops run block by block (one
//! 1024-column block of every token and the f64 lane sums stay in L1). Blocking never
//! changes what one (row, token) lane computes, so batched results equal one-token
//! results bit for bit.
//!
//! Only AVX-512F instructions are used (plus AVX2/FMA from the baseline), so the path needs
//! `avx512f` at run time; nothing else is assumed.

use std::arch::x86_64::*;

use super::gemv::{Mat, MatData};
use super::portable::{
    groups, reduce_lanes, stage_partial, x_stride, BLOCK_GROUPS, E2M1_SCALED, GROUP_COLS, LANES,
};

/// A weight format's group decoder.
trait Fmt: Copy {
    /// Start of group `q` of row `r` and its scale byte.
    ///
    /// # Safety
    /// `r` and `q` must address a full group inside the matrix.
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8);
    /// Decode one full group at `p` into (lanes 0..15, lanes 16..31).
    ///
    /// # Safety
    /// `p` must point to the group's bytes (64 for bf16, 128 for f32, 16 for MXFP4); the
    /// CPU must support AVX-512F (callers are `#[target_feature]` functions).
    unsafe fn dec(p: *const u8, s: u8) -> [__m512; 2];
    /// Software prefetch distance in bytes ahead of the group being decoded.
    const PF: usize;
}

#[derive(Clone, Copy)]
struct Bf16 {
    p: *const u8,
    stride: usize,
}

impl Fmt for Bf16 {
    const PF: usize = 1024;
    /// # Safety
    /// As [`Fmt::at`].
    #[inline(always)]
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8) {
        // SAFETY: the caller guarantees (r, q) is a full group of this matrix.
        (unsafe { self.p.add(r * self.stride + 64 * q) }, 127)
    }
    /// # Safety
    /// As [`Fmt::dec`].
    #[inline(always)]
    unsafe fn dec(p: *const u8, _s: u8) -> [__m512; 2] {
        // SAFETY: 64 readable bytes at p (caller); AVX-512F enabled in the caller.
        unsafe {
            let v = _mm512_loadu_si512(p as *const _);
            let even = _mm512_slli_epi32(v, 16);
            let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
            [_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd)]
        }
    }
}

#[derive(Clone, Copy)]
struct F32 {
    p: *const u8,
    stride: usize,
}

impl Fmt for F32 {
    const PF: usize = 1024;
    /// # Safety
    /// As [`Fmt::at`].
    #[inline(always)]
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8) {
        // SAFETY: the caller guarantees (r, q) is a full group of this matrix.
        (unsafe { self.p.add(r * self.stride + 128 * q) }, 127)
    }
    /// # Safety
    /// As [`Fmt::dec`].
    #[inline(always)]
    unsafe fn dec(p: *const u8, _s: u8) -> [__m512; 2] {
        // SAFETY: 128 readable bytes at p (caller); AVX-512F enabled in the caller.
        unsafe {
            let a = _mm512_loadu_ps(p as *const f32);
            let b = _mm512_loadu_ps(p.add(64) as *const f32);
            let ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            [
                _mm512_permutex2var_ps(a, ie, b),
                _mm512_permutex2var_ps(a, io, b),
            ]
        }
    }
}

#[derive(Clone, Copy)]
struct Mx {
    p: *const u8,
    pstride: usize,
    s: *const u8,
    sstride: usize,
}

impl Fmt for Mx {
    const PF: usize = 512;
    /// # Safety
    /// As [`Fmt::at`].
    #[inline(always)]
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8) {
        // SAFETY: the caller guarantees (r, q) is a full group: 16 packed bytes and a
        // scale byte exist there.
        unsafe {
            (
                self.p.add(r * self.pstride + 16 * q),
                *self.s.add(r * self.sstride + q),
            )
        }
    }
    /// # Safety
    /// As [`Fmt::dec`].
    #[inline(always)]
    unsafe fn dec(p: *const u8, s: u8) -> [__m512; 2] {
        // SAFETY: 16 readable bytes at p (caller); AVX-512F enabled in the caller.
        unsafe {
            // The group's 16 weights E2M1[code]·2^(s−127), precomputed (exact f32).
            let tbl = _mm512_load_ps(E2M1_SCALED.0[s as usize].as_ptr());
            let codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
            // vpermps reads the low 4 bits of each index: the low nibble, then the high.
            [
                _mm512_permutexvar_ps(codes, tbl),
                _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), tbl),
            ]
        }
    }
}

/// Add the 32 f32 lanes `a` (widened exactly) into the f64 lane sums.
///
/// # Safety
/// AVX-512F must be enabled in the caller.
#[inline(always)]
unsafe fn promote(a: &[__m512; 2], acc: &mut [f64; LANES]) {
    // SAFETY: acc has 32 f64; each store/load covers 8 of them at 8h (h < 4).
    unsafe {
        for (k, v) in a.iter().enumerate() {
            let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(*v));
            let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                _mm512_castps_pd(*v),
                1,
            )));
            let p = acc.as_mut_ptr().add(16 * k);
            _mm512_storeu_pd(p, _mm512_add_pd(_mm512_loadu_pd(p), lo));
            _mm512_storeu_pd(p.add(8), _mm512_add_pd(_mm512_loadu_pd(p.add(8)), hi));
        }
    }
}

/// One f32 block (groups `q0..qe`) of rows `r..r+R` × tokens `t0..t0+T`: the lanes'
/// f32 partials, promoted into `acc[j*ntok + t0 + t]` at the end.
///
/// # Safety
/// Rows `r..r+R` exist in `m` and `f` describes `m`; groups below `qf` are full, a group
/// `qf` (if `< qe`) is the staged partial one in `pbuf`/`psc`; `xp` holds `ntok` permuted
/// tokens at stride `stride`, `t0 + T <= ntok`, `acc.len() >= R*ntok`; AVX-512F enabled
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
        let mut a = [[[_mm512_setzero_ps(); 2]; T]; R];
        let mut q = q0;
        while q < qe {
            let mut w = [[_mm512_setzero_ps(); 2]; R];
            if q < qf {
                for (j, wj) in w.iter_mut().enumerate() {
                    let (p, s) = f.at(r + j, q);
                    // Software prefetch PF bytes ahead in the row's stream (a hint: it
                    // never faults; wrapping_add keeps the pointer arithmetic defined).
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(F::PF) as *const i8);
                    *wj = F::dec(p, s);
                }
            } else {
                for (j, wj) in w.iter_mut().enumerate() {
                    *wj = F::dec(pbuf[j].as_ptr(), psc[j]);
                }
            }
            for t in 0..T {
                let xq = xp.add((t0 + t) * stride + GROUP_COLS * q);
                let x0 = _mm512_loadu_ps(xq);
                let x1 = _mm512_loadu_ps(xq.add(16));
                for j in 0..R {
                    a[j][t][0] = _mm512_fmadd_ps(w[j][0], x0, a[j][t][0]);
                    a[j][t][1] = _mm512_fmadd_ps(w[j][1], x1, a[j][t][1]);
                }
            }
            q += 1;
        }
        for j in 0..R {
            for t in 0..T {
                promote(&a[j][t], &mut acc[j * ntok + t0 + t]);
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
            out[j * ntok + t] = reduce_lanes(&mut acc[j * ntok + t]);
        }
    }
}

/// Rows `r0..r1` × all tokens with the f32-block contract.
///
/// # Safety
/// As [`tile`], for every row tile; AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn drive<F: Fmt>(
    f: F,
    m: &Mat<'_>,
    r0: usize,
    r1: usize,
    xp: &[f32],
    ntok: usize,
    out: &mut [f64],
) {
    let stride = x_stride(m.cols);
    assert!(xp.len() >= ntok * stride);
    assert!(out.len() >= (r1 - r0) * ntok);
    assert!(r1 <= m.rows);
    let x = xp.as_ptr();
    let mut acc = Vec::new();
    let mut r = r0;
    // SAFETY: every tile's rows lie in r0..r1 <= m.rows and its outputs in out (asserted).
    unsafe {
        if ntok == 1 {
            while r + 4 <= r1 {
                tile::<F, 4, 1>(f, m, r, x, 1, &mut acc, &mut out[r - r0..]);
                r += 4;
            }
        } else {
            while r + 2 <= r1 {
                tile::<F, 2, 4>(f, m, r, x, ntok, &mut acc, &mut out[(r - r0) * ntok..]);
                r += 2;
            }
        }
        while r < r1 {
            tile::<F, 1, 4>(f, m, r, x, ntok, &mut acc, &mut out[(r - r0) * ntok..]);
            r += 1;
        }
    }
}

/// Sums of rows `r0..r1` × `ntok` permuted f32 tokens (f32-block contract) into
/// `out[(r-r0)*ntok + t]`.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn rows_f32(
    m: &Mat<'_>,
    r0: usize,
    r1: usize,
    xp: &[f32],
    ntok: usize,
    out: &mut [f64],
) {
    let c = m.cols;
    // SAFETY: the Fmt values describe m's own buffers (strides from its shape); features
    // are enabled on this function.
    unsafe {
        match m.data {
            MatData::Bf16(b) => drive(
                Bf16 {
                    p: b.as_ptr(),
                    stride: 2 * c,
                },
                m,
                r0,
                r1,
                xp,
                ntok,
                out,
            ),
            MatData::F32(b) => drive(
                F32 {
                    p: b.as_ptr(),
                    stride: 4 * c,
                },
                m,
                r0,
                r1,
                xp,
                ntok,
                out,
            ),
            MatData::Mxfp4 { packed, scales } => drive(
                Mx {
                    p: packed.as_ptr(),
                    pstride: c.div_ceil(2),
                    s: scales.as_ptr(),
                    sstride: groups(c),
                },
                m,
                r0,
                r1,
                xp,
                ntok,
                out,
            ),
        }
    }
}

/// One row · one permuted f64 token under the f64 contract.
///
/// # Safety
/// Row `r` exists, `xp` holds `groups(m.cols)*32` values; AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn row64<F: Fmt>(f: F, m: &Mat<'_>, r: usize, xp: *const f64) -> f64 {
    let ng = groups(m.cols);
    let full = m.cols / GROUP_COLS;
    let mut pbuf = [0u8; 128];
    let psc = if full < ng {
        stage_partial(m, r, full, &mut pbuf)
    } else {
        0
    };
    // SAFETY: as in `block`: in-place reads for full groups, staged for the partial one.
    unsafe {
        let mut a = [_mm512_setzero_pd(); 4];
        for q in 0..ng {
            let (p, s) = if q < full {
                f.at(r, q)
            } else {
                (pbuf.as_ptr(), psc)
            };
            let w = F::dec(p, s);
            let xq = xp.add(GROUP_COLS * q);
            for (k, v) in w.iter().enumerate() {
                let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(*v));
                let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                    _mm512_castps_pd(*v),
                    1,
                )));
                a[2 * k] = _mm512_fmadd_pd(lo, _mm512_loadu_pd(xq.add(16 * k)), a[2 * k]);
                a[2 * k + 1] =
                    _mm512_fmadd_pd(hi, _mm512_loadu_pd(xq.add(16 * k + 8)), a[2 * k + 1]);
            }
        }
        let mut acc = [0f64; LANES];
        for (k, v) in a.iter().enumerate() {
            _mm512_storeu_pd(acc.as_mut_ptr().add(8 * k), *v);
        }
        reduce_lanes(&mut acc)
    }
}

/// Rows `r0..r1` × all tokens with the f64 contract (one row and token at a time).
///
/// # Safety
/// `f` describes `m`; the CPU features of the calling `#[target_feature]` function.
#[inline(always)]
unsafe fn drive64<F: Fmt>(
    f: F,
    m: &Mat<'_>,
    r0: usize,
    r1: usize,
    xp: &[f64],
    ntok: usize,
    out: &mut [f64],
) {
    let stride = x_stride(m.cols);
    assert!(xp.len() >= ntok * stride);
    assert!(out.len() >= (r1 - r0) * ntok);
    assert!(r1 <= m.rows);
    for r in r0..r1 {
        for t in 0..ntok {
            // SAFETY: r < m.rows and token t's permuted values lie inside xp (asserted).
            out[(r - r0) * ntok + t] = unsafe { row64(f, m, r, xp.as_ptr().add(t * stride)) };
        }
    }
}

/// Sums of rows `r0..r1` × `ntok` permuted f64 tokens (f64 contract) into
/// `out[(r-r0)*ntok + t]`.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn rows_f64(
    m: &Mat<'_>,
    r0: usize,
    r1: usize,
    xp: &[f64],
    ntok: usize,
    out: &mut [f64],
) {
    let c = m.cols;
    // SAFETY: as in `rows_f32`.
    unsafe {
        match m.data {
            MatData::Bf16(b) => drive64(
                Bf16 {
                    p: b.as_ptr(),
                    stride: 2 * c,
                },
                m,
                r0,
                r1,
                xp,
                ntok,
                out,
            ),
            MatData::F32(b) => drive64(
                F32 {
                    p: b.as_ptr(),
                    stride: 4 * c,
                },
                m,
                r0,
                r1,
                xp,
                ntok,
                out,
            ),
            MatData::Mxfp4 { packed, scales } => drive64(
                Mx {
                    p: packed.as_ptr(),
                    pstride: c.div_ceil(2),
                    s: scales.as_ptr(),
                    sstride: groups(c),
                },
                m,
                r0,
                r1,
                xp,
                ntok,
                out,
            ),
        }
    }
}
