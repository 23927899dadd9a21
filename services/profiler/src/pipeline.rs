//! A profile run on the execution engine: a candidate checked and compiled exactly as an evaluation does it (the
//! same static checks, the same artifact cache), then run on one device lease: its kernel census (the evaluator's
//! definition and own-kernel rule; the one kept from the latest evaluation or profile of the same build on the
//! same task, else a stage of its own), then its profiled calls in a stage that a launcher wraps (Nsight Compute).
//! No outputs are compared and nothing is timed: correctness and speed are the evaluation's.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kforge_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

use kforge_execution::cache;
use kforge_execution::census;
use kforge_execution::engine::{
    Backend, Engine, InfraError, RemoveOnDrop, RequestError, Submission, SubmissionRequest, finding_proto,
    hack_finding, ms, phases_into,
};
use kforge_execution::protocol::CandidateRun;
use kforge_execution::stage::{CallLimits, Started};
use kforge_static_checks::{self as static_checks, Category};

/// The launcher's command line for the candidate's own kernels (by function name): the program and its arguments,
/// before the interpreter (`ncu ... -o DIR/report`).
pub type LauncherArgv = Arc<dyn Fn(&[String]) -> Vec<OsString> + Send + Sync>;

/// What runs the profiled stage's interpreter, and what it needs of the sandbox.
#[derive(Clone)]
pub struct Launcher {
    pub argv: LauncherArgv,
    /// Files it reads: its installation.
    pub readable: Vec<PathBuf>,
    /// What it writes: its output directory (report, home and temporary files; the caller's, kept after the job)
    /// and whatever else it needs beyond the stage's scratch.
    pub writable: Vec<PathBuf>,
    /// Environment it needs, over the stage's.
    pub env: Vec<(OsString, OsString)>,
}

impl std::fmt::Debug for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launcher")
            .field("argv", &(self.argv)(&["<own kernels>".to_owned()]))
            .field("readable", &self.readable)
            .field("writable", &self.writable)
            .field("env", &self.env)
            .finish()
    }
}

/// One candidate to profile, as the profiler runs it.
#[derive(Debug, Clone)]
pub struct ProfileRun {
    pub request_id: String,
    pub task: pb::Task,
    pub candidate: String,
    pub backend: pb::Backend,
    /// Static policy by name; empty selects the engine's default.
    pub policy: String,
    pub priority: i32,
    pub job_id: String,
    /// Launches of the candidate's own kernels the launcher profiles (it stops there): enough forward calls run
    /// under it to make them, by the census's count of own launches per call, after one untimed warm-up call. 0,
    /// or a candidate with no kernel of its own: no profiled stage (the census alone).
    pub launch_limit: u32,
    /// How long the profiled stage may run.
    pub wall: Duration,
    pub launcher: Launcher,
}

/// What a profile run found: the response's verdict, findings, logs, census and stage times (the launcher's own
/// output is the caller's to read), and the GPU it ran on.
#[derive(Debug)]
pub struct Profiled {
    pub response: pb::ProfileResponse,
    pub gpu: Option<usize>,
    /// The candidate's own kernels (`census::own_kernels`), as the census counted them; empty when the run ended
    /// before they were known.
    pub own_kernels: Vec<String>,
}

/// Runs one profile run on `engine`. Dropping the returned future cancels it and kills its children.
pub async fn profile(engine: &Engine, run: ProfileRun) -> Result<Profiled, RequestError> {
    let submission = engine.submission(SubmissionRequest {
        request_id: run.request_id.clone(),
        task: Some(run.task.clone()),
        candidate_source: run.candidate.clone(),
        backend: run.backend as i32,
        policy: run.policy.clone(),
        priority: run.priority,
        job_id: run.job_id.clone(),
    })?;
    if submission.backend == Backend::Cpu {
        return Err(RequestError::invalid(
            "backend",
            "a CPU candidate has no device kernels to profile: ask for CUDA or Triton on a GPU",
        ));
    }
    let permit = engine.admit()?;
    let scratch = engine.scratch_dir("profile-");
    let _cleanup = RemoveOnDrop(scratch.clone());
    let cancel = CancellationToken::new();
    let _cancel_on_drop = cancel.clone().drop_guard();
    let mut evaluation = pb::EvaluateResponse::default();
    let mut ran = Ran::default();
    let stages = stages(engine, &submission, &run, &scratch, &cancel, &mut evaluation, &mut ran).await;
    let verdict = match stages {
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
        request_id: run.request_id,
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
    Ok(Profiled { response, gpu: ran.gpu, own_kernels: ran.own_kernels })
}

/// The run's stages, filling `evaluation` as an evaluation would be; the verdict.
async fn stages(
    engine: &Engine,
    submission: &Submission,
    run: &ProfileRun,
    scratch: &Path,
    cancel: &CancellationToken,
    evaluation: &mut pb::EvaluateResponse,
    ran: &mut Ran,
) -> Result<pb::Verdict, InfraError> {
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
    let started = Instant::now();
    let built = match engine.build(submission, &compile_dir, cancel, evaluation).await? {
        Ok(built) => built,
        Err(verdict) => return Ok(verdict),
    };
    if built.compiles {
        evaluation.stage_ms.insert("compile".into(), ms(started.elapsed()));
    }
    let (artifact_key, artifact_dir, compiles) = (&built.key, &built.dir, built.compiles);
    let task_key = cache::key(&[submission.task.as_bytes()]);
    // The census of this build on this task when an evaluation or a profile just ran it; otherwise a stage of
    // its own. Both processes start before the lane: their interpreters and torch load off the device's time.
    let census_from = match engine.censuses().get(artifact_key, &task_key) {
        Some(records) => CensusFrom::Kept(records),
        None => CensusFrom::Stage(engine.start_candidate(submission, &census_dir, artifact_dir, cancel)?),
    };
    // The profiler is told the own kernels by name when it starts. The build's are known now, and the Triton
    // kernels when the census is kept; otherwise the source's are the best guess until the census's run reports
    // them, and the profiled process starts again if the guess was wrong.
    let kept_jit = match &census_from {
        CensusFrom::Kept(records) => records.jit_kernels.as_deref(),
        CensusFrom::Stage(_) => None,
    };
    let guessed = census::own_kernels(&submission.candidate, built.kernels.as_ref(), kept_jit).names;
    let mut profiled_process = match run.launch_limit {
        0 => None,
        _ if guessed.is_empty() => None,
        _ => Some(start_profiled(engine, submission, &profiled_dir, artifact_dir, run, &guessed, cancel)?),
    };
    let started = Instant::now();
    let footprint = engine.footprint(&task_key);
    let lane = engine.lanes().acquire(true, submission.priority, &submission.job_id, footprint).await?;
    // Counters of a kernel that shares its SMs with another process's say little: the device is this job's.
    lane.go_solo();
    evaluation.stage_ms.insert("queue_device".into(), ms(started.elapsed()));
    ran.gpu = lane.gpu();
    // The evaluation's seeds for the task: the same model and the first of its timing inputs.
    let init_seed = engine.seeds(&task_key, "init", 1)[0];
    let timing_seeds = engine.seeds(&task_key, "timing", 1);
    let config = engine.config();
    let candidate_run = |census_calls, profiled_calls| CandidateRun {
        init_seed,
        seeds: vec![],
        recheck_from: 0,
        sensitivity: None,
        replay: None,
        output_bytes_budget: config.output_bytes_budget,
        timing: None,
        timing_seeds: timing_seeds.clone(),
        census_calls,
        profiled_calls,
        keep_timed: None,
    };

    let census_calls = config.census_calls.max(1);
    let records = match census_from {
        CensusFrom::Kept(records) => {
            ran.census_reused = true;
            records
        }
        CensusFrom::Stage(process) => {
            let started = Instant::now();
            let reference_ms = engine.eager_median_ms(&task_key, lane.gpu());
            let limits = CallLimits::for_reference(&config.call_limits, reference_ms);
            let spec = candidate_run(census_calls, 0);
            let outcome = engine.candidate_stage(process, &lane, &census_dir, spec, limits, None).await;
            evaluation.stage_ms.insert("census".into(), ms(started.elapsed()));
            let result = match engine.candidate_result(outcome, lane.gpu(), evaluation)? {
                Ok(result) => result,
                Err(verdict) => return Ok(verdict),
            };
            phases_into(&result, "census", &mut evaluation.stage_ms);
            match result.body.census {
                Some(Ok(modes)) if !modes.is_empty() => {
                    let records = Arc::new(census::Records { modes, jit_kernels: result.body.jit_kernels });
                    engine.censuses().put(artifact_key, &task_key, records.clone());
                    records
                }
                unreadable => {
                    let why = match unreadable {
                        Some(Err(error)) => error.to_string(),
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
    let own = census::own_kernels(&submission.candidate, built.kernels.as_ref(), records.jit_kernels.as_deref());
    if !own.from_source.is_empty() {
        tracing::warn!(why = ?own.from_source, "own kernel names read from the candidate's source");
    }
    ran.own_kernels.clone_from(&own.names);
    let modes = &records.modes;
    let candidate = census::Candidate { kernels: &own.names, compiles, median_ms: None, policy: submission.policy };
    let census = census::analyse(modes, candidate, true);
    // The measured mode's kernels: what the profiled calls run.
    evaluation.kernels = census.kernels.into_iter().filter(|k| k.mode == modes[0].mode).collect();
    evaluation.profiling_ratio = census.profiling_ratio;
    evaluation.findings.extend(census.findings.iter().map(finding_proto));
    if census.findings.iter().any(|f| f.category == Category::Hack) {
        return Ok(pb::Verdict::Hack);
    }

    if own.names != guessed {
        // The run made other kernels than the source suggested: the profiler is started again, told them.
        let again = profiled_dir.with_file_name("profiled-again");
        profiled_process = match (run.launch_limit, own.names.is_empty()) {
            (0, _) | (_, true) => None,
            _ => Some(start_profiled(engine, submission, &again, artifact_dir, run, &own.names, cancel)?),
        };
    }
    let Some(profiled_process) = profiled_process else { return Ok(pb::Verdict::Correct) };
    let profiled_calls = profiled_calls(run.launch_limit, &evaluation.kernels, census_calls);
    let started = Instant::now();
    // A profiled call replays each kernel once per pass: its limit is the stage's.
    let limits = CallLimits::fixed(run.wall, "the profile's run limit");
    let spec = candidate_run(0, profiled_calls);
    let outcome = engine.candidate_stage(profiled_process, &lane, &profiled_dir, spec, limits, None).await;
    evaluation.stage_ms.insert("profiled".into(), ms(started.elapsed()));
    match engine.candidate_result(outcome, lane.gpu(), evaluation)? {
        Ok(result) => {
            phases_into(&result, "profiled", &mut evaluation.stage_ms);
            Ok(pb::Verdict::Correct)
        }
        Err(verdict) => Ok(verdict),
    }
}

/// Starts the profiled stage's process in `dir`, its interpreter run by the run's launcher.
fn start_profiled(
    engine: &Engine,
    submission: &Submission,
    dir: &Path,
    artifact_dir: &Path,
    run: &ProfileRun,
    own_kernels: &[String],
    cancel: &CancellationToken,
) -> Result<Started, InfraError> {
    let launcher = &run.launcher;
    let mut stage = engine.candidate_process(submission, dir, artifact_dir)?;
    stage.launcher = (launcher.argv)(own_kernels);
    stage.readable.extend(launcher.readable.iter().cloned());
    stage.writable.extend(launcher.writable.iter().cloned());
    stage.env.extend(launcher.env.iter().cloned());
    stage.wall = run.wall;
    Ok(engine.start(stage, cancel))
}

/// Where a profile run's census comes from: kept from the latest evaluation or profile, or a stage of its own.
enum CensusFrom {
    Kept(Arc<census::Records>),
    Stage(Started),
}

/// Where a profile run ran, whether it measured its census or reused one, and the own kernels it found.
#[derive(Debug, Default)]
struct Ran {
    gpu: Option<usize>,
    census_reused: bool,
    own_kernels: Vec<String>,
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
