//! Cost of the per-chunk CRC the trunk-loader checks on every read of `trunk.bin`:
//! `cargo bench -p k3-model --bench trunk_crc` prints GB/s over a 256 MiB run (in cache),
//! the figure docs/measurements.md compares with a streamed token.

use std::time::Instant;

fn main() {
    let n = 256usize << 20;
    let payload: Vec<u8> = (0..n)
        .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
        .collect();
    let crcs = k3_model::trunk::chunk_crcs(&payload);
    let check = k3_model::trunk::RunCheck {
        layer: 0,
        offset: 0,
        length: n as u64,
        crc32: crcs,
        tensor: None,
    };
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        check.check(&payload).expect("unchanged payload");
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "trunk crc check: {} MiB in {:.1} ms = {:.2} GB/s (best of 5, one thread)",
        n >> 20,
        best * 1e3,
        n as f64 / best / 1e9
    );
}
