//! How the forward pass receives its weights: the [`Weights`] trait.
//!
//! The forward asks for trunk tensors by their released name, brackets each decoder layer
//! with [`Weights::begin_layer`] / [`Weights::end_layer`] (so a trunk loader can stream
//! layers through ring slots) and its use phases with [`Weights::end_phase`] (so it can
//! stream the parts of a layer), and asks for the routed experts of a layer with
//! [`Weights::experts`], which may deliver them in ANY order, each to a callback tagged with
//! its position in the request. Compute keeps one output per request slot and combines them
//! in top-k order, so results never depend on arrival order. A failed expert load is
//! delivered as an `Err` for its slot: compute counts it (the caller exits 4) and leaves
//! that expert out of the sum.
//!
//! All methods take `&self` so trunk tensors borrowed during a layer stay valid while the
//! experts arrive; implementations needing mutation use interior mutability.
//!
//! [`SourceWeights`] adapts any [`WeightSource`] (e.g. `k3_model::mmap_weights::MmapWeights`).

use k3_model::tensor::{Dtype, TensorRef, WeightError, WeightSource};

use k3_model::classify::expert_tensor;
pub use k3_model::classify::{LM_HEAD, MODEL_PREFIX};

/// One routed-expert projection as stored.
#[derive(Clone, Copy, Debug)]
pub enum ExpertProj<'a> {
    /// A plain `weight` tensor (BF16 or F32), `[rows, cols]`.
    Dense(TensorRef<'a>),
    /// compressed-tensors MXFP4: `weight_packed` U8 `[rows, cols/2]` and `weight_scale` U8
    /// `[rows, cols/32]`.
    Mxfp4 {
        packed: TensorRef<'a>,
        scale: TensorRef<'a>,
    },
}

/// Routed experts delivered together ([`Weights::experts`]): each with its slot in the
/// request, or the reason it could not be loaded.
pub type Delivery<'b> = Vec<(usize, Result<ExpertRef<'b>, WeightError>)>;

/// The three projections of one routed expert: w1 = gate, w3 = up, w2 = down.
#[derive(Clone, Copy, Debug)]
pub struct ExpertRef<'a> {
    pub w1: ExpertProj<'a>,
    pub w2: ExpertProj<'a>,
    pub w3: ExpertProj<'a>,
}

/// Where the forward pass gets its weights.
pub trait Weights {
    /// A trunk or model-level tensor by its full released name. For a decoder-layer tensor
    /// this is only called between `begin_layer(l)` and `end_layer(l)` of its layer.
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError>;

    /// Layer `layer` is about to run (a streaming implementation waits for it here).
    fn begin_layer(&self, _layer: usize) -> Result<(), WeightError> {
        Ok(())
    }

    /// Layer `layer` is finished; its trunk tensors will not be asked for again this step.
    fn end_layer(&self, _layer: usize) {}

    /// The trunk tensors of `layer` asked for since `begin_layer` or the last `end_phase`
    /// are no longer used (the forward dropped every borrow of them): a trunk streamed in
    /// parts gives their slot back now. The forward binds a layer one use phase at a time
    /// (`k3_model::trunk::use_phase`) and calls this between phases.
    fn end_phase(&self, _layer: usize) {}

    /// Whether layer `layer`'s trunk tensors come in use-phase parts (asked between its
    /// `begin_layer` and `end_layer`): then a phase must be given back before the next is
    /// bound. False (the default): the whole layer can be bound at once, so the forward may
    /// fuse products of two phases that read the same input (a dense FFN's gate and up).
    fn in_parts(&self, _layer: usize) -> bool {
        false
    }

    /// Rows `rows` of the model-level matrix `name` (the token embedding), read on demand,
    /// as (dtype, the rows' bytes back to back). `None`: no on-demand path; the forward
    /// slices `tensor(name)` instead. An implementation that reads here never needs the
    /// whole embedding in memory: a token needs one row.
    fn model_rows(
        &self,
        _name: &str,
        _rows: &[u32],
    ) -> Option<Result<(Dtype, Vec<u8>), WeightError>> {
        None
    }

    /// The model-level matrix `name` (the lm_head) in consecutive row chunks: `f(first_row,
    /// chunk)` for chunks covering every row in order, each a `[n, cols]` tensor. `None`:
    /// not chunked (the matrix is held; the forward uses `tensor(name)`). Each output row
    /// is one dot product, so chunking never changes a logit.
    fn matrix_chunks(
        &self,
        _name: &str,
        _f: &mut dyn FnMut(usize, TensorRef<'_>) -> Result<(), WeightError>,
    ) -> Option<Result<(), WeightError>> {
        None
    }

    /// The forward will ask for the routed experts `ids` of `layer` next (the same ids,
    /// in the same order, in its next [`experts`](Self::experts) call); it says so the
    /// moment the router has chosen them, before it computes the shared experts, so an
    /// implementation that reads experts can start the reads now and overlap them with
    /// that compute. The default does nothing (`experts` then asks for them).
    fn announce_experts(&self, _layer: usize, _ids: &[u32]) {}

    /// `--speculate on`: the predictor that guesses each next layer's routed experts
    /// (`crate::predict`); None (the default): no guesses.
    fn predictor(&self) -> Option<&crate::predict::Predictor> {
        None
    }

    /// A guess of `layer`'s routed experts, made before its router runs: an
    /// implementation that reads experts may start reading them into room nobody needs.
    /// A hint only (the forward never reads what it names); the default ignores it.
    fn guess_experts(&self, _layer: usize, _ids: &[u32]) {}

    /// Deliver the routed experts `ids` of `layer` (distinct ids, in first-use order: for
    /// one token its top-k order): call `deliver` with the experts available together,
    /// as many times as needed, so that every slot `0..ids.len()` is delivered exactly
    /// once, in any order and any grouping; the borrowed weights need only live for the
    /// call. Deliver as many as are ready at once: compute multiplies the experts of one
    /// delivery side by side, one per thread (more of a prompt's few-token products then
    /// run at once, instead of each split over the pool).
    fn experts(&self, layer: usize, ids: &[u32], deliver: &mut dyn for<'b> FnMut(Delivery<'b>));
}

impl<W: Weights + ?Sized> Weights for &W {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        (**self).tensor(name)
    }
    fn begin_layer(&self, layer: usize) -> Result<(), WeightError> {
        (**self).begin_layer(layer)
    }
    fn end_layer(&self, layer: usize) {
        (**self).end_layer(layer)
    }
    fn end_phase(&self, layer: usize) {
        (**self).end_phase(layer)
    }
    fn in_parts(&self, layer: usize) -> bool {
        (**self).in_parts(layer)
    }
    fn model_rows(
        &self,
        name: &str,
        rows: &[u32],
    ) -> Option<Result<(Dtype, Vec<u8>), WeightError>> {
        (**self).model_rows(name, rows)
    }
    fn matrix_chunks(
        &self,
        name: &str,
        f: &mut dyn FnMut(usize, TensorRef<'_>) -> Result<(), WeightError>,
    ) -> Option<Result<(), WeightError>> {
        (**self).matrix_chunks(name, f)
    }
    fn announce_experts(&self, layer: usize, ids: &[u32]) {
        (**self).announce_experts(layer, ids)
    }
    fn predictor(&self) -> Option<&crate::predict::Predictor> {
        (**self).predictor()
    }
    fn guess_experts(&self, layer: usize, ids: &[u32]) {
        (**self).guess_experts(layer, ids)
    }
    fn experts(&self, layer: usize, ids: &[u32], deliver: &mut dyn for<'b> FnMut(Delivery<'b>)) {
        (**self).experts(layer, ids, deliver)
    }
}

/// Look up one routed expert in a [`WeightSource`]: MXFP4 (`w*.weight_packed` +
/// `w*.weight_scale`) when the packed tensor exists, else plain `w*.weight`.
pub fn expert_from_source<S: WeightSource + ?Sized>(
    src: &S,
    layer: usize,
    id: u32,
) -> Result<ExpertRef<'_>, WeightError> {
    let one = |w: &str| -> Result<ExpertProj<'_>, WeightError> {
        let packed = expert_tensor(layer, id as usize, &format!("{w}.weight_packed"));
        if src.contains(&packed) {
            let scale = expert_tensor(layer, id as usize, &format!("{w}.weight_scale"));
            Ok(ExpertProj::Mxfp4 {
                packed: src.tensor(&packed)?,
                scale: src.tensor(&scale)?,
            })
        } else {
            Ok(ExpertProj::Dense(src.tensor(&expert_tensor(
                layer,
                id as usize,
                &format!("{w}.weight"),
            ))?))
        }
    };
    Ok(ExpertRef {
        w1: one("w1")?,
        w2: one("w2")?,
        w3: one("w3")?,
    })
}

/// [`Weights`] over any [`WeightSource`]: every tensor is always available, experts are
/// delivered in request order, all in one delivery.
pub struct SourceWeights<S> {
    pub source: S,
}

impl<S: WeightSource> SourceWeights<S> {
    pub fn new(source: S) -> Self {
        SourceWeights { source }
    }
}

impl<S: WeightSource> Weights for SourceWeights<S> {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        self.source.tensor(name)
    }

    fn experts(&self, layer: usize, ids: &[u32], deliver: &mut dyn for<'b> FnMut(Delivery<'b>)) {
        deliver(
            ids.iter()
                .enumerate()
                .map(|(slot, &id)| (slot, expert_from_source(&self.source, layer, id)))
                .collect(),
        );
    }
}

/// Widen a BF16/F32 tensor to f32 (small vectors: norms, biases, conv taps), refusing a
/// value that is not finite ([`WeightError::NonFinite`]).
pub fn to_f32_vec(name: &str, t: &TensorRef<'_>) -> Result<Vec<f32>, WeightError> {
    let n = t.numel();
    let want = n * t.dtype.size();
    if t.bytes.len() != want {
        return Err(WeightError::Invalid {
            name: name.to_string(),
            msg: format!("{} bytes for {n} {} elements", t.bytes.len(), t.dtype),
        });
    }
    let v: Vec<f32> = match t.dtype {
        Dtype::F32 => t
            .bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => t
            .bytes
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect(),
        other => {
            return Err(WeightError::Invalid {
                name: name.to_string(),
                msg: format!("dtype {other} where BF16 or F32 is expected"),
            })
        }
    };
    // A NaN norm weight, bias, conv tap or A_log can vanish before the hidden state (a
    // router bias only steers the top-k choice): refused here, naming the tensor.
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(WeightError::NonFinite {
            name: name.to_string(),
            msg: format!("element {i} is {}", v[i]),
        }),
        None => Ok(v),
    }
}
