//! Property-based fuzzing (proptest) of the three readers that take untrusted input: the
//! safetensors header parser, the index reader and the config reader. Every input must
//! give a result or an error, never a panic; accepted inputs must satisfy the readers'
//! invariants. Cases per property: `PROPTEST_CASES` (default 64, to keep `cargo test`
//! fast); each test prints how many cases it ran. The long runs (≥ 10^7 cases per reader)
//! use the faster mutation fuzzer in `examples/fuzz_parsers` (docs/fuzzing.md); its
//! findings have regression tests at the end of this file.

use k3_model::catalog::{check_safetensors_bytes, Catalog};
use k3_model::config::{LayerKind, ModelConfig};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::Value;
use std::cell::Cell;
use std::path::{Path, PathBuf};

fn fixture(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(p)
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

fn runner() -> TestRunner {
    TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    })
}

/// Invariants of an accepted catalog: every tensor inside its shard's data section,
/// len = numel × dtype size, no two non-empty tensors overlap, lookups round-trip.
fn check_catalog(c: &Catalog) {
    let mut spans: Vec<(usize, u64, u64)> = Vec::new();
    for (name, e) in c.iter() {
        let s = &c.shards()[e.shard];
        assert!(e.offset >= s.data_start && e.end() <= s.file_size, "{name}");
        assert_eq!(e.len, e.numel() * e.dtype.size() as u64);
        assert_eq!(c.get(&name), Some(e), "{name:?}");
        if e.len > 0 {
            spans.push((e.shard, e.offset, e.end()));
        }
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[0].0 != w[1].0 || w[0].2 <= w[1].1, "overlap {w:?}");
    }
}

fn write_file(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

/// Arbitrary bytes as a whole safetensors file.
#[test]
fn fuzz_header_arbitrary_bytes() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("model.safetensors");
    let n = Cell::new(0u32);
    let strat = (
        any::<u64>(),
        prop::collection::vec(any::<u8>(), 0..400),
        any::<bool>(),
    );
    runner()
        .run(&strat, |(len, body, real_len)| {
            n.set(n.get() + 1);
            let mut b = if real_len {
                (body.len() as u64).to_le_bytes().to_vec()
            } else {
                len.to_le_bytes().to_vec()
            };
            b.extend_from_slice(&body);
            write_file(&f, &b);
            let mem = check_safetensors_bytes(&f, &b);
            match Catalog::open(&f) {
                Ok(c) => {
                    check_catalog(&c);
                    assert_eq!(mem.as_ref().ok(), Some(&c.shards()[0]));
                }
                Err(e) => assert_eq!(mem.err(), Some(e)),
            }
            Ok(())
        })
        .unwrap();
    eprintln!("fuzz_header_arbitrary_bytes: {} cases", n.get());
}

/// Byte-level mutations (flip, insert, delete, truncate) of the seed's real edge-case shard.
#[test]
fn fuzz_header_mutations() {
    let base = std::fs::read(fixture("seed/st/model-00001-of-00002.safetensors")).unwrap();
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("model.safetensors");
    let n = Cell::new(0u32);
    let ops = prop::collection::vec((0usize..4, any::<prop::sample::Index>(), any::<u8>()), 1..6);
    runner()
        .run(&ops, |ops| {
            n.set(n.get() + 1);
            let mut b = base.clone();
            for (kind, at, byte) in ops {
                if b.is_empty() {
                    break;
                }
                // Mutate mostly inside the length prefix + header, where parsing happens.
                let hdr_end = (8 + 1022).min(b.len());
                let i = at.index(hdr_end);
                match kind {
                    0 => b[i] ^= byte | 1,
                    1 => b.insert(i, byte),
                    2 => {
                        b.remove(i);
                    }
                    _ => b.truncate(at.index(b.len())),
                }
            }
            write_file(&f, &b);
            let mem = check_safetensors_bytes(&f, &b);
            match Catalog::open(&f) {
                Ok(c) => {
                    check_catalog(&c);
                    assert_eq!(mem.as_ref().ok(), Some(&c.shards()[0]));
                }
                Err(e) => {
                    assert!(!e.msg.is_empty());
                    assert_eq!(mem.err(), Some(e));
                }
            }
            Ok(())
        })
        .unwrap();
    eprintln!("fuzz_header_mutations: {} cases", n.get());
}

/// Structured headers: random names, dtypes (some invalid), shapes and offsets. Accepted
/// headers must satisfy the catalog invariants; each rejection names the file.
#[test]
fn fuzz_header_structured() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("model.safetensors");
    let n = Cell::new(0u32);
    let accepted = Cell::new(0u32);
    let name = prop::sample::select(vec![
        "a",
        "a.0",
        "a.1",
        "a.00",
        "layers.3.w",
        "layers.3.experts.7.w1",
        "x.1.y.2.z.3",
        "",
        "__metadata__",
        "q\"\\",
    ]);
    let dtype = prop::sample::select(vec![
        "F32", "BF16", "U8", "I32", "F16", "BOOL", "F8", "bf16", "",
    ]);
    let shape = prop::collection::vec(prop::sample::select(vec![0u64, 1, 2, 3, 7, 1 << 40]), 0..4);
    let entry = (name, dtype, shape, 0u64..64, 0u64..64);
    let strat = (prop::collection::vec(entry, 0..6), 0usize..96);
    runner()
        .run(&strat, |(entries, data_len)| {
            n.set(n.get() + 1);
            let mut h = String::from("{");
            for (i, (nm, dt, sh, b, e)) in entries.iter().enumerate() {
                if i > 0 {
                    h.push(',');
                }
                let shs: Vec<String> = sh.iter().map(|x| x.to_string()).collect();
                h.push_str(&format!(
                    "{}: {{\"dtype\": \"{dt}\", \"shape\": [{}], \"data_offsets\": [{b}, {e}]}}",
                    serde_json::to_string(nm).unwrap(),
                    shs.join(",")
                ));
            }
            h.push('}');
            let mut b = (h.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(h.as_bytes());
            b.resize(b.len() + data_len, 7);
            write_file(&f, &b);
            match Catalog::open(&f) {
                Ok(c) => {
                    accepted.set(accepted.get() + 1);
                    check_catalog(&c);
                }
                Err(e) => assert_eq!(e.file, f),
            }
            Ok(())
        })
        .unwrap();
    eprintln!(
        "fuzz_header_structured: {} cases, {} accepted",
        n.get(),
        accepted.get()
    );
}

/// Index files: the true weight_map of tiny-mxfp4/sharded, perturbed (drop, duplicate,
/// reassign, add unknown, bad file name) or replaced by junk. Accepted iff unperturbed.
#[test]
fn fuzz_index() {
    let src = fixture("tiny-mxfp4/sharded");
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            std::os::unix::fs::symlink(&p, d.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    let truth: Value = serde_json::from_str(
        &std::fs::read_to_string(src.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let wm: Vec<(String, String)> = truth["weight_map"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    let idx = d.path().join("model.safetensors.index.json");
    let n = Cell::new(0u32);
    let strat = (
        0usize..7,
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
        prop::collection::vec(any::<u8>(), 0..64),
    );
    runner()
        .run(&strat, |(kind, i, j, junk)| {
            n.set(n.get() + 1);
            let mut m = wm.clone();
            let a = i.index(m.len());
            let other_file = m[j.index(m.len())].1.clone();
            let text = match kind {
                0 => None,
                1 => {
                    m.remove(a);
                    None
                }
                2 => {
                    let x = m[a].clone();
                    m.push(x);
                    None
                }
                3 => {
                    if m[a].1 == other_file {
                        m[a].1 = "model-00099-of-000014.safetensors".into();
                    } else {
                        m[a].1 = other_file;
                    }
                    None
                }
                4 => {
                    m.push(("language_model.unknown.weight".into(), m[a].1.clone()));
                    None
                }
                5 => {
                    m[a].1 = "../model.safetensors".into();
                    None
                }
                _ => Some(junk),
            };
            let bytes = match text {
                Some(junk) => junk,
                None => {
                    let mut s =
                        String::from("{\"metadata\": {\"total_size\": 3629312}, \"weight_map\": {");
                    for (k, (name, file)) in m.iter().enumerate() {
                        if k > 0 {
                            s.push(',');
                        }
                        s.push_str(&format!(
                            "{}: {}",
                            serde_json::to_string(name).unwrap(),
                            serde_json::to_string(file).unwrap()
                        ));
                    }
                    s.push_str("}}");
                    s.into_bytes()
                }
            };
            write_file(&idx, &bytes);
            let r = Catalog::open(d.path());
            assert_eq!(r.is_ok(), kind == 0, "kind {kind}: {:?}", r.as_ref().err());
            match r {
                Ok(c) => {
                    assert_eq!(c.len(), 916);
                    check_catalog(&c);
                }
                Err(e) => assert!(!e.msg.is_empty()),
            }
            Ok(())
        })
        .unwrap();
    eprintln!("fuzz_index: {} cases", n.get());
}

fn random_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        prop::sample::select(vec![
            0i64,
            1,
            2,
            4,
            8,
            13,
            93,
            999,
            -1,
            4_294_967_295,
            1 << 40
        ])
        .prop_map(Value::from),
        any::<f64>()
            .prop_map(|x| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)),
        "[a-z]{0,6}".prop_map(Value::String),
        prop::collection::vec(0u64..100, 0..5).prop_map(Value::from),
        Just(serde_json::json!({})),
    ]
}

/// Config mutations: replace or delete random fields of the released and tiny configs
/// (including inside linear_attn_config and quantization_config), or feed raw mutated text.
/// Accepted configs satisfy the reader's invariants.
#[test]
fn fuzz_config() {
    let bases: Vec<Value> = [
        "released/config.json",
        "tiny-mxfp4/config.json",
        "tiny-seed/config.json",
    ]
    .iter()
    .map(|p| serde_json::from_str(&std::fs::read_to_string(fixture(p)).unwrap()).unwrap())
    .collect();
    let n = Cell::new(0u32);
    let accepted = Cell::new(0u32);
    let edit = (
        0usize..3,
        any::<prop::sample::Index>(),
        prop::option::of(random_json()),
    );
    let strat = (
        0usize..3,
        prop::collection::vec(edit, 1..4),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
    );
    runner()
        .run(&strat, |(which, edits, byte_flips)| {
            n.set(n.get() + 1);
            let mut v = bases[which].clone();
            for (level, key, val) in edits {
                let obj = match level {
                    0 => v["text_config"].as_object_mut(),
                    1 => v["text_config"]["linear_attn_config"].as_object_mut(),
                    _ => v["text_config"]
                        .get_mut("quantization_config")
                        .and_then(|q| q.as_object_mut()),
                };
                let Some(obj) = obj else { continue };
                if obj.is_empty() {
                    continue;
                }
                let k = obj.keys().nth(key.index(obj.len())).unwrap().clone();
                match val {
                    Some(x) => {
                        obj.insert(k, x);
                    }
                    None => {
                        obj.remove(&k);
                    }
                }
            }
            let mut text = serde_json::to_string(&v).unwrap().into_bytes();
            for (at, b) in byte_flips {
                let i = at.index(text.len());
                text[i] = b;
            }
            let text = String::from_utf8_lossy(&text);
            match ModelConfig::from_json_str(&text) {
                Ok(c) => {
                    accepted.set(accepted.get() + 1);
                    assert_eq!(c.layer_kinds().len(), c.n_layers());
                    assert!(
                        c.num_experts_per_token <= c.num_experts && c.num_experts_per_token > 0
                    );
                    let kda = c
                        .layer_kinds()
                        .iter()
                        .filter(|&&k| k == LayerKind::Kda)
                        .count();
                    assert_eq!(kda, c.linear_attn.kda_layers.len());
                    assert!(c.rms_norm_eps > 0.0);
                    for l in 0..c.n_layers() {
                        let _ = c.is_moe(l);
                    }
                    let _ = c.expert_bytes(k3_model::tensor::Dtype::BF16);
                }
                Err(e) => assert!(!e.problems.is_empty()),
            }
            Ok(())
        })
        .unwrap();
    eprintln!(
        "fuzz_config: {} cases, {} accepted",
        n.get(),
        accepted.get()
    );
}

/// Found by the mutation fuzzer (examples/fuzz_parsers): a header whose skipped
/// `__metadata__` held bytes that are not UTF-8 was accepted (serde_json does not check the
/// strings it skips; the safetensors reference reader refuses such a header). Both readers,
/// in memory and from a file, now refuse it and say why.
#[test]
fn a_header_that_is_not_utf8_is_refused() {
    let json: &[u8] = b"{\"__metadata__\":{\"\xe6ormat\":\"pt\"}}";
    let mut b = (json.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(json);
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("model.safetensors");
    write_file(&f, &b);
    let mem = check_safetensors_bytes(&f, &b).unwrap_err();
    assert!(mem.msg.contains("not UTF-8"), "{mem}");
    assert_eq!(Catalog::open(&f).unwrap_err(), mem);
    // The same header with valid text is accepted (no tensors).
    let ok: &[u8] = b"{\"__metadata__\":{\"format\":\"pt\"}}";
    let mut b = (ok.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(ok);
    assert_eq!(check_safetensors_bytes(&f, &b).unwrap().n_tensors, 0);
}

/// Same finding for the index: bytes that are not UTF-8 in a member the reader skips.
#[test]
fn an_index_that_is_not_utf8_is_refused() {
    let shard = std::fs::read(fixture("seed/st/model-00002-of-00002.safetensors")).unwrap();
    let (n, rest) = shard.split_at(8);
    let n = u64::from_le_bytes(n.try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&rest[..n]).unwrap();
    let mut wm = serde_json::Map::new();
    for k in h.as_object().unwrap().keys() {
        if k != "__metadata__" {
            wm.insert(k.clone(), Value::from("s.safetensors"));
        }
    }
    let good = serde_json::to_vec(&serde_json::json!({ "weight_map": wm })).unwrap();
    let mut bad = b"{\"x\": \"\xff\", ".to_vec();
    bad.extend_from_slice(&good[1..]);
    let shards = |name: &str| (name == "s.safetensors").then_some(shard.as_slice());
    let d = tempfile::tempdir().unwrap();
    let idx = d.path().join("model.safetensors.index.json");
    let c = Catalog::from_index_bytes(&idx, &good, shards).unwrap();
    assert_eq!(c.len(), wm.len());
    let e = Catalog::from_index_bytes(&idx, &bad, shards).unwrap_err();
    assert!(e.msg.contains("not UTF-8"), "{e}");
    // From files: the same verdicts.
    write_file(&d.path().join("s.safetensors"), &shard);
    write_file(&idx, &good);
    assert_eq!(Catalog::open(d.path()).unwrap().len(), wm.len());
    write_file(&idx, &bad);
    assert_eq!(Catalog::open(d.path()).unwrap_err(), e);
}

/// The in-memory index reader agrees with the file reader on the real sharded fixture:
/// same tensors, same places; a missing shard is an error naming it.
#[test]
fn from_index_bytes_matches_open_index() {
    let dir = fixture("tiny-mxfp4/sharded");
    let idx = dir.join("model.safetensors.index.json");
    let json = std::fs::read(&idx).unwrap();
    let files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| {
            let n = p.file_name().unwrap().to_str().unwrap().to_string();
            (n, std::fs::read(&p).unwrap())
        })
        .collect();
    let get = |name: &str| {
        files
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.as_slice())
    };
    let mem = Catalog::from_index_bytes(&idx, &json, get).unwrap();
    let disk = Catalog::open(&dir).unwrap();
    assert_eq!(mem.len(), 916);
    assert_eq!(mem.shards(), disk.shards());
    let a: Vec<_> = mem.iter().collect();
    let b: Vec<_> = disk.iter().collect();
    assert_eq!(a, b);
    check_catalog(&mem);
    let missing = Catalog::from_index_bytes(&idx, &json, |n: &str| {
        (!n.starts_with("model-00003")).then(|| get(n)).flatten()
    })
    .unwrap_err();
    assert!(
        missing.file.ends_with("model-00003-of-000014.safetensors")
            && missing.msg.contains("cannot read"),
        "{missing}"
    );
}
