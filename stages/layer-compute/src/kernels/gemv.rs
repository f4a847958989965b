//! Matrix-vector products `y = W x` over weights kept exactly as shipped.
//!
//! Three weight encodings share one reduction contract: BF16 (widened exactly to f32 by a
//! 16-bit shift), F32, and MXFP4 (compressed-tensors packing, decoded on the fly from the
//! packed bytes; the matrix is never expanded in memory).
//!
//! The reduction contract, which every path (portable, AVX2, 1 or N threads) follows bit
//! for bit:
//! - each output row is one dot product; threads split output rows, never a dot product;
//! - column `c` is accumulated into lane `c % 32` of 32 f64 accumulators, in increasing
//!   `c`, as a separate multiply then add; the product of a widened weight (≤ 24
//!   significant bits) and an f32 activation is EXACT in f64, so only the additions round;
//! - the 32 lanes are then combined by the fixed halving tree of [`reduce_lanes`] and the
//!   sum is rounded once to f32;
//! - an MXFP4 weight is `E2M1[code] * 2^(scale - 127)` (an exact f32), multiplied by `x[c]`
//!   like any other weight; a group whose scale byte is 255 (NaN in the OCP spec) is skipped,
//!   which is the same as zeroing it.
//!
//! Consequently an MXFP4 product equals, bit for bit, the F32 product of its dequantised
//! matrix, and a BF16 product equals the F32 product of its widened matrix.

use super::mxfp4;
use super::simd;

/// Number of independent accumulator lanes of every dot product.
pub const LANES: usize = 32;

/// Combine the 32 lanes with the fixed halving tree (16, 8, 4, 2, 1).
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

/// How the weight bytes encode the matrix.
#[derive(Clone, Copy, Debug)]
pub enum MatData<'a> {
    /// Row-major bf16, little-endian, `rows * cols * 2` bytes.
    Bf16(&'a [u8]),
    /// Row-major f32, little-endian, `rows * cols * 4` bytes.
    F32(&'a [u8]),
    /// compressed-tensors MXFP4: `packed` is `[rows, ceil(cols/2)]` (low nibble = even
    /// column), `scales` is `[rows, ceil(cols/32)]` E8M0 bytes.
    Mxfp4 { packed: &'a [u8], scales: &'a [u8] },
}

/// A borrowed weight matrix `W ∈ R^{rows×cols}` (nn.Linear convention, `y = W x`).
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    pub rows: usize,
    pub cols: usize,
    pub data: MatData<'a>,
}

/// A matrix whose bytes do not fit its declared shape.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ShapeError(pub String);

impl<'a> Mat<'a> {
    /// A bf16 matrix; checks the byte count.
    pub fn bf16(bytes: &'a [u8], rows: usize, cols: usize) -> Result<Self, ShapeError> {
        Self::check(bytes.len(), rows * cols * 2, "bf16", rows, cols)?;
        Ok(Mat {
            rows,
            cols,
            data: MatData::Bf16(bytes),
        })
    }

    /// An f32 matrix; checks the byte count.
    pub fn f32(bytes: &'a [u8], rows: usize, cols: usize) -> Result<Self, ShapeError> {
        Self::check(bytes.len(), rows * cols * 4, "f32", rows, cols)?;
        Ok(Mat {
            rows,
            cols,
            data: MatData::F32(bytes),
        })
    }

    /// An MXFP4 matrix of logical shape `rows × cols`; checks both byte counts.
    pub fn mxfp4(
        packed: &'a [u8],
        scales: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self, ShapeError> {
        Self::check(
            packed.len(),
            rows * cols.div_ceil(2),
            "mxfp4 packed",
            rows,
            cols,
        )?;
        Self::check(
            scales.len(),
            rows * cols.div_ceil(mxfp4::GROUP),
            "mxfp4 scale",
            rows,
            cols,
        )?;
        Ok(Mat {
            rows,
            cols,
            data: MatData::Mxfp4 { packed, scales },
        })
    }

    fn check(
        got: usize,
        want: usize,
        what: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(), ShapeError> {
        if got != want {
            return Err(ShapeError(format!(
                "{what} matrix {rows}x{cols} needs {want} bytes, got {got}"
            )));
        }
        Ok(())
    }

    /// Bytes of weight data read by one product (for bandwidth accounting).
    pub fn weight_bytes(&self) -> usize {
        match self.data {
            MatData::Bf16(b) | MatData::F32(b) => b.len(),
            MatData::Mxfp4 { packed, scales } => packed.len() + scales.len(),
        }
    }

    /// Dot product of row `r` with `x` (len `cols`), on the selected path.
    pub fn row_dot(&self, r: usize, x: &[f32]) -> f32 {
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        self.row_dot_with(r, &x64, simd::avx2_enabled()) as f32
    }

    /// The unrounded f64 sum of row `r` · `x` (the lane tree's result).
    #[inline]
    fn row_dot_with(&self, r: usize, x: &[f64], avx2: bool) -> f64 {
        let c = self.cols;
        match self.data {
            MatData::Bf16(b) => {
                let row = &b[r * c * 2..(r + 1) * c * 2];
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: avx2_enabled() verified AVX2 at run time.
                    return unsafe { simd::dot_bf16_avx2(row, x) };
                }
                let _ = avx2;
                dot_bf16_portable(row, x)
            }
            MatData::F32(b) => {
                let row = &b[r * c * 4..(r + 1) * c * 4];
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: avx2_enabled() verified AVX2 at run time.
                    return unsafe { simd::dot_f32_avx2(row, x) };
                }
                dot_f32_portable(row, x)
            }
            MatData::Mxfp4 { packed, scales } => {
                let pb = c.div_ceil(2);
                let sb = c.div_ceil(mxfp4::GROUP);
                let prow = &packed[r * pb..(r + 1) * pb];
                let srow = &scales[r * sb..(r + 1) * sb];
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: avx2_enabled() verified AVX2 at run time.
                    return unsafe { simd::dot_mxfp4_avx2(prow, srow, x) };
                }
                dot_mxfp4_portable(prow, srow, x)
            }
        }
    }

    /// Row dot on the portable path regardless of the CPU (for tests and benchmarks).
    pub fn row_dot_portable(&self, r: usize, x: &[f32]) -> f32 {
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        self.row_dot_with(r, &x64, false) as f32
    }
}

/// Widen one bf16 (little-endian bytes) to f32 exactly.
#[inline(always)]
pub fn bf16_at(b: &[u8], i: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16)
}

/// Read one little-endian f32.
#[inline(always)]
pub fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// Portable bf16 row · x (x already widened to f64) under the lane contract.
pub fn dot_bf16_portable(row: &[u8], x: &[f64]) -> f64 {
    let n = x.len();
    assert_eq!(row.len(), 2 * n);
    let mut acc = [0f64; LANES];
    let full = n / LANES * LANES;
    let mut i = 0;
    while i < full {
        let rb = &row[2 * i..2 * (i + LANES)];
        let xb = &x[i..i + LANES];
        for l in 0..LANES {
            acc[l] += bf16_at(rb, l) as f64 * xb[l];
        }
        i += LANES;
    }
    for c in full..n {
        acc[c - full] += bf16_at(row, c) as f64 * x[c];
    }
    reduce_lanes(&mut acc)
}

/// Portable f32 row · x (x already widened to f64) under the lane contract.
pub fn dot_f32_portable(row: &[u8], x: &[f64]) -> f64 {
    let n = x.len();
    assert_eq!(row.len(), 4 * n);
    let mut acc = [0f64; LANES];
    let full = n / LANES * LANES;
    let mut i = 0;
    while i < full {
        let rb = &row[4 * i..4 * (i + LANES)];
        let xb = &x[i..i + LANES];
        for l in 0..LANES {
            acc[l] += f32_at(rb, l) as f64 * xb[l];
        }
        i += LANES;
    }
    for c in full..n {
        acc[c - full] += f32_at(row, c) as f64 * x[c];
    }
    reduce_lanes(&mut acc)
}

/// Portable MXFP4 row · x (x widened to f64) straight from packed bytes, under the lane
/// contract.
pub fn dot_mxfp4_portable(prow: &[u8], srow: &[u8], x: &[f64]) -> f64 {
    let n = x.len();
    assert_eq!(prow.len(), n.div_ceil(2));
    assert_eq!(srow.len(), n.div_ceil(mxfp4::GROUP));
    let mut acc = [0f64; LANES];
    for (g, &sbyte) in srow.iter().enumerate() {
        if sbyte == 255 {
            continue; // NaN scale: the group contributes nothing
        }
        let s = mxfp4::e8m0(sbyte);
        let c0 = g * mxfp4::GROUP;
        let c1 = (c0 + mxfp4::GROUP).min(n);
        for c in c0..c1 {
            let byte = prow[c / 2];
            let code = if c % 2 == 0 { byte & 0x0F } else { byte >> 4 };
            let w = mxfp4::E2M1[code as usize] * s;
            acc[c - c0] += w as f64 * x[c];
        }
    }
    reduce_lanes(&mut acc)
}

/// Below this many weights a product runs on the calling thread only.
pub const PAR_MIN_WEIGHTS: usize = 1 << 15;

/// Split `0..rows` into at most `parts` contiguous chunks of near-equal size.
fn row_chunks(rows: usize, parts: usize) -> Vec<(usize, usize)> {
    let parts = parts.clamp(1, rows.max(1));
    let base = rows / parts;
    let extra = rows % parts;
    let mut out = Vec::with_capacity(parts);
    let mut r0 = 0;
    for p in 0..parts {
        let len = base + usize::from(p < extra);
        out.push((r0, r0 + len));
        r0 += len;
    }
    out
}

/// `y = W x` with `threads` workers splitting the output rows.
pub fn gemv(m: &Mat<'_>, x: &[f32], y: &mut [f32], threads: usize) {
    gemm(m, x, y, 1, threads);
}

/// `ys[t] = W xs[t]` for `t < ntok`; `xs` is `ntok × cols`, `ys` is `ntok × rows`.
///
/// Row-outer, token-inner: each weight row is read from memory once for all tokens, and
/// every (row, token) result is the same dot product [`gemv`] computes, so batching never
/// changes a bit.
pub fn gemm(m: &Mat<'_>, xs: &[f32], ys: &mut [f32], ntok: usize, threads: usize) {
    let x64: Vec<f64> = xs.iter().map(|&v| v as f64).collect();
    gemm_impl(m, &x64, ys, ntok, threads, |v| v as f32);
}

/// [`gemm`] returning the unrounded f64 sums (for a caller that adds two products and
/// rounds once).
pub fn gemm64(m: &Mat<'_>, xs: &[f32], ys: &mut [f64], ntok: usize, threads: usize) {
    let x64: Vec<f64> = xs.iter().map(|&v| v as f64).collect();
    gemm_impl(m, &x64, ys, ntok, threads, |v| v);
}

/// [`gemm64`] over an f64 input (an f64 island, e.g. SiTU output feeding a down
/// projection). The product of a weight and an f64 input rounds in f64.
pub fn gemm64_x64(m: &Mat<'_>, xs: &[f64], ys: &mut [f64], ntok: usize, threads: usize) {
    gemm_impl(m, xs, ys, ntok, threads, |v| v);
}

fn gemm_impl<T: Copy + Send + Default>(
    m: &Mat<'_>,
    xs: &[f64],
    ys: &mut [T],
    ntok: usize,
    threads: usize,
    conv: fn(f64) -> T,
) {
    assert_eq!(xs.len(), ntok * m.cols, "gemm input length");
    assert_eq!(ys.len(), ntok * m.rows, "gemm output length");
    let avx2 = simd::avx2_enabled();
    let work = m.rows * m.cols * ntok.max(1);
    if threads <= 1 || work < PAR_MIN_WEIGHTS || m.rows < 2 {
        for r in 0..m.rows {
            for t in 0..ntok {
                ys[t * m.rows + r] =
                    conv(m.row_dot_with(r, &xs[t * m.cols..(t + 1) * m.cols], avx2));
            }
        }
        return;
    }
    let chunks = row_chunks(m.rows, threads);
    if ntok == 1 {
        // Disjoint output slices, written in place.
        let mut rest: &mut [T] = ys;
        let mut slices = Vec::with_capacity(chunks.len());
        for &(r0, r1) in &chunks {
            let (a, b) = rest.split_at_mut(r1 - r0);
            slices.push((r0, a));
            rest = b;
        }
        std::thread::scope(|s| {
            let mut it = slices.into_iter();
            let first = it.next();
            for (r0, out) in it {
                s.spawn(move || {
                    for (i, o) in out.iter_mut().enumerate() {
                        *o = conv(m.row_dot_with(r0 + i, xs, avx2));
                    }
                });
            }
            if let Some((r0, out)) = first {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = conv(m.row_dot_with(r0 + i, xs, avx2));
                }
            }
        });
        return;
    }
    // Several tokens: each worker fills a local [rows_chunk × ntok] block, then scatter.
    let blocks: Vec<Vec<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .iter()
            .map(|&(r0, r1)| {
                s.spawn(move || {
                    let mut blk = Vec::with_capacity((r1 - r0) * ntok);
                    for r in r0..r1 {
                        for t in 0..ntok {
                            blk.push(conv(m.row_dot_with(
                                r,
                                &xs[t * m.cols..(t + 1) * m.cols],
                                avx2,
                            )));
                        }
                    }
                    blk
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("gemv worker panicked"))
            .collect()
    });
    for (&(r0, r1), blk) in chunks.iter().zip(blocks) {
        for r in r0..r1 {
            for t in 0..ntok {
                ys[t * m.rows + r] = blk[(r - r0) * ntok + t];
            }
        }
    }
}

/// `y = W x` on the portable path, single-threaded (the reference the SIMD tests use).
pub fn gemv_portable(m: &Mat<'_>, x: &[f32], y: &mut [f32]) {
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for (r, o) in y.iter_mut().enumerate().take(m.rows) {
        *o = m.row_dot_with(r, &x64, false) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    // Catches: a reduction that is not the documented lane order (a plain sequential sum
    // differs in the last bits on these sizes).
    #[test]
    fn f32_dot_follows_lane_contract() {
        let mut s = 7u64;
        for n in [1usize, 5, 31, 32, 33, 64, 100, 257] {
            let w: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
            let x: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
            let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            let mut acc = [0f64; LANES];
            for c in 0..n {
                acc[c % LANES] += w[c] as f64 * x[c] as f64;
            }
            let want = reduce_lanes(&mut acc) as f32;
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            assert_eq!(
                (dot_f32_portable(&bytes, &x64) as f32).to_bits(),
                want.to_bits(),
                "n={n}"
            );
        }
    }

    // Catches: a threaded split that changes the reduction (results must be bitwise equal).
    #[test]
    fn threads_do_not_change_bits() {
        let mut s = 11u64;
        let (rows, cols) = (301, 257);
        let w: Vec<u8> = (0..rows * cols)
            .flat_map(|_| ((lcg(&mut s).to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        let m = Mat::bf16(&w, rows, cols).unwrap();
        let ntok = 3;
        let x: Vec<f32> = (0..cols * ntok).map(|_| lcg(&mut s)).collect();
        let mut y1 = vec![0f32; rows * ntok];
        gemm(&m, &x, &mut y1, ntok, 1);
        for th in [2, 3, 7] {
            let mut y2 = vec![0f32; rows * ntok];
            gemm(&m, &x, &mut y2, ntok, th);
            assert!(y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()));
            let mut y3 = vec![0f32; rows];
            gemv(&m, &x[cols..2 * cols], &mut y3, th);
            for r in 0..rows {
                assert_eq!(y3[r].to_bits(), y1[rows + r].to_bits());
            }
        }
    }
}
