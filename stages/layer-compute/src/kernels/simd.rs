//! AVX2 dot products and the run-time choice between them and the portable kernels.
//!
//! Each AVX2 kernel performs exactly the operations of its portable twin in
//! [`super::gemv`], in the same order: eight 4-wide f64 accumulators are lanes 0..31 of the
//! lane contract, multiply and add are separate instructions (no FMA, because the portable
//! path has none; the products are exact in f64 anyway), the tail and the final halving
//! tree run the shared scalar code. The
//! results are therefore bit-identical, which the tests check on random inputs.
//!
//! The path is chosen at run time (`is_x86_feature_detected!`); `K3_FORCE_PORTABLE=1` in
//! the environment, or [`set_force_portable`], forces the portable kernels.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// 0 = follow the environment, 1 = forced portable, 2 = SIMD allowed.
static FORCE: AtomicU8 = AtomicU8::new(0);

fn env_forces_portable() -> bool {
    static ENV: OnceLock<bool> = OnceLock::new();
    *ENV.get_or_init(|| {
        std::env::var("K3_FORCE_PORTABLE")
            .map(|v| !v.is_empty() && v != "0")
            .unwrap_or(false)
    })
}

/// Whether this CPU has AVX2 (detected once).
pub fn avx2_available() -> bool {
    static HAVE: OnceLock<bool> = OnceLock::new();
    *HAVE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx2")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Force (true) or release (false) the portable path for the whole process.
pub fn set_force_portable(force: bool) {
    FORCE.store(if force { 1 } else { 2 }, Ordering::SeqCst);
}

/// Whether products currently run on the AVX2 kernels.
#[inline]
pub fn avx2_enabled() -> bool {
    let forced = match FORCE.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => env_forces_portable(),
    };
    !forced && avx2_available()
}

/// The kernel family in use, for reports.
pub fn path_name() -> &'static str {
    if avx2_enabled() {
        "avx2"
    } else {
        "portable"
    }
}

#[cfg(target_arch = "x86_64")]
pub use x86::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::gemv::{bf16_at, f32_at, reduce_lanes, LANES};
    use super::super::mxfp4;
    use std::arch::x86_64::*;

    /// Eight 4-wide f64 accumulators: lanes 4j..4j+3 live in `a[j]`.
    type Acc = [__m256d; 8];

    #[inline(always)]
    unsafe fn spill(a: &Acc) -> [f64; LANES] {
        let mut acc = [0f64; LANES];
        for (j, v) in a.iter().enumerate() {
            // SAFETY: acc has room for 8 × 4 f64; unaligned stores are allowed.
            unsafe { _mm256_storeu_pd(acc.as_mut_ptr().add(4 * j), *v) };
        }
        acc
    }

    /// Accumulate 8 f32 weights `w` times `x[0..8]` into lanes `a[2k]`, `a[2k+1]`
    /// (widen, multiply, add; no FMA).
    #[inline(always)]
    unsafe fn acc8(a: &mut Acc, k: usize, w: __m256, x: *const f64) {
        // SAFETY: the caller guarantees 8 readable f64 at x and AVX2 support.
        unsafe {
            let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(w));
            let hi = _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1));
            a[2 * k] = _mm256_add_pd(a[2 * k], _mm256_mul_pd(lo, _mm256_loadu_pd(x)));
            a[2 * k + 1] =
                _mm256_add_pd(a[2 * k + 1], _mm256_mul_pd(hi, _mm256_loadu_pd(x.add(4))));
        }
    }

    /// bf16 row · x, bit-identical to `gemv::dot_bf16_portable`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_bf16_avx2(row: &[u8], x: &[f64]) -> f64 {
        let n = x.len();
        assert_eq!(row.len(), 2 * n);
        let full = n / LANES * LANES;
        let rp = row.as_ptr();
        let xp = x.as_ptr();
        let mut a: Acc = [_mm256_setzero_pd(); 8];
        let mut i = 0;
        while i < full {
            for k in 0..4 {
                // SAFETY: i + 8k + 8 <= full <= n: 16 bytes at 2(i+8k), 8 f64 at i+8k.
                unsafe {
                    let h = _mm_loadu_si128(rp.add(2 * (i + 8 * k)) as *const __m128i);
                    let w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                    acc8(&mut a, k, w, xp.add(i + 8 * k));
                }
            }
            i += LANES;
        }
        // SAFETY: AVX2 is enabled for this function.
        let mut acc = unsafe { spill(&a) };
        for c in full..n {
            acc[c - full] += bf16_at(row, c) as f64 * x[c];
        }
        reduce_lanes(&mut acc)
    }

    /// f32 row · x, bit-identical to `gemv::dot_f32_portable`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_f32_avx2(row: &[u8], x: &[f64]) -> f64 {
        let n = x.len();
        assert_eq!(row.len(), 4 * n);
        let full = n / LANES * LANES;
        let rp = row.as_ptr();
        let xp = x.as_ptr();
        let mut a: Acc = [_mm256_setzero_pd(); 8];
        let mut i = 0;
        while i < full {
            for k in 0..4 {
                // SAFETY: i + 8k + 8 <= n: 32 bytes at 4(i+8k), 8 f64 at i+8k.
                unsafe {
                    let w = _mm256_loadu_ps(rp.add(4 * (i + 8 * k)) as *const f32);
                    acc8(&mut a, k, w, xp.add(i + 8 * k));
                }
            }
            i += LANES;
        }
        // SAFETY: AVX2 is enabled for this function.
        let mut acc = unsafe { spill(&a) };
        for c in full..n {
            acc[c - full] += f32_at(row, c) as f64 * x[c];
        }
        reduce_lanes(&mut acc)
    }

    /// MXFP4 row · x from packed bytes, bit-identical to `gemv::dot_mxfp4_portable`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_mxfp4_avx2(prow: &[u8], srow: &[u8], x: &[f64]) -> f64 {
        let n = x.len();
        assert_eq!(prow.len(), n.div_ceil(2));
        assert_eq!(srow.len(), n.div_ceil(mxfp4::GROUP));
        let full_groups = n / mxfp4::GROUP;
        let pp = prow.as_ptr();
        let xp = x.as_ptr();
        let mag = _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
        let low4 = _mm_set1_epi8(0x0F);
        let eight = _mm256_set1_epi32(8);
        let mut a: Acc = [_mm256_setzero_pd(); 8];
        for (g, &sbyte) in srow.iter().enumerate().take(full_groups) {
            if sbyte == 255 {
                continue;
            }
            let sv = _mm256_set1_ps(mxfp4::e8m0(sbyte));
            let c0 = g * mxfp4::GROUP;
            // SAFETY: a full group has 16 packed bytes at c0/2 and 32 f64 at c0.
            unsafe {
                let bytes = _mm_loadu_si128(pp.add(c0 / 2) as *const __m128i);
                let lo = _mm_and_si128(bytes, low4);
                let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
                let ca = _mm_unpacklo_epi8(lo, hi); // codes of columns 0..15
                let cb = _mm_unpackhi_epi8(lo, hi); // codes of columns 16..31
                let pieces = [ca, _mm_srli_si128(ca, 8), cb, _mm_srli_si128(cb, 8)];
                for (k, piece) in pieces.into_iter().enumerate() {
                    let codes = _mm256_cvtepu8_epi32(piece);
                    // vpermps reads the low 3 bits of each index: the magnitude.
                    let m = _mm256_permutevar8x32_ps(mag, codes);
                    let sign = _mm256_slli_epi32(_mm256_and_si256(codes, eight), 28);
                    let v = _mm256_or_ps(m, _mm256_castsi256_ps(sign));
                    acc8(&mut a, k, _mm256_mul_ps(v, sv), xp.add(c0 + 8 * k));
                }
            }
        }
        // SAFETY: AVX2 is enabled for this function.
        let mut acc = unsafe { spill(&a) };
        if full_groups < srow.len() {
            let sbyte = srow[full_groups];
            if sbyte != 255 {
                let s = mxfp4::e8m0(sbyte);
                let c0 = full_groups * mxfp4::GROUP;
                for c in c0..n {
                    let byte = prow[c / 2];
                    let code = if c % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                    let w = mxfp4::E2M1[code as usize] * s;
                    acc[c - c0] += w as f64 * x[c];
                }
            }
        }
        reduce_lanes(&mut acc)
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::super::gemv::{dot_bf16_portable, dot_f32_portable, dot_mxfp4_portable};
    use super::*;

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    fn randf(seed: &mut u64) -> f32 {
        let v = (rng(seed) >> 40) as f32 / (1u64 << 24) as f32;
        (v * 2.0 - 1.0) * 3.0
    }

    const SIZES: [usize; 12] = [1, 2, 7, 31, 32, 33, 63, 64, 65, 100, 257, 1031];

    // Catches: an AVX2 path that reassociates the sum, uses FMA, or mishandles the tail.
    #[test]
    fn avx2_bf16_and_f32_match_portable_bitwise() {
        if !avx2_available() {
            return;
        }
        let mut s = 0x1234_5678_9abc_def0u64;
        for &n in &SIZES {
            for _ in 0..20 {
                let x: Vec<f64> = (0..n).map(|_| randf(&mut s) as f64).collect();
                let wb: Vec<u8> = (0..n)
                    .flat_map(|_| (rng(&mut s) as u16).to_le_bytes())
                    .collect();
                let wf: Vec<u8> = (0..n).flat_map(|_| randf(&mut s).to_le_bytes()).collect();
                // SAFETY: avx2_available() checked above.
                let (a, b) = unsafe { (dot_bf16_avx2(&wb, &x), dot_f32_avx2(&wf, &x)) };
                let pa = dot_bf16_portable(&wb, &x);
                // NaN bf16 patterns may appear from random bits; compare bits unless both NaN.
                assert!(
                    a.to_bits() == pa.to_bits() || (a.is_nan() && pa.is_nan()),
                    "bf16 n={n}"
                );
                assert_eq!(
                    b.to_bits(),
                    dot_f32_portable(&wf, &x).to_bits(),
                    "f32 n={n}"
                );
            }
        }
    }

    // Catches: nibble order, sign of code 8, the 255 skip or an odd tail differing between
    // the AVX2 and the portable MXFP4 kernels.
    #[test]
    fn avx2_mxfp4_matches_portable_bitwise() {
        if !avx2_available() {
            return;
        }
        let mut s = 0xdead_beef_cafe_f00du64;
        for &n in &SIZES {
            for _ in 0..20 {
                let x: Vec<f64> = (0..n).map(|_| randf(&mut s) as f64).collect();
                let p: Vec<u8> = (0..n.div_ceil(2)).map(|_| rng(&mut s) as u8).collect();
                let sc: Vec<u8> = (0..n.div_ceil(32))
                    .map(|_| match rng(&mut s) % 10 {
                        0 => 255,
                        1 => 0,
                        _ => 110 + (rng(&mut s) % 30) as u8,
                    })
                    .collect();
                // SAFETY: avx2_available() checked above.
                let a = unsafe { dot_mxfp4_avx2(&p, &sc, &x) };
                assert_eq!(
                    a.to_bits(),
                    dot_mxfp4_portable(&p, &sc, &x).to_bits(),
                    "n={n}"
                );
            }
        }
    }
}
