//! Benchmark: message round-trip latency and one-way throughput of the transports — the
//! shared-memory ring across two processes, the same ring between two threads, the
//! in-process transport, and a plain `std::sync::mpsc` pair for reference. Prints a table.
//!
//! Run: `cargo run --release -p k3-protocol --example ring_bench [-- --quick]`
//! (`K3_RING_SPIN=N` overrides the busy-poll count before sleeping on the futex).

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k3_protocol::control::{self, ChildOptions, ControlSocket};
use k3_protocol::messages::{Msg, RegionRole, Stage};
use k3_protocol::ring::{PeerWatch, RingConfig};
use k3_protocol::shm::{Access, Handle, Region};
use k3_protocol::transport::{InProcTransport, ShmTransport, Side, Transport, TransportError};

const PEER_ENV: &str = "K3_RING_BENCH_PEER";
const T: Option<Duration> = Some(Duration::from_secs(60));
const STOP: &[u8] = b"\0stop";
const FETCHER: &[u8] = b"\0fetcher";

fn tuning() -> RingConfig {
    let mut c = RingConfig::new(1024, 256);
    if let Some(s) = std::env::var("K3_RING_SPIN")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        c.spin = s;
    }
    if let Some(s) = std::env::var("K3_RING_YIELDS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        c.yields = s;
    }
    c
}

/// Peer loop: frames starting with b'E' are echoed, others counted; STOP ends the phase with
/// an acknowledgement carrying the count.
fn serve(t: &mut dyn Transport) {
    let mut count: u64 = 0;
    loop {
        match t.recv_bytes(T) {
            Ok(f) if f == STOP => {
                t.send_bytes(&count.to_le_bytes(), T).unwrap();
                count = 0;
            }
            Ok(f) if f == FETCHER => fetcher(t),
            Ok(f) if f.first() == Some(&b'E') => t.send_bytes(&f, T).unwrap(),
            Ok(_) => count += 1,
            Err(TransportError::Closed) => return,
            Err(e) => panic!("bench peer: {e}"),
        }
    }
}

/// Play expert-fetcher: answer each `Experts` with one `ExpertReady` per id and an
/// `ExpertBatchDone`, until `Shutdown`.
fn fetcher(t: &mut dyn Transport) {
    loop {
        match t.recv(T).unwrap() {
            Msg::Experts {
                pass, layer, ids, ..
            } => {
                for (i, id) in ids.iter().enumerate() {
                    let handle = Handle {
                        region: 9,
                        offset: i as u64 * 17_547_264,
                        len: 17_547_264,
                        generation: 1,
                    };
                    t.send(
                        &Msg::ExpertReady {
                            pass,
                            layer,
                            id: *id,
                            handle,
                        },
                        T,
                    )
                    .unwrap();
                }
                let done = Msg::ExpertBatchDone {
                    pass,
                    layer,
                    requests: ids.len() as u64,
                    resident_hits: 0,
                    failed: 0,
                    read_bytes: 0,
                    io_seconds: 0.0,
                };
                t.send(&done, T).unwrap();
            }
            Msg::Shutdown => return,
            m => panic!("fetcher: unexpected {m:?}"),
        }
    }
}

/// Microseconds per simulated layer exchange: `Experts{16 ids}` out, 17 typed replies in.
fn layer_exchange(t: &mut dyn Transport, layers: usize) -> f64 {
    t.send_bytes(FETCHER, T).unwrap();
    let t0 = Instant::now();
    for l in 0..layers {
        let ids: Vec<u32> = (0..16).map(|i| (i * 56 + l as u32) % 896).collect();
        let m = Msg::Experts {
            pass: 1,
            layer: l as u32,
            ids,
        };
        t.send(&m, T).unwrap();
        for _ in 0..17 {
            t.recv(T).unwrap();
        }
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / layers as f64;
    t.send(&Msg::Shutdown, T).unwrap();
    us
}

struct Stats {
    rtt_mean_us: f64,
    rtt_p50_us: f64,
    rtt_p99_us: f64,
    thr: Vec<(usize, f64, f64)>, // (size, msgs/s, MB/s)
    layer_us: f64,
}

fn measure(t: &mut dyn Transport, rtt_iters: usize, stream_bytes: usize, sizes: &[usize]) -> Stats {
    let ping = {
        let mut v = vec![0u8; 64];
        v[0] = b'E';
        v
    };
    for _ in 0..rtt_iters / 10 {
        t.send_bytes(&ping, T).unwrap();
        t.recv_bytes(T).unwrap();
    }
    let mut lat = Vec::with_capacity(rtt_iters);
    let start = Instant::now();
    for _ in 0..rtt_iters {
        let t0 = Instant::now();
        t.send_bytes(&ping, T).unwrap();
        let r = t.recv_bytes(T).unwrap();
        lat.push(t0.elapsed().as_nanos() as f64 / 1000.0);
        assert_eq!(r.len(), 64);
    }
    let mean = start.elapsed().as_nanos() as f64 / 1000.0 / rtt_iters as f64;
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mut thr = Vec::new();
    for &size in sizes {
        let n = (stream_bytes / size).clamp(1000, 2_000_000);
        let msg = vec![b'D'; size];
        let t0 = Instant::now();
        for _ in 0..n {
            t.send_bytes(&msg, T).unwrap();
        }
        t.send_bytes(STOP, T).unwrap();
        let ack = t.recv_bytes(T).unwrap();
        let dt = t0.elapsed().as_secs_f64();
        assert_eq!(u64::from_le_bytes(ack[..8].try_into().unwrap()), n as u64);
        thr.push((size, n as f64 / dt, (n * size) as f64 / dt / 1e6));
    }
    let layer_us = layer_exchange(t, rtt_iters / 4);
    Stats {
        layer_us,
        rtt_mean_us: mean,
        rtt_p50_us: lat[lat.len() / 2],
        rtt_p99_us: lat[lat.len() * 99 / 100],
        thr,
    }
}

/// `std::sync::mpsc` wrapped as a Transport, as the reference in-process channel.
struct Mpsc {
    tx: mpsc::SyncSender<Vec<u8>>,
    rx: mpsc::Receiver<Vec<u8>>,
}
impl Transport for Mpsc {
    fn send_bytes(&mut self, f: &[u8], _t: Option<Duration>) -> Result<(), TransportError> {
        self.tx.send(f.to_vec()).map_err(|_| TransportError::Closed)
    }
    fn recv_bytes(&mut self, t: Option<Duration>) -> Result<Vec<u8>, TransportError> {
        self.rx
            .recv_timeout(t.unwrap_or(Duration::from_secs(3600)))
            .map_err(|e| match e {
                mpsc::RecvTimeoutError::Timeout => TransportError::Timeout,
                mpsc::RecvTimeoutError::Disconnected => TransportError::Closed,
            })
    }
    fn max_message(&self) -> usize {
        usize::MAX
    }
    fn peer_dead(&self) -> bool {
        false
    }
}

fn peer_main() {
    let ctl = ControlSocket::from_env().unwrap();
    let (m, mut fds) = ctl.recv(T).unwrap();
    assert!(matches!(m, Msg::Region { .. }));
    let region = Arc::new(Region::open(fds.pop().unwrap(), Access::ReadWrite).unwrap());
    let mut t =
        ShmTransport::attach(region, Side::B, ctl.hangup_watch().unwrap(), tuning()).unwrap();
    serve(&mut t);
}

fn main() {
    if std::env::var(PEER_ENV).is_ok() {
        peer_main();
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let (rtt_iters, stream_bytes) = if quick {
        (2000, 16 << 20)
    } else {
        (20_000, 256 << 20)
    };
    let sizes = [64usize, 1024, 16 * 1024];
    let cfg = tuning();
    let mut rows: Vec<(&str, Stats)> = Vec::new();

    // Shared-memory ring, two processes.
    {
        let (ours, theirs) = control::pair().unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.env(PEER_ENV, "1").stdin(Stdio::null());
        control::prepare_child(
            &mut cmd,
            &theirs,
            ChildOptions {
                kill_on_parent_death: true,
            },
        );
        let mut child = cmd.spawn().unwrap();
        drop(theirs);
        let region = Arc::new(ShmTransport::create_region(1, "bench", &cfg).unwrap());
        let role = RegionRole::Link {
            peer: Stage::Orchestrator,
            side: Side::B,
            peer_pid: std::process::id(),
        };
        ours.send(&Msg::Region { id: 1, role }, &[region.fd()])
            .unwrap();
        let mut t = ShmTransport::attach(
            region,
            Side::A,
            PeerWatch::pid(child.id() as i32).unwrap(),
            cfg,
        )
        .unwrap();
        rows.push((
            "shm ring, 2 processes",
            measure(&mut t, rtt_iters, stream_bytes, &sizes),
        ));
        drop(t);
        child.wait().unwrap();
    }
    // Shared-memory ring, two threads.
    {
        let region = Arc::new(ShmTransport::create_region(2, "bench", &cfg).unwrap());
        let mut a = ShmTransport::attach(region.clone(), Side::A, PeerWatch::None, cfg).unwrap();
        let mut b = ShmTransport::attach(region, Side::B, PeerWatch::None, cfg).unwrap();
        let j = std::thread::spawn(move || serve(&mut b));
        rows.push((
            "shm ring, 2 threads",
            measure(&mut a, rtt_iters, stream_bytes, &sizes),
        ));
        drop(a);
        j.join().unwrap();
    }
    // In-process transport (mutex + condvar, same slot accounting).
    {
        let (mut a, mut b) = InProcTransport::pair(cfg).unwrap();
        let j = std::thread::spawn(move || serve(&mut b));
        rows.push((
            "InProcTransport, 2 threads",
            measure(&mut a, rtt_iters, stream_bytes, &sizes),
        ));
        drop(a);
        j.join().unwrap();
    }
    // std mpsc reference.
    {
        let (tx1, rx1) = mpsc::sync_channel(1024);
        let (tx2, rx2) = mpsc::sync_channel(1024);
        let mut a = Mpsc { tx: tx1, rx: rx2 };
        let mut b = Mpsc { tx: tx2, rx: rx1 };
        let j = std::thread::spawn(move || serve(&mut b));
        rows.push((
            "std mpsc, 2 threads",
            measure(&mut a, rtt_iters, stream_bytes, &sizes),
        ));
        drop(a);
        j.join().unwrap();
    }

    println!(
        "ring: {} slots x {} B, spin {}, yields {}, {} round trips of 64 B, {} MiB streamed per size; {} CPUs",
        cfg.slots,
        cfg.slot_size,
        cfg.spin,
        cfg.yields,
        rtt_iters,
        stream_bytes >> 20,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    print!(
        "{:<28} {:>9} {:>9} {:>9}",
        "transport", "rtt mean", "rtt p50", "rtt p99"
    );
    for s in sizes {
        print!(" {:>20}", format!("{} B msgs/s (MB/s)", s));
    }
    println!(" {:>12}", "layer xchg");
    for (name, s) in &rows {
        print!(
            "{:<28} {:>7.2}us {:>7.2}us {:>7.2}us",
            name, s.rtt_mean_us, s.rtt_p50_us, s.rtt_p99_us
        );
        for (_, mps, mbs) in &s.thr {
            print!(" {:>20}", format!("{:.0} ({:.0})", mps, mbs));
        }
        println!(" {:>10.1}us", s.layer_us);
    }
}
