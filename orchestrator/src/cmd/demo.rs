//! `k3-orch demo`: the bundled tiny model through the staged pipeline, checked against the
//! oracle.
//!
//! The tiny-mxfp4 model (13 layers, released tensor names and dtypes, compressed-tensors
//! MXFP4 experts, released multi-shard layout) is compiled into the binary, so the demo
//! works from any directory. It is written to a temporary directory, run through the four
//! stage processes with incremental decode, and the generated ids are compared with the
//! ids of k3ref (a float64 numpy reference written from the spec by other people) and of
//! llama.cpp's kimi-k3 graph. The last line is a VERDICT.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The bundled model's files, (name, bytes).
pub const BUNDLED: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/config.json"
        )),
    ),
    (
        "model.safetensors.index.json",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model.safetensors.index.json"
        )),
    ),
    (
        "model-00001-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00001-of-000014.safetensors"
        )),
    ),
    (
        "model-00002-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00002-of-000014.safetensors"
        )),
    ),
    (
        "model-00003-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00003-of-000014.safetensors"
        )),
    ),
    (
        "model-00004-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00004-of-000014.safetensors"
        )),
    ),
    (
        "model-00005-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00005-of-000014.safetensors"
        )),
    ),
    (
        "model-00006-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00006-of-000014.safetensors"
        )),
    ),
    (
        "model-00007-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00007-of-000014.safetensors"
        )),
    ),
    (
        "model-00008-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00008-of-000014.safetensors"
        )),
    ),
    (
        "model-00009-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00009-of-000014.safetensors"
        )),
    ),
    (
        "model-00010-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00010-of-000014.safetensors"
        )),
    ),
    (
        "model-00011-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00011-of-000014.safetensors"
        )),
    ),
    (
        "model-00012-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00012-of-000014.safetensors"
        )),
    ),
    (
        "model-00013-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00013-of-000014.safetensors"
        )),
    ),
    (
        "model-00014-of-000014.safetensors",
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-mxfp4/sharded/model-00014-of-000014.safetensors"
        )),
    ),
];

/// k3ref's expected output for the bundled model (prompt and greedy continuation).
pub const EXPECTED_K3REF: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/tiny-mxfp4/expected-k3ref.json"
));
/// llama.cpp's expected output for the same model.
pub const EXPECTED_LLAMACPP: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/tiny-mxfp4/expected-llamacpp.json"
));

/// Write the bundled model into `dir` (created), returning the model directory.
pub fn extract_bundled(dir: &Path) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    for (name, bytes) in BUNDLED {
        std::fs::write(dir.join(name), bytes)?;
    }
    Ok(dir.to_path_buf())
}

/// (prompt_ids, full_ids) from an oracle's expected-*.json.
pub fn oracle_ids(json: &str) -> Result<(Vec<u32>, Vec<u32>), String> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let ids = |k: &str| -> Result<Vec<u32>, String> {
        v.get(k)
            .and_then(|a| a.as_array())
            .ok_or_else(|| format!("oracle file has no {k}"))?
            .iter()
            .map(|x| {
                x.as_u64()
                    .map(|n| n as u32)
                    .ok_or_else(|| format!("bad id in {k}"))
            })
            .collect()
    };
    Ok((ids("prompt_ids")?, ids("full_ids")?))
}

pub fn main(args: Vec<OsString>) -> i32 {
    crate::gen::demo(args)
}
