//! The Profiler service: Nsight Compute metrics of a candidate's own kernels, the device specification and a
//! bottleneck diagnosis. `Profile` ([`profile`]) runs the candidate ([`pipeline`]) on the execution engine
//! (`kforge_execution`: static checks, artifact cache, sandbox and device lanes; in one process with the Evaluator
//! service, the same engine) under Nsight Compute ([`nsight`]), reads the raw page ([`ncu`]) and diagnoses each
//! launch ([`diagnosis`]);
//! `SelectMetrics` ([`selection`]), `GetDeviceSpec` ([`device`], [`spec`]), `StreamReport` and `GetCapabilities`
//! complete it. Every failure is a [`ProfilerError`], given its gRPC code in one place ([`error`]).

pub mod device;
pub mod diagnosis;
pub mod error;
pub mod ncu;
pub mod nsight;
pub mod pipeline;
pub mod profile;
pub mod selection;
pub mod spec;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use kforge_execution::{Engine, ExecutionConfig, ExecutionMetrics};
use kforge_proto::v1 as pb;
use kforge_proto::v1::profiler_server::{Profiler, ProfilerServer};
use kforge_server::{Host, ServeError, ServerConfig, ServiceConfig};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use error::ProfilerError;
use profile::{Profiling, Reports};

/// Metrics each task contributes to a selection when the request does not say (CudaForge's 24).
const DEFAULT_TOP_K: usize = 24;

/// Configuration of the Profiler service (`[profiler]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProfilerConfig {
    pub server: ServerConfig,
    /// The `ncu` program; unset: found on PATH or in /usr/local/cuda/bin.
    pub ncu: Option<PathBuf>,
    /// How long a profiled stage may run, in seconds.
    pub timeout_secs: u64,
    /// Raw reports kept for `StreamReport` (the newest; each is a few MB).
    pub reports_kept: usize,
    /// The engine that compiles and runs candidates, for a profiler on its own. In one process with the Evaluator
    /// service (`kforge up`, `kforge serve`), the `[evaluator]` table's engine keys are used instead: one engine,
    /// one lease per GPU (`Engine::shared`).
    pub execution: ExecutionConfig,
}

impl Default for ProfilerConfig {
    fn default() -> Self {
        Self {
            server: ServerConfig::listening_on(([127, 0, 0, 1], 50052).into()),
            ncu: None,
            timeout_secs: 300,
            reports_kept: 64,
            execution: ExecutionConfig::default(),
        }
    }
}

impl ServiceConfig for ProfilerConfig {
    const SECTION: &'static str = "profiler";
    fn server(&self) -> &ServerConfig {
        &self.server
    }
}

/// Serves the Profiler service on `listener` until `shutdown` completes.
pub async fn serve(
    config: ProfilerConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut host = Host::new("profiler", &config.server)?;
    let limit = host.max_message_bytes();
    let metrics = ExecutionMetrics::register(host.registry());
    let setup = |message: String| ServeError::Setup { service: "profiler", message };
    let engine =
        Engine::shared(config.execution.clone(), metrics).await.map_err(|e| setup(format!("work directory: {e}")))?;
    let reports = Reports::new(config.execution.work_dir.join("profiles"), config.reports_kept.max(1))
        .map_err(|e| setup(format!("report directory: {e}")))?;
    let ncu = tokio::task::spawn_blocking({
        let configured = config.ncu.clone();
        move || nsight::Ncu::locate(configured.as_deref())
    })
    .await
    .map_err(|e| setup(e.to_string()))?;
    match &ncu {
        Ok(ncu) => tracing::info!(program = %ncu.program.display(), version = %ncu.version, "Nsight Compute found"),
        Err(error) => tracing::warn!(%error, "Profile will answer UNAVAILABLE"),
    }
    let profiling = Profiling { engine, ncu, reports, config, specs: Default::default() };
    host.add_service(
        ProfilerServer::new(ProfilerService { profiling: Arc::new(profiling) })
            .max_decoding_message_size(limit)
            .max_encoding_message_size(limit),
    );
    host.serve(listener, shutdown).await
}

/// The `kforge.v1.Profiler` implementation.
#[derive(Debug, Clone)]
pub struct ProfilerService {
    profiling: Arc<Profiling>,
}

/// Bytes per `ReportChunk`.
const CHUNK_BYTES: usize = 1 << 20;

#[tonic::async_trait]
impl Profiler for ProfilerService {
    async fn profile(&self, request: Request<pb::ProfileRequest>) -> Result<Response<pb::ProfileResponse>, Status> {
        self.profiling.profile(request.into_inner()).await.map(Response::new).map_err(Status::from)
    }

    type StreamReportStream = Pin<Box<dyn Stream<Item = Result<pb::ReportChunk, Status>> + Send>>;

    async fn stream_report(
        &self,
        request: Request<pb::StreamReportRequest>,
    ) -> Result<Response<Self::StreamReportStream>, Status> {
        use std::io::Read;
        let id = request.into_inner().report_id;
        let path = self.profiling.reports.path(&id).ok_or_else(|| ProfilerError::NoReport { id: id.clone() })?;
        let mut file = std::fs::File::open(&path).map_err(ProfilerError::ReportOpen)?;
        let (send, receive) = tokio::sync::mpsc::channel(4);
        tokio::task::spawn_blocking(move || {
            loop {
                let mut data = vec![0; CHUNK_BYTES];
                let chunk = match file.read(&mut data) {
                    Ok(0) => return,
                    Ok(n) => {
                        data.truncate(n);
                        Ok(pb::ReportChunk { data })
                    }
                    Err(error) => Err(ProfilerError::ReportRead(error).into()),
                };
                let failed = chunk.is_err();
                if send.blocking_send(chunk).is_err() || failed {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(receive))))
    }

    async fn get_capabilities(
        &self,
        _request: Request<pb::GetProfilerCapabilitiesRequest>,
    ) -> Result<Response<pb::ProfilerCapabilities>, Status> {
        let profiling = &self.profiling;
        let (counters_permitted, counters) = nsight::counters_permitted();
        let engine = profiling.engine.capabilities();
        Ok(Response::new(pb::ProfilerCapabilities {
            ncu_version: profiling.ncu.as_ref().map(|n| n.version.clone()).unwrap_or_default(),
            ncu: match &profiling.ncu {
                Ok(ncu) => ncu.program.display().to_string(),
                Err(error) => error.to_string(),
            },
            counters_permitted,
            counters,
            devices: engine.devices.into_iter().filter(|d| d.starts_with("cuda")).collect(),
            queue_capacity: engine.queue_capacity as u32,
            cudaforge_metrics: nsight::CUDAFORGE.iter().map(|m| (*m).to_owned()).collect(),
        }))
    }

    async fn select_metrics(
        &self,
        request: Request<pb::SelectMetricsRequest>,
    ) -> Result<Response<pb::SelectMetricsResponse>, Status> {
        select_metrics(request.into_inner()).map(Response::new).map_err(Status::from)
    }

    async fn get_device_spec(
        &self,
        request: Request<pb::GetDeviceSpecRequest>,
    ) -> Result<Response<pb::GetDeviceSpecResponse>, Status> {
        device_spec(request.into_inner().device)
            .await
            .map(|spec| Response::new(pb::GetDeviceSpecResponse { spec: Some(spec) }))
            .map_err(Status::from)
    }
}

/// `SelectMetrics`: the request checked, then [`selection::select`].
fn select_metrics(request: pb::SelectMetricsRequest) -> Result<pb::SelectMetricsResponse, ProfilerError> {
    let mut samples = Vec::with_capacity(request.samples.len());
    for (index, sample) in request.samples.into_iter().enumerate() {
        if sample.task.is_empty() {
            return Err(ProfilerError::invalid(format!("samples[{index}].task"), "required"));
        }
        if !(sample.runtime_ms.is_finite() && sample.runtime_ms > 0.0) {
            return Err(ProfilerError::invalid(
                format!("samples[{index}].runtime_ms"),
                format!("must be finite and positive, not {}", sample.runtime_ms),
            ));
        }
        if let Some((name, _)) = sample.metrics.iter().find(|(_, value)| !value.is_finite()) {
            return Err(ProfilerError::invalid(format!("samples[{index}].metrics[{name}]"), "not finite"));
        }
        samples.push(selection::Sample {
            task: sample.task,
            runtime_ms: sample.runtime_ms,
            metrics: sample.metrics.into_iter().collect(),
        });
    }
    let mut per_task = std::collections::HashMap::<&str, usize>::new();
    for sample in &samples {
        *per_task.entry(sample.task.as_str()).or_default() += 1;
    }
    if !per_task.values().any(|count| *count >= selection::MIN_SAMPLES) {
        return Err(ProfilerError::invalid(
            "samples",
            format!("no task has {} or more samples to correlate", selection::MIN_SAMPLES),
        ));
    }
    let top_k = match request.top_k {
        0 => DEFAULT_TOP_K,
        k => k as usize,
    };
    let metrics = selection::select(&samples, top_k)
        .into_iter()
        .map(|s| pb::SelectedMetric { name: s.name, correlation: s.correlation, tasks: s.tasks as u32 })
        .collect();
    Ok(pb::SelectMetricsResponse { metrics })
}

/// `GetDeviceSpec`: device `ordinal` read from the driver.
async fn device_spec(ordinal: u32) -> Result<pb::DeviceSpec, ProfilerError> {
    let spec = tokio::task::spawn_blocking(move || device::read(ordinal)).await.map_err(ProfilerError::DeviceRead)?;
    Ok(spec?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(task: &str, runtime_ms: f64, bytes: f64) -> pb::MetricSample {
        pb::MetricSample { task: task.into(), runtime_ms, metrics: [("dram_bytes".to_owned(), bytes)].into() }
    }

    #[tokio::test]
    async fn the_device_spec_is_read_from_the_driver_or_refused_naming_what_is_missing() {
        match device_spec(0).await {
            Ok(spec) => {
                assert!(spec.sm_count > 0 && spec.peak_memory_bandwidth_gbps > 0.0, "{spec:?}");
            }
            Err(error) => {
                let status = Status::from(error);
                assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
                assert!(status.message().contains("no CUDA driver library (libcuda)"), "{}", status.message());
            }
        }
    }

    #[tokio::test]
    async fn select_metrics_answers_and_bad_samples_are_invalid_arguments_naming_the_field() {
        let samples = vec![sample("t", 1.0, 10.0), sample("t", 2.0, 20.0), sample("t", 4.0, 39.0)];
        let request = pb::SelectMetricsRequest { samples: samples.clone(), top_k: 0 };
        let selected = select_metrics(request).expect("selects");
        assert_eq!(selected.metrics.len(), 1);
        assert_eq!((selected.metrics[0].name.as_str(), selected.metrics[0].tasks), ("dram_bytes", 1));

        let cases = [
            (vec![sample("", 1.0, 1.0)], "samples[0].task"),
            (vec![sample("t", f64::NAN, 1.0)], "samples[0].runtime_ms"),
            (vec![sample("t", 1.0, f64::INFINITY)], "samples[0].metrics[dram_bytes]"),
            (samples[..2].to_vec(), "no task has 3"),
        ];
        for (samples, named) in cases {
            let error = select_metrics(pb::SelectMetricsRequest { samples, top_k: 0 }).expect_err("invalid");
            let status = Status::from(error);
            assert_eq!(status.code(), tonic::Code::InvalidArgument);
            assert!(status.message().contains(named), "{}", status.message());
        }
    }
}
