//! Test support: fixture paths, an .npy reader, an .npz (zip) reader, op-fixture JSON
//! helpers and a model loader over the committed tiny models.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;

use k3_layer_compute::{Model, ModelOptions, SourceWeights};
use k3_protocol::config::ModelConfig;
use k3_protocol::tensor::{Dtype, TensorRef, WeightError, WeightSource};

/// `tests/fixtures` of the repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// A parsed .npy array (f32 or i32 data, widened to f32).
#[derive(Debug, Clone)]
pub struct Npy {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Parse .npy v1/v2 bytes holding little-endian `<f4` or `<i4`, C order.
pub fn parse_npy(b: &[u8]) -> Npy {
    assert_eq!(&b[..6], b"\x93NUMPY", "not an .npy file");
    let (hlen, start) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        _ => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
    };
    let header = std::str::from_utf8(&b[start..start + hlen]).unwrap();
    assert!(header.contains("'fortran_order': False"), "npy: {header}");
    let descr = header
        .split("'descr': '")
        .nth(1)
        .unwrap()
        .split('\'')
        .next()
        .unwrap();
    let shape_s = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap();
    let shape: Vec<usize> = shape_s
        .split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let raw = &b[start + hlen..];
    let n: usize = shape.iter().product();
    let data: Vec<f32> = match descr {
        "<f4" => raw[..4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        "<i4" => raw[..4 * n]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32)
            .collect(),
        other => panic!("npy dtype {other} not supported"),
    };
    Npy { shape, data }
}

pub fn read_npy(path: &std::path::Path) -> Npy {
    parse_npy(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

/// Every member of an .npz (zip of .npy), by name without the `.npy` suffix.
pub fn read_npz(path: &std::path::Path) -> BTreeMap<String, Npy> {
    let f = std::fs::File::open(path).unwrap();
    let mut z = zip::ZipArchive::new(f).unwrap();
    let mut out = BTreeMap::new();
    for i in 0..z.len() {
        let mut m = z.by_index(i).unwrap();
        let name = m.name().trim_end_matches(".npy").to_string();
        let mut buf = Vec::new();
        m.read_to_end(&mut buf).unwrap();
        out.insert(name, parse_npy(&buf));
    }
    out
}

pub fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(
        &std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

/// A `{"shape": [...], "data": [...]}` array of an op fixture, as f32.
pub fn arr(v: &serde_json::Value, key: &str) -> Vec<f32> {
    let a = &v[key]["data"];
    a.as_array()
        .unwrap_or_else(|| panic!("fixture key {key} missing"))
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub fn shape(v: &serde_json::Value, key: &str) -> Vec<usize> {
    v[key]["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect()
}

pub fn ids(v: &serde_json::Value, key: &str) -> Vec<u32> {
    v[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// f32 values as little-endian bytes (to build F32 tensors for the kernels).
pub fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Largest |got − want|.
pub fn max_abs_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

/// Assert the MANIFEST tolerance `|got − want| ≤ atol + rtol·|want|` elementwise.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = atol + rtol * w.abs();
        let d = (g - w).abs();
        assert!(
            d <= tol,
            "{what}[{i}]: got {g}, want {w} (|diff| {d} > tol {tol})"
        );
        worst = worst.max(d / tol);
    }
    eprintln!("{what}: worst {worst:.3} of tolerance");
}

/// A minimal in-memory safetensors reader for the tests (single file or index + shards).
/// Temporary: replaced by `k3_protocol::mmap_weights::MmapWeights` once it is exported.
pub struct TestWeights {
    files: Vec<Vec<u8>>,
    map: BTreeMap<String, (usize, Dtype, Vec<usize>, usize, usize)>,
}

impl TestWeights {
    pub fn open(dir: &std::path::Path) -> TestWeights {
        let idx = dir.join("model.safetensors.index.json");
        let names: Vec<PathBuf> = if idx.is_file() {
            let j = read_json(&idx);
            let mut f: Vec<String> = j["weight_map"]
                .as_object()
                .unwrap()
                .values()
                .map(|v| v.as_str().unwrap().to_string())
                .collect();
            f.sort();
            f.dedup();
            f.into_iter().map(|n| dir.join(n)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut tw = TestWeights {
            files: Vec::new(),
            map: BTreeMap::new(),
        };
        for (fi, p) in names.iter().enumerate() {
            let b = std::fs::read(p).unwrap();
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
            for (k, v) in h.as_object().unwrap() {
                if k == "__metadata__" {
                    continue;
                }
                let dt = Dtype::parse(v["dtype"].as_str().unwrap()).unwrap();
                let sh: Vec<usize> = v["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as usize)
                    .collect();
                let o = v["data_offsets"].as_array().unwrap();
                let (a, e) = (
                    o[0].as_u64().unwrap() as usize + 8 + n,
                    o[1].as_u64().unwrap() as usize + 8 + n,
                );
                tw.map.insert(k.clone(), (fi, dt, sh, a, e));
            }
            tw.files.push(b);
        }
        tw
    }
}

impl WeightSource for TestWeights {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        let (f, dt, sh, a, e) = self
            .map
            .get(name)
            .ok_or_else(|| WeightError::Missing(name.to_string()))?;
        Ok(TensorRef {
            dtype: *dt,
            shape: sh,
            bytes: &self.files[*f][*a..*e],
        })
    }
    fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }
}

pub type TinyModel = Model<SourceWeights<TestWeights>>;

/// Load a tiny model directory (`tiny-seed`, `tiny-mxfp4`, or their `sharded/`).
pub fn load(rel: &str, threads: usize) -> TinyModel {
    let dir = fixtures().join(rel);
    let cfg = ModelConfig::load_dir(&dir).unwrap_or_else(|e| panic!("{e}"));
    let w = TestWeights::open(&dir);
    Model::new(
        cfg,
        SourceWeights::new(w),
        ModelOptions {
            threads,
            ..Default::default()
        },
    )
    .unwrap()
}

/// An in-memory [`WeightSource`] of F32 tensors (op-fixture weights under released names).
#[derive(Default)]
pub struct MapWeights {
    pub map: BTreeMap<String, (Vec<usize>, Vec<u8>)>,
}

impl MapWeights {
    pub fn put(&mut self, name: &str, shape: Vec<usize>, data: &[f32]) {
        self.map.insert(name.to_string(), (shape, le_bytes(data)));
    }
}

impl WeightSource for MapWeights {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        let (sh, b) = self
            .map
            .get(name)
            .ok_or_else(|| WeightError::Missing(name.to_string()))?;
        Ok(TensorRef {
            dtype: Dtype::F32,
            shape: sh,
            bytes: b,
        })
    }
    fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }
}
