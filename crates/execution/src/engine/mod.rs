//! The engine: what every run of candidate code shares in one process. It owns the work directory (harness files,
//! caches, scratch space), the probed Python environment, the sandbox fitted to this host, the compile pool, the
//! device lanes and the admission queue, the disk budget, and the censuses kept for profiles. The evaluator's and
//! the profiler's pipelines are built on it; in one process they share one engine ([`Engine::shared`]), so a GPU
//! has one set of lanes (a profile never runs beside a timed stage) and a build is compiled once.
//!
//! Its surface, one concern per module (each one `impl Engine` block):
//!
//! - [`setup`](self::setup): start-up, sandbox fitting and the warm-up;
//! - [`resources`](self::resources): the parts a pipeline builds on (environment, lanes, disk, caches, metrics);
//! - [`serving`](self::serving): admission, readiness and what the engine can run ([`Capabilities`]);
//! - [`submission`](self::submission): a request checked into a [`Submission`];
//! - [`compile`](self::compile): the shared start of every run, [`Engine::check`] then [`Engine::build`];
//! - [`candidate`](self::candidate): the candidate's process, its stage on a lane, and what it reported, judged;
//! - [`stages`](self::stages): harness stages of any kind, their CPU account, scratch directories;
//! - [`tasks`](self::tasks): what the engine learns of each task (seeds, reference peaks, eager medians);
//! - [`outcome`](self::outcome): how a run ends and what each step reports, in the engine's own terms;
//! - [`error`](self::error): the engine's own failures, [`InfraError`].

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use kforge_sandbox::Sandbox;
use tokio::sync::{Semaphore, watch};

use crate::cache::Cache;
use crate::census;
use crate::config::ExecutionConfig;
use crate::devices::Lanes;
use crate::disk::DiskBudget;
use crate::handoff::MemoryFiles;
use crate::metrics::ExecutionMetrics;
use crate::python::{PythonEnv, PythonUnavailable};

mod candidate;
mod compile;
mod error;
mod outcome;
mod resources;
mod serving;
mod setup;
mod stages;
mod submission;
mod tasks;

pub use candidate::out_of_memory;
pub use compile::{Built, Checked};
pub use error::InfraError;
pub use outcome::{Finding, Judgement, Notes, Staged, Stop, Verdict};
pub use serving::Capabilities;
pub use setup::WarmUpFailed;
pub use submission::{Backend, RequestError, RequestedBackend, Submission, SubmissionRequest, TaskSource};

tokio::task_local! {
    /// CPU milliseconds of the current run's harness stages (each process and the children it waited for, as the
    /// harness reports them), by stage.
    static STAGE_CPU: RefCell<BTreeMap<&'static str, f64>>;
}

struct Inner {
    config: ExecutionConfig,
    sandbox: Sandbox,
    python: Result<PythonEnv, PythonUnavailable>,
    harness: PathBuf,
    work_dir: PathBuf,
    artifacts: Cache,
    scratch_root: PathBuf,
    compile_slots: Semaphore,
    lanes: Arc<Lanes>,
    admission: Arc<Semaphore>,
    /// The disk the runs' files may take at once (`disk.rs`).
    disk: DiskBudget,
    /// Where candidates' outputs files go in memory, if the host has a memory-backed filesystem for them
    /// (`handoff.rs`).
    memory_files: Option<MemoryFiles>,
    secret: u64,
    metrics: ExecutionMetrics,
    /// Peak device memory of each task's reference, by (task key, device name), as the reference stage measured
    /// it: what memory-aware admission estimates a run's footprint from (`devices::footprint`).
    reference_peaks: Mutex<HashMap<(String, String), u64>>,
    /// The reference's eager median per call, by (task key, device name), as the latest baseline read or timed
    /// said: what a call's limit scales with.
    eager_medians: Mutex<HashMap<(String, String), f64>>,
    /// The warm-up's outcome once it is over: the bindings' precompiled header, or why there is none.
    warm: watch::Receiver<Option<Result<PathBuf, WarmUpFailed>>>,
    /// The GPU censuses of the latest evaluations and profiles, which a profile reuses.
    censuses: census::Recent,
}

/// The engine: cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("work_dir", &self.inner.work_dir)
            .field("python", &self.inner.python.as_ref().map(|p| &p.python))
            .finish_non_exhaustive()
    }
}
