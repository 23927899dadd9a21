//! What a job's turns call: clients of the gateway and reward service, the evaluator and profiler pools, the limits
//! on calls in flight to each peer shared by every job of this orchestrator, the retrying evaluation call, each
//! call's span.

use std::sync::Arc;
use std::time::Duration;

use kforge_proto::v1 as pb;
use kforge_proto::v1::evaluator_client::EvaluatorClient;
use kforge_proto::v1::gateway_client::GatewayClient;
use kforge_proto::v1::reward_client::RewardClient;
use kforge_server::client::Channel;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::balance::Balancer;
use crate::config::{InFlightConfig, RetryConfig};
use crate::monitoring::OrchestratorMetrics;

/// Clients of the services a job calls, and the limits and metrics shared by every job of this orchestrator.
#[derive(Debug, Clone)]
pub struct Peers {
    pub gateway: GatewayClient<Channel>,
    /// The evaluator pool, each call to one of its endpoints (`balance.rs`).
    pub evaluator: Arc<Balancer>,
    pub reward: RewardClient<Channel>,
    /// The profiler pool, for `cudaforge` jobs that may profile (see `OrchestratorService::connect`).
    pub profiler: Option<Arc<Balancer>>,
    pub limits: Arc<Limits>,
    pub metrics: OrchestratorMetrics,
}

/// Calls in flight to each peer, across every job. Tokio's semaphore hands permits out in the order they were
/// asked for, so a job of thousands of episodes cannot starve a later job of a service: both queue in turn.
#[derive(Debug)]
pub struct Limits {
    pub gateway: Semaphore,
    pub evaluator: Semaphore,
    pub reward: Semaphore,
    pub profiler: Semaphore,
    pub retry: RetryPolicy,
}

/// Backoff for an evaluator that is busy (RESOURCE_EXHAUSTED) or answers a retryable VERDICT_INFRA_ERROR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Calls in all, the first included.
    pub attempts: u32,
    /// The wait after the first failure; doubled after each later one, up to `max_backoff`.
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl Limits {
    /// A semaphore of each peer's `max_in_flight` places (at least one), and the retry policy.
    pub fn new(in_flight: &InFlightConfig, retry: &RetryConfig) -> Self {
        let permits = |n: u32| Semaphore::new((n as usize).max(1));
        Self {
            gateway: permits(in_flight.gateway),
            evaluator: permits(in_flight.evaluator),
            reward: permits(in_flight.reward),
            profiler: permits(in_flight.profiler),
            retry: RetryPolicy {
                attempts: retry.attempts.max(1),
                initial_backoff: Duration::from_millis(retry.initial_backoff_ms),
                max_backoff: Duration::from_millis(retry.max_backoff_ms),
            },
        }
    }
}

impl RetryPolicy {
    fn backoff(&self, failures: u32) -> Duration {
        let factor = 2u32.saturating_pow(failures.saturating_sub(1));
        self.initial_backoff.saturating_mul(factor).min(self.max_backoff)
    }
}

/// The span of one call to a peer (`Service/Method`), under the current turn's: the call carries its context, so
/// the peer's server span continues the episode's trace.
pub(super) fn call_span(method: &'static str) -> tracing::Span {
    tracing::info_span!("call", otel.name = method, otel.kind = "client", rpc.method = method)
}

/// The notice of an evaluation whose paired timing spread beyond the evaluator's bound (docs/evaluator/TIMING.md,
/// "Paired timing").
const UNSTEADY: &str = "timing.unsteady";

/// Evaluates as [`evaluate_retrying`] does. An answer whose timing the evaluator found unsteady (its machine's load
/// moved faster than its paired rounds alternate) is not scored as it is: the evaluation runs once more, under a
/// key of its own (`<key>#retimed`), and the second answer is the turn's, with its own notice if it is unsteady too.
pub(crate) async fn evaluate(
    evaluators: &Arc<Balancer>,
    limits: &Limits,
    request: pb::EvaluateRequest,
    cancel: &CancellationToken,
) -> Result<pb::EvaluateResponse, tonic::Status> {
    let first = evaluate_retrying(evaluators, limits, request.clone(), cancel).await?;
    if !first.findings.iter().any(|finding| finding.code == UNSTEADY) || cancel.is_cancelled() {
        return Ok(first);
    }
    tracing::info!(key = %request.idempotency_key, "unsteady timing: measuring again");
    let again = pb::EvaluateRequest { idempotency_key: format!("{}#retimed", request.idempotency_key), ..request };
    match evaluate_retrying(evaluators, limits, again, cancel).await {
        Ok(second) if second.verdict() != pb::Verdict::InfraError => Ok(second),
        // The second evaluation could not run: the first answer, with its notice, stands.
        _ => Ok(first),
    }
}

/// Evaluates, retrying with backoff while the evaluator is busy (RESOURCE_EXHAUSTED) or answers a retryable
/// VERDICT_INFRA_ERROR, up to the policy's attempts; the last answer is returned either way (a final infra error
/// is recorded, never scored). Retries reuse the idempotency key, so an evaluation the evaluator did finish is not
/// run again.
async fn evaluate_retrying(
    evaluators: &Arc<Balancer>,
    limits: &Limits,
    request: pb::EvaluateRequest,
    cancel: &CancellationToken,
) -> Result<pb::EvaluateResponse, tonic::Status> {
    let mut failures = 0;
    loop {
        let answer = {
            let _permit = limits.evaluator.acquire().await.expect("the evaluator semaphore is never closed");
            match evaluators.acquire(&request.idempotency_key).await {
                Ok(place) => {
                    let mut client = EvaluatorClient::new(place.channel());
                    let call = client.evaluate(request.clone()).instrument(call_span("Evaluator/Evaluate"));
                    call.await.map(tonic::Response::into_inner)
                }
                Err(status) => Err(status),
            }
        };
        let retryable = match &answer {
            Err(status) => status.code() == tonic::Code::ResourceExhausted,
            Ok(response) => response.verdict() == pb::Verdict::InfraError && response.retryable,
        };
        failures += 1;
        if !retryable || failures >= limits.retry.attempts {
            return answer;
        }
        let wait = limits.retry.backoff(failures);
        tracing::info!(key = %request.idempotency_key, failures, ?wait, "evaluator busy or infra error: retrying");
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = cancel.cancelled() => return answer,
        }
    }
}
