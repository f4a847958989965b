//! Time of one real-dimension decoder layer per token: a KDA+MoE layer (layer 1) and an
//! MLA+MoE layer (layer 3) of Kimi K3, with random weights in the released dtypes held in
//! memory (BF16 trunk, F32 KDA parameters, MXFP4 experts of exactly 17,547,264 bytes), run
//! through the same `Model::forward_layer` the real forward uses.
//!
//! Run: `cargo run --release -p k3-layer-compute --example layer_bench [-- THREADS]`.
//! Needs about 2.4 GB of RAM. Prints per-token seconds and the weight bytes each layer
//! reads, as GB/s.

use std::collections::BTreeMap;
use std::time::Instant;

use k3_layer_compute::{Model, ModelOptions};
use k3_model::config::{LayerKind, ModelConfig};
use k3_model::tensor::{Dtype, TensorRef, WeightError, WeightSource};

struct RandWeights {
    map: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>,
    seed: u64,
}

impl RandWeights {
    fn next(&mut self) -> u64 {
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        self.seed
    }
    fn put(&mut self, name: String, dtype: Dtype, shape: Vec<usize>, scale: f32) {
        let n: usize = shape.iter().product();
        let bytes: Vec<u8> = match dtype {
            Dtype::BF16 => (0..n)
                .flat_map(|_| {
                    let v = ((self.next() >> 40) as f32 / 16777216.0 - 0.5) * 2.0 * scale;
                    ((v.to_bits() >> 16) as u16).to_le_bytes()
                })
                .collect(),
            Dtype::F32 => (0..n)
                .flat_map(|_| {
                    (((self.next() >> 40) as f32 / 16777216.0 - 0.5) * 2.0 * scale).to_le_bytes()
                })
                .collect(),
            _ => (0..n).map(|_| self.next() as u8).collect(),
        };
        self.map.insert(name, (dtype, shape, bytes));
    }
    fn put_scales(&mut self, name: String, shape: Vec<usize>) {
        let n: usize = shape.iter().product();
        let bytes = (0..n).map(|_| 118 + (self.next() % 3) as u8).collect();
        self.map.insert(name, (Dtype::U8, shape, bytes));
    }
}

impl WeightSource for RandWeights {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        let (d, s, b) = self
            .map
            .get(name)
            .ok_or_else(|| WeightError::Missing(name.into()))?;
        Ok(TensorRef {
            dtype: *d,
            shape: s,
            bytes: b,
        })
    }
    fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }
}

fn build(cfg: &ModelConfig, l: usize, w: &mut RandWeights) {
    let d = cfg.hidden_size;
    let p = |s: &str| format!("language_model.model.layers.{l}.{s}");
    let s = 1.0 / (d as f32).sqrt();
    for n in [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attention_res_norm.weight",
        "mlp_res_norm.weight",
    ] {
        w.put(p(n), Dtype::BF16, vec![d], 1.0);
    }
    for n in ["self_attention_res_proj.weight", "mlp_res_proj.weight"] {
        w.put(p(n), Dtype::BF16, vec![1, d], s);
    }
    match cfg.layer_kind(l) {
        LayerKind::Kda => {
            let (h, hd) = (cfg.linear_attn.num_heads, cfg.linear_attn.head_dim);
            let pw = h * hd;
            for n in ["q_proj", "k_proj", "v_proj", "g_proj"] {
                w.put(
                    p(&format!("self_attn.{n}.weight")),
                    Dtype::BF16,
                    vec![pw, d],
                    s,
                );
            }
            w.put(
                p("self_attn.o_proj.weight"),
                Dtype::BF16,
                vec![d, pw],
                1.0 / (pw as f32).sqrt(),
            );
            for n in ["q_conv1d", "k_conv1d", "v_conv1d"] {
                w.put(
                    p(&format!("self_attn.{n}.weight")),
                    Dtype::F32,
                    vec![pw, 1, cfg.linear_attn.short_conv_kernel_size],
                    0.5,
                );
            }
            w.put(p("self_attn.f_a_proj.weight"), Dtype::BF16, vec![hd, d], s);
            w.put(
                p("self_attn.f_b_proj.weight"),
                Dtype::BF16,
                vec![pw, hd],
                0.1,
            );
            w.put(p("self_attn.b_proj.weight"), Dtype::BF16, vec![h, d], s);
            w.put(p("self_attn.dt_bias"), Dtype::F32, vec![pw], 1.0);
            w.put(p("self_attn.A_log"), Dtype::F32, vec![hd], 1.0);
            w.put(p("self_attn.o_norm.weight"), Dtype::F32, vec![hd], 1.0);
        }
        LayerKind::Mla => {
            let (h, qh) = (cfg.num_attention_heads, cfg.mla_qk_head_dim());
            let (ql, kl, r, v, nope) = (
                cfg.q_lora_rank,
                cfg.kv_lora_rank,
                cfg.qk_rope_head_dim,
                cfg.v_head_dim,
                cfg.qk_nope_head_dim,
            );
            w.put(p("self_attn.q_a_proj.weight"), Dtype::BF16, vec![ql, d], s);
            w.put(
                p("self_attn.q_a_layernorm.weight"),
                Dtype::BF16,
                vec![ql],
                1.0,
            );
            w.put(
                p("self_attn.q_b_proj.weight"),
                Dtype::BF16,
                vec![h * qh, ql],
                0.03,
            );
            w.put(
                p("self_attn.kv_a_proj_with_mqa.weight"),
                Dtype::BF16,
                vec![kl + r, d],
                s,
            );
            w.put(
                p("self_attn.kv_a_layernorm.weight"),
                Dtype::BF16,
                vec![kl],
                1.0,
            );
            w.put(
                p("self_attn.kv_b_proj.weight"),
                Dtype::BF16,
                vec![h * (nope + v), kl],
                0.04,
            );
            w.put(p("self_attn.g_proj.weight"), Dtype::BF16, vec![h * v, d], s);
            w.put(
                p("self_attn.o_proj.weight"),
                Dtype::BF16,
                vec![d, h * v],
                0.01,
            );
        }
    }
    let (e, lat, sw) = (
        cfg.num_experts,
        cfg.routed_expert_hidden_size,
        cfg.shared_expert_width(),
    );
    let m = |s: &str| p(&format!("block_sparse_moe.{s}"));
    w.put(m("gate.weight"), Dtype::BF16, vec![e, d], s);
    w.put(m("gate.e_score_correction_bias"), Dtype::F32, vec![e], 0.01);
    w.put(
        m("routed_expert_down_proj.weight"),
        Dtype::BF16,
        vec![lat, d],
        s,
    );
    w.put(m("routed_expert_norm.weight"), Dtype::BF16, vec![lat], 1.0);
    w.put(
        m("routed_expert_up_proj.weight"),
        Dtype::BF16,
        vec![d, lat],
        0.02,
    );
    w.put(
        m("shared_experts.gate_proj.weight"),
        Dtype::BF16,
        vec![sw, d],
        s,
    );
    w.put(
        m("shared_experts.up_proj.weight"),
        Dtype::BF16,
        vec![sw, d],
        s,
    );
    w.put(
        m("shared_experts.down_proj.weight"),
        Dtype::BF16,
        vec![d, sw],
        0.01,
    );
    // Routed experts: see `BenchWeights` (16 stored experts serve every id).
}

/// Routed experts: every id maps to one of 16 stored random experts (same bytes per id
/// modulo 16), so the benchmark reads 16 distinct 17.5 MB experts per token like the real
/// model, without 896 of them in memory.
struct BenchWeights {
    inner: RandWeights,
}

impl k3_layer_compute::Weights for BenchWeights {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        self.inner.tensor(name)
    }
    fn experts(
        &self,
        _layer: usize,
        ids: &[u32],
        deliver: &mut dyn for<'b> FnMut(k3_layer_compute::Delivery<'b>),
    ) {
        deliver(
            (0..ids.len())
                .map(|slot| {
                    let e = k3_layer_compute::weights::expert_from_source(
                        &self.inner,
                        0,
                        (slot % 16) as u32,
                    );
                    (slot, e)
                })
                .collect(),
        );
    }
}

fn main() {
    // The kernel settings in the environment (`K3_SIMD`, ...), as k3-orch reads them.
    k3_layer_compute::kernels::tuning::install(k3_layer_compute::kernels::tuning::from_env());
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    let cfg_path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/released/config.json"
    );
    let cfg = ModelConfig::load(cfg_path).expect("released config");
    let mut w = RandWeights {
        map: BTreeMap::new(),
        seed: 0x1234_5678_9abc_def1,
    };
    let t0 = Instant::now();
    for l in [1usize, 3] {
        build(&cfg, l, &mut w);
    }
    // 16 stored experts under layer 0's names (see BenchWeights).
    let (lat, f) = (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size);
    for id in 0..16u32 {
        for (wn, r, c) in [("w1", f, lat), ("w2", lat, f), ("w3", f, lat)] {
            let b = format!("language_model.model.layers.0.block_sparse_moe.experts.{id}.{wn}");
            w.put(format!("{b}.weight_packed"), Dtype::U8, vec![r, c / 2], 0.0);
            w.put_scales(format!("{b}.weight_scale"), vec![r, c / 32]);
        }
    }
    let total: usize = w.map.values().map(|(_, _, b)| b.len()).sum();
    println!(
        "random weights: {:.2} GB built in {:.1} s; threads {threads}; kernels {}",
        total as f64 / 1e9,
        t0.elapsed().as_secs_f64(),
        k3_layer_compute::kernels::simd::Kernel::current().name()
    );
    let model = Model::new(
        cfg.clone(),
        BenchWeights { inner: w },
        ModelOptions {
            threads,
            ..Default::default()
        },
    )
    .unwrap();
    let d = cfg.hidden_size;
    for l in [1usize, 3] {
        let kind = format!("{:?}+MoE", cfg.layer_kind(l));
        let mut sess = model.new_session();
        let mut h: Vec<f32> = (0..d).map(|i| ((i % 13) as f32 - 6.0) / 10.0).collect();
        let mut bank = vec![h.clone()];
        // Warm-up token, then time 3 decode tokens.
        model
            .forward_layer(l, &mut sess, &mut h, &mut bank, 1)
            .unwrap();
        let mut best = f64::MAX;
        for _ in 0..3 {
            let mut hh = h.clone();
            let mut bb = bank.clone();
            let t = Instant::now();
            let st = model
                .forward_layer(l, &mut sess, &mut hh, &mut bb, 1)
                .unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            assert_eq!(st.expert_failures, 0);
        }
        let trunk: usize = model
            .weights()
            .inner
            .map
            .iter()
            .filter(|(n, _)| n.contains(&format!("layers.{l}.")))
            .map(|(_, (_, _, b))| b.len())
            .sum();
        let bytes = trunk + cfg.num_experts_per_token * 17_547_264;
        println!(
            "layer {l} {kind:<10} {:.3} s/token  reads {:.2} GB (trunk {:.2} + 16 experts) = {:.2} GB/s",
            best,
            bytes as f64 / 1e9,
            trunk as f64 / 1e9,
            bytes as f64 / best / 1e9
        );
    }
}
