//! Start-up: the work directory and the harness files in it, the Python environment probed, the sandbox fitted to
//! what works on this host, and the warm-up (the bindings' header precompiled) in the background; one engine per
//! work directory in a process ([`Engine::shared`]).

use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kforge_sandbox::Sandbox;
use tokio::sync::{Semaphore, watch};

use super::{Engine, Inner};
use crate::cache::Cache;
use crate::census;
use crate::config::{BuildRecipe, ExecutionConfig};
use crate::devices::Lanes;
use crate::disk::{self, DiskBudget};
use crate::handoff::MemoryFiles;
use crate::metrics::ExecutionMetrics;
use crate::precompiled_header;
use crate::python::{self, PythonEnv, PythonUnavailable};

/// Censuses kept for profiles to reuse (`census::Recent`): a few hundred KiB at most for ordinary candidates.
const RECENT_CENSUSES: usize = 256;

/// Why there is no precompiled header for the bindings: the warm-up is off, or failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct WarmUpFailed(pub String);

/// Each GPU's memory budget for admission (`ExecutionConfig::gpu_memory_budget`).
fn gpu_memory_budgets(config: &ExecutionConfig, python: &Result<PythonEnv, PythonUnavailable>) -> Vec<Option<u64>> {
    let gpus = python.as_ref().map_or(&[][..], |env| env.gpus.as_slice());
    gpus.iter().map(|gpu| config.gpu_memory_budget(gpu.total_memory)).collect()
}

/// Writes the harness package into `harness_dir` (the package's files into its folder, `kforge_harness/`); the
/// program to run, `python harness/kforge_harness` (the package's `__main__.py`), with the harness directory (where
/// kforge's nvcc lies too) readable to the stage as the program's parent.
fn install_harness(harness_dir: &Path) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(harness_dir)?;
    // Replaced atomically: engines in this and other processes may share the work directory and be starting the
    // harness right now (a truncated file would run as an empty script and exit 0 without a result). Each engine
    // stages its own copy: two starting at once in one process once renamed the same staged file.
    static STAGED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let engine_number = STAGED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    for (name, contents) in python::HARNESS_FILES {
        let path = harness_dir.join(name);
        if std::fs::read(&path).ok().as_deref() != Some(contents.as_bytes()) {
            if let Some(folder) = path.parent() {
                std::fs::create_dir_all(folder)?;
            }
            let staged = harness_dir.join(format!("{name}.{}-{engine_number}", std::process::id()));
            std::fs::write(&staged, contents)?;
            std::fs::rename(&staged, &path)?;
        }
    }
    Ok(harness_dir.join(python::HARNESS_PACKAGE))
}

/// The Python environment of `config`, probed in `scratch_root`, fitted to this host: kforge's build recipe (its
/// nvcc in `harness_dir`), the GPU stages' threads, and a CPU kept per GPU for launching timed work.
async fn probe_python(
    config: &ExecutionConfig,
    harness_dir: &Path,
    scratch_root: &Path,
) -> Result<PythonEnv, PythonUnavailable> {
    let mut python = PythonEnv::probe(&config.python, &scratch_root.join("probe")).await?;
    python.use_build_recipe(config.build_recipe, &harness_dir.join(python::NVCC_WRAPPER));
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    if let Some(threads) = config.gpu_stage_threads_on(python.gpus.len(), cores) {
        python.limit_gpu_stage_threads(threads);
    }
    if config.reserve_timing_cpu && !python.gpus.is_empty() {
        match python.reserve_timing_cpus() {
            [] => tracing::info!("fewer than four CPUs per GPU: timed work shares the CPUs with every stage"),
            cpus => tracing::info!(?cpus, "one CPU per GPU is kept for launching its timed work"),
        }
    }
    Ok(python)
}

/// The disk the runs' files may take: `disk_budget_bytes`, by default 60% of what is available now.
fn disk_budget(config: &ExecutionConfig, work: &Path) -> u64 {
    let available = disk::available_bytes(work);
    let disk_budget = match config.disk_budget_bytes {
        0 => available.map_or(64 << 30, |bytes| bytes / 5 * 3),
        bytes => bytes,
    };
    tracing::info!(available, disk_budget, "disk budget");
    disk_budget
}

impl Engine {
    /// The sandbox as far as this host's interpreter and GPU driver work in it. A protection that stops them is
    /// dropped and reported rather than left to fail every evaluation: command users where the interpreter is out of
    /// their reach (under a private home directory) or the GPU's device files are; Landlock where the GPU driver
    /// fails under it; both where only that works.
    async fn fit_sandbox(sandbox: Sandbox, env: &PythonEnv, scratch: &std::path::Path) -> Sandbox {
        let gpu = !env.gpus.is_empty();
        let what = if gpu { "the GPU driver" } else { "the interpreter" };
        let Err(reason) = python::sandbox_probe(&sandbox, env, scratch, gpu).await else { return sandbox };
        let no_users = format!("disabled: {what} fails as a command user on this host ({reason})");
        let no_landlock = format!("disabled: {what} fails under it on this host ({reason})");
        let (users, landlock) = (sandbox.command_users_active(), gpu && sandbox.landlock_active());
        let mut fallbacks = Vec::new();
        if users {
            fallbacks.push(("command_user", sandbox.without_command_users(no_users.clone())));
        }
        if landlock {
            fallbacks.push(("landlock", sandbox.without_landlock(no_landlock.clone())));
        }
        if users && landlock {
            fallbacks.push((
                "command_user and landlock",
                sandbox.without_command_users(no_users).without_landlock(no_landlock),
            ));
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

    /// The engine of this process for `config`: one is made on the first call (as [`Engine::new`]), and every
    /// later call with the same configuration while it lives gets the same one. The Evaluator and Profiler services
    /// in one process are given the same configuration (`kforge up`, `kforge serve`), so they share its device
    /// lanes (a profile never runs beside a timed stage), its admission queue, its compile pool and its caches.
    /// Another configuration gets an engine of its own, even on the same work directory (whose caches are safe to
    /// share between engines, as between processes): a request never runs under limits it was not configured with.
    pub async fn shared(config: ExecutionConfig, metrics: ExecutionMetrics) -> std::io::Result<Self> {
        static RUNNING: tokio::sync::Mutex<Vec<(ExecutionConfig, std::sync::Weak<Inner>)>> =
            tokio::sync::Mutex::const_new(Vec::new());
        let mut running = RUNNING.lock().await;
        running.retain(|(_, inner)| inner.strong_count() > 0);
        let same = running.iter().find(|(running, _)| *running == config);
        if let Some(inner) = same.and_then(|(_, inner)| inner.upgrade()) {
            return Ok(Self { inner });
        }
        let engine = Self::new(config.clone(), metrics).await?;
        running.push((config, Arc::downgrade(&engine.inner)));
        Ok(engine)
    }

    /// Prepares the work directory, probes the sandbox and the Python environment. An environment without
    /// PyTorch is not fatal: the engine serves and says why it cannot run candidates.
    pub async fn new(config: ExecutionConfig, metrics: ExecutionMetrics) -> std::io::Result<Self> {
        let work = std::path::absolute(&config.work_dir)?;
        let harness = install_harness(&work.join("harness"))?;
        let scratch_root = work.join("scratch");
        std::fs::create_dir_all(&scratch_root)?;
        let sandbox = Sandbox::detect_with(config.sandbox).await;
        let python = probe_python(&config, &work.join("harness"), &scratch_root).await;
        let sandbox = match &python {
            Ok(env) => Self::fit_sandbox(sandbox, env, &scratch_root.join("sandbox-probe")).await,
            Err(_) => sandbox,
        };
        match &python {
            Ok(env) => {
                tracing::info!(python = %env.python.display(), versions = ?env.versions, gpus = env.gpus.len(), "engine ready")
            }
            Err(error) => tracing::warn!(%error, "candidates cannot run until python with torch is configured"),
        }
        let warm = Self::warm_up_in_background(&config, &sandbox, &python, &harness, &work)?;
        let compile_workers = match config.compile_workers {
            0 => std::thread::available_parallelism().map_or(2, usize::from),
            n => n,
        };
        let command_users = sandbox.protections().iter().any(|p| p.name == "command_user" && p.active);
        let memory_files = MemoryFiles::open(&config.memory_files_dir, config.memory_files_bytes, command_users);
        Ok(Self {
            inner: Arc::new(Inner {
                artifacts: Cache::new(work.join("artifacts"), config.cache_limits.artifacts_bytes)?,
                admission: Arc::new(Semaphore::new(config.queue_capacity)),
                disk: DiskBudget::new(disk_budget(&config, &work)),
                memory_files,
                compile_slots: Semaphore::new(compile_workers),
                lanes: Lanes::with_budgets(
                    gpu_memory_budgets(&config, &python),
                    config.gpu_slots,
                    config.device_probe.clone(),
                    metrics.clone(),
                ),
                reference_peaks: Mutex::default(),
                eager_medians: Mutex::default(),
                secret: std::collections::hash_map::RandomState::new().hash_one("kforge-evaluator-seeds"),
                config,
                sandbox,
                python,
                harness,
                scratch_root,
                work_dir: work,
                metrics,
                warm,
                censuses: census::Recent::new(RECENT_CENSUSES),
            }),
        })
    }

    /// Starts the warm-up (precompiling the bindings' header, with kforge's build recipe and `bindings_pch`);
    /// compiles that start before it ends build without what it makes.
    fn warm_up_in_background(
        config: &ExecutionConfig,
        sandbox: &Sandbox,
        python: &Result<PythonEnv, PythonUnavailable>,
        harness: &Path,
        work: &Path,
    ) -> std::io::Result<watch::Receiver<Option<Result<PathBuf, WarmUpFailed>>>> {
        let (done, warm) = watch::channel(None);
        let python = match python {
            Ok(python) if config.build_recipe == BuildRecipe::Kforge && config.bindings_pch => python.clone(),
            Ok(_) => {
                done.send_replace(Some(Err(WarmUpFailed("off (build_recipe, bindings_pch)".into()))));
                return Ok(warm);
            }
            Err(error) => {
                done.send_replace(Some(Err(WarmUpFailed(error.to_string()))));
                return Ok(warm);
            }
        };
        let cache = Cache::new(work.join("pch"), config.cache_limits.bindings_pch_bytes)?;
        let scratch = work.join("scratch").join(format!("{}-bindings-pch", std::process::id()));
        let (sandbox, harness) = (sandbox.clone(), harness.to_owned());
        let wall = Duration::from_secs(config.compile_timeout_secs);
        tokio::spawn(async move {
            let _ = std::fs::create_dir_all(&scratch);
            let built = precompiled_header::build(&sandbox, &python, &harness, &cache, &scratch, wall).await;
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
                    done.send_replace(Some(Err(WarmUpFailed(reason.to_string()))));
                    None
                }
            };
            // Pinned, so that no eviction removes it, while this engine lives.
            done.closed().await;
        });
        Ok(warm)
    }

    /// Waits for the warm-up to end: the bindings' precompiled header in place (its directory), or why it is not.
    /// Evaluations do not wait for it.
    pub async fn warm_up(&self) -> Result<PathBuf, WarmUpFailed> {
        let mut warm = self.inner.warm.clone();
        let outcome = warm.wait_for(Option::is_some).await.map(|outcome| outcome.clone());
        outcome.ok().flatten().unwrap_or_else(|| Err(WarmUpFailed("the warm-up ended without an outcome".into())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Evaluator and Profiler services of one process, given the same configuration, run on one engine (one
    /// set of device lanes, one admission queue); another configuration gets its own.
    #[tokio::test]
    async fn one_engine_per_configuration_in_a_process() {
        let work_dir = std::env::temp_dir().join(format!("kforge-engine-shared-{}", std::process::id()));
        // No interpreter: the engine starts and says why it cannot run candidates.
        let config = ExecutionConfig {
            work_dir: work_dir.clone(),
            python: work_dir.join("no-python"),
            bindings_pch: false,
            ..ExecutionConfig::default()
        };
        let metrics = ExecutionMetrics::unregistered;
        let first = Engine::shared(config.clone(), metrics()).await.expect("starts");
        let again = Engine::shared(config.clone(), metrics()).await.expect("starts");
        assert!(Arc::ptr_eq(&first.inner, &again.inner), "the same configuration shares the engine");
        let other = Engine::shared(ExecutionConfig { queue_capacity: 0, ..config }, metrics()).await.expect("starts");
        assert!(!Arc::ptr_eq(&first.inner, &other.inner), "another configuration has its own");
        assert!(other.admit().is_err() && first.admit().is_ok(), "each with its own queue");
        let _ = std::fs::remove_dir_all(&work_dir);
    }
}
