//! The `bf16x3` product path on AMX-BF16 (`TDPBF16PS`): the same split activations and
//! exact products as [`super::bf16x3`], summed by the tile unit, whose order inside a step
//! no scalar model reproduces (`tools/probes/amx_bits.c`). So this kernel has no portable
//! twin: on a CPU with AMX it is the one kernel of every product of a `bf16x3` run (one
//! token and batched alike), and its bits differ from the AVX512-BF16 kernel's. It is
//! tested against an f64 reference within its error budget and against itself across
//! batch shapes, row splits and tile positions (`tests/unit/amx.rs`).
//!
//! # Tiles
//!
//! `TDPBF16PS C, A, B` adds to each f32 `C[i][n]` the 32 products of row `i` of `A` (32
//! bf16) with column `n` of `B` (16 dwords of bf16 pairs, one per row of `B`).
//! - **A: weights.** 16 rows × one 32-column group, as shipped (BF16 copied, MXFP4 decoded
//!   with one `vpermw` per row and group, F32 split into three parts, each its own tile),
//!   read in place (BF16, few tokens), decoded a group ahead into a ring in L1 (MXFP4
//!   against one token tile: [`drive_decode`]) or staged per 2048-column block into an
//!   aligned buffer (`[group][part][row][32]`, 1 KiB a tile), zero rows past the task's
//!   last and zero columns past the matrix's last.
//! - **B: activations.** Each token's three parts (hi, mid, lo: [`super::bf16x3::split`])
//!   are three columns, prepared once per product ([`prepare`]): column `3t + k` of the
//!   product's activations is part `k` of token `t`, and tile `n` holds its columns `16n ..
//!   16n + 16` (a token's parts may straddle two tiles); row `j` of a tile holds columns
//!   `2j`, `2j + 1` of the matrix (even column in the low half). Up to
//!   [`NARROW_TOKENS`] tokens are one tile `3 · ntok` columns wide, rows packed (the
//!   decode's); from six on every tile is 16 wide, its rows 64 bytes apart (one cache
//!   line each). Sixteen columns a tile, where five tokens (15) had been, take 3 tiles
//!   instead of 4 for 16 tokens and 96 instead of 103 for 512.
//! - **C: sums.** A block's accumulators are stored into the chunk's ring (six tiles' width,
//!   32 tokens' parts a row) and promoted every six tiles or at the last ([`promote`]),
//!   each token's three parts gathered from their columns.
//! - **Registers.** `tmm0..3` accumulate 2 row tiles × 2 token tiles, `tmm4/5` hold the
//!   row tiles' weights, `tmm6/7` the token tiles: per group 4 loads against 4 steps of
//!   8192 multiply-adds (12 steps for F32 weights). With one token tile (up to five
//!   tokens: the decode) `tmm0..2` accumulate 3 row tiles and `tmm7` holds the third
//!   one's weights ([`block3`]). With three or more token tiles read in place (11 to 64
//!   tokens), one row tile: `tmm0..3` accumulate up to four of its token tiles, `tmm4`
//!   holds its weights, `tmm5..7` the token tiles ([`block_row`]).
//! - **Speed** (`kernel_micro --direct`, one thread, the Xeon of 2026-12-06): BF16 from 4
//!   tokens on and MXFP4 from 16 on run faster than `exact` (64 tokens: 2.6 times); one
//!   token runs at 0.4-0.8 of `exact`, bound by the tile loads of rows from memory
//!   (prefetching them measured slower) and, for MXFP4, by the decode into tiles (a tile
//!   load of rows just stored waits for the stores, so they are decoded a group ahead).
//!   docs/measurements.md, "The bf16x3 path on AMX" and "The AMX one-token MXFP4 product
//!   decoded a group ahead".
//!
//! # Reduction contract
//!
//! For each output `y[t][r]`: columns in groups of 32, in blocks of [`BLOCK_GROUPS`]
//! groups (2048 columns). Per block, three f32 accumulators `h, m, l` (the parts' columns of
//! `C`) start at +0 and take one `TDPBF16PS` step per group in increasing order (F32
//! weights: one per weight part, hi first), each in the hardware's order with DAZ on its
//! inputs and FTZ on its result; then the f64 sum gets `(f64(h) + f64(m)) + f64(l)`.
//! `gemm` rounds the sum once to f32. What a `C` element computes depends only on its row
//! of `A` and its column of `B`, never on the tile's other rows or columns, its width, the
//! thread split or the batch: the tests check that bit for bit.
//!
//! # Error budget (u32 = 2^-24, A = Σ|w·x|)
//!
//! Each step rounds at least once into its accumulator and at most once per product pair
//! inside (the probe found one rounding a step in 83% of outputs): a block of 64 steps
//! ≤ 64·17·u32·A in the worst case, where the `exact` path's 1024-column block is
//! 32·u32·A; the small parts' accumulators add ≤ 2^-7 of that. The tests hold it to the
//! `exact` path's documented budget (33·u32·A + u32·|y|) on random data, as `bf16x3`
//! (measured: at most 3e-8·A with 32-step blocks, the budget being 2e-6·A; the random
//! walk of 64 steps adds a factor near √2).
//!
//! Needs AMX-TILE and AMX-BF16, the kernel's permission to use the tile data
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once per process: [`available`]), and
//! AVX-512F/BW for the staging.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::{Cell, RefCell};
use std::sync::OnceLock;

use rayon::prelude::*;

use super::avx512bf16::{mxfp4 as mxfp4_bf16, mxfp4_in};
use super::bf16x3::{group_parts, split, weight_parts, E2M1_BF16, PARTS};
use super::format::{with_format, Format, FormatFn, FormatKind};
use super::matmul::Mat;
use super::portable::{groups, AlignedBuf, GROUP_COLS};

thread_local! {
    /// This thread's staging strip ([`drive`]), kept between calls.
    static STRIP: RefCell<Option<AlignedBuf<u16>>> = const { RefCell::new(None) };
    /// This thread's split tokens ([`prepare`]), kept between calls.
    static SPLIT: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
}

/// Weight rows per tile.
pub const TILE_ROWS: usize = 16;
/// Columns of an activation tile: 16, each one part of one token (`3t + k` across the
/// product's tiles), so a token's three parts may lie in two tiles.
pub const TILE_COLS: usize = 16;
/// Tokens up to which the activations are one narrow tile (`3 · ntok` columns, rows packed:
/// the decode's); from six tokens on every tile is 16 columns wide.
pub const NARROW_TOKENS: usize = 5;
/// Columns the stored accumulators of a chunk keep per row until their promotion: six
/// tiles, 32 tokens' three parts, so every promotion starts at a token's first part.
const RING_COLS: usize = 6 * TILE_COLS;
/// BF16 weights are read in place (not staged) up to this many token tiles (64 tokens).
/// At two, each weight tile serves one pair of token tiles; from three on one row tile
/// serves four at a time ([`in_place_rows`]). Staging them first cost a copy whose loads
/// wait on DRAM: a 16-token prompt's attention took 400-430 ms in place (two passes then)
/// against 480-600 ms staged; the BF16 products of 48-token prompts took 7-23% less time
/// in place, of 64-token ones about as long (the Xeon of 2026-12-07, alternated,
/// `K3_PROFILE`, two sittings). Past that each row tile's reloads of every token tile
/// outgrow L2, where a staged chunk shares each load among eight row tiles.
const IN_PLACE_TILES: usize = 12;
/// Groups per f32 block: 2048 columns, twice the `exact` path's. Each block ends in a
/// tile store whose promotion's loads wait for the tile unit, and a next tile load that
/// waits for the promotion's stores, so the tile unit idles once a block. On the Xeon of
/// 2026-12-06, alternated, a 512-token prompt took 13.1-13.2 s against 14.6-15.5 s with
/// 1024 columns (512 had been slower still: 14.9-15.0 s against 13.9-14.1 s); the kernel
/// at 512 tokens ran 20-30% faster (`kernel_micro --direct`), level or faster from 1
/// token on. 4096 columns (with half the chunk, to keep the strip in L2) ran no faster.
pub const BLOCK_GROUPS: usize = 64;
/// Row tiles staged together (128 rows: 512 KiB of BF16 weights a block, in L2), against
/// which each pair of token tiles runs before the next pair is read.
pub const CHUNK_TILES: usize = 8;
/// bf16 values of one staged weight tile (16 rows × 32 columns).
const A_TILE: usize = TILE_ROWS * GROUP_COLS;
/// Column pairs of a group: the rows of an activation tile.
const PAIRS: usize = GROUP_COLS / 2;

/// Row tiles staged together against `token_tiles` token tiles ([`drive`]): three against
/// one (the decode's [`block3`]), a pair against two, [`CHUNK_TILES`] against more.
fn chunk_tiles(token_tiles: usize) -> usize {
    match token_tiles {
        1 => 3,
        2 => 2,
        _ => CHUNK_TILES,
    }
}

/// Row tiles a step of BF16 weights read in place against three or more token tiles
/// ([`in_place_rows`]) runs a block at a time: a pair, 32 rows, not a staged chunk's
/// 128. Each block of the next pair then follows its rows' previous block sooner: the
/// 16-token prompt's BF16 products took 6-10% less time than with eight row tiles
/// (`K3_PROFILE`, six rounds alternated; one row tile was level with two).
const IN_PLACE_CHUNK: usize = 2;

/// Rows a task of `ntok` tokens should hold a multiple of: whole chunks where a prompt's
/// chunks are staged (each reads every token tile once a block, so whole chunks read them
/// fewest times), whole pairs of row tiles otherwise (every tile full, and the BF16 tiles
/// read in place).
pub fn task_rows_multiple(ntok: usize) -> usize {
    match token_tiles(ntok) {
        nct if nct > 2 => chunk_tiles(nct) * TILE_ROWS,
        _ => 2 * TILE_ROWS,
    }
}

/// Activation tiles of `ntok` tokens: one narrow tile up to [`NARROW_TOKENS`], else
/// three columns a token, 16 a tile.
pub fn token_tiles(ntok: usize) -> usize {
    if ntok <= NARROW_TOKENS {
        1
    } else {
        (PARTS * ntok).div_ceil(TILE_COLS)
    }
}

/// Whether this CPU and kernel let the AMX kernel run: AMX-TILE, AMX-BF16, the AVX512-BF16
/// kernel's features (the staging decodes with them), and the permission to use the tile
/// data, which this asks for once for the whole process.
pub fn available() -> bool {
    static HAVE: OnceLock<bool> = OnceLock::new();
    *HAVE.get_or_init(|| {
        if !super::simd::bf16_dot_available() {
            return false;
        }
        // CPUID leaf 7 exists on every CPU with AVX-512 (checked above).
        let l7 = __cpuid_count(7, 0);
        let (bf16, tile) = (l7.edx >> 22 & 1 == 1, l7.edx >> 24 & 1 == 1);
        // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): without it the first
        // tile load faults (SIGILL).
        // SAFETY: arch_prctl takes two integers here and only changes which extended
        // states this process may use.
        bf16 && tile && unsafe { libc::syscall(libc::SYS_arch_prctl, 0x1023, 18) } == 0
    })
}

/// A product's activations as AMX tiles (see the module doc, "Tiles"): token tile `n`,
/// group `q` at `(n * groups + q) * 16 * width` dwords, row `j` (a column pair) at `j *
/// width` in it.
pub struct Tiles {
    data: AlignedBuf<u32>,
    ntok: usize,
    cols: usize,
    /// Columns of one tile, and dwords from one tile row to the next: 3 per token up to
    /// five tokens (the decode's narrow tile, compact), else 16 (each row one cache line).
    width: usize,
}

impl Tiles {
    /// Token tiles.
    fn tiles(&self) -> usize {
        token_tiles(self.ntok)
    }

    /// Where a tile operand is: dwords from one group's tile to the next (`bstep`), from one
    /// token tile to the next (`bnext`), and bytes from one tile row to the next
    /// (`bstride`), as [`block`] takes them.
    fn strides(&self) -> (usize, usize, usize) {
        let bstep = PAIRS * self.width;
        (bstep, bstep * groups(self.cols), 4 * self.width)
    }
}

/// `ntok` tokens of `cols` activations (`xs`, token-major) split into parts and laid out
/// as activation tiles; a partial last group zero-padded.
pub fn prepare(xs: &[f32], cols: usize, ntok: usize) -> Tiles {
    assert!(xs.len() >= ntok * cols, "input length");
    let ng = groups(cols);
    let width = if ntok <= NARROW_TOKENS {
        PARTS * ntok.max(1)
    } else {
        TILE_COLS
    };
    let tile = PAIRS * width;
    let mut data = AlignedBuf::<u32>::new(token_tiles(ntok) * ng * tile);
    // One token tile: the parts of its columns (part k of token t in column 3t + k of the
    // whole product). Its tokens are split first, each part a row of bf16 in column order
    // (a straight loop over the columns, vectorised; a token on the tile's edge is split
    // in both its tiles), then the tile is written row by row of each group.
    // Part-rows: `padded` bf16 columns, `half` column pairs (even column in the low half).
    let padded = ng * GROUP_COLS;
    let half = padded / 2;
    let fill = |n: usize, dst: &mut [u32]| {
        let (g0, g1) = (n * width, ((n + 1) * width).min(PARTS * ntok));
        let t0 = g0 / PARTS;
        let len = (g1.div_ceil(PARTS) - t0) * PARTS * half;
        // This thread's buffer, kept between calls (a fresh one a tile cost page faults);
        // every value read below is written first, the columns past `cols` as zero.
        let mut parts = SPLIT.with(|b| b.take());
        parts.clear();
        parts.resize(len, 0);
        for (t, pt) in (t0..).zip(parts.chunks_exact_mut(PARTS * half)) {
            // SAFETY: u32 storage viewed as twice as many u16 (alignment and every bit
            // pattern valid), borrowed mutably once.
            let pt = unsafe {
                std::slice::from_raw_parts_mut(pt.as_mut_ptr() as *mut u16, 2 * pt.len())
            };
            let (h, rest) = pt.split_at_mut(padded);
            let (m, l) = rest.split_at_mut(padded);
            // SAFETY: prepare runs only where the AMX kernel does, whose CPUs have
            // AVX-512F (`available`).
            unsafe { split_row(&xs[t * cols..(t + 1) * cols], h, m, l) };
        }
        // Column `at` of the tile: part (g mod 3) of token g / 3, g = g0 + at.
        let mut src = [0usize; TILE_COLS];
        for (s, g) in src.iter_mut().zip(g0..g1) {
            *s = ((g / PARTS - t0) * PARTS + g % PARTS) * half;
        }
        let src = &src[..g1 - g0];
        for q in 0..ng {
            for j in 0..PAIRS {
                let row = &mut dst[q * tile + j * width..q * tile + (j + 1) * width];
                for (o, &at) in row.iter_mut().zip(src) {
                    *o = parts[at + q * PAIRS + j];
                }
            }
        }
        SPLIT.with(|b| b.replace(parts));
    };
    // A prompt's token tiles on the pool (a 512-token prompt's input took 1.5% of its
    // samples on one thread while the other waited); each tile's bytes are the same
    // whoever writes them.
    if ntok * cols >= 1 << 16 {
        data.par_chunks_mut(ng * tile)
            .enumerate()
            .for_each(|(n, dst)| fill(n, dst));
    } else {
        for (n, dst) in data.chunks_mut(ng * tile).enumerate() {
            fill(n, dst);
        }
    }
    Tiles {
        data,
        ntok,
        cols,
        width,
    }
}

/// `x`'s three parts ([`split`]) into `h`, `m` and `l`, column by column (vectorised at
/// the AVX-512 width).
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn split_row(x: &[f32], h: &mut [u16], m: &mut [u16], l: &mut [u16]) {
    let n = x.len();
    for (((&v, h), m), l) in x.iter().zip(&mut h[..n]).zip(&mut m[..n]).zip(&mut l[..n]) {
        [*h, *m, *l] = split(v);
    }
}

/// The tile configuration (palette 1): `tmm0..3` (accumulators) and `tmm6/7`
/// (activations) 16 rows of `width` dwords, `tmm4/5` (weights) 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

impl Config {
    /// `three`: one token tile, so `tmm7` holds a third row tile's weights ([`block3`]).
    fn new(width: usize, three: bool) -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            let weights = t == 4 || t == 5 || (three && t == 7);
            let bytes = if weights { 64 } else { 4 * width as u16 };
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&bytes.to_le_bytes());
            c[48 + t] = TILE_ROWS as u8;
        }
        Config(c)
    }
}

/// `tileloadd tmm$t` from `p`, rows `s` bytes apart.
macro_rules! tload {
    ($t:literal, $p:expr, $s:expr) => {
        asm!(concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"), p = in(reg) $p, s = in(reg) $s,
             options(nostack, readonly, preserves_flags))
    };
}

/// `tdpbf16ps tmm$c, tmm$a, tmm$b`.
macro_rules! tdp {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem, preserves_flags)
        )
    };
}

/// `tilestored` of `tmm$t` to `p`, rows `s` bytes apart.
macro_rules! tstore {
    ($t:literal, $p:expr, $s:expr) => {
        asm!(concat!("tilestored [{p} + {s}*1], tmm", $t), p = in(reg) $p, s = in(reg) $s,
             options(nostack, preserves_flags))
    };
}

/// `tilezero tmm$t`.
macro_rules! tzero {
    ($t:literal) => {
        asm!(
            concat!("tilezero tmm", $t),
            options(nostack, nomem, preserves_flags)
        )
    };
}

/// Where a block's weight tiles are: row tile `k`'s group `g`, part `p` at byte `k·half +
/// g·group + p·1024` from `base`, its rows `stride` bytes apart. Staged tiles: 64-byte
/// rows, 1 KiB a part; BF16 in place: the matrix's rows, 64 bytes a group.
#[derive(Clone, Copy)]
struct Weights {
    base: *const u8,
    stride: usize,
    group: usize,
    half: usize,
}

/// Where a block's accumulators are stored: tile (row tile `rt`, token tile `ct`) at `c +
/// rt·rstep + ct·16` floats, its rows [`RING_COLS`] floats apart (the chunk's ring).
#[derive(Clone, Copy)]
struct Store {
    c: *mut f32,
    rstep: usize,
}

/// Bytes from one stored accumulator row to the next.
const RING_ROW: usize = 4 * RING_COLS;

/// One block of `nq` groups for `RT` row tiles × `CT` token tiles: the accumulators from
/// zero, one step per group and weight part, stored to `c` ([`Store`]).
///
/// # Safety
/// The tiles configured ([`Config`]); `a` addresses `nq` groups of `NP` parts of `RT`
/// readable weight tiles; `b` (and `b + bnext` when `CT == 2`) `nq` activation tiles
/// `bstep` dwords apart with rows `bstride` bytes apart; `c` has room for the `RT × CT`
/// tiles it addresses.
#[inline(always)]
unsafe fn block<const RT: usize, const CT: usize, const NP: usize>(
    a: Weights,
    b: *const u32,
    (bstep, bnext, bstride): (usize, usize, usize),
    nq: usize,
    Store { c, rstep }: Store,
) {
    // SAFETY: tile operations on the configured tiles over the buffers the caller vouches
    // for.
    unsafe {
        tzero!(0);
        if CT == 2 {
            tzero!(1);
        }
        if RT == 2 {
            tzero!(2);
        }
        if RT == 2 && CT == 2 {
            tzero!(3);
        }
        for g in 0..nq {
            let bp = b.add(g * bstep);
            tload!(6, bp, bstride);
            if CT == 2 {
                tload!(7, bp.add(bnext), bstride);
            }
            for p in 0..NP {
                let ap = a.base.add(g * a.group + p * 2 * A_TILE);
                tload!(4, ap, a.stride);
                if RT == 2 {
                    tload!(5, ap.add(a.half), a.stride);
                }
                tdp!(0, 4, 6);
                if CT == 2 {
                    tdp!(1, 4, 7);
                }
                if RT == 2 {
                    tdp!(2, 5, 6);
                }
                if RT == 2 && CT == 2 {
                    tdp!(3, 5, 7);
                }
            }
        }
        tstore!(0, c, RING_ROW);
        if CT == 2 {
            tstore!(1, c.add(TILE_COLS), RING_ROW);
        }
        if RT == 2 {
            tstore!(2, c.add(rstep), RING_ROW);
        }
        if RT == 2 && CT == 2 {
            tstore!(3, c.add(rstep + TILE_COLS), RING_ROW);
        }
    }
}

/// One row tile against `CT` (three or four) token tiles: the accumulators `tmm0..CT`
/// from zero, the weights in `tmm4` loaded once a group and part, the token tiles in
/// `tmm5..7` (the fourth reloaded into `tmm5` after the first's step), stored to `c`
/// ([`Store`], token tile `n` at column `16n`). Every accumulator takes the same steps in
/// the same order as in [`block`]: the same bits.
///
/// # Safety
/// As [`block`] with `RT == 1` and `CT` token tiles `bnext` dwords apart; every tile
/// configured 16 rows × 64 bytes (sixteen-column token tiles).
#[inline(always)]
unsafe fn block_row<const CT: usize, const NP: usize>(
    a: Weights,
    b: *const u32,
    (bstep, bnext, bstride): (usize, usize, usize),
    nq: usize,
    Store { c, .. }: Store,
) {
    debug_assert!(CT == 3 || CT == 4);
    // SAFETY: tile operations on the configured tiles over the buffers the caller vouches
    // for.
    unsafe {
        tzero!(0);
        tzero!(1);
        tzero!(2);
        if CT == 4 {
            tzero!(3);
        }
        for g in 0..nq {
            let bp = b.add(g * bstep);
            for p in 0..NP {
                tload!(4, a.base.add(g * a.group + p * 2 * A_TILE), a.stride);
                tload!(5, bp, bstride);
                tload!(6, bp.add(bnext), bstride);
                tload!(7, bp.add(2 * bnext), bstride);
                tdp!(0, 4, 5);
                tdp!(1, 4, 6);
                tdp!(2, 4, 7);
                if CT == 4 {
                    tload!(5, bp.add(3 * bnext), bstride);
                    tdp!(3, 4, 5);
                }
            }
        }
        tstore!(0, c, RING_ROW);
        tstore!(1, c.add(TILE_COLS), RING_ROW);
        tstore!(2, c.add(2 * TILE_COLS), RING_ROW);
        if CT == 4 {
            tstore!(3, c.add(3 * TILE_COLS), RING_ROW);
        }
    }
}

/// [`block`] for three row tiles × one token tile (`tmm7` configured for weights): the
/// three tiles' loads issue together before their steps, 48 rows of a group in flight.
///
/// # Safety
/// As [`block`] with `RT == 3`, `CT == 1`, and the tiles configured with `three`.
#[inline(always)]
unsafe fn block3<const NP: usize>(
    a: Weights,
    b: *const u32,
    (bstep, _, bstride): (usize, usize, usize),
    nq: usize,
    Store { c, rstep }: Store,
) {
    // SAFETY: as block.
    unsafe {
        tzero!(0);
        tzero!(1);
        tzero!(2);
        for g in 0..nq {
            tload!(6, b.add(g * bstep), bstride);
            for p in 0..NP {
                let ap = a.base.add(g * a.group + p * 2 * A_TILE);
                tload!(4, ap, a.stride);
                tload!(5, ap.add(a.half), a.stride);
                tload!(7, ap.add(2 * a.half), a.stride);
                tdp!(0, 4, 6);
                tdp!(1, 5, 6);
                tdp!(2, 7, 6);
            }
        }
        tstore!(0, c, RING_ROW);
        tstore!(1, c.add(rstep), RING_ROW);
        tstore!(2, c.add(2 * rstep), RING_ROW);
    }
}

/// Stage the weights of rows `r..r1.min(r + 16)`, groups `q0..q1`, of `f` (a view of
/// `m`) into `dst` as `NP`-part tiles (`[group][part][row][32]`); rows past `r1` zero.
///
/// # Safety
/// AVX-512F and AVX-512BW enabled in the caller; `dst` holds `(q1 - q0) · NP` tiles.
#[inline(always)]
unsafe fn stage<F: Format, const NP: usize>(
    f: F,
    m: &Mat<'_>,
    (r, r1): (usize, usize),
    (q0, q1): (usize, usize),
    dst: &mut [u16],
) {
    let full = m.cols / GROUP_COLS;
    for i in 0..TILE_ROWS {
        let row = r + i;
        for q in q0..q1 {
            let at = ((q - q0) * NP) * A_TILE + i * GROUP_COLS;
            if row >= r1 {
                for p in 0..NP {
                    dst[at + p * A_TILE..at + p * A_TILE + GROUP_COLS].fill(0);
                }
                continue;
            }
            if q < full && F::KIND != FormatKind::F32 {
                // SAFETY: (row, q) is a full group (q < full, row < r1 <= rows); 64 bytes
                // at dst[at..] (asserted by the slice).
                unsafe {
                    let (p, s) = f.at(row, q);
                    let d = dst[at..at + GROUP_COLS].as_mut_ptr();
                    let v = if F::KIND == FormatKind::Mxfp4 {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(BLOCK_GROUPS * 16) as *const i8);
                        mxfp4_bf16(p, s)
                    } else {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(BLOCK_GROUPS * 64) as *const i8);
                        _mm512_loadu_si512(p as *const _)
                    };
                    _mm512_storeu_si512(d as *mut _, v);
                }
            } else {
                let mut parts = [[0u16; GROUP_COLS]; PARTS];
                group_bf16::<F>(f, m, row, q, &mut parts);
                for (p, part) in parts.iter().enumerate().take(NP) {
                    dst[at + p * A_TILE..at + p * A_TILE + GROUP_COLS].copy_from_slice(part);
                }
            }
        }
    }
}

/// Group `q` of row `r` as bf16 weight parts in column order (one part for BF16 and MXFP4,
/// three for F32), a partial group zero-padded: the `bf16x3` twin's decode
/// ([`group_parts`]), whose parts are exact bf16 values.
fn group_bf16<F: Format>(f: F, m: &Mat<'_>, r: usize, q: usize, out: &mut [[u16; 32]; PARTS]) {
    let mut parts = [[0f32; 32]; PARTS];
    group_parts(f, m, r, q, &mut parts);
    for (o, p) in out.iter_mut().zip(&parts) {
        for (h, v) in o.iter_mut().zip(p) {
            *h = (v.to_bits() >> 16) as u16;
        }
    }
}

/// Steps a group is decoded ahead of its tile loads in [`drive_decode`]: a tile load of
/// rows just stored waits for the stores to reach L1, one group's tiles ahead does not.
const RING_DEPTH: usize = 2;

/// [`RING_DEPTH`] steps of three weight tiles (48 rows × one 32-column group, bf16): the
/// decode's ring, small enough to stay in L1 with the weights streaming past it.
#[repr(C, align(64))]
struct DecodeRing([[u16; 3 * A_TILE]; RING_DEPTH]);

/// Group `q` of rows `c0..c1` of MXFP4 weights into ring slot `q mod RING_DEPTH` as bf16
/// (a partial group zero-padded); rows past `c1` keep what the slot holds.
///
/// # Safety
/// AVX-512F and AVX-512BW enabled in the caller; `c1 - c0 <= 48`.
#[inline(always)]
unsafe fn decode_group<F: Format>(
    f: F,
    m: &Mat<'_>,
    ring: &mut DecodeRing,
    (c0, c1): (usize, usize),
    q: usize,
) {
    let whole = m.cols / GROUP_COLS;
    let slot = &mut ring.0[q % RING_DEPTH];
    if q < whole {
        // Row c0's group q, then a row's stride on for each row after it.
        let [(pc, pn), (ps, sn)] = f.spans(c0, c1);
        let (pstride, sstride) = (pn / (c1 - c0), sn / (c1 - c0));
        let (d, tbl) = (slot.as_mut_ptr(), E2M1_BF16.0.as_ptr());
        // SAFETY: rows c0..c1 hold full group q (q < whole): 16 packed bytes at
        // pc + i·pstride + 16q and a scale byte at ps + i·sstride + q for i < c1 - c0
        // (the pointers advance one row a step and are read only below that); the slot
        // holds 48 rows of 32 values (c1 - c0 <= 48, caller); AVX-512F/BW enabled in the
        // caller.
        unsafe {
            let (mut p, mut s) = (pc.add(16 * q), ps.add(q));
            for i in 0..c1 - c0 {
                _mm512_store_si512(d.add(i * GROUP_COLS) as *mut _, mxfp4_in(tbl, p, *s));
                p = p.wrapping_add(pstride);
                s = s.wrapping_add(sstride);
            }
        }
        return;
    }
    for row in c0..c1 {
        let at = (row - c0) * GROUP_COLS;
        let mut parts = [[0u16; GROUP_COLS]; PARTS];
        group_bf16::<F>(f, m, row, q, &mut parts);
        slot[at..at + GROUP_COLS].copy_from_slice(&parts[0]);
    }
}

/// Rows `r0..r1` of MXFP4 weights × one token tile (up to [`NARROW_TOKENS`] tokens: the
/// decode, a routed expert's few tokens) into `out`: [`drive`]'s staging fused into its
/// steps ([`drive_ring`], chunks of three row tiles). The steps, their operands and their
/// order are [`block3`]'s, so the sums are the same bits. On the Xeon of 2026-12-07: one
/// thread in cache 12 → 19-24 GMAC/s (`kernel_micro mxfp4 1 --direct --amx`, 192 × 3584),
/// two threads from memory 8.2-9.1 → 10.5-12.2 GB/s (`gemv_bench --only expert`), the
/// slice's routed experts 83-86 → 53-56 ms a decode step; `exact` 17 GB/s and 42 ms.
///
/// # Safety
/// As [`rows`]; the tiles configured for one token tile (`three`); `F::KIND` is MXFP4.
#[inline(always)]
unsafe fn drive_decode<F: Format>(
    f: F,
    m: &Mat<'_>,
    rows: (usize, usize),
    x: &Tiles,
    out: &mut [f64],
) {
    assert!(x.tiles() == 1, "one token tile");
    let (bstep, _, bstride) = x.strides();
    let rstep = TILE_ROWS * RING_COLS;
    // SAFETY (both closures): the tiles configured with `three` (caller); `a` is a ring
    // slot of three 1 KiB weight tiles of 64-byte rows; x.data holds ng groups of one
    // token tile, bstep dwords apart; `c` holds three row tiles of RING_COLS floats a row.
    let step = |q: usize, a: *const u8| unsafe {
        tload!(6, x.data[q * bstep..].as_ptr(), bstride);
        tload!(4, a, 2 * GROUP_COLS);
        tload!(5, a.add(2 * A_TILE), 2 * GROUP_COLS);
        tload!(7, a.add(4 * A_TILE), 2 * GROUP_COLS);
        tdp!(0, 4, 6);
        tdp!(1, 5, 6);
        tdp!(2, 7, 6);
    };
    let store = |c: *mut f32| unsafe {
        tstore!(0, c, RING_ROW);
        tstore!(1, c.add(rstep), RING_ROW);
        tstore!(2, c.add(2 * rstep), RING_ROW);
    };
    // SAFETY: as this function's; the closures step and store three row tiles.
    unsafe { drive_ring(f, m, rows, x, out, 3 * TILE_ROWS, step, store) }
}

/// Rows `r0..r1` of MXFP4 weights × two to four token tiles (6 to 21 tokens: a routed
/// expert's share of a short prompt or of a `serve` prefill chunk) into `out`: one row
/// tile at a time ([`drive_ring`]), its weight tile loaded once a group and stepped
/// against every token tile ([`block_row`]'s registers), instead of a chunk's block
/// staged into a strip in L2 and read back for every pair of token tiles. Each
/// accumulator's steps, their operands and their order are the staged path's: the same
/// bits. On the Xeon of 2026-12-07 the routed experts of 32- and 64-token prompts took
/// 13-32% less time (docs/measurements.md, "Short prompts in place, row tile by row tile").
///
/// # Safety
/// As [`rows`]; the tiles configured for sixteen-column token tiles; `F::KIND` is MXFP4.
#[inline(always)]
unsafe fn drive_decode_tiles<F: Format>(
    f: F,
    m: &Mat<'_>,
    rows: (usize, usize),
    x: &Tiles,
    out: &mut [f64],
) {
    let nct = x.tiles();
    assert!((2..=4).contains(&nct), "two to four token tiles");
    let (bstep, bnext, bstride) = x.strides();
    // SAFETY (both closures): the tiles configured 16 rows × 64 bytes (caller); `a` is a
    // ring slot whose first tile is 1 KiB of 64-byte rows; x.data holds the groups of each
    // of the nct token tiles, bstep dwords apart, bnext from tile to tile; `c` holds one
    // row tile of RING_COLS floats a row (nct <= 4 tiles of 16 columns).
    let step = |q: usize, a: *const u8| unsafe {
        let bp = x.data[q * bstep..].as_ptr();
        tload!(4, a, 2 * GROUP_COLS);
        tload!(5, bp, bstride);
        tload!(6, bp.add(bnext), bstride);
        tdp!(0, 4, 5);
        tdp!(1, 4, 6);
        if nct > 2 {
            tload!(7, bp.add(2 * bnext), bstride);
            tdp!(2, 4, 7);
        }
        if nct > 3 {
            tload!(5, bp.add(3 * bnext), bstride);
            tdp!(3, 4, 5);
        }
    };
    let store = |c: *mut f32| unsafe {
        tstore!(0, c, RING_ROW);
        tstore!(1, c.add(TILE_COLS), RING_ROW);
        if nct > 2 {
            tstore!(2, c.add(2 * TILE_COLS), RING_ROW);
        }
        if nct > 3 {
            tstore!(3, c.add(3 * TILE_COLS), RING_ROW);
        }
    };
    // SAFETY: as this function's; the closures step and store one row tile.
    unsafe { drive_ring(f, m, rows, x, out, TILE_ROWS, step, store) }
}

/// MXFP4 rows `r0..r1` × every prepared token into `out`, in chunks of `chunk` rows (48 or
/// 16): per chunk and block of [`BLOCK_GROUPS`] groups, group `q + 1` of the chunk's rows
/// is decoded into a ring in L1 ([`DecodeRing`]) while `step(q, slot)` loads and steps
/// group `q`'s tiles, instead of a whole block decoded first into a strip in L2 (written
/// and read back a block); the next chunk's codes and scales are prefetched into L2 a few
/// lines a step. `store(sums)` stores the block's accumulators (`tmm0..3`, zeroed at each
/// block's start) for [`promote`].
///
/// # Safety
/// As [`rows`]; `chunk` is 48 or 16 and the tiles configured for what `step` and `store`
/// do with them; `F::KIND` is MXFP4.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn drive_ring<F: Format>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    x: &Tiles,
    out: &mut [f64],
    chunk: usize,
    step: impl Fn(usize, *const u8),
    store: impl Fn(*mut f32),
) {
    let (ntok, ng) = (x.ntok, groups(m.cols));
    assert!(
        r1 <= m.rows && out.len() >= (r1 - r0) * ntok,
        "output length"
    );
    out[..(r1 - r0) * ntok].fill(0.0);
    let mut ring = DecodeRing([[0; 3 * A_TILE]; RING_DEPTH]);
    let mut sums = AlignedBuf::<f32>::new(3 * TILE_ROWS * RING_COLS);
    for c0 in (r0..r1).step_by(chunk) {
        let c1 = r1.min(c0 + chunk);
        // The next chunk's bytes (packed codes and scales, each consecutive) are prefetched
        // into L2 over this chunk's steps, `per_step` lines of each a step: from memory the
        // decode otherwise waits on its loads of the chunk's rows at once.
        let next = f.spans(c1, r1.min(c1 + chunk));
        let per_step = next.map(|(_, n)| 64 * n.div_ceil(64).div_ceil(ng));
        if c1 - c0 < chunk {
            // The last chunk's missing rows: zero weights, sums never promoted.
            ring = DecodeRing([[0; 3 * A_TILE]; RING_DEPTH]);
        }
        for q0 in (0..ng).step_by(BLOCK_GROUPS) {
            let q1 = (q0 + BLOCK_GROUPS).min(ng);
            for q in q0..q1.min(q0 + RING_DEPTH - 1) {
                decode_group(f, m, &mut ring, (c0, c1), q);
            }
            // SAFETY: the tiles configured (caller); tmm0..3 exist in every configuration.
            unsafe {
                tzero!(0);
                tzero!(1);
                tzero!(2);
                tzero!(3);
            }
            for q in q0..q1 {
                for k in 0..2 {
                    let (p, n) = next[k];
                    let (mut at, end) = (q * per_step[k], n.min((q + 1) * per_step[k]));
                    while at < end {
                        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(at) as *const i8);
                        at += 64;
                    }
                }
                if q + RING_DEPTH - 1 < q1 {
                    decode_group(f, m, &mut ring, (c0, c1), q + RING_DEPTH - 1);
                }
                step(q, ring.0[q % RING_DEPTH].as_ptr() as *const u8);
            }
            store(sums.as_mut_ptr());
            // SAFETY: AVX-512F enabled in the caller; `sums` holds tokens 0..ntok (at most
            // 21) of rows c0..c1.
            unsafe { promote(&sums, (c0, c1, r0), (0, ntok, ntok), out) };
        }
    }
}

/// Rows `r0..r1` × every prepared token of format `F` with `NP` weight parts into `out`.
/// Rows go in chunks of row tiles: three against one token tile ([`block3`]), a pair
/// against two, up to [`CHUNK_TILES`] against more (prefill: each pair of token tiles is
/// then read from memory once a chunk and block, against every pair of row tiles from the
/// strip in L2). Per chunk and block:
/// - **In place** with up to [`IN_PLACE_TILES`] token tiles (the decode, prompts up to 64
///   tokens), BF16 tiles whose rows and groups are all whole: the matrix's rows are the
///   tile's (no prefetch: it measured slower; from three token tiles on, a pair of row
///   tiles a step, row tile by row tile, [`in_place_rows`]).
/// - **Decoded a group ahead** for MXFP4 against one token tile ([`drive_decode`]).
/// - **Staged** otherwise: the chunk's block decoded (or copied, split) into a strip of
///   two halves, one step ahead: a tile load of rows just stored waits for the stores.
///
/// # Safety
/// As [`rows`]; the tiles configured for `x.width`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
unsafe fn drive<F: Format, const NP: usize>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    x: &Tiles,
    out: &mut [f64],
) {
    let (ntok, ng, nct) = (x.ntok, groups(m.cols), x.tiles());
    if F::KIND == FormatKind::Mxfp4 && nct == 1 {
        // SAFETY: as this function's.
        return unsafe { drive_decode(f, m, (r0, r1), x, out) };
    }
    if F::KIND == FormatKind::Mxfp4 && nct <= 4 {
        // SAFETY: as this function's (nct > 1: sixteen-column token tiles).
        return unsafe { drive_decode_tiles(f, m, (r0, r1), x, out) };
    }
    assert!(
        r1 <= m.rows && out.len() >= (r1 - r0) * ntok,
        "output length"
    );
    out[..(r1 - r0) * ntok].fill(0.0);
    // One row tile's staged block.
    let tile_block = BLOCK_GROUPS * NP * A_TILE;
    // BF16 weights are read in place wherever a chunk's row tiles are whole.
    let bf16_in_place = F::KIND == FormatKind::Bf16 && nct <= IN_PLACE_TILES;
    let chunk = if bf16_in_place && nct > 2 {
        IN_PLACE_CHUNK
    } else {
        chunk_tiles(nct)
    };
    let whole = m.cols / GROUP_COLS;
    // The steps: (first row, end row, first group, end group), chunk by chunk, block by
    // block, and whether each reads its weights in place.
    let mut steps = Vec::new();
    for c0 in (r0..r1).step_by(chunk * TILE_ROWS) {
        let c1 = r1.min(c0 + chunk * TILE_ROWS);
        let in_place = bf16_in_place && (c1 - c0) % TILE_ROWS == 0;
        for q0 in (0..ng).step_by(BLOCK_GROUPS) {
            let q1 = (q0 + BLOCK_GROUPS).min(ng);
            steps.push(((c0, c1), (q0, q1), in_place && q1 <= whole));
        }
    }
    let half_len = chunk * tile_block;
    // The strip is this thread's, kept from call to call: a fresh one a call (up to
    // 1 MiB, zeroed) cost page faults and page clearing on every prompt task.
    // Every tile a step reads is staged in that step, so what an earlier call left in it
    // never reaches a result.
    let mut strip = match STRIP.with(|s| s.borrow_mut().take()) {
        Some(s) if s.len() >= 2 * half_len => s,
        _ => AlignedBuf::<u16>::new(2 * half_len),
    };
    // The chunk's stored accumulators: row tile k's rows from k · rstep, RING_COLS floats
    // a row, token tile n at column 16 · (n mod 6).
    let rstep = TILE_ROWS * RING_COLS;
    let mut ring = AlignedBuf::<f32>::new(chunk * rstep);
    let bs = x.strides();
    let bstep = bs.0;
    for k in 0..steps.len() {
        // Step 0's weights, then always the next step's before this one's products.
        for j in if k == 0 { 0..2 } else { k + 1..k + 2 } {
            let Some(&((c0, c1), qs, false)) = steps.get(j) else {
                continue;
            };
            let h = &mut strip[(j & 1) * half_len..(j & 1) * half_len + half_len];
            for (i, dst) in h.chunks_exact_mut(tile_block).enumerate() {
                if c0 + i * TILE_ROWS < c1 {
                    // SAFETY: dst holds BLOCK_GROUPS × NP tiles; features as rows'.
                    unsafe { stage::<F, NP>(f, m, (c0 + i * TILE_ROWS, c1), qs, dst) };
                }
            }
        }
        let ((c0, c1), (q0, q1), direct) = steps[k];
        let tiles = (c1 - c0).div_ceil(TILE_ROWS);
        let a0 = if direct {
            // SAFETY: (c0, q0) is a whole group of the matrix.
            let (p, _) = unsafe { f.at(c0, q0) };
            Weights {
                base: p,
                stride: 2 * m.cols,
                group: 2 * GROUP_COLS,
                half: TILE_ROWS * 2 * m.cols,
            }
        } else {
            Weights {
                base: strip[(k & 1) * half_len..].as_ptr() as *const u8,
                stride: 2 * GROUP_COLS,
                group: NP * 2 * A_TILE,
                half: 2 * tile_block,
            }
        };
        if direct && nct > 2 {
            // In place against three or more token tiles: row tile by row tile.
            // SAFETY: as the loop below's.
            unsafe { in_place_rows::<NP>(a0, x, (c0, c1, r0), (q0, q1), bs, &mut ring, out) };
            continue;
        }
        // Tokens whose sums have this block's accumulators added.
        let mut done = 0;
        for n in (0..nct).step_by(2) {
            let pair = n + 1 < nct;
            let b = x.data[(n * ng + q0) * bstep..].as_ptr();
            let col = TILE_COLS * (n % (RING_COLS / TILE_COLS));
            let mut i = 0;
            while i < tiles {
                // Three row tiles only where tmm7 is configured for weights.
                let rts = if nct == 1 && tiles - i >= 3 {
                    3
                } else {
                    2.min(tiles - i)
                };
                // SAFETY: still inside the strip or the matrix (row tile i < tiles).
                let a = Weights {
                    base: unsafe { a0.base.add(i * a0.half) },
                    ..a0
                };
                let nq = q1 - q0;
                let cp = Store {
                    c: ring[i * rstep + col..].as_mut_ptr(),
                    rstep,
                };
                // SAFETY: `a` addresses row tiles i..i + rts of the block; token tile n
                // (and n + 1) has groups q0..q1 in x.data; the ring holds row tiles
                // i..i + rts (i + rts <= chunk) and columns col..col + 32 (col <= 64);
                // tiles configured (three row tiles only with one token tile).
                unsafe {
                    match (rts, pair) {
                        (3, _) => block3::<NP>(a, b, bs, nq, cp),
                        (2, true) => block::<2, 2, NP>(a, b, bs, nq, cp),
                        (2, false) => block::<2, 1, NP>(a, b, bs, nq, cp),
                        (_, true) => block::<1, 2, NP>(a, b, bs, nq, cp),
                        (_, false) => block::<1, 1, NP>(a, b, bs, nq, cp),
                    }
                }
                i += rts;
            }
            // The ring full (six tiles: 32 whole tokens) or the last tiles stored.
            let end = n + 1 + pair as usize;
            if end.is_multiple_of(RING_COLS / TILE_COLS) || end == nct {
                let upto = if end == nct {
                    ntok
                } else {
                    end * TILE_COLS / PARTS
                };
                // SAFETY: AVX-512F enabled in the caller; the ring holds tokens done..upto
                // of rows c0..c1 (at most 32 tokens, from column 0).
                unsafe { promote(&ring, (c0, c1, r0), (done, upto, ntok), out) };
                done = upto;
            }
        }
    }
    STRIP.with(|s| *s.borrow_mut() = Some(strip));
}

/// One in-place step (rows `c0..c1`, whole row tiles; groups `q0..q1`) against three to
/// [`IN_PLACE_TILES`] token tiles (11 to 64 tokens), row tile by row tile, into `out`
/// (row `r` at `(r - r0) · ntok`): per group of six token tiles (the ring's 32 tokens),
/// each row tile's weights are loaded once a group from memory against four token tiles
/// at a time ([`block_row`]; the rest from L2), then the group's sums promoted. Pairs of
/// row tiles against pairs of token tiles (the order before) read every weight tile
/// twice and walked 32 rows at once; one row tile walks 16. Against that order the BF16
/// products of 11-, 16- and 21-token prompts took 8-17% less time, and 15-20% less
/// again with the step's pair of row tiles ([`IN_PLACE_CHUNK`]); 26- and 32-token
/// prompts, staged before, 29-33% less (`K3_PROFILE`, alternated: docs/measurements.md,
/// "Short prompts in place, row tile by row tile"). Each accumulator's steps and the
/// promotion are unchanged: the same bits.
///
/// # Safety
/// As [`drive`]'s loop: `a0` addresses the step's row tiles in place, groups `q0..q1`;
/// sixteen-column token tiles; tiles configured; AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn in_place_rows<const NP: usize>(
    a0: Weights,
    x: &Tiles,
    (c0, c1, r0): (usize, usize, usize),
    (q0, q1): (usize, usize),
    bs: (usize, usize, usize),
    ring: &mut AlignedBuf<f32>,
    out: &mut [f64],
) {
    let rstep = TILE_ROWS * RING_COLS;
    let (nct, ntok) = (x.tiles(), x.ntok);
    let tiles = (c1 - c0) / TILE_ROWS;
    let per_ring = RING_COLS / TILE_COLS;
    let mut done = 0;
    for g0 in (0..nct).step_by(per_ring) {
        let g1 = (g0 + per_ring).min(nct);
        for i in 0..tiles {
            let a = Weights {
                base: a0.base.wrapping_add(i * a0.half),
                ..a0
            };
            for n in (g0..g1).step_by(4) {
                let b = x.data[n * bs.1 + q0 * bs.0..].as_ptr();
                let cp = Store {
                    c: ring[i * rstep + TILE_COLS * (n - g0)..].as_mut_ptr(),
                    rstep,
                };
                // SAFETY: row tile i of the step in place; token tiles n..g1 with groups
                // q0..q1 in x.data, bs.1 dwords apart; the ring's row tile i holds their
                // columns (g1 - g0 <= 6 tiles).
                unsafe {
                    match g1 - n {
                        1 => block::<1, 1, NP>(a, b, bs, q1 - q0, cp),
                        2 => block::<1, 2, NP>(a, b, bs, q1 - q0, cp),
                        3 => block_row::<3, NP>(a, b, bs, q1 - q0, cp),
                        _ => block_row::<4, NP>(a, b, bs, q1 - q0, cp),
                    }
                }
            }
        }
        let upto = if g1 == nct {
            ntok
        } else {
            g1 * TILE_COLS / PARTS
        };
        // SAFETY: AVX-512F enabled in the caller; the ring holds tokens done..upto (at most
        // 32, from column 0) of rows c0..c1.
        unsafe { promote(ring, (c0, c1, r0), (done, upto, ntok), out) };
        done = upto;
    }
}

/// Lane indices gathering part `k` of 16 tokens from their 48 interleaved columns (part `k`
/// of lane `i` in column `3i + k`): `[k][0]` picks columns below 32 from two registers
/// (`vpermt2ps`, indices 0..31), `[k][1]` keeps those lanes and takes the rest from the
/// third register (16 + its column − 32).
const PART_IDX: [[[i32; 16]; 2]; 3] = {
    let mut v = [[[0i32; 16]; 2]; 3];
    let mut k = 0;
    while k < 3 {
        let mut lane = 0;
        while lane < 16 {
            let col = 3 * lane + k;
            if col < 32 {
                v[k][0][lane] = col as i32;
                v[k][1][lane] = lane as i32;
            } else {
                v[k][1][lane] = (16 + col - 32) as i32;
            }
            lane += 1;
        }
        k += 1;
    }
    v
};

/// Add one block's stored accumulators of rows `c0..c1` (the chunk's ring, from
/// [`block`], [`block3`] and [`drive_decode`]) for tokens `t0..t1` (at most 32, the first at
/// ring column 0: part `k` of token `t` at column `3(t − t0) + k`) to the f64 sums:
/// `(f64(h) + f64(m)) + f64(l)` per (row, token). Up to [`NARROW_TOKENS`] tokens (one
/// narrow tile) a value at a time; more sixteen tokens at a time, the three parts gathered
/// from the interleaved columns by two permutes each, lanes past `t1` masked off.
///
/// # Safety
/// AVX-512F enabled in the caller.
#[inline(always)]
unsafe fn promote(
    ring: &[f32],
    (c0, c1, r0): (usize, usize, usize),
    (t0, t1, ntok): (usize, usize, usize),
    out: &mut [f64],
) {
    assert!(t1 - t0 <= 2 * TILE_COLS && t1 <= ntok);
    assert!(ring.len() >= (c1 - c0) * RING_COLS && out.len() >= (c1 - r0) * ntok);
    if t1 - t0 <= NARROW_TOKENS {
        // One narrow tile (the decode's): the same sums a value at a time, cheaper than
        // gathering each row's parts by permutes.
        for r in c0..c1 {
            let row = &ring[(r - c0) * RING_COLS..(r - c0) * RING_COLS + 3 * (t1 - t0)];
            let o = &mut out[(r - r0) * ntok + t0..(r - r0) * ntok + t1];
            for (y, p) in o.iter_mut().zip(row.chunks_exact(PARTS)) {
                *y += (p[0] as f64 + p[1] as f64) + p[2] as f64;
            }
        }
        return;
    }
    // SAFETY: 64 bytes of each 16-lane index array.
    let ix = |v: &[i32; 16]| unsafe { _mm512_loadu_si512(v.as_ptr() as *const _) };
    let first = [
        ix(&PART_IDX[0][0]),
        ix(&PART_IDX[1][0]),
        ix(&PART_IDX[2][0]),
    ];
    let second = [
        ix(&PART_IDX[0][1]),
        ix(&PART_IDX[1][1]),
        ix(&PART_IDX[2][1]),
    ];
    // The two halves of 16 f32 lanes as f64.
    let wide = |v: __m512| -> [__m512d; 2] {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        [_mm512_cvtps_pd(lo), _mm512_cvtps_pd(hi)]
    };
    for r in c0..c1 {
        let row = &ring[(r - c0) * RING_COLS..(r - c0 + 1) * RING_COLS];
        let o = &mut out[(r - r0) * ntok..(r - r0 + 1) * ntok];
        for b in (t0..t1).step_by(TILE_COLS) {
            let p = row[3 * (b - t0)..3 * (b - t0) + 3 * TILE_COLS].as_ptr();
            // SAFETY: 48 floats at p (sliced above); the masked f64 loads and stores touch
            // tokens b..t1 of o only.
            unsafe {
                let za = _mm512_loadu_ps(p);
                // Up to five tokens (the decode's narrow tile) lie in the first register.
                let (h, m, l) = if t1 - b <= NARROW_TOKENS {
                    let part = |k: usize| wide(_mm512_permutexvar_ps(first[k], za));
                    (part(0), part(1), part(2))
                } else {
                    let (zb, zc) = (_mm512_loadu_ps(p.add(16)), _mm512_loadu_ps(p.add(32)));
                    let part = |k: usize| {
                        let ab = _mm512_permutex2var_ps(za, first[k], zb);
                        wide(_mm512_permutex2var_ps(ab, second[k], zc))
                    };
                    (part(0), part(1), part(2))
                };
                for half in 0..2 {
                    let t = b + 8 * half;
                    if t >= t1 {
                        break;
                    }
                    let mask = (0xffu16 >> (8 - (t1 - t).min(8))) as u8;
                    let s = _mm512_add_pd(_mm512_add_pd(h[half], m[half]), l[half]);
                    let y = _mm512_maskz_loadu_pd(mask, o.as_ptr().add(t));
                    _mm512_mask_storeu_pd(o.as_mut_ptr().add(t), mask, _mm512_add_pd(y, s));
                }
            }
        }
    }
}

/// Sums of rows `r0..r1` × every token of `x` ([`prepare`]) under the AMX reduction
/// contract (module doc) into `out[(r - r0) * ntok + t]`.
///
/// # Safety
/// [`available`] must have returned true.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
pub unsafe fn rows(m: &Mat<'_>, r0: usize, r1: usize, x: &Tiles, out: &mut [f64]) {
    struct Rows<'x> {
        rows: (usize, usize),
        x: &'x Tiles,
        out: &'x mut [f64],
    }
    impl FormatFn for Rows<'_> {
        type Out = ();
        #[inline(always)]
        fn call<F: Format>(self, f: F, m: &Mat<'_>) {
            // SAFETY: `f` is m's view (with_format); the tiles are configured and the
            // features enabled in `rows`, into which this is inlined.
            unsafe {
                if weight_parts(F::KIND) == 1 {
                    drive::<F, 1>(f, m, self.rows, self.x, self.out)
                } else {
                    drive::<F, PARTS>(f, m, self.rows, self.x, self.out)
                }
            }
        }
    }
    assert_eq!(x.cols, m.cols, "input prepared for another shape");
    if x.ntok == 0 || r0 >= r1 {
        return;
    }
    let cfg = Config::new(x.width, x.tiles() == 1);
    // SAFETY: AMX is available (caller); the configuration is a valid palette-1 layout.
    unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
    with_format(
        m,
        Rows {
            rows: (r0, r1),
            x,
            out,
        },
    );
    // SAFETY: AMX is available; releasing returns the tiles to their initial state.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}
