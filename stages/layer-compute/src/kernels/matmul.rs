//! Matrix-vector and matrix-matrix products `y = W x` over weights kept exactly as shipped.
//!
//! Three weight encodings: BF16 (widened exactly to f32 by a 16-bit shift), F32, and MXFP4
//! (compressed-tensors packing, decoded on the fly from the packed bytes; the matrix is
//! never expanded in memory). Activations are f32 (the f64-input products were removed
//! once the forward stopped calling them: the SiTU output stays f32).
//!
//! # Reduction contract
//!
//! Every path (portable twin, AVX2+FMA, AVX-512F), every thread count and every batch
//! size computes each output `y[t][r]` by exactly these operations, in this order:
//!
//! 1. **Lanes.** Columns are cut into groups of 32 (`q = c / 32`; the last group is
//!    padded with zero weights and zero activations). Inside a group, lane `l < 16` takes
//!    column `32q + 2l` and lane `16 + l` column `32q + 2l + 1` (even columns, then odd:
//!    [`portable::lane_col`]). The input is permuted into lane order once per product.
//! 2. **f32 blocks.** Columns are cut into blocks of 1024 (32 groups). Inside a block each
//!    lane keeps an f32 partial, starting at +0, updated once per group, in increasing `q`,
//!    by one fused multiply-add `p = fma(w, x, p)`, with `w` the exact f32 weight
//!    (bf16 widened; MXFP4 `E2M1[code] · 2^(scale−127)`, scale byte 255 → weight 0).
//! 3. **f64 promotion.** At the end of each block every lane's f32 partial is widened
//!    (exactly) to f64 and added to that lane's f64 sum (starting at +0), block by block.
//! 4. **Tree.** The 32 f64 lane sums are combined by the fixed halving tree
//!    ([`portable::reduce_lanes`]: 16, 8, 4, 2, 1) into one f64, which [`gemm`] rounds once
//!    to f32 and [`gemm64`] returns unrounded.
//! 5. **Rows and tokens are independent.** Threads split output rows (fixed row blocks,
//!    rayon), never a reduction; batching tokens only shares weight reads and decode.
//!    Hence results are bitwise independent of thread count, of batched vs one token at a
//!    time, of fusion ([`gemm_fused`]) and of the SIMD path.
//!
//! Special values follow IEEE arithmetic in these operations: subnormal weights and
//! activations are kept (never flushed to zero) and infinities propagate, the same bits
//! on every path. A NaN result is NaN on every path, but which NaN (payload, sign) is not
//! part of the contract: x86 passes on the first NaN operand, and the operand order of a
//! fused multiply-add differs between the paths.
//!
//! Error budgets (u32 = 2^-24, u64 = 2^-53; n = cols; A = Σ|w·x|):
//! - **E_block** (f32 FMA chain in a lane within one block, ≤ 32 terms): each FMA rounds
//!   once, so |err| ≤ 32·u32·A_block (worst case 1.9e-6·A; a random walk gives about
//!   √32·u32 ≈ 3.4e-7·A). This is the dominant term and replaces the old exact products.
//! - **E_promote** (f64 lane sums over n/1024 blocks) and **E_tree** (5 levels):
//!   ≤ (n/1024 + 5)·u64·A, negligible (< 2e-15·A for n = 7168).
//! - **E_round**: the final f32 rounding, ≤ u32·|y| (half an ulp), as before.
//! - Total for an f32 output: |y − exact| ≤ 33·u32·A + u32·|y| ≈ 2e-6·A worst case. The
//!   oracle gates (seed ops 1e-5 + 1e-4 rel, tiny models 1e-4 / 1e-3, trace 5e-4 relative)
//!   leave a margin of two to three orders of magnitude; see `tests/` for measured gaps.
//!
//! An MXFP4 product equals, bit for bit, the F32 product of its dequantised matrix (same
//! weights, same operations), and a BF16 product equals the F32 product of its widened
//! matrix. Products of MXFP4 weights never materialise the f32 matrix: each 32-column group
//! (16 packed bytes + 1 scale byte) is decoded in registers by a 16-entry table lookup.
//!
//! SIMD vs portable: the AVX2 and AVX-512 kernels ([`super::avx2`], [`super::avx512`]) are
//! bit-identical to the portable twin ([`super::portable`], `mul_add`), tested on random
//! and special inputs including partial groups and blocks (`tests/kernels_bitexact.rs`),
//! so the instruction set ([`super::simd`]) never changes a result.
//!
//! # Product paths
//!
//! This reduction contract is the `exact` path's. The `bf16x3` path (design.md "Product
//! paths"; [`super::bf16x3`], its own contract and error budget, the same size as
//! E_block + E_round here) runs through the same API, threads and row blocks: only the
//! prepared input ([`Prepared`]: activations split into bf16 parts instead of permuted)
//! and the row kernels differ. One path per run, for every product.
//!
//! # Dispatch
//!
//! A product reads the installed [`Kernel`] once ([`Kernel::current`]: product path,
//! instruction set, drivers' tuning), prepares its input for that path once
//! ([`Prepared::new`]), then `rows_on` matches the kernel once (the only match on the
//! product path and instruction set), and each kernel's entry point matches the weight
//! format once ([`super::format::with_format`]); the drivers are monomorphised per format.
//!
//! # Wiring (for the callers in the layer modules)
//!
//! - **Fused products sharing one input** — [`gemm_fused`] / [`gemm_fused64`]:
//!   `gemm_fused(&[&w.q, &w.k, &w.v, &w.g], u, &mut [&mut q, &mut k, &mut v, &mut g], ntok, th)`
//!   for KDA (add `&w.b`, `&w.f_a` when they read the same `u`), `[&w.q_a, &w.kv_a]` for
//!   MLA, `[gate, up]` in `glu_mlp`/`glu_mlp64` (dense FFN, shared expert, routed
//!   experts). One x permutation and one fork/join for all matrices; results are bitwise
//!   those of separate [`gemm`] calls, so wiring it changes no id or logit.
//! - **Batched prefill** — [`gemm`] with `ntok > 1` *is* the batched, register-blocked
//!   GEMM (weights read from DRAM once per 16 tokens; on AVX-512, BF16/F32 weights at 3-8
//!   tokens are widened in registers and multiplied into 4 rows × 2 tokens per inner loop
//!   with no staging, and above that groups of 4 rows are taken block by block, each
//!   block staged once into an aligned buffer, with the token passes outermost; see
//!   [`super::avx512`]). Callers should pass the
//!   whole chunk in one call (as they do today) instead of looping tokens; per-token
//!   results equal [`gemv`] bit for bit.
//! - **Tuning** — the instruction-set cap, the one-token AVX-512 kernel's rows side by
//!   side and prefetch distance and the batched kernel's staging form are one
//!   [`super::tuning::KernelTuning`], installed once per process (the stage from its
//!   configuration; `K3_*` variables are parsed by k3-orch); speed settings only, never a
//!   result.
//! - **lm_head** — one [`gemm`] call (rows = vocab) parallelises over 256 KiB row blocks
//!   on the current pool; nothing else is needed.
//! - **Pool** — products use `rayon::current_num_threads()`; run the forward inside
//!   `pool.install(..)` of a pool sized/pinned to the stage's CPUs. `threads <= 1` keeps a
//!   product on the calling thread.
//! - **f64 outputs** — [`gemm64`] (f32 input, unrounded f64 output) is as fast as
//!   [`gemm`].
//!
//! # Threads
//!
//! Products with more than [`PAR_MIN_WEIGHTS`] multiply-adds run on the *current* rayon
//! pool (`rayon::current_num_threads()`; the stage confines it with `pool.install`), split
//! into row blocks whose size depends only on the matrix shape and the token count. The
//! `threads` argument is a hint: `threads <= 1` runs on the calling thread, anything else
//! uses the current pool.

use rayon::prelude::*;

use super::bf16x3;
use super::mxfp4;
use super::portable::{self, AlignedBuf};
use super::simd::{Isa, Kernel, ProductPath};

pub use super::portable::{reduce_lanes, LANES};

/// How the weight bytes encode the matrix.
#[derive(Clone, Copy, Debug)]
pub enum MatData<'a> {
    /// Row-major bf16, little-endian, `rows * cols * 2` bytes.
    Bf16(&'a [u8]),
    /// Row-major f32, little-endian, `rows * cols * 4` bytes.
    F32(&'a [u8]),
    /// compressed-tensors MXFP4: `packed` is `[rows, ceil(cols/2)]` (low nibble = even
    /// column), `scales` is `[rows, ceil(cols/32)]` E8M0 bytes.
    Mxfp4 { packed: &'a [u8], scales: &'a [u8] },
}

/// A borrowed weight matrix `W ∈ R^{rows×cols}` (nn.Linear convention, `y = W x`).
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    pub rows: usize,
    pub cols: usize,
    pub data: MatData<'a>,
}

/// A matrix whose bytes do not fit its declared shape.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ShapeError(pub String);

impl<'a> Mat<'a> {
    /// A bf16 matrix; checks the byte count.
    pub fn bf16(bytes: &'a [u8], rows: usize, cols: usize) -> Result<Self, ShapeError> {
        Self::check(bytes.len(), rows * cols * 2, "bf16", rows, cols)?;
        Ok(Mat {
            rows,
            cols,
            data: MatData::Bf16(bytes),
        })
    }

    /// An f32 matrix; checks the byte count.
    pub fn f32(bytes: &'a [u8], rows: usize, cols: usize) -> Result<Self, ShapeError> {
        Self::check(bytes.len(), rows * cols * 4, "f32", rows, cols)?;
        Ok(Mat {
            rows,
            cols,
            data: MatData::F32(bytes),
        })
    }

    /// An MXFP4 matrix of logical shape `rows × cols`; checks both byte counts.
    pub fn mxfp4(
        packed: &'a [u8],
        scales: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self, ShapeError> {
        Self::check(
            packed.len(),
            rows * cols.div_ceil(2),
            "mxfp4 packed",
            rows,
            cols,
        )?;
        Self::check(
            scales.len(),
            rows * cols.div_ceil(mxfp4::GROUP),
            "mxfp4 scale",
            rows,
            cols,
        )?;
        Ok(Mat {
            rows,
            cols,
            data: MatData::Mxfp4 { packed, scales },
        })
    }

    fn check(
        got: usize,
        want: usize,
        what: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(), ShapeError> {
        if got != want {
            return Err(ShapeError(format!(
                "{what} matrix {rows}x{cols} needs {want} bytes, got {got}"
            )));
        }
        Ok(())
    }

    /// Bytes of weight data read by one product (for bandwidth accounting).
    pub fn weight_bytes(&self) -> usize {
        match self.data {
            MatData::Bf16(b) | MatData::F32(b) => b.len(),
            MatData::Mxfp4 { packed, scales } => packed.len() + scales.len(),
        }
    }

    /// Dot product of row `r` with `x` (len `cols`), on the installed kernels.
    pub fn row_dot(&self, r: usize, x: &[f32]) -> f32 {
        self.row_dot_on(r, x, &Kernel::current())
    }

    /// Row dot on the portable kernels regardless of the CPU (for tests and benchmarks).
    pub fn row_dot_portable(&self, r: usize, x: &[f32]) -> f32 {
        self.row_dot_on(r, x, &Kernel::on(Isa::Portable))
    }

    fn row_dot_on(&self, r: usize, x: &[f32], k: &Kernel) -> f32 {
        assert_eq!(x.len(), self.cols, "row_dot input length");
        assert!(r < self.rows, "row_dot row");
        let xp = Prepared::new(k, x, self.cols, 1);
        let mut out = [0f64; 1];
        rows_on(k, self, (r, r + 1), &xp, 1, &mut out);
        out[0] as f32
    }
}

/// A product's input, prepared once for its kernel's product path: permuted into lane
/// order for `exact` ([`portable::permute_tokens`]), split into bf16 parts for `bf16x3`
/// ([`bf16x3::split_tokens`]).
pub struct Prepared {
    data: PreparedData,
    cols: usize,
    ntok: usize,
}

enum PreparedData {
    Lanes(AlignedBuf<f32>),
    Parts(AlignedBuf<u16>),
    #[cfg(target_arch = "x86_64")]
    Tiles(super::amx::Tiles),
}

impl Prepared {
    /// `ntok` tokens of `cols` activations (`xs`, token-major) prepared for `kernel`.
    pub fn new(kernel: &Kernel, xs: &[f32], cols: usize, ntok: usize) -> Prepared {
        assert!(xs.len() >= ntok * cols, "input length");
        let data = match kernel.product() {
            #[cfg(target_arch = "x86_64")]
            ProductPath::Bf16x3 if kernel.on_amx() => {
                PreparedData::Tiles(super::amx::prepare(xs, cols, ntok))
            }
            ProductPath::Exact => PreparedData::Lanes(portable::permute_tokens(xs, cols, ntok)),
            ProductPath::Bf16x3 => PreparedData::Parts(bf16x3::split_tokens(xs, cols, ntok)),
        };
        Prepared { data, cols, ntok }
    }
}

/// The products' one dispatch: sums of rows `r0..r1` × `ntok` prepared tokens `x`
/// (`out[(r - r0) * ntok + t]`) on kernel `k`, by product path and instruction set. A new
/// product path or instruction set adds its arm here; the format dispatch below it is
/// shared ([`super::format::with_format`]).
fn rows_on(
    k: &Kernel,
    m: &Mat<'_>,
    (r0, r1): (usize, usize),
    x: &Prepared,
    ntok: usize,
    out: &mut [f64],
) {
    assert!(
        x.cols == m.cols && ntok <= x.ntok,
        "input prepared for another shape"
    );
    match (k.product(), k.isa(), &x.data) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a Kernel's instruction set is one the CPU has (Kernel::current caps it
        // at the detected best, Kernel::on checks it): avx512f, avx2 and fma here.
        (ProductPath::Exact, Isa::Avx512, PreparedData::Lanes(xp)) => unsafe {
            super::avx512::rows_f32(m, r0, r1, xp, ntok, out, k.tuning())
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above: avx2 and fma were detected.
        (ProductPath::Exact, Isa::Avx2, PreparedData::Lanes(xp)) => unsafe {
            super::avx2::rows_f32(m, r0, r1, xp, ntok, out)
        },
        (ProductPath::Exact, _, PreparedData::Lanes(xp)) => {
            portable::rows_f32(m, r0, r1, xp, ntok, out)
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a bf16x3 Kernel is on AVX-512 only where the CPU has the bf16 dot
        // product (Kernel::current and Kernel::with_path check bf16_dot_available):
        // avx512f, avx512bw, avx512bf16, avx2 and fma.
        (ProductPath::Bf16x3, Isa::Avx512, PreparedData::Parts(xs)) => unsafe {
            super::avx512bf16::rows(m, r0, r1, xs, ntok, out, k.tuning())
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a Kernel on AMX exists only where amx::available() (Kernel::current and
        // Kernel::amx check it), and only it prepares tiles.
        (ProductPath::Bf16x3, Isa::Avx512, PreparedData::Tiles(xt)) => unsafe {
            super::amx::rows(m, r0, r1, xt, out)
        },
        (ProductPath::Bf16x3, _, PreparedData::Parts(xs)) => {
            bf16x3::rows_portable(m, r0, r1, xs, ntok, out)
        }
        (p, _, _) => panic!("an input prepared for another product path than {p:?}"),
    }
}

thread_local! {
    /// Each thread's task sums ([`run`]), kept between tasks.
    static SUMS: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Below this many multiply-adds (rows × cols × tokens, summed over fused matrices) a
/// product runs on the calling thread only.
pub const PAR_MIN_WEIGHTS: usize = 1 << 18;

/// Weight bytes per rayon task at one token (smaller with more tokens).
pub const TASK_BYTES: usize = 256 << 10;

/// Activation bytes (`ntok × cols × 4`) from which a batched product's tasks take at least
/// [`PROMPT_TASK_ROWS`] rows: past a few MiB the prompt's activations no longer stay in
/// the last-level cache between tasks, and each task reads all of them again from memory.
pub const PROMPT_X_BYTES: usize = 8 << 20;

/// Fewest rows per task of a product whose activations reach [`PROMPT_X_BYTES`]: every
/// task streams the whole input (in the AVX-512 kernel, one pass of 16 tokens at a time,
/// reused by all the task's row groups from L2), so its rows set the multiply-adds per
/// byte read. With 16-row tasks a 512-token prompt ran `o_proj` (12 288 columns) at 36
/// GMAC per CPU-second and the dense FFN's down projection (33 792) at 27; with 96 at
/// 51-59 and 41-46 (`kernel_micro bf16 512 --direct`, loaded machine, indicative).
pub const PROMPT_TASK_ROWS: usize = 96;

/// Rows per task for `m` at `ntok` tokens: a function of the shape only (never of the
/// thread count), a multiple of 8 (of 16 when batched), so the decode tiles of 2, 4 or 8
/// rows divide it.
pub fn task_rows(m: &Mat<'_>, ntok: usize) -> usize {
    let row_bytes = (m.weight_bytes() / m.rows.max(1)).max(1);
    if ntok > 1 {
        // Batched: whole groups of rows (the AVX-512 kernel stages 4 rows a block at a
        // time and prefetches the next group while it computes), at least 16 per task,
        // and at least PROMPT_TASK_ROWS once the input outgrows the caches.
        let per = TASK_BYTES / (row_bytes * ntok.min(8));
        let least = if ntok * m.cols * 4 >= PROMPT_X_BYTES {
            PROMPT_TASK_ROWS
        } else {
            16
        };
        return per.max(least).div_ceil(16) * 16;
    }
    let per = TASK_BYTES / row_bytes;
    per.max(8).div_ceil(8) * 8
}

/// Output pointer shared by the tasks of one product.
#[derive(Clone, Copy)]
struct OutPtr<O>(*mut O, usize);
// SAFETY: tasks write disjoint elements (distinct (row, token) pairs) of a buffer that
// outlives the parallel region; O: Send.
unsafe impl<O: Send> Send for OutPtr<O> {}
// SAFETY: as above; no element is read or written by two tasks.
unsafe impl<O: Send> Sync for OutPtr<O> {}

/// Run the products of `mats` (same `cols`) on one prepared input on `kernel`; `outs[i]`
/// is `ntok × mats[i].rows`, token-major, each sum passed through `conv` (a generic, so
/// inlined in the copy loop: as a function pointer, its call per value was 3-4% of a
/// 512-token prompt's samples).
#[allow(clippy::too_many_arguments)]
fn run<O: Copy + Send, C: Fn(f64) -> O + Sync>(
    kernel: &Kernel,
    mats: &[&Mat<'_>],
    xp: &Prepared,
    outs: &mut [&mut [O]],
    ntok: usize,
    threads: usize,
    conv: C,
) {
    assert_eq!(mats.len(), outs.len(), "one output per matrix");
    for (m, o) in mats.iter().zip(outs.iter()) {
        assert_eq!(o.len(), ntok * m.rows, "gemm output length");
        assert_eq!(m.cols, mats[0].cols, "fused matrices share cols");
    }
    if ntok == 0 {
        return;
    }
    let ptrs: Vec<OutPtr<O>> = outs
        .iter_mut()
        .map(|o| OutPtr(o.as_mut_ptr(), o.len()))
        .collect();
    let task = |i: usize, r0: usize, r1: usize| {
        let m = mats[i];
        // This thread's sums, kept between tasks (zeroed for each): a fresh vector a task
        // (up to 400 KB in a prompt) cost page faults and page clearing every time.
        let mut sums = SUMS.with(|s| s.take());
        sums.clear();
        sums.resize((r1 - r0) * ntok, 0.0);
        rows_on(kernel, m, (r0, r1), xp, ntok, &mut sums);
        let OutPtr(p, len) = ptrs[i];
        // Eight tokens at a time: each row's eight sums are one cache line, and each
        // token's rows one run of the output. (Row by row every write went to another
        // line: 9% of a 512-token prompt's samples; token by token every read, `ntok`
        // sums apart, to another line and page: 3-4%.)
        for t0 in (0..ntok).step_by(8) {
            let t1 = ntok.min(t0 + 8);
            for r in r0..r1 {
                let row = &sums[(r - r0) * ntok + t0..(r - r0) * ntok + t1];
                for (t, &v) in (t0..t1).zip(row) {
                    let k = t * m.rows + r;
                    assert!(k < len);
                    // SAFETY: k < len of outs[i], which outlives this call; (r, t) belongs
                    // to this task only (row ranges are disjoint), so no other task
                    // touches k.
                    unsafe { *p.add(k) = conv(v) };
                }
            }
        }
        SUMS.with(|s| s.replace(sums));
    };
    let work: usize = mats.iter().map(|m| m.rows * m.cols).sum::<usize>() * ntok;
    if threads <= 1 || work < PAR_MIN_WEIGHTS || rayon::current_num_threads() <= 1 {
        for (i, m) in mats.iter().enumerate() {
            if m.rows > 0 {
                task(i, 0, m.rows);
            }
        }
        return;
    }
    let mut tasks = Vec::new();
    for (i, m) in mats.iter().enumerate() {
        let step = task_rows(m, ntok);
        // The AMX kernel's row tiles go in pairs or chunks (`amx::task_rows_multiple`).
        #[cfg(target_arch = "x86_64")]
        let step = if kernel.on_amx() {
            let whole = super::amx::task_rows_multiple(ntok);
            step.div_ceil(whole) * whole
        } else {
            step
        };
        let mut r0 = 0;
        while r0 < m.rows {
            let r1 = (r0 + step).min(m.rows);
            tasks.push((i, r0, r1));
            r0 = r1;
        }
    }
    tasks.par_iter().for_each(|&(i, r0, r1)| task(i, r0, r1));
}

/// `y = W x` (`threads`: see the module doc).
pub fn gemv(m: &Mat<'_>, x: &[f32], y: &mut [f32], threads: usize) {
    gemm(m, x, y, 1, threads);
}

/// `ys[t] = W xs[t]` for `t < ntok`; `xs` is `ntok × cols`, `ys` is `ntok × rows`.
///
/// A batched, register-blocked GEMM: each weight row is read from memory once for all
/// tokens (SIMD: 4 rows × 2 tokens per inner loop on AVX-512), and every
/// (row, token) result is the dot product [`gemv`] computes, bit for bit.
pub fn gemm(m: &Mat<'_>, xs: &[f32], ys: &mut [f32], ntok: usize, threads: usize) {
    gemm_fused(&[m], xs, &mut [ys], ntok, threads);
}

/// Several products sharing one input: `outs[i][t] = mats[i] · xs[t]`, every matrix with
/// the same `cols`, `outs[i]` being `ntok × mats[i].rows`. The input is permuted once and
/// all row blocks of all matrices form one parallel region (one fork/join instead of one
/// per matrix). Each result is bit-identical to [`gemm`] of that matrix alone.
///
/// Wire it where products read the same input: gate+up of an FFN, the q/k/v/g (and b,
/// f_a) projections of KDA, q_a/kv_a of MLA.
pub fn gemm_fused(
    mats: &[&Mat<'_>],
    xs: &[f32],
    outs: &mut [&mut [f32]],
    ntok: usize,
    threads: usize,
) {
    let Some(first) = mats.first() else { return };
    assert_eq!(xs.len(), ntok * first.cols, "gemm input length");
    let kernel = Kernel::current();
    let xp = Prepared::new(&kernel, xs, first.cols, ntok);
    run(&kernel, mats, &xp, outs, ntok, threads, |v| v as f32);
}

/// [`gemm_fused`] returning the unrounded f64 sums.
pub fn gemm_fused64(
    mats: &[&Mat<'_>],
    xs: &[f32],
    outs: &mut [&mut [f64]],
    ntok: usize,
    threads: usize,
) {
    let Some(first) = mats.first() else { return };
    assert_eq!(xs.len(), ntok * first.cols, "gemm input length");
    let kernel = Kernel::current();
    let xp = Prepared::new(&kernel, xs, first.cols, ntok);
    run(&kernel, mats, &xp, outs, ntok, threads, |v| v);
}

/// [`gemm`] returning the unrounded f64 sums (for a caller that adds two products and
/// rounds once). Same contract and speed as [`gemm`].
pub fn gemm64(m: &Mat<'_>, xs: &[f32], ys: &mut [f64], ntok: usize, threads: usize) {
    gemm_fused64(&[m], xs, &mut [ys], ntok, threads);
}

/// `y = W x` on the `exact` path's portable twin, single-threaded (the reference the SIMD
/// tests use).
pub fn gemv_portable(m: &Mat<'_>, x: &[f32], y: &mut [f32]) {
    assert_eq!(y.len(), m.rows, "gemv output length");
    let xp = portable::permute_tokens(x, m.cols, 1);
    let mut sums = vec![0f64; m.rows];
    portable::rows_f32(m, 0, m.rows, &xp, 1, &mut sums);
    for (o, s) in y.iter_mut().zip(sums) {
        *o = s as f32;
    }
}

/// [`gemm`] on explicit kernels, single-threaded (tests and benchmarks: `Kernel::on`
/// panics when the CPU lacks the instruction set, it never runs another one instead).
pub fn gemm_on(kernel: &Kernel, m: &Mat<'_>, xs: &[f32], ys: &mut [f32], ntok: usize) {
    assert_eq!(xs.len(), ntok * m.cols, "gemm input length");
    assert_eq!(ys.len(), ntok * m.rows, "gemm output length");
    let xp = Prepared::new(kernel, xs, m.cols, ntok);
    let mut sums = vec![0f64; m.rows * ntok];
    rows_on(kernel, m, (0, m.rows), &xp, ntok, &mut sums);
    for r in 0..m.rows {
        for t in 0..ntok {
            ys[t * m.rows + r] = sums[r * ntok + t] as f32;
        }
    }
}

/// The row kernel alone on explicit kernels, single-threaded: `xp` is already prepared
/// for `kernel` ([`Prepared::new`]) and `out` receives the unrounded sums of every row ×
/// token (`out[r * ntok + t]`). For benchmarks that time the inner loops without the
/// input's preparation and the output conversion.
pub fn rows_prepared_on(kernel: &Kernel, m: &Mat<'_>, xp: &Prepared, ntok: usize, out: &mut [f64]) {
    assert!(out.len() >= m.rows * ntok, "output length");
    rows_on(kernel, m, (0, m.rows), xp, ntok, out);
}
