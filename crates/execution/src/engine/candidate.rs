//! The candidate's stage: its process started before its lane, run on the lane with its call limits, and what it
//! reported read into a verdict or a result (how a stage that did not finish cleanly is judged: pure, tested).

use std::path::Path;
use std::time::Duration;

use kforge_sandbox::{Exit, tail as cap};
use tokio_util::sync::CancellationToken;

use super::outcome::{Finding, Judgement, Stop, Verdict};
use super::{Backend, Engine, InfraError, Submission};
use crate::devices::{Lane, PairSide};
use crate::protocol::{CandidatePlacement, CandidateResult, CandidateRun, CandidateSpec, Mode, Report};
use crate::stage::{CallLimits, Request, Stage, StageOutcome, Started};

impl Engine {
    /// Starts the candidate's process in `dir`, before it has a lane: the interpreter starts and imports torch
    /// meanwhile. Its device comes with the request.
    pub fn start_candidate(
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
    pub fn candidate_process(
        &self,
        submission: &Submission,
        dir: &Path,
        artifact_dir: &Path,
    ) -> Result<Stage, InfraError> {
        let python = self.checked_python();
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
        // The build's (`Engine::build`): a Triton kernel compiled by one stage is not compiled by the next.
        env.push(("TRITON_CACHE_DIR".into(), artifact_dir.join("triton").into()));
        let stage = Stage {
            scratch: dir.to_owned(),
            readable: vec![],
            // The extension build directory takes a lock file even when nothing needs building.
            writable: vec![artifact_dir.to_owned()],
            env,
            wall: Duration::from_secs(self.inner.config.run_timeout_secs),
            background: false,
            launcher: vec![],
        };
        Ok(stage)
    }

    /// Empties the candidate's directory (nothing of a first run may be read as the second's) and starts the
    /// candidate's process again there. The directory itself stays: the checker was started with it readable.
    pub fn restart_candidate(
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

    /// Runs the candidate's started process on `lane` with `spec`; with `pair`, its timing rounds alternate with its
    /// baseline's (`devices::pairing`).
    pub async fn candidate_stage(
        &self,
        started: Started,
        lane: &Lane,
        dir: &Path,
        run: CandidateRun,
        limits: CallLimits,
        pair: Option<PairSide>,
    ) -> Result<StageOutcome<CandidateResult>, InfraError> {
        let python = self.checked_python();
        let placement = CandidatePlacement {
            task_path: dir.join("task.py"),
            candidate_path: dir.join("candidate.py"),
            candidate_dir: dir.to_owned(),
            device: lane.device(),
            timing_cpu: python.timing_cpu(lane.gpu()),
        };
        let spec = CandidateSpec { run, placement };
        let request = Request { spec, env: python.device_env(lane.gpu()), limits: Some(limits), pair };
        self.stage(started, request, Some(lane)).await.map_err(InfraError::stage(Mode::Candidate))
    }

    /// The result of a candidate stage that finished cleanly with nothing found at run time; otherwise why the run
    /// stops: the candidate's verdict (a note of its device's quarantine, where the stage left it quarantined), or
    /// the engine's own failure.
    pub fn candidate_result(
        &self,
        outcome: Result<StageOutcome<CandidateResult>, InfraError>,
        gpu: Option<usize>,
    ) -> Result<Report<CandidateResult>, Stop> {
        let outcome = outcome?;
        let quarantined = || gpu.and_then(|gpu| self.inner.lanes.quarantine_reason(gpu));
        match candidate_failure(&outcome) {
            Ok(None) => {}
            Ok(Some(mut judgement)) => {
                if let Some(reason) = quarantined() {
                    judgement.error.push_str(&format!("\n[the device was quarantined after this: {reason}]"));
                }
                return Err(judgement.into());
            }
            Err(error) => {
                return Err(match quarantined() {
                    Some(reason) => InfraError::Quarantined { source: Box::new(error), reason },
                    None => error,
                }
                .into());
            }
        }
        let result = outcome.result.expect("a successful candidate stage wrote its result");
        match runtime_hack(&result.body) {
            Some(judgement) => Err(judgement.into()),
            None => Ok(result),
        }
    }
}

/// What the harness saw at run time, each a hack: the findings it reported, and inputs the candidate modified.
fn runtime_hack(result: &CandidateResult) -> Option<Judgement> {
    let mut findings: Vec<Finding> = result
        .findings
        .iter()
        .map(|f| {
            Finding::hack(f.code.as_deref().unwrap_or("runtime.unknown").to_owned(), f.message.as_deref().unwrap_or(""))
        })
        .collect();
    if let trials @ [_, ..] = &result.mutated_inputs[..] {
        findings.push(Finding::hack(
            "runtime.input_mutation",
            format!("the candidate modified its inputs (trials {trials:?})"),
        ));
    }
    (!findings.is_empty()).then(|| Judgement { findings, ..Judgement::verdict(Verdict::Hack) })
}

/// The verdict of a candidate stage that did not finish cleanly; `None` when it did; an error where the failure
/// is the engine's.
fn candidate_failure<R>(outcome: &StageOutcome<R>) -> Result<Option<Judgement>, InfraError> {
    if outcome.ok() {
        return Ok(None);
    }
    if let Some(hung) = &outcome.hung {
        return Ok(Some(Judgement::error(Verdict::Timeout, format!("the candidate was stopped: {hung}"))));
    }
    let error = cap(&outcome.error_text(), 8000);
    let judgement = match outcome.finished.exit {
        Exit::TimedOut if outcome.candidate_used_its_time() => Judgement::error(
            Verdict::Timeout,
            format!(
                "the candidate exceeded its stage's time limit and was killed ({:.1} s of {:.1} s in its own calls)",
                outcome.in_calls.as_secs_f64(),
                outcome.running().as_secs_f64()
            ),
        ),
        Exit::TimedOut => {
            return Err(InfraError::OwnTimeLimit { in_calls: outcome.in_calls, running: outcome.running() });
        }
        Exit::Cancelled => return Err(InfraError::Cancelled),
        Exit::Signal(signal) => Judgement::error(
            Verdict::RuntimeError,
            format!("the candidate was killed by signal {signal} ({})\n{error}", signal_name(signal)),
        ),
        Exit::Code(_) if outcome.result.is_none() => Judgement::error(
            Verdict::RuntimeError,
            format!("the candidate exited ({:?}) without reporting a result\n{error}", outcome.finished.exit),
        ),
        Exit::Code(_) => {
            // Extensions build at import; Triton compiles a kernel at its first launch.
            let compile = outcome.error_type() == Some("CompilationError")
                || outcome.result.as_ref().and_then(|r| r.phase.as_deref()) == Some("import")
                    && error.contains("Error building extension");
            Judgement::error(if compile { Verdict::CompileError } else { Verdict::RuntimeError }, error)
        }
    };
    Ok(Some(judgement))
}

/// Whether a stage failed for want of device memory.
pub fn out_of_memory<R>(outcome: &StageOutcome<R>) -> bool {
    !outcome.ok()
        && outcome.finished.exit != Exit::Cancelled
        && outcome.error_text().to_lowercase().contains("out of memory")
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        24 => "SIGXCPU",
        25 => "SIGXFSZ",
        _ => "signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::RuntimeFinding;

    #[test]
    fn signals_are_named() {
        assert_eq!((signal_name(11), signal_name(9), signal_name(64)), ("SIGSEGV", "SIGKILL", "signal"));
    }

    fn failed(error_type: Option<&str>, phase: Option<&str>, error: &str) -> Option<Report<CandidateResult>> {
        Some(Report {
            error: Some(error.to_owned()),
            error_type: error_type.map(str::to_owned),
            phase: phase.map(str::to_owned),
            ..Report::default()
        })
    }

    fn judged(outcome: &StageOutcome<CandidateResult>) -> (Verdict, String) {
        let judgement = candidate_failure(outcome).expect("the candidate's").expect("a verdict");
        (judgement.verdict, judgement.error)
    }

    #[test]
    fn a_candidate_stage_that_ended_badly_is_judged_by_how_it_ended() {
        let clean =
            StageOutcome::<CandidateResult>::ended(Exit::Code(0), Some(Report { ok: true, ..Report::default() }));
        assert!(candidate_failure(&clean).expect("no failure").is_none());

        let raised = StageOutcome::ended(Exit::Code(1), failed(Some("ValueError"), Some("run"), "ValueError: bad"));
        assert_eq!(judged(&raised), (Verdict::RuntimeError, "ValueError: bad".to_owned()));
        let triton = StageOutcome::ended(Exit::Code(1), failed(Some("CompilationError"), Some("run"), "at 3:4"));
        assert_eq!(judged(&triton).0, Verdict::CompileError, "Triton compiles at its first launch");
        let import = failed(None, Some("import"), "RuntimeError: Error building extension 'x'");
        assert_eq!(judged(&StageOutcome::ended(Exit::Code(1), import)).0, Verdict::CompileError);

        let silent = judged(&StageOutcome::ended(Exit::Code(3), None));
        assert_eq!(silent.0, Verdict::RuntimeError);
        assert!(silent.1.starts_with("the candidate exited (Code(3)) without reporting a result"), "{}", silent.1);
        let segv = judged(&StageOutcome::ended(Exit::Signal(11), None));
        assert!(segv.1.starts_with("the candidate was killed by signal 11 (SIGSEGV)"), "{}", segv.1);

        let mut hung = StageOutcome::ended(Exit::Signal(9), None);
        hung.hung = Some("a call ran 3.0 s".into());
        assert_eq!(judged(&hung), (Verdict::Timeout, "the candidate was stopped: a call ran 3.0 s".to_owned()));
    }

    #[test]
    fn a_stage_killed_at_its_limit_is_the_candidate_s_timeout_only_when_its_calls_used_the_time() {
        let mut outcome = StageOutcome::<CandidateResult>::ended(Exit::TimedOut, None);
        outcome.finished.wall = Duration::from_secs(10);
        outcome.in_calls = Duration::from_secs(6);
        let (verdict, error) = judged(&outcome);
        assert_eq!(verdict, Verdict::Timeout);
        assert!(error.contains("(6.0 s of 10.0 s in its own calls)"), "{error}");
        outcome.in_calls = Duration::from_secs(1);
        let own = candidate_failure(&outcome).expect_err("the harness's own work");
        assert_eq!(own.cause(), "own_time_limit");
        let cancelled = candidate_failure(&StageOutcome::<CandidateResult>::ended(Exit::Cancelled, None));
        assert!(matches!(cancelled, Err(InfraError::Cancelled)), "{cancelled:?}");
    }

    #[test]
    fn what_the_harness_saw_at_run_time_is_a_hack() {
        assert_eq!(runtime_hack(&CandidateResult::default()), None);
        let result = CandidateResult {
            findings: vec![
                RuntimeFinding { code: Some("runtime.patch_torch".into()), message: Some("patched".into()) },
                RuntimeFinding { code: None, message: None },
            ],
            mutated_inputs: vec![0, 2],
            ..CandidateResult::default()
        };
        let judgement = runtime_hack(&result).expect("hacks");
        assert_eq!(judgement.verdict, Verdict::Hack);
        let codes: Vec<&str> = judgement.findings.iter().map(|f| f.code.as_ref()).collect();
        assert_eq!(codes, ["runtime.patch_torch", "runtime.unknown", "runtime.input_mutation"]);
        assert_eq!(judgement.findings[2].message, "the candidate modified its inputs (trials [0, 2])");
    }
}
