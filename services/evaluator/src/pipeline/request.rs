//! A request checked before evaluation: refused with a [`RequestError`] naming the field, or made an
//! [`Evaluation`]: the engine's [`Submission`] and how to evaluate it.

use kforge_execution::engine::{RequestError, Submission, SubmissionRequest};
use kforge_proto::v1 as pb;

use super::Evaluator;

/// A checked request: what runs (the engine's submission), and how it is evaluated.
#[derive(Debug, Clone)]
pub(super) struct Evaluation {
    pub(super) submission: Submission,
    pub(super) trials: u32,
    pub(super) measure: bool,
    pub(super) census: bool,
}

impl Evaluator {
    pub(super) fn validate(&self, request: pb::EvaluateRequest) -> Result<Evaluation, RequestError> {
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
        let submission = self.inner.engine.submission(SubmissionRequest {
            request_id,
            task: task.map(kforge_execution_proto::task),
            candidate_source,
            backend: kforge_execution_proto::requested_backend(backend),
            policy,
            priority,
            job_id,
        })?;
        let trials = if correctness_trials == 0 { self.inner.config.default_trials } else { correctness_trials };
        if trials > 100 {
            return Err(RequestError::invalid("correctness_trials", format!("{trials} is over the limit of 100")));
        }
        Ok(Evaluation { submission, trials, measure: measure_performance, census: census || measure_performance })
    }
}
