//! What the products' inner loops can reach on this CPU, stripped of everything else
//! (issue 10's roofline). Not the kernels: hand-written loops of the same shape, so the
//! kernels' own figures (`gemv_bench`, `kernel_micro`) can be read against them.
//!
//! 1. **Decode** (weights from DRAM, 2 threads): a BF16 matrix of the lm_head's shape
//!    read 4 rows side by side, 64 bytes of each row in turn, with the kernels' T0
//!    prefetch 1024 bytes ahead, doing per 64-byte line:
//!    - `load only`: an integer add (the read probe's work);
//!    - `exact f32`: the reduction contract's work: widen the 32 bf16 to two f32 vectors
//!      (shift, and) and two f32 FMAs with the f32 activations;
//!    - `bf16 dot, x hi+lo`: two `vdpbf16ps` (AVX512-BF16) with the activation split into
//!      two bf16 halves (16 of its 24 mantissa bits);
//!    - `bf16 dot, x hi`: one `vdpbf16ps`, activations rounded to bf16 (llama.cpp's form).
//! 2. **Prefill tile** (one thread, the weights of one staged block in L1): the batched
//!    kernel's 4 rows x 2 tokens register tile, `exact f32` (widen once per pair of tokens,
//!    16 FMAs) against `bf16 dot, x hi+lo` (16 `vdpbf16ps`), then the exact tile with the
//!    contract's f64 promotion at each block end over 16 tokens of 7168-column inputs
//!    (the kernel without its staging copy and without DRAM); then the exact tile staged
//!    as f32 (two plain loads per row and group, no widening) and the core's FMA ceiling
//!    (16 independent FMA chains in registers, no load).
//!
//! The bf16-dot rows need AVX512-BF16 (skipped without it) and do not follow the
//! reduction contract: they measure what that instruction would buy, nothing more.
//!
//! Run: `cargo run --release -p k3-layer-compute --example roofline_probe`.

#[cfg(target_arch = "x86_64")]
mod probe {
    use std::arch::x86_64::*;
    use std::hint::black_box;
    use std::time::Instant;

    /// The 32 bf16 of `v` as the dot instruction's operand type (same 64 bytes).
    #[inline(always)]
    fn bh(v: __m512i) -> __m512bh {
        // SAFETY: both are 64-byte plain SIMD values; every bit pattern is valid for both.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// The hidden size: every matrix here has this many columns.
    pub const COLS: usize = 7168;
    /// Bytes of one bf16 row.
    pub const ROW: usize = COLS * 2;
    /// Rows per rayon task (the kernels' one-token task is 24 rows of this width).
    const TASK_ROWS: usize = 24;

    #[derive(Clone, Copy, PartialEq)]
    pub enum Work {
        LoadOnly,
        Exact,
        DotHiLo,
        DotHi,
    }

    impl Work {
        pub fn name(self) -> &'static str {
            match self {
                Work::LoadOnly => "load only",
                Work::Exact => "exact f32 (widen + 2 FMA)",
                Work::DotHiLo => "bf16 dot, x hi+lo (2 vdpbf16ps)",
                Work::DotHi => "bf16 dot, x hi (1 vdpbf16ps)",
            }
        }
    }

    /// Rows `r0..r1` (a multiple of 4) of the matrix `w` with the work `k`.
    ///
    /// # Safety
    /// AVX-512F, BW and (for the dot forms) AVX512-BF16 must be present; `w` holds the
    /// rows; `xf` holds `COLS` f32 and `xh`, `xl` `ROW` bytes each.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn rows(w: &[u8], (r0, r1): (usize, usize), xf: &[f32], xh: &[u8], xl: &[u8], k: Work) {
        // SAFETY (whole body): every address is inside `w`, `xf`, `xh` or `xl`
        // (c < ROW, rows < r1); prefetches never fault.
        unsafe {
            let m = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            let mut r = r0;
            while r + 4 <= r1 {
                let mut a = [_mm512_setzero_ps(); 8];
                let mut s = [_mm512_setzero_si512(); 4];
                let base = w.as_ptr().add(r * ROW);
                let mut c = 0;
                while c < ROW {
                    for j in 0..4 {
                        let p = base.add(j * ROW + c);
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(1024) as *const i8);
                        let v = _mm512_loadu_si512(p as *const _);
                        match k {
                            Work::LoadOnly => s[j] = _mm512_add_epi64(s[j], v),
                            Work::Exact => {
                                let x0 = _mm512_loadu_ps(xf.as_ptr().add(c / 2));
                                let x1 = _mm512_loadu_ps(xf.as_ptr().add(c / 2 + 16));
                                let e = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                                let o = _mm512_castsi512_ps(_mm512_and_si512(v, m));
                                a[2 * j] = _mm512_fmadd_ps(e, x0, a[2 * j]);
                                a[2 * j + 1] = _mm512_fmadd_ps(o, x1, a[2 * j + 1]);
                            }
                            Work::DotHiLo | Work::DotHi => {
                                let wb = bh(v);
                                let h: __m512bh =
                                    bh(_mm512_loadu_si512(xh.as_ptr().add(c) as *const _));
                                a[2 * j] = _mm512_dpbf16_ps(a[2 * j], wb, h);
                                if k == Work::DotHiLo {
                                    let l: __m512bh =
                                        bh(_mm512_loadu_si512(xl.as_ptr().add(c) as *const _));
                                    a[2 * j + 1] = _mm512_dpbf16_ps(a[2 * j + 1], wb, l);
                                }
                            }
                        }
                    }
                    c += 64;
                }
                black_box((a, s));
                r += 4;
            }
        }
    }

    /// GB/s of weight bytes for one pass of `k` over `w` on `pool`.
    pub fn decode_rate(pool: &rayon::ThreadPool, w: &[u8], k: Work) -> f64 {
        use rayon::prelude::*;
        let xf: Vec<f32> = (0..COLS).map(|i| 1.0 + i as f32 * 1e-6).collect();
        let (xh, xl) = (vec![0x3cu8; ROW], vec![0x30u8; ROW]);
        let nrows = w.len() / ROW / TASK_ROWS * TASK_ROWS;
        let t = Instant::now();
        pool.install(|| {
            (0..nrows / TASK_ROWS).into_par_iter().for_each(|i| {
                // SAFETY: features checked by the caller (`has_features`); buffers sized
                // as `rows` requires.
                unsafe { rows(w, (i * TASK_ROWS, (i + 1) * TASK_ROWS), &xf, &xh, &xl, k) }
            })
        });
        (nrows * ROW) as f64 / t.elapsed().as_secs_f64() / 1e9
    }

    /// f64 lane sums of one (row, token): 32 f64.
    #[repr(C, align(64))]
    pub struct Sums(pub [[f64; 32]; 4 * 16]);

    /// One staged block (4 rows x 32 groups of bf16, group-major) times `ntok` tokens in
    /// tiles of 2 (`x + t * xs` the token's block); `dot`: the bf16-dot form (`xb` holds
    /// per token and group 64 bytes of hi halves then 64 of lo halves); `sums`: promote
    /// each tile into `sums`' f64 lane sums at the end (the contract) when `prom`, else a
    /// plain add.
    ///
    /// # Safety
    /// As [`rows`]; `sums` is valid and unaliased; `w` holds 8 KiB; every token has 1024
    /// values at its pointer (or 4 KiB of `xb` for the dot form).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::needless_range_loop)] // (row, token) indices, as in the kernel
    pub unsafe fn tile_block(
        w: *const u8,
        (x, xs, xb): (*const f32, usize, *const u8),
        ntok: usize,
        dot: bool,
        (sums, prom): (*mut Sums, bool),
    ) -> __m512 {
        // SAFETY (whole body): reads inside the block and the tokens' blocks (caller);
        // sums indices < 4 * 16.
        unsafe {
            let m = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            let mut tot = _mm512_setzero_ps();
            let mut t0 = 0;
            while t0 + 2 <= ntok {
                let mut a = [[[_mm512_setzero_ps(); 2]; 2]; 4];
                for q in 0..32 {
                    let g = w.add(q * 256);
                    if dot {
                        let mut wv: [__m512bh; 4] = std::mem::zeroed();
                        for (j, wj) in wv.iter_mut().enumerate() {
                            *wj = bh(_mm512_load_si512(g.add(64 * j) as *const _));
                        }
                        for t in 0..2 {
                            let p = xb.add(((t0 + t) * 32 + q) * 128);
                            let h: __m512bh = bh(_mm512_loadu_si512(p as *const _));
                            let l: __m512bh = bh(_mm512_loadu_si512(p.add(64) as *const _));
                            for j in 0..4 {
                                a[j][t][0] = _mm512_dpbf16_ps(a[j][t][0], wv[j], h);
                                a[j][t][1] = _mm512_dpbf16_ps(a[j][t][1], wv[j], l);
                            }
                        }
                    } else {
                        let mut wv = [[_mm512_setzero_ps(); 2]; 4];
                        for (j, wj) in wv.iter_mut().enumerate() {
                            let v = _mm512_load_si512(g.add(64 * j) as *const _);
                            *wj = [
                                _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                                _mm512_castsi512_ps(_mm512_and_si512(v, m)),
                            ];
                        }
                        for t in 0..2 {
                            let xq = x.add((t0 + t) * xs + 32 * q);
                            let (x0, x1) = (_mm512_loadu_ps(xq), _mm512_loadu_ps(xq.add(16)));
                            for j in 0..4 {
                                a[j][t][0] = _mm512_fmadd_ps(wv[j][0], x0, a[j][t][0]);
                                a[j][t][1] = _mm512_fmadd_ps(wv[j][1], x1, a[j][t][1]);
                            }
                        }
                    }
                }
                for (j, aj) in a.iter().enumerate() {
                    for (t, ajt) in aj.iter().enumerate() {
                        if prom {
                            let acc = &mut (*sums).0[j * 16 + t0 + t];
                            for (h, v) in ajt.iter().enumerate() {
                                let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(*v));
                                let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                                    _mm512_castps_pd(*v),
                                    1,
                                )));
                                let p = acc.as_mut_ptr().add(16 * h);
                                _mm512_storeu_pd(p, _mm512_add_pd(_mm512_loadu_pd(p), lo));
                                _mm512_storeu_pd(
                                    p.add(8),
                                    _mm512_add_pd(_mm512_loadu_pd(p.add(8)), hi),
                                );
                            }
                        } else {
                            tot = _mm512_add_ps(tot, _mm512_add_ps(ajt[0], ajt[1]));
                        }
                    }
                }
                t0 += 2;
            }
            tot
        }
    }

    /// The f32-staged form of the exact tile (the kernels' [`WeightStaging::F32`]): one
    /// block of 4 rows x 32 groups of lane-ordered f32 (group-major, 128 bytes a row), two
    /// plain loads per row and group, no integer operation; 2-token tiles, plain adds at
    /// the end.
    ///
    /// # Safety
    /// AVX-512F present; `w` holds 16 KiB; every token has 1024 values at `x + t * xs`.
    ///
    /// [`WeightStaging::F32`]: k3_layer_compute::kernels::tuning::WeightStaging::F32
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_block_f32(w: *const f32, x: *const f32, xs: usize, ntok: usize) -> __m512 {
        // SAFETY (whole body): reads inside the block and the tokens' blocks (caller).
        unsafe {
            let mut tot = _mm512_setzero_ps();
            let mut t0 = 0;
            while t0 + 2 <= ntok {
                let mut a = [[[_mm512_setzero_ps(); 2]; 2]; 4];
                for q in 0..32 {
                    let g = w.add(q * 128);
                    for t in 0..2 {
                        let xq = x.add((t0 + t) * xs + 32 * q);
                        let (x0, x1) = (_mm512_loadu_ps(xq), _mm512_loadu_ps(xq.add(16)));
                        for (j, aj) in a.iter_mut().enumerate() {
                            let wj = g.add(32 * j);
                            aj[t][0] = _mm512_fmadd_ps(_mm512_load_ps(wj), x0, aj[t][0]);
                            aj[t][1] = _mm512_fmadd_ps(_mm512_load_ps(wj.add(16)), x1, aj[t][1]);
                        }
                    }
                }
                for aj in &a {
                    for ajt in aj {
                        tot = _mm512_add_ps(tot, _mm512_add_ps(ajt[0], ajt[1]));
                    }
                }
                t0 += 2;
            }
            tot
        }
    }

    /// The core's FMA ceiling: `n` rounds of 16 independent zmm FMA chains, registers
    /// only (no load at all); returns multiply-adds per second.
    ///
    /// # Safety
    /// AVX-512F present.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_peak(n: usize) -> f64 {
        let x = _mm512_set1_ps(black_box(0.999_999_9));
        let y = _mm512_set1_ps(black_box(1e-7));
        // Distinct starting values, so that no two chains can be merged.
        let mut a: [__m512; 16] = std::array::from_fn(|i| _mm512_set1_ps(black_box(i as f32)));
        let t = Instant::now();
        for _ in 0..n {
            for v in a.iter_mut() {
                *v = _mm512_fmadd_ps(*v, x, y);
            }
        }
        let dt = t.elapsed().as_secs_f64();
        black_box(&a);
        (n * 16 * 16) as f64 / dt
    }

    pub fn has_features() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16")
    }
}

#[cfg(target_arch = "x86_64")]
fn main() {
    use probe::*;
    use std::time::Instant;
    let uptime = || {
        std::process::Command::new("uptime")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    println!("uptime at start: {}", uptime());
    if !has_features() {
        println!("needs AVX-512F, BW and BF16 (the bf16-dot rows are the point): skipped");
        return;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("rayon pool");
    // The lm_head's shape (163840 x 7168 bf16, 2.35 GB), 16 bytes past a line as the
    // slice's tensors sit.
    let rows = 163_840usize;
    let mut buf = vec![0u8; rows * ROW + 128];
    let off = buf.as_ptr().align_offset(64) + 16;
    for (i, b) in buf.iter_mut().enumerate() {
        // Bytes 1..=0x3f: no bf16 with a zero exponent. A subnormal weight (the former
        // `& 0x3f` made 1 in 64) costs Intel cores a microcode assist per FMA: the exact
        // row read 5.8 GB/s on the Xeon of 2026-12-03 (AMD runs them at full speed).
        *b = ((i.wrapping_mul(2_654_435_761) >> 13) as u8 & 0x3f).max(1);
    }
    let w = &buf[off..off + rows * ROW];
    println!(
        "\n== decode: 4 rows side by side, T0 prefetch 1024 B, 2 threads, 2.35 GB from DRAM (GB/s)"
    );
    let works = [Work::LoadOnly, Work::Exact, Work::DotHiLo, Work::DotHi];
    for round in 1..=4 {
        let line: Vec<String> = works
            .iter()
            .map(|&k| format!("{} {:.1}", k.name(), decode_rate(&pool, w, k)))
            .collect();
        println!("round {round}: {}", line.join(" | "));
    }

    println!("\n== prefill tile: 4 rows x 2 tokens, one staged block in L1, one thread (GMAC/s)");
    #[repr(C, align(64))]
    struct Block([u8; 8192]);
    let blk = Box::new(Block([0x3f; 8192]));
    #[repr(C, align(64))]
    struct Block32([f32; 4096]);
    let blk32 = Box::new(Block32(std::array::from_fn(|i| {
        0.5 + (i % 7) as f32 * 0.01
    })));
    let xf: Vec<f32> = (0..16 * COLS).map(|i| 1.0 + i as f32 * 1e-7).collect();
    let xb = vec![0x3cu8; 16 * 32 * 128];
    let mut sums = Box::new(Sums([[0.0; 32]; 64]));
    let reps = 40_000usize;
    for round in 1..=3 {
        let mut out = Vec::new();
        for (name, ntok, xs, dot, prom) in [
            ("exact f32, 2 tokens", 2usize, 1024usize, false, false),
            ("bf16 dot hi+lo, 2 tokens", 2, 1024, true, false),
            (
                "exact f32 + f64 promotion, 16 tokens of 7168 cols",
                16,
                COLS,
                false,
                true,
            ),
            ("the same without the promotion", 16, COLS, false, false),
        ] {
            let t = Instant::now();
            let n = reps * 16 / ntok;
            for r in 0..n {
                // Block r % 7 of the 7168-column rows when the tokens are that wide.
                let x = xf
                    .as_ptr()
                    .wrapping_add(if xs == COLS { (r % 7) * 1024 } else { 0 });
                // SAFETY: features checked above; the block is 8 KiB, every token has
                // 1024 values from x (xs = COLS: 7 blocks per row) and 4 KiB of xb.
                let v = unsafe {
                    tile_block(
                        blk.0.as_ptr(),
                        (x, xs, xb.as_ptr()),
                        ntok,
                        dot,
                        (&mut *sums, prom),
                    )
                };
                std::hint::black_box(v);
            }
            let macs = (n * 4 * ntok * 1024) as f64;
            out.push(format!(
                "{name} {:.1}",
                macs / t.elapsed().as_secs_f64() / 1e9
            ));
        }
        // The f32-staged tile (2 tokens, 16 KiB block) and the FMA ceiling.
        let t = Instant::now();
        let n = reps * 8;
        for _ in 0..n {
            // SAFETY: features checked above; the block is 16 KiB and the two tokens have
            // 1024 values each.
            std::hint::black_box(unsafe { tile_block_f32(blk32.0.as_ptr(), xf.as_ptr(), 1024, 2) });
        }
        out.push(format!(
            "exact f32, f32 staged, 2 tokens {:.1}",
            (n * 4 * 2 * 1024) as f64 / t.elapsed().as_secs_f64() / 1e9
        ));
        // SAFETY: features checked above.
        let peak = unsafe { fma_peak(50_000_000) };
        out.push(format!("FMA ceiling (registers only) {:.1}", peak / 1e9));
        println!("round {round}: {}", out.join(" | "));
    }
    std::hint::black_box(&sums);
    println!("\nuptime at end: {}", uptime());
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("x86_64 only");
}
