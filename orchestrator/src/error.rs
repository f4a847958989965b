//! The orchestrator's final error: what went wrong and the exit code it ends the run with
//! (docs/cli.md: 1 a bind or forward failure or a dead stage, 2 a usage error, an unusable
//! configuration or a request refused up front, 4 a finished run whose routed experts
//! failed to load).
//!
//! The layers below return typed errors ([`SuperviseError`], ...); this module is where
//! each becomes a [`RunError`]: its exit code chosen by matching the type (and a stage's
//! [`FailureKind`]), its message the error's `Display`, printed as it is.

use k3_protocol::failure::FailureKind;

use crate::run::plan::BudgetError;
use crate::run::GenError;
use crate::supervise::SuperviseError;
use crate::tools::score::ScoreError;

/// Exit code: success.
pub const EXIT_OK: i32 = 0;
/// Exit code: a tensor failed to bind, a forward pass failed, a stage died, an I/O error.
pub const EXIT_FAILED: i32 = 1;
/// Exit code: usage error, unreadable config, or a request refused up front.
pub const EXIT_USAGE: i32 = 2;
/// Exit code: the run finished but a routed expert failed to load (the ids are unsound).
pub const EXIT_UNSOUND: i32 = 4;

/// A failure that ends a command, with its exit code. The message is complete: it is
/// printed as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct RunError {
    pub code: i32,
    pub msg: String,
}

impl RunError {
    pub fn new(code: i32, msg: impl Into<String>) -> RunError {
        RunError {
            code,
            msg: msg.into(),
        }
    }

    /// A usage error or a refused request (exit 2).
    pub fn usage(msg: impl Into<String>) -> RunError {
        RunError::new(EXIT_USAGE, msg)
    }

    /// A failure while running (exit 1).
    pub fn failed(msg: impl Into<String>) -> RunError {
        RunError::new(EXIT_FAILED, msg)
    }

    /// Print the message (through the log) and return the exit code.
    pub fn report(&self) -> i32 {
        tracing::error!("{}", self.msg);
        self.code
    }
}

/// Tools built on anyhow fail with exit 1 and the whole context chain.
impl From<anyhow::Error> for RunError {
    fn from(e: anyhow::Error) -> RunError {
        RunError::failed(format!("{e:#}"))
    }
}

/// The exit code of a run ended by a stage's failure of `kind`: a configuration or input
/// files the stage cannot use is the run's configuration (2, as if refused up front);
/// anything else, a dead peer included, is a failed run (1).
pub fn failure_exit_code(kind: FailureKind) -> i32 {
    match kind {
        FailureKind::Config => EXIT_USAGE,
        FailureKind::Io
        | FailureKind::Bind
        | FailureKind::Forward
        | FailureKind::ExpertLoad
        | FailureKind::PeerDied
        | FailureKind::Timeout
        | FailureKind::Protocol => EXIT_FAILED,
    }
}

/// The exit code of a pipeline that could not start or stopped early.
pub fn supervise_exit_code(e: &SuperviseError) -> i32 {
    use SuperviseError as E;
    match e {
        E::Interrupted { signal } => 128 + signal,
        E::CgroupsRequired(_) | E::Numa(_) | E::EmptyPrompt | E::PromptTooLong { .. } => EXIT_USAGE,
        E::Failed { failure, .. } | E::ThreadFailed { failure, .. } => {
            failure_exit_code(failure.kind)
        }
        E::OwnBinary(_)
        | E::ControlPair { .. }
        | E::Spawn { .. }
        | E::ControlReader(_)
        | E::Send { .. }
        | E::LinkRegion { .. }
        | E::Hung { .. }
        | E::AllGone
        | E::Exited { .. }
        | E::KnockOn { .. }
        | E::ControlClosed { .. }
        | E::Unexpected { .. }
        | E::Version { .. }
        | E::MissingFd { .. }
        | E::Panicked { .. }
        | E::ShutdownExit { .. } => EXIT_FAILED,
    }
}

impl From<SuperviseError> for RunError {
    fn from(e: SuperviseError) -> RunError {
        RunError::new(supervise_exit_code(&e), e.to_string())
    }
}

/// The exit code of a generation that did not run or did not finish: refused up front
/// (2: a flag, a file or the memory plan), failed (1), or the pipeline's own.
pub fn gen_exit_code(e: &GenError) -> i32 {
    use GenError as E;
    match e {
        E::Supervise(s) => supervise_exit_code(s),
        // A shard that is a FIFO or a device is refused before it is read.
        E::Catalog(c) if c.is_not_regular() => EXIT_USAGE,
        E::NoModelDir(_)
        | E::ModelDir { .. }
        | E::Config(_)
        | E::Layers { .. }
        | E::TrunkManifest(_)
        | E::TrunkSource { .. }
        | E::Experts(_)
        | E::Budget(_)
        | E::IdsOutside { .. }
        | E::OutputRefused { .. }
        | E::RecordNotDir { .. }
        | E::RecordDirMissing { .. }
        | E::PromptFile { .. }
        | E::NotUtf8 { .. }
        | E::Chat(_)
        | E::NeedsTok
        | E::CtxSize(_)
        | E::Tokenizer { .. }
        | E::LoadState(_)
        | E::SaveStatePath(_)
        | E::HookNotArmed(_)
        | E::BadHookValue { .. }
        | E::BadBudgetOverride(_)
        | E::BadInjection { .. } => EXIT_USAGE,
        E::Catalog(_)
        | E::Fingerprint(_)
        | E::Pool(_)
        | E::Model(_)
        | E::State(_)
        | E::Decode(_)
        | E::Routes(_)
        | E::Report { .. } => EXIT_FAILED,
    }
}

/// A generation's message as printed: the pipeline's and the memory plan's refusals as
/// they are (they carry their own head), anything else after `k3-orch: `.
fn gen_message(e: &GenError) -> String {
    match e {
        GenError::Supervise(_) => e.to_string(),
        GenError::Budget(b) if b.is_refusal() => e.to_string(),
        _ => format!("k3-orch: {e}"),
    }
}

impl From<GenError> for RunError {
    fn from(e: GenError) -> RunError {
        RunError::new(gen_exit_code(&e), gen_message(&e))
    }
}

/// A memory plan that cannot be made is refused up front (exit 2).
impl From<BudgetError> for RunError {
    fn from(e: BudgetError) -> RunError {
        RunError::from(GenError::Budget(e))
    }
}

/// The exit code of a `score` that did not score: its request refused up front (2), or a
/// failure while running (1).
pub fn score_exit_code(e: &ScoreError) -> i32 {
    use ScoreError as E;
    match e {
        E::EmptyIds
        | E::TooManyIds { .. }
        | E::NoThreads
        | E::Config(_)
        | E::IdOutside { .. }
        | E::Layers { .. }
        | E::Model(_) => EXIT_USAGE,
        E::Checkpoint(_)
        | E::Binding(_)
        | E::Forward(_)
        | E::NonFinite { .. }
        | E::Write { .. } => EXIT_FAILED,
    }
}

/// The result of a command.
pub type Result<T, E = RunError> = std::result::Result<T, E>;
