//! Every numeric kernel of the Kimi K3 forward, one module per family.
//!
//! Portable kernels are the reference; the AVX2 kernels in [`simd`] reproduce the GEMV
//! kernels bit for bit. Activations are f32 throughout.

pub mod act;
pub mod attnres;
pub mod conv;
pub mod gemv;
pub mod kda;
pub mod mla;
pub mod mxfp4;
pub mod norm;
pub mod router;
pub mod simd;
