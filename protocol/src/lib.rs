//! `k3-protocol`: only what crosses a process boundary; the one place stages agree.
//!
//! - [`shm`]: memfd regions, handles `{region, offset, len, generation}` and region tables.
//! - [`ring`]: the cross-process single-producer single-consumer ring and its doorbell.
//! - [`transport`]: a duplex link of two rings ([`transport::ShmTransport`]) or channels.
//! - [`messages`]: every message a stage sends or receives.
//! - [`control`]: the control socket between k3-orch and a stage (frames + fd passing).
//! - [`failure`]: a stage's failure as the orchestrator sees it ([`failure::StageFailure`],
//!   matched by [`failure::FailureKind`], never by its text).
//! - [`record`]: recordings for `--record` and `k3-orch replay`.
//! - [`routes`]: route traces (`--record-routes`): every token's routed experts per layer.
//! - [`conf`]: typed stage configuration (each stage's `Configure` payload, region ids).
//! - [`link`]: the stage context ([`link::StageCtx`]): hello, heartbeat, links to peers,
//!   data regions, `Configure`, recording; what every stage's `stage::run` starts from.
//!
//! The checkpoint itself (config, catalog, tensor names, packed trunk) is `k3-model`; disk
//! reads and aligned memory are `k3-io`.

pub mod conf;
pub mod control;
pub mod failure;
pub mod link;
pub mod messages;
pub mod record;
pub mod ring;
pub mod routes;
pub mod shm;
pub mod transport;
