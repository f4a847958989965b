//! The [`Transport`] trait: how two stages exchange small messages, and its implementations.
//!
//! - [`InProcTransport`]: two threads of one process (`--inproc`), a mutex-protected queue per
//!   direction with the *same* capacity accounting as the shared-memory ring (messages use
//!   `ceil((8 + len) / slot_size)` slots of a fixed budget), so back-pressure and size limits
//!   behave identically.
//! - [`ShmTransport`]: two processes, one shared-memory [`Region`] holding two rings (one per
//!   direction, see [`crate::ring`]) with futex doorbells and peer-death detection.
//!
//! Both carry opaque byte frames; [`Transport::send`] / [`Transport::recv`] add the bincode
//! encoding of [`Msg`]. Semantics every implementation keeps (checked by one conformance suite
//! in `protocol/tests/transport.rs`):
//! - messages arrive complete, once, in order;
//! - `send` blocks while the peer's inbox is full (back-pressure) and returns
//!   [`TransportError::Timeout`] when its timeout passes, having sent nothing;
//! - a message longer than [`Transport::max_message`] is refused with
//!   [`TransportError::TooLarge`];
//! - `recv` returns [`TransportError::Timeout`] when nothing arrives in time;
//! - after the peer dropped its end, queued messages are still delivered, then
//!   [`TransportError::Closed`]; if the peer died (process killed, thread panicked),
//!   [`TransportError::PeerDied`] within about one wait slice (20 ms by default).
//!
//! A timeout of `None` waits without limit (but still notices the peer's death);
//! `Some(Duration::ZERO)` only tries once.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::messages::{self, Msg};
use crate::ring::{
    self, Consumer, PeerWatch, Producer, RingConfig, STATE_CLOSED, STATE_DIED, STATE_OPEN,
};
use crate::shm::Region;

/// Everything that can go wrong moving a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("timed out")]
    Timeout,
    #[error("the peer closed its end")]
    Closed,
    #[error("the peer died: {0}")]
    PeerDied(String),
    #[error("message of {len} bytes is larger than the transport's limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("corrupt transport state: {0}")]
    Corrupt(String),
    #[error("transport configuration: {0}")]
    Config(String),
    #[error("transport I/O: {0}")]
    Io(String),
    #[error("message encoding: {0}")]
    Codec(String),
    #[error("replay: {0}")]
    Replay(String),
}

/// A bidirectional message link between two stages.
pub trait Transport: Send {
    /// Send one frame (opaque bytes), waiting for room up to `timeout`.
    fn send_bytes(&mut self, frame: &[u8], timeout: Option<Duration>)
        -> Result<(), TransportError>;
    /// Receive one frame, waiting up to `timeout`.
    fn recv_bytes(&mut self, timeout: Option<Duration>) -> Result<Vec<u8>, TransportError>;
    /// Largest frame accepted by `send_bytes`.
    fn max_message(&self) -> usize;
    /// True when the peer is known to be gone (non-blocking; used by health checks).
    fn peer_dead(&self) -> bool;

    /// Encode and send a message.
    fn send(&mut self, msg: &Msg, timeout: Option<Duration>) -> Result<(), TransportError> {
        let b = messages::encode(msg).map_err(|e| TransportError::Codec(e.to_string()))?;
        self.send_bytes(&b, timeout)
    }
    /// Receive and decode a message.
    fn recv(&mut self, timeout: Option<Duration>) -> Result<Msg, TransportError> {
        let b = self.recv_bytes(timeout)?;
        messages::decode(&b).map_err(|e| TransportError::Codec(e.to_string()))
    }
}

impl<T: Transport + ?Sized> Transport for Box<T> {
    fn send_bytes(
        &mut self,
        frame: &[u8],
        timeout: Option<Duration>,
    ) -> Result<(), TransportError> {
        (**self).send_bytes(frame, timeout)
    }
    fn recv_bytes(&mut self, timeout: Option<Duration>) -> Result<Vec<u8>, TransportError> {
        (**self).recv_bytes(timeout)
    }
    fn max_message(&self) -> usize {
        (**self).max_message()
    }
    fn peer_dead(&self) -> bool {
        (**self).peer_dead()
    }
}

fn deadline(timeout: Option<Duration>) -> Option<Instant> {
    timeout.map(|t| Instant::now() + t)
}

// ---------------------------------------------------------------------------------------------
// In-process

struct DirState {
    msgs: VecDeque<Vec<u8>>,
    used_slots: u64,
    prod: u32,
    cons: u32,
}

struct Dir {
    st: Mutex<DirState>,
    cv: Condvar,
}

impl Dir {
    fn new() -> Arc<Dir> {
        Arc::new(Dir {
            st: Mutex::new(DirState {
                msgs: VecDeque::new(),
                used_slots: 0,
                prod: STATE_OPEN,
                cons: STATE_OPEN,
            }),
            cv: Condvar::new(),
        })
    }
    fn lock(&self) -> MutexGuard<'_, DirState> {
        // A poisoned lock only means a peer thread panicked while holding it; the queue itself
        // is always consistent (every critical section is panic-free), so keep going.
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn state_err(state: u32, what: &str) -> Option<TransportError> {
    match state {
        STATE_OPEN => None,
        STATE_CLOSED => Some(TransportError::Closed),
        _ => Some(TransportError::PeerDied(format!("{what} thread panicked"))),
    }
}

/// One end of an in-process link (see the module docs).
pub struct InProcTransport {
    tx: Arc<Dir>,
    rx: Arc<Dir>,
    cfg: RingConfig,
}

impl InProcTransport {
    /// A connected pair with the capacity of a ring of geometry `cfg` in each direction.
    pub fn pair(cfg: RingConfig) -> Result<(InProcTransport, InProcTransport), TransportError> {
        cfg.validate()?;
        let ab = Dir::new();
        let ba = Dir::new();
        Ok((
            InProcTransport {
                tx: ab.clone(),
                rx: ba.clone(),
                cfg,
            },
            InProcTransport {
                tx: ba,
                rx: ab,
                cfg,
            },
        ))
    }
}

impl Transport for InProcTransport {
    fn send_bytes(
        &mut self,
        frame: &[u8],
        timeout: Option<Duration>,
    ) -> Result<(), TransportError> {
        if frame.len() > self.cfg.max_message() {
            return Err(TransportError::TooLarge {
                len: frame.len(),
                max: self.cfg.max_message(),
            });
        }
        let need = self.cfg.slots_for(frame.len());
        let dl = deadline(timeout);
        let mut st = self.tx.lock();
        loop {
            if let Some(e) = state_err(st.cons, "the receiver") {
                return Err(e);
            }
            if st.used_slots + need <= self.cfg.slots as u64 {
                st.used_slots += need;
                st.msgs.push_back(frame.to_vec());
                drop(st);
                self.tx.cv.notify_all();
                return Ok(());
            }
            st = match dl {
                None => self.tx.cv.wait(st).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(TransportError::Timeout);
                    }
                    self.tx
                        .cv
                        .wait_timeout(st, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    fn recv_bytes(&mut self, timeout: Option<Duration>) -> Result<Vec<u8>, TransportError> {
        let dl = deadline(timeout);
        let mut st = self.rx.lock();
        loop {
            if let Some(m) = st.msgs.pop_front() {
                st.used_slots -= self.cfg.slots_for(m.len());
                drop(st);
                self.rx.cv.notify_all();
                return Ok(m);
            }
            if let Some(e) = state_err(st.prod, "the sender") {
                return Err(e);
            }
            st = match dl {
                None => self.rx.cv.wait(st).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(TransportError::Timeout);
                    }
                    self.rx
                        .cv
                        .wait_timeout(st, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    fn max_message(&self) -> usize {
        self.cfg.max_message()
    }

    fn peer_dead(&self) -> bool {
        self.rx.lock().prod == STATE_DIED || self.tx.lock().cons == STATE_DIED
    }
}

impl Drop for InProcTransport {
    fn drop(&mut self) {
        let state = if std::thread::panicking() {
            STATE_DIED
        } else {
            STATE_CLOSED
        };
        self.tx.lock().prod = state;
        self.tx.cv.notify_all();
        self.rx.lock().cons = state;
        self.rx.cv.notify_all();
    }
}

// ---------------------------------------------------------------------------------------------
// Cross-process

/// Which end of a two-ring region this is: `A` sends on ring 0 and receives on ring 1, `B` the
/// other way round. By convention the region's creator (the parent) is `A`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Side {
    A,
    B,
}

/// One end of a cross-process link: two rings in one shared region plus a peer watch.
pub struct ShmTransport {
    tx: Producer,
    rx: Consumer,
    peer: PeerWatch,
    max: usize,
}

fn second_ring_offset(cfg: &RingConfig) -> usize {
    cfg.ring_bytes().div_ceil(128) * 128
}

impl ShmTransport {
    /// Data bytes a region needs for a link of geometry `cfg`.
    pub fn region_bytes(cfg: &RingConfig) -> u64 {
        (second_ring_offset(cfg) + cfg.ring_bytes()) as u64
    }

    /// Create (and first-touch, so the creator's cgroup pays) a region holding both rings of a
    /// link, with initialised headers. Hand its fd to the peer, then both sides `attach`.
    pub fn create_region(id: u32, name: &str, cfg: &RingConfig) -> Result<Region, TransportError> {
        cfg.validate()?;
        let region = Region::create(id, name, Self::region_bytes(cfg), 1)
            .map_err(|e| TransportError::Io(e.to_string()))?;
        region
            .prefault()
            .map_err(|e| TransportError::Io(e.to_string()))?;
        ring::init_ring(&region, 0, cfg)?;
        ring::init_ring(&region, second_ring_offset(cfg), cfg)?;
        Ok(region)
    }

    /// Attach one end. The geometry is read from the ring headers (so the peer needs only the
    /// fd); the wait tuning (`spin`, `slice`) comes from `tuning`.
    pub fn attach(
        region: Arc<Region>,
        side: Side,
        peer: PeerWatch,
        tuning: RingConfig,
    ) -> Result<ShmTransport, TransportError> {
        let (slots, slot_size) = read_geometry(&region)?;
        let cfg = RingConfig {
            slots,
            slot_size,
            ..tuning
        };
        cfg.validate()?;
        let off1 = second_ring_offset(&cfg);
        let (tx_off, rx_off) = match side {
            Side::A => (0, off1),
            Side::B => (off1, 0),
        };
        Ok(ShmTransport {
            tx: Producer::attach(region.clone(), tx_off, cfg)?,
            rx: Consumer::attach(region, rx_off, cfg)?,
            peer,
            max: cfg.max_message(),
        })
    }

    /// The shared region of this link.
    pub fn region(&self) -> &Arc<Region> {
        self.rx.region()
    }

    /// Replace the peer watch (e.g. once the peer's pid is known).
    pub fn set_peer(&mut self, peer: PeerWatch) {
        self.peer = peer;
    }
}

/// Slot count and size recorded in the first ring header of a link region.
pub fn read_geometry(region: &Region) -> Result<(u32, u32), TransportError> {
    if region.data_len() < ring::RING_HEADER {
        return Err(TransportError::Config(format!(
            "region {} is too small for a ring",
            region.id()
        )));
    }
    let p = region.data_ptr();
    // SAFETY: the data area is at least RING_HEADER bytes (checked) and page aligned; these
    // words are written once by the creator before the region is shared.
    let (magic, slots, slot_size) = unsafe {
        (
            (p as *const u64).read(),
            (p.add(8) as *const u32).read(),
            (p.add(12) as *const u32).read(),
        )
    };
    if magic != ring::RING_MAGIC {
        return Err(TransportError::Corrupt(format!(
            "region {} does not start with a ring header",
            region.id()
        )));
    }
    Ok((slots, slot_size))
}

impl Transport for ShmTransport {
    fn send_bytes(
        &mut self,
        frame: &[u8],
        timeout: Option<Duration>,
    ) -> Result<(), TransportError> {
        self.tx.send(frame, deadline(timeout), &self.peer)
    }
    fn recv_bytes(&mut self, timeout: Option<Duration>) -> Result<Vec<u8>, TransportError> {
        self.rx.recv(deadline(timeout), &self.peer)
    }
    fn max_message(&self) -> usize {
        self.max
    }
    fn peer_dead(&self) -> bool {
        self.rx.producer_state() == STATE_DIED
            || self.tx.consumer_state() == STATE_DIED
            || self.peer.is_dead()
    }
}
