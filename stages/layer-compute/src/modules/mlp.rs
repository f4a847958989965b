//! The SiTU-GLU FFN (k3-spec §4.4 SiTU, §4.8 the dense FFN of layer 0), also the shape of
//! the MoE's shared and routed experts. A dense layer's FFN weights are bound in
//! `forward.rs` by use phase (gate, up, down: phases 2, 3 and 4), so a trunk streamed in
//! parts never holds all three.

use rayon::prelude::*;

use crate::kernels::act::situ_glu;
use crate::kernels::matmul::{gemm64, gemm_fused, Mat};

/// Values per parallel SiTU task (each value costs three f64 transcendentals,
/// `kernels::act`).
const SITU_CHUNK: usize = 4096;

/// SiTU caps.
#[derive(Clone, Copy, Debug)]
pub struct Situ {
    pub b1: f32,
    pub b2: f32,
}

/// `W_down · SiTU(W_gate x, W_up x)` for `ntok` rows, as unrounded f64 sums. The SiTU
/// output is rounded to f32 (activations are f32) before the down projection.
pub fn glu_mlp64(
    gate: &Mat<'_>,
    up: &Mat<'_>,
    down: &Mat<'_>,
    situ: Situ,
    x: &[f32],
    ntok: usize,
    threads: usize,
) -> Vec<f64> {
    let f = gate.rows;
    let mut g = vec![0f32; ntok * f];
    let mut u = vec![0f32; ntok * f];
    gemm_fused(&[gate, up], x, &mut [&mut g, &mut u], ntok, threads);
    glu_down64(&g, &u, down, situ, ntok, threads)
}

/// The second half of [`glu_mlp64`], for callers that computed the gate and up products
/// themselves (fused with other products of the same input).
pub fn glu_down64(
    g: &[f32],
    u: &[f32],
    down: &Mat<'_>,
    situ: Situ,
    ntok: usize,
    threads: usize,
) -> Vec<f64> {
    let mut a = vec![0f32; g.len()];
    // Elementwise (three f64 transcendentals per value): split over the pool in
    // fixed chunks when it is worth a fork, which cannot change a value.
    if threads > 1 && a.len() >= 2 * SITU_CHUNK {
        a.par_chunks_mut(SITU_CHUNK)
            .zip(g.par_chunks(SITU_CHUNK).zip(u.par_chunks(SITU_CHUNK)))
            .for_each(|(a, (g, u))| situ_glu(g, u, situ.b1, situ.b2, a));
    } else {
        situ_glu(g, u, situ.b1, situ.b2, &mut a);
    }
    let mut y = vec![0f64; ntok * down.rows];
    gemm64(down, &a, &mut y, ntok, threads);
    y
}

/// `W_down · SiTU(W_gate x, W_up x)` for `ntok` rows (rounded once to f32).
pub fn glu_mlp(
    gate: &Mat<'_>,
    up: &Mat<'_>,
    down: &Mat<'_>,
    situ: Situ,
    x: &[f32],
    ntok: usize,
    threads: usize,
) -> Vec<f32> {
    glu_mlp64(gate, up, down, situ, x, ntok, threads)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}
