//! The candidate's stage: its process started before its lane, run on the lane with its call limits, and what it
//! reported read into a verdict or a result (how a stage that did not finish cleanly is judged: pure, tested).

use std::path::Path;
use std::time::Duration;

use kforge_proto::v1 as pb;
use kforge_sandbox::{Exit, tail as cap};
use tokio_util::sync::CancellationToken;

use super::{Backend, Engine, InfraError, Submission, hack_finding};
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

    /// The result of a candidate stage that finished cleanly with nothing found at run time; otherwise the
    /// verdict, with `response` filled in, or the engine's own failure.
    pub fn candidate_result(
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
}

/// The verdict of a candidate stage that did not finish cleanly; `None` when it did; an error where the failure
/// is the engine's.
fn candidate_failure<R>(
    outcome: &StageOutcome<R>,
    response: &mut pb::EvaluateResponse,
) -> Result<Option<pb::Verdict>, InfraError> {
    if outcome.ok() {
        return Ok(None);
    }
    if let Some(hung) = &outcome.hung {
        response.error = format!("the candidate was stopped: {hung}");
        return Ok(Some(pb::Verdict::Timeout));
    }
    let error = cap(&outcome.error_text(), 8000);
    let verdict = match outcome.finished.exit {
        Exit::TimedOut if outcome.candidate_used_its_time() => {
            response.error = format!(
                "the candidate exceeded its stage's time limit and was killed ({:.1} s of {:.1} s in its own calls)",
                outcome.in_calls.as_secs_f64(),
                outcome.running().as_secs_f64()
            );
            return Ok(Some(pb::Verdict::Timeout));
        }
        Exit::TimedOut => {
            return Err(InfraError::OwnTimeLimit { in_calls: outcome.in_calls, running: outcome.running() });
        }
        Exit::Cancelled => return Err(InfraError::Cancelled),
        Exit::Signal(signal) => {
            response.error = format!("the candidate was killed by signal {signal} ({})\n{error}", signal_name(signal));
            pb::Verdict::RuntimeError
        }
        Exit::Code(_) if outcome.result.is_none() => {
            response.error =
                format!("the candidate exited ({:?}) without reporting a result\n{error}", outcome.finished.exit);
            pb::Verdict::RuntimeError
        }
        Exit::Code(_) => {
            // Extensions build at import; Triton compiles a kernel at its first launch.
            let compile = outcome.error_type() == Some("CompilationError")
                || outcome.result.as_ref().and_then(|r| r.phase.as_deref()) == Some("import")
                    && error.contains("Error building extension");
            response.error = error;
            if compile { pb::Verdict::CompileError } else { pb::Verdict::RuntimeError }
        }
    };
    Ok(Some(verdict))
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

    #[test]
    fn signals_are_named() {
        assert_eq!((signal_name(11), signal_name(9), signal_name(64)), ("SIGSEGV", "SIGKILL", "signal"));
    }
}
