//! The Reward service: [`kforge_reward_core`]'s math behind the `kforge.v1.Reward` contract.
//!
//! Each handler converts the request to domain types (failing with INVALID_ARGUMENT that names the field), runs
//! the pure function on the blocking pool (a million-sample batch is CPU work the async workers should not hold),
//! and converts the result back. Nothing here decides a number; `kforge-reward-core` does. Verdicts are read with
//! `kforge-reward-proto`'s mapping, the one the orchestrator's job metrics use.

mod convert;

use std::future::Future;

use kforge_proto::v1 as pb;
use kforge_proto::v1::reward_server::{Reward, RewardServer};
use kforge_reward_core::InvalidInput;
use kforge_server::{Host, ServeError, ServerConfig, ServiceConfig};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

/// Configuration of the Reward service (`[reward]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardConfig {
    pub server: ServerConfig,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self { server: ServerConfig::listening_on(([127, 0, 0, 1], 50053).into()) }
    }
}

impl ServiceConfig for RewardConfig {
    const SECTION: &'static str = "reward";
    fn server(&self) -> &ServerConfig {
        &self.server
    }
}

/// Serves the Reward service on `listener` until `shutdown` completes.
pub async fn serve(
    config: RewardConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut host = Host::new("reward", &config.server)?;
    let limit = host.max_message_bytes();
    host.add_service(
        RewardServer::new(RewardService).max_decoding_message_size(limit).max_encoding_message_size(limit),
    );
    host.serve(listener, shutdown).await
}

/// What can go wrong in a Reward call.
#[derive(Debug, thiserror::Error)]
enum RewardError {
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    #[error("reward computation did not finish: {0}")]
    Worker(#[from] tokio::task::JoinError),
}

impl From<RewardError> for Status {
    fn from(error: RewardError) -> Self {
        match error {
            RewardError::Invalid(invalid) => Status::invalid_argument(invalid.to_string()),
            RewardError::Worker(_) => Status::internal(error.to_string()),
        }
    }
}

/// Runs `work` on the blocking pool.
async fn compute<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, InvalidInput> + Send + 'static,
) -> Result<Response<T>, Status> {
    let result = tokio::task::spawn_blocking(work).await.map_err(RewardError::from)?;
    Ok(Response::new(result.map_err(RewardError::from)?))
}

/// The `kforge.v1.Reward` implementation; stateless.
#[derive(Debug, Clone, Copy, Default)]
pub struct RewardService;

#[tonic::async_trait]
impl Reward for RewardService {
    async fn score_kernels(
        &self,
        request: Request<pb::ScoreKernelsRequest>,
    ) -> Result<Response<pb::ScoreKernelsResponse>, Status> {
        let request = request.into_inner();
        compute(move || convert::score_kernels(request)).await
    }

    async fn compute_returns(
        &self,
        request: Request<pb::ComputeReturnsRequest>,
    ) -> Result<Response<pb::ComputeReturnsResponse>, Status> {
        let request = request.into_inner();
        compute(move || convert::compute_returns(request)).await
    }

    async fn compute_advantages(
        &self,
        request: Request<pb::ComputeAdvantagesRequest>,
    ) -> Result<Response<pb::ComputeAdvantagesResponse>, Status> {
        let request = request.into_inner();
        compute(move || convert::compute_advantages(request)).await
    }

    async fn rejection_sample(
        &self,
        request: Request<pb::RejectionSampleRequest>,
    ) -> Result<Response<pb::RejectionSampleResponse>, Status> {
        let request = request.into_inner();
        compute(move || convert::rejection_sample(request)).await
    }

    async fn diagnose(&self, request: Request<pb::DiagnoseRequest>) -> Result<Response<pb::DiagnoseResponse>, Status> {
        let request = request.into_inner();
        compute(move || convert::diagnose(request)).await
    }
}
