//! Run-time choice of the kernels: the product path and the instruction set ([`Kernel`]).
//!
//! - **Instruction set** ([`Isa`]: portable, AVX2+FMA, AVX-512F). Every one performs the
//!   operations of the reduction contract (see [`super::matmul`]) in the same order, lane
//!   for lane, so all give bit-identical results (`tests/kernels_bitexact.rs` checks that
//!   on random and special inputs): the choice is a speed decision only. The best one the
//!   CPU supports is detected once (`is_x86_feature_detected!`; the build's target
//!   features are never changed) and capped by the installed tuning
//!   ([`super::tuning`]: `K3_SIMD`, `K3_FORCE_PORTABLE`). The activations
//!   ([`super::act`]) and the KDA recurrence ([`super::kda::delta_step`]) follow the same
//!   choice: one body compiled for the chosen vector width, bit-identical on every path
//!   (tested in `act.rs` and `kda.rs`).
//! - **Product path** ([`ProductPath`]): which numerics contract the matrix products
//!   follow (design.md, "Product paths"). Today only `exact`; a second path (bf16x3) adds a
//!   variant, its row kernels and one arm in [`super::matmul`]'s dispatch, beside the
//!   instruction set, without another copy of the format dispatch.
//!
//! Tests that compare instruction sets ask [`runnable`] first: a set the host lacks is
//! reported as `SKIPPED:` (never silently replaced by another), and fails the test when
//! `K3_REQUIRE_SIMD` names it (CI sets it from the host's CPU flags).

use std::io::Write;
use std::sync::OnceLock;

pub use k3_protocol::conf::Isa;

use super::tuning::{self, DriverTuning, KernelTuning};

/// The best instruction set this CPU supports (detected once).
pub fn best_available() -> Isa {
    static HAVE: OnceLock<Isa> = OnceLock::new();
    *HAVE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma");
            let avx512 = avx2 && std::arch::is_x86_feature_detected!("avx512f");
            if avx512 {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    })
}

/// Whether this CPU can run `isa`.
pub fn available(isa: Isa) -> bool {
    isa <= best_available()
}

/// Whether this CPU has AVX2 and FMA (detected once).
pub fn avx2_available() -> bool {
    available(Isa::Avx2)
}

/// Whether this CPU has AVX-512F (detected once).
pub fn avx512_available() -> bool {
    available(Isa::Avx512)
}

/// The instruction set the kernels run on now: the best available, capped by the
/// installed tuning.
#[inline]
pub fn isa() -> Isa {
    tuning::current()
        .max_isa
        .unwrap_or(Isa::Avx512)
        .min(best_available())
}

/// `isa`, which the caller asked for explicitly: panics when the CPU lacks it (a test
/// or benchmark that asks for an instruction set must never run another one instead).
pub fn checked(isa: Isa) -> Isa {
    checked_against(isa, best_available())
}

/// [`checked`] on a CPU whose best instruction set is `best`.
fn checked_against(isa: Isa, best: Isa) -> Isa {
    assert!(
        isa <= best,
        "the {} kernels were asked for, but this CPU's best is {}",
        isa.name(),
        best.name()
    );
    isa
}

/// The numerics contract of the matrix products (design.md, "Product paths").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProductPath {
    /// f32 FMA inside fixed 1024-column blocks, promoted to f64 between blocks, fixed
    /// tree: the reduction contract of [`super::matmul`], bit-identical on every
    /// instruction set.
    Exact,
}

impl ProductPath {
    /// Name for reports.
    pub fn name(self) -> &'static str {
        match self {
            ProductPath::Exact => "exact",
        }
    }
}

/// The matrix products' kernels: a product path, an instruction set the CPU has, and the
/// drivers' tuning. Chosen once per product from the installed tuning ([`Kernel::current`]),
/// or explicitly by tests and benchmarks ([`Kernel::on`]); [`super::matmul`] dispatches on
/// it in one place.
/// Its fields are private so that the instruction set is always one this CPU has (the
/// dispatch relies on it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    product: ProductPath,
    isa: Isa,
    tuning: DriverTuning,
}

impl Kernel {
    /// The kernels the installed tuning selects on this CPU.
    #[inline]
    pub fn current() -> Kernel {
        let t = tuning::current();
        Kernel {
            product: ProductPath::Exact,
            isa: t.max_isa.unwrap_or(Isa::Avx512).min(best_available()),
            tuning: DriverTuning::of(&t),
        }
    }

    /// The installed kernels with the instruction set `isa`; panics when the CPU lacks it
    /// ([`checked`]).
    pub fn on(isa: Isa) -> Kernel {
        Kernel::with(isa, &tuning::current())
    }

    /// The kernels of instruction set `isa` with the drivers' tuning of `t` (its cap is
    /// not used), whatever is installed: tests and benchmarks that compare tunings. Panics
    /// when the CPU lacks `isa` ([`checked`]).
    pub fn with(isa: Isa, t: &KernelTuning) -> Kernel {
        Kernel::with_best(isa, t, best_available())
    }

    /// [`Kernel::with`] on a CPU whose best instruction set is `best`.
    fn with_best(isa: Isa, t: &KernelTuning, best: Isa) -> Kernel {
        Kernel {
            product: ProductPath::Exact,
            isa: checked_against(isa, best),
            tuning: DriverTuning::of(t),
        }
    }

    /// The numerics contract.
    pub fn product(&self) -> ProductPath {
        self.product
    }

    /// The instruction set (one this CPU has).
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Loop shapes and prefetch distances (never a result).
    pub fn tuning(&self) -> &DriverTuning {
        &self.tuning
    }

    /// Name for reports: `exact/avx512`.
    pub fn name(&self) -> String {
        format!("{}/{}", self.product.name(), self.isa.name())
    }
}

/// Whether a test may run `isa` here. If the CPU lacks it, prints `SKIPPED: <test>:
/// <why>` to the real stderr (where `.ci/run` collects it; the harness captures the print
/// macros) and returns false, or panics when `K3_REQUIRE_SIMD` (a comma-separated list of
/// instruction set names) names it. A name there that is no instruction set panics too,
/// so a typo cannot turn the requirement off.
pub fn runnable(test: &str, isa: Isa) -> bool {
    match verdict(isa, best_available(), &required_isas()) {
        None => true,
        Some(Err(why)) => panic!("{test}: {why}"),
        Some(Ok(why)) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED: {test}: {why}");
            false
        }
    }
}

/// [`runnable`]'s decision for `isa` on a CPU whose best is `best`: None to run it, else
/// why not, as `Ok` (skip) or `Err` (fail: `required` names it).
fn verdict(isa: Isa, best: Isa, required: &[Isa]) -> Option<Result<String, String>> {
    if isa <= best {
        return None;
    }
    let why = format!(
        "this CPU lacks {} (its best is {})",
        isa.name(),
        best.name()
    );
    Some(if required.contains(&isa) {
        Err(format!("{why}, and K3_REQUIRE_SIMD requires it"))
    } else {
        Ok(why)
    })
}

/// The instruction sets `K3_REQUIRE_SIMD` names (a test hook: see [`runnable`]).
fn required_isas() -> Vec<Isa> {
    parse_required(&std::env::var("K3_REQUIRE_SIMD").unwrap_or_default())
}

/// The instruction sets a `K3_REQUIRE_SIMD` value names; panics on a name that is none.
fn parse_required(v: &str) -> Vec<Isa> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            Isa::from_name(s).unwrap_or_else(|| {
                panic!("K3_REQUIRE_SIMD={v:?}: {s:?} is none of portable, avx2, avx512")
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Catches: a requirement list read loosely (a typo that turns the requirement off,
    // spaces or an empty value not tolerated).
    #[test]
    fn require_list_parses_strictly() {
        assert_eq!(parse_required(""), vec![]);
        assert_eq!(parse_required("avx2, avx512"), vec![Isa::Avx2, Isa::Avx512]);
        let typo = std::panic::catch_unwind(|| parse_required("avx2,avx-512"));
        assert!(typo.is_err(), "an unknown name must panic");
    }

    // Catches: an instruction set the CPU lacks that is run anyway, or quietly replaced by
    // another (issue 36: `gemm_on` once clamped it, and two tests compared AVX2 with AVX2
    // on a CPU without AVX-512), and a lacking one that K3_REQUIRE_SIMD names but that is
    // only skipped.
    #[test]
    fn a_missing_instruction_set_is_skipped_or_fails_never_replaced() {
        let t = KernelTuning::default();
        for best in Isa::ALL {
            for isa in Isa::ALL {
                let k = std::panic::catch_unwind(|| Kernel::with_best(isa, &t, best));
                assert_eq!(k.is_ok(), isa <= best, "{isa:?} on {best:?}");
                if let Ok(k) = k {
                    assert_eq!(k.isa(), isa, "never another instruction set");
                }
                match verdict(isa, best, &[]) {
                    None => assert!(isa <= best),
                    Some(Ok(why)) => assert!(isa > best && why.contains(isa.name()), "{why}"),
                    Some(Err(why)) => panic!("not required, yet it fails: {why}"),
                }
                let required = verdict(isa, best, &[isa]);
                assert_eq!(matches!(required, Some(Err(_))), isa > best);
            }
        }
        for isa in Isa::ALL {
            let on = std::panic::catch_unwind(|| Kernel::on(isa));
            assert_eq!(on.is_ok(), available(isa));
            if available(isa) {
                assert!(runnable(
                    "a_missing_instruction_set_is_skipped_or_fails",
                    isa
                ));
            }
        }
    }

    // Catches: a cap in the installed tuning that the kernels do not apply.
    #[test]
    fn the_installed_cap_is_applied() {
        let t = KernelTuning {
            max_isa: Some(Isa::Portable),
            ..KernelTuning::default()
        };
        assert_eq!(Kernel::with(Isa::Portable, &t).isa(), Isa::Portable);
        // The only test of this binary that installs a tuning (no setting changes a
        // result, so the others may run meanwhile).
        tuning::install(t);
        assert_eq!(
            (isa(), Kernel::current().isa()),
            (Isa::Portable, Isa::Portable)
        );
        tuning::install(KernelTuning::default());
        assert_eq!(isa(), best_available());
    }
}
