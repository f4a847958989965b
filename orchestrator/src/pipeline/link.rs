//! The stage side of the control protocol, shared by every stage role.
//!
//! A stage says `Hello`, then receives (in any order) the links to its peers (two-ring
//! shared-memory regions), read-only data regions owned by other stages, and its
//! `Configure` JSON. The orchestrator's `Ready` is the signal to start serving. A heartbeat
//! thread answers for the stage while it works, so a stage that is stopped (SIGSTOP, a
//! deadlock in the kernel) is noticed by the orchestrator even when it has nothing to say.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k3_protocol::control::ControlSocket;
use k3_protocol::messages::{Msg, RegionRole, Stage, PROTOCOL_VERSION};
use k3_protocol::ring::{PeerWatch, RingConfig};
use k3_protocol::shm::{Access, Region, RegionTable};
use k3_protocol::transport::{ShmTransport, Transport};

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
}

impl Drop for StageCtx {
    fn drop(&mut self) {
        self.heartbeat_stop.store(true, Ordering::Relaxed);
    }
}

impl StageCtx {
    /// Say hello and start the heartbeat.
    pub fn connect(stage: Stage, control: ControlSocket) -> Result<StageCtx, String> {
        let control = Arc::new(control);
        control
            .send(
                &Msg::Hello {
                    stage,
                    pid: std::process::id(),
                    version: PROTOCOL_VERSION,
                },
                &[],
            )
            .map_err(|e| format!("{stage}: hello: {e}"))?;
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
            .map_err(|e| format!("{stage}: heartbeat thread: {e}"))?;
        Ok(StageCtx {
            stage,
            control,
            links: HashMap::new(),
            regions: RegionTable::new(),
            data: HashMap::new(),
            conf_json: String::new(),
            heartbeat_stop: stop,
        })
    }

    /// Receive control messages until `until` says stop (it sees every message that is not a
    /// link or data region, which are handled here).
    pub fn serve_control(
        &mut self,
        mut until: impl FnMut(&mut Self, Msg) -> Result<bool, String>,
    ) -> Result<(), String> {
        loop {
            let (msg, mut fds) = self
                .control
                .recv(None)
                .map_err(|e| format!("{}: control: {e}", self.stage))?;
            match msg {
                Msg::Region { id, role } => {
                    let fd: OwnedFd = fds.pop().ok_or_else(|| {
                        format!("{}: region {id} arrived without its fd", self.stage)
                    })?;
                    self.add_region(id, role, fd)?;
                }
                Msg::Shutdown => return Err(format!("{}: shut down before start", self.stage)),
                other => {
                    if until(self, other)? {
                        return Ok(());
                    }
                }
            }
        }
    }

    fn add_region(&mut self, id: u32, role: RegionRole, fd: OwnedFd) -> Result<(), String> {
        match role {
            RegionRole::Link {
                peer,
                side,
                peer_pid,
            } => {
                let region = Region::open(fd, Access::ReadWrite)
                    .map_err(|e| format!("{}: link to {peer}: {e}", self.stage))?;
                let watch = if peer_pid > 0 {
                    PeerWatch::pid(peer_pid as i32).map_err(|e| {
                        format!("{}: watching {peer} (pid {peer_pid}): {e}", self.stage)
                    })?
                } else {
                    PeerWatch::None
                };
                let t = ShmTransport::attach(Arc::new(region), side, watch, link_ring())
                    .map_err(|e| format!("{}: link to {peer}: {e}", self.stage))?;
                self.links.insert(peer, t);
            }
            RegionRole::Data { name } => {
                let region = Region::open(fd, Access::ReadOnly)
                    .map_err(|e| format!("{}: data region {name}: {e}", self.stage))?;
                let rid = region.id();
                if rid != id {
                    return Err(format!(
                        "{}: data region {name} announced as {id} but its header says {rid}",
                        self.stage
                    ));
                }
                self.regions
                    .insert(Arc::new(region))
                    .map_err(|e| format!("{}: data region {name}: {e}", self.stage))?;
                self.data.insert(name, id);
            }
        }
        Ok(())
    }

    /// Phase 1: links and `Configure`.
    pub fn wait_configure(&mut self) -> Result<(), String> {
        self.serve_control(|ctx, m| match m {
            Msg::Configure { json } => {
                ctx.conf_json = json;
                Ok(true)
            }
            other => Err(format!(
                "{}: unexpected {other:?} before Configure",
                ctx.stage
            )),
        })
    }

    /// Phase 2 (after the stage set itself up and said `Ready`): data regions, then go.
    pub fn wait_go(&mut self) -> Result<(), String> {
        self.serve_control(|ctx, m| match m {
            Msg::Ready {
                stage: Stage::Orchestrator,
            } => Ok(true),
            other => Err(format!("{}: unexpected {other:?} before start", ctx.stage)),
        })
    }

    /// Tell the orchestrator this stage is set up.
    pub fn ready(&self) -> Result<(), String> {
        self.send_control(&Msg::Ready { stage: self.stage })
    }

    /// Send a message to the orchestrator.
    pub fn send_control(&self, m: &Msg) -> Result<(), String> {
        self.control
            .send(m, &[])
            .map_err(|e| format!("{}: control: {e}", self.stage))
    }

    /// Hand a region this stage owns to the orchestrator (which passes it on).
    pub fn share_region(&self, region: &Region, name: &str) -> Result<(), String> {
        self.control
            .send(
                &Msg::Region {
                    id: region.id(),
                    role: RegionRole::Data { name: name.into() },
                },
                &[region.fd()],
            )
            .map_err(|e| format!("{}: sharing region {name}: {e}", self.stage))
    }

    /// Take the link to `peer` out of the context.
    pub fn take_link(&mut self, peer: Stage) -> Result<ShmTransport, String> {
        self.links
            .remove(&peer)
            .ok_or_else(|| format!("{}: no link to {peer} was configured", self.stage))
    }

    /// Report a fatal error to the orchestrator (best effort) and return it.
    pub fn fail(&self, msg: String) -> String {
        let _ = self.control.send(
            &Msg::Error {
                stage: self.stage,
                msg: msg.clone(),
            },
            &[],
        );
        msg
    }
}

/// Receive on a link, turning a timeout into a message that names the silent peer.
pub fn recv_from(
    link: &mut ShmTransport,
    me: Stage,
    peer: Stage,
    timeout: Option<Duration>,
) -> Result<Msg, String> {
    link.recv(timeout).map_err(|e| match e {
        k3_protocol::transport::TransportError::Timeout => format!(
            "{me}: {peer} stopped answering (nothing for {:.0} s)",
            timeout.map(|t| t.as_secs_f64()).unwrap_or(0.0)
        ),
        other => format!("{me}: link to {peer}: {other}"),
    })
}

/// Send on a link with an error that names the peer.
pub fn send_to(
    link: &mut ShmTransport,
    me: Stage,
    peer: Stage,
    m: &Msg,
    timeout: Option<Duration>,
) -> Result<(), String> {
    link.send(m, timeout)
        .map_err(|e| format!("{me}: sending to {peer}: {e}"))
}
