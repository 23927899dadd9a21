//! The Evaluator service: static checks, sandboxed compile, correctness, hack detection and timing of candidate
//! kernels against KernelBench-format tasks, on the `cpu`, `cuda` and `triton` backends.
//!
//! [`pipeline`] holds the stages, on the shared execution engine (`kforge_execution`); this module is the gRPC face:
//! validation errors and a full queue become statuses (`kforge_execution_proto::status`, as the profiler answers
//! them), everything else a verdict, its response built once (`pipeline/response.rs`); a dropped request (client gone, deadline
//! passed) cancels its evaluation and kills its child processes.

pub mod config;
pub mod metrics;
pub mod pipeline;
pub mod stats;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};

use kforge_execution::cache;
use kforge_proto::v1 as pb;
use kforge_proto::v1::evaluator_server::{Evaluator as EvaluatorRpc, EvaluatorServer};
use kforge_server::{Host, ServeError};
use tokio::net::TcpListener;
use tokio::sync::OnceCell;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};

pub use config::EvaluatorConfig;
pub use kforge_execution::RequestError;
pub use metrics::EvaluatorMetrics;
pub use pipeline::Evaluator;

/// Serves the Evaluator service on `listener` until `shutdown` completes.
pub async fn serve(
    config: EvaluatorConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut host = Host::new("evaluator", &config.server)?;
    let metrics = EvaluatorMetrics::register(host.registry());
    let evaluator = Evaluator::shared(config, metrics)
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

/// Whether `result` is final, so kept for its idempotency key and replayed to every later request with that key: any
/// verdict but a retryable `VERDICT_INFRA_ERROR`. A status (the request was refused: a full queue, an invalid field,
/// no backend) and a retryable infra error are not final: a retry with the same key evaluates afresh.
fn is_final(result: &Result<pb::EvaluateResponse, Status>) -> bool {
    match result {
        Ok(response) => !(response.verdict == pb::Verdict::InfraError as i32 && response.retryable),
        Err(_) => false,
    }
}

/// Recent idempotency keys: key -> (request fingerprint, the evaluation of the key's request, in flight or final),
/// oldest first in `order`; both hold the same keys.
#[derive(Debug, Default)]
struct Remembered {
    entries: HashMap<String, (String, Shared)>,
    order: VecDeque<String>,
}

impl Remembered {
    /// The evaluation to share for `key`: the one in flight or final, or a new one. A key already used for another
    /// fingerprint is INVALID_ARGUMENT. A non-final result still held (its caller is about to forget it) is not
    /// shared: the key gets a new evaluation.
    fn claim(&mut self, key: &str, fingerprint: String) -> Result<Shared, Status> {
        if let Some((seen, shared)) = self.entries.get(key)
            && shared.get().is_none_or(is_final)
        {
            if *seen != fingerprint {
                return Err(Status::invalid_argument("idempotency_key: already used for a different request"));
            }
            return Ok(shared.clone());
        }
        let shared = Shared::default();
        if self.entries.insert(key.to_owned(), (fingerprint, shared.clone())).is_none() {
            if self.order.len() >= IDEMPOTENCY_ENTRIES
                && let Some(oldest) = self.order.pop_front()
            {
                self.entries.remove(&oldest);
            }
            self.order.push_back(key.to_owned());
        }
        Ok(shared)
    }

    /// Forgets `key` if it still holds `shared` (not a newer evaluation claimed since), so that the next request
    /// with the key evaluates afresh.
    fn forget(&mut self, key: &str, shared: &Shared) {
        if self.entries.get(key).is_some_and(|(_, held)| Arc::ptr_eq(held, shared)) {
            self.entries.remove(key);
            self.order.retain(|held| held != key);
        }
    }
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

    /// Evaluates, sharing one evaluation among the requests with the same idempotency key and content: concurrent
    /// ones wait for it, later ones get its result replayed (with their own `request_id`) while it is final (see
    /// [`is_final`]). A non-final result is forgotten once it is returned.
    async fn evaluate_once(&self, request: pb::EvaluateRequest) -> Result<pb::EvaluateResponse, Status> {
        if request.idempotency_key.is_empty() {
            return self.evaluator.evaluate(request).await.map_err(kforge_execution_proto::status);
        }
        let fingerprint = {
            let mut keyless = request.clone();
            keyless.idempotency_key.clear();
            keyless.request_id.clear();
            cache::key(&[&prost::Message::encode_to_vec(&keyless)])
        };
        let remembered = || self.idempotent.lock().expect("idempotency map lock is never poisoned");
        let key = request.idempotency_key.clone();
        let shared = remembered().claim(&key, fingerprint)?;
        let request_id = request.request_id.clone();
        let result = shared
            .get_or_init(|| async { self.evaluator.evaluate(request).await.map_err(kforge_execution_proto::status) })
            .await
            .clone();
        if !is_final(&result) {
            remembered().forget(&key, &shared);
        }
        result.map(|mut response| {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn response(verdict: pb::Verdict, retryable: bool) -> Result<pb::EvaluateResponse, Status> {
        Ok(pb::EvaluateResponse { verdict: verdict.into(), retryable, ..Default::default() })
    }

    /// A claimed evaluation, completed with `result`.
    fn completed(shared: &Shared, result: Result<pb::EvaluateResponse, Status>) {
        shared.set(result).expect("not completed before");
    }

    #[test]
    fn only_verdicts_but_a_retryable_infra_error_are_final() {
        for verdict in [
            pb::Verdict::Correct,
            pb::Verdict::Incorrect,
            pb::Verdict::CompileError,
            pb::Verdict::RuntimeError,
            pb::Verdict::Timeout,
            pb::Verdict::Hack,
            pb::Verdict::Rejected,
        ] {
            assert!(is_final(&response(verdict, false)), "{verdict:?}");
        }
        assert!(is_final(&response(pb::Verdict::InfraError, false)), "a non-retryable infra error is final");
        assert!(!is_final(&response(pb::Verdict::InfraError, true)));
        for status in [Status::resource_exhausted("queue full"), Status::invalid_argument("policy: unknown")] {
            assert!(!is_final(&Err(status)));
        }
    }

    #[test]
    fn a_key_shares_its_evaluation_until_a_non_final_result_is_forgotten() {
        let mut remembered = Remembered::default();
        let first = remembered.claim("k", "a".into()).expect("a new key");
        assert!(Arc::ptr_eq(&first, &remembered.claim("k", "a".into()).expect("the same request")));
        let other = remembered.claim("k", "b".into()).expect_err("another request");
        assert_eq!(other.code(), tonic::Code::InvalidArgument, "{other:?}");

        // Completed with a status: no later request shares it, even before its caller forgets it.
        completed(&first, Err(Status::resource_exhausted("queue full")));
        let second = remembered.claim("k", "b".into()).expect("a refused key is free again");
        assert!(!Arc::ptr_eq(&first, &second));
        // The first caller forgets its result late: the newer evaluation stays.
        remembered.forget("k", &first);
        assert!(Arc::ptr_eq(&second, &remembered.claim("k", "b".into()).expect("still held")));
        assert_eq!(remembered.order, ["k"], "one key, once");

        completed(&second, response(pb::Verdict::InfraError, true));
        remembered.forget("k", &second);
        assert!(remembered.entries.is_empty() && remembered.order.is_empty(), "{remembered:?}");
        let third = remembered.claim("k", "c".into()).expect("a forgotten key is free");
        completed(&third, response(pb::Verdict::InfraError, false));
        assert!(Arc::ptr_eq(&third, &remembered.claim("k", "c".into()).expect("a final result is kept")));
    }

    #[test]
    fn the_oldest_key_is_evicted_past_the_limit() {
        let mut remembered = Remembered::default();
        for i in 0..=IDEMPOTENCY_ENTRIES {
            let shared = remembered.claim(&i.to_string(), "f".into()).expect("a new key");
            completed(&shared, response(pb::Verdict::Correct, false));
        }
        assert_eq!((remembered.entries.len(), remembered.order.len()), (IDEMPOTENCY_ENTRIES, IDEMPOTENCY_ENTRIES));
        assert!(!remembered.entries.contains_key("0") && remembered.entries.contains_key("1"));
    }
}
