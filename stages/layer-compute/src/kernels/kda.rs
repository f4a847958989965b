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
