//! Route traces (`--record-routes FILE`): every token's routed experts per MoE layer, as
//! layer-compute's router chose them, in a compact binary file with a JSON header. Written
//! by layer-compute (staged) or the orchestrator (`--single-process`), read by
//! `k3-orch sim-cache` and `k3-orch project --trace`. It lives here because two processes
//! agree on it, as [`crate::record`] does.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! 8 bytes   magic "K3ROUTES"
//! u32       format version (1)
//! u32       header length H
//! H bytes   JSON header (RouteHeader): fingerprint, layers, moe_layers, experts, top_k, records
//! records   `records` of them, each 4 + 2 + 2·top_k bytes:
//!           u32 position (the token's index in its sequence), u16 layer,
//!           top_k × u16 expert ids (the router's top-k, best first)
//! ```
//!
//! Records are in the order they were computed: pass by pass, in each pass layer by layer,
//! in each layer row by row; a prompt pass's rows come before the decode steps. A row the
//! last layer skips (a prompt row whose logits nobody reads) has no record there. 38 bytes
//! per token and MoE layer for Kimi K3 (top-16): 3.5 KB a token.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The file's first bytes.
pub const MAGIC: &[u8; 8] = b"K3ROUTES";
/// The format version this code writes and reads.
pub const VERSION: u32 = 1;
/// The header's `format` value.
pub const FORMAT: &str = "k3-routes-1";
/// The largest header accepted.
const HEADER_CAP: usize = 1 << 20;

/// A route trace that could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum RoutesError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}: not a route trace (no K3ROUTES magic)")]
    Magic(String),
    #[error("{path}: {what}")]
    Malformed { path: String, what: String },
    #[error("expert {id} or layer {layer} does not fit the format's 16 bits")]
    Wide { layer: u32, id: u32 },
    #[error("a route of {got} experts where the trace's top-k is {want}")]
    TopK { got: usize, want: usize },
}

/// What a route trace describes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteHeader {
    /// Always [`FORMAT`].
    pub format: String,
    /// The model's fingerprint (`k3_layer_compute::state::fingerprint`: config, headers,
    /// sampled data, layers bound).
    pub fingerprint: String,
    /// Layers the run bound.
    pub layers: u32,
    /// The MoE layers among them (the only ones with records).
    pub moe_layers: Vec<u32>,
    /// Routed experts per layer.
    pub experts: u32,
    /// Experts each token takes per MoE layer.
    pub top_k: u32,
    /// Records that follow the header.
    pub records: u64,
}

/// One token's route through one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub position: u32,
    pub layer: u32,
    /// The router's top-k, best first.
    pub ids: Vec<u32>,
}

/// A route trace being recorded or read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteTrace {
    pub header: RouteHeader,
    /// The records' bytes (each `4 + 2 + 2·top_k`).
    body: Vec<u8>,
}

impl RouteTrace {
    /// An empty trace for a model.
    pub fn new(
        fingerprint: String,
        layers: u32,
        moe_layers: Vec<u32>,
        experts: u32,
        top_k: u32,
    ) -> Self {
        RouteTrace {
            header: RouteHeader {
                format: FORMAT.into(),
                fingerprint,
                layers,
                moe_layers,
                experts,
                top_k,
                records: 0,
            },
            body: Vec::new(),
        }
    }

    fn record_len(&self) -> usize {
        6 + 2 * self.header.top_k as usize
    }

    /// Append one token's route through `layer`.
    pub fn push(&mut self, position: u32, layer: u32, ids: &[u32]) -> Result<(), RoutesError> {
        if ids.len() != self.header.top_k as usize {
            return Err(RoutesError::TopK {
                got: ids.len(),
                want: self.header.top_k as usize,
            });
        }
        let wide = |x: u32| u16::try_from(x).map_err(|_| RoutesError::Wide { layer, id: x });
        let l = wide(layer)?;
        // Checked before anything is appended: a refused route leaves the body whole.
        let ids: Vec<u16> = ids.iter().map(|&id| wide(id)).collect::<Result<_, _>>()?;
        self.body.extend_from_slice(&position.to_le_bytes());
        self.body.extend_from_slice(&l.to_le_bytes());
        for id in ids {
            self.body.extend_from_slice(&id.to_le_bytes());
        }
        self.header.records += 1;
        Ok(())
    }

    /// The records, in order.
    pub fn routes(&self) -> impl Iterator<Item = Route> + '_ {
        self.body.chunks_exact(self.record_len()).map(|c| Route {
            position: u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            layer: u16::from_le_bytes([c[4], c[5]]) as u32,
            ids: c[6..]
                .chunks_exact(2)
                .map(|x| u16::from_le_bytes([x[0], x[1]]) as u32)
                .collect(),
        })
    }

    /// The whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let h = serde_json::to_vec(&self.header).expect("a header serializes");
        let mut out = Vec::with_capacity(16 + h.len() + self.body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(h.len() as u32).to_le_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(&self.body);
        out
    }

    /// Write the file atomically (a temporary name renamed over `path`).
    pub fn write(&self, path: &Path) -> Result<(), RoutesError> {
        k3_io::output::write_atomic(path, &self.to_bytes()).map_err(|source| RoutesError::Io {
            path: path.display().to_string(),
            source,
        })
    }

    /// Whether `bytes` start like a route trace.
    pub fn is_route_trace(bytes: &[u8]) -> bool {
        bytes.starts_with(MAGIC)
    }

    /// Parse a whole file; `name` is used in errors. Every record is checked against the
    /// header: its layer among `moe_layers`, its ids below `experts`.
    pub fn parse(bytes: &[u8], name: &str) -> Result<RouteTrace, RoutesError> {
        let bad = |what: String| RoutesError::Malformed {
            path: name.to_string(),
            what,
        };
        if !Self::is_route_trace(bytes) {
            return Err(RoutesError::Magic(name.to_string()));
        }
        if bytes.len() < 16 {
            return Err(bad("truncated before the header".into()));
        }
        let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        if version != VERSION {
            return Err(bad(format!(
                "format version {version}, this k3 reads {VERSION}"
            )));
        }
        let hlen = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]) as usize;
        if hlen > HEADER_CAP || 16 + hlen > bytes.len() {
            return Err(bad(format!("header length {hlen} runs past the file")));
        }
        let header: RouteHeader = serde_json::from_slice(&bytes[16..16 + hlen])
            .map_err(|e| bad(format!("header: {e}")))?;
        if header.format != FORMAT {
            return Err(bad(format!("header format {:?}", header.format)));
        }
        if header.top_k == 0 || header.top_k > header.experts {
            return Err(bad(format!(
                "top_k {} of {} experts",
                header.top_k, header.experts
            )));
        }
        let t = RouteTrace {
            header,
            body: bytes[16 + hlen..].to_vec(),
        };
        let want = (t.header.records as u128) * t.record_len() as u128;
        if want != t.body.len() as u128 {
            return Err(bad(format!(
                "{} bytes of records where the header's {} records of {} bytes make {want}",
                t.body.len(),
                t.header.records,
                t.record_len()
            )));
        }
        for (i, r) in t.routes().enumerate() {
            if !t.header.moe_layers.contains(&r.layer) {
                return Err(bad(format!(
                    "record {i}: layer {} is not a MoE layer",
                    r.layer
                )));
            }
            if let Some(id) = r.ids.iter().find(|&&id| id >= t.header.experts) {
                return Err(bad(format!(
                    "record {i}: expert {id} of {}",
                    t.header.experts
                )));
            }
        }
        Ok(t)
    }

    /// Read and parse a file (at most `k3_io::input::TRACE_CAP` bytes).
    pub fn read(path: &Path) -> Result<RouteTrace, RoutesError> {
        let name = path.display().to_string();
        let bytes = k3_io::input::read_capped(path, k3_io::input::TRACE_CAP).map_err(|source| {
            RoutesError::Io {
                path: name.clone(),
                source,
            }
        })?;
        Self::parse(&bytes, &name)
    }
}
