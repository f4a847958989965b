//! NoPE multi-head latent attention over a per-position cache.
//!
//! Keys per head are `[k_nope_h(s) ‖ k_r(s)]` (the "rope" slot is shared by all heads and
//! never rotated), queries `[q_nope_h ‖ q_r_h]`; scores are scaled by
//! `1/sqrt(nope + rope)`, causal, softmax over positions, values mixed in position order.
//! Dot products, softmax and the value mix accumulate in f64.

/// Geometry of one MLA layer.
#[derive(Clone, Copy, Debug)]
pub struct MlaDims {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
}

/// The cache contents the attention reads, for positions `0..len`.
pub struct MlaCacheView<'a> {
    /// `[pos][heads][nope]`
    pub k_nope: &'a [f32],
    /// `[pos][heads][v]`
    pub v: &'a [f32],
    /// `[pos][rope]`
    pub k_rope: &'a [f32],
}

/// Attention of one query (`heads × (nope+rope)`) over positions `0..=last`; writes
/// `o` (`heads × v`).
pub fn attend(d: MlaDims, q: &[f32], cache: &MlaCacheView<'_>, last: usize, o: &mut [f32]) {
    let qh = d.nope + d.rope;
    let scale = 1.0 / (qh as f64).sqrt();
    let npos = last + 1;
    let mut p = vec![0f64; npos];
    for h in 0..d.heads {
        let qn = &q[h * qh..h * qh + d.nope];
        let qr = &q[h * qh + d.nope..(h + 1) * qh];
        let mut m = f64::NEG_INFINITY;
        for (s, ps) in p.iter_mut().enumerate() {
            let kn = &cache.k_nope[(s * d.heads + h) * d.nope..(s * d.heads + h + 1) * d.nope];
            let kr = &cache.k_rope[s * d.rope..(s + 1) * d.rope];
            let mut acc = 0f64;
            for i in 0..d.nope {
                acc += qn[i] as f64 * kn[i] as f64;
            }
            for i in 0..d.rope {
                acc += qr[i] as f64 * kr[i] as f64;
            }
            *ps = acc * scale;
            m = m.max(*ps);
        }
        let mut z = 0f64;
        for ps in p.iter_mut() {
            *ps = (*ps - m).exp();
            z += *ps;
        }
        let oh = &mut o[h * d.v..(h + 1) * d.v];
        for (j, oj) in oh.iter_mut().enumerate() {
            let mut acc = 0f64;
            for (s, ps) in p.iter().enumerate() {
                acc += ps / z * cache.v[(s * d.heads + h) * d.v + j] as f64;
            }
            *oj = acc as f32;
        }
    }
}
