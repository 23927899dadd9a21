//! The Orchestrator service: jobs and episodes per recipe, calls to the other services, persistence and export.
//! This crate serves the `kforge.v1.Orchestrator` contract; jobs arrive with the orchestrator work, and until then
//! every RPC answers UNIMPLEMENTED.

use std::future::Future;

use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_server::{Orchestrator, OrchestratorServer};
use kforge_server::{Host, ServeError, ServerConfig, ServiceConfig, not_yet_implemented};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};

/// What brings this service's behaviour.
const CAPABILITY: &str = "the orchestrator";

/// Configuration of the Orchestrator service (`[orchestrator]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OrchestratorConfig {
    pub server: ServerConfig,
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        Self { server: ServerConfig::listening_on(([127, 0, 0, 1], 50055).into()) }
    }
}

impl ServiceConfig for OrchestratorConfig {
    const SECTION: &'static str = "orchestrator";
    fn server(&self) -> &ServerConfig {
        &self.server
    }
}

/// Serves the Orchestrator service on `listener` until `shutdown` completes.
pub async fn serve(
    config: OrchestratorConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut host = Host::new("orchestrator", &config.server)?;
    let limit = host.max_message_bytes();
    host.add_service(
        OrchestratorServer::new(OrchestratorService).max_decoding_message_size(limit).max_encoding_message_size(limit),
    );
    host.serve(listener, shutdown).await
}

/// The `kforge.v1.Orchestrator` implementation.
#[derive(Debug, Clone, Copy, Default)]
pub struct OrchestratorService;

#[tonic::async_trait]
impl Orchestrator for OrchestratorService {
    async fn submit_job(&self, _request: Request<pb::SubmitJobRequest>) -> Result<Response<pb::Job>, Status> {
        Err(not_yet_implemented("Orchestrator/SubmitJob", CAPABILITY))
    }

    async fn get_job(&self, _request: Request<pb::GetJobRequest>) -> Result<Response<pb::Job>, Status> {
        Err(not_yet_implemented("Orchestrator/GetJob", CAPABILITY))
    }

    type WatchJobStream = BoxStream<pb::Job>;

    async fn watch_job(&self, _request: Request<pb::GetJobRequest>) -> Result<Response<Self::WatchJobStream>, Status> {
        Err(not_yet_implemented("Orchestrator/WatchJob", CAPABILITY))
    }

    async fn cancel_job(&self, _request: Request<pb::CancelJobRequest>) -> Result<Response<pb::Job>, Status> {
        Err(not_yet_implemented("Orchestrator/CancelJob", CAPABILITY))
    }

    async fn list_trajectories(
        &self,
        _request: Request<pb::ListTrajectoriesRequest>,
    ) -> Result<Response<pb::ListTrajectoriesResponse>, Status> {
        Err(not_yet_implemented("Orchestrator/ListTrajectories", CAPABILITY))
    }

    async fn export_samples(
        &self,
        _request: Request<pb::ExportSamplesRequest>,
    ) -> Result<Response<pb::ExportSamplesResponse>, Status> {
        Err(not_yet_implemented("Orchestrator/ExportSamples", CAPABILITY))
    }

    async fn start_episode(
        &self,
        _request: Request<pb::StartEpisodeRequest>,
    ) -> Result<Response<pb::Observation>, Status> {
        Err(not_yet_implemented("Orchestrator/StartEpisode", CAPABILITY))
    }

    async fn step(&self, _request: Request<pb::StepRequest>) -> Result<Response<pb::Observation>, Status> {
        Err(not_yet_implemented("Orchestrator/Step", CAPABILITY))
    }
}
