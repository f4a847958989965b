//! `k3-orch doctor [MODEL_DIR]`: can this machine run the model, with which preset, and what
//! to type next.
//!
//! Checks: CPU features (run-time detection; the engine has AVX2+FMA and AVX-512 paths and a
//! portable fallback), what is available (MemAvailable capped by the memory cgroup k3 runs
//! in, read by `k3_io::sysmem` as the run's plan reads it; not MemTotal) mapped to a preset
//! by the seed's thresholds (>= 192 GB server, >= 96 workstation, >= 32 desktop, >= 10
//! laptop), a short devbw on the model's disk, whether memory cgroups (v2 or v1) are there
//! to enforce per-stage budgets, and the NUMA node count. Exits 1 when the machine cannot
//! run the model at all (below every preset and the checkpoint does not simply fit), 2 on
//! usage errors.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::Parser;
use k3_io::devbw::measure;
use k3_io::sysmem::{mem_available, parse_meminfo};
use k3_trunk_loader::presets::{Preset, Presets, GB};

#[derive(Parser, Debug)]
#[command(
    name = "k3-orch doctor",
    about = "Machine check, preset advice, next command"
)]
struct Args {
    /// The checkpoint directory (shards + config.json); without it the disk is not measured
    model_dir: Option<PathBuf>,
    /// Seconds per devbw measurement (two measurements)
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
}

/// `(name, detected)` for the CPU features the kernels care about.
pub fn cpu_features() -> Vec<(&'static str, bool)> {
    #[cfg(target_arch = "x86_64")]
    {
        vec![
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("f16c", std::arch::is_x86_feature_detected!("f16c")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
            (
                "avx512bf16",
                std::arch::is_x86_feature_detected!("avx512bf16"),
            ),
            (
                "avx512vnni",
                std::arch::is_x86_feature_detected!("avx512vnni"),
            ),
        ]
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Vec::new()
    }
}

/// What memory cgroups offer: a description and whether per-stage budgets can be enforced.
pub fn cgroup_status() -> (String, bool) {
    let root = Path::new("/sys/fs/cgroup");
    let writable = |p: &Path| {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok();
        // SAFETY: `access` only reads the NUL-terminated path.
        c.is_some_and(|c| unsafe { libc::access(c.as_ptr(), libc::W_OK) } == 0)
    };
    if let Ok(ctl) = std::fs::read_to_string(root.join("cgroup.controllers")) {
        if ctl.split_whitespace().any(|c| c == "memory") {
            let w = writable(root);
            return (
                format!(
                    "v2, memory controller present at {} (writable: {})",
                    root.display(),
                    if w { "yes" } else { "no" }
                ),
                w,
            );
        }
        return ("v2 without the memory controller".into(), false);
    }
    let v1 = root.join("memory");
    if v1.join("memory.limit_in_bytes").exists() {
        let w = writable(&v1);
        return (
            format!(
                "v1, memory controller at {} (writable: {})",
                v1.display(),
                if w { "yes" } else { "no" }
            ),
            w,
        );
    }
    ("no memory cgroup controller found".into(), false)
}

/// NUMA nodes (1 when the kernel exposes none).
pub fn numa_nodes() -> usize {
    std::fs::read_dir("/sys/devices/system/node")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    n.starts_with("node")
                        && n[4..].chars().all(|c| c.is_ascii_digit())
                        && n.len() > 4
                })
                .count()
        })
        .unwrap_or(0)
        .max(1)
}

/// The largest `*.safetensors` (or `trunk.bin`) in a directory, and the total of the shards.
fn model_files(dir: &Path) -> (Option<(PathBuf, u64)>, u64) {
    let mut best: Option<(PathBuf, u64)> = None;
    let mut total = 0u64;
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.filter_map(|e| e.ok()) {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            let Ok(m) = e.metadata() else { continue };
            if !m.is_file() {
                continue;
            }
            let is_shard = name.ends_with(".safetensors");
            if is_shard {
                total += m.len();
            }
            if (is_shard || name == "trunk.bin") && best.as_ref().is_none_or(|b| m.len() > b.1) {
                best = Some((p, m.len()));
            }
        }
    }
    (best, total)
}

/// A packed trunk next to the model: `<MODEL_DIR>/trunk`, `<MODEL_DIR>-trunk`, or `../k3trunk`.
fn find_trunk(model: &Path) -> Option<PathBuf> {
    let mut c = vec![model.join("trunk")];
    if let Some(name) = model.file_name() {
        let mut n = name.to_os_string();
        n.push("-trunk");
        c.push(model.with_file_name(n));
    }
    c.push(model.with_file_name("k3trunk"));
    c.into_iter().find(|p| p.join("trunk.json").is_file())
}

pub fn main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    if let Some(d) = &a.model_dir {
        if !d.is_dir() {
            tracing::error!("k3-orch doctor: {} is not a directory", d.display());
            return 2;
        }
    }
    let presets = Presets::builtin();
    print_cpu();
    let Some(mem) = print_memory(&presets, a.model_dir.as_deref()) else {
        tracing::error!("k3-orch doctor: cannot read MemAvailable from /proc/meminfo");
        return 1;
    };
    print_disk(a.model_dir.as_deref(), a.seconds);
    print_cgroups();
    print_numa();
    print_next(a.model_dir.as_deref(), &mem)
}

/// The CPU line: architecture, threads, the features the kernels care about, the path.
fn print_cpu() {
    let feats = cpu_features();
    let has = |n: &str| feats.iter().any(|(f, y)| *f == n && *y);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let list: Vec<String> = feats
        .iter()
        .map(|(n, y)| format!("{n} {}", if *y { "yes" } else { "no" }))
        .collect();
    println!(
        "cpu        : {}, {threads} threads; {}",
        std::env::consts::ARCH,
        if list.is_empty() {
            "no x86 features".to_string()
        } else {
            list.join(", ")
        }
    );
    let path = if has("avx512f") && has("fma") {
        "AVX-512 and AVX2+FMA kernels available"
    } else if has("avx2") && has("fma") {
        "AVX2+FMA kernels"
    } else {
        "portable kernels only (no AVX2+FMA): correct, but several times slower"
    };
    println!("             {path}");
}

/// What the memory check found: the preset for what is available, and whether the
/// checkpoint fits in memory whole.
struct Memory<'p> {
    preset: Option<&'p Preset>,
    fits_whole: bool,
}

/// The memory and preset lines; None when MemAvailable cannot be read.
fn print_memory<'p>(presets: &'p Presets, model_dir: Option<&Path>) -> Option<Memory<'p>> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let total = parse_meminfo(&meminfo, "MemTotal:");
    let avail = mem_available()?;
    println!(
        "memory     : MemTotal {:.1} GB, available {:.1} GB (MemAvailable capped by the cgroup \
         k3 runs in; presets key on it)",
        total.unwrap_or(0) as f64 / GB,
        avail as f64 / GB
    );
    let preset = presets.for_available(avail);
    let (_, shard_total) = model_dir.map(model_files).unwrap_or((None, 0));
    let fits_whole = shard_total > 0 && (shard_total as f64) < avail as f64 * 0.8;
    match preset {
        Some(p) => println!(
            "preset     : {} ({:.1} / {:.1} GB trunk / cache; available >= {} GB; the seed measured {} on the released checkpoint)",
            p.name,
            p.trunk_gb,
            p.cache_gb,
            p.min_available_gb.unwrap_or(0.0),
            p.expect
        ),
        None => println!(
            "preset     : none: below the {} GB floor of the smallest preset",
            presets
                .presets
                .iter()
                .filter_map(|p| p.min_available_gb)
                .fold(f64::INFINITY, f64::min)
        ),
    }
    if fits_whole {
        println!(
            "             this checkpoint is {:.2} GB: it fits in memory whole, no streaming needed",
            shard_total as f64 / GB
        );
    }
    Some(Memory { preset, fits_whole })
}

/// The disk line: random-read bandwidth at QD1 and QD16 on the model's largest file.
fn print_disk(model_dir: Option<&Path>, seconds: f64) {
    let Some(dir) = model_dir else {
        println!("disk       : not measured (give MODEL_DIR, or run `k3-orch devbw FILE`)");
        return;
    };
    let Some((file, size)) = model_files(dir).0 else {
        println!(
            "disk       : no *.safetensors in {}; run `k3-orch devbw FILE` on the model's disk",
            dir.display()
        );
        return;
    };
    let rb = 17_547_264u64.min(size / 4096 * 4096);
    if rb == 0 {
        println!("disk       : {} is too small to measure", file.display());
        return;
    }
    let q1 = measure(&file, rb, 1, seconds);
    let q16 = measure(&file, rb, 16, seconds);
    match (q1, q16) {
        (Ok(x), Ok(y)) => println!(
            "disk       : {}: {rb}-byte random reads, QD1 {:.0} MB/s, QD16 {:.0} MB/s ({})",
            file.display(),
            x.mb_per_s(),
            y.mb_per_s(),
            if x.direct {
                "O_DIRECT"
            } else {
                "buffered: O_DIRECT refused, page cache may inflate this"
            }
        ),
        (Err(e), _) | (_, Err(e)) => println!("disk       : cannot measure: {e}"),
    }
    if size < 4 * rb {
        println!("             (a small file: random reads overlap; run devbw on a large shard)");
    }
}

/// The cgroups line and the cgroups dead runs left behind.
fn print_cgroups() {
    let (cg, enforce) = cgroup_status();
    println!(
        "cgroups    : {cg}{}",
        if enforce {
            "; per-stage memory budgets can be enforced"
        } else {
            "; budgets cannot be enforced by the kernel here (the plan still applies)"
        }
    );
    if let Ok(sup) = crate::supervise::cgroup::probe() {
        let dead = crate::supervise::cgroup::dead_runs(&sup.parent);
        if dead.is_empty() {
            println!("leftovers  : no cgroups of dead k3 runs");
        } else {
            println!(
                "leftovers  : {} cgroup(s) of dead k3 runs (the next run removes the empty ones):",
                dead.len()
            );
            for d in &dead {
                println!("             {}", d.display());
            }
        }
    }
}

/// The NUMA line.
fn print_numa() {
    let nodes = numa_nodes();
    println!(
        "numa       : {nodes} node{}{}",
        if nodes == 1 { "" } else { "s" },
        if nodes == 1 {
            " (placement is a no-op)"
        } else {
            "; --numa auto places I/O stages near the disk"
        }
    );
}

/// The next command to type, and doctor's exit code: 2 for a directory that is not a
/// checkpoint, 1 when the machine cannot run the model, else 0.
fn print_next(model_dir: Option<&Path>, mem: &Memory) -> i32 {
    let model = model_dir.map_or("MODEL_DIR".to_string(), |p| p.display().to_string());
    let ids = "--ids 1008,10484,318,15383,387 --gen 8 --incremental";
    // A directory that is not a checkpoint gets no run or pack-trunk advice that would fail.
    if let Some(dir) = model_dir {
        let problem = match k3_model::config::ModelConfig::load_dir(dir) {
            Err(e) => Some(e.to_string()),
            Ok(_) => k3_model::catalog::Catalog::open(dir)
                .err()
                .map(|e| e.to_string()),
        };
        if let Some(why) = problem {
            println!("next       : {model} is not a checkpoint ({why})");
            println!(
                "             fetch one with scripts/download-model.sh DIR, or try the bundled tiny model: k3-orch demo"
            );
            return 2;
        }
    }
    match (mem.preset, mem.fits_whole) {
        (_, true) => {
            println!("next       : k3-orch {model} --ids 1,2,3 --gen 8 --incremental");
            0
        }
        (Some(p), false) => {
            match model_dir.and_then(find_trunk) {
                Some(t) => println!(
                    "next       : k3-orch {model} --trunk {} --preset {} {ids}",
                    t.display(),
                    p.name
                ),
                None => {
                    let t = format!("{}-trunk", model.trim_end_matches('/'));
                    println!("next       : k3-orch pack-trunk {model} {t}");
                    println!(
                        "             k3-orch {model} --trunk {t} --preset {} {ids}",
                        p.name
                    );
                }
            }
            0
        }
        (None, false) => {
            println!(
                "next       : this machine cannot run the model: it needs at least 10 GB of \
                 MemAvailable (the laptop preset peaks at 8.2 GB). Free memory or use a larger machine."
            );
            1
        }
    }
}
