//! Token selection from a row of logits: greedy argmax, or opt-in seeded sampling.
//!
//! Greedy is the default and the contract the tests rest on. Sampling (temperature, then
//! top-k, top-p and min-p as filters) draws from a ChaCha stream keyed by (seed, step), so a
//! seeded run picks the same ids at every memory budget, in every process mode, and whether
//! the prefix is recomputed or carried: nothing but the logits row, the step number and the
//! tokens so far (for the repetition penalty) enters the draw.
//!
//! Order, as in llama.cpp: repetition penalty on the raw logits, then the presence and
//! frequency penalties (OpenAI's, over the generated ids); greedy stops there; else sort,
//! top-k, softmax at the temperature, top-p, min-p, draw.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

pub use k3_protocol::conf::{SamplerConfig, REPEAT_WINDOW};

/// Index of the largest logit; the lowest index wins a tie, NaN never wins.
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best
}

/// The logits row with the penalties applied (None when every one is off: use the row as
/// it is): the repetition penalty on the ids among the last [`REPEAT_WINDOW`] of `history`,
/// then OpenAI's presence and frequency penalties over `generated` (this request's ids so
/// far): `logit - count * frequency - (count > 0) * presence`, in f32.
fn penalised(
    logits: &[f32],
    cfg: &SamplerConfig,
    history: &[u32],
    generated: &[u32],
) -> Option<Vec<f32>> {
    let rep = cfg.repetition_penalty.filter(|p| *p > 0.0 && *p != 1.0);
    let presence = cfg.presence_penalty.filter(|p| *p != 0.0);
    let frequency = cfg.frequency_penalty.filter(|p| *p != 0.0);
    if rep.is_none() && presence.is_none() && frequency.is_none() {
        return None;
    }
    let mut row = logits.to_vec();
    if let Some(pen) = rep {
        let recent = &history[history.len().saturating_sub(REPEAT_WINDOW)..];
        let mut seen = std::collections::BTreeSet::new();
        for &id in recent {
            let i = id as usize;
            if i < row.len() && seen.insert(i) {
                let v = row[i];
                row[i] = if v > 0.0 { v / pen } else { v * pen };
            }
        }
    }
    if presence.is_some() || frequency.is_some() {
        let mut counts = std::collections::BTreeMap::<usize, u32>::new();
        for &id in generated {
            if (id as usize) < row.len() {
                *counts.entry(id as usize).or_default() += 1;
            }
        }
        let (p, f) = (presence.unwrap_or(0.0), frequency.unwrap_or(0.0));
        for (i, c) in counts {
            row[i] -= c as f32 * f + p;
        }
    }
    Some(row)
}

/// Pick the next token for generation step `step` (0-based); `history` is every token so
/// far (prompt and generated), which only the repetition penalty reads; `generated` is the
/// ids this request has generated so far, which only the presence and frequency penalties
/// read.
pub fn sample(
    logits: &[f32],
    cfg: &SamplerConfig,
    step: u64,
    history: &[u32],
    generated: &[u32],
) -> usize {
    let owned = penalised(logits, cfg, history, generated);
    let logits: &[f32] = owned.as_deref().unwrap_or(logits);
    let t = match cfg.temperature {
        Some(t) if t > 0.0 => t as f64,
        _ => return argmax(logits),
    };
    // Candidates sorted by logit, descending; ties by lower id (a total, input-only order).
    let mut idx: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    if idx.is_empty() {
        return argmax(logits);
    }
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if let Some(k) = cfg.top_k {
        idx.truncate(k.max(1));
    }
    let m = logits[idx[0]] as f64;
    let w: Vec<f64> = idx
        .iter()
        .map(|&i| ((logits[i] as f64 - m) / t).exp())
        .collect();
    let z: f64 = w.iter().sum();
    let mut keep = w.len();
    if let Some(p) = cfg.top_p {
        let mut c = 0.0;
        for (j, wj) in w.iter().enumerate() {
            c += wj / z;
            if c >= p as f64 {
                keep = j + 1;
                break;
            }
        }
    }
    if let Some(mp) = cfg.min_p.filter(|p| *p > 0.0) {
        // w[0] is the top candidate's weight (1.0); candidates are sorted, so the kept set
        // is a prefix. The top candidate always stays.
        let floor = mp as f64 * w[0];
        keep = keep.min(w.iter().take_while(|&&x| x >= floor).count().max(1));
    }
    let zk: f64 = w[..keep].iter().sum();
    let mut rng = ChaCha20Rng::seed_from_u64(cfg.seed);
    rng.set_stream(step);
    let u: f64 = rng.gen::<f64>() * zk;
    let mut c = 0.0;
    for j in 0..keep {
        c += w[j];
        if u < c {
            return idx[j];
        }
    }
    idx[keep - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_prefers_lowest_index_on_ties_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.1]), 1);
    }

    #[test]
    fn greedy_config_is_argmax() {
        let l = [0.1, 0.9, 0.3];
        let cfg = SamplerConfig::default();
        assert!(cfg.is_greedy());
        assert_eq!(sample(&l, &cfg, 7, &[], &[]), 1);
    }

    #[test]
    fn seeded_sampling_depends_only_on_seed_and_step() {
        let l: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let cfg = SamplerConfig {
            temperature: Some(1.0),
            top_p: Some(0.9),
            top_k: Some(20),
            seed: 42,
            ..Default::default()
        };
        let a: Vec<usize> = (0..20).map(|s| sample(&l, &cfg, s, &[], &[])).collect();
        let b: Vec<usize> = (0..20).map(|s| sample(&l, &cfg, s, &[], &[])).collect();
        assert_eq!(a, b);
        // Different steps draw differently (a sampler that ignored the step would repeat).
        assert!(a.iter().any(|&x| x != a[0]));
        // top-k = 1 is greedy whatever the temperature.
        let k1 = SamplerConfig {
            top_k: Some(1),
            ..cfg
        };
        assert!((0..10).all(|s| sample(&l, &k1, s, &[], &[]) == argmax(&l)));
    }

    fn row() -> Vec<f32> {
        (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect()
    }

    #[test]
    fn min_p_keeps_only_candidates_near_the_top() {
        // Two strong candidates, the rest far below: min-p 0.5 keeps only the two.
        let mut l = vec![-10.0f32; 30];
        l[3] = 5.0;
        l[7] = 4.8;
        let cfg = SamplerConfig {
            temperature: Some(1.0),
            min_p: Some(0.5),
            seed: 1,
            ..Default::default()
        };
        let picks: std::collections::BTreeSet<usize> =
            (0..200).map(|s| sample(&l, &cfg, s, &[], &[])).collect();
        assert_eq!(picks, [3usize, 7].into_iter().collect());
        // Without min-p at a high temperature the tail is reachable.
        let hot = SamplerConfig {
            temperature: Some(50.0),
            min_p: None,
            ..cfg
        };
        let picks: std::collections::BTreeSet<usize> =
            (0..200).map(|s| sample(&l, &hot, s, &[], &[])).collect();
        assert!(picks.len() > 2);
    }

    #[test]
    fn repetition_penalty_moves_greedy_off_a_repeated_id() {
        let l = [1.0f32, 3.0, 2.5, -1.0];
        let cfg = SamplerConfig {
            repetition_penalty: Some(1.5),
            ..Default::default()
        };
        // Without history the top id wins; once id 1 was seen, 3.0/1.5 = 2.0 < 2.5.
        assert_eq!(sample(&l, &cfg, 0, &[], &[]), 1);
        assert_eq!(sample(&l, &cfg, 0, &[1], &[]), 2);
        // Negative logits are pushed further down, not up.
        let neg = [-1.0f32, -1.2];
        assert_eq!(sample(&neg, &cfg, 0, &[0], &[]), 1);
        // Only the last REPEAT_WINDOW tokens count.
        let mut old = vec![1u32];
        old.extend(std::iter::repeat_n(3u32, REPEAT_WINDOW));
        assert_eq!(sample(&l, &cfg, 0, &old, &[]), 1);
    }

    #[test]
    fn presence_and_frequency_penalties_count_generated_ids_only() {
        let l = [3.0f32, 2.5, 2.4, -1.0];
        let pres = SamplerConfig {
            presence_penalty: Some(0.7),
            ..Default::default()
        };
        // Id 0 generated once: 3.0 - 0.7 = 2.3 < 2.5; the prompt (history) does not count.
        assert_eq!(sample(&l, &pres, 0, &[0, 0, 0], &[]), 0);
        assert_eq!(sample(&l, &pres, 0, &[0], &[0]), 1);
        // Presence counts an id once however often it came (2.3, 1.8, 2.4).
        assert_eq!(sample(&l, &pres, 0, &[], &[0, 0, 0, 1]), 2);
        let freq = SamplerConfig {
            frequency_penalty: Some(0.3),
            ..Default::default()
        };
        // Once: 3.0 - 0.3 = 2.7 still wins; twice: 2.4 < 2.5.
        assert_eq!(sample(&l, &freq, 0, &[], &[0]), 0);
        assert_eq!(sample(&l, &freq, 0, &[], &[0, 0]), 1);
        // Negative penalties favour repeats: id 3 generated 4 times at -1: -1 + 4 = 3 (not
        // above 3.0 at id 0, which keeps the tie by the lower id), 5 times wins.
        let neg = SamplerConfig {
            frequency_penalty: Some(-1.0),
            ..Default::default()
        };
        assert_eq!(sample(&l, &neg, 0, &[], &[3; 4]), 0);
        assert_eq!(sample(&l, &neg, 0, &[], &[3; 5]), 3);
        // Both at once, exactly: count * f + p in f32.
        let both = SamplerConfig {
            presence_penalty: Some(0.25),
            frequency_penalty: Some(0.125),
            ..Default::default()
        };
        let row = penalised(&l, &both, &[], &[1, 1, 2]).unwrap();
        assert_eq!(row, vec![3.0, 2.5 - 0.5, 2.4 - (0.125 + 0.25), -1.0]);
        // Off (None or 0): the row is used as it is.
        let zero = SamplerConfig {
            presence_penalty: Some(0.0),
            frequency_penalty: Some(0.0),
            ..Default::default()
        };
        assert!(penalised(&l, &zero, &[0], &[0]).is_none());
    }

    #[test]
    fn top_k_alone_with_a_temperature_is_not_greedy() {
        let l = row();
        let cfg = SamplerConfig {
            temperature: Some(1.0),
            top_k: Some(5),
            seed: 9,
            ..Default::default()
        };
        let picks: std::collections::BTreeSet<usize> =
            (0..100).map(|s| sample(&l, &cfg, s, &[], &[])).collect();
        assert!(picks.len() > 1, "top-k 5 at T=1 drew only {picks:?}");
        assert!(picks.len() <= 5);
    }
}
