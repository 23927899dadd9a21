//! A profile run on the execution engine: a candidate checked and compiled exactly as an evaluation does it (the
//! same static checks, the same artifact cache), then run on one device lease: its kernel census (the evaluator's
//! definition and own-kernel rule; the one kept from the latest evaluation or profile of the same build on the
//! same task, else a stage of its own), then its profiled calls in a stage that a launcher wraps (Nsight Compute).
//! No outputs are compared and nothing is timed: correctness and speed are the evaluation's.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use kforge_execution::cache;
use kforge_execution::census::{self, KernelRecord};
use kforge_execution::devices::Lane;
use kforge_execution::engine::{
    Backend, Built, Engine, InfraError, RequestError, RequestedBackend, Submission, SubmissionRequest, TaskSource,
};
use kforge_execution::protocol::CandidateRun;
use kforge_execution::scratch::RemoveOnDrop;
use kforge_execution::stage::{CallLimits, Started};
use kforge_execution::times::Stage;
use kforge_execution::{Finding, Judgement, Notes, Staged, Stop, Verdict};
use kforge_static_checks::Category;

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
    pub task: TaskSource,
    pub candidate: String,
    pub backend: RequestedBackend,
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

/// What a profile run found: how it ended (`Ok`: its census, and its profiled calls where it has kernels of its
/// own, ran), and what its stages reported whatever became of it. The launcher's own output is the caller's to
/// read.
#[derive(Debug)]
pub struct Profiled {
    pub end: Result<(), Stop>,
    pub ran: Ran,
}

/// What a profile run's stages reported, whatever became of it.
#[derive(Debug, Default)]
pub struct Ran {
    /// Stage times and findings, in the order they came.
    pub notes: Notes,
    /// The GPU it ran on.
    pub gpu: Option<usize>,
    /// Whether its census was kept from the latest evaluation or profile of the build, rather than measured.
    pub census_reused: bool,
    /// The census of the measured mode (`train/no_grad`), once analysed: what the profiled calls run.
    pub census: Option<MeasuredCensus>,
    /// The candidate's own kernels (`census::own_kernels`), as the census counted them; empty when the run ended
    /// before they were known.
    pub own_kernels: Vec<String>,
}

/// The kernels of a census's measured mode, and its profiling ratio.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MeasuredCensus {
    pub kernels: Vec<KernelRecord>,
    pub profiling_ratio: f64,
}

/// Runs one profile run on `engine`. Dropping the returned future cancels it and kills its children.
pub async fn profile(engine: &Engine, run: ProfileRun) -> Result<Profiled, RequestError> {
    let submission = engine.submission(SubmissionRequest {
        request_id: run.request_id.clone(),
        task: Some(run.task.clone()),
        candidate_source: run.candidate.clone(),
        backend: run.backend,
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
    let _cleanup = RemoveOnDrop::new(scratch.clone());
    let cancel = CancellationToken::new();
    let _cancel_on_drop = cancel.clone().drop_guard();
    let mut ran = Ran::default();
    let session = Session { engine, submission: &submission, run: &run, scratch: &scratch, cancel: &cancel };
    let end = stages(&session, &mut ran).await;
    if let Err(Stop::Infra(error)) = &end {
        tracing::error!(%error, cause = error.cause(), "profile infrastructure error");
    }
    drop(permit);
    Ok(Profiled { end, ran })
}

/// A profile run under way: what its stages share.
#[derive(Debug, Clone, Copy)]
struct Session<'a> {
    engine: &'a Engine,
    submission: &'a Submission,
    run: &'a ProfileRun,
    scratch: &'a Path,
    cancel: &'a CancellationToken,
}

/// The run's stages, each adding what it reports to `ran`; the first that judges the candidate, or fails, stops
/// the run there.
async fn stages(session: &Session<'_>, ran: &mut Ran) -> Result<(), Stop> {
    let Session { engine, submission, run, scratch, cancel } = *session;
    let checked = ran.notes.add(engine.check(submission))?;
    let dirs = ["compile", "census", "profiled"].map(|stage| scratch.join(stage));
    for dir in &dirs {
        std::fs::create_dir_all(dir).map_err(InfraError::files(format!("scratch directory {}", dir.display())))?;
    }
    let [compile_dir, census_dir, profiled_dir] = dirs;
    let built = ran.notes.add(engine.build(&checked, &compile_dir, cancel).await)?;
    let task_key = cache::key(&[submission.task.as_bytes()]);
    // The census of this build on this task when an evaluation or a profile just ran it; otherwise a stage of
    // its own. Both processes start before the lane: their interpreters and torch load off the device's time.
    let census_from = match engine.censuses().get(&built.key, &task_key) {
        Some(records) => CensusFrom::Kept(records),
        None => CensusFrom::Stage(engine.start_candidate(submission, &census_dir, &built.dir, cancel)?),
    };
    // The profiler is told the own kernels by name when it starts. The build's are known now, and the Triton
    // kernels when the census is kept; otherwise the source's are the best guess until the census's run reports
    // them, and the profiled process starts again if the guess was wrong.
    let kept_jit = match &census_from {
        CensusFrom::Kept(records) => records.jit_kernels.as_deref(),
        CensusFrom::Stage(_) => None,
    };
    let guessed = census::own_kernels(&submission.candidate, built.kernels.as_ref(), kept_jit).names;
    let mut profiled_process = start_profiled(session, &profiled_dir, &built, &guessed)?;
    let lane = ran.notes.add(acquire_lane(engine, submission, &task_key).await)?;
    ran.gpu = lane.gpu();
    ran.census_reused = matches!(census_from, CensusFrom::Kept(_));
    let records = ran.notes.add(census_records(session, census_from, &lane, &census_dir, &built.key).await)?;
    let own = census::own_kernels(&submission.candidate, built.kernels.as_ref(), records.jit_kernels.as_deref());
    if !own.from_source.is_empty() {
        tracing::warn!(why = ?own.from_source, "own kernel names read from the candidate's source");
    }
    ran.own_kernels.clone_from(&own.names);
    analyse(&records, &own.names, &built, submission, ran)?;
    if own.names != guessed {
        // The run made other kernels than the source suggested: the profiler is started again, told them.
        profiled_process = start_profiled(session, &profiled_dir.with_file_name("profiled-again"), &built, &own.names)?;
    }
    let Some(process) = profiled_process else { return Ok(()) };
    let kernels = ran.census.as_ref().map_or(&[][..], |census| &census.kernels[..]);
    let calls = profiled_calls(run.launch_limit, kernels, engine.config().census_calls.max(1));
    ran.notes.add(profiled_stage(session, process, &lane, &profiled_dir, calls).await)
}

/// The run's device lane, the device to itself: counters of a kernel that shares its SMs with another process's
/// say little. Its note: `queue_device`.
async fn acquire_lane(engine: &Engine, submission: &Submission, task_key: &str) -> Staged<Lane> {
    let started = Instant::now();
    let footprint = engine.footprint(task_key);
    let lane = engine.lanes().acquire(true, submission.priority, &submission.job_id, footprint).await;
    let mut notes = Notes::default();
    if let Ok(lane) = &lane {
        lane.go_solo();
        notes.times.since(Stage::QueueDevice, started);
    }
    Staged::new(notes, lane.map_err(|unavailable| InfraError::from(unavailable).into()))
}

/// The candidate's run for a profile: the evaluation's seeds for the task (the same model and the first of its
/// timing inputs), its census's calls and its profiled ones; no trials, nothing timed.
fn candidate_run(engine: &Engine, task_key: &str, census_calls: u32, profiled_calls: u32) -> CandidateRun {
    CandidateRun {
        init_seed: engine.seeds(task_key, "init", 1)[0],
        seeds: vec![],
        recheck_from: 0,
        sensitivity: None,
        replay: None,
        output_bytes_budget: engine.config().output_bytes_budget,
        timing: None,
        timing_seeds: engine.seeds(task_key, "timing", 1),
        census_calls,
        profiled_calls,
        keep_timed: None,
    }
}

/// The census's records: kept, or measured in the started stage on `lane` (kept then for the next profile or
/// evaluation of the build, `artifact_key`). Its notes: `census` and its phases; the run stops here when the stage
/// did not finish cleanly, or its records are unreadable or missing (a hack).
async fn census_records(
    session: &Session<'_>,
    from: CensusFrom,
    lane: &Lane,
    dir: &Path,
    artifact_key: &str,
) -> Staged<Arc<census::Records>> {
    let (engine, submission) = (session.engine, session.submission);
    let process = match from {
        CensusFrom::Kept(records) => return Staged::new(Notes::default(), Ok(records)),
        CensusFrom::Stage(process) => process,
    };
    let task_key = cache::key(&[submission.task.as_bytes()]);
    let started = Instant::now();
    let config = engine.config();
    let limits = CallLimits::for_reference(&config.call_limits, engine.eager_median_ms(&task_key, lane.gpu()));
    let spec = candidate_run(engine, &task_key, config.census_calls.max(1), 0);
    let outcome = engine.candidate_stage(process, lane, dir, spec, limits, None).await;
    let mut notes = Notes::default();
    notes.times.since(Stage::Census, started);
    let outcome = engine.candidate_result(outcome, lane.gpu()).and_then(|result| {
        notes.times.phases(Stage::Census, &result);
        let body = result.body;
        match body.census {
            Some(Ok(modes)) if !modes.is_empty() => {
                let records = Arc::new(census::Records { modes, jit_kernels: body.jit_kernels });
                engine.censuses().put(artifact_key, &task_key, records.clone());
                Ok(records)
            }
            unreadable => {
                let why = match unreadable {
                    Some(Err(error)) => error.to_string(),
                    _ => "none were written".to_owned(),
                };
                let finding =
                    Finding::hack("runtime.census_unreadable", format!("the census records are malformed: {why}"));
                Err(Judgement::hack(finding).into())
            }
        }
    });
    Staged::new(notes, outcome)
}

/// The census analysed by the candidate's policy against its `own` kernels: the measured mode's kernels and
/// profiling ratio, and its findings, into `ran`; any hack among them stops the run.
fn analyse(
    records: &census::Records,
    own: &[String],
    built: &Built,
    submission: &Submission,
    ran: &mut Ran,
) -> Result<(), Judgement> {
    let modes = &records.modes;
    let candidate =
        census::Candidate { kernels: own, compiles: built.compiles, median_ms: None, policy: submission.policy };
    let census = census::analyse(modes, candidate, true);
    let hack = census.findings.iter().any(|f| f.category == Category::Hack);
    ran.notes.findings.extend(census.findings.into_iter().map(Finding::from));
    // The measured mode's kernels: what the profiled calls run.
    let kernels = census.kernels.into_iter().filter(|k| k.mode == modes[0].mode).collect();
    ran.census = Some(MeasuredCensus { kernels, profiling_ratio: census.profiling_ratio });
    match hack {
        true => Err(Judgement::verdict(Verdict::Hack)),
        false => Ok(()),
    }
}

/// The profiled calls, in the started process under the launcher on `lane`. A profiled call replays each kernel
/// once per pass: its limit is the stage's. Its notes: `profiled` and its phases.
async fn profiled_stage(
    session: &Session<'_>,
    process: Started,
    lane: &Lane,
    dir: &Path,
    profiled_calls: u32,
) -> Staged<()> {
    let (engine, run) = (session.engine, session.run);
    let task_key = cache::key(&[session.submission.task.as_bytes()]);
    let started = Instant::now();
    let limits = CallLimits::fixed(run.wall, "the profile's run limit");
    let spec = candidate_run(engine, &task_key, 0, profiled_calls);
    let outcome = engine.candidate_stage(process, lane, dir, spec, limits, None).await;
    let mut notes = Notes::default();
    notes.times.since(Stage::Profiled, started);
    let outcome =
        engine.candidate_result(outcome, lane.gpu()).map(|result| notes.times.phases(Stage::Profiled, &result));
    Staged::new(notes, outcome)
}

/// Starts the profiled stage's process in `dir`, its interpreter run by the run's launcher told the `own_kernels`;
/// none without a launch to profile or a kernel of the candidate's own.
fn start_profiled(
    session: &Session<'_>,
    dir: &Path,
    built: &Built,
    own_kernels: &[String],
) -> Result<Option<Started>, InfraError> {
    let (engine, run) = (session.engine, session.run);
    if run.launch_limit == 0 || own_kernels.is_empty() {
        return Ok(None);
    }
    let launcher = &run.launcher;
    let mut stage = engine.candidate_process(session.submission, dir, &built.dir)?;
    stage.launcher = (launcher.argv)(own_kernels);
    stage.readable.extend(launcher.readable.iter().cloned());
    stage.writable.extend(launcher.writable.iter().cloned());
    stage.env.extend(launcher.env.iter().cloned());
    stage.wall = run.wall;
    Ok(Some(engine.start(stage, session.cancel)))
}

/// Where a profile run's census comes from: kept from the latest evaluation or profile, or a stage of its own.
enum CensusFrom {
    Kept(Arc<census::Records>),
    Stage(Started),
}

/// Forward calls that make `launch_limit` launches of the candidate's own kernels, by the census's count of them
/// (`census_calls` calls in the measured mode): at least one, at most `launch_limit`.
fn profiled_calls(launch_limit: u32, census: &[KernelRecord], census_calls: u32) -> u32 {
    let own: u64 = census.iter().filter(|k| k.own).map(|k| k.launches).sum();
    let per_call = own.div_ceil(u64::from(census_calls.max(1))).max(1);
    u64::from(launch_limit).div_ceil(per_call).clamp(1, u64::from(launch_limit.max(1))) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(name: &str, own: bool, launches: u64) -> KernelRecord {
        KernelRecord { name: name.into(), own, launches, total_ms: 1.0, mode: "train/no_grad".into() }
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
