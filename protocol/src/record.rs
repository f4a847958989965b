//! The recording format behind `--record DIR`, and its reader for `k3-orch replay`.
//!
//! Each stage writes one file, `DIR/<stage>.k3rec`:
//!
//! ```text
//! header : "K3REC001" | u16 LE name length | stage name (UTF-8) | u8 flags (bit 0: bytes kept)
//! entry  : u8 kind | u32 LE payload length | payload | 32-byte chain hash
//! ```
//!
//! Kinds: `1` inbound frame and `2` outbound frame (payload: u8 channel-name length, channel
//! name, then the transport frame exactly as it travelled, i.e. the bincode message), `3` a
//! shared buffer read (payload: the handle as region u32, offset u64, len u64, generation u64,
//! all LE; the SHA-256 of the bytes read; u8 1/0; then the bytes when kept), `255` end of
//! recording (payload: u64 LE entry count).
//!
//! The chain hash of entry `i` is `SHA-256(chain[i-1] | kind | length | payload)`, with
//! `chain[-1] = SHA-256(header)`, so any changed, dropped, reordered or inserted entry is
//! detected by [`read_recording`] with `verify = true`, naming the entry and its file offset.
//! `verify = false` parses without checking, for tests that want to feed a deliberately
//! mutated message to a stage and watch the replay comparison (not the checksum) fail.
//!
//! A recording cut short by a crash is still readable up to the last whole entry:
//! [`Recording::complete`] says whether the end marker was seen.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::shm::Handle;
use crate::transport::{Transport, TransportError};

const MAGIC: &[u8; 8] = b"K3REC001";
const KIND_IN: u8 = 1;
const KIND_OUT: u8 = 2;
const KIND_BUF: u8 = 3;
const KIND_END: u8 = 255;
/// Largest entry payload the reader accepts.
pub const MAX_ENTRY: usize = 1 << 30;

/// One recorded event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A frame the stage received on `channel`.
    Inbound { channel: String, frame: Vec<u8> },
    /// A frame the stage sent on `channel`.
    Outbound { channel: String, frame: Vec<u8> },
    /// The stage read a shared buffer: its handle, the SHA-256 of its bytes, optionally the
    /// bytes.
    BufferRead {
        handle: Handle,
        sha256: [u8; 32],
        bytes: Option<Vec<u8>>,
    },
}

/// A whole recording, as read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recording {
    pub stage: String,
    pub bytes_kept: bool,
    pub entries: Vec<Entry>,
    /// The end marker was present (the stage finished recording normally).
    pub complete: bool,
}

/// Recording failures.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("recording {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("recording {path}: not a k3 recording (bad magic)")]
    BadMagic { path: PathBuf },
    #[error("recording {path}: entry {entry} at byte {offset} fails its chain hash (the log was modified)")]
    Integrity {
        path: PathBuf,
        entry: usize,
        offset: usize,
    },
    #[error("recording {path}: entry {entry} at byte {offset} is malformed: {why}")]
    Malformed {
        path: PathBuf,
        entry: usize,
        offset: usize,
        why: String,
    },
    #[error("recording {path}: {why}")]
    Invalid { path: PathBuf, why: String },
}

/// SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Where stage `stage`'s recording lives in `dir`.
pub fn recording_path(dir: &Path, stage: &str) -> PathBuf {
    dir.join(format!("{stage}.k3rec"))
}

fn chain_next(prev: &[u8; 32], kind: u8, payload: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(prev);
    h.update([kind]);
    h.update((payload.len() as u32).to_le_bytes());
    h.update(payload);
    h.finalize().into()
}

/// Writes one stage's recording. Every entry is flushed as it is written, so a stage that
/// is killed leaves a readable prefix.
pub struct Recorder {
    w: BufWriter<File>,
    path: PathBuf,
    chain: [u8; 32],
    keep_bytes: bool,
    count: u64,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("path", &self.path)
            .field("count", &self.count)
            .finish()
    }
}

impl Recorder {
    /// Start `dir/<stage>.k3rec` (creating `dir`). `keep_bytes`: store the bytes of every
    /// shared buffer read, not only their hash (for small runs).
    pub fn create(dir: &Path, stage: &str, keep_bytes: bool) -> Result<Recorder, RecordError> {
        let path = recording_path(dir, stage);
        let ioe = |source| RecordError::Io {
            path: path.clone(),
            source,
        };
        if stage.is_empty() || stage.len() > u16::MAX as usize {
            return Err(RecordError::Invalid {
                path: path.clone(),
                why: format!("stage name of {} bytes", stage.len()),
            });
        }
        // Only the last component is created (never `mkdir -p` of a mistyped path).
        match std::fs::create_dir(dir) {
            Err(e) if !(e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir()) => {
                return Err(ioe(e))
            }
            _ => {}
        }
        // Never through a symlink planted at the predictable name (O_NOFOLLOW: ELOOP).
        let f = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
                .map_err(ioe)?
        };
        let mut header = Vec::with_capacity(11 + stage.len());
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&(stage.len() as u16).to_le_bytes());
        header.extend_from_slice(stage.as_bytes());
        header.push(keep_bytes as u8);
        let mut w = BufWriter::new(f);
        w.write_all(&header).and_then(|_| w.flush()).map_err(ioe)?;
        Ok(Recorder {
            w,
            chain: sha256(&header),
            path,
            keep_bytes,
            count: 0,
        })
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn entry(&mut self, kind: u8, payload: &[u8]) -> Result<(), RecordError> {
        if payload.len() > MAX_ENTRY {
            return Err(RecordError::Invalid {
                path: self.path.clone(),
                why: format!(
                    "entry of {} bytes is over the {MAX_ENTRY}-byte limit",
                    payload.len()
                ),
            });
        }
        self.chain = chain_next(&self.chain, kind, payload);
        let r = (|| {
            self.w.write_all(&[kind])?;
            self.w.write_all(&(payload.len() as u32).to_le_bytes())?;
            self.w.write_all(payload)?;
            self.w.write_all(&self.chain)?;
            self.w.flush()
        })();
        r.map_err(|source| RecordError::Io {
            path: self.path.clone(),
            source,
        })?;
        if kind != KIND_END {
            self.count += 1;
        }
        Ok(())
    }

    fn frame_entry(&mut self, kind: u8, channel: &str, frame: &[u8]) -> Result<(), RecordError> {
        if channel.len() > u8::MAX as usize {
            return Err(RecordError::Invalid {
                path: self.path.clone(),
                why: format!("channel name {channel:?} is longer than 255 bytes"),
            });
        }
        let mut p = Vec::with_capacity(1 + channel.len() + frame.len());
        p.push(channel.len() as u8);
        p.extend_from_slice(channel.as_bytes());
        p.extend_from_slice(frame);
        self.entry(kind, &p)
    }

    /// Log a frame received on `channel`.
    pub fn inbound(&mut self, channel: &str, frame: &[u8]) -> Result<(), RecordError> {
        self.frame_entry(KIND_IN, channel, frame)
    }

    /// Log a frame sent on `channel`.
    pub fn outbound(&mut self, channel: &str, frame: &[u8]) -> Result<(), RecordError> {
        self.frame_entry(KIND_OUT, channel, frame)
    }

    /// Log a shared-buffer read: its handle and content hash (and the bytes, if kept).
    pub fn buffer_read(&mut self, handle: &Handle, bytes: &[u8]) -> Result<(), RecordError> {
        let mut p = Vec::with_capacity(61 + if self.keep_bytes { bytes.len() } else { 0 });
        p.extend_from_slice(&handle.region.to_le_bytes());
        p.extend_from_slice(&handle.offset.to_le_bytes());
        p.extend_from_slice(&handle.len.to_le_bytes());
        p.extend_from_slice(&handle.generation.to_le_bytes());
        p.extend_from_slice(&sha256(bytes));
        p.push(self.keep_bytes as u8);
        if self.keep_bytes {
            p.extend_from_slice(bytes);
        }
        self.entry(KIND_BUF, &p)
    }

    /// Write the end marker and close. Returns the file's path.
    pub fn finish(mut self) -> Result<PathBuf, RecordError> {
        let n = self.count;
        self.entry(KIND_END, &n.to_le_bytes())?;
        Ok(self.path.clone())
    }
}

/// Read a recording. With `verify`, any modification of the file is an error.
pub fn read_recording(path: &Path, verify: bool) -> Result<Recording, RecordError> {
    let data = std::fs::read(path).map_err(|source| RecordError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_recording(path, &data, verify)
}

/// [`read_recording`] of bytes already read (`path` only names them in errors): the
/// in-memory twin the fuzzer drives (`protocol/examples/fuzz_protocol`).
pub fn parse_recording(path: &Path, data: &[u8], verify: bool) -> Result<Recording, RecordError> {
    let p = || path.to_path_buf();
    let (stage, bytes_kept, mut pos) = read_header(data, path)?;
    let mut chain = sha256(&data[..pos]);
    let mut entries = Vec::new();
    let mut complete = false;
    let mut idx = 0usize;
    while pos < data.len() {
        let start = pos;
        let malformed = |why: String| RecordError::Malformed {
            path: p(),
            entry: idx,
            offset: start,
            why,
        };
        if complete {
            return Err(malformed("data after the end marker".into()));
        }
        if data.len() - pos < 5 {
            break; // cut short by a crash: keep the whole entries before it
        }
        let kind = data[pos];
        let len = u32::from_le_bytes(data[pos + 1..pos + 5].try_into().unwrap()) as usize;
        if len > MAX_ENTRY {
            return Err(malformed(format!("payload length {len}")));
        }
        if data.len() - pos - 5 < len + 32 {
            break; // truncated tail
        }
        let payload = &data[pos + 5..pos + 5 + len];
        let stored: [u8; 32] = data[pos + 5 + len..pos + 5 + len + 32].try_into().unwrap();
        chain = chain_next(&chain, kind, payload);
        if verify && stored != chain {
            return Err(RecordError::Integrity {
                path: p(),
                entry: idx,
                offset: start,
            });
        }
        if !verify {
            chain = stored;
        }
        pos += 5 + len + 32;
        match decode_entry(kind, payload, entries.len(), &malformed)? {
            Some(e) => entries.push(e),
            None => complete = true,
        }
        idx += 1;
    }
    Ok(Recording {
        stage,
        bytes_kept,
        entries,
        complete,
    })
}

/// The header of a recording: the stage name, whether bytes are kept, and where the first
/// entry starts.
fn read_header(data: &[u8], path: &Path) -> Result<(String, bool, usize), RecordError> {
    let p = || path.to_path_buf();
    if data.len() < 11 || &data[..8] != MAGIC {
        return Err(RecordError::BadMagic { path: p() });
    }
    let name_len = u16::from_le_bytes([data[8], data[9]]) as usize;
    if data.len() < 11 + name_len {
        return Err(RecordError::Invalid {
            path: p(),
            why: "header cut short".into(),
        });
    }
    let stage =
        String::from_utf8(data[10..10 + name_len].to_vec()).map_err(|_| RecordError::Invalid {
            path: p(),
            why: "stage name is not UTF-8".into(),
        })?;
    let bytes_kept = data[10 + name_len] & 1 == 1;
    Ok((stage, bytes_kept, 11 + name_len))
}

/// Decode one entry's payload: `Some(entry)`, or `None` for the end marker (which must
/// count the `entries` before it). `malformed` makes the error, naming the entry.
fn decode_entry(
    kind: u8,
    payload: &[u8],
    entries: usize,
    malformed: &dyn Fn(String) -> RecordError,
) -> Result<Option<Entry>, RecordError> {
    let bad = |why: &str| Err(malformed(why.into()));
    match kind {
        KIND_IN | KIND_OUT => {
            let Some(&cl) = payload.first() else {
                return bad("empty frame entry");
            };
            let cl = cl as usize;
            if payload.len() < 1 + cl {
                return bad("channel name cut short");
            }
            let Ok(channel) = String::from_utf8(payload[1..1 + cl].to_vec()) else {
                return bad("channel name is not UTF-8");
            };
            let frame = payload[1 + cl..].to_vec();
            Ok(Some(if kind == KIND_IN {
                Entry::Inbound { channel, frame }
            } else {
                Entry::Outbound { channel, frame }
            }))
        }
        KIND_BUF => {
            if payload.len() < 61 {
                return Err(malformed(format!(
                    "buffer entry of {} bytes",
                    payload.len()
                )));
            }
            let u64_at = |o: usize| u64::from_le_bytes(payload[o..o + 8].try_into().unwrap());
            let handle = Handle {
                region: u32::from_le_bytes(payload[0..4].try_into().unwrap()),
                offset: u64_at(4),
                len: u64_at(12),
                generation: u64_at(20),
            };
            let sha: [u8; 32] = payload[28..60].try_into().unwrap();
            let bytes = match payload[60] {
                0 if payload.len() == 61 => None,
                1 => {
                    let b = &payload[61..];
                    if b.len() as u64 != handle.len || sha256(b) != sha {
                        return bad("kept bytes do not match the handle length and hash");
                    }
                    Some(b.to_vec())
                }
                _ => return bad("bad bytes-kept flag"),
            };
            Ok(Some(Entry::BufferRead {
                handle,
                sha256: sha,
                bytes,
            }))
        }
        KIND_END => {
            if payload.len() != 8
                || u64::from_le_bytes(payload.try_into().unwrap()) != entries as u64
            {
                return bad("end marker does not match the entry count");
            }
            Ok(None)
        }
        k => Err(malformed(format!("unknown entry kind {k}"))),
    }
}

/// A recorder shared by the transports of one stage.
pub type SharedRecorder = Arc<Mutex<Recorder>>;

/// Wraps a transport so every frame it carries is logged under `channel`.
pub struct RecordingTransport<T> {
    inner: T,
    channel: String,
    rec: SharedRecorder,
}

impl<T: Transport> RecordingTransport<T> {
    /// Log `inner`'s traffic into `rec` as channel `channel`.
    pub fn new(inner: T, channel: &str, rec: SharedRecorder) -> Self {
        RecordingTransport {
            inner,
            channel: channel.to_string(),
            rec,
        }
    }

    /// The wrapped transport.
    pub fn into_inner(self) -> T {
        self.inner
    }

    fn log(&self, inbound: bool, frame: &[u8]) -> Result<(), TransportError> {
        let mut r = self.rec.lock().unwrap_or_else(|p| p.into_inner());
        if inbound {
            r.inbound(&self.channel, frame)
        } else {
            r.outbound(&self.channel, frame)
        }
        .map_err(|e| TransportError::Io(e.to_string()))
    }
}

impl<T: Transport> Transport for RecordingTransport<T> {
    fn send_bytes(
        &mut self,
        frame: &[u8],
        timeout: Option<Duration>,
    ) -> Result<(), TransportError> {
        self.inner.send_bytes(frame, timeout)?;
        self.log(false, frame)
    }
    fn recv_bytes(&mut self, timeout: Option<Duration>) -> Result<Vec<u8>, TransportError> {
        let f = self.inner.recv_bytes(timeout)?;
        self.log(true, &f)?;
        Ok(f)
    }
    fn max_message(&self) -> usize {
        self.inner.max_message()
    }
    fn peer_dead(&self) -> bool {
        self.inner.peer_dead()
    }
}

impl Recording {
    /// Channel names that appear in the recording, in order of first appearance.
    pub fn channels(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for e in &self.entries {
            if let Entry::Inbound { channel, .. } | Entry::Outbound { channel, .. } = e {
                if !out.contains(channel) {
                    out.push(channel.clone());
                }
            }
        }
        out
    }

    /// Frames of one direction on one channel, in order.
    pub fn frames(&self, channel: &str, inbound: bool) -> Vec<Vec<u8>> {
        self.entries
            .iter()
            .filter_map(|e| match e {
                Entry::Inbound { channel: c, frame } if inbound && c == channel => {
                    Some(frame.clone())
                }
                Entry::Outbound { channel: c, frame } if !inbound && c == channel => {
                    Some(frame.clone())
                }
                _ => None,
            })
            .collect()
    }

    /// The shared-buffer reads, in order, for [`BufferCheck`].
    pub fn buffer_reads(&self) -> BufferCheck {
        BufferCheck {
            reads: self
                .entries
                .iter()
                .filter_map(|e| match e {
                    Entry::BufferRead {
                        handle,
                        sha256,
                        bytes,
                    } => Some((*handle, *sha256, bytes.clone())),
                    _ => None,
                })
                .collect(),
            seen: 0,
        }
    }
}

fn first_difference(a: &[u8], b: &[u8]) -> usize {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()))
}

/// A transport that plays back one channel of a recording for `k3-orch replay`: `recv`
/// returns the recorded inbound frames in order (then `Closed`), and `send` compares every
/// outbound frame byte for byte with the recorded one, failing with
/// [`TransportError::Replay`] at the first difference.
#[derive(Debug)]
pub struct ReplayTransport {
    channel: String,
    inbound: VecDeque<Vec<u8>>,
    expected: VecDeque<Vec<u8>>,
    received: usize,
    sent: usize,
}

impl ReplayTransport {
    /// Play back `channel` of `rec`.
    pub fn new(rec: &Recording, channel: &str) -> Self {
        ReplayTransport {
            channel: channel.to_string(),
            inbound: rec.frames(channel, true).into(),
            expected: rec.frames(channel, false).into(),
            received: 0,
            sent: 0,
        }
    }

    /// After the replayed stage finished: every recorded outbound frame must have been
    /// produced (and every inbound frame consumed).
    pub fn finish(&self) -> Result<(), TransportError> {
        if !self.expected.is_empty() {
            return Err(TransportError::Replay(format!(
                "channel {}: the stage sent {} frames but the recording has {} more",
                self.channel,
                self.sent,
                self.expected.len()
            )));
        }
        if !self.inbound.is_empty() {
            return Err(TransportError::Replay(format!(
                "channel {}: the stage stopped reading after {} frames; {} recorded frames were never read",
                self.channel,
                self.received,
                self.inbound.len()
            )));
        }
        Ok(())
    }
}

impl Transport for ReplayTransport {
    fn send_bytes(
        &mut self,
        frame: &[u8],
        _timeout: Option<Duration>,
    ) -> Result<(), TransportError> {
        let n = self.sent;
        let Some(want) = self.expected.pop_front() else {
            return Err(TransportError::Replay(format!(
                "channel {}: outbound frame {n} was not in the recording (it has {n} frames)",
                self.channel
            )));
        };
        self.sent += 1;
        if want != frame {
            return Err(TransportError::Replay(format!(
                "channel {}: outbound frame {n} differs from the recording at byte {} ({} bytes sent, {} recorded)",
                self.channel,
                first_difference(frame, &want),
                frame.len(),
                want.len()
            )));
        }
        Ok(())
    }

    fn recv_bytes(&mut self, _timeout: Option<Duration>) -> Result<Vec<u8>, TransportError> {
        let f = self.inbound.pop_front().ok_or(TransportError::Closed)?;
        self.received += 1;
        Ok(f)
    }

    fn max_message(&self) -> usize {
        crate::messages::MAX_MESSAGE_BYTES
    }

    fn peer_dead(&self) -> bool {
        false
    }
}

/// Checks, during a replay, that the stage reads the same shared buffers with the same
/// contents, in the same order, as when it was recorded.
#[derive(Debug)]
pub struct BufferCheck {
    reads: Vec<(Handle, [u8; 32], Option<Vec<u8>>)>,
    seen: usize,
}

impl BufferCheck {
    /// The recorded bytes of read `i` (when the recording kept bytes), to rebuild regions.
    pub fn recorded(&self) -> impl Iterator<Item = (&Handle, Option<&[u8]>)> {
        self.reads.iter().map(|(h, _, b)| (h, b.as_deref()))
    }

    /// The stage read `bytes` through `handle`: it must be the next recorded read.
    pub fn check(&mut self, handle: &Handle, bytes: &[u8]) -> Result<(), TransportError> {
        let i = self.seen;
        let Some((h, sha, _)) = self.reads.get(i) else {
            return Err(TransportError::Replay(format!(
                "buffer read {i} ({handle:?}) was not in the recording ({} reads)",
                self.reads.len()
            )));
        };
        self.seen += 1;
        if h != handle {
            return Err(TransportError::Replay(format!(
                "buffer read {i}: handle {handle:?}, recorded {h:?}"
            )));
        }
        if sha256(bytes) != *sha {
            return Err(TransportError::Replay(format!(
                "buffer read {i} ({handle:?}): contents differ from the recording (SHA-256)"
            )));
        }
        Ok(())
    }

    /// Every recorded read happened.
    pub fn finish(&self) -> Result<(), TransportError> {
        if self.seen != self.reads.len() {
            return Err(TransportError::Replay(format!(
                "the stage made {} buffer reads; the recording has {}",
                self.seen,
                self.reads.len()
            )));
        }
        Ok(())
    }
}
