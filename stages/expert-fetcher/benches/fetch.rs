//! Benchmark: batch fetch of 16 experts of 17,547,264 bytes (one Kimi K3 routed expert) from
//! a generated file at queue depth 1 and 16, next to `devbw` on the same file in the same run,
//! so the fetcher's MB/s can be read as a fraction of what the device gives.
//!
//! `cargo bench -p k3-expert-fetcher --bench fetch [-- --experts N --batches B --seconds S]`
//! The file (N experts, 32 by default = 561 MB, starting at an unaligned offset like a
//! safetensors shard) is written to the system temp dir and deleted afterwards.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use k3_expert_fetcher::{BatchEvent, ExpertCacheConfig, ExpertExtents, ExpertFetcher, ExpertTable};
use k3_io::devbw;
use k3_io::DirectFiles;

const EXPERT: u64 = 17_547_264;
const HEADER: u64 = 20_600 + 8; // an unaligned start, like the seed's cache fixture

fn arg(name: &str, default: f64) -> f64 {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let n_experts = arg("--experts", 32.0) as u32;
    let batches = arg("--batches", 8.0) as usize;
    let seconds = arg("--seconds", 3.0);
    let n_experts = n_experts.max(32) / 16 * 16;

    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("experts.bin");
    {
        let mut f = std::fs::File::create(&path).expect("create");
        f.write_all(&vec![0u8; HEADER as usize]).unwrap();
        let mut buf = vec![0u8; EXPERT as usize];
        for e in 0..n_experts {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = (i as u32 ^ e.wrapping_mul(2_654_435_761)) as u8;
            }
            f.write_all(&buf).unwrap();
        }
        f.sync_all().unwrap();
    }
    let size = HEADER + n_experts as u64 * EXPERT;
    println!(
        "file: {} experts x {EXPERT} bytes = {:.0} MB at offset {HEADER} (unaligned)",
        n_experts,
        size as f64 / 1e6
    );

    let mut table = ExpertTable::new(vec![path.clone()]);
    for e in 0..n_experts {
        table.insert(
            0,
            e,
            ExpertExtents::contiguous(0, HEADER + e as u64 * EXPERT, EXPERT),
        );
    }
    let table = Arc::new(table);

    println!("\nfetch_batch: 16 experts per batch, 16 slots, every batch misses (disjoint sets)");
    println!(
        "{:<6}{:>9}{:>12}{:>12}{:>12}{:>10}",
        "QD", "BATCHES", "GB READ", "IO SECONDS", "MB/s", "ms/BATCH"
    );
    let mut fetch_mbps = Vec::new();
    for qd in [1usize, 16] {
        let files = Arc::new(DirectFiles::open(std::slice::from_ref(&path)).expect("open"));
        let mut f = ExpertFetcher::new(
            ExpertCacheConfig {
                slots: 16,
                slot_bytes: 0,
                readers: qd,
            },
            table.clone(),
            files.clone(),
        )
        .expect("fetcher");
        // Warm-up batch (first touch of the arena pages), not counted.
        let ids: Vec<u32> = (0..16).collect();
        f.fetch_batch(0, &ids, |_| {});
        let base = f.total_stats();
        let t0 = Instant::now();
        let mut x = 12345u32;
        for b in 0..batches {
            let group = ((b + 1) % (n_experts as usize / 16)) as u32;
            let mut ids: Vec<u32> = (group * 16..group * 16 + 16).collect();
            for i in (1..ids.len()).rev() {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                ids.swap(i, (x >> 8) as usize % (i + 1));
            }
            let mut failed = 0;
            f.fetch_batch(0, &ids, |ev| {
                if let BatchEvent::Failed(e) = ev {
                    eprintln!("{e}");
                    failed += 1;
                }
            });
            assert_eq!(failed, 0);
        }
        let wall = t0.elapsed().as_secs_f64();
        let s = f.total_stats();
        let bytes = s.bytes_read - base.bytes_read;
        let io = s.io_seconds - base.io_seconds;
        let mbps = bytes as f64 / 1e6 / io;
        fetch_mbps.push(mbps);
        println!(
            "{:<6}{:>9}{:>12.2}{:>12.2}{:>12.0}{:>10.1}{}",
            qd,
            batches,
            bytes as f64 / 1e9,
            io,
            mbps,
            1e3 * wall / batches as f64,
            if files.direct_in_use() {
                ""
            } else {
                "  (BUFFERED: O_DIRECT refused)"
            }
        );
    }

    println!("\ndevbw on the same file ({seconds} s per cell):");
    let mut dev = Vec::new();
    for (bytes, qd) in devbw::standard_cells() {
        dev.push(devbw::measure(&path, bytes, qd, seconds).expect("devbw"));
    }
    print!("{}", devbw::render(&path, &dev));
    let d1 = dev[2].mb_per_s();
    let d16 = dev[3].mb_per_s();
    println!(
        "\nfetch / devbw at expert size: QD1 {:.2}, QD16 {:.2}",
        fetch_mbps[0] / d1,
        fetch_mbps[1] / d16
    );
    drop(dir); // deletes the file
}
