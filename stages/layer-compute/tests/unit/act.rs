//! The activations (`src/kernels/act.rs`): the f64 exponential family against libm, its
//! edges, the f32 SiTU against the formula it replaced, and every path bit for bit.

use k3_layer_compute::kernels::act::*;
use k3_layer_compute::kernels::simd::{self, Isa};

use crate::support::kernels_shared;

/// A deterministic stream of test arguments (xorshift; no dependency on `rand`'s
/// version for the values).
fn args(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Uniform in [-1, 1), times a spread of magnitudes 2^-31 .. 2^0 (half the
            // values keep the full scale).
            let u = (s >> 11) as f64 / (1u64 << 52) as f64 - 1.0;
            let e = if s & 32 == 0 { 0 } else { -((s & 31) as i32) };
            u * scale * 2f64.powi(e)
        })
        .collect()
}

fn ulps(a: f64, b: f64) -> f64 {
    if a == b {
        return 0.0;
    }
    ((a - b) / (b.abs().max(f64::MIN_POSITIVE) * f64::EPSILON)).abs()
}

/// Against libm (itself within 1 ulp): a wrong polynomial coefficient, a reduction
/// without the low half of ln 2, or `2^k` built one off shows as thousands of ulp.
#[test]
fn exponential_family_is_accurate() {
    let mut worst = [0f64; 4];
    for &x in &args(2_000_000, 0x9E37_79B9_7F4A_7C15, 60.0) {
        let xe = clamp_nan(x * 10.0, -700.0, 700.0);
        worst[0] = worst[0].max(ulps(exp_in_range(xe), xe.exp()));
        let (t, e) = split(x);
        worst[1] = worst[1].max(ulps(t * e + (t - 1.0), x.exp_m1()));
        worst[2] = worst[2].max(ulps(tanh(x), x.tanh()));
        worst[3] = worst[3].max(ulps(sigmoid64(x), 1.0 / (1.0 + (-x).exp())));
    }
    assert!(
        worst[0] <= 2.0 && worst[1] <= 2.0,
        "exp/expm1 ulps {worst:?}"
    );
    assert!(
        worst[2] <= 3.0 && worst[3] <= 3.0,
        "tanh/sigmoid ulps {worst:?}"
    );
}

#[test]
fn edges() {
    assert_eq!(tanh(0.0), 0.0);
    assert_eq!(tanh(20.0), 1.0);
    assert_eq!(tanh(1e300), 1.0);
    assert_eq!(tanh(-1e300), -1.0);
    assert_eq!(tanh(f64::INFINITY), 1.0);
    assert!(tanh(f64::NAN).is_nan());
    assert_eq!(sigmoid64(0.0), 0.5);
    assert_eq!(sigmoid64(f64::INFINITY), 1.0);
    assert!(sigmoid64(f64::NEG_INFINITY) < 1e-300);
    assert!(sigmoid64(f64::NAN).is_nan());
    // Deep in the tail the sigmoid is still the exponential, not a clamp at zero
    // (the SiTU of a gate of -60 is -3.5e-26, a normal f32).
    let s = sigmoid64(-60.0);
    assert!(
        ulps(s, (-60f64).exp() / (1.0 + (-60f64).exp())) <= 4.0,
        "{s}"
    );
    assert_eq!(silu(0.0), 0.0);
    assert!(silu(f64::NAN).is_nan());
}

/// The f32 SiTU against the libm formula it replaced: at most one f32 ulp apart, and
/// nearly always equal.
#[test]
fn situ_within_one_f32_ulp_of_libm() {
    // `situ_glu` runs on the installed instruction set.
    let _turn = kernels_shared();
    let xs = args(400_000, 7, 40.0);
    let (g, u): (Vec<f32>, Vec<f32>) = xs.chunks(2).map(|p| (p[0] as f32, p[1] as f32)).unzip();
    let mut out = vec![0f32; g.len()];
    situ_glu(&g, &u, 4.0, 25.0, &mut out);
    let mut differ = 0;
    for i in 0..g.len() {
        let (gg, uu) = (g[i] as f64, u[i] as f64);
        let a = 4.0 * (gg / 4.0).tanh() * (1.0 / (1.0 + (-gg).exp()));
        let b = 25.0 * (uu / 25.0).tanh();
        let libm = (a * b) as f32;
        if libm != out[i] {
            differ += 1;
            let gap = (libm.to_bits() as i64 - out[i].to_bits() as i64).abs();
            assert!(gap <= 1, "g {} u {}: {} vs {}", g[i], u[i], out[i], libm);
        }
    }
    assert!(differ <= 5, "{differ} of {} values differ", g.len());
}

/// Every path gives the same bits (a vector body that fused, reordered or used a
/// different rounding would not).
#[test]
fn paths_match_bit_for_bit() {
    let xs = args(100_003, 11, 80.0);
    let g: Vec<f32> = xs.iter().map(|&v| v as f32).collect();
    let mut u: Vec<f32> = g.iter().rev().copied().collect();
    u[5] = f32::NAN;
    u[6] = f32::INFINITY;
    u[7] = -0.0;
    let mut z = xs.clone();
    z[3] = f64::NAN;
    z[4] = -1e308;
    let run = |p: Isa| {
        let mut a = vec![0f32; g.len()];
        situ_glu_on(p, &g, &u, 4.0, 25.0, &mut a);
        let mut b = vec![0f32; z.len()];
        silu_into_on(p, &z, &mut b);
        let mut c = u.clone();
        mul_sigmoid_on(p, &mut c, &g);
        (a, b, c)
    };
    let same = |what: &str, p: Isa, v: &[f32], r: &[f32]| {
        assert_eq!(v.len(), r.len(), "{what} on {p:?}: length");
        if let Some(i) = (0..v.len()).find(|&i| v[i].to_bits() != r[i].to_bits()) {
            panic!("{what} on {p:?}, value {i}: {} against {}", v[i], r[i]);
        }
    };
    let (a0, b0, c0) = run(Isa::Portable);
    let test = "act::paths_match_bit_for_bit";
    for p in [Isa::Avx2, Isa::Avx512] {
        // A vector path the CPU lacks: SKIPPED, or a failure under K3_REQUIRE_SIMD.
        if !simd::runnable(test, p) {
            continue;
        }
        let (a, b, c) = run(p);
        same("situ", p, &a, &a0);
        same("silu", p, &b, &b0);
        same("gate", p, &c, &c0);
    }
}
