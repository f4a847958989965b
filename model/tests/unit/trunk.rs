//! The packed-trunk format (`src/trunk.rs`): the manifest's round trip and checks, a stale
//! source, CRCs, the use phases and parts.

use k3_model::tensor::Dtype;
use k3_model::trunk::*;

fn sample() -> TrunkManifest {
    let t = |name: &str, off: u64| TrunkTensor {
        name: name.into(),
        dtype: Dtype::BF16,
        shape: vec![2, 3],
        offset: off,
        len: 12,
        crc32: vec![0],
    };
    TrunkManifest {
        format: TRUNK_FORMAT.into(),
        align: 4096,
        file: TRUNK_BIN.into(),
        file_size: 8192,
        total_bytes: 36,
        max_run: 24,
        max_run_layer: 0,
        source: SourceIdentity {
            total_size: 100,
            shards: vec![ShardIdentity {
                file: "a".into(),
                size: 10,
                header_sha256: "ab".repeat(32),
                sample_sha256: "ef".repeat(32),
            }],
        },
        layers: vec![
            TrunkLayer {
                layer: 0,
                offset: 0,
                length: 24,
                padded_length: 4096,
                shard: "a".into(),
                source_offset: 8,
                sha256: "0".repeat(64),
                crc32: vec![0],
                tensors: vec![t("x", 0), t("y", 12)],
            },
            TrunkLayer {
                layer: 1,
                offset: 4096,
                length: 12,
                padded_length: 4096,
                shard: "a".into(),
                source_offset: 8,
                sha256: "0".repeat(64),
                crc32: vec![0],
                tensors: vec![t("z", 0)],
            },
        ],
        codec: None,
    }
}

#[test]
fn valid_manifest_round_trips() {
    let m = sample();
    let text = serde_json::to_string(&m).unwrap();
    assert_eq!(TrunkManifest::from_json_str(&text).unwrap(), m);
}

/// Each corruption a careless writer could make is named.
#[test]
fn inconsistencies_are_named() {
    let mut m = sample();
    m.layers[1].offset = 100; // unaligned and overlapping
    let p = m.problems().join("\n");
    assert!(p.contains("not 4096-aligned"), "{p}");
    assert!(p.contains("overlaps the previous run"), "{p}");

    let mut m = sample();
    m.layers[0].tensors[1].len = 10;
    let p = m.problems().join("\n");
    assert!(p.contains("tensor y: len 10"), "{p}");

    let mut m = sample();
    m.max_run = 12;
    assert!(m.problems().join("\n").contains("max_run"));

    let mut m = sample();
    m.file_size = 4096;
    assert!(m.problems().join("\n").contains("past file_size"));
}

#[test]
fn stale_source_is_detected() {
    let m = sample();
    assert!(m.check_source(&m.source.clone()).is_ok());
    let mut other = m.source.clone();
    other.shards[0].size = 11;
    let e = m.check_source(&other).unwrap_err().to_string();
    assert!(e.contains("a is 11 bytes, was 10"), "{e}");
}

/// Same sizes, different header bytes (another checkpoint of the same layout): refused.
/// Failed before the header digest was part of the identity (sizes alone matched).
#[test]
fn same_sizes_other_headers_are_detected() {
    let m = sample();
    let mut other = m.source.clone();
    other.shards[0].header_sha256 = "cd".repeat(32);
    let e = m.check_source(&other).unwrap_err().to_string();
    assert!(e.contains("a: its header differs"), "{e}");
    let mut other = m.source.clone();
    other.shards[0].sample_sha256 = "cd".repeat(32);
    let e = m.check_source(&other).unwrap_err().to_string();
    assert!(e.contains("a: same header, other data"), "{e}");
}

/// An older version's manifest (other fields, other format string) is refused by its
/// format, naming both versions and the command that repacks it; without the early
/// check the message was serde's "missing field" about whichever field differs.
#[test]
fn another_format_version_is_refused_with_the_fix() {
    let mut v = serde_json::to_value(sample()).unwrap();
    v["format"] = "k3-trunk/1".into();
    v.as_object_mut().unwrap().remove("source");
    let e = TrunkManifest::from_json_str(&v.to_string())
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"k3-trunk/1\""), "{e}");
    assert!(e.contains(TRUNK_FORMAT), "{e}");
    assert!(e.contains("re-run k3-orch pack-trunk --force"), "{e}");
    let mut v = serde_json::to_value(sample()).unwrap();
    v["format"] = "k3-trunk/2".into();
    assert!(TrunkManifest::from_json_str(&v.to_string()).is_err());
}

/// Tensor CRCs fed from a run in odd-sized buffers equal `chunk_crcs` of each tensor's
/// own bytes (a tensor over two chunks, one of zero bytes, one ending mid-buffer).
/// Catches a chunk boundary counted from the run instead of the tensor, a CRC carried
/// across tensors, and a last partial chunk dropped.
#[test]
fn tensor_crcs_match_each_tensors_own_chunks() {
    let sizes = [5u64, CHECK_CHUNK + 7, 0, 3 * CHECK_CHUNK, 1];
    let mut ts = Vec::new();
    let mut at = 0u64;
    for (i, &n) in sizes.iter().enumerate() {
        ts.push(TrunkTensor {
            name: format!("t{i}"),
            dtype: Dtype::U8,
            shape: vec![n as usize],
            offset: at,
            len: n,
            crc32: Vec::new(),
        });
        at += n;
    }
    let run: Vec<u8> = (0..at).map(|i| ((i * 2654435761) >> 13) as u8).collect();
    let mut c = TensorCrcs::new(&ts);
    let mut pos = 0usize;
    for step in [1usize, 4093, 1 << 20, 77, usize::MAX].iter().cycle() {
        if pos >= run.len() {
            break;
        }
        let n = (*step).min(run.len() - pos);
        c.feed(pos as u64, &run[pos..pos + n]);
        pos += n;
    }
    let got = c.finish();
    for (t, g) in ts.iter().zip(&got) {
        let want = chunk_crcs(&run[t.offset as usize..(t.offset + t.len) as usize]);
        assert_eq!(g, &want, "{}", t.name);
    }
}

// Catches: a latent MoE bound as one phase (its router and shared experts then stay
// held, in a streamed trunk's only ring slot, while the routed experts are computed),
// a tail tensor (used after the routed experts) put in the head's phase, and the
// attention's output projection or a dense FFN's up-projection bound with the
// products before them (the ring slot must then hold both).
#[test]
fn the_use_phases_split_attention_the_ffn_and_a_latent_moe() {
    for (s, want) in [
        ("input_layernorm.weight", 0),
        ("self_attention_res_proj.weight", 0),
        ("self_attn.q_proj.weight", 0),
        ("self_attn.g_proj.weight", 0),
        ("self_attn.kv_b_proj.weight", 0),
        ("self_attn.o_norm.weight", 0),
        ("self_attn.o_proj.weight", 1),
        ("block_sparse_moe.gate.weight", 2),
        ("block_sparse_moe.gate.e_score_correction_bias", 2),
        ("block_sparse_moe.routed_expert_down_proj.weight", 2),
        ("block_sparse_moe.shared_experts.down_proj.weight", 2),
        ("mlp.gate_proj.weight", 2),
        ("mlp.up_proj.weight", 3),
        ("block_sparse_moe.routed_expert_up_proj.weight", 4),
        ("block_sparse_moe.routed_expert_norm.weight", 4),
        ("mlp.down_proj.weight", 4),
        ("something_else.weight", 5),
    ] {
        assert_eq!(use_phase(s), want, "{s}");
    }
}

/// Parts are the use phases, page-granular, smaller than the layer, each tensor inside
/// its part at the offset its pieces put it.
#[test]
fn parts_group_the_use_phases() {
    let names = [
        ("layers.0.block_sparse_moe.gate.weight", 5000u64),
        ("layers.0.input_layernorm.weight", 100),
        ("layers.0.mlp_res_proj.weight", 9000),
        ("layers.0.post_attention_layernorm.weight", 100),
        ("layers.0.self_attn.q_proj.weight", 20000),
    ];
    let mut ts = Vec::new();
    let mut at = 0u64;
    for (n, len) in names {
        ts.push(TrunkTensor {
            name: format!("language_model.model.{n}"),
            dtype: Dtype::U8,
            shape: vec![len as usize],
            offset: at,
            len,
            crc32: vec![0],
        });
        at += len;
    }
    let l = TrunkLayer {
        layer: 0,
        offset: 0,
        length: at,
        padded_length: align_up(at, TRUNK_ALIGN),
        shard: "a".into(),
        source_offset: 0,
        sha256: "0".repeat(64),
        crc32: vec![0],
        tensors: ts,
    };
    let parts = layer_parts_of(&l);
    assert_eq!(parts.iter().map(|p| p.phase).collect::<Vec<_>>(), [0, 2]);
    // Phase 0: input_layernorm (5000..5100) and q_proj (14200..34200): two pieces of
    // whole pages, the second up to the run's padded end.
    assert_eq!(
        parts[0].pieces,
        [
            PartPiece {
                at: 4096,
                len: 4096
            },
            PartPiece {
                at: 12288,
                len: 36864 - 12288
            }
        ]
    );
    // Phase 2: the MoE gate (0..5000), mlp_res_proj and the post norm (5000..14200),
    // touching pages merged into one piece.
    assert_eq!(parts[1].pieces, [PartPiece { at: 0, len: 16384 }]);
    for p in &parts {
        assert!(p.bytes() < l.padded_length || p.pieces.len() > 1);
        for &(i, off, k) in &p.tensors {
            let t = &l.tensors[i];
            let pc = p.pieces[k];
            let before: u64 = p.pieces[..k]
                .iter()
                .map(|x| align_up(x.len, TRUNK_ALIGN))
                .sum();
            assert_eq!(off, before + t.offset - pc.at, "{}", t.name);
            assert!(t.offset + t.len <= pc.at + pc.len);
        }
    }
    let all: usize = parts.iter().map(|p| p.tensors.len()).sum();
    assert_eq!(all, 5);
}

#[test]
fn crc_count_must_match_the_run() {
    let mut m = sample();
    m.layers[0].crc32.clear();
    assert!(m.problems().join("\n").contains("0 crc32 entries"));
}

/// A flipped byte is found and named by layer and trunk.bin offset.
#[test]
fn run_check_names_layer_and_offset() {
    let payload: Vec<u8> = (0..(CHECK_CHUNK * 2 + 100)).map(|i| i as u8).collect();
    let c = RunCheck {
        layer: 2,
        offset: 8192,
        length: payload.len() as u64,
        crc32: chunk_crcs(&payload),
        tensor: None,
    };
    assert_eq!(c.crc32.len(), 3);
    assert!(c.check(&payload).is_ok());
    let mut bad = payload.clone();
    bad[CHECK_CHUNK as usize + 5] ^= 1;
    let e = c.check(&bad).unwrap_err();
    assert!(
        matches!(e, CheckError::Mismatch { offset, layer: 2, .. } if offset == 8192 + CHECK_CHUNK),
        "{e:?}"
    );
    let e = e.to_string();
    assert!(e.contains("(layer 2,"), "{e}");
    assert!(
        e.contains(&format!("at offset {} ", 8192 + CHECK_CHUNK)),
        "{e}"
    );
    assert!(matches!(
        c.check(&payload[..10]),
        Err(CheckError::Short { read: 10, .. })
    ));
}
