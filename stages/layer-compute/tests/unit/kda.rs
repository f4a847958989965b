//! The KDA recurrence's step (`src/kernels/kda.rs`): every path against the four separate
//! sweeps, bit for bit.

use k3_layer_compute::kernels::kda::*;
use k3_layer_compute::kernels::simd::{self, Isa};

/// The recurrence as four separate sweeps, written from the module doc (the form
/// before the sweeps were fused).
#[allow(clippy::too_many_arguments)]
fn reference(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    alpha: &[f32],
    beta: f32,
    o: &mut [f32],
) {
    let (dk, dv) = (k.len(), v.len());
    for i in 0..dk {
        for j in 0..dv {
            s[i * dv + j] *= alpha[i];
        }
    }
    let mut r = vec![0f32; dv];
    for i in 0..dk {
        for j in 0..dv {
            r[j] += k[i] * s[i * dv + j];
        }
    }
    for j in 0..dv {
        r[j] = v[j] - r[j];
    }
    for i in 0..dk {
        let kb = k[i] * beta;
        for j in 0..dv {
            s[i * dv + j] += kb * r[j];
        }
    }
    o.iter_mut().for_each(|x| *x = 0.0);
    for i in 0..dk {
        for j in 0..dv {
            o[j] += q[i] * s[i * dv + j];
        }
    }
}

// Catches: a fused or vectorised sweep that changes one operation or its order (the
// read taken before the decay, the output from the old state, a product fused into
// an FMA on the SIMD paths), on every path the CPU has, over several steps so the
// state carries errors forward; odd shapes check the vector tails.
#[test]
fn delta_step_paths_match_the_four_sweeps_bit_for_bit() {
    let mut seed = 5u64;
    let mut rnd = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    for (dk, dv) in [(128usize, 128usize), (7, 13), (16, 33)] {
        let steps: Vec<_> = (0..4)
            .map(|_| {
                let q: Vec<f32> = (0..dk).map(|_| rnd()).collect();
                let k: Vec<f32> = (0..dk).map(|_| rnd()).collect();
                let v: Vec<f32> = (0..dv).map(|_| rnd()).collect();
                let a: Vec<f32> = (0..dk).map(|_| 0.5 + 0.5 * rnd().abs()).collect();
                (q, k, v, a, 0.5 + 0.4 * rnd())
            })
            .collect();
        let mut s0 = vec![0f32; dk * dv];
        s0.iter_mut().for_each(|x| *x = rnd());
        let mut want_s = s0.clone();
        let mut want_o = Vec::new();
        for (q, k, v, a, b) in &steps {
            let mut o = vec![0f32; dv];
            reference(&mut want_s, q, k, v, a, *b, &mut o);
            want_o.push(o);
        }
        let test = "kda::delta_step_paths_match_the_four_sweeps_bit_for_bit";
        let paths = [Isa::Portable, Isa::Avx2, Isa::Avx512];
        // A vector path the CPU lacks: SKIPPED, or a failure under K3_REQUIRE_SIMD.
        for path in paths.into_iter().filter(|&p| simd::runnable(test, p)) {
            let mut s = s0.clone();
            let mut scratch = vec![0f32; dv];
            for (n, (q, k, v, a, b)) in steps.iter().enumerate() {
                let mut o = vec![7f32; dv];
                let x = DeltaIn {
                    q,
                    k,
                    v,
                    alpha: a,
                    beta: *b,
                };
                delta_step_on(path, &mut s, x, &mut o, &mut scratch);
                let same = o
                    .iter()
                    .zip(&want_o[n])
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{path:?} {dk}x{dv} step {n}: output differs");
            }
            let same = s
                .iter()
                .zip(&want_s)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{path:?} {dk}x{dv}: state differs");
        }
    }
}
