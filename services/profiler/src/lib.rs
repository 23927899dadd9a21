//! The Profiler service: Nsight Compute metrics of a candidate's own kernels, the device specification and a
//! bottleneck diagnosis. This crate serves the `kforge.v1.Profiler` contract; profiling arrives with the profiler
//! work, and until then every RPC answers UNIMPLEMENTED.

pub mod diagnosis;
pub mod ncu;

use std::future::Future;

use kforge_proto::v1 as pb;
use kforge_proto::v1::profiler_server::{Profiler, ProfilerServer};
use kforge_server::{Host, ServeError, ServerConfig, ServiceConfig, not_yet_implemented};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

use tonic::{Request, Response, Status};

/// What brings this service's behaviour.
const CAPABILITY: &str = "the profiler";

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
        _request: Request<pb::SelectMetricsRequest>,
    ) -> Result<Response<pb::SelectMetricsResponse>, Status> {
        Err(not_yet_implemented("Profiler/SelectMetrics", CAPABILITY))
    }

    async fn get_device_spec(
        &self,
        _request: Request<pb::GetDeviceSpecRequest>,
    ) -> Result<Response<pb::GetDeviceSpecResponse>, Status> {
        Err(not_yet_implemented("Profiler/GetDeviceSpec", CAPABILITY))
    }
}
