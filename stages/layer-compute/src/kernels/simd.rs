//! Run-time choice of the product kernels: portable, AVX2+FMA, or AVX-512F.
//!
//! Every path performs the operations of the reduction contract (see [`super::gemv`]) in
//! the same order, lane for lane, so all three give bit-identical results; the tests in
//! `avx2.rs`, `avx512.rs` and `tests/kernels_bitexact.rs` check that on random inputs.
//! The choice is therefore a speed decision only. The KDA recurrence
//! ([`super::kda::delta_step`]) follows the same choice: its one body compiled for the
//! chosen vector width, bit-identical on every path (tested in `kda.rs`).
//!
//! The best path the CPU supports is detected once (`is_x86_feature_detected!`; the build's
//! target features are never changed). `K3_FORCE_PORTABLE=1` in the environment, or
//! [`set_force_portable`], forces the portable kernels; `K3_SIMD=avx2` (or
//! [`set_max_path`]) caps the choice at AVX2.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// A kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Path {
    /// Scalar Rust (`mul_add`), the reference twin.
    Portable = 1,
    /// AVX2 + FMA (the x86-64 baseline of this engine).
    Avx2 = 2,
    /// AVX-512F (zmm registers, same contract).
    Avx512 = 3,
}

impl Path {
    /// Name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Path::Portable => "portable",
            Path::Avx2 => "avx2",
            Path::Avx512 => "avx512",
        }
    }
}

/// 0 = follow the environment, otherwise the `Path` discriminant of the cap.
static CAP: AtomicU8 = AtomicU8::new(0);

fn env_cap() -> Path {
    static ENV: OnceLock<Path> = OnceLock::new();
    *ENV.get_or_init(|| {
        let forced = std::env::var("K3_FORCE_PORTABLE")
            .map(|v| !v.is_empty() && v != "0")
            .unwrap_or(false);
        if forced {
            return Path::Portable;
        }
        match std::env::var("K3_SIMD").as_deref() {
            Ok("portable") => Path::Portable,
            Ok("avx2") => Path::Avx2,
            Ok("avx512") | Err(_) => Path::Avx512,
            Ok(other) => {
                tracing::warn!(
                    "K3_SIMD={other:?} is none of portable, avx2, avx512: no cap (the best path)"
                );
                Path::Avx512
            }
        }
    })
}

/// The best path this CPU supports (detected once).
pub fn best_available() -> Path {
    static HAVE: OnceLock<Path> = OnceLock::new();
    *HAVE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma");
            let avx512 = avx2 && std::arch::is_x86_feature_detected!("avx512f");
            if avx512 {
                return Path::Avx512;
            }
            if avx2 {
                return Path::Avx2;
            }
        }
        Path::Portable
    })
}

/// Whether this CPU has AVX2 and FMA (detected once).
pub fn avx2_available() -> bool {
    best_available() >= Path::Avx2
}

/// Whether this CPU has AVX-512F (detected once).
pub fn avx512_available() -> bool {
    best_available() >= Path::Avx512
}

/// Force (true) or release (false) the portable path for the whole process.
pub fn set_force_portable(force: bool) {
    set_max_path(if force { Path::Portable } else { Path::Avx512 });
}

/// Cap the path for the whole process (benchmarks, tests). `Path::Avx512` lifts the cap
/// (the CPU still decides what is available).
pub fn set_max_path(cap: Path) {
    CAP.store(cap as u8, Ordering::SeqCst);
}

/// The path products run on now: the best available, capped.
#[inline]
pub fn path() -> Path {
    let cap = match CAP.load(Ordering::Relaxed) {
        1 => Path::Portable,
        2 => Path::Avx2,
        3 => Path::Avx512,
        _ => env_cap(),
    };
    cap.min(best_available())
}

/// Whether products currently run on a SIMD kernel (AVX2 or AVX-512).
#[inline]
pub fn avx2_enabled() -> bool {
    path() >= Path::Avx2
}

/// The kernel family in use, for reports.
pub fn path_name() -> &'static str {
    path().name()
}
