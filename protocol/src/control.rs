//! The control socket between the orchestrator and one stage process.
//!
//! A Unix stream socketpair; each frame is `[len: u32 LE][nfds: u32 LE][len bytes]`, the
//! payload usually a bincode [`Msg`]. File descriptors (memfd regions, ring regions) ride with
//! a frame via SCM_RIGHTS: they are attached to the `sendmsg` that carries the frame header,
//! and the receiver collects them with the `recvmsg` that reads the header (with
//! `MSG_CMSG_CLOEXEC`), then checks it got exactly `nfds` of them.
//!
//! The child end is handed to a re-executed stage process by [`prepare_child`], which clears
//! its close-on-exec flag in the child only and names it in the `K3_CONTROL_FD` environment
//! variable; the stage picks it up with [`ControlSocket::from_env`]. The same call can arm
//! `PR_SET_PDEATHSIG` so the stage is killed if the orchestrator dies (no orphans).
//!
//! End of file on the socket means the peer closed it or died: [`ControlError::Closed`].

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};

use crate::messages::{self, Msg};
use crate::ring::PeerWatch;

/// Environment variable naming the control socket fd in a stage process.
pub const CONTROL_FD_ENV: &str = "K3_CONTROL_FD";
/// Largest control frame payload.
pub const MAX_CONTROL_FRAME: usize = 64 << 20;
/// Most fds one frame may carry.
pub const MAX_FDS: usize = 16;

/// Control-socket failures.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control socket: the peer closed the connection")]
    Closed,
    #[error("control socket: timed out")]
    Timeout,
    #[error("control socket: {op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("control socket: bad frame: {0}")]
    BadFrame(String),
    #[error("control socket: {0}")]
    Codec(#[from] messages::CodecError),
    #[error("control socket: {0}")]
    Env(String),
}

fn io(op: &'static str) -> impl FnOnce(rustix::io::Errno) -> ControlError {
    move |e| ControlError::Io {
        op,
        source: e.into(),
    }
}

/// One end of a control connection. `send*` and `recv*` may be used from different threads
/// (each direction is serialised by its own lock).
#[derive(Debug)]
pub struct ControlSocket {
    fd: OwnedFd,
    send_lock: Mutex<()>,
    recv_lock: Mutex<()>,
}

/// A connected pair (both ends close-on-exec).
pub fn pair() -> Result<(ControlSocket, ControlSocket), ControlError> {
    let (a, b) = rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(io("socketpair"))?;
    Ok((ControlSocket::from_fd(a), ControlSocket::from_fd(b)))
}

/// Options for [`prepare_child`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ChildOptions {
    /// Ask the kernel to SIGKILL the child when the thread that spawned it exits
    /// (`PR_SET_PDEATHSIG`; spawn from a long-lived thread, e.g. the main thread).
    pub kill_on_parent_death: bool,
}

/// Arrange for `child_end` to be inherited by the process `cmd` will start: its fd number goes
/// into `K3_CONTROL_FD` and its close-on-exec flag is cleared in the child only (after fork).
/// The caller keeps `child_end` alive until `spawn` returned, then drops it.
pub fn prepare_child(cmd: &mut Command, child_end: &ControlSocket, opts: ChildOptions) {
    let fd: RawFd = child_end.fd.as_raw_fd();
    cmd.env(CONTROL_FD_ENV, fd.to_string());
    let kill = opts.kill_on_parent_death;
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (fcntl, prctl, getppid, kill); it allocates nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            if kill {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) == -1
                {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect.
                if libc::getppid() as u32 != parent {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
            Ok(())
        });
    }
}

impl ControlSocket {
    /// Wrap a connected stream socket.
    pub fn from_fd(fd: OwnedFd) -> Self {
        ControlSocket {
            fd,
            send_lock: Mutex::new(()),
            recv_lock: Mutex::new(()),
        }
    }

    /// In a stage process: take the socket named by `K3_CONTROL_FD` (and make it
    /// close-on-exec again so it does not leak into our own children).
    pub fn from_env() -> Result<Self, ControlError> {
        let v = std::env::var(CONTROL_FD_ENV)
            .map_err(|_| ControlError::Env(format!("{CONTROL_FD_ENV} is not set")))?;
        let fd: RawFd = v.parse().ok().filter(|&fd| fd > 2).ok_or_else(|| {
            ControlError::Env(format!(
                "{CONTROL_FD_ENV}={v:?} is not a file descriptor number > 2"
            ))
        })?;
        // SAFETY: F_GETFD on an arbitrary number is harmless; it tells us whether it is open.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
            return Err(ControlError::Env(format!(
                "{CONTROL_FD_ENV}={fd} is not an open fd"
            )));
        }
        // SAFETY: the fd is open (checked) and was handed to this process for it alone by the
        // parent (prepare_child); nothing else in this process owns it.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let st = rustix::fs::fstat(&owned).map_err(io("fstat"))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
            return Err(ControlError::Env(format!(
                "{CONTROL_FD_ENV}={fd} is not a socket"
            )));
        }
        rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC)
            .map_err(io("fcntl(F_SETFD)"))?;
        Ok(ControlSocket::from_fd(owned))
    }

    /// The socket fd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A peer watch that fires when the other end of this socket is closed (the peer exited).
    pub fn hangup_watch(&self) -> Result<PeerWatch, ControlError> {
        Ok(PeerWatch::Hangup(self.fd.try_clone().map_err(
            |source| ControlError::Io { op: "dup", source },
        )?))
    }

    /// Encode `msg` and send it with `fds` attached.
    pub fn send(&self, msg: &Msg, fds: &[BorrowedFd<'_>]) -> Result<(), ControlError> {
        self.send_frame(&messages::encode(msg)?, fds)
    }

    /// Receive and decode one message and the fds that came with it.
    pub fn recv(&self, timeout: Option<Duration>) -> Result<(Msg, Vec<OwnedFd>), ControlError> {
        let (b, fds) = self.recv_frame(timeout)?;
        Ok((messages::decode(&b)?, fds))
    }

    /// Send one frame with `fds` attached.
    pub fn send_frame(&self, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), ControlError> {
        if payload.len() > MAX_CONTROL_FRAME {
            return Err(ControlError::BadFrame(format!(
                "{} bytes is over the {MAX_CONTROL_FRAME}-byte limit",
                payload.len()
            )));
        }
        if fds.len() > MAX_FDS {
            return Err(ControlError::BadFrame(format!(
                "{} fds (at most {MAX_FDS})",
                fds.len()
            )));
        }
        let mut hdr = [0u8; 8];
        hdr[0..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        hdr[4..8].copy_from_slice(&(fds.len() as u32).to_le_bytes());
        let _g = self.send_lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut anc = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !anc.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(ControlError::BadFrame(
                "fds do not fit the control buffer".into(),
            ));
        }
        let total = 8 + payload.len();
        let iov = [IoSlice::new(&hdr), IoSlice::new(payload)];
        let mut sent = loop {
            match rustix::net::sendmsg(&self.fd, &iov, &mut anc, SendFlags::NOSIGNAL) {
                Ok(n) => break n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::PIPE) | Err(rustix::io::Errno::CONNRESET) => {
                    return Err(ControlError::Closed)
                }
                Err(e) => return Err(io("sendmsg")(e)),
            }
        };
        // The fds went with the first chunk; send whatever the kernel did not take.
        while sent < total {
            let rest: &[u8] = if sent < 8 {
                &hdr[sent..]
            } else {
                &payload[sent - 8..]
            };
            match rustix::net::send(&self.fd, rest, SendFlags::NOSIGNAL) {
                Ok(n) => sent += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::PIPE) | Err(rustix::io::Errno::CONNRESET) => {
                    return Err(ControlError::Closed)
                }
                Err(e) => return Err(io("send")(e)),
            }
        }
        Ok(())
    }

    fn wait_readable(&self, deadline: Option<Instant>) -> Result<(), ControlError> {
        loop {
            let ts = match deadline {
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    Some(rustix::event::Timespec {
                        tv_sec: left.as_secs() as i64,
                        tv_nsec: left.subsec_nanos() as i64,
                    })
                }
            };
            let mut pfd = [PollFd::new(&self.fd, PollFlags::IN)];
            match rustix::event::poll(&mut pfd, ts.as_ref()) {
                Ok(0) => return Err(ControlError::Timeout),
                Ok(_) => return Ok(()),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(io("poll")(e)),
            }
        }
    }

    /// Receive one frame and its fds, waiting up to `timeout` for it to start.
    pub fn recv_frame(
        &self,
        timeout: Option<Duration>,
    ) -> Result<(Vec<u8>, Vec<OwnedFd>), ControlError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let _g = self.recv_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.wait_readable(deadline)?;
        let mut hdr = [0u8; 8];
        let mut got = 0usize;
        let mut fds: Vec<OwnedFd> = Vec::new();
        let mut truncated = false;
        {
            let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
            let mut anc = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(&mut hdr)];
            let r = loop {
                match rustix::net::recvmsg(&self.fd, &mut iov, &mut anc, RecvFlags::CMSG_CLOEXEC) {
                    Err(rustix::io::Errno::INTR) => continue,
                    other => break other,
                }
            };
            let r = r.map_err(io("recvmsg"))?;
            if r.bytes == 0 {
                return Err(ControlError::Closed);
            }
            got += r.bytes;
            if r.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
                truncated = true;
            }
            for m in anc.drain() {
                if let RecvAncillaryMessage::ScmRights(it) = m {
                    fds.extend(it);
                }
            }
        }
        while got < 8 {
            self.wait_readable(deadline)?;
            got += self.read_some(&mut hdr[got..])?;
        }
        let len = u32::from_le_bytes(hdr[0..4].try_into().unwrap()) as usize;
        let nfds = u32::from_le_bytes(hdr[4..8].try_into().unwrap()) as usize;
        if truncated || nfds != fds.len() {
            return Err(ControlError::BadFrame(format!(
                "frame announced {nfds} fds but {} arrived{}",
                fds.len(),
                if truncated {
                    " (control data truncated)"
                } else {
                    ""
                }
            )));
        }
        if len > MAX_CONTROL_FRAME {
            return Err(ControlError::BadFrame(format!(
                "frame length {len} over the {MAX_CONTROL_FRAME}-byte limit"
            )));
        }
        let mut payload = vec![0u8; len];
        let mut pos = 0;
        while pos < len {
            self.wait_readable(deadline)?;
            pos += self.read_some(&mut payload[pos..])?;
        }
        Ok((payload, fds))
    }

    fn read_some(&self, buf: &mut [u8]) -> Result<usize, ControlError> {
        loop {
            match rustix::net::recv(&self.fd, &mut *buf, RecvFlags::empty()) {
                Ok((0, _)) => return Err(ControlError::Closed),
                Ok((n, _)) => return Ok(n),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(io("recv")(e)),
            }
        }
    }
}
