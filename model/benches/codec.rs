//! The trunk codec on Gaussian BF16: `cargo bench -p k3-model --bench codec` prints, per
//! effort of the exponent plane's encoder (zstd levels 1, 3, 19 and the default fast
//! literals), the stored share of raw and the decode speed in GB/s
//! of BF16 output on one core (4 MiB chunks, as `pack-trunk --codec bf16-zstd` writes),
//! beside plain zstd on the interleaved bytes and the exponent plane's entropy.
//! Indicative only on a loaded machine: docs/measurements.md says where the numbers came
//! from.

use std::time::Instant;

use k3_model::codec::{byte_entropy, decode, encode_with, split, Codec, Effort};

/// Decoded bytes per chunk, as `pack-trunk --codec` writes them (its `CODEC_CHUNK`).
const CHUNK: usize = 4 << 20;

/// `n` BF16 values ~N(0, sigma) (xorshift + Box-Muller), little endian.
fn gaussian_bf16(n: usize, sigma: f64) -> Vec<u8> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut u = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut out = Vec::with_capacity(2 * n);
    while out.len() < 2 * n {
        let (a, b) = (u(), u());
        let r = (-2.0 * a.ln()).sqrt();
        for z in [
            r * (2.0 * std::f64::consts::PI * b).cos(),
            r * (2.0 * std::f64::consts::PI * b).sin(),
        ] {
            let f = (z * sigma) as f32;
            // Round to nearest even BF16.
            let bits = f.to_bits();
            let bf = ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
            out.extend_from_slice(&bf.to_le_bytes());
        }
    }
    out.truncate(2 * n);
    out
}

fn best_of<F: FnMut()>(runs: usize, mut f: F) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..runs {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    let raw = gaussian_bf16(32 << 20, 1.0 / 7168f64.sqrt());
    let (mut e, mut s) = (Vec::new(), Vec::new());
    split(&raw, &mut e, &mut s);
    println!(
        "gaussian BF16, sigma 1/sqrt(7168): {} MiB, exponent entropy {:.2} bits, sign+mantissa {:.2} bits",
        raw.len() >> 20,
        byte_entropy(&e),
        byte_entropy(&s)
    );
    let chunks: Vec<&[u8]> = raw.chunks(CHUNK).collect();
    let mut out = vec![0u8; CHUNK];
    println!("| codec | stored / raw | decode GB/s of BF16 (1 core) | encode MB/s |");
    println!("|---|---|---|---|");
    let efforts = [
        Effort::Level(1),
        Effort::Level(3),
        Effort::Level(19),
        Effort::Literals,
    ];
    for effort in efforts {
        let t0 = Instant::now();
        let enc: Vec<Vec<u8>> = chunks
            .iter()
            .map(|c| encode_with(Codec::Bf16Zstd, c, effort).unwrap())
            .collect();
        let enc_s = t0.elapsed().as_secs_f64();
        let stored: usize = enc.iter().map(Vec::len).sum();
        let t = best_of(3, || {
            for (z, c) in enc.iter().zip(&chunks) {
                decode(Codec::Bf16Zstd, z, &mut out[..c.len()]).unwrap();
            }
        });
        println!(
            "| bf16-zstd, {effort} | {:.4} | {:.2} | {:.0} |",
            stored as f64 / raw.len() as f64,
            raw.len() as f64 / t / 1e9,
            raw.len() as f64 / enc_s / 1e6
        );
    }
    let z: Vec<Vec<u8>> = chunks
        .iter()
        .map(|c| zstd::bulk::compress(c, 3).unwrap())
        .collect();
    let n: usize = z.iter().map(Vec::len).sum();
    let t = best_of(3, || {
        for x in &z {
            zstd::bulk::decompress_to_buffer(x, &mut out[..]).unwrap();
        }
    });
    println!(
        "| plain zstd level 3 on the interleaved bytes | {:.3} | {:.2} | |",
        n as f64 / raw.len() as f64,
        raw.len() as f64 / t / 1e9
    );
    let t = best_of(5, || {
        out.copy_from_slice(&raw[..CHUNK]);
    });
    println!(
        "| memcpy of one chunk (the ceiling) | 1.000 | {:.2} | |",
        CHUNK as f64 / t / 1e9
    );
}
