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
//!
//! `Evaluator::run` is the sequence: each stage returns what it made, with the stage times and findings it adds
//! (the engine's `Staged`), or a stop (`kforge_execution::Stop`: a verdict with what explains it, or the engine's
//! failure), so each step reads `record.notes.add(stage(..))?`. What the stages reported is kept in a typed
//! `Record` (`record.rs`), from which `response.rs` builds the response once. The modules: `request` (validation),
//! `prepare` (directories, seeds, room for the files, processes started early, the lane), `candidate` (the
//! candidate's stage, its census, the remeasure), `check` (reference and checker), `measure` and `timing` (timing),
//! `baseline` and `paired` (baselines), `verdict` (the verdict rules, pure), `record` (the typed outcome),
//! `response` (the response built from it), `setup`.

use std::path::Path;
use std::sync::Arc;

use kforge_execution::Stop;
use kforge_execution::cache::{self, Cache};
use kforge_execution::devices;
use kforge_execution::engine::{Backend, Built, Engine, InfraError, RequestError, Submission};
use kforge_execution::scratch::RemoveOnDrop;
use kforge_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

use crate::config::EvaluatorConfig;
use crate::metrics::EvaluatorMetrics;

mod baseline;
mod candidate;
mod check;
mod measure;
mod paired;
mod prepare;
mod record;
mod request;
mod response;
mod setup;
mod timing;
mod verdict;

use check::Trials;
use prepare::Dirs;
pub(crate) use record::{Basis, Device, KernelCensus, Record, Timing};
use request::Evaluation;

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

/// An evaluation under way, past its build: what its stages share.
#[derive(Debug)]
struct Evaluating<'a> {
    evaluation: &'a Evaluation,
    /// The task's key in the caches.
    task_key: String,
    trials: Trials,
    dirs: Dirs,
    /// The candidate's build, pinned until the evaluation ends.
    built: Built,
    cancel: &'a CancellationToken,
}

impl Evaluator {
    /// What this evaluator can do: its engine's backends, devices, policies and protections.
    pub fn capabilities(&self) -> pb::GetCapabilitiesResponse {
        kforge_execution_proto::capabilities(self.inner.engine.capabilities())
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
        let _cleanup = RemoveOnDrop::new(scratch.clone());
        let cancel = CancellationToken::new();
        let _cancel_on_drop = cancel.clone().drop_guard();
        let mut record = Record::default();
        let (end, stage_cpu) = Engine::with_cpu_account(self.run(&evaluation, &scratch, &cancel, &mut record)).await;
        // The lane was released when `run` returned: its hold is the device time this evaluation took.
        record.close(stage_cpu, &self.inner.metrics.execution);
        if let Err(Stop::Infra(error)) = &end {
            self.infra_error(error);
        }
        let response = response::response(evaluation.submission.request_id.clone(), record, end);
        self.inner.metrics.verdict(response.verdict(), &response.findings);
        drop(permit);
        Ok(response)
    }

    /// An evaluation the evaluator itself could not complete (`VERDICT_INFRA_ERROR`): logged and counted by cause.
    fn infra_error(&self, error: &InfraError) {
        let cause = error.cause();
        tracing::error!(%error, cause, "evaluation infrastructure error");
        self.inner.metrics.infra_error(cause);
    }

    /// Runs the stages in order, each adding its notes to `record`; the first that judges the candidate short of
    /// correct, or fails, stops the evaluation there.
    async fn run(
        &self,
        evaluation: &Evaluation,
        scratch: &Path,
        cancel: &CancellationToken,
        record: &mut Record,
    ) -> Result<(), Stop> {
        let (engine, submission) = (&self.inner.engine, &evaluation.submission);
        let checked = record.notes.add(engine.check(submission))?;
        let mut dirs = Dirs::make(scratch)?;
        let task_key = cache::key(&[submission.task.as_bytes()]);
        self.baseline_ahead(evaluation);
        self.sizes_ahead(submission, &task_key);
        // Compile: only candidates that build extensions; the rest are imported where they run. The build is
        // pinned until the evaluation ends, so eviction cannot take it meanwhile.
        let built = record.notes.add(engine.build(&checked, &dirs.compile, cancel).await)?;
        let trials = self.trials(evaluation, &task_key);
        // Held to the evaluation's end: the room its files take, and its cached references' protection.
        let room = record.notes.add(self.reserve_room(evaluation, &trials, &task_key, scratch).await)?;
        if let Some(dir) = room.memory_dir() {
            dirs.candidate = dir.to_owned();
        }
        let run = Evaluating { evaluation, task_key, trials, dirs, built, cancel };
        let processes = self.start_processes(&run)?;
        let lane = record.notes.add(self.acquire_lane(&run, room.sizes).await)?;
        record.placed(engine, &lane, &run.task_key);
        // The clean process that checks the outputs starts now, while the candidate runs.
        let check = self.prepare_check(&run, &lane).await?;
        // The candidate first: nothing of the reference has run on this device for this evaluation.
        let ran = record.notes.add(self.run_candidate(&run, &lane, processes).await)?;
        record.device_peak_bytes = ran.result.device_peak_bytes.unwrap_or(0);
        // Correctness, in a clean process; the outputs of the timed calls kept are checked too, on rebuilt inputs.
        let timed_outputs = verdict::timed_outputs(evaluation.measure, &ran.result)?;
        let compared = record.notes.add(self.compare(check, &lane, timed_outputs, run.trials.seeds.len()).await)?;
        record.checked(compared)?;
        if evaluation.measure {
            let timing = record.notes.add(self.time(&run, &lane, &ran.result, ran.paired).await)?;
            let again = self.remeasure_if_implausible(&run, &lane, &timing).await;
            let timing = record.timing.insert(timing);
            let again = record.notes.add(again)?;
            record.notes.findings.extend(timing.take_slower(again, self.inner.config.plausible_speedup));
        }
        let median_ms = record.candidate_median_ms();
        if let Some(census) = self.census(&run, ran.result, median_ms, lane.gpu())? {
            record.censused(census)?;
        }
        Ok(())
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
            let _cleanup = RemoveOnDrop::new(scratch.clone());
            let python = engine.checked_python();
            engine.disk().task_sizes(&task_key, &task, engine.sandbox(), python, &scratch).await;
        });
    }
}
