//! Run-time choice of the kernels: the product path and the instruction set ([`Kernel`]).
//!
//! - **Instruction set** ([`Isa`]: portable, AVX2+FMA, AVX-512F). Every one performs the
//!   operations of its product path's contract in the same order, lane for lane, so all
//!   give bit-identical results (`tests/kernels_bitexact.rs` checks that on random and
//!   special inputs): the choice is a speed decision only. The best one the CPU supports
//!   is detected once (`is_x86_feature_detected!`; the build's target features are never
//!   changed) and capped by the installed tuning ([`super::tuning`]: `K3_SIMD`,
//!   `K3_FORCE_PORTABLE`). The activations ([`super::act`]), the KDA recurrence
//!   ([`super::kda::delta_step`]) and the MLA attention core ([`super::mla`]) follow the
//!   same choice: one body compiled for the chosen vector width, bit-identical on every
//!   path (tested in `act.rs`, `kda.rs` and `mla.rs`).
//! - **Product path** ([`ProductPath`]): which numerics contract the matrix products
//!   follow (design.md, "Product paths"); one per run, for every product.
//!   - `exact` ([`super::matmul`]): every instruction set above.
//!   - `bf16x3` ([`super::bf16x3`]): the AVX512-BF16 kernel ([`super::avx512bf16`],
//!     `vdpbf16ps`; needs AVX-512F, AVX-512BW and AVX512_BF16: [`bf16_dot_available`]) and
//!     its bit-exact portable twin; and, where the CPU has AMX-BF16 ([`amx_available`]),
//!     the AMX kernel ([`super::amx`], `bf16x3/amx`), which has no twin and other bits:
//!     on such a CPU it is the path's kernel for every product (`K3_AMX=0` keeps the
//!     AVX512-BF16 one). No AVX2 kernel exists for it (AVX2 has no bf16 dot product): on a
//!     CPU without AVX512_BF16 the path runs on the portable twin (the same bits, slowly),
//!     named `bf16x3/portable` in reports.
//!
//!   Chosen by `K3_SIMD=exact|bf16x3` (installed tuning), else automatically
//!   ([`auto_product`]): `exact` unless [`super::tuning::AUTO_BF16X3`] says the bf16x3
//!   kernel is faster on a CPU that has it (today it says no: on AVX512-BF16 without
//!   AMX three `vdpbf16ps` passes cost 1.5 FMAs' time per multiply-add; on AMX the decode
//!   measured slower than `exact`).
//!
//! Tests that compare instruction sets ask [`runnable`] first (product paths:
//! [`runnable_path`]): a set the host lacks is reported as `SKIPPED:` (never silently
//! replaced by another), and fails the test when `K3_REQUIRE_SIMD` names it (CI sets it
//! from the host's CPU flags: `avx2`, `avx512`, `bf16x3`).

use std::io::Write;
use std::sync::OnceLock;

pub use k3_protocol::conf::{Isa, ProductPath};

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

/// Whether this CPU has the bf16 dot-product instructions the `bf16x3` kernel uses:
/// AVX-512F, AVX-512BW (`vpermw`, `vpermt2w`) and AVX512_BF16 (`vdpbf16ps`), beside AVX2
/// and FMA (detected once).
pub fn bf16_dot_available() -> bool {
    static HAVE: OnceLock<bool> = OnceLock::new();
    *HAVE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            avx512_available()
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Whether the `bf16x3` path's AMX kernel runs here ([`super::amx::available`]: AMX-TILE,
/// AMX-BF16, the AVX512-BF16 kernel's features and the kernel's permission).
pub fn amx_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU has a kernel for `product` on `isa`: `exact` on every instruction set
/// it has; `bf16x3` on the portable twin everywhere and on AVX-512 where
/// [`bf16_dot_available`].
pub fn path_available(product: ProductPath, isa: Isa) -> bool {
    match product {
        ProductPath::Exact => available(isa),
        ProductPath::Bf16x3 => match isa {
            Isa::Portable => true,
            Isa::Avx2 => false,
            Isa::Avx512 => bf16_dot_available(),
        },
    }
}

/// The product path "automatic" means on this CPU: `bf16x3` where its hardware kernel
/// runs and [`tuning::AUTO_BF16X3`] prefers it, else `exact`.
pub fn auto_product() -> ProductPath {
    if tuning::AUTO_BF16X3 && bf16_dot_available() {
        ProductPath::Bf16x3
    } else {
        ProductPath::Exact
    }
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
    /// `bf16x3` on the AMX kernel (only where [`amx_available`]).
    amx: bool,
    tuning: DriverTuning,
}

/// Whether a `bf16x3` kernel on `isa` runs on AMX under tuning `t`: where the CPU has it,
/// unless `K3_AMX=0`.
fn use_amx(t: &KernelTuning, product: ProductPath, isa: Isa) -> bool {
    product == ProductPath::Bf16x3 && isa == Isa::Avx512 && t.amx != Some(false) && amx_available()
}

/// The product path and instruction set tuning `t` selects on a CPU whose best
/// instruction set is `best` and that has the bf16 dot product or not (`bf16`); `auto` is
/// what "automatic" means there.
#[doc(hidden)]
pub fn select(t: &KernelTuning, best: Isa, bf16: bool, auto: ProductPath) -> (ProductPath, Isa) {
    let product = t.product.unwrap_or(auto);
    let cap = t.max_isa.unwrap_or(Isa::Avx512).min(best);
    let isa = match product {
        ProductPath::Exact => cap,
        ProductPath::Bf16x3 if cap == Isa::Avx512 && bf16 => Isa::Avx512,
        ProductPath::Bf16x3 => Isa::Portable,
    };
    (product, isa)
}

impl Kernel {
    /// The kernels the installed tuning selects on this CPU: its product path (else
    /// [`auto_product`]) on the widest instruction set that path has here within the cap.
    #[inline]
    pub fn current() -> Kernel {
        let t = tuning::current();
        let (product, isa) = select(&t, best_available(), bf16_dot_available(), auto_product());
        Kernel {
            product,
            isa,
            amx: use_amx(&t, product, isa),
            tuning: DriverTuning::of(&t),
        }
    }

    /// The kernels tuning `t` would select on this CPU if installed (what a stage given `t`
    /// runs: the report's and `doctor`'s product path).
    pub fn selected(t: &KernelTuning) -> Kernel {
        let (product, isa) = select(t, best_available(), bf16_dot_available(), auto_product());
        Kernel {
            product,
            isa,
            amx: use_amx(t, product, isa),
            tuning: DriverTuning::of(t),
        }
    }

    /// The installed kernels of the `exact` path with the instruction set `isa`; panics
    /// when the CPU lacks it ([`checked`]).
    pub fn on(isa: Isa) -> Kernel {
        Kernel::with(isa, &tuning::current())
    }

    /// The installed kernels of `product` on `isa`; panics when this CPU has no such kernel
    /// ([`path_available`]): a test or benchmark that asks for one never runs another.
    pub fn on_path(product: ProductPath, isa: Isa) -> Kernel {
        Kernel::with_path(product, isa, &tuning::current())
    }

    /// The `exact` kernels of instruction set `isa` with the drivers' tuning of `t` (its
    /// cap and product path are not used), whatever is installed: tests and benchmarks
    /// that compare tunings. Panics when the CPU lacks `isa` ([`checked`]).
    pub fn with(isa: Isa, t: &KernelTuning) -> Kernel {
        Kernel::with_best(isa, t, best_available())
    }

    /// [`Kernel::with`] for the product path `product`; panics when this CPU has no such
    /// kernel ([`path_available`]).
    pub fn with_path(product: ProductPath, isa: Isa, t: &KernelTuning) -> Kernel {
        assert!(
            path_available(product, isa),
            "the {} kernels on {} were asked for, but this CPU has none (best instruction \
             set {}, bf16 dot product: {})",
            product.name(),
            isa.name(),
            best_available().name(),
            bf16_dot_available()
        );
        Kernel {
            product,
            isa,
            amx: false,
            tuning: DriverTuning::of(t),
        }
    }

    /// The `bf16x3` path's AMX kernel with the drivers' tuning of `t`; panics when this
    /// CPU cannot run it ([`amx_available`]). ([`Kernel::with_path`] gives the AVX512-BF16
    /// kernel on such a CPU.)
    pub fn amx(t: &KernelTuning) -> Kernel {
        assert!(
            amx_available(),
            "the bf16x3 AMX kernel was asked for, but this CPU (or its kernel) has no AMX-BF16"
        );
        Kernel {
            product: ProductPath::Bf16x3,
            isa: Isa::Avx512,
            amx: true,
            tuning: DriverTuning::of(t),
        }
    }

    /// [`Kernel::with`] on a CPU whose best instruction set is `best`.
    #[doc(hidden)]
    pub fn with_best(isa: Isa, t: &KernelTuning, best: Isa) -> Kernel {
        Kernel {
            product: ProductPath::Exact,
            isa: checked_against(isa, best),
            amx: false,
            tuning: DriverTuning::of(t),
        }
    }

    /// The numerics contract.
    pub fn product(&self) -> ProductPath {
        self.product
    }

    /// The instruction set (one this CPU has for the product path).
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Whether this is the `bf16x3` path's AMX kernel.
    pub fn on_amx(&self) -> bool {
        self.amx
    }

    /// Loop shapes and prefetch distances (never a result).
    pub fn tuning(&self) -> &DriverTuning {
        &self.tuning
    }

    /// Name for reports: `exact/avx512`, `bf16x3/amx`, `bf16x3/avx512bf16`,
    /// `bf16x3/portable`.
    pub fn name(&self) -> String {
        let isa = match (self.product, self.isa) {
            _ if self.amx => "amx",
            (ProductPath::Bf16x3, Isa::Avx512) => "avx512bf16",
            (_, isa) => isa.name(),
        };
        format!("{}/{}", self.product.name(), isa)
    }
}

/// Whether a test may run `isa` here. If the CPU lacks it, prints `SKIPPED: <test>:
/// <why>` to the real stderr (where `.ci/run` collects it; the harness captures the print
/// macros) and returns false, or panics when `K3_REQUIRE_SIMD` (a comma-separated list of
/// instruction set and product path names) names it. A name there that is neither panics
/// too, so a typo cannot turn the requirement off.
pub fn runnable(test: &str, isa: Isa) -> bool {
    let required = required();
    decide(test, verdict(isa, best_available(), &required.0))
}

/// Whether a test may run `product`'s hardware kernel here (`exact`: always; `bf16x3`:
/// where [`bf16_dot_available`]); as [`runnable`], `K3_REQUIRE_SIMD=bf16x3` turns a skip
/// into a failure. (The portable twin of every path runs everywhere.)
pub fn runnable_path(test: &str, product: ProductPath) -> bool {
    let have = match product {
        ProductPath::Exact => true,
        ProductPath::Bf16x3 => bf16_dot_available(),
    };
    decide(test, path_verdict(product, have, &required().1))
}

/// Whether a test may run the `bf16x3` AMX kernel here ([`amx_available`]); as
/// [`runnable`], `K3_REQUIRE_SIMD=amx` turns a skip into a failure.
pub fn runnable_amx(test: &str) -> bool {
    let required = required().2;
    let v = (!amx_available()).then(|| {
        let why = "this CPU has no AMX-BF16 kernel (it lacks AMX-TILE/AMX-BF16 or AVX512_BF16, \
                   or the kernel refused the tile state)";
        if required {
            Err(format!("{why}, and K3_REQUIRE_SIMD requires it"))
        } else {
            Ok(why.to_string())
        }
    });
    decide(test, v)
}

/// Act on a verdict: run (true), skip with a `SKIPPED:` line (false) or fail.
fn decide(test: &str, v: Option<Result<String, String>>) -> bool {
    match v {
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
#[doc(hidden)]
pub fn verdict(isa: Isa, best: Isa, required: &[Isa]) -> Option<Result<String, String>> {
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

/// [`runnable_path`]'s decision for `product`, whose hardware kernel this CPU has or not.
#[doc(hidden)]
pub fn path_verdict(
    product: ProductPath,
    have: bool,
    required: &[ProductPath],
) -> Option<Result<String, String>> {
    if have {
        return None;
    }
    let why = format!(
        "this CPU has no {} kernel (it lacks AVX512_BF16 with AVX-512BW)",
        product.name()
    );
    Some(if required.contains(&product) {
        Err(format!("{why}, and K3_REQUIRE_SIMD requires it"))
    } else {
        Ok(why)
    })
}

/// The instruction sets, product paths and AMX kernel `K3_REQUIRE_SIMD` names (a test
/// hook: see [`runnable`]).
fn required() -> (Vec<Isa>, Vec<ProductPath>, bool) {
    parse_required(&std::env::var("K3_REQUIRE_SIMD").unwrap_or_default())
}

/// The instruction sets and product paths a `K3_REQUIRE_SIMD` value names, and whether it
/// names `amx` (the `bf16x3` AMX kernel: [`runnable_amx`]); panics on a name that is none
/// of them.
#[doc(hidden)]
pub fn parse_required(v: &str) -> (Vec<Isa>, Vec<ProductPath>, bool) {
    let (mut isas, mut paths, mut amx) = (Vec::new(), Vec::new(), false);
    for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if let Some(i) = Isa::from_name(s) {
            isas.push(i);
        } else if let Some(p) = ProductPath::from_name(s) {
            paths.push(p);
        } else if s == "amx" {
            amx = true;
        } else {
            panic!(
                "K3_REQUIRE_SIMD={v:?}: {s:?} is none of portable, avx2, avx512, exact, bf16x3, \
                 amx"
            );
        }
    }
    (isas, paths, amx)
}
