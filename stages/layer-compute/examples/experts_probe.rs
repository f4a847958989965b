//! How to spread a prompt's routed experts over the pool: one after another with each
//! product split by rows, against side by side (one expert per thread, in rayon's order or
//! the most tokens first), on the real expert shape from a synthetic slice's weights.
//! The MoE ([`k3_layer_compute::modules::moe`]) takes the side-by-side form for a delivery
//! of at least two experts per thread; this probe is the measurement behind that choice.
//!
//! Run: `cargo run --release -p k3-layer-compute --example experts_probe -- SLICE_DIR
//! [--decode]` with a slice from `k3-orch synth --shape slice --vocab 163840 --seed 7`.
//! Token counts per expert are drawn as a 16-token prompt's top-16-of-64 routes are
//! (binomial, 16 draws at 1/4, by a fixed generator); `--decode` gives 16 experts per
//! layer one token each instead. Every expert of the slice's three MoE layers is read
//! from the page cache (mapped, prefaulted), so the rates are DRAM rates.

use std::time::Instant;

use k3_layer_compute::kernels::matmul::Mat;
use k3_layer_compute::modules::mlp::{glu_mlp, Situ};
use k3_model::mmap_weights::MmapWeights;
use rayon::prelude::*;

fn uptime() -> String {
    std::process::Command::new("uptime")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn main() {
    // The kernel settings in the environment (`K3_SIMD`, ...), as k3-orch reads them.
    k3_layer_compute::kernels::tuning::install(k3_layer_compute::kernels::tuning::from_env());
    let args: Vec<String> = std::env::args().collect();
    let Some(dir) = args.get(1).filter(|a| !a.starts_with("--")) else {
        eprintln!("usage: experts_probe SLICE_DIR [--decode]");
        std::process::exit(2);
    };
    let decode = args.iter().any(|a| a == "--decode");
    let mw = match MmapWeights::open(dir) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("experts_probe: {e}");
            std::process::exit(2);
        }
    };
    // Only a hint (page tables); the rounds read the experts either way.
    mw.populate(|n| n.contains(".experts.")).ok();
    let get = |l: usize, e: usize, w: &str, x: &str| -> Option<&[u8]> {
        let n =
            format!("language_model.model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight_{x}");
        mw.catalog().get(&n).map(|t| mw.bytes(&t))
    };
    let (inter, lat) = (3072usize, 3584usize);
    let mut s = 12345u64;
    let mut jobs: Vec<([Mat<'_>; 3], usize)> = Vec::new();
    for l in 1..4 {
        for e in 0..64 {
            let mut k = 0;
            for _ in 0..16 {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                k += usize::from(s >> 62 == 0);
            }
            if decode {
                k = usize::from(e % 4 == 0);
            }
            let m = |w: &str, rows, cols| -> Option<Mat<'_>> {
                Mat::mxfp4(get(l, e, w, "packed")?, get(l, e, w, "scale")?, rows, cols).ok()
            };
            let (Some(w1), Some(w3), Some(w2)) = (
                m("w1", inter, lat),
                m("w3", inter, lat),
                m("w2", lat, inter),
            ) else {
                eprintln!("experts_probe: {dir} lacks the slice's MXFP4 experts (layer {l}, {e})");
                std::process::exit(2);
            };
            if k > 0 {
                jobs.push(([w1, w3, w2], k));
            }
        }
    }
    let macs: usize = jobs.iter().map(|j| j.1 * 3 * inter * lat).sum();
    let routes: usize = jobs.iter().map(|j| j.1).sum();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("rayon pool");
    let situ = Situ { b1: 4.0, b2: 25.0 };
    let x: Vec<f32> = (0..16 * lat)
        .map(|i| ((i % 13) as f32 - 6.0) * 0.05)
        .collect();
    let run = |([w1, w3, w2], k): &([Mat<'_>; 3], usize), th: usize| {
        glu_mlp(w1, w3, w2, situ, &x[..k * lat], *k, th)
    };
    let mut lpt: Vec<usize> = (0..jobs.len()).collect();
    lpt.sort_by_key(|&j| std::cmp::Reverse(jobs[j].1));
    println!("uptime at start: {}", uptime());
    println!(
        "{} experts, {routes} token routes, {:.1} GMAC, 2 threads; ms (GMAC/s)",
        jobs.len(),
        macs as f64 / 1e9
    );
    let time = |f: &(dyn Fn() + Sync)| {
        let t = Instant::now();
        pool.install(f);
        let dt = t.elapsed().as_secs_f64();
        format!("{:6.0} ({:5.1})", dt * 1e3, macs as f64 / dt / 1e9)
    };
    for round in 1..=4 {
        let split = time(&|| {
            for j in &jobs {
                std::hint::black_box(run(j, 2));
            }
        });
        let side = time(&|| {
            jobs.par_iter().with_max_len(1).for_each(|j| {
                std::hint::black_box(run(j, 1));
            })
        });
        let most = time(&|| {
            lpt.par_iter().with_max_len(1).for_each(|&j| {
                std::hint::black_box(run(&jobs[j], 1));
            })
        });
        println!(
            "round {round}: split by rows {split} | side by side {side} | most tokens first {most}"
        );
    }
    println!("uptime at end: {}", uptime());
}
