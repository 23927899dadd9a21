//! A request's fields the engine reads, and the status of a request it refused.

use kforge_execution::RequestError;
use kforge_execution::engine::{RequestedBackend, TaskSource};
use kforge_proto::v1 as pb;
use tonic::Status;

/// A request's task.
pub fn task(task: pb::Task) -> TaskSource {
    let pb::Task { task_id, source } = task;
    TaskSource { task_id, source }
}

/// A request's `backend`; a value the contract does not define is [`RequestedBackend::Unknown`] (the engine refuses
/// it, naming the value).
pub fn requested_backend(value: i32) -> RequestedBackend {
    match pb::Backend::try_from(value) {
        Ok(pb::Backend::Unspecified) => RequestedBackend::Any,
        Ok(pb::Backend::Cpu) => RequestedBackend::Cpu,
        Ok(pb::Backend::Cuda) => RequestedBackend::Cuda,
        Ok(pb::Backend::Triton) => RequestedBackend::Triton,
        Err(_) => RequestedBackend::Unknown(value),
    }
}

/// The status of a request the engine refused, alike from every service: INVALID_ARGUMENT naming the field,
/// RESOURCE_EXHAUSTED with the queue's `retry-after-ms` hint ([`RequestError::retry_after`]), UNAVAILABLE without a
/// backend.
pub fn status(error: RequestError) -> Status {
    let message = error.to_string();
    match &error {
        RequestError::Invalid { .. } => Status::invalid_argument(message),
        RequestError::QueueFull { .. } => {
            let mut status = Status::resource_exhausted(message);
            let hint = error.retry_after().and_then(|after| after.as_millis().to_string().parse().ok());
            if let Some(value) = hint {
                status.metadata_mut().insert("retry-after-ms", value);
            }
            status
        }
        RequestError::Unavailable(_) => Status::unavailable(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_answers_resource_exhausted_with_its_retry_hint() {
        let status = status(RequestError::QueueFull { capacity: 8, retry_after_secs: 30 });
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("queue is full"), "{}", status.message());
        let hint = status.metadata().get("retry-after-ms").and_then(|value| value.to_str().ok());
        assert_eq!(hint, Some("30000"));
        let invalid = super::status(RequestError::invalid("task.source", "required"));
        assert_eq!((invalid.code(), invalid.message()), (tonic::Code::InvalidArgument, "task.source: required"));
        assert!(invalid.metadata().get("retry-after-ms").is_none());
    }

    #[test]
    fn a_backend_the_contract_does_not_define_is_named_for_the_engine_to_refuse() {
        assert_eq!(requested_backend(pb::Backend::Unspecified.into()), RequestedBackend::Any);
        assert_eq!(requested_backend(pb::Backend::Triton.into()), RequestedBackend::Triton);
        assert_eq!(requested_backend(99), RequestedBackend::Unknown(99));
    }
}
