//! GEMV benchmark at Kimi K3's real shapes: bf16 and MXFP4 weights, 1 and 2 threads,
//! AVX2 and portable, in GB/s of weight bytes read, beside the machine's memory read
//! bandwidth measured in the same run (a multi-threaded sum over a large buffer).
//!
//! Run: `cargo run --release -p k3-layer-compute --example gemv_bench [-- --quick]`.
//! Weight buffers are replicated until each shape streams at least 512 MiB per round, so
//! the numbers are DRAM numbers, not cache numbers.

use std::hint::black_box;
use std::time::Instant;

use k3_layer_compute::kernels::gemv::{gemv, Mat};
use k3_layer_compute::kernels::simd;

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// Read bandwidth (GB/s) of summing `buf` with `threads` threads, best of `reps`.
fn read_bw(buf: &[u64], threads: usize, reps: usize) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t0 = Instant::now();
        let chunk = buf.len().div_ceil(threads);
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(chunk)
                .map(|c| {
                    s.spawn(move || {
                        let mut acc = [0u64; 8];
                        for blk in c.chunks_exact(8) {
                            for i in 0..8 {
                                acc[i] = acc[i].wrapping_add(blk[i]);
                            }
                        }
                        acc.iter().fold(0u64, |a, b| a.wrapping_add(*b))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .fold(0, u64::wrapping_add)
        });
        black_box(total);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    (buf.len() * 8) as f64 / best / 1e9
}

struct Case {
    name: &'static str,
    rows: usize,
    cols: usize,
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 2 } else { 4 };
    let min_bytes: usize = if quick { 128 << 20 } else { 512 << 20 };
    let mut s = 0x9e37_79b9_7f4a_7c15u64;

    let bw_buf: Vec<u64> = (0..(1usize << 30) / 8).map(|i| i as u64).collect();
    let bw1 = read_bw(&bw_buf, 1, reps);
    let bw2 = read_bw(&bw_buf, 2, reps);
    drop(bw_buf);
    println!("memory read bandwidth (1 GiB sum): 1 thread {bw1:.2} GB/s, 2 threads {bw2:.2} GB/s");
    println!("AVX2 available: {}", simd::avx2_available());
    println!();
    println!(
        "{:<8} {:<22} {:>9} {:>8} {:>8} {:>9} {:>10}",
        "format", "shape (out x in)", "MB/copy", "threads", "path", "GB/s", "% of read"
    );

    let cases = [
        Case {
            name: "kda q/k/v/g",
            rows: 12288,
            cols: 7168,
        },
        Case {
            name: "latent down",
            rows: 3584,
            cols: 7168,
        },
        Case {
            name: "expert w1/w3",
            rows: 3072,
            cols: 3584,
        },
        Case {
            name: "expert w2",
            rows: 3584,
            cols: 3072,
        },
    ];
    for fmt in ["bf16", "mxfp4"] {
        for c in &cases {
            let per = match fmt {
                "bf16" => c.rows * c.cols * 2,
                _ => c.rows * c.cols / 2 + c.rows * c.cols / 32,
            };
            let copies = min_bytes.div_ceil(per).max(1);
            // Weights: random bytes (bf16: finite values; MXFP4: any code, scales near 2^-7).
            let bufs: Vec<(Vec<u8>, Vec<u8>)> = (0..copies)
                .map(|_| match fmt {
                    "bf16" => (
                        (0..c.rows * c.cols)
                            .flat_map(|_| {
                                let v = ((xorshift(&mut s) >> 40) as f32 / 16777216.0 - 0.5) * 0.1;
                                ((v.to_bits() >> 16) as u16).to_le_bytes()
                            })
                            .collect(),
                        Vec::new(),
                    ),
                    _ => (
                        (0..c.rows * c.cols / 2)
                            .map(|_| xorshift(&mut s) as u8)
                            .collect(),
                        (0..c.rows * c.cols / 32)
                            .map(|_| 118 + (xorshift(&mut s) % 4) as u8)
                            .collect(),
                    ),
                })
                .collect();
            let mats: Vec<Mat<'_>> = bufs
                .iter()
                .map(|(a, b)| match fmt {
                    "bf16" => Mat::bf16(a, c.rows, c.cols).unwrap(),
                    _ => Mat::mxfp4(a, b, c.rows, c.cols).unwrap(),
                })
                .collect();
            let x: Vec<f32> = (0..c.cols)
                .map(|i| ((i % 97) as f32 - 48.0) / 50.0)
                .collect();
            let mut y = vec![0f32; c.rows];
            let paths: &[bool] = if simd::avx2_available() {
                &[true, false]
            } else {
                &[false]
            };
            for &avx2 in paths {
                simd::set_force_portable(!avx2);
                for threads in [1usize, 2] {
                    if !avx2 && quick && threads == 2 {
                        continue;
                    }
                    let mut best = f64::MAX;
                    for _ in 0..reps {
                        let t0 = Instant::now();
                        for m in &mats {
                            gemv(m, &x, &mut y, threads);
                            black_box(&y);
                        }
                        best = best.min(t0.elapsed().as_secs_f64());
                    }
                    let gbs = (per * copies) as f64 / best / 1e9;
                    let base = if threads == 1 { bw1 } else { bw2 };
                    println!(
                        "{:<8} {:<22} {:>9.1} {:>8} {:>8} {:>9.2} {:>9.0}%",
                        fmt,
                        format!("{} {}x{}", c.name, c.rows, c.cols),
                        per as f64 / 1e6,
                        threads,
                        if avx2 { "avx2" } else { "portable" },
                        gbs,
                        100.0 * gbs / base
                    );
                }
            }
            simd::set_force_portable(false);
        }
    }
}
