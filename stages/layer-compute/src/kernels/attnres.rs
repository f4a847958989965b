//! Attention residuals (AttnRes): a softmax mix over depth-wise sources.
//!
//! Fold `w = norm ⊙ proj` once; per source `s_i` the key is `s_i / sqrt(mean(s_i²) + eps)`
//! and the score `σ_i = key · w`; `α = softmax(σ)`; the output mixes the RAW sources,
//! `Σ α_i s_i`, in source order. Scores, softmax and the mix are accumulated in f64.

/// Mix `sources` (each of length `fold.len()`, oldest first, current prefix last).
pub fn mix(sources: &[&[f32]], fold: &[f32], eps: f32, out: &mut [f32]) {
    let n = fold.len();
    assert!(!sources.is_empty(), "AttnRes mix needs at least one source");
    let mut score = Vec::with_capacity(sources.len());
    for s in sources {
        assert_eq!(s.len(), n);
        let ss: f64 = s.iter().map(|&v| v as f64 * v as f64).sum();
        let inv = 1.0 / (ss / n as f64 + eps as f64).sqrt();
        let mut acc = 0f64;
        for j in 0..n {
            acc += s[j] as f64 * inv * fold[j] as f64;
        }
        score.push(acc);
    }
    let m = score.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut z = 0f64;
    for v in score.iter_mut() {
        *v = (*v - m).exp();
        z += *v;
    }
    for (j, o) in out.iter_mut().enumerate().take(n) {
        let mut acc = 0f64;
        for (i, s) in sources.iter().enumerate() {
            acc += score[i] / z * s[j] as f64;
        }
        *o = acc as f32;
    }
}

/// `fold = norm ⊙ proj`.
pub fn fold(norm: &[f32], proj: &[f32]) -> Vec<f32> {
    norm.iter().zip(proj).map(|(a, b)| a * b).collect()
}
