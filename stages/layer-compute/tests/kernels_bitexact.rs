//! The product kernels' determinism contract, bit for bit: AVX-512 == AVX2 == portable
//! twin, batched == one token at a time, fused == separate, any thread count, MXFP4 ==
//! F32 of its dequantised matrix. Shapes cover partial groups (cols % 32 != 0), odd
//! MXFP4 column counts, several 1024-column blocks and row counts that leave remainders
//! after register blocking. Inputs include subnormal and −0 weights and activations, a
//! NaN and an infinite activation (in tokens of their own) and NaN and infinite weights
//! (in rows of their own), which must come out with the same bits on every path (a NaN
//! result as a NaN: its payload is not part of the contract).
//!
//! The `bf16x3` path the same way: its AVX512-BF16 kernel against its portable twin on
//! the same inputs plus adversarial ones (parts below 2^-126, huge exponents, exact
//! cancellation, every MXFP4 scale byte), one token against batched, threads and fusion,
//! and its error budget.
//!
//! An instruction set the CPU lacks is reported (`SKIPPED:`, [`simd::runnable`]), never
//! replaced by another; under `K3_REQUIRE_SIMD` (CI) the test fails instead. Tests that
//! run products on the installed kernels hold `support::kernels_lock` (one of them installs the
//! `bf16x3` path, which changes results).

use k3_layer_compute::kernels::matmul::{gemm, gemm64, gemm_fused, gemm_on, gemv, Mat};
use k3_layer_compute::kernels::tuning::{self, KernelTuning, WeightStaging};
use k3_layer_compute::kernels::{mxfp4, simd, simd::Isa, simd::Kernel, simd::ProductPath};

use crate::support::{cap_isa, kernels_lock, kernels_shared};

fn rng(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

fn randf(s: &mut u64) -> f32 {
    ((rng(s) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 3.0
}

/// A subnormal f32 of either sign.
fn subnormal(s: &mut u64) -> f32 {
    let r = rng(s) as u32;
    f32::from_bits((r & 0x007F_FFFF).max(1) | (r & 0x8000_0000))
}

/// `ntok` tokens of `cols` activations: random, with one value in 16 subnormal and one in
/// 16 a −0; token 1 holds a NaN and token 2 a −∞ (the other tokens stay finite, so they
/// still see every reordering).
fn activations(ntok: usize, cols: usize, s: &mut u64) -> Vec<f32> {
    let mut x: Vec<f32> = (0..ntok * cols)
        .map(|_| match rng(s) % 16 {
            0 => subnormal(s),
            1 => -0.0,
            _ => randf(s),
        })
        .collect();
    if ntok > 1 {
        x[cols + cols / 2] = f32::from_bits(0x7FC0_1234);
    }
    if ntok > 2 {
        x[2 * cols + cols / 3] = f32::NEG_INFINITY;
    }
    x
}

/// The instruction sets `test` compares with the portable twin: those the CPU has (the
/// others reported as skipped, or failing under `K3_REQUIRE_SIMD`).
fn simd_isas(test: &str) -> Vec<Isa> {
    [Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|&i| simd::runnable(test, i))
        .collect()
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
    /// [`Owned::new`] with special weights: one in 16 subnormal and one in 16 a −0
    /// (BF16, F32; MXFP4 has scale bytes 0 and 255 already), and, with 3 rows or more, a
    /// +∞ in row 1 and a NaN in row 2.
    fn special(fmt: &'static str, rows: usize, cols: usize, s: &mut u64) -> Self {
        let mut o = Owned::new(fmt, rows, cols, s);
        let put = |a: &mut Vec<u8>, i: usize, v: f32| match fmt {
            "bf16" => {
                a[2 * i..2 * i + 2].copy_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes())
            }
            _ => a[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
        };
        if fmt == "mxfp4" {
            return o;
        }
        for i in 0..rows * cols {
            match rng(s) % 16 {
                // A bf16 subnormal: the top half of an f32 whose exponent bits are 0.
                0 => put(
                    &mut o.a,
                    i,
                    f32::from_bits(subnormal(s).to_bits() | 0x0001_0000),
                ),
                1 => put(&mut o.a, i, -0.0),
                _ => {}
            }
        }
        if rows >= 3 {
            put(&mut o.a, cols, f32::INFINITY);
            put(&mut o.a, 2 * cols + cols / 2, f32::from_bits(0xFFC5_0000));
        }
        o
    }

    fn mat(&self) -> Mat<'_> {
        match self.fmt {
            "bf16" => Mat::bf16(&self.a, self.rows, self.cols).unwrap(),
            "f32" => Mat::f32(&self.a, self.rows, self.cols).unwrap(),
            _ => Mat::mxfp4(&self.a, &self.b, self.rows, self.cols).unwrap(),
        }
    }
}

/// `got` and `want` have the same length (not zero) and the same bits everywhere, except
/// that a NaN matches any NaN: which NaN an operation passes on (payload, sign) depends on
/// its operands' order, which differs between the paths' fused multiply-adds, so the
/// contract only says a NaN result is NaN on every path (see the reduction contract).
fn assert_same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(!got.is_empty(), "{what}: nothing to compare");
    let differ =
        |i: usize| got[i].to_bits() != want[i].to_bits() && !(got[i].is_nan() && want[i].is_nan());
    if let Some(i) = (0..got.len()).find(|&i| differ(i)) {
        panic!(
            "{what}: differs at [{i}]: {} vs {} (bits {:#010x} vs {:#010x})",
            got[i],
            want[i],
            got[i].to_bits(),
            want[i].to_bits()
        );
    }
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
    let _kernels = kernels_shared();
    let mut s = 0x1234_5678_9abc_def1u64;
    let paths = simd_isas("simd_paths_match_portable_twin_bitwise");
    // Results that are NaN, infinite, subnormal: the special inputs must reach them.
    let mut seen = [0usize; 3];
    for fmt in ["bf16", "f32", "mxfp4"] {
        for &(rows, cols) in &SHAPES {
            let o = Owned::special(fmt, rows, cols, &mut s);
            let m = o.mat();
            // 2 to 8 tokens: every few-token tile of AVX-512 (rows_few, and rows_small's
            // pairs with an odd last token). 37 tokens: three passes of the AVX-512
            // batched path (16 + 16 + 5 tokens, the weights staged again for each).
            for ntok in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 37] {
                let x = activations(ntok, cols, &mut s);
                let mut want = vec![0f32; ntok * rows];
                gemm_on(&Kernel::on(Isa::Portable), &m, &x, &mut want, ntok);
                seen[0] += want.iter().filter(|v| v.is_nan()).count();
                seen[1] += want.iter().filter(|v| v.is_infinite()).count();
                seen[2] += want.iter().filter(|v| v.is_subnormal()).count();
                for &p in &paths {
                    let mut got = vec![0f32; ntok * rows];
                    gemm_on(&Kernel::on(p), &m, &x, &mut got, ntok);
                    assert_same(
                        &format!("{fmt} {rows}x{cols} ntok={ntok} {p:?}"),
                        &got,
                        &want,
                    );
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
                    let what = format!("{fmt} {rows}x{cols} batch t={t}");
                    assert_same(&what, &one, &want[t * rows..(t + 1) * rows]);
                }
            }
        }
    }
    let [nan, inf, sub] = seen;
    assert!(
        nan > 0 && inf > 0 && sub > 0,
        "NaN {nan}, ±∞ {inf}, subnormal {sub} results"
    );
}

// Catches: a comparison that passes when one side is empty or shorter (`zip(..).all(..)`,
// the helper this file had), that takes −0 for +0, or that tells NaNs apart by payload.
#[test]
fn assert_same_checks_length_bits_and_nans() {
    let _kernels = kernels_shared();
    let fails = |a: &'static [f32], b: &'static [f32]| {
        std::panic::catch_unwind(|| assert_same("x", a, b)).is_err()
    };
    assert!(fails(&[], &[1.0]), "length");
    assert!(fails(&[1.0], &[1.0, 2.0]), "length");
    assert!(fails(&[], &[]), "empty");
    assert!(fails(&[1.0, -0.0], &[1.0, 0.0]), "sign of zero");
    assert!(fails(&[f32::NAN], &[1.0]), "NaN against a number");
    assert!(
        !fails(&[1.0, f32::NAN], &[1.0, -f32::NAN]),
        "NaN against NaN"
    );
}

// Catches: an MXFP4 kernel whose weights are not exactly E2M1·2^(s−127) (or that treats
// the NaN scale differently from a zeroed group): it must equal the F32 product of the
// dequantised matrix bit for bit, on every path.
#[test]
fn mxfp4_equals_dequantised_f32_bitwise() {
    let _kernels = kernels_shared();
    let mut s = 0xfeed_f00d_1234_5679u64;
    let mut paths = vec![Isa::Portable];
    paths.extend(simd_isas("mxfp4_equals_dequantised_f32_bitwise"));
    for &(rows, cols) in &SHAPES {
        let o = Owned::new("mxfp4", rows, cols, &mut s);
        let m = o.mat();
        let deq: Vec<u8> = mxfp4::dequantize(&o.a, &o.b, rows, cols)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mf = Mat::f32(&deq, rows, cols).unwrap();
        let ntok = 3;
        let x = activations(ntok, cols, &mut s);
        for &p in &paths {
            let (mut a, mut b) = (vec![0f32; ntok * rows], vec![0f32; ntok * rows]);
            gemm_on(&Kernel::on(p), &m, &x, &mut a, ntok);
            gemm_on(&Kernel::on(p), &mf, &x, &mut b, ntok);
            assert_same(&format!("{rows}x{cols} {p:?}"), &a, &b);
        }
    }
}

// Catches: a fused product, a multi-threaded split or the f64-output variant that differs
// from the plain single-threaded product.
#[test]
fn fused_threads_and_f64_outputs_agree() {
    let _installed = kernels_lock();
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
            assert_same(&format!("fused {i} ntok={ntok}"), &fused[i], &singles[i]);
            let mut y2 = vec![0f32; ntok * m.rows];
            pool.install(|| gemm(m, &x, &mut y2, ntok, 2));
            assert_same(&format!("threads {i}"), &y2, &singles[i]);
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
                assert_same(&format!("gemv {i}"), &g, &singles[i]);
                for r in [0, m.rows / 2, m.rows - 1] {
                    assert_eq!(m.row_dot(r, &x).to_bits(), singles[i][r].to_bits());
                    assert_eq!(m.row_dot_portable(r, &x).to_bits(), singles[i][r].to_bits());
                }
            }
        }
    }
    // The process-wide switch still forces the portable path (and changes nothing). The
    // cap is taken in turn with the other capping tests of this binary.
    let cap = cap_isa(Isa::Portable);
    assert_eq!(simd::isa(), Isa::Portable);
    let x: Vec<f32> = (0..cols).map(|_| randf(&mut s)).collect();
    let mut a = vec![0f32; ms[0].rows];
    gemv(&ms[0], &x, &mut a, 1);
    drop(cap);
    let mut b = vec![0f32; ms[0].rows];
    gemv(&ms[0], &x, &mut b, 1);
    assert_same("forced portable", &a, &b);
}

// Catches: a contract change that breaks the documented error budget (matmul.rs module doc:
// |y − exact| ≤ 33·u32·Σ|w·x| + u32·|y|, the same for bf16x3: bf16x3.rs), e.g. f32 blocks
// much longer than 1024 columns (512 on bf16x3), an f32 tree, or a bf16x3 split that is not
// exact. Reports the worst observed error relative to Σ|w·x| on each path.
#[test]
fn error_within_documented_budget() {
    let _kernels = kernels_shared();
    let mut s = 0x5eed_0000_1111_2222u64;
    let (rows, cols) = (64, 7168);
    let o = Owned::new("bf16", rows, cols, &mut s);
    let m = o.mat();
    let x: Vec<f32> = (0..cols).map(|_| randf(&mut s)).collect();
    let hw = simd::runnable_path("error_within_documented_budget", ProductPath::Bf16x3);
    let bf16x3 = if hw { Isa::Avx512 } else { Isa::Portable };
    for k in [
        Kernel::on(simd::best_available()),
        Kernel::on_path(ProductPath::Bf16x3, bf16x3),
    ] {
        let mut y = vec![0f32; rows];
        gemm_on(&k, &m, &x, &mut y, 1);
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
                "{} row {r}: {err} vs A {a}",
                k.name()
            );
            worst = worst.max(err / a);
        }
        println!(
            "{} bf16 {rows}x{cols}: worst |err|/Σ|w·x| = {worst:.2e} (budget 2.0e-6)",
            k.name()
        );
    }
}

// Catches: a one-token AVX-512 kernel whose row count per tile or compiled prefetch
// distance changes a result (a tile that skips or repeats a row, a remainder tile that
// reads the wrong row, a prefetch variant compiled with another lane order). Every tuning
// must equal the portable twin bit for bit (each passed explicitly: `Kernel::with`).
#[test]
fn every_decode_tuning_matches_portable_bitwise() {
    let _kernels = kernels_shared();
    if !simd::runnable("every_decode_tuning_matches_portable_bitwise", Isa::Avx512) {
        return;
    }
    let mut s = 0x5eed_0f7e_5700_1234_u64;
    for fmt in ["bf16", "f32", "mxfp4"] {
        // 29 rows: tiles of 8, 6, 4 and 2 all leave a remainder; 2100 columns: three
        // blocks, the last with a partial group.
        let o = Owned::special(fmt, 29, 2100, &mut s);
        let m = o.mat();
        let x = activations(1, m.cols, &mut s);
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
                assert_same(&format!("{fmt} rows {rows} pf {pf}"), &got, &want);
            }
        }
    }
}

// Catches: a batched staging form that changes a result: a widened (f32) stage that
// splits a group into the wrong lanes, pads a partial group or a padded row with anything
// but zero, or a bf16-pair stage that rounds an MXFP4 weight. Both forms must equal the
// portable twin bit for bit, through partial groups and blocks, a padded last row group
// and a second token pass (each form passed explicitly: `Kernel::with`). The wide shape
// (17 000 columns: 16 tokens' activations pass 1 MiB) takes AVX-512's blocks-outermost
// pass for its 16-token passes and the row-groups-outermost one for the rest: catches a
// blocks-outermost pass that mixes up two row groups' or tokens' lane sums, drops the
// padded row group's or the partial group's weights, or promotes at a wrong block edge.
// With bf16 staging, BF16 and F32 take no stage at all but in-place passes of up to 16
// tokens (37 = 16 + 16 + 5; 17 = 16 + 1, a last pass of one token): catches a pass that
// writes its sums at the wrong row stride or token offset, or reads the wrong tokens.
#[test]
fn both_batch_stagings_match_portable_bitwise() {
    let _kernels = kernels_shared();
    if !simd::runnable("both_batch_stagings_match_portable_bitwise", Isa::Avx512) {
        return;
    }
    let mut s = 0x57a6_e0f3_2b1d_9c44_u64;
    for fmt in ["bf16", "f32", "mxfp4"] {
        for (rows, cols) in [(133usize, 1057usize), (29, 2100), (9, 17000)] {
            let o = Owned::special(fmt, rows, cols, &mut s);
            let m = o.mat();
            for ntok in [5usize, 9, 16, 17, 37] {
                let x = activations(ntok, cols, &mut s);
                let mut want = vec![0f32; ntok * rows];
                gemm_on(&Kernel::on(Isa::Portable), &m, &x, &mut want, ntok);
                for form in [WeightStaging::Bf16, WeightStaging::F32] {
                    let t = KernelTuning {
                        weight_staging: Some(form),
                        ..KernelTuning::default()
                    };
                    let mut got = vec![0f32; ntok * rows];
                    gemm_on(&Kernel::with(Isa::Avx512, &t), &m, &x, &mut got, ntok);
                    let what = format!("{fmt} {rows}x{cols} ntok={ntok} {form:?}");
                    assert_same(&what, &got, &want);
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
    let _kernels = kernels_shared();
    use k3_layer_compute::kernels::portable::E2M1_SCALED;
    for (s, row) in E2M1_SCALED.0.iter().enumerate() {
        for (c, w) in row.iter().enumerate() {
            assert_eq!(w.to_bits() & 0xFFFF, 0, "scale {s} code {c}: {w:e}");
        }
    }
}

/// The bf16x3 kernels this host compares: the portable twin (the reference) and, where the
/// CPU has it, the AVX512-BF16 kernel (else `SKIPPED:`, or a failure under
/// `K3_REQUIRE_SIMD=bf16x3`).
fn bf16x3_kernels(test: &str) -> (Kernel, Option<Kernel>) {
    let twin = Kernel::on_path(ProductPath::Bf16x3, Isa::Portable);
    let hw = simd::runnable_path(test, ProductPath::Bf16x3)
        .then(|| Kernel::on_path(ProductPath::Bf16x3, Isa::Avx512));
    (twin, hw)
}

/// Activations that try the split: [`activations`] plus, in token 3 on, values whose mid
/// and lo parts (or all three) fall below 2^-126, huge values (about 2^120, whose products
/// with the huge weights overflow), and exact cancellations (a value next to its negation).
fn adversarial(ntok: usize, cols: usize, s: &mut u64) -> Vec<f32> {
    let mut x = activations(ntok, cols, s);
    for t in 3..ntok {
        for c in 0..cols {
            let prev = if c > 0 { x[t * cols + c - 1] } else { 1.0 };
            let v = &mut x[t * cols + c];
            *v = match rng(s) % 8 {
                // Below about 2^-101: mid and lo (or more) below 2^-126.
                0 => f32::from_bits((rng(s) as u32 & 0x80FF_FFFF) | 0x0080_0000),
                // About 2^-4 .. 2^124 (exponent 0x7B << 1 | bit): huge against huge weights.
                1 => f32::from_bits((rng(s) as u32 & 0x807F_FFFF) | (0xFB << 23)),
                2 => -prev,
                _ => *v,
            };
        }
    }
    x
}

/// [`Owned::special`] plus, for BF16 and F32, a row of huge weights (about 2^120) and a
/// row of weights paired for cancellation (w, -w on consecutive columns).
fn adversarial_weights(fmt: &'static str, rows: usize, cols: usize, s: &mut u64) -> Owned {
    let mut o = Owned::special(fmt, rows, cols, s);
    if fmt == "mxfp4" || rows < 5 {
        return o;
    }
    let put = |a: &mut Vec<u8>, i: usize, v: f32| match fmt {
        "bf16" => a[2 * i..2 * i + 2].copy_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes()),
        _ => a[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
    };
    for c in 0..cols {
        let huge = f32::from_bits((rng(s) as u32 & 0x807F_0000) | (0xF7 << 23));
        put(&mut o.a, 3 * cols + c, huge);
        let w = randf(s);
        put(&mut o.a, 4 * cols + c, if c % 2 == 1 { -w } else { w });
    }
    o
}

const BF16X3_SHAPES: [(usize, usize); 11] = [
    (1, 1),
    (3, 7),
    (5, 31),
    (4, 32),
    (7, 33),
    (6, 511),
    (9, 512),
    (6, 513),
    (11, 1057),
    // 5 blocks, the last partial; 4-row groups and 2- and 1-row tiles left over.
    (13, 2600),
    (133, 1057),
];

// Catches: an AVX512-BF16 kernel that is not its twin bit for bit: a pair taken in the
// wrong order, a part dropped or multiplied twice, the hi and small accumulators mixed, a
// promotion at the wrong block edge (512 columns), a tile that reads another row or token,
// an MXFP4 nibble or an F32 split decoded differently, a partial group padded with
// anything but zeros. And a batch that differs from one token at a time on either.
#[test]
fn bf16x3_kernel_matches_portable_twin_bitwise() {
    let _kernels = kernels_shared();
    let mut s = 0xbf16_0003_7a11_c0deu64;
    let (twin, hw) = bf16x3_kernels("bf16x3_kernel_matches_portable_twin_bitwise");
    let mut seen = [0usize; 3];
    for fmt in ["bf16", "f32", "mxfp4"] {
        for &(rows, cols) in &BF16X3_SHAPES {
            let o = adversarial_weights(fmt, rows, cols, &mut s);
            let m = o.mat();
            // 1, 2, 3 tokens read in place; 4 on staged; 37: three passes (16 + 16 + 5).
            for ntok in [1usize, 2, 3, 4, 5, 7, 16, 37] {
                let x = adversarial(ntok, cols, &mut s);
                let mut want = vec![0f32; ntok * rows];
                gemm_on(&twin, &m, &x, &mut want, ntok);
                seen[0] += want.iter().filter(|v| v.is_nan()).count();
                seen[1] += want.iter().filter(|v| v.is_infinite()).count();
                seen[2] += want.iter().filter(|v| **v == 0.0).count();
                if let Some(hw) = &hw {
                    let mut got = vec![0f32; ntok * rows];
                    gemm_on(hw, &m, &x, &mut got, ntok);
                    assert_same(&format!("{fmt} {rows}x{cols} ntok={ntok}"), &got, &want);
                }
                for t in 0..ntok {
                    let xt = &x[t * cols..(t + 1) * cols];
                    for k in [Some(&twin), hw.as_ref()].into_iter().flatten() {
                        let mut one = vec![0f32; rows];
                        gemm_on(k, &m, xt, &mut one, 1);
                        let what = format!("{fmt} {rows}x{cols} {} batch t={t}", k.name());
                        assert_same(&what, &one, &want[t * rows..(t + 1) * rows]);
                    }
                }
            }
        }
    }
    let [nan, inf, zero] = seen;
    assert!(
        nan > 0 && inf > 0 && zero > 0,
        "NaN {nan}, ±∞ {inf}, zero {zero} results"
    );
}

// Catches: an MXFP4 decode that differs from the twin's for some scale byte (the bf16
// table, a `vpermw` index whose fifth bit picks another entry, the subnormal weights of
// scale bytes 0 and 1 that the hardware reads as zero, the overflowing ones of 253 and 254,
// the zeroed groups of 255) or some code; and an MXFP4 product on bf16x3 that is not the
// F32 product of its dequantised matrix's weights taken as one exact bf16 part (so the
// MXFP4 and F32 paths agree where the F32 weights are exact bf16).
#[test]
fn bf16x3_every_mxfp4_scale_byte_and_code() {
    let _kernels = kernels_shared();
    let (twin, hw) = bf16x3_kernels("bf16x3_every_mxfp4_scale_byte_and_code");
    let mut s = 0x5ca1_eb7e_0000_00ffu64;
    // 256 rows × 64 columns: row r has scale byte r in both groups, every code in each.
    let (rows, cols) = (256usize, 64usize);
    let mut packed = vec![0u8; rows * cols / 2];
    let scales: Vec<u8> = (0..rows).flat_map(|r| [r as u8, r as u8]).collect();
    for (i, b) in packed.iter_mut().enumerate() {
        let c = (i % 8) as u8 * 2;
        *b = c | (c + 1) << 4;
        if i % 32 >= 16 {
            *b = rng(&mut s) as u8;
        }
    }
    let m = Mat::mxfp4(&packed, &scales, rows, cols).unwrap();
    for ntok in [1usize, 3, 6] {
        let x = adversarial(ntok, cols, &mut s);
        let mut want = vec![0f32; ntok * rows];
        gemm_on(&twin, &m, &x, &mut want, ntok);
        if let Some(hw) = &hw {
            let mut got = vec![0f32; ntok * rows];
            gemm_on(hw, &m, &x, &mut got, ntok);
            assert_same(&format!("mxfp4 every scale ntok={ntok}"), &got, &want);
        }
        // Scale bytes 2..=252: every weight a normal bf16 or zero, so the product equals
        // the BF16 product of the dequantised matrix (one part, the same steps).
        let deq = mxfp4::dequantize(&packed, &scales, rows, cols);
        let bf: Vec<u8> = deq
            .iter()
            .flat_map(|w| ((w.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        let mb = Mat::bf16(&bf, rows, cols).unwrap();
        let mut via_bf16 = vec![0f32; ntok * rows];
        gemm_on(&twin, &mb, &x, &mut via_bf16, ntok);
        for t in 0..ntok {
            let r = 2..253;
            let what = format!("mxfp4 vs bf16 t={t}");
            let at = |v: &[f32]| v[t * rows + r.start..t * rows + r.end].to_vec();
            assert_same(&what, &at(&want), &at(&via_bf16));
        }
    }
}

// Catches: a bf16x3 product whose result depends on the thread count, on fusion, on the
// f64-output variant or on batching, through the installed kernels (gemm, gemm_fused,
// gemv); and an installed product path that the products do not follow.
#[test]
fn bf16x3_threads_fusion_and_batching_do_not_change_bits() {
    let _installed = kernels_lock();
    let (twin, hw) = bf16x3_kernels("bf16x3_threads_fusion_and_batching_do_not_change_bits");
    installed_bf16x3_consistent(hw.unwrap_or(twin));
}

// Catches: the same on the AMX kernel (its tasks are whole row tile pairs, so a thread
// split moves rows between tiles), and an installed `bf16x3` path that does not run on
// AMX where the CPU has it.
#[test]
fn amx_threads_fusion_and_batching_do_not_change_bits() {
    let _installed = kernels_lock();
    if let Some(k) = amx_kernel("amx_threads_fusion_and_batching_do_not_change_bits") {
        installed_bf16x3_consistent(k);
    }
}

/// Install `kernel`'s `bf16x3` (AMX or not) and check the installed products against it.
fn installed_bf16x3_consistent(kernel: Kernel) {
    let mut s = 0x7b4e_adf0_0000_3333u64;
    let cols = 1500;
    let mats: Vec<Owned> = [("bf16", 700), ("mxfp4", 333), ("f32", 129)]
        .iter()
        .map(|&(f, r)| Owned::new(f, r, cols, &mut s))
        .collect();
    let ms: Vec<Mat<'_>> = mats.iter().map(|o| o.mat()).collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    /// Puts the default tuning back, also when an assertion fails.
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            tuning::install(KernelTuning::default());
        }
    }
    let _restore = Restore;
    tuning::install(KernelTuning {
        product: Some(ProductPath::Bf16x3),
        max_isa: (kernel.isa() == Isa::Portable).then_some(Isa::Portable),
        amx: Some(kernel.on_amx()),
        ..KernelTuning::default()
    });
    let current = Kernel::current();
    {
        assert_eq!(current.name(), kernel.name());
        for ntok in [1usize, 6] {
            let x: Vec<f32> = (0..ntok * cols).map(|_| randf(&mut s)).collect();
            let mut fused: Vec<Vec<f32>> = ms.iter().map(|m| vec![0f32; ntok * m.rows]).collect();
            {
                let refs: Vec<&Mat<'_>> = ms.iter().collect();
                let mut outs: Vec<&mut [f32]> = fused.iter_mut().map(|v| &mut v[..]).collect();
                pool.install(|| gemm_fused(&refs, &x, &mut outs, ntok, 3));
            }
            for (i, m) in ms.iter().enumerate() {
                let mut want = vec![0f32; ntok * m.rows];
                gemm_on(&kernel, m, &x, &mut want, ntok);
                assert_same(&format!("fused {i} ntok={ntok}"), &fused[i], &want);
                let mut y2 = vec![0f32; ntok * m.rows];
                pool.install(|| gemm(m, &x, &mut y2, ntok, 2));
                assert_same(&format!("threads {i} ntok={ntok}"), &y2, &want);
                let mut y64 = vec![0f64; ntok * m.rows];
                gemm64(m, &x, &mut y64, ntok, 2);
                let y64: Vec<f32> = y64.iter().map(|v| *v as f32).collect();
                assert_same(&format!("gemm64 {i} ntok={ntok}"), &y64, &want);
                for t in 0..ntok {
                    let mut g = vec![0f32; m.rows];
                    pool.install(|| gemv(m, &x[t * cols..(t + 1) * cols], &mut g, 2));
                    let what = format!("gemv {i} t={t}");
                    assert_same(&what, &g, &want[t * m.rows..(t + 1) * m.rows]);
                }
            }
        }
    }
}

/// The `bf16x3` AMX kernel where this host has it (else `SKIPPED:`, or a failure under
/// `K3_REQUIRE_SIMD=amx`). It has no portable twin (the tile unit's order inside a step
/// follows no scalar model): its tests are its error budget and its own bits across
/// shapes.
fn amx_kernel(test: &str) -> Option<Kernel> {
    simd::runnable_amx(test).then(|| Kernel::amx(&KernelTuning::default()))
}

/// Row `r` of `o` as f64 weights in column order (MXFP4 dequantised).
fn weights_f64(o: &Owned) -> Vec<f64> {
    match o.fmt {
        "bf16" => {
            o.a.chunks_exact(2)
                .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16) as f64)
                .collect()
        }
        "f32" => {
            o.a.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
                .collect()
        }
        _ => mxfp4::dequantize(&o.a, &o.b, o.rows, o.cols)
            .iter()
            .map(|&v| v as f64)
            .collect(),
    }
}

// Catches: an AMX kernel that pairs a weight column with the wrong activation column
// (even and odd halves of a pair swapped, a part in another token's column), drops or
// repeats a weight part or an activation part (the split's mid and lo are 2^-8 and 2^-16
// of hi: a lost part is far outside the budget), decodes a nibble or a partial group
// wrongly, or zero-pads with garbage. Every format, 2100 columns (one whole 2048-column
// block and a partial one, the last group partial), 37 rows (a lone row tile last), 1, 3
// and 7 tokens.
#[test]
fn amx_within_error_budget() {
    let _kernels = kernels_shared();
    let Some(k) = amx_kernel("amx_within_error_budget") else {
        return;
    };
    let mut s = 0x0a3c_5eed_0000_7777u64;
    let u32_ = 2f64.powi(-24);
    for fmt in ["bf16", "mxfp4", "f32"] {
        let (rows, cols) = (37, 2100);
        let o = Owned::new(fmt, rows, cols, &mut s);
        let w = weights_f64(&o);
        for ntok in [1usize, 3, 7] {
            let x: Vec<f32> = (0..ntok * cols).map(|_| randf(&mut s)).collect();
            let mut y = vec![0f32; ntok * rows];
            gemm_on(&k, &o.mat(), &x, &mut y, ntok);
            let mut worst = 0f64;
            for t in 0..ntok {
                for r in 0..rows {
                    let (mut exact, mut a) = (0f64, 0f64);
                    for c in 0..cols {
                        let p = w[r * cols + c] * x[t * cols + c] as f64;
                        exact += p;
                        a += p.abs();
                    }
                    let yr = y[t * rows + r] as f64;
                    let err = (yr - exact).abs();
                    assert!(
                        err <= 33.0 * u32_ * a + u32_ * yr.abs(),
                        "{fmt} ntok {ntok} token {t} row {r}: {yr} vs {exact} (A {a})"
                    );
                    worst = worst.max(err / a.max(f64::MIN_POSITIVE));
                }
            }
            println!("amx {fmt} ntok {ntok}: worst |err|/Σ|w·x| = {worst:.2e} (budget 2.0e-6)");
        }
    }
}

// Catches: an AMX result that depends on where its row or token sits in a tile (a row
// tile, the second of a pair, the width of the activation tile: 3 columns for one token,
// 16 from six on, a token's parts split over two tiles), on the other rows or tokens of
// the batch, or on a task's first row; a promotion that takes a part from the wrong
// column or token (45 tokens: nine tiles, the chunk's stored sums promoted after six and
// after the ninth, odd one; 3 and 5 tokens: one narrow tile, whose MXFP4 sums the
// decode-ahead driver promotes itself; MXFP4 at 7, 13 and 21 tokens: two, three and four
// token tiles against one decoded row tile, `amx::drive_decode_tiles`, whose last row
// tile here is partial). Special weights and activations (subnormals, −0, ∞ and NaN
// rows and tokens) must come out with the same bits every way. 2113 columns: a whole
// 2048-column block, then a partial one ending in a partial group, so each result is
// promoted twice.
/// `ntok` tokens `x` through `k` as one batch, then each token alone: every token's
/// results must be the same bits both ways (`what` names the case). Returns the batch's
/// results, `m.rows` a token.
fn batch_matches_each_alone(
    k: &Kernel,
    m: &Mat<'_>,
    x: &[f32],
    ntok: usize,
    what: &str,
) -> Vec<f32> {
    let (rows, cols) = (m.rows, m.cols);
    let mut all = vec![0f32; ntok * rows];
    gemm_on(k, m, x, &mut all, ntok);
    for t in 0..ntok {
        let mut one = vec![0f32; rows];
        gemm_on(k, m, &x[t * cols..(t + 1) * cols], &mut one, 1);
        let got = &all[t * rows..(t + 1) * rows];
        assert_same(&format!("{what}: token {t} of {ntok} alone"), &one, got);
    }
    all
}

/// BF16 weights read in place against 3 to 12 token tiles (11-64 tokens), row tile by row
/// tile (`amx::in_place_rows`): 160 rows (five pairs of row tiles, all in place: whole
/// tiles) × 4160 columns (three blocks, all whole groups), each token alone (one narrow
/// tile) against the same token in batches of 11, 16, 21 (three and four tiles: one
/// pass), 26 and 32 (a pass of four, then one of one or two), 40 and 64 (two groups of
/// six tiles, each promoted on its own), bit for bit. The shape of
/// `amx_rows_and_tokens_independent_bitwise` (53 rows, a partial group) is staged but for
/// its first pair of row tiles and block, and its batches are of 7 and 13 tokens: a step
/// that stored its sums at another token tile's columns once passed it. That fails here,
/// and so do a fourth token tile loaded from the third's place and a second group of six
/// tiles promoted as the first's tokens (each checked).
#[test]
fn amx_in_place_token_tiles_bitwise() {
    let _kernels = kernels_shared();
    let Some(k) = amx_kernel("amx_in_place_token_tiles_bitwise") else {
        return;
    };
    let mut s = 0x51ce_0000_7777_0001u64;
    let (rows, cols) = (160, 4160);
    let o = Owned::special("bf16", rows, cols, &mut s);
    let m = o.mat();
    for ntok in [11, 16, 21, 26, 32, 40, 64] {
        let x = adversarial(ntok, cols, &mut s);
        let all = batch_matches_each_alone(&k, &m, &x, ntok, "bf16 in place");
        assert!(
            all.iter().any(|v| v.is_finite() && *v != 0.0),
            "{ntok}: no plain result"
        );
    }
}

/// Each token alone against the same token in batches of 7 to 40 plain tokens (finite
/// after the first three), MXFP4 and BF16, 53 rows (a partial row tile) × 2113 columns (a
/// partial group): a token tile's sums taken from another tile's activations fail here.
/// The adversarial tokens above mostly sum to NaN or ∞, where such a mix-up passes: a
/// fourth MXFP4 token tile loaded from the third's place (`amx::drive_decode_tiles`)
/// passed `amx_rows_and_tokens_independent_bitwise` and fails this test (checked).
#[test]
fn amx_plain_tokens_in_every_tile_bitwise() {
    let _kernels = kernels_shared();
    let Some(k) = amx_kernel("amx_plain_tokens_in_every_tile_bitwise") else {
        return;
    };
    let mut s = 0x7a11_0000_4242_0007u64;
    let (rows, cols) = (53, 2113);
    for fmt in ["mxfp4", "bf16"] {
        let o = Owned::new(fmt, rows, cols, &mut s);
        let m = o.mat();
        for ntok in [7, 13, 21, 26, 40] {
            let x = activations(ntok, cols, &mut s);
            let all = batch_matches_each_alone(&k, &m, &x, ntok, &format!("{fmt} plain"));
            // The comparison has teeth: the tokens after the first three sum to finite,
            // non-zero values (a zero scale group aside).
            let plain = all[3 * rows..]
                .iter()
                .filter(|v| v.is_finite() && **v != 0.0);
            assert!(
                plain.count() * 10 >= 9 * (ntok - 3) * rows,
                "{fmt} {ntok}: too few finite results"
            );
        }
    }
}

#[test]
fn amx_rows_and_tokens_independent_bitwise() {
    let _kernels = kernels_shared();
    let Some(k) = amx_kernel("amx_rows_and_tokens_independent_bitwise") else {
        return;
    };
    let mut s = 0x0a3c_0000_1234_9999u64;
    for (fmt, ntok) in [
        ("bf16", 13),
        ("mxfp4", 13),
        ("mxfp4", 21),
        ("f32", 13),
        ("bf16", 45),
        ("mxfp4", 45),
    ] {
        let (rows, cols) = (53, 2113);
        let o = Owned::special(fmt, rows, cols, &mut s);
        let m = o.mat();
        let x = adversarial(ntok, cols, &mut s);
        // Every token alone, and tokens 4..11 as a batch of 7 (each at another column).
        let all = batch_matches_each_alone(&k, &m, &x, ntok, fmt);
        let col = |y: &[f32], t: usize| -> Vec<f32> { y[t * rows..(t + 1) * rows].to_vec() };
        // Tokens 0.. as batches of 3 and 5 (one narrow token tile: MXFP4 decoded a group
        // ahead, each token's parts in columns 3t..3t + 3; tokens 0..3 are plain ones, whose
        // sums a part from the wrong column changes), tokens 4..11 as a batch of 7 (two
        // tiles, staged).
        for (t0, n) in [(0, 3), (0, 5), (4, 7)] {
            let mut few = vec![0f32; n * rows];
            gemm_on(&k, &m, &x[t0 * cols..(t0 + n) * cols], &mut few, n);
            for t in 0..n {
                let what = format!("{fmt} token {} in a batch of {n}", t0 + t);
                assert_same(&what, &col(&few, t), &col(&all, t0 + t));
            }
        }
        // Rows 5..50 as their own matrix: every row at another tile position.
        let (r0, r1) = (5, 50);
        let sub = match fmt {
            "bf16" => Mat::bf16(&o.a[2 * r0 * cols..2 * r1 * cols], r1 - r0, cols),
            "f32" => Mat::f32(&o.a[4 * r0 * cols..4 * r1 * cols], r1 - r0, cols),
            _ => {
                let (pb, sb) = (cols.div_ceil(2), cols.div_ceil(32));
                Mat::mxfp4(
                    &o.a[pb * r0..pb * r1],
                    &o.b[sb * r0..sb * r1],
                    r1 - r0,
                    cols,
                )
            }
        }
        .unwrap();
        let mut part = vec![0f32; ntok * (r1 - r0)];
        gemm_on(&k, &sub, &x, &mut part, ntok);
        for t in 0..ntok {
            let want: Vec<f32> = (r0..r1).map(|r| all[t * rows + r]).collect();
            let got = &part[t * (r1 - r0)..(t + 1) * (r1 - r0)];
            assert_same(&format!("{fmt} rows {r0}..{r1} token {t}"), got, &want);
        }
        // The special inputs reached the results.
        assert!(all.iter().any(|v| v.is_nan()), "{fmt}: no NaN result");
    }
}
