//! Probe: how fast a coded trunk's lm_head chunks decode in memory, with and without their
//! two CRC-32C checks, on N threads (the ceiling the streamed coded lm_head is measured
//! against; docs/measurements.md, "The coded lm_head").
//!
//!   cargo run --release -p k3-model --example head_decode_probe -- TRUNK_DIR [THREADS]
use k3_model::codec::{Codec, Decoder};
use k3_model::codec_trunk::{decode_chunk, Unit};
use k3_model::trunk::TrunkManifest;
use std::time::Instant;

fn main() {
    let dir = std::env::args().nth(1).unwrap();
    let threads: usize = std::env::args().nth(2).map_or(1, |s| s.parse().unwrap());
    let m = TrunkManifest::load_dir(&dir).unwrap();
    let h = m.codec.as_ref().unwrap().head.clone().unwrap();
    let n = 160.min(h.chunks.len());
    let bytes = std::fs::read(std::path::Path::new(&dir).join(&h.file)).unwrap();
    let raw_total: u64 = h.chunks[..n].iter().map(|c| c.raw).sum();
    for crc in [false, true] {
        let t = Instant::now();
        std::thread::scope(|s| {
            for tid in 0..threads {
                let (h, bytes) = (&h, &bytes);
                s.spawn(move || {
                    let mut dec = Decoder::new();
                    let mut out = vec![0u8; 4 << 20];
                    for k in (tid..n).step_by(threads) {
                        let ch = &h.chunks[k];
                        let st = &bytes[ch.offset as usize..(ch.offset + ch.stored) as usize];
                        let o = &mut out[..ch.raw as usize];
                        if crc {
                            decode_chunk(&mut dec, Codec::Bf16Zstd, Unit::Head, k, ch, st, o)
                                .unwrap();
                        } else {
                            dec.decode(Codec::Bf16Zstd, st, o).unwrap();
                        }
                    }
                });
            }
        });
        let s = t.elapsed().as_secs_f64();
        println!(
            "threads {threads} crc {crc}: {:.2} GB/s decoded",
            raw_total as f64 / s / 1e9
        );
    }
}
