//! Every numeric kernel of the Kimi K3 forward, one module per family.
//!
//! Portable kernels are the reference; the AVX2 and AVX-512 product kernels ([`avx2`],
//! [`avx512`], chosen at run time by [`simd`]) reproduce the portable twin ([`portable`])
//! bit for bit. Activations are f32 throughout. The reduction contract is in [`gemv`].

pub mod act;
pub mod attnres;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod conv;
pub mod format;
pub mod gemv;
pub mod kda;
pub mod mla;
pub mod mxfp4;
pub mod norm;
pub mod ops;
pub mod portable;
pub mod router;
pub mod simd;
pub mod tuning;
