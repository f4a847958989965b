//! `Weights` over links: the forward pass over weights other stages own.
//!
//! [`StagedWeights`] implements [`crate::Weights`] over the loaders' links
//! ([`LoaderLinks`]): a pass starts with `StartPass`; `begin_layer(l)` waits for the
//! trunk-loader's `LayerReady{l}` and maps its tensors in place (handles into the trunk
//! region, never copied); `end_layer(l)` says `LayerDone`; `experts(layer, ids)` sends
//! `Experts` (unless `announce_experts` already has), delivers the experts to the forward
//! as their `ExpertReady` land, in whatever order the reads finish (each delivery takes
//! every `ExpertReady` already waiting: a batch's hits come in one burst), and gives each
//! slot back (`ExpertsDone`, one per expert) as soon as that delivery returns. The forward
//! keeps one output per top-k slot and sums them in top-k order, so ids do not depend on
//! arrival order.
//!
//! When the budget cannot hold a whole layer the trunk-loader sends a layer's parts instead
//! (`PartReady`, one per use phase, in use order): `begin_layer` maps the first, `tensor`
//! waits for the part that holds a name, `end_phase` gives every part held back
//! (`PartDone`), and `end_layer` gives back the rest, so compute never holds more than one
//! phase of a layer.
//!
//! Model-level tensors are this stage's own, so its cgroup pays for them together with the
//! KV cache, the recurrent state and the scratch: the final norms mapped from the shards,
//! the embedding read a row per token and the lm_head held or read in chunks
//! ([`StagedWeights::with_model_stream`], [`crate::model_stream`]; without it, both
//! mapped).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::PeerError;
use crate::weights::{Delivery, ExpertProj, ExpertRef, Weights};
use k3_model::classify::{split_expert, split_layer};
use k3_model::mmap_weights::MmapWeights;
use k3_model::tensor::{Dtype, TensorRef, WeightError, WeightSource};
use k3_protocol::messages::{Msg, Stage};
use k3_protocol::shm::{Handle, Region};

use k3_protocol::link::{recv_from, send_to, Link, LinkError, Rec};
use k3_protocol::transport::Transport;

/// One tensor of one routed expert, relative to the expert's first byte.
#[derive(Clone, Debug)]
struct RelPart {
    suffix: String,
    dtype: Dtype,
    shape: Vec<usize>,
    offset: u64,
    len: u64,
}

/// Per-pass I/O counters, filled from the loaders' reports.
#[derive(Clone, Copy, Debug, Default)]
pub struct IoCounters {
    pub trunk_read_bytes: u64,
    pub trunk_io_seconds: f64,
    pub trunk_binds: u64,
    pub trunk_hits: u64,
    pub expert_read_bytes: u64,
    pub expert_io_seconds: f64,
    pub expert_requests: u64,
    pub resident_hits: u64,
    pub expert_failed: u64,
    /// Seconds compute spent waiting on the links.
    pub wait_seconds: f64,
}

/// `Weights` over the trunk-loader's and expert-fetcher's regions.
pub struct StagedWeights {
    model: MmapWeights,
    trunk_region: Arc<Region>,
    expert_region: Arc<Region>,
    trunk: RefCell<Link>,
    fetch: RefCell<Link>,
    /// The recorder (`--record`): every layer blob and expert span read is logged.
    rec: Rec,
    /// dtype and shape of every layer trunk tensor, from the checkpoint headers.
    meta: HashMap<String, (Dtype, Vec<usize>)>,
    experts: HashMap<(u32, u32), Vec<RelPart>>,
    current: RefCell<HashMap<String, Handle>>,
    n_layers: usize,
    pass: Cell<u64>,
    io: Cell<IoCounters>,
    timeout: Option<Duration>,
    /// The first link failure seen inside a callback that cannot return it (end_layer,
    /// the expert deliveries) or under an error that would hide it (a trunk receive that
    /// fails a tensor's binding): the cause of any forward error that follows.
    link_error: RefCell<Option<PeerError>>,
    /// Embedding rows on demand and lm_head chunks (None: both from the mapping).
    stream: Option<crate::model_stream::ModelStream>,
    /// The trunk streams in parts (`PartReady`): (layer, parts of it received, parts it
    /// has); `None` while whole layers come (`LayerReady`).
    parts: Cell<Option<(usize, usize, usize)>>,
    /// Parts received and not yet given back (`PartDone`), as (layer, part).
    held: RefCell<Vec<(u32, u32)>>,
    /// The `Experts` request already sent by `announce_experts` (pass, layer, ids), which
    /// the next `experts` call for the same batch answers instead of sending it again.
    announced: RefCell<Option<(u64, usize, Vec<u32>)>>,
    /// `--speculate on`: guesses each next layer's experts (`crate::predict`).
    predictor: Option<crate::predict::Predictor>,
}

/// The two loaders' links and the shared-memory regions they publish into, as the stage is
/// handed them.
pub struct LoaderLinks {
    /// The trunk-loader's link, and its region (layers or their parts).
    pub trunk: Link,
    pub trunk_region: Arc<Region>,
    /// The expert-fetcher's link, and its region (expert slots).
    pub fetch: Link,
    pub expert_region: Arc<Region>,
}

impl StagedWeights {
    /// `Weights` over `links` for the first `n_layers` layers of `model` (whose catalog
    /// gives every trunk tensor's dtype and shape and every expert's layout); `timeout`
    /// bounds each wait on a link; `rec` records what is read (`--record`).
    pub fn new(
        model: MmapWeights,
        links: LoaderLinks,
        n_layers: usize,
        timeout: Option<Duration>,
        rec: Rec,
    ) -> Self {
        let mut meta = HashMap::new();
        // Each expert's parts with their absolute offsets, rebased below.
        let mut parts: HashMap<(u32, u32), Vec<RelPart>> = HashMap::new();
        for (name, e) in model.catalog().iter() {
            if split_layer(name.as_str()).is_none() {
                continue;
            }
            if let Some((l, e_id, suffix)) = split_expert(name.as_str()) {
                parts
                    .entry((l as u32, e_id as u32))
                    .or_default()
                    .push(RelPart {
                        suffix: suffix.to_string(),
                        dtype: e.dtype,
                        shape: e.shape.to_vec(),
                        offset: e.offset,
                        len: e.len,
                    });
            } else {
                meta.insert(name.clone(), (e.dtype, e.shape.to_vec()));
            }
        }
        let experts = parts
            .into_iter()
            .map(|(k, mut v)| {
                let start = v.iter().map(|p| p.offset).min().unwrap_or(0);
                for p in &mut v {
                    p.offset -= start;
                }
                (k, v)
            })
            .collect();
        let LoaderLinks {
            trunk,
            trunk_region,
            fetch,
            expert_region,
        } = links;
        StagedWeights {
            model,
            trunk_region,
            expert_region,
            trunk: RefCell::new(trunk),
            fetch: RefCell::new(fetch),
            rec,
            meta,
            experts,
            current: RefCell::new(HashMap::new()),
            n_layers,
            pass: Cell::new(0),
            io: Cell::new(IoCounters::default()),
            timeout,
            link_error: RefCell::new(None),
            stream: None,
            announced: RefCell::new(None),
            parts: Cell::new(None),
            held: RefCell::new(Vec::new()),
            predictor: None,
        }
    }

    /// `--speculate on`: guess each next layer's routed experts and send the fetcher a
    /// `Guess` ahead of the real request (ids never change).
    pub fn with_speculation(mut self, on: bool) -> Self {
        self.predictor = on.then(crate::predict::Predictor::new);
        self
    }

    /// Read the embedding one row per token on demand, and the lm_head in chunks of about
    /// `head_chunk_bytes` when given (else it stays mapped and held), instead of from the
    /// mapping of the shards; the streamed rows from `coded` when given.
    pub fn with_model_stream(
        mut self,
        head_chunk_bytes: Option<u64>,
        head_held_bytes: u64,
        coded: Option<crate::model_stream::CodedHeadFile>,
    ) -> std::io::Result<Self> {
        self.stream = Some(crate::model_stream::ModelStream::open(
            self.model.catalog(),
            head_chunk_bytes,
            head_held_bytes,
            coded,
        )?);
        Ok(self)
    }

    /// A link failure seen since the last call, if any (and forget it).
    pub fn take_link_error(&self) -> Option<PeerError> {
        self.link_error.borrow_mut().take()
    }

    /// Keep `e` as the link failure unless one is kept already (the first is the cause).
    fn note(&self, e: impl Into<PeerError>) {
        self.link_error.borrow_mut().get_or_insert(e.into());
    }

    /// Tell both loaders that generation is over.
    pub fn shutdown(&self) -> Result<(), LinkError> {
        for (peer, link) in [
            (Stage::TrunkLoader, &self.trunk),
            (Stage::ExpertFetcher, &self.fetch),
        ] {
            send_to(
                &mut **link.borrow_mut(),
                Stage::LayerCompute,
                peer,
                &Msg::Shutdown,
                self.timeout,
            )?;
        }
        Ok(())
    }

    /// Counters since the last call (and reset them).
    /// lm_head chunks count with the trunk's reads.
    pub fn take_io(&self) -> IoCounters {
        let mut c = self.io.replace(IoCounters::default());
        if let Some(s) = &self.stream {
            let r = s.take_read();
            c.trunk_read_bytes += r.bytes;
            c.trunk_io_seconds += r.seconds;
        }
        c
    }

    fn bump(&self, f: impl FnOnce(&mut IoCounters)) {
        let mut c = self.io.get();
        f(&mut c);
        self.io.set(c);
    }

    fn recv_trunk(&self) -> Result<Msg, WeightError> {
        let _wait = crate::profile::span(crate::profile::Phase::TrunkWait);
        let t0 = Instant::now();
        let r = recv_from(
            &mut **self.trunk.borrow_mut(),
            Stage::LayerCompute,
            Stage::TrunkLoader,
            self.timeout,
        );
        let dt = t0.elapsed().as_secs_f64();
        self.bump(|c| c.wait_seconds += dt);
        r.map_err(|e| self.trunk_link_failed(e))
    }

    /// A failed trunk link: kept as the link failure (the forward's binding error it causes
    /// would hide the peer's death), and the tensor error for the forward.
    fn trunk_link_failed(&self, e: LinkError) -> WeightError {
        let msg = e.to_string();
        self.note(e);
        WeightError::Io {
            name: "trunk".into(),
            msg,
        }
    }

    /// Check a trunk-loader's tensor spans against the checkpoint headers and map them.
    fn take_spans(
        &self,
        tensors: Vec<k3_protocol::messages::TensorSpan>,
    ) -> Result<(), WeightError> {
        let mut cur = self.current.borrow_mut();
        for t in tensors {
            match self.meta.get(&t.name) {
                Some((dt, sh))
                    if *dt == t.dtype
                        && sh.len() == t.shape.len()
                        && sh.iter().zip(&t.shape).all(|(a, b)| *a as u64 == *b) => {}
                _ => {
                    return Err(WeightError::Invalid {
                        name: t.name,
                        msg: "the trunk-loader's dtype/shape differ from the checkpoint header"
                            .into(),
                    })
                }
            }
            if self.rec.on() {
                // SAFETY: as in `tensor`: the loader keeps the part until PartDone.
                let bytes = unsafe { self.trunk_region.resolve(&t.handle) }.map_err(|e| {
                    WeightError::Invalid {
                        name: t.name.clone(),
                        msg: e.to_string(),
                    }
                })?;
                self.rec
                    .buffer(&t.handle, bytes)
                    .map_err(|msg| WeightError::Io {
                        name: t.name.clone(),
                        msg: msg.to_string(),
                    })?;
            }
            cur.insert(t.name, t.handle);
        }
        Ok(())
    }

    /// Receive the next part of layer `layer` (the trunk streams in parts) and map it.
    /// False when every part of the layer has come already.
    fn next_part(&self, layer: usize) -> Result<bool, WeightError> {
        if let Some((l, got, n)) = self.parts.get() {
            if l == layer && got >= n {
                return Ok(false);
            }
        }
        let pass = self.pass.get();
        match self.recv_trunk()? {
            Msg::PartReady {
                pass: p,
                layer: l,
                part,
                parts,
                tensors,
            } if p == pass && l as usize == layer => {
                let got = match self.parts.get() {
                    Some((pl, got, _)) if pl == layer => got,
                    _ => 0,
                };
                if part as usize != got {
                    return Err(WeightError::Io {
                        name: format!("layer {layer}"),
                        msg: format!("part {part} came, part {got} was next"),
                    });
                }
                self.parts.set(Some((layer, got + 1, parts as usize)));
                self.held.borrow_mut().push((l, part));
                self.take_spans(tensors)?;
                Ok(true)
            }
            other => Err(WeightError::Io {
                name: format!("layer {layer}"),
                msg: format!("expected PartReady of layer {layer} (pass {pass}), got {other:?}"),
            }),
        }
    }

    /// Give back every part held (`PartDone`) and forget its tensors.
    fn release_parts(&self) {
        self.current.borrow_mut().clear();
        let held = std::mem::take(&mut *self.held.borrow_mut());
        let pass = self.pass.get();
        for (layer, part) in held {
            let r = send_to(
                &mut **self.trunk.borrow_mut(),
                Stage::LayerCompute,
                Stage::TrunkLoader,
                &Msg::PartDone { pass, layer, part },
                self.timeout,
            );
            if let Err(e) = r {
                self.note(e);
            }
        }
    }

    fn expert_tensor<'a>(
        &'a self,
        bytes: &'a [u8],
        parts: &'a [RelPart],
        w: &str,
    ) -> Result<ExpertProj<'a>, WeightError> {
        let find = |suffix: &str| -> Option<TensorRef<'a>> {
            let p = parts.iter().find(|p| p.suffix == suffix)?;
            let b = bytes.get(p.offset as usize..(p.offset + p.len) as usize)?;
            Some(TensorRef {
                dtype: p.dtype,
                shape: &p.shape,
                bytes: b,
            })
        };
        if let (Some(packed), Some(scale)) = (
            find(&format!("{w}.weight_packed")),
            find(&format!("{w}.weight_scale")),
        ) {
            return Ok(ExpertProj::Mxfp4 { packed, scale });
        }
        find(&format!("{w}.weight"))
            .map(ExpertProj::Dense)
            .ok_or_else(|| WeightError::Missing(format!("expert {w}")))
    }
}

impl Weights for StagedWeights {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        if split_layer(name).is_none() {
            return self.model.tensor(name);
        }
        let (dtype, shape) = self
            .meta
            .get(name)
            .ok_or_else(|| WeightError::Missing(name.to_string()))?;
        // Streamed in parts: the parts of the layer come in use order; wait for the one
        // that holds `name` (the parts before it are the phase being bound).
        if let Some((layer, _, _)) = self.parts.get() {
            while !self.current.borrow().contains_key(name) {
                if !self.next_part(layer)? {
                    break;
                }
            }
        }
        let h = *self
            .current
            .borrow()
            .get(name)
            .ok_or_else(|| WeightError::Invalid {
                name: name.to_string(),
                msg: "asked for outside its layer (not in the current LayerReady or its parts)"
                    .into(),
            })?;
        // SAFETY: the trunk-loader rewrites this range only after our LayerDone for its
        // layer (or PartDone for its part), which end_layer (end_phase) sends after the
        // forward stopped using the tensors.
        let bytes = unsafe { self.trunk_region.resolve(&h) }.map_err(|e| WeightError::Invalid {
            name: name.to_string(),
            msg: e.to_string(),
        })?;
        Ok(TensorRef {
            dtype: *dtype,
            shape,
            bytes,
        })
    }

    fn model_rows(
        &self,
        name: &str,
        rows: &[u32],
    ) -> Option<Result<(Dtype, Vec<u8>), WeightError>> {
        self.stream.as_ref()?.rows(name, rows)
    }

    fn matrix_chunks(
        &self,
        name: &str,
        f: &mut dyn FnMut(usize, TensorRef<'_>) -> Result<(), WeightError>,
    ) -> Option<Result<(), WeightError>> {
        self.stream.as_ref()?.chunks(name, f)
    }

    fn begin_layer(&self, layer: usize) -> Result<(), WeightError> {
        if layer == 0 {
            let pass = self.pass.get() + 1;
            self.pass.set(pass);
            send_to(
                &mut **self.trunk.borrow_mut(),
                Stage::LayerCompute,
                Stage::TrunkLoader,
                &Msg::StartPass {
                    pass,
                    start: 0,
                    len: 0,
                },
                self.timeout,
            )
            .map_err(|e| self.trunk_link_failed(e))?;
        }
        let pass = self.pass.get();
        self.held.borrow_mut().clear();
        if self.parts.get().is_some() {
            // Streamed in parts: the layer's first part comes now.
            self.parts.set(Some((layer, 0, usize::MAX)));
            self.current.borrow_mut().clear();
            self.next_part(layer)?;
            return Ok(());
        }
        match self.recv_trunk()? {
            Msg::PartReady {
                pass: p,
                layer: l,
                part: 0,
                parts,
                tensors,
            } if p == pass && l as usize == layer => {
                self.parts.set(Some((layer, 1, parts as usize)));
                self.held.borrow_mut().push((l, 0));
                self.current.borrow_mut().clear();
                self.take_spans(tensors)?;
                Ok(())
            }
            Msg::LayerReady {
                pass: p,
                layer: l,
                tensors,
                handle,
            } if p == pass && l as usize == layer => {
                if self.rec.on() {
                    // SAFETY: as in `tensor`: the loader keeps the layer until LayerDone.
                    let bytes = unsafe { self.trunk_region.resolve(&handle) }.map_err(|e| {
                        WeightError::Invalid {
                            name: format!("layer {layer}"),
                            msg: e.to_string(),
                        }
                    })?;
                    self.rec
                        .buffer(&handle, bytes)
                        .map_err(|msg| WeightError::Io {
                            name: format!("layer {layer}"),
                            msg: msg.to_string(),
                        })?;
                }
                // The layer's blob was recorded above; its spans are not recorded again.
                let mut cur = self.current.borrow_mut();
                cur.clear();
                for t in tensors {
                    match self.meta.get(&t.name) {
                        Some((dt, sh))
                            if *dt == t.dtype
                                && sh.len() == t.shape.len()
                                && sh.iter().zip(&t.shape).all(|(a, b)| *a as u64 == *b) => {}
                        _ => return Err(WeightError::Invalid {
                            name: t.name,
                            msg: "the trunk-loader's dtype/shape differ from the checkpoint header"
                                .into(),
                        }),
                    }
                    cur.insert(t.name, t.handle);
                }
                Ok(())
            }
            other => Err(WeightError::Io {
                name: format!("layer {layer}"),
                msg: format!("expected LayerReady of layer {layer} (pass {pass}), got {other:?}"),
            }),
        }
    }

    fn end_phase(&self, _layer: usize) {
        if self.parts.get().is_some() {
            self.release_parts();
        }
    }

    fn in_parts(&self, _layer: usize) -> bool {
        self.parts.get().is_some()
    }

    fn end_layer(&self, layer: usize) {
        let pass = self.pass.get();
        if self.parts.get().is_some() {
            // Give back what is held, then take and give back at once the parts the
            // forward never asked for (tensors it does not use), so the stream goes on.
            self.release_parts();
            loop {
                match self.next_part(layer) {
                    Ok(true) => self.release_parts(),
                    Ok(false) => break,
                    Err(e) => {
                        self.note(PeerError::Trunk(e));
                        return;
                    }
                }
            }
            if layer + 1 == self.n_layers {
                self.finish_pass(pass);
            }
            return;
        }
        self.current.borrow_mut().clear();
        let r = send_to(
            &mut **self.trunk.borrow_mut(),
            Stage::LayerCompute,
            Stage::TrunkLoader,
            &Msg::LayerDone {
                pass,
                layer: layer as u32,
            },
            self.timeout,
        );
        if let Err(e) = r {
            self.note(e);
            return;
        }
        if layer + 1 == self.n_layers {
            self.finish_pass(pass);
        }
    }

    fn experts(&self, layer: usize, ids: &[u32], deliver: &mut dyn for<'b> FnMut(Delivery<'b>)) {
        self.experts_impl(layer, ids, deliver)
    }

    fn announce_experts(&self, layer: usize, ids: &[u32]) {
        self.announce_impl(layer, ids)
    }

    fn predictor(&self) -> Option<&crate::predict::Predictor> {
        self.predictor.as_ref()
    }

    fn guess_experts(&self, layer: usize, ids: &[u32]) {
        let m = Msg::Guess {
            pass: self.pass.get(),
            layer: layer as u32,
            experts: ids.to_vec(),
        };
        let (me, peer) = (Stage::LayerCompute, Stage::ExpertFetcher);
        let r = send_to(&mut **self.fetch.borrow_mut(), me, peer, &m, self.timeout);
        if let Err(e) = r {
            // The fetcher is gone: the next request fails with the same link.
            self.note(e);
        }
    }
}

impl StagedWeights {
    /// After the last layer of a pass: the trunk-loader's `TrunkPassDone`.
    fn finish_pass(&self, pass: u64) {
        {
            match self.recv_trunk() {
                Ok(Msg::TrunkPassDone {
                    pass: p,
                    binds,
                    hits,
                    read_bytes,
                    io_seconds,
                }) if p == pass => self.bump(|c| {
                    c.trunk_binds += binds;
                    c.trunk_hits += hits;
                    c.trunk_read_bytes += read_bytes;
                    c.trunk_io_seconds += io_seconds;
                }),
                Ok(other) => self.note(PeerError::OutOfTurn {
                    peer: Stage::TrunkLoader,
                    want: "TrunkPassDone",
                    got: format!("{other:?}"),
                }),
                // Kept by `recv_trunk`.
                Err(_) => {}
            }
        }
    }

    /// Ask the fetcher for a layer's batch of experts in this pass.
    fn send_experts(
        &self,
        link: &mut dyn Transport,
        layer: usize,
        ids: &[u32],
    ) -> Result<(), LinkError> {
        send_to(
            link,
            Stage::LayerCompute,
            Stage::ExpertFetcher,
            &Msg::Experts {
                pass: self.pass.get(),
                layer: layer as u32,
                ids: ids.to_vec(),
            },
            self.timeout,
        )
    }

    fn announce_impl(&self, layer: usize, ids: &[u32]) {
        let pass = self.pass.get();
        *self.announced.borrow_mut() = None;
        let r = self.send_experts(&mut **self.fetch.borrow_mut(), layer, ids);
        match r {
            Ok(()) => *self.announced.borrow_mut() = Some((pass, layer, ids.to_vec())),
            // `experts` sends it again and fails every slot with the link's error.
            Err(e) => self.note(e),
        }
    }

    fn experts_impl(
        &self,
        layer: usize,
        ids: &[u32],
        deliver: &mut dyn for<'b> FnMut(Delivery<'b>),
    ) {
        let mut req = Pending {
            pass: self.pass.get(),
            layer,
            ids,
            delivered: vec![false; ids.len()],
        };
        // Already requested by `announce_experts` (the same batch): only collect it. A
        // different batch than announced cannot happen with the forward in this crate; if
        // it did, the announced one would be answered first and this one fail as
        // unexpected, so it is refused plainly instead.
        let sent = match self.announced.borrow_mut().take() {
            Some((p, l, a)) if p == req.pass && l == layer && a == ids => true,
            Some((p, l, _)) => {
                let e = PeerError::Internal(format!(
                    "experts of layer {layer} asked for, but the batch announced was layer {l} \
                     (pass {p}) with other ids"
                ));
                self.fail_request(&mut req, deliver, e);
                return;
            }
            None => false,
        };
        let mut link = self.fetch.borrow_mut();
        if !sent {
            if let Err(e) = self.send_experts(&mut **link, layer, ids) {
                self.fail_request(&mut req, deliver, e.into());
                return;
            }
        }
        loop {
            let msgs = self.recv_burst(&mut **link);
            let burst = self.take_burst(&mut req, msgs, &mut **link);
            if !burst.delivery.is_empty() {
                deliver(burst.delivery);
            }
            // An `ExpertRef` cannot outlive its delivery (its lifetime is the callback's):
            // no byte of these experts is read again.
            for id in burst.held {
                self.release_expert(&mut **link, &req, id);
            }
            if let Some(end) = burst.end {
                self.finish_request(&mut req, deliver, end);
                return;
            }
        }
    }

    /// Record a link failure and fail every slot of `req` not yet delivered with it.
    fn fail_request(
        &self,
        req: &mut Pending<'_>,
        deliver: &mut dyn for<'b> FnMut(Delivery<'b>),
        e: PeerError,
    ) {
        let msg = e.to_string();
        self.note(e);
        req.fail_rest(deliver, &msg);
    }

    /// The next message from the fetcher (waiting for it), and every `ExpertReady` or
    /// `ExpertFailed` that has already arrived behind it: one delivery's worth.
    fn recv_burst(&self, link: &mut dyn Transport) -> Vec<Result<Msg, LinkError>> {
        let t0 = Instant::now();
        let first = recv_from(
            link,
            Stage::LayerCompute,
            Stage::ExpertFetcher,
            self.timeout,
        );
        let dt = t0.elapsed().as_secs_f64();
        self.bump(|c| c.wait_seconds += dt);
        let mut msgs = vec![first];
        while let Some(Ok(Msg::ExpertReady { .. } | Msg::ExpertFailed { .. })) = msgs.last() {
            match link.recv(Some(Duration::ZERO)) {
                Ok(m) => msgs.push(Ok(m)),
                // Nothing waiting, or a failing link: the next blocking receive says why.
                Err(_) => break,
            }
        }
        msgs
    }

    /// Turn a burst of the fetcher's messages for `req` into one delivery: each expert
    /// ready for a slot still open is bound (its slot held until the delivery returns),
    /// each failed one becomes its slot's error, and an expert not (or no longer) asked for
    /// is given back at once. The first other message ends the burst (and the request).
    fn take_burst<'a>(
        &'a self,
        req: &mut Pending<'_>,
        msgs: Vec<Result<Msg, LinkError>>,
        link: &mut dyn Transport,
    ) -> Burst<'a> {
        let (pass, layer) = (req.pass, req.layer);
        let mut burst = Burst {
            delivery: Vec::with_capacity(msgs.len()),
            held: Vec::with_capacity(msgs.len()),
            end: None,
        };
        for m in msgs {
            match m {
                Ok(Msg::ExpertReady {
                    pass: p,
                    layer: l,
                    id,
                    handle,
                }) if p == pass && l as usize == layer => {
                    let Some(slot) = req.claim(id) else {
                        self.release_expert(link, req, id);
                        continue;
                    };
                    self.record_expert(&handle);
                    burst
                        .delivery
                        .push((slot, self.bind_expert(layer, id, &handle)));
                    burst.held.push(id);
                }
                Ok(Msg::ExpertFailed {
                    pass: p,
                    layer: l,
                    id,
                    error,
                }) if p == pass && l as usize == layer => {
                    if let Some(slot) = req.claim(id) {
                        // The fetcher's message already names the expert and says "read
                        // failed"; keep only its cause.
                        let msg = error
                            .strip_prefix(&format!("layer {layer} expert {id}: read failed: "))
                            .map(str::to_string)
                            .unwrap_or(error);
                        let name = format!("layer {layer} expert {id}");
                        burst
                            .delivery
                            .push((slot, Err(WeightError::Io { name, msg })));
                    }
                }
                // The batch's end, or a failure: handled once this delivery is done.
                other => {
                    burst.end = Some(other);
                    break;
                }
            }
        }
        burst
    }

    /// Log a published expert's bytes to the recorder (`--record`), when recording.
    fn record_expert(&self, handle: &Handle) {
        if !self.rec.on() {
            return;
        }
        // SAFETY: as in `bind_expert`: the fetcher holds the slot until our ExpertsDone.
        if let Ok(b) = unsafe { self.expert_region.resolve(handle) } {
            if let Err(e) = self.rec.buffer(handle, b) {
                self.note(e);
            }
        }
    }

    /// Map the published expert `id` of `layer` and bind its three projections.
    fn bind_expert(
        &self,
        layer: usize,
        id: u32,
        handle: &Handle,
    ) -> Result<ExpertRef<'_>, WeightError> {
        let parts = self
            .experts
            .get(&(layer as u32, id))
            .ok_or_else(|| WeightError::Missing(format!("layer {layer} expert {id}")))?;
        // SAFETY: the fetcher holds this expert's slot (never rewrites it) until our
        // ExpertsDone for it, which we send only after the delivery holding it has returned.
        let bytes =
            unsafe { self.expert_region.resolve(handle) }.map_err(|e| WeightError::Invalid {
                name: format!("layer {layer} expert {id}"),
                msg: e.to_string(),
            })?;
        Ok(ExpertRef {
            w1: self.expert_tensor(bytes, parts, "w1")?,
            w2: self.expert_tensor(bytes, parts, "w2")?,
            w3: self.expert_tensor(bytes, parts, "w3")?,
        })
    }

    /// Give expert `id`'s slot back to the fetcher (`ExpertsDone`): it holds a published
    /// slot until then, which is sent as soon as the delivery holding the expert has
    /// returned (or at once for one we do not use).
    fn release_expert(&self, link: &mut dyn Transport, req: &Pending<'_>, id: u32) {
        let m = Msg::ExpertsDone {
            pass: req.pass,
            layer: req.layer as u32,
            ids: vec![id],
        };
        if let Err(e) = send_to(
            link,
            Stage::LayerCompute,
            Stage::ExpertFetcher,
            &m,
            self.timeout,
        ) {
            self.note(e);
        }
    }

    /// The message that ended `req`: on its `ExpertBatchDone`, add the fetcher's counters
    /// and fail every slot it never sent; on anything else, fail the request with it.
    fn finish_request(
        &self,
        req: &mut Pending<'_>,
        deliver: &mut dyn for<'b> FnMut(Delivery<'b>),
        end: Result<Msg, LinkError>,
    ) {
        match end {
            Ok(Msg::ExpertBatchDone {
                pass: p,
                layer: l,
                requests,
                resident_hits,
                failed,
                read_bytes,
                io_seconds,
            }) if p == req.pass && l as usize == req.layer => {
                self.bump(|c| {
                    c.expert_requests += requests;
                    c.resident_hits += resident_hits;
                    c.expert_failed += failed;
                    c.expert_read_bytes += read_bytes;
                    c.expert_io_seconds += io_seconds;
                });
                req.fail_rest(deliver, "the fetcher finished the batch without it");
            }
            Ok(other) => {
                let e = PeerError::OutOfTurn {
                    peer: Stage::ExpertFetcher,
                    want: "ExpertReady, ExpertFailed or ExpertBatchDone",
                    got: format!("{other:?}"),
                };
                self.fail_request(req, deliver, e);
            }
            Err(e) => self.fail_request(req, deliver, e.into()),
        }
    }
}

/// One `Experts` request being answered: which of its slots have been delivered.
struct Pending<'i> {
    pass: u64,
    layer: usize,
    ids: &'i [u32],
    delivered: Vec<bool>,
}

impl Pending<'_> {
    /// The slot of expert `id` when it is asked for and not delivered yet (it is from now).
    fn claim(&mut self, id: u32) -> Option<usize> {
        let slot = self.ids.iter().position(|&x| x == id)?;
        if self.delivered[slot] {
            return None;
        }
        self.delivered[slot] = true;
        Some(slot)
    }

    /// Deliver every slot not delivered yet as failed with `msg`.
    fn fail_rest(&mut self, deliver: &mut dyn for<'b> FnMut(Delivery<'b>), msg: &str) {
        let (layer, ids) = (self.layer, self.ids);
        let left: Delivery<'_> = self
            .delivered
            .iter_mut()
            .enumerate()
            .filter(|(_, d)| !**d)
            .map(|(i, d)| {
                *d = true;
                let name = format!("layer {layer} expert {}", ids[i]);
                let msg = msg.to_string();
                (i, Err(WeightError::Io { name, msg }))
            })
            .collect();
        if !left.is_empty() {
            deliver(left);
        }
    }
}

/// What one burst of the fetcher's messages gives ([`StagedWeights::take_burst`]).
struct Burst<'a> {
    /// The experts to deliver together (or their slots' errors).
    delivery: Delivery<'a>,
    /// The ids whose slots the delivery holds, given back once it returns.
    held: Vec<u32>,
    /// The message that ended the burst and the request (the batch's end, or a failure).
    end: Option<Result<Msg, LinkError>>,
}
