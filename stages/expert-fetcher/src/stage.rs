//! The expert-fetcher stage: owns the expert arena and serves routed experts to compute.
//!
//! Compute sends `Experts{layer, ids}` as soon as routing is known; this stage answers one
//! `ExpertReady{handle}` per expert the moment it is in the arena (hits first, then reads as
//! they land, issued in disk order at queue depth `readers`), or `ExpertFailed`, then
//! `ExpertBatchDone` with the batch's counters. The arena is a shared-memory region this
//! stage creates and first-touches, so its budget is charged to this stage's cgroup.
//!
//! A failure ([`FetcherStageError`]) is reported to the orchestrator once, as a
//! `StageFailure` of its kind (`k3_protocol::failure`); an expert that fails to load is not
//! one: it is an `ExpertFailed` and the batch goes on.

use std::sync::Arc;
use std::time::Duration;

use crate::devices::DeviceMap;
use crate::fetcher::{
    slots_for_budget, BatchEvent, BatchIo, ExpertCacheConfig, ReaderGone, SetupError,
};
use crate::locate::{ExpertTable, Locate, TableError};
use crate::trace::TraceWriteError;
use crate::ExpertFetcher;
use k3_io::direct::{DirectFiles, FaultyReader, ReadAt};
use k3_io::slot_bytes_for;
use k3_model::catalog::{Catalog, CatalogError};
use k3_model::experts::PackedExperts;
use k3_protocol::conf::{FetcherConf, EXPERT_REGION};
use k3_protocol::failure::{FailureKind, StageFailure};
use k3_protocol::link::{
    recv_from, send_to, LinkError, LinkOp, ProtocolError, Rec, RecError, StageCtx,
};
use k3_protocol::messages::{Msg, Stage};
use k3_protocol::shm::{HandleError, Region, ShmArena, ShmError};
use k3_protocol::transport::{Transport, TransportError};

/// Why the expert-fetcher stage stopped. Every message starts with `expert-fetcher:`.
#[derive(Debug, thiserror::Error)]
pub enum FetcherStageError {
    #[error("expert-fetcher: bad Configure: {0}")]
    Configure(#[source] serde_json::Error),
    #[error("expert-fetcher: {0}")]
    Catalog(#[source] CatalogError),
    #[error("expert-fetcher: {0}")]
    Table(#[source] TableError),
    /// `--experts DIR...` cannot serve this model.
    #[error("expert-fetcher: --experts: {0}")]
    Packed(#[source] k3_model::experts::ExpertsError),
    /// The arena's shared-memory region (`what`: its creation, its first touch).
    #[error("expert-fetcher: {what}: {source}")]
    Arena {
        what: String,
        #[source]
        source: ShmError,
    },
    #[error("expert-fetcher: {0}")]
    Open(#[source] std::io::Error),
    #[error("expert-fetcher: {0}")]
    Setup(#[source] SetupError),
    #[error("expert-fetcher: --dump-cache-trace: {0}")]
    Trace(#[source] TraceWriteError),
    /// A published expert's bytes could not be read back for the recording.
    #[error("expert-fetcher: {0}")]
    Resolve(#[source] HandleError),
    #[error("expert-fetcher: unexpected {0}")]
    Unexpected(String),
    /// Compute sent something else than an `ExpertsDone` during a batch (its debug form).
    #[error("expert-fetcher: expected ExpertsDone during a batch, got {0}")]
    ExpectedDone(String),
    #[error(transparent)]
    Record(#[from] RecError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error(transparent)]
    Link(#[from] LinkError),
}

impl From<FetcherStageError> for StageFailure {
    fn from(e: FetcherStageError) -> StageFailure {
        use FetcherStageError as E;
        let kind = match e {
            E::Protocol(p) => return p.into(),
            E::Link(l) => return l.into(),
            E::Configure(_) | E::Catalog(_) | E::Table(_) | E::Packed(_) => FailureKind::Config,
            E::Arena { .. } | E::Open(_) | E::Setup(_) => FailureKind::ExpertLoad,
            E::Trace(_) | E::Record(_) => FailureKind::Io,
            E::Resolve(_) | E::Unexpected(_) | E::ExpectedDone(_) => FailureKind::Protocol,
        };
        StageFailure::new(kind, e.to_string())
    }
}

/// Run the expert-fetcher stage until shutdown; a failure is also reported to the
/// orchestrator.
pub fn run(mut ctx: StageCtx) -> Result<(), StageFailure> {
    serve(&mut ctx).map_err(|e| ctx.fail(e))
}

fn serve(ctx: &mut StageCtx) -> Result<(), FetcherStageError> {
    ctx.wait_configure()?;
    let conf: FetcherConf =
        serde_json::from_str(&ctx.conf_json).map_err(FetcherStageError::Configure)?;
    let (region, mut fetcher) = setup(&conf)?;
    tracing::debug!(
        slots = fetcher.slot_count(),
        slot_bytes = fetcher.slot_bytes(),
        readers = fetcher.readers(),
        devices = fetcher.devices().names().join(", "),
        "expert-fetcher: arena ready"
    );
    ctx.share_region(&region, "experts")?;
    ctx.ready()?;
    ctx.wait_go()?;
    let mut link = ctx.take_link(Stage::LayerCompute)?;
    let (me, peer) = (Stage::ExpertFetcher, Stage::LayerCompute);
    if conf.trace_dir.is_some() {
        fetcher.record_trace();
        fetcher.record_guesses();
    }
    // Compute maps published slots in place: each stays held until its ExpertsDone.
    fetcher.hold_published(true);
    let mut last_pass = u64::MAX;
    loop {
        let Some(msg) = next_message(&mut fetcher, &mut *link)? else {
            continue;
        };
        match msg {
            Msg::Shutdown => break,
            Msg::ExpertsDone { layer, ids, .. } => {
                fetcher.release(layer, &ids);
                fetcher.pump_guesses();
            }
            Msg::Guess {
                pass,
                layer,
                experts,
            } => fetcher.guess(pass, layer, &experts),
            Msg::Experts { pass, layer, ids } => {
                if pass != last_pass {
                    fetcher.begin_step();
                    last_pass = pass;
                }
                fetcher.score_guess(pass, layer, &ids);
                let before = fetcher.step_stats();
                let mut io = LinkIo {
                    link: &mut *link,
                    region: &region,
                    rec: ctx.rec.clone(),
                    pass,
                    send_err: None,
                    shutdown: false,
                    guesses: Vec::new(),
                };
                fetcher.fetch_batch_io(layer, &ids, &mut io);
                if io.shutdown {
                    break;
                }
                if let Some(e) = io.send_err {
                    return Err(e);
                }
                // Guesses that came during the batch: read now that it is over.
                for (pass, layer, experts) in std::mem::take(&mut io.guesses) {
                    fetcher.guess(pass, layer, &experts);
                }
                fetcher.pump_guesses();
                let after = fetcher.step_stats();
                send_to(
                    &mut *link,
                    me,
                    peer,
                    &Msg::ExpertBatchDone {
                        pass,
                        layer,
                        requests: after.requests - before.requests,
                        resident_hits: after.resident_hits() - before.resident_hits(),
                        failed: after.failed - before.failed,
                        read_bytes: after.bytes_read - before.bytes_read,
                        io_seconds: after.io_seconds - before.io_seconds,
                    },
                    None,
                )?;
            }
            other => return Err(FetcherStageError::Unexpected(format!("{other:?}"))),
        }
    }
    if let (Some(dir), Some(tr)) = (&conf.trace_dir, fetcher.trace()) {
        tr.write(dir).map_err(FetcherStageError::Trace)?;
    }
    fetcher.finish_guesses();
    let guesses = fetcher.guess_stats();
    if let (Some(dir), Some(g)) = (&conf.trace_dir, fetcher.guess_trace()) {
        if guesses.guesses > 0 {
            write_guess_trace(dir, g).map_err(FetcherStageError::Trace)?;
        }
    }
    let total = fetcher.total_stats();
    let mut summary = serde_json::json!({
        "slots": fetcher.slot_count(),
        "slot_bytes": fetcher.slot_bytes(),
        "arena_bytes": region.data_len(),
        "readers": fetcher.readers(),
        "stats": total,
        "true_resident_hit_rate": total.true_resident_hit_rate(),
        "mb_per_s": total.mb_per_s(),
        "report": fetcher.render_stats("expert cache [whole run]", &total),
    });
    // Only with guesses: a run without them sends the summary it always sent (the
    // committed recordings replay it byte for byte).
    if guesses.guesses > 0 {
        summary["speculation"] = guesses.to_json();
    }
    ctx.send_control(&Msg::Summary {
        stage: me,
        json: summary.to_string(),
    })?;
    Ok(ctx.finish_recording()?)
}

/// How often the stage looks for landed guess reads while it waits for compute.
const GUESS_POLL: Duration = Duration::from_millis(1);

/// The next message from compute; while guess reads are pending, waits at most
/// [`GUESS_POLL`] and takes the landed ones (issuing the queued ones) meanwhile (None).
fn next_message(
    fetcher: &mut ExpertFetcher,
    link: &mut dyn Transport,
) -> Result<Option<Msg>, FetcherStageError> {
    let (me, peer) = (Stage::ExpertFetcher, Stage::LayerCompute);
    if !fetcher.guesses_pending() {
        return Ok(Some(recv_from(link, me, peer, None)?));
    }
    match link.recv(Some(GUESS_POLL)) {
        Ok(m) => Ok(Some(m)),
        Err(TransportError::Timeout) => {
            fetcher.pump_guesses();
            Ok(None)
        }
        Err(source) => {
            // As `recv_from`: a dead peer's own report names the cause; let it come first.
            if matches!(source, TransportError::PeerDied(_) | TransportError::Closed) {
                std::thread::sleep(k3_protocol::link::PEER_DEATH_GRACE);
            }
            Err(LinkError {
                me,
                peer,
                op: LinkOp::Recv,
                timeout: Some(GUESS_POLL),
                source,
            }
            .into())
        }
    }
}

/// `guess_trace.bin` in `dir`: every guess as int32 little-endian `(pass, layer, expert)`
/// triples, in the order received (written beside `expert_trace.bin`).
fn write_guess_trace(
    dir: &std::path::Path,
    guesses: &[(u64, u32, u32)],
) -> Result<(), TraceWriteError> {
    let mut bin = Vec::with_capacity(guesses.len() * 12);
    for &(p, l, e) in guesses {
        let p = p.min(i32::MAX as u64) as i32;
        let l = i32::try_from(l).map_err(|_| TraceWriteError::Layer(l))?;
        let e = i32::try_from(e).map_err(|_| TraceWriteError::Expert(e))?;
        for v in [p, l, e] {
            bin.extend_from_slice(&v.to_le_bytes());
        }
    }
    let path = dir.join("guess_trace.bin");
    k3_io::output::write_atomic(&path, &bin).map_err(|source| TraceWriteError::Io { path, source })
}

/// A batch's publications over the link to compute, and compute's `ExpertsDone` for each
/// expert it has multiplied (sent as soon as it is done with it), read during the batch so
/// a batch larger than the arena reuses slots as compute lets them go.
struct LinkIo<'a> {
    link: &'a mut dyn Transport,
    region: &'a Region,
    rec: Rec,
    pass: u64,
    /// The first failure to send (the batch goes on unpublished; the stage then fails).
    send_err: Option<FetcherStageError>,
    /// Compute sent Shutdown during the batch.
    shutdown: bool,
    /// `Guess`es compute sent during the batch, as `(pass, layer, experts)`: read after it.
    guesses: Vec<(u64, u32, Vec<u32>)>,
}

impl BatchIo for LinkIo<'_> {
    fn event(&mut self, ev: BatchEvent<'_>) {
        if self.send_err.is_some() || self.shutdown {
            return;
        }
        let pass = self.pass;
        let m = match ev {
            BatchEvent::Ready(a) => match self.region.handle(0, a.arena_offset, a.len) {
                Ok(handle) => Msg::ExpertReady {
                    pass,
                    layer: a.layer,
                    id: a.expert,
                    handle,
                },
                Err(e) => Msg::ExpertFailed {
                    pass,
                    layer: a.layer,
                    id: a.expert,
                    error: e.to_string(),
                },
            },
            BatchEvent::Failed(e) => {
                let (l, id) = e.key();
                Msg::ExpertFailed {
                    pass,
                    layer: l,
                    id,
                    error: e.to_string(),
                }
            }
        };
        let (me, peer) = (Stage::ExpertFetcher, Stage::LayerCompute);
        if let Err(e) = send_to(self.link, me, peer, &m, None) {
            self.send_err = Some(e.into());
            return;
        }
        if let (true, Msg::ExpertReady { handle, .. }) = (self.rec.on(), &m) {
            // SAFETY: the slot was just filled by this stage and stays held (never
            // rewritten) until compute's ExpertsDone for it.
            let r = unsafe { self.region.resolve(handle) }
                .map_err(FetcherStageError::Resolve)
                .and_then(|b| Ok(self.rec.buffer(handle, b)?));
            if let Err(e) = r {
                self.send_err = Some(e);
            }
        }
    }

    fn takes_releases(&self) -> bool {
        self.send_err.is_none() && !self.shutdown
    }

    fn releases(&mut self, wait: Option<Duration>) -> Result<Vec<(u32, Vec<u32>)>, ReaderGone> {
        let (me, peer) = (Stage::ExpertFetcher, Stage::LayerCompute);
        let mut out = Vec::new();
        let mut wait = wait;
        loop {
            let e = match self.link.recv(wait) {
                Ok(Msg::ExpertsDone { layer, ids, .. }) => {
                    out.push((layer, ids));
                    // Take whatever else is already there, without waiting.
                    wait = Some(Duration::ZERO);
                    continue;
                }
                Ok(Msg::Guess {
                    pass,
                    layer,
                    experts,
                }) => {
                    self.guesses.push((pass, layer, experts));
                    wait = Some(Duration::ZERO);
                    continue;
                }
                // Compute stopped mid-batch (it gave up on the forward): end the batch and
                // then the stage, as a Shutdown between batches would.
                Ok(Msg::Shutdown) => {
                    self.shutdown = true;
                    return Err(ReaderGone(format!("{me}: shut down during a batch")));
                }
                Ok(other) => FetcherStageError::ExpectedDone(format!("{other:?}")),
                Err(TransportError::Timeout) => return Ok(out),
                Err(source) => FetcherStageError::Link(LinkError {
                    me,
                    peer,
                    op: LinkOp::Recv,
                    timeout: wait,
                    source,
                }),
            };
            let gone = ReaderGone(e.to_string());
            self.send_err.get_or_insert(e);
            return Err(gone);
        }
    }
}

/// Where the routed experts are: the pack of `--experts DIR...` (checked against the
/// checkpoint's headers; the orchestrator has checked its identity), else the shards.
fn expert_table(conf: &FetcherConf, cat: &Catalog) -> Result<ExpertTable, FetcherStageError> {
    if conf.experts_dirs.is_empty() {
        let paths: Vec<_> = cat.shards().iter().map(|s| s.path.clone()).collect();
        return ExpertTable::from_safetensors(&paths).map_err(FetcherStageError::Table);
    }
    let pack = PackedExperts::open(&conf.experts_dirs).map_err(FetcherStageError::Packed)?;
    pack.check_layout(cat).map_err(FetcherStageError::Packed)?;
    Ok(ExpertTable::from_packed(&pack))
}

/// The reader of the table's files: O_DIRECT, with the test hooks' failures injected (the
/// listed experts, and every file under a failed drive's directory).
fn reader(conf: &FetcherConf, table: &ExpertTable) -> Result<Arc<dyn ReadAt>, FetcherStageError> {
    let direct = DirectFiles::open(table.files()).map_err(FetcherStageError::Open)?;
    if conf.inject_failures.is_empty() && conf.inject_drive_failures.is_empty() {
        return Ok(Arc::new(direct));
    }
    let mut ranges = Vec::new();
    for &(l, e) in &conf.inject_failures {
        if let Some(loc) = table.locate(l, e) {
            for x in &loc.extents {
                ranges.push((loc.file, x.offset, x.offset + x.len));
            }
            for p in &loc.parts {
                ranges.push((p.file, p.offset, p.offset + (p.to - p.from)));
            }
        }
    }
    let failed: Vec<_> = conf
        .inject_drive_failures
        .iter()
        .filter_map(|d| std::fs::canonicalize(d).ok())
        .collect();
    for (i, f) in table.files().iter().enumerate() {
        let f = std::fs::canonicalize(f).unwrap_or_else(|_| f.clone());
        if failed.iter().any(|d| f.starts_with(d)) {
            ranges.push((i as u32, 0, u64::MAX));
        }
    }
    Ok(Arc::new(FaultyReader::new(direct, ranges)))
}

fn setup(conf: &FetcherConf) -> Result<(Arc<Region>, ExpertFetcher), FetcherStageError> {
    let cat = Catalog::open(&conf.model_dir).map_err(FetcherStageError::Catalog)?;
    let table = expert_table(conf, &cat)?;
    let slot_bytes = slot_bytes_for(table.max_span().max(1));
    let slots = slots_for_budget(conf.cache_bytes, slot_bytes)
        .min(conf.max_slots)
        .max(conf.min_slots.max(1));
    let bytes = slots as u64 * slot_bytes;
    let arena = |what: String| move |source| FetcherStageError::Arena { what, source };
    let region = Region::create(EXPERT_REGION, "experts", bytes, 1)
        .map_err(arena(format!("arena of {bytes} bytes")))?;
    region
        .prefault()
        .map_err(arena("first touch of the arena".into()))?;
    let region = Arc::new(region);
    let reader = reader(conf, &table)?;
    let devices = DeviceMap::of_files(table.files());
    let mut fetcher = ExpertFetcher::with_arena(
        ExpertCacheConfig {
            slots,
            slot_bytes,
            readers: conf.readers.max(1),
        },
        Arc::new(table),
        reader,
        Arc::new(ShmArena(region.clone())),
    )
    .map_err(FetcherStageError::Setup)?;
    fetcher.set_devices(devices);
    Ok((region, fetcher))
}
