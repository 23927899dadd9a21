//! The profiler's errors and their one mapping to gRPC codes. A refusal by the execution engine maps as the
//! evaluator maps it, with the same function (`kforge_execution_proto::status`: INVALID_ARGUMENT, UNAVAILABLE,
//! RESOURCE_EXHAUSTED with the engine's `retry-after-ms` hint), so a full queue answers alike from either service.

use kforge_execution::RequestError;
use tonic::Status;

use crate::device::DeviceError;
use crate::nsight;

/// Why a Profiler call failed (a candidate that fails is a verdict, never an error).
#[derive(Debug, thiserror::Error)]
pub enum ProfilerError {
    /// The request is malformed; `field` names what to fix.
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    /// The engine refused the run before it started: a field it checks, a full queue, no backend.
    #[error(transparent)]
    Refused(#[from] RequestError),
    /// Nsight Compute was not found at start-up.
    #[error(transparent)]
    NcuUnusable(nsight::Unusable),
    /// The driver keeps the GPU's performance counters from this process, as its parameters say before a run.
    #[error("GPU performance counters: {why}")]
    CountersClosed { why: String },
    /// Nsight Compute's own refusal to read the counters (ERR_NVGPUCTRPERM), in its words and with the remedy.
    #[error("{0}")]
    CountersRefused(String),
    /// A profile's report directory could not be made.
    #[error("report directory: {0}")]
    ReportDir(std::io::Error),
    /// `StreamReport` names no report that is kept.
    #[error("report_id: no kept report `{id}`")]
    NoReport { id: String },
    /// A kept report could not be opened (evicted since it was found, say).
    #[error("report: {0}")]
    ReportOpen(std::io::Error),
    /// A kept report could not be read to the end.
    #[error("reading the report: {0}")]
    ReportRead(std::io::Error),
    /// The device's specification could not be read.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The blocking task reading the device did not finish.
    #[error("reading the device: {0}")]
    DeviceRead(tokio::task::JoinError),
}

impl ProfilerError {
    /// `field` is wrong: `reason` says how.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid { field: field.into(), reason: reason.into() }
    }
}

impl From<ProfilerError> for Status {
    fn from(error: ProfilerError) -> Self {
        use ProfilerError as E;
        match error {
            E::Refused(refused) => kforge_execution_proto::status(refused),
            e @ E::Invalid { .. } => Status::invalid_argument(e.to_string()),
            e @ E::NcuUnusable(_) => Status::unavailable(e.to_string()),
            e @ (E::CountersClosed { .. } | E::CountersRefused(_) | E::Device(DeviceError::NoDriver)) => {
                Status::failed_precondition(e.to_string())
            }
            // The ordinal is the caller's: a device this host does not have.
            e @ E::Device(DeviceError::Driver { .. }) => Status::invalid_argument(e.to_string()),
            e @ (E::NoReport { .. } | E::ReportOpen(_)) => Status::not_found(e.to_string()),
            e @ (E::ReportDir(_) | E::ReportRead(_) | E::DeviceRead(_)) => Status::internal(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_engine_queue_answers_resource_exhausted_with_the_evaluators_retry_hint() {
        let refused = ProfilerError::from(RequestError::QueueFull { capacity: 8, retry_after_secs: 30 });
        let status = Status::from(refused);
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("queue is full"), "{}", status.message());
        let hint = status.metadata().get("retry-after-ms").and_then(|value| value.to_str().ok());
        assert_eq!(hint, Some("30000"), "{status:?}");
    }

    #[test]
    fn the_profilers_own_failures_keep_their_codes_and_name_the_field() {
        let cases = [
            (ProfilerError::invalid("launch_limit", "101 is over the limit of 100"), tonic::Code::InvalidArgument),
            (ProfilerError::from(RequestError::invalid("task.source", "required")), tonic::Code::InvalidArgument),
            (ProfilerError::NcuUnusable(nsight::Unusable::Missing("not on PATH".into())), tonic::Code::Unavailable),
            (ProfilerError::CountersClosed { why: "RmProfilingAdminOnly: 1".into() }, tonic::Code::FailedPrecondition),
            (ProfilerError::NoReport { id: "00ff".into() }, tonic::Code::NotFound),
            (ProfilerError::Device(DeviceError::NoDriver), tonic::Code::FailedPrecondition),
            (
                ProfilerError::Device(DeviceError::Driver { ordinal: 9, error: "invalid device".into() }),
                tonic::Code::InvalidArgument,
            ),
        ];
        for (error, code) in cases {
            let message = error.to_string();
            let status = Status::from(error);
            assert_eq!((status.code(), status.message()), (code, message.as_str()));
            assert!(status.metadata().get("retry-after-ms").is_none(), "only a full queue hints: {status:?}");
        }
        let status = Status::from(ProfilerError::NoReport { id: "00ff".into() });
        assert_eq!(status.message(), "report_id: no kept report `00ff`", "the message `kforge call` users see");
        let status = Status::from(ProfilerError::CountersClosed { why: "RmProfilingAdminOnly: 1".into() });
        assert!(status.message().starts_with("GPU performance counters: "), "{}", status.message());
    }
}
