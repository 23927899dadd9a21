//! The orchestrator's errors and their one mapping to gRPC codes, and the store's errors as the handlers return
//! them.

use tonic::{Code, Status};

use crate::store::StoreError;

/// Why an orchestrator call failed.
#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    /// The request is malformed; `field` names what to fix.
    #[error("{field}: {message}")]
    InvalidArgument { field: String, message: String },
    /// No job has this id.
    #[error("job `{0}` not found")]
    JobNotFound(String),
    /// The request does not fit the state of what it names (a step-API turn already taken, an episode over...).
    #[error("{0}")]
    Precondition(String),
    /// A peer service could not be reached.
    #[error("{peer} at {url} is unavailable: {message}")]
    PeerUnavailable { peer: &'static str, url: String, message: String },
}

impl OrchestratorError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidArgument { field: field.into(), message: message.into() }
    }
}

impl From<OrchestratorError> for Status {
    fn from(error: OrchestratorError) -> Self {
        let code = match &error {
            OrchestratorError::InvalidArgument { .. } => Code::InvalidArgument,
            OrchestratorError::JobNotFound(_) => Code::NotFound,
            OrchestratorError::Precondition(_) => Code::FailedPrecondition,
            OrchestratorError::PeerUnavailable { .. } => Code::Unavailable,
        };
        Status::new(code, error.to_string())
    }
}

/// A store failure's gRPC code: UNAVAILABLE, except a stored record that no longer decodes (DATA_LOSS).
pub(crate) fn store_code(error: &StoreError) -> Code {
    match error {
        StoreError::Database(_) | StoreError::Migration(_) | StoreError::BadUrl { .. } => Code::Unavailable,
        StoreError::Corrupt { .. } => Code::DataLoss,
    }
}

/// A store failure as a handler returns it, with [`store_code`].
pub(crate) fn store_status(error: StoreError) -> Status {
    Status::new(store_code(&error), error.to_string())
}
