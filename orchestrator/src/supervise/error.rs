//! What can end a pipeline the supervisor runs: [`SuperviseError`], typed so that the exit
//! code (`crate::error`) and the stage to blame ([`SuperviseError::culprit`]) come from the
//! variant and the stages' [`FailureKind`]s, never from a message's wording.

use std::time::Duration;

use k3_protocol::control::ControlError;
use k3_protocol::failure::{FailureKind, StageFailure};
use k3_protocol::messages::Stage;
use k3_protocol::transport::TransportError;

use super::cgroup::CgroupError;
use super::numa::NumaError;
use super::spawn::{signal_name, ExitCause};

/// Why a stage process could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Why the pipeline could not be started, or stopped before its end.
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    #[error("k3-orch: cannot find its own binary: {0}")]
    OwnBinary(#[source] std::io::Error),
    /// `--require-cgroups` and no per-stage memory cgroups (refused up front).
    #[error("k3-orch: --require-cgroups: per-stage memory cgroups are unavailable: {0}")]
    CgroupsRequired(#[source] CgroupError),
    /// `--numa` cannot be planned (refused up front).
    #[error("k3-orch: --numa: {0}")]
    Numa(#[source] NumaError),
    #[error("k3-orch: control socket for {stage}: {source}")]
    ControlPair {
        stage: Stage,
        #[source]
        source: ControlError,
    },
    #[error("k3-orch: starting {stage}: {source}")]
    Spawn {
        stage: Stage,
        #[source]
        source: SpawnError,
    },
    #[error("k3-orch: control reader: {0}")]
    ControlReader(#[source] std::io::Error),
    #[error("k3-orch: sending to {stage}: {source}")]
    Send {
        stage: Stage,
        #[source]
        source: ControlError,
    },
    #[error("k3-orch: link region {a}<->{b}: {source}")]
    LinkRegion {
        a: Stage,
        b: Stage,
        #[source]
        source: TransportError,
    },
    /// SIGINT or SIGTERM reached k3-orch (it exits 128 + the signal).
    #[error("k3-orch: interrupted by {}; stages stopped", signal_name(*signal))]
    Interrupted { signal: i32 },
    /// No heartbeat from a stage for the stage timeout.
    #[error(
        "k3-orch: stage {stage} stopped answering (no heartbeat for {:.0} s); stopping the \
         pipeline",
        timeout.as_secs_f64()
    )]
    Hung { stage: Stage, timeout: Duration },
    #[error("k3-orch: every stage connection is gone")]
    AllGone,
    /// A stage process ended before its part was done (or was OOM-killed at its cgroup's
    /// limit, `oom_limit`).
    #[error("{}", exited_message(stage, *pid, cause, *oom_limit))]
    Exited {
        stage: String,
        pid: u32,
        cause: ExitCause,
        oom_limit: Option<u64>,
    },
    /// A stage reported its own failure (`Msg::Error`).
    #[error("k3-orch: stage {stage} failed: {failure}")]
    Failed { stage: Stage, failure: StageFailure },
    /// A stage reported a peer's death and the peer gave no report of its own in time.
    #[error("k3-orch: stage {culprit} is gone ({reporter} reports: {failure})")]
    KnockOn {
        culprit: Stage,
        reporter: Stage,
        failure: StageFailure,
    },
    #[error("k3-orch: stage {stage} closed its control socket {phase}: {source}")]
    ControlClosed {
        stage: Stage,
        phase: &'static str,
        #[source]
        source: ControlError,
    },
    /// A stage sent a message the protocol does not allow then (`message` is its debug
    /// form; `phase` says when, as "during set-up").
    #[error("k3-orch: {stage} sent {message} {phase}")]
    Unexpected {
        stage: Stage,
        message: String,
        phase: &'static str,
    },
    #[error("k3-orch: {stage} speaks protocol {version}")]
    Version { stage: Stage, version: u32 },
    #[error("k3-orch: {stage} announced region {name} without its fd")]
    MissingFd { stage: Stage, name: String },
    /// The prompt cannot run (refused up front).
    #[error("k3-orch: the prompt encodes to no tokens")]
    EmptyPrompt,
    #[error("k3-orch: the prompt is {len} tokens, over the {max}-token limit")]
    PromptTooLong { len: usize, max: usize },
    /// An in-process stage (`--inproc`) returned its failure.
    #[error("k3-orch: stage {stage}: {failure}")]
    ThreadFailed { stage: Stage, failure: StageFailure },
    #[error("k3-orch: stage {stage} panicked")]
    Panicked { stage: Stage },
    #[error("k3-orch: stage {stage} {cause} at shutdown")]
    ShutdownExit { stage: Stage, cause: ExitCause },
}

fn exited_message(stage: &str, pid: u32, cause: &ExitCause, oom_limit: Option<u64>) -> String {
    let mut msg = match oom_limit {
        Some(limit) => format!(
            "k3-orch: stage {stage} (pid {pid}) was killed by the kernel OOM killer at its \
             memory limit of {} ({cause})",
            crate::units::human(limit)
        ),
        None => format!("k3-orch: stage {stage} (pid {pid}) {cause}"),
    };
    if matches!(cause, ExitCause::Code(0)) {
        msg.push_str(" before the run was finished");
    }
    msg
}

impl SuperviseError {
    /// The stage to blame, when one is: the one that exited, hung or reported its own
    /// failure; for a report of a peer's death or silence, that peer.
    pub fn culprit(&self) -> Option<Stage> {
        match self {
            SuperviseError::Exited { stage, .. } => Stage::parse(stage),
            SuperviseError::Failed { stage, failure }
            | SuperviseError::ThreadFailed { stage, failure } => match failure.peer {
                Some(p)
                    if p != Stage::Orchestrator
                        && matches!(failure.kind, FailureKind::PeerDied | FailureKind::Timeout) =>
                {
                    Some(p)
                }
                _ => Some(*stage),
            },
            SuperviseError::KnockOn { culprit, .. } => Some(*culprit),
            SuperviseError::Hung { stage, .. }
            | SuperviseError::ControlClosed { stage, .. }
            | SuperviseError::Unexpected { stage, .. }
            | SuperviseError::Version { stage, .. }
            | SuperviseError::MissingFd { stage, .. }
            | SuperviseError::Panicked { stage }
            | SuperviseError::ShutdownExit { stage, .. }
            | SuperviseError::Spawn { stage, .. } => Some(*stage),
            _ => None,
        }
    }

    /// A stage's report of another's death, which that other's own report (or exit)
    /// explains better.
    pub fn is_knock_on(&self) -> bool {
        matches!(self, SuperviseError::Failed { failure, .. } if failure.kind.is_secondary())
    }
}
