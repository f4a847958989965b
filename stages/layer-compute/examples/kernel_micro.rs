//! Kernel arithmetic rate with the weights in cache (no DRAM): GMAC/s of one thread for
//! bf16 and MXFP4 at 1, 2, 4, 8, 16 and 64 tokens (each AVX-512 driver: one token, few
//! tokens, chunked small batches, one and several staged passes), per kernel (product path and instruction set:
//! `exact/avx512`, `exact/avx2`, `bf16x3/avx512bf16` where the CPU has them), in wall time
//! and per CPU-second of the thread (`/proc/thread-self/schedstat`: meaningful on a loaded
//! machine too). Complements `gemv_bench` (DRAM rates).
//!
//! Run: `cargo run --release -p k3-layer-compute --example kernel_micro [FMT [NTOK]]
//! [--direct] [--avx512 | --bf16x3 | --amx]` (`--avx512`: the exact AVX-512 kernel alone;
//! `--bf16x3`: the bf16x3 kernels alone; `--amx`: the AMX kernel alone). Environment:
//! `MICRO_ROWS`, `MICRO_COLS` (the matrix, default 128 × 7168) and `MICRO_MACS` (at least
//! that many G multiply-adds a case: a 512-token case otherwise runs once, its first
//! touches included).

use std::hint::black_box;
use std::time::Instant;

use k3_layer_compute::kernels::matmul::{gemm_on, rows_prepared_on, Mat, Prepared};
use k3_layer_compute::kernels::simd::{self, Isa, Kernel, ProductPath};

/// On-CPU seconds of the calling thread (`/proc/thread-self/schedstat`), so a busy
/// machine's share can be told apart from the kernel's rate; NaN where unavailable.
fn thread_cpu() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(f64::NAN, |ns| ns as f64 / 1e9)
}

fn main() {
    // The kernel settings in the environment (`K3_WEIGHT_STAGING`, ...), as k3-orch reads them.
    k3_layer_compute::kernels::tuning::install(k3_layer_compute::kernels::tuning::from_env());
    let rows: usize = std::env::var("MICRO_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128);
    let cols: usize = std::env::var("MICRO_COLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7168);
    // `MICRO_MACS` (module doc).
    let min_macs: f64 = std::env::var("MICRO_MACS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let mut s = 0x1234_5678u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let bf: Vec<u8> = (0..rows * cols)
        .flat_map(|_| {
            ((((next() >> 40) as f32 / 16777216.0 - 0.5).to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect();
    let pk: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
    let sc: Vec<u8> = (0..rows * cols / 32)
        .map(|_| 118 + (next() % 4) as u8)
        .collect();
    let mats = [
        ("bf16", Mat::bf16(&bf, rows, cols).unwrap()),
        ("mxfp4", Mat::mxfp4(&pk, &sc, rows, cols).unwrap()),
    ];
    // `kernel_micro FMT NTOK` runs one case (for profiling).
    let args: Vec<String> = std::env::args().collect();
    for (name, m) in &mats {
        if args.len() > 1 && args[1] != *name {
            continue;
        }
        // `kernel_micro FMT NTOK` takes any token count (an expert's few tokens: 1-11).
        let counts: Vec<usize> = match args.get(2).and_then(|v| v.parse().ok()) {
            Some(n) if n > 0 => vec![n],
            _ => vec![1, 2, 4, 8, 16, 64],
        };
        for &ntok in &counts {
            let x: Vec<f32> = (0..ntok * cols).map(|i| (i % 13) as f32 * 0.1).collect();
            let mut y = vec![0f32; ntok * rows];
            // `--avx512` / `--bf16x3` / `--amx`: that kernel alone (`--bf16x3`: both of
            // the path's kernels where the CPU has AMX).
            let all = [
                (ProductPath::Exact, Isa::Avx512),
                (ProductPath::Exact, Isa::Avx2),
                (ProductPath::Bf16x3, Isa::Avx512),
            ];
            let kernels: Vec<Kernel> = all
                .into_iter()
                .filter(|&(pp, i)| simd::path_available(pp, i))
                .filter(|&(pp, i)| {
                    !args.iter().any(|a| a == "--avx512")
                        || (pp, i) == (ProductPath::Exact, Isa::Avx512)
                })
                .filter(|&(pp, _)| {
                    !args.iter().any(|a| a == "--bf16x3") || pp == ProductPath::Bf16x3
                })
                .map(|(pp, i)| Kernel::on_path(pp, i))
                .filter(|_| !args.iter().any(|a| a == "--amx"))
                .chain(
                    (simd::amx_available() && !args.iter().any(|a| a == "--avx512"))
                        .then(|| Kernel::amx(&Default::default())),
                )
                .collect();
            for k in &kernels {
                let iters = ((2000 / ntok * if args.len() > 2 { 5 } else { 1 }) * (128 * 7168)
                    / (rows * cols))
                    .max((min_macs * 1e9 / (rows * cols * ntok) as f64).ceil() as usize)
                    .max(1);
                let c0 = thread_cpu();
                let t0 = Instant::now();
                // `--direct` (with FMT NTOK): the row kernel alone on a prepared input.
                let direct = args.iter().any(|a| a == "--direct");
                let xp = Prepared::new(k, &x, cols, ntok);
                let mut sums = vec![0f64; rows * ntok];
                for _ in 0..iters {
                    if direct {
                        rows_prepared_on(k, m, &xp, ntok, &mut sums);
                        black_box(&sums);
                    } else {
                        gemm_on(k, m, &x, &mut y, ntok);
                        black_box(&y);
                    }
                }
                let dt = t0.elapsed().as_secs_f64();
                let cpu = thread_cpu() - c0;
                let gmac = (iters * rows * cols * ntok) as f64 / dt / 1e9;
                let gbs = (iters * m.weight_bytes()) as f64 / dt / 1e9;
                let per_cpu = (iters * rows * cols * ntok) as f64 / cpu / 1e9;
                println!(
                    "{name:<6} ntok {ntok:>2} {:<17} {gmac:>7.1} GMAC/s  {gbs:>7.1} GB/s of \
                     weights (cached)  {per_cpu:>7.1} GMAC/cpu-s",
                    k.name()
                );
            }
        }
    }
}
