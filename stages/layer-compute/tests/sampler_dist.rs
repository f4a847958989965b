//! The sampler's distributions (issue 13, "untested paths"): on a fixed logits vector,
//! temperature shapes the probabilities (softmax(logits / T)), top-k keeps only the k
//! largest, top-p keeps the smallest prefix of the sorted candidates whose mass reaches p,
//! and the draws follow the renormalised probabilities (Pearson chi-square). The expected
//! probabilities are computed here from the definitions, not taken from the sampler.
//!
//! The draws are seeded (seed, step), so the test is deterministic; the threshold is the
//! chi-square quantile at p = 1e-6, which a correct sampler misses with that probability
//! for a given seed, and every wrong implementation below exceeds by orders of magnitude.

use k3_layer_compute::sampler::{sample, SamplerConfig};

const LOGITS: [f32; 8] = [1.0, 2.5, -0.5, 2.0, 0.0, 1.5, -3.0, 0.5];
const DRAWS: u64 = 40_000;

fn cfg(t: f32, top_k: Option<usize>, top_p: Option<f32>) -> SamplerConfig {
    SamplerConfig {
        temperature: Some(t),
        top_k,
        top_p,
        seed: 20260413,
        ..SamplerConfig::default()
    }
}

/// Expected probabilities by definition, in f64: sort descending, cut to top-k, softmax at
/// T, cut to the smallest prefix whose mass reaches p, renormalise.
fn expected(t: f64, top_k: Option<usize>, top_p: Option<f64>) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..LOGITS.len()).collect();
    idx.sort_by(|&a, &b| LOGITS[b].total_cmp(&LOGITS[a]));
    if let Some(k) = top_k {
        idx.truncate(k);
    }
    let w: Vec<f64> = idx.iter().map(|&i| (LOGITS[i] as f64 / t).exp()).collect();
    let z: f64 = w.iter().sum();
    let mut keep = w.len();
    if let Some(p) = top_p {
        let mut c = 0.0;
        for (j, x) in w.iter().enumerate() {
            c += x / z;
            if c >= p {
                keep = j + 1;
                break;
            }
        }
    }
    let zk: f64 = w[..keep].iter().sum();
    let mut p = vec![0.0; LOGITS.len()];
    for j in 0..keep {
        p[idx[j]] = w[j] / zk;
    }
    p
}

fn counts(c: &SamplerConfig) -> Vec<u64> {
    let mut n = vec![0u64; LOGITS.len()];
    for step in 0..DRAWS {
        n[sample(&LOGITS, c, step, &[], &[])] += 1;
    }
    n
}

/// Upper chi-square quantile at p = 1e-6 (Wilson-Hilferty, z = 4.753).
fn critical(df: usize) -> f64 {
    let d = df as f64;
    let z = 4.753;
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

/// Pearson chi-square of `n` against `p`; ids with p = 0 must never be drawn.
fn chi2(n: &[u64], p: &[f64]) -> (f64, usize) {
    let total: u64 = n.iter().sum();
    let mut x = 0.0;
    let mut cells = 0;
    for (i, (&o, &pi)) in n.iter().zip(p).enumerate() {
        if pi == 0.0 {
            assert_eq!(
                o, 0,
                "id {i} is outside the candidates but was drawn {o} times"
            );
            continue;
        }
        let e = pi * total as f64;
        x += (o as f64 - e).powi(2) / e;
        cells += 1;
    }
    (x, cells - 1)
}

fn check(what: &str, t: f32, top_k: Option<usize>, top_p: Option<f32>) -> Vec<u64> {
    let n = counts(&cfg(t, top_k, top_p));
    let p = expected(t as f64, top_k, top_p.map(|x| x as f64));
    let (x, df) = chi2(&n, &p);
    let crit = critical(df.max(1));
    eprintln!("{what}: counts {n:?}, chi2 {x:.1} (df {df}, p=1e-6 at {crit:.1})");
    assert!(
        x < crit,
        "{what}: chi2 {x:.1} >= {crit:.1}; counts {n:?} vs p {p:?}"
    );
    n
}

/// T = 1, no cut: every id in proportion to exp(logit). Catches a sampler drawing
/// uniformly, from the unnormalised or the wrong-order weights, or one stuck on argmax.
#[test]
fn plain_softmax() {
    let n = check("T=1", 1.0, None, None);
    assert!(n.iter().all(|&c| c > 0), "every id must be drawn: {n:?}");
}

/// Temperature shapes: T = 0.5 sharpens, T = 2 flattens, each matching softmax(l/T). Catches
/// a temperature that is ignored (the T = 1 distribution fails both), multiplied instead
/// of divided (T = 0.5 would flatten), or applied after normalisation.
#[test]
fn temperature_shapes_the_distribution() {
    let sharp = check("T=0.5", 0.5, None, None);
    let flat = check("T=2", 2.0, None, None);
    // And they are not the T = 1 distribution.
    let p1 = expected(1.0, None, None);
    assert!(chi2(&sharp, &p1).0 > 10.0 * critical(7));
    assert!(chi2(&flat, &p1).0 > 10.0 * critical(7));
}

/// top-k > 1 keeps exactly the k largest logits, drawn in renormalised proportion. Catches
/// a top-k that is ignored, off by one (k - 1 or k + 1 candidates), keeps the k smallest,
/// or cuts after sampling.
#[test]
fn top_k_restricts_the_candidates() {
    for k in [2, 3, 5] {
        let n = check(&format!("top-k {k}"), 1.0, Some(k), None);
        assert_eq!(n.iter().filter(|&&c| c > 0).count(), k, "top-k {k}: {n:?}");
    }
    // top-k 1 is greedy.
    let n = counts(&cfg(1.0, Some(1), None));
    assert_eq!(n[1], DRAWS, "top-k 1 must always pick the argmax: {n:?}");
}

/// top-p keeps the smallest prefix of the sorted candidates whose mass reaches p. With
/// these logits at T = 1 the sorted masses are 0.405, 0.246, 0.149, 0.090, 0.055, ...: p = 0.5
/// keeps 2, p = 0.7 keeps 3, p = 0.9 keeps 5. Catches a top-p that is ignored, keeps the first id
/// past p out (one too few), uses the unsorted order, or measures mass before temperature.
#[test]
fn top_p_restricts_the_candidates() {
    for (p, want) in [(0.5f32, 2usize), (0.7, 3), (0.9, 5)] {
        let e = expected(1.0, None, Some(p as f64));
        assert_eq!(e.iter().filter(|&&x| x > 0.0).count(), want, "p {p}");
        let n = check(&format!("top-p {p}"), 1.0, None, Some(p));
        assert_eq!(
            n.iter().filter(|&&c| c > 0).count(),
            want,
            "top-p {p}: {n:?}"
        );
    }
    // Temperature applies before the nucleus: at T = 0.5 the top mass alone is 0.63, so
    // p = 0.5 keeps 1 candidate.
    let e = expected(0.5, None, Some(0.5));
    assert_eq!(e.iter().filter(|&&x| x > 0.0).count(), 1);
    let n = counts(&cfg(0.5, None, Some(0.5)));
    assert_eq!(n[1], DRAWS, "T=0.5 top-p 0.5: {n:?}");
    // top-k and top-p together: top-k first, then the nucleus of the renormalised rest.
    check("top-k 4 top-p 0.8", 1.0, Some(4), Some(0.8));
}

/// OpenAI's presence and frequency penalties: the draws follow softmax(l - c·f - [c>0]·p)
/// over the generated ids' counts c (the prompt does not count). Catches penalties that
/// are ignored (the plain distribution fails), applied to the prompt, counted once for the
/// frequency or per occurrence for the presence.
#[test]
fn presence_and_frequency_penalties_shift_the_distribution() {
    // Generated so far: id 1 three times, id 3 once; the prompt holds id 5 (not counted).
    let generated = [1u32, 3, 1, 1];
    let prompt = [5u32];
    let (pres, freq) = (0.5f32, 0.25f32);
    let c = SamplerConfig {
        temperature: Some(1.0),
        presence_penalty: Some(pres),
        frequency_penalty: Some(freq),
        seed: 20260413,
        ..SamplerConfig::default()
    };
    let mut n = vec![0u64; LOGITS.len()];
    let mut history = prompt.to_vec();
    history.extend_from_slice(&generated);
    for step in 0..DRAWS {
        n[sample(&LOGITS, &c, step, &history, &generated)] += 1;
    }
    // Expected, by definition, in f64.
    let mut l: Vec<f64> = LOGITS.iter().map(|&x| x as f64).collect();
    for (id, count) in [(1usize, 3.0f64), (3, 1.0)] {
        l[id] -= count * freq as f64 + pres as f64;
    }
    let w: Vec<f64> = l.iter().map(|x| x.exp()).collect();
    let z: f64 = w.iter().sum();
    let p: Vec<f64> = w.iter().map(|x| x / z).collect();
    let (x, df) = chi2(&n, &p);
    assert!(x < critical(df), "chi2 {x:.1}; counts {n:?} vs p {p:?}");
    // Not the unpenalised distribution.
    let plain = expected(1.0, None, None);
    assert!(chi2(&n, &plain).0 > 10.0 * critical(7), "{n:?}");
}
