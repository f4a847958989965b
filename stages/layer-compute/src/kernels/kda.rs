//! Kimi Delta Attention pieces: the bounded decay gate, the gated delta-rule recurrence and
//! the per-head gated output norm.
//!
//! - Gate: `g = lb · sigmoid(exp(A_log[h]) · (z + dt_bias))` with A_log indexed per HEAD
//!   (the first `heads` entries of a possibly head_dim-padded tensor), `α = exp(g)`.
//! - Recurrence per head, state `S ∈ R^{dk×dv}` (row = key channel): decay rows by α,
//!   read `r = Sᵀk`, write `S += β·k(v − r)ᵀ`, output `o = Sᵀq` from the UPDATED state
//!   (q arrives pre-scaled by dk^-1/2). All f32, loops in index order.
//! - Output: per head RMSNorm (eps), times the o_norm weight, THEN times sigmoid(gate).

use super::act::sigmoid64;

/// Decay gate for one token: `z`, `dt_bias` are `heads × dk`; writes `g` and `alpha`.
pub fn decay_gate(
    z: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    heads: usize,
    dk: usize,
    lower_bound: f32,
    g: &mut [f32],
    alpha: &mut [f32],
) {
    assert!(a_log.len() >= heads);
    assert!(z.len() >= heads * dk && dt_bias.len() >= heads * dk);
    assert!(g.len() >= heads * dk && alpha.len() >= heads * dk);
    for h in 0..heads {
        let a = (a_log[h] as f64).exp();
        let r = h * dk..(h + 1) * dk;
        bounded_gate(
            a,
            &z[r.clone()],
            &dt_bias[r.clone()],
            lower_bound,
            &mut g[r.clone()],
        );
        for (al, gi) in alpha[r.clone()].iter_mut().zip(&g[r]) {
            *al = gi.exp();
        }
    }
}

/// `g[c] = lb · sigmoid(a · (z[c] + dt_bias[c]))`, rounded once, at the CPU's vector width
/// (the sigmoid is [`super::act`]'s own, the same bits on every path).
fn bounded_gate(a: f64, z: &[f32], dt_bias: &[f32], lower_bound: f32, g: &mut [f32]) {
    super::act::on_path!(
        super::simd::isa(),
        fn(a: f64, z: &[f32], dt_bias: &[f32], lower_bound: f32, g: &mut [f32]) {
            for ((gi, &zc), &bc) in g.iter_mut().zip(z).zip(dt_bias) {
                let u = a * (zc as f64 + bc as f64);
                *gi = (lower_bound as f64 * sigmoid64(u)) as f32;
            }
        }
    )
}

/// One token's inputs to a head's delta-rule step: `q`, `k` and `alpha` have `dk` values,
/// `v` has `dv`; `q` arrives pre-scaled by dk^-1/2.
#[derive(Clone, Copy)]
pub struct DeltaIn<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub alpha: &'a [f32],
    pub beta: f32,
}

/// One delta-rule step for one head. `s` is `dk × dv` row-major, `scratch` has `dv` room.
///
/// Per state element the operations are those of the four steps in the module doc, in
/// that order (`s·α` rounded, `r += k·s` in increasing row order, `s += (β·k)·(v − r)`,
/// `o += q·s` in increasing row order, each product and sum rounded once, never fused),
/// so the result is the same bit for bit on every path. The steps run in two sweeps over
/// the 64 KiB state (decay with the read, then the write with the output) instead of
/// four, and on x86-64 the same code is compiled for AVX2 or AVX-512 when the CPU has
/// them (chosen by [`super::simd::isa`]): wider vectors, the same operations.
pub fn delta_step(s: &mut [f32], x: DeltaIn<'_>, o: &mut [f32], scratch: &mut [f32]) {
    delta_step_on(super::simd::isa(), s, x, o, scratch)
}

/// [`delta_step`] on an explicit instruction set (tests compare them bit for bit); panics
/// when the CPU lacks it ([`super::simd::checked`]).
pub fn delta_step_on(
    path: super::simd::Isa,
    s: &mut [f32],
    x: DeltaIn<'_>,
    o: &mut [f32],
    scratch: &mut [f32],
) {
    let path = super::simd::checked(path);
    #[cfg(target_arch = "x86_64")]
    {
        use super::simd::Isa;
        /// # Safety
        /// The CPU must support AVX-512F.
        #[target_feature(enable = "avx512f")]
        unsafe fn wide512(s: &mut [f32], x: DeltaIn<'_>, o: &mut [f32], scratch: &mut [f32]) {
            delta_body(s, x, o, scratch)
        }
        /// # Safety
        /// The CPU must support AVX2.
        #[target_feature(enable = "avx2")]
        unsafe fn wide256(s: &mut [f32], x: DeltaIn<'_>, o: &mut [f32], scratch: &mut [f32]) {
            delta_body(s, x, o, scratch)
        }
        match path {
            // SAFETY: the path is one the CPU supports (checked above).
            Isa::Avx512 => return unsafe { wide512(s, x, o, scratch) },
            // SAFETY: as above (AVX2 detected).
            Isa::Avx2 => return unsafe { wide256(s, x, o, scratch) },
            Isa::Portable => {}
        }
    }
    let _ = path;
    delta_body(s, x, o, scratch)
}

/// The body of [`delta_step`], inlined into each target-feature wrapper.
#[inline(always)]
fn delta_body(s: &mut [f32], x: DeltaIn<'_>, o: &mut [f32], scratch: &mut [f32]) {
    let DeltaIn {
        q,
        k,
        v,
        alpha,
        beta,
    } = x;
    let dk = k.len();
    let dv = v.len();
    assert_eq!(s.len(), dk * dv, "delta_step state shape");
    assert!(q.len() >= dk && alpha.len() >= dk && o.len() >= dv && scratch.len() >= dv);
    let r = &mut scratch[..dv];
    let o = &mut o[..dv];
    r.iter_mut().for_each(|x| *x = 0.0);
    // (a) decay row i by alpha[i], then (b) read r = S^T k (row i added after row i-1).
    for (i, row) in s.chunks_exact_mut(dv).enumerate() {
        let (a, ki) = (alpha[i], k[i]);
        for (x, rj) in row.iter_mut().zip(r.iter_mut()) {
            *x *= a;
            *rj += ki * *x;
        }
    }
    // (c) write S += beta k (v - r)^T, then (d) o = S^T q from the updated rows.
    for (rj, vj) in r.iter_mut().zip(v) {
        *rj = vj - *rj;
    }
    o.iter_mut().for_each(|x| *x = 0.0);
    for (i, row) in s.chunks_exact_mut(dv).enumerate() {
        let (kb, qi) = (k[i] * beta, q[i]);
        for ((x, rj), oj) in row.iter_mut().zip(r.iter()).zip(o.iter_mut()) {
            *x += kb * rj;
            *oj += qi * *x;
        }
    }
}

/// Gated output norm for one token, in place on `o` (`heads × dv`):
/// `o_h ← rmsnorm(o_h, eps) ⊙ w ⊙ sigmoid(gate_h)`.
pub fn output_norm_gate(o: &mut [f32], gate: &[f32], w: &[f32], heads: usize, eps: f32) {
    let dv = w.len();
    assert_eq!(o.len(), heads * dv);
    for h in 0..heads {
        let oh = &mut o[h * dv..(h + 1) * dv];
        super::norm::rmsnorm_inplace(oh, Some(w), eps);
        super::act::mul_sigmoid(oh, &gate[h * dv..(h + 1) * dv]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::simd::Isa;

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
            for path in paths
                .into_iter()
                .filter(|&p| crate::kernels::simd::runnable(test, p))
            {
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
}
