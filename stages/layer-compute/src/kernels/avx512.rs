//! AVX-512F product kernels (zmm), bit-identical to the portable twin in
//! [`super::portable`].
//!
//! Two parts:
//! - **[`Avx512`]**, this instruction set's [`Ops`]: a group's 32 lanes in two zmm
//!   registers (lanes 0..15: the even columns of a 32-column group; lanes 16..31: the odd
//!   ones). Per group each lane performs one f32 `vfmadd` of the decoded weight and the
//!   permuted activation, exactly the `mul_add` of the twin; every 1024 columns the lanes
//!   are widened to f64 (`vcvtps2pd`, exact) and added to 32 f64 lane sums; the final
//!   halving tree is the shared one, done in registers level by level
//!   ([`Avx512::reduce`]). Decode: BF16 by shift and mask; MXFP4 by two `vpermps` lookups
//!   in the scale byte's row of [`E2M1_SCALED`] (1 zero-extension, 1 shift, 2 lookups per
//!   group and row, nothing else); F32 by `vpermt2ps`.
//! - **The drivers** (register-tile shapes), reached through [`super::format::rows`] with
//!   the weight format's view; per-format settings are the [`TUNE`] table:
//!   - one token (decode, memory-bound for BF16, decode-bound for MXFP4): [`R1`] BF16/F32
//!     rows or [`R1_MXFP4`] MXFP4 rows (tunable) streamed side by side, block by block,
//!     the groups of one 64-byte line of every row taken in one run with one prefetch per
//!     row: a line ahead in the row, or, for a tile of short rows (a routed expert's), the
//!     next tile's bytes in order ([`short_tile`]) ([`rows1`]);
//!   - 2 to 4 tokens of an MXFP4 matrix (a routed expert's share of a prompt), 2 tokens
//!     of a BF16 or F32 one: the one-token loop with each decoded weight multiplied into
//!     every token ([`rows_few`]);
//!   - 3 or more tokens of a BF16 or F32 matrix (`serve --parallel` decode passes,
//!     prompts), in passes of up to [`SMALL`] (16) tokens (with f32 staging, the Intel
//!     default, 3 to [`SMALL_F32_STAGING`] (8) tokens, more staged as below): the
//!     same 4 rows × 2 tokens register tile without staging, rows in chunks of
//!     [`CHUNK`] (one tile) taken block by block, so that a row tile's weights stay in
//!     L1 for all its token pairs ([`rows_small`]; at an even count the last pair
//!     prefetches the next block, [`NX_TOKENS`]);
//!   - 5 or more tokens of an MXFP4 matrix (a routed expert's share of a prompt, whose
//!     decode is dear), and with f32 staging more than 8 of a BF16 or F32 one: tokens in
//!     passes of up to 16 (outermost, so a pass's
//!     tokens stay in L2 for all the rows), rows in groups of [`RB`] (4). Per group and
//!     pass, block by block (1024 columns), the group's block is staged
//!     once into an aligned L1 buffer, group-major, in one of two forms ([`Staging`]:
//!     [`Bf16Pairs`], MXFP4 decoded into exact bf16 pairs; or
//!     [`LaneF32`], widened into lane-ordered f32: always for F32, for every format with
//!     [`WeightStaging::F32`], the default on Intel), so a group is decoded once whatever
//!     the token count; then every token tile of up to [`TB`] (2) tokens runs the block
//!     in a 4 rows × 2 tokens register tile (16 zmm accumulators) and promotes it into
//!     its f64 lane sums ([`rows_batched`]). The next group's weights are prefetched
//!     (`T0`) a share per tile pass, a whole group ahead. This shape ran more FMAs per
//!     cycle than 2 × 4; zmm loads are kept from straddling two lines (which halved the
//!     loop's speed), and the f64 sums of a pass stay in L1 (docs/measurements.md,
//!     "Kernel notes moved out of the code"). A pass whose tokens do not fit L2 (more
//!     than [`PASS_X_BYTES`]: the dense FFN's down projection) takes the blocks
//!     outermost instead, every row group in turn per block, so each block of its tokens
//!     is read from memory once; its f64 sums then live in L2 ([`pass_by_block`]).
//!
//! Blocking never changes what one (row, token) lane computes (the same FMAs in the same
//! order, the same promotion at block ends, the same tree), so batched results equal
//! one-token results bit for bit. These drivers are AVX-512's own, not AVX2's: the 4 × 2
//! tile needs 26 of the 32 zmm registers, and each shape was measured on its own.
//!
//! Only AVX-512F instructions are used (plus AVX2/FMA from the baseline), so the path needs
//! `avx512f` at run time; nothing else is assumed.
//!
//! **Compile time.** The drivers' row loops ([`tiles`], [`small_chunk`], [`pass_by_group`],
//! [`pass_by_block`]) are functions of their own, each with the entry point's target
//! features, called once per row range, chunk or pass; everything inside them (the tiles,
//! the segments, the decode) is inlined as before, so their loops are the same. Inlined
//! all the way into [`rows_f32`], the three formats' drivers made one function of 904 KB of
//! machine code, whose optimisation was most of the 210 s that this crate took to compile at
//! the test profile's `opt-level` 1, on one core (`-Z time-passes`: `LLVM_passes` 173 s;
//! 2026-12-06), the longest step of CI.

use std::arch::x86_64::*;

use super::format::{self, stage_partial, Driver, Format, FormatKind};
use super::matmul::Mat;
use super::ops::{prefetch_l1, prefetch_l2, prefetch_lines, short_tile, Ops};
use super::portable::{groups, x_stride, AlignedBuf, BLOCK_GROUPS, E2M1_SCALED, GROUP_COLS, LANES};
use super::tuning::{DriverTuning, WeightStaging, R1, R1_MXFP4};

/// The AVX-512F operations: a group is two zmm (lanes 0..15, the even columns; lanes
/// 16..31, the odd ones).
#[derive(Clone, Copy)]
pub(crate) struct Avx512;

impl Ops for Avx512 {
    type Lanes = [__m512; 2];

    #[inline(always)]
    unsafe fn zero() -> [__m512; 2] {
        // SAFETY: register-only AVX-512F operation (the caller enables it).
        unsafe { [_mm512_setzero_ps(); 2] }
    }

    #[inline(always)]
    unsafe fn load(p: *const f32) -> [__m512; 2] {
        // SAFETY: 128 readable bytes at p (caller); AVX-512F enabled in the caller.
        unsafe { [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))] }
    }

    #[inline(always)]
    unsafe fn fma(w: [__m512; 2], x: [__m512; 2], acc: [__m512; 2]) -> [__m512; 2] {
        // SAFETY: register-only AVX-512F operations (the caller enables them).
        unsafe {
            [
                _mm512_fmadd_ps(w[0], x[0], acc[0]),
                _mm512_fmadd_ps(w[1], x[1], acc[1]),
            ]
        }
    }

    /// One 64-byte load gives 16 dwords, each an even and an odd column.
    #[inline(always)]
    unsafe fn bf16(p: *const u8) -> [__m512; 2] {
        // SAFETY: 64 readable bytes at p (caller); AVX-512F enabled in the caller.
        unsafe {
            let v = _mm512_loadu_si512(p as *const _);
            let even = _mm512_slli_epi32(v, 16);
            let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
            [_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd)]
        }
    }

    /// `vpermt2ps` splits 32 floats into even and odd columns.
    #[inline(always)]
    unsafe fn f32(p: *const u8) -> [__m512; 2] {
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

    /// The 16 packed bytes zero-extended to dwords; `vpermps` (a 16-entry lookup on the
    /// low 4 bits) of `dword` and `dword >> 4` in the scale byte's row of
    /// [`E2M1_SCALED`]: 1 zero-extension, 1 shift and 2 lookups per group.
    #[inline(always)]
    unsafe fn mxfp4(p: *const u8, s: u8) -> [__m512; 2] {
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

    /// The shared halving tree in registers, each level's adds done lane by lane in one
    /// vector add, so the result is bit for bit the shared one.
    #[inline(always)]
    unsafe fn reduce(a: &mut [f64; LANES]) -> f64 {
        // SAFETY: 32 f64 at a; loads of 8 at offsets 0, 8, 16, 24.
        unsafe {
            let p = a.as_ptr();
            // Level 16: lanes j and j + 16, for j < 16.
            let l0 = _mm512_add_pd(_mm512_loadu_pd(p), _mm512_loadu_pd(p.add(16)));
            let l1 = _mm512_add_pd(_mm512_loadu_pd(p.add(8)), _mm512_loadu_pd(p.add(24)));
            // Level 8: j and j + 8, for j < 8.
            let m = _mm512_add_pd(l0, l1);
            // Level 4, 2, 1.
            let h = _mm256_add_pd(_mm512_castpd512_pd256(m), _mm512_extractf64x4_pd(m, 1));
            let q = _mm_add_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
            _mm_cvtsd_f64(_mm_add_sd(q, _mm_unpackhi_pd(q, q)))
        }
    }
}

/// Where a driver reads a row's groups, with this driver's settings for the format.
trait Fmt: Copy {
    /// The format.
    const KIND: FormatKind;
    /// Start of group `q` of row `r` and its scale byte.
    ///
    /// # Safety
    /// `r` and `q` must address a full group inside the matrix.
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8);
    /// Decode one full group at `p` into (lanes 0..15, lanes 16..31).
    ///
    /// # Safety
    /// `p` must point to the group's bytes; the CPU must support AVX-512F (callers are
    /// inlined into the `#[target_feature]` entry point).
    unsafe fn dec(p: *const u8, s: u8) -> [__m512; 2];
    /// Decode group `(r, q)`: in place, or from its zero-padded copy `part` (the
    /// partial group, see [`stage_partial`]).
    ///
    /// # Safety
    /// As [`Fmt::at`] when `part` is `None`; AVX-512F enabled in the caller.
    #[inline(always)]
    unsafe fn group(&self, r: usize, q: usize, part: Option<(&[u8; 128], u8)>) -> [__m512; 2] {
        // SAFETY: forwarded (the copy holds 128 readable bytes).
        unsafe {
            match part {
                Some((buf, s)) => Self::dec(buf.as_ptr(), s),
                None => {
                    let (p, s) = self.at(r, q);
                    Self::dec(p, s)
                }
            }
        }
    }
    /// The bytes of rows `r0..r1` (see [`Format::spans`]).
    fn spans(&self, r0: usize, r1: usize) -> [(*const u8, usize); 2];
    /// Software prefetch distance in bytes ahead of the group being decoded, in the
    /// few-token paths.
    const PF: usize;
    /// The same in the one-token path.
    const PF1: usize;
    /// Whether the one-token loop's prefetch asks for L1 (`T0`) rather than L2 (`T1`).
    const PF_L1: bool;
    /// Groups per 64-byte line of a row's weights (at least 1): the one-token path
    /// prefetches once per run of `U` groups.
    const U: usize;
    /// Default rows per one-token tile ([`R1`], [`R1_MXFP4`]).
    const ROWS1: usize;
    /// Most tokens (from 2, at most [`FEW`]; below 2: none) that take [`rows_few`]
    /// (each weight decoded once in registers for all of them, rows tile by tile).
    const FEW_TOKENS: usize;
    /// Most tokens (above [`Fmt::FEW_TOKENS`], at most [`SMALL`]) that take [`rows_small`]
    /// (row tiles in chunks, token pairs block by block); more take [`rows_batched`]
    /// (stage, then widen per tile pass).
    const SMALL_TOKENS: usize;
}

/// This driver's per-format settings (its column of the format table).
struct Tune {
    /// [`Fmt::PF`].
    pf: usize,
    /// [`Fmt::PF1`].
    pf1: usize,
    /// [`Fmt::PF_L1`].
    pf_l1: bool,
    /// [`Fmt::ROWS1`].
    rows1: usize,
    /// [`Fmt::FEW_TOKENS`].
    few: usize,
    /// [`Fmt::SMALL_TOKENS`].
    small: usize,
}

/// [`Tune`] by [`format::FormatKind`]. One-token prefetch (on Intel 1 KiB for every format:
/// [`super::tuning::default_decode_prefetch`]): 256 B ahead, BF16 and F32 into
/// L1, MXFP4 into L2 (its decode, not memory, bounds it): on a Zen 5 VM whose memory
/// gave the kernels 28-32 GB/s, 1 KiB (BF16) and 512 B (MXFP4) ahead, the earlier
/// defaults, kept up to 64 lines per thread in flight and decoded 12% slower than 256 B
/// (alternated, docs/measurements.md, "The one-token prefetch distance"). The few-token
/// paths prefetch 1 KiB (BF16, F32) or 512 B (MXFP4) ahead. A few tokens: BF16 and F32
/// take two tokens in [`rows_few`] and up to [`SMALL`] in [`rows_small`] (on Zen 5, one
/// thread, weights in cache, 4 rows × 2 tokens in registers read 40 to 60% faster at 2
/// to 4 tokens than staging, 5 to 10% at 5 to 8); MXFP4 takes up to 4 tokens
/// in [`rows_few`] and stages from 5 on (its decode is dear: staging decodes a group once
/// for all the tokens, and ran 10 to 30% faster than [`rows_small`] there).
/// Measurements: docs/measurements.md, "Kernel notes moved out of the code", and the
/// commit that added [`rows_small`].
const TUNE: [Tune; 3] = [
    Tune {
        pf: 1024,
        pf1: 256,
        pf_l1: true,
        rows1: R1,
        few: 2,
        small: SMALL,
    },
    Tune {
        pf: 1024,
        pf1: 256,
        pf_l1: true,
        rows1: R1,
        few: 2,
        small: SMALL,
    },
    Tune {
        pf: 512,
        pf1: 256,
        pf_l1: false,
        rows1: R1_MXFP4,
        few: FEW,
        small: 0,
    },
];

impl<F: Format> Fmt for F {
    const KIND: FormatKind = <F as Format>::KIND;
    const PF: usize = TUNE[F::KIND as usize].pf;
    const PF1: usize = TUNE[F::KIND as usize].pf1;
    const PF_L1: bool = TUNE[F::KIND as usize].pf_l1;
    /// One 64-byte line holds 64 / (group bytes) groups (MXFP4: 4), at least one.
    const U: usize = {
        let g = F::KIND.info().group_bytes;
        if g >= 64 {
            1
        } else {
            64 / g
        }
    };
    const ROWS1: usize = TUNE[F::KIND as usize].rows1;
    const FEW_TOKENS: usize = {
        let n = TUNE[F::KIND as usize].few;
        assert!(n <= FEW, "rows_few takes at most FEW tokens");
        n
    };
    const SMALL_TOKENS: usize = {
        let n = TUNE[F::KIND as usize].small;
        assert!(n <= SMALL, "rows_small takes at most SMALL tokens");
        n
    };
    #[inline(always)]
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8) {
        // SAFETY: forwarded.
        unsafe { Format::at(self, r, q) }
    }
    #[inline(always)]
    unsafe fn dec(p: *const u8, s: u8) -> [__m512; 2] {
        // SAFETY: forwarded.
        unsafe { F::decode::<Avx512>(p, s) }
    }
    #[inline(always)]
    fn spans(&self, r0: usize, r1: usize) -> [(*const u8, usize); 2] {
        Format::spans(self, r0, r1)
    }
}

/// The one-token loop's prefetch of the line at `p`, with the format's hint.
#[inline(always)]
fn prefetch_row<F: Fmt>(p: *const u8) {
    if F::PF_L1 {
        prefetch_l1(p);
    } else {
        prefetch_l2(p);
    }
}

/// Software prefetch of the first `bytes` of rows `r0..r1` (clamped to the
/// matrix): the heads of the next tile's rows, which the in-row prefetch cannot reach.
/// `f` describes `m`; prefetches never fault.
#[inline(always)]
fn prefetch_heads<F: Fmt>(f: F, m: &Mat<'_>, r0: usize, r1: usize, bytes: usize) {
    if m.cols < GROUP_COLS {
        return;
    }
    for row in r0..r1.min(m.rows) {
        // Hints only: the row's start address (from `spans`, no read of the weights or,
        // for MXFP4, of its scale byte), lines formed with wrapping_add.
        prefetch_lines(f.spans(row, row + 1)[0].0, bytes);
    }
}

/// `T` tokens (one for decode, a few for an expert's tokens in a prompt), one f32 block
/// (groups `q0..qe`) of rows `r..r+R`: each group's activations are loaded once, then
/// every row's group is loaded, decoded and multiplied into every token (R weight streams
/// side by side, each weight decoded once for the T tokens); the lanes' f32 partials are
/// promoted into `acc[j * os + t]` at the end. `PF` is the software prefetch distance in
/// bytes along each row (0: none), a constant so that the prefetch address is the load's
/// with a displacement (as a run-time value it cost every row a second pointer, and the
/// row pointers no longer fit the registers). `NX` ([`NX_NONE`], [`NX_ROWS`],
/// [`NX_SPAN`]) says what else each run of groups prefetches into L1 (addresses only):
/// nothing; the same groups of the rows at `next` (group 0 of each row: the next row
/// tile's block, see [`NX_TOKENS`]); or `R` lines of the span from `next[0]`, in order,
/// the run's `R` lines of the tile's bytes (the next row tile of contiguous rows,
/// [`short_tile`]).
///
/// # Safety
/// Rows `r..r+R` exist in `m` and `f` describes `m`; groups below `qf` are full, a group
/// `qf` (if `< qe`) is the staged partial one in `pbuf`/`psc`; `xp + t * xs` (`t < T`)
/// holds one permuted token each; `acc.len() > (R - 1) * os + T - 1`, `os >= T`; AVX-512F
/// enabled in the caller.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn seg<F: Fmt, const R: usize, const T: usize, const PF: usize, const NX: u8>(
    f: F,
    r: usize,
    (q0, qe, qf): (usize, usize, usize),
    (pbuf, psc): (&[[u8; 128]; R], &[u8; R]),
    (xp, xs): (*const f32, usize),
    (acc, next): (&mut [[f64; LANES]], &[*const u8; R]),
    os: usize,
) {
    // SAFETY (whole body): groups < qf are read in place, the partial one from pbuf; x
    // reads stay inside the tokens (32 values at 32q < their length); acc indices
    // j * os + t <= (R - 1) * os + T - 1.
    unsafe {
        let mut a = [[Avx512::zero(); T]; R];
        let qm = qf.clamp(q0, qe);
        // Group `q`: its activations loaded once, row `j`'s weights decoded by `$w`.
        macro_rules! group {
            ($q:expr, $j:ident => $w:expr) => {{
                let mut xv = [Avx512::zero(); T];
                for (t, xt) in xv.iter_mut().enumerate() {
                    *xt = Avx512::load(xp.add(t * xs + GROUP_COLS * $q));
                }
                for ($j, aj) in a.iter_mut().enumerate() {
                    let w: [__m512; 2] = $w;
                    for (ajt, xt) in aj.iter_mut().zip(xv.iter()) {
                        *ajt = Avx512::fma(w, *xt, *ajt);
                    }
                }
            }};
        }
        let mut q = q0;
        // Full groups in runs of U (one cache line of every row's weights): each row's
        // line ahead is prefetched once per run.
        while q + F::U <= qm {
            if PF != 0 {
                for j in 0..R {
                    let (p, _) = f.at(r + j, q);
                    // A hint: it never faults; wrapping_add keeps the arithmetic defined.
                    prefetch_row::<F>(p.wrapping_add(PF));
                }
            }
            // The next row tile (hints, as above).
            let gb = F::KIND.info().group_bytes;
            if NX == NX_ROWS {
                for nj in next {
                    prefetch_lines(nj.wrapping_add(q * gb), F::U * gb);
                }
            } else if NX == NX_SPAN {
                prefetch_lines(next[0].wrapping_add(q * gb * R), R * F::U * gb);
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
        for (j, aj) in a.iter().enumerate() {
            for (t, ajt) in aj.iter().enumerate() {
                Avx512::promote(ajt, &mut acc[j * os + t]);
            }
        }
    }
}

/// Rows `r..r+R` × `T` tokens (`xp + t * xs`), block by block. Sums into
/// `out[j * os + t]`.
///
/// # Safety
/// As [`seg`]; `out.len() > (R - 1) * os + T - 1`.
#[inline(always)]
unsafe fn tile<F: Fmt, const R: usize, const T: usize, const N: usize, const PF: usize>(
    f: F,
    m: &Mat<'_>,
    r: usize,
    x: (*const f32, usize),
    out: &mut [f64],
    os: usize,
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
    // N = R * T lane sums (a parameter of its own: array lengths cannot be computed from
    // generic parameters on stable Rust), so a one-token tile zeroes only its R sums.
    let mut acc = [[0f64; LANES]; N];
    debug_assert_eq!(N, R * T);
    let mut q = 0;
    // A tile of short rows prefetches the next tile's bytes, in order, instead of a line
    // ahead in each of its rows ([`short_tile`]). Addresses only: `spans` computes them
    // without reading, also past the matrix's last row, and a prefetch never faults.
    let ahead = PF != 0 && short_tile(R, f.spans(r, r + 1)[0].1);
    let next: [*const u8; R] = [f.spans(r + R, r + 2 * R)[0].0; R];
    // SAFETY: the caller's guarantees, passed on to seg with q ranges inside 0..ng.
    unsafe {
        if PF != 0 && !ahead {
            prefetch_heads(f, m, r + R, r + 2 * R, PF);
        }
        while q < ng {
            let qe = (q + BLOCK_GROUPS).min(ng);
            let b = (q, qe, full);
            if ahead {
                let a = (&mut acc[..], &next);
                seg::<F, R, T, 0, NX_SPAN>(f, r, b, (&pbuf, &psc), x, a, T);
            } else {
                let a = (&mut acc[..], &[std::ptr::null(); R]);
                seg::<F, R, T, PF, NX_NONE>(f, r, b, (&pbuf, &psc), x, a, T);
            }
            q = qe;
        }
    }
    for j in 0..R {
        for t in 0..T {
            // SAFETY: AVX-512F is enabled in the caller.
            out[j * os + t] = unsafe { Avx512::reduce(&mut acc[j * T + t]) };
        }
    }
}

/// [`seg`] prefetches nothing beyond its own rows.
const NX_NONE: u8 = 0;
/// [`seg`] prefetches the same groups of the rows at `next`.
const NX_ROWS: u8 = 1;
/// [`seg`] prefetches the span from `next[0]` in order, `R` lines a run of groups.
const NX_SPAN: u8 = 2;

/// A form the batched path stages a row group's block in: how a group is written into the
/// staging buffer, and how the register tile reads it back. Both forms hold the same exact
/// f32 weights, so the FMAs, and the results, are the same bit for bit; which is faster
/// depends on the core ([`WeightStaging`]).
trait Staging {
    /// Bytes of one staged group of one row.
    const GB: usize;
    /// Write group `(r, q)` of `f` in this form to `dst`: full groups from the matrix,
    /// the partial one from `part`, its zero-padded copy and scale byte (see
    /// [`stage_partial`]).
    ///
    /// # Safety
    /// `(r, q)` is a full group of the matrix when `part` is `None`; `dst` has room for
    /// `GB` bytes; AVX-512F enabled in the caller.
    unsafe fn put<F: Fmt>(f: F, r: usize, q: usize, part: Option<(&[u8; 128], u8)>, dst: *mut u8);
    /// Read one staged group at `p` into (lanes 0..15, lanes 16..31).
    ///
    /// # Safety
    /// `GB` readable bytes at `p`; AVX-512F enabled in the caller.
    unsafe fn get(p: *const u8) -> [__m512; 2];
}

/// Bf16 pairs, for formats whose weights are exact bf16
/// ([`format::FormatInfo::bf16_exact`]): dword `l` of a staged group is `(even weight >>
/// 16) | odd weight`, widened back into the same two f32 lanes by a shift and an `and` in
/// every tile pass (the BF16 decode). Groups are decoded once and packed, so the tile reads
/// one 64-byte line per row and group instead of two. Only MXFP4 products are staged this
/// way: BF16 ones take [`rows_small`]'s passes in place wherever staging is bf16.
struct Bf16Pairs;

impl Staging for Bf16Pairs {
    const GB: usize = 64;
    #[inline(always)]
    unsafe fn put<F: Fmt>(f: F, r: usize, q: usize, part: Option<(&[u8; 128], u8)>, dst: *mut u8) {
        debug_assert!(F::KIND.info().bf16_exact);
        // SAFETY: the group's bytes are read in place or from the copy; 64 bytes are
        // written at dst (caller).
        unsafe {
            let [even, odd] = f.group(r, q, part);
            let pair = _mm512_or_si512(
                _mm512_srli_epi32(_mm512_castps_si512(even), 16),
                _mm512_castps_si512(odd),
            );
            _mm512_storeu_si512(dst as *mut _, pair);
        }
    }
    #[inline(always)]
    unsafe fn get(p: *const u8) -> [__m512; 2] {
        // SAFETY: forwarded (64 bytes at p).
        unsafe { Avx512::bf16(p) }
    }
}

/// Lane-ordered f32, for every format: each group decoded once per block, so the tile
/// passes take two plain loads per row and group and no integer operation. The only form
/// for F32 weights (they need all 32 bits).
struct LaneF32;

impl Staging for LaneF32 {
    const GB: usize = 128;
    #[inline(always)]
    unsafe fn put<F: Fmt>(f: F, r: usize, q: usize, part: Option<(&[u8; 128], u8)>, dst: *mut u8) {
        // SAFETY: the group's bytes are read in place or from the copy; 128 bytes are
        // written at dst (caller).
        unsafe {
            let [a, b] = f.group(r, q, part);
            _mm512_storeu_ps(dst as *mut f32, a);
            _mm512_storeu_ps(dst.add(64) as *mut f32, b);
        }
    }
    #[inline(always)]
    unsafe fn get(p: *const u8) -> [__m512; 2] {
        // SAFETY: 128 readable bytes at p (caller).
        unsafe { Avx512::load(p as *const f32) }
    }
}

/// Rows per register tile of the batched path, and per staged row group.
const RB: usize = 4;
/// Tokens per register tile of the batched path (RB × TB × 2 = 16 accumulators, RB × 2
/// weights and 2 activations: 26 of the 32 zmm registers; 4 × 2 ran more FMAs per cycle
/// than 2 × 4).
pub const TB: usize = 2;
/// Tokens whose f64 lane sums one pass over a row group keeps (RB × TC × 256 bytes =
/// 16 KiB, in L1); a larger batch is taken in further passes that stage the weights again.
const TC: usize = 16;

/// The f64 lane sums of a row group's pass, on cache lines (a promotion's 64-byte
/// read-add-write of a line-straddling sum costs two L1 accesses each way).
#[repr(C, align(64))]
struct Acc([[f64; LANES]; RB * TC]);

/// One row group's block in staged form, group-major (group `q`, row `j` at
/// `(q * RB + j) * GB`), so the tile reads it as one sequential stream.
#[repr(C, align(64))]
struct StageBuf([u8; RB * BLOCK_GROUPS * 128]);

/// One f32 block (`ng` staged groups at `w`) of the RB rows × tokens `x + t * stride`
/// (`t < T`, each pointing at the block's first column): the register tile's f32 lane
/// partials, promoted into `acc[j * tc + t]` at the end.
///
/// # Safety
/// `w` holds `ng` staged groups of RB rows; every token has `32 * ng` readable values at
/// its pointer; `acc.len() >= (RB - 1) * tc + T`; AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn tile_block<S: Staging, const T: usize>(
    w: *const u8,
    ng: usize,
    x: *const f32,
    stride: usize,
    acc: &mut [[f64; LANES]],
    tc: usize,
) {
    // SAFETY (whole body): reads stay inside the staged block and the tokens' blocks
    // (caller); acc indices j * tc + t < (RB - 1) * tc + T.
    unsafe {
        let mut a = [[Avx512::zero(); T]; RB];
        for q in 0..ng {
            let g = w.add(q * RB * S::GB);
            let mut wq = [Avx512::zero(); RB];
            for (j, wj) in wq.iter_mut().enumerate() {
                *wj = S::get(g.add(j * S::GB));
            }
            for t in 0..T {
                let xq = Avx512::load(x.add(t * stride + GROUP_COLS * q));
                for j in 0..RB {
                    a[j][t] = Avx512::fma(wq[j], xq, a[j][t]);
                }
            }
        }
        for j in 0..RB {
            for t in 0..T {
                Avx512::promote(&a[j][t], &mut acc[j * tc + t]);
            }
        }
    }
}

/// Rows `r0..r1` × all `ntok` tokens, batched. Tokens go in passes of up to [`TC`]
/// (outermost), rows in groups of [`RB`] (a group past the last row is padded with zero
/// weights, whose sums are dropped). Per pass and group, block by block (1024 columns):
/// the group's block is staged into an aligned L1 buffer ([`Staging::put`]: raw bf16,
/// MXFP4 decoded once into exact bf16 pairs, F32 into lane-ordered f32; the partial group
/// zero-padded), and every token tile of up to [`TB`] tokens runs the block in registers
/// ([`tile_block`]) and promotes into its f64 lane sums; meanwhile [`Ahead`] prefetches
/// the next group. A pass takes the row groups outermost ([`pass_by_group`]) while its
/// tokens' activations fit L2 ([`PASS_X_BYTES`]), else the blocks ([`pass_by_block`]).
/// Each (row, token) lane performs exactly the contract's FMA chain (in increasing group
/// order), promotes at the end of each block and reduces by the shared tree, so results
/// equal the one-token kernel bit for bit, in either order.
///
/// # Safety
/// `f` describes `m`, `r1 <= m.rows`; `xp` holds `ntok` permuted tokens; `out` has room for
/// `(r1 - r0) * ntok` sums; AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn rows_batched<F: Fmt, S: Staging>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    xp: *const f32,
    ntok: usize,
    out: &mut [f64],
) {
    let stride = x_stride(m.cols);
    // Neither buffer is read before it is written: the stage block by block, the sums
    // pass by pass (zeroed at each pass's start). Zero-filling both (32 KiB) for every
    // task cost a small product (an expert's few tokens) about a tile pass.
    let mut buf = std::mem::MaybeUninit::<StageBuf>::uninit();
    let mut sums = std::mem::MaybeUninit::<Acc>::uninit();
    let dst = buf.as_mut_ptr() as *mut u8;
    // The lane sums of every row of a pass by blocks (allocated at its first pass).
    let mut wide: Option<AlignedBuf<f64>> = None;
    let mut c0 = 0;
    while c0 < ntok {
        let tc = (ntok - c0).min(TC);
        let toks = (ntok, c0, tc);
        // SAFETY: the caller's guarantees; tokens c0..c0 + tc < ntok.
        unsafe {
            if tc * stride * 4 <= PASS_X_BYTES {
                let acc = sums.as_mut_ptr() as *mut [f64; LANES];
                pass_by_group::<F, S>(f, m, (r0, r1), xp, toks, out, (acc, dst));
            } else {
                let n = (r1 - r0).div_ceil(RB) * RB * TC * LANES;
                let acc = wide.get_or_insert_with(|| AlignedBuf::new(n));
                let acc = acc.as_mut_ptr() as *mut [f64; LANES];
                pass_by_block::<F, S>(f, m, (r0, r1), xp, toks, out, (acc, dst));
            }
        }
        c0 += tc;
    }
}

/// Register-tile passes over one block of a row group: per pass of `tc` tokens, `tc / TB`
/// tiles of [`TB`] tokens and `tc % TB` of one.
const fn tile_passes(tc: usize) -> usize {
    tc / TB + tc % TB
}

/// The register tiles of one staged block (`stage`, groups `q..qe` of a row group) over
/// tokens `c0..c0 + tc`, their f64 lane sums `acc[j * tc + t]` (row `j` of the group,
/// token `c0 + t`); `ahead` steps once per tile.
///
/// # Safety
/// `stage` holds `qe - q` staged groups of RB rows; `xp` holds the tokens (stride
/// `stride`); `acc` has `RB * tc` entries; AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn tiles_over_block<S: Staging, const N: usize>(
    stage: *const u8,
    (q, qe): (usize, usize),
    (xp, stride): (*const f32, usize),
    (c0, tc): (usize, usize),
    acc: &mut [[f64; LANES]],
    ahead: &mut Ahead<N>,
) {
    let mut t0 = 0;
    while t0 < tc {
        let x = xp.wrapping_add((c0 + t0) * stride + GROUP_COLS * q);
        let a = &mut acc[t0..];
        ahead.step();
        // SAFETY: the staged block holds qe - q groups of RB rows; tokens c0 + t0.. have
        // their block's values at x (+ t * stride); acc has RB * tc >= (RB - 1) * tc + t0
        // + T entries (caller).
        unsafe {
            if t0 + TB <= tc {
                tile_block::<S, TB>(stage, qe - q, x, stride, a, tc);
                t0 += TB;
            } else {
                tile_block::<S, 1>(stage, qe - q, x, stride, a, tc);
                t0 += 1;
            }
        }
    }
}

/// One pass of tokens `c0..c0 + tc` (`toks = (ntok, c0, tc)`) over rows `r0..r1`, row
/// groups outermost: each group's lane sums (`acc`, room for `RB * TC`) stay in L1 for
/// all its blocks, and the pass's tokens (`TC` × 4 bytes a column) in L2 for all the row
/// groups, whose weights (a task's, a few hundred KiB at most) are read from memory in
/// the first pass and from L2 in the next ones; row groups outermost over all the tokens
/// streamed every token (more than L2 from 36 tokens of 7168 columns) once per group.
/// `dst` is the staging buffer ([`StageBuf`]).
///
/// # Safety
/// As [`rows_batched`] for tokens `c0..c0 + tc`; `acc` and `dst` are valid for writes of
/// `RB * TC` lane sums and a [`StageBuf`].
// Its own function, not inlined into the entry point (module docs, "Compile time").
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline(never)]
unsafe fn pass_by_group<F: Fmt, S: Staging>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    xp: *const f32,
    (ntok, c0, tc): (usize, usize, usize),
    out: &mut [f64],
    (acc, dst): (*mut [f64; LANES], *mut u8),
) {
    let ng = groups(m.cols);
    let full = m.cols / GROUP_COLS;
    let stride = x_stride(m.cols);
    let mut parts = [([0u8; 128], 0u8); RB];
    let mut g0 = r0;
    while g0 < r1 {
        let nr = (r1 - g0).min(RB);
        if full < ng {
            for (j, p) in parts.iter_mut().enumerate().take(nr) {
                p.1 = stage_partial(m, g0 + j, full, &mut p.0);
            }
        }
        // The next group's weights, over this group's tile passes.
        let next = (g0 + nr, (g0 + nr + RB).min(r1));
        let steps = ng.div_ceil(BLOCK_GROUPS) * tile_passes(tc);
        let mut ahead = Ahead::new(f.spans(next.0, next.1), steps);
        // SAFETY: RB * tc <= RB * TC lane sums fit the buffer (caller); they are zeroed
        // here before the slice over them is formed.
        let acc: &mut [[f64; LANES]] = unsafe {
            std::ptr::write_bytes(acc, 0, RB * tc);
            std::slice::from_raw_parts_mut(acc, RB * tc)
        };
        let mut q = 0;
        while q < ng {
            let qe = (q + BLOCK_GROUPS).min(ng);
            // SAFETY: rows g0..g0+nr < m.rows and groups q..qe < ng (full ones read in
            // place, the partial one from its copy); the staged block fits the buffer
            // (qe - q <= BLOCK_GROUPS, RB rows of at most 128 bytes a group); the tiles
            // read what was staged, tokens c0..c0 + tc < ntok.
            unsafe {
                stage_block::<F, S>(f, (g0, nr, full), (q, qe), &parts, dst);
                let x = (xp, stride);
                tiles_over_block::<S, 2>(dst, (q, qe), x, (c0, tc), acc, &mut ahead);
            }
            q = qe;
        }
        for j in 0..nr {
            for t in 0..tc {
                // SAFETY: AVX-512F is enabled in the caller.
                out[(g0 + j - r0) * ntok + c0 + t] =
                    unsafe { Avx512::reduce(&mut acc[j * tc + t]) };
            }
        }
        g0 += nr;
    }
}

/// Bytes of a pass's activations (`TC` tokens × 4 bytes a column) up to which it takes
/// the row groups outermost ([`pass_by_group`]: they stay in L2, 1 MiB a core on Zen 5,
/// for all the groups); a wider pass (the dense FFN's down projection, 33 792 columns: 2.2
/// MB) takes the blocks outermost ([`pass_by_block`]). On Zen 5, one thread, 96 rows ×
/// 33 792 columns × 128 tokens: 48-56 GMAC per CPU-second by blocks against 37-51 by
/// groups (MXFP4 62-63 against 54-55); at 12 288 columns (787 KB a pass) the two orders
/// were level, at 7168 by groups was ahead (docs/measurements.md, "Wide products by
/// blocks").
const PASS_X_BYTES: usize = 1 << 20;

/// One pass of tokens `c0..c0 + tc` over rows `r0..r1`, blocks outermost: per block, every
/// row group in turn is staged and runs its tiles, so one block of the pass's tokens
/// (`TC` × 4 KiB) stays in L1 and L2 for all the groups and the whole pass's activations
/// are read from memory once, however wide the matrix. The lane sums of every row of the
/// pass (`acc`, room for `RB * TC` per row group: 384 KiB for a task of 96 rows) live in
/// L2 between blocks. [`Ahead`] prefetches the next group's block (the next block's first
/// group after the last).
///
/// # Safety
/// As [`pass_by_group`]; `acc` is valid for writes of `RB * TC` lane sums per row group of
/// `r0..r1`.
// Its own function, not inlined into the entry point (module docs, "Compile time").
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline(never)]
unsafe fn pass_by_block<F: Fmt, S: Staging>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    xp: *const f32,
    (ntok, c0, tc): (usize, usize, usize),
    out: &mut [f64],
    (acc, dst): (*mut [f64; LANES], *mut u8),
) {
    let ng = groups(m.cols);
    let full = m.cols / GROUP_COLS;
    let stride = x_stride(m.cols);
    let n = (r1 - r0).div_ceil(RB) * RB * tc;
    // SAFETY: n lane sums fit the buffer (caller); zeroed before the slice is formed.
    let acc: &mut [[f64; LANES]] = unsafe {
        std::ptr::write_bytes(acc, 0, n);
        std::slice::from_raw_parts_mut(acc, n)
    };
    let mut parts = [([0u8; 128], 0u8); RB];
    let mut q = 0;
    while q < ng {
        let qe = (q + BLOCK_GROUPS).min(ng);
        let mut g0 = r0;
        while g0 < r1 {
            let nr = (r1 - g0).min(RB);
            if qe > full {
                for (j, p) in parts.iter_mut().enumerate().take(nr) {
                    p.1 = stage_partial(m, g0 + j, full, &mut p.0);
                }
            }
            let (nq, ng0) = if g0 + nr < r1 { (q, g0 + nr) } else { (qe, r0) };
            let nb = (nq, (nq + BLOCK_GROUPS).min(ng));
            let spans = block_spans(f, m, (ng0, (ng0 + RB).min(r1)), nb);
            let mut ahead = Ahead::new(spans, tile_passes(tc));
            let a = &mut acc[(g0 - r0) * tc..];
            // SAFETY: as in pass_by_group; the group's sums are RB * tc entries from
            // (g0 - r0) * tc, inside the n of acc.
            unsafe {
                stage_block::<F, S>(f, (g0, nr, full), (q, qe), &parts, dst);
                let x = (xp, stride);
                tiles_over_block::<S, { 2 * RB }>(dst, (q, qe), x, (c0, tc), a, &mut ahead);
            }
            g0 += nr;
        }
        q = qe;
    }
    for r in r0..r1 {
        for t in 0..tc {
            // SAFETY: AVX-512F is enabled in the caller.
            out[(r - r0) * ntok + c0 + t] = unsafe { Avx512::reduce(&mut acc[(r - r0) * tc + t]) };
        }
    }
}

/// Stage groups `q..qe` of the row group at `g0` (`nr` real rows): full groups read in
/// place, the partial one from its zero-padded copy in `parts`, rows past `nr` as zero
/// weights. A block of whole groups of every row (nearly all of them) is copied row by row
/// without the per-group checks (a measurable share of a few-token MXFP4 product).
///
/// # Safety
/// Rows `g0..g0 + nr` exist in the matrix `f` describes, `full` is its count of full
/// groups and `parts[j]` row `g0 + j`'s staged partial group when `qe > full`; `dst` has
/// room for `(qe - q) * RB` staged groups; AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn stage_block<F: Fmt, S: Staging>(
    f: F,
    (g0, nr, full): (usize, usize, usize),
    (q, qe): (usize, usize),
    parts: &[([u8; 128], u8); RB],
    dst: *mut u8,
) {
    let gb = S::GB;
    if nr == RB && qe <= full {
        for j in 0..RB {
            for qq in q..qe {
                // SAFETY: row g0 + j and group qq are real and full; inside the buffer.
                unsafe { S::put(f, g0 + j, qq, None, dst.add(((qq - q) * RB + j) * gb)) };
            }
        }
        return;
    }
    for qq in q..qe {
        for (j, part) in parts.iter().enumerate() {
            // SAFETY: inside the buffer (caller); rows below nr are real, their groups
            // below full read in place and the partial one from its copy.
            unsafe {
                let d = dst.add(((qq - q) * RB + j) * gb);
                if j >= nr {
                    std::ptr::write_bytes(d, 0, gb);
                } else {
                    let part = (qq >= full).then_some((&part.0, part.1));
                    S::put(f, g0 + j, qq, part, d);
                }
            }
        }
    }
}

/// Software prefetch of the next row group's weights, spread over the current
/// group's work: [`Ahead::step`] is called once per register-tile pass and prefetches its
/// share of the lines, so every line is asked for a whole row group ahead of its staging
/// (a block ahead, asked for in one burst, arrived too late: the staging copy stalled on
/// memory as long as the tiles computed). `N` spans: the rows' weights and scales (2), or
/// one block of each of a group's rows ([`block_spans`]).
struct Ahead<const N: usize> {
    spans: [(*const u8, usize); N],
    /// Bytes of `spans` already prefetched.
    done: usize,
    /// Bytes per step.
    per: usize,
}

impl<const N: usize> Ahead<N> {
    /// Prefetch `spans` over `steps` calls of [`Ahead::step`].
    fn new(spans: [(*const u8, usize); N], steps: usize) -> Self {
        let total: usize = spans.iter().map(|s| s.1).sum();
        let per = total.div_ceil(steps.max(1)).div_ceil(64) * 64;
        Ahead {
            spans,
            done: 0,
            per,
        }
    }

    /// Prefetch the next share (hints only: prefetches never fault, and the addresses are
    /// formed with wrapping arithmetic).
    #[inline(always)]
    fn step(&mut self) {
        let (lo, mut base) = (self.done, 0);
        let hi = lo + self.per;
        for &(p, n) in &self.spans {
            if lo < base + n && hi > base {
                let a = lo.max(base) - base;
                prefetch_lines(p.wrapping_add(a), hi.min(base + n) - base - a);
            }
            base += n;
        }
        self.done = hi.min(base);
    }
}

/// The bytes of groups `q..qe` of rows `g0..g1` (at most [`RB`]): per row, its weights
/// and its scales (empty without scales); spans past `g1` are empty. Addresses only.
#[inline(always)]
fn block_spans<F: Fmt>(
    f: F,
    m: &Mat<'_>,
    (g0, g1): (usize, usize),
    (q, qe): (usize, usize),
) -> [(*const u8, usize); 2 * RB] {
    let info = F::KIND.info();
    let (wb, sb) = (info.row_bytes(m.cols), info.row_scale_bytes(m.cols));
    let mut out = [(std::ptr::null::<u8>(), 0usize); 2 * RB];
    for (j, row) in (g0..g1.min(m.rows)).take(RB).enumerate() {
        let [(w, _), (s, _)] = f.spans(row, row + 1);
        let (w0, w1) = (
            (q * info.group_bytes).min(wb),
            (qe * info.group_bytes).min(wb),
        );
        out[2 * j] = (w.wrapping_add(w0), w1 - w0);
        let (s0, s1) = (
            (q * info.scale_bytes).min(sb),
            (qe * info.scale_bytes).min(sb),
        );
        out[2 * j + 1] = (s.wrapping_add(s0), s1 - s0);
    }
    out
}

/// Rows `r0..r1` × one token, in tiles of `rows` rows (2, 4, 6 or 8) side by side, the
/// remainder in tiles of 4, 2 and 1; `PF` bytes of software prefetch along each row.
///
/// # Safety
/// `f` describes `m`, `r1 <= m.rows`; `x` holds one permuted token; `out` has room for
/// `r1 - r0` sums; AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn rows1<F: Fmt, const PF: usize>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    x: *const f32,
    rows: usize,
    out: &mut [f64],
) {
    let (mut r, rs, x) = (r0, (r0, r1), (x, 0));
    // SAFETY: the caller's guarantees (one token: stride 0, one sum per row).
    unsafe {
        match rows {
            8 => r = tiles::<F, 8, 1, 8, PF>(f, m, (r, rs), x, 1, out),
            6 => r = tiles::<F, 6, 1, 6, PF>(f, m, (r, rs), x, 1, out),
            2 => r = tiles::<F, 2, 1, 2, PF>(f, m, (r, rs), x, 1, out),
            _ => {}
        }
        // The remainder (and the default) in tiles of 4, then 2, then single rows.
        r = tiles::<F, 4, 1, 4, PF>(f, m, (r, rs), x, 1, out);
        r = tiles::<F, 2, 1, 2, PF>(f, m, (r, rs), x, 1, out);
        tiles::<F, 1, 1, 1, PF>(f, m, (r, rs), x, 1, out);
    }
}

/// Rows from `r` on, in tiles of `R` rows × `T` tokens (`N = R * T`), while a whole tile
/// fits below `r1`; sums of row `i` into `out[(i - r0) * os + t]`. Returns the first row
/// not done (`r1` when `R` is 1).
///
/// # Safety
/// As [`tile`] for every tile: rows `r..r1` exist in `m`, `f` describes it, `x.0 + t *
/// x.1` (`t < T`) holds one permuted token each, `out` has room for `(r1 - r0) * os`
/// sums; AVX-512F enabled in the caller.
// Its own function, not inlined into the entry point (module docs, "Compile time").
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline(never)]
unsafe fn tiles<F: Fmt, const R: usize, const T: usize, const N: usize, const PF: usize>(
    f: F,
    m: &Mat<'_>,
    (mut r, (r0, r1)): (usize, (usize, usize)),
    x: (*const f32, usize),
    os: usize,
    out: &mut [f64],
) -> usize {
    while r + R <= r1 {
        // SAFETY: rows r..r+R < r1 (caller) and their sums inside out.
        unsafe { tile::<F, R, T, N, PF>(f, m, r, x, &mut out[(r - r0) * os..], os) };
        r += R;
    }
    r
}

impl Driver for Avx512 {
    /// Rows `r0..r1` × all tokens with the f32-block contract: one token in [`rows1`],
    /// 2..=[`Fmt::FEW_TOKENS`] in [`rows_few`], more in [`rows_small`]'s passes of up to
    /// [`Fmt::SMALL_TOKENS`] (with f32 staging up to [`SMALL_F32_STAGING`] tokens), the
    /// rest (MXFP4, and BF16 or F32 with f32 staging) in [`rows_batched`] (staged as
    /// [`Bf16Pairs`] or [`LaneF32`]).
    #[inline(always)]
    unsafe fn drive<F: Format>(
        f: F,
        m: &Mat<'_>,
        (r0, r1): (usize, usize),
        xp: &[f32],
        ntok: usize,
        out: &mut [f64],
        tuning: &DriverTuning,
    ) {
        let stride = x_stride(m.cols);
        assert!(xp.len() >= ntok * stride);
        assert!(out.len() >= (r1 - r0) * ntok);
        assert!(r1 <= m.rows);
        let x = xp.as_ptr();
        // SAFETY: every tile's rows lie in r0..r1 <= m.rows and its outputs in out
        // (asserted); AVX-512F is enabled in the caller.
        unsafe {
            if ntok == 1 {
                let rows = tuning.decode_rows.unwrap_or(<F as Fmt>::ROWS1);
                let pf = tuning
                    .decode_prefetch
                    .or_else(super::tuning::default_decode_prefetch)
                    .unwrap_or(<F as Fmt>::PF1);
                // The distance is a compile-time constant of the kernel: the nearest of
                // these.
                let rs = (r0, r1);
                match pf {
                    0 => rows1::<F, 0>(f, m, rs, x, rows, out),
                    1..=383 => rows1::<F, 256>(f, m, rs, x, rows, out),
                    384..=767 => rows1::<F, 512>(f, m, rs, x, rows, out),
                    768..=1535 => rows1::<F, 1024>(f, m, rs, x, rows, out),
                    1536..=3071 => rows1::<F, 2048>(f, m, rs, x, rows, out),
                    _ => rows1::<F, 4096>(f, m, rs, x, rows, out),
                }
            } else if ntok <= <F as Fmt>::FEW_TOKENS {
                if <F as Fmt>::PF >= 1024 {
                    rows_few::<F, 1024>(f, m, (r0, r1), x, ntok, out);
                } else {
                    rows_few::<F, 512>(f, m, (r0, r1), x, ntok, out);
                }
            } else if <F as Fmt>::SMALL_TOKENS >= 2
                && (tuning.staging == WeightStaging::Bf16 || ntok <= SMALL_F32_STAGING)
            {
                // Passes of up to SMALL_TOKENS tokens in place (a prompt's BF16 products
                // too, see SMALL); sums at out[(r - r0) * ntok + c0 + t].
                let pass = <F as Fmt>::SMALL_TOKENS;
                let mut c0 = 0;
                while c0 < ntok {
                    let tc = (ntok - c0).min(pass);
                    let xs = x.add(c0 * stride);
                    let o = &mut out[c0..];
                    if <F as Fmt>::PF >= 1024 {
                        rows_small::<F, 1024>(f, m, (r0, r1), xs, (tc, ntok), o);
                    } else {
                        rows_small::<F, 512>(f, m, (r0, r1), xs, (tc, ntok), o);
                    }
                    c0 += tc;
                }
            } else if <F as Format>::KIND.info().bf16_exact && tuning.staging == WeightStaging::Bf16
            {
                rows_batched::<F, Bf16Pairs>(f, m, (r0, r1), x, ntok, out);
            } else {
                rows_batched::<F, LaneF32>(f, m, (r0, r1), x, ntok, out);
            }
        }
    }
}

/// Most tokens the few-token path takes ([`rows_few`]); more go to [`rows_batched`].
const FEW: usize = 4;

/// Rows `r0..r1` × `ntok` (2..=[`FEW`]) tokens without staging: the one-token kernel's
/// loop with every decoded weight multiplied into all the tokens (tiles of 4 rows × 2
/// tokens, 2 rows × 3 or 4; 16 accumulators at most). A routed expert of a prompt sees a
/// few tokens (16 tokens × top-16 over 64 experts: 4 on average), where staging a group
/// (decode, store, reload, widen) cost more than the FMAs it fed. Same FMAs, same order,
/// same promotion and tree as every other path: bit for bit the portable result.
///
/// # Safety
/// `f` describes `m`, `r1 <= m.rows`; `x` holds `ntok` permuted tokens; `out` has room for
/// `(r1 - r0) * ntok` sums; AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn rows_few<F: Fmt, const PF: usize>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    x: *const f32,
    ntok: usize,
    out: &mut [f64],
) {
    let (rs, x) = ((r0, r1), (x, x_stride(m.cols)));
    // SAFETY: the caller's guarantees; every tile writes rows × ntok sums from
    // (r - r0) * ntok.
    unsafe {
        match ntok {
            2 => {
                let r = tiles::<F, 4, 2, 8, PF>(f, m, (r0, rs), x, ntok, out);
                tiles::<F, 1, 2, 2, PF>(f, m, (r, rs), x, ntok, out);
            }
            3 => {
                let r = tiles::<F, 2, 3, 6, PF>(f, m, (r0, rs), x, ntok, out);
                tiles::<F, 1, 3, 3, PF>(f, m, (r, rs), x, ntok, out);
            }
            _ => {
                let r = tiles::<F, 2, 4, 8, PF>(f, m, (r0, rs), x, ntok, out);
                tiles::<F, 1, 4, 4, PF>(f, m, (r, rs), x, ntok, out);
            }
        }
    }
}

/// Most tokens one [`rows_small`] pass takes. Where staging is bf16 (the AMD default),
/// BF16 and F32 products of more tokens (a prompt's) take passes of this many in place,
/// and only MXFP4 ones are staged ([`rows_batched`]); with f32 staging see
/// [`SMALL_F32_STAGING`]. 16 since its chunks are one row tile ([`CHUNK`]). Zen 4, one
/// thread, alternated, `kernel_micro bf16`, GMAC/s, staged → in place: at 10-16 tokens
/// 40.5-43.1 → 44.5-46.3 in cache (128 × 7168), from DRAM (12 288 rows) at 12 and 16
/// tokens 29.9-32.4 → 36.2-36.5 and 35.5-36.1 → 38.3-38.5 (15 tokens level); the dense
/// FFN's width (33 792 columns, which staging takes blocks outermost) from DRAM at 16 and
/// 64 tokens 27.4-29.7 → 34.3-37.0 and 21.2-24.1 → 34.6-34.8; at 32 and 64 tokens in
/// cache 40.1-41.8 → 44.3-44.9; `gemv_bench --only batch16` on two threads 69.3-72.2 →
/// 76.1-77.2. The 16-token prompt 5% faster, a 512-token one 27.1 → 26.0 s
/// (docs/measurements.md, "Sixteen tokens without staging" and "Prompts of more than 16
/// tokens in place too").
const SMALL: usize = 16;

/// Most tokens that [`rows_small`] takes where the batched path stages in f32
/// ([`WeightStaging::F32`], the default on Intel, measured faster there); more go to
/// [`rows_batched`], as before [`SMALL`] grew on Zen 4, where staging is bf16: the
/// in-place passes were measured on AMD hosts only.
const SMALL_F32_STAGING: usize = 8;

/// Most tokens for which [`rows_small`]'s last token pair of a row tile, when it is the
/// tile's last pass (an even count: 4, 6, ... 16), prefetches the next row tile's block into
/// L1 (`T0`), so that the weights keep coming while that pair computes from L1 (the
/// first pair of every tile stalled on them, the later ones read none). Zen 5, one
/// thread, alternating: from DRAM, `gemv_bench --only "batch4 kda"` (the `serve
/// --parallel 4` pass's shape) 29.6-30.4 → 36.2-38.4 GMAC per CPU-second (2 threads
/// 28.7-30.4 → 35.2-37.6), `kernel_micro` over 12 288 × 7168 at 6 tokens 39-43 → 46-47,
/// at 8 49-50 → 53-55; in cache level at 6 and 8, 61-63 → 65-66 at 4. Where a single
/// token's pass follows (3, 5, 7) it lost in cache (the lines wait in L1 longer), and
/// into L2 (`T1`) it did not pay (docs/measurements.md, "Wide products by blocks"). With
/// a chunk of one tile ([`CHUNK`]) the next row tile's block is the same rows' next one.
const NX_TOKENS: usize = SMALL;

/// Rows per chunk of [`rows_small`]: the row tiles that take one block of the tokens in
/// turn. One tile of 4: each of its rows is then read from memory as one run, block after
/// block (the second token pair prefetches the same rows' next block), where a chunk of 16
/// took 2 KiB of each of 16 rows in turn; the tokens' block (4 KiB a token) comes from L2
/// for every tile instead of staying in L1 for four. Zen 4, from DRAM, alternated 3
/// rounds: `gemv_bench --only batch4` (the `serve --parallel 4` pass's shape, 12 288 ×
/// 7168) 24.1-24.5 → 26.4-28.8 GMAC/s on one thread, 38.8-45.2 → 49.1-56.1 on two; a
/// chunk of 8 was between; `kernel_micro bf16` at 3-8 tokens level or faster in cache
/// (docs/measurements.md, "Four tokens from memory: one row tile a chunk").
const CHUNK: usize = 4;

/// The f64 lane sums of one [`rows_small`] chunk ([`CHUNK`] rows × [`SMALL`] tokens at
/// most, 16 KiB), on cache lines.
#[repr(C, align(64))]
struct SmallAcc([[f64; LANES]; CHUNK * SMALL]);

/// Rows `r0..r1` × `ntok` (1..=[`SMALL`]: a larger product's last pass may hold one)
/// tokens without staging, sums of row `r` at `out[(r - r0) * os + t]` (`os >= ntok`: a
/// pass of a larger product's tokens), in chunks of up to [`CHUNK`] rows. Per chunk,
/// block by block (1024 columns), every tile of 4 rows takes the tokens two at a time in
/// the one-token loop's register tile (4 rows × 2 tokens, 16 zmm accumulators, [`seg`];
/// an odd last token in a 4 × 1 tile), each weight decoded in registers (BF16: a shift and
/// an `and`) and multiplied into both tokens. A tile's block of weights stays in L1 for
/// all its token pairs; where staging copied every block to a buffer and read it back for
/// each pair, this reads the weights once from memory and then from L1. Rows past the last
/// whole tile of 4 take tiles of 2 and 1 rows. Every (row, token) lane runs the contract's
/// FMA chain in increasing group order from +0 and is promoted once at the block's end,
/// then the shared tree: bit for bit the portable result.
///
/// # Safety
/// `f` describes `m`, `r1 <= m.rows`; `x` holds `ntok` permuted tokens; `out` has room for
/// `(r1 - r0 - 1) * os + ntok` sums; `ntok <= SMALL` and `ntok <= os`; AVX-512F enabled in
/// the caller.
#[inline(always)]
unsafe fn rows_small<F: Fmt, const PF: usize>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    x: *const f32,
    (ntok, os): (usize, usize),
    out: &mut [f64],
) {
    let mut r = r0;
    // Chunks of whole row tiles of 4, 2 and 1 rows. (No closure here: a closure would not
    // inherit the entry point's target features.)
    for rows in [4, 2, 1] {
        while r + rows <= r1 {
            let n = ((r1 - r) / rows * rows).min(CHUNK);
            let o = &mut out[(r - r0) * os..];
            // SAFETY: the caller's guarantees; the chunk's rows r..r+n lie in r0..r1 and
            // its sums (row stride os) in out from (r - r0) * os.
            unsafe {
                match rows {
                    4 => small_chunk::<F, 4, PF>(f, m, (r, r + n), x, (ntok, os), o),
                    2 => small_chunk::<F, 2, PF>(f, m, (r, r + n), x, (ntok, os), o),
                    _ => small_chunk::<F, 1, PF>(f, m, (r, r + n), x, (ntok, os), o),
                }
            }
            r += n;
        }
    }
}

/// Rows `c0..c1` (whole tiles of `R`, at most [`CHUNK`]) × `ntok` tokens (see
/// [`rows_small`]); sums into `out[(r - c0) * os + t]`.
///
/// # Safety
/// Rows `c0..c1` exist in `m`, `f` describes it; `x + t * x_stride(m.cols)` (`t < ntok`)
/// holds one permuted token each; `ntok <= os`, `out.len() >= (c1 - c0 - 1) * os + ntok`;
/// AVX-512F enabled in the caller.
// Its own function, not inlined into the entry point (module docs, "Compile time").
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline(never)]
unsafe fn small_chunk<F: Fmt, const R: usize, const PF: usize>(
    f: F,
    m: &Mat<'_>,
    (c0, c1): (usize, usize),
    x: *const f32,
    (ntok, os): (usize, usize),
    out: &mut [f64],
) {
    let ng = groups(m.cols);
    let full = m.cols / GROUP_COLS;
    let stride = x_stride(m.cols);
    let nr = c1 - c0;
    assert!(nr % R == 0 && nr <= CHUNK && ntok <= SMALL);
    let mut pbuf = [[0u8; 128]; CHUNK];
    let mut psc = [0u8; CHUNK];
    if full < ng {
        for j in 0..nr {
            psc[j] = stage_partial(m, c0 + j, full, &mut pbuf[j]);
        }
    }
    let mut sums = std::mem::MaybeUninit::<SmallAcc>::uninit();
    // SAFETY: nr * ntok <= CHUNK * SMALL lane sums fit the buffer; they are zeroed before
    // the slice over them is formed.
    let acc: &mut [[f64; LANES]] = unsafe {
        let p = sums.as_mut_ptr() as *mut [f64; LANES];
        std::ptr::write_bytes(p, 0, nr * ntok);
        std::slice::from_raw_parts_mut(p, nr * ntok)
    };
    // The next chunk's rows' heads, which the in-row prefetch cannot reach.
    if PF != 0 {
        prefetch_heads(f, m, c1, c1 + nr, PF);
    }
    let mut q = 0;
    while q < ng {
        let qe = (q + BLOCK_GROUPS).min(ng);
        for i in 0..nr / R {
            let (r, j0) = (c0 + i * R, i * R);
            let pb: &[[u8; 128]; R] = pbuf[j0..j0 + R].try_into().expect("R rows");
            let ps: &[u8; R] = psc[j0..j0 + R].try_into().expect("R rows");
            let pp = (pb, ps);
            // The next row tile's block (after the chunk's last tile, the first tile's
            // next block), prefetched by the second token pair (addresses only).
            let (nr0, nq) = if i + 1 < nr / R { (r + R, q) } else { (c0, qe) };
            let gb = F::KIND.info().group_bytes;
            let next: [*const u8; R] = std::array::from_fn(|j| {
                let row = f.spans(nr0 + j, nr0 + j + 1)[0].0;
                row.wrapping_add(nq * gb).wrapping_sub(q * gb)
            });
            let mut t0 = 0;
            while t0 < ntok {
                let xt = (x.wrapping_add(t0 * stride), stride);
                let a = (&mut acc[j0 * ntok + t0..], &next);
                // SAFETY: rows r..r+R lie in c0..c1 (caller), groups q..qe in 0..ng (full
                // ones read in place, the partial one from its copy); tokens t0.. < ntok
                // are at xt; the tile's sums (j0 + j) * ntok + t0 + t < nr * ntok. Only
                // the first pair of a block prefetches along the rows (the others find
                // the block in L1).
                unsafe {
                    let b = (q, qe, full);
                    match (ntok - t0 >= 2, t0 == 0) {
                        (true, true) => seg::<F, R, 2, PF, NX_NONE>(f, r, b, pp, xt, a, ntok),
                        (true, false) if t0 + 2 == ntok && ntok <= NX_TOKENS => {
                            seg::<F, R, 2, 0, NX_ROWS>(f, r, b, pp, xt, a, ntok)
                        }
                        (true, false) => seg::<F, R, 2, 0, NX_NONE>(f, r, b, pp, xt, a, ntok),
                        (false, _) => seg::<F, R, 1, 0, NX_NONE>(f, r, b, pp, xt, a, ntok),
                    }
                }
                t0 += 2;
            }
        }
        q = qe;
    }
    for (j, row) in acc.chunks_exact_mut(ntok).enumerate() {
        for (o, a) in out[j * os..j * os + ntok].iter_mut().zip(row.iter_mut()) {
            // SAFETY: AVX-512F is enabled in the caller.
            *o = unsafe { Avx512::reduce(a) };
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
    tuning: &DriverTuning,
) {
    // SAFETY: the features are enabled on this function (the caller checked the CPU).
    unsafe { format::rows::<Avx512>(m, (r0, r1), xp, ntok, out, tuning) }
}
