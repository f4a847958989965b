//! The kernels' tuning (`src/kernels/tuning.rs`): its packing, the environment it is read
//! from, and its hop to the stage in `ComputeConf`.

use k3_layer_compute::kernels::tuning::*;

fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

// Catches: a packing that drops or mixes up a field (the atomic is the only copy).
#[test]
fn pack_round_trips_every_field() {
    let mut cases = vec![KernelTuning::default()];
    for isa in [
        None,
        Some(Isa::Portable),
        Some(Isa::Avx2),
        Some(Isa::Avx512),
    ] {
        for st in [None, Some(WeightStaging::Bf16), Some(WeightStaging::F32)] {
            for rows in [None, Some(0u8), Some(6), Some(255)] {
                for pf in [None, Some(0u32), Some(512), Some(u32::MAX)] {
                    for product in [None, Some(ProductPath::Exact), Some(ProductPath::Bf16x3)] {
                        for amx in [None, Some(false), Some(true)] {
                            cases.push(KernelTuning {
                                max_isa: isa,
                                decode_rows: rows,
                                decode_prefetch: pf,
                                weight_staging: st,
                                product,
                                amx,
                            });
                        }
                    }
                }
            }
        }
    }
    for t in cases {
        assert_eq!(unpack(pack(&t)), t);
    }
    assert_eq!(pack(&KernelTuning::default()), 0);
}

// Catches: a variable read under another name, a cap that `K3_FORCE_PORTABLE` does not
// override, an unknown value taken silently (it must be reported), and the old
// `K3_STAGE` honoured or ignored without a word.
#[test]
fn parse_reads_every_variable_and_reports_unknown_values() {
    let (t, p) = parse(env(&[]));
    assert_eq!((t, p.len()), (KernelTuning::default(), 0));
    let (t, p) = parse(env(&[
        ("K3_SIMD", "avx2"),
        ("K3_GEMV_ROWS", "6"),
        ("K3_GEMV_PF", " 2048 "),
        ("K3_WEIGHT_STAGING", "f32"),
        ("K3_AMX", "0"),
    ]));
    assert!(p.is_empty(), "{p:?}");
    let want = KernelTuning {
        max_isa: Some(Isa::Avx2),
        decode_rows: Some(6),
        decode_prefetch: Some(2048),
        weight_staging: Some(WeightStaging::F32),
        product: None,
        amx: Some(false),
    };
    assert_eq!(t, want);
    let (t, p) = parse(env(&[("K3_SIMD", "bf16x3")]));
    assert!(p.is_empty(), "{p:?}");
    assert_eq!((t.product, t.max_isa), (Some(ProductPath::Bf16x3), None));
    let (t, p) = parse(env(&[("K3_SIMD", " exact, avx2 ")]));
    assert!(p.is_empty(), "{p:?}");
    assert_eq!(
        (t.product, t.max_isa),
        (Some(ProductPath::Exact), Some(Isa::Avx2))
    );
    let (t, _) = parse(env(&[("K3_SIMD", "bf16x3"), ("K3_FORCE_PORTABLE", "1")]));
    assert_eq!(
        (t.product, t.max_isa),
        (Some(ProductPath::Bf16x3), Some(Isa::Portable))
    );
    let (t, _) = parse(env(&[("K3_SIMD", "avx512"), ("K3_FORCE_PORTABLE", "1")]));
    assert_eq!(t.max_isa, Some(Isa::Portable));
    let (t, _) = parse(env(&[("K3_SIMD", "avx512"), ("K3_FORCE_PORTABLE", "0")]));
    assert_eq!(t.max_isa, None);
    let (t, p) = parse(env(&[
        ("K3_SIMD", "sse"),
        ("K3_GEMV_ROWS", "3"),
        ("K3_GEMV_PF", "far"),
        ("K3_WEIGHT_STAGING", "fp8"),
        ("K3_AMX", "maybe"),
        ("K3_STAGE", "bf16"),
    ]));
    assert_eq!(t, KernelTuning::default());
    assert_eq!(p.len(), 6, "{p:?}");
    for (v, line) in [
        "K3_SIMD",
        "K3_GEMV_ROWS",
        "K3_GEMV_PF",
        "K3_WEIGHT_STAGING",
        "K3_AMX",
        "K3_STAGE",
    ]
    .iter()
    .zip(&p)
    {
        assert!(line.starts_with(v), "{line}");
    }
}

// Catches: a Configure recorded before `tuning` existed that no longer parses (the
// field must default), and a tuning that does not survive the JSON hop to the stage.
#[test]
fn compute_conf_carries_the_tuning_and_old_ones_parse() {
    let old = r#"{"model_dir":"m","config_path":"c","layers":null,"prompt_ids":[1],
        "gen":1,"incremental":false,"sampler":{"temperature":null,"top_p":null,
        "top_k":null,"seed":0},"threads":1,"dump_logits":null,"io_timeout_s":1.0,
        "stop_ids":[],"record_dir":null}"#;
    let c: k3_protocol::conf::ComputeConf = serde_json::from_str(old).unwrap();
    assert_eq!(c.tuning, KernelTuning::default());
    let mut c = c;
    c.tuning = KernelTuning {
        max_isa: Some(Isa::Portable),
        decode_rows: Some(8),
        decode_prefetch: Some(0),
        weight_staging: Some(WeightStaging::Bf16),
        product: Some(ProductPath::Bf16x3),
        amx: Some(true),
    };
    let back: k3_protocol::conf::ComputeConf =
        serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(back.tuning, c.tuning);
}
