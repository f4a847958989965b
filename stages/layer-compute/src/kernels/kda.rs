//! Kimi Delta Attention pieces: the bounded decay gate, the gated delta-rule recurrence and
//! the per-head gated output norm.
//!
//! - Gate: `g = lb · sigmoid(exp(A_log[h]) · (z + dt_bias))` with A_log indexed per HEAD
//!   (the first `heads` entries of a possibly head_dim-padded tensor), `α = exp(g)`.
//! - Recurrence per head, state `S ∈ R^{dk×dv}` (row = key channel): decay rows by α,
//!   read `r = Sᵀk`, write `S += β·k(v − r)ᵀ`, output `o = Sᵀq` from the UPDATED state
//!   (q arrives pre-scaled by dk^-1/2). All f32, loops in index order.
//! - Output: per head RMSNorm (eps), times the o_norm weight, THEN times sigmoid(gate).

use super::act::{sigmoid, sigmoid64};

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
    for h in 0..heads {
        let a = (a_log[h] as f64).exp();
        for c in 0..dk {
            let i = h * dk + c;
            let u = a * (z[i] as f64 + dt_bias[i] as f64);
            let gi = (lower_bound as f64 * sigmoid64(u)) as f32;
            g[i] = gi;
            alpha[i] = gi.exp();
        }
    }
}

/// One delta-rule step for one head. `s` is `dk × dv` row-major, `scratch` has `dv` room.
#[allow(clippy::too_many_arguments)]
pub fn delta_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    alpha: &[f32],
    beta: f32,
    o: &mut [f32],
    scratch: &mut [f32],
) {
    let dk = k.len();
    let dv = v.len();
    debug_assert_eq!(s.len(), dk * dv);
    // (a) decay row i by alpha[i]
    for i in 0..dk {
        let a = alpha[i];
        s[i * dv..(i + 1) * dv].iter_mut().for_each(|x| *x *= a);
    }
    // (b) read r = S^T k
    let r = &mut scratch[..dv];
    r.iter_mut().for_each(|x| *x = 0.0);
    for i in 0..dk {
        let ki = k[i];
        let row = &s[i * dv..(i + 1) * dv];
        for j in 0..dv {
            r[j] += ki * row[j];
        }
    }
    // (c) write S += beta k (v - r)^T
    for j in 0..dv {
        r[j] = v[j] - r[j];
    }
    for i in 0..dk {
        let kb = k[i] * beta;
        let row = &mut s[i * dv..(i + 1) * dv];
        for j in 0..dv {
            row[j] += kb * r[j];
        }
    }
    // (d) output from the updated state
    o.iter_mut().for_each(|x| *x = 0.0);
    for i in 0..dk {
        let qi = q[i];
        let row = &s[i * dv..(i + 1) * dv];
        for j in 0..dv {
            o[j] += qi * row[j];
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
        for (j, x) in oh.iter_mut().enumerate() {
            *x *= sigmoid(gate[h * dv + j]);
        }
    }
}
