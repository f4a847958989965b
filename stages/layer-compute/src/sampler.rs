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
#[doc(hidden)]
pub fn penalised(
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
