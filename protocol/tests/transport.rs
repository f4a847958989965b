//! The transport conformance suite: one set of checks run against every `Transport`
//! implementation — in-process (threads), shared-memory rings between two threads, and
//! shared-memory rings across a real process boundary (this test binary re-executed as the
//! peer, its link region handed over a control socket with SCM_RIGHTS, the peer SIGKILLed for
//! the death checks).
//!
//! Each check names the wrong implementation it catches.

use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use k3_protocol::control::{self, ChildOptions, ControlSocket};
use k3_protocol::messages::{Msg, RegionRole, Stage};
use k3_protocol::ring::{PeerWatch, RingConfig};
use k3_protocol::shm::{Access, Region};
use k3_protocol::transport::{InProcTransport, ShmTransport, Side, Transport, TransportError};

const PEER_ENV: &str = "K3_TEST_TRANSPORT_PEER";
const QUIT: &[u8] = b"\0quit";
const LONG: Option<Duration> = Some(Duration::from_secs(20));

/// What the peer does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Script {
    /// Send every frame back, until `QUIT` (then drop the end cleanly).
    Echo,
    /// Read nothing until signalled, then `Echo`.
    StallThenEcho,
    /// Neither read nor write; wait to be killed.
    Idle,
    /// Send `n` numbered frames, then drop the end cleanly.
    SendThenClose,
}

impl Script {
    fn name(self) -> &'static str {
        match self {
            Script::Echo => "echo",
            Script::StallThenEcho => "stall",
            Script::Idle => "idle",
            Script::SendThenClose => "send-close",
        }
    }
    fn parse(s: &str) -> Script {
        match s {
            "echo" => Script::Echo,
            "stall" => Script::StallThenEcho,
            "idle" => Script::Idle,
            "send-close" => Script::SendThenClose,
            _ => panic!("unknown script {s}"),
        }
    }
}

const SEND_CLOSE_N: u32 = 5;

fn numbered(i: u32, len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect();
    if len >= 4 {
        v[..4].copy_from_slice(&i.to_le_bytes());
    }
    v
}

/// Run `script` on the peer end. `signalled` / `killed` are polled while waiting.
fn run_peer(
    t: &mut dyn Transport,
    script: Script,
    signalled: &dyn Fn() -> bool,
    killed: &dyn Fn() -> bool,
) {
    let tick = Some(Duration::from_millis(5));
    match script {
        Script::Idle => loop {
            if killed() {
                panic!("peer killed (simulated death)");
            }
            std::thread::sleep(Duration::from_millis(5));
        },
        Script::SendThenClose => {
            for i in 0..SEND_CLOSE_N {
                t.send_bytes(&numbered(i, 40 + i as usize * 3), LONG)
                    .unwrap();
            }
        }
        Script::StallThenEcho | Script::Echo => {
            if script == Script::StallThenEcho {
                while !signalled() {
                    if killed() {
                        panic!("peer killed (simulated death)");
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
            loop {
                if killed() {
                    panic!("peer killed (simulated death)");
                }
                match t.recv_bytes(tick) {
                    Ok(f) if f == QUIT => return,
                    Ok(f) => t.send_bytes(&f, LONG).unwrap(),
                    Err(TransportError::Timeout) => {}
                    Err(e) => panic!("peer recv: {e}"),
                }
            }
        }
    }
}

/// Control over the running peer.
trait PeerCtl {
    fn signal(&mut self);
    fn kill(&mut self);
    fn finish(&mut self);
}

trait Harness {
    fn name(&self) -> &'static str;
    fn start(&self, script: Script, cfg: RingConfig) -> (Box<dyn Transport>, Box<dyn PeerCtl>);
}

// --- threads

struct ThreadPeer {
    signal: Arc<AtomicBool>,
    kill: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
}

impl PeerCtl for ThreadPeer {
    fn signal(&mut self) {
        self.signal.store(true, Ordering::SeqCst);
    }
    fn kill(&mut self) {
        self.kill.store(true, Ordering::SeqCst);
    }
    fn finish(&mut self) {
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

impl Drop for ThreadPeer {
    fn drop(&mut self) {
        self.kill();
        self.finish();
    }
}

fn thread_peer(mut t: Box<dyn Transport>, script: Script) -> Box<dyn PeerCtl> {
    let signal = Arc::new(AtomicBool::new(false));
    let kill = Arc::new(AtomicBool::new(false));
    let (s2, k2) = (signal.clone(), kill.clone());
    let join = std::thread::spawn(move || {
        run_peer(&mut *t, script, &|| s2.load(Ordering::SeqCst), &|| {
            k2.load(Ordering::SeqCst)
        });
    });
    Box::new(ThreadPeer {
        signal,
        kill,
        join: Some(join),
    })
}

struct InProc;
impl Harness for InProc {
    fn name(&self) -> &'static str {
        "in-process channel"
    }
    fn start(&self, script: Script, cfg: RingConfig) -> (Box<dyn Transport>, Box<dyn PeerCtl>) {
        let (a, b) = InProcTransport::pair(cfg).unwrap();
        (Box::new(a), thread_peer(Box::new(b), script))
    }
}

struct ShmThreads;
impl Harness for ShmThreads {
    fn name(&self) -> &'static str {
        "shm ring, two threads"
    }
    fn start(&self, script: Script, cfg: RingConfig) -> (Box<dyn Transport>, Box<dyn PeerCtl>) {
        let region = Arc::new(ShmTransport::create_region(1, "t", &cfg).unwrap());
        let a = ShmTransport::attach(region.clone(), Side::A, PeerWatch::None, cfg).unwrap();
        // The peer maps the region a second time from its fd, as a child would.
        let r2 = Arc::new(Region::open(region.try_clone_fd().unwrap(), Access::ReadWrite).unwrap());
        let b = ShmTransport::attach(r2, Side::B, PeerWatch::None, cfg).unwrap();
        (Box::new(a), thread_peer(Box::new(b), script))
    }
}

// --- processes

struct ProcessPeer {
    child: Child,
    ctl: ControlSocket,
    done: bool,
}

impl PeerCtl for ProcessPeer {
    fn signal(&mut self) {
        self.ctl.send(&Msg::Ping { nonce: 1 }, &[]).unwrap();
    }
    fn kill(&mut self) {
        let _ = self.child.kill(); // SIGKILL
    }
    fn finish(&mut self) {
        if !self.done {
            self.done = true;
            self.child.wait().unwrap();
        }
    }
}

impl Drop for ProcessPeer {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

struct ShmProcesses;
impl Harness for ShmProcesses {
    fn name(&self) -> &'static str {
        "shm ring, two processes"
    }
    fn start(&self, script: Script, cfg: RingConfig) -> (Box<dyn Transport>, Box<dyn PeerCtl>) {
        let (ours, theirs) = control::pair().unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--ignored",
            "--exact",
            "transport::peer_process_main",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(PEER_ENV, script.name())
        .env("K3_TEST_SLICE_MS", cfg.slice.as_millis().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null());
        control::prepare_child(
            &mut cmd,
            &theirs,
            ChildOptions {
                kill_on_parent_death: true,
            },
        );
        let child = cmd.spawn().unwrap();
        drop(theirs);
        let region = Arc::new(ShmTransport::create_region(2, "link", &cfg).unwrap());
        ours.send(
            &Msg::Region {
                id: 2,
                role: RegionRole::Link {
                    peer: Stage::Orchestrator,
                    side: Side::B,
                    peer_pid: std::process::id(),
                },
            },
            &[region.fd()],
        )
        .unwrap();
        let a = ShmTransport::attach(
            region,
            Side::A,
            PeerWatch::pid(child.id() as i32).unwrap(),
            cfg,
        )
        .unwrap();
        (
            Box::new(a),
            Box::new(ProcessPeer {
                child,
                ctl: ours,
                done: false,
            }),
        )
    }
}

/// Entry point of the re-executed peer process (the parent runs it by its exact name with
/// `--ignored`; in a normal run it is ignored, so it is never counted as a pass).
#[test]
#[ignore = "child-process entry point: the parent test runs it with --ignored --exact"]
fn peer_process_main() {
    let Ok(script) = std::env::var(PEER_ENV) else {
        return;
    };
    let script = Script::parse(&script);
    let ctl = ControlSocket::from_env().unwrap();
    let (msg, mut fds) = ctl.recv(LONG).unwrap();
    let side = match msg {
        Msg::Region {
            role: RegionRole::Link { side, .. },
            ..
        } => side,
        m => panic!("expected a link region, got {m:?}"),
    };
    assert_eq!(fds.len(), 1);
    let region = Arc::new(Region::open(fds.pop().unwrap(), Access::ReadWrite).unwrap());
    let slice: u64 = std::env::var("K3_TEST_SLICE_MS").unwrap().parse().unwrap();
    let tuning = RingConfig {
        slice: Duration::from_millis(slice),
        ..Default::default()
    };
    // Watch the parent through the control socket: it hangs up when the parent exits.
    let mut t = ShmTransport::attach(region, side, ctl.hangup_watch().unwrap(), tuning).unwrap();
    let signalled = || ctl.recv_frame(Some(Duration::ZERO)).is_ok();
    run_peer(&mut t, script, &signalled, &|| false);
}

// --- the suite

fn cfg_small() -> RingConfig {
    // 8 slots of 64 bytes: max message 504 bytes, frames of <= 56 payload bytes take 1 slot.
    RingConfig::new(8, 64)
}

/// Ordering and wrap-around: 3000 frames of 0..300 bytes (1..5 slots each) through an 8-slot
/// ring, echoed back, pipelined so that frames straddle the end of the slot array.
/// Catches: a ring that drops or duplicates a frame, mis-copies a frame that wraps, or
/// returns frames out of order.
fn check_order_and_wrap(h: &dyn Harness) {
    let (mut t, mut peer) = h.start(Script::Echo, cfg_small());
    let n = 3000u32;
    let size = |i: u32| ((i as usize * 37) % 301).max(4);
    let (mut sent, mut got) = (0u32, 0u32);
    while got < n {
        if sent < n {
            match t.send_bytes(&numbered(sent, size(sent)), Some(Duration::ZERO)) {
                Ok(()) => {
                    sent += 1;
                    continue;
                }
                Err(TransportError::Timeout) => {}
                Err(e) => panic!("{}: send {sent}: {e}", h.name()),
            }
        }
        let f = t
            .recv_bytes(LONG)
            .unwrap_or_else(|e| panic!("{}: recv {got}: {e}", h.name()));
        assert_eq!(f, numbered(got, size(got)), "{}: frame {got}", h.name());
        got += 1;
    }
    t.send_bytes(QUIT, LONG).unwrap();
    // After QUIT the peer drops its end cleanly.
    assert_eq!(
        t.recv_bytes(LONG),
        Err(TransportError::Closed),
        "{}",
        h.name()
    );
    peer.finish();
}

/// Back-pressure: with the peer not reading, exactly `slots` one-slot frames fit; the next
/// send times out having sent nothing; once the peer drains, all arrive in order and sending
/// works again. Catches: a ring that overwrites unread slots, one that wastes a slot
/// (full/empty ambiguity, capacity slots-1), and a send that half-writes on timeout.
fn check_back_pressure(h: &dyn Harness) {
    let cfg = cfg_small();
    let (mut t, mut peer) = h.start(Script::StallThenEcho, cfg);
    let mut k = 0u32;
    loop {
        match t.send_bytes(&numbered(k, 40), Some(Duration::from_millis(30))) {
            Ok(()) => k += 1,
            Err(TransportError::Timeout) => break,
            Err(e) => panic!("{}: {e}", h.name()),
        }
        assert!(
            k <= cfg.slots,
            "{}: more frames accepted than slots",
            h.name()
        );
    }
    assert_eq!(
        k,
        cfg.slots,
        "{}: one-slot frames accepted before the ring was full",
        h.name()
    );
    // A bigger frame cannot squeeze in either.
    assert_eq!(
        t.send_bytes(&numbered(99, 200), Some(Duration::ZERO)),
        Err(TransportError::Timeout)
    );
    peer.signal();
    for i in 0..k {
        assert_eq!(
            t.recv_bytes(LONG).unwrap(),
            numbered(i, 40),
            "{}: frame {i}",
            h.name()
        );
    }
    t.send_bytes(&numbered(k, 40), LONG).unwrap();
    assert_eq!(t.recv_bytes(LONG).unwrap(), numbered(k, 40));
    t.send_bytes(QUIT, LONG).unwrap();
    peer.finish();
}

/// Large messages: frames spanning several slots, the largest possible frame (the whole
/// ring), a frame that wraps, and one byte over the limit refused with `TooLarge`.
/// Catches: a ring that only carries one slot per message, truncates multi-slot frames, or
/// accepts a frame that cannot fit (and then deadlocks or corrupts).
fn check_large(h: &dyn Harness) {
    let cfg = cfg_small();
    let max = cfg.max_message();
    assert_eq!(max, 8 * 64 - 8);
    let (mut t, mut peer) = h.start(Script::Echo, cfg);
    assert_eq!(t.max_message(), max, "{}", h.name());
    for (i, len) in [100usize, max, 57, 250, max, 0, 56].into_iter().enumerate() {
        let f = numbered(i as u32, len);
        t.send_bytes(&f, LONG).unwrap();
        assert_eq!(
            t.recv_bytes(LONG).unwrap(),
            f,
            "{}: frame of {len} bytes",
            h.name()
        );
    }
    assert_eq!(
        t.send_bytes(&vec![1u8; max + 1], LONG),
        Err(TransportError::TooLarge { len: max + 1, max }),
        "{}",
        h.name()
    );
    // Typed messages travel the same way.
    let m = Msg::Experts {
        pass: 3,
        layer: 17,
        ids: (0..16).map(|i| i * 55).collect(),
    };
    t.send(&m, LONG).unwrap();
    assert_eq!(t.recv(LONG).unwrap(), m);
    t.send_bytes(QUIT, LONG).unwrap();
    peer.finish();
}

/// Timeout: nothing arrives, `recv` says `Timeout` (not `Closed`/`PeerDied`, not a hang).
fn check_timeout(h: &dyn Harness) {
    let (mut t, mut peer) = h.start(Script::Idle, cfg_small());
    assert_eq!(
        t.recv_bytes(Some(Duration::from_millis(50))),
        Err(TransportError::Timeout),
        "{}",
        h.name()
    );
    assert_eq!(
        t.recv_bytes(Some(Duration::ZERO)),
        Err(TransportError::Timeout),
        "{}",
        h.name()
    );
    assert!(!t.peer_dead(), "{}", h.name());
    peer.kill();
    peer.finish();
}

/// Peer death while we wait to receive: `PeerDied` well inside 5 s (the 5 s timeout would
/// turn a missed death into `Timeout` and fail). Catches: a wait that only watches the
/// doorbell and sleeps until its timeout (or forever) when the peer is SIGKILLed.
fn check_death_recv(h: &dyn Harness) {
    let (mut t, mut peer) = h.start(Script::Idle, cfg_small());
    // Make sure the peer is up and idle before killing it.
    assert_eq!(
        t.recv_bytes(Some(Duration::from_millis(20))),
        Err(TransportError::Timeout)
    );
    peer.kill();
    match t.recv_bytes(Some(Duration::from_secs(5))) {
        Err(TransportError::PeerDied(_)) => {}
        r => panic!("{}: recv after the peer was killed: {r:?}", h.name()),
    }
    peer.finish();
}

/// Peer death while we are blocked sending into a full ring.
/// Catches: a sender that waits for space forever when the consumer is gone.
fn check_death_send(h: &dyn Harness) {
    let (mut t, mut peer) = h.start(Script::StallThenEcho, cfg_small());
    while t
        .send_bytes(&[7u8; 40], Some(Duration::from_millis(20)))
        .is_ok()
    {}
    peer.kill();
    match t.send_bytes(&[7u8; 40], Some(Duration::from_secs(5))) {
        Err(TransportError::PeerDied(_)) => {}
        r => panic!("{}: send after the peer was killed: {r:?}", h.name()),
    }
    peer.finish();
}

/// Clean close: frames sent before the peer dropped its end are all delivered, then
/// `Closed`. Catches: an implementation that reports the close before draining, or reports a
/// clean close as a death.
fn check_close(h: &dyn Harness) {
    let (mut t, mut peer) = h.start(Script::SendThenClose, cfg_small());
    peer.finish(); // the peer has sent everything and dropped its end (or exited)
    for i in 0..SEND_CLOSE_N {
        assert_eq!(
            t.recv_bytes(LONG).unwrap(),
            numbered(i, 40 + i as usize * 3),
            "{}",
            h.name()
        );
    }
    match t.recv_bytes(LONG) {
        Err(TransportError::Closed) => {}
        // A process peer exits right after closing: either answer is a clean end, but the
        // shm end's state word says closed before the process is gone.
        r => panic!("{}: after the last frame: {r:?}", h.name()),
    }
}

/// Peer killed at an arbitrary moment in a busy two-way stream (5 different moments):
/// every frame that arrives is intact and in order, and the stream ends with `PeerDied`
/// (never `Corrupt`, never a hang or `Timeout`). Catches: publishing `head` before the frame
/// is fully written (a torn frame after a kill), and death checks that only run when idle.
fn check_death_midstream(h: &dyn Harness) {
    for round in 0..5u32 {
        let (mut t, mut peer) = h.start(Script::Echo, cfg_small());
        let kill_after = 50 + round * 173;
        let size = |i: u32| ((i as usize * 53) % 200).max(4);
        let (mut sent, mut got) = (0u32, 0u32);
        let end = loop {
            if got == kill_after {
                peer.kill();
            }
            match t.send_bytes(&numbered(sent, size(sent)), Some(Duration::ZERO)) {
                Ok(()) => {
                    sent += 1;
                    continue;
                }
                Err(TransportError::Timeout) => {}
                Err(e) => break e,
            }
            match t.recv_bytes(Some(Duration::from_secs(5))) {
                Ok(f) => {
                    assert_eq!(f, numbered(got, size(got)), "{}: frame {got}", h.name());
                    got += 1;
                }
                Err(e) => break e,
            }
        };
        assert!(
            matches!(end, TransportError::PeerDied(_)),
            "{}: round {round}: stream ended with {end:?} after {got} frames",
            h.name()
        );
        assert!(got >= kill_after);
        peer.finish();
    }
}

fn suite(h: &dyn Harness) {
    check_order_and_wrap(h);
    check_back_pressure(h);
    check_large(h);
    check_timeout(h);
    check_death_recv(h);
    check_death_send(h);
    check_close(h);
    check_death_midstream(h);
}

#[test]
fn conformance_inproc() {
    if std::env::var(PEER_ENV).is_ok() {
        return;
    }
    suite(&InProc);
}

#[test]
fn conformance_shm_threads() {
    if std::env::var(PEER_ENV).is_ok() {
        return;
    }
    suite(&ShmThreads);
}

#[test]
fn conformance_shm_processes() {
    if std::env::var(PEER_ENV).is_ok() {
        return;
    }
    suite(&ShmProcesses);
}

/// The control socket carries fds across a real process boundary: covered by every
/// `ShmProcesses` check (the link region travels that way); here also the hang-up watch.
#[test]
fn control_hangup_is_peer_death() {
    if std::env::var(PEER_ENV).is_ok() {
        return;
    }
    let (a, b) = control::pair().unwrap();
    let w = a.hangup_watch().unwrap();
    assert!(!w.is_dead());
    drop(b);
    assert!(w.is_dead());
    let _ = a.fd().as_fd();
}
