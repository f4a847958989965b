//! The run-time choice of the kernels (`src/kernels/simd.rs`): `K3_REQUIRE_SIMD` read
//! strictly, an instruction set or product path the CPU lacks skipped or failed (never
//! replaced), the installed cap applied, the product path selected.

use k3_layer_compute::kernels::simd::*;
use k3_layer_compute::kernels::tuning::{self, KernelTuning};

use crate::support::kernels_lock;

// Catches: a requirement list read loosely (a typo that turns the requirement off,
// spaces or an empty value not tolerated).
#[test]
fn require_list_parses_strictly() {
    assert_eq!(parse_required(""), (vec![], vec![], false));
    assert_eq!(
        parse_required("avx2, avx512"),
        (vec![Isa::Avx2, Isa::Avx512], vec![], false)
    );
    assert_eq!(
        parse_required("avx2,bf16x3 ,exact"),
        (
            vec![Isa::Avx2],
            vec![ProductPath::Bf16x3, ProductPath::Exact],
            false
        )
    );
    // `amx` is a name (the AMX kernel, read by `runnable_amx`), not a typo.
    assert_eq!(
        parse_required("bf16x3,amx"),
        (vec![], vec![ProductPath::Bf16x3], true)
    );
    for typo in ["avx2,avx-512", "bf16", "bf16x3,amx512"] {
        let r = std::panic::catch_unwind(|| parse_required(typo));
        assert!(r.is_err(), "{typo:?}: an unknown name must panic");
    }
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
    // It installs a tuning: the installed kernels alone until it is back to the default.
    let _turn = kernels_lock();
    tuning::install(t);
    assert_eq!(
        (isa(), Kernel::current().isa()),
        (Isa::Portable, Isa::Portable)
    );
    tuning::install(KernelTuning::default());
    assert_eq!(isa(), best_available());
}

// Catches: a forced product path that is not applied, bf16x3 run on an instruction set
// that has no kernel for it (AVX2, or AVX-512 without the bf16 dot product), a cap
// (`K3_FORCE_PORTABLE`) that bf16x3 ignores, and "automatic" not meaning `auto`.
#[test]
fn the_product_path_is_selected_and_kept_on_a_kernel_it_has() {
    let t = |product, max_isa| KernelTuning {
        product,
        max_isa,
        ..KernelTuning::default()
    };
    let (ex, bf) = (ProductPath::Exact, ProductPath::Bf16x3);
    for best in Isa::ALL {
        for bf16 in [false, true] {
            let bf16 = bf16 && best == Isa::Avx512;
            for auto in ProductPath::ALL {
                assert_eq!(select(&t(None, None), best, bf16, auto).0, auto);
            }
            assert_eq!(select(&t(Some(ex), None), best, bf16, bf), (ex, best));
            let want = if bf16 { Isa::Avx512 } else { Isa::Portable };
            assert_eq!(select(&t(Some(bf), None), best, bf16, ex), (bf, want));
            let capped = t(Some(bf), Some(Isa::Portable));
            assert_eq!(select(&capped, best, bf16, ex), (bf, Isa::Portable));
            let avx2 = t(Some(bf), Some(Isa::Avx2));
            assert_eq!(select(&avx2, best, bf16, ex), (bf, Isa::Portable));
        }
    }
    assert_eq!(
        auto_product(),
        ProductPath::Exact,
        "AUTO_BF16X3 is off today"
    );
}

// Catches: a bf16x3 kernel asked for on a CPU without one that runs anyway, or is
// replaced by another, and a missing bf16x3 that K3_REQUIRE_SIMD names but only skips.
#[test]
fn a_missing_product_path_is_skipped_or_fails_never_replaced() {
    let t = KernelTuning::default();
    for product in ProductPath::ALL {
        for isa in Isa::ALL {
            let k = std::panic::catch_unwind(|| Kernel::with_path(product, isa, &t));
            assert_eq!(
                k.is_ok(),
                path_available(product, isa),
                "{product:?} {isa:?}"
            );
            if let Ok(k) = k {
                assert_eq!((k.product(), k.isa()), (product, isa));
            }
        }
    }
    assert!(!path_available(ProductPath::Bf16x3, Isa::Avx2));
    assert!(path_available(ProductPath::Bf16x3, Isa::Portable));
    let bf = ProductPath::Bf16x3;
    assert_eq!(path_verdict(bf, true, &[bf]), None);
    assert!(matches!(path_verdict(bf, false, &[]), Some(Ok(_))));
    assert!(matches!(path_verdict(bf, false, &[bf]), Some(Err(_))));
    assert!(runnable_path("exact always runs", ProductPath::Exact));
    let name = Kernel::with_path(bf, Isa::Portable, &t).name();
    assert_eq!(name, "bf16x3/portable");
}

// Catches: a `bf16x3` run on an AMX CPU that does not take the AMX kernel, `K3_AMX=0`
// that does not keep the AVX512-BF16 one, and AMX taken for `exact` or under a cap below
// AVX-512 (where the portable twin runs).
#[test]
fn bf16x3_takes_amx_where_the_cpu_has_it() {
    let t = |product, amx, max_isa| KernelTuning {
        product: Some(product),
        amx,
        max_isa,
        ..KernelTuning::default()
    };
    let k = Kernel::selected(&t(ProductPath::Bf16x3, None, None));
    assert_eq!(k.on_amx(), amx_available(), "{}", k.name());
    if amx_available() {
        assert_eq!(k.name(), "bf16x3/amx");
        assert_eq!(Kernel::amx(&KernelTuning::default()), k);
    }
    for off in [
        t(ProductPath::Bf16x3, Some(false), None),
        t(ProductPath::Bf16x3, Some(true), Some(Isa::Avx2)),
        t(ProductPath::Exact, Some(true), None),
    ] {
        let k = Kernel::selected(&off);
        assert!(!k.on_amx(), "{off:?} gave {}", k.name());
    }
}
