//! The candidate's stage as the evaluator runs it beyond the engine's (`Engine::candidate_stage`): the remeasure
//! of an implausible speedup in a fresh process, and the call limits from the task's cached baseline.

use std::path::Path;

use kforge_execution::cache::Entry;
use kforge_execution::devices::Lane;
use kforge_execution::engine::{InfraError, Submission};
use kforge_execution::protocol::{CandidateResult, CandidateRun, TimingSpec};
use kforge_execution::stage::{CallLimits, StageOutcome};
use tokio_util::sync::CancellationToken;

use super::Evaluator;
use super::baseline::Baseline;
use crate::stats::timing_stats;

impl Evaluator {
    /// The candidate's timing alone, in a fresh child, on timing inputs of their own.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn remeasure(
        &self,
        submission: &Submission,
        lane: &Lane,
        task_key: &str,
        init_seed: u64,
        artifact_dir: &Path,
        scratch: &Path,
        cancel: &CancellationToken,
    ) -> Result<StageOutcome<CandidateResult>, InfraError> {
        let timing = self.inner.config.timing;
        // No trials (their budget and sensitivity trial go unread): timing alone.
        let spec = CandidateRun {
            init_seed,
            seeds: vec![],
            recheck_from: 0,
            sensitivity: None,
            replay: None,
            output_bytes_budget: self.inner.config.output_bytes_budget,
            timing: Some(TimingSpec::from(&timing)),
            timing_seeds: self.inner.engine.seeds(task_key, "remeasure", timing.input_sets.max(1) as usize),
            census_calls: 0,
            profiled_calls: 0,
            keep_timed: None,
        };
        let dir = scratch.join("remeasure");
        let engine = &self.inner.engine;
        let started = engine.start_candidate(submission, &dir, artifact_dir, cancel)?;
        engine.candidate_stage(started, lane, &dir, spec, self.call_limits(submission, lane.gpu()), None).await
    }

    /// How long each call of `submission`'s candidate may run on `gpu`: from the task's eager median where its
    /// baseline is cached, else the limit for tasks not measured yet. The median is told to the engine, whose
    /// profiles on the task take their limits from it.
    pub(super) fn call_limits(&self, submission: &Submission, gpu: Option<usize>) -> CallLimits {
        let config = &self.inner.config.call_limits;
        let reference_ms = match self.inner.baselines.get(&self.baseline_key(submission, gpu)) {
            Some(Entry::Ready(text)) => {
                Baseline::parse(&text).ok().and_then(|baseline| timing_stats(baseline.eager)).map(|s| s.median_ms)
            }
            _ => None,
        };
        if let Some(median_ms) = reference_ms {
            let task_key = kforge_execution::cache::key(&[submission.task.as_bytes()]);
            self.inner.engine.note_eager_median(&task_key, gpu, median_ms);
        }
        CallLimits::for_reference(config, reference_ms)
    }
}
