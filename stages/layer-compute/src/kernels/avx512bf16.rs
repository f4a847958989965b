//! The `bf16x3` product kernel on AVX512-BF16 (`vdpbf16ps` zmm), bit-identical to its
//! portable twin ([`super::bf16x3::rows_portable`]), whose module doc holds the contract:
//! the split, the hardware step, the reduction order and the error budget.
//!
//! # Registers
//!
//! A 32-column group of one row is one zmm of bf16 pairs (dword `j` = columns `2j`,
//! `2j + 1`): BF16 weights are loaded as shipped; an MXFP4 group is decoded in registers
//! (`vpmovzxbd` of the 16 packed bytes, `vpslld` + `vpor` to put the high nibble in the
//! odd word, one `vpermw` lookup in the scale byte's row of [`E2M1_BF16`]: 4 instructions,
//! no multiply); an F32 group is two zmm split into three parts (`and`, `sub` twice, with
//! masks for NaN and ∞) and packed into bf16 pairs by one `vpermt2w` per part. A split
//! token's group is three zmm (hi, mid, lo), read from the split input. Each (row, token)
//! keeps two f32 accumulators, `h` and `s` (the hi part and the small parts), promoted to
//! f64 every 512 columns.
//!
//! # Tiles (loads against `vdpbf16ps` per group)
//!
//! A tile of `R` rows × `T` tokens loads (or decodes) `R` weight groups and `3·T`
//! activation parts per group and issues `3·R·T` `vdpbf16ps` (`9·R·T` for F32 weights),
//! into `2·R·T` accumulators.
//! - **One token** ([`drive`], `ntok == 1`): 4 rows × 1 token (F32: 2 × 1): 4 loads
//!   (+ 3 activation loads shared by the rows) against 12 `vdpbf16ps`; the weights stream
//!   from memory, each row's line ahead prefetched (`K3_GEMV_PF`, default 1 KiB for BF16
//!   and F32, 512 B for MXFP4), so this shape is memory-bound as the `exact` one is; a
//!   tile of short rows (a routed expert's) prefetches the next tile's bytes in order
//!   instead, as the `exact` kernel does (`ops::short_tile`: on the Zen 4 VM of
//!   2026-12-06 the one-token expert products went from 12.6-13.0 to 16.1-17.6 GMAC/s on
//!   one thread, `gemv_bench --only expert --path bf16x3/avx512bf16`, 3 rounds
//!   alternated). The partial last group of each row comes from its zero-padded copy.
//! - **Two or three tokens** (a routed expert's share of a prompt): 2 rows × `ntok`
//!   tokens, weights decoded once in registers for all of them, no staging.
//! - **Four tokens or more** (prefill): rows in groups of [`RB`] (4), tokens in passes of
//!   up to [`TC`] (16). Per group and pass, block by block (512 columns), the group's
//!   weights are staged once into an aligned L1 buffer as bf16 parts (BF16 copied, MXFP4
//!   decoded, F32 split), then every tile of 2 tokens (an odd one alone) runs the block:
//!   4 rows × 2 tokens is 16 accumulators, 4 weight and 3 activation registers (23 of 32
//!   zmm), 10 loads against 24 `vdpbf16ps` per group, compute-bound (two loads and two
//!   `vdpbf16ps` issue per cycle on Zen 5), and the `s` chain (two dependent
//!   `vdpbf16ps` per group) is covered by the 24 independent ones. (4 × 3, 31 registers,
//!   compiled with accumulators spilled to the stack and moved around every group.) F32
//!   weights run 2 rows × 3 tokens (6 weight registers).
//!
//! Tiling never changes what a (row, token) lane computes: the same steps in the same
//! order, so one token, a batch, any tile and any thread split give the same bits.
//!
//! Needs AVX-512F, AVX-512BW (`vpermw`, `vpermt2w`) and AVX512_BF16 at run time
//! ([`super::simd::bf16_dot_available`]).

use std::arch::x86_64::*;

use super::bf16x3::{
    token_stride, weight_parts, BLOCK_GROUPS, E2M1_BF16, GROUP_VALUES, PAIR_LANES, PARTS,
};
use super::format::{stage_partial, with_format, Format, FormatFn, FormatKind};
use super::matmul::Mat;
use super::ops::{prefetch_l1, short_tile};
use super::portable::{groups, GROUP_COLS};
use super::tuning::DriverTuning;

/// A group's weight parts (bf16 pairs); only the first [`weight_parts`] are used.
type Parts = [__m512i; PARTS];

/// f64 lane sums of one (row, token).
type Sums = [f64; PAIR_LANES];

/// `acc + w·x` over the column pairs of every lane (the hardware step twice).
///
/// # Safety
/// AVX512_BF16 enabled in the caller.
#[inline(always)]
unsafe fn dp(acc: __m512, w: __m512i, x: __m512i) -> __m512 {
    // SAFETY: __m512i and __m512bh are the same 64 bytes (32 bf16); AVX512_BF16 is enabled
    // in the caller.
    unsafe {
        _mm512_dpbf16_ps(
            acc,
            std::mem::transmute::<__m512i, __m512bh>(w),
            std::mem::transmute::<__m512i, __m512bh>(x),
        )
    }
}

/// An MXFP4 group (16 packed bytes, low nibble = even column) with scale byte `s`, as 32
/// bf16 in column order: dword `j` = byte `j` zero-extended, `| byte << 12` puts its high
/// nibble in the odd word's low bits (the even word's index gets bits 0..4 of the byte,
/// whose fifth bit the doubled table row ignores), then `vpermw` in the scale's row.
///
/// # Safety
/// 16 readable bytes at `p`; AVX-512F and AVX-512BW enabled in the caller.
#[inline(always)]
pub(super) unsafe fn mxfp4(p: *const u8, s: u8) -> __m512i {
    // SAFETY: forwarded.
    unsafe { mxfp4_in(E2M1_BF16.0.as_ptr(), p, s) }
}

/// [`mxfp4`] with [`E2M1_BF16`]'s rows at `rows` (its address taken once, outside a loop
/// over many groups: the AMX decode's, where reloading it per group measured 5-8% slower).
///
/// # Safety
/// As [`mxfp4`]; `rows` is `E2M1_BF16.0.as_ptr()`.
#[inline(always)]
pub(super) unsafe fn mxfp4_in(rows: *const [u16; 32], p: *const u8, s: u8) -> __m512i {
    // SAFETY: 16 bytes at p (caller); the table row is 64 aligned bytes (s < 256 rows).
    unsafe {
        let tbl = _mm512_load_si512(rows.add(s as usize) as *const _);
        let codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
        let idx = _mm512_or_si512(codes, _mm512_slli_epi32(codes, 12));
        _mm512_permutexvar_epi16(idx, tbl)
    }
}

/// 16 f32 split into their three parts as f32 bit patterns whose low halves are zero
/// ([`super::bf16x3::split`], lane by lane).
///
/// # Safety
/// AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn split16(v: __m512) -> [__m512i; PARTS] {
    // SAFETY: register-only AVX-512F operations.
    unsafe {
        let b = _mm512_castps_si512(v);
        let exp = _mm512_set1_epi32(0x7F80_0000);
        let top = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let nonfinite = _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, exp), exp);
        let nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFF_FFFF)), exp);
        let quiet = _mm512_mask_or_epi32(b, nan, b, _mm512_set1_epi32(0x0040_0000));
        let hi = _mm512_and_si512(quiet, top);
        let r = _mm512_maskz_sub_ps(!nonfinite, v, _mm512_castsi512_ps(hi));
        let mid = _mm512_and_si512(_mm512_castps_si512(r), top);
        let lo = _mm512_sub_ps(r, _mm512_castsi512_ps(mid));
        [hi, mid, _mm512_castps_si512(lo)]
    }
}

/// `vpermt2w` indices taking the high word of every dword of two registers: word `k` of
/// the result is the top half of f32 `k` of the 32 (columns in order).
#[repr(C, align(64))]
struct OddWords([u16; 32]);
static ODD_WORDS: OddWords = {
    let mut t = [0u16; 32];
    let mut k = 0;
    while k < 32 {
        t[k] = (2 * k + 1) as u16;
        k += 1;
    }
    OddWords(t)
};

/// An F32 group (128 bytes, columns in order) as three parts of bf16 pairs.
///
/// # Safety
/// 128 readable bytes at `p`; AVX-512F and AVX-512BW enabled in the caller.
#[inline(always)]
unsafe fn f32_parts(p: *const u8) -> Parts {
    // SAFETY: 128 bytes at p (caller); the index table is 64 aligned bytes.
    unsafe {
        let a = split16(_mm512_loadu_ps(p as *const f32));
        let b = split16(_mm512_loadu_ps(p.add(64) as *const f32));
        let idx = _mm512_load_si512(ODD_WORDS.0.as_ptr() as *const _);
        [
            _mm512_permutex2var_epi16(a[0], idx, b[0]),
            _mm512_permutex2var_epi16(a[1], idx, b[1]),
            _mm512_permutex2var_epi16(a[2], idx, b[2]),
        ]
    }
}

/// One group of format `F` at `p` (scale byte `s`) as weight parts.
///
/// # Safety
/// The group's bytes at `p` ([`super::format::FormatInfo::group_bytes`]); AVX-512F and
/// AVX-512BW enabled in the caller.
#[inline(always)]
unsafe fn parts<F: Format>(p: *const u8, s: u8) -> Parts {
    // SAFETY: forwarded.
    unsafe {
        let z = _mm512_setzero_si512();
        match F::KIND {
            FormatKind::Bf16 => [_mm512_loadu_si512(p as *const _), z, z],
            FormatKind::Mxfp4 => [mxfp4(p, s), z, z],
            FormatKind::F32 => f32_parts(p),
        }
    }
}

/// Where a tile reads the weight parts of its rows.
trait Src {
    /// Row `j`'s parts of group `q`.
    ///
    /// # Safety
    /// `j` and `q` inside what the source holds; the kernel's features enabled.
    unsafe fn get(&self, j: usize, q: usize) -> Parts;
    /// Ask for row `j`'s weights ahead of group `q` (a hint; default none).
    #[inline(always)]
    fn ahead(&self, _j: usize, _q: usize) {}
}

/// Rows read in place from the matrix (the partial last group from zero-padded copies).
struct Direct<'a, F> {
    f: F,
    /// First row of the tile.
    r: usize,
    /// Full groups of a row.
    full: usize,
    /// Each row's partial group, zero-padded, and its scale byte.
    part: &'a [([u8; 128], u8)],
    /// Start of each row's weights, for the prefetch.
    heads: &'a [*const u8],
    /// Prefetch distance in bytes (0: none).
    pf: usize,
    /// The next tile's bytes, prefetched in order instead of each row's line `pf` ahead
    /// when the tile's rows are short (null: they are not; [`short_tile`]).
    next: *const u8,
}

impl<F: Format> Src for Direct<'_, F> {
    #[inline(always)]
    unsafe fn get(&self, j: usize, q: usize) -> Parts {
        // SAFETY: (r + j, q) is a full group of the matrix when q < full, else the copy
        // holds 128 readable bytes (caller: j is a row of the tile).
        unsafe {
            if q < self.full {
                let (p, s) = self.f.at(self.r + j, q);
                parts::<F>(p, s)
            } else {
                let (buf, s) = &self.part[j];
                parts::<F>(buf.as_ptr(), *s)
            }
        }
    }
    #[inline(always)]
    fn ahead(&self, j: usize, q: usize) {
        if self.pf != 0 && q < self.full {
            let gb = F::KIND.info().group_bytes;
            // A hint: it never faults; wrapping_add keeps the arithmetic defined. With
            // `next`, group q of the tile's rows asks for the next tile's bytes from
            // (q * rows + j) groups on: the tile's groups in order, one group a row.
            if self.next.is_null() {
                prefetch_l1(self.heads[j].wrapping_add(q * gb + self.pf));
            } else {
                let at = (q * self.heads.len() + j) * gb;
                prefetch_l1(self.next.wrapping_add(at));
            }
        }
    }
}

/// A row group's block staged in [`StageBuf`]: group `q - q0`, row `j`, part `i` at
/// `((q - q0) * RB + j) * np + i` (64 bytes each).
struct Staged {
    base: *const u8,
    q0: usize,
    np: usize,
}

impl Src for Staged {
    #[inline(always)]
    unsafe fn get(&self, j: usize, q: usize) -> Parts {
        // SAFETY: the staged block holds group q and row j (caller); unused parts are not
        // read (np of them were written).
        unsafe {
            let p = self.base.add(((q - self.q0) * RB + j) * self.np * 64);
            let z = _mm512_setzero_si512();
            let mut w = [z; PARTS];
            for (i, wi) in w.iter_mut().enumerate().take(self.np) {
                *wi = _mm512_load_si512(p.add(64 * i) as *const _);
            }
            w
        }
    }
}

/// Add `f64(h) + f64(s)` of every lane to its f64 sum.
///
/// # Safety
/// AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn promote(h: __m512, s: __m512, acc: &mut Sums) {
    // SAFETY: acc has 16 f64; loads and stores of 8 at offsets 0 and 8.
    unsafe {
        let half = |v: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        let lo = _mm512_add_pd(
            _mm512_cvtps_pd(_mm512_castps512_ps256(h)),
            _mm512_cvtps_pd(_mm512_castps512_ps256(s)),
        );
        let hi = _mm512_add_pd(_mm512_cvtps_pd(half(h)), _mm512_cvtps_pd(half(s)));
        let p = acc.as_mut_ptr();
        _mm512_storeu_pd(p, _mm512_add_pd(_mm512_loadu_pd(p), lo));
        _mm512_storeu_pd(p.add(8), _mm512_add_pd(_mm512_loadu_pd(p.add(8)), hi));
    }
}

/// The fixed halving tree over the 16 lane sums ([`super::bf16x3::reduce16`]), each
/// level's adds in one vector add.
///
/// # Safety
/// AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn reduce(a: &Sums) -> f64 {
    // SAFETY: 16 f64 at a.
    unsafe {
        let p = a.as_ptr();
        let m = _mm512_add_pd(_mm512_loadu_pd(p), _mm512_loadu_pd(p.add(8)));
        let h = _mm256_add_pd(_mm512_castpd512_pd256(m), _mm512_extractf64x4_pd(m, 1));
        let q = _mm_add_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
        _mm_cvtsd_f64(_mm_add_sd(q, _mm_unpackhi_pd(q, q)))
    }
}

/// Rows `j0..j0+R` of `src` × tokens `x + t * xs` (`t < T`, each at its group 0) over
/// groups `q0..qe` (one block): the contract's steps per group, then each (row, token)'s
/// accumulators promoted into `sums[j * ts + t]`.
///
/// # Safety
/// `src` holds rows `j0..j0+R` and groups `q0..qe`; every token has its groups' parts at
/// its pointer; `sums.len() > (R - 1) * ts + T - 1`; the kernel's features enabled.
#[inline(always)]
unsafe fn block<S: Src, const NP: usize, const R: usize, const T: usize>(
    src: &S,
    j0: usize,
    (q0, qe): (usize, usize),
    (x, xs): (*const u16, usize),
    sums: &mut [Sums],
    ts: usize,
) {
    // SAFETY (whole body): the reads stay inside the source and the tokens (caller); sums
    // indices j * ts + t < (R - 1) * ts + T.
    unsafe {
        let mut h = [[_mm512_setzero_ps(); T]; R];
        let mut s = [[_mm512_setzero_ps(); T]; R];
        for q in q0..qe {
            let mut w = [[_mm512_setzero_si512(); PARTS]; R];
            for (j, wj) in w.iter_mut().enumerate() {
                src.ahead(j0 + j, q);
                *wj = src.get(j0 + j, q);
            }
            for t in 0..T {
                let xp = x.add(t * xs + q * GROUP_VALUES);
                let x0 = _mm512_loadu_si512(xp as *const _);
                let x1 = _mm512_loadu_si512(xp.add(GROUP_COLS) as *const _);
                let x2 = _mm512_loadu_si512(xp.add(2 * GROUP_COLS) as *const _);
                for j in 0..R {
                    h[j][t] = dp(h[j][t], w[j][0], x0);
                    let mut a = dp(s[j][t], w[j][0], x1);
                    a = dp(a, w[j][0], x2);
                    for wi in &w[j][1..NP] {
                        a = dp(a, *wi, x0);
                        a = dp(a, *wi, x1);
                        a = dp(a, *wi, x2);
                    }
                    s[j][t] = a;
                }
            }
        }
        for j in 0..R {
            for t in 0..T {
                promote(h[j][t], s[j][t], &mut sums[j * ts + t]);
            }
        }
    }
}

/// Rows from `r` on in tiles of `R` rows × `T` tokens (`N = R * T`) read in place, while a
/// whole tile fits below `r1`; sums of row `i`, token `t` into `out[(i - r0) * T + t]`.
/// Returns the first row not done.
///
/// # Safety
/// `f` describes `m`, `r1 <= m.rows`; `x` holds `T` split tokens `xs` apart; `out` has room
/// for `(r1 - r0) * T` sums; the kernel's features enabled.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tiles_direct<
    F: Format,
    const NP: usize,
    const R: usize,
    const T: usize,
    const N: usize,
>(
    f: F,
    m: &Mat<'_>,
    (mut r, r0, r1): (usize, usize, usize),
    x: (*const u16, usize),
    pf: usize,
    out: &mut [f64],
) -> usize {
    let ng = groups(m.cols);
    let full = m.cols / GROUP_COLS;
    while r + R <= r1 {
        let mut part = [([0u8; 128], 0u8); R];
        if full < ng {
            for (j, p) in part.iter_mut().enumerate() {
                p.1 = stage_partial(m, r + j, full, &mut p.0);
            }
        }
        let mut heads = [std::ptr::null::<u8>(); R];
        for (j, h) in heads.iter_mut().enumerate() {
            *h = f.spans(r + j, r + j + 1)[0].0;
        }
        // Addresses only (`spans` computes them without reading, past the last row too).
        let short = short_tile(R, f.spans(r, r + 1)[0].1);
        let src = Direct {
            f,
            r,
            full,
            part: &part,
            heads: &heads,
            pf,
            next: if short {
                f.spans(r + R, r + 2 * R)[0].0
            } else {
                std::ptr::null()
            },
        };
        let mut sums = [[0f64; PAIR_LANES]; N];
        debug_assert_eq!(N, R * T);
        let mut q = 0;
        while q < ng {
            let qe = (q + BLOCK_GROUPS).min(ng);
            // SAFETY: rows r..r+R < r1 <= m.rows, groups q..qe < ng (full ones in place,
            // the partial one from its copy); the caller's tokens and features.
            unsafe { block::<_, NP, R, T>(&src, 0, (q, qe), x, &mut sums, T) };
            q = qe;
        }
        for j in 0..R {
            for t in 0..T {
                // SAFETY: AVX-512F enabled in the caller.
                out[(r + j - r0) * T + t] = unsafe { reduce(&sums[j * T + t]) };
            }
        }
        r += R;
    }
    r
}

/// Rows per staged row group of the batched path.
const RB: usize = 4;
/// Tokens per pass over a row group (their f64 sums, RB × TC × 128 bytes = 8 KiB, stay in
/// L1); a larger batch takes further passes that stage the weights again.
const TC: usize = 16;

/// A row group's block as staged parts (F32: three parts a group, 12 KiB).
#[repr(C, align(64))]
struct StageBuf([u8; BLOCK_GROUPS * RB * PARTS * 64]);

/// The f64 sums of a row group's pass, on cache lines.
#[repr(C, align(64))]
struct PassSums([Sums; RB * TC]);

/// Stage groups `q..qe` of the row group at `g0` (`nr` real rows; rows past them zero).
///
/// # Safety
/// Rows `g0..g0 + nr` exist in the matrix `f` describes, `full` is its count of full groups
/// and `part[j]` row `g0 + j`'s padded partial group when `qe > full`; `dst` has room for
/// `(qe - q) * RB * NP` parts; the kernel's features enabled.
#[inline(always)]
unsafe fn stage<F: Format, const NP: usize>(
    f: F,
    (g0, nr, full): (usize, usize, usize),
    (q, qe): (usize, usize),
    part: &[([u8; 128], u8); RB],
    dst: *mut u8,
) {
    // SAFETY: as the caller guarantees; each store is inside the buffer.
    unsafe {
        for qq in q..qe {
            for (j, (buf, sc)) in part.iter().enumerate() {
                let d = dst.add(((qq - q) * RB + j) * NP * 64);
                if j >= nr {
                    std::ptr::write_bytes(d, 0, NP * 64);
                    continue;
                }
                let w = if qq < full {
                    let (p, s) = f.at(g0 + j, qq);
                    parts::<F>(p, s)
                } else {
                    parts::<F>(buf.as_ptr(), *sc)
                };
                for (i, wi) in w.iter().enumerate().take(NP) {
                    _mm512_store_si512(d.add(64 * i) as *mut _, *wi);
                }
            }
        }
    }
}

/// Rows `r0..r1` × `ntok` (4 or more) split tokens, batched (see the module doc, "Tiles").
///
/// # Safety
/// `f` describes `m`, `r1 <= m.rows`; `x` holds `ntok` split tokens; `out` has room for
/// `(r1 - r0) * ntok` sums; the kernel's features enabled.
#[inline(always)]
unsafe fn rows_staged<F: Format, const NP: usize>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    x: *const u16,
    ntok: usize,
    out: &mut [f64],
) {
    let ng = groups(m.cols);
    let full = m.cols / GROUP_COLS;
    let xs = token_stride(m.cols);
    // Neither buffer is read before it is written: the stage block by block, the sums
    // pass by pass (zeroed at each pass's start).
    let mut buf = std::mem::MaybeUninit::<StageBuf>::uninit();
    let mut sums = std::mem::MaybeUninit::<PassSums>::uninit();
    let mut part = [([0u8; 128], 0u8); RB];
    let mut g0 = r0;
    while g0 < r1 {
        let nr = (r1 - g0).min(RB);
        if full < ng {
            for (j, p) in part.iter_mut().enumerate().take(nr) {
                p.1 = stage_partial(m, g0 + j, full, &mut p.0);
            }
        }
        let mut c0 = 0;
        while c0 < ntok {
            let tc = (ntok - c0).min(TC);
            // SAFETY: RB * tc <= RB * TC sums fit the buffer; zeroed before the slice over
            // them is formed.
            let acc: &mut [Sums] = unsafe {
                let p = sums.as_mut_ptr() as *mut Sums;
                std::ptr::write_bytes(p, 0, RB * tc);
                std::slice::from_raw_parts_mut(p, RB * tc)
            };
            let mut q = 0;
            while q < ng {
                let qe = (q + BLOCK_GROUPS).min(ng);
                let dst = buf.as_mut_ptr() as *mut u8;
                // SAFETY: rows g0..g0+nr < m.rows, groups q..qe < ng; the block fits the
                // buffer (qe - q <= BLOCK_GROUPS, RB rows, NP <= PARTS parts).
                unsafe { stage::<F, NP>(f, (g0, nr, full), (q, qe), &part, dst) };
                let src = Staged {
                    base: dst,
                    q0: q,
                    np: NP,
                };
                let mut t0 = 0;
                while t0 < tc {
                    let xt = (x.wrapping_add((c0 + t0) * xs), xs);
                    let left = tc - t0;
                    // SAFETY: the staged block holds groups q..qe of RB rows; tokens
                    // c0+t0.. < ntok; the sums slice from t0 has (RB - 1) * tc + T entries.
                    unsafe {
                        let a = &mut acc[t0..];
                        match (NP, left) {
                            (1, 2..) => block::<_, NP, RB, 2>(&src, 0, (q, qe), xt, a, tc),
                            (1, _) => block::<_, NP, RB, 1>(&src, 0, (q, qe), xt, a, tc),
                            (_, 3..) => {
                                block::<_, NP, 2, 3>(&src, 0, (q, qe), xt, a, tc);
                                let a2 = &mut acc[2 * tc + t0..];
                                block::<_, NP, 2, 3>(&src, 2, (q, qe), xt, a2, tc);
                            }
                            (_, 2) => {
                                block::<_, NP, 2, 2>(&src, 0, (q, qe), xt, a, tc);
                                let a2 = &mut acc[2 * tc + t0..];
                                block::<_, NP, 2, 2>(&src, 2, (q, qe), xt, a2, tc);
                            }
                            (_, _) => {
                                block::<_, NP, 2, 1>(&src, 0, (q, qe), xt, a, tc);
                                let a2 = &mut acc[2 * tc + t0..];
                                block::<_, NP, 2, 1>(&src, 2, (q, qe), xt, a2, tc);
                            }
                        }
                    }
                    t0 += left.min(if NP == 1 { 2 } else { 3 });
                }
                q = qe;
            }
            for j in 0..nr {
                for t in 0..tc {
                    // SAFETY: AVX-512F enabled in the caller.
                    out[(g0 + j - r0) * ntok + c0 + t] = unsafe { reduce(&acc[j * tc + t]) };
                }
            }
            c0 += tc;
        }
        g0 += nr;
    }
}

/// Rows `r0..r1` × `ntok` split tokens of format `F` with `NP` weight parts: one token
/// in 4-row tiles (2 for F32), two or three tokens in 2-row tiles read in place, more
/// staged ([`rows_staged`]).
///
/// # Safety
/// As [`rows`]; `f` describes `m` and `NP == weight_parts(F::KIND)`.
#[inline(always)]
unsafe fn drive<F: Format, const NP: usize>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    xs: &[u16],
    ntok: usize,
    out: &mut [f64],
    tuning: &DriverTuning,
) {
    let stride = token_stride(m.cols);
    assert!(xs.len() >= ntok * stride, "split input length");
    assert!(out.len() >= (r1 - r0) * ntok, "output length");
    assert!(r1 <= m.rows);
    let x = (xs.as_ptr(), stride);
    let pf = tuning
        .decode_prefetch
        .unwrap_or(if F::KIND == FormatKind::Mxfp4 {
            512
        } else {
            1024
        });
    // SAFETY: every tile's rows lie in r0..r1 <= m.rows and its outputs in out (asserted);
    // the features are enabled in the caller.
    unsafe {
        match ntok {
            0 => {}
            1 => {
                let rs = |r| (r, r0, r1);
                let mut r = r0;
                if NP == 1 {
                    r = tiles_direct::<F, NP, 4, 1, 4>(f, m, rs(r), x, pf, out);
                }
                r = tiles_direct::<F, NP, 2, 1, 2>(f, m, rs(r), x, pf, out);
                tiles_direct::<F, NP, 1, 1, 1>(f, m, rs(r), x, pf, out);
            }
            2 => {
                let r = tiles_direct::<F, NP, 2, 2, 4>(f, m, (r0, r0, r1), x, pf, out);
                tiles_direct::<F, NP, 1, 2, 2>(f, m, (r, r0, r1), x, pf, out);
            }
            3 => {
                let r = tiles_direct::<F, NP, 2, 3, 6>(f, m, (r0, r0, r1), x, pf, out);
                tiles_direct::<F, NP, 1, 3, 3>(f, m, (r, r0, r1), x, pf, out);
            }
            _ => rows_staged::<F, NP>(f, m, (r0, r1), x.0, ntok, out),
        }
    }
}

/// Sums of rows `r0..r1` × `ntok` split tokens `xs` ([`super::bf16x3::split_tokens`])
/// under the `bf16x3` contract into `out[(r - r0) * ntok + t]`.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW, AVX512_BF16, AVX2 and FMA
/// ([`super::simd::bf16_dot_available`]).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
pub unsafe fn rows(
    m: &Mat<'_>,
    r0: usize,
    r1: usize,
    xs: &[u16],
    ntok: usize,
    out: &mut [f64],
    tuning: &DriverTuning,
) {
    struct Rows<'x> {
        rows: (usize, usize),
        xs: &'x [u16],
        ntok: usize,
        out: &'x mut [f64],
        tuning: &'x DriverTuning,
    }
    impl FormatFn for Rows<'_> {
        type Out = ();
        #[inline(always)]
        fn call<F: Format>(self, f: F, m: &Mat<'_>) {
            let (rows, xs, ntok, out, t) = (self.rows, self.xs, self.ntok, self.out, self.tuning);
            // SAFETY: `f` is m's view (with_format) and NP its part count; the features are
            // those of `rows`, into which this is inlined.
            unsafe {
                if weight_parts(F::KIND) == 1 {
                    drive::<F, 1>(f, m, rows, xs, ntok, out, t)
                } else {
                    drive::<F, PARTS>(f, m, rows, xs, ntok, out, t)
                }
            }
        }
    }
    let v = Rows {
        rows: (r0, r1),
        xs,
        ntok,
        out,
        tuning,
    };
    with_format(m, v)
}
