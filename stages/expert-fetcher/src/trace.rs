//! `--dump-cache-trace DIR`: record every routed-expert request and write it out as
//! `expert_trace.bin` (int32 little-endian `(layer, expert)` pairs, the format
//! [`crate::sim::read_trace`] and `k3-orch sim-cache` replay) and `expert_hist.json`
//! (requests per expert).
//!
//! Files are written to a temporary name and renamed when complete, so a crash never leaves
//! a half-written trace that looks whole.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::sim::Key;

/// A trace that could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TraceWriteError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("layer {0} does not fit an int32")]
    Layer(u32),
    #[error("expert {0} does not fit an int32")]
    Expert(u32),
    #[error("{0}")]
    Json(#[source] serde_json::Error),
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> TraceWriteError + '_ {
    move |source| TraceWriteError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Collects requests in order. Cheap enough to leave on for a whole run (8 bytes a request).
#[derive(Clone, Debug, Default)]
pub struct TraceRecorder {
    requests: Vec<Key>,
}

impl TraceRecorder {
    /// An empty recorder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record the experts one batch asked for, in the order asked.
    pub fn record(&mut self, layer: u32, ids: &[u32]) {
        self.requests.extend(ids.iter().map(|&e| (layer, e)));
    }

    /// Everything recorded so far.
    pub fn requests(&self) -> &[Key] {
        &self.requests
    }

    /// Write `expert_trace.bin` and `expert_hist.json` into `dir` (created if missing).
    pub fn write(&self, dir: &Path) -> Result<(PathBuf, PathBuf), TraceWriteError> {
        write_cache_trace(dir, &self.requests)
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), TraceWriteError> {
    k3_io::output::write_atomic(path, bytes).map_err(io_at(path))
}

/// The `expert_hist.json` document for a trace: requests, distinct experts, and per layer the
/// request count of every expert that was requested.
pub fn hist_json(requests: &[Key]) -> serde_json::Value {
    let mut per: BTreeMap<u32, BTreeMap<u32, u64>> = BTreeMap::new();
    for &(l, e) in requests {
        *per.entry(l).or_default().entry(e).or_default() += 1;
    }
    let distinct: usize = per.values().map(|m| m.len()).sum();
    let layers: serde_json::Map<String, serde_json::Value> = per
        .iter()
        .map(|(l, m)| {
            let experts: serde_json::Map<String, serde_json::Value> = m
                .iter()
                .map(|(e, c)| (e.to_string(), serde_json::json!(c)))
                .collect();
            (l.to_string(), serde_json::Value::Object(experts))
        })
        .collect();
    serde_json::json!({
        "format": "k3-expert-hist-1",
        "requests": requests.len(),
        "distinct": distinct,
        "layers": layers,
    })
}

/// Write `DIR/expert_trace.bin` and `DIR/expert_hist.json`; returns their paths.
pub fn write_cache_trace(
    dir: &Path,
    requests: &[Key],
) -> Result<(PathBuf, PathBuf), TraceWriteError> {
    // Only the last component is created (never `mkdir -p` of a mistyped path).
    match std::fs::create_dir(dir) {
        Err(e) if !(e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir()) => {
            return Err(io_at(dir)(e))
        }
        _ => {}
    }
    let mut bin = Vec::with_capacity(requests.len() * 8);
    for &(l, e) in requests {
        let l = i32::try_from(l).map_err(|_| TraceWriteError::Layer(l))?;
        let e = i32::try_from(e).map_err(|_| TraceWriteError::Expert(e))?;
        bin.extend_from_slice(&l.to_le_bytes());
        bin.extend_from_slice(&e.to_le_bytes());
    }
    let trace = dir.join("expert_trace.bin");
    let hist = dir.join("expert_hist.json");
    write_atomically(&trace, &bin)?;
    let text = serde_json::to_string_pretty(&hist_json(requests)).map_err(TraceWriteError::Json)?;
    write_atomically(&hist, text.as_bytes())?;
    Ok((trace, hist))
}
