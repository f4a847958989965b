//! The sampler (`src/sampler.rs`): greedy ties and NaNs, seeded draws, top-k, min-p and the
//! repetition, presence and frequency penalties.

use k3_layer_compute::sampler::*;

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
