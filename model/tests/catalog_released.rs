//! The released tensor list (`k3_model::released`) against the checkpoint facts of
//! k3-spec §2/§7 (counts, byte totals, header sizes, shard-2 geometry), and the catalog on
//! released-shape headers.

use k3_model::catalog::Catalog;
use k3_model::released::{self, ReleasedTensor};
use k3_model::tensor::Dtype;

fn bytes(t: &[ReleasedTensor]) -> u64 {
    t.iter().map(|x| x.bytes()).sum()
}

/// Totals of §7. A list with a wrong KDA/MLA rule, a missing tensor or a wrong shape moves
/// at least one of these numbers.
#[test]
fn released_counts_and_totals() {
    let mut n = 0usize;
    let mut payload = 0u64;
    let mut headers = 0u64;
    let mut trunk = 0u64;
    let mut experts = 0u64;
    for shard in 1..=released::N_SHARDS {
        let t = released::shard_tensors(shard);
        let (json, data) = released::header_json(&t);
        n += t.len();
        payload += data;
        headers += 8 + json.len() as u64;
        if shard <= released::N_LAYERS {
            let l = shard - 1;
            let tr = bytes(&released::layer_trunk_tensors(l));
            trunk += tr;
            experts += data - tr;
        }
    }
    assert_eq!(n, 497_220);
    assert_eq!(payload, 1_560_860_324_864);
    assert_eq!(headers, 75_766_584);
    assert_eq!(trunk, 108_811_877_376);
    assert_eq!(experts, 1_446_456_066_048);
    assert_eq!(experts, 92 * 896 * 17_547_264);
    let m = released::model_tensors();
    assert_eq!(m[0].bytes() + m[1].bytes(), 2 * 2_348_810_240);
    assert_eq!(bytes(&m[2..]), 43_008);
    assert_eq!(bytes(&released::mm_projector_tensors()), 92_289_024);
    assert_eq!(bytes(&released::vision_tensors()), 802_428_928);
    assert_eq!(released::vision_tensors().len(), 165);
    // Per-layer trunk runs (§7).
    assert_eq!(bytes(&released::layer_trunk_tensors(1)), 1_267_744_256);
    assert_eq!(bytes(&released::layer_trunk_tensors(3)), 844_335_616);
    assert_eq!(bytes(&released::layer_trunk_tensors(0)), 2_341_213_184);
    assert_eq!(bytes(&released::expert_tensors(5, 7)), 17_547_264);
    let mla: Vec<usize> = (0..93).filter(|&l| !released::is_kda_layer(l)).collect();
    assert_eq!(mla.len(), 24);
    assert_eq!(&mla[mla.len() - 3..], &[87, 91, 92]);
    assert_eq!(
        released::shard_file_name(2),
        "model-00002-of-000096.safetensors"
    );
}

/// Shard 2 (layer 1) as the catalog sees it: header 818,696 bytes, file 16,990,911,504
/// bytes, trunk first, expert 0's six tensors at data-relative [1,267,744,256,
/// 1,285,291,520) = absolute 1,268,562,960 in w1p, w1s, w2p, w2s, w3p, w3s order, and
/// experts in lexicographic (not id) order. A catalog that assumed id order or
/// data-relative offsets fails.
#[test]
fn shard2_geometry_through_the_catalog() {
    let d = tempfile::tempdir().unwrap();
    let mut paths = Vec::new();
    for shard in [2usize, 94] {
        let t = released::shard_tensors(shard);
        let (json, data) = released::header_json(&t);
        let p = d.path().join(released::shard_file_name(shard));
        let mut b = (json.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(&json);
        std::fs::write(&p, &b).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(8 + json.len() as u64 + data)
            .unwrap();
        paths.push(p);
    }
    let c = Catalog::from_files(&paths).unwrap();
    assert_eq!(c.len(), (8 + 12 + 8) + 896 * 6 + 5);
    let s = &c.shards()[0];
    assert_eq!(s.header_len, 818_696);
    assert_eq!(s.data_start, 818_704);
    assert_eq!(s.file_size, 16_990_911_504);
    assert_eq!(s.data_end, s.file_size);
    let mut off = 1_268_562_960u64;
    for suf in released::EXPERT_SUFFIXES {
        let e = c
            .get(&k3_model::classify::expert_tensor(1, 0, suf))
            .unwrap();
        assert_eq!(e.offset, off, "{suf}");
        assert_eq!(e.dtype, Dtype::U8);
        off += e.len;
    }
    assert_eq!(off - 1_268_562_960, 17_547_264);
    assert_eq!(off - s.data_start, 1_285_291_520);
    // File order after expert 0: experts 1, 10, 100, 101, ...
    let order: Vec<String> = c
        .shard_entries(0)
        .map(|(n, _)| n)
        .filter(|n| n.ends_with("w1.weight_packed"))
        .take(4)
        .collect();
    let want: Vec<String> = [0, 1, 10, 100]
        .iter()
        .map(|&e| k3_model::classify::expert_tensor(1, e, "w1.weight_packed"))
        .collect();
    assert_eq!(order, want);
    // The trunk is the first 1,267,744,256 data bytes.
    let trunk_end = c
        .shard_entries(0)
        .filter(|(n, _)| !n.contains(".experts."))
        .map(|(_, e)| e.end())
        .max()
        .unwrap();
    assert_eq!(trunk_end - s.data_start, 1_267_744_256);
    let e = c.get("language_model.model.embed_tokens.weight").unwrap();
    assert_eq!((e.shard, e.shape), (1, &[163_840usize, 7168][..]));
}
