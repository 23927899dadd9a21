//! The engine: what every run of candidate code shares in one process. It owns the work directory (harness files,
//! caches, scratch space), the probed Python environment, the sandbox fitted to this host, the compile pool, the
//! device lanes and the admission queue, the disk budget, and the censuses kept for profiles. The evaluator's and
//! the profiler's pipelines are built on it; in one process they share one engine ([`Engine::shared`]), so a GPU
//! has one set of lanes (a profile never runs beside a timed stage) and a build is compiled once.
//!
//! - [`setup`](self::setup): start-up, sandbox fitting and the warm-up;
//! - [`compile`](self::compile): the artifact cache's entry point, [`Engine::build`];
//! - [`candidate`](self::candidate): the candidate's process, its stage on a lane, and what it reported;
//! - [`submission`](self::submission): a request checked into a [`Submission`];
//! - [`error`](self::error): the engine's own failures, [`InfraError`].

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kforge_proto::v1 as pb;
use kforge_sandbox::Sandbox;
use kforge_static_checks::Policy;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

use crate::cache::Cache;
use crate::census;
use crate::config::ExecutionConfig;
use crate::devices::{self, Lane, Lanes};
use crate::disk::DiskBudget;
use crate::handoff::MemoryFiles;
use crate::metrics::ExecutionMetrics;
use crate::protocol::{Report, StageSpec};
use crate::python::{PythonEnv, PythonUnavailable};
use crate::stage::{self, Joining, Request, Stage, StageError, StageOutcome, Started};

mod candidate;
mod compile;
mod error;
mod findings;
mod setup;
mod submission;

pub use candidate::out_of_memory;
pub use compile::Built;
pub use error::InfraError;
pub use findings::{finding_proto, hack_finding};
pub use setup::WarmUpFailed;
pub use submission::{Backend, RequestError, Submission, SubmissionRequest};

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

impl Engine {
    pub fn config(&self) -> &ExecutionConfig {
        &self.inner.config
    }

    /// The work directory, absolute.
    pub fn work_dir(&self) -> &Path {
        &self.inner.work_dir
    }

    pub fn sandbox(&self) -> &Sandbox {
        &self.inner.sandbox
    }

    /// The Python environment, or why there is none usable.
    pub fn python(&self) -> Result<&PythonEnv, &PythonUnavailable> {
        self.inner.python.as_ref()
    }

    /// The Python environment of a run whose submission was checked (`Engine::submission` refuses every request
    /// while there is none).
    pub fn checked_python(&self) -> &PythonEnv {
        self.inner.python.as_ref().expect("a submission is made only with a usable environment")
    }

    pub fn lanes(&self) -> &Arc<Lanes> {
        &self.inner.lanes
    }

    pub fn disk(&self) -> &DiskBudget {
        &self.inner.disk
    }

    pub fn memory_files(&self) -> Option<&MemoryFiles> {
        self.inner.memory_files.as_ref()
    }

    pub fn censuses(&self) -> &census::Recent {
        &self.inner.censuses
    }

    pub fn metrics(&self) -> &ExecutionMetrics {
        &self.inner.metrics
    }

    /// A place in the admission queue (`queue_capacity` runs at once, evaluations and profiles together), or
    /// [`RequestError::QueueFull`].
    pub fn admit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, RequestError> {
        self.inner
            .admission
            .clone()
            .try_acquire_owned()
            .map_err(|_| RequestError::QueueFull { capacity: self.inner.config.queue_capacity, retry_after_secs: 30 })
    }

    /// What this engine can run: backends, devices (quarantined ones say why), policies, sandbox protections,
    /// versions and the queue's capacity.
    pub fn capabilities(&self) -> pb::GetCapabilitiesResponse {
        let inner = &self.inner;
        let (backends, devices, versions) = match &inner.python {
            Ok(env) => {
                let mut backends = vec![pb::Backend::Cpu as i32];
                if !env.gpus.is_empty() {
                    backends.push(pb::Backend::Cuda as i32);
                    if env.versions.contains_key("triton") {
                        backends.push(pb::Backend::Triton as i32);
                    }
                }
                let mut devices = vec!["cpu".to_owned()];
                devices.extend(env.gpus.iter().enumerate().map(|(i, g)| {
                    let device = format!("cuda:{i} {} (sm {})", g.name, g.capability);
                    match inner.lanes.quarantine_reason(i) {
                        Some(reason) => format!("{device} quarantined: {reason}"),
                        None => device,
                    }
                }));
                (backends, devices, env.versions.clone().into_iter().collect())
            }
            Err(_) => (vec![], vec![], HashMap::new()),
        };
        let mut sandbox: Vec<pb::SandboxProtection> = inner
            .sandbox
            .protections()
            .iter()
            .map(|p| pb::SandboxProtection { name: p.name.into(), active: p.active, detail: p.detail.clone() })
            .collect();
        let has_gpu = inner.python.as_ref().is_ok_and(|env| !env.gpus.is_empty());
        sandbox.push(match (has_gpu, inner.lanes.probe_program()) {
            (false, _) => pb::SandboxProtection {
                name: "device_health_probe".into(),
                active: false,
                detail: "no GPU to probe".into(),
            },
            (true, Ok(program)) => pb::SandboxProtection {
                name: "device_health_probe".into(),
                active: true,
                detail: format!("{} after each device fault; a failing GPU is quarantined", program.display()),
            },
            (true, Err(reason)) => {
                pb::SandboxProtection { name: "device_health_probe".into(), active: false, detail: reason.to_string() }
            }
        });
        pb::GetCapabilitiesResponse {
            backends,
            devices,
            policies: Policy::ALL.iter().map(Policy::id).collect(),
            sandbox,
            versions,
            queue_capacity: inner.config.queue_capacity as u32,
            python: match &inner.python {
                Ok(env) => env.python.display().to_string(),
                Err(reason) => reason.to_string(),
            },
            disk_budget_bytes: inner.disk.capacity(),
            memory_files_bytes: inner.memory_files.as_ref().map_or(0, |files| files.budget().capacity()),
        }
    }

    /// False while every GPU is quarantined: the services' readiness.
    pub fn readiness(&self) -> watch::Receiver<bool> {
        self.inner.lanes.readiness()
    }

    /// Where each GPU's time went since this engine started: alone, draining, shared, empty.
    pub fn gpu_accounts(&self) -> Vec<devices::GateAccount> {
        self.inner.lanes.gpu_accounts()
    }

    /// Runs `run`, accounting the CPU time of the harness stages it runs; returns its output and the CPU
    /// milliseconds by stage.
    pub async fn with_cpu_account<T>(run: impl Future<Output = T>) -> (T, BTreeMap<&'static str, f64>) {
        STAGE_CPU
            .scope(RefCell::default(), async {
                let output = run.await;
                (output, STAGE_CPU.with(RefCell::take))
            })
            .await
    }

    /// Starts a harness process for `stage` now; it waits for its request (see [`stage::start`]).
    pub fn start(&self, stage: Stage, cancel: &CancellationToken) -> Started {
        let inner = &self.inner;
        stage::start(&inner.sandbox, self.checked_python(), &inner.harness, stage, cancel.child_token())
    }

    /// Runs `request` in a started harness process; one on a GPU `lane` that ends in a device fault has the device
    /// probed before the lane is used again.
    pub async fn stage<S: StageSpec>(
        &self,
        started: Started,
        request: Request<S>,
        lane: Option<&Lane>,
    ) -> Result<StageOutcome<S::Result>, StageError> {
        let inner = &self.inner;
        let name = request.mode().name();
        let _running = inner.metrics.stage(name);
        let started_at = std::time::Instant::now();
        // Stages that run no candidate code join idle and share the device only for their device work.
        let trusted = request.mode().trusted();
        let joining = |lane: &Lane| match lane.solo() {
            false if trusted => Joining::Idle,
            solo => Joining::Share { solo },
        };
        let outcome = started.run(request, lane.map(|lane| (lane.gate(), joining(lane)))).await;
        if let (Ok(outcome), Some(lane)) = (&outcome, lane) {
            lane.add_gate_times(outcome.gate);
        }
        inner.metrics.stage_seconds(name, started_at.elapsed());
        if let Some(cpu_ms) = outcome.as_ref().ok().and_then(|outcome| outcome.cpu_ms()) {
            // Work outside an accounted run (a baseline computed ahead) has no account to add to.
            let _ = STAGE_CPU.try_with(|spent| *spent.borrow_mut().entry(name).or_default() += cpu_ms);
        }
        if let (Ok(finished), Some(lane)) = (&outcome, lane)
            && lane.gpu().is_some()
            && let Some(fault) = devices::fault(finished.finished.exit, &finished.error_text())
        {
            inner.lanes.after_fault(lane, &fault).await;
        }
        // Only now may the others on the device run alone without this stage: a stage that was killed, hung or
        // faulted leaves the device once it has been checked.
        outcome.map(|mut outcome| {
            outcome.leave_gate();
            outcome
        })
    }

    /// Evicts from `cache` in the background if it grew past its bound.
    pub fn evict_later(&self, name: &'static str, cache: &Cache) {
        let (cache, metrics) = (cache.clone(), self.inner.metrics.clone());
        tokio::task::spawn_blocking(move || {
            let removed = cache.evict();
            if removed > 0 {
                tracing::info!(cache = name, removed, "evicted cache entries");
                metrics.evicted(name, removed);
            }
        });
    }

    /// A fresh scratch directory's path (`prefix` names what it is for), unique across every engine of this
    /// process and every process sharing the work directory. Not created.
    pub fn scratch_dir(&self, prefix: &str) -> PathBuf {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.scratch_root.join(format!("{}-{prefix}{id}", std::process::id()))
    }

    /// Seeds the candidate cannot know in advance: derived from a secret drawn when this engine started, so they
    /// repeat per task and `purpose` (and the reference cache hits) but differ between engine instances.
    pub fn seeds(&self, task_key: &str, purpose: &str, count: usize) -> Vec<u64> {
        let hasher = std::hash::BuildHasherDefault::<std::hash::DefaultHasher>::default();
        (0..count).map(|i| hasher.hash_one((self.inner.secret, task_key, purpose, i)) % (1 << 31)).collect()
    }

    /// The device memory a run of the task needs on a GPU, from its reference's measured peak
    /// (`devices::footprint`); `None` until the task's reference has run on a GPU in this engine (or its cache
    /// entry recorded the peak). With GPUs of several kinds, the largest known.
    pub fn footprint(&self, task_key: &str) -> Option<u64> {
        self.reference_peak(task_key).map(devices::footprint)
    }

    /// The largest reference peak device memory known for the task on any of this engine's GPUs.
    pub fn reference_peak(&self, task_key: &str) -> Option<u64> {
        let python = self.inner.python.as_ref().ok()?;
        let peaks = self.inner.reference_peaks.lock().expect("never poisoned");
        let known = python.gpus.iter().filter_map(|gpu| peaks.get(&(task_key.to_owned(), gpu.name.clone())));
        known.copied().max()
    }

    /// Keeps the task's reference peak device memory on `device` (by name).
    pub fn note_reference_peak(&self, task_key: &str, device: &str, peak: u64) {
        let mut peaks = self.inner.reference_peaks.lock().expect("never poisoned");
        peaks.insert((task_key.to_owned(), device.to_owned()), peak);
    }

    /// The task's reference eager median per call on `gpu` (or the CPU), as the latest baseline said.
    pub fn eager_median_ms(&self, task_key: &str, gpu: Option<usize>) -> Option<f64> {
        let device = self.inner.python.as_ref().ok()?.device_name(gpu).to_owned();
        self.inner.eager_medians.lock().expect("never poisoned").get(&(task_key.to_owned(), device)).copied()
    }

    /// Keeps the task's reference eager median per call on `gpu` (or the CPU).
    pub fn note_eager_median(&self, task_key: &str, gpu: Option<usize>, median_ms: f64) {
        let Ok(python) = self.inner.python.as_ref() else { return };
        let key = (task_key.to_owned(), python.device_name(gpu).to_owned());
        self.inner.eager_medians.lock().expect("never poisoned").insert(key, median_ms);
    }
}

/// The harness's time per phase of a stage (`phases_ms`), as `stage_ms` entries `<stage>.<phase>`.
pub fn phases_into<R>(result: &Report<R>, stage: &str, stage_ms: &mut HashMap<String, f64>) {
    for (phase, value) in &result.phases_ms {
        stage_ms.insert(format!("{stage}.{phase}"), *value);
    }
}

/// Milliseconds, as `stage_ms` holds them.
pub fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// A scratch directory, removed however the work in it ends (cancellation included): outputs can be large.
#[derive(Debug)]
pub struct RemoveOnDrop(pub PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
