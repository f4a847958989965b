//! `k3-orch synth`: the tiny model must have exactly the released layout of the tiny-mxfp4
//! fixture (written by another generator), be deterministic, have sane magnitudes, and be
//! written atomically.

use std::path::Path;

use crate::tools_common::{fixtures, header, k3, k3_ok, shard_names, tensor_bytes};
use k3_model::config::ModelConfig;

/// Every shard's header (names, dtypes, shapes, data offsets, header length), the file
/// sizes, the index and the config must equal the fixture's, which another tool wrote in
/// the released layout. Wrong implementations this catches: experts sorted numerically
/// (experts.2 before experts.10), trunk not sorted F32-then-BF16, `-of-%05d` shard names,
/// A_log sized by heads, a header not padded to 8 bytes, a flat config.json.
#[test]
fn tiny_matches_the_fixture_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    k3_ok(&["synth", "--shape", "tiny", out.to_str().unwrap()]);
    let fix = fixtures().join("tiny-mxfp4/sharded");
    let names = shard_names(&fix);
    assert_eq!(shard_names(&out), names);
    assert_eq!(names.len(), 14);
    for n in &names {
        let (la, ha) = header(&fix.join(n));
        let (lb, hb) = header(&out.join(n));
        assert_eq!(ha, hb, "{n}: header differs");
        assert_eq!(la, lb, "{n}: header length differs");
        let sa = std::fs::metadata(fix.join(n)).unwrap().len();
        let sb = std::fs::metadata(out.join(n)).unwrap().len();
        assert_eq!(sa, sb, "{n}: file size differs");
    }
    let ia: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fix.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let ib: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(ia, ib);
    let ca = ModelConfig::load(fixtures().join("tiny-mxfp4/config.json")).unwrap();
    let cb = ModelConfig::load(out.join("config.json")).unwrap();
    assert_eq!(ca, cb);
}

fn bf16s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
        .collect()
}

fn rms(v: &[f32]) -> f32 {
    (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt()
}

/// Magnitudes for a numerically sane forward: projections rms ≈ 1/sqrt(in), gains ≈ 1,
/// E8M0 scales in 118..=124, MXFP4 codes using both nibbles. A generator that wrote
/// N(0, 1) projections, zero gains or scale 127 fails.
#[test]
fn tiny_magnitudes_are_sane() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    k3_ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "7",
        out.to_str().unwrap(),
    ]);
    let s2 = out.join("model-00002-of-000014.safetensors");
    let p = "language_model.model.layers.1.";
    let q = bf16s(&tensor_bytes(&s2, &format!("{p}self_attn.q_proj.weight")));
    let r = rms(&q);
    let want = 1.0 / (128f32).sqrt();
    assert!((r / want - 1.0).abs() < 0.1, "q_proj rms {r}, want {want}");
    let g = bf16s(&tensor_bytes(&s2, &format!("{p}input_layernorm.weight")));
    let mean = g.iter().sum::<f32>() / g.len() as f32;
    assert!((mean - 1.0).abs() < 0.01, "gain mean {mean}");
    let sc = tensor_bytes(
        &s2,
        &format!("{p}block_sparse_moe.experts.3.w2.weight_scale"),
    );
    assert!(sc.iter().all(|&b| (118..=124).contains(&b)), "{sc:?}");
    let pk = tensor_bytes(
        &s2,
        &format!("{p}block_sparse_moe.experts.3.w2.weight_packed"),
    );
    assert!(pk.iter().any(|&b| b & 0x0f != 0) && pk.iter().any(|&b| b >> 4 != 0));
    // Dequantised expert weights: rms within a factor 2 of 1/sqrt(64).
    let lut = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let mut sq = 0.0f32;
    for (j, b) in pk.iter().enumerate() {
        let row = j / 32;
        let col = (j % 32) * 2;
        let s = 2f32.powi(sc[row * 2 + col / 32] as i32 - 127);
        for c in [b & 15, b >> 4] {
            let v = lut[(c & 7) as usize] * s;
            sq += v * v;
        }
    }
    let r = (sq / (pk.len() * 2) as f32).sqrt();
    assert!(r > 0.0625 && r < 0.25, "expert rms {r}");
}

/// Same seed, same bytes; another seed, other bytes in the same layout.
#[test]
fn deterministic_by_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    let b = tmp.path().join("b");
    let c = tmp.path().join("c");
    k3_ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "3",
        a.to_str().unwrap(),
    ]);
    k3_ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "3",
        b.to_str().unwrap(),
    ]);
    k3_ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "4",
        c.to_str().unwrap(),
    ]);
    let f = "model-00005-of-000014.safetensors";
    let fa = std::fs::read(a.join(f)).unwrap();
    assert_eq!(fa, std::fs::read(b.join(f)).unwrap());
    let fc = std::fs::read(c.join(f)).unwrap();
    assert_eq!(fa.len(), fc.len());
    assert_ne!(fa, fc);
}

/// `--shape FILE.json` with overrides: layer count and experts change, layer kinds follow
/// the released rule, the config reads back.
#[test]
fn shape_from_config_with_overrides() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let cfg = fixtures().join("tiny-mxfp4/config.json");
    k3_ok(&[
        "synth",
        "--shape",
        cfg.to_str().unwrap(),
        "--layers",
        "5",
        "--experts",
        "40",
        "--top-k",
        "4",
        out.to_str().unwrap(),
    ]);
    assert_eq!(shard_names(&out).len(), 6);
    let c = ModelConfig::load(out.join("config.json")).unwrap();
    assert_eq!(c.num_hidden_layers, 5);
    assert_eq!(c.num_experts, 40);
    assert_eq!(c.num_experts_per_token, 4);
    assert_eq!(c.mla_layer_indices(), vec![3, 4]);
    // 40 experts: lexicographic order puts experts.10 right after experts.1.
    let (_, h) = header(&out.join("model-00002-of-000006.safetensors"));
    let off = |e: usize| {
        h[format!("language_model.model.layers.1.block_sparse_moe.experts.{e}.w1.weight_packed")]
            ["data_offsets"][0]
            .as_u64()
            .unwrap()
    };
    assert!(off(1) < off(10) && off(10) < off(2) && off(39) < off(4));
}

/// Refusals: a non-empty OUT_DIR without --force (exit 2, named), a bad shape, top-k above
/// the expert count, a usage error. --force replaces; a dead run's temp dir is removed.
#[test]
fn refusals_and_atomic_replace() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), b"x").unwrap();
    let o = out.to_str().unwrap();
    let (code, _, err) = k3(&["synth", "--shape", "tiny", o]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("not empty") && err.contains("--force"),
        "{err}"
    );
    assert!(out.join("keep.txt").exists());

    let (code, _, err) = k3(&["synth", "--shape", "nonesuch", o]);
    assert_eq!(code, 2);
    assert!(err.contains("nonesuch"), "{err}");
    let (code, _, err) = k3(&["synth", "--shape", "tiny", "--top-k", "9", o]);
    assert_eq!(code, 2);
    assert!(err.contains("top-k 9"), "{err}");
    let (code, _, _) = k3(&["synth", "--shape", "tiny"]);
    assert_eq!(code, 2);

    // A temp dir left by a dead process (pid far above pid_max) is cleaned up.
    let stale = tmp.path().join("m.tmp-999999999");
    std::fs::create_dir(&stale).unwrap();
    k3_ok(&["synth", "--shape", "tiny", "--force", o]);
    assert!(!stale.exists());
    assert!(!out.join("keep.txt").exists());
    assert!(out.join("config.json").exists());
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "only OUT_DIR remains");
    assert!(Path::new(&out)
        .join("model-00014-of-000014.safetensors")
        .exists());
}

/// A geometry larger than the free space is refused up front (exit 2) with its size and the
/// free space, and nothing is left behind. Before: a ~1 TB slice started writing with no
/// estimate and filled the disk.
#[test]
fn a_geometry_larger_than_the_disk_is_refused_before_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("huge");
    let (code, _, err) = k3(&[
        "synth",
        "--shape",
        "slice",
        "--layers",
        "93",
        "--experts",
        "896",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("GB free"), "{err}");
    assert!(std::fs::read_dir(tmp.path()).unwrap().next().is_none());
}
