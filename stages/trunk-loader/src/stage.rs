//! The trunk-loader stage: owns the trunk's memory and publishes one layer at a time.
//!
//! Two modes:
//! - **streamed** (`--trunk DIR`): `trunk.bin` + `trunk.json` from `pack-trunk`, served by
//!   `k3_trunk_loader::TrunkLoader` (pinned prefix + ring of slots, O_DIRECT reads running
//!   ahead in layer order) over a shared-memory arena this stage owns and first-touches.
//! - **resident** (no `--trunk`): every layer's trunk tensors are read once from the shards,
//!   tensor by tensor (any shard layout works), into one region, and stay.
//!
//! A coded trunk's layers the plan keeps coded (`--trunk-resident`) have their stored runs
//! read once into the arena after the ring, and are then served through the ring like
//! streamed ones, decoded from memory instead of read.
//!
//! When the budget cannot hold one slot for the largest layer, the trunk streams in parts
//! instead (`k3_model::trunk::TrunkManifest::layer_parts`: the tensors the forward uses
//! together), each part a loader unit answered by `PartReady` / `PartDone`.
//!
//! Per pass, compute sends `StartPass`; this stage answers `LayerReady{layer, handle,
//! tensors}` for layers 0..n in order, as fast as memory allows, and frees a ring slot only
//! when compute's `LayerDone` for it arrives. After the last `LayerDone` it sends
//! `TrunkPassDone` with what the pass cost.
//!
//! A failure ([`TrunkStageError`]) is reported to the orchestrator once, as a
//! `StageFailure` of its kind (`k3_protocol::failure`).

// Tuples of catalog fields are clearer here than one-off structs.
#![allow(clippy::type_complexity)]

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::loader::{LoaderError, Piece, Unit, UnitReadError};
use crate::{LayerRun, LoadError, RingPolicy, TrunkLoader};
use k3_io::arena::ALIGN;
use k3_io::direct::DirectFiles;
use k3_model::catalog::{Catalog, CatalogError};
use k3_model::classify::{split_expert, split_layer};
use k3_model::tensor::Dtype;
use k3_model::trunk::{TrunkError, TrunkManifest};
use k3_protocol::conf::{TrunkConf, TRUNK_REGION};
use k3_protocol::failure::{FailureKind, StageFailure};
use k3_protocol::link::{recv_from, send_to, LinkError, ProtocolError, RecError, StageCtx};
use k3_protocol::messages::{Msg, Stage, TensorSpan};
use k3_protocol::shm::{HandleError, Region, ShmArena, ShmError};
use k3_protocol::transport::Transport;

/// One tensor of a layer, relative to the layer's bytes.
#[derive(Clone, Debug)]
struct LayerTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    offset: u64,
    len: u64,
}

/// Trunk tensors of every bound layer, grouped by layer, in catalog (file) order.
pub fn layer_tensors(
    cat: &Catalog,
    layers: usize,
) -> Vec<Vec<(String, usize, u64, u64, Dtype, Vec<usize>)>> {
    let mut out = vec![Vec::new(); layers];
    for (name, e) in cat.iter() {
        let Some((l, _)) = split_layer(&name) else {
            continue;
        };
        if l >= layers || split_expert(&name).is_some() {
            continue;
        }
        out[l].push((name, e.shard, e.offset, e.len, e.dtype, e.shape.to_vec()));
    }
    out
}

/// One part of a layer when the trunk streams in parts: unit `i` of the loader.
#[derive(Clone, Debug)]
struct PartUnit {
    layer: usize,
    part: usize,
    parts: usize,
    /// Offsets relative to the unit's first arena byte.
    tensors: Vec<LayerTensor>,
}

enum Source {
    Streamed {
        loader: TrunkLoader,
        manifest: Box<TrunkManifest>,
        /// Offset of each layer's first payload byte inside its arena mirror.
        head: Vec<u64>,
        /// `Some`: the trunk streams in parts (a budget below one whole layer): the
        /// loader's units are these, in stream order, and compute gets `PartReady`.
        parts: Option<Vec<PartUnit>>,
        /// A coded trunk's decoding reader (its stored and decoded byte counters).
        coded: Option<Arc<k3_model::codec_trunk::CodedReader>>,
    },
    Resident {
        /// Per layer: (offset of the layer in the region, its tensors).
        layers: Vec<(u64, u64, Vec<LayerTensor>)>,
    },
}

/// Why the trunk-loader stage stopped. The messages name the stage (`trunk-loader:`), or the
/// trunk layer that could not be served.
#[derive(Debug, thiserror::Error)]
pub enum TrunkStageError {
    #[error("trunk-loader: bad Configure: {0}")]
    Configure(#[source] serde_json::Error),
    #[error("trunk-loader: {0}")]
    Manifest(#[source] TrunkError),
    #[error("trunk-loader: {} holds {have} layers, the run binds {binds}", dir.display())]
    TooFewLayers {
        dir: PathBuf,
        have: usize,
        binds: usize,
    },
    #[error("trunk-loader: {0}")]
    Plan(#[source] crate::PlanError),
    #[error("trunk-loader: {0}")]
    Catalog(#[source] CatalogError),
    #[error("trunk-loader: layer {layer} has no trunk tensors in {}", dir.display())]
    NoTrunkTensors { layer: usize, dir: PathBuf },
    /// The shared-memory region for the trunk (`what`: the arena, the resident trunk).
    #[error("trunk-loader: {what}: {source}")]
    Region {
        what: String,
        #[source]
        source: ShmError,
    },
    /// Opening the trunk's files (`path` names the file when the message should).
    #[error("trunk-loader: {}{source}", path.as_ref().map(|p| format!("{}: ", p.display())).unwrap_or_default())]
    Open {
        path: Option<PathBuf>,
        #[source]
        source: std::io::Error,
    },
    #[error("trunk-loader: reading {name}: {source}")]
    ReadTensor {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("trunk-loader: {0}")]
    Loader(#[source] LoaderError),
    /// A layer (or part) could not be served.
    #[error("{0}")]
    Load(#[source] LoadError),
    #[error("trunk layer {layer} part {part}: read failed: {why}")]
    PartRead {
        layer: usize,
        part: usize,
        why: UnitReadError,
    },
    #[error("trunk layer {layer} part {part}: {source}")]
    Part {
        layer: usize,
        part: usize,
        #[source]
        source: LoadError,
    },
    /// A handle into the trunk region (`what`: the layer or tensor).
    #[error("trunk-loader: {what}: {source}")]
    Handle {
        what: String,
        #[source]
        source: ShmError,
    },
    #[error("trunk-loader: {what}: {source}")]
    Resolve {
        what: String,
        #[source]
        source: HandleError,
    },
    #[error("trunk-loader: PartDone of layer {layer} part {part}: no such part")]
    NoSuchPart { layer: u32, part: u32 },
    #[error(
        "trunk-loader: PartDone of layer {layer} part {part}, but the trunk is served whole layers"
    )]
    NotInParts { layer: u32, part: u32 },
    /// Compute sent something else than the `LayerDone` awaited (its debug form).
    #[error("trunk-loader: expected LayerDone of pass {pass}, got {got}")]
    ExpectedDone { pass: u64, got: String },
    #[error("trunk-loader: unexpected {0}")]
    Unexpected(String),
    #[error(transparent)]
    Record(#[from] RecError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error(transparent)]
    Link(#[from] LinkError),
}

impl From<TrunkStageError> for StageFailure {
    fn from(e: TrunkStageError) -> StageFailure {
        use TrunkStageError as E;
        let kind = match e {
            E::Protocol(p) => return p.into(),
            E::Link(l) => return l.into(),
            E::Configure(_)
            | E::Manifest(_)
            | E::TooFewLayers { .. }
            | E::Plan(_)
            | E::Catalog(_)
            | E::NoTrunkTensors { .. } => FailureKind::Config,
            E::Region { .. }
            | E::Open { .. }
            | E::ReadTensor { .. }
            | E::Loader(_)
            | E::Load(_)
            | E::PartRead { .. }
            | E::Part { .. }
            | E::Record(_) => FailureKind::Io,
            E::Handle { .. }
            | E::Resolve { .. }
            | E::NoSuchPart { .. }
            | E::NotInParts { .. }
            | E::ExpectedDone { .. }
            | E::Unexpected(_) => FailureKind::Protocol,
        };
        StageFailure::new(kind, e.to_string())
    }
}

/// Run the trunk-loader stage until shutdown; a failure is also reported to the
/// orchestrator.
pub fn run(mut ctx: StageCtx) -> Result<(), StageFailure> {
    serve(&mut ctx).map_err(|e| ctx.fail(e))
}

fn serve(ctx: &mut StageCtx) -> Result<(), TrunkStageError> {
    ctx.wait_configure()?;
    let conf: TrunkConf =
        serde_json::from_str(&ctx.conf_json).map_err(TrunkStageError::Configure)?;
    let me = Stage::TrunkLoader;
    let (region, source, total_read) = {
        // Progress of the up-front read, at most every 100 ms (and at the end).
        let mut last = Instant::now();
        let ctx = &*ctx;
        let mut progress = |done: u64, total: u64| {
            if done == total || last.elapsed() >= Duration::from_millis(100) {
                last = Instant::now();
                ctx.progress("load", done, total);
            }
        };
        setup(&conf, &mut progress)?
    };
    tracing::debug!(
        arena_bytes = region.data_len(),
        read_bytes = total_read.0,
        read_seconds = total_read.1,
        "trunk-loader: arena ready"
    );
    ctx.share_region(&region, "trunk")?;
    test_load_delay();
    ctx.ready()?;
    ctx.wait_go()?;
    let mut link = ctx.take_link(Stage::LayerCompute)?;
    if let Source::Streamed { loader, .. } = &source {
        loader.hold_wrap(conf.hold_wrap);
    }
    let mut server = PassServer::new(ctx, &mut *link, &region, &source, conf.layers);
    let mut resident_read = total_read;
    let mut passes = 0u64;
    loop {
        let pass = match recv_from(&mut *server.link, me, Stage::LayerCompute, None)? {
            Msg::StartPass { pass, .. } => {
                if let Source::Streamed { loader, .. } = &source {
                    loader.open_pass();
                }
                pass
            }
            Msg::Shutdown => break,
            other => return Err(TrunkStageError::Unexpected(format!("{other:?}"))),
        };
        passes += 1;
        let before = stats_of(&source);
        server.serve_pass(pass, passes == 1)?;
        let after = stats_of(&source);
        let first_resident = std::mem::take(&mut resident_read);
        send_to(
            &mut *server.link,
            me,
            Stage::LayerCompute,
            &Msg::TrunkPassDone {
                pass,
                binds: after.0 - before.0,
                hits: after.1 - before.1,
                read_bytes: after.2 - before.2 + first_resident.0,
                io_seconds: after.3 - before.3 + first_resident.1,
            },
            None,
        )?;
    }
    let summary = match &source {
        Source::Streamed {
            loader,
            parts,
            manifest,
            coded,
            ..
        } => serde_json::json!({
            "mode": if parts.is_some() { "streamed in parts" } else { "streamed" },
            "plan": loader.plan(),
            "stats": loader.stats(),
            "passes": passes,
            // A coded trunk: what the disk delivered against what the slots received.
            // Layers kept coded decode their stored bytes from memory, never read them.
            "codec": coded.as_ref().zip(manifest.codec.as_ref()).map(|(r, c)| serde_json::json!({
                "name": c.name,
                "stored_bytes_read": r.stored_bytes_read(),
                "stored_bytes_kept": r.stored_bytes_kept(),
                "decoded_bytes": r.decoded_bytes(),
                "kept_layers": loader.plan().kept,
                "kept_bytes": loader.plan().kept_bytes,
            })),
        }),
        Source::Resident { layers } => serde_json::json!({
            "mode": "resident",
            "layers": layers.len(),
            "bytes": region.data_len(),
            "read_bytes": total_read.0,
            "read_seconds": total_read.1,
            "passes": passes,
        }),
    };
    ctx.send_control(&Msg::Summary {
        stage: me,
        json: summary.to_string(),
    })?;
    Ok(ctx.finish_recording()?)
}

/// The test hook `K3_TEST_LOAD_DELAY_MS=N`: the stage says it is ready N ms after its
/// load, so a test sees the window in which `serve` answers 503 ("loading"). Honoured only
/// with `K3_TEST_HOOKS=1`; the orchestrator refuses it (exit 2, before any stage starts)
/// when unarmed or not a positive integer (`k3-orch`'s `check_test_hooks`).
fn test_load_delay() {
    if std::env::var("K3_TEST_HOOKS").as_deref() != Ok("1") {
        return;
    }
    let ms = std::env::var("K3_TEST_LOAD_DELAY_MS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(ms) = ms {
        tracing::warn!("trunk-loader: TEST HOOK K3_TEST_LOAD_DELAY_MS: ready {ms} ms late");
        std::thread::sleep(Duration::from_millis(ms));
    }
}

/// Serves one pass after another: publishes the units in forward order as far as the ring
/// allows, and frees each streamed unit's slot when compute says it is done with it.
struct PassServer<'a> {
    ctx: &'a StageCtx,
    link: &'a mut dyn Transport,
    region: &'a Region,
    source: &'a Source,
    /// The loader's unit for each stream unit, in the order the forward uses them (parts
    /// are the loader's in the plan's order, pinned first).
    fwd: Vec<usize>,
    /// Units below this are pinned (never wait for a ring slot).
    pinned: usize,
    ring_slots: usize,
}

impl<'a> PassServer<'a> {
    fn new(
        ctx: &'a StageCtx,
        link: &'a mut dyn Transport,
        region: &'a Region,
        source: &'a Source,
        layers: usize,
    ) -> PassServer<'a> {
        let (pinned, ring_slots) = match source {
            Source::Streamed { loader, .. } => {
                (loader.plan().pinned, loader.plan().ring_slots.max(1))
            }
            Source::Resident { layers } => (layers.len(), usize::MAX),
        };
        let fwd: Vec<usize> = match source {
            Source::Streamed {
                parts: Some(parts), ..
            } => {
                let mut v: Vec<usize> = (0..parts.len()).collect();
                v.sort_by_key(|&i| (parts[i].layer, parts[i].part));
                v
            }
            _ => (0..layers).collect(),
        };
        PassServer {
            ctx,
            link,
            region,
            source,
            fwd,
            pinned,
            ring_slots,
        }
    }

    /// Serve every unit of pass `pass` (the first pass is the prefill, whose progress is
    /// reported) and wait until compute is done with each.
    fn serve_pass(&mut self, pass: u64, first: bool) -> Result<(), TrunkStageError> {
        let mut outstanding: VecDeque<usize> = VecDeque::new();
        let mut done = 0usize;
        // Units served per pass: layers, or the layers' parts.
        let n = self.fwd.len();
        for (l, li) in self.fwd.clone().into_iter().enumerate() {
            // A streamed layer needs a free ring slot: wait for compute to finish one.
            if li >= self.pinned {
                while outstanding.len() >= self.ring_slots {
                    self.retire_one(pass, &mut outstanding)?;
                    done += 1;
                    self.prefill_progress(first, done, n);
                }
            }
            let ready = publish(self.region, self.source, li, pass)?;
            send_to(
                &mut *self.link,
                Stage::TrunkLoader,
                Stage::LayerCompute,
                &ready,
                None,
            )?;
            self.record(&ready, l)?;
            if li >= self.pinned {
                outstanding.push_back(li);
            }
        }
        while done < n {
            self.retire_one(pass, &mut outstanding)?;
            done += 1;
            self.prefill_progress(first, done, n);
        }
        Ok(())
    }

    /// When recording, log the bytes of what `ready` (the message for forward unit `l`)
    /// published.
    fn record(&self, ready: &Msg, l: usize) -> Result<(), TrunkStageError> {
        let rec = &self.ctx.rec;
        if let (true, Msg::LayerReady { handle, .. }) = (rec.on(), ready) {
            // SAFETY: this stage wrote the layer and rewrites it only after compute's
            // LayerDone for it; reading it here races with nobody.
            let bytes = unsafe { self.region.resolve(handle) }.map_err(|source| {
                TrunkStageError::Resolve {
                    what: format!("layer {l}"),
                    source,
                }
            })?;
            rec.buffer(handle, bytes)?;
        }
        if let (true, Msg::PartReady { tensors, .. }) = (rec.on(), ready) {
            for t in tensors {
                // SAFETY: as above: the part stays until compute's PartDone for it.
                let bytes = unsafe { self.region.resolve(&t.handle) }.map_err(|source| {
                    TrunkStageError::Resolve {
                        what: t.name.clone(),
                        source,
                    }
                })?;
                rec.buffer(&t.handle, bytes)?;
            }
        }
        Ok(())
    }

    /// Wait for compute to finish one unit of this pass, free its ring slot and forget it.
    fn retire_one(
        &mut self,
        pass: u64,
        outstanding: &mut VecDeque<usize>,
    ) -> Result<(), TrunkStageError> {
        let d = wait_done(&mut *self.link, pass, self.source)?;
        release(self.source, d)?;
        if let Some(pos) = outstanding.iter().position(|&x| x == d) {
            outstanding.remove(pos);
        }
        Ok(())
    }

    /// The first pass is the prefill (the whole prompt through one layer at a time): say
    /// how many layers it has done.
    fn prefill_progress(&self, first: bool, done: usize, n: usize) {
        if first {
            self.ctx.progress("prefill", done as u64, n as u64);
        }
    }
}

/// (binds, hits, bytes read for the units served, io seconds) so far.
fn stats_of(s: &Source) -> (u64, u64, u64, f64) {
    match s {
        Source::Streamed { loader, .. } => {
            let st = loader.stats();
            (st.binds, st.hits, loader.served_bytes(), st.io_seconds)
        }
        Source::Resident { .. } => (0, 0, 0, 0.0),
    }
}

fn wait_done(
    link: &mut dyn Transport,
    pass: u64,
    source: &Source,
) -> Result<usize, TrunkStageError> {
    match recv_from(link, Stage::TrunkLoader, Stage::LayerCompute, None)? {
        Msg::LayerDone { pass: p, layer } if p == pass => Ok(layer as usize),
        Msg::PartDone {
            pass: p,
            layer,
            part,
        } if p == pass => match source {
            Source::Streamed {
                parts: Some(parts), ..
            } => parts
                .iter()
                .position(|u| u.layer == layer as usize && u.part == part as usize)
                .ok_or(TrunkStageError::NoSuchPart { layer, part }),
            _ => Err(TrunkStageError::NotInParts { layer, part }),
        },
        other => Err(TrunkStageError::ExpectedDone {
            pass,
            got: format!("{other:?}"),
        }),
    }
}

fn release(s: &Source, layer: usize) -> Result<(), TrunkStageError> {
    match s {
        Source::Streamed { loader, .. } => loader.release(layer).map_err(TrunkStageError::Load),
        Source::Resident { .. } => Ok(()),
    }
}

fn publish(region: &Region, s: &Source, l: usize, pass: u64) -> Result<Msg, TrunkStageError> {
    let handle_of = |what: &str, off: u64, len: u64| {
        region
            .handle(0, off, len)
            .map_err(|source| TrunkStageError::Handle {
                what: what.to_string(),
                source,
            })
    };
    let (base, len, tensors): (u64, u64, Vec<LayerTensor>) = match s {
        Source::Streamed {
            loader,
            parts: Some(parts),
            ..
        } => {
            let u = &parts[l];
            let h = loader.acquire(l).map_err(|e| match e {
                LoadError::Read { why, .. } => TrunkStageError::PartRead {
                    layer: u.layer,
                    part: u.part,
                    why,
                },
                source => TrunkStageError::Part {
                    layer: u.layer,
                    part: u.part,
                    source,
                },
            })?;
            let mut spans = Vec::with_capacity(u.tensors.len());
            for t in &u.tensors {
                spans.push(TensorSpan {
                    handle: handle_of(&t.name, h.arena_offset + t.offset, t.len)?,
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                });
            }
            return Ok(Msg::PartReady {
                pass,
                layer: u.layer as u32,
                part: u.part as u32,
                parts: u.parts as u32,
                tensors: spans,
            });
        }
        Source::Streamed {
            loader,
            manifest,
            head,
            parts: None,
            ..
        } => {
            let h = loader.acquire(l).map_err(TrunkStageError::Load)?;
            let ml = &manifest.layers[l];
            let ts = ml
                .tensors
                .iter()
                .map(|t| LayerTensor {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.iter().map(|&d| d as u64).collect(),
                    offset: t.offset,
                    len: t.len,
                })
                .collect();
            (h.arena_offset + head[l], ml.length, ts)
        }
        Source::Resident { layers } => {
            let (off, len, ts) = &layers[l];
            (*off, *len, ts.clone())
        }
    };
    let handle = handle_of(&format!("layer {l}"), base, len)?;
    let mut spans = Vec::with_capacity(tensors.len());
    for t in tensors {
        spans.push(TensorSpan {
            handle: handle_of(&t.name, base + t.offset, t.len)?,
            name: t.name,
            dtype: t.dtype,
            shape: t.shape,
        });
    }
    Ok(Msg::LayerReady {
        pass,
        layer: l as u32,
        handle,
        tensors: spans,
    })
}

/// Build the arena and the source; returns the bytes and seconds of the up-front reads.
fn setup(
    conf: &TrunkConf,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(Arc<Region>, Source, (u64, f64)), TrunkStageError> {
    match &conf.trunk_dir {
        Some(dir) => setup_streamed(conf, dir),
        None => setup_resident(conf, progress),
    }
}

fn setup_streamed(
    conf: &TrunkConf,
    dir: &std::path::Path,
) -> Result<(Arc<Region>, Source, (u64, f64)), TrunkStageError> {
    let manifest = TrunkManifest::load_dir(dir).map_err(TrunkStageError::Manifest)?;
    if manifest.layers.len() < conf.layers {
        return Err(TrunkStageError::TooFewLayers {
            dir: dir.to_path_buf(),
            have: manifest.layers.len(),
            binds: conf.layers,
        });
    }
    let layers = &manifest.layers[..conf.layers];
    let runs: Vec<LayerRun> = layers
        .iter()
        .map(|l| LayerRun {
            offset: l.offset,
            len: l.padded_length,
        })
        .collect();
    let head: Vec<u64> = layers.iter().map(|l| l.offset % ALIGN as u64).collect();
    // Whole layers when one slot for the largest fits the budget; else the layers' parts
    // (the tensors the forward uses together), so no slot holds a whole layer.
    let mut checks = manifest.run_checks();
    checks.truncate(conf.layers);
    let streams = crate::Streams::of_manifest(&manifest, conf.layers)
        .with_decode_weight(conf.decode_weight_ppm)
        .with_resident(conf.trunk_resident);
    let sp = crate::plan_streams_with(
        conf.budget_bytes,
        &streams,
        RingPolicy::default(),
        conf.sink_bytes,
    )
    .map_err(TrunkStageError::Plan)?;
    let p = sp.plan;
    let (units, parts) = if sp.parts {
        let (units, parts) = part_units(&manifest, conf.layers, &mut checks);
        // The loader's units in the plan's order (pinned first); `PartUnit` keeps each
        // one's place in the stream.
        match &sp.order {
            Some(order) => (
                order.iter().map(|&i| units[i].clone()).collect(),
                Some(order.iter().map(|&i| parts[i].clone()).collect()),
            ),
            None => (units, Some(parts)),
        }
    } else {
        let units: Vec<Unit> = runs
            .iter()
            .enumerate()
            .map(|(l, r)| Unit {
                pieces: vec![Piece {
                    offset: r.offset,
                    len: r.len,
                    check: Some((l, 0)),
                    tensor_checks: Vec::new(),
                }],
            })
            .collect();
        (units, None)
    };
    let bytes = p.bytes().max(ALIGN as u64);
    let region = trunk_region(bytes, format!("arena of {bytes} bytes"), "arena")?;
    // Layers kept coded: their stored runs after the ring, read now (the arena is not
    // shared with compute before setup returns).
    let keep = crate::loader::KeepCoded {
        layers: &sp.kept,
        arena: Arc::new(ShmArena(region.clone())),
        at: p.kept_at(),
    };
    let (reader, coded) =
        crate::loader::trunk_reader_keeping(dir, &conf.trunk_copies, &manifest, Some(keep))
            .map_err(TrunkStageError::Loader)?;
    let loader = TrunkLoader::with_units_grid(
        units,
        p,
        reader,
        0,
        Arc::new(ShmArena(region.clone())),
        checks,
        crate::loader::ChunkGrid::of(&manifest),
    )
    .map_err(TrunkStageError::Loader)?;
    let mut manifest = manifest;
    manifest.layers.truncate(conf.layers);
    Ok((
        region,
        Source::Streamed {
            loader,
            manifest: Box::new(manifest),
            head,
            parts,
            coded,
        },
        (0, 0.0),
    ))
}

/// The parts of layers `0..layers` as loader units (in stream order: layer by layer, each
/// layer's parts in use order) and what each part holds. Each tensor is checked by its own
/// CRCs: their checks are appended to `checks`.
fn part_units(
    m: &TrunkManifest,
    layers: usize,
    checks: &mut Vec<k3_model::trunk::RunCheck>,
) -> (Vec<Unit>, Vec<PartUnit>) {
    let mut units = Vec::new();
    let mut parts = Vec::new();
    for (l, ml) in m.layers.iter().enumerate().take(layers) {
        let lp = m.layer_parts(l);
        let n = lp.len();
        for (k, part) in lp.into_iter().enumerate() {
            let mut pieces: Vec<Piece> = part
                .pieces
                .iter()
                .map(|pc| Piece {
                    offset: ml.offset + pc.at,
                    len: pc.len,
                    check: None,
                    tensor_checks: Vec::new(),
                })
                .collect();
            for &(i, _, pk) in &part.tensors {
                if let Some(c) = m.tensor_check(l, i) {
                    pieces[pk]
                        .tensor_checks
                        .push((checks.len(), ml.tensors[i].offset - part.pieces[pk].at));
                    checks.push(c);
                }
            }
            units.push(Unit { pieces });
            parts.push(PartUnit {
                layer: l,
                part: k,
                parts: n,
                tensors: part
                    .tensors
                    .iter()
                    .map(|&(i, off, _)| {
                        let t = &ml.tensors[i];
                        LayerTensor {
                            name: t.name.clone(),
                            dtype: t.dtype,
                            shape: t.shape.iter().map(|&d| d as u64).collect(),
                            offset: off,
                            len: t.len,
                        }
                    })
                    .collect(),
            });
        }
    }
    (units, parts)
}

fn setup_resident(
    conf: &TrunkConf,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(Arc<Region>, Source, (u64, f64)), TrunkStageError> {
    let cat = Catalog::open(&conf.model_dir).map_err(TrunkStageError::Catalog)?;
    let per_layer = layer_tensors(&cat, conf.layers);
    let mut layout = Vec::with_capacity(per_layer.len());
    let mut at = 0u64;
    for (l, ts) in per_layer.iter().enumerate() {
        if ts.is_empty() {
            return Err(TrunkStageError::NoTrunkTensors {
                layer: l,
                dir: conf.model_dir.clone(),
            });
        }
        let start = at;
        let mut tensors = Vec::with_capacity(ts.len());
        for (name, _, _, len, dtype, shape) in ts {
            tensors.push(LayerTensor {
                name: name.clone(),
                dtype: *dtype,
                shape: shape.iter().map(|&d| d as u64).collect(),
                offset: at - start,
                len: *len,
            });
            at = (at + len).div_ceil(64) * 64;
        }
        layout.push((start, at - start, tensors));
        at = at.div_ceil(ALIGN as u64) * ALIGN as u64;
    }
    let bytes = at.max(ALIGN as u64);
    let region = trunk_region(
        bytes,
        format!("{bytes} bytes for the resident trunk"),
        "trunk",
    )?;
    let paths: Vec<PathBuf> = cat.shards().iter().map(|s| s.path.clone()).collect();
    let reader =
        DirectFiles::open(&paths).map_err(|source| TrunkStageError::Open { path: None, source })?;
    let mut scratch = None;
    let t0 = Instant::now();
    let mut read = 0u64;
    // Read each tensor straight into its place in the region, in bounded chunks: no copy
    // buffer the size of the largest tensor (484 MB for layer 0's dense FFN) on top of the
    // arena, which the stage's cgroup budget does not cover.
    const CHUNK: u64 = 8 << 20;
    let total: u64 = per_layer.iter().flat_map(|ts| ts.iter().map(|t| t.3)).sum();
    for (l, ts) in per_layer.iter().enumerate() {
        let (start, _, tensors) = &layout[l];
        for ((name, shard, off, len, _, _), t) in ts.iter().zip(tensors) {
            let mut done = 0u64;
            while done < *len {
                let n = (*len - done).min(CHUNK);
                // SAFETY: the region is not shared yet (it is handed to compute only after
                // setup returns), so nothing else reads or writes this range.
                let dst =
                    unsafe { region.bytes_mut(start + t.offset + done, n) }.map_err(|source| {
                        TrunkStageError::Handle {
                            what: name.clone(),
                            source,
                        }
                    })?;
                reader
                    .read_exact_unaligned(*shard as u32, *off + done, dst, &mut scratch)
                    .map_err(|source| TrunkStageError::ReadTensor {
                        name: name.clone(),
                        source,
                    })?;
                done += n;
                progress(read + done, total);
            }
            read += len;
        }
    }
    if total == 0 {
        progress(0, 0);
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok((region, Source::Resident { layers: layout }, (read, secs)))
}

/// The trunk region of `bytes`, created and first-touched (so this stage's cgroup pays);
/// `what` and `touched` name it in the errors.
fn trunk_region(bytes: u64, what: String, touched: &str) -> Result<Arc<Region>, TrunkStageError> {
    let region = Region::create(TRUNK_REGION, "trunk", bytes, 1)
        .map_err(|source| TrunkStageError::Region { what, source })?;
    region
        .prefault()
        .map_err(|source| TrunkStageError::Region {
            what: format!("first touch of the {touched}"),
            source,
        })?;
    Ok(Arc::new(region))
}

/// How long compute may keep a layer before the loader gives up on it.
pub const LAYER_TIMEOUT: Duration = Duration::from_secs(600);

#[cfg(test)]
mod tests {
    use super::*;

    /// The orchestrator decides by kind: a trunk that does not fit the run is
    /// configuration, a read that failed is I/O, a message out of turn is the protocol.
    #[test]
    fn failures_carry_their_kind() {
        let kind = |e: TrunkStageError| StageFailure::from(e).kind;
        assert_eq!(
            kind(TrunkStageError::TooFewLayers {
                dir: "t".into(),
                have: 2,
                binds: 3
            }),
            FailureKind::Config
        );
        let read = LoadError::Read {
            layer: 4,
            why: UnitReadError::Io("injected".into()),
        };
        let f = StageFailure::from(TrunkStageError::Load(read));
        assert_eq!(f.kind, FailureKind::Io);
        assert_eq!(f.detail, "trunk layer 4: read failed: injected");
        assert_eq!(
            kind(TrunkStageError::NoSuchPart { layer: 1, part: 9 }),
            FailureKind::Protocol
        );
    }
}
