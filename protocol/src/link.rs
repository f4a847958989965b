//! The stage context: the stage side of the control protocol, shared by every stage role
//! (each stage crate's `stage::run` takes a [`StageCtx`]).
//!
//! A stage says `Hello`, then receives (in any order) the links to its peers (two-ring
//! shared-memory regions), read-only data regions owned by other stages, and its
//! `Configure` JSON. The orchestrator's `Ready` is the signal to start serving. A heartbeat
//! thread answers for the stage while it works, so a stage that is stopped (SIGSTOP, a
//! deadlock in the kernel) is noticed by the orchestrator even when it has nothing to say.
//!
//! Recording (`--record DIR`, see [`crate::record`]): the context logs every control
//! frame the stage receives and sends (not the heartbeat `Pong`s, which are timing noise),
//! and [`StageCtx::take_link`] wraps each link so its frames are logged too, on a channel
//! named after the peer (`trunk-loader`, ...; the control socket is `control`). The
//! directory only arrives inside `Configure`, so what came before (Hello, links, data
//! regions) is held and written when the recorder starts. Besides frames a recording holds:
//! - one inbound entry on the pseudo-channel [`REGION_META`] per data region the stage
//!   mapped (JSON `{"id","name","slot_size","nslots"}`), so a replay can recreate it;
//! - [`Rec::buffer`] entries: layer-compute logs each trunk layer blob and expert span it
//!   resolves, right after the message naming it (bytes kept when its data regions total at
//!   most [`KEEP_BYTES_LIMIT`], or as `K3_RECORD_BYTES=1/0` says); the loaders log the hash
//!   of every buffer they publish, right after the message. A buffer whose handle was logged
//!   with the same contents, with no overlapping buffer logged since, is not logged again
//!   (the replay's copy of the region still holds those bytes).
//!
//! Errors are typed: [`ProtocolError`] for the context (control socket, regions,
//! recording), [`LinkError`] for [`send_to`] / [`recv_from`] on a link, which keeps the
//! [`TransportError`] (`PeerDied`, `Timeout`, ...) matchable and names both ends.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::control::{ControlError, ControlSocket};
use crate::failure::{FailureKind, StageFailure};
use crate::messages::{self, CodecError, Msg, RegionRole, Stage, PROTOCOL_VERSION};
use crate::record::{sha256, RecordError, Recorder};
use crate::ring::{PeerWatch, RingConfig};
use crate::shm::{Access, Handle, Region, RegionTable, ShmError};
use crate::transport::{ShmTransport, Transport, TransportError};

/// What went wrong in a stage's side of the control protocol ([`StageCtx`]). Every variant
/// names the stage; the message is complete.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("{stage}: hello: {source}")]
    Hello {
        stage: Stage,
        #[source]
        source: ControlError,
    },
    #[error("{stage}: heartbeat thread: {source}")]
    Heartbeat {
        stage: Stage,
        #[source]
        source: std::io::Error,
    },
    /// The control socket failed (closed, I/O) or sending on it did.
    #[error("{stage}: control: {source}")]
    Control {
        stage: Stage,
        #[source]
        source: ControlError,
    },
    /// A control frame did not decode.
    #[error("{stage}: control: {source}")]
    Decode {
        stage: Stage,
        #[source]
        source: CodecError,
    },
    #[error("{stage}: {source}")]
    Record {
        stage: Stage,
        #[source]
        source: RecError,
    },
    #[error("{stage}: region {id} arrived without its fd")]
    MissingFd { stage: Stage, id: u32 },
    #[error("{stage}: shut down before start")]
    ShutDown { stage: Stage },
    /// A message the protocol does not allow at this point (`message` is its debug form).
    #[error("{stage}: unexpected {message} before {phase}")]
    Unexpected {
        stage: Stage,
        message: String,
        phase: &'static str,
    },
    #[error("{stage}: link to {peer}: {source}")]
    LinkRegion {
        stage: Stage,
        peer: Stage,
        #[source]
        source: ShmError,
    },
    #[error("{stage}: link to {peer}: {source}")]
    LinkAttach {
        stage: Stage,
        peer: Stage,
        #[source]
        source: TransportError,
    },
    #[error("{stage}: watching {peer} (pid {pid}): {source}")]
    Watch {
        stage: Stage,
        peer: Stage,
        pid: u32,
        #[source]
        source: TransportError,
    },
    #[error("{stage}: data region {name}: {source}")]
    DataRegion {
        stage: Stage,
        name: String,
        #[source]
        source: ShmError,
    },
    #[error("{stage}: data region {name} announced as {id} but its header says {header}")]
    RegionId {
        stage: Stage,
        name: String,
        id: u32,
        header: u32,
    },
    #[error("{stage}: sharing region {name}: {source}")]
    Share {
        stage: Stage,
        name: String,
        #[source]
        source: ControlError,
    },
    #[error("{stage}: no link to {peer} was configured")]
    NoLink { stage: Stage, peer: Stage },
}

impl ProtocolError {
    fn record(stage: Stage) -> impl FnOnce(RecError) -> ProtocolError {
        move |source| ProtocolError::Record { stage, source }
    }

    fn control(stage: Stage) -> impl FnOnce(ControlError) -> ProtocolError {
        move |source| ProtocolError::Control { stage, source }
    }
}

impl ProtocolError {
    /// The failure kind this error reports to the orchestrator: a control socket the
    /// orchestrator closed is its death, a recording that could not be written is I/O,
    /// anything else broke the protocol.
    pub fn kind(&self) -> FailureKind {
        match self {
            ProtocolError::Control {
                source: ControlError::Closed,
                ..
            } => FailureKind::PeerDied,
            ProtocolError::Record { .. } | ProtocolError::Heartbeat { .. } => FailureKind::Io,
            _ => FailureKind::Protocol,
        }
    }
}

impl From<ProtocolError> for StageFailure {
    fn from(e: ProtocolError) -> StageFailure {
        let f = StageFailure::new(e.kind(), e.to_string());
        match e.kind() {
            FailureKind::PeerDied => f.with_peer(Stage::Orchestrator),
            _ => f,
        }
    }
}

impl LinkError {
    /// The failure kind this error reports: the peer's death (or its closing its end, which
    /// mid-run means it failed), its silence, an I/O error, or a broken protocol.
    pub fn kind(&self) -> FailureKind {
        match self.source {
            TransportError::PeerDied(_) | TransportError::Closed => FailureKind::PeerDied,
            TransportError::Timeout => FailureKind::Timeout,
            TransportError::Io(_) => FailureKind::Io,
            _ => FailureKind::Protocol,
        }
    }
}

impl From<LinkError> for StageFailure {
    fn from(e: LinkError) -> StageFailure {
        StageFailure::new(e.kind(), e.to_string()).with_peer(e.peer)
    }
}

/// A recording (`--record`) could not be written.
#[derive(Debug, thiserror::Error)]
#[error("--record: {0}")]
pub struct RecError(#[from] pub RecordError);

/// Which way a link operation went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkOp {
    Send,
    Recv,
}

/// A link operation failed: who sent or received, to or from whom, and the transport's
/// error, which stays matchable (`PeerDied`, `Closed`, `Timeout`, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkError {
    pub me: Stage,
    pub peer: Stage,
    pub op: LinkOp,
    /// The receive timeout that passed (named in a `Timeout`'s message).
    pub timeout: Option<Duration>,
    pub source: TransportError,
}

impl LinkError {
    /// The peer died or closed its end (its own report names the cause).
    pub fn peer_gone(&self) -> bool {
        matches!(
            self.source,
            TransportError::PeerDied(_) | TransportError::Closed
        )
    }
}

impl std::fmt::Display for LinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (me, peer) = (self.me, self.peer);
        match (self.op, &self.source) {
            (LinkOp::Recv, TransportError::Timeout) => write!(
                f,
                "{me}: {peer} stopped answering (nothing for {:.0} s)",
                self.timeout.map(|t| t.as_secs_f64()).unwrap_or(0.0)
            ),
            (LinkOp::Recv, e) => write!(f, "{me}: link to {peer}: {e}"),
            (LinkOp::Send, e) => write!(f, "{me}: sending to {peer}: {e}"),
        }
    }
}

impl std::error::Error for LinkError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// A link as the stage roles use it: the shared-memory transport, wrapped for recording
/// when `--record` is on (and a replay transport in tests).
pub type Link = Box<dyn Transport>;

/// Channel name of the control socket in recordings.
pub const CONTROL: &str = "control";
/// Pseudo-channel of the data-region geometry entries in recordings.
pub const REGION_META: &str = "@region";
/// Keep buffer bytes in a recording when the stage's data regions total at most this.
pub const KEEP_BYTES_LIMIT: u64 = 64 << 20;

/// A stage's recorder, shared by its context, its links and its buffer reads. Cloning is
/// cheap; a default `Rec` records nothing.
#[derive(Clone, Default)]
pub struct Rec(Option<Arc<RecState>>);

struct RecState {
    rec: Mutex<Option<Recorder>>,
    /// Last contents logged per handle (see the module doc).
    last: Mutex<HashMap<Handle, [u8; 32]>>,
}

impl Rec {
    fn start(dir: &std::path::Path, stage: Stage, keep_bytes: bool) -> Result<Rec, RecError> {
        let r = Recorder::create(dir, stage.name(), keep_bytes)?;
        Ok(Rec(Some(Arc::new(RecState {
            rec: Mutex::new(Some(r)),
            last: Mutex::new(HashMap::new()),
        }))))
    }

    /// Recording is on.
    pub fn on(&self) -> bool {
        self.0.is_some()
    }

    fn with(
        &self,
        f: impl FnOnce(&mut Recorder) -> Result<(), RecordError>,
    ) -> Result<(), RecError> {
        let Some(st) = &self.0 else { return Ok(()) };
        let mut g = st.rec.lock().unwrap_or_else(|p| p.into_inner());
        match g.as_mut() {
            Some(r) => Ok(f(r)?),
            None => Ok(()),
        }
    }

    /// Log a frame.
    pub fn frame(&self, inbound: bool, channel: &str, frame: &[u8]) -> Result<(), RecError> {
        self.with(|r| {
            if inbound {
                r.inbound(channel, frame)
            } else {
                r.outbound(channel, frame)
            }
        })
    }

    /// Log a shared buffer the stage read (or published): handle, hash, maybe bytes.
    pub fn buffer(&self, h: &Handle, bytes: &[u8]) -> Result<(), RecError> {
        let Some(st) = &self.0 else { return Ok(()) };
        let sha = sha256(bytes);
        {
            let mut last = st.last.lock().unwrap_or_else(|p| p.into_inner());
            if last.get(h) == Some(&sha) {
                return Ok(());
            }
            let end = h.offset + h.len;
            last.retain(|k, _| {
                k.region != h.region || k.offset >= end || k.offset + k.len <= h.offset
            });
            last.insert(*h, sha);
        }
        self.with(|r| r.buffer_read(h, bytes))
    }

    /// Write the end marker (the stage finished normally).
    pub fn finish(&self) -> Result<(), RecError> {
        let Some(st) = &self.0 else { return Ok(()) };
        let r = st.rec.lock().unwrap_or_else(|p| p.into_inner()).take();
        match r {
            Some(r) => Ok(r.finish().map(|_| ())?),
            None => Ok(()),
        }
    }
}

/// A link whose frames are logged on `channel`.
struct RecordedLink {
    inner: ShmTransport,
    channel: String,
    rec: Rec,
}

impl Transport for RecordedLink {
    fn send_bytes(
        &mut self,
        frame: &[u8],
        timeout: Option<Duration>,
    ) -> Result<(), TransportError> {
        self.inner.send_bytes(frame, timeout)?;
        self.rec
            .frame(false, &self.channel, frame)
            .map_err(|e| TransportError::Io(e.to_string()))
    }
    fn recv_bytes(&mut self, timeout: Option<Duration>) -> Result<Vec<u8>, TransportError> {
        let f = self.inner.recv_bytes(timeout)?;
        self.rec
            .frame(true, &self.channel, &f)
            .map_err(|e| TransportError::Io(e.to_string()))?;
        Ok(f)
    }
    fn max_message(&self) -> usize {
        self.inner.max_message()
    }
    fn peer_dead(&self) -> bool {
        self.inner.peer_dead()
    }
}

/// Frames seen before the recorder could start (it learns its directory from `Configure`).
type Pending = Vec<(bool, String, Vec<u8>)>;

/// Heartbeat period of every stage.
pub const HEARTBEAT: Duration = Duration::from_millis(250);

/// Ring geometry of every link: 256 slots of 256 bytes each way.
pub fn link_ring() -> RingConfig {
    RingConfig::default()
}

/// What a stage has once the orchestrator configured it.
pub struct StageCtx {
    pub stage: Stage,
    pub control: Arc<ControlSocket>,
    pub links: HashMap<Stage, ShmTransport>,
    pub regions: RegionTable,
    /// Named data regions (`trunk`, `experts`), by name.
    pub data: HashMap<String, u32>,
    pub conf_json: String,
    heartbeat_stop: Arc<AtomicBool>,
    /// The recorder (off until `Configure` names a `record_dir`).
    pub rec: Rec,
    /// Frames held until `Configure` says whether to record (None once it did).
    pending: Option<Pending>,
}

impl Drop for StageCtx {
    fn drop(&mut self) {
        self.heartbeat_stop.store(true, Ordering::Relaxed);
    }
}

impl StageCtx {
    /// Say hello and start the heartbeat.
    pub fn connect(stage: Stage, control: ControlSocket) -> Result<StageCtx, ProtocolError> {
        let control = Arc::new(control);
        let hello = messages::encode(&Msg::Hello {
            stage,
            pid: std::process::id(),
            version: PROTOCOL_VERSION,
        })
        .map_err(|e| ProtocolError::Hello {
            stage,
            source: e.into(),
        })?;
        control
            .send_frame(&hello, &[])
            .map_err(|source| ProtocolError::Hello { stage, source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let (c2, s2) = (control.clone(), stop.clone());
        std::thread::Builder::new()
            .name(format!("k3-{stage}-heartbeat"))
            .spawn(move || {
                let mut n = 0u64;
                while !s2.load(Ordering::Relaxed) {
                    if c2.send(&Msg::Pong { nonce: n }, &[]).is_err() {
                        break;
                    }
                    n += 1;
                    std::thread::sleep(HEARTBEAT);
                }
            })
            .map_err(|source| ProtocolError::Heartbeat { stage, source })?;
        Ok(StageCtx {
            stage,
            control,
            links: HashMap::new(),
            regions: RegionTable::new(),
            data: HashMap::new(),
            conf_json: String::new(),
            heartbeat_stop: stop,
            rec: Rec::default(),
            pending: Some(vec![(false, CONTROL.to_string(), hello)]),
        })
    }

    fn log(&mut self, inbound: bool, channel: &str, frame: &[u8]) -> Result<(), ProtocolError> {
        match &mut self.pending {
            Some(p) => {
                p.push((inbound, channel.to_string(), frame.to_vec()));
                Ok(())
            }
            None => self
                .rec
                .frame(inbound, channel, frame)
                .map_err(ProtocolError::record(self.stage)),
        }
    }

    /// `Configure` arrived: start recording if it names a `record_dir`, and write what was
    /// held. Buffer bytes are kept when the mapped data regions are small (see the module
    /// doc); `K3_RECORD_BYTES=1` or `0` forces either way.
    fn start_recording(&mut self, json: &str) -> Result<(), ProtocolError> {
        let pending = self.pending.take().unwrap_or_default();
        let dir: Option<PathBuf> = serde_json::from_str::<serde_json::Value>(json)
            .ok()
            .and_then(|v| {
                v.get("record_dir")
                    .and_then(|d| d.as_str())
                    .map(PathBuf::from)
            });
        let Some(dir) = dir else { return Ok(()) };
        let data_bytes: u64 = self
            .data
            .values()
            .filter_map(|id| self.regions.get(*id))
            .map(|r| r.data_len() as u64)
            .sum();
        let keep = match std::env::var("K3_RECORD_BYTES").ok().as_deref() {
            Some("1") => true,
            Some("0") => false,
            _ => self.stage == Stage::LayerCompute && data_bytes <= KEEP_BYTES_LIMIT,
        };
        self.rec = Rec::start(&dir, self.stage, keep).map_err(ProtocolError::record(self.stage))?;
        for (inbound, ch, f) in pending {
            self.rec
                .frame(inbound, &ch, &f)
                .map_err(ProtocolError::record(self.stage))?;
        }
        Ok(())
    }

    /// The stage is done (call after its last message): close the recording normally (end
    /// marker), stop the heartbeat and wait (up to 2 s) until the orchestrator has read
    /// everything sent on the control socket.
    ///
    /// The wait closes a race: the orchestrator learns of a stage's exit from its process
    /// watcher and of its last message (`Finished`, `Summary`) from a control reader thread;
    /// a stage that exits right after sending could be reaped before its last message was
    /// read, and be reported as "exited with status 0 before the run was finished".
    pub fn finish_recording(&self) -> Result<(), ProtocolError> {
        let r = self.rec.finish().map_err(ProtocolError::record(self.stage));
        self.heartbeat_stop.store(true, Ordering::Relaxed);
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while std::time::Instant::now() < deadline && unread_control_bytes(&self.control) > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        r
    }

    /// Receive control messages until `until` says stop (it sees every message that is not a
    /// link or data region, which are handled here). `until`'s error type is the caller's
    /// (a stage's own error, which a [`ProtocolError`] converts into).
    pub fn serve_control<E: From<ProtocolError>>(
        &mut self,
        mut until: impl FnMut(&mut Self, Msg) -> Result<bool, E>,
    ) -> Result<(), E> {
        let stage = self.stage;
        loop {
            let (frame, mut fds) = self
                .control
                .recv_frame(None)
                .map_err(ProtocolError::control(stage))?;
            let msg = messages::decode(&frame)
                .map_err(|source| ProtocolError::Decode { stage, source })?;
            self.log(true, CONTROL, &frame)?;
            if let Msg::Configure { json } = &msg {
                self.start_recording(json)?;
            }
            match msg {
                Msg::Region { id, role } => {
                    let fd: OwnedFd = fds.pop().ok_or(ProtocolError::MissingFd { stage, id })?;
                    self.add_region(id, role, fd)?;
                }
                Msg::Shutdown => return Err(ProtocolError::ShutDown { stage }.into()),
                other => {
                    if until(self, other)? {
                        return Ok(());
                    }
                }
            }
        }
    }

    fn add_region(&mut self, id: u32, role: RegionRole, fd: OwnedFd) -> Result<(), ProtocolError> {
        let stage = self.stage;
        match role {
            RegionRole::Link {
                peer,
                side,
                peer_pid,
            } => {
                let region = Region::open(fd, Access::ReadWrite).map_err(|source| {
                    ProtocolError::LinkRegion {
                        stage,
                        peer,
                        source,
                    }
                })?;
                let watch = if peer_pid > 0 {
                    PeerWatch::pid(peer_pid as i32).map_err(|source| ProtocolError::Watch {
                        stage,
                        peer,
                        pid: peer_pid,
                        source,
                    })?
                } else {
                    PeerWatch::None
                };
                let t = ShmTransport::attach(Arc::new(region), side, watch, link_ring()).map_err(
                    |source| ProtocolError::LinkAttach {
                        stage,
                        peer,
                        source,
                    },
                )?;
                self.links.insert(peer, t);
            }
            RegionRole::Data { name } => {
                let region = match Region::open(fd, Access::ReadOnly) {
                    Ok(r) => r,
                    Err(source) => {
                        return Err(ProtocolError::DataRegion {
                            stage,
                            name,
                            source,
                        })
                    }
                };
                let meta = serde_json::json!({
                    "id": id,
                    "name": name,
                    "slot_size": region.slot_size(),
                    "nslots": region.nslots(),
                })
                .to_string();
                self.log(true, REGION_META, meta.as_bytes())?;
                let rid = region.id();
                if rid != id {
                    return Err(ProtocolError::RegionId {
                        stage,
                        name,
                        id,
                        header: rid,
                    });
                }
                if let Err(source) = self.regions.insert(Arc::new(region)) {
                    return Err(ProtocolError::DataRegion {
                        stage,
                        name,
                        source,
                    });
                }
                self.data.insert(name, id);
            }
        }
        Ok(())
    }

    /// Phase 1: links and `Configure`.
    pub fn wait_configure(&mut self) -> Result<(), ProtocolError> {
        self.serve_control(|ctx, m| match m {
            Msg::Configure { json } => {
                ctx.conf_json = json;
                Ok(true)
            }
            other => Err(ProtocolError::Unexpected {
                stage: ctx.stage,
                message: format!("{other:?}"),
                phase: "Configure",
            }),
        })
    }

    /// Phase 2 (after the stage set itself up and said `Ready`): data regions, then go.
    pub fn wait_go(&mut self) -> Result<(), ProtocolError> {
        self.serve_control(|ctx, m| match m {
            Msg::Ready {
                stage: Stage::Orchestrator,
            } => Ok(true),
            other => Err(ProtocolError::Unexpected {
                stage: ctx.stage,
                message: format!("{other:?}"),
                phase: "start",
            }),
        })
    }

    /// Tell the orchestrator this stage is set up.
    pub fn ready(&self) -> Result<(), ProtocolError> {
        self.send_control(&Msg::Ready { stage: self.stage })
    }

    /// Send a message to the orchestrator.
    pub fn send_control(&self, m: &Msg) -> Result<(), ProtocolError> {
        self.send_frame(m, &[])
            .map_err(ProtocolError::control(self.stage))?
            .map_err(ProtocolError::record(self.stage))
    }

    /// Send `m` with `fds`; the inner result is the recording's (the frame went out).
    fn send_frame(
        &self,
        m: &Msg,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Result<(), RecError>, ControlError> {
        let frame = messages::encode(m)?;
        self.control.send_frame(&frame, fds)?;
        // After Configure (the only time roles send on their own) pending is None.
        Ok(self.rec.frame(false, CONTROL, &frame))
    }

    /// Report progress through a long phase to the orchestrator (best effort). Like the
    /// heartbeat it is timing, not behaviour: it is not recorded, and replay skips it.
    pub fn progress(&self, phase: &str, done: u64, total: u64) {
        let _ = self.control.send(
            &Msg::Progress {
                stage: self.stage,
                phase: phase.to_string(),
                done,
                total,
            },
            &[],
        );
    }

    /// Hand a region this stage owns to the orchestrator (which passes it on).
    pub fn share_region(&self, region: &Region, name: &str) -> Result<(), ProtocolError> {
        self.send_frame(
            &Msg::Region {
                id: region.id(),
                role: RegionRole::Data { name: name.into() },
            },
            &[region.fd()],
        )
        .map_err(|source| ProtocolError::Share {
            stage: self.stage,
            name: name.into(),
            source,
        })?
        .map_err(ProtocolError::record(self.stage))
    }

    /// Take the link to `peer` out of the context (logged on channel `<peer>` when
    /// recording).
    pub fn take_link(&mut self, peer: Stage) -> Result<Link, ProtocolError> {
        let t = self.links.remove(&peer).ok_or(ProtocolError::NoLink {
            stage: self.stage,
            peer,
        })?;
        Ok(if self.rec.on() {
            Box::new(RecordedLink {
                inner: t,
                channel: peer.name().to_string(),
                rec: self.rec.clone(),
            })
        } else {
            Box::new(t)
        })
    }

    /// Report a fatal failure to the orchestrator (best effort) and return it.
    pub fn fail(&self, failure: impl Into<StageFailure>) -> StageFailure {
        let failure = failure.into();
        let _ = self.send_frame(
            &Msg::Error {
                stage: self.stage,
                failure: failure.clone(),
            },
            &[],
        );
        failure
    }
}

/// Bytes sent on `control` that the peer has not read yet (0 when unknown).
fn unread_control_bytes(control: &ControlSocket) -> i32 {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) on a socket fd we own writes one int through the pointer;
    // for a unix socket it is the bytes queued to the peer and not yet consumed by it.
    let r = unsafe { libc::ioctl(control.fd().as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    if r == 0 {
        n
    } else {
        0
    }
}

/// How long a stage that saw its peer die waits before failing itself.
///
/// The orchestrator names the first stage whose exit it sees. When one stage is killed its
/// link peers notice within milliseconds and would exit with a secondary error ("the peer
/// died") that can reach the orchestrator first; waiting here lets the orchestrator see
/// the real cause (the killed stage's exit) and stop everyone. Without an orchestrator
/// (replay, tests) it only delays the error.
pub const PEER_DEATH_GRACE: Duration = Duration::from_secs(3);

fn peer_death_grace(e: TransportError) -> TransportError {
    // A peer that closed its end mid-run failed (and reported why) or was killed: either
    // way its own report, not ours, names the cause, so let it reach k3-orch first.
    if matches!(e, TransportError::PeerDied(_) | TransportError::Closed) {
        std::thread::sleep(PEER_DEATH_GRACE);
    }
    e
}

/// Receive on a link; the error names both ends (a timeout's message names the silent
/// peer).
pub fn recv_from(
    link: &mut dyn Transport,
    me: Stage,
    peer: Stage,
    timeout: Option<Duration>,
) -> Result<Msg, LinkError> {
    link.recv(timeout).map_err(|e| LinkError {
        me,
        peer,
        op: LinkOp::Recv,
        timeout,
        source: peer_death_grace(e),
    })
}

/// Send on a link; the error names both ends.
pub fn send_to(
    link: &mut dyn Transport,
    me: Stage,
    peer: Stage,
    m: &Msg,
    timeout: Option<Duration>,
) -> Result<(), LinkError> {
    link.send(m, timeout).map_err(|e| LinkError {
        me,
        peer,
        op: LinkOp::Send,
        timeout,
        source: peer_death_grace(e),
    })
}
