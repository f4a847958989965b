//! The `bf16x3` product path's pieces (`src/kernels/bf16x3.rs`): the exact three-way split,
//! the bf16 weight table, and the scalar model of `vdpbf16ps` against the instruction.

use k3_layer_compute::kernels::bf16x3::*;
use k3_layer_compute::kernels::portable::E2M1_SCALED;
use k3_layer_compute::kernels::simd;

fn rng(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

// Catches: a split that does not add up to x exactly (rounding instead of truncating,
// a lost bit), parts of mixed signs, non-finite values that leak into mid/lo or a NaN
// whose payload truncates to ∞, and a tiny x whose parts are not bf16 patterns.
#[test]
fn split_is_exact_and_handles_special_values() {
    let mut s = 0x5a11_7e57_u64;
    for i in 0..200_000 {
        let b = rng(&mut s) as u32;
        // Normal values over the whole range, and one in 8 with a small exponent.
        let x = if i % 8 == 0 {
            f32::from_bits(b & 0x83FF_FFFF)
        } else {
            f32::from_bits(b)
        };
        let [h, m, l] = split(x).map(bf16_f32);
        if !x.is_finite() {
            assert_eq!((m.to_bits(), l.to_bits()), (0, 0), "{x}");
            assert_eq!(h.is_nan(), x.is_nan(), "{:#x}", x.to_bits());
            if x.is_infinite() {
                assert_eq!(h, x);
            }
            continue;
        }
        if x.abs() >= 2f32.powi(-100) {
            // Every part a normal bf16 (or zero): exact, same sign.
            assert_eq!((h as f64) + (m as f64) + (l as f64), x as f64, "{x:e}");
            for p in [m, l] {
                assert!(p == 0.0 || p.signum() == x.signum(), "{x:e}");
            }
            assert!(
                (m as f64 + l as f64).abs() < x.abs() as f64 / 128.0,
                "{x:e}"
            );
        } else {
            // What the hardware sees (parts below 2^-126 as zero) is within 2^-126.
            let seen: f64 = [h, m, l]
                .iter()
                .map(|&p| if p.is_subnormal() { 0.0 } else { p as f64 })
                .sum();
            assert!((seen - x as f64).abs() < 2f64.powi(-126), "{x:e}");
        }
    }
    let nan = f32::from_bits(0x7F80_0001);
    assert!(bf16_f32(split(nan)[0]).is_nan(), "an sNaN stays NaN");
    assert_eq!(split(-0.0), [0x8000, 0, 0]);
}

// Catches: a table row that is not the f32 table's top half, or whose second copy
// differs (a vpermw index with its fifth bit set would read another weight).
#[test]
fn bf16_table_is_the_f32_table() {
    for s in 0..256 {
        for c in 0..32 {
            let w = E2M1_SCALED.0[s][c % 16];
            assert_eq!(
                bf16_f32(E2M1_BF16.0[s][c]).to_bits(),
                w.to_bits(),
                "{s} {c}"
            );
        }
    }
}

/// The instruction on one lane pair (AVX512-BF16 hosts only).
#[cfg(target_arch = "x86_64")]
fn instruction(acc: &[f32; 16], a: &[u16; 32], b: &[u16; 32]) -> [f32; 16] {
    use std::arch::x86_64::*;
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn dp(acc: &[f32; 16], a: &[u16; 32], b: &[u16; 32]) -> [f32; 16] {
        let mut o = [0f32; 16];
        // SAFETY: 64 readable bytes each; the CPU has AVX512_BF16 (the caller checked);
        // __m512i and __m512bh are the same 64 bytes.
        unsafe {
            let x: __m512bh = std::mem::transmute(_mm512_loadu_si512(a.as_ptr() as _));
            let y: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.as_ptr() as _));
            let r = _mm512_dpbf16_ps(_mm512_loadu_ps(acc.as_ptr()), x, y);
            _mm512_storeu_ps(o.as_mut_ptr(), r);
        }
        o
    }
    // SAFETY: the tests call it only where bf16_dot_available().
    unsafe { dp(acc, a, b) }
}

// Catches: a scalar model that is not the hardware's step (order of the pair, DAZ on
// inputs or the accumulator, FTZ between or after the steps, tininess before rounding)
// on the cases the probe found decisive: subnormal inputs and accumulators, subnormal
// results, results at 2^-126, products below 2^-149, overflow, NaN/∞, signed zeros.
#[cfg(target_arch = "x86_64")]
#[test]
fn dp_step_is_the_instruction() {
    if !simd::runnable_path(
        "bf16x3::dp_step_is_the_instruction",
        simd::ProductPath::Bf16x3,
    ) {
        return;
    }
    let mut s = 0x0d0b_f16a_u64;
    let bf = |emin: u64, emax: u64, s: &mut u64| -> u16 {
        let e = emin + rng(s) % (emax - emin + 1);
        ((rng(s) & 0x807F) | (e << 7)) as u16
    };
    let specials = [
        0x7F80u16, 0xFF80, 0x7FC0, 0x7F81, 0x0000, 0x8000, 0x0001, 0x8045,
    ];
    let mut checked = 0usize;
    for it in 0..120_000 {
        let (mut a, mut b, mut acc) = ([0u16; 32], [0u16; 32], [0f32; 16]);
        for i in 0..32 {
            (a[i], b[i]) = match it % 6 {
                0 => (bf(100, 150, &mut s), bf(100, 150, &mut s)),
                1 => (bf(0, 130, &mut s), bf(0, 130, &mut s)),
                2 => (bf(60, 70, &mut s), bf(45, 60, &mut s)),
                3 => (bf(190, 254, &mut s), bf(190, 254, &mut s)),
                4 => (specials[(rng(&mut s) % 8) as usize], bf(100, 150, &mut s)),
                _ => (bf(40, 77, &mut s), bf(40, 90, &mut s)),
            };
        }
        for v in acc.iter_mut() {
            let r = rng(&mut s);
            *v = match it % 3 {
                0 => f32::from_bits((r as u32 & 0x807F_FFFF) | 1),
                1 => f32::from_bits((r as u32 & 0x807F_FFFF) | ((1 + r % 3) as u32) << 23),
                _ => f32::from_bits(r as u32),
            };
            if it % 6 == 5 {
                // Just above ±2^-126: the products take it to the boundary.
                *v = f32::from_bits(0x0080_0000 | (r % 4) as u32)
                    * if r & 8 == 0 { 1.0 } else { -1.0 };
            }
        }
        let hw = instruction(&acc, &a, &b);
        for j in 0..16 {
            let w = [bf16_f32(a[2 * j]), bf16_f32(a[2 * j + 1])];
            let x = [bf16_f32(b[2 * j]), bf16_f32(b[2 * j + 1])];
            let model = dp_pair(acc[j], w, x);
            assert!(
                hw[j].to_bits() == model.to_bits() || (hw[j].is_nan() && model.is_nan()),
                "acc {:#x} w {:?} x {:?}: hardware {:#x}, model {:#x}",
                acc[j].to_bits(),
                [a[2 * j], a[2 * j + 1]],
                [b[2 * j], b[2 * j + 1]],
                hw[j].to_bits(),
                model.to_bits()
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 120_000 * 16);
}
