//! The Evaluator service: static checks, sandboxed compile, correctness, hack detection, timing and kernel census
//! of candidate kernels (docs/ARCHITECTURE.md). This crate serves the `kforge.v1.Evaluator` contract; the evaluation
//! pipeline itself arrives with the evaluator core, and until then every RPC answers UNIMPLEMENTED.

pub mod statics;

use std::future::Future;

use kforge_proto::v1 as pb;
use kforge_proto::v1::evaluator_server::{Evaluator, EvaluatorServer};
use kforge_server::{Host, ServeError, ServerConfig, ServiceConfig, not_yet_implemented};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};

/// What brings this service's behaviour.
const CAPABILITY: &str = "the evaluator core";

/// Configuration of the Evaluator service (`[evaluator]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvaluatorConfig {
    pub server: ServerConfig,
}

impl Default for EvaluatorConfig {
    fn default() -> Self {
        Self { server: ServerConfig::listening_on(([127, 0, 0, 1], 50051).into()) }
    }
}

impl ServiceConfig for EvaluatorConfig {
    const SECTION: &'static str = "evaluator";
    fn server(&self) -> &ServerConfig {
        &self.server
    }
}

/// Serves the Evaluator service on `listener` until `shutdown` completes.
pub async fn serve(
    config: EvaluatorConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut host = Host::new("evaluator", &config.server)?;
    let limit = host.max_message_bytes();
    host.add_service(
        EvaluatorServer::new(EvaluatorService).max_decoding_message_size(limit).max_encoding_message_size(limit),
    );
    host.serve(listener, shutdown).await
}

/// The `kforge.v1.Evaluator` implementation.
#[derive(Debug, Clone, Copy, Default)]
pub struct EvaluatorService;

#[tonic::async_trait]
impl Evaluator for EvaluatorService {
    async fn evaluate(&self, _request: Request<pb::EvaluateRequest>) -> Result<Response<pb::EvaluateResponse>, Status> {
        Err(not_yet_implemented("Evaluator/Evaluate", CAPABILITY))
    }

    type EvaluateStreamStream = BoxStream<pb::EvaluateResponse>;

    async fn evaluate_stream(
        &self,
        _request: Request<tonic::Streaming<pb::EvaluateRequest>>,
    ) -> Result<Response<Self::EvaluateStreamStream>, Status> {
        Err(not_yet_implemented("Evaluator/EvaluateStream", CAPABILITY))
    }

    async fn get_capabilities(
        &self,
        _request: Request<pb::GetCapabilitiesRequest>,
    ) -> Result<Response<pb::GetCapabilitiesResponse>, Status> {
        Err(not_yet_implemented("Evaluator/GetCapabilities", CAPABILITY))
    }
}
