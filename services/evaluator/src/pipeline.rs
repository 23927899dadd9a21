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

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kforge_proto::v1 as pb;
use kforge_sandbox::{Exit, Sandbox, tail as cap};
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

use crate::bindings_pch;
use crate::cache::{self, Cache, Entry};
use crate::census;
use crate::config::{BuildRecipe, CallLimitsConfig, EvaluatorConfig};
use crate::devices::{self, Lane, Lanes, MemberTimes};
use crate::metrics::EvaluatorMetrics;
use crate::protocol::{
    BaselineSpec, CandidatePlacement, CandidateResult, CandidateRun, CandidateSpec, CompareSpec, CompileSpec,
    MismatchRecord, Report, Sensitivity, StageSpec, TimingSpec,
};
use crate::python::{self, CallLimits, Joining, PythonEnv, Request, Stage, StageError, StageOutcome, Started};
use crate::statics::{self, Category, Policy};
use crate::stats::timing_stats;

tokio::task_local! {
    /// CPU milliseconds of the current evaluation's harness stages (each process and the children it waited for,
    /// as the harness reports them), by stage; reported as `stage_ms["cpu.<stage>"]`.
    static STAGE_CPU: RefCell<BTreeMap<&'static str, f64>>;
}

/// Why a request was refused before evaluation (a verdict is never an error).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    #[error("evaluation queue is full ({capacity} admitted); retry in about {retry_after_secs} s")]
    QueueFull { capacity: usize, retry_after_secs: u64 },
    #[error("no backend can run evaluations: {0}")]
    Unavailable(String),
}

fn invalid(field: &str, reason: impl Into<String>) -> RequestError {
    RequestError::Invalid { field: field.into(), reason: reason.into() }
}

/// A backend resolved against this evaluator's devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Cpu,
    Cuda,
    Triton,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Triton => "triton",
        }
    }
}

/// A validated request.
#[derive(Debug, Clone)]
struct Job {
    request_id: String,
    task_id: String,
    task: String,
    candidate: String,
    backend: Backend,
    policy: Policy,
    trials: u32,
    measure: bool,
    census: bool,
    priority: i32,
    job_id: String,
}

struct Inner {
    config: EvaluatorConfig,
    sandbox: Sandbox,
    python: Result<PythonEnv, String>,
    harness: PathBuf,
    artifacts: Cache,
    references: Cache,
    baselines: Cache,
    scratch_root: PathBuf,
    compile_slots: Semaphore,
    lanes: Arc<Lanes>,
    admission: Arc<Semaphore>,
    secret: u64,
    metrics: EvaluatorMetrics,
    /// Peak device memory of each task's reference, by (task key, device name), as the reference stage measured
    /// it: what memory-aware admission estimates an evaluation's footprint from (`devices::footprint`).
    reference_peaks: Mutex<HashMap<(String, String), u64>>,
    /// The warm-up's outcome once it is over: the bindings' precompiled header, or why there is none.
    warm: watch::Receiver<Option<Result<PathBuf, String>>>,
}

/// The evaluator: cheap to clone, shared by every request.
#[derive(Clone)]
pub struct Evaluator {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Evaluator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Evaluator")
            .field("python", &self.inner.python.as_ref().map(|p| &p.python))
            .finish_non_exhaustive()
    }
}

impl Evaluator {
    /// The sandbox as far as this host's interpreter and GPU driver work in it. A protection that stops them is
    /// dropped and reported rather than left to fail every evaluation: job users where the interpreter is out of
    /// their reach (under a private home directory) or the GPU's device files are; Landlock where the GPU driver
    /// fails under it; both where only that works.
    async fn fit_sandbox(sandbox: Sandbox, env: &PythonEnv, scratch: &std::path::Path) -> Sandbox {
        let gpu = !env.gpus.is_empty();
        let what = if gpu { "the GPU driver" } else { "the interpreter" };
        let Err(reason) = python::sandbox_probe(&sandbox, env, scratch, gpu).await else { return sandbox };
        let no_users = format!("disabled: {what} fails as a job user on this host ({reason})");
        let no_landlock = format!("disabled: {what} fails under it on this host ({reason})");
        let (users, landlock) = (sandbox.job_users_active(), gpu && sandbox.landlock_active());
        let mut fallbacks = Vec::new();
        if users {
            fallbacks.push(("job_user", sandbox.without_job_users(no_users.clone())));
        }
        if landlock {
            fallbacks.push(("landlock", sandbox.without_landlock(no_landlock.clone())));
        }
        if users && landlock {
            fallbacks
                .push(("job_user and landlock", sandbox.without_job_users(no_users).without_landlock(no_landlock)));
        }
        for (dropped, fallback) in fallbacks {
            if python::sandbox_probe(&fallback, env, scratch, gpu).await.is_ok() {
                tracing::warn!(%reason, dropped, "{what} fails in the sandbox here; running without");
                return fallback;
            }
        }
        tracing::warn!(%reason, "{what} fails in the sandbox, whatever is dropped: evaluations will fail");
        sandbox
    }

    /// Prepares the work directory, probes the sandbox and the Python environment. An environment without
    /// PyTorch is not fatal: the evaluator serves and says why it cannot evaluate.
    pub async fn new(config: EvaluatorConfig, metrics: EvaluatorMetrics) -> std::io::Result<Self> {
        let work = std::path::absolute(&config.work_dir)?;
        let harness_dir = work.join("harness");
        std::fs::create_dir_all(&harness_dir)?;
        // Replaced atomically: evaluators in other processes may share the work directory and be starting the
        // harness right now (a truncated file would run as an empty script and exit 0 without a result).
        for (name, contents) in python::HARNESS_FILES {
            let path = harness_dir.join(name);
            if std::fs::read(&path).ok().as_deref() != Some(contents.as_bytes()) {
                let staged = harness_dir.join(format!("{name}.{}", std::process::id()));
                std::fs::write(&staged, contents)?;
                std::fs::rename(&staged, &path)?;
            }
        }
        let harness = harness_dir.join("kforge_harness.py");
        let scratch_root = work.join("scratch");
        std::fs::create_dir_all(&scratch_root)?;
        let sandbox = Sandbox::detect_with(config.sandbox).await;
        let mut python = PythonEnv::probe(&config.python, &scratch_root.join("probe")).await;
        if let Ok(env) = &mut python {
            env.use_build_recipe(config.build_recipe, &harness_dir.join("kforge_nvcc.py"));
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            if let Some(threads) = config.gpu_stage_threads_on(env.gpus.len(), cores) {
                env.limit_gpu_stage_threads(threads);
            }
            if config.reserve_timing_cpu && !env.gpus.is_empty() {
                match env.reserve_timing_cpus() {
                    [] => tracing::info!("fewer than four CPUs per GPU: timed work shares the CPUs with every stage"),
                    cpus => tracing::info!(?cpus, "one CPU per GPU is kept for launching its timed work"),
                }
            }
        }
        let sandbox = match &python {
            Ok(env) => Self::fit_sandbox(sandbox, env, &scratch_root.join("sandbox-probe")).await,
            Err(_) => sandbox,
        };
        match &python {
            Ok(env) => {
                tracing::info!(python = %env.python.display(), versions = ?env.versions, gpus = env.gpus.len(), "evaluator ready")
            }
            Err(error) => tracing::warn!(%error, "evaluator cannot evaluate until python with torch is configured"),
        }
        let warm = Self::warm_up_in_background(&config, &sandbox, &python, &harness, &work)?;
        let compile_workers = match config.compile_workers {
            0 => std::thread::available_parallelism().map_or(2, usize::from),
            n => n,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                artifacts: Cache::new(work.join("artifacts"), config.cache_limits.artifacts_bytes)?,
                references: Cache::new(work.join("references"), config.cache_limits.references_bytes)?,
                baselines: Cache::new(work.join("baselines"), config.cache_limits.baselines_bytes)?,
                admission: Arc::new(Semaphore::new(config.queue_capacity)),
                compile_slots: Semaphore::new(compile_workers),
                lanes: Lanes::with_budgets(
                    gpu_memory_budgets(&config, &python),
                    config.gpu_slots,
                    config.device_probe.clone(),
                    metrics.clone(),
                ),
                reference_peaks: Mutex::default(),
                secret: std::collections::hash_map::RandomState::new().hash_one("kforge-evaluator-seeds"),
                config,
                sandbox,
                python,
                harness,
                scratch_root,
                metrics,
                warm,
            }),
        })
    }

    /// Starts the warm-up (precompiling the bindings' header, with kforge's build recipe and `bindings_pch`);
    /// compiles that start before it ends build without what it makes.
    fn warm_up_in_background(
        config: &EvaluatorConfig,
        sandbox: &Sandbox,
        python: &Result<PythonEnv, String>,
        harness: &Path,
        work: &Path,
    ) -> std::io::Result<watch::Receiver<Option<Result<PathBuf, String>>>> {
        let (done, warm) = watch::channel(None);
        let python = match python {
            Ok(python) if config.build_recipe == BuildRecipe::Kforge && config.bindings_pch => python.clone(),
            Ok(_) => {
                done.send_replace(Some(Err("off (build_recipe, bindings_pch)".into())));
                return Ok(warm);
            }
            Err(error) => {
                done.send_replace(Some(Err(error.clone())));
                return Ok(warm);
            }
        };
        let cache = Cache::new(work.join("pch"), config.cache_limits.bindings_pch_bytes)?;
        let scratch = work.join("scratch").join(format!("{}-bindings-pch", std::process::id()));
        let (sandbox, harness) = (sandbox.clone(), harness.to_owned());
        let wall = Duration::from_secs(config.compile_timeout_secs);
        tokio::spawn(async move {
            let _ = std::fs::create_dir_all(&scratch);
            let built = bindings_pch::build(&sandbox, &python, &harness, &cache, &scratch, wall).await;
            let _ = std::fs::remove_dir_all(&scratch);
            let _pin = match built {
                Ok((dir, pin)) => {
                    python.offer_bindings_pch(dir.clone());
                    // Older versions' headers go once this one is pinned.
                    tokio::task::spawn_blocking(move || cache.evict());
                    done.send_replace(Some(Ok(dir)));
                    Some(pin)
                }
                Err(reason) => {
                    tracing::warn!(%reason, "building without a precompiled bindings header");
                    done.send_replace(Some(Err(reason.to_string())));
                    None
                }
            };
            // Pinned, so that no eviction removes it, while this evaluator lives.
            done.closed().await;
        });
        Ok(warm)
    }

    /// Waits for the warm-up to end: the bindings' precompiled header in place (its directory), or why it is not.
    /// Evaluations do not wait for it.
    pub async fn warm_up(&self) -> Result<PathBuf, String> {
        let mut warm = self.inner.warm.clone();
        let outcome = warm.wait_for(Option::is_some).await.map(|outcome| outcome.clone());
        outcome.ok().flatten().unwrap_or_else(|| Err("the warm-up ended without an outcome".into()))
    }

    /// What this evaluator can do.
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
        }
    }

    /// False while every GPU is quarantined: the service's readiness.
    pub fn readiness(&self) -> tokio::sync::watch::Receiver<bool> {
        self.inner.lanes.readiness()
    }

    /// Where each GPU's time went since this evaluator started: alone, draining, shared, empty.
    pub fn gpu_accounts(&self) -> Vec<devices::GateAccount> {
        self.inner.lanes.gpu_accounts()
    }

    /// Evaluates one request. Dropping the returned future cancels the evaluation and kills its children.
    pub async fn evaluate(&self, request: pb::EvaluateRequest) -> Result<pb::EvaluateResponse, RequestError> {
        let job = self.validate(request)?;
        let permit = self.inner.admission.clone().try_acquire_owned().map_err(|_| RequestError::QueueFull {
            capacity: self.inner.config.queue_capacity,
            retry_after_secs: 30,
        })?;
        let _admitted = self.inner.metrics.admitted();
        let scratch = self.scratch_dir("");
        // Removed however the evaluation ends (including cancellation): candidate outputs can be large.
        let _cleanup = RemoveOnDrop(scratch.clone());
        let cancel = CancellationToken::new();
        let _cancel_on_drop = cancel.clone().drop_guard();
        let mut response = pb::EvaluateResponse { request_id: job.request_id.clone(), ..Default::default() };
        let mut lane_held = None;
        let (verdict, stage_cpu) = STAGE_CPU
            .scope(RefCell::default(), async {
                let verdict = self.run(&job, &scratch, &cancel, &mut response, &mut lane_held).await;
                (verdict, STAGE_CPU.with(RefCell::take))
            })
            .await;
        for (stage, cpu_ms) in stage_cpu {
            response.stage_ms.insert(format!("cpu.{stage}"), cpu_ms);
        }
        // The lane was released when `run` returned: its hold is the device time this evaluation took.
        if let Some((held, gate)) = lane_held {
            response.stage_ms.insert("device".into(), ms(held.elapsed()));
            self.inner.metrics.stage_seconds("device_lane", held.elapsed());
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

    fn validate(&self, request: pb::EvaluateRequest) -> Result<Job, RequestError> {
        let config = &self.inner.config;
        let pb::EvaluateRequest {
            request_id,
            task,
            candidate_source,
            backend,
            policy,
            correctness_trials,
            measure_performance,
            census,
            idempotency_key: _,
            priority,
            job_id,
        } = request;
        let task = task.ok_or_else(|| invalid("task", "required"))?;
        if task.source.trim().is_empty() {
            return Err(invalid("task.source", "required"));
        }
        if task.source.len() > config.max_source_bytes {
            return Err(invalid(
                "task.source",
                format!("{} bytes, over the {}-byte limit", task.source.len(), config.max_source_bytes),
            ));
        }
        statics::check_task(&task.source).map_err(|reason| invalid("task.source", reason))?;
        if candidate_source.trim().is_empty() {
            return Err(invalid("candidate_source", "required"));
        }
        if candidate_source.len() > config.max_source_bytes {
            return Err(invalid(
                "candidate_source",
                format!("{} bytes, over the {}-byte limit", candidate_source.len(), config.max_source_bytes),
            ));
        }
        // The request is checked before the environment: a caller's mistake is worth knowing first.
        let python = self.inner.python.as_ref().map_err(|e| RequestError::Unavailable(e.clone()))?;
        let has_gpu = !python.gpus.is_empty();
        let backend = match pb::Backend::try_from(backend) {
            Ok(pb::Backend::Unspecified) if has_gpu => Backend::Cuda,
            Ok(pb::Backend::Unspecified | pb::Backend::Cpu) => Backend::Cpu,
            Ok(pb::Backend::Cuda) if has_gpu => Backend::Cuda,
            Ok(pb::Backend::Triton) if has_gpu && python.versions.contains_key("triton") => Backend::Triton,
            Ok(requested @ (pb::Backend::Cuda | pb::Backend::Triton)) => {
                return Err(invalid(
                    "backend",
                    format!("{} needs a GPU with its toolchain; this evaluator has only cpu", requested.as_str_name()),
                ));
            }
            Err(_) => return Err(invalid("backend", format!("unknown value {backend}"))),
        };
        let policy_name = if policy.is_empty() { config.default_policy.as_str() } else { policy.as_str() };
        let policy = Policy::resolve(policy_name).ok_or_else(|| {
            let known: Vec<String> = Policy::ALL.iter().map(Policy::id).collect();
            invalid("policy", format!("unknown policy `{policy_name}` (known: {})", known.join(", ")))
        })?;
        let trials = if correctness_trials == 0 { config.default_trials } else { correctness_trials };
        if trials > 100 {
            return Err(invalid("correctness_trials", format!("{trials} is over the limit of 100")));
        }
        let task_id = if task.task_id.is_empty() { "task".to_owned() } else { task.task_id };
        Ok(Job {
            request_id,
            task_id,
            task: task.source,
            candidate: candidate_source,
            backend,
            policy,
            trials,
            measure: measure_performance,
            census: census || measure_performance,
            priority,
            job_id,
        })
    }

    /// Runs every stage, filling `response`; returns the verdict.
    async fn run(
        &self,
        job: &Job,
        scratch: &Path,
        cancel: &CancellationToken,
        response: &mut pb::EvaluateResponse,
        lane_held: &mut Option<(Instant, Arc<Mutex<MemberTimes>>)>,
    ) -> pb::Verdict {
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");

        let started = Instant::now();
        let mut report = statics::check_candidate(&job.candidate, job.policy);
        report.findings.extend(statics::precision_downgrade(&job.candidate, &job.task));
        response.findings.extend(report.findings.iter().map(finding_proto));
        response.stage_ms.insert("static".into(), ms(started.elapsed()));
        if report.syntax_error {
            return pb::Verdict::CompileError;
        }
        if report.rejected() {
            return pb::Verdict::Rejected;
        }
        let own_kernels = statics::own_kernel_names(&job.candidate);

        let stage_dirs = ["compile", "candidate", "check", "baseline"].map(|stage| scratch.join(stage));
        for dir in &stage_dirs {
            if let Err(error) = std::fs::create_dir_all(dir) {
                return infra(response, format!("scratch directory {}: {error}", dir.display()), true);
            }
        }
        let [compile_dir, candidate_dir, check_dir, baseline_dir] = stage_dirs;
        let versions = python.versions_key();
        let task_key = cache::key(&[job.task.as_bytes()]);

        self.baseline_ahead(job);

        // Compile: only candidates that build extensions; the rest are imported where they run.
        let artifact_key = cache::key(&[
            job.candidate.as_bytes(),
            job.backend.name().as_bytes(),
            versions.as_bytes(),
            gpu_arch(python).as_bytes(),
            inner.config.build_recipe.name().as_bytes(),
            // Who owns the build's files: a build made as the evaluator's user (before job users, or where they
            // are off) has files a job user cannot write, such as the lock a later run takes.
            if inner.sandbox.job_users_active() { b"owned by the jobs' group" } else { b"owned by the evaluator" },
        ]);
        let artifact_dir = inner.artifacts.dir(&artifact_key);
        let compiles = builds_extension(&job.candidate);
        // The built extension is pinned until the evaluation ends, so eviction cannot take it meanwhile.
        let mut _artifact_pin = None;
        if compiles {
            let started = Instant::now();
            let compiled = self.compile(job, &artifact_key, &compile_dir, cancel, response).await;
            // The build itself: time waiting for a compile worker is `queue_compile`.
            let queued = response.stage_ms.get("queue_compile").copied().unwrap_or(0.0);
            response.stage_ms.insert("compile".into(), ms(started.elapsed()) - queued);
            if let Some(verdict) = compiled {
                return verdict;
            }
            match inner.artifacts.pin(&artifact_key).await {
                Ok(pin) if inner.artifacts.get(&artifact_key).is_some() => _artifact_pin = Some(pin),
                Ok(_) => return infra(response, "the compiled artifact was evicted before use".into(), true),
                Err(error) => return infra(response, format!("artifact pin: {error}"), true),
            }
        }

        // Started before the lane: the interpreter and torch load while other evaluations use the device.
        let candidate_process = match self.start_candidate(job, &candidate_dir, &artifact_dir, cancel) {
            Ok(started) => started,
            Err(error) => return infra(response, error, true),
        };
        let started = Instant::now();
        let on_gpu = job.backend != Backend::Cpu;
        let footprint = if on_gpu { self.footprint(&task_key) } else { None };
        let lane = match inner.lanes.acquire(on_gpu, job.priority, &job.job_id, footprint).await {
            Ok(lane) => lane,
            Err(unavailable) => return infra(response, unavailable.to_string(), true),
        };
        if on_gpu {
            response.reference_peak_bytes = self.reference_peak(&task_key).unwrap_or(0);
        }
        *lane_held = Some((Instant::now(), lane.gate_times()));
        let gpu = lane.gpu();
        response.stage_ms.insert("queue_device".into(), ms(started.elapsed()));
        response.device = python.device_name(gpu).to_owned();
        // The last `recheck_trials` trials run after timing and the census.
        let mut seeds = self.seeds(&task_key, "trial", (job.trials + inner.config.recheck_trials) as usize);
        let recheck_from = job.trials as usize;
        let sensitivity = self.sensitivity_trial(&task_key, &mut seeds, recheck_from);
        let (init_seed, timing_seeds) = self.baseline_seeds(&task_key);
        if let Err(error) = std::fs::write(check_dir.join("task.py"), &job.task) {
            return infra(response, format!("writing task.py: {error}"), true);
        }
        // The clean process that checks the outputs starts now, while the candidate runs.
        let trials = Trials { seeds: &seeds, init_seed, timing_seeds: &timing_seeds, sensitivity };
        let check = match self.prepare_check(job, &lane, &trials, &check_dir, &candidate_dir, cancel).await {
            Ok(check) => check,
            Err(error) => return infra(response, error, true),
        };

        // The candidate first: nothing of the reference has run on this device for this evaluation.
        let started = Instant::now();
        let spec = CandidateRun {
            init_seed,
            seeds: seeds.clone(),
            recheck_from,
            sensitivity,
            output_bytes_budget: inner.config.output_bytes_budget,
            timing: job.measure.then(|| TimingSpec::from(&inner.config.timing)),
            timing_seeds: timing_seeds.clone(),
            census_calls: if job.census { inner.config.census_calls } else { 0 },
        };
        let limits = self.call_limits(job, gpu);
        let mut candidate =
            self.candidate_stage(candidate_process, &lane, &candidate_dir, spec.clone(), limits.clone()).await;
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
            candidate = match self.restart_candidate(job, &candidate_dir, &artifact_dir, cancel) {
                Ok(process) => self.candidate_stage(process, &lane, &candidate_dir, spec, limits.clone()).await,
                Err(error) => return infra(response, error, true),
            };
        }
        response.stage_ms.insert("run".into(), ms(started.elapsed()));
        let result = match self.candidate_result(candidate, gpu, response) {
            Ok(result) => result,
            Err(verdict) => return verdict,
        };
        phases_into(&result, "run", response);
        let result = result.body;
        response.device_peak_bytes = result.device_peak_bytes.unwrap_or(0);
        // What competition for the CPU cost the timed loop's launching thread (0 when nothing competed).
        if let Some(waited) = result.timing_cpu.as_ref().and_then(|t| t.cpu_wait_ms) {
            response.stage_ms.insert("run.timing_cpu_wait".into(), waited);
        }

        // Correctness, in a clean process.
        let started = Instant::now();
        // The output of the last timed call is checked too, on its rebuilt inputs.
        let timed_call = result.last_call.filter(|_| job.measure);
        let checked = self.check(check, &lane, timed_call).await;
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
                        "the output of a timed call is wrong although the correctness trials passed: the work \
                         done under measurement differs from the work that was checked"
                            .to_owned(),
                    )),
                    Trial::Index(index) if index >= recheck_from => Some((
                        "runtime.changed_after_check",
                        format!(
                            "trial {index}, run after timing and the census, is wrong although the first trials passed"
                        ),
                    )),
                    Trial::Index(_) => None,
                };
                let Some((code, message)) = changed else { return pb::Verdict::Incorrect };
                response.findings.push(hack_finding(code, message));
                return pb::Verdict::Hack;
            }
            Err(error) => return infra(response, error, true),
        }

        if job.measure {
            let started = Instant::now();
            let measured = match timing_samples(&result) {
                Ok(measured) => measured,
                Err(finding) => {
                    response.findings.push(finding);
                    return pb::Verdict::Hack;
                }
            };
            let baseline = match self.baseline(job, &lane, init_seed, &timing_seeds, &baseline_dir, cancel).await {
                Ok(baseline) => baseline,
                Err(error) => return infra(response, error, true),
            };
            if let Some(finding) = wall_clock_mismatch(&measured, &baseline) {
                response.findings.push(finding);
                return pb::Verdict::Hack;
            }
            response.eager_timing = timing_stats(baseline.eager.clone());
            response.compile_timing = baseline.compiled.clone().and_then(timing_stats);
            response.candidate_timing = timing_stats(measured.events.clone());
            set_speedups(response);
            response.stage_ms.insert("timing".into(), ms(started.elapsed()));

            // An implausible speedup is measured again in a fresh process, on inputs the first never saw; the
            // slower of the two counts. Whatever made the first process fast must then work twice, from scratch.
            let bound = inner.config.plausible_speedup;
            if bound > 0.0 && response.speedup_eager > bound {
                let started = Instant::now();
                let first = response.speedup_eager;
                let again = self.remeasure(job, &lane, &task_key, init_seed, &artifact_dir, scratch, cancel).await;
                response.stage_ms.insert("remeasure".into(), ms(started.elapsed()));
                let result = match self.candidate_result(again, gpu, response) {
                    Ok(result) => result,
                    Err(verdict) => return verdict,
                };
                let again = match timing_samples(&result.body) {
                    Ok(again) => again,
                    Err(finding) => {
                        response.findings.push(finding);
                        return pb::Verdict::Hack;
                    }
                };
                if let Some(finding) = wall_clock_mismatch(&again, &baseline) {
                    response.findings.push(finding);
                    return pb::Verdict::Hack;
                }
                let again = timing_stats(again.events);
                let medians =
                    (response.candidate_timing.as_ref().map(|t| t.median_ms), again.as_ref().map(|t| t.median_ms));
                if let (Some(first_ms), Some(again_ms)) = medians {
                    if again_ms > first_ms {
                        response.candidate_timing = again;
                        set_speedups(response);
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
            let modes = match records {
                Ok(modes) => modes,
                Err(error) => {
                    response.findings.push(hack_finding(
                        "runtime.census_unreadable",
                        format!("the census records are malformed: {error}"),
                    ));
                    return pb::Verdict::Hack;
                }
            };
            let median = response.candidate_timing.as_ref().map(|t| t.median_ms);
            let candidate =
                census::Candidate { kernels: &own_kernels, compiles, median_ms: median, policy: job.policy };
            let census = census::analyse(&modes, candidate, gpu.is_some());
            response.kernels = census.kernels;
            response.profiling_ratio = census.profiling_ratio;
            let hack = census.findings.iter().any(|f| f.category == Category::Hack);
            response.findings.extend(census.findings.iter().map(finding_proto));
            if hack {
                return pb::Verdict::Hack;
            }
        }
        pb::Verdict::Correct
    }

    /// Starts the candidate's process in `dir`, before it has a lane: the interpreter starts and imports torch
    /// meanwhile. Its device comes with the request.
    fn start_candidate(
        &self,
        job: &Job,
        dir: &Path,
        artifact_dir: &Path,
        cancel: &CancellationToken,
    ) -> Result<Started, String> {
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");
        std::fs::create_dir_all(dir).map_err(|e| format!("scratch directory {}: {e}", dir.display()))?;
        for (name, source) in [("task.py", &job.task), ("candidate.py", &job.candidate)] {
            std::fs::write(dir.join(name), source).map_err(|e| format!("writing {name}: {e}"))?;
        }
        let mut env = python.env(dir);
        if job.backend == Backend::Cpu {
            // Hidden from the start: a CPU evaluation never sees a GPU.
            env.extend(python.device_env(None).into_iter().map(|(k, v)| (k.into(), v.into())));
        } else {
            // Its GPU is known only once it has a slot, but torch reads its thread limit when it loads, now.
            env.extend(python.gpu_threads_env().into_iter().map(|(k, v)| (k.into(), v.into())));
        }
        env.push(("TORCH_EXTENSIONS_DIR".into(), artifact_dir.join("ext").into()));
        env.push(("TRITON_CACHE_DIR".into(), dir.join("triton").into()));
        let stage = Stage {
            scratch: dir.to_owned(),
            readable: vec![],
            // The extension build directory takes a lock file even when nothing needs building.
            writable: vec![artifact_dir.to_owned()],
            env,
            wall: Duration::from_secs(inner.config.run_timeout_secs),
            background: false,
        };
        Ok(self.start(stage, cancel))
    }

    /// Empties the candidate's directory (nothing of a first run may be read as the second's) and starts the
    /// candidate's process again there. The directory itself stays: the checker was started with it readable.
    fn restart_candidate(
        &self,
        job: &Job,
        dir: &Path,
        artifact_dir: &Path,
        cancel: &CancellationToken,
    ) -> Result<Started, String> {
        let entries = std::fs::read_dir(dir).map_err(|e| format!("scratch directory {}: {e}", dir.display()))?;
        for entry in entries {
            let path = entry.map_err(|e| format!("scratch directory {}: {e}", dir.display()))?.path();
            let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            removed.map_err(|e| format!("clearing {}: {e}", path.display()))?;
        }
        self.start_candidate(job, dir, artifact_dir, cancel)
    }

    /// Runs the candidate's started process on `lane` with `spec`.
    async fn candidate_stage(
        &self,
        started: Started,
        lane: &Lane,
        dir: &Path,
        run: CandidateRun,
        limits: CallLimits,
    ) -> Result<StageOutcome<CandidateResult>, String> {
        let python = self.inner.python.as_ref().expect("validate checked the environment");
        let placement = CandidatePlacement {
            task_path: dir.join("task.py"),
            candidate_path: dir.join("candidate.py"),
            candidate_dir: dir.to_owned(),
            device: lane.device(),
            timing_cpu: python.timing_cpu(lane.gpu()),
        };
        let spec = CandidateSpec { run, placement };
        let request = Request { spec, env: python.device_env(lane.gpu()), limits: Some(limits) };
        self.stage(started, request, Some(lane)).await.map_err(|e| format!("candidate stage: {e}"))
    }

    /// The result of a candidate stage that finished cleanly with nothing found at run time; otherwise the
    /// verdict, with `response` filled in.
    fn candidate_result(
        &self,
        outcome: Result<StageOutcome<CandidateResult>, String>,
        gpu: Option<usize>,
        response: &mut pb::EvaluateResponse,
    ) -> Result<Report<CandidateResult>, pb::Verdict> {
        let outcome = outcome.map_err(|error| infra(response, error, true))?;
        if let Some(verdict) = candidate_failure(&outcome, response) {
            if let Some(reason) = gpu.and_then(|gpu| self.inner.lanes.quarantine_reason(gpu)) {
                response.error.push_str(&format!("\n[the device was quarantined after this: {reason}]"));
            }
            return Err(verdict);
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
            return Err(pb::Verdict::Hack);
        }
        Ok(result)
    }

    /// The candidate's timing alone, in a fresh child, on timing inputs of their own.
    #[allow(clippy::too_many_arguments)]
    async fn remeasure(
        &self,
        job: &Job,
        lane: &Lane,
        task_key: &str,
        init_seed: u64,
        artifact_dir: &Path,
        scratch: &Path,
        cancel: &CancellationToken,
    ) -> Result<StageOutcome<CandidateResult>, String> {
        let timing = self.inner.config.timing;
        // No trials (their budget and sensitivity trial go unread): timing alone.
        let spec = CandidateRun {
            init_seed,
            seeds: vec![],
            recheck_from: 0,
            sensitivity: None,
            output_bytes_budget: self.inner.config.output_bytes_budget,
            timing: Some(TimingSpec::from(&timing)),
            timing_seeds: self.seeds(task_key, "remeasure", timing.input_sets.max(1) as usize),
            census_calls: 0,
        };
        let dir = scratch.join("remeasure");
        let started = self.start_candidate(job, &dir, artifact_dir, cancel)?;
        self.candidate_stage(started, lane, &dir, spec, self.call_limits(job, lane.gpu())).await
    }

    /// Builds the candidate's extensions into the artifact cache; `Some(verdict)` when the evaluation ends here.
    async fn compile(
        &self,
        job: &Job,
        key: &str,
        scratch: &Path,
        cancel: &CancellationToken,
        response: &mut pb::EvaluateResponse,
    ) -> Option<pb::Verdict> {
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");
        if let Some(entry) = inner.artifacts.get(key) {
            inner.metrics.cache("artifact", true);
            response.compile_cache_hit = true;
            return cached_compile(entry, response);
        }
        let queued = Instant::now();
        let _slot = inner.compile_slots.acquire().await.expect("the compile pool is never closed");
        response.stage_ms.insert("queue_compile".into(), ms(queued.elapsed()));
        let lock = match inner.artifacts.lock(key).await {
            Ok(lock) => lock,
            Err(error) => return Some(infra(response, format!("artifact lock: {error}"), true)),
        };
        // Another evaluation may have built it while this one waited.
        if let Some(entry) = inner.artifacts.get(key) {
            inner.metrics.cache("artifact", true);
            response.compile_cache_hit = true;
            return cached_compile(entry, response);
        }
        inner.metrics.cache("artifact", false);
        let artifact_dir = inner.artifacts.dir(key);
        // The build directory (`ext`) is the job's to make, so it is its group's.
        if let Err(error) = std::fs::create_dir_all(&artifact_dir)
            .and_then(|()| std::fs::write(scratch.join("candidate.py"), &job.candidate))
        {
            return Some(infra(response, format!("preparing the compile: {error}"), true));
        }
        // A CPU build must not pick up a GPU toolchain by accident.
        let gpu = (job.backend != Backend::Cpu).then_some(0);
        let mut env = python.env_on(scratch, gpu);
        env.push(("TORCH_EXTENSIONS_DIR".into(), artifact_dir.join("ext").into()));
        let (pch_env, pch_readable) = python.compile_env();
        env.extend(pch_env);
        let stage = Stage {
            scratch: scratch.to_owned(),
            readable: pch_readable,
            writable: vec![artifact_dir.clone()],
            env,
            wall: Duration::from_secs(inner.config.compile_timeout_secs),
            // Compiles fill every core; the stages holding a device go first.
            background: true,
        };
        let request = Request::plain(CompileSpec { candidate_path: scratch.join("candidate.py") });
        let outcome = match self.stage(self.start(stage, cancel), request, None).await {
            Ok(outcome) => outcome,
            Err(error) => return Some(infra(response, format!("compile stage: {error}"), true)),
        };
        let log = outcome.error_text();
        match outcome.finished.exit {
            _ if outcome.ok() => {
                if let Err(error) = inner.artifacts.complete(key, &Entry::Ready(String::new()), &lock) {
                    return Some(infra(response, format!("artifact cache: {error}"), true));
                }
                self.evict_later("artifact", &inner.artifacts);
                None
            }
            Exit::TimedOut => {
                inner.artifacts.discard(key, &lock);
                response.error = format!("compilation exceeded {} s", inner.config.compile_timeout_secs);
                Some(pb::Verdict::Timeout)
            }
            Exit::Cancelled => {
                inner.artifacts.discard(key, &lock);
                Some(infra(response, "cancelled".into(), true))
            }
            // The harness reported the failure: the same source fails the same way, so remember it.
            Exit::Code(_) if outcome.result.is_some() => {
                let log = cap(&log, 16 * 1024);
                if let Err(error) = inner.artifacts.complete(key, &Entry::Failed(log.clone()), &lock) {
                    tracing::warn!(%error, "could not cache a compile failure");
                }
                response.compile_log = log;
                Some(pb::Verdict::CompileError)
            }
            // Killed or vanished without a report (a crashing compiler, memory): not cached, maybe transient.
            Exit::Code(_) | Exit::Signal(_) => {
                inner.artifacts.discard(key, &lock);
                response.compile_log = cap(&log, 16 * 1024);
                Some(pb::Verdict::CompileError)
            }
        }
    }

    /// Prepares the comparison of the candidate's outputs with the reference's on `lane`: takes the cached
    /// reference (pinned) or the right to compute it (locked), and starts the clean process that will do it, so it
    /// starts while the candidate runs.
    async fn prepare_check(
        &self,
        job: &Job,
        lane: &Lane,
        trials: &Trials<'_>,
        scratch: &Path,
        candidate_dir: &Path,
        cancel: &CancellationToken,
    ) -> Result<PreparedCheck, String> {
        let gpu = lane.gpu();
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");
        let versions = python.versions_key();
        let Trials { seeds, init_seed, timing_seeds, sensitivity } = *trials;
        let mut seed_text: String = seeds.iter().map(|s| format!("{s},")).collect();
        if let Some(Sensitivity { trial, base, seed }) = sensitivity {
            seed_text.push_str(&format!("sensitivity {trial} from {base} with {seed}"));
        }
        let device_name = python.device_name(gpu);
        let key = cache::key(&[
            job.task.as_bytes(),
            seed_text.as_bytes(),
            init_seed.to_string().as_bytes(),
            device_name.as_bytes(),
            versions.as_bytes(),
            python::harness_digest().as_bytes(),
            // The budget decides which trials' outputs the entry holds.
            inner.config.output_bytes_budget.to_string().as_bytes(),
        ]);
        let reference_dir = inner.references.dir(&key);
        let mut spec = CompareSpec {
            computes_reference: false,
            task_path: scratch.join("task.py"),
            device: lane.device(),
            init_seed,
            seeds: seeds.to_vec(),
            reference_dir: reference_dir.clone(),
            candidate_dir: candidate_dir.to_owned(),
            tolerances: inner.config.tolerances,
            timing_seeds: timing_seeds.to_vec(),
            sensitivity,
            output_bytes_budget: inner.config.output_bytes_budget,
            timed_call: None,
        };
        // Built once per key: the first evaluation computes the reference (and checks), later ones only check.
        // A cached reference is pinned while the checker reads it, so eviction cannot take it meanwhile.
        // The reference's peak device memory, recorded in its cache entry (none in entries from before it was).
        let peak_key = (cache::key(&[job.task.as_bytes()]), device_name.to_owned());
        let (lock, pin) = match inner.references.get(&key) {
            Some(_) => {
                let pin = inner.references.pin(&key).await.map_err(|e| format!("reference pin: {e}"))?;
                let Some(entry) = inner.references.get(&key) else {
                    return Err("the cached reference was evicted before use; retry".into());
                };
                self.note_reference_peak(&peak_key, &entry);
                (None, Some(pin))
            }
            None => {
                let lock = inner.references.lock(&key).await.map_err(|e| format!("reference lock: {e}"))?;
                if let Some(entry) = inner.references.get(&key) {
                    self.note_reference_peak(&peak_key, &entry);
                    (None, None)
                } else {
                    std::fs::create_dir_all(&reference_dir).map_err(|e| format!("reference dir: {e}"))?;
                    (Some(lock), None)
                }
            }
        };
        inner.metrics.cache("reference", lock.is_none());
        spec.computes_reference = lock.is_some();
        let stage = Stage {
            scratch: scratch.to_owned(),
            readable: vec![candidate_dir.to_owned(), reference_dir.clone()],
            writable: if spec.computes_reference { vec![reference_dir] } else { vec![] },
            env: python.env_on(scratch, gpu),
            wall: Duration::from_secs(inner.config.run_timeout_secs),
            background: false,
        };
        Ok(PreparedCheck { started: self.start(stage, cancel), spec, key, peak_key, lock, _pin: pin })
    }

    /// Runs a prepared comparison; `timed_call` is the candidate's last timed call, when it was timed (its output
    /// is checked too, on rebuilt inputs). The first mismatch, when the outputs differ, and how many trials were
    /// compared (fewer than all where the outputs are large: `output_bytes_budget`).
    async fn check(
        &self,
        prepared: PreparedCheck,
        lane: &Lane,
        timed_call: Option<i64>,
    ) -> Result<(Option<(Trial, pb::Mismatch)>, Option<usize>), String> {
        let inner = &self.inner;
        let PreparedCheck { started, mut spec, key, peak_key, lock, _pin } = prepared;
        spec.timed_call = timed_call;
        let mode = spec.mode();
        let request = Request::plain(spec);
        let outcome =
            self.stage(started, request, Some(lane)).await.map_err(|e| format!("{} stage: {e}", mode.name()))?;
        if !outcome.ok() {
            let what = if lock.is_some() { "the reference failed" } else { "the checker failed" };
            return Err(format!("{what}: {}", cap(&outcome.error_text(), 4000)));
        }
        if let Some(lock) = &lock {
            // The reference's peak device memory (GPU only), for admission: kept here and in the cache entry.
            let peak = outcome.result.as_ref().and_then(|r| r.body.device_peak_bytes);
            let marker = match peak {
                Some(peak) => serde_json::json!({ "device_peak_bytes": peak }).to_string(),
                None => String::new(),
            };
            let entry = Entry::Ready(marker);
            self.note_reference_peak(&peak_key, &entry);
            inner.references.complete(&key, &entry, lock).map_err(|e| format!("reference cache: {e}"))?;
            self.evict_later("reference", &inner.references);
        }
        let result = outcome.result.map(|r| r.body).unwrap_or_default();
        let compared = result.compared_trials.map(|trials| trials.len());
        let mismatch = result.mismatch.map(|m| {
            let trial = match m.trial {
                Some(index) if index >= 0 => Trial::Index(index as usize),
                _ => Trial::Timed,
            };
            (trial, mismatch_proto(&m))
        });
        Ok((mismatch, compared))
    }

    /// Starts the task's baseline now, beside the candidate's compile and outside the device's slots (a GPU
    /// evaluation that is timed, with `baselines_ahead`): the evaluation then finds it cached, or waits for it on
    /// the cache's lock, instead of holding its slot while the baseline's torch.compile runs. It runs to the end
    /// whatever becomes of the evaluation (the next one of the task needs it too); a failure is only logged, and
    /// met again, and reported, by the evaluation's own [`Self::baseline`].
    fn baseline_ahead(&self, job: &Job) {
        let inner = &self.inner;
        if !(inner.config.baselines_ahead && job.measure && job.backend != Backend::Cpu) {
            return;
        }
        let Some(lane) = inner.lanes.outside_slots() else { return };
        let task_key = cache::key(&[job.task.as_bytes()]);
        let (init_seed, timing_seeds) = self.baseline_seeds(&task_key);
        let scratch = self.scratch_dir("baseline-");
        let (evaluator, job) = (self.clone(), job.clone());
        tokio::spawn(async move {
            let _cleanup = RemoveOnDrop(scratch.clone());
            let cancel = CancellationToken::new();
            let computed = match std::fs::create_dir_all(&scratch) {
                Ok(()) => evaluator.baseline(&job, &lane, init_seed, &timing_seeds, &scratch, &cancel).await.map(drop),
                Err(error) => Err(format!("scratch directory {}: {error}", scratch.display())),
            };
            if let Err(error) = computed {
                tracing::warn!(task = %job.task_id, %error, "the baseline computed ahead failed");
            }
        });
    }

    /// Eager and torch.compile samples of the reference, from the cache or a clean child.
    async fn baseline(
        &self,
        job: &Job,
        lane: &Lane,
        init_seed: u64,
        timing_seeds: &[u64],
        scratch: &Path,
        cancel: &CancellationToken,
    ) -> Result<Baseline, String> {
        let gpu = lane.gpu();
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");
        let with_compile = inner.config.baseline_torch_compile;
        let key = self.baseline_key(job, gpu);
        if let Some(Entry::Ready(text)) = inner.baselines.get(&key) {
            inner.metrics.cache("baseline", true);
            return Baseline::parse(&text);
        }
        let lock = inner.baselines.lock(&key).await.map_err(|e| format!("baseline lock: {e}"))?;
        if let Some(Entry::Ready(text)) = inner.baselines.get(&key) {
            inner.metrics.cache("baseline", true);
            return Baseline::parse(&text);
        }
        inner.metrics.cache("baseline", false);
        std::fs::write(scratch.join("task.py"), &job.task).map_err(|e| format!("writing task.py: {e}"))?;
        let mut env = python.env_on(scratch, gpu);
        env.push(("TORCHINDUCTOR_CACHE_DIR".into(), scratch.join("inductor").into()));
        env.push(("TRITON_CACHE_DIR".into(), scratch.join("triton").into()));
        let stage = Stage {
            scratch: scratch.to_owned(),
            readable: vec![],
            writable: vec![],
            env,
            wall: Duration::from_secs(inner.config.run_timeout_secs),
            background: false,
        };
        let request = Request::plain(BaselineSpec {
            task_path: scratch.join("task.py"),
            device: lane.device(),
            init_seed,
            timing: TimingSpec::from(&inner.config.timing),
            timing_seeds: timing_seeds.to_vec(),
            compile: with_compile,
            timing_cpu: python.timing_cpu(gpu),
        });
        let outcome = self
            .stage(self.start(stage, cancel), request, Some(lane))
            .await
            .map_err(|e| format!("baseline stage: {e}"))?;
        if !outcome.ok() {
            return Err(format!("the baseline failed: {}", cap(&outcome.error_text(), 4000)));
        }
        let result = outcome.result.map(|r| r.body).unwrap_or_default();
        if let Some(error) = &result.compile_error {
            tracing::warn!(task = %job.task_id, %error, "torch.compile baseline unavailable");
        }
        let Some(eager) = result.eager_ms else {
            return Err("the baseline reported no readable eager samples".into());
        };
        let baseline = Baseline { eager, eager_host: result.eager_host_ms, compiled: result.compile_ms };
        let text = baseline.text();
        inner
            .baselines
            .complete(&key, &Entry::Ready(text.clone()), &lock)
            .map_err(|e| format!("baseline cache: {e}"))?;
        self.evict_later("baseline", &inner.baselines);
        Ok(baseline)
    }

    /// The baseline cache's key of `job`'s task on `gpu` (or the CPU).
    fn baseline_key(&self, job: &Job, gpu: Option<usize>) -> String {
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");
        let timing = serde_json::to_string(&inner.config.timing).unwrap_or_default();
        cache::key(&[
            job.task.as_bytes(),
            python.device_name(gpu).as_bytes(),
            python.versions_key().as_bytes(),
            timing.as_bytes(),
            &[u8::from(inner.config.baseline_torch_compile)],
            python::harness_digest().as_bytes(),
        ])
    }

    /// How long each call of `job`'s candidate may run on `gpu`: from the task's eager median where its baseline
    /// is cached, else the limit for tasks not measured yet.
    fn call_limits(&self, job: &Job, gpu: Option<usize>) -> CallLimits {
        let config = &self.inner.config.call_limits;
        let reference_ms = match self.inner.baselines.get(&self.baseline_key(job, gpu)) {
            Some(Entry::Ready(text)) => {
                Baseline::parse(&text).ok().and_then(|baseline| timing_stats(baseline.eager)).map(|s| s.median_ms)
            }
            _ => None,
        };
        call_limits(config, reference_ms)
    }

    /// The device memory an evaluation of the task needs on a GPU, from its reference's measured peak
    /// (`devices::footprint`); `None` until the task's reference has run on a GPU in this evaluator (or its cache
    /// entry recorded the peak). With GPUs of several kinds, the largest known.
    fn footprint(&self, task_key: &str) -> Option<u64> {
        self.reference_peak(task_key).map(devices::footprint)
    }

    /// The largest reference peak device memory known for the task on any of this evaluator's GPUs.
    fn reference_peak(&self, task_key: &str) -> Option<u64> {
        let python = self.inner.python.as_ref().ok()?;
        let peaks = self.inner.reference_peaks.lock().expect("never poisoned");
        let known = python.gpus.iter().filter_map(|gpu| peaks.get(&(task_key.to_owned(), gpu.name.clone())));
        known.copied().max()
    }

    /// Keeps the peak device memory a reference cache entry records, if it records one.
    fn note_reference_peak(&self, (task_key, device): &(String, String), entry: &Entry) {
        let Entry::Ready(marker) = entry else { return };
        let peak = serde_json::from_str::<serde_json::Value>(marker)
            .ok()
            .and_then(|marker| marker.get("device_peak_bytes").and_then(|p| p.as_u64()));
        if let Some(peak) = peak {
            let mut peaks = self.inner.reference_peaks.lock().expect("never poisoned");
            peaks.insert((task_key.clone(), device.clone()), peak);
        }
    }

    /// Starts a harness process for `stage` now; it waits for its request (see [`python::start`]).
    fn start(&self, stage: Stage, cancel: &CancellationToken) -> Started {
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");
        python::start(&inner.sandbox, python, &inner.harness, stage, cancel.child_token())
    }

    /// Runs `request` in a started harness process; one on a GPU `lane` that ends in a device fault has the device
    /// probed before the lane is used again.
    async fn stage<S: StageSpec>(
        &self,
        started: Started,
        request: Request<S>,
        lane: Option<&Lane>,
    ) -> Result<StageOutcome<S::Result>, StageError> {
        let inner = &self.inner;
        let name = request.mode().name();
        let _running = inner.metrics.stage(name);
        let started_at = Instant::now();
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
            // Work outside an evaluation (a baseline computed ahead) has no account to add to.
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
    fn evict_later(&self, name: &'static str, cache: &Cache) {
        let (cache, metrics) = (cache.clone(), self.inner.metrics.clone());
        tokio::task::spawn_blocking(move || {
            let removed = cache.evict();
            if removed > 0 {
                tracing::info!(cache = name, removed, "evicted least recently used cache entries");
                metrics.evicted(name, removed);
            }
        });
    }

    /// A fresh scratch directory's path (`prefix` names what it is for), unique across every evaluator of this
    /// process and every process sharing the work directory.
    fn scratch_dir(&self, prefix: &str) -> PathBuf {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.scratch_root.join(format!("{}-{prefix}{id}", std::process::id()))
    }

    /// The task's model initialisation seed and timing input seeds: the same for the candidate, its checks and
    /// the baseline, so all of them see the same model and inputs.
    fn baseline_seeds(&self, task_key: &str) -> (u64, Vec<u64>) {
        let sets = self.inner.config.timing.input_sets.max(1) as usize;
        (self.seeds(task_key, "init", 1)[0], self.seeds(task_key, "timing", sets))
    }

    /// Seeds the candidate cannot know in advance: derived from a secret drawn when this evaluator started, so
    /// they repeat per task (and the reference cache hits) but differ between evaluator instances.
    /// Picks the sensitivity trial among the first `trials` (not trial 0, its base), from the secret per task, and
    /// gives it trial 0's seed: the harness moves a few of those inputs far out of range (`perturb_sparsely`) and
    /// the check compares how both outputs moved. None when disabled or with fewer than two first trials.
    fn sensitivity_trial(&self, task_key: &str, seeds: &mut [u64], trials: usize) -> Option<Sensitivity> {
        if !self.inner.config.sensitivity_check || trials < 2 {
            return None;
        }
        let drawn = self.seeds(task_key, "sensitivity", 2);
        let trial = 1 + drawn[0] as usize % (trials - 1);
        seeds[trial] = seeds[0];
        Some(Sensitivity { trial, base: 0, seed: drawn[1] })
    }

    fn seeds(&self, task_key: &str, purpose: &str, count: usize) -> Vec<u64> {
        let hasher = std::hash::BuildHasherDefault::<std::hash::DefaultHasher>::default();
        (0..count).map(|i| hasher.hash_one((self.inner.secret, task_key, purpose, i)) % (1 << 31)).collect()
    }
}

/// The reference's timing samples: eager (events and host clock) and torch.compile.
#[derive(Debug, Clone)]
struct Baseline {
    eager: Vec<f64>,
    /// Absent in baselines cached before the host clock was recorded.
    eager_host: Option<Vec<f64>>,
    compiled: Option<Vec<f64>>,
}

/// A baseline as the cache holds it.
#[derive(serde::Serialize, serde::Deserialize)]
struct CachedBaseline {
    eager_ms: serde_json::Value,
    #[serde(default)]
    eager_host_ms: serde_json::Value,
    #[serde(default)]
    compile_ms: serde_json::Value,
}

impl Baseline {
    /// A baseline as the cache holds it.
    fn parse(text: &str) -> Result<Self, String> {
        let cached: CachedBaseline = serde_json::from_str(text).map_err(|e| format!("baseline cache: {e}"))?;
        let eager = serde_json::from_value(cached.eager_ms).map_err(|e| format!("baseline samples: {e}"))?;
        Ok(Self {
            eager,
            eager_host: serde_json::from_value(cached.eager_host_ms).ok(),
            compiled: serde_json::from_value(cached.compile_ms).ok(),
        })
    }

    /// The cache's text of this baseline.
    fn text(&self) -> String {
        let cached = CachedBaseline {
            eager_ms: self.eager.clone().into(),
            eager_host_ms: self.eager_host.clone().into(),
            compile_ms: self.compiled.clone().into(),
        };
        serde_json::to_string(&cached).expect("a baseline serialises")
    }
}

/// A candidate's timing samples: by the events (or the clock on a CPU) and by the host clock.
#[derive(Debug, Clone)]
struct Measured {
    events: Vec<f64>,
    host: Vec<f64>,
}

/// The harness's time per phase of a stage (`phases_ms`), as `stage_ms` entries `<stage>.<phase>`.
fn phases_into<R>(result: &Report<R>, stage: &str, response: &mut pb::EvaluateResponse) {
    for (phase, value) in &result.phases_ms {
        response.stage_ms.insert(format!("{stage}.{phase}"), *value);
    }
}

/// The samples of a candidate run, or the finding that they are impossible.
fn timing_samples(result: &CandidateResult) -> Result<Measured, pb::Finding> {
    let (events, host) = (result.samples_ms.clone(), result.host_ms.clone());
    let valid = |s: &[f64]| !s.is_empty() && s.iter().all(|v| v.is_finite() && *v > 0.0);
    if !valid(&events) || !valid(&host) || events.len() != host.len() {
        return Err(hack_finding(
            "timing.impossible",
            format!(
                "{} timing samples and {} host-clock samples: empty, unequal, negative or not finite",
                events.len(),
                host.len()
            ),
        ));
    }
    Ok(Measured { events, host })
}

/// Unaccounted wall-clock time per timed call must stay under this (ms), or half the candidate's median if larger.
const WALL_CLOCK_SLACK_MS: f64 = 0.25;

/// The parent's wall-clock cross-check: a candidate whose timed steps take much longer on the host clock than its
/// events say (beyond the overhead the clean baseline shows) did work, or waited, where the events cannot see.
fn wall_clock_mismatch(measured: &Measured, baseline: &Baseline) -> Option<pb::Finding> {
    let base_host = baseline.eager_host.as_deref()?;
    let hidden = crate::stats::unaccounted_host_ms((&measured.events, &measured.host), (&baseline.eager, base_host))?;
    let median = timing_stats(measured.events.clone())?.median_ms;
    (hidden > WALL_CLOCK_SLACK_MS.max(0.5 * median)).then(|| {
        hack_finding(
            "timing.wall_clock_mismatch",
            format!(
                "each timed call took {hidden:.3} ms more on the host clock than its timer reported ({median:.3} ms \
                 median), beyond the reference's overhead: work was done where the timer could not see it"
            ),
        )
    })
}

fn set_speedups(response: &mut pb::EvaluateResponse) {
    let speedup = |baseline: &Option<pb::TimingStats>| match (baseline, &response.candidate_timing) {
        (Some(b), Some(c)) if c.median_ms > 0.0 => b.median_ms / c.median_ms,
        _ => 0.0,
    };
    response.speedup_eager = speedup(&response.eager_timing);
    response.speedup_compile = speedup(&response.compile_timing);
}

/// The inputs a check covers: correctness trials by seed, and the last timed call.
#[derive(Debug, Clone, Copy)]
struct Trials<'a> {
    seeds: &'a [u64],
    init_seed: u64,
    timing_seeds: &'a [u64],
    /// The sensitivity trial (`Evaluator::sensitivity_trial`).
    sensitivity: Option<Sensitivity>,
}

/// A comparison ready to run: its started clean process, and its hold on the reference cache entry.
struct PreparedCheck {
    started: Started,
    /// `reference` mode (computes and caches the reference, then compares) or `check` (compares with the cache).
    spec: CompareSpec,
    key: String,
    /// The task's key and the device's name: where the reference's peak device memory is kept.
    peak_key: (String, String),
    /// Held while the reference is computed.
    lock: Option<cache::EntryLock>,
    /// Held while a cached reference is read.
    _pin: Option<cache::EntryLock>,
}

/// Which output differed.
#[derive(Debug, Clone, Copy)]
enum Trial {
    Index(usize),
    Timed,
}

/// A call's limits: `reference_factor` times the reference's eager median, at least `floor_secs`; without a
/// measured reference, `unmeasured_secs`.
fn call_limits(config: &CallLimitsConfig, reference_ms: Option<f64>) -> CallLimits {
    let (call, basis) = match reference_ms {
        Some(ms) => {
            let secs = (config.reference_factor * ms / 1e3).max(config.floor_secs);
            let basis = format!(
                "limit: {} x the reference's {ms:.3} ms per call, at least {} s",
                config.reference_factor, config.floor_secs
            );
            (secs, basis)
        }
        None => (config.unmeasured_secs, "limit for a task whose reference is not measured yet".to_owned()),
    };
    CallLimits {
        call: Duration::from_secs_f64(call.max(0.001)),
        busy: Duration::from_secs_f64(config.busy_secs.max(call)),
        basis,
    }
}

/// Whether the source builds a C++/CUDA extension (and so needs the compile stage).
fn builds_extension(source: &str) -> bool {
    source.contains("load_inline") || source.contains("cpp_extension")
}

fn gpu_arch(python: &PythonEnv) -> String {
    python.gpus.iter().map(|g| g.capability.as_str()).collect::<Vec<_>>().join(",")
}

fn cached_compile(entry: Entry, response: &mut pb::EvaluateResponse) -> Option<pb::Verdict> {
    match entry {
        Entry::Ready(_) => None,
        Entry::Failed(log) => {
            response.compile_log = log;
            Some(pb::Verdict::CompileError)
        }
    }
}

/// The verdict of a candidate stage that did not finish cleanly; `None` when it did.
fn candidate_failure<R>(outcome: &StageOutcome<R>, response: &mut pb::EvaluateResponse) -> Option<pb::Verdict> {
    if outcome.ok() {
        return None;
    }
    if let Some(hung) = &outcome.hung {
        response.error = format!("the candidate was stopped: {hung}");
        return Some(pb::Verdict::Timeout);
    }
    let error = cap(&outcome.error_text(), 8000);
    let verdict = match outcome.finished.exit {
        Exit::TimedOut if outcome.candidate_used_its_time() => {
            response.error = format!(
                "the candidate exceeded its stage's time limit and was killed ({:.1} s of {:.1} s in its own calls)",
                outcome.in_calls.as_secs_f64(),
                outcome.running().as_secs_f64()
            );
            return Some(pb::Verdict::Timeout);
        }
        Exit::TimedOut => {
            let error = format!(
                "candidate stage: the evaluator's own work (making inputs, reading and checking outputs) used the \
                 stage's time limit: {:.1} s of {:.1} s were in the candidate's calls",
                outcome.in_calls.as_secs_f64(),
                outcome.running().as_secs_f64()
            );
            return Some(infra(response, error, false));
        }
        Exit::Cancelled => return Some(infra(response, "cancelled".into(), true)),
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
    Some(verdict)
}

/// Each GPU's memory budget for admission (`EvaluatorConfig::gpu_memory_budget`).
fn gpu_memory_budgets(config: &EvaluatorConfig, python: &Result<PythonEnv, String>) -> Vec<Option<u64>> {
    let gpus = python.as_ref().map_or(&[][..], |env| env.gpus.as_slice());
    gpus.iter().map(|gpu| config.gpu_memory_budget(gpu.total_memory)).collect()
}

/// Whether a stage failed for want of device memory.
fn out_of_memory<R>(outcome: &StageOutcome<R>) -> bool {
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

fn infra(response: &mut pb::EvaluateResponse, error: String, retryable: bool) -> pb::Verdict {
    tracing::error!(%error, "evaluation infrastructure error");
    response.error = error;
    response.retryable = retryable;
    pb::Verdict::InfraError
}

/// A run-time finding of category hack.
fn hack_finding(code: impl Into<String>, message: impl Into<String>) -> pb::Finding {
    pb::Finding { code: code.into(), message: message.into(), line: 0, category: pb::FindingCategory::Hack as i32 }
}

fn finding_proto(finding: &statics::Finding) -> pb::Finding {
    let category = match finding.category {
        Category::Hack => pb::FindingCategory::Hack,
        Category::Policy => pb::FindingCategory::Policy,
        Category::Notice => pb::FindingCategory::Notice,
    };
    pb::Finding {
        code: finding.code.into(),
        message: finding.message.clone(),
        line: finding.line,
        category: category as i32,
    }
}

fn mismatch_proto(record: &MismatchRecord) -> pb::Mismatch {
    pb::Mismatch {
        // A negative trial (the timed call) reads as none.
        trial: record.trial.and_then(|t| u64::try_from(t).ok()).unwrap_or(u32::MAX.into()) as u32,
        output_index: record.output_index.unwrap_or(0) as u32,
        element_index: record.element_index.clone(),
        expected: record.expected,
        got: record.got,
        max_abs_error: record.max_abs_error,
        max_rel_error: record.max_rel_error,
        detail: record.detail.clone(),
    }
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
