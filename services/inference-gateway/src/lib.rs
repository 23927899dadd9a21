//! The inference gateway: one gRPC front to many OpenAI-compatible backends (and replay files), with routing,
//! affinity, retries, token ids, log-probabilities and cost. This crate serves the `kforge.v1.Gateway` contract;
//! routing arrives with the gateway work, and until then every RPC answers UNIMPLEMENTED.

use std::future::Future;

use kforge_proto::v1 as pb;
use kforge_proto::v1::gateway_server::{Gateway, GatewayServer};
use kforge_server::{Host, ServeError, ServerConfig, ServiceConfig, not_yet_implemented};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};

/// What brings this service's behaviour.
const CAPABILITY: &str = "the inference gateway";

/// Configuration of the Gateway service (`[gateway]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    pub server: ServerConfig,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self { server: ServerConfig::listening_on(([127, 0, 0, 1], 50054).into()) }
    }
}

impl ServiceConfig for GatewayConfig {
    const SECTION: &'static str = "gateway";
    fn server(&self) -> &ServerConfig {
        &self.server
    }
}

/// Serves the Gateway service on `listener` until `shutdown` completes.
pub async fn serve(
    config: GatewayConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut host = Host::new("gateway", &config.server)?;
    let limit = host.max_message_bytes();
    host.add_service(
        GatewayServer::new(GatewayService).max_decoding_message_size(limit).max_encoding_message_size(limit),
    );
    host.serve(listener, shutdown).await
}

/// The `kforge.v1.Gateway` implementation.
#[derive(Debug, Clone, Copy, Default)]
pub struct GatewayService;

#[tonic::async_trait]
impl Gateway for GatewayService {
    async fn generate(&self, _request: Request<pb::GenerateRequest>) -> Result<Response<pb::GenerateResponse>, Status> {
        Err(not_yet_implemented("Gateway/Generate", CAPABILITY))
    }

    type GenerateStreamStream = BoxStream<pb::GenerateStreamResponse>;

    async fn generate_stream(
        &self,
        _request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStreamStream>, Status> {
        Err(not_yet_implemented("Gateway/GenerateStream", CAPABILITY))
    }

    async fn list_models(
        &self,
        _request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        Err(not_yet_implemented("Gateway/ListModels", CAPABILITY))
    }

    async fn control_backends(
        &self,
        _request: Request<pb::ControlBackendsRequest>,
    ) -> Result<Response<pb::ControlBackendsResponse>, Status> {
        Err(not_yet_implemented("Gateway/ControlBackends", CAPABILITY))
    }
}
