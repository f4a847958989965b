//! Kernel table at Kimi K3's real shapes: bf16 and MXFP4 weights, 1 and 2 threads (rayon
//! pools), every kernel this CPU has (product path and instruction set: `exact/avx512`,
//! `exact/avx2`, `exact/portable`, `bf16x3/avx512bf16`, `bf16x3/portable`), plain GEMV,
//! fused products sharing one input and batched GEMMs (4, 16 and 64 tokens), in GB/s of
//! weight bytes read (MXFP4: packed + scale bytes) and GMAC/s, beside the memory read
//! bandwidth measured in the same run by a vectorised read, and the load average
//! (`uptime`) at the start and the end.
//!
//! Run: `cargo run --release -p k3-layer-compute --example gemv_bench [-- --quick | --membw]
//! [--only NAME] [--path KERNEL] [--th 1|2] [--sweep]`. `--path` takes a kernel's name
//! (`bf16x3/avx512bf16`), a product path (`bf16x3`: its kernels) or an instruction set
//! (`avx512`: the exact path's).
//!
//! The read probe sums a 1 GiB buffer (10× the L3 here) with AVX-512 loads on the same
//! rayon pools as the kernels, with 1, 4 and 8 interleaved streams per task (rows of
//! 14336 bytes read 64 bytes at a time in turn, like a GEMV row tile), and prints every
//! variant (the machine's read limit, printed for reference). "% read" is paired: each
//! timed rep of a case first reads the case's own weight bytes with the same probe on
//! the same pool ([`membw::read_seconds`], 4 streams per task), and the column is the
//! median over reps of that read's time over the kernel's. `--sweep` times the one-token
//! cases for every decode tuning (rows side by side × software prefetch distance, see
//! `tuning::KernelTuning`); the "GMAC/cpu-s" column divides by the CPU time the
//! process spent (all threads), which tells a loaded machine from a slow kernel.
//! Weight buffers are replicated until each case streams at least 512 MiB per round
//! (the lm_head is one 2.35 GB copy), so the numbers are DRAM numbers, not cache numbers.
//! Only meaningful on a quiet machine (load average well below the core count).

use std::hint::black_box;
use std::time::Instant;

use k3_layer_compute::kernels::matmul::{gemm, gemm_fused, gemv, Mat};
use k3_layer_compute::kernels::simd::{self, Isa, Kernel, ProductPath};
use k3_layer_compute::kernels::tuning::{self, DriverTuning, KernelTuning};
use k3_layer_compute::membw;

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

fn uptime() -> String {
    std::process::Command::new("uptime")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|_| "uptime unavailable".into())
}

/// Read bandwidth (GB/s) over `buf` on `pool` with `k` interleaved streams per task
/// ([`membw::read_seconds`]), best of `reps`.
fn read_bw(pool: &rayon::ThreadPool, buf: &[u8], k: usize, reps: usize) -> f64 {
    let best = (0..reps)
        .map(|_| pool.install(|| membw::read_seconds(&[buf], k)))
        .fold(f64::MAX, f64::min);
    buf.len() as f64 / best / 1e9
}

/// The memory read limit on each pool: 1, 4 and 8 interleaved streams per task over a
/// 1 GiB buffer (10× the L3), best of `reps`; prints every variant and returns the best
/// per pool.
fn read_limit(pools: &[rayon::ThreadPool], reps: usize) -> Vec<f64> {
    let buf: Vec<u8> = (0..1usize << 30).map(|i| (i >> 12) as u8).collect();
    let mut best = vec![0f64; pools.len()];
    for k in [1usize, 4, 8] {
        let row: Vec<String> = pools
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let g = read_bw(p, &buf, k, reps);
                best[i] = best[i].max(g);
                format!("{} thread(s) {g:.2} GB/s", p.current_num_threads())
            })
            .collect();
        println!(
            "  read probe, {k} stream(s) per task ({} loads): {}",
            if simd::avx512_available() {
                "zmm"
            } else {
                "portable"
            },
            row.join(", ")
        );
    }
    best
}

/// CPU time (seconds) of every thread of this process so far (`/proc/self/task/*/schedstat`,
/// nanoseconds on CPU), so a busy machine's share can be told apart from the kernel's.
fn cpu_seconds() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return f64::NAN;
    };
    let mut ns = 0u64;
    for e in dir.flatten() {
        if let Ok(s) = std::fs::read_to_string(e.path().join("schedstat")) {
            ns += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    ns as f64 / 1e9
}

#[derive(Clone, Copy, PartialEq)]
enum Fmt {
    Bf16,
    Mxfp4,
}

struct Owned {
    /// Backing store of the weights (`a_len` bytes at `a_off`).
    a: Vec<u8>,
    a_off: usize,
    a_len: usize,
    b: Vec<u8>,
    rows: usize,
    cols: usize,
    fmt: Fmt,
}

/// Where the weights start relative to a cache line (bytes): a checkpoint's tensors sit at
/// any 8-byte offset (safetensors pads its header to 8), and the synthetic slice's shards
/// put most of them 16 bytes past a line. `K3_BENCH_WOFF` overrides it.
fn weight_offset() -> usize {
    std::env::var("K3_BENCH_WOFF")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(16)
        % 64
}

impl Owned {
    fn new(fmt: Fmt, rows: usize, cols: usize, s: &mut u64) -> Self {
        // The weights start at the chosen offset from a line (the Vec's own start is
        // wherever the allocator put it) and are generated in place.
        let a_len = match fmt {
            Fmt::Bf16 => rows * cols * 2,
            Fmt::Mxfp4 => rows * cols / 2,
        };
        let mut placed = vec![0u8; a_len + 128];
        let a_off = placed.as_ptr().align_offset(64) + weight_offset();
        let a = &mut placed[a_off..a_off + a_len];
        let b = match fmt {
            Fmt::Bf16 => {
                for ch in a.chunks_exact_mut(2) {
                    let v = ((xorshift(s) >> 40) as f32 / 16777216.0 - 0.5) * 0.1;
                    ch.copy_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
                }
                vec![]
            }
            Fmt::Mxfp4 => {
                for ch in a.chunks_exact_mut(8) {
                    ch.copy_from_slice(&xorshift(s).to_le_bytes());
                }
                (0..rows * cols / 32)
                    .map(|_| 118 + (xorshift(s) % 4) as u8)
                    .collect()
            }
        };
        Owned {
            a: placed,
            a_off,
            a_len,
            b,
            rows,
            cols,
            fmt,
        }
    }
    fn mat(&self) -> Mat<'_> {
        let a = &self.a[self.a_off..self.a_off + self.a_len];
        match self.fmt {
            Fmt::Bf16 => Mat::bf16(a, self.rows, self.cols).unwrap(),
            Fmt::Mxfp4 => Mat::mxfp4(a, &self.b, self.rows, self.cols).unwrap(),
        }
    }
    fn bytes(&self) -> usize {
        self.a_len + self.b.len()
    }
}

/// What one timed call does.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// One matrix, one token.
    Gemv,
    /// All matrices of a set in one `gemm_fused` call, one token.
    Fused,
    /// One matrix over this many tokens (the batched GEMM: weights read once).
    Batch(usize),
}

struct Case {
    name: &'static str,
    fmt: Fmt,
    /// Shapes of the matrices of one set (fused: several).
    shapes: Vec<(usize, usize)>,
    kind: Kind,
}

fn main() {
    // The kernel settings in the environment (`K3_GEMV_ROWS`, ...), as k3-orch reads them;
    // each case installs its instruction set (and, with `--sweep`, its decode tuning) over
    // them.
    let base = tuning::from_env();
    tuning::install(base);
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--only SUBSTR`: run only the cases whose name contains SUBSTR (profiling).
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    // `--path NAME` / `--th N`: only that kernel path / pool size (A/B runs, profiling).
    let arg = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let only_path = arg("--path");
    let only_th: Option<usize> = arg("--th").and_then(|v| v.parse().ok());
    // `--sweep`: one-token cases only, AVX-512 only, every decode tuning (rows side by
    // side × prefetch distance); results never change, only the access pattern.
    let sweep = args.iter().any(|a| a == "--sweep");
    let tunings: Vec<(Option<u8>, Option<u32>)> = if sweep {
        [2u8, 4, 6, 8]
            .iter()
            .flat_map(|&r| [0u32, 256, 512, 1024, 2048, 4096].map(|p| (Some(r), Some(p))))
            .collect()
    } else {
        vec![(base.decode_rows, base.decode_prefetch)]
    };
    let reps = if quick { 2 } else { 4 };
    let min_bytes: usize = if quick { 256 << 20 } else { 512 << 20 };
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let up0 = uptime();
    println!("uptime at start: {up0}");

    let pools: Vec<rayon::ThreadPool> = [1usize, 2]
        .iter()
        .map(|&n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap()
        })
        .collect();
    // `--no-probe`: skip the read probes (A/B runs of one case; "% read" is then NaN).
    let no_probe = args.iter().any(|a| a == "--no-probe");
    let bw = if no_probe {
        vec![f64::NAN; pools.len()]
    } else {
        read_limit(&pools, reps + 2)
    };
    println!(
        "memory read bandwidth (best probe, 1 GiB): 1 thread {:.2} GB/s, 2 threads {:.2} GB/s",
        bw[0], bw[1]
    );
    // `--membw`: only the read bandwidth (scripts/bench-slice.sh measures it beside a run).
    if args.iter().any(|a| a == "--membw") {
        return;
    }
    println!(
        "best path: {} (AVX2+FMA {}, AVX-512F {}, AVX512-BF16 dot product {}); automatic \
         product path: {}; AVX-512 batched staging: {:?} (K3_WEIGHT_STAGING)",
        simd::best_available().name(),
        simd::avx2_available(),
        simd::avx512_available(),
        simd::bf16_dot_available(),
        simd::auto_product().name(),
        DriverTuning::of(&base).staging
    );
    println!();
    println!(
        "{:<8} {:<34} {:>8} {:>3} {:>17} {:>8} {:>7} {:>9} {:>9}",
        "format",
        "case (out x in)",
        "MB/set",
        "th",
        "path",
        "GB/s",
        "% read",
        "GMAC/s",
        "GMAC/cpu-s"
    );

    let cases = vec![
        Case {
            name: "lm_head 163840x7168",
            fmt: Fmt::Bf16,
            shapes: vec![(163840, 7168)],
            kind: Kind::Gemv,
        },
        Case {
            name: "kda q 12288x7168",
            fmt: Fmt::Bf16,
            shapes: vec![(12288, 7168)],
            kind: Kind::Gemv,
        },
        Case {
            name: "latent down 3584x7168",
            fmt: Fmt::Bf16,
            shapes: vec![(3584, 7168)],
            kind: Kind::Gemv,
        },
        Case {
            name: "fused kda q/k/v/g 4x(12288x7168)",
            fmt: Fmt::Bf16,
            shapes: vec![(12288, 7168); 4],
            kind: Kind::Fused,
        },
        Case {
            name: "batch16 kda q 12288x7168",
            fmt: Fmt::Bf16,
            shapes: vec![(12288, 7168)],
            kind: Kind::Batch(16),
        },
        // A `serve --parallel 4` decode pass: 4 rows of every trunk product.
        Case {
            name: "batch4 kda q 12288x7168",
            fmt: Fmt::Bf16,
            shapes: vec![(12288, 7168)],
            kind: Kind::Batch(4),
        },
        Case {
            name: "batch8 kda q 12288x7168",
            fmt: Fmt::Bf16,
            shapes: vec![(12288, 7168)],
            kind: Kind::Batch(8),
        },
        // A prompt's dense FFN down projection: a pass of 16 tokens' activations (2.2 MB)
        // outgrows L2.
        Case {
            name: "batch64 dense down 7168x33792",
            fmt: Fmt::Bf16,
            shapes: vec![(7168, 33792)],
            kind: Kind::Batch(64),
        },
        // A prompt chunk's dense products: compute-bound, where bf16x3 and exact differ.
        Case {
            name: "batch64 latent down 3584x7168",
            fmt: Fmt::Bf16,
            shapes: vec![(3584, 7168)],
            kind: Kind::Batch(64),
        },
        Case {
            name: "expert w1/w3 3072x3584",
            fmt: Fmt::Mxfp4,
            shapes: vec![(3072, 3584)],
            kind: Kind::Gemv,
        },
        Case {
            name: "expert w2 3584x3072",
            fmt: Fmt::Mxfp4,
            shapes: vec![(3584, 3072)],
            kind: Kind::Gemv,
        },
        Case {
            name: "fused expert w1+w3 2x(3072x3584)",
            fmt: Fmt::Mxfp4,
            shapes: vec![(3072, 3584); 2],
            kind: Kind::Fused,
        },
        Case {
            name: "batch16 expert w1 3072x3584",
            fmt: Fmt::Mxfp4,
            shapes: vec![(3072, 3584)],
            kind: Kind::Batch(16),
        },
        Case {
            name: "batch64 expert w1 3072x3584",
            fmt: Fmt::Mxfp4,
            shapes: vec![(3072, 3584)],
            kind: Kind::Batch(64),
        },
        // A prompt's routed expert sees about top-k x tokens / experts of them (16 x 16 / 64
        // on the slice): the prefill's typical batch.
        Case {
            name: "batch4 expert w1 3072x3584",
            fmt: Fmt::Mxfp4,
            shapes: vec![(3072, 3584)],
            kind: Kind::Batch(4),
        },
    ];
    // Every kernel this CPU has, fastest first within a path.
    // (path, instruction set, AMX): the AMX kernel is `bf16x3` on AVX-512 with AMX on.
    let paths: Vec<(ProductPath, Isa, bool)> = [
        (ProductPath::Exact, Isa::Avx512, false),
        (ProductPath::Exact, Isa::Avx2, false),
        (ProductPath::Exact, Isa::Portable, false),
        (ProductPath::Bf16x3, Isa::Avx512, true),
        (ProductPath::Bf16x3, Isa::Avx512, false),
        (ProductPath::Bf16x3, Isa::Portable, false),
    ]
    .into_iter()
    .filter(|&(pp, i, amx)| simd::path_available(pp, i) && (!amx || simd::amx_available()))
    .collect();
    let kernel_name = |pp: ProductPath, i: Isa, amx: bool| {
        if amx {
            Kernel::amx(&base).name()
        } else {
            Kernel::with_path(pp, i, &base).name()
        }
    };
    // `--path`: a kernel's name, a product path's (all its kernels) or an instruction
    // set's (the exact path's kernel on it, as before product paths existed).
    let wanted = |pp: ProductPath, i: Isa, amx: bool| {
        only_path.as_ref().is_none_or(|o| {
            *o == kernel_name(pp, i, amx)
                || *o == pp.name()
                || (pp == ProductPath::Exact && *o == i.name())
        })
    };

    for c in &cases {
        if quick && c.shapes[0].0 == 163840 {
            continue;
        }
        if only.as_ref().is_some_and(|o| !c.name.contains(o.as_str())) {
            continue;
        }
        if sweep && c.kind != Kind::Gemv {
            continue;
        }
        let set_bytes: usize = c
            .shapes
            .iter()
            .map(|&(r, k)| match c.fmt {
                Fmt::Bf16 => r * k * 2,
                Fmt::Mxfp4 => r * k / 2 + r * k / 32,
            })
            .sum();
        let copies = min_bytes.div_ceil(set_bytes).max(1);
        let sets: Vec<Vec<Owned>> = (0..copies)
            .map(|_| {
                c.shapes
                    .iter()
                    .map(|&(r, k)| Owned::new(c.fmt, r, k, &mut s))
                    .collect()
            })
            .collect();
        debug_assert_eq!(sets[0].iter().map(Owned::bytes).sum::<usize>(), set_bytes);
        // The bytes the kernel reads (every copy), for the paired probe.
        let spans: Vec<&[u8]> = sets
            .iter()
            .flatten()
            .flat_map(|o| [&o.a[o.a_off..o.a_off + o.a_len], &o.b[..]])
            .collect();
        let mats: Vec<Vec<Mat<'_>>> = sets
            .iter()
            .map(|set| set.iter().map(Owned::mat).collect())
            .collect();
        let cols = c.shapes[0].1;
        let ntok = match c.kind {
            Kind::Batch(n) => n,
            _ => 1,
        };
        let x: Vec<f32> = (0..cols * ntok)
            .map(|i| ((i % 97) as f32 - 48.0) / 50.0)
            .collect();
        let macs: usize = c.shapes.iter().map(|&(r, k)| r * k).sum::<usize>() * ntok;
        let mut ys: Vec<Vec<f32>> = c
            .shapes
            .iter()
            .map(|&(r, _)| vec![0f32; r * ntok])
            .collect();
        for (&(pp, p, amx), &(trows, tpf)) in paths
            .iter()
            .flat_map(|p| tunings.iter().map(move |t| (p, t)))
        {
            if sweep && p != Isa::Avx512 {
                continue;
            }
            tuning::install(KernelTuning {
                max_isa: Some(p),
                product: Some(pp),
                decode_rows: trows,
                decode_prefetch: tpf,
                amx: Some(amx),
                ..base
            });
            let kernel = Kernel::current();
            assert_eq!(
                (kernel.product(), kernel.isa(), kernel.on_amx()),
                (pp, p, amx),
                "the kernel asked for"
            );
            for (ti, pool) in pools.iter().enumerate() {
                let threads = ti + 1;
                // The portable twin is a reference, not a fast path: one thread, GEMV only.
                if p == Isa::Portable && (threads == 2 || c.kind != Kind::Gemv || quick) {
                    continue;
                }
                if p == Isa::Portable && c.shapes[0].0 == 163840 {
                    continue;
                }
                if !wanted(pp, p, amx) || only_th.is_some_and(|n| n != threads) {
                    continue;
                }
                let mut best = f64::MAX;
                let mut best_cpu = f64::MAX;
                // Each rep first reads the same weight bytes with the probe on the same
                // pool: "% read" is the median over reps of probe time / kernel time,
                // paired within the second (this host's bandwidth drifts by a third
                // within a minute; against one probe at start the column was noise).
                let mut paired = Vec::with_capacity(reps);
                for _ in 0..reps {
                    let tp = if no_probe {
                        f64::NAN
                    } else {
                        pool.install(|| membw::read_seconds(&spans, 4))
                    };
                    let c0 = cpu_seconds();
                    let t0 = Instant::now();
                    pool.install(|| {
                        for set in &mats {
                            match c.kind {
                                Kind::Gemv => gemv(&set[0], &x, &mut ys[0], threads),
                                Kind::Batch(_) => gemm(&set[0], &x, &mut ys[0], ntok, threads),
                                Kind::Fused => {
                                    let refs: Vec<&Mat<'_>> = set.iter().collect();
                                    let mut outs: Vec<&mut [f32]> =
                                        ys.iter_mut().map(|v| &mut v[..]).collect();
                                    gemm_fused(&refs, &x, &mut outs, ntok, threads);
                                }
                            }
                            black_box(&ys);
                        }
                    });
                    let tk = t0.elapsed().as_secs_f64();
                    best = best.min(tk);
                    best_cpu = best_cpu.min(cpu_seconds() - c0);
                    paired.push(tp / tk);
                }
                paired.sort_by(f64::total_cmp);
                let pct = 100.0 * paired[paired.len() / 2];
                let gbs = (set_bytes * copies) as f64 / best / 1e9;
                let label = if sweep {
                    let show = |v: Option<u32>| v.map_or("default".to_string(), |v| v.to_string());
                    let (rows, pf) = (show(trows.map(u32::from)), show(tpf));
                    format!("{} [rows {rows}, pf {pf}]", c.name)
                } else {
                    c.name.to_string()
                };
                println!(
                    "{:<8} {:<w$} {:>8.1} {:>3} {:>17} {:>8.2} {:>6.0}% {:>9.1} {:>9.1}",
                    if c.fmt == Fmt::Bf16 { "bf16" } else { "mxfp4" },
                    label,
                    set_bytes as f64 / 1e6,
                    threads,
                    kernel.name(),
                    gbs,
                    pct,
                    (macs * copies) as f64 / best / 1e9,
                    (macs * copies) as f64 / best_cpu / 1e9,
                    w = if sweep { 48 } else { 34 },
                );
            }
        }
        tuning::install(base);
    }
    println!();
    println!("uptime at end:   {}", uptime());
}
