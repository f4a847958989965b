//! Prometheus histograms and a sliding tokens-per-second rate for `/metrics` (issue 33):
//! rows per forward pass, time to first token, inter-token time and each request's decode
//! speed. Fixed buckets, lock-free counters: recording costs a few atomic adds, and the
//! memory is fixed (no sample is kept).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Rows in one forward pass (decode rows plus prompt rows).
pub const ROWS_BUCKETS: &[f64] = &[
    1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0,
];
/// Seconds from a request's arrival to its first token.
pub const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Seconds between two tokens of one request.
pub const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// One request's decode speed (tokens per second after its first token).
pub const TPS_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0,
];

/// A Prometheus histogram with fixed upper bounds (`le`), plus `+Inf`.
pub struct Histogram {
    bounds: &'static [f64],
    /// One count per bound, then `+Inf` (not cumulative; rendered cumulative).
    counts: Vec<AtomicU64>,
    /// The sum of the observations, as f64 bits.
    sum_bits: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// Count one observation (NaN is dropped).
    pub fn observe(&self, v: f64) {
        if v.is_nan() {
            return;
        }
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some((f64::from_bits(b) + v).to_bits())
            });
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// The histogram in the Prometheus text format: HELP, TYPE, the cumulative buckets,
    /// `_sum` and `_count`.
    pub fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut acc = 0u64;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            acc += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {acc}");
        }
        acc += self.counts[self.bounds.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {acc}");
        let sum = f64::from_bits(self.sum_bits.load(Ordering::Relaxed));
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {acc}");
    }
}

/// Tokens generated per second over the last [`Rate::WINDOW_S`] seconds, over every
/// request: one counter per second in a fixed ring.
pub struct Rate {
    t0: Instant,
    /// (second since `t0`, tokens in it), at `second % SLOTS`.
    ring: Mutex<[(u64, u64); Rate::SLOTS]>,
}

impl Default for Rate {
    fn default() -> Self {
        Rate {
            t0: Instant::now(),
            ring: Mutex::new([(u64::MAX, 0); Rate::SLOTS]),
        }
    }
}

impl Rate {
    /// Seconds the rate looks back.
    pub const WINDOW_S: u64 = 10;
    const SLOTS: usize = 16;

    /// `n` tokens now.
    pub fn add(&self, n: u64) {
        let sec = self.t0.elapsed().as_secs();
        if let Ok(mut r) = self.ring.lock() {
            let e = &mut r[(sec % Self::SLOTS as u64) as usize];
            if e.0 != sec {
                *e = (sec, 0);
            }
            e.1 += n;
        }
    }

    /// Tokens per second over the window: the tokens of its whole seconds and of the
    /// current one, over the time from the first second that had any (at most the window).
    pub fn per_second(&self) -> f64 {
        let now = self.t0.elapsed().as_secs_f64();
        let sec = now as u64;
        let Ok(r) = self.ring.lock() else {
            return 0.0;
        };
        let lo = sec.saturating_sub(Self::WINDOW_S);
        let live = r
            .iter()
            .filter(|(s, n)| *s != u64::MAX && *s >= lo && *s <= sec && *n > 0);
        let (tokens, first) = live.fold((0u64, u64::MAX), |(t, f), (s, n)| (t + n, f.min(*s)));
        if tokens == 0 {
            return 0.0;
        }
        let span = (now - first as f64).max(1.0);
        tokens as f64 / span
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Catches buckets rendered per bucket instead of cumulative, a `+Inf` that misses the
    // observations past the last bound, and a count or sum that drops some.
    #[test]
    fn buckets_are_cumulative_with_sum_and_count() {
        let h = Histogram::new(&[1.0, 2.0, 4.0]);
        for v in [0.5, 1.0, 1.5, 3.0, 9.0, f64::NAN] {
            h.observe(v);
        }
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        for line in [
            "# TYPE x histogram",
            "x_bucket{le=\"1\"} 2",
            "x_bucket{le=\"2\"} 3",
            "x_bucket{le=\"4\"} 4",
            "x_bucket{le=\"+Inf\"} 5",
            "x_sum 15",
            "x_count 5",
        ] {
            assert!(s.lines().any(|l| l == line), "{line} not in\n{s}");
        }
        assert_eq!(h.count(), 5);
    }

    #[test]
    fn the_rate_counts_the_window() {
        let r = Rate::default();
        assert_eq!(r.per_second(), 0.0);
        r.add(30);
        r.add(12);
        // Within the first second: 42 tokens over (at least) one second.
        let v = r.per_second();
        assert!((v - 42.0).abs() < 1e-9, "{v}");
    }
}
