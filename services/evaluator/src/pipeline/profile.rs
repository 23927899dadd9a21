//! A profile job: a candidate checked and compiled exactly as an evaluation does it (the same static checks, the
//! same artifact cache), then run on one device lease: its kernel census (the evaluator's definition and own-kernel
//! rule; the one kept from the latest evaluation or profile of the same build on the same task, else a stage of its
//! own), then its profiled calls in a stage that a launcher wraps (Nsight Compute, for the Profiler service). No
//! outputs are compared and nothing is timed: correctness and speed are the evaluation's.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kforge_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

use super::verdict::{finding_proto, hack_finding};
use super::{Backend, Evaluator, InfraError, RemoveOnDrop, RequestError, Submission, ms, phases_into};
use crate::cache;
use crate::census::{self, ModeRecords};
use crate::protocol::CandidateRun;
use crate::stage::{CallLimits, Started};
use crate::static_checks::{self, Category};

/// What runs the profiled stage's interpreter, and what it needs of the sandbox.
#[derive(Debug, Clone, Default)]
pub struct Launcher {
    /// The program and its arguments, before the interpreter (`ncu ... -o DIR/report`).
    pub argv: Vec<OsString>,
    /// Files it reads: its installation.
    pub readable: Vec<PathBuf>,
    /// What it writes: its output directory (report, home and temporary files; the caller's, kept after the job)
    /// and whatever else it needs beyond the stage's scratch.
    pub writable: Vec<PathBuf>,
    /// Environment it needs, over the stage's.
    pub env: Vec<(OsString, OsString)>,
}

/// One candidate to profile.
#[derive(Debug, Clone)]
pub struct ProfileJob {
    pub request_id: String,
    pub task: pb::Task,
    pub candidate: String,
    pub backend: pb::Backend,
    /// Static policy by name; empty selects the evaluator's default.
    pub policy: String,
    pub priority: i32,
    pub job_id: String,
    /// Launches of the candidate's own kernels the launcher profiles (it stops there): enough forward calls run
    /// under it to make them, by the census's count of own launches per call, after one untimed warm-up call. 0:
    /// no profiled stage (the census alone).
    pub launch_limit: u32,
    /// How long the profiled stage may run.
    pub wall: Duration,
    pub launcher: Launcher,
}

/// What a profile job found: the response's verdict, findings, logs, census and stage times (the launcher's own
/// output is the caller's to read), and the GPU it ran on.
#[derive(Debug)]
pub struct Profiled {
    pub response: pb::ProfileResponse,
    pub gpu: Option<usize>,
    /// The candidate's own kernel names (`static_checks::own_kernel_names`), as the census counts them.
    pub own_kernels: Vec<String>,
}

impl Evaluator {
    /// The kernels a candidate defines itself, by the rule the census uses: what a profiler restricts itself to.
    pub fn own_kernel_names(candidate: &str) -> Vec<String> {
        static_checks::own_kernel_names(candidate)
    }

    /// Runs one profile job. Dropping the returned future cancels it and kills its children.
    pub async fn profile(&self, job: ProfileJob) -> Result<Profiled, RequestError> {
        let submission = self.validate(pb::EvaluateRequest {
            request_id: job.request_id.clone(),
            task: Some(job.task.clone()),
            candidate_source: job.candidate.clone(),
            backend: job.backend as i32,
            policy: job.policy.clone(),
            correctness_trials: 1,
            measure_performance: false,
            census: true,
            idempotency_key: String::new(),
            priority: job.priority,
            job_id: job.job_id.clone(),
        })?;
        if submission.backend == Backend::Cpu {
            return Err(RequestError::Invalid {
                field: "backend".into(),
                reason: "a CPU candidate has no device kernels to profile: ask for CUDA or Triton on a GPU".into(),
            });
        }
        let permit = self.inner.admission.clone().try_acquire_owned().map_err(|_| RequestError::QueueFull {
            capacity: self.inner.config.queue_capacity,
            retry_after_secs: 30,
        })?;
        let scratch = self.scratch_dir("profile-");
        let _cleanup = RemoveOnDrop(scratch.clone());
        let cancel = CancellationToken::new();
        let _cancel_on_drop = cancel.clone().drop_guard();
        let mut evaluation = pb::EvaluateResponse::default();
        let mut ran = Ran::default();
        let run = self.profile_stages(&submission, &job, &scratch, &cancel, &mut evaluation, &mut ran).await;
        let verdict = match run {
            Ok(verdict) => verdict,
            Err(error) => {
                tracing::error!(%error, cause = error.cause(), "profile infrastructure error");
                evaluation.error = error.to_string();
                evaluation.retryable = error.retryable();
                pb::Verdict::InfraError
            }
        };
        drop(permit);
        let response = pb::ProfileResponse {
            request_id: job.request_id,
            verdict: verdict as i32,
            findings: evaluation.findings,
            compile_log: evaluation.compile_log,
            error: evaluation.error,
            census: evaluation.kernels,
            profiling_ratio: evaluation.profiling_ratio,
            stage_ms: evaluation.stage_ms,
            retryable: verdict == pb::Verdict::InfraError && evaluation.retryable,
            census_reused: ran.census_reused,
            ..Default::default()
        };
        Ok(Profiled { response, gpu: ran.gpu, own_kernels: Evaluator::own_kernel_names(&submission.candidate) })
    }

    /// The job's stages, filling `evaluation` as an evaluation would be; the verdict.
    async fn profile_stages(
        &self,
        submission: &Submission,
        job: &ProfileJob,
        scratch: &Path,
        cancel: &CancellationToken,
        evaluation: &mut pb::EvaluateResponse,
        ran: &mut Ran,
    ) -> Result<pb::Verdict, InfraError> {
        let inner = &self.inner;
        let started = Instant::now();
        let report = static_checks::check_candidate(&submission.candidate, submission.policy);
        evaluation.findings.extend(report.findings.iter().map(finding_proto));
        evaluation.stage_ms.insert("static".into(), ms(started.elapsed()));
        if report.syntax_error {
            return Ok(pb::Verdict::CompileError);
        }
        if report.rejected() {
            return Ok(pb::Verdict::Rejected);
        }
        let dirs = ["compile", "census", "profiled"].map(|stage| scratch.join(stage));
        for dir in &dirs {
            std::fs::create_dir_all(dir).map_err(InfraError::files(format!("scratch directory {}", dir.display())))?;
        }
        let [compile_dir, census_dir, profiled_dir] = dirs;
        let (artifact_key, compiles) = self.artifact_key(submission);
        let artifact_dir = inner.artifacts.dir(&artifact_key);
        let mut _artifact_pin = None;
        if compiles {
            let started = Instant::now();
            if let Some(verdict) = self.compile(submission, &artifact_key, &compile_dir, cancel, evaluation).await? {
                return Ok(verdict);
            }
            evaluation.stage_ms.insert("compile".into(), ms(started.elapsed()));
            match inner.artifacts.pin(&artifact_key).await {
                Ok(pin) if inner.artifacts.get(&artifact_key).is_some() => _artifact_pin = Some(pin),
                Ok(_) => return Err(InfraError::Evicted { what: "compiled artifact" }),
                Err(error) => return Err(InfraError::cache("artifact pin")(error)),
            }
        } else {
            _artifact_pin = Some(self.jit_cache(&artifact_key).await?);
        }
        let task_key = cache::key(&[submission.task.as_bytes()]);
        // The census of this build on this task when an evaluation or a profile just ran it; otherwise a stage of
        // its own. Both processes start before the lane: their interpreters and torch load off the device's time.
        let census_from = match inner.censuses.get(&artifact_key, &task_key) {
            Some(modes) => CensusFrom::Kept(modes),
            None => CensusFrom::Stage(self.start_candidate(submission, &census_dir, &artifact_dir, cancel)?),
        };
        let profiled_process = match job.launch_limit {
            0 => None,
            _ => {
                Some(self.start_profiled(submission, &profiled_dir, &artifact_dir, &job.launcher, job.wall, cancel)?)
            }
        };
        let started = Instant::now();
        let footprint = self.footprint(&task_key);
        let lane = inner.lanes.acquire(true, submission.priority, &submission.job_id, footprint).await?;
        // Counters of a kernel that shares its SMs with another process's say little: the device is this job's.
        lane.go_solo();
        evaluation.stage_ms.insert("queue_device".into(), ms(started.elapsed()));
        ran.gpu = lane.gpu();
        let (init_seed, timing_seeds) = self.baseline_seeds(&task_key);
        let run = |census_calls, profiled_calls| CandidateRun {
            init_seed,
            seeds: vec![],
            recheck_from: 0,
            sensitivity: None,
            output_bytes_budget: inner.config.output_bytes_budget,
            timing: None,
            timing_seeds: timing_seeds[..1].to_vec(),
            census_calls,
            profiled_calls,
        };

        let census_calls = inner.config.census_calls.max(1);
        let modes = match census_from {
            CensusFrom::Kept(modes) => {
                ran.census_reused = true;
                modes
            }
            CensusFrom::Stage(process) => {
                let started = Instant::now();
                let limits = self.call_limits(submission, lane.gpu());
                let outcome = self.candidate_stage(process, &lane, &census_dir, run(census_calls, 0), limits).await;
                evaluation.stage_ms.insert("census".into(), ms(started.elapsed()));
                let result = match self.candidate_result(outcome, lane.gpu(), evaluation)? {
                    Ok(result) => result,
                    Err(verdict) => return Ok(verdict),
                };
                phases_into(&result, "census", evaluation);
                match result.body.census {
                    Some(Ok(modes)) if !modes.is_empty() => {
                        let modes = Arc::new(modes);
                        inner.censuses.put(&artifact_key, &task_key, modes.clone());
                        modes
                    }
                    unreadable => {
                        let why = match unreadable {
                            Some(Err(error)) => error,
                            _ => "none were written".to_owned(),
                        };
                        evaluation.findings.push(hack_finding(
                            "runtime.census_unreadable",
                            format!("the census records are malformed: {why}"),
                        ));
                        return Ok(pb::Verdict::Hack);
                    }
                }
            }
        };
        let own_kernels = Evaluator::own_kernel_names(&submission.candidate);
        let candidate =
            census::Candidate { kernels: &own_kernels, compiles, median_ms: None, policy: submission.policy };
        let census = census::analyse(&modes, candidate, true);
        // The measured mode's kernels: what the profiled calls run.
        evaluation.kernels = census.kernels.into_iter().filter(|k| k.mode == modes[0].mode).collect();
        evaluation.profiling_ratio = census.profiling_ratio;
        evaluation.findings.extend(census.findings.iter().map(finding_proto));
        if census.findings.iter().any(|f| f.category == Category::Hack) {
            return Ok(pb::Verdict::Hack);
        }

        let Some(profiled_process) = profiled_process else { return Ok(pb::Verdict::Correct) };
        let profiled_calls = profiled_calls(job.launch_limit, &evaluation.kernels, census_calls);
        let started = Instant::now();
        // A profiled call replays each kernel once per pass: its limit is the stage's.
        let limits = CallLimits { call: job.wall, busy: job.wall, basis: "the profile's run limit".into() };
        let outcome =
            self.candidate_stage(profiled_process, &lane, &profiled_dir, run(0, profiled_calls), limits).await;
        evaluation.stage_ms.insert("profiled".into(), ms(started.elapsed()));
        match self.candidate_result(outcome, lane.gpu(), evaluation)? {
            Ok(result) => {
                phases_into(&result, "profiled", evaluation);
                Ok(pb::Verdict::Correct)
            }
            Err(verdict) => Ok(verdict),
        }
    }

    /// Starts the profiled stage's process in `dir`, its interpreter run by `launcher`.
    fn start_profiled(
        &self,
        submission: &Submission,
        dir: &Path,
        artifact_dir: &Path,
        launcher: &Launcher,
        wall: Duration,
        cancel: &CancellationToken,
    ) -> Result<Started, InfraError> {
        let mut stage = self.candidate_process(submission, dir, artifact_dir)?;
        stage.launcher.clone_from(&launcher.argv);
        stage.readable.extend(launcher.readable.iter().cloned());
        stage.writable.extend(launcher.writable.iter().cloned());
        stage.env.extend(launcher.env.iter().cloned());
        stage.wall = wall;
        Ok(self.start(stage, cancel))
    }
}

/// Where a profile job's census comes from: kept from the latest evaluation or profile, or a stage of its own.
enum CensusFrom {
    Kept(Arc<Vec<ModeRecords>>),
    Stage(Started),
}

/// Where a profile job ran, and whether it measured its census or reused one.
#[derive(Debug, Default)]
struct Ran {
    gpu: Option<usize>,
    census_reused: bool,
}

/// Forward calls that make `launch_limit` launches of the candidate's own kernels, by the census's count of them
/// (`census_calls` calls in the measured mode): at least one, at most `launch_limit`.
fn profiled_calls(launch_limit: u32, census: &[pb::KernelRecord], census_calls: u32) -> u32 {
    let own: u64 = census.iter().filter(|k| k.own).map(|k| k.launches).sum();
    let per_call = own.div_ceil(u64::from(census_calls.max(1))).max(1);
    u64::from(launch_limit).div_ceil(per_call).clamp(1, u64::from(launch_limit.max(1))) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(name: &str, own: bool, launches: u64) -> pb::KernelRecord {
        pb::KernelRecord { name: name.into(), own, launches, total_ms: 1.0, mode: "train/no_grad".into() }
    }

    #[test]
    fn enough_calls_run_to_reach_the_launch_limit_and_no_more() {
        // Two census calls, three own launches each: ten launches take four calls.
        let census = [kernel("a", true, 4), kernel("b", true, 2), kernel("at::add", false, 50)];
        assert_eq!(profiled_calls(10, &census, 2), 4);
        assert_eq!(profiled_calls(3, &census, 2), 1);
        // No own launch seen: one launch per call is assumed, up to the limit.
        assert_eq!(profiled_calls(5, &[kernel("at::add", false, 8)], 2), 5);
        assert_eq!(profiled_calls(1, &[], 0), 1);
    }
}
