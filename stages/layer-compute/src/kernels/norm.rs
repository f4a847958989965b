//! Normalisations: RMSNorm (ε inside the square root) and the KDA L2 norm (sum of squares,
//! ε inside the square root).
//!
//! Sums of squares accumulate in f64 in index order; the scale factor is rounded once to
//! f32 and applied as `(x · inv) · w`.

/// `out = (x · 1/sqrt(mean(x²) + eps)) ⊙ w` (`w = None`: no gain).
pub fn rmsnorm(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let n = x.len();
    assert_eq!(out.len(), n);
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let inv = (1.0 / (ss / n as f64 + eps as f64).sqrt()) as f32;
    match w {
        Some(w) => {
            assert_eq!(w.len(), n);
            for i in 0..n {
                out[i] = x[i] * inv * w[i];
            }
        }
        None => {
            for i in 0..n {
                out[i] = x[i] * inv;
            }
        }
    }
}

/// In-place [`rmsnorm`].
pub fn rmsnorm_inplace(x: &mut [f32], w: Option<&[f32]>, eps: f32) {
    let n = x.len();
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let inv = (1.0 / (ss / n as f64 + eps as f64).sqrt()) as f32;
    match w {
        Some(w) => x.iter_mut().zip(w).for_each(|(v, &g)| *v = *v * inv * g),
        None => x.iter_mut().for_each(|v| *v *= inv),
    }
}

/// In-place L2 normalisation: `x / sqrt(Σ x² + eps)` (a SUM, not a mean).
pub fn l2norm_inplace(x: &mut [f32], eps: f32) {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let inv = (1.0 / (ss + eps as f64).sqrt()) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}
