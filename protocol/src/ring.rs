//! A cross-process single-producer single-consumer ring of fixed-size slots in shared memory.
//!
//! Layout of one ring (at a 128-byte aligned offset inside a [`Region`]'s data area); each
//! group of words sits on its own 128-byte line (two cache lines, so the adjacent-line
//! prefetcher does not couple them):
//!
//! | offset | contents                                                        | written by |
//! |-------:|-----------------------------------------------------------------|------------|
//! | 0      | magic `K3RING01`, slot count (u32), slot size (u32)              | creator    |
//! | 128    | `head`: slots published (u64, monotonically increasing)          | producer   |
//! | 256    | `tail`: slots consumed (u64)                                     | consumer   |
//! | 384    | `data_seq` (futex word), `consumer_waiting`                      | both       |
//! | 512    | `space_seq` (futex word), `producer_waiting`                     | both       |
//! | 640    | `producer_state`, `consumer_state` (open/closed/died), pids      | each side  |
//! | 768    | `slots * slot_size` bytes of slots                               | producer   |
//!
//! **Framing.** A message of `n` bytes is written as an 8-byte frame header (`n` as u32 LE and
//! a frame magic) followed by the payload, spread over `ceil((8 + n) / slot_size)`
//! consecutive slots (consecutive in sequence numbers, so a frame may wrap around the end of
//! the slot array). The producer waits until that many slots are free, copies the whole frame
//! and only then publishes the new `head`, so the consumer never sees a partial message and a
//! timed-out `send` never leaves half a frame behind. A message larger than the whole ring
//! (`slots * slot_size - 8` bytes, [`RingConfig::max_message`]) is rejected with
//! [`TransportError::TooLarge`]; bulk data goes through regions and handles instead.
//!
//! **Doorbell.** Each direction has a futex word (`data_seq` for "data published", `space_seq`
//! for "slots freed") and a *waiting* flag. A side that is about to sleep reads the futex word,
//! sets its waiting flag, issues a SeqCst fence and re-checks the ring before `FUTEX_WAIT`.
//! The other side publishes, fences, and only calls `FUTEX_WAKE` (after bumping the word) when
//! the waiting flag is set, so the fast path is syscall-free and no wakeup can be lost.
//!
//! **Peer death.** Waits are cut into slices (20 ms by default). After a slice without
//! progress, and before reporting a timeout, the waiter asks its [`PeerWatch`] whether the peer
//! is gone (pidfd readable, or the peer's end of a socket hung up) and returns
//! [`TransportError::PeerDied`]. A peer that drops its end cleanly marks its state word
//! *closed* (the other side gets [`TransportError::Closed`] once the ring is drained); an end
//! dropped while its thread panics marks *died*.
//!
//! Everything read from shared memory (head, tail, frame lengths) is validated before use, so
//! a corrupt or malicious peer produces [`TransportError::Corrupt`], never out-of-bounds
//! access.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::thread::futex;

use crate::shm::{Region, ShmError};
use crate::transport::TransportError;

/// Magic word at the start of a ring header.
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"K3RING01");
/// Bytes of ring header before the slots.
pub const RING_HEADER: usize = 768;
/// Bytes of frame header at the start of a message's first slot.
pub const FRAME_HEADER: usize = 8;
const FRAME_MAGIC: u32 = 0x4b33_4652; // "K3FR"

const OFF_HEAD: usize = 128;
const OFF_TAIL: usize = 256;
const OFF_DATA_SEQ: usize = 384;
const OFF_CONS_WAITING: usize = 388;
const OFF_SPACE_SEQ: usize = 512;
const OFF_PROD_WAITING: usize = 516;
const OFF_PROD_STATE: usize = 640;
const OFF_CONS_STATE: usize = 644;
const OFF_PROD_PID: usize = 648;
const OFF_CONS_PID: usize = 652;

/// End state: still in use.
pub const STATE_OPEN: u32 = 0;
/// End state: dropped normally.
pub const STATE_CLOSED: u32 = 1;
/// End state: dropped while its thread was panicking.
pub const STATE_DIED: u32 = 2;

/// Geometry and wait tuning of one ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingConfig {
    /// Number of slots (>= 1).
    pub slots: u32,
    /// Bytes per slot (a multiple of 64, >= 64).
    pub slot_size: u32,
    /// Busy-poll iterations before sleeping on the futex (0 = sleep at once).
    pub spin: u32,
    /// `sched_yield` rounds after spinning and before sleeping on the futex (cheap on an
    /// oversubscribed machine, where the peer may be waiting for our core).
    pub yields: u32,
    /// Length of one wait slice: how often a sleeping side re-checks the peer's liveness.
    pub slice: Duration,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            slots: 256,
            slot_size: 256,
            spin: 64,
            yields: 16,
            slice: Duration::from_millis(20),
        }
    }
}

impl RingConfig {
    /// A config with `slots` slots of `slot_size` bytes and default wait tuning.
    pub fn new(slots: u32, slot_size: u32) -> Self {
        RingConfig {
            slots,
            slot_size,
            ..Default::default()
        }
    }

    /// Check the geometry.
    pub fn validate(&self) -> Result<(), TransportError> {
        if self.slots == 0 || self.slots > 1 << 24 {
            return Err(TransportError::Config(format!(
                "ring slots {} (must be 1..=16777216)",
                self.slots
            )));
        }
        if self.slot_size < 64 || !self.slot_size.is_multiple_of(64) || self.slot_size > 1 << 24 {
            return Err(TransportError::Config(format!(
                "ring slot size {} (must be a multiple of 64 in 64..=16777216)",
                self.slot_size
            )));
        }
        if self.slice.is_zero() {
            return Err(TransportError::Config("ring wait slice is zero".into()));
        }
        Ok(())
    }

    /// Largest message payload a ring of this geometry carries.
    pub fn max_message(&self) -> usize {
        self.slots as usize * self.slot_size as usize - FRAME_HEADER
    }

    /// Slots a message of `len` payload bytes occupies.
    pub fn slots_for(&self, len: usize) -> u64 {
        (FRAME_HEADER + len).div_ceil(self.slot_size as usize) as u64
    }

    /// Bytes one ring (header + slots) occupies in a region.
    pub fn ring_bytes(&self) -> usize {
        RING_HEADER + self.slots as usize * self.slot_size as usize
    }
}

/// How a waiting side learns that its peer is gone without having said goodbye.
#[derive(Debug)]
pub enum PeerWatch {
    /// No external watch: only the peer's state word (closed/died) is consulted. Right for
    /// threads of one process.
    None,
    /// A pidfd of the peer process: readable once the process has exited (even as a zombie).
    Pidfd(OwnedFd),
    /// An fd whose hangup means the peer is gone: our end of a socketpair or the read end of a
    /// pipe whose other end only the peer holds (for example the stage's control socket).
    Hangup(OwnedFd),
}

impl PeerWatch {
    /// Watch process `pid` through a pidfd.
    pub fn pid(pid: i32) -> Result<PeerWatch, TransportError> {
        let p = rustix::process::Pid::from_raw(pid)
            .ok_or_else(|| TransportError::Config(format!("invalid peer pid {pid}")))?;
        let fd = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty())
            .map_err(|e| TransportError::Io(format!("pidfd_open({pid}): {e}")))?;
        Ok(PeerWatch::Pidfd(fd))
    }

    /// Watch this process's parent. If the parent is already gone (we were re-parented), the
    /// watch reports the peer dead at once.
    pub fn parent() -> Result<PeerWatch, TransportError> {
        let Some(ppid) = rustix::process::getppid() else {
            return Err(TransportError::PeerDied(
                "parent (no parent process)".into(),
            ));
        };
        let w = PeerWatch::pid(ppid.as_raw_nonzero().get())?;
        // If the parent died between getppid and pidfd_open, the pid may name another
        // process; a changed getppid tells us so.
        if rustix::process::getppid() != Some(ppid) {
            return Err(TransportError::PeerDied("parent exited".into()));
        }
        Ok(w)
    }

    /// True when the watched peer is known to be gone. Never blocks.
    pub fn is_dead(&self) -> bool {
        let (fd, dead_flags, events) = match self {
            PeerWatch::None => return false,
            PeerWatch::Pidfd(fd) => (
                fd,
                PollFlags::IN | PollFlags::HUP | PollFlags::ERR,
                PollFlags::IN,
            ),
            PeerWatch::Hangup(fd) => (
                fd,
                PollFlags::HUP | PollFlags::ERR | PollFlags::RDHUP | PollFlags::NVAL,
                PollFlags::RDHUP,
            ),
        };
        let mut pfd = [PollFd::from_borrowed_fd(fd.as_fd(), events)];
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut pfd, Some(&zero)) {
            Ok(0) => false,
            Ok(_) => pfd[0].revents().intersects(dead_flags | PollFlags::NVAL),
            Err(_) => false,
        }
    }
}

/// Write a fresh ring header at `offset` of `region`'s data area (the region's creator does
/// this once, before handing the region out).
pub fn init_ring(region: &Region, offset: usize, cfg: &RingConfig) -> Result<(), TransportError> {
    cfg.validate()?;
    check_room(region, offset, cfg)?;
    let mut hdr = [0u8; RING_HEADER];
    hdr[0..8].copy_from_slice(&RING_MAGIC.to_le_bytes());
    hdr[8..12].copy_from_slice(&cfg.slots.to_le_bytes());
    hdr[12..16].copy_from_slice(&cfg.slot_size.to_le_bytes());
    region
        .write_at(offset as u64, &hdr)
        .map_err(|e: ShmError| TransportError::Io(e.to_string()))
}

fn check_room(region: &Region, offset: usize, cfg: &RingConfig) -> Result<(), TransportError> {
    if !offset.is_multiple_of(128) {
        return Err(TransportError::Config(format!(
            "ring offset {offset} is not 128-byte aligned"
        )));
    }
    match offset.checked_add(cfg.ring_bytes()) {
        Some(end) if end <= region.data_len() => Ok(()),
        _ => Err(TransportError::Config(format!(
            "ring of {} bytes at offset {offset} does not fit in region {} ({} bytes)",
            cfg.ring_bytes(),
            region.id(),
            region.data_len()
        ))),
    }
}

/// Shared pointers into one ring; both ends hold one.
struct RingMem {
    region: Arc<Region>,
    base: *mut u8,
    slots: u64,
    slot_size: usize,
}

// SAFETY: `base` points into `region`'s mapping, which the `Arc` keeps alive and which is
// shared memory meant to be used from any thread; all shared words are accessed atomically and
// slot bytes only by the side that owns them under the head/tail protocol.
unsafe impl Send for RingMem {}

impl RingMem {
    fn attach(
        region: Arc<Region>,
        offset: usize,
        cfg: &RingConfig,
    ) -> Result<Self, TransportError> {
        cfg.validate()?;
        check_room(&region, offset, cfg)?;
        // SAFETY: offset + ring_bytes <= data_len (checked), so the header is in bounds.
        let base = unsafe { region.data_ptr().add(offset) };
        // SAFETY: in bounds and 8-aligned (data area page aligned, offset 128 aligned). The
        // creator wrote these before sharing the region; they are never rewritten.
        let (magic, slots, slot_size) = unsafe {
            (
                (base as *const u64).read(),
                (base.add(8) as *const u32).read(),
                (base.add(12) as *const u32).read(),
            )
        };
        if magic != RING_MAGIC {
            return Err(TransportError::Corrupt(format!(
                "ring at offset {offset} of region {}: bad magic {magic:#x} (not initialised?)",
                region.id()
            )));
        }
        if slots != cfg.slots || slot_size != cfg.slot_size {
            return Err(TransportError::Config(format!(
                "ring at offset {offset} of region {} has {slots} slots of {slot_size} bytes, \
                 expected {} of {}",
                region.id(),
                cfg.slots,
                cfg.slot_size
            )));
        }
        Ok(RingMem {
            region,
            base,
            slots: cfg.slots as u64,
            slot_size: cfg.slot_size as usize,
        })
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` is one of the fixed header offsets (< RING_HEADER, 8-aligned), in
        // bounds of the live mapping; shared words are only ever accessed atomically.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }
    fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as for `u64_at`, 4-aligned.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }
    fn head(&self) -> &AtomicU64 {
        self.u64_at(OFF_HEAD)
    }
    fn tail(&self) -> &AtomicU64 {
        self.u64_at(OFF_TAIL)
    }
    fn slot_ptr(&self, seq: u64) -> *mut u8 {
        let idx = (seq % self.slots) as usize;
        // SAFETY: idx < slots, so the slot lies within ring_bytes of base (checked at attach).
        unsafe { self.base.add(RING_HEADER + idx * self.slot_size) }
    }
    fn capacity(&self) -> usize {
        self.slots as usize * self.slot_size
    }
}

/// Sleep on `word` while it still holds `expected`, for at most `dur`.
/// Returns true if the wait ran out its time.
fn futex_sleep(word: &AtomicU32, expected: u32, dur: Duration) -> bool {
    let ts = rustix::event::Timespec {
        tv_sec: dur.as_secs() as i64,
        tv_nsec: dur.subsec_nanos() as i64,
    };
    // Not FUTEX_PRIVATE: the word is in shared memory and the waker is another process.
    matches!(
        futex::wait(word, futex::Flags::empty(), expected, Some(&ts)),
        Err(rustix::io::Errno::TIMEDOUT)
    )
}

fn futex_ring(word: &AtomicU32) {
    word.fetch_add(1, Ordering::SeqCst);
    let _ = futex::wake(word, futex::Flags::empty(), 1);
}

fn backoff(i: u32, spin: u32) {
    if i < spin {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

fn remaining(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

fn mark_state(mem: &RingMem, state_off: usize, wake_off: usize) {
    let state = if std::thread::panicking() {
        STATE_DIED
    } else {
        STATE_CLOSED
    };
    mem.u32_at(state_off).store(state, Ordering::SeqCst);
    futex_ring(mem.u32_at(wake_off));
}

fn peer_gone(state: u32, what: &str) -> Option<TransportError> {
    match state {
        STATE_OPEN => None,
        STATE_CLOSED => Some(TransportError::Closed),
        _ => Some(TransportError::PeerDied(format!(
            "{what} dropped its end while panicking"
        ))),
    }
}

/// The sending end of a ring.
pub struct Producer {
    mem: RingMem,
    head: u64,
    cfg: RingConfig,
}

impl Producer {
    /// Attach as the producer of the ring at data offset `offset` of `region`.
    pub fn attach(
        region: Arc<Region>,
        offset: usize,
        cfg: RingConfig,
    ) -> Result<Self, TransportError> {
        let mem = RingMem::attach(region, offset, &cfg)?;
        let head = mem.head().load(Ordering::Acquire);
        mem.u32_at(OFF_PROD_PID)
            .store(std::process::id(), Ordering::Relaxed);
        Ok(Producer { mem, head, cfg })
    }

    /// The consumer end's state word (`STATE_OPEN`, `STATE_CLOSED` or `STATE_DIED`).
    pub fn consumer_state(&self) -> u32 {
        self.mem.u32_at(OFF_CONS_STATE).load(Ordering::SeqCst)
    }

    /// Largest payload accepted.
    pub fn max_message(&self) -> usize {
        self.cfg.max_message()
    }

    /// Free slots right now.
    fn free(&self) -> Result<u64, TransportError> {
        let tail = self.mem.tail().load(Ordering::Acquire);
        let used = self.head.wrapping_sub(tail);
        if used > self.mem.slots {
            return Err(TransportError::Corrupt(format!(
                "ring tail {tail} is not within {} slots of head {}",
                self.mem.slots, self.head
            )));
        }
        Ok(self.mem.slots - used)
    }

    /// Send one message, waiting for room until `deadline` (None: no limit).
    pub fn send(
        &mut self,
        msg: &[u8],
        deadline: Option<Instant>,
        peer: &PeerWatch,
    ) -> Result<(), TransportError> {
        if msg.len() > self.max_message() {
            return Err(TransportError::TooLarge {
                len: msg.len(),
                max: self.max_message(),
            });
        }
        let need = self.cfg.slots_for(msg.len());
        let cons_state = self.mem.u32_at(OFF_CONS_STATE);
        loop {
            if let Some(e) = peer_gone(cons_state.load(Ordering::Acquire), "the receiver") {
                return Err(e);
            }
            if self.free()? >= need {
                break;
            }
            let mut spun = false;
            for i in 0..self.cfg.spin + self.cfg.yields {
                backoff(i, self.cfg.spin);
                if self.free()? >= need {
                    spun = true;
                    break;
                }
            }
            if spun {
                continue;
            }
            let left = remaining(deadline);
            if left == Some(Duration::ZERO) {
                return Err(if peer.is_dead() {
                    TransportError::PeerDied("receiver process exited".into())
                } else {
                    TransportError::Timeout
                });
            }
            let seq_word = self.mem.u32_at(OFF_SPACE_SEQ);
            let waiting = self.mem.u32_at(OFF_PROD_WAITING);
            let seq = seq_word.load(Ordering::SeqCst);
            waiting.store(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if self.free()? >= need || cons_state.load(Ordering::SeqCst) != STATE_OPEN {
                waiting.store(0, Ordering::Relaxed);
                continue;
            }
            let dur = left.map_or(self.cfg.slice, |l| l.min(self.cfg.slice));
            let timed_out = futex_sleep(seq_word, seq, dur);
            waiting.store(0, Ordering::Relaxed);
            if timed_out && peer.is_dead() {
                return Err(TransportError::PeerDied("receiver process exited".into()));
            }
        }
        // Copy the frame: header + payload as one byte stream over `need` slots.
        let mut hdr = [0u8; FRAME_HEADER];
        hdr[0..4].copy_from_slice(&(msg.len() as u32).to_le_bytes());
        hdr[4..8].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        let ss = self.mem.slot_size;
        let mut src_pos = 0usize; // position in the virtual stream hdr ++ msg
        let total = FRAME_HEADER + msg.len();
        for i in 0..need {
            let dst = self.mem.slot_ptr(self.head + i);
            let chunk_end = (src_pos + ss).min(total);
            let mut d = 0usize;
            let mut p = src_pos;
            while p < chunk_end {
                let (src, len) = if p < FRAME_HEADER {
                    (
                        &hdr[p..FRAME_HEADER.min(chunk_end)],
                        FRAME_HEADER.min(chunk_end) - p,
                    )
                } else {
                    (
                        &msg[p - FRAME_HEADER..chunk_end - FRAME_HEADER],
                        chunk_end - p,
                    )
                };
                // SAFETY: dst + d + len <= dst + slot_size (chunk is at most one slot); the
                // slots head..head+need are free (checked above), so the consumer does not
                // read them until we publish head below.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.add(d), len) };
                d += len;
                p += len;
            }
            src_pos = chunk_end;
        }
        self.head += need;
        self.mem.head().store(self.head, Ordering::Release);
        fence(Ordering::SeqCst);
        if self.mem.u32_at(OFF_CONS_WAITING).load(Ordering::SeqCst) != 0 {
            futex_ring(self.mem.u32_at(OFF_DATA_SEQ));
        }
        Ok(())
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        mark_state(&self.mem, OFF_PROD_STATE, OFF_DATA_SEQ);
    }
}

/// The receiving end of a ring.
pub struct Consumer {
    mem: RingMem,
    tail: u64,
    cfg: RingConfig,
}

impl Consumer {
    /// Attach as the consumer of the ring at data offset `offset` of `region`.
    pub fn attach(
        region: Arc<Region>,
        offset: usize,
        cfg: RingConfig,
    ) -> Result<Self, TransportError> {
        let mem = RingMem::attach(region, offset, &cfg)?;
        let tail = mem.tail().load(Ordering::Acquire);
        mem.u32_at(OFF_CONS_PID)
            .store(std::process::id(), Ordering::Relaxed);
        Ok(Consumer { mem, tail, cfg })
    }

    /// Take one message if one is published.
    fn try_take(&mut self) -> Result<Option<Vec<u8>>, TransportError> {
        let head = self.mem.head().load(Ordering::Acquire);
        let avail = head.wrapping_sub(self.tail);
        if avail == 0 {
            return Ok(None);
        }
        if avail > self.mem.slots {
            return Err(TransportError::Corrupt(format!(
                "ring head {head} is not within {} slots of tail {}",
                self.mem.slots, self.tail
            )));
        }
        let ss = self.mem.slot_size;
        let first = self.mem.slot_ptr(self.tail);
        let mut hdr = [0u8; FRAME_HEADER];
        // SAFETY: the slot at tail is published (avail >= 1) and at least 64 bytes long.
        unsafe { std::ptr::copy_nonoverlapping(first, hdr.as_mut_ptr(), FRAME_HEADER) };
        let len = u32::from_le_bytes(hdr[0..4].try_into().unwrap()) as usize;
        let magic = u32::from_le_bytes(hdr[4..8].try_into().unwrap());
        if magic != FRAME_MAGIC || len > self.mem.capacity() - FRAME_HEADER {
            return Err(TransportError::Corrupt(format!(
                "ring frame at sequence {}: magic {magic:#x}, length {len}",
                self.tail
            )));
        }
        let need = self.cfg.slots_for(len);
        if need > avail {
            return Err(TransportError::Corrupt(format!(
                "ring frame at sequence {} claims {need} slots but only {avail} are published",
                self.tail
            )));
        }
        let mut out = vec![0u8; len];
        let total = FRAME_HEADER + len;
        let mut pos = 0usize;
        for i in 0..need {
            let src = self.mem.slot_ptr(self.tail + i);
            let chunk_end = (pos + ss).min(total);
            let from = pos.max(FRAME_HEADER);
            if from < chunk_end {
                // SAFETY: the source range lies inside this published slot
                // (from - pos < ss, chunk_end - pos <= ss) and the destination inside `out`
                // (chunk_end - FRAME_HEADER <= len).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.add(from - pos),
                        out.as_mut_ptr().add(from - FRAME_HEADER),
                        chunk_end - from,
                    )
                };
            }
            pos = chunk_end;
        }
        self.tail += need;
        self.mem.tail().store(self.tail, Ordering::Release);
        fence(Ordering::SeqCst);
        if self.mem.u32_at(OFF_PROD_WAITING).load(Ordering::SeqCst) != 0 {
            futex_ring(self.mem.u32_at(OFF_SPACE_SEQ));
        }
        Ok(Some(out))
    }

    /// Receive one message, waiting until `deadline` (None: no limit). Messages the peer
    /// published before it closed or died are still delivered, then `Closed`/`PeerDied`.
    pub fn recv(
        &mut self,
        deadline: Option<Instant>,
        peer: &PeerWatch,
    ) -> Result<Vec<u8>, TransportError> {
        loop {
            if let Some(m) = self.try_take()? {
                return Ok(m);
            }
            if let Some(e) = peer_gone(self.prod_state(), "the sender") {
                // The state is stored after the last publish: look once more.
                if let Some(m) = self.try_take()? {
                    return Ok(m);
                }
                return Err(e);
            }
            let mut got = false;
            for i in 0..self.cfg.spin + self.cfg.yields {
                backoff(i, self.cfg.spin);
                if self.mem.head().load(Ordering::Relaxed) != self.tail {
                    got = true;
                    break;
                }
            }
            if got {
                continue;
            }
            let left = remaining(deadline);
            if left == Some(Duration::ZERO) {
                return Err(if peer.is_dead() {
                    TransportError::PeerDied("sender process exited".into())
                } else {
                    TransportError::Timeout
                });
            }
            let seq_word = self.mem.u32_at(OFF_DATA_SEQ);
            let waiting = self.mem.u32_at(OFF_CONS_WAITING);
            let seq = seq_word.load(Ordering::SeqCst);
            waiting.store(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if self.mem.head().load(Ordering::SeqCst) != self.tail
                || self.prod_state() != STATE_OPEN
            {
                waiting.store(0, Ordering::Relaxed);
                continue;
            }
            let dur = left.map_or(self.cfg.slice, |l| l.min(self.cfg.slice));
            let timed_out = futex_sleep(seq_word, seq, dur);
            waiting.store(0, Ordering::Relaxed);
            if timed_out && peer.is_dead() {
                if let Some(m) = self.try_take()? {
                    return Ok(m);
                }
                return Err(TransportError::PeerDied("sender process exited".into()));
            }
        }
    }

    fn prod_state(&self) -> u32 {
        self.mem.u32_at(OFF_PROD_STATE).load(Ordering::SeqCst)
    }

    /// The producer end's state word (`STATE_OPEN`, `STATE_CLOSED` or `STATE_DIED`).
    pub fn producer_state(&self) -> u32 {
        self.prod_state()
    }

    /// Which pid attached as the producer (diagnostics only; 0 if none yet).
    pub fn producer_pid(&self) -> u32 {
        self.mem.u32_at(OFF_PROD_PID).load(Ordering::Relaxed)
    }

    /// The region holding this ring.
    pub fn region(&self) -> &Arc<Region> {
        &self.mem.region
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        mark_state(&self.mem, OFF_CONS_STATE, OFF_SPACE_SEQ);
    }
}
