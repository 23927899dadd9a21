//! The execution engine's configuration: where it works, the interpreter it runs, how many compiles and device
//! slots it runs at once, its sandbox, caches and limits. The evaluator's `[evaluator]` table carries these keys
//! (`EvaluatorConfig::execution`); a profiler on its own reads them from `[profiler.execution]`.

use std::path::{Path, PathBuf};

use kforge_sandbox::SandboxOptions;
use serde::{Deserialize, Serialize};

/// What the engine needs to know to run candidates (the keys of the same names in `[evaluator]`, documented
/// there).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExecutionConfig {
    /// Python interpreter with PyTorch. Default: `.venv/bin/python` when it exists (what `scripts/setup.sh`
    /// creates), otherwise `python3` from PATH.
    pub python: PathBuf,
    /// Caches (compiled artifacts, reference outputs, baselines) and per-run scratch space. One engine per work
    /// directory in a process (`Engine::shared`).
    pub work_dir: PathBuf,
    /// Concurrent compiles; 0 means one per CPU core.
    pub compile_workers: usize,
    /// Runs on one GPU at once; timed work runs alone.
    pub gpu_slots: usize,
    /// CPU threads of each harness process on a GPU; 0: the cores divided among all slots (with several slots).
    pub gpu_stage_threads: usize,
    /// Memory-aware admission: each GPU's budget is its total memory times this fraction (0: slots alone).
    pub gpu_memory_fraction: f64,
    /// Evaluations and profiles admitted at once (queued or running).
    pub queue_capacity: usize,
    /// Static policy when a request names none.
    pub default_policy: String,
    /// Largest candidate or task source accepted, in bytes.
    pub max_source_bytes: usize,
    /// The most bytes of outputs one run saves for its check, per side (0: every trial).
    pub output_bytes_budget: u64,
    /// Bytes of disk the runs' files may take at once; 0: 60% of the space available in `work_dir` at start.
    pub disk_budget_bytes: u64,
    /// A memory-backed directory (tmpfs) for candidates' outputs files on a GPU; empty, or not memory-backed: the
    /// disk (`handoff.rs`).
    pub memory_files_dir: PathBuf,
    /// Bytes those files may take in memory at once; 0: half the smaller of its free room and the available memory.
    pub memory_files_bytes: u64,
    /// Forward calls profiled per mode in the kernel census.
    pub census_calls: u32,
    /// Wall-clock limit of a compile, in seconds.
    pub compile_timeout_secs: u64,
    /// Wall-clock limit of each run stage, in seconds.
    pub run_timeout_secs: u64,
    /// How long one call into candidate code may run before its stage is stopped as hung.
    pub call_limits: CallLimitsConfig,
    /// With at least four CPUs per GPU: keep one CPU per GPU for the thread that launches its timed work.
    pub reserve_timing_cpu: bool,
    /// How candidates' extensions are built (`kforge` or `stock`).
    pub build_recipe: BuildRecipe,
    /// With kforge's recipe: precompile torch's extension header for the bindings at start.
    pub bindings_pch: bool,
    /// Optional sandbox protections (each on by default, used where the kernel allows).
    pub sandbox: SandboxOptions,
    /// The GPU health probe run after a device fault, and while a device is quarantined.
    pub device_probe: DeviceProbeConfig,
    /// Size bounds of the on-disk caches.
    pub cache_limits: CacheLimits,
}

impl Default for ExecutionConfig {
    fn default() -> Self {
        Self {
            python: default_python(),
            work_dir: PathBuf::from(".kforge/evaluator"),
            compile_workers: 0,
            gpu_slots: 4,
            gpu_stage_threads: 0,
            gpu_memory_fraction: 0.9,
            queue_capacity: 64,
            default_policy: "permissive".into(),
            max_source_bytes: 256 * 1024,
            output_bytes_budget: 12 << 30,
            disk_budget_bytes: 0,
            memory_files_dir: PathBuf::from("/dev/shm"),
            memory_files_bytes: 0,
            census_calls: 2,
            compile_timeout_secs: 600,
            run_timeout_secs: 300,
            call_limits: CallLimitsConfig::default(),
            reserve_timing_cpu: true,
            build_recipe: BuildRecipe::Kforge,
            bindings_pch: true,
            sandbox: SandboxOptions::default(),
            device_probe: DeviceProbeConfig::default(),
            cache_limits: CacheLimits::default(),
        }
    }
}

fn default_python() -> PathBuf {
    let venv = Path::new(".venv/bin/python");
    if venv.exists() {
        // Absolute, so that children started in scratch directories find it.
        std::path::absolute(venv).unwrap_or_else(|_| venv.to_owned())
    } else {
        PathBuf::from("python3")
    }
}

impl ExecutionConfig {
    /// The memory budget for admission of a GPU of `total_memory` bytes: `gpu_memory_fraction` of it; `None`
    /// (admission by slots alone) where the fraction is not positive or the memory is unknown (0).
    pub fn gpu_memory_budget(&self, total_memory: u64) -> Option<u64> {
        let fraction = self.gpu_memory_fraction;
        (fraction > 0.0 && total_memory > 0).then_some((total_memory as f64 * fraction) as u64)
    }

    /// CPU threads for each harness process on a GPU, with `gpus` GPUs on a machine of `cores` cores (see
    /// `gpu_stage_threads`); `None`: torch's own default.
    pub fn gpu_stage_threads_on(&self, gpus: usize, cores: usize) -> Option<usize> {
        match self.gpu_stage_threads {
            0 if self.gpu_slots > 1 && gpus > 0 => Some((cores / (gpus * self.gpu_slots)).max(1)),
            0 => None,
            threads => Some(threads),
        }
    }
}

/// How GPUs are health-probed (`device_probe`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceProbeConfig {
    /// The probe program. Default: `kforge-device-probe` next to this executable, else on PATH.
    pub command: Option<PathBuf>,
    /// A probe that has not finished after this many seconds failed (a wedged device hangs driver calls).
    pub timeout_secs: u64,
    /// While a device is quarantined, it is probed again this often, in seconds.
    pub retry_secs: u64,
}

impl Default for DeviceProbeConfig {
    fn default() -> Self {
        Self { command: None, timeout_secs: 30, retry_secs: 15 }
    }
}

/// How candidates' extensions are built (`build_recipe`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildRecipe {
    #[default]
    Kforge,
    Stock,
}

impl BuildRecipe {
    const ALL: [Self; 2] = [Self::Kforge, Self::Stock];

    /// Its name in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kforge => "kforge",
            Self::Stock => "stock",
        }
    }
}

/// A build recipe name that is neither `kforge` nor `stock`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stock or kforge, not {0}")]
pub struct UnknownBuildRecipe(pub String);

impl std::str::FromStr for BuildRecipe {
    type Err = UnknownBuildRecipe;

    fn from_str(name: &str) -> Result<Self, UnknownBuildRecipe> {
        Self::ALL.into_iter().find(|recipe| recipe.name() == name).ok_or_else(|| UnknownBuildRecipe(name.to_owned()))
    }
}

/// Size bounds of the caches' completed entries in `work_dir`, in bytes (0: unbounded). Over its bound, a cache
/// drops entries no evaluation is using, the largest size times time since last use first (`Cache::evict`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheLimits {
    /// Compiled extensions (tens of MB each).
    pub artifacts_bytes: u64,
    /// Reference outputs per task, seeds and device (large tasks hold GBs); at most 20% of the space available
    /// in the work directory when the evaluator starts, whatever this says.
    pub references_bytes: u64,
    /// Baseline timing samples (KBs each).
    pub baselines_bytes: u64,
    /// torch's extension header precompiled for the bindings (`bindings_pch`; about 1.6 GB per torch version).
    pub bindings_pch_bytes: u64,
}

impl Default for CacheLimits {
    fn default() -> Self {
        const GIB: u64 = 1 << 30;
        Self {
            artifacts_bytes: 20 * GIB,
            references_bytes: 50 * GIB,
            baselines_bytes: GIB,
            bindings_pch_bytes: 4 * GIB,
        }
    }
}

/// The error allowed per element of one dtype's outputs: `atol * min(1, peak) + rtol * |expected| + scale_rtol *
/// typical`, `peak` and `typical` being the output's largest and mean finite `|expected|` (docs/evaluator/OUTPUTS.md,
/// "Tolerances").
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tolerance {
    pub atol: f64,
    pub rtol: f64,
    /// Relative to the output's mean `|expected|`: an element near zero that is a sum of terms as large as the
    /// output's typical values carries their rounding, which `rtol * |expected|` does not cover.
    pub scale_rtol: f64,
}

/// Tolerances by floating dtype; integer and boolean outputs compare exactly.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tolerances {
    pub float16: Tolerance,
    pub bfloat16: Tolerance,
    /// atol and rtol 1e-3: tight enough that an fp16 shortcut on an fp32 task fails it. scale_rtol 1e-5: legitimate
    /// 8192-term row sums with a mean |value| of about 2.5e3 are off by up to 2.2e-3 on elements near zero
    /// (level2/14 on an H200, rejected by 1e-3 alone in 2 of 4 evaluations; bench/results/timing-fidelity/2026-11-27).
    pub float32: Tolerance,
    pub float64: Tolerance,
}

impl Default for Tolerances {
    fn default() -> Self {
        Self {
            float16: Tolerance { atol: 1e-2, rtol: 1e-2, scale_rtol: 1e-4 },
            bfloat16: Tolerance { atol: 2e-2, rtol: 2e-2, scale_rtol: 2e-4 },
            float32: Tolerance { atol: 1e-3, rtol: 1e-3, scale_rtol: 1e-5 },
            float64: Tolerance { atol: 1e-8, rtol: 1e-8, scale_rtol: 1e-10 },
        }
    }
}

/// The adaptive timing loop's budget, shared by candidates and baselines.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimingBudget {
    /// Untimed runs first; they run exactly the code path of measured runs.
    pub warmup_runs: u32,
    /// Fewest measured runs.
    pub min_runs: u32,
    /// Most measured runs.
    pub max_runs: u32,
    /// Measurement stops once this much time has passed, in seconds.
    pub max_seconds: f64,
    /// Measurement goes on for at least this long, in seconds (with `min_runs`): a stable median of a short call
    /// needs many samples.
    pub min_seconds: f64,
    /// Measurement stops (past `min_runs` and `min_seconds`) once the standard error of the mean is this fraction
    /// of the mean.
    pub target_rel_error: f64,
    /// Input sets rotated through (fresh inputs from different seeds).
    pub input_sets: u32,
}

impl Default for TimingBudget {
    fn default() -> Self {
        Self {
            warmup_runs: 10,
            min_runs: 50,
            max_runs: 1000,
            max_seconds: 5.0,
            min_seconds: 0.2,
            target_rel_error: 0.005,
            input_sets: 3,
        }
    }
}

/// Limits of one call into candidate code (`call_limits`); see `stage::CallLimits`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CallLimitsConfig {
    /// A call that waits (a kernel running) may take this many times the reference's eager median...
    #[serde(deserialize_with = "positive")]
    pub reference_factor: f64,
    /// ...and at least this long, in seconds.
    #[serde(deserialize_with = "positive")]
    pub floor_secs: f64,
    /// A waiting call's limit while the task has no measured reference yet, in seconds.
    #[serde(deserialize_with = "positive")]
    pub unmeasured_secs: f64,
    /// A call that used at least this share of a CPU over its last few seconds is working (JIT compiles,
    /// autotuning, host code), not hung: a process waiting on a kernel that never ends uses none. In (0, 1].
    #[serde(deserialize_with = "share")]
    pub working_share: f64,
    /// A working call may run this long, in seconds.
    #[serde(deserialize_with = "positive")]
    pub working_secs: f64,
}

/// The most any call limit may be: a day, in seconds (a larger figure is a typo, and would overflow a deadline).
const LONGEST_LIMIT: f64 = 86_400.0;

/// A positive, finite figure of at most [`LONGEST_LIMIT`].
fn positive<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    let value = f64::deserialize(deserializer)?;
    if value > 0.0 && value <= LONGEST_LIMIT {
        Ok(value)
    } else {
        Err(serde::de::Error::custom(format!("{value} is not a positive figure of at most {LONGEST_LIMIT}")))
    }
}

/// A share of one CPU, in (0, 1].
fn share<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    let value = f64::deserialize(deserializer)?;
    if value > 0.0 && value <= 1.0 {
        Ok(value)
    } else {
        Err(serde::de::Error::custom(format!("{value} is not a share of a CPU in (0, 1]")))
    }
}

impl Default for CallLimitsConfig {
    fn default() -> Self {
        Self {
            reference_factor: 100.0,
            floor_secs: 3.0,
            unmeasured_secs: 30.0,
            working_share: 0.01,
            working_secs: 60.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_on_a_shared_gpu_divide_the_cores_among_the_slots() {
        let config =
            |gpu_slots, gpu_stage_threads| ExecutionConfig { gpu_slots, gpu_stage_threads, ..Default::default() };
        assert_eq!(config(8, 0).gpu_stage_threads_on(1, 16), Some(2));
        assert_eq!(config(8, 0).gpu_stage_threads_on(2, 32), Some(2), "every GPU's slots count");
        assert_eq!(config(8, 0).gpu_stage_threads_on(1, 4), Some(1), "at least one");
        assert_eq!(config(1, 0).gpu_stage_threads_on(1, 16), None, "a GPU to itself keeps torch's default");
        assert_eq!(config(8, 0).gpu_stage_threads_on(0, 16), None, "no GPU");
        assert_eq!(config(8, 3).gpu_stage_threads_on(1, 16), Some(3), "as configured");
    }

    #[test]
    fn call_limits_refuse_figures_that_would_defeat_or_overflow_them() {
        let limits = |key: &str, value: f64| {
            serde_json::from_value::<CallLimitsConfig>(serde_json::json!({ key: value })).map_err(|e| e.to_string())
        };
        assert_eq!(limits("working_share", 0.05).expect("valid").working_share, 0.05);
        assert_eq!(limits("floor_secs", 1.5).expect("valid").floor_secs, 1.5);
        // A share of 0 would count every call as working, a hang included; more than a CPU, none.
        for share in [0.0, -0.1, 1.5] {
            let error = limits("working_share", share).expect_err("refused");
            assert!(error.contains("share of a CPU"), "{error}");
        }
        for key in ["reference_factor", "floor_secs", "unmeasured_secs", "working_secs"] {
            for value in [0.0, -1.0, 1e12] {
                let error = limits(key, value).expect_err("refused");
                assert!(error.contains("positive figure"), "{key} = {value}: {error}");
            }
        }
    }

    #[test]
    fn a_gpu_s_memory_budget_is_its_configured_fraction() {
        let config = |gpu_memory_fraction| ExecutionConfig { gpu_memory_fraction, ..Default::default() };
        let gib = 1u64 << 30;
        assert_eq!(ExecutionConfig::default().gpu_memory_budget(80 * gib), Some(72 * gib), "0.9 by default");
        assert_eq!(config(0.5).gpu_memory_budget(80 * gib), Some(40 * gib));
        assert_eq!(config(0.0).gpu_memory_budget(80 * gib), None, "0: slots alone");
        assert_eq!(config(f64::NAN).gpu_memory_budget(80 * gib), None);
        assert_eq!(config(0.9).gpu_memory_budget(0), None, "memory unknown");
        let configured: ExecutionConfig =
            serde_json::from_value(serde_json::json!({ "gpu_memory_fraction": 0.75 })).expect("valid");
        assert_eq!(configured.gpu_memory_fraction, 0.75);
    }

    #[test]
    fn build_recipes_are_named_as_the_configuration_spells_them() {
        for recipe in BuildRecipe::ALL {
            assert_eq!(recipe.name().parse::<BuildRecipe>(), Ok(recipe));
            let configured: ExecutionConfig =
                serde_json::from_value(serde_json::json!({ "build_recipe": recipe.name() })).expect("valid");
            assert_eq!(configured.build_recipe, recipe);
        }
        assert_eq!("fast".parse::<BuildRecipe>(), Err(UnknownBuildRecipe("fast".into())));
    }
}
