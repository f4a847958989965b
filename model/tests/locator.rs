//! Expert locator on the seed's misaligned expert cache, the tiny models, and layouts built
//! here where an expert is not contiguous.

use k3_model::catalog::Catalog;
use k3_model::locator::{locate_expert, locate_layer, MXFP4_SUFFIXES};
use k3_model::mmap_weights::MmapWeights;
use std::path::PathBuf;

fn fixture(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(p)
}

/// seed/cache: 24 experts of 6 MXFP4 tensors, 1,632 bytes each (not a multiple of 4096),
/// header 20,600 bytes. Byte i of tensor (e, w, kind) is
/// `(((209·e + 31·k + 7·s) mod 256) + i) mod 251` with k = 0,1,2 for w1,w2,w3 and s = 1 for
/// the scale — the fixture's own pattern, read off the file. A locator that assumed
/// 4096-aligned or id-computed offsets, or mixed up parts, reads the wrong bytes.
#[test]
fn seed_cache_experts() {
    let w = MmapWeights::open(fixture("seed/cache/model-00001-of-00001.safetensors")).unwrap();
    let c = w.catalog();
    let locs = locate_layer(c, 0, 24).unwrap();
    for (e, loc) in locs.iter().enumerate() {
        let run = loc.run.expect("seed cache experts are contiguous");
        assert_eq!(run.shard, 0);
        assert_eq!(run.len, 1632);
        assert_eq!(loc.bytes(), 1632);
        assert_eq!(run.offset, 8 + 20_600 + 1632 * e as u64, "expert {e}");
        assert!(loc.is_mxfp4());
        assert_eq!(loc.reads(), vec![run]);
        let bytes = w.shard_bytes(run.shard, run.offset, run.len).unwrap();
        for p in &loc.parts {
            let k = (p.suffix.as_bytes()[1] - b'1') as usize;
            let s = p.suffix.ends_with("scale") as usize;
            let base = (209 * e + 31 * k + 7 * s) % 256;
            let got = &bytes[p.run_offset as usize..(p.run_offset + p.at.len) as usize];
            for (i, &b) in got.iter().enumerate() {
                assert_eq!(
                    b as usize,
                    (base + i) % 251,
                    "expert {e} {} byte {i}",
                    p.suffix
                );
            }
        }
        assert_eq!(loc.part("w1.weight_packed").unwrap().shape, vec![8, 64]);
        assert_eq!(loc.part("w3.weight_scale").unwrap().shape, vec![8, 4]);
    }
    let e = locate_expert(c, 0, 24).unwrap_err();
    assert!(e.to_string().contains("not in the checkpoint"), "{e}");
    let e = locate_expert(c, 1, 0).unwrap_err();
    assert_eq!((e.layer, e.expert), (1, 0));
}

/// tiny-mxfp4/sharded: layer l's experts are in shard l (0-based index), after its trunk,
/// contiguous; the run's bytes equal the single-file tensors concatenated in part order.
/// tiny-seed: plain F32 w1/w2/w3.weight experts, also contiguous.
#[test]
fn tiny_sharded_experts() {
    for (dir, parts, expert_bytes) in [
        ("tiny-mxfp4", 6usize, 3 * (2048 + 128)),
        ("tiny-seed", 3, 3 * 48 * 64 * 4),
    ] {
        let sharded = MmapWeights::open(fixture(&format!("{dir}/sharded"))).unwrap();
        let single = MmapWeights::open(fixture(dir)).unwrap();
        for layer in 1..13 {
            let trunk_end = sharded
                .catalog()
                .shard_entries(layer)
                .filter(|(n, _)| !n.contains(".experts."))
                .map(|(_, e)| e.end())
                .max()
                .unwrap();
            for loc in locate_layer(sharded.catalog(), layer, 8).unwrap() {
                assert_eq!(loc.parts.len(), parts);
                let run = loc
                    .run
                    .unwrap_or_else(|| panic!("{dir} {layer} {} not contiguous", loc.expert));
                assert_eq!(run.shard, layer);
                assert_eq!(run.len, expert_bytes as u64);
                assert!(run.offset >= trunk_end);
                let got = sharded.shard_bytes(run.shard, run.offset, run.len).unwrap();
                let single_loc = locate_expert(single.catalog(), layer, loc.expert).unwrap();
                let mut want = Vec::new();
                let mut by_offset = single_loc.parts.clone();
                by_offset.sort_by_key(|p| p.at.offset);
                let mut sharded_parts = loc.parts.clone();
                sharded_parts.sort_by_key(|p| p.at.offset);
                for (a, b) in by_offset.iter().zip(&sharded_parts) {
                    assert_eq!(a.suffix, b.suffix);
                    want.extend_from_slice(
                        single
                            .shard_bytes(a.at.shard, a.at.offset, a.at.len)
                            .unwrap(),
                    );
                }
                assert!(
                    got == &want[..],
                    "{dir} layer {layer} expert {}",
                    loc.expert
                );
            }
        }
    }
}

fn write_st(path: &std::path::Path, entries: &[(&str, u64, u64)]) {
    let mut h = String::from("{");
    let mut end = 0;
    for (i, (name, b, e)) in entries.iter().enumerate() {
        if i > 0 {
            h.push(',');
        }
        h.push_str(&format!(
            "\"{name}\": {{\"dtype\": \"U8\", \"shape\": [{}], \"data_offsets\": [{b}, {e}]}}",
            e - b
        ));
        end = end.max(*e);
    }
    h.push('}');
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.resize(bytes.len() + end as usize, 0);
    std::fs::write(path, bytes).unwrap();
}

/// An expert whose tensors are separated by another tensor, or in another order, or split
/// over shards: contiguity is verified, not assumed, and the fallback lists every part.
#[test]
fn non_contiguous_experts_fall_back() {
    let d = tempfile::tempdir().unwrap();
    let n = |e: usize, s: &str| {
        format!("language_model.model.layers.1.block_sparse_moe.experts.{e}.{s}")
    };
    let names0: Vec<String> = MXFP4_SUFFIXES.iter().map(|s| n(0, s)).collect();
    let names1: Vec<String> = MXFP4_SUFFIXES.iter().map(|s| n(1, s)).collect();
    let names2: Vec<String> = MXFP4_SUFFIXES.iter().map(|s| n(2, s)).collect();
    let mut ents: Vec<(&str, u64, u64)> = Vec::new();
    // Expert 0: contiguous but stored in reverse part order -> still one run.
    for (i, nm) in names0.iter().rev().enumerate() {
        ents.push((nm, i as u64 * 10, i as u64 * 10 + 10));
    }
    // Expert 1: a foreign tensor between its 3rd and 4th part -> six reads.
    let mut off = 60;
    for (i, nm) in names1.iter().enumerate() {
        if i == 3 {
            ents.push(("intruder", off, off + 5));
            off += 5;
        }
        ents.push((nm, off, off + 10));
        off += 10;
    }
    // Expert 2: five parts here, the sixth in the second shard.
    for nm in &names2[..5] {
        ents.push((nm, off, off + 10));
        off += 10;
    }
    let f1 = d.path().join("a.safetensors");
    let f2 = d.path().join("b.safetensors");
    write_st(&f1, &ents);
    write_st(&f2, &[(&names2[5], 0, 10)]);
    let c = Catalog::from_files(&[f1, f2]).unwrap();
    let l0 = locate_expert(&c, 1, 0).unwrap();
    let r0 = l0.run.unwrap();
    assert_eq!((r0.offset - c.shards()[0].data_start, r0.len), (0, 60));
    assert_eq!(l0.part("w1.weight_packed").unwrap().run_offset, 50);
    let l1 = locate_expert(&c, 1, 1).unwrap();
    assert_eq!(l1.run, None);
    assert_eq!(l1.reads().len(), 6);
    assert_eq!(l1.bytes(), 60);
    let l2 = locate_expert(&c, 1, 2).unwrap();
    assert_eq!(l2.run, None);
    let reads = l2.reads();
    assert_eq!(reads.len(), 6);
    assert_eq!(reads[5].shard, 1);
    // A missing part is named.
    let f3 = d.path().join("c.safetensors");
    write_st(&f3, &[(&names0[0], 0, 10), (&names0[1], 10, 20)]);
    let c = Catalog::from_files(&[f3]).unwrap();
    let e = locate_expert(&c, 1, 0).unwrap_err();
    assert_eq!(e.tensor.as_deref(), Some(names0[2].as_str()));
}
