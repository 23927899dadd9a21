//! The orchestrator's errors and their one mapping to gRPC codes, and the store's errors as the handlers return
//! them.

use std::time::Duration;

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
    /// The request asks for more than a configured limit (`key`) allows; `field` names what to lower.
    #[error("{field}: {value}{unit} is over the limit of {limit} ({key})")]
    OverLimit { field: String, value: u64, unit: String, limit: u64, key: &'static str },
    /// A named caller acted on a job another named caller submitted.
    #[error("caller `{caller}` may not act on job `{job_id}`: another caller submitted it")]
    NotOwner { caller: String, job_id: String },
    /// A named caller is over one of its quotas (`key`); `retry_after` when it is known when there will be room.
    #[error("caller `{caller}` is over its quota: {detail} ({key})")]
    OverQuota { caller: String, detail: String, key: &'static str, retry_after: Option<Duration> },
}

impl OrchestratorError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidArgument { field: field.into(), message: message.into() }
    }

    /// A spec's enum field holding a value this build does not know.
    pub fn unknown_enum(field: &str, value: i32) -> Self {
        Self::invalid(field, format!("unknown value {value}"))
    }
}

impl From<OrchestratorError> for Status {
    fn from(error: OrchestratorError) -> Self {
        let code = match &error {
            OrchestratorError::InvalidArgument { .. } => Code::InvalidArgument,
            OrchestratorError::JobNotFound(_) => Code::NotFound,
            OrchestratorError::Precondition(_) => Code::FailedPrecondition,
            OrchestratorError::PeerUnavailable { .. } => Code::Unavailable,
            OrchestratorError::OverLimit { .. } => Code::InvalidArgument,
            OrchestratorError::OverQuota { .. } => Code::ResourceExhausted,
            OrchestratorError::NotOwner { .. } => Code::PermissionDenied,
        };
        let mut status = Status::new(code, bounded(error.to_string()));
        // The evaluator's convention for a refusal that will pass later: `retry-after-ms` metadata.
        if let OrchestratorError::OverQuota { retry_after: Some(wait), .. } = &error
            && let Ok(value) = wait.as_millis().to_string().parse()
        {
            status.metadata_mut().insert("retry-after-ms", value);
        }
        status
    }
}

/// The longest status message sent, in bytes. A message quotes what it refuses (a path, an id), and travels in a
/// response header: a request's megabyte-long field must not become a megabyte-long header.
const MAX_MESSAGE_BYTES: usize = 1024;

/// `message`, cut to [`MAX_MESSAGE_BYTES`] at a character boundary, saying how much was left out.
fn bounded(mut message: String) -> String {
    if message.len() <= MAX_MESSAGE_BYTES {
        return message;
    }
    let total = message.len();
    let mut end = MAX_MESSAGE_BYTES - 64;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message.truncate(end);
    message.push_str(&format!("... ({} more bytes)", total - end));
    message
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_names_its_field_and_key_and_a_quota_says_when_to_retry() {
        let over = OrchestratorError::OverLimit {
            field: "spec.turns".into(),
            value: 4_294_967_295,
            unit: String::new(),
            limit: 32,
            key: "orchestrator.limits.turns",
        };
        let status = Status::from(over);
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "spec.turns: 4294967295 is over the limit of 32 (orchestrator.limits.turns)");
        let quota = |retry_after| OrchestratorError::OverQuota {
            caller: "alice".into(),
            detail: "2 jobs queued or running, the quota is 2".into(),
            key: "orchestrator.quotas.jobs_in_flight",
            retry_after,
        };
        let status = Status::from(quota(Some(Duration::from_millis(1500))));
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(
            status.message(),
            "caller `alice` is over its quota: 2 jobs queued or running, the quota is 2 \
             (orchestrator.quotas.jobs_in_flight)"
        );
        assert_eq!(status.metadata().get("retry-after-ms").map(|v| v.to_str().ok()), Some(Some("1500")));
        assert!(Status::from(quota(None)).metadata().get("retry-after-ms").is_none());
    }

    #[test]
    fn a_message_quoting_a_huge_field_is_cut_at_a_character_boundary() {
        let path = "é".repeat(1_000_000);
        let status = Status::from(OrchestratorError::invalid("spec.task_set", format!("{path} is not a directory")));
        assert!(status.message().starts_with("spec.task_set: éé"), "{}", &status.message()[..40]);
        assert!(status.message().len() <= MAX_MESSAGE_BYTES, "{}", status.message().len());
        assert!(status.message().ends_with(" more bytes)"), "{}", status.message());
    }
}
