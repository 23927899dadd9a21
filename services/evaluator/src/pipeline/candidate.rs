//! The candidate's stage: its process started before its lane, run on the lane with its call limits, and what it
//! reported read into a verdict or a result; and the remeasure of an implausible speedup in a fresh process.

use std::path::Path;
use std::time::Duration;

use kforge_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

use super::baseline::Baseline;
use super::timing::call_limits;
use super::verdict::{candidate_failure, hack_finding};
use super::{Backend, Evaluator, InfraError, Submission};
use crate::cache::Entry;
use crate::devices::Lane;
use crate::protocol::{CandidatePlacement, CandidateResult, CandidateRun, CandidateSpec, Mode, Report, TimingSpec};
use crate::stage::{CallLimits, Request, Stage, StageOutcome, Started};
use crate::stats::timing_stats;

impl Evaluator {
    /// Starts the candidate's process in `dir`, before it has a lane: the interpreter starts and imports torch
    /// meanwhile. Its device comes with the request.
    pub(super) fn start_candidate(
        &self,
        submission: &Submission,
        dir: &Path,
        artifact_dir: &Path,
        cancel: &CancellationToken,
    ) -> Result<Started, InfraError> {
        let stage = self.candidate_process(submission, dir, artifact_dir)?;
        Ok(self.start(stage, cancel))
    }

    /// The candidate's process in `dir`, its task and source written there.
    pub(super) fn candidate_process(
        &self,
        submission: &Submission,
        dir: &Path,
        artifact_dir: &Path,
    ) -> Result<Stage, InfraError> {
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");
        std::fs::create_dir_all(dir).map_err(InfraError::files(format!("scratch directory {}", dir.display())))?;
        for (name, source) in [("task.py", &submission.task), ("candidate.py", &submission.candidate)] {
            std::fs::write(dir.join(name), source).map_err(InfraError::files(format!("writing {name}")))?;
        }
        let mut env = python.env(dir);
        if submission.backend == Backend::Cpu {
            // Hidden from the start: a CPU evaluation never sees a GPU.
            env.extend(python.device_env(None).into_iter().map(|(k, v)| (k.into(), v.into())));
        } else {
            // Its GPU is known only once it has a slot, but torch reads its thread limit when it loads, now.
            env.extend(python.gpu_threads_env().into_iter().map(|(k, v)| (k.into(), v.into())));
        }
        env.push(("TORCH_EXTENSIONS_DIR".into(), artifact_dir.join("ext").into()));
        // The build's (`Evaluator::jit_cache`): a Triton kernel compiled by one stage is not compiled by the next.
        env.push(("TRITON_CACHE_DIR".into(), artifact_dir.join("triton").into()));
        let stage = Stage {
            scratch: dir.to_owned(),
            readable: vec![],
            // The extension build directory takes a lock file even when nothing needs building.
            writable: vec![artifact_dir.to_owned()],
            env,
            wall: Duration::from_secs(inner.config.run_timeout_secs),
            background: false,
            launcher: vec![],
        };
        Ok(stage)
    }

    /// Empties the candidate's directory (nothing of a first run may be read as the second's) and starts the
    /// candidate's process again there. The directory itself stays: the checker was started with it readable.
    pub(super) fn restart_candidate(
        &self,
        submission: &Submission,
        dir: &Path,
        artifact_dir: &Path,
        cancel: &CancellationToken,
    ) -> Result<Started, InfraError> {
        let entries =
            std::fs::read_dir(dir).map_err(InfraError::files(format!("scratch directory {}", dir.display())))?;
        for entry in entries {
            let path = entry.map_err(InfraError::files(format!("scratch directory {}", dir.display())))?.path();
            let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            removed.map_err(InfraError::files(format!("clearing {}", path.display())))?;
        }
        self.start_candidate(submission, dir, artifact_dir, cancel)
    }

    /// Runs the candidate's started process on `lane` with `spec`.
    pub(super) async fn candidate_stage(
        &self,
        started: Started,
        lane: &Lane,
        dir: &Path,
        run: CandidateRun,
        limits: CallLimits,
    ) -> Result<StageOutcome<CandidateResult>, InfraError> {
        let python = self.inner.python.as_ref().expect("validate checked the environment");
        let placement = CandidatePlacement {
            task_path: dir.join("task.py"),
            candidate_path: dir.join("candidate.py"),
            candidate_dir: dir.to_owned(),
            device: lane.device(),
            timing_cpu: python.timing_cpu(lane.gpu()),
        };
        let spec = CandidateSpec { run, placement };
        let request = Request { spec, env: python.device_env(lane.gpu()), limits: Some(limits) };
        self.stage(started, request, Some(lane)).await.map_err(InfraError::stage(Mode::Candidate))
    }

    /// The result of a candidate stage that finished cleanly with nothing found at run time; otherwise the
    /// verdict, with `response` filled in, or the evaluator's own failure.
    pub(super) fn candidate_result(
        &self,
        outcome: Result<StageOutcome<CandidateResult>, InfraError>,
        gpu: Option<usize>,
        response: &mut pb::EvaluateResponse,
    ) -> Result<Result<Report<CandidateResult>, pb::Verdict>, InfraError> {
        let outcome = outcome?;
        let quarantined = || gpu.and_then(|gpu| self.inner.lanes.quarantine_reason(gpu));
        match candidate_failure(&outcome, response) {
            Ok(None) => {}
            Ok(Some(verdict)) => {
                if let Some(reason) = quarantined() {
                    response.error.push_str(&format!("\n[the device was quarantined after this: {reason}]"));
                }
                return Ok(Err(verdict));
            }
            Err(error) => {
                return Err(match quarantined() {
                    Some(reason) => InfraError::Quarantined { source: Box::new(error), reason },
                    None => error,
                });
            }
        }
        let result = outcome.result.expect("a successful candidate stage wrote its result");
        // What the harness saw at run time: each is a hack.
        let mut findings: Vec<pb::Finding> = result
            .body
            .findings
            .iter()
            .map(|f| hack_finding(f.code.as_deref().unwrap_or("runtime.unknown"), f.message.as_deref().unwrap_or("")))
            .collect();
        if let trials @ [_, ..] = &result.body.mutated_inputs[..] {
            findings.push(hack_finding(
                "runtime.input_mutation",
                format!("the candidate modified its inputs (trials {trials:?})"),
            ));
        }
        if !findings.is_empty() {
            response.findings.extend(findings);
            return Ok(Err(pb::Verdict::Hack));
        }
        Ok(Ok(result))
    }

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
            output_bytes_budget: self.inner.config.output_bytes_budget,
            timing: Some(TimingSpec::from(&timing)),
            timing_seeds: self.seeds(task_key, "remeasure", timing.input_sets.max(1) as usize),
            census_calls: 0,
            profiled_calls: 0,
        };
        let dir = scratch.join("remeasure");
        let started = self.start_candidate(submission, &dir, artifact_dir, cancel)?;
        self.candidate_stage(started, lane, &dir, spec, self.call_limits(submission, lane.gpu())).await
    }

    /// How long each call of `submission`'s candidate may run on `gpu`: from the task's eager median where its baseline
    /// is cached, else the limit for tasks not measured yet.
    pub(super) fn call_limits(&self, submission: &Submission, gpu: Option<usize>) -> CallLimits {
        let config = &self.inner.config.call_limits;
        let reference_ms = match self.inner.baselines.get(&self.baseline_key(submission, gpu)) {
            Some(Entry::Ready(text)) => {
                Baseline::parse(&text).ok().and_then(|baseline| timing_stats(baseline.eager)).map(|s| s.median_ms)
            }
            _ => None,
        };
        call_limits(config, reference_ms)
    }
}
