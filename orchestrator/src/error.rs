//! The orchestrator's one error type: what went wrong and the exit code it ends the run
//! with (docs/cli.md: 1 a bind or forward failure or a dead stage, 2 a usage error or a
//! request refused up front, 4 a finished run whose routed experts failed to load).

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

/// The result of a command.
pub type Result<T, E = RunError> = std::result::Result<T, E>;
