//! Start-up: the work directory and the harness files in it, the Python environment probed, the sandbox fitted to
//! what works on this host, and the warm-up (the bindings' header precompiled) in the background.

use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kforge_sandbox::Sandbox;
use tokio::sync::{Semaphore, watch};

use super::{Evaluator, Inner};
use crate::bindings_pch;
use crate::cache::Cache;
use crate::census;
use crate::config::{BuildRecipe, EvaluatorConfig};
use crate::devices::Lanes;
use crate::disk::{self, DiskBudget};
use crate::metrics::EvaluatorMetrics;
use crate::python::{self, PythonEnv};

/// Censuses kept for profiles to reuse (`census::Recent`): a few hundred KiB at most for ordinary candidates.
const RECENT_CENSUSES: usize = 256;

/// Each GPU's memory budget for admission (`EvaluatorConfig::gpu_memory_budget`).
pub(super) fn gpu_memory_budgets(config: &EvaluatorConfig, python: &Result<PythonEnv, String>) -> Vec<Option<u64>> {
    let gpus = python.as_ref().map_or(&[][..], |env| env.gpus.as_slice());
    gpus.iter().map(|gpu| config.gpu_memory_budget(gpu.total_memory)).collect()
}

impl Evaluator {
    /// The sandbox as far as this host's interpreter and GPU driver work in it. A protection that stops them is
    /// dropped and reported rather than left to fail every evaluation: job users where the interpreter is out of
    /// their reach (under a private home directory) or the GPU's device files are; Landlock where the GPU driver
    /// fails under it; both where only that works.
    pub(super) async fn fit_sandbox(sandbox: Sandbox, env: &PythonEnv, scratch: &std::path::Path) -> Sandbox {
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

    /// The evaluator of this process for `config.work_dir`: one is made on the first call (as [`Evaluator::new`]),
    /// and every later call while it lives gets the same one, whatever its configuration. The Evaluator and
    /// Profiler services in one process use one, so they share its device lanes (a profile never runs beside a
    /// timed stage), its compile pool and its caches.
    pub async fn shared(config: EvaluatorConfig, metrics: EvaluatorMetrics) -> std::io::Result<Self> {
        static RUNNING: tokio::sync::Mutex<Vec<(PathBuf, std::sync::Weak<Inner>)>> =
            tokio::sync::Mutex::const_new(Vec::new());
        let work = std::path::absolute(&config.work_dir)?;
        let mut running = RUNNING.lock().await;
        running.retain(|(_, inner)| inner.strong_count() > 0);
        if let Some(inner) = running.iter().find(|(dir, _)| *dir == work).and_then(|(_, inner)| inner.upgrade()) {
            return Ok(Self { inner });
        }
        let evaluator = Self::new(config, metrics).await?;
        running.push((work, Arc::downgrade(&evaluator.inner)));
        Ok(evaluator)
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
        // The disk: the evaluations' files get `disk_budget_bytes` (by default 60% of what is available now), the
        // reference cache at most 20% of what is available.
        let available = disk::available_bytes(&work);
        let disk_budget = match config.disk_budget_bytes {
            0 => available.map_or(64 << 30, |bytes| bytes / 5 * 3),
            bytes => bytes,
        };
        let references_bytes = available
            .map_or(config.cache_limits.references_bytes, |bytes| config.cache_limits.references_bytes.min(bytes / 5));
        tracing::info!(available, disk_budget, references_bytes, "disk budget");
        Ok(Self {
            inner: Arc::new(Inner {
                artifacts: Cache::new(work.join("artifacts"), config.cache_limits.artifacts_bytes)?,
                references: Cache::new(work.join("references"), references_bytes)?,
                baselines: Cache::new(work.join("baselines"), config.cache_limits.baselines_bytes)?,
                admission: Arc::new(Semaphore::new(config.queue_capacity)),
                disk: DiskBudget::new(disk_budget),
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
                censuses: census::Recent::new(RECENT_CENSUSES),
            }),
        })
    }

    /// Starts the warm-up (precompiling the bindings' header, with kforge's build recipe and `bindings_pch`);
    /// compiles that start before it ends build without what it makes.
    pub(super) fn warm_up_in_background(
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
}
