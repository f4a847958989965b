//! The MLA attention core (`src/kernels/mla.rs`): every path, batch and thread count against
//! the f64 reference, bit for bit.

use k3_layer_compute::kernels::mla::*;
use k3_layer_compute::kernels::simd::{self, Isa};

use crate::support::kernels_shared;

fn rng(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// A value in about ±`scale`; one in 32 subnormal, one in 32 a −0.
fn val(s: &mut u64, scale: f32) -> f32 {
    let r = rng(s);
    match r % 32 {
        0 => f32::from_bits((r >> 8) as u32 & 0x807F_FFFF),
        1 => -0.0,
        _ => ((r >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale,
    }
}

// Catches: a vector body that reorders a score's sum (dimension order, rope before
// nope), fuses the value mix's multiply with its add (w·v is not exact in f64), divides
// after mixing instead of per position, mixes positions out of order, mishandles the
// last partial pass of positions or the rope keys shared by the heads, reads another
// head's keys or values, or depends on the batch of queries, the thread count or the
// instruction set. The unrounded f64 outputs are compared (a last-bit difference in
// f64 rarely survives the rounding to f32); large scores (far positions' exp underflows
// to 0) and subnormal and −0 inputs included.
#[test]
fn vector_paths_equal_the_reference_bitwise() {
    // `attend` (the last check) runs on the installed instruction set.
    let _turn = kernels_shared();
    let mut s = 0x3a11_7e57_0000_0001u64;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let test = "mla::vector_paths_equal_the_reference_bitwise";
    let isas: Vec<Isa> = Isa::ALL
        .into_iter()
        .filter(|&i| i == Isa::Portable || simd::runnable(test, i))
        .collect();
    let dims = |heads, nope, rope, v| MlaDims {
        heads,
        nope,
        rope,
        v,
    };
    for (d, npos, scale) in [
        (dims(4, 24, 8, 16), 6, 1.0),
        (dims(3, 5, 3, 7), PB + 1, 4.0),
        (dims(5, 16, 4, 9), 2 * PB + 37, 30.0),
    ] {
        let qh = d.nope + d.rope;
        let kn: Vec<f32> = (0..npos * d.heads * d.nope)
            .map(|_| val(&mut s, scale))
            .collect();
        let v: Vec<f32> = (0..npos * d.heads * d.v)
            .map(|_| val(&mut s, 1.0))
            .collect();
        let kr: Vec<f32> = (0..npos * d.rope).map(|_| val(&mut s, scale)).collect();
        let cache = MlaCacheView {
            k_nope: &kn,
            v: &v,
            k_rope: &kr,
        };
        // Queries at every position (a prompt), plus the whole cache again.
        let lasts: Vec<usize> = (0..npos).chain([npos - 1]).collect();
        let qw = d.heads * qh;
        let qs: Vec<f32> = (0..lasts.len() * qw).map(|_| val(&mut s, scale)).collect();
        let ow = d.heads * d.v;
        let mut want = vec![0f64; lasts.len() * ow];
        for (k, &last) in lasts.iter().enumerate() {
            let (q, o) = (&qs[k * qw..(k + 1) * qw], &mut want[k * ow..(k + 1) * ow]);
            attend_reference64(d, q, &cache, last, o);
        }
        let same = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        for &isa in &isas {
            for threads in [1, 3] {
                let mut got = vec![0f64; lasts.len() * ow];
                pool.install(|| attend_batch64_on(isa, d, &qs, &lasts, &cache, &mut got, threads));
                assert!(same(&got, &want), "{isa:?} threads {threads} {d:?}");
                let mut rounded = vec![0f32; lasts.len() * ow];
                attend_batch_on(isa, d, &qs, &lasts, &cache, &mut rounded, threads);
                let bad = (0..rounded.len()).find(|&i| rounded[i] != want[i] as f32);
                assert!(bad.is_none(), "{isa:?} rounded, at {bad:?}");
            }
            // One query at a time (decode).
            for (k, &last) in lasts.iter().enumerate() {
                let mut one = vec![0f64; ow];
                let q = &qs[k * qw..(k + 1) * qw];
                attend_batch64_on(isa, d, q, &[last], &cache, &mut one, 1);
                let w = &want[k * ow..(k + 1) * ow];
                assert!(same(&one, w), "{isa:?} one query at {last}");
            }
        }
    }
    let mut o = [0f32; 16];
    let (kn, v, kr) = ([0.5f32; 24], [2.0f32; 16], [0.25f32; 8]);
    let one = MlaCacheView {
        k_nope: &kn,
        v: &v,
        k_rope: &kr,
    };
    attend(dims(1, 24, 8, 16), &[1.0; 32], &one, 0, &mut o);
    assert_eq!(o, [2.0; 16], "one position: its value");
}
