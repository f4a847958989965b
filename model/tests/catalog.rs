//! Catalog and mmap reader tests: the seed's safetensors edge cases, the tiny models in both
//! layouts, and corrupted headers built here.

use k3_model::catalog::{check_safetensors_bytes, Catalog, CatalogError};
use k3_model::mmap_weights::MmapWeights;
use k3_model::tensor::{Dtype, WeightSource};
use std::path::{Path, PathBuf};

fn fixture(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(p)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn seed_st() -> MmapWeights {
    let files = vec![
        fixture("seed/st/model-00001-of-00002.safetensors"),
        fixture("seed/st/model-00002-of-00002.safetensors"),
    ];
    MmapWeights::from_catalog(Catalog::from_files(&files).unwrap()).unwrap()
}

/// Shapes, dtypes and leading bytes of every tensor in the seed's two edge-case shards
/// (expected values read from the files with an independent script). A reader that indexed
/// `__metadata__`, forgot the 8 + N data start, or mishandled the escaped name fails.
#[test]
fn seed_st_shapes_dtypes_bytes() {
    let w = seed_st();
    let c = w.catalog();
    assert_eq!(c.len(), 13, "__metadata__ must not be a tensor");
    assert!(!c.contains("__metadata__"));
    let want: &[(&str, Dtype, &[usize], &str, &str)] = &[
        (
            "plain.f32.2d",
            Dtype::F32,
            &[16, 16],
            "a5db713bc36f653fb28952bf5ffe2ac0",
            "f72061c0489d34c0",
        ),
        (
            "plain.bf16.1d",
            Dtype::BF16,
            &[128],
            "807f80ffc07f000000808000abd35fc3",
            "fcc078e329552c2f",
        ),
        (
            "tricky.f16.1d",
            Dtype::F16,
            &[64],
            "007c00fc007e000000800100ff030004",
            "26346d38cf3f4cb2",
        ),
        (
            "packed.u8.2d",
            Dtype::U8,
            &[7, 32],
            "179d94be8e6f283a65c7c6835addf91f",
            "f6f383bc8569a881",
        ),
        ("scalar.f32", Dtype::F32, &[], "00006040", "00006040"),
        ("empty.f32", Dtype::F32, &[0, 8], "", ""),
        (
            "language_model.model.layers.0.block_sparse_moe.experts.0.w1.weight_packed",
            Dtype::U8,
            &[2, 32],
            "9eaf3c7152a0547f4941a48bcf8c3aea",
            "8d77eae905660e77",
        ),
        (
            "language_model.model.layers.0.block_sparse_moe.experts.1.w1.weight_packed",
            Dtype::U8,
            &[2, 32],
            "4e93e9da9ad87fe1bfc19919433ecec2",
            "520820f997b955bc",
        ),
        (
            "rank3.f32",
            Dtype::F32,
            &[2, 3, 4],
            "beb6f2be9fb7033f3a3d07be6012c7be",
            "7014f3bfd681ac3f",
        ),
        (
            "rank4.u8",
            Dtype::U8,
            &[2, 2, 2, 2],
            "94b431740da56eabbd3cbd6abe798335",
            "bd3cbd6abe798335",
        ),
        (
            "second.shard.f32",
            Dtype::F32,
            &[10, 10],
            "7174c4bece6697bebf2f90bf0e5d2240",
            "fb15c0bd75978fbf",
        ),
        (
            "second.shard.u8",
            Dtype::U8,
            &[300],
            "03f7c1306d1551861ed198e275148aa1",
            "46df6e79b8e815d9",
        ),
        (
            "weird\\name.\"with\"quotes",
            Dtype::F32,
            &[3],
            "0000803f0000004000004040",
            "0000004000004040",
        ),
    ];
    for &(name, dtype, shape, head, tail) in want {
        let t = w.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(t.dtype, dtype, "{name}");
        assert_eq!(t.shape, shape, "{name}");
        assert_eq!(t.bytes.len(), t.numel() * dtype.size(), "{name}");
        let n = head.len() / 2;
        assert_eq!(hex(&t.bytes[..n]), head, "{name}");
        let m = tail.len() / 2;
        assert_eq!(hex(&t.bytes[t.bytes.len() - m..]), tail, "{name}");
    }
    // Second-shard tensors point at shard 1; offsets are absolute (8 + 253 header).
    let e = c.get("second.shard.f32").unwrap();
    assert_eq!(e.shard, 1);
    assert_eq!(e.offset, 8 + 253);
    assert_eq!(e.len, 400);
    let s = &c.shards()[0];
    assert_eq!(
        (s.file_size, s.header_len, s.data_start, s.data_end),
        (2906, 1022, 1030, 2906)
    );
    let bytes = std::fs::read(&s.path).unwrap();
    assert_eq!(check_safetensors_bytes(&s.path, &bytes).unwrap(), *s);
    // Iteration in file order: shard 0 by offset, then shard 1, with names restored.
    let names: Vec<String> = c.iter().map(|(n, _)| n).collect();
    assert_eq!(names[0], "plain.f32.2d");
    assert_eq!(names[12], "weird\\name.\"with\"quotes");
    assert_eq!(names[10], "second.shard.f32");
    let offs: Vec<(usize, u64)> = c.iter().map(|(_, e)| (e.shard, e.offset)).collect();
    assert!(offs.windows(2).all(|w| w[0] <= w[1]));
    for (n, e) in c.iter() {
        assert_eq!(c.get(&n), Some(e), "{n}");
    }
    assert!(!c.contains("plain.f32"));
    assert!(matches!(
        w.tensor("nope"),
        Err(k3_model::tensor::WeightError::Missing(_))
    ));
}

fn same_tensors(a: &MmapWeights, b: &MmapWeights) {
    let (ca, cb) = (a.catalog(), b.catalog());
    assert_eq!(ca.len(), cb.len());
    for (name, e) in ca.iter() {
        let f = cb
            .get(&name)
            .unwrap_or_else(|| panic!("{name} missing in sharded"));
        assert_eq!((e.dtype, e.shape), (f.dtype, f.shape), "{name}");
        assert!(a.bytes(&e) == b.bytes(&f), "{name}: bytes differ");
    }
}

/// Single-file and sharded layouts of each tiny model give the same tensors with identical
/// bytes (a reader that ignored the per-shard data start, or read the wrong shard, fails).
#[test]
fn tiny_single_and_sharded_agree() {
    for (dir, count, payload) in [
        ("tiny-seed", 628usize, 8_922_448u64),
        ("tiny-mxfp4", 916, 3_629_312),
    ] {
        let single = MmapWeights::open(fixture(dir)).unwrap();
        let sharded = MmapWeights::open(fixture(&format!("{dir}/sharded"))).unwrap();
        assert_eq!(single.catalog().len(), count, "{dir}");
        assert_eq!(single.catalog().payload_bytes(), payload, "{dir}");
        assert_eq!(sharded.catalog().shards().len(), 14);
        assert_eq!(sharded.catalog().index_total_size(), Some(payload));
        same_tensors(&single, &sharded);
        // Layer l lives in shard l + 1 (index l).
        let e = sharded
            .catalog()
            .get("language_model.model.layers.5.post_attention_layernorm.weight")
            .unwrap();
        assert_eq!(e.shard, 5);
        let e = sharded
            .catalog()
            .get("language_model.lm_head.weight")
            .unwrap();
        assert_eq!(e.shard, 13);
    }
    let m = MmapWeights::open(fixture("tiny-mxfp4")).unwrap();
    let t = m
        .tensor("language_model.model.layers.1.block_sparse_moe.experts.5.w2.weight_scale")
        .unwrap();
    assert_eq!((t.dtype, t.shape), (Dtype::U8, &[64usize, 2][..]));
    assert_eq!(hex(&t.bytes[..8]), "7575747474767576");
    let t = m
        .tensor("language_model.model.layers.0.self_attn.A_log")
        .unwrap();
    assert_eq!(t.shape, &[16]);
    assert_eq!(hex(&t.bytes[..16]), "3860e03faf3c333f3e8d32be5f2485bf");
    assert!(t.bytes[16..].iter().all(|&b| b == 0));
    let s = MmapWeights::open(fixture("tiny-seed/sharded")).unwrap();
    let t = s
        .tensor("language_model.model.layers.1.block_sparse_moe.experts.5.w2.weight")
        .unwrap();
    assert_eq!((t.dtype, t.shape), (Dtype::F32, &[64usize, 48][..]));
    assert_eq!(hex(&t.bytes[..8]), "bc8c093b178489bc");
    let t = s
        .tensor("language_model.model.layers.0.self_attn.A_log")
        .unwrap();
    assert_eq!(hex(t.bytes), "cdccccbe8a88083eabaa2a3f9a99993f");
}

// ---- corrupted headers ----

/// Write a safetensors file from a raw header JSON string and `data_len` data bytes.
fn write_st(path: &Path, header: &str, data_len: usize) {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend((0..data_len).map(|i| i as u8));
    std::fs::write(path, b).unwrap();
}

fn open_err(dir: &Path) -> CatalogError {
    Catalog::open(dir).expect_err("must be rejected")
}

fn expect(e: &CatalogError, file: &Path, tensor: Option<&str>, msg_part: &str) {
    assert_eq!(e.file, file, "{e}");
    assert_eq!(e.tensor.as_deref(), tensor, "{e}");
    assert!(e.msg.contains(msg_part), "{e}");
    let shown = e.to_string();
    assert!(shown.contains(&file.display().to_string()), "{shown}");
    if let Some(t) = tensor {
        assert!(shown.contains(t), "{shown}");
    }
}

const GOOD: &str = r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}"#;

#[test]
fn corrupted_single_files() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("model.safetensors");
    write_st(&f, GOOD, 12);
    assert_eq!(Catalog::open(d.path()).unwrap().len(), 2);

    // Truncated: header length runs past the file.
    let mut b = std::fs::read(&f).unwrap();
    b.truncate(40);
    std::fs::write(&f, &b).unwrap();
    expect(
        &open_err(d.path()),
        &f,
        None,
        "runs past the end of the file",
    );

    // Shorter than the length prefix.
    std::fs::write(&f, [1u8, 2, 3]).unwrap();
    expect(&open_err(d.path()), &f, None, "too short");

    // Data truncated: tensor b runs past the data section.
    write_st(&f, GOOD, 10);
    expect(
        &open_err(d.path()),
        &f,
        Some("b"),
        "past the end of the data section",
    );

    // Overlap: b starts inside a.
    let h = r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]}}"#;
    write_st(&f, h, 12);
    expect(&open_err(d.path()), &f, Some("b"), "overlap tensor \"a\"");

    // Wrong size: dtype x shape != bytes.
    let h = r#"{"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}"#;
    write_st(&f, h, 12);
    expect(
        &open_err(d.path()),
        &f,
        Some("a"),
        "hold 8 bytes but F32 [3] needs 12",
    );

    // Unknown dtype, missing field, reversed offsets.
    let h = r#"{"a": {"dtype": "F8_E4M3", "shape": [8], "data_offsets": [0, 8]}}"#;
    write_st(&f, h, 8);
    expect(&open_err(d.path()), &f, Some("a"), "unknown dtype");
    let h = r#"{"__metadata__": {"x": "y"}, "a": {"dtype": "F32", "shape": [2]}}"#;
    write_st(&f, h, 8);
    expect(&open_err(d.path()), &f, Some("a"), "data_offsets");
    let h = r#"{"a": {"dtype": "U8", "shape": [0], "data_offsets": [8, 4]}}"#;
    write_st(&f, h, 8);
    expect(&open_err(d.path()), &f, Some("a"), "end before they begin");

    // Not JSON / not an object / duplicate name.
    write_st(&f, "{\"a\": ", 8);
    expect(&open_err(d.path()), &f, Some("a"), "bad header entry");
    write_st(&f, "{,}", 8);
    expect(
        &open_err(d.path()),
        &f,
        None,
        "not a valid safetensors JSON object",
    );
    write_st(&f, "[1, 2]", 8);
    expect(
        &open_err(d.path()),
        &f,
        None,
        "not a valid safetensors JSON object",
    );
    let h = r#"{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}"#;
    write_st(&f, h, 8);
    expect(&open_err(d.path()), &f, Some("a"), "appears twice");
    let e = check_safetensors_bytes(&f, &std::fs::read(&f).unwrap()).unwrap_err();
    assert_eq!(e, open_err(d.path()));

    // Empty directory.
    let e = Catalog::open(tempfile::tempdir().unwrap().path()).unwrap_err();
    assert!(
        e.msg
            .contains("no model.safetensors.index.json or model.safetensors"),
        "{e}"
    );
}

#[test]
fn corrupted_index() {
    let d = tempfile::tempdir().unwrap();
    let s1 = d.path().join("model-00001-of-00002.safetensors");
    let s2 = d.path().join("model-00002-of-00002.safetensors");
    write_st(&s1, GOOD, 12);
    write_st(
        &s2,
        r#"{"c": {"dtype": "BF16", "shape": [], "data_offsets": [0, 2]}}"#,
        2,
    );
    let idx = d.path().join("model.safetensors.index.json");
    let write_idx = |wm: &str| {
        std::fs::write(
            &idx,
            format!(r#"{{"metadata": {{"total_size": 14}}, "weight_map": {{{wm}}}}}"#),
        )
        .unwrap()
    };
    let f1 = "model-00001-of-00002.safetensors";
    let f2 = "model-00002-of-00002.safetensors";
    write_idx(&format!(r#""a": "{f1}", "b": "{f1}", "c": "{f2}""#));
    let c = Catalog::open(d.path()).unwrap();
    assert_eq!(c.len(), 3);
    assert_eq!(c.index_total_size(), Some(14));
    assert_eq!(c.get("c").unwrap().shard, 1);
    assert_eq!(c.get("c").unwrap().shape, &[] as &[usize]);

    // Index names the wrong shard.
    write_idx(&format!(r#""a": "{f1}", "b": "{f2}", "c": "{f2}""#));
    expect(
        &open_err(d.path()),
        &idx,
        Some("b"),
        "names shard model-00002-of-00002.safetensors but the tensor is in",
    );
    // Index names a tensor the shard does not hold.
    write_idx(&format!(
        r#""a": "{f1}", "b": "{f1}", "c": "{f2}", "zz": "{f2}""#
    ));
    expect(&open_err(d.path()), &idx, Some("zz"), "has no such tensor");
    // Index misses a tensor.
    write_idx(&format!(r#""a": "{f1}", "c": "{f2}""#));
    expect(
        &open_err(d.path()),
        &idx,
        Some("b"),
        "missing from the weight_map",
    );
    // Index names a missing shard file.
    write_idx(&format!(
        r#""a": "{f1}", "b": "{f1}", "c": "model-00003-of-00002.safetensors""#
    ));
    let e = open_err(d.path());
    assert!(
        e.file.ends_with("model-00003-of-00002.safetensors") && e.msg.contains("cannot read"),
        "{e}"
    );
    // Path escape.
    write_idx(r#""a": "../x.safetensors""#);
    expect(
        &open_err(d.path()),
        &idx,
        Some("a"),
        "not a plain file name",
    );
    // Same name in two shards.
    write_st(
        &s2,
        r#"{"a": {"dtype": "BF16", "shape": [], "data_offsets": [0, 2]}}"#,
        2,
    );
    write_idx(&format!(r#""a": "{f1}", "b": "{f1}", "a": "{f2}""#));
    expect(&open_err(d.path()), &s2, Some("a"), "appears twice");
    // Broken index JSON.
    std::fs::write(&idx, "{\"weight_map\": 3}").unwrap();
    expect(
        &open_err(d.path()),
        &idx,
        None,
        "not a valid safetensors index",
    );
}

/// Compact keys must not confuse names that differ only in numeric components or
/// non-canonical numbers.
#[test]
fn numeric_name_components_round_trip() {
    let names = [
        "layers.0.w",
        "layers.00.w",
        "layers.1.w",
        "layers.01.w",
        "a.1.b.2.c",
        "a.1.b.2.c.3",
        "a.1.b.2.c.4",
        "x.4294967295",
        "x.4294967296",
        "x.",
        ".x",
        "x..y",
        "1",
        "0.0.0",
        "x.-1",
        "x.+1",
        "x.1e3",
        "ä.7",
    ];
    let mut header = String::from("{");
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "{:?}: {{\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [{i}, {}]}}",
            n,
            i + 1
        ));
    }
    header.push('}');
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("model.safetensors");
    write_st(&f, &header, names.len());
    let w = MmapWeights::open(d.path()).unwrap();
    assert_eq!(w.catalog().len(), names.len());
    for (i, n) in names.iter().enumerate() {
        assert_eq!(w.tensor(n).unwrap().bytes, &[i as u8], "{n}");
    }
    let got: Vec<String> = w.catalog().iter().map(|(n, _)| n).collect();
    assert_eq!(got, names.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    for absent in [
        "layers.2.w",
        "layers.000.w",
        "a.1.b.3.c",
        "a.1.b.2.c.5",
        "x.0",
        "2",
        "0.0.1",
    ] {
        assert!(!w.contains(absent), "{absent}");
    }
}
