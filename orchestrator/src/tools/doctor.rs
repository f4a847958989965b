//! `k3-orch doctor [MODEL_DIR] [--experts DIR,...]`: can this machine run the model, how fast would it be, and
//! what to type next.
//!
//! Checks: CPU features (run-time detection; the engine has AVX2+FMA and AVX-512 paths and a
//! portable fallback), what is available (MemAvailable capped by the memory cgroup k3 runs
//! in, read by `k3_io::sysmem` as the run's plan reads it; not MemTotal) and the `--mem-gb`
//! to give a run: that less a stated reserve ([`RESERVE`]) for the rest of the machine, a
//! short devbw on each drive the weights sit on (the shards, symlinks followed, and each
//! `--experts DIR` of a pack; the projection reads from all of them at once, their sum),
//! whether memory cgroups (v2 or v1) are there to enforce
//! per-stage budgets, and the NUMA node count. Then k3's projection for this machine
//! (`tools::project`: the model's headers, the disk as measured, the memory bandwidth and
//! MAC rate measured here; each can be given instead) and the next commands: a one-shot run
//! with a text prompt and `chat`, at that `--mem-gb`. Exits 1 when the machine cannot run
//! the model at all (its plan refuses the memory there is), 2 on usage errors and for a
//! directory that is not a checkpoint.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::Parser;
use k3_io::devbw::measure;
use k3_io::sysmem::{mem_available, parse_meminfo};
use k3_trunk_loader::presets::{Presets, GB};

use super::project::{self, MachineFlags, ModelShape};

#[derive(Parser, Debug)]
#[command(
    name = "k3-orch doctor",
    about = "Machine check, projected s/token, the --mem-gb to use, next command"
)]
struct Args {
    /// The checkpoint directory (shards + config.json); without it the disk is not measured
    /// and the projection is for the released model
    model_dir: Option<PathBuf>,
    /// Seconds per devbw measurement (two measurements)
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// The drive's read bandwidth in GB/s instead of the measurement
    #[arg(long = "drive-gbps")]
    drive_gbps: Option<f64>,
    /// The memory read bandwidth in GB/s instead of the measurement
    #[arg(long = "mem-gbps")]
    mem_gbps: Option<f64>,
    /// Multiply-adds per second of one core, in G, instead of the measurement
    #[arg(long = "gmacs-per-core")]
    gmacs_per_core: Option<f64>,
    /// The packed experts' directories (pack-experts), one per drive: each drive is
    /// measured, and the projection reads from all of them at once
    #[arg(long, value_delimiter = ',')]
    experts: Vec<PathBuf>,
}

/// The share of what is available that doctor leaves to the rest of the machine (the
/// shell, the page cache, other programs) when it advises `--mem-gb`; the run keeps its
/// own 5% of the budget on top.
pub const RESERVE: f64 = 0.10;

/// The `--mem-gb` doctor advises for `available` bytes: less [`RESERVE`], in GB rounded
/// down to a tenth.
pub fn spare_gb(available: u64) -> f64 {
    (available as f64 * (1.0 - RESERVE) / GB * 10.0).floor() / 10.0
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
    for (flag, v) in [
        ("--drive-gbps", a.drive_gbps),
        ("--mem-gbps", a.mem_gbps),
        ("--gmacs-per-core", a.gmacs_per_core),
    ] {
        if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
            tracing::error!("k3-orch doctor: {flag}: must be > 0");
            return 2;
        }
    }
    let presets = Presets::builtin();
    print_cpu();
    let Some(mem) = print_memory(&presets, a.model_dir.as_deref()) else {
        tracing::error!("k3-orch doctor: cannot read MemAvailable from /proc/meminfo");
        return 1;
    };
    let disk = print_disks(a.model_dir.as_deref(), &a.experts, a.seconds);
    print_cgroups();
    print_numa();
    // A directory that is not a checkpoint gets no projection or advice that would fail.
    let shape = match a.model_dir.as_deref().map(ModelShape::from_dir) {
        None => ModelShape::released(),
        Some(Ok(s)) => s,
        Some(Err(why)) => return not_a_checkpoint(a.model_dir.as_deref(), &why.to_string()),
    };
    let drives = disk.map_or(1, |d| d.0);
    let (copies, split) = project::pack_layout(&a.experts);
    let flags = MachineFlags {
        drives,
        copies,
        split,
        drive_gbps: a
            .drive_gbps
            .or(disk.map(|(n, bps)| bps / n.max(1) as f64 / GB)),
        probe: None,
        mem_gbps: a.mem_gbps,
        cores: None,
        gmacs_per_core: a.gmacs_per_core,
        seconds: a.seconds,
    };
    let runs = print_projection(&shape, &mem, &flags, disk.is_some());
    print_next(a.model_dir.as_deref(), &mem, runs)
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
    println!("path       : {}", product_path_line());
}

/// The product path this machine's runs get (`K3_SIMD` and the CPU), and why.
fn product_path_line() -> String {
    use k3_layer_compute::kernels::simd::{self, Kernel, ProductPath};
    use k3_layer_compute::kernels::tuning;
    let (t, warnings) = tuning::parse(|k| std::env::var(k).ok());
    let k = Kernel::selected(&t);
    let why = if t.product.is_some() {
        "the product path K3_SIMD asks for".to_string()
    } else if k.product() == ProductPath::Bf16x3 {
        "automatic: the AVX512-BF16 kernel measured faster than exact on this CPU kind".into()
    } else if simd::amx_available() {
        "automatic: this CPU has the bf16x3 AMX kernel (K3_SIMD=bf16x3: a 512-token prompt \
         about 2.7x faster, a 16-token one about 1.4x), but its decode measured 12-16% \
         slower than exact (docs/measurements.md, \"Short prompts in place, row tile by row \
         tile\")"
            .into()
    } else if simd::bf16_dot_available() {
        "automatic: this CPU has the AVX512-BF16 kernel (K3_SIMD=bf16x3), but without AMX \
         it measured slower than exact (docs/measurements.md)"
            .into()
    } else {
        "automatic: the bit-exact reference path; no bf16 dot-product kernel on this CPU".into()
    };
    let mut line = format!("{} ({why}", k.name());
    if let Some(cap) = t.max_isa {
        line.push_str(&format!(
            "; instruction sets capped at {} by K3_SIMD",
            cap.name()
        ));
    }
    line.push(')');
    for w in warnings {
        line.push_str(&format!("; {w}"));
    }
    line
}

/// What the memory check found: what is available, the `--mem-gb` to advise, the preset
/// that fits, and whether the checkpoint fits in memory whole.
struct Memory {
    spare_gb: f64,
    fits_whole: bool,
}

/// The memory and preset lines; None when MemAvailable cannot be read.
fn print_memory(presets: &Presets, model_dir: Option<&Path>) -> Option<Memory> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let total = parse_meminfo(&meminfo, "MemTotal:");
    let avail = mem_available()?;
    let spare_gb = spare_gb(avail);
    println!(
        "memory     : MemTotal {:.1} GB, available {:.1} GB (MemAvailable capped by the cgroup \
         k3 runs in); give a run --mem-gb {spare_gb:.1} (available less a {:.0}% reserve for \
         the rest of the machine)",
        total.unwrap_or(0) as f64 / GB,
        avail as f64 / GB,
        100.0 * RESERVE
    );
    let preset = presets.for_available(avail);
    let (_, shard_total) = model_dir.map(model_files).unwrap_or((None, 0));
    let fits_whole = shard_total > 0 && (shard_total as f64) < spare_gb * GB * 0.8;
    match preset {
        Some(p) => println!(
            "preset     : {} fits ({:.1} / {:.1} GB trunk / cache; --list-presets); one total \
             --mem-gb uses all of it better",
            p.name, p.trunk_gb, p.cache_gb,
        ),
        None => println!(
            "preset     : none fits (the smallest wants 10 GB available); --mem-gb still plans"
        ),
    }
    if fits_whole {
        println!(
            "             this checkpoint is {:.2} GB: it fits in memory whole, no streaming needed",
            shard_total as f64 / GB
        );
    }
    Some(Memory {
        spare_gb,
        fits_whole,
    })
}

/// The disk lines: one drive per device the weights sit on (the model's shards, symlinks
/// resolved, a packed trunk beside them, and each `--experts` directory's `experts.bin`),
/// each measured on its largest file that holds data. Returns how many drives were
/// measured with O_DIRECT and the sum of their QD16 bytes per second (what reads striped
/// over them all get).
fn print_disks(model_dir: Option<&Path>, experts: &[PathBuf], seconds: f64) -> Option<(u32, f64)> {
    use std::os::unix::fs::MetadataExt;
    let mut files: Vec<PathBuf> = experts
        .iter()
        .map(|d| d.join(k3_model::experts::EXPERTS_BIN))
        .collect();
    if let Some(dir) = model_dir {
        let entries = std::fs::read_dir(dir).into_iter().flatten().flatten();
        files.extend(entries.map(|e| e.path()).filter(|p| {
            let n = p.file_name().map(|n| n.to_string_lossy().into_owned());
            n.is_some_and(|n| n.ends_with(".safetensors") || n == "trunk.bin")
        }));
    }
    // The largest file holding data (not sparse) on each device, symlinks followed.
    let mut best: Vec<(k3_expert_fetcher::devices::DevNum, PathBuf, u64)> = Vec::new();
    for f in files {
        let (Ok(m), Some(dev)) = (
            std::fs::metadata(&f),
            k3_expert_fetcher::devices::device_of(&f),
        ) else {
            continue;
        };
        if !m.is_file() || m.blocks() * 512 < m.len() / 2 {
            continue;
        }
        match best.iter_mut().find(|b| b.0 == dev) {
            Some(b) if b.2 >= m.len() => {}
            Some(b) => (b.1, b.2) = (f, m.len()),
            None => best.push((dev, f, m.len())),
        }
    }
    if best.len() <= 1 {
        let one = best.pop().map(|b| b.1);
        return print_disk(model_dir, one, seconds).map(|bps| (1, bps));
    }
    let (mut sum, mut n) = (0.0, 0u32);
    let all = best.len();
    for (dev, file, _) in best {
        let name = k3_expert_fetcher::devices::block_name(dev)
            .map_or_else(|| dev.to_string(), |n| format!("{n} ({dev})"));
        println!("drive      : {name}");
        // A drive that cannot be measured with O_DIRECT (tmpfs, an error) adds nothing.
        if let Some(bps) = print_disk(model_dir, Some(file), seconds) {
            sum += bps;
            n += 1;
        }
    }
    println!(
        "disks      : {n} of {all} drives measured, {:.0} MB/s together at QD16 (the plan \
         reads them all at once)",
        sum / 1e6
    );
    (n > 0).then_some((n, sum))
}

/// The disk line: random-read bandwidth at QD1 and QD16 on `file`, the largest file that
/// holds data (None: the model's, if any). Returns the QD16 bytes per second when it was
/// read with O_DIRECT.
fn print_disk(model_dir: Option<&Path>, file: Option<PathBuf>, seconds: f64) -> Option<f64> {
    let Some(dir) = model_dir.filter(|_| file.is_none()) else {
        let Some(file) = file else {
            println!("disk       : not measured (give MODEL_DIR, or run `k3-orch devbw FILE`)");
            return None;
        };
        return measure_file(&file, seconds);
    };
    let Some(file) = project::largest_data_file(dir) else {
        let what = if model_files(dir).0.is_some() {
            "its shards are header-only (sparse): there is nothing to read"
        } else {
            "no *.safetensors there"
        };
        println!(
            "disk       : not measured in {}: {what}; run `k3-orch devbw FILE` on the model's drive",
            dir.display()
        );
        return None;
    };
    measure_file(&file, seconds)
}

/// Random-read bandwidth at QD1 and QD16 on `file`, printed; the QD16 bytes per second
/// when it was read with O_DIRECT.
fn measure_file(file: &Path, seconds: f64) -> Option<f64> {
    let size = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
    let rb = 17_547_264u64.min(size / 4096 * 4096);
    if rb == 0 {
        println!("disk       : {} is too small to measure", file.display());
        return None;
    }
    let q1 = measure(file, rb, 1, seconds);
    let q16 = measure(file, rb, 16, seconds);
    let bps = match (q1, q16) {
        (Ok(x), Ok(y)) => {
            println!(
                "disk       : {}: {rb}-byte random reads, QD1 {:.0} MB/s, QD16 {:.0} MB/s ({})",
                file.display(),
                x.mb_per_s(),
                y.mb_per_s(),
                if x.direct {
                    "O_DIRECT"
                } else {
                    "buffered: O_DIRECT refused, page cache may inflate this"
                }
            );
            (y.direct && y.mb_per_s() > 0.0).then(|| y.mb_per_s() * 1e6)
        }
        (Err(e), _) | (_, Err(e)) => {
            println!("disk       : cannot measure: {e}");
            None
        }
    };
    if size < 4 * rb {
        println!("             (a small file: random reads overlap; run devbw on a large shard)");
    }
    bps
}

/// The projection line for `shape` at the advised `--mem-gb` on this machine; whether the
/// plan runs at all there.
fn print_projection(
    shape: &ModelShape,
    mem: &Memory,
    flags: &MachineFlags,
    measured: bool,
) -> bool {
    let machine = project::measure_machine(shape, flags);
    let budget = (mem.spare_gb * GB) as u64;
    match project::project(shape, budget, &machine) {
        Ok(p) => {
            let t = &p.times;
            println!(
                "projected  : {} per token at --mem-gb {:.1} on this machine, {}-bound (disk {} \
                 at {:.2} GB/s, memory {}, compute {}); a 256-token reply in {}",
                project::duration(t.s_per_token()),
                mem.spare_gb,
                t.floor(),
                crate::units::human(p.per_token.disk_bytes() as u64),
                machine.drives as f64 * machine.drive_bps / GB,
                project::duration(t.memory),
                project::duration(t.compute),
                project::duration(256.0 * t.s_per_token())
            );
            println!(
                "             a PROJECTION of {} (k3-orch project), not a measurement{}",
                shape.label,
                if measured || flags.drive_gbps.is_some() {
                    String::new()
                } else {
                    format!("; the drive is {}", machine.drive_source)
                }
            );
            true
        }
        Err(e) => {
            println!(
                "projected  : none: at --mem-gb {:.1} the plan refuses ({e})",
                mem.spare_gb
            );
            mem.fits_whole
        }
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

/// A directory that is not a checkpoint: say so and what to do instead; exit 2.
fn not_a_checkpoint(model_dir: Option<&Path>, why: &str) -> i32 {
    let model = model_dir.map_or("MODEL_DIR".to_string(), |p| p.display().to_string());
    println!("next       : {model} is not a checkpoint ({why})");
    println!(
        "             fetch one with scripts/download-model.sh DIR, or try the bundled tiny model: k3-orch demo"
    );
    2
}

/// The prompt doctor's commands use.
pub const PROMPT: &str = "What is the capital of France?";

/// The next commands to type, and doctor's exit code: 1 when the machine cannot run the
/// model (`runs` false), else 0.
fn print_next(model_dir: Option<&Path>, mem: &Memory, runs: bool) -> i32 {
    if !runs {
        println!(
            "next       : this machine cannot run the model: its plan refuses the {:.1} GB there is \
             to spare. Free memory or use a larger machine.",
            mem.spare_gb
        );
        return 1;
    }
    let model = model_dir.map_or("MODEL_DIR".to_string(), |p| p.display().to_string());
    let has_tok =
        model_dir.is_none_or(|d| crate::run::defaults::missing_tokenizer_files(d).is_empty());
    let mem_gb = format!("--mem-gb {:.1}", mem.spare_gb);
    let mut lines = Vec::new();
    let trunk = match (mem.fits_whole, model_dir.and_then(find_trunk)) {
        (true, _) => String::new(),
        (false, Some(t)) => format!(" --trunk {}", t.display()),
        (false, None) => {
            let t = format!("{}-trunk", model.trim_end_matches('/'));
            lines.push(format!(
                "k3-orch pack-trunk {model} {t}      # once: the trunk, one run per layer"
            ));
            format!(" --trunk {t}")
        }
    };
    if has_tok {
        lines.push(format!(
            "k3-orch {model}{trunk} {mem_gb} --chat -p \"{PROMPT}\" -n 64"
        ));
        lines.push(format!(
            "k3-orch chat {model} --tok {model}{trunk} {mem_gb}      # a conversation"
        ));
    } else {
        lines.push(format!("k3-orch {model}{trunk} {mem_gb} --ids 1,2,3 -n 8"));
        lines.push(format!(
            "(no tokenizer files in {model}: text prompts and chat need --tok DIR)"
        ));
    }
    for (i, l) in lines.iter().enumerate() {
        println!(
            "{} {l}",
            if i == 0 {
                "next       :"
            } else {
                "            "
            }
        );
    }
    0
}
