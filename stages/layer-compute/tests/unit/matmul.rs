//! The exact product path's drivers (`src/kernels/matmul.rs`): the reduction contract, the
//! task sizes of long prompts, threads and batching bit for bit.

use k3_layer_compute::kernels::matmul::*;
use k3_layer_compute::kernels::portable;

use crate::support::kernels_shared;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

// Catches: a reduction that is not the documented contract (lane map, f32 blocks of
// 1024 columns with FMA, f64 promotion, halving tree), written here independently.
#[test]
fn f32_dot_follows_block_contract() {
    // `row_dot` runs the installed kernels (another test may install `bf16x3`).
    let _turn = kernels_shared();
    let mut s = 7u64;
    for n in [
        1usize, 5, 31, 32, 33, 64, 100, 257, 1023, 1024, 1025, 2100, 3100,
    ] {
        let w: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
        let x: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut acc64 = [0f64; 32];
        let mut acc32 = [0f32; 32];
        for c in 0..n.div_ceil(32) * 32 {
            let (wc, xc) = if c < n { (w[c], x[c]) } else { (0.0, 0.0) };
            let l = if c % 2 == 0 {
                (c % 32) / 2
            } else {
                16 + (c % 32) / 2
            };
            acc32[l] = wc.mul_add(xc, acc32[l]);
            if c % 1024 == 1023 || c + 1 == n.div_ceil(32) * 32 {
                for l in 0..32 {
                    acc64[l] += acc32[l] as f64;
                    acc32[l] = 0.0;
                }
            }
        }
        let want = portable::reduce_lanes(&mut acc64) as f32;
        let m = Mat::f32(&bytes, 1, n).unwrap();
        let mut y = [0f32];
        gemv_portable(&m, &x, &mut y);
        assert_eq!(y[0].to_bits(), want.to_bits(), "n={n}");
        assert_eq!(m.row_dot(0, &x).to_bits(), want.to_bits(), "simd n={n}");
    }
}

// Catches: a long prompt's products cut into tasks of 16 rows again (each task reads
// the whole prompt's activations from memory: `o_proj` and the down projection ran at
// half speed), a short prompt's or a decode step's split changed with it, or a task
// size that is not a multiple of 16 rows (the batched kernels' row groups).
#[test]
fn long_prompts_take_tasks_of_many_rows() {
    let w = vec![0u8; 200 * 12288 * 2];
    let m = Mat::bf16(&w, 200, 12288).unwrap();
    for ntok in [512, 171] {
        let rows = task_rows(&m, ntok);
        assert!(
            rows >= PROMPT_TASK_ROWS && rows.is_multiple_of(16),
            "{ntok}: {rows}"
        );
    }
    assert_eq!(task_rows(&m, 16), 16, "a 16-token prompt (786 KB of input)");
    assert_eq!(task_rows(&m, 1), 16, "one token: 256 KiB of weights");
    // Few columns: the rows that fill a task's bytes, as before.
    let w = vec![0u8; 300 * 128 * 2];
    assert_eq!(task_rows(&Mat::bf16(&w, 300, 128).unwrap(), 512), 128);
}

// Catches: a threaded split or a batched kernel that changes a result (bitwise).
#[test]
fn threads_and_batching_do_not_change_bits() {
    let _turn = kernels_shared();
    let mut s = 11u64;
    let (rows, cols) = (301, 1057);
    let w: Vec<u8> = (0..rows * cols)
        .flat_map(|_| ((lcg(&mut s).to_bits() >> 16) as u16).to_le_bytes())
        .collect();
    let m = Mat::bf16(&w, rows, cols).unwrap();
    let ntok = 7;
    let x: Vec<f32> = (0..cols * ntok).map(|_| lcg(&mut s)).collect();
    let mut y1 = vec![0f32; rows * ntok];
    gemm(&m, &x, &mut y1, ntok, 1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for th in [2, 3, 7] {
        let mut y2 = vec![0f32; rows * ntok];
        pool.install(|| gemm(&m, &x, &mut y2, ntok, th));
        assert!(y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()));
        for t in 0..ntok {
            let mut y3 = vec![0f32; rows];
            pool.install(|| gemv(&m, &x[t * cols..(t + 1) * cols], &mut y3, th));
            for r in 0..rows {
                assert_eq!(y3[r].to_bits(), y1[t * rows + r].to_bits());
            }
        }
    }
}
