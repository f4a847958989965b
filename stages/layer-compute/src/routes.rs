//! `--record-routes FILE`: the routes the router chose, kept while the model runs.
//!
//! [`RouteLog`] wraps a [`k3_protocol::routes::RouteTrace`] with what the MoE module does
//! not know: the layer being computed and the position of each row it is given (the
//! forward sets both per layer, [`crate::forward::Model::forward_batch`]). The MoE module
//! hands each row's top-k to it through [`crate::modules::LayerCtx::record_routes`].
//! Recording reads the router's choice and changes nothing computed.

use std::path::Path;

use k3_protocol::routes::{RouteTrace, RoutesError};

use crate::forward::Model;
use crate::kernels::router::Routing;
use crate::state::StateError;
use crate::weights::Weights;

/// Start recording `model`'s routes, the trace's header naming the model by its
/// fingerprint (over `config_path` and `model_dir`, as `--save-state`'s).
pub fn start<W: Weights>(
    model: &Model<W>,
    config_path: &Path,
    model_dir: &Path,
) -> Result<(), StateError> {
    let n = model.n_layers();
    let cfg = model.config();
    let fingerprint = crate::state::fingerprint(config_path, model_dir, n)?;
    let moe = (0..n)
        .filter(|&l| cfg.is_moe(l))
        .map(|l| l as u32)
        .collect();
    model.record_routes(RouteLog::new(RouteTrace::new(
        fingerprint,
        n as u32,
        moe,
        cfg.num_experts as u32,
        cfg.num_experts_per_token as u32,
    )));
    Ok(())
}

/// Write what `model` recorded to `path` (a temporary name renamed over it); the records
/// written (0 and nothing written when it was not recording).
pub fn finish<W: Weights>(model: &Model<W>, path: &Path) -> Result<u64, RoutesError> {
    let Some(log) = model.take_routes() else {
        return Ok(0);
    };
    let t = log.finish()?;
    t.write(path)?;
    Ok(t.header.records)
}

/// A route trace being recorded, with the rows of the layer now computed.
#[derive(Debug)]
pub struct RouteLog {
    trace: RouteTrace,
    /// The position of each row the MoE of `layer` is given.
    rows: Vec<u32>,
    layer: u32,
    /// The first route that did not fit the format (recording stops there).
    error: Option<RoutesError>,
}

impl RouteLog {
    /// An empty log for `trace`'s model.
    pub fn new(trace: RouteTrace) -> Self {
        RouteLog {
            trace,
            rows: Vec::new(),
            layer: 0,
            error: None,
        }
    }

    /// The layer computed next, and the positions of the rows its MoE gets: every row's
    /// (`positions`), or only the `live` ones (indices into them) when the last layer
    /// skips the others.
    pub(crate) fn set_rows(&mut self, layer: usize, positions: &[u32], live: Option<&[usize]>) {
        self.layer = layer as u32;
        self.rows.clear();
        match live {
            Some(w) => self.rows.extend(w.iter().map(|&r| positions[r])),
            None => self.rows.extend_from_slice(positions),
        }
    }

    /// Each row's top-k in the current layer, row `i` at `rows[i]`.
    pub(crate) fn push(&mut self, routes: &[Routing]) {
        if self.error.is_some() {
            return;
        }
        for (r, &pos) in routes.iter().zip(&self.rows) {
            if let Err(e) = self.trace.push(pos, self.layer, &r.ids) {
                self.error = Some(e);
                return;
            }
        }
    }

    /// The trace recorded, or the first route that could not be recorded.
    pub fn finish(self) -> Result<RouteTrace, RoutesError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.trace),
        }
    }
}
