//! `k3-orch replay REC_DIR --stage NAME`: re-run one stage alone against its recording.
//!
//! The recording is `REC_DIR/<stage>.k3rec`, written by a run with `--record REC_DIR` (format:
//! `k3_protocol::record`; what a stage logs: `pipeline::link`). The stage role runs in a
//! thread of this process (`pipeline::stage_main`) on a fresh control socketpair, and this
//! command plays every peer from the log, entry by entry, in log order:
//!
//! - an **inbound** frame is sent to the stage on its channel (`control`, or the link named
//!   after the peer). A control `Region` that carried a link makes a fresh link region with
//!   the same id and hands its fd over; one that carried a data region (layer-compute's
//!   `trunk` and `experts`) makes a region with the same id and geometry (from the
//!   `@region` entry);
//! - for layer-compute, the **buffer** entries logged right after an inbound frame are
//!   written into the recreated data regions *before* that frame is sent (the recording
//!   must have kept bytes); for the loaders a buffer entry is the hash of a buffer the stage
//!   published, and is checked against the stage's own region after the message naming it;
//! - an **outbound** frame is awaited on its channel and compared with the recording.
//!
//! Outbound messages are compared byte for byte as re-encoded after masking the fields that
//! are wall-clock or process noise, and nothing else:
//!
//! | message | masked | why |
//! |---|---|---|
//! | `Hello` | `pid` | a new process (here: this one) |
//! | `StepStats` | `seconds`, `io_wait_seconds` | wall-clock time of the step / of its waits |
//! | `TrunkPassDone` | `io_seconds` | wall-clock time of the loader's reads |
//! | `ExpertBatchDone` | `io_seconds` | same, for the fetcher |
//! | `Summary` (JSON) | every key containing `second`, `mb_per_s`, and the rendered `report` text | timing, and a throughput computed from it |
//!
//! Heartbeat `Pong`s are not recorded and are skipped here. The expert-fetcher sends one
//! `ExpertReady`/`ExpertFailed` per expert as its reads land, in whatever order the disk
//! finishes them (design.md: compute combines experts in top-k order, so the order is
//! free); a run of consecutive such messages is therefore compared as a multiset, each
//! message still byte for byte. Compute gives each expert back (`ExpertsDone`) as soon as
//! it is done with it, and the fetcher reads those during the batch, so in a fetcher's
//! recording they interleave with its events as timing fell: replaying the fetcher, a
//! batch's events and those releases form one group, each release sent once the experts it
//! names have arrived, each published buffer checked as its message arrives.
//!
//! Inbound frames are sent as recorded except for three rewrites that only undo the
//! original run's environment: a link `Region`'s `peer_pid` becomes 0 (the recorded pid is
//! gone; 0 = no pid watch), and `Configure`'s `record_dir`, `dump_logits` and `trace_dir`
//! become null (a replay must not overwrite the recording it reads or the run's outputs).
//! Paths inside `Configure` (the model directory) are used as recorded, so replay from the
//! directory the run was started in.
//!
//! Exit codes: 0 `replay <stage>: N messages identical` (N = outbound messages compared);
//! 1 at the first difference, naming the entry, the channel and both messages (or for an
//! unreadable or modified recording, or a stage that failed); 2 for usage.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use k3_protocol::control::{self, ControlError, ControlSocket};
use k3_protocol::failure::StageFailure;
use k3_protocol::messages::{self, CodecError, Msg, RegionRole, Stage};
use k3_protocol::record::{read_recording, recording_path, sha256, Entry, Recording};
use k3_protocol::ring::PeerWatch;
use k3_protocol::shm::{Access, Handle, HandleError, Region, ShmError};
use k3_protocol::transport::{ShmTransport, Side, Transport, TransportError};

use k3_protocol::link::{link_ring, CONTROL, REGION_META};

/// Why a replay failed: the recording, setting the stage up, an entry of the log that
/// could not be played or did not come back as recorded, or what the stage did after it.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(
        "recording truncated at entry {0}: it ends without its end marker (the recorded run \
         was cut short or the file was cut); nothing to replay it against"
    )]
    Truncated(usize),
    #[error("control socketpair: {0}")]
    SocketPair(#[source] ControlError),
    #[error("starting the stage thread: {0}")]
    Thread(#[source] std::io::Error),
    /// A `@region` entry that does not parse (`what`: the parse error or the entry).
    #[error("bad {REGION_META} entry: {0}")]
    RegionMeta(String),
    /// Entry `entry` of the log, seen `at`.
    #[error("entry {entry}{at}: {why}")]
    Entry {
        entry: usize,
        at: At,
        #[source]
        why: EntryError,
    },
    /// The log is over, and the stage did not end as it should.
    #[error(transparent)]
    After(#[from] AfterLog),
}

/// Where an entry's failure was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum At {
    /// The entry itself (a buffer, a release).
    Entry,
    /// The message as recorded.
    Recorded,
    /// Sending it to the stage on this channel.
    Inbound(String),
    /// Waiting for it from the stage on this channel.
    Outbound(String),
    /// Waiting for it, one of a batch of expert events compared in any order.
    Batch(String),
}

impl std::fmt::Display for At {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            At::Entry => Ok(()),
            At::Recorded => write!(f, " (recorded)"),
            At::Inbound(c) => write!(f, " (inbound on {c})"),
            At::Outbound(c) => write!(f, " (outbound on {c})"),
            At::Batch(c) => write!(
                f,
                " (outbound on {c}, one of a batch of expert events compared in any order)"
            ),
        }
    }
}

/// How the stage thread ended, when it ended before it should have.
#[derive(Debug, thiserror::Error)]
pub enum StageEnd {
    #[error("the stage finished early")]
    FinishedEarly,
    #[error("the stage failed: {0}")]
    Failed(StageFailure),
    #[error("the stage panicked")]
    Panicked,
}

/// Why one entry of the log failed.
#[derive(Debug, thiserror::Error)]
pub enum EntryError {
    #[error(
        "the recording kept only the hash of buffer {0:?}; replaying layer-compute needs the \
         bytes (record with K3_RECORD_BYTES=1)"
    )]
    NoBytes(Handle),
    #[error("buffer {handle:?} is in region {}, which the stage was never given", handle.region)]
    RegionNotGiven { handle: Handle },
    #[error("buffer {handle:?} is in region {}, which the stage never shared", handle.region)]
    RegionNotShared { handle: Handle },
    #[error("buffer {handle:?} has generation {} but the region is at {at}", handle.generation)]
    Generation { handle: Handle, at: u64 },
    #[error("filling {handle:?}: {source}")]
    Fill {
        handle: Handle,
        #[source]
        source: ShmError,
    },
    #[error(transparent)]
    Region(#[from] ShmError),
    #[error(transparent)]
    Handle(#[from] HandleError),
    #[error("region {id} from the stage: {source}")]
    StageRegion {
        id: u32,
        #[source]
        source: ShmError,
    },
    #[error("no {REGION_META} entry for data region {id} ({name})")]
    NoRegionMeta { id: u32, name: String },
    #[error("no link to this peer was set up")]
    NoLink,
    #[error("sending to the stage: {0}")]
    Send(#[source] TransportError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("control: {source}{}", stage.as_ref().map(|s| format!(" {s}")).unwrap_or_default())]
    ControlRecv {
        #[source]
        source: ControlError,
        stage: Option<StageEnd>,
    },
    #[error("undecodable: {0}")]
    Undecodable(#[source] CodecError),
    #[error("the stage sent nothing for {:.0} s", .0.as_secs_f64())]
    Silent(Duration),
    #[error("the recording expects a message, but {0}")]
    StageEnded(StageEnd),
    #[error("differs\n  stage sent: {sent:?}\n  recorded:   {recorded:?}")]
    Differs { sent: Box<Msg>, recorded: Box<Msg> },
    #[error("was not sent\n  recorded:   {recorded:?}\n  stage sent (unmatched): {unmatched:?}")]
    NotSent {
        recorded: Box<Msg>,
        unmatched: Vec<Msg>,
    },
    #[error(
        "the stage sent {sent:?}, which the recording does not have here\n  recorded (not yet \
         sent): {left:?}"
    )]
    NotRecorded { sent: Box<Msg>, left: Vec<Msg> },
    #[error("a release the recording has in this batch names an expert the stage never published")]
    ReleaseNeverPublished,
    #[error("the contents of published buffer {0:?} differ from the recording (SHA-256)")]
    ContentsDiffer(Handle),
}

/// What the stage did wrong once the log was over.
#[derive(Debug, thiserror::Error)]
pub enum AfterLog {
    /// `message`: the frame as decoded (or why it did not decode).
    #[error("after the log the stage sent on {channel}: {message} (not in the recording)")]
    Sent { channel: String, message: String },
    #[error("the log is over but the stage is still running after {:.0} s", .0.as_secs_f64())]
    StillRunning(Duration),
    #[error("after the log the stage failed: {0}")]
    Failed(StageFailure),
    #[error("after the log the stage panicked")]
    Panicked,
}

/// An entry's failure, seen `at`.
fn at(entry: usize, at: At) -> impl FnOnce(EntryError) -> ReplayError {
    move |why| ReplayError::Entry { entry, at, why }
}

#[derive(Parser, Debug)]
#[command(
    name = "k3-orch replay",
    about = "Re-run one stage alone against a --record log and compare its outbound messages"
)]
struct Args {
    /// Directory written by `--record DIR`.
    rec_dir: PathBuf,
    /// Stage to replay: tokenizer, trunk-loader, expert-fetcher or layer-compute.
    #[arg(long)]
    stage: String,
    /// Read the recording without checking its chain hashes (for deliberately edited logs).
    #[arg(long)]
    no_verify: bool,
    /// Seconds to wait for each message the stage should send.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
}

pub fn main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let Some(stage) = Stage::parse(&a.stage).filter(|s| *s != Stage::Orchestrator) else {
        tracing::error!(
            "k3-orch replay: unknown stage '{}' (tokenizer, trunk-loader, expert-fetcher, layer-compute)",
            a.stage
        );
        return 2;
    };
    // Bounded as `--stage-timeout` is: a huge value would overflow `Duration`.
    if !(crate::run::args::MIN_STAGE_TIMEOUT_S..=crate::run::args::MAX_STAGE_TIMEOUT_S)
        .contains(&a.timeout)
    {
        tracing::error!("k3-orch replay: --timeout must be 0.001 to 1000000 seconds");
        return 2;
    }
    let path = recording_path(&a.rec_dir, stage.name());
    let rec = match read_recording(&path, !a.no_verify) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!("k3-orch replay: {e}");
            return 1;
        }
    };
    if rec.stage != stage.name() {
        tracing::error!(
            "k3-orch replay: {} is a recording of stage {}, not {stage}",
            path.display(),
            rec.stage
        );
        return 1;
    }
    match replay(stage, &rec, Duration::from_secs_f64(a.timeout)) {
        Ok(n) => {
            println!("replay {stage}: {n} messages identical");
            0
        }
        Err(e) => {
            tracing::error!("replay {stage}: FAIL: {e}");
            1
        }
    }
}

/// Mask the fields of `m` that are timing or pid noise (see the module doc).
pub fn mask(m: &Msg) -> Msg {
    let mut m = m.clone();
    match &mut m {
        Msg::Hello { pid, .. } => *pid = 0,
        Msg::StepStats(s) => {
            s.seconds = 0.0;
            s.io_wait_seconds = 0.0;
        }
        Msg::TrunkPassDone {
            io_seconds,
            read_bytes,
            ..
        } => {
            *io_seconds = 0.0;
            *read_bytes = 0;
        }
        Msg::ExpertBatchDone { io_seconds, .. } => *io_seconds = 0.0,
        Msg::Summary { json, stage } => {
            let read_ahead = *stage == Stage::TrunkLoader;
            if let Ok(mut v) = serde_json::from_str::<serde_json::Value>(json) {
                mask_json(&mut v, read_ahead);
                *json = v.to_string();
            }
        }
        _ => {}
    }
    m
}

fn mask_json(v: &mut serde_json::Value, read_ahead: bool) {
    match v {
        serde_json::Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                let timing = k.contains("second") || k.contains("mb_per_s") || k == "report";
                let ahead = read_ahead && (k == "reads" || k == "bytes_read");
                if timing || ahead {
                    *x = serde_json::Value::Null;
                } else {
                    mask_json(x, read_ahead);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(|x| mask_json(x, read_ahead)),
        _ => {}
    }
}

/// The masked, re-encoded form of a frame (the bytes compared).
fn masked_bytes(frame: &[u8]) -> Result<(Msg, Vec<u8>), EntryError> {
    let m = messages::decode(frame).map_err(EntryError::Undecodable)?;
    let b = messages::encode(&mask(&m)).map_err(EntryError::Undecodable)?;
    Ok((m, b))
}

/// The experts an inbound `ExpertsDone` releases, as `(layer, ids)`.
fn releases_of(frame: &[u8]) -> Option<(u32, Vec<u32>)> {
    match messages::decode(frame) {
        Ok(Msg::ExpertsDone { layer, ids, .. }) => Some((layer, ids)),
        _ => None,
    }
}

fn is_expert_event(frame: &[u8]) -> bool {
    matches!(
        messages::decode(frame),
        Ok(Msg::ExpertReady { .. } | Msg::ExpertFailed { .. })
    )
}

struct Replayer {
    stage: Stage,
    control: ControlSocket,
    links: HashMap<String, ShmTransport>,
    /// Regions the stage shared with us (the loaders' arenas), by id.
    own: HashMap<u32, Region>,
    /// Regions we created for the stage (layer-compute's data), by id.
    data: HashMap<u32, Arc<Region>>,
    /// Geometry of the data regions, from the `@region` entries.
    geometry: HashMap<u32, (u64, u32)>,
    thread: Option<std::thread::JoinHandle<Result<(), k3_protocol::failure::StageFailure>>>,
    timeout: Duration,
}

/// Replay `rec` against a fresh instance of `stage`; returns the number of outbound
/// messages compared.
pub fn replay(stage: Stage, rec: &Recording, timeout: Duration) -> Result<usize, ReplayError> {
    if !rec.complete {
        // Feeding the stage a log that stops mid-run would only wait out `timeout` and then
        // blame the stage.
        return Err(ReplayError::Truncated(rec.entries.len()));
    }
    let (ours, theirs) = control::pair().map_err(ReplayError::SocketPair)?;
    let thread = std::thread::Builder::new()
        .name(format!("k3-replay-{stage}"))
        .spawn(move || crate::supervise::stage_main(stage, theirs))
        .map_err(ReplayError::Thread)?;
    let mut r = Replayer {
        stage,
        control: ours,
        links: HashMap::new(),
        own: HashMap::new(),
        data: HashMap::new(),
        geometry: HashMap::new(),
        thread: Some(thread),
        timeout,
    };
    for e in &rec.entries {
        if let Entry::Inbound { channel, frame } = e {
            if channel == REGION_META {
                let v: serde_json::Value = serde_json::from_slice(frame)
                    .map_err(|e| ReplayError::RegionMeta(e.to_string()))?;
                let g = |k: &str| v.get(k).and_then(|x| x.as_u64());
                match (g("id"), g("slot_size"), g("nslots")) {
                    (Some(id), Some(ss), Some(n)) => {
                        r.geometry.insert(id as u32, (ss, n as u32));
                    }
                    _ => return Err(ReplayError::RegionMeta(v.to_string())),
                }
            }
        }
    }
    let compute = stage == Stage::LayerCompute;
    let entries = &rec.entries;
    let mut compared = 0usize;
    let mut i = 0usize;
    while i < entries.len() {
        match &entries[i] {
            Entry::Inbound { channel, .. } if channel == REGION_META => i += 1,
            Entry::Inbound { channel, frame } => {
                if compute {
                    let mut j = i + 1;
                    while let Some(Entry::BufferRead { handle, bytes, .. }) = entries.get(j) {
                        r.fill(j, handle, bytes.as_deref())?;
                        j += 1;
                    }
                }
                r.send_inbound(i, channel, frame)?;
                i += 1;
            }
            Entry::Outbound { channel, frame } => {
                // A run of expert events (and the buffer entries between them) is a group
                // compared as a multiset.
                let mut end = i + 1;
                let fetcher = stage == Stage::ExpertFetcher;
                if channel != CONTROL && is_expert_event(frame) {
                    while let Some(e) = entries.get(end) {
                        match e {
                            Entry::Outbound {
                                channel: c,
                                frame: f,
                            } if c == channel && is_expert_event(f) => {}
                            Entry::BufferRead { .. } => {}
                            // Compute's per-expert releases, which the fetcher read during
                            // the batch: part of the group (see `expect_fetcher_group`).
                            Entry::Inbound {
                                channel: c,
                                frame: f,
                            } if fetcher && c == channel && releases_of(f).is_some() => {}
                            _ => break,
                        }
                        end += 1;
                    }
                    // A trailing release belongs to whatever follows, as recorded.
                    while end > i + 1
                        && matches!(&entries[end - 1], Entry::Inbound { frame: f, .. } if releases_of(f).is_some())
                    {
                        end -= 1;
                    }
                }
                compared += if fetcher && end > i + 1 {
                    r.expect_fetcher_group(entries, i, end)?
                } else {
                    r.expect(entries, i, end)?
                };
                i = end;
            }
            Entry::BufferRead { handle, sha256, .. } => {
                if !compute {
                    r.check_published(i, handle, sha256)?;
                }
                i += 1;
            }
        }
    }
    r.finish()?;
    Ok(compared)
}

impl Replayer {
    fn stage_error(&mut self) -> Option<StageEnd> {
        let t = self.thread.as_ref()?;
        if !t.is_finished() {
            return None;
        }
        let h = self.thread.take()?;
        Some(match h.join() {
            Ok(Ok(())) => StageEnd::FinishedEarly,
            Ok(Err(e)) => StageEnd::Failed(e),
            Err(_) => StageEnd::Panicked,
        })
    }

    fn fill(&mut self, entry: usize, h: &Handle, bytes: Option<&[u8]>) -> Result<(), ReplayError> {
        self.fill_buffer(h, bytes).map_err(at(entry, At::Entry))
    }

    fn fill_buffer(&mut self, h: &Handle, bytes: Option<&[u8]>) -> Result<(), EntryError> {
        let bytes = bytes.ok_or(EntryError::NoBytes(*h))?;
        let region = self
            .data
            .get(&h.region)
            .ok_or(EntryError::RegionNotGiven { handle: *h })?;
        let slot = (h.offset / region.slot_size().max(1) as u64) as u32;
        let mut gen = region.generation(slot)?;
        if gen > h.generation {
            return Err(EntryError::Generation {
                handle: *h,
                at: gen,
            });
        }
        while gen < h.generation {
            gen = region.bump_generation(slot)?;
        }
        region
            .write_at(h.offset, bytes)
            .map_err(|source| EntryError::Fill { handle: *h, source })
    }

    fn send_inbound(
        &mut self,
        entry: usize,
        channel: &str,
        frame: &[u8],
    ) -> Result<(), ReplayError> {
        self.send_frame_in(channel, frame)
            .map_err(at(entry, At::Inbound(channel.to_string())))
    }

    fn send_frame_in(&mut self, channel: &str, frame: &[u8]) -> Result<(), EntryError> {
        if channel != CONTROL {
            let link = self.links.get_mut(channel).ok_or(EntryError::NoLink)?;
            return link
                .send_bytes(frame, Some(self.timeout))
                .map_err(EntryError::Send);
        }
        let msg = messages::decode(frame).map_err(EntryError::Undecodable)?;
        match msg {
            Msg::Region {
                id,
                role: RegionRole::Link { peer, side, .. },
            } => {
                let region =
                    ShmTransport::create_region(id, &format!("replay-{peer}"), &link_ring())?;
                let region = Arc::new(region);
                let ours = match side {
                    Side::A => Side::B,
                    Side::B => Side::A,
                };
                let t = ShmTransport::attach(region.clone(), ours, PeerWatch::None, link_ring())?;
                self.links.insert(peer.name().to_string(), t);
                let m = Msg::Region {
                    id,
                    role: RegionRole::Link {
                        peer,
                        side,
                        peer_pid: 0,
                    },
                };
                Ok(self.control.send(&m, &[region.fd()])?)
            }
            Msg::Region {
                id,
                role: RegionRole::Data { name },
            } => {
                let (ss, n) = *self
                    .geometry
                    .get(&id)
                    .ok_or_else(|| EntryError::NoRegionMeta {
                        id,
                        name: name.clone(),
                    })?;
                let region = Region::create(id, &format!("replay-{name}"), ss, n)?;
                self.control.send_frame(frame, &[region.fd()])?;
                self.data.insert(id, Arc::new(region));
                Ok(())
            }
            Msg::Configure { json } => {
                let json = match serde_json::from_str::<serde_json::Value>(&json) {
                    Ok(mut v) => {
                        if let Some(o) = v.as_object_mut() {
                            for k in ["record_dir", "dump_logits", "trace_dir"] {
                                if let Some(x) = o.get_mut(k) {
                                    *x = serde_json::Value::Null;
                                }
                            }
                        }
                        v.to_string()
                    }
                    Err(_) => json,
                };
                Ok(self.control.send(&Msg::Configure { json }, &[])?)
            }
            _ => Ok(self.control.send_frame(frame, &[])?),
        }
    }

    /// The next frame the stage sends on `channel` (Pongs skipped).
    fn recv(&mut self, entry: usize, channel: &str) -> Result<Vec<u8>, ReplayError> {
        self.recv_frame_out(channel)
            .map_err(at(entry, At::Outbound(channel.to_string())))
    }

    fn recv_frame_out(&mut self, channel: &str) -> Result<Vec<u8>, EntryError> {
        let deadline = Instant::now() + self.timeout;
        let step = Duration::from_millis(50);
        loop {
            if Instant::now() > deadline {
                return Err(EntryError::Silent(self.timeout));
            }
            if channel == CONTROL {
                match self.control.recv_frame(Some(step)) {
                    Ok((f, mut fds)) => {
                        let m = messages::decode(&f).map_err(EntryError::Undecodable)?;
                        match m {
                            Msg::Pong { .. } | Msg::Progress { .. } => continue,
                            Msg::Region {
                                id,
                                role: RegionRole::Data { .. },
                            } => {
                                if let Some(fd) = fds.pop() {
                                    let r = Region::open(fd, Access::ReadOnly)
                                        .map_err(|source| EntryError::StageRegion { id, source })?;
                                    self.own.insert(id, r);
                                }
                            }
                            _ => {}
                        }
                        return Ok(f);
                    }
                    Err(ControlError::Timeout) => {}
                    Err(source) => {
                        return Err(EntryError::ControlRecv {
                            source,
                            stage: self.stage_error(),
                        });
                    }
                }
            } else {
                let link = self.links.get_mut(channel).ok_or(EntryError::NoLink)?;
                match link.recv_bytes(Some(step)) {
                    Ok(f) => return Ok(f),
                    Err(TransportError::Timeout) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if let Some(why) = self.stage_error() {
                return Err(EntryError::StageEnded(why));
            }
        }
    }

    /// Await and compare the outbound entries in `start..end` (one, or a group of expert
    /// events compared as a multiset). Returns how many messages were compared.
    fn expect(
        &mut self,
        entries: &[Entry],
        start: usize,
        end: usize,
    ) -> Result<usize, ReplayError> {
        let mut want: Vec<(usize, String, Msg, Vec<u8>)> = Vec::new();
        for (k, e) in entries.iter().enumerate().take(end).skip(start) {
            if let Entry::Outbound { channel, frame } = e {
                let (m, b) = masked_bytes(frame).map_err(at(k, At::Recorded))?;
                want.push((k, channel.clone(), m, b));
            }
        }
        let mut got: Vec<(Msg, Vec<u8>)> = Vec::new();
        for (k, channel, _, _) in &want {
            let f = self.recv(*k, channel)?;
            let (m, b) = masked_bytes(&f).map_err(at(*k, At::Outbound(channel.clone())))?;
            got.push((m, b));
        }
        if want.len() == 1 {
            let (k, ch, wm, wb) = &want[0];
            let (gm, gb) = &got[0];
            if wb != gb {
                let why = EntryError::Differs {
                    sent: Box::new(gm.clone()),
                    recorded: Box::new(wm.clone()),
                };
                return Err(at(*k, At::Outbound(ch.clone()))(why));
            }
        } else {
            for (k, ch, wm, wb) in &want {
                match got.iter().position(|(_, b)| b == wb) {
                    Some(p) => {
                        got.remove(p);
                    }
                    None => {
                        let why = EntryError::NotSent {
                            recorded: Box::new(wm.clone()),
                            unmatched: got.iter().map(|(m, _)| m.clone()).collect(),
                        };
                        return Err(at(*k, At::Batch(ch.clone()))(why));
                    }
                }
            }
        }
        for (k, e) in entries.iter().enumerate().take(end).skip(start) {
            if let (Entry::BufferRead { handle, sha256, .. }, false) =
                (e, self.stage == Stage::LayerCompute)
            {
                self.check_published(k, handle, sha256)?;
            }
        }
        Ok(want.len())
    }

    /// The expert-fetcher's events for one batch, with compute's releases that it read
    /// during the batch (`start..end`): the events are compared as a multiset, each
    /// published buffer is checked against its recorded hash as soon as its message
    /// arrives (the stage may reuse the slot once it is released), and each release is
    /// sent once every expert it names has arrived (a release of an expert this group does
    /// not publish is sent at once). The recorded interleaving of releases and events is
    /// timing; what must not change is what is published and where, whatever the timing,
    /// which is what this checks. Returns how many messages were compared.
    fn expect_fetcher_group(
        &mut self,
        entries: &[Entry],
        start: usize,
        end: usize,
    ) -> Result<usize, ReplayError> {
        struct Want {
            entry: usize,
            channel: String,
            msg: Msg,
            bytes: Vec<u8>,
            /// The buffer it publishes and the hash recorded for it.
            buffer: Option<(Handle, [u8; 32])>,
        }
        struct Release {
            entry: usize,
            channel: String,
            frame: Vec<u8>,
            layer: u32,
            ids: Vec<u32>,
        }
        let mut want: Vec<Want> = Vec::new();
        let mut releases: Vec<Release> = Vec::new();
        for (k, e) in entries.iter().enumerate().take(end).skip(start) {
            match e {
                Entry::Outbound { channel, frame } => {
                    let (msg, bytes) = masked_bytes(frame).map_err(at(k, At::Recorded))?;
                    want.push(Want {
                        entry: k,
                        channel: channel.clone(),
                        msg,
                        bytes,
                        buffer: None,
                    });
                }
                Entry::BufferRead { handle, sha256, .. } => {
                    if let Some(w) = want.last_mut() {
                        w.buffer = Some((*handle, *sha256));
                    }
                }
                Entry::Inbound { channel, frame } => {
                    if let Some((layer, ids)) = releases_of(frame) {
                        releases.push(Release {
                            entry: k,
                            channel: channel.clone(),
                            frame: frame.clone(),
                            layer,
                            ids,
                        });
                    }
                }
            }
        }
        let expert_of = |m: &Msg| match m {
            Msg::ExpertReady { layer, id, .. } | Msg::ExpertFailed { layer, id, .. } => {
                Some((*layer, *id))
            }
            _ => None,
        };
        let pending: std::collections::HashSet<(u32, u32)> =
            want.iter().filter_map(|w| expert_of(&w.msg)).collect();
        let mut arrived: std::collections::HashSet<(u32, u32)> = Default::default();
        let mut compared = 0usize;
        loop {
            // Send every release whose experts have all arrived (or are not this group's).
            let mut k = 0;
            while k < releases.len() {
                let r = &releases[k];
                let ready = r.ids.iter().all(|&id| {
                    arrived.contains(&(r.layer, id)) || !pending.contains(&(r.layer, id))
                });
                if ready {
                    let r = releases.remove(k);
                    self.send_inbound(r.entry, &r.channel, &r.frame)?;
                } else {
                    k += 1;
                }
            }
            let Some((k0, channel)) = want.first().map(|w| (w.entry, w.channel.clone())) else {
                break;
            };
            let f = self.recv(k0, &channel)?;
            let (gm, gb) = masked_bytes(&f).map_err(at(k0, At::Outbound(channel.clone())))?;
            let Some(p) = want.iter().position(|w| w.bytes == gb) else {
                let why = EntryError::NotRecorded {
                    sent: Box::new(gm),
                    left: want.iter().map(|w| w.msg.clone()).collect(),
                };
                return Err(at(k0, At::Batch(channel))(why));
            };
            let w = want.remove(p);
            if let Some((h, sha)) = w.buffer {
                self.check_published(w.entry, &h, &sha)?;
            }
            if let Some(x) = expert_of(&w.msg) {
                arrived.insert(x);
            }
            compared += 1;
        }
        if let Some(r) = releases.first() {
            return Err(at(r.entry, At::Entry)(EntryError::ReleaseNeverPublished));
        }
        Ok(compared)
    }

    /// A loader published `h`: its contents must hash as recorded.
    fn check_published(
        &self,
        entry: usize,
        h: &Handle,
        want: &[u8; 32],
    ) -> Result<(), ReplayError> {
        self.published_as_recorded(h, want)
            .map_err(at(entry, At::Entry))
    }

    fn published_as_recorded(&self, h: &Handle, want: &[u8; 32]) -> Result<(), EntryError> {
        let region = self
            .own
            .get(&h.region)
            .ok_or(EntryError::RegionNotShared { handle: *h })?;
        // SAFETY: the stage published this range and does not rewrite it before the
        // message that releases it, which this replay has not sent yet.
        let bytes = unsafe { region.resolve(h) }?;
        if &sha256(bytes) != want {
            return Err(EntryError::ContentsDiffer(*h));
        }
        Ok(())
    }

    /// After the log: the stage must finish cleanly and send nothing more.
    fn finish(mut self) -> Result<(), AfterLog> {
        let deadline = Instant::now() + self.timeout;
        // Keep reading control while the stage winds down (it waits for its last frames,
        // heartbeats included, to be read before it exits).
        loop {
            let done = self.thread.as_ref().is_none_or(|t| t.is_finished());
            match self.control.recv_frame(Some(Duration::from_millis(10))) {
                Ok((f, _)) => match messages::decode(&f) {
                    Ok(Msg::Pong { .. }) | Ok(Msg::Progress { .. }) => {}
                    m => {
                        return Err(AfterLog::Sent {
                            channel: CONTROL.to_string(),
                            message: format!("{m:?}"),
                        })
                    }
                },
                Err(_) if done => break,
                Err(_) => {}
            }
            if Instant::now() > deadline {
                return Err(AfterLog::StillRunning(self.timeout));
            }
        }
        if let Some(h) = self.thread.take() {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(AfterLog::Failed(e)),
                Err(_) => return Err(AfterLog::Panicked),
            }
        }
        for (ch, l) in self.links.iter_mut() {
            if let Ok(f) = l.recv_bytes(Some(Duration::from_millis(1))) {
                return Err(AfterLog::Sent {
                    channel: ch.clone(),
                    message: format!("{:?}", messages::decode(&f)),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_protocol::messages::StepStats;

    fn step(token: u32, seconds: f64, expert_read_bytes: u64) -> Msg {
        Msg::StepStats(StepStats {
            step: 0,
            token,
            seconds,
            trunk_read_bytes: 1,
            expert_read_bytes,
            expert_requests: 2,
            resident_hits: 3,
            expert_failures: 0,
            io_wait_seconds: seconds / 2.0,
        })
    }

    /// Timing is masked, everything else still compared: a mask that blanked whole
    /// messages (or compared only their kind) would make the second and third asserts fail.
    #[test]
    fn truncated_recording_fails_at_once() {
        let rec = Recording {
            stage: "tokenizer".into(),
            bytes_kept: false,
            entries: Vec::new(),
            complete: false,
        };
        let t0 = std::time::Instant::now();
        let e = replay(Stage::Tokenizer, &rec, Duration::from_secs(60)).unwrap_err();
        assert!(matches!(e, ReplayError::Truncated(0)), "{e}");
        assert!(
            e.to_string().starts_with("recording truncated at entry 0"),
            "{e}"
        );
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn mask_hides_timing_only() {
        let enc = |m: &Msg| messages::encode(&mask(m)).unwrap();
        assert_eq!(enc(&step(7, 0.5, 10)), enc(&step(7, 1.25, 10)));
        assert_ne!(enc(&step(7, 0.5, 10)), enc(&step(8, 0.5, 10)));
        assert_ne!(enc(&step(7, 0.5, 10)), enc(&step(7, 0.5, 11)));
        let sum = |reads: u64, secs: f64, stage: Stage| {
            Msg::Summary {
            stage,
            json: serde_json::json!({"stats": {"reads": reads, "io_seconds": secs}, "report": format!("{secs} s")})
                .to_string(),
        }
        };
        assert_eq!(
            enc(&sum(3, 0.1, Stage::ExpertFetcher)),
            enc(&sum(3, 0.2, Stage::ExpertFetcher))
        );
        assert_ne!(
            enc(&sum(3, 0.1, Stage::ExpertFetcher)),
            enc(&sum(4, 0.1, Stage::ExpertFetcher))
        );
        assert_eq!(
            enc(&sum(3, 0.1, Stage::TrunkLoader)),
            enc(&sum(4, 0.1, Stage::TrunkLoader))
        );
        let hello = |pid| Msg::Hello {
            stage: Stage::Tokenizer,
            pid,
            version: 1,
        };
        assert_eq!(enc(&hello(10)), enc(&hello(20)));
    }
}
