//! How a stage's failure crosses the process boundary: [`StageFailure`], a [`FailureKind`]
//! the orchestrator matches on (exit code, which stage is to blame) and the full message it
//! prints.
//!
//! A stage that cannot go on sends `Msg::Error { stage, failure }` on its control socket
//! (see [`crate::link::StageCtx::fail`]) and exits with status 1; in-process stages return
//! the same value from their `stage::run`. Each stage crate maps its own error type onto a
//! kind (`impl From<ItsError> for StageFailure`), so no reader of a failure ever has to
//! parse its text.

use serde::{Deserialize, Serialize};

use crate::messages::Stage;

/// What kind of failure ended a stage. New kinds go at the end (the wire encoding numbers
/// them in order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FailureKind {
    /// The stage's configuration or its input files cannot be used (a bad `Configure`, a
    /// checkpoint or packed trunk that does not fit the run, a missing tokenizer).
    Config,
    /// Reading or writing a file (a recording too), or setting up memory, failed.
    Io,
    /// A tensor could not be bound (missing, wrong shape or dtype, bad handle).
    Bind,
    /// The forward pass failed.
    Forward,
    /// The expert arena could not be set up or served.
    ExpertLoad,
    /// A peer stage died or closed its end: a secondary failure, the peer's own report
    /// names the cause ([`StageFailure::peer`] names the peer).
    PeerDied,
    /// A peer stopped answering within the timeout ([`StageFailure::peer`] names it).
    Timeout,
    /// The control protocol was broken: an unexpected message, a control socket or link
    /// that failed, a message that did not decode.
    Protocol,
}

impl FailureKind {
    /// The failure is a consequence of another stage's (its report names the cause).
    pub fn is_secondary(self) -> bool {
        matches!(self, FailureKind::PeerDied)
    }
}

/// A stage's fatal failure: its kind, the peer it concerns (for [`FailureKind::PeerDied`]
/// and [`FailureKind::Timeout`]), and the complete message (printed as it is).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{detail}")]
pub struct StageFailure {
    pub kind: FailureKind,
    /// The stage at the other end of a link, when the failure is about it.
    pub peer: Option<Stage>,
    /// The message, naming the stage and what failed.
    pub detail: String,
}

impl StageFailure {
    /// A failure of `kind` with message `detail`.
    pub fn new(kind: FailureKind, detail: impl Into<String>) -> StageFailure {
        StageFailure {
            kind,
            peer: None,
            detail: detail.into(),
        }
    }

    /// The same failure, about `peer`.
    pub fn with_peer(mut self, peer: Stage) -> StageFailure {
        self.peer = Some(peer);
        self
    }

    /// A failure from an error value, keeping its message.
    pub fn from_error(kind: FailureKind, e: &dyn std::error::Error) -> StageFailure {
        StageFailure::new(kind, e.to_string())
    }
}
