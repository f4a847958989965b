//! Every numeric kernel of the Kimi K3 forward, one module per family.
//!
//! Portable kernels are the reference; the AVX2 and AVX-512 product kernels ([`avx2`],
//! [`avx512`]) reproduce the portable twin ([`portable`]) bit for bit, and the `bf16x3`
//! path's AVX512-BF16 kernel ([`avx512bf16`]) its own twin ([`bf16x3`]). Activations are
//! f32 throughout.
//!
//! # Layout of the products
//!
//! - [`matmul`]: the products' API (`gemm`, `gemm_fused`, ...), the `exact` path's
//!   reduction contract and the one dispatch on the product path and instruction set;
//! - [`bf16x3`]: the `bf16x3` path's contract (the split, the hardware step, the order,
//!   the error budget) and its portable twin; [`avx512bf16`]: its AVX512-BF16 kernel;
//! - [`simd`]: which kernels run ([`simd::Kernel`]: product path, instruction set) and the
//!   CPU detection; [`tuning`]: their speed settings, installed once per process;
//! - [`format`]: the weight formats, described once (the format table and the per-format
//!   views), and the one dispatch on the format;
//! - [`ops`]: the per-ISA operations the drivers are written over; [`avx2`], [`avx512`]:
//!   each instruction set's operations and drivers; [`portable`]: the twin and the lane
//!   layout every path shares; [`mxfp4`]: the MXFP4 code and scale tables.
//!
//! # Numerics
//!
//! Each operation, where its contract is written down, and the named error budget or
//! tolerance that holds it (oracle tolerances are FIXTURES.md's, never loosened; "same
//! bits" means every instruction set and every loop shape gives identical results; u32 =
//! 2^-24).
//!
//! | Operation | Contract | Error budget / tolerance | Held by |
//! |---|---|---|---|
//! | Matrix products (all weights, lm_head) | [`matmul`] "Reduction contract": f32 FMA in fixed 1024-column blocks, f64 promotion, fixed halving tree; NaN payloads excepted, same bits | E_block + E_promote + E_tree + E_round: \|y − exact\| ≤ 33·u32·Σ\|w·x\| + u32·\|y\| (≈ 2e-6 relative to Σ\|w·x\|) | `kernels_bitexact` (every path, tuning and staging form; `error_within_documented_budget`), `unit::matmul` |
//! | Matrix products on `bf16x3` (`K3_SIMD=bf16x3`) | [`bf16x3`] "Reduction contract": activations split exactly into three bf16 parts, `vdpbf16ps` steps (DAZ, FTZ after rounding, odd element first) into a hi and a small accumulator per 16-lane column pair, 512-column f32 blocks, f64 promotion, fixed tree; the AVX512-BF16 kernel and the twin give the same bits | E_block + E_small + E_round + E_tiny: \|y − exact\| ≤ 33·u32·A + u32·\|y\| + 2^-126 terms (37·u32·A with F32 weights) | `kernels_bitexact` (`bf16x3_*`, `error_within_documented_budget`), `unit::bf16x3::dp_step_is_the_instruction`; the gates on this path (`gates_tiny`, `ops_seed`, `trace_k3ref`, the demo) |
//! | MXFP4 decode | [`mxfp4`]: `E2M1[code] · 2^(s−127)`, scale 255 → 0, exact in f32 and in bf16 | exact (an MXFP4 product is bit for bit the F32 product of its dequantised matrix) | `mxfp4_equals_dequantised_f32_bitwise`, `every_mxfp4_weight_is_an_exact_bf16`, `ops_seed::mxfp4_real_bytes` |
//! | RMSNorm, KDA L2 norm | [`norm`]: f64 sum of squares in index order, scale rounded once to f32, `(x · inv) · w` in f32 | seed ops: atol 1e-5 + rtol 1e-4 | `ops_seed::rmsnorm`, `ops_seed::kda_module` |
//! | exp, expm1, tanh, sigmoid; SiLU, SiTU-GLU, sigmoid gates | [`act`]: the engine's own f64 exponential (no libm, no fusing), rounded once; same bits on every instruction set | E_exp ≤ 2 (exp, expm1) and 3 (tanh, sigmoid) units of 2^-52 relative to libm; SiTU within one f32 ulp of the libm formula | `unit::act` (`exponential_family_is_accurate`, `situ_within_one_f32_ulp_of_libm`, `paths_match_bit_for_bit`), `ops_seed::situ_glu` |
//! | KDA decay gate | [`kda`]: `g = lb · sigmoid(exp(A_log[h]) · (z + dt_bias))` in f64, rounded once (the sigmoid [`act`]'s, same bits on every instruction set; `exp(A_log[h])` libm f64), `α = exp(g)` libm f32 (its last bit may differ between platforms' libm) | seed ops: atol 1e-5 + rtol 1e-4 | `ops_seed::kda_decay` |
//! | KDA delta-rule recurrence | [`kda::delta_step`]: f32, each product and sum rounded once, never fused, index order; same bits on every instruction set | seed ops: atol 1e-5 + rtol 1e-4 | `unit::kda` (`delta_step_paths_match_the_four_sweeps_bit_for_bit`), `ops_seed::kda_recurrence` |
//! | Short convolution + SiLU | [`conv`]: f64 tap sums oldest to newest, then [`act`]'s SiLU | seed ops: atol 1e-5 + rtol 1e-4 | `ops_seed::shortconv`, `ops_seed::shortconv_width_one` |
//! | MoE router | [`router`]: f32 sigmoid scores, top-k of `s + bias` (ties to the lower id), unbiased weights renormalised by `Σ + 1e-20`, times the scaling factor | selected sets exact; weights atol 1e-5 + rtol 1e-4 | `ops_seed::router_topk_renormalised_and_scaled`, `ops_seed::router_tie_breaks_to_lower_id` |
//! | Softmax (MLA attention, AttnRes) | [`mla`], [`attnres`]: f64 scores, max subtracted, libm f64 `exp`, f64 sums in position / source order, rounded once | seed ops: atol 1e-5 + rtol 1e-4 | `ops_seed::mla_module`, `ops_seed::attnres_mix` |
//! | Whole layers and models | all of the above composed (FIXTURES.md, "Tolerances to assert") | greedy ids exact; tiny-seed logits atol 1e-4, tiny-mxfp4 atol 1e-3; trace arrays 5e-4 of their largest value | `gates_tiny`, `trace_k3ref`, `ops_seed::decoder_layers`, `ops_seed::moe_module`, the e2e golden and demo tests |

pub mod act;
#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod attnres;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "x86_64")]
pub mod avx512bf16;
pub mod bf16x3;
pub mod conv;
pub mod format;
pub mod kda;
pub mod matmul;
pub mod mla;
pub mod mxfp4;
pub mod norm;
pub mod ops;
pub mod portable;
pub mod router;
pub mod simd;
pub mod tuning;
