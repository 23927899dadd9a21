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
use kforge_sandbox::Sandbox;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

use crate::cache::{self, Cache};
use crate::census;
use crate::config::EvaluatorConfig;
use crate::devices::{self, Lane, Lanes, MemberTimes};
use crate::disk::{DiskBudget, OutputPlan};
use crate::metrics::EvaluatorMetrics;
use crate::protocol::{CandidateRun, Report, Sensitivity, StageSpec, TimingSpec};
use crate::python::PythonEnv;
use crate::stage::{self, Joining, Request, Stage, StageError, StageOutcome, Started};
use crate::static_checks::{self, Category, Policy};
use crate::stats::timing_stats;

mod baseline;
mod candidate;
mod check;
mod compile;
mod error;
mod profile;
mod request;
mod setup;
mod timing;
mod verdict;

use check::{Trial, Trials};
use compile::{builds_extension, gpu_arch};
use timing::{set_speedups, timing_samples, wall_clock_mismatch};
use verdict::{finding_proto, hack_finding, out_of_memory};

pub use error::InfraError;
pub use profile::{Launcher, ProfileJob, Profiled};
pub use request::RequestError;
use request::{Backend, Submission};

tokio::task_local! {
    /// CPU milliseconds of the current evaluation's harness stages (each process and the children it waited for,
    /// as the harness reports them), by stage; reported as `stage_ms["cpu.<stage>"]`.
    static STAGE_CPU: RefCell<BTreeMap<&'static str, f64>>;
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
    /// The disk the evaluations' files may take at once (`disk.rs`).
    disk: DiskBudget,
    secret: u64,
    metrics: EvaluatorMetrics,
    /// Peak device memory of each task's reference, by (task key, device name), as the reference stage measured
    /// it: what memory-aware admission estimates an evaluation's footprint from (`devices::footprint`).
    reference_peaks: Mutex<HashMap<(String, String), u64>>,
    /// The warm-up's outcome once it is over: the bindings' precompiled header, or why there is none.
    warm: watch::Receiver<Option<Result<PathBuf, String>>>,
    /// The GPU censuses of the latest evaluations and profiles, which a profile reuses.
    censuses: census::Recent,
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
        let submission = self.validate(request)?;
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
        let mut response = pb::EvaluateResponse { request_id: submission.request_id.clone(), ..Default::default() };
        let mut lane_held = None;
        let (verdict, stage_cpu) = STAGE_CPU
            .scope(RefCell::default(), async {
                let verdict = match self.run(&submission, &scratch, &cancel, &mut response, &mut lane_held).await {
                    Ok(verdict) => verdict,
                    Err(error) => self.infra_error(error, &mut response),
                };
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

    /// The response to an evaluation the evaluator itself could not complete: the one place an [`InfraError`]
    /// becomes a verdict.
    fn infra_error(&self, error: InfraError, response: &mut pb::EvaluateResponse) -> pb::Verdict {
        let cause = error.cause();
        tracing::error!(%error, cause, "evaluation infrastructure error");
        self.inner.metrics.infra_error(cause);
        response.error = error.to_string();
        response.retryable = error.retryable();
        pb::Verdict::InfraError
    }

    /// Runs every stage, filling `response`; returns the verdict.
    async fn run(
        &self,
        submission: &Submission,
        scratch: &Path,
        cancel: &CancellationToken,
        response: &mut pb::EvaluateResponse,
        lane_held: &mut Option<(Instant, Arc<Mutex<MemberTimes>>)>,
    ) -> Result<pb::Verdict, InfraError> {
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");

        let started = Instant::now();
        let mut report = static_checks::check_candidate(&submission.candidate, submission.policy);
        report.findings.extend(static_checks::precision_downgrade(&submission.candidate, &submission.task));
        response.findings.extend(report.findings.iter().map(finding_proto));
        response.stage_ms.insert("static".into(), ms(started.elapsed()));
        if report.syntax_error {
            return Ok(pb::Verdict::CompileError);
        }
        if report.rejected() {
            return Ok(pb::Verdict::Rejected);
        }
        let own_kernels = static_checks::own_kernel_names(&submission.candidate);

        let stage_dirs = ["compile", "candidate", "check", "baseline"].map(|stage| scratch.join(stage));
        for dir in &stage_dirs {
            std::fs::create_dir_all(dir).map_err(InfraError::files(format!("scratch directory {}", dir.display())))?;
        }
        let [compile_dir, candidate_dir, check_dir, baseline_dir] = stage_dirs;
        let task_key = cache::key(&[submission.task.as_bytes()]);

        self.baseline_ahead(submission);
        self.sizes_ahead(submission, &task_key);

        // Compile: only candidates that build extensions; the rest are imported where they run.
        let (artifact_key, compiles) = self.artifact_key(submission);
        let artifact_dir = inner.artifacts.dir(&artifact_key);
        // The built extension is pinned until the evaluation ends, so eviction cannot take it meanwhile.
        let mut _artifact_pin = None;
        if compiles {
            let started = Instant::now();
            let compiled = self.compile(submission, &artifact_key, &compile_dir, cancel, response).await?;
            // The build itself: time waiting for a compile worker is `queue_compile`.
            let queued = response.stage_ms.get("queue_compile").copied().unwrap_or(0.0);
            response.stage_ms.insert("compile".into(), ms(started.elapsed()) - queued);
            if let Some(verdict) = compiled {
                return Ok(verdict);
            }
            match inner.artifacts.pin(&artifact_key).await {
                Ok(pin) if inner.artifacts.get(&artifact_key).is_some() => _artifact_pin = Some(pin),
                Ok(_) => return Err(InfraError::Evicted { what: "compiled artifact" }),
                Err(error) => return Err(InfraError::cache("artifact pin")(error)),
            }
        } else if submission.backend != Backend::Cpu {
            _artifact_pin = Some(self.jit_cache(&artifact_key).await?);
        }

        // On a GPU, the task's sizes (a dry run on the meta device, once per task): the disk its files take, and
        // its footprint before its reference has run. The files' share of the disk is reserved before the
        // candidate starts, and held until the evaluation ends.
        let on_gpu = submission.backend != Backend::Cpu;
        let mut _disk = None;
        let mut sizes = None;
        if on_gpu {
            let started = Instant::now();
            let dry_run = scratch.join("sizes");
            sizes = inner.disk.task_sizes(&task_key, &submission.task, &inner.sandbox, python, &dry_run).await;
            let plan = OutputPlan {
                trials: u64::from(submission.trials + inner.config.recheck_trials),
                budget: inner.config.output_bytes_budget,
                new_reference: self.reference_peak(&task_key).is_none(),
            };
            _disk = Some(inner.disk.reserve(inner.disk.need(sizes, plan)).await);
            response.stage_ms.insert("queue_disk".into(), ms(started.elapsed()));
        }

        // Started before the lane: the interpreter and torch load while other evaluations use the device.
        let candidate_process = self.start_candidate(submission, &candidate_dir, &artifact_dir, cancel)?;
        let started = Instant::now();
        let footprint = match on_gpu {
            true => self.footprint(&task_key).or(sizes.map(|s| devices::footprint(s.input_bytes + s.output_bytes))),
            false => None,
        };
        let lane = inner.lanes.acquire(on_gpu, submission.priority, &submission.job_id, footprint).await?;
        if on_gpu {
            response.reference_peak_bytes = self.reference_peak(&task_key).unwrap_or(0);
        }
        *lane_held = Some((Instant::now(), lane.gate_times()));
        let gpu = lane.gpu();
        response.stage_ms.insert("queue_device".into(), ms(started.elapsed()));
        response.device = python.device_name(gpu).to_owned();
        // The last `recheck_trials` trials run after timing and the census.
        let mut seeds = self.seeds(&task_key, "trial", (submission.trials + inner.config.recheck_trials) as usize);
        let recheck_from = submission.trials as usize;
        let sensitivity = self.sensitivity_trial(&task_key, &mut seeds, recheck_from);
        let (init_seed, timing_seeds) = self.baseline_seeds(&task_key);
        std::fs::write(check_dir.join("task.py"), &submission.task).map_err(InfraError::files("writing task.py"))?;
        // The clean process that checks the outputs starts now, while the candidate runs.
        let trials = Trials { seeds: &seeds, init_seed, timing_seeds: &timing_seeds, sensitivity };
        let check = self.prepare_check(submission, &lane, &trials, &check_dir, &candidate_dir, cancel).await?;

        // The candidate first: nothing of the reference has run on this device for this evaluation.
        let started = Instant::now();
        let spec = CandidateRun {
            init_seed,
            seeds: seeds.clone(),
            recheck_from,
            sensitivity,
            output_bytes_budget: inner.config.output_bytes_budget,
            timing: submission.measure.then(|| TimingSpec::from(&inner.config.timing)),
            timing_seeds: timing_seeds.clone(),
            census_calls: if submission.census { inner.config.census_calls } else { 0 },
            profiled_calls: 0,
        };
        let limits = self.call_limits(submission, gpu);
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
            let process = self.restart_candidate(submission, &candidate_dir, &artifact_dir, cancel)?;
            candidate = self.candidate_stage(process, &lane, &candidate_dir, spec, limits.clone()).await;
        }
        response.stage_ms.insert("run".into(), ms(started.elapsed()));
        let result = match self.candidate_result(candidate, gpu, response)? {
            Ok(result) => result,
            Err(verdict) => return Ok(verdict),
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
        let timed_call = result.last_call.filter(|_| submission.measure);
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
                let Some((code, message)) = changed else { return Ok(pb::Verdict::Incorrect) };
                response.findings.push(hack_finding(code, message));
                return Ok(pb::Verdict::Hack);
            }
            Err(error) => return Err(error),
        }

        if submission.measure {
            let started = Instant::now();
            let measured = match timing_samples(&result) {
                Ok(measured) => measured,
                Err(finding) => {
                    response.findings.push(finding);
                    return Ok(pb::Verdict::Hack);
                }
            };
            let baseline = self.baseline(submission, &lane, init_seed, &timing_seeds, &baseline_dir, cancel).await?;
            if let Some(finding) = wall_clock_mismatch(&measured, &baseline) {
                response.findings.push(finding);
                return Ok(pb::Verdict::Hack);
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
                let again =
                    self.remeasure(submission, &lane, &task_key, init_seed, &artifact_dir, scratch, cancel).await;
                response.stage_ms.insert("remeasure".into(), ms(started.elapsed()));
                let result = match self.candidate_result(again, gpu, response)? {
                    Ok(result) => result,
                    Err(verdict) => return Ok(verdict),
                };
                let again = match timing_samples(&result.body) {
                    Ok(again) => again,
                    Err(finding) => {
                        response.findings.push(finding);
                        return Ok(pb::Verdict::Hack);
                    }
                };
                if let Some(finding) = wall_clock_mismatch(&again, &baseline) {
                    response.findings.push(finding);
                    return Ok(pb::Verdict::Hack);
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
                    return Ok(pb::Verdict::Hack);
                }
            };
            if on_gpu {
                inner.censuses.put(&artifact_key, &task_key, Arc::new(modes.clone()));
            }
            let median = response.candidate_timing.as_ref().map(|t| t.median_ms);
            let candidate =
                census::Candidate { kernels: &own_kernels, compiles, median_ms: median, policy: submission.policy };
            let census = census::analyse(&modes, candidate, gpu.is_some());
            response.kernels = census.kernels;
            response.profiling_ratio = census.profiling_ratio;
            let hack = census.findings.iter().any(|f| f.category == Category::Hack);
            response.findings.extend(census.findings.iter().map(finding_proto));
            if hack {
                return Ok(pb::Verdict::Hack);
            }
        }
        Ok(pb::Verdict::Correct)
    }

    /// Starts the task's dry run (`disk.rs`, once per task) on a GPU now, beside the compile, in a scratch
    /// directory of its own: the evaluation waits for it only after its compile, and one that ends early leaves it
    /// to finish for the next.
    fn sizes_ahead(&self, submission: &Submission, task_key: &str) {
        if submission.backend == Backend::Cpu || self.inner.python.is_err() {
            return;
        }
        let scratch = self.scratch_dir("sizes-");
        let (evaluator, task_key, task) = (self.clone(), task_key.to_owned(), submission.task.clone());
        tokio::spawn(async move {
            let _cleanup = RemoveOnDrop(scratch.clone());
            let inner = &evaluator.inner;
            let python = inner.python.as_ref().expect("checked above");
            inner.disk.task_sizes(&task_key, &task, &inner.sandbox, python, &scratch).await;
        });
    }

    /// The artifact cache's key for `submission`'s build, and whether the candidate builds anything.
    fn artifact_key(&self, submission: &Submission) -> (String, bool) {
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");
        let key = cache::key(&[
            submission.candidate.as_bytes(),
            submission.backend.name().as_bytes(),
            python.versions_key().as_bytes(),
            gpu_arch(python).as_bytes(),
            inner.config.build_recipe.name().as_bytes(),
            // Who owns the build's files: a build made as the evaluator's user (before job users, or where they
            // are off) has files a job user cannot write, such as the lock a later run takes.
            if inner.sandbox.job_users_active() { b"owned by the jobs' group" } else { b"owned by the evaluator" },
        ]);
        (key, builds_extension(&submission.candidate))
    }

    /// Starts a harness process for `stage` now; it waits for its request (see [`stage::start`]).
    fn start(&self, stage: Stage, cancel: &CancellationToken) -> Started {
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");
        stage::start(&inner.sandbox, python, &inner.harness, stage, cancel.child_token())
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
    pub(super) fn evict_later(&self, name: &'static str, cache: &Cache) {
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

/// The harness's time per phase of a stage (`phases_ms`), as `stage_ms` entries `<stage>.<phase>`.
fn phases_into<R>(result: &Report<R>, stage: &str, response: &mut pb::EvaluateResponse) {
    for (phase, value) in &result.phases_ms {
        response.stage_ms.insert(format!("{stage}.{phase}"), *value);
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
