//! The Evaluator service: static checks, sandboxed compile, correctness, hack detection and timing of candidate
//! kernels against KernelBench-format tasks, on the `cpu`, `cuda` and `triton` backends.
//!
//! [`pipeline`] holds the stages; this module is the gRPC face: validation errors and a full queue become statuses,
//! everything else a verdict; a dropped request (client gone, deadline passed) cancels its evaluation and kills
//! its child processes.

pub mod bindings_pch;
pub mod cache;
pub mod census;
pub mod config;
pub mod devices;
pub mod metrics;
pub mod pipeline;
pub mod python;
pub mod statics;
pub mod stats;
pub mod tasks;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};

use kforge_proto::v1 as pb;
use kforge_proto::v1::evaluator_server::{Evaluator as EvaluatorRpc, EvaluatorServer};
use kforge_server::{Host, ServeError};
use tokio::net::TcpListener;
use tokio::sync::OnceCell;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};

pub use config::EvaluatorConfig;
pub use metrics::EvaluatorMetrics;
pub use pipeline::{Evaluator, RequestError};

impl From<RequestError> for Status {
    fn from(error: RequestError) -> Self {
        match &error {
            RequestError::Invalid { .. } => Status::invalid_argument(error.to_string()),
            RequestError::QueueFull { retry_after_secs, .. } => {
                let mut status = Status::resource_exhausted(error.to_string());
                if let Ok(value) = (retry_after_secs * 1000).to_string().parse() {
                    status.metadata_mut().insert("retry-after-ms", value);
                }
                status
            }
            RequestError::Unavailable(_) => Status::unavailable(error.to_string()),
        }
    }
}

/// Serves the Evaluator service on `listener` until `shutdown` completes.
pub async fn serve(
    config: EvaluatorConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut host = Host::new("evaluator", &config.server)?;
    let metrics = EvaluatorMetrics::register(host.registry());
    let evaluator = Evaluator::new(config, metrics)
        .await
        .map_err(|e| ServeError::Setup { service: "evaluator", message: format!("work directory: {e}") })?;
    host.follow_readiness(evaluator.readiness());
    let limit = host.max_message_bytes();
    host.add_service(
        EvaluatorServer::new(EvaluatorService::new(evaluator))
            .max_decoding_message_size(limit)
            .max_encoding_message_size(limit),
    );
    host.serve(listener, shutdown).await
}

/// Requests remembered for idempotency.
const IDEMPOTENCY_ENTRIES: usize = 4096;

type Shared = Arc<OnceCell<Result<pb::EvaluateResponse, Status>>>;

/// Recent idempotency keys: key -> (request fingerprint, the first call's result), oldest first in `order`.
#[derive(Debug, Default)]
struct Remembered {
    entries: HashMap<String, (String, Shared)>,
    order: VecDeque<String>,
}

/// The `kforge.v1.Evaluator` implementation.
#[derive(Debug, Clone)]
pub struct EvaluatorService {
    evaluator: Evaluator,
    idempotent: Arc<Mutex<Remembered>>,
}

impl EvaluatorService {
    pub fn new(evaluator: Evaluator) -> Self {
        Self { evaluator, idempotent: Arc::default() }
    }

    /// Evaluates, or returns the result of the first request with the same idempotency key and content.
    async fn evaluate_once(&self, request: pb::EvaluateRequest) -> Result<pb::EvaluateResponse, Status> {
        if request.idempotency_key.is_empty() {
            return Ok(self.evaluator.evaluate(request).await?);
        }
        let fingerprint = {
            let mut keyless = request.clone();
            keyless.idempotency_key.clear();
            keyless.request_id.clear();
            cache::key(&[&prost::Message::encode_to_vec(&keyless)])
        };
        let shared = {
            let mut guard = self.idempotent.lock().expect("idempotency map lock is never poisoned");
            let Remembered { entries, order } = &mut *guard;
            match entries.get(&request.idempotency_key) {
                Some((seen, _)) if *seen != fingerprint => {
                    return Err(Status::invalid_argument("idempotency_key: already used for a different request"));
                }
                Some((_, shared)) => shared.clone(),
                None => {
                    if order.len() >= IDEMPOTENCY_ENTRIES
                        && let Some(oldest) = order.pop_front()
                    {
                        entries.remove(&oldest);
                    }
                    let shared = Shared::default();
                    entries.insert(request.idempotency_key.clone(), (fingerprint, shared.clone()));
                    order.push_back(request.idempotency_key.clone());
                    shared
                }
            }
        };
        let request_id = request.request_id.clone();
        let result =
            shared.get_or_init(|| async { self.evaluator.evaluate(request).await.map_err(Status::from) }).await;
        result.clone().map(|mut response| {
            response.request_id = request_id;
            response
        })
    }
}

#[tonic::async_trait]
impl EvaluatorRpc for EvaluatorService {
    async fn evaluate(&self, request: Request<pb::EvaluateRequest>) -> Result<Response<pb::EvaluateResponse>, Status> {
        Ok(Response::new(self.evaluate_once(request.into_inner()).await?))
    }

    type EvaluateStreamStream = BoxStream<pb::EvaluateResponse>;

    async fn evaluate_stream(
        &self,
        request: Request<tonic::Streaming<pb::EvaluateRequest>>,
    ) -> Result<Response<Self::EvaluateStreamStream>, Status> {
        let mut incoming = request.into_inner();
        let (sender, receiver) = tokio::sync::mpsc::channel::<Result<pb::EvaluateResponse, Status>>(64);
        let service = self.clone();
        // Owns every evaluation of the stream; when the client goes away the sender closes and they are all
        // dropped, which kills their children.
        tokio::spawn(async move {
            let mut running = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    message = incoming.message() => match message {
                        Ok(Some(request)) => {
                            let (service, sender) = (service.clone(), sender.clone());
                            running.spawn(async move {
                                let request_id = request.request_id.clone();
                                let response = if request_id.is_empty() {
                                    Err(Status::invalid_argument("request_id: required in EvaluateStream"))
                                } else {
                                    service.evaluate_once(request).await
                                };
                                let item = response.unwrap_or_else(|status| pb::EvaluateResponse {
                                    request_id,
                                    request_error: format!("{}: {}", kforge_server::code_name(status.code()), status.message()),
                                    ..Default::default()
                                });
                                let _ = sender.send(Ok(item)).await;
                            });
                        }
                        Ok(None) | Err(_) => break,
                    },
                    () = sender.closed() => return,
                }
            }
            tokio::select! {
                () = async { while running.join_next().await.is_some() {} } => {}
                () = sender.closed() => {}
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(receiver))))
    }

    async fn get_capabilities(
        &self,
        _request: Request<pb::GetCapabilitiesRequest>,
    ) -> Result<Response<pb::GetCapabilitiesResponse>, Status> {
        Ok(Response::new(self.evaluator.capabilities()))
    }
}
