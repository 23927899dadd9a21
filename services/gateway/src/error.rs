//! What a gateway call can fail with, and the one mapping of each failure to a gRPC status.
//!
//! Bad input is INVALID_ARGUMENT naming the field. An upstream failure names the backend and how many attempts
//! were made; its code says what the caller can do: UNAVAILABLE (retry later), RESOURCE_EXHAUSTED (rate limited),
//! DEADLINE_EXCEEDED, INTERNAL (the backend answered something the API does not allow), NOT_FOUND (a replay file
//! has no record for the keys).
//!
//! What stops the gateway from starting is a [`SetupError`]: it ends the process, never a call.

use std::time::Duration;

use tonic::{Code, Status};

use crate::backends::{AttemptError, BackendError};
use crate::config::ConfigError;
use crate::request::InvalidField;

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Invalid(#[from] InvalidField),
    /// No backend of the pool can take requests.
    #[error("model `{model}`: no backend can take requests: {reason}")]
    NoBackend { model: String, reason: String },
    /// The last attempt's failure, after every allowed attempt.
    #[error("backend {backend}: {error} (after {attempts} attempt{})", if *.attempts == 1 { "" } else { "s" })]
    Upstream { backend: String, attempts: u32, error: AttemptError },
    /// The deadline passed while waiting (for a paused pool, a concurrency slot or a Retry-After).
    #[error("model `{model}`: deadline passed while {waiting} (after {attempts} attempts)")]
    Deadline { model: String, waiting: &'static str, attempts: u32 },
    /// The backend asked for a longer wait than the gateway allows or the deadline leaves.
    #[error("backend {backend}: rate limited, retry after {}s (after {attempts} attempts)", .retry_after.as_secs_f64())]
    RateLimited { backend: String, retry_after: Duration, attempts: u32 },
    /// A streaming request's worker task failed.
    #[error("generation task failed: {0}")]
    Task(String),
}

impl GatewayError {
    /// The gRPC code of this error; the one mapping, exhaustive.
    pub fn code(&self) -> Code {
        match self {
            Self::Invalid(_) => Code::InvalidArgument,
            Self::NoBackend { .. } => Code::Unavailable,
            Self::Deadline { .. } => Code::DeadlineExceeded,
            Self::RateLimited { .. } => Code::ResourceExhausted,
            Self::Task(_) => Code::Internal,
            Self::Upstream { error, .. } => match error {
                AttemptError::Connect(_) | AttemptError::Broken { .. } => Code::Unavailable,
                AttemptError::Deadline => Code::DeadlineExceeded,
                AttemptError::Status { status, .. } => match status {
                    429 => Code::ResourceExhausted,
                    408 | 500..=599 => Code::Unavailable,
                    400 | 413 | 422 => Code::InvalidArgument,
                    _ => Code::FailedPrecondition,
                },
                AttemptError::Protocol(_) => Code::Internal,
                AttemptError::NoRecord { .. } => Code::NotFound,
                AttemptError::TooFewRecorded { .. } => Code::FailedPrecondition,
            },
        }
    }
}

impl From<GatewayError> for Status {
    fn from(error: GatewayError) -> Self {
        Status::new(error.code(), error.to_string())
    }
}

/// Why the gateway could not be built from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("http client: {0}")]
    HttpClient(#[source] reqwest::Error),
    /// A pool's backend could not be built (its API key or replay file).
    #[error("pool `{model}` backends[{index}]: {source}")]
    Backend { model: String, index: usize, source: BackendError },
}
