//! The Profiler service: Nsight Compute metrics of a candidate's own kernels, the device specification and a
//! bottleneck diagnosis. Built: reading Nsight Compute's raw page ([`ncu`]), the diagnosis of a launch
//! ([`diagnosis`]), `SelectMetrics` ([`selection`]) and `GetDeviceSpec` ([`device`], [`spec`]). `Profile` answers
//! UNIMPLEMENTED until the profiler runs candidates under Nsight Compute.

pub mod device;
pub mod diagnosis;
pub mod ncu;
pub mod selection;
pub mod spec;

use std::future::Future;

use kforge_proto::v1 as pb;
use kforge_proto::v1::profiler_server::{Profiler, ProfilerServer};
use kforge_server::{Host, ServeError, ServerConfig, ServiceConfig, not_yet_implemented};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

use tonic::{Request, Response, Status};

/// What brings this service's behaviour.
const CAPABILITY: &str = "the profiler";

/// Metrics each task contributes to a selection when the request does not say (CudaForge's 24).
const DEFAULT_TOP_K: usize = 24;

/// Configuration of the Profiler service (`[profiler]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProfilerConfig {
    pub server: ServerConfig,
}

impl Default for ProfilerConfig {
    fn default() -> Self {
        Self { server: ServerConfig::listening_on(([127, 0, 0, 1], 50052).into()) }
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
    host.add_service(
        ProfilerServer::new(ProfilerService).max_decoding_message_size(limit).max_encoding_message_size(limit),
    );
    host.serve(listener, shutdown).await
}

/// The `kforge.v1.Profiler` implementation.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProfilerService;

#[tonic::async_trait]
impl Profiler for ProfilerService {
    async fn profile(&self, _request: Request<pb::ProfileRequest>) -> Result<Response<pb::ProfileResponse>, Status> {
        Err(not_yet_implemented("Profiler/Profile", CAPABILITY))
    }

    async fn select_metrics(
        &self,
        request: Request<pb::SelectMetricsRequest>,
    ) -> Result<Response<pb::SelectMetricsResponse>, Status> {
        let request = request.into_inner();
        let mut samples = Vec::with_capacity(request.samples.len());
        for (index, sample) in request.samples.into_iter().enumerate() {
            if sample.task.is_empty() {
                return Err(Status::invalid_argument(format!("samples[{index}].task is required")));
            }
            if !(sample.runtime_ms.is_finite() && sample.runtime_ms > 0.0) {
                return Err(Status::invalid_argument(format!(
                    "samples[{index}].runtime_ms must be finite and positive, not {}",
                    sample.runtime_ms
                )));
            }
            if let Some((name, _)) = sample.metrics.iter().find(|(_, value)| !value.is_finite()) {
                return Err(Status::invalid_argument(format!("samples[{index}].metrics[{name}] is not finite")));
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
            return Err(Status::invalid_argument(format!(
                "samples: no task has {} or more samples to correlate",
                selection::MIN_SAMPLES
            )));
        }
        let top_k = match request.top_k {
            0 => DEFAULT_TOP_K,
            k => k as usize,
        };
        let metrics = selection::select(&samples, top_k)
            .into_iter()
            .map(|s| pb::SelectedMetric { name: s.name, correlation: s.correlation, tasks: s.tasks as u32 })
            .collect();
        Ok(Response::new(pb::SelectMetricsResponse { metrics }))
    }

    async fn get_device_spec(
        &self,
        request: Request<pb::GetDeviceSpecRequest>,
    ) -> Result<Response<pb::GetDeviceSpecResponse>, Status> {
        let ordinal = request.into_inner().device;
        let spec = tokio::task::spawn_blocking(move || device::read(ordinal))
            .await
            .map_err(|error| Status::internal(format!("reading the device: {error}")))?;
        match spec {
            Ok(spec) => Ok(Response::new(pb::GetDeviceSpecResponse { spec: Some(spec) })),
            Err(error @ device::DeviceError::NoDriver) => Err(Status::failed_precondition(error.to_string())),
            Err(error @ device::DeviceError::Driver { .. }) => Err(Status::invalid_argument(error.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(task: &str, runtime_ms: f64, bytes: f64) -> pb::MetricSample {
        pb::MetricSample { task: task.into(), runtime_ms, metrics: [("dram_bytes".to_owned(), bytes)].into() }
    }

    #[tokio::test]
    async fn the_device_spec_is_read_from_the_driver_or_refused_naming_what_is_missing() {
        let answer = ProfilerService.get_device_spec(Request::new(pb::GetDeviceSpecRequest { device: 0 })).await;
        match answer {
            Ok(response) => {
                let spec = response.into_inner().spec.expect("a spec");
                assert!(spec.sm_count > 0 && spec.peak_memory_bandwidth_gbps > 0.0, "{spec:?}");
            }
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
                assert!(status.message().contains("no CUDA driver library (libcuda)"), "{}", status.message());
            }
        }
    }

    #[tokio::test]
    async fn select_metrics_answers_and_bad_samples_are_invalid_arguments_naming_the_field() {
        let service = ProfilerService;
        let samples = vec![sample("t", 1.0, 10.0), sample("t", 2.0, 20.0), sample("t", 4.0, 39.0)];
        let request = pb::SelectMetricsRequest { samples: samples.clone(), top_k: 0 };
        let selected = service.select_metrics(Request::new(request)).await.expect("selects").into_inner();
        assert_eq!(selected.metrics.len(), 1);
        assert_eq!((selected.metrics[0].name.as_str(), selected.metrics[0].tasks), ("dram_bytes", 1));

        let cases = [
            (vec![sample("", 1.0, 1.0)], "samples[0].task"),
            (vec![sample("t", f64::NAN, 1.0)], "samples[0].runtime_ms"),
            (vec![sample("t", 1.0, f64::INFINITY)], "samples[0].metrics[dram_bytes]"),
            (samples[..2].to_vec(), "no task has 3"),
        ];
        for (samples, named) in cases {
            let status = service.select_metrics(Request::new(pb::SelectMetricsRequest { samples, top_k: 0 })).await;
            let status = status.expect_err("invalid");
            assert_eq!(status.code(), tonic::Code::InvalidArgument);
            assert!(status.message().contains(named), "{}", status.message());
        }
    }
}
