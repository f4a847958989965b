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

/// An oracle's expected-*.json that does not hold its ids.
#[derive(Debug, thiserror::Error)]
pub enum OracleError {
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error("oracle file has no {0}")]
    Missing(&'static str),
    #[error("bad id in {0}")]
    BadId(&'static str),
}

/// (prompt_ids, full_ids) from an oracle's expected-*.json.
pub fn oracle_ids(json: &str) -> Result<(Vec<u32>, Vec<u32>), OracleError> {
    let v: serde_json::Value = serde_json::from_str(json)?;
    let ids = |k: &'static str| -> Result<Vec<u32>, OracleError> {
        v.get(k)
            .and_then(|a| a.as_array())
            .ok_or(OracleError::Missing(k))?
            .iter()
            .map(|x| x.as_u64().map(|n| n as u32).ok_or(OracleError::BadId(k)))
            .collect()
    };
    Ok((ids("prompt_ids")?, ids("full_ids")?))
}

/// demo's own arguments: the generation flags to pass on and `--keep DIR`; Err: the exit
/// code (`--help` is 0).
fn demo_args(argv: Vec<OsString>) -> Result<(Vec<String>, Option<PathBuf>), i32> {
    let mut extra: Vec<String> = Vec::new();
    for a in argv.into_iter().skip(1) {
        match a.into_string() {
            Ok(s) if s == "--help" || s == "-h" => {
                println!("usage: k3-orch demo [--inproc|--single-process] [--keep DIR] [generation flags]");
                println!("runs the bundled tiny model (tiny-mxfp4) through the staged pipeline and checks");
                println!("its greedy ids against the k3ref and llama.cpp oracles; the last line is a VERDICT.");
                return Err(0);
            }
            Ok(s) => extra.push(s),
            Err(_) => {
                tracing::error!("k3-orch demo: arguments must be UTF-8");
                return Err(2);
            }
        }
    }
    let mut keep: Option<PathBuf> = None;
    if let Some(i) = extra.iter().position(|x| x == "--keep") {
        if i + 1 >= extra.len() {
            tracing::error!("k3-orch demo: --keep needs a directory");
            return Err(2);
        }
        keep = Some(PathBuf::from(extra.remove(i + 1)));
        extra.remove(i);
    }
    Ok((extra, keep))
}

/// Where the model is written: `--keep DIR`, or a fresh private directory (mkdtemp: random
/// name, mode 0700) removed when the returned guard drops, on every way out, refusals
/// included; never a predictable /tmp/k3-demo-<pid> that may already exist.
fn work_dir(keep: Option<PathBuf>) -> Result<(PathBuf, Option<tempfile::TempDir>), i32> {
    if let Some(d) = keep {
        return Ok((d, None));
    }
    match tempfile::Builder::new().prefix("k3-demo-").tempdir() {
        Ok(d) => Ok((d.path().to_path_buf(), Some(d))),
        Err(e) => {
            tracing::error!("k3-orch demo: creating a temporary directory: {e}");
            Err(1)
        }
    }
}

/// The generated ids a run's JSON report holds (empty when it cannot be read).
fn generated_ids(report: &Path) -> Vec<u32> {
    std::fs::read(report)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| {
            v.get("generated_ids")?
                .as_array()?
                .iter()
                .map(|x| x.as_u64().map(|n| n as u32))
                .collect()
        })
        .unwrap_or_default()
}

/// The VERDICT line for the ids `got` against both oracles' continuations; the exit code.
fn verdict(got: &[u32], want: &[u32], want_llama: &[u32]) -> i32 {
    let same = got.iter().zip(want).filter(|(a, b)| a == b).count();
    if got == want && got == want_llama {
        println!(
            "VERDICT: PASS - {same}/{} generated ids identical to k3ref (float64 numpy reference) and to llama.cpp's kimi-k3 graph",
            want.len()
        );
        0
    } else {
        println!(
            "VERDICT: MISMATCH - {same}/{} generated ids match k3ref\n  got  {got:?}\n  want {want:?}",
            want.len()
        );
        1
    }
}

/// `k3-orch demo`.
pub fn main(argv: Vec<OsString>) -> i32 {
    let (extra, keep) = match demo_args(argv) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let (tmp, private) = match work_dir(keep) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let dir = match extract_bundled(&tmp) {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(
                "k3-orch demo: writing the bundled model to {}: {e}",
                tmp.display()
            );
            return 1;
        }
    };
    let (prompt, k3ref_full) = oracle_ids(EXPECTED_K3REF).expect("bundled oracle parses");
    let (_, llama_full) = oracle_ids(EXPECTED_LLAMACPP).expect("bundled oracle parses");
    let n_new = k3ref_full.len() - prompt.len();
    let out = tmp.join("k3_run.json");
    let mut args: Vec<String> = vec![
        dir.display().to_string(),
        "--ids".into(),
        prompt
            .iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(","),
        "--gen".into(),
        n_new.to_string(),
        "--incremental".into(),
        "--out".into(),
        out.display().to_string(),
    ];
    args.extend(extra);
    println!(
        "k3-orch demo: the bundled tiny-mxfp4 model (13 layers, MXFP4 experts, released layout)"
    );
    println!("              through tokenizer, trunk-loader, expert-fetcher and layer-compute\n");
    let parsed = match crate::run::args::parse(&args) {
        Ok(crate::run::args::Parsed::Run(a)) => a,
        Ok(_) => return 0,
        Err(e) => {
            tracing::error!("k3-orch demo: {e}");
            return 2;
        }
    };
    let code = match crate::run::run(&parsed) {
        Ok(c) => c,
        Err(e) => e.report(),
    };
    if code != 0 {
        println!("VERDICT: FAILED (the run exited {code})");
        return code;
    }
    let got = generated_ids(&out);
    drop(private);
    verdict(
        &got,
        &k3ref_full[prompt.len()..],
        &llama_full[prompt.len()..],
    )
}
