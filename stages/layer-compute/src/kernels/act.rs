//! Activations: sigmoid, SiLU and SiTU-GLU, on the engine's own f64 exponential.
//!
//! SiTU-GLU (Kimi K3's `hidden_act = "situ"`): for gate g and up u,
//! `a = β₁·tanh(g/β₁)·sigmoid(g)` — the sigmoid reads the UNCAPPED gate — and
//! `b = β₂·tanh(u/β₂)`, out = a·b, so |out| ≤ β₁β₂. Evaluated in f64, rounded once.
//!
//! # The exponential
//!
//! `exp`, `expm1`, `tanh` and `sigmoid` are computed here, not by the platform's libm:
//! - **Same bits everywhere.** Only IEEE additions, multiplications, divisions,
//!   comparisons and bit moves, each rounded once, never fused (no `mul_add`, which the
//!   x86-64 baseline would turn into a libm call), in a fixed order. The result is
//!   therefore the same on every platform and libm (glibc, musl and macOS disagree on the
//!   last bit of `tanh` now and then), and the same whether the loop below runs scalar or
//!   is compiled for AVX2 or AVX-512 ([`situ_glu`], [`silu_into`], [`mul_sigmoid`] and the
//!   KDA decay gate pick the width through [`super::simd::isa`]; a wider vector performs
//!   the same operations lane by lane, tested bit for bit in this module).
//! - **Method.** `x = k·ln2 + r` with `k` rounded to nearest by the 1.5·2^52 shifter,
//!   `r = (x − k·LN2_HI) − k·LN2_LO` (Cody-Waite: `LN2_HI` has 32 significant bits, so
//!   `k·LN2_HI` and the first subtraction are exact for |k| < 2^21), |r| ≤ 0.347;
//!   `expm1(r) = r + r²·P(r)` with `P` the Taylor series of `(eʳ − 1 − r)/r²` to `r¹¹/13!`
//!   (truncation below 1.3e-17 relative); `2^k` is built from the shifter's bits.
//!   `exp(x) = 2^k·expm1(r) + 2^k`, `expm1(x) = 2^k·expm1(r) + (2^k − 1)` (the product by
//!   a power of two is exact, one rounding in the sum); `tanh(y) = e/(e + 2)` with
//!   `e = expm1(2y)`, y clamped to ±20 (tanh(20) rounds to 1 in f64);
//!   `sigmoid(x) = 1/(1 + exp(−x))`, exp's argument clamped below at −700 (so 2^k stays
//!   normal; the sigmoid is 1 there in f64) and taken as +inf above 700 (the sigmoid is
//!   then 0 against a true value below 1e-304; every caller rounds it to f32 or multiplies
//!   it into one). NaN stays NaN (the clamps are written so that it passes through).
//! - **Error budget E_exp.** Against libm (itself within an ulp of exact), over 2·10⁶
//!   random arguments per function in its tests (`tests/unit/act.rs`, 2026-12-03): `exp` within 1.0 and
//!   `expm1` within 1.2 units of 2^-52 relative, `tanh` and `sigmoid` within 2.3; the
//!   tests hold them to 2 and 3, i.e. below 7e-16 relative. Every result here is
//!   rounded to f32 (2^-24 relative) or feeds one, so a value can differ from a
//!   correctly rounded one only when it lies within 1e-15 of an f32 rounding boundary
//!   (about one value in 10⁸; of 200 000 SiTU values in the tests none differs from the
//!   libm formula's, and the tests bound any difference at one f32 ulp). The oracle
//!   gates (1e-5 + 1e-4 rel and looser) are ten orders of magnitude away.
//! - **Why.** libm's `tanh`, `expm1` and `exp` were about 4% of a prompt's CPU samples
//!   (`perf`, 16-token prompt on the slice), called one value at a time; this runs eight
//!   lanes at once on AVX-512.

/// log2(e), rounded to f64.
const LOG2E: f64 = std::f64::consts::LOG2_E;
/// ln 2 to 32 significant bits (0.6931471803691238): `k·LN2_HI` is exact.
const LN2_HI: f64 = f64::from_bits(0x3FE6_2E42_FEE0_0000);
/// ln 2 − `LN2_HI`, rounded (1.9082149292705877e-10).
const LN2_LO: f64 = f64::from_bits(0x3DEA_39EF_3579_3C76);
/// 1.5·2^52: adding it rounds a value below 2^51 to an integer (nearest, ties to even),
/// which then sits in the low mantissa bits.
const SHIFTER: f64 = 6_755_399_441_055_744.0;
/// `1/n!` for n = 2..=13: `P(r) = Σ r^(n−2)/n!`.
const INV_FACT: [f64; 12] = [
    1.0 / 2.0,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5_040.0,
    1.0 / 40_320.0,
    1.0 / 362_880.0,
    1.0 / 3_628_800.0,
    1.0 / 39_916_800.0,
    1.0 / 479_001_600.0,
    1.0 / 6_227_020_800.0,
];

/// `v` limited to `[lo, hi]`; NaN passes through (both comparisons are false).
#[inline(always)]
#[doc(hidden)]
pub fn clamp_nan(v: f64, lo: f64, hi: f64) -> f64 {
    if v < lo {
        lo
    } else if v > hi {
        hi
    } else {
        v
    }
}

/// `x = k·ln2 + r`: returns `(2^k, expm1(r))`. Needs |x| ≤ 700 (callers clamp).
#[inline(always)]
#[doc(hidden)]
pub fn split(x: f64) -> (f64, f64) {
    let m = x * LOG2E + SHIFTER;
    let k = m - SHIFTER;
    // The low bits of `m` hold k (two's complement); adding the bias and shifting the
    // exponent field into place drops the shifter's own bits: the exponent of 2^k.
    let t = f64::from_bits(m.to_bits().wrapping_add(1023) << 52);
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let mut p = INV_FACT[11];
    for c in INV_FACT[..11].iter().rev() {
        p = p * r + c;
    }
    (t, r + (r * r) * p)
}

/// `exp(x)` for |x| ≤ 700.
#[inline(always)]
#[doc(hidden)]
pub fn exp_in_range(x: f64) -> f64 {
    let (t, e) = split(x);
    t * e + t
}

/// `tanh(y)` (see the module doc).
#[inline(always)]
#[doc(hidden)]
pub fn tanh(y: f64) -> f64 {
    let (t, e) = split(clamp_nan(y, -20.0, 20.0) * 2.0);
    let em1 = t * e + (t - 1.0);
    em1 / (em1 + 2.0)
}

/// Logistic sigmoid in f64 (see the module doc).
#[inline(always)]
pub fn sigmoid64(x: f64) -> f64 {
    let v = -x;
    let e = exp_in_range(clamp_nan(v, -700.0, 700.0));
    // Past 700 exp(v) is taken as +inf (the sigmoid is then 0, below the true value by
    // less than 1e-304), so that a huge negative SiLU input still gives -0, not
    // `x · 1e-304`.
    1.0 / (1.0 + if v > 700.0 { f64::INFINITY } else { e })
}

/// Logistic sigmoid of an f32, rounded once.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    sigmoid64(x as f64) as f32
}

/// One NaN for every NaN: which operand's NaN an x86 instruction passes on depends on
/// the operand order, which the compiler may swap between a scalar and a vector body.
#[inline(always)]
fn canonical(v: f32) -> f32 {
    if v.is_nan() {
        f32::NAN
    } else {
        v
    }
}

/// SiLU `z·sigmoid(z)`, rounded once.
#[inline(always)]
pub fn silu(z: f64) -> f32 {
    canonical((z * sigmoid64(z)) as f32)
}

/// One SiTU-GLU value, rounded once.
#[inline(always)]
fn situ(g: f32, u: f32, b1: f64, b2: f64) -> f32 {
    let (g, u) = (g as f64, u as f64);
    let a = b1 * tanh(g / b1) * sigmoid64(g);
    let b = b2 * tanh(u / b2);
    canonical((a * b) as f32)
}

/// Run `$body`, the body of a function of the listed arguments, compiled for the widest
/// vector `$path` allows (an instruction set the CPU has: [`super::simd::checked`] panics
/// on another, which is never run in its place): one body, three compilations
/// (AVX-512F, AVX2, the x86-64 baseline), the same operations (see the module doc). The
/// arguments are passed on by value, so they must be `Copy` or references. Expands to a
/// `return` from the enclosing function on the vector paths.
macro_rules! on_path {
    ($path:expr, fn($($arg:ident: $ty:ty),*) $body:block) => {{
        let path = $crate::kernels::simd::checked($path);
        #[cfg(target_arch = "x86_64")]
        {
            use $crate::kernels::simd::Isa;
            /// # Safety
            /// The CPU must support AVX-512F.
            #[target_feature(enable = "avx512f")]
            unsafe fn wide512($($arg: $ty),*) $body
            /// # Safety
            /// The CPU must support AVX2.
            #[target_feature(enable = "avx2")]
            unsafe fn wide256($($arg: $ty),*) $body
            match path {
                // SAFETY: the path is one the CPU supports (checked above).
                Isa::Avx512 => return unsafe { wide512($($arg),*) },
                // SAFETY: as above (AVX2 detected).
                Isa::Avx2 => return unsafe { wide256($($arg),*) },
                Isa::Portable => {}
            }
        }
        let _ = path;
        fn scalar($($arg: $ty),*) $body
        scalar($($arg),*)
    }};
}
pub(crate) use on_path;

/// `out[i] = SiTU(gate[i], up[i])`.
pub fn situ_glu(gate: &[f32], up: &[f32], b1: f32, b2: f32, out: &mut [f32]) {
    situ_glu_on(super::simd::isa(), gate, up, b1, b2, out)
}

/// [`situ_glu`] on an explicit instruction set (tests compare them bit for bit); panics
/// when the CPU lacks it ([`super::simd::checked`]).
pub fn situ_glu_on(
    path: super::simd::Isa,
    gate: &[f32],
    up: &[f32],
    b1: f32,
    b2: f32,
    out: &mut [f32],
) {
    assert_eq!(gate.len(), up.len());
    assert_eq!(gate.len(), out.len());
    on_path!(path, fn(gate: &[f32], up: &[f32], b1: f32, b2: f32, out: &mut [f32]) {
        let (b1, b2) = (b1 as f64, b2 as f64);
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = situ(g, u, b1, b2);
        }
    })
}

/// `out[i] = SiLU(z[i])`, rounded once.
pub fn silu_into(z: &[f64], out: &mut [f32]) {
    silu_into_on(super::simd::isa(), z, out)
}

/// [`silu_into`] on an explicit instruction set (as [`situ_glu_on`]).
pub fn silu_into_on(path: super::simd::Isa, z: &[f64], out: &mut [f32]) {
    assert_eq!(z.len(), out.len());
    on_path!(path, fn(z: &[f64], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(z) {
            *o = silu(v);
        }
    })
}

/// `x[i] *= sigmoid(gate[i])` (the f32 sigmoid, then one f32 product): the output gates of
/// KDA and MLA.
pub fn mul_sigmoid(x: &mut [f32], gate: &[f32]) {
    mul_sigmoid_on(super::simd::isa(), x, gate)
}

/// [`mul_sigmoid`] on an explicit instruction set (as [`situ_glu_on`]).
pub fn mul_sigmoid_on(path: super::simd::Isa, x: &mut [f32], gate: &[f32]) {
    assert_eq!(x.len(), gate.len());
    on_path!(path, fn(x: &mut [f32], gate: &[f32]) {
        for (v, &g) in x.iter_mut().zip(gate) {
            *v = canonical(*v * sigmoid(g));
        }
    })
}
