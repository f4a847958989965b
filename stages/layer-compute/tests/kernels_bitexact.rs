//! The product kernels' determinism contract, bit for bit: AVX-512 == AVX2 == portable
//! twin, batched == one token at a time, fused == separate, any thread count, MXFP4 ==
//! F32 of its dequantised matrix. Shapes cover partial groups (cols % 32 != 0), odd
//! MXFP4 column counts, several 1024-column blocks and row counts that leave remainders
//! after register blocking.

use k3_layer_compute::kernels::gemv::{gemm, gemm64, gemm_fused, gemm_on, gemv, Mat};
use k3_layer_compute::kernels::tuning::{self, KernelTuning, WeightStaging};
use k3_layer_compute::kernels::{mxfp4, simd, simd::Isa, simd::Kernel};

fn rng(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

fn randf(s: &mut u64) -> f32 {
    ((rng(s) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 3.0
}

struct Owned {
    fmt: &'static str,
    rows: usize,
    cols: usize,
    a: Vec<u8>,
    b: Vec<u8>,
}

impl Owned {
    fn new(fmt: &'static str, rows: usize, cols: usize, s: &mut u64) -> Self {
        let (a, b) = match fmt {
            "bf16" => (
                (0..rows * cols)
                    .flat_map(|_| ((randf(s).to_bits() >> 16) as u16).to_le_bytes())
                    .collect(),
                vec![],
            ),
            "f32" => (
                (0..rows * cols)
                    .flat_map(|_| randf(s).to_le_bytes())
                    .collect(),
                vec![],
            ),
            _ => (
                (0..rows * cols.div_ceil(2)).map(|_| rng(s) as u8).collect(),
                (0..rows * cols.div_ceil(32))
                    .map(|_| match rng(s) % 12 {
                        0 => 255,
                        1 => 0,
                        2 => 1,
                        _ => 110 + (rng(s) % 30) as u8,
                    })
                    .collect(),
            ),
        };
        Owned {
            fmt,
            rows,
            cols,
            a,
            b,
        }
    }
    fn mat(&self) -> Mat<'_> {
        match self.fmt {
            "bf16" => Mat::bf16(&self.a, self.rows, self.cols).unwrap(),
            "f32" => Mat::f32(&self.a, self.rows, self.cols).unwrap(),
            _ => Mat::mxfp4(&self.a, &self.b, self.rows, self.cols).unwrap(),
        }
    }
}

fn same(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

const SHAPES: [(usize, usize); 10] = [
    (1, 1),
    (3, 7),
    (5, 31),
    (4, 32),
    (7, 33),
    (9, 1023),
    (6, 1024),
    (11, 1057),
    (13, 2600),
    // Many batched row groups (AVX-512: 4 rows, the last one padded: 133 = 33 * 4 + 1),
    // an odd count (a single-row tile last) and a partial last group.
    (133, 1057),
];

// Catches: an AVX2 or AVX-512 kernel that reorders a sum, skips the f32→f64 promotion
// at a block edge, decodes a nibble or a partial group differently, or a register-blocked
// batch that differs from one token.
#[test]
fn simd_paths_match_portable_twin_bitwise() {
    let mut s = 0x1234_5678_9abc_def1u64;
    let paths = [Isa::Avx2, Isa::Avx512];
    // `gemm_on` runs a path the CPU lacks on the best one it has: say so, never silently.
    for p in paths {
        if simd::best_available() < p {
            eprintln!(
                "SKIPPED: simd_paths_match_portable_twin_bitwise[{}]: this CPU lacks it",
                p.name()
            );
        }
    }
    for fmt in ["bf16", "f32", "mxfp4"] {
        for &(rows, cols) in &SHAPES {
            let o = Owned::new(fmt, rows, cols, &mut s);
            let m = o.mat();
            // 37 tokens: three passes of the AVX-512 batched path (16 + 16 + 5 tokens,
            // the weights staged again for each).
            for ntok in [1usize, 2, 3, 4, 5, 9, 13, 16, 37] {
                let x: Vec<f32> = (0..ntok * cols).map(|_| randf(&mut s)).collect();
                let mut want = vec![0f32; ntok * rows];
                gemm_on(&Kernel::on(Isa::Portable), &m, &x, &mut want, ntok);
                for &p in &paths {
                    let mut got = vec![0f32; ntok * rows];
                    gemm_on(&Kernel::on(p), &m, &x, &mut got, ntok);
                    assert!(same(&got, &want), "{fmt} {rows}x{cols} ntok={ntok} {p:?}");
                }
                // Batched == one token at a time (on the portable path as well).
                for t in 0..ntok {
                    let mut one = vec![0f32; rows];
                    gemm_on(
                        &Kernel::on(Isa::Portable),
                        &m,
                        &x[t * cols..(t + 1) * cols],
                        &mut one,
                        1,
                    );
                    assert!(
                        same(&one, &want[t * rows..(t + 1) * rows]),
                        "{fmt} batch t={t}"
                    );
                }
            }
        }
    }
}

// Catches: an MXFP4 kernel whose weights are not exactly E2M1·2^(s−127) (or that treats
// the NaN scale differently from a zeroed group): it must equal the F32 product of the
// dequantised matrix bit for bit, on every path.
#[test]
fn mxfp4_equals_dequantised_f32_bitwise() {
    let mut s = 0xfeed_f00d_1234_5679u64;
    for &(rows, cols) in &SHAPES {
        let o = Owned::new("mxfp4", rows, cols, &mut s);
        let m = o.mat();
        let deq: Vec<u8> = mxfp4::dequantize(&o.a, &o.b, rows, cols)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mf = Mat::f32(&deq, rows, cols).unwrap();
        let ntok = 3;
        let x: Vec<f32> = (0..ntok * cols).map(|_| randf(&mut s)).collect();
        for p in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
            let (mut a, mut b) = (vec![0f32; ntok * rows], vec![0f32; ntok * rows]);
            gemm_on(&Kernel::on(p), &m, &x, &mut a, ntok);
            gemm_on(&Kernel::on(p), &mf, &x, &mut b, ntok);
            assert!(same(&a, &b), "{rows}x{cols} {p:?}");
        }
    }
}

// Catches: a fused product, a multi-threaded split or the f64-output variant that differs
// from the plain single-threaded product.
#[test]
fn fused_threads_and_f64_outputs_agree() {
    let mut s = 0x0bad_cafe_dead_beefu64;
    let cols = 1500;
    let mats: Vec<Owned> = [("bf16", 700), ("mxfp4", 333), ("bf16", 64), ("f32", 129)]
        .iter()
        .map(|&(f, r)| Owned::new(f, r, cols, &mut s))
        .collect();
    let ms: Vec<Mat<'_>> = mats.iter().map(|o| o.mat()).collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for ntok in [1usize, 6] {
        let x: Vec<f32> = (0..ntok * cols).map(|_| randf(&mut s)).collect();
        let singles: Vec<Vec<f32>> = ms
            .iter()
            .map(|m| {
                let mut y = vec![0f32; ntok * m.rows];
                gemm(m, &x, &mut y, ntok, 1);
                y
            })
            .collect();
        let mut fused: Vec<Vec<f32>> = ms.iter().map(|m| vec![0f32; ntok * m.rows]).collect();
        {
            let refs: Vec<&Mat<'_>> = ms.iter().collect();
            let mut outs: Vec<&mut [f32]> = fused.iter_mut().map(|v| &mut v[..]).collect();
            pool.install(|| gemm_fused(&refs, &x, &mut outs, ntok, 3));
        }
        for (i, m) in ms.iter().enumerate() {
            assert!(same(&fused[i], &singles[i]), "fused {i} ntok={ntok}");
            let mut y2 = vec![0f32; ntok * m.rows];
            pool.install(|| gemm(m, &x, &mut y2, ntok, 2));
            assert!(same(&y2, &singles[i]), "threads {i}");
            let mut y64 = vec![0f64; ntok * m.rows];
            gemm64(m, &x, &mut y64, ntok, 2);
            assert!(
                y64.iter()
                    .zip(&singles[i])
                    .all(|(a, b)| (*a as f32).to_bits() == b.to_bits()),
                "gemm64 {i}"
            );
            if ntok == 1 {
                let mut g = vec![0f32; m.rows];
                gemv(m, &x, &mut g, 2);
                assert!(same(&g, &singles[i]));
                for r in [0, m.rows / 2, m.rows - 1] {
                    assert_eq!(m.row_dot(r, &x).to_bits(), singles[i][r].to_bits());
                    assert_eq!(m.row_dot_portable(r, &x).to_bits(), singles[i][r].to_bits());
                }
            }
        }
    }
    // The process-wide switch still forces the portable path (and changes nothing).
    tuning::install(KernelTuning {
        max_isa: Some(Isa::Portable),
        ..KernelTuning::default()
    });
    assert_eq!(simd::isa(), Isa::Portable);
    let x: Vec<f32> = (0..cols).map(|_| randf(&mut s)).collect();
    let mut a = vec![0f32; ms[0].rows];
    gemv(&ms[0], &x, &mut a, 1);
    tuning::install(KernelTuning::default());
    let mut b = vec![0f32; ms[0].rows];
    gemv(&ms[0], &x, &mut b, 1);
    assert!(same(&a, &b));
}

// Catches: a contract change that breaks the documented error budget (gemv.rs module doc:
// |y − exact| ≤ 33·u32·Σ|w·x| + u32·|y|), e.g. f32 blocks much longer than 1024 columns or
// an f32 tree. Reports the worst observed error relative to Σ|w·x|.
#[test]
fn error_within_documented_budget() {
    let mut s = 0x5eed_0000_1111_2222u64;
    let (rows, cols) = (64, 7168);
    let o = Owned::new("bf16", rows, cols, &mut s);
    let m = o.mat();
    let x: Vec<f32> = (0..cols).map(|_| randf(&mut s)).collect();
    let mut y = vec![0f32; rows];
    gemv(&m, &x, &mut y, 1);
    let u32_ = 2f64.powi(-24);
    let mut worst = 0f64;
    for (r, &yr) in y.iter().enumerate() {
        let (mut exact, mut a) = (0f64, 0f64);
        for (c, &xc) in x.iter().enumerate() {
            let b = &o.a[2 * (r * cols + c)..];
            let w = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16) as f64;
            exact += w * xc as f64;
            a += (w * xc as f64).abs();
        }
        let err = (yr as f64 - exact).abs();
        assert!(
            err <= 33.0 * u32_ * a + u32_ * (yr as f64).abs(),
            "row {r}: {err} vs A {a}"
        );
        worst = worst.max(err / a);
    }
    println!("gemv bf16 {rows}x{cols}: worst |err|/Σ|w·x| = {worst:.2e} (budget 2.0e-6)");
}

// Catches: a one-token AVX-512 kernel whose row count per tile or compiled prefetch
// distance changes a result (a tile that skips or repeats a row, a remainder tile that
// reads the wrong row, a prefetch variant compiled with another lane order). Every tuning
// must equal the portable twin bit for bit; the tuning is process-wide, but no setting may
// change any result, so the other tests are unaffected whatever it is meanwhile.
#[test]
fn every_decode_tuning_matches_portable_bitwise() {
    if simd::best_available() < Isa::Avx512 {
        eprintln!("SKIPPED: every_decode_tuning_matches_portable_bitwise: no AVX-512");
        return;
    }
    let mut s = 0x5eed_0f7e_5700_1234_u64;
    for fmt in ["bf16", "f32", "mxfp4"] {
        // 29 rows: tiles of 8, 6, 4 and 2 all leave a remainder; 2100 columns: three
        // blocks, the last with a partial group.
        let o = Owned::new(fmt, 29, 2100, &mut s);
        let m = o.mat();
        let x: Vec<f32> = (0..m.cols).map(|_| randf(&mut s)).collect();
        let mut want = vec![0f32; m.rows];
        gemm_on(&Kernel::on(Isa::Portable), &m, &x, &mut want, 1);
        for rows in [2u8, 4, 6, 8] {
            for pf in [0u32, 256, 512, 1024, 2048, 4096] {
                let t = KernelTuning {
                    decode_rows: Some(rows),
                    decode_prefetch: Some(pf),
                    ..KernelTuning::default()
                };
                let mut got = vec![0f32; m.rows];
                gemm_on(&Kernel::with(Isa::Avx512, &t), &m, &x, &mut got, 1);
                assert!(same(&got, &want), "{fmt} rows {rows} pf {pf}");
            }
        }
    }
}

// Catches: a batched staging form that changes a result: a widened (f32) stage that
// splits a group into the wrong lanes, pads a partial group or a padded row with anything
// but zero, or a bf16-pair stage that rounds an MXFP4 weight. Both forms must equal the
// portable twin bit for bit, through partial groups and blocks, a padded last row group
// and a second token pass; the form is process-wide, but neither may change any result.
#[test]
fn both_batch_stagings_match_portable_bitwise() {
    if simd::best_available() < Isa::Avx512 {
        eprintln!("SKIPPED: both_batch_stagings_match_portable_bitwise: no AVX-512");
        return;
    }
    let mut s = 0x57a6_e0f3_2b1d_9c44_u64;
    for fmt in ["bf16", "f32", "mxfp4"] {
        for (rows, cols) in [(133usize, 1057usize), (29, 2100)] {
            let o = Owned::new(fmt, rows, cols, &mut s);
            let m = o.mat();
            for ntok in [5usize, 16, 37] {
                let x: Vec<f32> = (0..ntok * cols).map(|_| randf(&mut s)).collect();
                let mut want = vec![0f32; ntok * rows];
                gemm_on(&Kernel::on(Isa::Portable), &m, &x, &mut want, ntok);
                for form in [WeightStaging::Bf16, WeightStaging::F32] {
                    let t = KernelTuning {
                        weight_staging: Some(form),
                        ..KernelTuning::default()
                    };
                    let mut got = vec![0f32; ntok * rows];
                    gemm_on(&Kernel::with(Isa::Avx512, &t), &m, &x, &mut got, ntok);
                    assert!(
                        same(&got, &want),
                        "{fmt} {rows}x{cols} ntok={ntok} {form:?}"
                    );
                }
            }
        }
    }
}

// Catches: an MXFP4 weight that is not exactly a bf16 (the AVX-512 batched path stages
// MXFP4 groups as bf16 pairs, which is exact only if every E2M1 value times every E8M0
// scale has 16 zero low bits in f32): a wrong E8M0 table (a subnormal off by one bit) or
// a code table with a third mantissa bit would fail here before any product differs.
#[test]
fn every_mxfp4_weight_is_an_exact_bf16() {
    use k3_layer_compute::kernels::portable::E2M1_SCALED;
    for (s, row) in E2M1_SCALED.0.iter().enumerate() {
        for (c, w) in row.iter().enumerate() {
            assert_eq!(w.to_bits() & 0xFFFF, 0, "scale {s} code {c}: {w:e}");
        }
    }
}
