//! The released Kimi K3 checkpoint's tensor list, rebuilt from k3-spec §2 and §7: every one
//! of the 497,220 tensors with its name, dtype, shape and shard, in the order the shards
//! store them, plus a writer for a *header-only* copy of the 96-shard set (sparse files:
//! real headers, correct data offsets, no data) for benchmarks, census tests and tools that
//! must see the released geometry without the 1.56 TB.
//!
//! Layout (§7): layer ℓ (0..92) lives in shard ℓ+1; shard 94 holds the model-level tensors;
//! 95 the mm_projector; 96 the vision tower. Inside a shard, tensors are ordered like the
//! safetensors writer orders them — larger dtype alignment first (F32, then BF16, then U8),
//! then by name — so a layer's trunk comes first, followed by its experts in lexicographic
//! name order (experts.0, experts.1, experts.10, experts.100, ...). Header JSON is compact
//! with no `__metadata__`, padded with spaces to a multiple of 8; with that, shard 2's
//! header is 818,696 bytes and all 96 headers total 75,766,584 bytes with their length
//! fields, as in the release.

use std::cmp::Reverse;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::classify::expert_tensor;
use crate::tensor::Dtype;

/// Decoder layers.
pub const N_LAYERS: usize = 93;
/// Routed experts per MoE layer.
pub const N_EXPERTS: usize = 896;
/// Shard files.
pub const N_SHARDS: usize = 96;
/// Tensor records in the whole set.
pub const N_TENSORS: usize = 497_220;
/// Shard holding embed_tokens, lm_head, model.norm and output_attn_res_* (1-based).
pub const MODEL_SHARD: usize = 94;
/// Shard holding the mm_projector (1-based).
pub const MM_PROJECTOR_SHARD: usize = 95;
/// Shard holding the vision tower (1-based).
pub const VISION_SHARD: usize = 96;

const D: usize = 7168;
const P: usize = 12288;

/// One released tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReleasedTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl ReleasedTensor {
    fn new(name: String, dtype: Dtype, shape: &[usize]) -> Self {
        ReleasedTensor {
            name,
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// Byte length.
    pub fn bytes(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product::<u64>() * self.dtype.size() as u64
    }
}

/// Whether 0-based layer `l` is KDA in the release ((l+1) mod 4 ≠ 0 and l ≤ 90).
pub fn is_kda_layer(l: usize) -> bool {
    !(l + 1).is_multiple_of(4) && l <= 90
}

/// The released file name of 1-based shard `shard`: `model-00001-of-000096.safetensors`
/// (five-digit index, six-digit total).
pub fn shard_file_name(shard: usize) -> String {
    format!("model-{shard:05}-of-{N_SHARDS:06}.safetensors")
}

/// The six suffixes of one MXFP4 expert, in the released order.
pub const EXPERT_SUFFIXES: [&str; 6] = [
    "w1.weight_packed",
    "w1.weight_scale",
    "w2.weight_packed",
    "w2.weight_scale",
    "w3.weight_packed",
    "w3.weight_scale",
];

/// The non-expert ("trunk") tensors of 0-based layer `l`, unordered.
pub fn layer_trunk_tensors(l: usize) -> Vec<ReleasedTensor> {
    use Dtype::{BF16, F32};
    let p = format!("language_model.model.layers.{l}.");
    let mut t = Vec::with_capacity(32);
    let mut add = |s: &str, dt: Dtype, shape: &[usize]| {
        t.push(ReleasedTensor::new(format!("{p}{s}"), dt, shape))
    };
    for s in [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attention_res_norm.weight",
        "mlp_res_norm.weight",
    ] {
        add(s, BF16, &[D]);
    }
    add("self_attention_res_proj.weight", BF16, &[1, D]);
    add("mlp_res_proj.weight", BF16, &[1, D]);
    add("self_attn.g_proj.weight", BF16, &[P, D]);
    add("self_attn.o_proj.weight", BF16, &[D, P]);
    if is_kda_layer(l) {
        for x in ["q", "k", "v"] {
            add(&format!("self_attn.{x}_proj.weight"), BF16, &[P, D]);
            add(&format!("self_attn.{x}_conv1d.weight"), F32, &[P, 1, 4]);
        }
        add("self_attn.f_a_proj.weight", BF16, &[128, D]);
        add("self_attn.f_b_proj.weight", BF16, &[P, 128]);
        add("self_attn.dt_bias", F32, &[P]);
        add("self_attn.A_log", F32, &[128]);
        add("self_attn.b_proj.weight", BF16, &[96, D]);
        add("self_attn.o_norm.weight", F32, &[128]);
    } else {
        add("self_attn.q_a_proj.weight", BF16, &[1536, D]);
        add("self_attn.q_a_layernorm.weight", BF16, &[1536]);
        add("self_attn.q_b_proj.weight", BF16, &[18432, 1536]);
        add("self_attn.kv_a_proj_with_mqa.weight", BF16, &[576, D]);
        add("self_attn.kv_a_layernorm.weight", BF16, &[512]);
        add("self_attn.kv_b_proj.weight", BF16, &[24576, 512]);
    }
    if l == 0 {
        add("mlp.gate_proj.weight", BF16, &[33792, D]);
        add("mlp.up_proj.weight", BF16, &[33792, D]);
        add("mlp.down_proj.weight", BF16, &[D, 33792]);
    } else {
        add("block_sparse_moe.gate.weight", BF16, &[N_EXPERTS, D]);
        add(
            "block_sparse_moe.gate.e_score_correction_bias",
            F32,
            &[N_EXPERTS],
        );
        add(
            "block_sparse_moe.routed_expert_down_proj.weight",
            BF16,
            &[3584, D],
        );
        add("block_sparse_moe.routed_expert_norm.weight", BF16, &[3584]);
        add(
            "block_sparse_moe.routed_expert_up_proj.weight",
            BF16,
            &[D, 3584],
        );
        add(
            "block_sparse_moe.shared_experts.gate_proj.weight",
            BF16,
            &[6144, D],
        );
        add(
            "block_sparse_moe.shared_experts.up_proj.weight",
            BF16,
            &[6144, D],
        );
        add(
            "block_sparse_moe.shared_experts.down_proj.weight",
            BF16,
            &[D, 6144],
        );
    }
    t
}

/// The six tensors of routed expert `e` of MoE layer `l` (w1/w3 [3072, 3584] and w2
/// [3584, 3072] logical, MXFP4-packed), in the released order.
pub fn expert_tensors(l: usize, e: usize) -> Vec<ReleasedTensor> {
    let mut t = Vec::with_capacity(6);
    for (w, rows, cols) in [("w1", 3072, 3584), ("w2", 3584, 3072), ("w3", 3072, 3584)] {
        t.push(ReleasedTensor::new(
            expert_tensor(l, e, &format!("{w}.weight_packed")),
            Dtype::U8,
            &[rows, cols / 2],
        ));
        t.push(ReleasedTensor::new(
            expert_tensor(l, e, &format!("{w}.weight_scale")),
            Dtype::U8,
            &[rows, cols / 32],
        ));
    }
    t
}

/// Model-level tensors (shard 94).
pub fn model_tensors() -> Vec<ReleasedTensor> {
    let b = Dtype::BF16;
    vec![
        ReleasedTensor::new(
            "language_model.model.embed_tokens.weight".into(),
            b,
            &[163840, D],
        ),
        ReleasedTensor::new("language_model.lm_head.weight".into(), b, &[163840, D]),
        ReleasedTensor::new("language_model.model.norm.weight".into(), b, &[D]),
        ReleasedTensor::new(
            "language_model.model.output_attn_res_norm.weight".into(),
            b,
            &[D],
        ),
        ReleasedTensor::new(
            "language_model.model.output_attn_res_proj.weight".into(),
            b,
            &[1, D],
        ),
    ]
}

/// mm_projector tensors (shard 95).
pub fn mm_projector_tensors() -> Vec<ReleasedTensor> {
    let b = Dtype::BF16;
    vec![
        ReleasedTensor::new("mm_projector.post_norm.weight".into(), b, &[D]),
        ReleasedTensor::new("mm_projector.proj.0.weight".into(), b, &[4096, 4096]),
        ReleasedTensor::new("mm_projector.proj.2.weight".into(), b, &[D, 4096]),
    ]
}

/// Vision-tower tensors (shard 96, 165 of them).
pub fn vision_tensors() -> Vec<ReleasedTensor> {
    let b = Dtype::BF16;
    let mut t = vec![
        ReleasedTensor::new(
            "vision_tower.patch_embed.proj.weight".into(),
            b,
            &[1024, 3, 14, 14],
        ),
        ReleasedTensor::new(
            "vision_tower.patch_embed.pos_emb.weight".into(),
            b,
            &[64, 64, 1024],
        ),
        ReleasedTensor::new(
            "vision_tower.encoder.final_layernorm.weight".into(),
            b,
            &[1024],
        ),
    ];
    for blk in 0..27 {
        let p = format!("vision_tower.encoder.blocks.{blk}.");
        for (s, shape) in [
            ("wqkv.weight", &[4608usize, 1024][..]),
            ("wo.weight", &[1024, 1536]),
            ("norm0.weight", &[1024]),
            ("norm1.weight", &[1024]),
            ("mlp.fc0.weight", &[4096, 1024]),
            ("mlp.fc1.weight", &[1024, 4096]),
        ] {
            t.push(ReleasedTensor::new(format!("{p}{s}"), b, shape));
        }
    }
    t
}

/// Order tensors as the safetensors writer stores them: larger dtype first, then by name.
pub fn sort_in_file_order(t: &mut [ReleasedTensor]) {
    t.sort_by(|a, b| (Reverse(a.dtype.size()), &a.name).cmp(&(Reverse(b.dtype.size()), &b.name)));
}

/// The tensors of 1-based shard `shard` (1..=96) in stored order; empty when out of range.
pub fn shard_tensors(shard: usize) -> Vec<ReleasedTensor> {
    let mut t = match shard {
        1..=N_LAYERS => {
            let l = shard - 1;
            let mut t = layer_trunk_tensors(l);
            if l >= 1 {
                t.reserve(N_EXPERTS * 6);
                for e in 0..N_EXPERTS {
                    t.extend(expert_tensors(l, e));
                }
            }
            t
        }
        MODEL_SHARD => model_tensors(),
        MM_PROJECTOR_SHARD => mm_projector_tensors(),
        VISION_SHARD => vision_tensors(),
        _ => Vec::new(),
    };
    sort_in_file_order(&mut t);
    t
}

/// A safetensors header for `tensors` stored back to back in the given order: the JSON
/// (compact, no `__metadata__`, space-padded to a multiple of 8) and the data length.
pub fn header_json(tensors: &[ReleasedTensor]) -> (Vec<u8>, u64) {
    let mut j = Vec::with_capacity(tensors.len() * 150);
    j.push(b'{');
    let mut off = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if i > 0 {
            j.push(b',');
        }
        // Writing to a Vec cannot fail, and a &str always serialises.
        let _ = serde_json::to_writer(&mut j, &t.name);
        let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        let end = off + t.bytes();
        let _ = write!(
            j,
            ":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{off},{end}]}}",
            t.dtype,
            shape.join(",")
        );
        off = end;
    }
    j.push(b'}');
    while j.len() % 8 != 0 {
        j.push(b' ');
    }
    (j, off)
}

/// What [`write_header_only_set`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderOnlySet {
    /// Tensors written.
    pub n_tensors: usize,
    /// Sum of tensor bytes (the index's `total_size`).
    pub payload_bytes: u64,
    /// Sum over shards of 8 + header length.
    pub header_bytes: u64,
}

/// Write the 96 released shards as sparse header-only files into `dir` (created if
/// needed), each `set_len` to its full size without writing data, plus
/// `model.safetensors.index.json`. Takes about 120 MB of real disk (headers + index).
pub fn write_header_only_set(dir: &Path) -> std::io::Result<HeaderOnlySet> {
    std::fs::create_dir_all(dir)?;
    let mut out = HeaderOnlySet {
        n_tensors: 0,
        payload_bytes: 0,
        header_bytes: 0,
    };
    let mut index =
        BufWriter::with_capacity(1 << 20, File::create(dir.join(crate::catalog::INDEX_FILE))?);
    let mut first = true;
    let mut map = Vec::with_capacity(64 << 20);
    for shard in 1..=N_SHARDS {
        let tensors = shard_tensors(shard);
        let (json, data_len) = header_json(&tensors);
        let fname = shard_file_name(shard);
        let mut f = File::create(dir.join(&fname))?;
        f.write_all(&(json.len() as u64).to_le_bytes())?;
        f.write_all(&json)?;
        f.set_len(8 + json.len() as u64 + data_len)?;
        out.n_tensors += tensors.len();
        out.payload_bytes += data_len;
        out.header_bytes += 8 + json.len() as u64;
        for t in &tensors {
            if !first {
                map.push(b',');
            }
            first = false;
            map.extend_from_slice(b"\n    ");
            let _ = serde_json::to_writer(&mut map, &t.name);
            let _ = write!(map, ": \"{fname}\"");
        }
    }
    write!(
        index,
        "{{\n  \"metadata\": {{\n    \"total_size\": {}\n  }},\n  \"weight_map\": {{",
        out.payload_bytes
    )?;
    index.write_all(&map)?;
    index.write_all(b"\n  }\n}\n")?;
    index.flush()?;
    Ok(out)
}

/// File size of 1-based shard `shard` as built from the tensor list: 8 + header + data.
pub fn computed_shard_size(shard: usize) -> u64 {
    let (json, data) = header_json(&shard_tensors(shard));
    8 + json.len() as u64 + data
}

/// The released shards' file sizes in bytes (`SHARD_SIZES[k - 1]` is shard k's), as
/// [`computed_shard_size`] builds them from the tensor list (the test
/// `size_table_is_the_tensor_list` holds the two together). They add up to
/// [`RELEASED_BYTES`], the figure the seed's download script checks.
pub const SHARD_SIZES: [u64; N_SHARDS] = [
    2_341_216_112,
    16_990_911_504,
    16_990_911_504,
    16_567_501_776,
    16_990_911_504,
    16_990_911_504,
    16_990_911_504,
    16_567_501_776,
    16_990_911_504,
    16_990_911_504,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_990_916_912,
    16_990_916_912,
    16_990_916_912,
    16_567_507_176,
    16_567_507_176,
    4_697_664_072,
    92_289_328,
    802_448_352,
];

/// Bytes of the 96 released shards together.
pub const RELEASED_BYTES: u64 = 1_560_936_091_448;
/// The index's `metadata.total_size` of the release (tensor payload bytes, no headers).
pub const RELEASED_PAYLOAD: u64 = 1_560_860_324_864;
