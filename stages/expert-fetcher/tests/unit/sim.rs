//! The cache simulator (`src/sim.rs`): each policy's hits on small traces worked by hand.

use k3_expert_fetcher::sim::*;

fn keys(v: &[u32]) -> Vec<Key> {
    v.iter().map(|&e| (1, e)).collect()
}

#[test]
fn lru_on_a_cyclic_scan_never_hits() {
    // 3 keys cycled through 2 slots: LRU always evicts the key needed next.
    let t = DenseTrace::new(&keys(&[0, 1, 2, 0, 1, 2, 0, 1, 2]));
    assert_eq!(simulate(Policy::Lru, &t, 2), 0);
    // Belady keeps one of them: hits at 3 (0), 5 (2)... exactly 3 of the 6 repeats.
    assert_eq!(simulate(Policy::Belady, &t, 2), 3);
    assert_eq!(simulate(Policy::Lru, &t, 3), 6);
}

#[test]
fn pin_lru_pins_the_most_requested_half() {
    // Key 7 is requested most; with 2 slots, 1 is pinned to 7, 1 is an LRU.
    let t = DenseTrace::new(&keys(&[1, 7, 2, 7, 3, 7, 1, 7]));
    // 7: first miss, then 3 hits; the LRU slot never hits (1,2,3,1 distinct in a row).
    assert_eq!(simulate(Policy::PinLru, &t, 2), 3);
    // Plain LRU with 2 slots: 7 stays (hit 3 times), the other slot churns.
    assert_eq!(simulate(Policy::Lru, &t, 2), 3);
}

#[test]
fn every_policy_hits_everything_when_it_all_fits() {
    let tr = keys(&[5, 6, 5, 6, 9, 9, 5]);
    let t = DenseTrace::new(&tr);
    // Pinned-hot admits nothing it did not pin: pins learned on the whole trace here.
    let all = Pins::Learn(1.0);
    for p in Policy::ALL {
        assert_eq!(simulate_with(p, &t, 3, &all), 4, "{}", p.name());
        assert_eq!(simulate_with(p, &t, 0, &all), 0, "{}", p.name());
    }
}

/// LRU with 2 slots on A B A C A: A, B miss; A hits; C evicts B (A was used more
/// recently); A hits: 2 hits. Catches an LRU that evicts the most recently used (it
/// would throw A out for C, and A would miss: 1 hit).
#[test]
fn lru_evicts_the_least_recent() {
    let t = DenseTrace::new(&keys(&[0, 1, 0, 2, 0]));
    assert_eq!(simulate(Policy::Lru, &t, 2), 2);
}

/// S3-FIFO with 2 slots (small 1, main 1, ghost 1) on A A A B C A:
/// A misses into small, hits twice (freq 2); B misses into small (the cache is not
/// full); C finds it full: small's tail A has freq 2 > 1 and moves to main, then B
/// (freq 0) leaves for the ghost; C goes to small; A hits in main. 3 hits. LRU gets 2
/// (C evicts A, the least recent). Catches an S3-FIFO that never promotes (A would
/// leave for the ghost and be dropped from it by B: 2 hits) and one that promotes at
/// freq > 0 only (same 3 here, caught below).
#[test]
fn s3fifo_promotes_what_was_used_on_probation() {
    let t = DenseTrace::new(&keys(&[0, 0, 0, 1, 2, 0]));
    assert_eq!(simulate(Policy::S3Fifo, &t, 2), 3);
    assert_eq!(simulate(Policy::Lru, &t, 2), 2);
    // A used once on probation (freq 1) is NOT promoted (the paper's freq > 1):
    // A A B C A: C evicts A to the ghost (dropped by B), then A misses again: 1 hit.
    // Promoting at freq 1 would keep A in main: 2 hits.
    let t = DenseTrace::new(&keys(&[0, 0, 1, 2, 0]));
    assert_eq!(simulate(Policy::S3Fifo, &t, 2), 1);
}

/// S3-FIFO's ghost, 4 slots (small 1, main 3, ghost 3) on A B C D E A E A F G H I A:
/// A..D fill the cache (all in small); E evicts small's tail A (freq 0) to the ghost;
/// A misses, B goes to the ghost, and A, found in the ghost, goes straight into main;
/// E hits (small, freq 1); A hits (main); F, G, H, I each evict small's tail (C, D, E
/// with freq 1 < 2, F) to the ghost; A hits in main. 3 hits. Catches a ghost that is
/// never consulted: A would re-enter small, and I would evict it (freq 1): 2 hits.
#[test]
fn s3fifo_ghost_hits_go_to_main() {
    let t = DenseTrace::new(&keys(&[0, 1, 2, 3, 4, 0, 4, 0, 5, 6, 7, 8, 0]));
    assert_eq!(simulate(Policy::S3Fifo, &t, 4), 3);
}

/// Pinned-hot with 1 slot on A A A B | C C C C, learning on the first half: A is
/// pinned, and the second half (scored) never asks for it: 0 hits. Learning on the
/// whole trace (share 1, scored on the whole) pins C (4 requests): it misses once, then
/// 3 hits; a given pin set of [C] gets the same. Catches pins learned on the whole
/// trace (the future) instead of the prefix: C pinned, 3 hits in the scored half,
/// scaled to 6.
/// On A A B A | A C A C, learning on the first half pins A; the scored half has A
/// (its read), C, A (a hit), C: 1 hit in 4, scaled to 2 of 8. Catches the prefix
/// scored too (A's hits there: 4) and an unscaled count (1).
#[test]
fn pinned_hot_learns_on_the_prefix_or_takes_the_given_set() {
    let t = DenseTrace::new(&keys(&[0, 0, 0, 1, 2, 2, 2, 2]));
    assert_eq!(simulate_with(Policy::PinHot, &t, 1, &Pins::Learn(0.5)), 0);
    assert_eq!(simulate_with(Policy::PinHot, &t, 1, &Pins::Learn(1.0)), 3);
    let u = DenseTrace::new(&keys(&[0, 0, 1, 0, 0, 2, 0, 2]));
    assert_eq!(simulate_with(Policy::PinHot, &u, 1, &Pins::Learn(0.5)), 2);
    assert_eq!(
        simulate_with(Policy::PinHot, &t, 1, &Pins::Given(vec![(1, 2)])),
        3
    );
    // A given key outside the trace takes its slot and hits nothing.
    assert_eq!(
        simulate_with(Policy::PinHot, &t, 1, &Pins::Given(vec![(9, 9), (1, 2)])),
        0
    );
}

/// A route trace's requests are its records' top-k in order, layer by layer. Catches
/// keys built as (expert, layer) or records flattened out of order.
#[test]
fn route_traces_become_requests_in_order() {
    let mut t = k3_protocol::routes::RouteTrace::new("fp".into(), 4, vec![1, 3], 8, 2);
    t.push(0, 1, &[5, 2]).unwrap();
    t.push(0, 3, &[7, 5]).unwrap();
    t.push(1, 1, &[2, 6]).unwrap();
    assert_eq!(
        keys_of_routes(&t),
        vec![(1, 5), (1, 2), (3, 7), (3, 5), (1, 2), (1, 6)]
    );
}

/// Synthetic routes: deterministic in the seed; a flat router spreads requests so that
/// pinning 10% of the pool serves about 10% (less its compulsory misses), a Zipf-1 one
/// lets the same pins serve far more. Catches a skew that is not applied.
#[test]
fn synthetic_routes_flat_and_skewed() {
    let a = synthetic_routes(200, 4, 64, 4, 0.0, 7);
    assert_eq!(a, synthetic_routes(200, 4, 64, 4, 0.0, 7));
    assert_eq!(a.header.records, 800);
    let rate = |z: f64| {
        let t = DenseTrace::new(&keys_of_routes(&synthetic_routes(400, 4, 64, 4, z, 3)));
        simulate(Policy::PinHot, &t, 26) as f64 / t.requests() as f64
    };
    let (flat, skew) = (rate(0.0), rate(1.0));
    assert!((0.07..0.13).contains(&flat), "flat {flat}");
    assert!(skew > 2.0 * flat, "skew {skew} flat {flat}");
}

#[test]
fn parse_rejects_bad_traces() {
    assert!(matches!(
        parse_trace(&[0; 7], "t"),
        Err(TraceError::Length { .. })
    ));
    let mut b = Vec::new();
    b.extend_from_slice(&1i32.to_le_bytes());
    b.extend_from_slice(&(-3i32).to_le_bytes());
    assert!(matches!(
        parse_trace(&b, "t"),
        Err(TraceError::Negative { .. })
    ));
    b.truncate(4);
    b.extend_from_slice(&3i32.to_le_bytes());
    assert_eq!(parse_trace(&b, "t").unwrap(), vec![(1, 3)]);
}

#[test]
fn policy_names_round_trip() {
    for p in Policy::ALL {
        assert_eq!(Policy::parse(p.name()), Some(p));
    }
    assert_eq!(Policy::parse("PIN+LRU"), None);
    assert_eq!(Policy::parse("S3-FIFO"), Some(Policy::S3Fifo));
}
