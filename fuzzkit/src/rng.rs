//! The fuzzers' PRNG: splitmix64, small, fast, and the same sequence on every machine, so
//! a seed reproduces a run.

/// splitmix64. Each harness passes its own `stream` constant, so two harnesses run with the
/// same seed draw different sequences.
pub struct Rng(u64);

impl Rng {
    /// The generator for `seed` in `stream`.
    pub fn new(seed: u64, stream: u64) -> Rng {
        Rng(seed ^ stream)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`0` when `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// True with probability 1/n.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    /// A uniformly chosen element of `xs` (not empty).
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }

    /// Shuffle `xs` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            xs.swap(i, self.below(i + 1));
        }
    }
}

/// How many edits a case stacks: 1 to 8, mostly few.
pub fn n_edits(rng: &mut Rng) -> usize {
    1 + (rng.next_u64().trailing_ones() as usize).min(7)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seed reproduces its sequence, another stream gives another one; a change of the
    /// generator (which would silently change every harness's cases) fails here.
    #[test]
    fn sequences_are_fixed_per_seed_and_stream() {
        let mut a = Rng::new(1, 0x6b33_5f66_757a_7a21);
        let first: Vec<u64> = (0..3).map(|_| a.next_u64()).collect();
        let mut b = Rng::new(1, 0x6b33_5f66_757a_7a21);
        assert_eq!(first, (0..3).map(|_| b.next_u64()).collect::<Vec<_>>());
        let mut c = Rng::new(1, 0x6b33_5f74_6f6b_656e);
        assert_ne!(first[0], c.next_u64());
        let mut z = Rng::new(0, 0);
        assert_eq!(z.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert!((0..1000).all(|_| z.below(7) < 7));
        assert_eq!(z.below(0), 0);
        let mut v: Vec<u32> = (0..50).collect();
        z.shuffle(&mut v);
        v.sort_unstable();
        assert_eq!(v, (0..50).collect::<Vec<_>>());
        assert!((0..1000).all(|_| (1..=8).contains(&n_edits(&mut z))));
    }
}
