//! The layer-compute stage's errors, and the [`FailureKind`] each reports to the
//! orchestrator.
//!
//! - [`PeerError`]: talking to the other stages failed (a link, the control socket, a
//!   recording, a peer's message out of turn). It keeps the protocol's typed errors, so a
//!   peer's death stays [`FailureKind::PeerDied`] naming that peer.
//! - [`ComputeError`]: anything that ends the stage: configuration, binding, the decode
//!   loop ([`crate::decode::DecodeError`]), a state file ([`crate::state::StateError`]), or a
//!   [`PeerError`].
//!
//! `impl From<ComputeError> for StageFailure` is the one place a kind is chosen; the
//! message is the error's `Display`, complete as it is.

use k3_model::catalog::CatalogError;
use k3_model::config::ConfigError;
use k3_model::tensor::WeightError;
use k3_protocol::control::ControlError;
use k3_protocol::failure::{FailureKind, StageFailure};
use k3_protocol::link::{LinkError, ProtocolError, RecError};
use k3_protocol::messages::Stage;

use crate::decode::DecodeError;
use crate::forward::ForwardError;
use crate::state::StateError;

/// What went wrong talking to the other stages.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// A link to a loader or the tokenizer (its message names both ends).
    #[error(transparent)]
    Link(#[from] LinkError),
    /// The stage's side of the control protocol (its message names the stage).
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// Receiving on the control socket failed.
    #[error("layer-compute: control: {0}")]
    Control(#[from] ControlError),
    /// The orchestrator sent a message the protocol does not allow here (`got` is its
    /// debug form).
    #[error("layer-compute: unexpected {got} {when}")]
    Unexpected { got: String, when: &'static str },
    /// A loader sent a message out of turn (`got` is its debug form).
    #[error("layer-compute: expected {want} from {peer}, got {got}")]
    OutOfTurn {
        peer: Stage,
        want: &'static str,
        got: String,
    },
    /// This stage broke its own side of the protocol (a bug).
    #[error("layer-compute: internal: {0}")]
    Internal(String),
    /// The recording (`--record`) could not be written.
    #[error("layer-compute: {0}")]
    Record(#[from] RecError),
    /// A trunk part the trunk-loader sent does not bind (seen where no forward call could
    /// return it: giving a layer back).
    #[error("layer-compute: {0}")]
    Trunk(WeightError),
}

impl PeerError {
    /// The failure kind it reports, and the peer it is about.
    pub fn kind(&self) -> (FailureKind, Option<Stage>) {
        match self {
            PeerError::Link(e) => (e.kind(), Some(e.peer)),
            PeerError::Protocol(e) => match e.kind() {
                FailureKind::PeerDied => (FailureKind::PeerDied, Some(Stage::Orchestrator)),
                k => (k, None),
            },
            PeerError::Control(ControlError::Closed) => {
                (FailureKind::PeerDied, Some(Stage::Orchestrator))
            }
            PeerError::Control(_) | PeerError::Unexpected { .. } | PeerError::Internal(_) => {
                (FailureKind::Protocol, None)
            }
            PeerError::OutOfTurn { peer, .. } => (FailureKind::Protocol, Some(*peer)),
            PeerError::Record(_) => (FailureKind::Io, None),
            PeerError::Trunk(_) => (FailureKind::Bind, Some(Stage::TrunkLoader)),
        }
    }
}

/// The compute worker pool could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot start {threads} compute threads: {source}")]
pub struct PoolError {
    pub threads: usize,
    #[source]
    pub source: rayon::ThreadPoolBuildError,
}

/// Why the layer-compute stage stopped.
#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    /// The `Configure` JSON does not parse.
    #[error("layer-compute: bad Configure: {0}")]
    Configure(#[source] serde_json::Error),
    #[error("layer-compute: {0}")]
    Pool(#[from] PoolError),
    /// A data region the stage needs was not handed over, or is not mapped.
    #[error("layer-compute: the {name} region was not handed over")]
    NoRegion { name: &'static str },
    #[error("layer-compute: region {id} ({name}) is not mapped")]
    Unmapped { id: u32, name: &'static str },
    /// The model's config.json.
    #[error("layer-compute: {0}")]
    Config(#[from] ConfigError),
    /// The checkpoint's shards (their headers).
    #[error("layer-compute: {0}")]
    Checkpoint(#[from] CatalogError),
    /// Opening the shards for the embedding rows and the lm_head chunks.
    #[error("layer-compute: {0}")]
    ModelStream(#[source] std::io::Error),
    /// Binding the model (`Model::new`) or a pass outside the decode loop.
    #[error("layer-compute: {0}")]
    Forward(#[from] ForwardError),
    /// A saved state (`--load-state`, `--save-state`).
    #[error("layer-compute: {0}")]
    State(#[from] StateError),
    /// The decode loop, for a reason of its own (a hook's error is a [`ComputeError::Peer`]).
    #[error("layer-compute: {0}")]
    Decode(DecodeError<PeerError>),
    #[error(transparent)]
    Peer(#[from] PeerError),
    /// The warm stage's slots (`ComputeConf::slots`) cannot be set up.
    #[error("layer-compute: {0}")]
    Slots(#[source] crate::batch::BadOptions),
    /// A batched pass failed as a whole (the scheduler's report of it).
    #[error("layer-compute: {0}")]
    Pass(String),
    /// `--record-routes`: a route that does not fit the format, or the file not written.
    #[error("layer-compute: --record-routes: {0}")]
    Routes(#[from] k3_protocol::routes::RoutesError),
}

impl From<DecodeError<PeerError>> for ComputeError {
    fn from(e: DecodeError<PeerError>) -> ComputeError {
        match e {
            DecodeError::Hook(p) => ComputeError::Peer(p),
            e => ComputeError::Decode(e),
        }
    }
}

impl From<LinkError> for ComputeError {
    fn from(e: LinkError) -> ComputeError {
        ComputeError::Peer(PeerError::Link(e))
    }
}

impl From<ProtocolError> for ComputeError {
    fn from(e: ProtocolError) -> ComputeError {
        ComputeError::Peer(PeerError::Protocol(e))
    }
}

impl From<ControlError> for ComputeError {
    fn from(e: ControlError) -> ComputeError {
        ComputeError::Peer(PeerError::Control(e))
    }
}

/// The kind of a forward pass's failure: a tensor that does not bind, or the pass itself.
fn forward_kind(e: &ForwardError) -> FailureKind {
    match e {
        ForwardError::Bind(_) => FailureKind::Bind,
        ForwardError::Input(_) | ForwardError::NonFinite(_) => FailureKind::Forward,
    }
}

impl ComputeError {
    /// The failure kind it reports, and the peer it is about.
    pub fn kind(&self) -> (FailureKind, Option<Stage>) {
        match self {
            ComputeError::Configure(_)
            | ComputeError::Pool(_)
            | ComputeError::Config(_)
            | ComputeError::Checkpoint(_) => (FailureKind::Config, None),
            ComputeError::NoRegion { .. } | ComputeError::Unmapped { .. } => {
                (FailureKind::Protocol, None)
            }
            ComputeError::ModelStream(_) => (FailureKind::Io, None),
            ComputeError::Forward(e) => (forward_kind(e), None),
            ComputeError::State(e) => (e.kind(), None),
            ComputeError::Decode(e) => match e {
                DecodeError::Forward { source, .. } => (forward_kind(source), None),
                DecodeError::DumpLogits { .. } => (FailureKind::Io, None),
                DecodeError::Hook(p) => p.kind(),
                DecodeError::KeptTooLong { .. }
                | DecodeError::Resume { .. }
                | DecodeError::NonFinite { .. } => (FailureKind::Forward, None),
            },
            ComputeError::Peer(p) => p.kind(),
            ComputeError::Slots(_) => (FailureKind::Config, None),
            ComputeError::Pass(_) => (FailureKind::Forward, None),
            ComputeError::Routes(_) => (FailureKind::Io, None),
        }
    }
}

impl From<ComputeError> for StageFailure {
    fn from(e: ComputeError) -> StageFailure {
        let (kind, peer) = e.kind();
        let f = StageFailure::new(kind, e.to_string());
        match peer {
            Some(p) => f.with_peer(p),
            None => f,
        }
    }
}
