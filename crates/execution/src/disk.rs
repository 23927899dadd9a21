//! The disk an evaluation's files take, and admission by it.
//!
//! Outputs travel from the candidate's process to the checker's as files, and reference outputs are cached on
//! disk: a KernelBench level-1 task with 8 GiB outputs writes about 40 GiB (two kept trials and the last timed
//! call's output on the candidate's side, two trials in its reference entry), so four such evaluations at once fill a
//! 64 GiB disk. Each GPU evaluation therefore reserves the bytes its files will take before it starts its
//! candidate, out of a budget ([`DiskBudget`]): `disk_budget_bytes`, by default 60% of the space available in the
//! work directory when the evaluator starts (the reference cache gets at most 20%). The bytes follow from the task's shapes ([`TaskSizes`]), found by a
//! dry run of the task on PyTorch's meta device (shapes only: no memory, no kernels) in the sandbox, once per task
//! and kept for the evaluator's life. Where the dry run cannot tell (a task that reads a value, or names a device
//! of its own), the evaluation reserves the whole main budget (it writes alone but for small reservations' lane)
//! until the task's reference has run: the most bytes one of its trials output, recorded in its cache entry, then
//! stand for the task's outputs ([`DiskBudget::note_reference_outputs`]). The same sizes give memory-aware admission
//! a footprint for a task whose reference has not run yet.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kforge_sandbox::{Command, Limits, Sandbox};
use serde::Deserialize;
use tokio::sync::{OnceCell, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::python::PythonEnv;

/// Reservations count whole mebibytes.
const UNIT: u64 = 1 << 20;

/// The bytes of one trial's inputs and outputs, as the task's shapes give them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct TaskSizes {
    pub input_bytes: u64,
    pub output_bytes: u64,
}

/// How an evaluation keeps its outputs: what [`files_bytes`] needs besides the task's sizes.
#[derive(Debug, Clone, Copy)]
pub struct OutputPlan {
    /// Correctness trials in all (re-checks included).
    pub trials: u64,
    /// `output_bytes_budget`: the most bytes of outputs a side keeps (0: every trial), at least two trials.
    pub budget: u64,
    /// Whether the evaluation may write the task's reference outputs: unless, when it reserves, the reference cache
    /// holds an entry for its trials on every kind of GPU the engine has (protected from eviction until it ends).
    pub new_reference: bool,
}

impl OutputPlan {
    /// Trials whose outputs a side keeps, for outputs of `output_bytes` a trial (the harness's `kept_trials`).
    pub fn kept(&self, output_bytes: u64) -> u64 {
        if self.budget == 0 || output_bytes == 0 {
            return self.trials;
        }
        self.trials.min((self.budget / output_bytes).max(2))
    }
}

/// The bytes of an evaluation's files, by side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FilesBytes {
    /// The candidate's kept trials and its timed calls' outputs: read by the checker, removed with the evaluation.
    pub candidate: u64,
    /// The reference's kept trials where its cache entry is missing (`plan.new_reference`): the new entry, which
    /// counts against the reference cache's bound only once written; else 0.
    pub reference: u64,
}

impl FilesBytes {
    pub fn total(&self) -> u64 {
        self.candidate.saturating_add(self.reference)
    }
}

/// The most timed calls whose outputs the candidate's harness saves besides the last one's (a random sample; it is
/// told so in `protocol::KeepTimed`)...
pub const SAMPLED_TIMED_CALLS: u64 = 4;
/// ...while together they take at most this many bytes (the harness holds a copy of each on the device while it
/// times).
pub const SAMPLED_TIMED_BYTES: u64 = 1 << 30;

/// How many sampled timed calls' outputs of `output_bytes` each the harness saves (its `sampled_timed_calls`).
pub fn sampled_timed_calls(output_bytes: u64) -> u64 {
    SAMPLED_TIMED_CALLS.min(SAMPLED_TIMED_BYTES / output_bytes.max(1))
}

/// The bytes an evaluation of a task of `sizes` writes, by side.
pub fn files_bytes(sizes: TaskSizes, plan: OutputPlan) -> FilesBytes {
    let kept = plan.kept(sizes.output_bytes);
    let timed = 1 + sampled_timed_calls(sizes.output_bytes);
    FilesBytes {
        candidate: (kept + timed).saturating_mul(sizes.output_bytes),
        reference: if plan.new_reference { kept.saturating_mul(sizes.output_bytes) } else { 0 },
    }
}

/// Bytes available to an unprivileged writer on the filesystem holding `path`.
pub fn available_bytes(path: &Path) -> Option<u64> {
    let stat = rustix::fs::statvfs(path).ok()?;
    Some(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// The size in bytes of the filesystem holding `path`.
pub fn total_bytes(path: &Path) -> Option<u64> {
    let stat = rustix::fs::statvfs(path).ok()?;
    Some(stat.f_blocks.saturating_mul(stat.f_frsize))
}

/// The disk budget shared by every run of this engine, and each task's sizes once known.
///
/// Waiters are served in order, so a large reservation at the head is never starved, but then every evaluation
/// behind it waits too, a task with 100 KiB of outputs behind one with 8 GiB (the KernelBench sweep's warm
/// evaluations waited 32 s at p50 for this, on two GPUs). So a sixteenth of the budget is a lane of its own for small
/// reservations (at most a quarter of that lane each): one takes room from the main budget where it is free and
/// nobody waits there, else waits in the small lane's own order. Large reservations share the rest, at most all of
/// it. Together they never hold more than the budget.
#[derive(Debug)]
pub struct DiskBudget {
    permits: Arc<Semaphore>,
    small_lane: Arc<Semaphore>,
    /// The most units a reservation may take from the small lane.
    small_units: u64,
    /// Units of the main budget.
    main_units: u64,
    capacity: u64,
    /// By task key: the sizes its dry run gave, or `None` where it could not tell; one dry run per task, which
    /// every evaluation of the task waiting for it shares.
    sizes: Mutex<HashMap<String, Arc<OnceCell<Option<TaskSizes>>>>>,
    /// Output bytes a task's reference wrote, for tasks whose dry run could not tell.
    measured: Mutex<HashMap<String, TaskSizes>>,
}

impl DiskBudget {
    /// A budget of `capacity` bytes (at least one unit).
    pub fn new(capacity: u64) -> Self {
        let units = (capacity / UNIT).max(1);
        let units = units.min(Semaphore::MAX_PERMITS as u64);
        // A lane too small to hold one small reservation (under 64 units) is no lane.
        let lane = if units >= 64 { units / 16 } else { 0 };
        let main_units = units - lane;
        Self {
            permits: Arc::new(Semaphore::new(main_units as usize)),
            small_lane: Arc::new(Semaphore::new(lane as usize)),
            small_units: lane / 4,
            main_units,
            capacity: units * UNIT,
            sizes: Mutex::default(),
            measured: Mutex::default(),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The most one reservation takes: the main budget.
    pub fn largest(&self) -> u64 {
        self.main_units * UNIT
    }

    /// Bytes not reserved now.
    pub fn unreserved(&self) -> u64 {
        (self.permits.available_permits() + self.small_lane.available_permits()) as u64 * UNIT
    }

    /// Waits until `bytes` (rounded up to a unit, at most the main budget) are free and reserves them until the
    /// returned permit drops: a small reservation from the main budget where it is free and nobody waits there,
    /// else from the small lane; in each, waiters are served in order.
    pub async fn reserve(&self, bytes: u64) -> OwnedSemaphorePermit {
        let units = bytes.div_ceil(UNIT).clamp(1, self.main_units);
        if units <= self.small_units {
            // Tokio's semaphore hands freed permits to its first waiter, so this takes nothing a waiter needs.
            if let Ok(permit) = self.permits.clone().try_acquire_many_owned(units as u32) {
                return permit;
            }
            return self.small_lane.clone().acquire_many_owned(units as u32).await.expect("never closed");
        }
        self.permits.clone().acquire_many_owned(units as u32).await.expect("the disk budget is never closed")
    }

    /// The bytes to reserve for an evaluation of a task of `sizes` (the whole budget where they are unknown;
    /// [`DiskBudget::reserve`] takes at most the main budget).
    pub fn need(&self, sizes: Option<TaskSizes>, plan: OutputPlan) -> u64 {
        sizes.map_or(self.capacity, |sizes| files_bytes(sizes, plan).total().min(self.capacity))
    }

    /// The task's sizes: known, or found by a dry run in `sandbox` (one per task: a caller that comes while it
    /// runs waits for it; a caller cancelled meanwhile leaves it to the next).
    pub async fn task_sizes(
        &self,
        task_key: &str,
        task_source: &str,
        sandbox: &Sandbox,
        python: &PythonEnv,
        scratch: &Path,
    ) -> Option<TaskSizes> {
        let cell = self.sizes.lock().expect("never poisoned").entry(task_key.to_owned()).or_default().clone();
        let sizes = cell.get_or_init(|| async {
            let sizes = dry_run(task_source, sandbox, python, scratch).await;
            if let Err(error) = &sizes {
                tracing::info!(%error, task = task_key, "the task's sizes are unknown: its evaluations write alone");
            }
            sizes.ok()
        });
        let sizes = *sizes.await;
        sizes.or_else(|| self.measured.lock().expect("never poisoned").get(task_key).copied())
    }

    /// Keeps the most bytes of tensors one of the task's reference trials output (as the harness counts them to
    /// choose the kept trials), for a task its dry run could not size (one that reads a tensor's value): its later
    /// evaluations reserve what their files take instead of the whole budget, and may put the candidate's files in
    /// memory. Only outputs: by then the task's footprint comes from the reference's measured peak, so its input
    /// bytes are given as 0.
    pub fn note_reference_outputs(&self, task_key: &str, output_bytes: u64) {
        let sizes = TaskSizes { input_bytes: 0, output_bytes };
        self.measured.lock().expect("never poisoned").insert(task_key.to_owned(), sizes);
    }
}

/// Why a dry run told nothing.
#[derive(Debug, thiserror::Error)]
pub enum DryRunError {
    #[error("writing the task for its dry run: {0}")]
    Files(#[from] std::io::Error),
    #[error("starting the dry run: {0}")]
    Sandbox(String),
    #[error("the dry run failed: {0}")]
    Failed(String),
    #[error("the dry run printed no sizes: {0}")]
    Output(#[from] serde_json::Error),
}

/// The task's module run on the meta device: `get_init_inputs`, `get_inputs`, the model and one forward call make
/// shapes and no data; the bytes of the tensors in the inputs and in the output (nested in tuples, lists and
/// dicts) are printed as JSON.
const DRY_RUN: &str = r#"
import importlib.util, json, sys
import torch
spec = importlib.util.spec_from_file_location("task", sys.argv[1])
task = importlib.util.module_from_spec(spec)
def nbytes(value):
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    return 0
with torch.device("meta"), torch.no_grad():
    spec.loader.exec_module(task)
    inputs = list(task.get_inputs())
    model = task.Model(*task.get_init_inputs())
    output = model(*inputs)
print(json.dumps({"input_bytes": nbytes(inputs), "output_bytes": nbytes(output)}))
"#;

async fn dry_run(
    task_source: &str,
    sandbox: &Sandbox,
    python: &PythonEnv,
    scratch: &Path,
) -> Result<TaskSizes, DryRunError> {
    std::fs::create_dir_all(scratch)?;
    let task = scratch.join("task.py");
    std::fs::write(&task, task_source)?;
    let command = Command {
        program: python.python.clone(),
        args: vec!["-c".into(), DRY_RUN.into(), task.into_os_string()],
        env: python.env_on(scratch, None),
        scratch: scratch.to_owned(),
        readable: python.readable.clone(),
        writable: vec![],
        limits: Limits { wall: Duration::from_secs(120), ..Limits::default() },
    };
    let finished = sandbox
        .run(command, CancellationToken::new())
        .await
        .map_err(|error| DryRunError::Sandbox(error.to_string()))?;
    if !finished.success() {
        let stderr = finished.stderr_tail(2000);
        let last = stderr.lines().rev().find(|line| !line.trim().is_empty()).unwrap_or("no error text");
        return Err(DryRunError::Failed(last.trim().to_owned()));
    }
    let stdout = String::from_utf8_lossy(&finished.stdout);
    let line = stdout.lines().rev().find(|line| line.starts_with('{')).unwrap_or_default();
    Ok(serde_json::from_str(line)?)
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_side_keeps_what_fits_in_the_budget_and_never_fewer_than_two_trials() {
        let plan = OutputPlan { trials: 8, budget: 12 * GIB, new_reference: true };
        assert_eq!(plan.kept(GIB), 8, "small outputs: every trial");
        assert_eq!(plan.kept(4 * GIB), 3);
        assert_eq!(plan.kept(8 * GIB), 2, "larger than half the budget: still two");
        assert_eq!(OutputPlan { trials: 8, budget: 0, new_reference: true }.kept(8 * GIB), 8, "no budget: every trial");
    }

    #[test]
    fn an_evaluation_s_files_are_both_sides_kept_trials_and_the_timed_outputs() {
        let plan = OutputPlan { trials: 8, budget: 12 * GIB, new_reference: true };
        let sizes = |output_bytes| TaskSizes { input_bytes: 0, output_bytes };
        let both = files_bytes(sizes(8 * GIB), plan);
        assert_eq!((both.candidate, both.reference), (24 * GIB, 16 * GIB), "two trials a side and the timed call");
        assert_eq!(files_bytes(sizes(GIB), plan).total(), 18 * GIB, "8 trials a side, the last and one sampled call");
        let small = files_bytes(sizes(1 << 20), plan);
        assert_eq!(small.candidate, 13 << 20, "8 trials, the last timed call and four sampled ones");
        assert_eq!(files_bytes(sizes(0), plan).total(), 0);
        let cached = OutputPlan { new_reference: false, ..plan };
        let candidate_only = FilesBytes { candidate: 24 * GIB, reference: 0 };
        assert_eq!(files_bytes(sizes(8 * GIB), cached), candidate_only, "the reference's entry is written already");
    }

    #[tokio::test]
    async fn reservations_wait_for_room_and_an_unknown_task_takes_the_whole_budget() {
        let budget = DiskBudget::new(10 * GIB);
        let plan = OutputPlan { trials: 8, budget: 12 * GIB, new_reference: true };
        assert_eq!(budget.need(None, plan), 10 * GIB);
        let small = TaskSizes { input_bytes: GIB, output_bytes: 256 << 20 };
        assert_eq!(budget.need(Some(small), plan), (21 * 256) << 20, "8 trials and 5 timed calls, 8 trials");
        let huge = TaskSizes { input_bytes: GIB, output_bytes: 8 * GIB };
        assert_eq!(budget.need(Some(huge), plan), 10 * GIB, "more than the budget: the whole of it");

        let first = budget.reserve(6 * GIB).await;
        assert_eq!(budget.unreserved(), 4 * GIB);
        let mut second = Box::pin(budget.reserve(6 * GIB));
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(second.as_mut().poll(&mut context).is_pending(), "no room beside the first");
        drop(first);
        let _second = second.await;
        assert_eq!(budget.unreserved(), 4 * GIB);
    }

    #[tokio::test]
    async fn a_small_reservation_does_not_wait_behind_a_large_one_and_the_budget_still_holds() {
        let budget = DiskBudget::new(16 * GIB); // a 1 GiB lane for reservations of at most 256 MiB
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        let tiny = budget.reserve(100 << 10).await;
        assert_eq!(budget.unreserved(), 16 * GIB - UNIT, "from the main budget while nobody waits there");
        drop(tiny);
        let first = budget.reserve(10 * GIB).await;
        let mut large = Box::pin(budget.reserve(10 * GIB));
        assert!(large.as_mut().poll(&mut context).is_pending(), "no room beside the first");
        // The main budget has 5 GiB free, held for the waiting large reservation: small ones use their lane.
        let mut smalls = Vec::new();
        for _ in 0..4 {
            smalls.push(budget.reserve(256 << 20).await);
        }
        let mut fifth = Box::pin(budget.reserve(256 << 20));
        assert!(fifth.as_mut().poll(&mut context).is_pending(), "the lane is full: in order behind the others");
        assert!(large.as_mut().poll(&mut context).is_pending());
        drop(first);
        let large = large.await;
        assert_eq!(budget.unreserved(), 5 * GIB, "the large one took its room from the main budget, the smalls none");
        drop(smalls);
        let _fifth = fifth.await;
        drop(large);
        let whole = budget.reserve(16 * GIB).await;
        assert_eq!(budget.unreserved(), GIB - (256 << 20), "a reservation takes at most the main budget");
        drop(whole);
    }
}
