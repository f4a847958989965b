//! The portable twin of every SIMD product kernel: plain Rust that performs, lane by lane,
//! the operations of the reduction contract (see [`super::matmul`]) in the contract's order,
//! with `f32::mul_add` / `f64::mul_add` where the SIMD kernels use a fused multiply-add.
//!
//! The AVX2 and AVX-512 kernels are tested bit for bit against these functions
//! (`tests/kernels_bitexact.rs`). The helpers here (lane map, x permutation, E8M0 tables,
//! lane tree) are shared by every path, so the contract is written down once; the
//! formats' decode and partial-group padding are in [`super::format`].

use super::format::{stage_partial, with_format, Format, FormatFn};
use super::matmul::Mat;
use super::mxfp4;

/// Accumulator lanes of every dot product (one per column of a 32-column group).
pub const LANES: usize = 32;
/// Columns per lane group (one column per lane); equal to the MXFP4 scale group.
pub const GROUP_COLS: usize = 32;
/// Lane groups per f32 block: lanes accumulate in f32 for [`BLOCK_COLS`] columns, then
/// are promoted to f64.
pub const BLOCK_GROUPS: usize = 32;
/// Columns per f32 accumulation block (1024).
pub const BLOCK_COLS: usize = BLOCK_GROUPS * GROUP_COLS;

/// Column (inside its 32-column group) that lane `l` accumulates: lanes 0..15 take the
/// even columns 0, 2, .., 30 and lanes 16..31 the odd columns 1, 3, .., 31.
#[inline(always)]
pub const fn lane_col(l: usize) -> usize {
    if l < 16 {
        2 * l
    } else {
        2 * (l - 16) + 1
    }
}

/// Number of 32-column groups of a row of `cols` columns.
#[inline]
pub const fn groups(cols: usize) -> usize {
    cols.div_ceil(GROUP_COLS)
}

/// E8M0 scale byte → 2^(s−127) as an exact f32 (subnormal at s = 0); 255 (NaN in the OCP
/// spec) → +0, which zeroes the group.
pub static E8M0: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut s = 1;
    while s < 255 {
        t[s] = f32::from_bits((s as u32) << 23);
        s += 1;
    }
    t[0] = f32::from_bits(0x0040_0000);
    t
};

/// 64-byte aligned rows of 16 f32 (one zmm each).
#[repr(C, align(64))]
pub struct ScaledE2M1(pub [[f32; 16]; 256]);

/// `E2M1[code] * E8M0[scale]` for every scale byte and code: the exact f32 MXFP4 weight,
/// computed by the same f32 multiply the twin performs (at compile time). The AVX-512
/// kernel looks a group's 16 possible weights up in one row (a memory operand of
/// `vpermps`), which saves the per-group multiply.
pub static E2M1_SCALED: ScaledE2M1 = {
    let mut t = [[0f32; 16]; 256];
    let mut s = 0;
    while s < 256 {
        let mut c = 0;
        while c < 16 {
            t[s][c] = mxfp4::E2M1[c] * E8M0[s];
            c += 1;
        }
        s += 1;
    }
    ScaledE2M1(t)
};

/// Distance (in values) between consecutive permuted tokens: the permuted length
/// `groups(cols)*32` plus 16 values (64 bytes) of padding, so that the same column of
/// consecutive tokens does not fall in the same L1 set when `cols*4` is a multiple of
/// 4096 (7168, 3072: batched products would thrash L1 otherwise).
#[inline]
pub const fn x_stride(cols: usize) -> usize {
    groups(cols) * GROUP_COLS + 16
}

/// Put `x` (one token, `cols` values) into lane order: `xp[32q + l] = x[32q + lane_col(l)]`,
/// zero where that column does not exist. `xp.len()` must be `groups(cols) * 32`.
pub fn permute_into<T: Copy + Default>(x: &[T], xp: &mut [T]) {
    let n = x.len();
    assert!(xp.len() >= groups(n) * GROUP_COLS, "permuted x length");
    for (q, dst) in xp[..groups(n) * GROUP_COLS]
        .chunks_exact_mut(GROUP_COLS)
        .enumerate()
    {
        let c0 = q * GROUP_COLS;
        if c0 + GROUP_COLS <= n {
            let src = &x[c0..c0 + GROUP_COLS];
            for i in 0..16 {
                dst[i] = src[2 * i];
                dst[16 + i] = src[2 * i + 1];
            }
        } else {
            for (l, d) in dst.iter_mut().enumerate() {
                let c = c0 + lane_col(l);
                *d = if c < n { x[c] } else { T::default() };
            }
        }
    }
}

/// Alignment (bytes) of a permuted input: one cache line, so no 64-byte SIMD load of an
/// activation group ever straddles two lines (a straddling zmm load costs two L1 reads:
/// the batched kernels ran at about half speed on an input 16 bytes off a line).
pub const X_ALIGN: usize = 64;

/// A zero-initialised buffer whose first element sits on an [`X_ALIGN`]-byte boundary
/// (a `Vec` with the slack to shift its start); dereferences to the aligned slice.
pub struct AlignedBuf<T> {
    v: Vec<T>,
    off: usize,
    len: usize,
}

impl<T: Copy + Default> AlignedBuf<T> {
    /// `len` default values starting on an [`X_ALIGN`]-byte boundary.
    pub fn new(len: usize) -> Self {
        let size = std::mem::size_of::<T>().max(1);
        assert!(
            X_ALIGN.is_multiple_of(size),
            "element size must divide the alignment"
        );
        let slack = X_ALIGN / size;
        let v = vec![T::default(); len + slack];
        // Elements of a Vec<T> sit at multiples of size_of::<T>(), so the distance to the
        // next boundary is a whole number of elements.
        let off = (v.as_ptr().align_offset(X_ALIGN)).min(slack);
        AlignedBuf { v, off, len }
    }
}

impl<T> std::ops::Deref for AlignedBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.v[self.off..self.off + self.len]
    }
}

impl<T> std::ops::DerefMut for AlignedBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.v[self.off..self.off + self.len]
    }
}

/// `ntok` tokens of `cols` values each, permuted; token `t` starts at `t * x_stride(cols)`,
/// and every token starts on an [`X_ALIGN`]-byte boundary (for f32: the stride is a
/// multiple of 16 values).
pub fn permute_tokens<T: Copy + Default>(xs: &[T], cols: usize, ntok: usize) -> AlignedBuf<T> {
    let stride = x_stride(cols);
    let mut out = AlignedBuf::new(ntok * stride);
    for t in 0..ntok {
        permute_into(
            &xs[t * cols..(t + 1) * cols],
            &mut out[t * stride..t * stride + groups(cols) * GROUP_COLS],
        );
    }
    out
}

/// Combine 32 f64 lanes with the fixed halving tree (16, 8, 4, 2, 1).
#[inline]
pub fn reduce_lanes(acc: &mut [f64; LANES]) -> f64 {
    let mut w = LANES / 2;
    while w > 0 {
        for j in 0..w {
            acc[j] += acc[j + w];
        }
        w /= 2;
    }
    acc[0]
}

/// Decode group `q` of row `r` of `f` (a view of `m`) into its 32 weights in lane order
/// (a partial group zero-padded, as every path pads it: [`stage_partial`]).
#[inline]
fn decode_group<F: Format>(f: F, m: &Mat<'_>, r: usize, q: usize, w: &mut [f32; LANES]) {
    if (q + 1) * GROUP_COLS <= m.cols {
        let (bytes, s) = f.group_bytes(r, q);
        F::decode_portable(bytes, s, w);
    } else {
        let mut buf = [0u8; 128];
        let s = stage_partial(m, r, q, &mut buf);
        F::decode_portable(&buf, s, w);
    }
}

/// Row `r` of `f` (a view of `m`) · one permuted f32 token `xp` under the f32-block
/// contract; the unrounded f64 result of the lane tree.
fn dot_f32_lanes<F: Format>(f: F, m: &Mat<'_>, r: usize, xp: &[f32]) -> f64 {
    let ng = groups(m.cols);
    assert!(xp.len() >= ng * GROUP_COLS);
    let mut acc64 = [0f64; LANES];
    let mut w = [0f32; LANES];
    let mut q = 0;
    while q < ng {
        let qe = (q + BLOCK_GROUPS).min(ng);
        let mut acc = [0f32; LANES];
        while q < qe {
            decode_group(f, m, r, q, &mut w);
            let xq = &xp[q * GROUP_COLS..(q + 1) * GROUP_COLS];
            for l in 0..LANES {
                acc[l] = w[l].mul_add(xq[l], acc[l]);
            }
            q += 1;
        }
        for l in 0..LANES {
            acc64[l] += acc[l] as f64;
        }
    }
    reduce_lanes(&mut acc64)
}

/// Portable row-block kernel: sums for rows `r0..r1` × `ntok` tokens into `out[(r-r0)*ntok+t]`.
pub fn rows_f32(m: &Mat<'_>, r0: usize, r1: usize, xp: &[f32], ntok: usize, out: &mut [f64]) {
    struct Rows<'x> {
        r0: usize,
        r1: usize,
        xp: &'x [f32],
        ntok: usize,
        out: &'x mut [f64],
    }
    impl FormatFn for Rows<'_> {
        type Out = ();
        fn call<F: Format>(self, f: F, m: &Mat<'_>) {
            let stride = x_stride(m.cols);
            for r in self.r0..self.r1 {
                for t in 0..self.ntok {
                    let x = &self.xp[t * stride..(t + 1) * stride];
                    self.out[(r - self.r0) * self.ntok + t] = dot_f32_lanes(f, m, r, x);
                }
            }
        }
    }
    with_format(
        m,
        Rows {
            r0,
            r1,
            xp,
            ntok,
            out,
        },
    );
}
