//! The Orchestrator service: runs jobs of episodes (task x trajectory x turn) through the gateway, evaluator and
//! reward services and keeps every turn in a durable store (SQLite or PostgreSQL, `store`), so that a restarted
//! orchestrator resumes its unfinished jobs without losing a turn or generating or evaluating one twice. Serves
//! SubmitJob, GetJob, WatchJob, ListJobs, ResumeJob, CancelJob, ListTrajectories and ExportSamples with the
//! `single-turn`, `kevin`, `drkernel` and `cudaforge` recipes, the step API (StartEpisode, Step) for trainers that
//! generate themselves, and RejectMismatched (docs/ORCHESTRATOR.md).
//!
//! The modules, from the outside in: `serve` (here) opens the store and serves what `config` describes;
//! `grpc` is the service's face (the handlers), over `service` (the jobs running here: started, resumed, taken
//! over, leased) and `export` (turns as training samples). `job` runs a job: its `Plan` (the checked spec and
//! tasks), its episodes and each turn's calls to the peers, and the step API's turns. What a turn is made of comes
//! from `recipe` (prompts and feedback), `judge` (cudaforge's reviews), `reward` (scores, returns, advantages) and
//! `metrics` (the job's metrics); `balance` spreads calls over GPU pools, `store` keeps jobs and turns, `monitoring`
//! counts for Prometheus and `error` maps failures to gRPC codes.

pub mod balance;
mod config;
pub mod error;
mod export;
pub mod faces;
pub mod failure;
mod grpc;
pub mod job;
pub mod judge;
pub mod metrics;
pub mod monitoring;
pub mod recipe;
pub mod reward;
mod service;
pub mod store;

use std::future::Future;

use kforge_proto::v1::orchestrator_server::OrchestratorServer;
use kforge_server::{Host, ServeError};
use tokio::net::TcpListener;

pub use config::{
    BreakerConfig, DiscoveriesConfig, DiscoveryConfig, DiscoveryError, HttpConfig, InFlightConfig, LimitsConfig,
    OrchestratorConfig, PeersConfig, QuotasConfig, RetryConfig,
};
pub use error::OrchestratorError;
pub use service::OrchestratorService;
use store::Store;

/// Serves the Orchestrator service on `listener` until `shutdown` completes: opens the store (migrating it),
/// resumes this instance's unfinished jobs when configured to, and serves. Running jobs are cancelled when
/// `shutdown` completes (before the drain, so that their watchers' streams end) and awaited before returning; they
/// stay RUNNING in the store, for the next start to resume.
pub async fn serve(
    config: OrchestratorConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let http = match http_address(&config.http)? {
        Some(addr) => Some(TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr, source })?),
        None => None,
    };
    serve_with_http(config, listener, http, shutdown).await
}

/// Where `http.listen` says the HTTP port listens; `None` when it is empty (no HTTP port).
pub fn http_address(http: &HttpConfig) -> Result<Option<std::net::SocketAddr>, ServeError> {
    if http.listen.trim().is_empty() {
        return Ok(None);
    }
    http.listen.trim().parse().map(Some).map_err(|error| ServeError::Setup {
        service: "orchestrator",
        message: format!("orchestrator.http.listen: `{}` is not an address: {error}", http.listen),
    })
}

/// [`serve`], with the HTTP port (protocol faces and JSON) on `http` when given, whatever `http.listen` says.
pub async fn serve_with_http(
    config: OrchestratorConfig,
    listener: TcpListener,
    http: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    serve_with_discovery(config, listener, http, None, shutdown).await
}

/// [`serve_with_http`], the evaluator pool's endpoints found by `evaluators` when given instead of
/// `discovery.evaluator`: for a caller that keeps the endpoint list itself (the simulated fleet,
/// `bench/src/fleet/`, whose endpoints have capacities of their own and disappear while it runs).
pub async fn serve_with_discovery(
    config: OrchestratorConfig,
    listener: TcpListener,
    http: Option<TcpListener>,
    evaluators: Option<std::sync::Arc<dyn kforge_discovery::Discovery>>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut host = Host::new("orchestrator", &config.server)?;
    let limit = host.max_message_bytes();
    let url = config.store_url();
    let store = Store::open_with(&url, config.store_durability)
        .await
        .map_err(|error| ServeError::Setup { service: "orchestrator", message: error.to_string() })?;
    tracing::info!(backend = store.backend(), instance = %config.instance, "store open");
    let resume = config.resume_on_start;
    let metrics = monitoring::OrchestratorMetrics::register(host.registry());
    let setup = |error: DiscoveryError| ServeError::Setup { service: "orchestrator", message: error.to_string() };
    let evaluators = match (evaluators, &config.discovery.evaluator) {
        (Some(given), _) => Some(given),
        (None, Some(discovery)) => Some(discovery.start("orchestrator.discovery.evaluator").await.map_err(setup)?),
        (None, None) => None,
    };
    let profilers = match &config.discovery.profiler {
        Some(discovery) => Some(discovery.start("orchestrator.discovery.profiler").await.map_err(setup)?),
        None => None,
    };
    let http_config = config.http.clone();
    let service = OrchestratorService::new(config, store, metrics).with_discovery(evaluators, profilers);
    if let Some(listener) = http {
        let tasks = job::task_set(&http_config.task_set).map_err(|error| ServeError::Setup {
            service: "orchestrator",
            message: format!("orchestrator.http.task_set: {error}"),
        })?;
        let face_service = service.clone();
        host.serve_http(listener, move |channel| faces::router(channel, face_service, tasks, http_config));
    }
    if resume {
        service.resume_unfinished().await;
    }
    let (jobs, stop) = (service.tracker.clone(), service.stop.clone());
    if service.config.take_over_orphans {
        let service = service.clone();
        jobs.spawn(async move { service.take_over_orphans().await });
    }
    host.add_service(
        OrchestratorServer::new(service).max_decoding_message_size(limit).max_encoding_message_size(limit),
    );
    let stop_jobs = stop.clone();
    let result = host
        .serve(listener, async move {
            shutdown.await;
            stop_jobs.cancel();
        })
        .await;
    stop.cancel();
    jobs.close();
    jobs.wait().await;
    result
}

/// Now as a protobuf timestamp.
pub(crate) fn now() -> prost_types::Timestamp {
    prost_types::Timestamp::from(std::time::SystemTime::now())
}
