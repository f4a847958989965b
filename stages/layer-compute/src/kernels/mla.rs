//! NoPE multi-head latent attention over a per-position cache.
//!
//! Keys per head are `[k_nope_h(s) ‖ k_r(s)]` (the "rope" slot is shared by all heads and
//! never rotated), queries `[q_nope_h ‖ q_r_h]`; scores are scaled by
//! `1/sqrt(nope + rope)`, causal, softmax over positions, values mixed in position order.
//! Dot products, softmax and the value mix accumulate in f64.
//!
//! # The operations (every path, the same bits)
//!
//! For one query and head, over positions `s = 0..=last`:
//! 1. `score(s) = (Σᵢ q[i]·k_s[i]) · scale`, the sum in f64 over the dimensions in order
//!    (the nope ones, then the rope ones), each product of two f32 exact in f64, each
//!    addition rounded once;
//! 2. `m = max(score)` (`f64::max` in position order), `p(s) = exp(score(s) − m)` (libm
//!    f64 `exp`), `z = Σ p(s)` in position order;
//! 3. `o[j] = Σₛ (p(s) / z) · v_s[j]` in f64, positions in order, the product and the sum
//!    each rounded once (never fused), the result rounded once to f32.
//!
//! [`attend_reference`] is that written plainly, one dimension after another. The kernel
//! ([`attend_batch`]) performs the same operations, vectorised where they are independent:
//! - **Scores across positions.** Each head's keys are transposed once per call into a
//!   dimension-major tile (`kt[i][s]`; the rope part once for all heads), so a vector
//!   lane is one position, and the lanes of [`PB`] positions advance through the
//!   dimensions in the scalar sum's order (one multiply, one add per dimension; the
//!   product is exact, so fusing could not change it either).
//! - **The softmax** stays scalar (`max`, `exp`, the sum: O(positions)).
//! - **The value mix across output dimensions.** `w = p(s) / z` is computed once per
//!   position (the value the scalar loop divides out again for every output), and each
//!   lane (one output dimension) adds `w · v_s[j]` position after position.
//! - **Queries of a batch** (a prompt's rows of one sequence) share the transposed keys;
//!   heads are independent and run on the current rayon pool when the work is large.
//!
//! So every path (portable, AVX2, AVX-512: one body compiled for each, the instruction set
//! [`super::simd::isa`]), every thread count and every batch gives [`attend_reference`]'s
//! bits, before the final rounding too (`tests::vector_paths_equal_the_reference_bitwise`
//! compares the unrounded f64 outputs).

use rayon::prelude::*;

use super::simd::Isa;

/// Geometry of one MLA layer.
#[derive(Clone, Copy, Debug)]
pub struct MlaDims {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
}

/// The cache contents the attention reads, for positions `0..len`.
pub struct MlaCacheView<'a> {
    /// `[pos][heads][nope]`
    pub k_nope: &'a [f32],
    /// `[pos][heads][v]`
    pub v: &'a [f32],
    /// `[pos][rope]`
    pub k_rope: &'a [f32],
}

/// Positions per score pass (the lanes one pass over the dimensions advances: 8 zmm of
/// f64 accumulators on AVX-512).
pub const PB: usize = 64;

/// Heads × queries × positions × (key + value dimensions) above which the heads run on
/// the rayon pool.
const PAR_MIN: usize = 1 << 18;

/// Attention of one query (`heads × (nope+rope)`) over positions `0..=last`; writes
/// `o` (`heads × v`).
pub fn attend(d: MlaDims, q: &[f32], cache: &MlaCacheView<'_>, last: usize, o: &mut [f32]) {
    attend_batch(d, q, &[last], cache, o, 1);
}

/// Attention of `lasts.len()` queries of one sequence: query `k` (`qs[k·heads·qh..]`,
/// `qh = nope + rope`) over positions `0..=lasts[k]`, into `out[k·heads·v..]`; the keys
/// are transposed once for all of them. `threads > 1` lets the heads run on the current
/// rayon pool. The bits of [`attend_reference`] for every query, on the instruction set
/// [`super::simd::isa`].
pub fn attend_batch(
    d: MlaDims,
    qs: &[f32],
    lasts: &[usize],
    cache: &MlaCacheView<'_>,
    out: &mut [f32],
    threads: usize,
) {
    attend_batch_on(super::simd::isa(), d, qs, lasts, cache, out, threads);
}

/// [`attend_batch`] on an explicit instruction set (tests compare them bit for bit);
/// panics when the CPU lacks it ([`super::simd::checked`]).
pub fn attend_batch_on(
    isa: Isa,
    d: MlaDims,
    qs: &[f32],
    lasts: &[usize],
    cache: &MlaCacheView<'_>,
    out: &mut [f32],
    threads: usize,
) {
    assert_eq!(out.len(), lasts.len() * d.heads * d.v, "mla output");
    let mut wide = vec![0f64; out.len()];
    attend_batch64_on(isa, d, qs, lasts, cache, &mut wide, threads);
    for (o, w) in out.iter_mut().zip(wide) {
        *o = w as f32;
    }
}

/// [`attend_batch`] for queries picked out of a pass: `picks[k] = (j, last)` is query row
/// `j` of `q` (rows of `heads·(nope+rope)`) over positions `0..=last`, written to row `j`
/// of `o` (rows of `heads·v`); the other rows of `o` are left as they are.
pub fn attend_rows(
    d: MlaDims,
    q: &[f32],
    picks: &[(usize, usize)],
    cache: &MlaCacheView<'_>,
    o: &mut [f32],
    threads: usize,
) {
    let (qw, ow) = (d.heads * (d.nope + d.rope), d.heads * d.v);
    let qs: Vec<f32> = picks
        .iter()
        .flat_map(|&(j, _)| q[j * qw..(j + 1) * qw].iter().copied())
        .collect();
    let lasts: Vec<usize> = picks.iter().map(|&(_, last)| last).collect();
    let mut os = vec![0f32; picks.len() * ow];
    attend_batch(d, &qs, &lasts, cache, &mut os, threads);
    for (k, &(j, _)) in picks.iter().enumerate() {
        o[j * ow..(j + 1) * ow].copy_from_slice(&os[k * ow..(k + 1) * ow]);
    }
}

/// One call's inputs, shared by the heads.
struct Call<'a> {
    d: MlaDims,
    qs: &'a [f32],
    lasts: &'a [usize],
    cache: &'a MlaCacheView<'a>,
    /// Positions the keys are transposed for (`max(lasts) + 1`).
    npos: usize,
    /// The rope keys, dimension-major: `kr[i * npos + s]`.
    kr: Vec<f32>,
}

/// [`attend_batch_on`] with the unrounded f64 outputs.
fn attend_batch64_on(
    isa: Isa,
    d: MlaDims,
    qs: &[f32],
    lasts: &[usize],
    cache: &MlaCacheView<'_>,
    out: &mut [f64],
    threads: usize,
) {
    let isa = super::simd::checked(isa);
    let (qh, nq) = (d.nope + d.rope, lasts.len());
    assert_eq!(qs.len(), nq * d.heads * qh, "mla queries");
    assert_eq!(out.len(), nq * d.heads * d.v, "mla output");
    let Some(&maxlast) = lasts.iter().max() else {
        return;
    };
    let npos = maxlast + 1;
    assert!(
        cache.k_nope.len() >= npos * d.heads * d.nope
            && cache.v.len() >= npos * d.heads * d.v
            && cache.k_rope.len() >= npos * d.rope,
        "mla cache shorter than the positions asked for"
    );
    let mut kr = vec![0f32; d.rope * npos];
    for s in 0..npos {
        for (i, &k) in cache.k_rope[s * d.rope..(s + 1) * d.rope]
            .iter()
            .enumerate()
        {
            kr[i * npos + s] = k;
        }
    }
    let call = Call {
        d,
        qs,
        lasts,
        cache,
        npos,
        kr,
    };
    let head = |h: usize| {
        let mut o = vec![0f64; nq * d.v];
        head_on(isa, &call, h, &mut o);
        o
    };
    let work = d.heads * nq * npos * (qh + d.v);
    let per_head: Vec<Vec<f64>> =
        if threads > 1 && work >= PAR_MIN && rayon::current_num_threads() > 1 {
            (0..d.heads).into_par_iter().map(head).collect()
        } else {
            (0..d.heads).map(head).collect()
        };
    for (h, o) in per_head.iter().enumerate() {
        for k in 0..nq {
            let dst = (k * d.heads + h) * d.v;
            out[dst..dst + d.v].copy_from_slice(&o[k * d.v..(k + 1) * d.v]);
        }
    }
}

/// Head `h` of every query of `c` into `o` (`nq × v`, unrounded), compiled for `isa`.
fn head_on(isa: Isa, c: &Call<'_>, h: usize, o: &mut [f64]) {
    super::act::on_path!(isa, fn(c: &Call<'_>, h: usize, o: &mut [f64]) {
        head_body(c, h, o)
    })
}

/// The body of [`head_on`], inlined into each compilation.
#[inline(always)]
fn head_body(c: &Call<'_>, h: usize, o: &mut [f64]) {
    let (d, npos) = (c.d, c.npos);
    let qh = d.nope + d.rope;
    let scale = 1.0 / (qh as f64).sqrt();
    // This head's nope keys, dimension-major: kn[i * npos + s].
    let mut kn = vec![0f32; d.nope * npos];
    for s in 0..npos {
        let row = &c.cache.k_nope[(s * d.heads + h) * d.nope..(s * d.heads + h + 1) * d.nope];
        for (i, &k) in row.iter().enumerate() {
            kn[i * npos + s] = k;
        }
    }
    let mut p = vec![0f64; npos];
    for (k, &last) in c.lasts.iter().enumerate() {
        let q = &c.qs[(k * d.heads + h) * qh..(k * d.heads + h + 1) * qh];
        let p = &mut p[..last + 1];
        scores(&q[..d.nope], &kn, &q[d.nope..], &c.kr, npos, scale, p);
        let mut m = f64::NEG_INFINITY;
        for &ps in p.iter() {
            m = m.max(ps);
        }
        let mut z = 0f64;
        for ps in p.iter_mut() {
            *ps = (*ps - m).exp();
            z += *ps;
        }
        let acc = &mut o[k * d.v..(k + 1) * d.v];
        acc.fill(0.0);
        for (s, &ps) in p.iter().enumerate() {
            let w = ps / z;
            let vs = &c.cache.v[(s * d.heads + h) * d.v..(s * d.heads + h + 1) * d.v];
            for (a, &vj) in acc.iter_mut().zip(vs) {
                *a += w * vj as f64;
            }
        }
    }
}

/// `p[s] = (Σᵢ qn[i]·kn[i][s] + Σᵢ qr[i]·kr[i][s]) · scale` for `s < p.len()`, the
/// dimensions in order, [`PB`] positions a pass (one lane each).
#[inline(always)]
fn scores(qn: &[f32], kn: &[f32], qr: &[f32], kr: &[f32], npos: usize, scale: f64, p: &mut [f64]) {
    let n = p.len();
    let mut s0 = 0;
    while s0 + PB <= n {
        let mut acc = [0f64; PB];
        for (i, &qi) in qn.iter().enumerate() {
            lanes(&mut acc, qi as f64, &kn[i * npos + s0..i * npos + s0 + PB]);
        }
        for (i, &qi) in qr.iter().enumerate() {
            lanes(&mut acc, qi as f64, &kr[i * npos + s0..i * npos + s0 + PB]);
        }
        for (ps, a) in p[s0..s0 + PB].iter_mut().zip(acc) {
            *ps = a * scale;
        }
        s0 += PB;
    }
    if s0 < n {
        let len = n - s0;
        let mut acc = [0f64; PB];
        for (i, &qi) in qn.iter().enumerate() {
            let row = &kn[i * npos + s0..i * npos + s0 + len];
            lanes(&mut acc[..len], qi as f64, row);
        }
        for (i, &qi) in qr.iter().enumerate() {
            let row = &kr[i * npos + s0..i * npos + s0 + len];
            lanes(&mut acc[..len], qi as f64, row);
        }
        for (ps, a) in p[s0..].iter_mut().zip(acc) {
            *ps = a * scale;
        }
    }
}

/// `acc[l] += q · k[l]` in f64 (the product exact, one rounding in the sum).
#[inline(always)]
fn lanes(acc: &mut [f64], q: f64, k: &[f32]) {
    for (a, &kl) in acc.iter_mut().zip(k) {
        *a += q * kl as f64;
    }
}

/// The reference: [`attend`]'s operations written one dimension after another (the
/// scalar f64 loops this module started from). Tests hold every path to its bits.
pub fn attend_reference(
    d: MlaDims,
    q: &[f32],
    cache: &MlaCacheView<'_>,
    last: usize,
    o: &mut [f32],
) {
    let mut wide = vec![0f64; o.len()];
    attend_reference64(d, q, cache, last, &mut wide);
    for (o, w) in o.iter_mut().zip(wide) {
        *o = w as f32;
    }
}

/// [`attend_reference`] with the unrounded f64 outputs.
fn attend_reference64(d: MlaDims, q: &[f32], cache: &MlaCacheView<'_>, last: usize, o: &mut [f64]) {
    let qh = d.nope + d.rope;
    let scale = 1.0 / (qh as f64).sqrt();
    let npos = last + 1;
    let mut p = vec![0f64; npos];
    for h in 0..d.heads {
        let qn = &q[h * qh..h * qh + d.nope];
        let qr = &q[h * qh + d.nope..(h + 1) * qh];
        let mut m = f64::NEG_INFINITY;
        for (s, ps) in p.iter_mut().enumerate() {
            let kn = &cache.k_nope[(s * d.heads + h) * d.nope..(s * d.heads + h + 1) * d.nope];
            let kr = &cache.k_rope[s * d.rope..(s + 1) * d.rope];
            let mut acc = 0f64;
            for i in 0..d.nope {
                acc += qn[i] as f64 * kn[i] as f64;
            }
            for i in 0..d.rope {
                acc += qr[i] as f64 * kr[i] as f64;
            }
            *ps = acc * scale;
            m = m.max(*ps);
        }
        let mut z = 0f64;
        for ps in p.iter_mut() {
            *ps = (*ps - m).exp();
            z += *ps;
        }
        let oh = &mut o[h * d.v..(h + 1) * d.v];
        for (j, oj) in oh.iter_mut().enumerate() {
            let mut acc = 0f64;
            for (s, ps) in p.iter().enumerate() {
                acc += ps / z * cache.v[(s * d.heads + h) * d.v + j] as f64;
            }
            *oj = acc;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut s = 0x3a11_7e57_0000_0001u64;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let test = "mla::vector_paths_equal_the_reference_bitwise";
        let isas: Vec<Isa> = Isa::ALL
            .into_iter()
            .filter(|&i| i == Isa::Portable || super::super::simd::runnable(test, i))
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
            let same =
                |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            for &isa in &isas {
                for threads in [1, 3] {
                    let mut got = vec![0f64; lasts.len() * ow];
                    pool.install(|| {
                        attend_batch64_on(isa, d, &qs, &lasts, &cache, &mut got, threads)
                    });
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
}
