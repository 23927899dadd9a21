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

    /// The wait before the next attempt after `failures` attempts, the last one `attempt`; `None`: no retry.
    fn next_wait(&self, attempt: Attempt, failures: u32) -> Option<Duration> {
        match attempt {
            _ if failures >= self.attempts => None,
            Attempt::Final => None,
            Attempt::Lost { elsewhere: true } => Some(Duration::ZERO),
            Attempt::Busy | Attempt::Lost { elsewhere: false } => Some(self.backoff(failures)),
        }
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

/// Evaluates, retrying while the evaluator is busy (RESOURCE_EXHAUSTED), answers a retryable VERDICT_INFRA_ERROR, or
/// lost the call (the pod died or refused it: retried on another endpoint, at once when one is up), up to the
/// policy's attempts; the last answer is returned either way (a final infra error is recorded, never scored).
/// Retries reuse the idempotency key, so an evaluation the evaluator did finish is not run again.
async fn evaluate_retrying(
    evaluators: &Arc<Balancer>,
    limits: &Limits,
    request: pb::EvaluateRequest,
    cancel: &CancellationToken,
) -> Result<pb::EvaluateResponse, tonic::Status> {
    let mut failures = 0;
    loop {
        let (answer, attempt) = {
            let _permit = limits.evaluator.acquire().await.expect("the evaluator semaphore is never closed");
            match evaluators.acquire(&request.idempotency_key).await {
                Ok(place) => {
                    let mut client = EvaluatorClient::new(place.channel());
                    let call = client.evaluate(request.clone()).instrument(call_span("Evaluator/Evaluate"));
                    let answer = call.await.map(tonic::Response::into_inner);
                    let attempt = match &answer {
                        // Marked before the place is freed, so that no call waiting for one takes it there.
                        Err(status) if lost_by_endpoint(status) => Attempt::Lost { elsewhere: place.lost() },
                        answer => Attempt::of(answer),
                    };
                    (answer, attempt)
                }
                // No place: the pool has had no ready endpoint for a while.
                Err(status) => (Err(status), Attempt::Final),
            }
        };
        failures += 1;
        let Some(wait) = limits.retry.next_wait(attempt, failures) else { return answer };
        match attempt {
            Attempt::Lost { .. } => {
                let error = answer.as_ref().err().map(ToString::to_string);
                tracing::warn!(key = %request.idempotency_key, failures, ?wait, error, "evaluator lost the call: retrying");
            }
            _ => {
                tracing::info!(key = %request.idempotency_key, failures, ?wait, "evaluator busy or infra error: retrying")
            }
        }
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = cancel.cancelled() => return answer,
        }
    }
}

/// What one evaluation attempt's answer asks of [`evaluate_retrying`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    /// An answer to keep: a final verdict, or an error retrying would not change.
    Final,
    /// The evaluator was busy (RESOURCE_EXHAUSTED) or hit a retryable infra error: tried again after the backoff.
    Busy,
    /// The endpoint lost the call ([`lost_by_endpoint`]); `elsewhere`: another endpoint of the pool is up, where the
    /// retry goes at once (`Place::lost`). Without one, the backoff paces the retries.
    Lost { elsewhere: bool },
}

impl Attempt {
    /// The attempt an answer the endpoint gave is.
    fn of(answer: &Result<pb::EvaluateResponse, tonic::Status>) -> Self {
        let busy = match answer {
            Err(status) => status.code() == tonic::Code::ResourceExhausted,
            Ok(response) => response.verdict() == pb::Verdict::InfraError && response.retryable,
        };
        if busy { Self::Busy } else { Self::Final }
    }
}

/// Whether a failed call was lost by its endpoint rather than answered by it: UNAVAILABLE (refused, or a server going
/// away), or a status this client made from a broken connection (a pod killed mid-call: its transport error is the
/// status's source; a status the evaluator sent has none). Another endpoint can take the call.
fn lost_by_endpoint(status: &tonic::Status) -> bool {
    match status.code() {
        tonic::Code::Unavailable => true,
        tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Cancelled => {
            std::error::Error::source(status).is_some()
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use kforge_discovery::{Endpoint, StaticDiscovery};
    use kforge_server::client::ClientConfig;
    use kforge_test_support::peers::{self, Hold, Standard, State};

    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy { attempts: 4, initial_backoff: Duration::from_millis(250), max_backoff: Duration::from_secs(1) }
    }

    #[test]
    fn a_lost_call_is_retried_at_once_where_another_endpoint_is_up_and_busy_ones_after_the_backoff() {
        let policy = policy();
        assert_eq!(policy.next_wait(Attempt::Lost { elsewhere: true }, 1), Some(Duration::ZERO));
        assert_eq!(policy.next_wait(Attempt::Lost { elsewhere: false }, 1), Some(Duration::from_millis(250)));
        assert_eq!(policy.next_wait(Attempt::Busy, 2), Some(Duration::from_millis(500)));
        assert_eq!(policy.next_wait(Attempt::Final, 1), None);
        // The attempts bound every kind: a pool whose pods all die does not retry forever.
        assert_eq!(policy.next_wait(Attempt::Lost { elsewhere: true }, 4), None);
        assert_eq!(policy.next_wait(Attempt::Busy, 4), None);
    }

    #[test]
    fn a_call_cut_in_transport_or_refused_is_lost_and_a_status_the_evaluator_sent_is_not() {
        let broken = tonic::Status::from_error(Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionReset)));
        assert_eq!(broken.code(), tonic::Code::Unknown);
        assert!(lost_by_endpoint(&broken), "a status made here from a transport error");
        assert!(lost_by_endpoint(&tonic::Status::unavailable("connection refused")));
        assert!(!lost_by_endpoint(&tonic::Status::unknown("the evaluator said so")));
        assert!(!lost_by_endpoint(&tonic::Status::internal("the evaluator said so")));
        assert!(!lost_by_endpoint(&tonic::Status::invalid_argument("task: required")));
        assert_eq!(Attempt::of(&Err(tonic::Status::resource_exhausted("queue full"))), Attempt::Busy);
        let infra = |retryable| pb::EvaluateResponse {
            verdict: pb::Verdict::InfraError.into(),
            retryable,
            ..Default::default()
        };
        assert_eq!(Attempt::of(&Ok(infra(true))), Attempt::Busy);
        assert_eq!(Attempt::of(&Ok(infra(false))), Attempt::Final);
    }

    /// The fakes serving on a runtime of their own, on a thread: stopping it drops every connection with it, as a
    /// killed process's kernel closes its sockets.
    struct Doomed {
        url: String,
        state: Arc<State>,
        stop: tokio::sync::oneshot::Sender<()>,
        thread: std::thread::JoinHandle<()>,
    }

    fn doomed() -> Doomed {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("non-blocking");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (sender, receiver) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("a tokio listener");
                let (state, server) = peers::serve(listener, Standard);
                sender.send(state).expect("the test waits");
                tokio::select! {
                    _ = server => {}
                    _ = stopped => {}
                }
            });
            // Every connection's task goes with the runtime.
            drop(runtime);
        });
        let state = receiver.recv().expect("the fakes start");
        Doomed { url, state, stop, thread }
    }

    #[tokio::test]
    async fn an_evaluation_cut_by_its_endpoints_death_is_retried_at_once_on_another() {
        let doomed = doomed();
        let (survivor, survivor_state) = peers::start_fakes().await;
        let endpoint = |url: &str| Endpoint {
            address: url.trim_start_matches("http://").parse::<SocketAddr>().expect("an address"),
            capacity: 4,
            pod: None,
        };
        let discovery = StaticDiscovery::new([endpoint(&doomed.url), endpoint(&survivor)]);
        let pool = Balancer::discovered("evaluator", Arc::new(discovery), ClientConfig::default());
        let mut key = String::new();
        for i in 0.. {
            key = format!("j/t/{i}/0");
            if pool.acquire(&key).await.expect("a place").url() == doomed.url {
                break;
            }
        }
        let turn = key.trim_start_matches("j/").to_owned();
        let mut held = doomed.state.hold(Hold::Evaluate(turn.clone()));
        // A backoff far beyond the test's patience: only an immediate retry passes.
        let limits = Limits {
            gateway: Semaphore::new(1),
            evaluator: Semaphore::new(4),
            reward: Semaphore::new(1),
            profiler: Semaphore::new(1),
            retry: RetryPolicy {
                attempts: 3,
                initial_backoff: Duration::from_secs(3600),
                max_backoff: Duration::from_secs(3600),
            },
        };
        let request = pb::EvaluateRequest { idempotency_key: key.clone(), job_id: "j".into(), ..Default::default() };
        let evaluation = tokio::spawn({
            let pool = pool.clone();
            async move { evaluate_retrying(&pool, &limits, request, &CancellationToken::new()).await }
        });
        held.recv().await.expect("the evaluation reaches the doomed endpoint");
        doomed.stop.send(()).expect("the doomed fakes run");
        tokio::task::spawn_blocking(move || doomed.thread.join().expect("stopped")).await.expect("joined");
        let answer = tokio::time::timeout(Duration::from_secs(30), evaluation).await.expect("retried at once");
        let response = answer.expect("task").expect("answered by the survivor");
        assert_eq!(response.verdict(), pb::Verdict::Correct);
        let (received, _) = survivor_state.evaluate_counts();
        assert_eq!(received, std::collections::HashMap::from([(turn, 1)]), "the same key, once, on the survivor");
    }
}
