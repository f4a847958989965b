//! Catalog benchmark: writes the released 96-shard set as sparse header-only files
//! (497,220 tensors, real header sizes, no data) and times `Catalog::open` on it, counting
//! the catalog's heap bytes with a counting global allocator.
//!
//! Run: `cargo bench -p k3-protocol --bench catalog` (optionally `-- DIR` to keep the set
//! in DIR, and `-- DIR --reuse` to skip rewriting it; default a temporary directory). Prints a table; goals: < 1 s, < 100 B/tensor.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};
use std::time::Instant;

use k3_model::catalog::Catalog;
use k3_model::released;

/// System allocator that tracks live and peak bytes.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size() as isize, Ordering::Relaxed) + l.size() as isize;
            PEAK.fetch_max(now.max(0) as usize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `alloc` with layout `l`.
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            let now = LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed)
                + new as isize
                - l.size() as isize;
            PEAK.fetch_max(now.max(0) as usize, Ordering::Relaxed);
        }
        q
    }
}

/// User + system CPU seconds of this process so far (all threads).
fn cpu_secs() -> f64 {
    // SAFETY: getrusage only writes the struct we pass; a zeroed rusage is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a live rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn main() {
    let arg = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let tmp;
    let dir = match arg {
        Some(d) => std::path::PathBuf::from(d),
        None => {
            tmp = tempfile::tempdir().expect("temp dir");
            tmp.path().to_path_buf()
        }
    };
    let t = Instant::now();
    let reuse = std::env::args().any(|a| a == "--reuse")
        && dir.join("model.safetensors.index.json").is_file();
    let set = if reuse {
        let c = Catalog::open(&dir).expect("open existing set");
        released::HeaderOnlySet {
            n_tensors: c.len(),
            payload_bytes: c.payload_bytes(),
            header_bytes: c.shards().iter().map(|s| s.data_start).sum(),
        }
    } else {
        released::write_header_only_set(&dir).expect("write header-only set")
    };
    println!(
        "wrote {} shards, {} tensors, headers {} B, payload {} B (sparse) in {:.2} s to {}",
        released::N_SHARDS,
        set.n_tensors,
        set.header_bytes,
        set.payload_bytes,
        t.elapsed().as_secs_f64(),
        dir.display()
    );
    println!(
        "machine: {} threads available; load average {}",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    println!("| run | open wall s | open CPU s (all threads) | catalog heap B | B/tensor | peak extra B during open |");
    println!("|---|---|---|---|---|---|");
    let mut times = Vec::new();
    for run in 0..5 {
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before.max(0) as usize, Ordering::Relaxed);
        let t = Instant::now();
        let c0 = cpu_secs();
        let cat = Catalog::open(&dir).expect("open");
        let secs = t.elapsed().as_secs_f64();
        let cpu = cpu_secs() - c0;
        let live = LIVE.load(Ordering::Relaxed) - before;
        let peak = PEAK.load(Ordering::Relaxed) as isize - before;
        assert_eq!(cat.len(), released::N_TENSORS);
        println!(
            "| {run} | {secs:.3} | {cpu:.3} | {live} | {:.1} | {peak} |",
            live as f64 / cat.len() as f64
        );
        times.push(secs);
        drop(cat);
    }
    // Phase split: shards alone (no index) and the raw JSON parse of the index.
    let files: Vec<std::path::PathBuf> = (1..=released::N_SHARDS)
        .map(|s| dir.join(released::shard_file_name(s)))
        .collect();
    let t = Instant::now();
    let c0 = cpu_secs();
    let cat = Catalog::from_files(&files).expect("shards");
    println!(
        "shards only (no index): {:.3} s wall, {:.3} s CPU",
        t.elapsed().as_secs_f64(),
        cpu_secs() - c0
    );
    drop(cat);
    let t = Instant::now();
    let c0 = cpu_secs();
    let idx = std::fs::read(dir.join("model.safetensors.index.json")).expect("index");
    let v: serde_json::Value = serde_json::from_slice(&idx).expect("index json");
    println!(
        "for scale, the index alone read into a serde_json::Value: {:.3} s wall, {:.3} s CPU",
        t.elapsed().as_secs_f64(),
        cpu_secs() - c0
    );
    drop(v);
    times.sort_by(f64::total_cmp);
    println!(
        "median open: {:.3} s wall over {} runs",
        times[times.len() / 2],
        times.len()
    );
}
