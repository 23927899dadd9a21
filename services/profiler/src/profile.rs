//! `Profile`: a candidate run under Nsight Compute on the execution engine ([`pipeline`]: the same static checks,
//! artifact cache, sandbox and device lease as an evaluation), its raw page read into per-launch metrics, each launch
//! diagnosed, and the report kept for `StreamReport`.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kforge_execution::engine::RequestedBackend;
use kforge_execution::{Engine, Notes};
use kforge_execution_proto::{self as execution_proto, Ending};
use kforge_proto::v1 as pb;

use crate::diagnosis::{self, Bottleneck};
use crate::error::ProfilerError;
use crate::nsight::{self, Metrics, Ncu};
use crate::pipeline::{self, Launcher, MeasuredCensus, ProfileRun, Profiled, Ran};
use crate::{ProfilerConfig, device, ncu};

/// A launch's device time, shown with every launch.
const DURATION: &str = "gpu__time_duration.sum";

/// Profiled launches when the request does not say, and at most. Each launch is replayed once per metric pass:
/// with CudaForge's 24 the profiled calls of three launches took 1.6 s (a 0.04 ms kernel) to 2.0 s (a 15 ms one)
/// on the H100, and three give a median that one odd launch does not move
/// (bench/results/profiler-cudaforge/2026-11-26).
pub const DEFAULT_LAUNCHES: u32 = 3;
pub const MAX_LAUNCHES: u32 = 100;

/// What a profile needs beyond the request: the engine, Nsight Compute, where reports are kept.
#[derive(Debug)]
pub struct Profiling {
    pub engine: Engine,
    pub ncu: Result<Ncu, nsight::Unusable>,
    pub reports: Reports,
    pub config: ProfilerConfig,
    /// Each GPU's specification, read once.
    pub specs: tokio::sync::Mutex<std::collections::HashMap<usize, pb::DeviceSpec>>,
}

impl Profiling {
    /// Profiles one request (see the module's documentation).
    pub async fn profile(self: &Arc<Self>, request: pb::ProfileRequest) -> Result<pb::ProfileResponse, ProfilerError> {
        // The caller's mistakes first, then what this host lacks.
        let (metrics, launch_limit) = checked(&request)?;
        let ncu = self.ncu.as_ref().map_err(|unusable| ProfilerError::NcuUnusable(unusable.clone()))?;
        let (permitted, why) = nsight::counters_permitted();
        if !permitted {
            return Err(ProfilerError::CountersClosed { why });
        }
        let dir = self.reports.create().map_err(ProfilerError::ReportDir)?;
        let run = ProfileRun {
            request_id: request.request_id.clone(),
            task: request.task.clone().map(execution_proto::task).unwrap_or_default(),
            candidate: request.candidate_source.clone(),
            backend: requested_backend(request.backend),
            policy: request.policy.clone(),
            priority: request.priority,
            job_id: request.job_id.clone(),
            launch_limit,
            wall: Duration::from_secs(self.config.timeout_secs),
            launcher: launcher(ncu, &metrics, launch_limit, request.lock_clocks, &dir),
        };
        let profiled = pipeline::profile(&self.engine, run).await?;
        let (gpu, own_kernels) = (profiled.ran.gpu, !profiled.ran.own_kernels.is_empty());
        let mut response = response(request.request_id, profiled);
        if let Some(gpu) = gpu {
            response.device = self.spec(gpu).await;
        }
        read_report(response, dir, &metrics, own_kernels)
    }

    /// GPU `gpu`'s specification, read from the driver once.
    async fn spec(&self, gpu: usize) -> Option<pb::DeviceSpec> {
        let mut specs = self.specs.lock().await;
        if let Some(spec) = specs.get(&gpu) {
            return Some(spec.clone());
        }
        let spec = tokio::task::spawn_blocking(move || device::read(gpu as u32)).await.ok()?.ok()?;
        specs.insert(gpu, spec.clone());
        Some(spec)
    }
}

/// The request's metrics and launch limit, checked: INVALID_ARGUMENT naming the field otherwise.
fn checked(request: &pb::ProfileRequest) -> Result<(Metrics, u32), ProfilerError> {
    if request.task.as_ref().is_none_or(|task| task.source.trim().is_empty()) {
        return Err(ProfilerError::invalid("task", "required"));
    }
    if request.candidate_source.trim().is_empty() {
        return Err(ProfilerError::invalid("candidate_source", "required"));
    }
    let metrics = match pb::MetricSet::try_from(request.metric_set) {
        Ok(pb::MetricSet::Unspecified | pb::MetricSet::Cudaforge) => {
            Metrics::List(nsight::CUDAFORGE.iter().map(|m| (*m).to_owned()).collect())
        }
        Ok(pb::MetricSet::Full) => Metrics::Full,
        Ok(pb::MetricSet::List) => {
            if request.metrics.is_empty() {
                return Err(ProfilerError::invalid("metrics", "required with METRIC_SET_LIST"));
            }
            if let Some(bad) = request.metrics.iter().find(|m| !nsight::valid_metric_name(m)) {
                return Err(ProfilerError::invalid("metrics", format!("`{bad}` is not a metric name")));
            }
            Metrics::List(request.metrics.clone())
        }
        Err(_) => {
            return Err(ProfilerError::invalid("metric_set", format!("unknown value {}", request.metric_set)));
        }
    };
    if request.metric_set != pb::MetricSet::List as i32 && !request.metrics.is_empty() {
        return Err(ProfilerError::invalid("metrics", "only with METRIC_SET_LIST"));
    }
    let launch_limit = match request.launch_limit {
        0 => DEFAULT_LAUNCHES,
        n if n > MAX_LAUNCHES => {
            return Err(ProfilerError::invalid("launch_limit", format!("{n} is over the limit of {MAX_LAUNCHES}")));
        }
        n => n,
    };
    Ok((metrics, launch_limit))
}

/// Nsight Compute as the profiled stage's launcher, writing into the profile's directory `dir`.
fn launcher(ncu: &Ncu, metrics: &Metrics, launch_limit: u32, lock_clocks: bool, dir: &ReportDir) -> Launcher {
    let argv = {
        let (ncu, metrics, path) = (ncu.clone(), metrics.clone(), dir.path.clone());
        Arc::new(move |own: &[String]| ncu.argv(own, launch_limit, &metrics, lock_clocks, &path))
    };
    Launcher {
        argv,
        readable: ncu.installation.clone(),
        // CUDA names its threads through /proc/self/task/*/comm. The sandbox grants a job its own /proc/<pid>,
        // but under Nsight Compute the interpreter is the job's child, which only a rule on /proc covers
        // (without it: CUDA error 304 at initialisation, measured on the H100 machine).
        // docs/threat_model/KNOWN_LIMITS.md.
        writable: vec![dir.path.clone(), PathBuf::from("/proc")],
        // Nsight Compute writes its settings under HOME and a lock under TMPDIR.
        env: vec![("HOME".into(), dir.path.join("home").into()), ("TMPDIR".into(), dir.path.join("tmp").into())],
    }
}

/// The response, completed from what Nsight Compute wrote into `dir` for the run (`response`, its census in): the
/// profiled launches with their metrics (`missing_metrics`: those asked for and not reported) and diagnoses, and
/// the report kept. A candidate with no kernel of its own has nothing to profile (`own_kernels`); a failure of the
/// profiler itself is an infrastructure error; a failing candidate's error gets the profiler's own lines.
fn read_report(
    mut response: pb::ProfileResponse,
    dir: ReportDir,
    metrics: &Metrics,
    own_kernels: bool,
) -> Result<pb::ProfileResponse, ProfilerError> {
    let correct = response.verdict == pb::Verdict::Correct as i32;
    if !own_kernels && correct {
        response.diagnosis = Some(pb::Diagnosis {
            bottleneck: pb::Bottleneck::Undetermined as i32,
            summary: "The candidate has no kernel of its own (its build compiled no CUDA kernel and its run made no \
                      Triton kernel): there is nothing of its own to profile. The census shows what ran."
                .into(),
            ..Default::default()
        });
        return Ok(response);
    }
    let log = std::fs::read_to_string(dir.path.join(nsight::LOG)).unwrap_or_default();
    match nsight::failure(&log) {
        Some(nsight::Failure::CounterPermission(text)) => return Err(ProfilerError::CountersRefused(text)),
        Some(nsight::Failure::Profiler(text)) if correct => {
            response.verdict = pb::Verdict::InfraError as i32;
            response.error = format!("Nsight Compute: {text}");
            return Ok(response);
        }
        _ => {}
    }
    if !correct {
        // Under the profiler a failure may be the profiler's report of the program: show its own lines.
        let said = nsight::messages(&log, 8);
        if !said.is_empty() {
            response.error = format!("{}\nNsight Compute: {}", response.error, said.join("\n")).trim().to_owned();
        }
        return Ok(response);
    }
    let launches = match ncu::parse_raw(&log) {
        Ok(launches) => launches,
        Err(ncu::ParseError::NoHeader) => vec![],
        Err(error) => {
            response.verdict = pb::Verdict::InfraError as i32;
            response.error = format!("reading Nsight Compute's output: {error}");
            return Ok(response);
        }
    };
    let asked = match metrics {
        Metrics::List(names) => names.clone(),
        Metrics::Full => vec![],
    };
    let reported: BTreeSet<&str> = launches.iter().flat_map(|l| l.metrics.keys().map(String::as_str)).collect();
    response.missing_metrics = if launches.is_empty() { vec![] } else { nsight::missing(&asked, &reported) };
    fill(&mut response, &launches, &asked);
    if dir.path.join(nsight::REPORT).is_file() {
        response.report_id = dir.id.clone();
        dir.keep();
    }
    Ok(response)
}

/// The response to a profile run, from what its stages reported and how it ended; the launches, the diagnosis,
/// the device and the report are the caller's to add.
fn response(request_id: String, profiled: Profiled) -> pb::ProfileResponse {
    let Profiled { end, ran } = profiled;
    let Ran { notes, gpu: _, census_reused, census, own_kernels: _ } = ran;
    let Notes { times, findings, compile_cache_hit: _ } = notes;
    let Ending { verdict, findings, error, compile_log, retryable } = execution_proto::ending(end, findings);
    let MeasuredCensus { kernels, profiling_ratio } = census.unwrap_or_default();
    pb::ProfileResponse {
        kernels: vec![],
        diagnosis: None,
        device: None,
        request_id,
        verdict: verdict.into(),
        findings,
        compile_log,
        error,
        census: kernels.into_iter().map(execution_proto::kernel).collect(),
        profiling_ratio,
        report_id: String::new(),
        stage_ms: times.wire().collect(),
        retryable,
        missing_metrics: vec![],
        census_reused,
    }
}

/// A request's `backend`; unlike the evaluator, the profiler reads a value the contract does not define as asking
/// for none in particular.
fn requested_backend(value: i32) -> RequestedBackend {
    match execution_proto::requested_backend(value) {
        RequestedBackend::Unknown(_) => RequestedBackend::Any,
        requested => requested,
    }
}

/// The profiled launches into `response`, each with its diagnosis, and the dominant kernel's diagnosis: the
/// census's own kernel with the most device time, else the longest launch. A launch shows the metrics asked for
/// (`asked`; all of them for the full set, which asks by section): Nsight Compute's raw page also carries some 280
/// device attributes and launch statistics of every launch, which the diagnosis reads but a model need not.
fn fill(response: &mut pb::ProfileResponse, launches: &[ncu::Launch], asked: &[String]) {
    let shown = |name: &str| asked.is_empty() || name == DURATION || asked.iter().any(|a| a == name);
    let mut seen = std::collections::HashMap::<&str, u32>::new();
    for launch in launches {
        let index = seen.entry(launch.kernel.as_str()).or_default();
        let diagnosis = diagnosis_proto(launch, &diagnosis::diagnose(launch));
        response.kernels.push(pb::KernelProfile {
            name: launch.kernel.clone(),
            launch: *index,
            duration_ms: launch.value(DURATION).map_or(0.0, |ns| ns / 1e6),
            metrics: launch
                .metrics
                .iter()
                .filter(|(name, _)| shown(name))
                .map(|(name, m)| pb::MetricValue { name: name.clone(), value: m.value, unit: m.unit.clone() })
                .collect(),
            diagnosis: Some(diagnosis),
            grid: launch.grid_size.clone(),
            block: launch.block_size.clone(),
        });
        *index += 1;
    }
    let dominant_census = response
        .census
        .iter()
        .filter(|k| k.own)
        .max_by(|a, b| a.total_ms.total_cmp(&b.total_ms))
        .map(|k| k.name.split('(').next().unwrap_or(&k.name).trim().to_owned());
    let dominant = dominant_census
        .and_then(|name| response.kernels.iter().find(|k| short(&k.name) == short(&name)))
        .or_else(|| response.kernels.iter().max_by(|a, b| a.duration_ms.total_cmp(&b.duration_ms)));
    response.diagnosis = dominant.and_then(|k| k.diagnosis.clone());
}

/// A kernel's function name: no parameter list, no template arguments, no return type or namespace.
fn short(name: &str) -> &str {
    let name = name.split('(').next().unwrap_or(name);
    let name = name.split('<').next().unwrap_or(name).trim();
    let name = name.rsplit(' ').next().unwrap_or(name);
    name.rsplit("::").next().unwrap_or(name)
}

/// A diagnosis as the contract carries it.
pub fn diagnosis_proto(launch: &ncu::Launch, diagnosis: &diagnosis::Diagnosis) -> pb::Diagnosis {
    let unit = |name: &str| launch.metrics.get(name).map(|m| m.unit.clone()).unwrap_or_default();
    pb::Diagnosis {
        bottleneck: match diagnosis.bottleneck {
            Bottleneck::Memory => pb::Bottleneck::Memory,
            Bottleneck::Compute => pb::Bottleneck::Compute,
            Bottleneck::Latency => pb::Bottleneck::Latency,
            Bottleneck::Occupancy => pb::Bottleneck::Occupancy,
            Bottleneck::Undetermined => pb::Bottleneck::Undetermined,
        } as i32,
        top_stalls: diagnosis
            .evidence
            .iter()
            .filter_map(|(name, _)| diagnosis::stall_reason(name).map(str::to_owned))
            .collect(),
        summary: diagnosis.text.clone(),
        evidence: diagnosis
            .evidence
            .iter()
            .map(|(name, value)| pb::MetricValue { name: name.clone(), value: *value, unit: unit(name) })
            .collect(),
        kernel: launch.kernel.clone(),
    }
}

/// Where reports are kept: one directory per profile under `root`, the newest `kept` of them.
#[derive(Debug)]
pub struct Reports {
    root: PathBuf,
    kept: usize,
}

/// A profile's directory: removed when dropped unless kept.
#[derive(Debug)]
pub struct ReportDir {
    pub id: String,
    pub path: PathBuf,
    keep: bool,
}

impl ReportDir {
    fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for ReportDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

impl Reports {
    pub fn new(root: PathBuf, kept: usize) -> std::io::Result<Self> {
        std::fs::create_dir_all(&root)?;
        Ok(Self { root, kept })
    }

    /// A new directory, writable by the sandbox's command users (Nsight Compute runs as one), with `home` and `tmp`.
    fn create(&self) -> std::io::Result<ReportDir> {
        use std::os::unix::fs::PermissionsExt;
        self.evict();
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let serial = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("{:016x}{serial:08x}", stamp.as_nanos() as u64);
        let path = self.root.join(&id);
        for dir in [path.clone(), path.join("home"), path.join("tmp")] {
            std::fs::create_dir_all(&dir)?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
        }
        Ok(ReportDir { id, path, keep: false })
    }

    /// Removes all but the newest `kept - 1` reports (room for one more).
    fn evict(&self) {
        let Ok(entries) = std::fs::read_dir(&self.root) else { return };
        let mut dirs: Vec<(std::time::SystemTime, PathBuf)> = entries
            .filter_map(Result::ok)
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        dirs.sort();
        let excess = dirs.len().saturating_sub(self.kept.saturating_sub(1));
        for (_, dir) in dirs.into_iter().take(excess) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// The report with `id`, if it is still kept.
    pub fn path(&self, id: &str) -> Option<PathBuf> {
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let path = self.root.join(id).join(nsight::REPORT);
        path.is_file().then_some(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_compare_by_function_name() {
        assert_eq!(short("void vectorized_elementwise_kernel<4, F>(int, T2)"), "vectorized_elementwise_kernel");
        assert_eq!(short("add_kernel"), "add_kernel");
        assert_eq!(short("ns::fused_relu(float const*, float*, int)"), "fused_relu");
    }

    #[test]
    fn the_dominant_kernel_is_the_census_own_kernel_with_the_most_time() {
        let raw = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/h100/memory.full.csv"))
            .expect("fixture");
        let launches = ncu::parse_raw(&raw).expect("parsed");
        let mut response = pb::ProfileResponse {
            census: vec![pb::KernelRecord {
                name: format!("{}(float, float const*, float*, long)", launches[0].short_name()),
                own: true,
                launches: 2,
                total_ms: 3.0,
                mode: "train/no_grad".into(),
            }],
            ..Default::default()
        };
        let asked = vec!["sm__throughput.avg.pct_of_peak_sustained_elapsed".to_owned()];
        fill(&mut response, &launches, &asked);
        assert_eq!(response.kernels.len(), launches.len());
        let shown: Vec<&str> = response.kernels[0].metrics.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(shown, [DURATION, "sm__throughput.avg.pct_of_peak_sustained_elapsed"], "only what was asked");
        assert_eq!(response.kernels[1].launch, 1);
        let diagnosis = response.diagnosis.expect("a diagnosis");
        assert_eq!(diagnosis.bottleneck, pb::Bottleneck::Memory as i32);
        assert!(diagnosis.evidence.len() >= 3, "{diagnosis:?}");
        assert!(diagnosis.evidence.iter().all(|m| m.unit == "%"), "{diagnosis:?}");
        assert!(response.kernels[0].metrics.iter().any(|m| m.name == "gpu__time_duration.sum" && m.unit == "ns"));
    }
}
