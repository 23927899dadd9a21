//! One evaluation, stage by stage, on separate resources:
//!
//! 1. static checks (in this process, over a parse; no candidate code runs here);
//! 2. compile, on a bounded CPU pool, in a sandboxed child, into a content-addressed artifact cache;
//! 3. on an exclusive device lane: the candidate in a fresh sandboxed child (before any reference work), then the
//!    reference in a separate clean child (cached per task, seeds, device and versions) that also compares the
//!    candidate's saved outputs, or a clean checker child when the reference is cached;
//! 4. timing statistics from the candidate's raw samples, and baselines (eager, torch.compile) timed in a clean
//!    child and cached per task, device and versions.
//!
//! The service process never runs candidate code. Every accepted request ends in exactly one response; a failure
//! of the evaluator itself is `VERDICT_INFRA_ERROR`, never blamed on the candidate.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kforge_execution::cache::{self, Cache};
use kforge_execution::census;
use kforge_execution::devices::{self, MemberTimes, Pairing, Side};
use kforge_execution::disk::OutputPlan;
use kforge_execution::engine::{
    Backend, Engine, InfraError, RemoveOnDrop, RequestError, Submission, finding_proto, hack_finding, ms,
    out_of_memory, phases_into,
};
use kforge_execution::handoff;
use kforge_execution::protocol::{CandidateRun, KeepTimed, Sensitivity, TimingSpec};
use kforge_proto::v1 as pb;
use kforge_static_checks::{self as static_checks, Category};
use tokio_util::sync::CancellationToken;

use crate::config::EvaluatorConfig;
use crate::metrics::EvaluatorMetrics;
use crate::stats::timing_stats;

mod baseline;
mod candidate;
mod check;
mod paired;
mod request;
mod setup;
mod timing;
mod verdict;

use check::{Trial, Trials};
use request::Evaluation;
use timing::{set_speedups, timing_samples, wall_clock_mismatch};

struct Inner {
    /// Runs the candidates: shared with the profiler in one process.
    engine: Engine,
    config: EvaluatorConfig,
    /// The reference's outputs per task, seeds and device.
    references: Cache,
    /// The baselines' timing samples per task, device and versions.
    baselines: Cache,
    metrics: EvaluatorMetrics,
}

/// The evaluator: cheap to clone, shared by every request.
#[derive(Clone)]
pub struct Evaluator {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Evaluator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Evaluator").field("engine", &self.inner.engine).finish_non_exhaustive()
    }
}

impl Evaluator {
    /// What this evaluator can do: its engine's backends, devices, policies and protections.
    pub fn capabilities(&self) -> pb::GetCapabilitiesResponse {
        self.inner.engine.capabilities()
    }

    /// False while every GPU is quarantined: the service's readiness.
    pub fn readiness(&self) -> tokio::sync::watch::Receiver<bool> {
        self.inner.engine.readiness()
    }

    /// Where each GPU's time went since the engine started: alone, draining, shared, empty.
    pub fn gpu_accounts(&self) -> Vec<devices::GateAccount> {
        self.inner.engine.gpu_accounts()
    }

    /// Evaluates one request. Dropping the returned future cancels the evaluation and kills its children.
    pub async fn evaluate(&self, request: pb::EvaluateRequest) -> Result<pb::EvaluateResponse, RequestError> {
        let evaluation = self.validate(request)?;
        let engine = &self.inner.engine;
        let permit = engine.admit()?;
        let _admitted = self.inner.metrics.admitted();
        let scratch = engine.scratch_dir("");
        // Removed however the evaluation ends (including cancellation): candidate outputs can be large.
        let _cleanup = RemoveOnDrop(scratch.clone());
        let cancel = CancellationToken::new();
        let _cancel_on_drop = cancel.clone().drop_guard();
        let request_id = evaluation.submission.request_id.clone();
        let mut response = pb::EvaluateResponse { request_id, ..Default::default() };
        let mut lane_held = None;
        let (run, stage_cpu) =
            Engine::with_cpu_account(self.run(&evaluation, &scratch, &cancel, &mut response, &mut lane_held)).await;
        let verdict = match run {
            Ok(verdict) => verdict,
            Err(error) => self.infra_error(error, &mut response),
        };
        for (stage, cpu_ms) in stage_cpu {
            response.stage_ms.insert(format!("cpu.{stage}"), cpu_ms);
        }
        // The lane was released when `run` returned: its hold is the device time this evaluation took.
        if let Some((held, gate)) = lane_held {
            response.stage_ms.insert("device".into(), ms(held.elapsed()));
            self.inner.metrics.execution.stage_seconds(kforge_execution::metrics::DEVICE_LANE_STAGE, held.elapsed());
            let gate = *gate.lock().expect("never poisoned");
            response.stage_ms.insert("device.alone".into(), ms(gate.alone));
            response.stage_ms.insert("device.gate_wait".into(), ms(gate.waited));
        }
        response.verdict = verdict as i32;
        response.retryable = verdict == pb::Verdict::InfraError && response.retryable;
        self.inner.metrics.verdict(verdict, &response.findings);
        drop(permit);
        Ok(response)
    }

    /// The response to an evaluation the evaluator itself could not complete: the one place an [`InfraError`]
    /// becomes a verdict.
    fn infra_error(&self, error: InfraError, response: &mut pb::EvaluateResponse) -> pb::Verdict {
        let cause = error.cause();
        tracing::error!(%error, cause, "evaluation infrastructure error");
        self.inner.metrics.infra_error(cause);
        response.error = error.to_string();
        response.retryable = error.retryable();
        pb::Verdict::InfraError
    }

    /// Runs every stage, filling `response`; returns the verdict.
    async fn run(
        &self,
        evaluation: &Evaluation,
        scratch: &Path,
        cancel: &CancellationToken,
        response: &mut pb::EvaluateResponse,
        lane_held: &mut Option<(Instant, Arc<Mutex<MemberTimes>>)>,
    ) -> Result<pb::Verdict, InfraError> {
        let inner = &self.inner;
        let engine = &inner.engine;
        let submission = &evaluation.submission;
        let python = engine.checked_python();

        let started = Instant::now();
        let mut report = static_checks::check_candidate(&submission.candidate, submission.policy);
        report.findings.extend(static_checks::precision_downgrade(&submission.candidate, &submission.task));
        response.findings.extend(report.findings.iter().map(finding_proto));
        response.stage_ms.insert("static".into(), ms(started.elapsed()));
        if report.syntax_error {
            return Ok(pb::Verdict::CompileError);
        }
        if report.rejected() {
            return Ok(pb::Verdict::Rejected);
        }

        let stage_dirs = ["compile", "candidate", "check", "baseline", "paired"].map(|stage| scratch.join(stage));
        for dir in &stage_dirs {
            std::fs::create_dir_all(dir).map_err(InfraError::files(format!("scratch directory {}", dir.display())))?;
        }
        let [compile_dir, mut candidate_dir, check_dir, baseline_dir, paired_dir] = stage_dirs;
        let task_key = cache::key(&[submission.task.as_bytes()]);

        self.baseline_ahead(evaluation);
        self.sizes_ahead(submission, &task_key);

        // Compile: only candidates that build extensions; the rest are imported where they run. The build is
        // pinned until the evaluation ends, so eviction cannot take it meanwhile.
        let started = Instant::now();
        let built = engine.build(submission, &compile_dir, cancel, response).await?;
        if built.as_ref().map_or(true, |built| built.compiles) {
            // The build itself: time waiting for a compile worker is `queue_compile`.
            let queued = response.stage_ms.get("queue_compile").copied().unwrap_or(0.0);
            response.stage_ms.insert("compile".into(), ms(started.elapsed()) - queued);
        }
        let built = match built {
            Ok(built) => built,
            Err(verdict) => return Ok(verdict),
        };
        let (artifact_key, artifact_dir, compiles) = (&built.key, &built.dir, built.compiles);

        // The last `recheck_trials` trials run after timing and the census; the first of them replays trial 0.
        let mut seeds = engine.seeds(&task_key, "trial", (evaluation.trials + inner.config.recheck_trials) as usize);
        let recheck_from = evaluation.trials as usize;
        let replay = replay_trial(&mut seeds, recheck_from);
        let sensitivity = self.sensitivity_trial(&task_key, &mut seeds, recheck_from);
        let (init_seed, timing_seeds) = self.baseline_seeds(&task_key);
        let digest_key = engine.seeds(&task_key, "timed-digest", 1)[0];
        let trials = Trials { seeds: &seeds, init_seed, timing_seeds: &timing_seeds, sensitivity, replay, digest_key };

        // On a GPU, the task's sizes (a dry run on the meta device, once per task): the room its files take, and
        // its footprint before its reference has run. The room is reserved before the candidate starts, and held
        // until the evaluation ends: the candidate's files in memory where they fit (`handoff.rs`), else on the disk.
        // A reference cached now is protected from eviction to the evaluation's end and needs no room; a missing one
        // gets room for the new entry.
        let on_gpu = submission.backend != Backend::Cpu;
        let mut _files_room = None;
        let mut _cached_references = Vec::new();
        let mut sizes = None;
        if on_gpu {
            let started = Instant::now();
            let dry_run = scratch.join("sizes");
            let disk = engine.disk();
            // First the cached references: their entries say the outputs' size where the dry run cannot.
            let (guards, cached) = self.protect_cached_references(submission, &trials);
            _cached_references = guards;
            sizes = disk.task_sizes(&task_key, &submission.task, engine.sandbox(), python, &dry_run).await;
            let plan = OutputPlan {
                trials: u64::from(evaluation.trials + inner.config.recheck_trials),
                budget: inner.config.output_bytes_budget,
                new_reference: !cached,
            };
            let room = handoff::reserve(disk, engine.memory_files(), sizes, plan)
                .await
                .map_err(InfraError::files("the candidate's directory in memory"))?;
            response.stage_ms.insert("queue_disk".into(), ms(started.elapsed()));
            if let Some(dir) = room.memory_dir() {
                candidate_dir = dir.to_owned();
            }
            _files_room = Some(room);
        }

        // Started before the lane: the interpreter and torch load while other evaluations use the device. So does a
        // paired baseline's, which a failed candidate stops (`paired.rs`).
        let candidate_process = engine.start_candidate(submission, &candidate_dir, artifact_dir, cancel)?;
        let paired_cancel = cancel.child_token();
        let paired_process = match evaluation.measure && inner.config.paired_timing.applies(on_gpu) {
            true => Some(self.start_paired_baseline(submission, &paired_dir, &paired_cancel)?),
            false => None,
        };
        let started = Instant::now();
        let footprint = match on_gpu {
            true => engine.footprint(&task_key).or(sizes.map(|s| devices::footprint(s.input_bytes + s.output_bytes))),
            false => None,
        };
        let lane = engine.lanes().acquire(on_gpu, submission.priority, &submission.job_id, footprint).await?;
        if on_gpu {
            response.reference_peak_bytes = engine.reference_peak(&task_key).unwrap_or(0);
        }
        *lane_held = Some((Instant::now(), lane.gate_times()));
        let gpu = lane.gpu();
        response.stage_ms.insert("queue_device".into(), ms(started.elapsed()));
        response.device = python.device_name(gpu).to_owned();
        std::fs::write(check_dir.join("task.py"), &submission.task).map_err(InfraError::files("writing task.py"))?;
        // The clean process that checks the outputs starts now, while the candidate runs.
        let check = self.prepare_check(submission, &lane, &trials, &check_dir, &candidate_dir, cancel).await?;

        // The candidate first: nothing of the reference has run on this device for this evaluation.
        let started = Instant::now();
        let spec = CandidateRun {
            init_seed,
            seeds: seeds.clone(),
            recheck_from,
            sensitivity,
            replay,
            output_bytes_budget: inner.config.output_bytes_budget,
            timing: evaluation.measure.then(|| TimingSpec::from(&inner.config.timing)),
            timing_seeds: timing_seeds.clone(),
            census_calls: if evaluation.census { inner.config.census_calls } else { 0 },
            profiled_calls: 0,
            keep_timed: Some(KeepTimed::sampled(digest_key)),
        };
        let limits = self.call_limits(submission, gpu);
        // Paired: the candidate's timing rounds and its baseline's take turns, in one window.
        let pairing = paired_process.is_some().then(Pairing::new);
        let timing = match &pairing {
            Some(_) => spec.timing.map(|timing| timing.paired(inner.config.paired_timing.rounds)),
            None => spec.timing,
        };
        let candidate_run = async {
            let side = pairing.as_ref().map(|pairing| pairing.side(Side::Candidate));
            let run = CandidateRun { timing, ..spec.clone() };
            let outcome =
                engine.candidate_stage(candidate_process, &lane, &candidate_dir, run, limits.clone(), side).await;
            let timed = outcome.as_ref().is_ok_and(|o| o.result.as_ref().is_some_and(|r| !r.body.rounds.is_empty()));
            if !timed {
                paired_cancel.cancel();
            }
            outcome
        };
        let paired_run = async {
            let (started, pairing) = paired_process.zip(pairing.as_ref())?;
            let side = pairing.side(Side::Baseline);
            Some(self.paired_baseline(started, &lane, side, init_seed, &timing_seeds, &paired_dir).await)
        };
        let (mut candidate, paired_outcome) = tokio::join!(candidate_run, paired_run);
        if lane.shared() && candidate.as_ref().is_ok_and(out_of_memory) {
            // Another evaluation on the device may have held the memory it needed: once more, with the device to
            // itself. A candidate that needs more than the device has fails again, alone.
            lane.go_solo();
            response.findings.push(pb::Finding {
                code: "device.retried_alone".into(),
                message: "the candidate ran out of device memory while sharing the device; it ran again alone".into(),
                line: 0,
                category: pb::FindingCategory::Notice as i32,
            });
            let process = engine.restart_candidate(submission, &candidate_dir, artifact_dir, cancel)?;
            candidate = engine.candidate_stage(process, &lane, &candidate_dir, spec, limits.clone(), None).await;
        }
        response.stage_ms.insert("run".into(), ms(started.elapsed()));
        let result = match engine.candidate_result(candidate, gpu, response)? {
            Ok(result) => result,
            Err(verdict) => return Ok(verdict),
        };
        phases_into(&result, "run", &mut response.stage_ms);
        let result = result.body;
        response.device_peak_bytes = result.device_peak_bytes.unwrap_or(0);
        // What competition for the CPU cost the timed loop's launching thread (0 when nothing competed), and on a
        // GPU its launches against the cover.
        if let Some(timing_cpu) = &result.timing_cpu {
            response.stage_ms.extend(timing_cpu.stage_ms().map(|(key, ms)| (key.to_owned(), ms)));
            response.findings.extend(timing::launch_exposed(timing_cpu));
        }

        // Correctness, in a clean process.
        let started = Instant::now();
        // The outputs of the timed calls kept (the last and a random sample) are checked too, on rebuilt inputs.
        let timed_outputs = if evaluation.measure {
            match timing::timed_outputs(&result) {
                Ok(calls) => calls,
                Err(finding) => {
                    response.findings.push(finding);
                    return Ok(pb::Verdict::Hack);
                }
            }
        } else {
            vec![]
        };
        let checked = self.check(check, &lane, timed_outputs, &mut response.stage_ms).await;
        response.stage_ms.insert("check".into(), ms(started.elapsed()));
        if let Ok((_, Some(compared))) = &checked
            && *compared < seeds.len()
        {
            response.findings.push(pb::Finding {
                code: "check.trials_limited".into(),
                message: format!(
                    "the outputs are large: {compared} of {} trials were compared (output_bytes_budget)",
                    seeds.len()
                ),
                line: 0,
                category: pb::FindingCategory::Notice as i32,
            });
        }
        match checked.map(|(mismatch, _)| mismatch) {
            Ok(None) => {}
            Ok(Some((trial, mismatch))) => {
                response.mismatch = Some(mismatch);
                let changed = match trial {
                    Trial::Timed => Some((
                        "runtime.timed_output_mismatch",
                        "the output of a timed call is wrong although the correctness trials, the replay of trial \
                         0 and the re-checks passed: the work done under measurement differs from the work that was \
                         checked"
                            .to_owned(),
                    )),
                    // A re-check's mismatch on fresh inputs, or the replay's near the tolerance, may be rounding:
                    // INCORRECT, as on a first trial.
                    Trial::Changed(index) => Some((
                        "runtime.changed_after_check",
                        format!(
                            "trial {index} repeats trial 0's inputs after timing and the census, and its output is \
                             far outside the tolerance although trial 0's was within it"
                        ),
                    )),
                    Trial::Index(_) => None,
                };
                let Some((code, message)) = changed else { return Ok(pb::Verdict::Incorrect) };
                response.findings.push(hack_finding(code, message));
                return Ok(pb::Verdict::Hack);
            }
            Err(error) => return Err(error),
        }

        if evaluation.measure {
            let started = Instant::now();
            let measured = match timing_samples(&result) {
                Ok(measured) => measured,
                Err(finding) => {
                    response.findings.push(finding);
                    return Ok(pb::Verdict::Hack);
                }
            };
            let cached = self.baseline(submission, &lane, init_seed, &timing_seeds, &baseline_dir, cancel).await?;
            // Paired: the eager samples are the paired baseline's, timed in the candidate's window.
            let (baseline, paired) = paired::reference(&cached, paired_outcome, (&measured.events, &result.rounds));
            if let Some(finding) = wall_clock_mismatch(&measured, &baseline) {
                response.findings.push(finding);
                return Ok(pb::Verdict::Hack);
            }
            response.eager_timing = timing_stats(baseline.eager.clone());
            // What a profile of the task on this device takes its call limits from.
            if let Some(eager) = timing_stats(cached.eager.clone()) {
                engine.note_eager_median(&task_key, gpu, eager.median_ms);
            }
            response.compile_timing = baseline.compiled.clone().and_then(timing_stats);
            response.candidate_timing = timing_stats(measured.events.clone());
            set_speedups(response);
            paired::record(response, paired, pairing.is_some(), inner.config.paired_timing.spread_bound);
            response.stage_ms.insert("timing".into(), ms(started.elapsed()));

            // An implausible speedup is measured again in a fresh process, on inputs the first never saw; the
            // slower of the two counts. Whatever made the first process fast must then work twice, from scratch.
            let bound = inner.config.plausible_speedup;
            if bound > 0.0 && response.speedup_eager > bound {
                let started = Instant::now();
                let first = response.speedup_eager;
                let again =
                    self.remeasure(submission, &lane, &task_key, init_seed, artifact_dir, scratch, cancel).await;
                response.stage_ms.insert("remeasure".into(), ms(started.elapsed()));
                let result = match engine.candidate_result(again, gpu, response)? {
                    Ok(result) => result,
                    Err(verdict) => return Ok(verdict),
                };
                let again = match timing_samples(&result.body) {
                    Ok(again) => again,
                    Err(finding) => {
                        response.findings.push(finding);
                        return Ok(pb::Verdict::Hack);
                    }
                };
                if let Some(finding) = wall_clock_mismatch(&again, &baseline) {
                    response.findings.push(finding);
                    return Ok(pb::Verdict::Hack);
                }
                let again = timing_stats(again.events);
                let medians =
                    (response.candidate_timing.as_ref().map(|t| t.median_ms), again.as_ref().map(|t| t.median_ms));
                if let (Some(first_ms), Some(again_ms)) = medians {
                    if again_ms > first_ms {
                        response.candidate_timing = again;
                        // The speedups, paired or not, scaled to the slower measurement.
                        response.speedup_eager *= first_ms / again_ms;
                        response.speedup_compile *= first_ms / again_ms;
                    }
                    response.findings.push(pb::Finding {
                        code: "timing.remeasured".into(),
                        message: format!(
                            "a speedup of {first:.1}x over eager is above the plausibility bound of {bound}x: \
                             measured again in a fresh process on new inputs ({first_ms:.4} ms, then {again_ms:.4} \
                             ms); the slower counts"
                        ),
                        line: 0,
                        category: pb::FindingCategory::Notice as i32,
                    });
                }
            }
        }
        if let Some(records) = result.census {
            let mut modes = match records {
                Ok(modes) => modes,
                Err(error) => {
                    response.findings.push(hack_finding(
                        "runtime.census_unreadable",
                        format!("the census records are malformed: {error}"),
                    ));
                    return Ok(pb::Verdict::Hack);
                }
            };
            let own = census::own_kernels(&submission.candidate, built.kernels.as_ref(), result.jit_kernels.as_deref());
            if !own.from_source.is_empty() {
                tracing::warn!(why = ?own.from_source, "own kernel names read from the candidate's source");
            }
            let median = response.candidate_timing.as_ref().map(|t| t.median_ms);
            let candidate =
                census::Candidate { kernels: &own.names, compiles, median_ms: median, policy: submission.policy };
            let census = census::analyse(&modes, candidate, gpu.is_some());
            if on_gpu {
                let records = census::Records { modes: std::mem::take(&mut modes), jit_kernels: result.jit_kernels };
                engine.censuses().put(artifact_key, &task_key, Arc::new(records));
            }
            response.kernels = census.kernels;
            response.profiling_ratio = census.profiling_ratio;
            let hack = census.findings.iter().any(|f| f.category == Category::Hack);
            response.findings.extend(census.findings.iter().map(finding_proto));
            if hack {
                return Ok(pb::Verdict::Hack);
            }
        }
        Ok(pb::Verdict::Correct)
    }

    /// Starts the task's dry run (`disk.rs`, once per task) on a GPU now, beside the compile, in a scratch
    /// directory of its own: the evaluation waits for it only after its compile, and one that ends early leaves it
    /// to finish for the next.
    fn sizes_ahead(&self, submission: &Submission, task_key: &str) {
        if submission.backend == Backend::Cpu {
            return;
        }
        let engine = self.inner.engine.clone();
        let scratch = engine.scratch_dir("sizes-");
        let (task_key, task) = (task_key.to_owned(), submission.task.clone());
        tokio::spawn(async move {
            let _cleanup = RemoveOnDrop(scratch.clone());
            let python = engine.checked_python();
            engine.disk().task_sizes(&task_key, &task, engine.sandbox(), python, &scratch).await;
        });
    }

    /// Picks the sensitivity trial among the first `trials` (not trial 0, its base), from the secret per task, and
    /// gives it trial 0's seed: the harness moves a few of those inputs far out of range (`perturb_sparsely`) and
    /// the check compares how both outputs moved. None when disabled or with fewer than two first trials.
    fn sensitivity_trial(&self, task_key: &str, seeds: &mut [u64], trials: usize) -> Option<Sensitivity> {
        if !self.inner.config.sensitivity_check || trials < 2 {
            return None;
        }
        let drawn = self.inner.engine.seeds(task_key, "sensitivity", 2);
        let trial = 1 + drawn[0] as usize % (trials - 1);
        seeds[trial] = seeds[0];
        Some(Sensitivity { trial, base: 0, seed: drawn[1] })
    }
}

/// Gives the first re-check (trial `recheck_from`, run after timing and the census) trial 0's seed: on the inputs
/// trial 0 passed, an output far outside the tolerance is changed behaviour, not rounding on new inputs. Its index,
/// or None without a first trial or a re-check.
fn replay_trial(seeds: &mut [u64], recheck_from: usize) -> Option<usize> {
    if recheck_from == 0 || recheck_from >= seeds.len() {
        return None;
    }
    seeds[recheck_from] = seeds[0];
    Some(recheck_from)
}

#[cfg(test)]
mod tests {
    use super::replay_trial;

    #[test]
    fn the_first_recheck_replays_trial_zero_and_later_ones_keep_their_seeds() {
        let mut seeds = vec![10, 11, 12, 13, 14];
        assert_eq!(replay_trial(&mut seeds, 3), Some(3));
        assert_eq!(seeds, vec![10, 11, 12, 10, 14]);
        let mut no_recheck = vec![10, 11, 12];
        assert_eq!(replay_trial(&mut no_recheck, 3), None);
        assert_eq!(no_recheck, vec![10, 11, 12]);
        let mut no_first_trial = vec![10, 11];
        assert_eq!(replay_trial(&mut no_first_trial, 0), None);
        assert_eq!(no_first_trial, vec![10, 11]);
    }
}
