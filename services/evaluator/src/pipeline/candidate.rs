//! The candidate's stage as the evaluator runs it on the engine's (`Engine::candidate_stage`): its run on the lane,
//! paired with its baseline's where timing is paired and again alone after running out of device memory beside
//! others; the census its run reported; the remeasure of an implausible speedup in a fresh process; and the call
//! limits from the task's cached baseline.

use std::sync::Arc;
use std::time::Instant;

use kforge_execution::cache::Entry;
use kforge_execution::census;
use kforge_execution::devices::{Lane, Pairing, Side};
use kforge_execution::engine::{Backend, InfraError, Submission, out_of_memory};
use kforge_execution::protocol::{BaselineResult, CandidateResult, CandidateRun, KeepTimed, TimingSpec};
use kforge_execution::stage::{CallLimits, StageOutcome, Started};
use kforge_execution::times::Stage;
use kforge_execution::{Finding, Judgement, Notes, Staged, Stop};
use tokio_util::sync::CancellationToken;

use super::baseline::Baseline;
use super::{Evaluating, Evaluator, timing};
use crate::stats::timing_stats;

/// The processes an evaluation starts before its lane: the candidate's, and its paired baseline's where timing is
/// paired (stopped through `paired_cancel` when the candidate's run is not timed).
#[derive(Debug)]
pub(super) struct Processes {
    pub(super) candidate: Started,
    pub(super) paired: Option<Started>,
    pub(super) paired_cancel: CancellationToken,
}

/// What the candidate's stage produced: its result, and the outcome of the paired baseline beside it, where
/// pairing was asked for.
#[derive(Debug)]
pub(super) struct Ran {
    pub(super) result: CandidateResult,
    pub(super) paired: Option<Result<StageOutcome<BaselineResult>, InfraError>>,
}

impl Evaluator {
    /// Runs the candidate's started process on `lane`: its trials, its timing (its rounds alternating with the
    /// paired baseline's, where timing is paired), its census and its re-checks. A candidate out of device memory
    /// on a shared device runs once more with the device to itself. Its notes: `run` and its phases, the times of
    /// the timed loop's launching thread, and notices; the evaluation stops here when the candidate's stage did not
    /// finish cleanly or found a hack at run time.
    pub(super) async fn run_candidate(&self, run: &Evaluating<'_>, lane: &Lane, processes: Processes) -> Staged<Ran> {
        let (inner, engine) = (&self.inner, &self.inner.engine);
        let (submission, trials, candidate_dir) = (&run.evaluation.submission, &run.trials, &run.dirs.candidate);
        let started = Instant::now();
        let mut notes = Notes::default();
        let spec = CandidateRun {
            init_seed: trials.init_seed,
            seeds: trials.seeds.clone(),
            recheck_from: trials.recheck_from,
            sensitivity: trials.sensitivity,
            replay: trials.replay,
            output_bytes_budget: inner.config.output_bytes_budget,
            timing: run.evaluation.measure.then(|| TimingSpec::from(&inner.config.timing)),
            timing_seeds: trials.timing_seeds.clone(),
            census_calls: if run.evaluation.census { inner.config.census_calls } else { 0 },
            profiled_calls: 0,
            keep_timed: Some(KeepTimed::sampled(trials.digest_key)),
        };
        let limits = self.call_limits(submission, lane.gpu());
        // Paired: the candidate's timing rounds and its baseline's take turns, in one window.
        let pairing = processes.paired.is_some().then(Pairing::new);
        let timing = match &pairing {
            Some(_) => spec.timing.map(|timing| timing.paired(inner.config.paired_timing.rounds)),
            None => spec.timing,
        };
        let candidate_run = async {
            let side = pairing.as_ref().map(|pairing| pairing.side(Side::Candidate));
            let run = CandidateRun { timing, ..spec.clone() };
            let outcome =
                engine.candidate_stage(processes.candidate, lane, candidate_dir, run, limits.clone(), side).await;
            let timed = outcome.as_ref().is_ok_and(|o| o.result.as_ref().is_some_and(|r| !r.body.rounds.is_empty()));
            if !timed {
                processes.paired_cancel.cancel();
            }
            outcome
        };
        let paired_run = async {
            let (started, pairing) = processes.paired.zip(pairing.as_ref())?;
            let side = pairing.side(Side::Baseline);
            let (init_seed, paired_dir) = (trials.init_seed, &run.dirs.paired);
            Some(self.paired_baseline(started, lane, side, init_seed, &trials.timing_seeds, paired_dir).await)
        };
        let (mut candidate, paired) = tokio::join!(candidate_run, paired_run);
        let outcome = async {
            if lane.shared() && candidate.as_ref().is_ok_and(out_of_memory) {
                // Another evaluation on the device may have held the memory it needed: once more, with the device
                // to itself. A candidate that needs more than the device has fails again, alone.
                lane.go_solo();
                notes.findings.push(Finding::notice(
                    "device.retried_alone",
                    "the candidate ran out of device memory while sharing the device; it ran again alone",
                ));
                let artifact_dir = &run.built.dir;
                let process = engine.restart_candidate(submission, candidate_dir, artifact_dir, run.cancel)?;
                candidate = engine.candidate_stage(process, lane, candidate_dir, spec, limits, None).await;
            }
            notes.times.since(Stage::Run, started);
            let result = engine.candidate_result(candidate, lane.gpu())?;
            notes.times.phases(Stage::Run, &result);
            let result = result.body;
            // What competition for the CPU cost the timed loop's launching thread (0 when nothing competed), and
            // on a GPU its launches against the cover.
            if let Some(timing_cpu) = &result.timing_cpu {
                for (phase, ms) in timing_cpu.phases() {
                    notes.times.insert_phase(Stage::Run, phase, ms);
                }
                notes.findings.extend(timing::launch_exposed(timing_cpu));
            }
            Ok::<_, Stop>(Ran { result, paired })
        }
        .await;
        Staged::new(notes, outcome)
    }

    /// The census of the candidate's run, when it ran: analysed by the candidate's policy against its own kernels,
    /// its records kept for a profile of the build on a GPU. A malformed one stops the evaluation as a hack.
    pub(super) fn census(
        &self,
        run: &Evaluating<'_>,
        result: CandidateResult,
        median_ms: Option<f64>,
        gpu: Option<usize>,
    ) -> Result<Option<census::Census>, Judgement> {
        let Some(records) = result.census else { return Ok(None) };
        let mut modes = super::verdict::census_records(records)?;
        let (submission, built) = (&run.evaluation.submission, &run.built);
        let own = census::own_kernels(&submission.candidate, built.kernels.as_ref(), result.jit_kernels.as_deref());
        if !own.from_source.is_empty() {
            tracing::warn!(why = ?own.from_source, "own kernel names read from the candidate's source");
        }
        let candidate =
            census::Candidate { kernels: &own.names, compiles: built.compiles, median_ms, policy: submission.policy };
        let analysed = census::analyse(&modes, candidate, gpu.is_some());
        if submission.backend != Backend::Cpu {
            let records = census::Records { modes: std::mem::take(&mut modes), jit_kernels: result.jit_kernels };
            self.inner.engine.censuses().put(&built.key, &run.task_key, Arc::new(records));
        }
        Ok(Some(analysed))
    }

    /// An implausible speedup (above `plausible_speedup`) measured again in a fresh process, on inputs the first
    /// never saw: whatever made the first process fast must then work twice, from scratch. The statistics of the
    /// second measurement, if there was one (`Timing::take_slower` keeps the slower); its note: `remeasure`.
    pub(super) async fn remeasure_if_implausible(
        &self,
        run: &Evaluating<'_>,
        lane: &Lane,
        first: &super::Timing,
    ) -> Staged<Option<crate::stats::TimingStats>> {
        let bound = self.inner.config.plausible_speedup;
        let mut notes = Notes::default();
        if !(bound > 0.0 && first.speedup_eager > bound) {
            return Staged::new(notes, Ok(None));
        }
        let started = Instant::now();
        let again = self.remeasure(run, lane).await;
        notes.times.since(Stage::Remeasure, started);
        let judged = |against: &Baseline| -> Result<_, Stop> {
            let result = self.inner.engine.candidate_result(again, lane.gpu())?;
            let again = super::verdict::samples(&result.body)?;
            super::verdict::wall_clock(&again, against)?;
            Ok(timing_stats(again.events))
        };
        Staged::new(notes, judged(&first.against))
    }

    /// The candidate's timing alone, in a fresh child, on timing inputs of their own.
    async fn remeasure(&self, run: &Evaluating<'_>, lane: &Lane) -> Result<StageOutcome<CandidateResult>, InfraError> {
        let timing = self.inner.config.timing;
        let engine = &self.inner.engine;
        // No trials (their budget and sensitivity trial go unread): timing alone.
        let spec = CandidateRun {
            init_seed: run.trials.init_seed,
            seeds: vec![],
            recheck_from: 0,
            sensitivity: None,
            replay: None,
            output_bytes_budget: self.inner.config.output_bytes_budget,
            timing: Some(TimingSpec::from(&timing)),
            timing_seeds: engine.seeds(&run.task_key, "remeasure", timing.input_sets.max(1) as usize),
            census_calls: 0,
            profiled_calls: 0,
            keep_timed: None,
        };
        let submission = &run.evaluation.submission;
        let dir = run.dirs.scratch.join("remeasure");
        let started = engine.start_candidate(submission, &dir, &run.built.dir, run.cancel)?;
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
