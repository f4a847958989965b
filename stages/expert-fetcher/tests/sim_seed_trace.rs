//! The seed's published cache table is the oracle: replaying its recorded trace
//! (`tests/fixtures/seed/expert_trace.bin`) must reprint every figure of it.

use k3_expert_fetcher::sim::{read_trace, run, Policy, SimOptions};
use std::path::PathBuf;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/seed/expert_trace.bin")
}

fn pct(h: u64, n: u64) -> String {
    format!("{:.2}", 100.0 * h as f64 / n as f64)
}

/// Expected values transcribed from the seed's section 13 table (not from our output).
/// Wrong implementations this catches: GB as GiB (455 slots would be 489), LRU that evicts
/// the most recent, Belady without the future, PIN+LRU that counts a pinned expert as a hit
/// on its first request (192 GB would exceed 90.00%), or that pins by first sight.
#[test]
fn seed_trace_reprints_the_seed_table() {
    let trace = read_trace(&fixture()).expect("fixture trace");
    let opts = SimOptions::default();
    let r = run(&trace, &opts);
    assert_eq!(r.requests, 100_096);
    assert_eq!(r.distinct, 10_010);
    assert_eq!(r.layers * 896, 82_432);
    assert_eq!(format!("{:.2}", r.ceiling_pct()), "90.00");
    assert_eq!(format!("{:.0}", r.tokens()), "68");
    assert_eq!(
        opts.policies,
        vec![Policy::Lru, Policy::Belady, Policy::PinLru]
    );
    let expect: [(usize, [&str; 3], &str, &str); 7] = [
        (455, ["36.24", "39.42", "37.82"], "16.47", "13.35"),
        (911, ["36.24", "42.61", "39.42"], "16.47", "13.35"),
        (1823, ["36.24", "48.99", "42.57"], "16.47", "13.35"),
        (3647, ["36.24", "61.74", "48.66"], "16.47", "13.35"),
        (7294, ["49.19", "84.59", "62.86"], "13.12", "10.64"),
        (10941, ["90.00", "90.00", "90.00"], "2.58", "2.09"),
        (82633, ["90.00", "90.00", "90.00"], "2.58", "2.09"),
    ];
    for (row, (slots, rates, gb, sec)) in r.rows.iter().zip(expect) {
        assert_eq!(row.slots, slots, "slots at {} GB", row.size_gb);
        for (i, want) in rates.iter().enumerate() {
            assert_eq!(
                pct(row.hits[i], r.requests),
                *want,
                "{} at {} GB",
                opts.policies[i].name(),
                row.size_gb
            );
        }
        let text = r.render();
        let line = text
            .lines()
            .find(|l| l.split_whitespace().nth(2) == Some(&slots.to_string()))
            .unwrap_or_else(|| panic!("no table row with {slots} slots in\n{text}"));
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cols[cols.len() - 2], gb, "GB READ/TOK in {line}");
        assert_eq!(cols[cols.len() - 1], sec, "SEC/TOK in {line}");
    }
    let text = r.render();
    assert!(text.contains("100096 requests, 10010 distinct experts, about 68 token(s)"));
    assert!(text.contains("10010 of 82432 (12.14% of the pool)"));
    assert!(text.contains("if nothing were cached: 25.83 GB per token"));
    assert!(text.contains("90086 of 100096 requests are repeats (90.0%)"));
}

/// The extra policies stay inside the bounds every policy must respect on this trace:
/// never above Belady (optimal) and never above the 90.00% compulsory-miss ceiling.
#[test]
fn extra_policies_respect_belady_and_the_ceiling() {
    let trace = read_trace(&fixture()).expect("fixture trace");
    let opts = SimOptions {
        policies: vec![Policy::Belady, Policy::S3Fifo, Policy::Lfu, Policy::Lru],
        sizes_gb: vec![8.0, 64.0, 192.0],
        ..SimOptions::default()
    };
    let r = run(&trace, &opts);
    for row in &r.rows {
        for &h in &row.hits[1..] {
            assert!(h <= row.hits[0], "{row:?} beats Belady");
            assert!(h <= r.requests - r.distinct);
        }
    }
    // Everything fits at 192 GB (10941 slots > 10010 distinct): every policy hits the ceiling.
    assert!(
        r.rows[2].hits.iter().all(|&h| h == 90_086),
        "{:?}",
        r.rows[2]
    );
}

/// Why the trunk-loader pins a prefix rather than caching layers: a 93-layer cyclic scan
/// through 90 LRU slots hits exactly 0% (every access evicts the layer needed next).
#[test]
fn lru_over_a_cyclic_scan_hits_nothing() {
    use k3_expert_fetcher::sim::{simulate, DenseTrace, Policy};
    let scan: Vec<(u32, u32)> = (0..8).flat_map(|_| (0..93u32).map(|l| (l, 0))).collect();
    let t = DenseTrace::new(&scan);
    assert_eq!(simulate(Policy::Lru, &t, 90), 0);
}
