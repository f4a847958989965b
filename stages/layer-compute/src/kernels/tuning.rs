//! The product kernels' settings: one [`KernelTuning`] per process, parsed from the
//! environment once at the top and installed, never read from the environment inside a
//! kernel.
//!
//! - **Where it comes from.** k3-orch calls [`from_env`] once: for a staged run it puts the
//!   result in the compute stage's `ComputeConf::tuning`, which the stage [`install`]s at
//!   its start; in-process runs (`--single-process`, `serve --single-process`, `score`)
//!   install it directly. Tests and benchmarks install what they compare. Nothing
//!   installed: every setting automatic ([`KernelTuning::default`]).
//! - **What it holds.** The product path (`K3_SIMD=exact|bf16x3`; automatic:
//!   [`super::simd::auto_product`], which reads [`AUTO_BF16X3`]), the instruction-set cap
//!   (`K3_SIMD=portable|avx2|avx512`, `K3_FORCE_PORTABLE`), the one-token AVX-512
//!   product's rows side by side and prefetch distance (`K3_GEMV_ROWS`, `K3_GEMV_PF`),
//!   the AVX-512 batched product's staging form (`K3_WEIGHT_STAGING`) and whether `bf16x3`
//!   runs on AMX where the CPU has it (`K3_AMX=0`: its AVX512-BF16 kernel). Only the
//!   product path and, under `bf16x3` on an AMX CPU, the AMX choice change results (every
//!   instruction set of a path and every loop shape gives the same bits): install a
//!   tuning with another product path only where no product runs meanwhile (a run
//!   installs one at its start; tests that compare paths serialise).
//! - **How the kernels read it.** Each product reads the installed tuning once (one
//!   atomic load: [`current`]) and passes it down with the chosen kernel
//!   ([`super::simd::Kernel`]); defaults that depend on the CPU (the staging form and the
//!   `exact` one-token prefetch distance, by vendor) are detected once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

pub use k3_protocol::conf::{Isa, KernelTuning, ProductPath, WeightStaging};

/// Default rows per one-token tile of the AVX-512 decode path for BF16 and F32 weights
/// (memory-bound: 4 rows with a 1 KiB prefetch read fastest on Zen 5; see
/// docs/measurements.md, "Kernel notes moved out of the code").
pub const R1: usize = 4;

/// Default rows per one-token tile for MXFP4 weights (bound by the decode, 3 shuffles and
/// a shift per group and row; 4 rows keep every row pointer in a register and read
/// fastest).
pub const R1_MXFP4: usize = 4;

/// Whether "automatic" prefers the `bf16x3` product path on a CPU with the AVX512-BF16
/// kernel (AVX-512F, AVX-512BW, AVX512_BF16). Off: there, without AMX, `vdpbf16ps` does
/// twice an FMA's multiply-adds, so three passes cost 1.5 FMAs' time per multiply-add and
/// the `exact` path is expected to stay faster (issue 32); turn it on only after
/// `gemv_bench` measures bf16x3 faster on such a host. `K3_SIMD=bf16x3` selects the path
/// whatever this says. On AMX it stays off too: a 512-token prompt ran 2.7 times faster,
/// but the decode 1.10-1.14 times slower (docs/measurements.md, "The AMX one-token MXFP4
/// product decoded a group ahead").
pub const AUTO_BF16X3: bool = false;

/// The variables [`from_env`] reads.
pub const ENV_VARS: [&str; 6] = [
    "K3_FORCE_PORTABLE",
    "K3_SIMD",
    "K3_AMX",
    "K3_GEMV_ROWS",
    "K3_GEMV_PF",
    "K3_WEIGHT_STAGING",
];

/// The kernel settings in the environment ([`ENV_VARS`]). A value that is none of the
/// documented ones is reported (a warning naming the variable) and ignored; so is
/// `K3_STAGE`, the former name of `K3_WEIGHT_STAGING`. `K3_SIMD=bf16x3` on a CPU without
/// the AVX512-BF16 kernel is warned about: the portable twin runs it (the same bits,
/// slowly). Call once, at the top of a process that runs or configures the forward.
pub fn from_env() -> KernelTuning {
    let (t, problems) = parse(|k| std::env::var(k).ok());
    for p in problems {
        tracing::warn!("{p}");
    }
    if t.product == Some(ProductPath::Bf16x3) && !super::simd::bf16_dot_available() {
        tracing::warn!(
            "K3_SIMD=bf16x3: this CPU lacks AVX512_BF16 (with AVX-512BW); the bf16x3 path \
             runs on its portable twin (the same bits, far slower)"
        );
    }
    t
}

/// [`from_env`] over any lookup: the tuning and one line per value ignored.
pub fn parse(get: impl Fn(&str) -> Option<String>) -> (KernelTuning, Vec<String>) {
    let mut t = KernelTuning::default();
    let mut problems = Vec::new();
    let forced = get("K3_FORCE_PORTABLE").is_some_and(|v| !v.is_empty() && v != "0");
    if let Some(v) = get("K3_SIMD") {
        // A comma-separated list: an instruction set (the cap) and/or a product path.
        for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match (Isa::from_name(s), ProductPath::from_name(s)) {
                // `avx512` is the widest: no cap.
                (Some(Isa::Avx512), _) => t.max_isa = None,
                (Some(isa), _) => t.max_isa = Some(isa),
                (None, Some(p)) => t.product = Some(p),
                (None, None) => problems.push(format!(
                    "K3_SIMD={v:?}: {s:?} is none of portable, avx2, avx512, exact, bf16x3: \
                     ignored"
                )),
            }
        }
    }
    if forced {
        t.max_isa = Some(Isa::Portable);
    }
    if let Some(v) = get("K3_GEMV_ROWS") {
        match v.trim().parse::<u8>() {
            Ok(n @ (2 | 4 | 6 | 8)) => t.decode_rows = Some(n),
            _ => problems.push(format!(
                "K3_GEMV_ROWS={v:?} is none of 2, 4, 6, 8: the format's default"
            )),
        }
    }
    if let Some(v) = get("K3_GEMV_PF") {
        match v.trim().parse::<u32>() {
            Ok(n) => t.decode_prefetch = Some(n),
            Err(_) => problems.push(format!(
                "K3_GEMV_PF={v:?} is not a byte count: the format's default"
            )),
        }
    }
    if let Some(v) = get("K3_WEIGHT_STAGING") {
        match v.trim() {
            "bf16" => t.weight_staging = Some(WeightStaging::Bf16),
            "f32" => t.weight_staging = Some(WeightStaging::F32),
            _ => problems.push(format!(
                "K3_WEIGHT_STAGING={v:?} is neither bf16 nor f32: by CPU vendor ({:?})",
                default_weight_staging()
            )),
        }
    }
    if let Some(v) = get("K3_AMX") {
        match v.trim() {
            "0" | "off" => t.amx = Some(false),
            "1" | "on" => t.amx = Some(true),
            _ => problems.push(format!(
                "K3_AMX={v:?} is none of 0, 1, off, on: AMX where the CPU has it"
            )),
        }
    }
    if let Some(v) = get("K3_STAGE") {
        problems.push(format!(
            "K3_STAGE={v:?} is ignored: the variable is now K3_WEIGHT_STAGING"
        ));
    }
    (t, problems)
}

/// The installed tuning, packed ([`pack`]); 0 is [`KernelTuning::default`].
static INSTALLED: AtomicU64 = AtomicU64::new(0);

/// Install `t` for the whole process (the stage at its start, k3-orch for in-process
/// runs, tests and benchmarks). Products that start afterwards use it; results never
/// change.
pub fn install(t: KernelTuning) {
    INSTALLED.store(pack(&t), Ordering::Relaxed);
}

/// The installed tuning ([`KernelTuning::default`] when none was).
#[inline]
pub fn current() -> KernelTuning {
    unpack(INSTALLED.load(Ordering::Relaxed))
}

/// `t` in 48 bits, so that one atomic holds it: the cap (bits 0-1: 0 none, else the
/// [`Isa`] discriminant), the staging form (2-3: 0 none, 1 bf16, 2 f32), the decode rows
/// (4-11, present if bit 12), the prefetch distance (13-44, present if bit 45) and the
/// product path (46-47: 0 automatic, 1 exact, 2 bf16x3) and the AMX choice (48-49: 0
/// automatic, 1 off, 2 on).
#[doc(hidden)]
pub fn pack(t: &KernelTuning) -> u64 {
    let isa = t.max_isa.map_or(0, |i| i as u64);
    let staging = match t.weight_staging {
        None => 0,
        Some(WeightStaging::Bf16) => 1,
        Some(WeightStaging::F32) => 2,
    };
    let rows = t.decode_rows.map_or(0, |r| (r as u64) << 4 | 1 << 12);
    let pf = t.decode_prefetch.map_or(0, |p| (p as u64) << 13 | 1 << 45);
    let product: u64 = match t.product {
        None => 0,
        Some(ProductPath::Exact) => 1,
        Some(ProductPath::Bf16x3) => 2,
    };
    let amx: u64 = match t.amx {
        None => 0,
        Some(false) => 1,
        Some(true) => 2,
    };
    isa | staging << 2 | rows | pf | product << 46 | amx << 48
}

/// The inverse of [`pack`].
#[doc(hidden)]
pub fn unpack(v: u64) -> KernelTuning {
    KernelTuning {
        max_isa: match v & 3 {
            1 => Some(Isa::Portable),
            2 => Some(Isa::Avx2),
            3 => Some(Isa::Avx512),
            _ => None,
        },
        weight_staging: match (v >> 2) & 3 {
            1 => Some(WeightStaging::Bf16),
            2 => Some(WeightStaging::F32),
            _ => None,
        },
        decode_rows: (v & 1 << 12 != 0).then_some((v >> 4) as u8),
        decode_prefetch: (v & 1 << 45 != 0).then_some((v >> 13) as u32),
        product: match (v >> 46) & 3 {
            1 => Some(ProductPath::Exact),
            2 => Some(ProductPath::Bf16x3),
            _ => None,
        },
        amx: match (v >> 48) & 3 {
            1 => Some(false),
            2 => Some(true),
            _ => None,
        },
    }
}

/// Whether this CPU is an Intel one (CPUID leaf 0's vendor string; detected once).
fn intel() -> bool {
    static INTEL: OnceLock<bool> = OnceLock::new();
    *INTEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // Leaf 0: the vendor string in EBX, EDX, ECX.
            let id = std::arch::x86_64::__cpuid(0);
            let mut v = [0u8; 12];
            v[..4].copy_from_slice(&id.ebx.to_le_bytes());
            v[4..8].copy_from_slice(&id.edx.to_le_bytes());
            v[8..].copy_from_slice(&id.ecx.to_le_bytes());
            &v == b"GenuineIntel"
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// The staging form for this CPU (detected once): [`WeightStaging::F32`] on Intel, where
/// 512-bit integer operations share the FMA ports, [`WeightStaging::Bf16`] elsewhere
/// (Zen 5 issues them beside the FMAs).
pub fn default_weight_staging() -> WeightStaging {
    if intel() {
        WeightStaging::F32
    } else {
        WeightStaging::Bf16
    }
}

/// The `exact` AVX-512 one-token prefetch distance for this CPU when `K3_GEMV_PF` does not
/// set one: 1 KiB on Intel, the format's own default elsewhere (256 B, measured best on
/// Zen 5). On the Intel Xeon of 2026-12-07 (AMX host), a resident decode step of the slice
/// took 346-372 ms with 1 KiB against 373-396 ms with 256 B in four rounds alternated
/// (`K3_PROFILE`: attention, dense FFN, lm_head and shared experts all faster, the MXFP4
/// experts level); 2 KiB ran between the two (docs/measurements.md, "The one-token
/// prefetch distance on Intel").
pub fn default_decode_prefetch() -> Option<usize> {
    intel().then_some(1024)
}

/// What the product drivers read: the installed tuning with the CPU's defaults filled in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverTuning {
    /// One-token AVX-512 rows side by side: 2, 4, 6 or 8 (None, also for any other
    /// installed value: the format's default, [`R1`] or [`R1_MXFP4`]).
    pub decode_rows: Option<usize>,
    /// One-token AVX-512 prefetch distance in bytes (None: the kernel's default; the
    /// `exact` kernel's is [`default_decode_prefetch`] on Intel, else the format's. Left
    /// unresolved here because the AVX512-BF16 kernel keeps its own per-format defaults).
    pub decode_prefetch: Option<usize>,
    /// The AVX-512 batched staging form.
    pub staging: WeightStaging,
}

impl DriverTuning {
    /// `t` resolved for this CPU.
    pub fn of(t: &KernelTuning) -> Self {
        DriverTuning {
            decode_rows: t
                .decode_rows
                .filter(|r| matches!(r, 2 | 4 | 6 | 8))
                .map(usize::from),
            decode_prefetch: t.decode_prefetch.map(|p| p as usize),
            staging: t.weight_staging.unwrap_or_else(default_weight_staging),
        }
    }
}
