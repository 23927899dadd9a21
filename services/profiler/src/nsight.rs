//! Nsight Compute as the profiler runs it: where `ncu` is, its version, whether this host lets an unprivileged
//! process read the GPU's counters, the command line that wraps a candidate's stage, and what its log says went
//! wrong.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The default metric set (`METRIC_SET_CUDAFORGE`): the 24 metrics CudaForge's paper profiles a kernel with, in
/// its order, for Hopper. Two of the published names are not offered there (Nsight Compute 2025.3.1 on the H100,
/// `tests/fixtures/h100/query-metrics.csv`), and ncu fails the whole run for a metric it does not know, so each is
/// replaced by its nearest offered metric:
///
/// - `sm__inst_executed_pipe_fp32` by `sm__inst_executed_pipe_fma`: since Volta FP32 instructions issue to the FMA
///   pipe, which is what is counted;
/// - `smsp__warp_issue_stalled_memory_dependency_per_warp_active` by
///   `smsp__warp_issue_stalled_lg_throttle_per_warp_active`, warps waiting on the global/local memory queue (the
///   wait on the memory's data, long_scoreboard, is in the set already).
///
/// The diagnosis derives its figures from these (`diagnosis.rs`).
pub const CUDAFORGE: [&str; 24] = [
    "sm__cycles_active.avg",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__occupancy_limit_blocks",
    "launch__occupancy_limit_registers",
    "launch__occupancy_limit_shared_mem",
    "launch__registers_per_thread",
    "sm__inst_executed.sum",
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes.sum.per_second",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "l1tex__t_sector_hit_rate.pct",
    "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "lts__t_sector_hit_rate.pct",
    "lts__throughput.avg.pct_of_peak_sustained_active",
    "smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct",
    "smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct",
    "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct",
    "smsp__warp_issue_stalled_barrier_per_warp_active.pct",
    "smsp__warp_issue_stalled_branch_resolving_per_warp_active.pct",
    "smsp__sass_average_branch_targets_threads_uniform.pct",
];

/// A launch's device time: collected with every list of metrics (CudaForge's 24 do not include it), since every
/// profiled launch shows its duration.
pub const DURATION: &str = "gpu__time_duration.sum";

/// Which metrics a run collects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Metrics {
    /// Nsight Compute's `full` set of sections.
    Full,
    /// These metrics, and [`DURATION`].
    List(Vec<String>),
}

/// Whether `name` has the shape of a metric name (`unit__counter.rollup.submetric`): what may go on ncu's
/// command line.
pub fn valid_metric_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'.')
        && !name.starts_with('.')
        && !name.ends_with('.')
}

/// Nsight Compute on this host.
#[derive(Debug, Clone)]
pub struct Ncu {
    /// The `ncu` program.
    pub program: PathBuf,
    /// `Version 2025.3.1.0 (build ...)`.
    pub version: String,
    /// What the profiled stage must be able to read: its installation.
    pub installation: Vec<PathBuf>,
}

/// Why Nsight Compute cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unusable {
    #[error("Nsight Compute (ncu) not found: {0}")]
    Missing(String),
}

impl Ncu {
    /// Finds `ncu`: `configured` when set, else on `PATH`, else in `/usr/local/cuda/bin`.
    pub fn locate(configured: Option<&Path>) -> Result<Self, Unusable> {
        let program = match configured {
            Some(path) if path.is_file() => path.to_owned(),
            Some(path) => return Err(Unusable::Missing(format!("{} (configured) is not a file", path.display()))),
            None => search_path().ok_or_else(|| {
                Unusable::Missing("not on PATH nor in /usr/local/cuda/bin; set [profiler].ncu".to_owned())
            })?,
        };
        let output = std::process::Command::new(&program)
            .arg("--version")
            .output()
            .map_err(|error| Unusable::Missing(format!("{} --version: {error}", program.display())))?;
        let text = String::from_utf8_lossy(&output.stdout);
        let version = text.lines().find(|line| line.starts_with("Version")).unwrap_or("").trim().to_owned();
        if !output.status.success() || version.is_empty() {
            return Err(Unusable::Missing(format!("{} --version printed no version", program.display())));
        }
        // `ncu` is a script in the CUDA toolkit's `bin` that runs the tool in its own directory beside it.
        let mut installation = Vec::new();
        for path in [program.clone(), std::fs::canonicalize(&program).unwrap_or_else(|_| program.clone())] {
            if let Some(root) = path.parent().and_then(Path::parent)
                && !installation.iter().any(|known: &PathBuf| root.starts_with(known))
            {
                installation.push(root.to_owned());
            }
        }
        Ok(Self { program, version, installation })
    }

    /// The command line that runs a stage's interpreter under Nsight Compute: profiling off until the harness's
    /// `cudaProfilerStart`, only `kernels` (by function name), at most `launch_limit` launches, each replayed
    /// kernel by kernel, clocks locked to base only when asked; the report and a raw CSV log in `dir`.
    pub fn argv(
        &self,
        kernels: &[String],
        launch_limit: u32,
        metrics: &Metrics,
        lock_clocks: bool,
        dir: &Path,
    ) -> Vec<OsString> {
        let mut argv: Vec<OsString> = vec![self.program.clone().into()];
        let mut arg = |a: &str| argv.push(a.into());
        arg("--profile-from-start");
        arg("off");
        arg("--target-processes");
        arg("all");
        arg("--replay-mode");
        arg("kernel");
        arg("--clock-control");
        arg(if lock_clocks { "base" } else { "none" });
        arg("--launch-count");
        arg(&launch_limit.to_string());
        arg("--kernel-name-base");
        arg("function");
        arg("--kernel-name");
        arg(&format!("regex:^({})$", kernels.iter().map(|k| regex_escape(k)).collect::<Vec<_>>().join("|")));
        match metrics {
            Metrics::Full => {
                arg("--set");
                arg("full");
            }
            Metrics::List(names) => {
                let mut names = names.clone();
                if !names.iter().any(|name| name == DURATION) {
                    names.push(DURATION.to_owned());
                }
                arg("--metrics");
                arg(&names.join(","));
            }
        }
        for a in ["--csv", "--page", "raw", "--print-units", "base", "--force-overwrite"] {
            arg(a);
        }
        argv.push("--log-file".into());
        argv.push(dir.join(LOG).into());
        argv.push("--export".into());
        argv.push(dir.join(REPORT_STEM).into());
        argv
    }
}

/// The raw CSV log and the report a run leaves in its directory.
pub const LOG: &str = "ncu.csv";
pub const REPORT_STEM: &str = "report";
pub const REPORT: &str = "report.ncu-rep";

fn search_path() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/local/cuda/bin")])
        .map(|dir| dir.join("ncu"))
        .find(|candidate| candidate.is_file())
}

/// Escapes a kernel name for ncu's regular expression.
fn regex_escape(name: &str) -> String {
    let mut escaped = String::with_capacity(name.len());
    for c in name.chars() {
        if !(c.is_ascii_alphanumeric() || c == '_') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// Whether this host lets every user read the GPU's performance counters, and why it is thought so: the NVIDIA
/// driver's `RmProfilingAdminOnly` parameter (0: every user; 1: only CAP_SYS_ADMIN).
pub fn counters_permitted() -> (bool, String) {
    match std::fs::read_to_string("/proc/driver/nvidia/params") {
        Ok(params) => match params.lines().find_map(|l| l.strip_prefix("RmProfilingAdminOnly:")).map(str::trim) {
            Some("0") => (true, "RmProfilingAdminOnly: 0 (counters open to all users)".into()),
            Some(value) => (
                false,
                format!(
                    "RmProfilingAdminOnly: {value}: only CAP_SYS_ADMIN may read counters; load the nvidia module \
                     with NVreg_RestrictProfilingToAdminUsers=0"
                ),
            ),
            None => (false, "the NVIDIA driver does not report RmProfilingAdminOnly".into()),
        },
        Err(error) => (false, format!("no NVIDIA driver parameters (/proc/driver/nvidia/params: {error})")),
    }
}

/// What an Nsight Compute log says went wrong with the profiler itself (not with the profiled program).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// ERR_NVGPUCTRPERM: the process may not read the counters.
    CounterPermission(String),
    /// Another `==ERROR==` line.
    Profiler(String),
}

/// The first profiler error in an ncu log, if any.
pub fn failure(log: &str) -> Option<Failure> {
    let line = log.lines().find(|line| line.starts_with("==ERROR=="))?;
    let text = line.trim_start_matches("==ERROR==").trim().to_owned();
    if text.contains("ERR_NVGPUCTRPERM") {
        Some(Failure::CounterPermission(format!(
            "{text} (grant it with the driver setting NVreg_RestrictProfilingToAdminUsers=0, or run the profiler \
             with CAP_SYS_ADMIN)"
        )))
    } else {
        Some(Failure::Profiler(text))
    }
}

/// Nsight Compute's own messages in its log (`==ERROR==`, `==WARNING==`, `==PROF==` lines), the last `max` of
/// them: what a failed profiled stage's error shows, since the profiler writes them to its log, not to stderr.
pub fn messages(log: &str, max: usize) -> Vec<&str> {
    let lines: Vec<&str> = log
        .lines()
        .filter(|line| ["==ERROR==", "==WARNING==", "==PROF=="].iter().any(|tag| line.starts_with(tag)))
        .collect();
    lines[lines.len().saturating_sub(max)..].to_vec()
}

/// The metrics asked for that no profiled launch reports (unknown to this device or this version of ncu).
pub fn missing(asked: &[String], reported: &std::collections::BTreeSet<&str>) -> Vec<String> {
    asked.iter().filter(|name| !reported.contains(name.as_str())).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CudaForge's published selection: the names the default set keeps, and the two it replaces on Hopper.
    const PUBLISHED_KEPT: [&str; 22] = [
        "sm__cycles_active.avg",
        "sm__warps_active.avg.pct_of_peak_sustained_active",
        "launch__occupancy_limit_blocks",
        "launch__occupancy_limit_registers",
        "launch__occupancy_limit_shared_mem",
        "launch__registers_per_thread",
        "sm__inst_executed.sum",
        "sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active",
        "dram__bytes_read.sum",
        "dram__bytes_write.sum",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "dram__bytes.sum.per_second",
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
        "l1tex__t_sector_hit_rate.pct",
        "l1tex__throughput.avg.pct_of_peak_sustained_active",
        "lts__t_sector_hit_rate.pct",
        "lts__throughput.avg.pct_of_peak_sustained_active",
        "smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct",
        "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct",
        "smsp__warp_issue_stalled_barrier_per_warp_active.pct",
        "smsp__warp_issue_stalled_branch_resolving_per_warp_active.pct",
        "smsp__sass_average_branch_targets_threads_uniform.pct",
    ];
    const PUBLISHED_REPLACED: [&str; 2] = [
        "sm__inst_executed_pipe_fp32.avg.pct_of_peak_sustained_active",
        "smsp__warp_issue_stalled_memory_dependency_per_warp_active.pct",
    ];

    #[test]
    fn the_cudaforge_set_is_its_24_with_two_substitutes_that_the_h100_offers() {
        let distinct: std::collections::BTreeSet<&str> = CUDAFORGE.iter().copied().collect();
        assert_eq!(distinct.len(), 24);
        assert!(CUDAFORGE.iter().all(|name| valid_metric_name(name)));
        for kept in PUBLISHED_KEPT {
            assert!(distinct.contains(kept), "{kept}");
        }
        for replaced in PUBLISHED_REPLACED {
            assert!(!distinct.contains(replaced), "{replaced}");
        }
        let substitutes: Vec<&str> = CUDAFORGE.iter().copied().filter(|name| !PUBLISHED_KEPT.contains(name)).collect();
        assert_eq!(
            substitutes,
            [
                "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
                "smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct"
            ]
        );

        // What Nsight Compute 2025.3.1 offers on the H100, by base name (before the first `.`: the roll-up and
        // sub-metric are not listed). Launch statistics are not metrics it lists: every raw page carries them.
        let offered =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/h100/query-metrics.csv"))
                .expect("fixture");
        let offered: std::collections::BTreeSet<&str> = offered
            .lines()
            .skip(1)
            .filter_map(|line| line.split(',').next())
            .map(|name| name.trim_matches('"'))
            .collect();
        assert!(offered.len() > 3000, "{}", offered.len());
        for name in CUDAFORGE {
            if name.starts_with("launch__") {
                continue;
            }
            let base = name.split('.').next().expect("a base");
            assert!(offered.contains(base), "{name}: the H100 does not offer {base}");
        }
        for replaced in PUBLISHED_REPLACED {
            let base = replaced.split('.').next().expect("a base");
            assert!(!offered.contains(base), "{base} is offered: no need to replace it");
        }
    }

    #[test]
    fn messages_are_the_profilers_own_lines_newest_last() {
        let log = "==PROF== Connected to process 7\nprogram output\n==WARNING== No kernels were profiled.\n\
                   ==ERROR== The application returned an error code (1).\n\"ID\",\"Kernel Name\"\n";
        assert_eq!(
            messages(log, 2),
            ["==WARNING== No kernels were profiled.", "==ERROR== The application returned an error code (1)."]
        );
        assert_eq!(messages(log, 10).len(), 3);
        assert!(messages("", 3).is_empty());
    }

    #[test]
    fn metric_names_that_could_smuggle_options_are_refused() {
        for bad in ["", "--set=full", "a,b", "dram bytes", ".x", "x.", "DRAM__bytes"] {
            assert!(!valid_metric_name(bad), "{bad}");
        }
        assert!(valid_metric_name("dram__bytes_read.sum"));
    }

    #[test]
    fn the_command_line_filters_on_the_candidates_own_function_names() {
        let ncu = Ncu { program: "/opt/ncu".into(), version: "Version 1".into(), installation: vec![] };
        let argv = ncu.argv(
            &["add_kernel".into(), "k$2".into()],
            7,
            &Metrics::List(vec!["a.sum".into(), "b.sum".into()]),
            false,
            Path::new("/out"),
        );
        let argv: Vec<String> = argv.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        let after = |flag: &str| argv[argv.iter().position(|a| a == flag).expect(flag) + 1].clone();
        assert_eq!(after("--kernel-name"), r"regex:^(add_kernel|k\$2)$");
        assert_eq!(after("--launch-count"), "7");
        assert_eq!(after("--clock-control"), "none");
        assert_eq!(after("--metrics"), "a.sum,b.sum,gpu__time_duration.sum", "the duration is always collected");
        let with_duration = Metrics::List(vec![DURATION.into(), "a.sum".into()]);
        let argv = ncu.argv(&["k".into()], 1, &with_duration, false, Path::new("/out"));
        let metrics = argv.iter().position(|a| a == "--metrics").expect("--metrics") + 1;
        assert_eq!(argv[metrics], "gpu__time_duration.sum,a.sum", "not twice");
        assert_eq!(after("--log-file"), "/out/ncu.csv");
        assert_eq!(after("--profile-from-start"), "off");
    }

    #[test]
    fn a_counter_permission_error_names_what_to_grant() {
        let log = "==PROF== Connected to process 1\n==ERROR== ERR_NVGPUCTRPERM - The user does not have \
                   permission to access NVIDIA GPU Performance Counters on the target device 0.\n";
        match failure(log) {
            Some(Failure::CounterPermission(text)) => assert!(text.contains("NVreg_RestrictProfilingToAdminUsers=0")),
            other => panic!("{other:?}"),
        }
        assert_eq!(failure("==PROF== Disconnected\n"), None);
    }
}
