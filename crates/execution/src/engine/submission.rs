//! A request checked before anything runs: refused with a [`RequestError`] naming the field, or made a
//! [`Submission`]. The services make a [`SubmissionRequest`] of their wire requests and give a refusal its status.

use std::time::Duration;

use kforge_static_checks::{self as static_checks, Policy};

use super::Engine;

/// Why a request was refused before anything ran (a verdict is never an error).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    #[error("evaluation queue is full ({capacity} admitted); retry in about {retry_after_secs} s")]
    QueueFull { capacity: usize, retry_after_secs: u64 },
    #[error("no backend can run evaluations: {0}")]
    Unavailable(#[from] crate::python::PythonUnavailable),
}

impl RequestError {
    /// `field` is wrong: `reason` says how.
    pub fn invalid(field: &str, reason: impl Into<String>) -> Self {
        Self::Invalid { field: field.into(), reason: reason.into() }
    }

    /// When a retry may be admitted: a full queue's hint (the services' `retry-after-ms`).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            RequestError::QueueFull { retry_after_secs, .. } => Some(Duration::from_secs(*retry_after_secs)),
            RequestError::Invalid { .. } | RequestError::Unavailable(_) => None,
        }
    }
}

fn invalid(field: &str, reason: impl Into<String>) -> RequestError {
    RequestError::invalid(field, reason)
}

/// A backend resolved against this engine's devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
    Triton,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Triton => "triton",
        }
    }
}

/// A checked request: the task and the candidate, where it runs and under which policy, and for whom (the
/// orchestrator's `job_id`, a priority).
#[derive(Debug, Clone)]
pub struct Submission {
    pub request_id: String,
    pub task_id: String,
    pub task: String,
    pub candidate: String,
    pub backend: Backend,
    pub policy: Policy,
    pub priority: i32,
    pub job_id: String,
}

/// A task as a request names it: its identifier (for caching and reporting) and its reference source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskSource {
    pub task_id: String,
    pub source: String,
}

/// The backend a request asks for, before it is resolved against the engine's devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RequestedBackend {
    /// Unspecified: CUDA where there is a GPU, else the CPU.
    #[default]
    Any,
    Cpu,
    Cuda,
    Triton,
    /// A value the contract does not define (refused, naming it).
    Unknown(i32),
}

/// What a caller asks the engine to run, before it is checked: the fields of an `EvaluateRequest` that every run
/// has.
#[derive(Debug, Clone, Default)]
pub struct SubmissionRequest {
    pub request_id: String,
    pub task: Option<TaskSource>,
    pub candidate_source: String,
    pub backend: RequestedBackend,
    /// A policy's name; empty: `default_policy`.
    pub policy: String,
    pub priority: i32,
    pub job_id: String,
}

impl Engine {
    /// Checks `request` against the limits and this engine's devices: the caller's mistakes first, then what the
    /// environment lacks.
    pub fn submission(&self, request: SubmissionRequest) -> Result<Submission, RequestError> {
        let config = &self.inner.config;
        let SubmissionRequest { request_id, task, candidate_source, backend, policy, priority, job_id } = request;
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
        static_checks::check_task(&task.source).map_err(|reason| invalid("task.source", reason.to_string()))?;
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
        let backend = match backend {
            RequestedBackend::Any if has_gpu => Backend::Cuda,
            RequestedBackend::Any | RequestedBackend::Cpu => Backend::Cpu,
            RequestedBackend::Cuda if has_gpu => Backend::Cuda,
            RequestedBackend::Triton if has_gpu && python.versions.contains_key("triton") => Backend::Triton,
            RequestedBackend::Cuda | RequestedBackend::Triton => {
                let name = if backend == RequestedBackend::Cuda { "BACKEND_CUDA" } else { "BACKEND_TRITON" };
                return Err(invalid(
                    "backend",
                    format!("{name} needs a GPU with its toolchain; this evaluator has only cpu"),
                ));
            }
            RequestedBackend::Unknown(value) => return Err(invalid("backend", format!("unknown value {value}"))),
        };
        let policy_name = if policy.is_empty() { config.default_policy.as_str() } else { policy.as_str() };
        let policy = Policy::resolve(policy_name).ok_or_else(|| {
            let known: Vec<String> = Policy::ALL.iter().map(Policy::id).collect();
            invalid("policy", format!("unknown policy `{policy_name}` (known: {})", known.join(", ")))
        })?;
        let task_id = if task.task_id.is_empty() { "task".to_owned() } else { task.task_id };
        Ok(Submission {
            request_id,
            task_id,
            task: task.source,
            candidate: candidate_source,
            backend,
            policy,
            priority,
            job_id,
        })
    }
}
