//! The evaluator's configuration (`[evaluator]`), with defaults that work on one machine.

use std::path::PathBuf;

pub use kforge_execution::config::{
    BuildRecipe, CacheLimits, CallLimitsConfig, DeviceProbeConfig, ExecutionConfig, TimingBudget, Tolerance,
    Tolerances, UnknownBuildRecipe,
};
use kforge_sandbox::SandboxOptions;
use kforge_server::{ServerConfig, ServiceConfig};
use serde::{Deserialize, Serialize};

/// Configuration of the Evaluator service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvaluatorConfig {
    pub server: ServerConfig,
    /// Python interpreter with PyTorch. Default: `.venv/bin/python` when it exists (what `scripts/setup.sh`
    /// creates), otherwise `python3` from PATH.
    pub python: PathBuf,
    /// Caches (compiled artifacts, reference outputs, baselines) and per-evaluation scratch space.
    pub work_dir: PathBuf,
    /// Concurrent compiles; 0 means one per CPU core. (One per two cores, since a CUDA build now keeps about two
    /// compilers busy, was measured on the H200 and showed no gain within run-to-run noise: docs/evaluator/COMPILE.md.)
    pub compile_workers: usize,
    /// Evaluations on one GPU at once. They share it for everything but timed work (timing loops and the census's
    /// recorded calls), which runs with every other process on the GPU stopped at a synchronised pause point.
    /// 1 gives each evaluation the GPU to itself from its first stage to its last.
    pub gpu_slots: usize,
    /// CPU threads (torch's intra-op pool, OpenMP, MKL) of each harness process on a GPU. 0: with several slots
    /// per GPU, the cores divided among all slots (at least 1), so that processes sharing the machine do not each
    /// start a thread per core; with one slot, torch's own default.
    pub gpu_stage_threads: usize,
    /// Memory-aware admission: each GPU's budget is its total memory times this fraction, and an evaluation whose
    /// task's footprint is known takes a slot only where it fits beside the footprints already there (or where
    /// none is; docs/evaluator/DEVICES.md, "Memory-aware admission"). The rest is left to what no footprint counts
    /// (the baseline computed ahead, allocator slack). 0: admission by slots alone.
    pub gpu_memory_fraction: f64,
    /// Evaluations admitted at once (queued or running); more get RESOURCE_EXHAUSTED with a retry hint.
    pub queue_capacity: usize,
    /// Static policy when a request names none.
    pub default_policy: String,
    /// Correctness trials when a request asks for 0.
    pub default_trials: u32,
    /// Extra correctness trials run after timing and the census: the first repeats trial 0's inputs (an output far
    /// outside the tolerance there is behaviour that changed once the first check was over, a hack), the others run
    /// on fresh inputs.
    pub recheck_trials: u32,
    /// One of the first correctness trials repeats trial 0's inputs with a few elements moved far out of range;
    /// the candidate's output must move as the reference's does (partial computation, closed-form shortcuts).
    pub sensitivity_check: bool,
    /// The most bytes of outputs one evaluation saves for its check, per side (candidate and reference): a task
    /// whose outputs are larger than this over all its trials keeps as many trials as fit, at least two (trial 0
    /// and the sensitivity trial; docs/evaluator/OUTPUTS.md, "Large outputs"). 0: every trial, whatever its size.
    pub output_bytes_budget: u64,
    /// Bytes of disk the evaluations' files may take at once (outputs on both sides and new reference entries);
    /// each GPU evaluation reserves its share before its candidate starts (docs/evaluator/OUTPUTS.md, "Disk budget").
    /// 0: 60% of the space available in `work_dir` when the evaluator starts.
    pub disk_budget_bytes: u64,
    /// A memory-backed directory (tmpfs) where a GPU evaluation's candidate outputs files go, when they fit, instead
    /// of the disk (docs/evaluator/OUTPUTS.md, "Outputs in memory"); empty, not memory-backed, or commands without
    /// command users of their own: the disk.
    pub memory_files_dir: PathBuf,
    /// Bytes those files may take in memory at once; 0: half the smaller of the directory's free room and the host's
    /// available memory when the evaluator starts.
    pub memory_files_bytes: u64,
    /// Forward calls profiled per mode in the kernel census.
    pub census_calls: u32,
    /// Largest candidate or task source accepted, in bytes.
    pub max_source_bytes: usize,
    /// Wall-clock limit of a compile, in seconds.
    pub compile_timeout_secs: u64,
    /// Wall-clock limit of each run stage (candidate, reference, check, baseline), in seconds.
    pub run_timeout_secs: u64,
    /// How long one call into candidate code may run before its stage is stopped as hung (a kernel that never
    /// ends costs seconds, not `run_timeout_secs`, and never stalls the other evaluations on its GPU).
    pub call_limits: CallLimitsConfig,
    /// Output comparison tolerances by dtype (`Tolerance`).
    pub tolerances: Tolerances,
    /// How long and how precisely to time.
    pub timing: TimingBudget,
    /// With at least four CPUs per GPU: keep one CPU per GPU for the thread that launches its timed work; every
    /// stage starts on the others (docs/evaluator/TIMING.md, "Nothing competes for the launching CPU").
    pub reserve_timing_cpu: bool,
    /// A candidate faster than eager by more than this factor is timed again in a fresh process and the slower
    /// measurement counts; 0 turns the re-measurement off.
    pub plausible_speedup: f64,
    /// Whether baselines include torch.compile (it needs a C compiler and minutes per task on first use).
    pub baseline_torch_compile: bool,
    /// Which evaluations time the candidate and a fresh eager baseline in alternating rounds
    /// (`[evaluator.paired_timing]`; docs/evaluator/TIMING.md, "Paired timing").
    pub paired_timing: PairedTimingConfig,
    /// Whether a GPU evaluation starts its task's baseline when it arrives, beside its compile and outside the
    /// device's slots, rather than on its slot after the checks (off: the serial design).
    pub baselines_ahead: bool,
    /// How candidates' extensions are built: `kforge` (the light header, kforge's nvcc, and torch's extension header
    /// precompiled for the bindings: docs/evaluator/COMPILE.md) or `stock` (exactly as load_inline builds them:
    /// the serial design the benchmark compares with, and a way back should the recipe misjudge a new torch).
    pub build_recipe: BuildRecipe,
    /// With kforge's recipe: precompile torch's extension header for the bindings at start (about 0.8 GB per flag
    /// set in `work_dir/pch`; compiles that start before it is ready build without it).
    pub bindings_pch: bool,
    /// Optional sandbox protections (each on by default, used where the kernel allows; see GetCapabilities).
    pub sandbox: SandboxOptions,
    /// The GPU health probe run after a device fault, and while a device is quarantined.
    pub device_probe: DeviceProbeConfig,
    /// Size bounds of the on-disk caches.
    pub cache_limits: CacheLimits,
}

impl EvaluatorConfig {
    /// The engine's share of this configuration: the keys the execution engine reads. Every field is named, so a
    /// new one fails to compile here until it is placed.
    pub fn execution(&self) -> ExecutionConfig {
        let Self {
            server: _,
            python,
            work_dir,
            compile_workers,
            gpu_slots,
            gpu_stage_threads,
            gpu_memory_fraction,
            queue_capacity,
            default_policy,
            default_trials: _,
            recheck_trials: _,
            sensitivity_check: _,
            output_bytes_budget,
            disk_budget_bytes,
            memory_files_dir,
            memory_files_bytes,
            census_calls,
            max_source_bytes,
            compile_timeout_secs,
            run_timeout_secs,
            call_limits,
            tolerances: _,
            timing: _,
            reserve_timing_cpu,
            plausible_speedup: _,
            baseline_torch_compile: _,
            paired_timing: _,
            baselines_ahead: _,
            build_recipe,
            bindings_pch,
            sandbox,
            device_probe,
            cache_limits,
        } = self.clone();
        ExecutionConfig {
            python,
            work_dir,
            compile_workers,
            gpu_slots,
            gpu_stage_threads,
            gpu_memory_fraction,
            queue_capacity,
            default_policy,
            max_source_bytes,
            output_bytes_budget,
            disk_budget_bytes,
            memory_files_dir,
            memory_files_bytes,
            census_calls,
            compile_timeout_secs,
            run_timeout_secs,
            call_limits,
            reserve_timing_cpu,
            build_recipe,
            bindings_pch,
            sandbox,
            device_probe,
            cache_limits,
        }
    }
}

impl Default for EvaluatorConfig {
    fn default() -> Self {
        // The engine's keys default as the engine's configuration does.
        let ExecutionConfig {
            python,
            work_dir,
            compile_workers,
            gpu_slots,
            gpu_stage_threads,
            gpu_memory_fraction,
            queue_capacity,
            default_policy,
            max_source_bytes,
            output_bytes_budget,
            disk_budget_bytes,
            memory_files_dir,
            memory_files_bytes,
            census_calls,
            compile_timeout_secs,
            run_timeout_secs,
            call_limits,
            reserve_timing_cpu,
            build_recipe,
            bindings_pch,
            sandbox,
            device_probe,
            cache_limits,
        } = ExecutionConfig::default();
        Self {
            server: ServerConfig::listening_on(([127, 0, 0, 1], 50051).into()),
            python,
            work_dir,
            compile_workers,
            gpu_slots,
            gpu_stage_threads,
            gpu_memory_fraction,
            queue_capacity,
            default_policy,
            default_trials: 5,
            recheck_trials: 2,
            sensitivity_check: true,
            output_bytes_budget,
            disk_budget_bytes,
            memory_files_dir,
            memory_files_bytes,
            census_calls,
            max_source_bytes,
            compile_timeout_secs,
            run_timeout_secs,
            call_limits,
            tolerances: Tolerances::default(),
            timing: TimingBudget::default(),
            reserve_timing_cpu,
            plausible_speedup: 10.0,
            baseline_torch_compile: true,
            paired_timing: PairedTimingConfig::default(),
            baselines_ahead: true,
            build_recipe,
            bindings_pch,
            sandbox,
            device_probe,
            cache_limits,
        }
    }
}

/// Paired timing: the candidate and a fresh baseline process time their calls in alternating rounds in one window,
/// so both meet the same load, and the speedup is the median of the rounds' ratios.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PairedTimingConfig {
    /// Where: `cpu` (the default: the CPU backend, whose timing shares the machine's CPUs with everything else),
    /// `all` (GPU backends too, a baseline process per evaluation), or `off` (every speedup against the cached
    /// baseline).
    pub on: PairedOn,
    /// Rounds per side, at most 100: the timing budget (`timing`) is spread over them. Default 10.
    #[serde(deserialize_with = "rounds")]
    pub rounds: u32,
    /// The rounds' speedups spreading more than this (their interquartile range over their median) gets the
    /// finding `timing.unsteady`; positive. Default 0.2.
    #[serde(deserialize_with = "spread_bound")]
    pub spread_bound: f64,
}

/// Paired rounds per side: each takes a turn at the device, so thousands would time switching, not calls.
const MOST_ROUNDS: u32 = 100;

fn rounds<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    let value = u32::deserialize(deserializer)?;
    match value <= MOST_ROUNDS {
        true => Ok(value),
        false => Err(serde::de::Error::custom(format!("{value} rounds: at most {MOST_ROUNDS}"))),
    }
}

fn spread_bound<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    let value = f64::deserialize(deserializer)?;
    match value.is_finite() && value > 0.0 {
        true => Ok(value),
        false => Err(serde::de::Error::custom(format!("{value} is not a positive figure"))),
    }
}

impl Default for PairedTimingConfig {
    fn default() -> Self {
        Self { on: PairedOn::Cpu, rounds: 10, spread_bound: 0.2 }
    }
}

/// Which backends time in pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PairedOn {
    Cpu,
    All,
    Off,
}

impl PairedTimingConfig {
    /// Whether an evaluation on the CPU (`on_gpu` false) or a GPU times in pairs.
    pub fn applies(&self, on_gpu: bool) -> bool {
        self.rounds > 0
            && match self.on {
                PairedOn::Cpu => !on_gpu,
                PairedOn::All => true,
                PairedOn::Off => false,
            }
    }
}

impl ServiceConfig for EvaluatorConfig {
    const SECTION: &'static str = "evaluator";
    fn server(&self) -> &ServerConfig {
        &self.server
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_keys_are_the_evaluator_s_own() {
        let config = EvaluatorConfig { gpu_slots: 2, queue_capacity: 7, census_calls: 3, ..Default::default() };
        let execution = config.execution();
        assert_eq!((execution.gpu_slots, execution.queue_capacity, execution.census_calls), (2, 7, 3));
        assert_eq!(EvaluatorConfig::default().execution(), ExecutionConfig::default());
    }

    #[test]
    fn paired_timing_is_checked_as_it_loads() {
        let parse = |json: &str| serde_json::from_str::<PairedTimingConfig>(json).map_err(|e| e.to_string());
        let parsed = parse(r#"{"on": "all", "rounds": 4, "spread_bound": 0.5}"#).expect("valid");
        assert_eq!(parsed, PairedTimingConfig { on: PairedOn::All, rounds: 4, spread_bound: 0.5 });
        assert!(parse(r#"{"rounds": 101}"#).expect_err("too many").contains("at most 100"));
        for bound in ["0.0", "-1.0"] {
            let error = parse(&format!(r#"{{"spread_bound": {bound}}}"#)).expect_err(bound);
            assert!(error.contains("not a positive figure"), "{bound}: {error}");
        }
        assert!(parse(r#"{"on": "gpu"}"#).is_err(), "an unknown place");
        assert!(!PairedTimingConfig { rounds: 0, ..Default::default() }.applies(false), "0 rounds: unpaired");
        assert!(PairedTimingConfig::default().applies(false) && !PairedTimingConfig::default().applies(true));
    }
}
