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
//! Register blocking:
//! - one token (decode, memory-bound for BF16, decode-bound for MXFP4): [`R1`] BF16/F32
//!   rows or [`R1_MXFP4`] MXFP4 rows (tunable) streamed side by side, block by block, the
//!   groups of one 64-byte line of every row taken in one run with one prefetch per row;
//! - several tokens (prefill): panels of rows whose 1024-column block slices fit 64 KiB
//!   (32 BF16, 128 MXFP4, 16 F32 rows). Per block, per token tile of up to [`TB`] tokens
//!   (the tile's block slice, 16 KiB, stays in L1), every row pair of the panel decodes
//!   each group into registers and multiplies it into a 2 rows × [`TB`] tokens register
//!   tile (16 zmm accumulators, nothing parked or spilled), then promotes the tile's f32
//!   partials into its f64 lane sums. The first token tile reads the panel's weights from
//!   memory and prefetches (into L2) each row's next block, or the next panel's first
//!   one; the other tiles find the panel's block slice in L2.
//!
//! Blocking never changes what one (row, token) lane computes (the same FMAs in the same
//! order, the same promotion at block ends, the same tree), so batched results equal
//! one-token results bit for bit.
//!
//! Only AVX-512F instructions are used (plus AVX2/FMA from the baseline), so the path needs
//! `avx512f` at run time; nothing else is assumed.

use std::arch::x86_64::*;

use super::gemv::{decode_tuning, Mat, MatData, R1, R1_MXFP4};
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
    /// Bytes of one row's f32 block (32 groups): the batched path's prefetch distance.
    const BLOCK: usize;
    /// Groups per 64-byte line of a row's weights (at least 1): the one-token path
    /// prefetches once per run of `U` groups.
    const U: usize;
    /// Default rows per one-token tile ([`super::gemv::R1`], [`super::gemv::R1_MXFP4`]).
    const ROWS1: usize;
    /// Bytes from one row's start to the next row's (of the weights `at` points into).
    fn row_bytes(&self) -> usize;
}

#[derive(Clone, Copy)]
struct Bf16 {
    p: *const u8,
    stride: usize,
}

impl Fmt for Bf16 {
    const PF: usize = 1024;
    const BLOCK: usize = 64 * BLOCK_GROUPS;
    const U: usize = 1;
    const ROWS1: usize = R1;
    fn row_bytes(&self) -> usize {
        self.stride
    }
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
    const BLOCK: usize = 128 * BLOCK_GROUPS;
    const U: usize = 1;
    const ROWS1: usize = R1;
    fn row_bytes(&self) -> usize {
        self.stride
    }
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
    const BLOCK: usize = 16 * BLOCK_GROUPS;
    const U: usize = 4;
    const ROWS1: usize = R1_MXFP4;
    fn row_bytes(&self) -> usize {
        self.pstride
    }
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

/// Software prefetch (to L2) of the first `bytes` of rows `r0..r1` (clamped to the
/// matrix): the heads of the next tile's rows, which the in-row prefetch cannot reach.
///
/// # Safety
/// `f` describes `m`; AVX-512F enabled in the caller. Prefetches never fault.
#[inline(always)]
unsafe fn prefetch_heads<F: Fmt>(f: F, m: &Mat<'_>, r0: usize, r1: usize, bytes: usize) {
    if m.cols < GROUP_COLS {
        return;
    }
    for row in r0..r1.min(m.rows) {
        // SAFETY: row < m.rows and group 0 is full (cols >= 32), so `at` addresses the
        // matrix; the prefetched addresses are hints (wrapping_add: no UB, no fault).
        unsafe {
            let (p, _) = f.at(row, 0);
            let mut off = 0;
            while off < bytes {
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(off) as *const i8);
                off += 64;
            }
        }
    }
}

/// One token, one f32 block (groups `q0..qe`) of rows `r..r+R`: each group's activations
/// are loaded once, then every row's group is loaded, decoded and multiplied (R weight
/// streams side by side); the lanes' f32 partials are promoted into `acc[j]` at the end.
/// `pf` is the software prefetch distance in bytes along each row (0: none).
///
/// # Safety
/// Rows `r..r+R` exist in `m` and `f` describes `m`; groups below `qf` are full, a group
/// `qf` (if `< qe`) is the staged partial one in `pbuf`/`psc`; `xp` holds one permuted
/// token; `acc.len() >= R`; AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn seg1<F: Fmt, const R: usize>(
    f: F,
    r: usize,
    (q0, qe, qf): (usize, usize, usize),
    (pbuf, psc): (&[[u8; 128]; R], &[u8; R]),
    xp: *const f32,
    pf: usize,
    acc: &mut [[f64; LANES]],
) {
    // SAFETY (whole body): groups < qf are read in place, the partial one from pbuf; x
    // reads stay inside the token (32 values at 32q < its length); acc indices < R.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); 2]; R];
        let qm = qf.clamp(q0, qe);
        // Group `q`: its activations loaded once, row `j`'s weights decoded by `$w`.
        macro_rules! group {
            ($q:expr, $j:ident => $w:expr) => {{
                let xq = xp.add(GROUP_COLS * $q);
                let x0 = _mm512_loadu_ps(xq);
                let x1 = _mm512_loadu_ps(xq.add(16));
                for ($j, aj) in a.iter_mut().enumerate() {
                    let w: [__m512; 2] = $w;
                    aj[0] = _mm512_fmadd_ps(w[0], x0, aj[0]);
                    aj[1] = _mm512_fmadd_ps(w[1], x1, aj[1]);
                }
            }};
        }
        let mut q = q0;
        // Full groups in runs of U (one cache line of every row's weights): each row's
        // line ahead is prefetched once per run.
        while q + F::U <= qm {
            if pf != 0 {
                for j in 0..R {
                    let (p, _) = f.at(r + j, q);
                    // A hint: it never faults; wrapping_add keeps the arithmetic defined.
                    _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(pf) as *const i8);
                }
            }
            for u in 0..F::U {
                group!(q + u, j => {
                    let (p, s) = f.at(r + j, q + u);
                    F::dec(p, s)
                });
            }
            q += F::U;
        }
        while q < qm {
            group!(q, j => {
                let (p, s) = f.at(r + j, q);
                F::dec(p, s)
            });
            q += 1;
        }
        for q in qm..qe {
            group!(q, j => F::dec(pbuf[j].as_ptr(), psc[j]));
        }
        for (aj, accj) in a.iter().zip(acc.iter_mut()) {
            promote(aj, accj);
        }
    }
}

/// Rows `r..r+R` × one token, block by block. Sums into `out[j]`.
///
/// # Safety
/// As [`seg1`]; `out.len() >= R`.
#[inline(always)]
unsafe fn tile1<F: Fmt, const R: usize>(
    f: F,
    m: &Mat<'_>,
    r: usize,
    xp: *const f32,
    pf: usize,
    out: &mut [f64],
) {
    let ng = groups(m.cols);
    let full = m.cols / GROUP_COLS;
    let mut pbuf = [[0u8; 128]; R];
    let mut psc = [0u8; R];
    if full < ng {
        for j in 0..R {
            psc[j] = stage_partial(m, r + j, full, &mut pbuf[j]);
        }
    }
    let mut acc = [[0f64; LANES]; R];
    let mut q = 0;
    // SAFETY: the caller's guarantees, passed on to seg1 with q ranges inside 0..ng.
    unsafe {
        if pf != 0 {
            prefetch_heads(f, m, r + R, r + 2 * R, pf);
        }
        while q < ng {
            let qe = (q + BLOCK_GROUPS).min(ng);
            seg1::<F, R>(f, r, (q, qe, full), (&pbuf, &psc), xp, pf, &mut acc);
            q = qe;
        }
    }
    for (o, a) in out.iter_mut().zip(acc.iter_mut()) {
        *o = reduce_lanes(a);
    }
}

/// Rows per register tile of the batched path.
const RB: usize = 2;
/// Tokens per register tile of the batched path (RB × TB × 2 = 16 accumulators, RB × 2
/// decoded weights and 2 activations: 22 of the 32 zmm registers, so nothing spills).
pub const TB: usize = 4;

/// One f32 block (groups `q0..qe`) of rows `r..r+R` × tokens `t0..t0+T`: the weights of
/// each group are decoded once into registers and multiplied into the `R × T` register
/// tile; the lanes' f32 partials are promoted into `acc[j*ntok + t0 + t]` at the block's
/// end. With `pf = Some(d)`, each group's weights `d` bytes further on are prefetched (the
/// first token tile of a block is the one that reads the weights from memory; `d` points
/// at the row's next block, or at the next panel's first one).
///
/// # Safety
/// Rows `r..r+R` exist in `m` and `f` describes `m`; groups below `qf` are full, a group
/// `qf` (if `< qe`) is the staged partial one in `pbuf`/`psc` (row `j` at index `j`); `xp`
/// holds `ntok` permuted tokens at stride `stride`, `t0 + T <= ntok`,
/// `acc.len() >= (R-1)*ntok + t0 + T`; AVX-512F enabled in the caller.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn seg<F: Fmt, const R: usize, const T: usize>(
    f: F,
    r: usize,
    (q0, qe, qf): (usize, usize, usize),
    (pbuf, psc): (&[[u8; 128]], &[u8]),
    xp: *const f32,
    (stride, t0, ntok): (usize, usize, usize),
    pf: Option<isize>,
    acc: &mut [[f64; LANES]],
) {
    // SAFETY (whole body): groups < qf are read in place, the partial one from pbuf; x
    // reads stay inside token t0+t (32 values at 32q < stride); acc indices as documented.
    unsafe {
        let mut a = [[[_mm512_setzero_ps(); 2]; T]; R];
        let qm = qf.clamp(q0, qe);
        let x = xp.add(t0 * stride);
        macro_rules! body {
            ($w:expr, $q:expr) => {{
                let w: [[__m512; 2]; R] = $w;
                let xq = x.add(GROUP_COLS * $q);
                for t in 0..T {
                    let x0 = _mm512_loadu_ps(xq.add(t * stride));
                    let x1 = _mm512_loadu_ps(xq.add(t * stride + 16));
                    for j in 0..R {
                        a[j][t][0] = _mm512_fmadd_ps(w[j][0], x0, a[j][t][0]);
                        a[j][t][1] = _mm512_fmadd_ps(w[j][1], x1, a[j][t][1]);
                    }
                }
            }};
        }
        for q in q0..qm {
            let mut w = [[_mm512_setzero_ps(); 2]; R];
            for (j, wj) in w.iter_mut().enumerate() {
                let (p, s) = f.at(r + j, q);
                if let Some(d) = pf {
                    // A hint: it never faults (wrapping_offset keeps the arithmetic
                    // defined, wherever d points).
                    _mm_prefetch::<_MM_HINT_T1>(p.wrapping_offset(d) as *const i8);
                }
                *wj = F::dec(p, s);
            }
            body!(w, q);
        }
        for q in qm..qe {
            let mut w = [[_mm512_setzero_ps(); 2]; R];
            for (j, wj) in w.iter_mut().enumerate() {
                *wj = F::dec(pbuf[j].as_ptr(), psc[j]);
            }
            body!(w, q);
        }
        for j in 0..R {
            for t in 0..T {
                promote(&a[j][t], &mut acc[j * ntok + t0 + t]);
            }
        }
    }
}

/// [`seg`] for a token tile of `t` (1..=TB) tokens.
///
/// # Safety
/// As [`seg`] with `T = t`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn seg_t<F: Fmt, const R: usize>(
    t: usize,
    f: F,
    r: usize,
    qs: (usize, usize, usize),
    stage: (&[[u8; 128]], &[u8]),
    xp: *const f32,
    st: (usize, usize, usize),
    pf: Option<isize>,
    acc: &mut [[f64; LANES]],
) {
    // SAFETY: forwarded.
    unsafe {
        match t {
            4 => seg::<F, R, 4>(f, r, qs, stage, xp, st, pf, acc),
            3 => seg::<F, R, 3>(f, r, qs, stage, xp, st, pf, acc),
            2 => seg::<F, R, 2>(f, r, qs, stage, xp, st, pf, acc),
            _ => seg::<F, R, 1>(f, r, qs, stage, xp, st, pf, acc),
        }
    }
}

/// Weight bytes of one block (1024 columns) of a batched panel's rows: the panel's block
/// slice is read from memory by the first token tile and found in L2 by the others.
const PANEL_BLOCK_BYTES: usize = 64 << 10;

/// Rows `r0..r1` × all `ntok` tokens, batched, in panels of rows whose block slices fit
/// [`PANEL_BLOCK_BYTES`]. Per panel, block by block (1024 columns): per token tile of up
/// to [`TB`] tokens (whose block slice, 16 KiB, stays in L1), every row pair of the panel
/// runs the block in registers ([`seg`]) and promotes into its f64 lane sums; the first
/// tile reads the weights from memory and prefetches the next block, the others find the
/// panel's block slice in cache. Each (row, token) lane performs exactly the contract's
/// FMA chain (in increasing group order), promotes at the end of each block and reduces by
/// the shared tree, so results equal the one-token kernel bit for bit.
///
/// # Safety
/// `f` describes `m`, `r1 <= m.rows`; `xp` holds `ntok` permuted tokens; `out` has room for
/// `(r1 - r0) * ntok` sums; AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn rows_batched<F: Fmt>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    xp: *const f32,
    ntok: usize,
    out: &mut [f64],
) {
    let ng = groups(m.cols);
    let full = m.cols / GROUP_COLS;
    let stride = x_stride(m.cols);
    let panel = (PANEL_BLOCK_BYTES / F::BLOCK).max(RB);
    let mut pbuf = vec![[0u8; 128]; if full < ng { panel } else { 0 }];
    let mut psc = vec![0u8; pbuf.len()];
    let mut acc = Vec::new();
    let mut p0 = r0;
    while p0 < r1 {
        let nr = (r1 - p0).min(panel);
        for j in 0..pbuf.len().min(nr) {
            psc[j] = stage_partial(m, p0 + j, full, &mut pbuf[j]);
        }
        acc.clear();
        acc.resize(nr * ntok, [0f64; LANES]);
        // SAFETY: the caller's guarantees; every seg's rows lie in p0..p0+nr <= r1, its
        // tokens in 0..ntok and its sums in acc (row j of the panel at j*ntok).
        unsafe {
            let mut q = 0;
            while q < ng {
                let qe = (q + BLOCK_GROUPS).min(ng);
                let qs = (q, qe, qe.min(full));
                let mut t0 = 0;
                while t0 < ntok {
                    let t = (ntok - t0).min(TB);
                    let st = (stride, t0, ntok);
                    // The first tile reads the weights: it prefetches the row's next
                    // block, or in the last block the next panel's first one.
                    let pf = (t0 == 0).then(|| {
                        if qe < ng {
                            F::BLOCK as isize
                        } else {
                            (nr * f.row_bytes()) as isize - (q * F::BLOCK / BLOCK_GROUPS) as isize
                        }
                    });
                    let mut j = 0;
                    while j < nr {
                        // Row j's staged partial group, if the rows have one.
                        let stage = (pbuf.get(j..).unwrap_or(&[]), psc.get(j..).unwrap_or(&[]));
                        let a = &mut acc[j * ntok..];
                        if j + RB <= nr {
                            seg_t::<F, RB>(t, f, p0 + j, qs, stage, xp, st, pf, a);
                            j += RB;
                        } else {
                            seg_t::<F, 1>(t, f, p0 + j, qs, stage, xp, st, pf, a);
                            j += 1;
                        }
                    }
                    t0 += t;
                }
                q = qe;
            }
        }
        let o = &mut out[(p0 - r0) * ntok..(p0 - r0 + nr) * ntok];
        for (o, a) in o.iter_mut().zip(acc.iter_mut()) {
            *o = reduce_lanes(a);
        }
        p0 += nr;
    }
}

/// Rows `r0..r1` × all tokens with the f32-block contract.
///
/// # Safety
/// `f` describes `m`; AVX-512F enabled in the caller.
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
    let mut r = r0;
    // SAFETY: every tile's rows lie in r0..r1 <= m.rows and its outputs in out (asserted).
    unsafe {
        if ntok == 1 {
            let (rows, pf) = decode_tuning();
            let rows = if rows == 0 { F::ROWS1 } else { rows };
            let pf = if pf == usize::MAX { F::PF } else { pf };
            macro_rules! run_rows {
                ($n:literal) => {
                    while r + $n <= r1 {
                        tile1::<F, $n>(f, m, r, x, pf, &mut out[r - r0..]);
                        r += $n;
                    }
                };
            }
            match rows {
                8 => run_rows!(8),
                6 => run_rows!(6),
                2 => run_rows!(2),
                _ => {}
            }
            // The remainder (and the default) in tiles of 4, then 2, then single rows.
            run_rows!(4);
            run_rows!(2);
            while r < r1 {
                tile1::<F, 1>(f, m, r, x, pf, &mut out[r - r0..]);
                r += 1;
            }
        } else {
            rows_batched::<F>(f, m, (r0, r1), x, ntok, out);
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
