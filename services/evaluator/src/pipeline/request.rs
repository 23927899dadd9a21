//! A request checked before evaluation: refused with a [`RequestError`] naming the field, or made a [`Submission`].

use kforge_proto::v1 as pb;

use super::Evaluator;
use crate::static_checks::{self, Policy};
/// Why a request was refused before evaluation (a verdict is never an error).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    #[error("evaluation queue is full ({capacity} admitted); retry in about {retry_after_secs} s")]
    QueueFull { capacity: usize, retry_after_secs: u64 },
    #[error("no backend can run evaluations: {0}")]
    Unavailable(String),
}

fn invalid(field: &str, reason: impl Into<String>) -> RequestError {
    RequestError::Invalid { field: field.into(), reason: reason.into() }
}

/// A backend resolved against this evaluator's devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Backend {
    Cpu,
    Cuda,
    Triton,
}

impl Backend {
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Triton => "triton",
        }
    }
}

/// A validated request: the task, the candidate and how to evaluate it (distinct from the orchestrator's job,
/// `job_id`, and the sandbox's `Job`, a process to run).
#[derive(Debug, Clone)]
pub(super) struct Submission {
    pub(super) request_id: String,
    pub(super) task_id: String,
    pub(super) task: String,
    pub(super) candidate: String,
    pub(super) backend: Backend,
    pub(super) policy: Policy,
    pub(super) trials: u32,
    pub(super) measure: bool,
    pub(super) census: bool,
    pub(super) priority: i32,
    pub(super) job_id: String,
}

impl Evaluator {
    pub(super) fn validate(&self, request: pb::EvaluateRequest) -> Result<Submission, RequestError> {
        let config = &self.inner.config;
        let pb::EvaluateRequest {
            request_id,
            task,
            candidate_source,
            backend,
            policy,
            correctness_trials,
            measure_performance,
            census,
            idempotency_key: _,
            priority,
            job_id,
        } = request;
        let task = task.ok_or_else(|| invalid("task", "required"))?;
        if task.source.trim().is_empty() {
            return Err(invalid("task.source", "required"));
        }
        if task.source.len() > config.max_source_bytes {
            return Err(invalid(
                "task.source",
                format!("{} bytes, over the {}-byte limit", task.source.len(), config.max_source_bytes),
            ));
        }
        static_checks::check_task(&task.source).map_err(|reason| invalid("task.source", reason))?;
        if candidate_source.trim().is_empty() {
            return Err(invalid("candidate_source", "required"));
        }
        if candidate_source.len() > config.max_source_bytes {
            return Err(invalid(
                "candidate_source",
                format!("{} bytes, over the {}-byte limit", candidate_source.len(), config.max_source_bytes),
            ));
        }
        // The request is checked before the environment: a caller's mistake is worth knowing first.
        let python = self.inner.python.as_ref().map_err(|e| RequestError::Unavailable(e.clone()))?;
        let has_gpu = !python.gpus.is_empty();
        let backend = match pb::Backend::try_from(backend) {
            Ok(pb::Backend::Unspecified) if has_gpu => Backend::Cuda,
            Ok(pb::Backend::Unspecified | pb::Backend::Cpu) => Backend::Cpu,
            Ok(pb::Backend::Cuda) if has_gpu => Backend::Cuda,
            Ok(pb::Backend::Triton) if has_gpu && python.versions.contains_key("triton") => Backend::Triton,
            Ok(requested @ (pb::Backend::Cuda | pb::Backend::Triton)) => {
                return Err(invalid(
                    "backend",
                    format!("{} needs a GPU with its toolchain; this evaluator has only cpu", requested.as_str_name()),
                ));
            }
            Err(_) => return Err(invalid("backend", format!("unknown value {backend}"))),
        };
        let policy_name = if policy.is_empty() { config.default_policy.as_str() } else { policy.as_str() };
        let policy = Policy::resolve(policy_name).ok_or_else(|| {
            let known: Vec<String> = Policy::ALL.iter().map(Policy::id).collect();
            invalid("policy", format!("unknown policy `{policy_name}` (known: {})", known.join(", ")))
        })?;
        let trials = if correctness_trials == 0 { config.default_trials } else { correctness_trials };
        if trials > 100 {
            return Err(invalid("correctness_trials", format!("{trials} is over the limit of 100")));
        }
        let task_id = if task.task_id.is_empty() { "task".to_owned() } else { task.task_id };
        Ok(Submission {
            request_id,
            task_id,
            task: task.source,
            candidate: candidate_source,
            backend,
            policy,
            trials,
            measure: measure_performance,
            census: census || measure_performance,
            priority,
            job_id,
        })
    }
}
