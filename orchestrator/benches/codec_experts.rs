//! What byte grouping + zstd saves on realistically quantized MXFP4 experts (issue 37):
//! `cargo bench -p k3-orch --bench codec_experts` builds one routed expert at the released
//! dimensions (gate and up 3072 x 7168, down 7168 x 3072) exactly as
//! `synth --weights gaussian` writes it (`tools::synth::gaussian_expert_planes`: the real
//! MXFP4 quantization of Gaussian groups), and prints, per zstd level, the stored share of
//! the codes plane, of the E8M0 scales plane and of both together, beside their order-0
//! entropy bounds, with the decode speed in GB/s of output on one core (4 MiB chunks of
//! codes, each with its groups' scales, as a pack would store them).
//! Indicative only on a loaded machine (lower bounds): docs/measurements.md says where the
//! numbers came from.

use std::time::Instant;

use k3_orch::tools::synth::{bits, gaussian_expert_planes};

/// Decoded bytes of codes per chunk (the trunk codec's chunk).
const CHUNK: usize = 4 << 20;
/// MXFP4 group: 16 bytes of codes per scale byte.
const CODES_PER_SCALE: usize = 16;

fn best_of<F: FnMut()>(runs: usize, mut f: F) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..runs {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// One plane cut in chunks: its stored share at `level` and its decode GB/s (one core).
fn measure(chunks: &[&[u8]], level: i32) -> (usize, f64, f64) {
    let t0 = Instant::now();
    let enc: Vec<Vec<u8>> = chunks
        .iter()
        .map(|c| zstd::bulk::compress(c, level).expect("zstd compress"))
        .collect();
    let enc_s = t0.elapsed().as_secs_f64();
    let stored: usize = enc.iter().map(Vec::len).sum();
    let raw: usize = chunks.iter().map(|c| c.len()).sum();
    let mut dec = zstd::bulk::Decompressor::new().expect("zstd context");
    let mut out = vec![0u8; CHUNK];
    let t = best_of(3, || {
        for (z, c) in enc.iter().zip(chunks) {
            let n = dec
                .decompress_to_buffer(z, &mut out[..c.len()])
                .expect("zstd decompress");
            assert_eq!(n, c.len());
        }
    });
    (stored, raw as f64 / t / 1e9, raw as f64 / enc_s / 1e6)
}

fn main() {
    let (mut codes, mut scales) = (Vec::new(), Vec::new());
    for (m, rows, fan_in) in [
        ("gate_proj", 3072, 7168),
        ("up_proj", 3072, 7168),
        ("down_proj", 7168, 3072),
    ] {
        let name = format!("language_model.model.layers.1.mlp.experts.0.{m}.weight");
        let (c, s) = gaussian_expert_planes(0, &name, rows, fan_in);
        codes.extend_from_slice(&c);
        scales.extend_from_slice(&s);
    }
    let (mut hn, mut hs) = ([0u64; 16], [0u64; 256]);
    for &b in &codes {
        hn[(b & 15) as usize] += 1;
        hn[(b >> 4) as usize] += 1;
    }
    for &b in &scales {
        hs[b as usize] += 1;
    }
    let (en, es) = (bits(&hn), bits(&hs));
    let total = codes.len() + scales.len();
    let bound = (codes.len() as f64 * en / 4.0 + scales.len() as f64 * es / 8.0) / total as f64;
    println!(
        "one released-size expert, synth --weights gaussian: codes {} MiB ({en:.3} bits per \
         nibble: order-0 bound {:.3}), scales {} KiB ({es:.3} bits per byte: bound {:.3}); \
         both: bound {bound:.3}",
        codes.len() >> 20,
        en / 4.0,
        scales.len() >> 10,
        es / 8.0
    );
    let cc: Vec<&[u8]> = codes.chunks(CHUNK).collect();
    let sc: Vec<&[u8]> = scales.chunks(CHUNK / CODES_PER_SCALE).collect();
    println!("| zstd level | codes stored/raw | codes decode GB/s | scales stored/raw | scales decode GB/s | both stored/raw | encode MB/s (codes) |");
    println!("|---|---|---|---|---|---|---|");
    for level in [1, 3, 19] {
        let (c, cgb, cenc) = measure(&cc, level);
        let (s, sgb, _) = measure(&sc, level);
        println!(
            "| {level} | {:.3} | {cgb:.2} | {:.3} | {sgb:.2} | {:.3} | {cenc:.0} |",
            c as f64 / codes.len() as f64,
            s as f64 / scales.len() as f64,
            (c + s) as f64 / total as f64
        );
    }
    // A finer grouping: each code byte's two 3-bit magnitudes in one plane (64 symbols),
    // its two sign bits packed four bytes to one and stored raw (signs are random).
    let mags: Vec<u8> = codes
        .iter()
        .map(|&b| (b & 7) | ((b >> 4) & 7) << 3)
        .collect();
    let signs = codes.len().div_ceil(4);
    let mc: Vec<&[u8]> = mags.chunks(CHUNK).collect();
    for level in [1, 19] {
        let (m, mgb, _) = measure(&mc, level);
        let (s, _, _) = measure(&sc, level);
        println!(
            "| {level}, codes as magnitudes + raw signs | {:.3} | {mgb:.2} (magnitudes only) | {:.3} | | {:.3} | |",
            (m + signs) as f64 / codes.len() as f64,
            s as f64 / scales.len() as f64,
            (m + signs + s) as f64 / total as f64
        );
    }
    let mut out = vec![0u8; CHUNK];
    let t = best_of(5, || {
        out.copy_from_slice(std::hint::black_box(&codes[..CHUNK]));
        std::hint::black_box(&mut out);
    });
    println!(
        "| memcpy of one chunk (the ceiling) | 1.000 | {:.2} | | | | |",
        CHUNK as f64 / t / 1e9
    );
}
