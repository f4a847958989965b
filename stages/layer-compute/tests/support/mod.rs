//! Test support: fixture paths, an .npy reader, an .npz (zip) reader, op-fixture JSON
//! helpers and a model loader over the committed tiny models.
#![allow(dead_code)]

use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use k3_layer_compute::kernels::simd::{self, ProductPath};
use k3_layer_compute::kernels::tuning::{self, Isa, KernelTuning};
use k3_layer_compute::{Model, ModelOptions, SourceWeights};
use k3_model::config::ModelConfig;
use k3_model::mmap_weights::MmapWeights;
use k3_model::tensor::{Dtype, TensorRef, WeightError, WeightSource};

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

/// Largest |got − want|, or NaN when any element of either side is NaN (or the difference
/// is, as for +Inf against +Inf), so every `d <= tol` check fails on a NaN. Folding with
/// `f32::max` instead drops NaN and would count a NaN logit as a difference of 0.
pub fn max_abs_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let mut worst = 0f32;
    for (a, b) in got.iter().zip(want) {
        let d = (a - b).abs();
        if d.is_nan() {
            return f32::NAN;
        }
        worst = worst.max(d);
    }
    worst
}

/// Assert `got` and `want` are the same length, non-empty, and equal bit for bit; names the
/// first differing index. (`zip(..).all(..)` alone passes when one side is empty.)
pub fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(!got.is_empty(), "{what}: nothing to compare");
    if let Some(i) = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{what}: differs at [{i}]: {} vs {} (bits {:#010x} vs {:#010x})",
            got[i],
            want[i],
            got[i].to_bits(),
            want[i].to_bits()
        );
    }
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

pub type TinyModel = Model<SourceWeights<MmapWeights>>;

/// Load a tiny model directory (`tiny-seed`, `tiny-mxfp4`, or their `sharded/`).
pub fn load(rel: &str, threads: usize) -> TinyModel {
    load_layers(rel, threads, None)
}

/// [`load`] binding only the first `layers` layers (None: all).
pub fn load_layers(rel: &str, threads: usize, layers: Option<usize>) -> TinyModel {
    let dir = fixtures().join(rel);
    let cfg = ModelConfig::load_dir(&dir).unwrap_or_else(|e| panic!("{e}"));
    let w = MmapWeights::open(&dir).unwrap_or_else(|e| panic!("{e}"));
    Model::new(
        cfg,
        SourceWeights::new(w),
        ModelOptions {
            threads,
            layers,
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

// The helpers themselves: each catches a wrong helper that would let a broken engine pass.
#[test]
fn max_abs_diff_fails_on_nan() {
    // Catches a fold with f32::max, which drops NaN and reports 0.
    assert!(max_abs_diff(&[1.0, f32::NAN], &[1.0, 2.0]).is_nan());
    assert!(max_abs_diff(&[1.0, 2.0], &[f32::NAN, 2.0]).is_nan());
    // The way every gate uses it: `d <= tol` must be false for a NaN.
    let d = max_abs_diff(&[f32::NAN], &[0.0]);
    assert!(d.partial_cmp(&1e-3) != Some(std::cmp::Ordering::Less));
    assert!(max_abs_diff(&[f32::INFINITY], &[0.0]) > 1e-3);
    assert_eq!(max_abs_diff(&[1.0, 2.5], &[1.5, 2.0]), 0.5);
}

#[test]
#[should_panic(expected = "length")]
fn assert_bits_eq_checks_lengths() {
    // Catches zip(..).all(..), which passes when one side is empty.
    assert_bits_eq("x", &[], &[1.0]);
}

#[test]
#[should_panic(expected = "differs at [1]")]
fn assert_bits_eq_checks_bits() {
    // -0.0 == 0.0 as floats; bitwise it differs.
    assert_bits_eq("x", &[1.0, -0.0], &[1.0, 0.0]);
}

/// The ISAs this host runs, best first, portable last. One the CPU lacks is reported
/// (`SKIPPED:`), or fails the test when `K3_REQUIRE_SIMD` names it (`simd::runnable`).
pub fn host_paths(test: &str) -> Vec<Isa> {
    [Isa::Avx512, Isa::Avx2]
        .into_iter()
        .filter(|&i| simd::runnable(test, i))
        .chain([Isa::Portable])
        .collect()
}

/// The products capped at one ISA for this process until dropped (then the default again).
#[must_use = "the cap holds only while the guard lives"]
pub struct IsaCap {
    _turn: KernelsTurn,
}

impl Drop for IsaCap {
    fn drop(&mut self) {
        tuning::install(KernelTuning::default());
    }
}

/// Cap the products at `isa` for this process (the test's kernel choice) while the guard
/// lives; other capping tests wait for it.
pub fn cap_isa(isa: Isa) -> IsaCap {
    // A test that panicked holding the cap poisons the lock; its guard still reset the cap.
    let turn = kernels_lock();
    tuning::install(KernelTuning {
        max_isa: Some(isa),
        ..KernelTuning::default()
    });
    IsaCap { _turn: turn }
}

/// A product path and, for `bf16x3`, its hardware kernel: the gates run once on each this
/// host has, since the AVX512-BF16 and AMX kernels give different bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatePath {
    /// The `exact` path.
    Exact,
    /// `bf16x3` on its AVX512-BF16 kernel (`K3_AMX=0`) or, with a cap below AVX-512, on
    /// its portable twin (the same bits).
    Bf16x3,
    /// `bf16x3` on the AMX kernel, which has no twin.
    Amx,
}

impl GatePath {
    /// The product path.
    pub fn product(self) -> ProductPath {
        match self {
            GatePath::Exact => ProductPath::Exact,
            GatePath::Bf16x3 | GatePath::Amx => ProductPath::Bf16x3,
        }
    }

    /// Name on stderr and in failures.
    pub fn name(self) -> &'static str {
        match self {
            GatePath::Exact => "exact",
            GatePath::Bf16x3 => "bf16x3 (AVX512-BF16 kernel or its twin)",
            GatePath::Amx => "bf16x3 on AMX",
        }
    }
}

/// The product paths this host runs its gates on, `exact` first: `bf16x3` where the CPU
/// has its AVX512-BF16 kernel (else `SKIPPED:`, or a failure under
/// `K3_REQUIRE_SIMD=bf16x3`: `simd::runnable_path`), and `bf16x3` on AMX where it has that
/// (else the same under `K3_REQUIRE_SIMD=amx`: `simd::runnable_amx`).
pub fn product_paths(test: &str) -> Vec<GatePath> {
    let mut paths = vec![GatePath::Exact];
    if simd::runnable_path(test, ProductPath::Bf16x3) {
        paths.push(GatePath::Bf16x3);
    }
    if simd::runnable_amx(test) {
        paths.push(GatePath::Amx);
    }
    paths
}

/// The installed kernel tuning is process-wide and this is one test binary: a test that
/// installs a product path or an ISA cap ([`on_each_path`], [`cap_isa`]) holds the
/// tuning alone ([`kernels_lock`]); every other test that runs products holds it shared
/// ([`kernels_shared`]), so none runs on a path another test installed meanwhile.
static KERNELS: RwLock<()> = RwLock::new(());

thread_local! {
    /// Whether this thread holds [`KERNELS`] alone (a shared turn inside it is a no-op).
    static ALONE: Cell<bool> = const { Cell::new(false) };
}

/// A turn on the installed kernels ([`KERNELS`]), alone or shared, until dropped.
#[must_use = "the turn holds only while the guard lives"]
pub struct KernelsTurn {
    _alone: Option<RwLockWriteGuard<'static, ()>>,
    _shared: Option<RwLockReadGuard<'static, ()>>,
}

impl Drop for KernelsTurn {
    fn drop(&mut self) {
        if self._alone.is_some() {
            ALONE.with(|a| a.set(false));
        }
    }
}

/// The installed kernels alone: held by tests that install a tuning. A no-op on a thread
/// that holds them alone already (a test that holds them and then caps the ISA). A test
/// that panicked holding them poisons the lock; its guards still restored the default
/// tuning.
pub fn kernels_lock() -> KernelsTurn {
    let alone = if ALONE.with(|a| a.get()) {
        None
    } else {
        let w = KERNELS.write().unwrap_or_else(|e| e.into_inner());
        ALONE.with(|a| a.set(true));
        Some(w)
    };
    KernelsTurn {
        _alone: alone,
        _shared: None,
    }
}

/// The installed kernels shared with other tests that only run products (the default
/// tuning); a no-op on a thread that holds them alone.
pub fn kernels_shared() -> KernelsTurn {
    let shared = if ALONE.with(|a| a.get()) {
        None
    } else {
        Some(KERNELS.read().unwrap_or_else(|e| e.into_inner()))
    };
    KernelsTurn {
        _alone: None,
        _shared: shared,
    }
}

/// Install `path` (every other setting automatic), keeping the instruction-set cap `isa`.
pub fn install_path(path: GatePath, isa: Option<Isa>) {
    tuning::install(KernelTuning {
        product: Some(path.product()),
        max_isa: isa,
        amx: Some(path == GatePath::Amx),
        ..KernelTuning::default()
    });
}

/// Run `body` once per product path of this host ([`product_paths`]) with that path
/// installed, holding [`kernels_lock`]; the default tuning is installed again afterwards,
/// also when `body` fails. The path is named on stderr before each run, so a failure
/// says which path it was on.
pub fn on_each_path(test: &str, mut body: impl FnMut(GatePath)) {
    /// Installs the default tuning when dropped.
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            tuning::install(KernelTuning::default());
        }
    }
    let _lock = kernels_lock();
    let _restore = Restore;
    for path in product_paths(test) {
        install_path(path, None);
        eprintln!("{test}: on the {} product path", path.name());
        body(path);
    }
}
