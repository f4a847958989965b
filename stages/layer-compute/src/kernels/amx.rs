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
//!   read in place (BF16, few tokens) or staged per 2048-column block into an aligned
//!   buffer (`[group][part][row][32]`, 1 KiB a tile), zero rows past the task's last and
//!   zero columns past the matrix's last.
//! - **B: activations.** Each token's three parts (hi, mid, lo: [`super::bf16x3::split`])
//!   are three columns, [`TILE_TOKENS`] tokens (15 columns) a tile, prepared once per
//!   product ([`prepare`]): `B[j][3t + k]` = part `k` of columns `2j`, `2j + 1` of token
//!   `t` (even column in the low half). One token is a tile 3 columns wide. A full tile's
//!   rows are 64 bytes apart (each one cache line), a narrower one's packed.
//! - **Registers.** `tmm0..3` accumulate 2 row tiles × 2 token tiles, `tmm4/5` hold the
//!   row tiles' weights, `tmm6/7` the token tiles: per group 4 loads against 4 steps of
//!   8192 multiply-adds (12 steps for F32 weights). With one token tile (up to five
//!   tokens: the decode) `tmm0..2` accumulate 3 row tiles and `tmm7` holds the third
//!   one's weights ([`block3`]).
//! - **Speed** (`kernel_micro --direct`, one thread, the Xeon of 2026-12-06): BF16 from 4
//!   tokens on and MXFP4 from 16 on run faster than `exact` (64 tokens: 2.6 times); one
//!   token runs at 0.4-0.8 of `exact`, bound by the tile loads of rows from memory
//!   (prefetching them measured slower, and a tile load of rows just stored waits for the
//!   stores, so MXFP4 is staged a step ahead). docs/measurements.md, "The bf16x3 path on
//!   AMX".
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
use std::cell::RefCell;
use std::sync::OnceLock;

use rayon::prelude::*;

use super::avx512bf16::mxfp4 as mxfp4_bf16;
use super::bf16x3::{group_parts, split, weight_parts, PARTS};
use super::format::{with_format, Format, FormatFn, FormatKind};
use super::matmul::Mat;
use super::portable::{groups, AlignedBuf, GROUP_COLS};

thread_local! {
    /// This thread's staging strip ([`drive`]), kept between calls.
    static STRIP: RefCell<Option<AlignedBuf<u16>>> = const { RefCell::new(None) };
}

/// Weight rows per tile.
pub const TILE_ROWS: usize = 16;
/// Tokens per activation tile (three columns each: 15 of 16).
pub const TILE_TOKENS: usize = 5;
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

/// Rows a task of `ntok` tokens should hold a multiple of: whole chunks where a prompt's
/// chunks are staged (each reads every token tile once a block, so whole chunks read them
/// fewest times), whole pairs of row tiles otherwise (every tile full, and the BF16 tiles
/// read in place).
pub fn task_rows_multiple(ntok: usize) -> usize {
    match ntok.div_ceil(TILE_TOKENS) {
        nct if nct > 2 => chunk_tiles(nct) * TILE_ROWS,
        _ => 2 * TILE_ROWS,
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
/// group `q` at `(n * groups + q) * 16 * pitch` dwords, row `j` (a column pair) at `j *
/// pitch` in it.
pub struct Tiles {
    data: AlignedBuf<u32>,
    ntok: usize,
    cols: usize,
    /// Columns of one tile: 3 per token, 15 from five tokens on.
    width: usize,
    /// Dwords from one tile row to the next: 16 for full tiles (each row its own cache
    /// line; 15 dwords apart, 15 of a tile's 16 rows straddled two lines), `width` for
    /// the narrower tiles of fewer than five tokens (the decode's, kept compact).
    pitch: usize,
}

impl Tiles {
    /// Token tiles.
    fn tiles(&self) -> usize {
        self.ntok.div_ceil(TILE_TOKENS)
    }
}

/// `ntok` tokens of `cols` activations (`xs`, token-major) split into parts and laid out
/// as activation tiles; a partial last group zero-padded.
pub fn prepare(xs: &[f32], cols: usize, ntok: usize) -> Tiles {
    assert!(xs.len() >= ntok * cols, "input length");
    let ng = groups(cols);
    let per = ntok.clamp(1, TILE_TOKENS);
    let width = PARTS * per;
    let pitch = if per == TILE_TOKENS { 16 } else { width };
    let tile = PAIRS * pitch;
    let mut data = AlignedBuf::<u32>::new(ntok.div_ceil(TILE_TOKENS) * ng * tile);
    // One token tile: its tokens' groups, one after another.
    let fill = |n: usize, dst: &mut [u32]| {
        for t in n * TILE_TOKENS..ntok.min((n + 1) * TILE_TOKENS) {
            let c0 = t % TILE_TOKENS;
            let x = &xs[t * cols..(t + 1) * cols];
            for q in 0..ng {
                let base = q * tile + c0;
                for j in 0..PAIRS {
                    let c = q * GROUP_COLS + 2 * j;
                    let p0 = split(x.get(c).copied().unwrap_or(0.0));
                    let p1 = split(x.get(c + 1).copied().unwrap_or(0.0));
                    for k in 0..PARTS {
                        dst[base + j * pitch + k * per] = (p1[k] as u32) << 16 | p0[k] as u32;
                    }
                }
            }
        }
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
        pitch,
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

/// `tilestored` of `tmm$t` to `p`, rows 64 bytes apart.
macro_rules! tstore {
    ($t:literal, $p:expr) => {
        asm!(concat!("tilestored [{p} + {s}*1], tmm", $t), p = in(reg) $p, s = in(reg) 64usize,
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

/// One block of `nq` groups for `RT` row tiles × `CT` token tiles: the accumulators from
/// zero, one step per group and weight part, stored to `c` (tile `2·rt + ct` at `256 ·
/// (2·rt + ct)` floats, rows 16 floats apart).
///
/// # Safety
/// The tiles configured ([`Config`]); `a` addresses `nq` groups of `NP` parts of `RT`
/// readable weight tiles; `b` (and `b + bnext` when `CT == 2`) `nq` activation tiles
/// `bstep` dwords apart with rows `bstride` bytes apart; `c` has room for 1024 floats.
#[inline(always)]
unsafe fn block<const RT: usize, const CT: usize, const NP: usize>(
    a: Weights,
    b: *const u32,
    (bstep, bnext, bstride): (usize, usize, usize),
    nq: usize,
    c: *mut f32,
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
        tstore!(0, c);
        if CT == 2 {
            tstore!(1, c.add(256));
        }
        if RT == 2 {
            tstore!(2, c.add(512));
        }
        if RT == 2 && CT == 2 {
            tstore!(3, c.add(768));
        }
    }
}

/// [`block`] for three row tiles × one token tile (`tmm7` configured for weights): the
/// three tiles' loads issue together before their steps, 48 rows of a group in flight.
/// Row tile `k` stored at `512 · k` floats (where [`block`] puts `(k, 0)`).
///
/// # Safety
/// As [`block`] with `RT == 3`, `CT == 1`, and the tiles configured with `three`.
#[inline(always)]
unsafe fn block3<const NP: usize>(
    a: Weights,
    b: *const u32,
    (bstep, _, bstride): (usize, usize, usize),
    nq: usize,
    c: *mut f32,
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
        tstore!(0, c);
        tstore!(1, c.add(512));
        tstore!(2, c.add(1024));
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

/// Rows `r0..r1` × every prepared token of format `F` with `NP` weight parts into `out`.
/// Rows go in chunks of row tiles: three against one token tile ([`block3`]), a pair
/// against two, up to [`CHUNK_TILES`] against more (prefill: each pair of token tiles is
/// then read from memory once a chunk and block, against every pair of row tiles from the
/// strip in L2). Per chunk and block:
/// - **In place** with up to two token tiles (the decode), BF16 tiles whose rows and groups
///   are all whole: the matrix's rows are the tile's (no prefetch: it measured slower).
/// - **Staged** otherwise: the chunk's block decoded (or copied, split) into a strip of
///   two halves, one step ahead: a tile load of rows just stored waits for the stores.
///
/// # Safety
/// As [`rows`]; the tiles configured for `x.width`.
unsafe fn drive<F: Format, const NP: usize>(
    f: F,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    x: &Tiles,
    out: &mut [f64],
) {
    let (ntok, ng, nct) = (x.ntok, groups(m.cols), x.tiles());
    assert!(
        r1 <= m.rows && out.len() >= (r1 - r0) * ntok,
        "output length"
    );
    out[..(r1 - r0) * ntok].fill(0.0);
    // One row tile's staged block.
    let tile_block = BLOCK_GROUPS * NP * A_TILE;
    let chunk = chunk_tiles(nct);
    let whole = m.cols / GROUP_COLS;
    // The steps: (first row, end row, first group, end group), chunk by chunk, block by
    // block, and whether each reads its weights in place.
    let mut steps = Vec::new();
    for c0 in (r0..r1).step_by(chunk * TILE_ROWS) {
        let c1 = r1.min(c0 + chunk * TILE_ROWS);
        let in_place = F::KIND == FormatKind::Bf16 && nct <= 2 && (c1 - c0) % TILE_ROWS == 0;
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
    // The stored tiles (row tile k, token tile j at 256 · (2k + j); k < 3), and the 16
    // floats the last row's `l` load reads past them.
    let mut c = AlignedBuf::<f32>::new(5 * 256 + 16);
    let bstep = PAIRS * x.pitch;
    let bs = (bstep, bstep * ng, 4 * x.pitch);
    let per = x.width / PARTS;
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
        for n in (0..nct).step_by(2) {
            let pair = n + 1 < nct;
            let b = x.data[(n * ng + q0) * bstep..].as_ptr();
            let mut i = 0;
            while i < tiles {
                // Three row tiles only where tmm7 is configured for weights.
                let rts = if nct == 1 && tiles - i >= 3 {
                    3
                } else {
                    2.min(tiles - i)
                };
                let rt = c0 + i * TILE_ROWS;
                // SAFETY: still inside the strip or the matrix (row tile i < tiles).
                let a = Weights {
                    base: unsafe { a0.base.add(i * a0.half) },
                    ..a0
                };
                let (cp, nq) = (c.as_mut_ptr(), q1 - q0);
                // SAFETY: `a` addresses row tiles i..i + rts of the block; token tile n
                // (and n + 1) has groups q0..q1 in x.data; c holds the stored tiles; tiles
                // configured (three row tiles only with one token tile).
                unsafe {
                    match (rts, pair) {
                        (3, _) => block3::<NP>(a, b, bs, nq, cp),
                        (2, true) => block::<2, 2, NP>(a, b, bs, nq, cp),
                        (2, false) => block::<2, 1, NP>(a, b, bs, nq, cp),
                        (_, true) => block::<1, 2, NP>(a, b, bs, nq, cp),
                        (_, false) => block::<1, 1, NP>(a, b, bs, nq, cp),
                    }
                }
                // SAFETY: AVX-512F enabled in the caller.
                unsafe { promote(&c, (rt, r0, c1), (n, ntok, per), (rts, pair), out) };
                i += rts;
            }
        }
    }
    STRIP.with(|s| *s.borrow_mut() = Some(strip));
}

/// Add one block's stored accumulators (`c`, from [`block`] or [`block3`]) of `rts` row
/// tiles at `rt` and token tiles from `n` (`per` tokens a tile: columns `h` at `0..per`,
/// `m` at `per..2·per`, `l` at `2·per..3·per`) to the f64 sums: `(f64(h) + f64(m)) +
/// f64(l)` per (row, token), eight lanes at a time (those past the tile's tokens masked
/// off).
///
/// # Safety
/// AVX-512F enabled in the caller; `c` holds 16 floats past the stored tiles.
#[inline(always)]
unsafe fn promote(
    c: &[f32],
    (rt, r0, r1): (usize, usize, usize),
    (n, ntok, per): (usize, usize, usize),
    (rts, pair): (usize, bool),
    out: &mut [f64],
) {
    assert!(c.len() >= 256 * (2 * rts - 1 + pair as usize) + 16 && per <= 8);
    for ri in 0..rts {
        for ci in 0..1 + pair as usize {
            let t0 = (n + ci) * TILE_TOKENS;
            let tn = per.min(ntok - t0);
            let mask = (1u8 << tn) - 1;
            for i in 0..TILE_ROWS.min(r1 - (rt + ri * TILE_ROWS)) {
                let r = rt + ri * TILE_ROWS + i;
                let at = 256 * (2 * ri + ci) + 16 * i;
                let o = &mut out[(r - r0) * ntok + t0..(r - r0) * ntok + t0 + tn];
                // SAFETY: 8 floats from at + 2·per <= at + 16 lie in c (asserted); the
                // masked f64 load and store touch the tn lanes of o only.
                unsafe {
                    let p = c.as_ptr().add(at);
                    let h = _mm512_cvtps_pd(_mm256_loadu_ps(p));
                    let m = _mm512_cvtps_pd(_mm256_loadu_ps(p.add(per)));
                    let l = _mm512_cvtps_pd(_mm256_loadu_ps(p.add(2 * per)));
                    let s = _mm512_add_pd(_mm512_add_pd(h, m), l);
                    let y = _mm512_maskz_loadu_pd(mask, o.as_ptr());
                    _mm512_mask_storeu_pd(o.as_mut_ptr(), mask, _mm512_add_pd(y, s));
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
