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
//! bits, before the final rounding too (`unit::mla::vector_paths_equal_the_reference_bitwise`
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
#[doc(hidden)]
pub fn attend_batch64_on(
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
#[doc(hidden)]
pub fn attend_reference64(
    d: MlaDims,
    q: &[f32],
    cache: &MlaCacheView<'_>,
    last: usize,
    o: &mut [f64],
) {
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
