//! The connections of `k3-orch serve`: its accept loop on hyper, with the limits that keep
//! hostile or idle clients from holding the server (issue 36, hostile 2).
//!
//! - **Header timeout** (`--header-timeout`): a connection must deliver a complete request
//!   head within it, counted from when the connection opened or its previous response
//!   ended; so it is the keep-alive idle timeout too. A slowloris client that trickles a
//!   head, or a socket that never sends one, is closed then.
//! - **Body timeout** (`--body-timeout`) and **body size** (`--max-body-bytes`): enforced
//!   by [`super::http`]'s guard, which answers 413 from the declared `Content-Length`
//!   before reading a byte of the body.
//! - **Connection cap** (`--max-connections`): at the cap, a new connection evicts the
//!   oldest one that has no request in a handler (idle keep-alive sockets, heads still
//!   arriving); when every connection is running a request, the new one is answered 503
//!   with `Retry-After: 1` (an OpenAI error object) and closed.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::Router;
use hyper::body::{Frame, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tower::ServiceExt as _;

/// The connection limits `serve` enforces (its flags).
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Connections held open at once.
    pub max_connections: usize,
    /// Time to a complete request head (from the connection's start or its previous
    /// response's end).
    pub header_timeout: Duration,
    /// Time to the whole request body once its head is in.
    pub body_timeout: Duration,
    /// Largest request body, in bytes.
    pub max_body: usize,
}

/// A connection's `busy` value once it has been chosen for eviction.
const EVICTED: usize = usize::MAX;

/// One open connection: how many requests it has in handlers (or [`EVICTED`]), and the
/// signal that closes it.
struct Conn {
    id: u64,
    busy: AtomicUsize,
    evict: Notify,
}

impl Conn {
    /// Marks a request as running; `None` once the connection was evicted.
    fn begin(self: &Arc<Conn>) -> Option<Busy> {
        let mut b = self.busy.load(Ordering::SeqCst);
        loop {
            if b == EVICTED {
                return None;
            }
            match self
                .busy
                .compare_exchange(b, b + 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Some(Busy(self.clone())),
                Err(now) => b = now,
            }
        }
    }

    /// Takes an idle connection for eviction; false when it runs a request.
    fn try_evict(&self) -> bool {
        self.busy
            .compare_exchange(0, EVICTED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }
}

/// A request in a handler, until its response body is done or dropped.
struct Busy(Arc<Conn>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its connection marked busy until it ends.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The open connections, oldest first.
#[derive(Default)]
struct Table {
    conns: Mutex<Vec<Arc<Conn>>>,
    next: AtomicU64,
    /// Refusals being written (bounded by the cap too).
    refusing: AtomicUsize,
    /// Signalled whenever a connection ends (shutdown waits for the table to empty).
    ended: Notify,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Conn>>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Room for one more connection: the new connection's entry, or `None` when every
    /// held connection runs a request (after evicting the oldest idle one at the cap).
    fn admit(&self, cap: usize) -> Option<Arc<Conn>> {
        let mut conns = self.lock();
        if conns.len() >= cap {
            let victim = conns.iter().position(|c| c.try_evict())?;
            let c = conns.remove(victim);
            c.evict.notify_one();
        }
        let c = Arc::new(Conn {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            busy: AtomicUsize::new(0),
            evict: Notify::new(),
        });
        conns.push(c.clone());
        Some(c)
    }

    fn remove(&self, id: u64) {
        self.lock().retain(|c| c.id != id);
        self.ended.notify_waiters();
    }

    fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

/// Serves `router` on `listener` until `shutdown` resolves; then stops accepting, lets every
/// connection finish the request it runs (idle ones close at once), and returns when all
/// are closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let table = Arc::new(Table::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of file descriptors (or another transient error): wait for
                    // connections to end instead of spinning.
                    tracing::warn!("k3-orch serve: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        match table.admit(limits.max_connections) {
            Some(c) => {
                let task = serve_one(
                    stream,
                    router.clone(),
                    limits,
                    c,
                    table.clone(),
                    stop_rx.clone(),
                );
                tokio::spawn(task);
            }
            None => refuse(stream, &table, limits.max_connections),
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    loop {
        let ended = table.ended.notified();
        if table.is_empty() {
            break;
        }
        ended.await;
    }
}

/// One connection's task: hyper's HTTP/1 on it, until it ends, is evicted (dropped: the
/// socket closes) or the server shuts down (graceful: the request it runs finishes).
async fn serve_one(
    stream: TcpStream,
    router: Router,
    limits: ConnLimits,
    conn: Arc<Conn>,
    table: Arc<Table>,
    mut stop: watch::Receiver<bool>,
) {
    let id = conn.id;
    let c = conn.clone();
    let svc =
        hyper::service::service_fn(move |req: axum::extract::Request<hyper::body::Incoming>| {
            let router = router.clone();
            let busy = c.begin();
            async move {
                let Some(busy) = busy else {
                    // Evicted between its head and here: it is being closed.
                    return Ok::<_, Infallible>(super::http::refusal_response());
                };
                let resp = match router.oneshot(req).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                };
                Ok(resp.map(|inner| Body::new(Tracked { inner, _busy: busy })))
            }
        });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true)
        .max_buf_size(256 * 1024)
        .max_headers(super::http::MAX_HEADERS * 2);
    let http = builder.serve_connection(TokioIo::new(stream), svc);
    let mut http = std::pin::pin!(http);
    let stopping = tokio::select! {
        _ = http.as_mut() => false,
        _ = conn.evict.notified() => false,
        _ = stop.wait_for(|s| *s) => true,
    };
    if stopping {
        http.as_mut().graceful_shutdown();
        let _ = http.as_mut().await;
    }
    table.remove(id);
}

/// Answers a connection beyond the cap with a 503 (Retry-After: 1) and closes it; a flood
/// beyond twice the cap is closed without an answer.
fn refuse(stream: TcpStream, table: &Arc<Table>, cap: usize) {
    if table.refusing.fetch_add(1, Ordering::SeqCst) >= cap {
        table.refusing.fetch_sub(1, Ordering::SeqCst);
        return;
    }
    let table = table.clone();
    tokio::spawn(async move {
        let second = Duration::from_secs(1);
        if let Ok(Ok(())) = tokio::time::timeout(second, write_all(&stream)).await {
            let _ = rustix::net::shutdown(&stream, rustix::net::Shutdown::Write);
            // Read what the client sent (for a second) so that closing does not reset the
            // connection before it has read the answer.
            let _ = tokio::time::timeout(second, drain(&stream)).await;
        }
        table.refusing.fetch_sub(1, Ordering::SeqCst);
    });
}

/// Writes the refusal ([`super::http::refusal_bytes`]) to `stream`.
async fn write_all(stream: &TcpStream) -> std::io::Result<()> {
    let bytes = super::http::refusal_bytes();
    let mut off = 0;
    while off < bytes.len() {
        stream.writable().await?;
        match stream.try_write(&bytes[off..]) {
            Ok(n) => off += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and drops what `stream` sends until it closes.
async fn drain(stream: &TcpStream) {
    let mut sink = [0u8; 4096];
    loop {
        if stream.readable().await.is_err() {
            return;
        }
        match stream.try_read(&mut sink) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// The connection cap to use: `wanted`, lowered so that it leaves 64 file descriptors of
/// the process's limit (`ulimit -n`) for everything else.
pub fn cap_for_fd_limit(wanted: usize) -> usize {
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    match lim.current {
        Some(n) => {
            let room = usize::try_from(n).unwrap_or(usize::MAX).saturating_sub(64);
            wanted.min(room.max(1))
        }
        None => wanted,
    }
}
