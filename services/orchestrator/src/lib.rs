//! The Orchestrator service: runs jobs of episodes (task x trajectory x turn) through the gateway, evaluator and
//! reward services and keeps every turn in a durable store (SQLite or PostgreSQL, `store`), so that a restarted
//! orchestrator resumes its unfinished jobs without losing a turn or generating or evaluating one twice. Serves
//! SubmitJob, GetJob, WatchJob, ListJobs, ResumeJob, CancelJob, ListTrajectories and ExportSamples with the
//! `single-turn` and `kevin` recipes, and the step API (StartEpisode, Step) for trainers that generate themselves
//! (docs/ORCHESTRATOR.md).

pub mod balance;
pub mod error;
pub mod job;
pub mod judge;
pub mod metrics;
pub mod monitoring;
pub mod recipe;
pub mod reward;
pub mod store;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_server::{Orchestrator, OrchestratorServer};
use kforge_server::client::{Channel, ClientConfig};
use kforge_server::{Host, ServeError, ServerConfig, ServiceConfig};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};

use balance::Balancer;
pub use error::OrchestratorError;
use job::{Limits, Peers, Plan, RetryPolicy};
use store::Store;

/// Configuration of the Orchestrator service (`[orchestrator]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OrchestratorConfig {
    pub server: ServerConfig,
    /// The services a job calls (`[orchestrator.peers]`).
    pub peers: PeersConfig,
    /// Episodes run at once per job when its spec names no limit. Default 4.
    pub max_concurrent_episodes: u32,
    /// Where jobs and turns are kept: `postgres://...`, `sqlite://PATH`, a file path, or `sqlite::memory:`.
    /// Empty (the default): `orchestrator.db` under `$XDG_STATE_HOME/kforge` (else `~/.local/state/kforge`).
    pub store: String,
    /// What a commit to a SQLite store survives: `process` (a killed orchestrator; the default) or `power_loss`
    /// (every commit synced to disk, slower).
    pub store_durability: store::Durability,
    /// This orchestrator's name in the store: it owns the jobs submitted to it (or resumed by it) and, with
    /// `resume_on_start`, resumes those left unfinished when it starts. Two orchestrators sharing a store need two
    /// names. Default `default`.
    pub instance: String,
    /// Resume this instance's queued and running jobs at start. Default true.
    pub resume_on_start: bool,
    /// Take over, while serving, the queued and running jobs of other instances whose lease ran out (a replica
    /// that died and does not come back under its name), checking at a third of `lease_ms`; the store's claim lets
    /// one replica have each. Default false: `kforge run`'s interrupted jobs wait for `--resume`. The chart turns it
    /// on for its replicas.
    pub take_over_orphans: bool,
    /// How long a job stays this instance's after its last renewal (renewed at a third of it while the job runs):
    /// another instance's ResumeJob may take the job over only after that. Default 30000.
    pub lease_ms: u64,
    /// Calls in flight to each peer across every job (`[orchestrator.max_in_flight]`).
    pub max_in_flight: InFlightConfig,
    /// Evaluator and profiler pods to balance calls over, by their capacity (`[orchestrator.discovery.*]`); a peer
    /// without one is called at its `peers` URL.
    pub discovery: DiscoveriesConfig,
    /// Retries of a busy evaluator or a retryable infrastructure error (`[orchestrator.retry]`).
    pub retry: RetryConfig,
}

/// Calls in flight to each peer, across every job: the orchestrator's share of each service, handed out first
/// come, first served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InFlightConfig {
    /// Default 256.
    pub gateway: u32,
    /// Default 64 (the evaluator queues and admits by its own resources; this bounds what waits there).
    pub evaluator: u32,
    /// Default 64.
    pub reward: u32,
    /// Default 8 (each profile holds a GPU alone for seconds; `cudaforge` profiles every correct kernel).
    pub profiler: u32,
}

impl Default for InFlightConfig {
    fn default() -> Self {
        Self { gateway: 256, evaluator: 64, reward: 64, profiler: 8 }
    }
}

/// Backoff of evaluations answered RESOURCE_EXHAUSTED or with a retryable VERDICT_INFRA_ERROR.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Calls in all, the first included; the last answer is recorded (an infra error is never scored). Default 8.
    pub attempts: u32,
    /// Wait after the first failure, doubled after each later one. Default 250.
    pub initial_backoff_ms: u64,
    /// Longest wait. Default 15000.
    pub max_backoff_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self { attempts: 8, initial_backoff_ms: 250, max_backoff_ms: 15_000 }
    }
}

/// The GPU pools whose endpoints are discovered (`balance.rs`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveriesConfig {
    pub evaluator: Option<DiscoveryConfig>,
    pub profiler: Option<DiscoveryConfig>,
}

/// Where a pool's endpoints are: a static list (`endpoints`, one machine or a cluster without API access) or a
/// Kubernetes Service whose EndpointSlices are watched (`service`). Exactly one of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// `host:port` addresses (IP addresses), each taking `capacity` calls.
    pub endpoints: Vec<String>,
    /// The (headless) Service's name.
    pub service: String,
    /// Its namespace; empty: the client's (in a pod, the pod's own).
    pub namespace: String,
    /// The Service port's name. Default `grpc`.
    pub port: String,
    /// Label selector of the Service's pods, whose `kforge.dev/capacity` annotation gives each one's capacity.
    pub pod_selector: String,
    /// Calls an endpoint takes at once when nothing says otherwise. Default 4.
    pub capacity: u32,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            service: String::new(),
            namespace: String::new(),
            port: "grpc".into(),
            pod_selector: String::new(),
            capacity: 4,
        }
    }
}

impl DiscoveryConfig {
    /// Starts the discovery this config names; `key` is its config path, for errors.
    async fn start(&self, key: &str) -> Result<Arc<dyn kforge_discovery::Discovery>, String> {
        match (self.endpoints.is_empty(), self.service.is_empty()) {
            (false, true) => {
                let mut addresses = Vec::new();
                for (i, text) in self.endpoints.iter().enumerate() {
                    let address: std::net::SocketAddr =
                        text.parse().map_err(|e| format!("{key}.endpoints[{i}]: {text:?} is not an ip:port: {e}"))?;
                    addresses.push(address);
                }
                Ok(Arc::new(kforge_discovery::StaticDiscovery::from_addresses(addresses, self.capacity.max(1))))
            }
            (true, false) => {
                let target = kforge_discovery::KubeTarget {
                    namespace: self.namespace.clone(),
                    service: self.service.clone(),
                    port_name: self.port.clone(),
                    pod_selector: self.pod_selector.clone(),
                    default_capacity: self.capacity.max(1),
                };
                let discovery = kforge_discovery::KubeDiscovery::start_in_environment(target).await.map_err(|e| {
                    format!("{key}.service: no Kubernetes API client (a pod's service account, or KUBECONFIG): {e}")
                })?;
                Ok(Arc::new(discovery))
            }
            _ => Err(format!("{key}: name exactly one of `endpoints` (a static list) and `service` (Kubernetes)")),
        }
    }
}

/// Where the orchestrator's peers listen. `kforge up` and `kforge run` set these to the in-process services.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeersConfig {
    /// The gateway's URL. Default `http://127.0.0.1:50054`.
    pub gateway: String,
    /// The evaluator's URL. Default `http://127.0.0.1:50051`.
    pub evaluator: String,
    /// The reward service's URL. Default `http://127.0.0.1:50053`.
    pub reward: String,
    /// The profiler's URL, called by `cudaforge` jobs on a GPU backend. Default `http://127.0.0.1:50052`.
    pub profiler: String,
    /// TLS and token for calling them.
    pub client: ClientConfig,
}

impl Default for PeersConfig {
    fn default() -> Self {
        Self {
            gateway: "http://127.0.0.1:50054".into(),
            evaluator: "http://127.0.0.1:50051".into(),
            reward: "http://127.0.0.1:50053".into(),
            profiler: "http://127.0.0.1:50052".into(),
            client: ClientConfig::default(),
        }
    }
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        Self {
            server: ServerConfig::listening_on(([127, 0, 0, 1], 50055).into()),
            peers: PeersConfig::default(),
            max_concurrent_episodes: 4,
            store: String::new(),
            store_durability: store::Durability::default(),
            instance: "default".into(),
            resume_on_start: true,
            take_over_orphans: false,
            lease_ms: 30_000,
            max_in_flight: InFlightConfig::default(),
            discovery: DiscoveriesConfig::default(),
            retry: RetryConfig::default(),
        }
    }
}

impl OrchestratorConfig {
    /// The store's URL: `store`, or the default file.
    pub fn store_url(&self) -> String {
        if self.store.is_empty() { store::default_url() } else { self.store.clone() }
    }
}

impl ServiceConfig for OrchestratorConfig {
    const SECTION: &'static str = "orchestrator";
    fn server(&self) -> &ServerConfig {
        &self.server
    }
}

/// Serves the Orchestrator service on `listener` until `shutdown` completes: opens the store (migrating it),
/// resumes this instance's unfinished jobs when configured to, and serves. Running jobs are cancelled when
/// `shutdown` completes (before the drain, so that their watchers' streams end) and awaited before returning; they
/// stay RUNNING in the store, for the next start to resume.
pub async fn serve(
    config: OrchestratorConfig,
    listener: TcpListener,
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
    let setup = |message: String| ServeError::Setup { service: "orchestrator", message };
    let evaluators = match &config.discovery.evaluator {
        Some(discovery) => Some(discovery.start("orchestrator.discovery.evaluator").await.map_err(setup)?),
        None => None,
    };
    let profilers = match &config.discovery.profiler {
        Some(discovery) => Some(discovery.start("orchestrator.discovery.profiler").await.map_err(setup)?),
        None => None,
    };
    let service = OrchestratorService::new(config, store, metrics).with_discovery(evaluators, profilers);
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

/// A job's live handles.
#[derive(Debug)]
struct Running {
    updates: watch::Receiver<pb::JobProgress>,
    cancel: CancellationToken,
}

/// The `kforge.v1.Orchestrator` implementation.
#[derive(Debug, Clone)]
pub struct OrchestratorService {
    config: Arc<OrchestratorConfig>,
    store: Store,
    limits: Arc<Limits>,
    /// The evaluator and profiler pools every job's calls are spread over.
    evaluators: Arc<Balancer>,
    profilers: Arc<Balancer>,
    running: Arc<Mutex<HashMap<String, Running>>>,
    /// Owner of every job's task: cancelled and awaited at shutdown.
    tracker: TaskTracker,
    stop: CancellationToken,
    next_id: Arc<AtomicU64>,
    metrics: monitoring::OrchestratorMetrics,
}

impl OrchestratorService {
    pub fn new(config: OrchestratorConfig, store: Store, metrics: monitoring::OrchestratorMetrics) -> Self {
        let permits = |n: u32| Semaphore::new((n as usize).max(1));
        let limits = Limits {
            gateway: permits(config.max_in_flight.gateway),
            evaluator: permits(config.max_in_flight.evaluator),
            reward: permits(config.max_in_flight.reward),
            profiler: permits(config.max_in_flight.profiler),
            retry: RetryPolicy {
                attempts: config.retry.attempts.max(1),
                initial_backoff: Duration::from_millis(config.retry.initial_backoff_ms),
                max_backoff: Duration::from_millis(config.retry.max_backoff_ms),
            },
        };
        let client = config.peers.client.clone();
        let evaluators =
            Balancer::fixed("evaluator", &config.peers.evaluator, config.max_in_flight.evaluator, client.clone());
        let profilers = Balancer::fixed("profiler", &config.peers.profiler, config.max_in_flight.profiler, client);
        Self {
            evaluators,
            profilers,
            config: Arc::new(config),
            store,
            limits: Arc::new(limits),
            running: Arc::default(),
            tracker: TaskTracker::new(),
            stop: CancellationToken::new(),
            next_id: Arc::default(),
            metrics,
        }
    }

    /// Spreads evaluator and profiler calls over the endpoints these find instead of the `peers` URLs.
    pub fn with_discovery(
        mut self,
        evaluators: Option<Arc<dyn kforge_discovery::Discovery>>,
        profilers: Option<Arc<dyn kforge_discovery::Discovery>>,
    ) -> Self {
        let client = &self.config.peers.client;
        if let Some(discovery) = evaluators {
            self.evaluators = Balancer::discovered("evaluator", discovery, client.clone());
        }
        if let Some(discovery) = profilers {
            self.profilers = Balancer::discovered("profiler", discovery, client.clone());
        }
        self
    }

    fn lease(&self) -> Duration {
        Duration::from_millis(self.config.lease_ms.max(3))
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, Running>> {
        // Inserts, removals and lookups only: a panic elsewhere cannot leave the map half-changed.
        self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Clients of the services `plan` calls. The profiler is one of them for `cudaforge` on a GPU backend (a
    /// missing one is UNAVAILABLE), and is tried for `cudaforge` on the evaluator's default backend (which is the
    /// CPU where no GPU is: then the recipe gives correction-only feedback and says so).
    /// A channel to `peer` at `url` (UNAVAILABLE naming both when it cannot be reached).
    async fn channel(&self, peer: &'static str, url: &str) -> Result<Channel, OrchestratorError> {
        kforge_server::client::connect(url, &self.config.peers.client).await.map_err(|error| {
            OrchestratorError::PeerUnavailable { peer, url: url.to_owned(), message: error.to_string() }
        })
    }

    async fn connect(&self, plan: &Plan) -> Result<Peers, OrchestratorError> {
        let peers = &self.config.peers;
        let channel = |peer, url| self.channel(peer, url);
        let gateway = pb::gateway_client::GatewayClient::new(channel("gateway", &peers.gateway).await?);
        self.evaluators.check().await?;
        Ok(Peers {
            gateway,
            evaluator: self.evaluators.clone(),
            reward: pb::reward_client::RewardClient::new(channel("reward", &peers.reward).await?),
            profiler: match (plan.recipe, plan.spec.backend()) {
                (recipe::Recipe::CudaForge, pb::Backend::Cuda | pb::Backend::Triton) => {
                    self.profilers.check().await?;
                    Some(self.profilers.clone())
                }
                (recipe::Recipe::CudaForge, pb::Backend::Unspecified) => {
                    self.profilers.check().await.ok().map(|()| self.profilers.clone())
                }
                _ => None,
            },
            limits: self.limits.clone(),
            metrics: self.metrics.clone(),
        })
    }

    async fn job(&self, job_id: &str) -> Result<pb::Job, Status> {
        if job_id.is_empty() {
            return Err(OrchestratorError::invalid("job_id", "required").into());
        }
        let job = self.store.job(job_id).await.map_err(store_status)?;
        Ok(job.ok_or_else(|| OrchestratorError::JobNotFound(job_id.to_owned()))?)
    }

    /// Starts the job's task here (its turns so far are in the store), unless it already runs here.
    fn start(&self, plan: Plan, job: pb::Job, peers: Peers) {
        let job_id = job.job_id.clone();
        let progress = pb::JobProgress { job: Some(job.clone()), ..Default::default() };
        let (updates, receiver) = watch::channel(progress);
        // `halt` stops the job here and leaves it to be resumed (a shutdown, a lost lease); `cancel` cancels it.
        let halt = self.stop.child_token();
        let cancel = halt.child_token();
        {
            let mut running = self.running();
            if running.contains_key(&job_id) {
                return;
            }
            running.insert(job_id.clone(), Running { updates: receiver, cancel: cancel.clone() });
        }
        let max_concurrent = match plan.spec.max_concurrent_episodes {
            0 => self.config.max_concurrent_episodes,
            n => n,
        } as usize;
        tracing::info!(job_id = %job_id, episodes = job.episodes_total, turns = job.turns_total, "job started");
        let store = self.store.clone();
        let running = self.running.clone();
        let (instance, lease) = (self.config.instance.clone(), self.lease());
        self.tracker.spawn(async move {
            // The lease is renewed beside the job, in a task of its own (the job may hold the store's only
            // connection while it waits); lost to another instance (this one stalled past its lease), the job stops
            // here without a verdict.
            let finished = CancellationToken::new();
            let renewal = tokio::spawn(renew_lease(
                store.clone(),
                job_id.clone(),
                instance,
                lease,
                halt.clone(),
                finished.clone(),
            ));
            job::run(Arc::new(plan), job, peers, store, updates, cancel, halt, max_concurrent).await;
            finished.cancel();
            if let Err(error) = renewal.await {
                tracing::error!(%job_id, %error, "the lease renewal task failed");
            }
            // A finished job is read from the store from now on; ResumeJob may start it again.
            running.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&job_id);
        });
    }

    /// Takes the job over and runs its unfinished turns here.
    async fn resume(&self, job_id: &str) -> Result<pb::Job, Status> {
        let mut job = self.job(job_id).await?;
        if self.running().contains_key(job_id) || job.state == pb::JobState::Succeeded as i32 {
            return Ok(job);
        }
        let spec = job.spec.clone().ok_or_else(|| Status::internal(format!("job {job_id} has no stored spec")))?;
        if spec.model == job::STEP_MODEL {
            return Err(
                OrchestratorError::Precondition(format!("{job_id} is a step-API episode: Step advances it")).into()
            );
        }
        let tasks = self.store.tasks(job_id).await.map_err(store_status)?;
        let plan = tokio::task::spawn_blocking(move || Plan::resumed(spec, tasks))
            .await
            .map_err(|error| Status::internal(format!("checking the stored spec panicked: {error}")))??;
        let peers = self.connect(&plan).await?;
        let claimed = self
            .store
            .claim(job_id, &self.config.instance, lease_until(Duration::ZERO), lease_until(self.lease()))
            .await
            .map_err(store_status)?;
        if let Err((owner, until_ms)) = claimed {
            let left_s = (until_ms - lease_until(Duration::ZERO)).max(0) as f64 / 1000.0;
            let message = format!("{job_id} is held by instance `{owner}` for another {left_s:.1} s (its lease)");
            return Err(OrchestratorError::Precondition(message).into());
        }
        job.state = pb::JobState::Queued.into();
        job.error.clear();
        job.updated_at = Some(now());
        self.store.put_job(&job).await.map_err(store_status)?;
        tracing::info!(job_id, instance = %self.config.instance, "job resumed");
        self.start(plan, job.clone(), peers);
        Ok(job)
    }

    /// Until the service stops: at a third of the lease, takes over the jobs of other instances whose lease ran
    /// out (`take_over_orphans`). A job another replica claimed first is left to it.
    async fn take_over_orphans(&self) {
        let mut sweep = tokio::time::interval(self.lease() / 3);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = sweep.tick() => {}
                () = self.stop.cancelled() => return,
            }
            let orphans = match self.store.orphaned_jobs(&self.config.instance, lease_until(Duration::ZERO)).await {
                Ok(orphans) => orphans,
                Err(error) => {
                    tracing::error!(%error, "listing orphaned jobs failed");
                    continue;
                }
            };
            for job_id in orphans {
                match self.resume(&job_id).await {
                    Ok(_) => tracing::info!(%job_id, instance = %self.config.instance, "took over an orphaned job"),
                    // Another replica claimed it first, or it cannot run here now: the next sweep looks again.
                    Err(status) => tracing::info!(%job_id, code = ?status.code(), message = status.message(),
                        "orphaned job not taken over"),
                }
            }
        }
    }

    /// Resumes every queued or running job this instance owns (at start). A job that cannot resume now (a peer
    /// down) is logged and left as it is, for ResumeJob or the next start.
    pub async fn resume_unfinished(&self) {
        let ids = match self.store.unfinished_jobs(&self.config.instance).await {
            Ok(ids) => ids,
            Err(error) => {
                tracing::error!(%error, "listing unfinished jobs failed: none resumed");
                return;
            }
        };
        for job_id in ids {
            if let Err(status) = self.resume(&job_id).await {
                tracing::error!(%job_id, code = ?status.code(), message = status.message(), "job not resumed");
            }
        }
    }
}

fn store_status(error: store::StoreError) -> Status {
    match &error {
        store::StoreError::Database(_) | store::StoreError::Migration(_) | store::StoreError::BadUrl { .. } => {
            Status::unavailable(error.to_string())
        }
        store::StoreError::Corrupt { .. } => Status::data_loss(error.to_string()),
    }
}

fn is_terminal(state: i32) -> bool {
    matches!(
        pb::JobState::try_from(state),
        Ok(pb::JobState::Succeeded | pb::JobState::Failed | pb::JobState::Cancelled)
    )
}

/// Renews `instance`'s lease on the job at a third of its length until `finished`; cancels `halt` when another
/// instance holds the job.
async fn renew_lease(
    store: Store,
    job_id: String,
    instance: String,
    lease: Duration,
    halt: CancellationToken,
    finished: CancellationToken,
) {
    let mut renewal = tokio::time::interval(lease / 3);
    loop {
        tokio::select! {
            () = finished.cancelled() => return,
            _ = renewal.tick() => match store.renew(&job_id, &instance, lease_until(lease)).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(%job_id, %instance, "lease lost to another instance: stopping the job here");
                    halt.cancel();
                    return;
                }
                Err(error) => tracing::error!(%job_id, %error, "lease not renewed"),
            },
        }
    }
}

/// `lease` from now, in milliseconds since the Unix epoch.
fn lease_until(lease: Duration) -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from((now + lease).as_millis()).unwrap_or(i64::MAX)
}

/// Now as a protobuf timestamp.
pub(crate) fn now() -> prost_types::Timestamp {
    prost_types::Timestamp::from(std::time::SystemTime::now())
}

/// A job id unique across restarts and orchestrators sharing a store: the time, a per-process random part and a
/// sequence.
fn new_job_id(sequence: u64) -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    static PROCESS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let process = *PROCESS.get_or_init(|| {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        hasher.finish() as u32
    });
    let millis = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    format!("job-{millis}-{process:08x}-{sequence}")
}

/// Parses a page token or cursor this service wrote.
fn token<T: std::str::FromStr>(field: &str, token: &str) -> Result<Option<T>, OrchestratorError> {
    if token.is_empty() {
        return Ok(None);
    }
    token.parse().map(Some).map_err(|_| OrchestratorError::invalid(field, "not a token this service wrote"))
}

/// A sample's cursor: its position in the job's order, `task.trajectory.turn`.
fn cursor((task, trajectory, turn): store::TurnPosition) -> String {
    format!("{task}.{trajectory}.{turn}")
}

fn parse_cursor(text: &str) -> Result<Option<store::TurnPosition>, OrchestratorError> {
    if text.is_empty() {
        return Ok(None);
    }
    let bad = || OrchestratorError::invalid("cursor", "not a cursor from ExportSamples");
    let mut parts = text.split('.');
    let mut next = || parts.next().ok_or_else(bad);
    let position =
        (next()?.parse().map_err(|_| bad())?, next()?.parse().map_err(|_| bad())?, next()?.parse().map_err(|_| bad())?);
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(Some(position))
}

/// A recorded turn as a training sample.
fn sample(job_id: &str, position: store::TurnPosition, turn: pb::TurnRecord) -> pb::Sample {
    pb::Sample {
        cursor: cursor(position),
        job_id: job_id.to_owned(),
        task_id: turn.task_id,
        trajectory: turn.trajectory,
        turn: turn.turn,
        prompt: turn.prompt,
        prompt_token_ids: turn.prompt_token_ids,
        response: turn.completion,
        kernel: turn.kernel,
        evaluation: turn.evaluation,
        verdict: turn.verdict,
        score: turn.score,
        return_value: turn.return_value,
        advantage: turn.advantage,
        keep: turn.keep,
        error: turn.error,
        judge: turn.judge,
        format_error: turn.format_error,
    }
}

#[tonic::async_trait]
impl Orchestrator for OrchestratorService {
    async fn submit_job(&self, request: Request<pb::SubmitJobRequest>) -> Result<Response<pb::Job>, Status> {
        let request = request.into_inner();
        let spec = request.spec.ok_or_else(|| OrchestratorError::invalid("spec", "required"))?;
        if let Some(job) = self.store.job_by_key(&request.idempotency_key).await.map_err(store_status)? {
            return Ok(Response::new(job));
        }
        // A KernelBench directory or a JSONL file is read from disk: off the async threads.
        let plan = tokio::task::spawn_blocking(move || Plan::new(spec))
            .await
            .map_err(|error| Status::internal(format!("resolving the task set panicked: {error}")))??;
        let peers = self.connect(&plan).await?;
        let job = pb::Job {
            job_id: new_job_id(self.next_id.fetch_add(1, Ordering::Relaxed)),
            spec: Some(plan.spec.clone()),
            state: pb::JobState::Queued.into(),
            episodes_total: plan.episodes(),
            turns_total: plan.turns_total(),
            metrics: Some(metrics::job_metrics(None, &[], 0.0)),
            created_at: Some(now()),
            updated_at: Some(now()),
            ..Default::default()
        };
        let existing = self
            .store
            .create_job(&job, &request.idempotency_key, &self.config.instance, lease_until(self.lease()), &plan.tasks)
            .await
            .map_err(store_status)?;
        if let Some(existing) = existing {
            // A concurrent submission with the same key won.
            return Ok(Response::new(existing));
        }
        tracing::info!(job_id = %job.job_id, "job submitted");
        self.start(plan, job.clone(), peers);
        Ok(Response::new(job))
    }

    async fn get_job(&self, request: Request<pb::GetJobRequest>) -> Result<Response<pb::Job>, Status> {
        let job_id = request.into_inner().job_id;
        // A job running here is read live; the store's snapshot of it is refreshed about once a second.
        let live = self.running().get(&job_id).and_then(|running| running.updates.borrow().job.clone());
        match live {
            Some(job) => Ok(Response::new(job)),
            None => Ok(Response::new(self.job(&job_id).await?)),
        }
    }

    type WatchJobStream = BoxStream<pb::JobProgress>;

    async fn watch_job(&self, request: Request<pb::WatchJobRequest>) -> Result<Response<Self::WatchJobStream>, Status> {
        let job = self.job(&request.into_inner().job_id).await?;
        let receiver = self.running().get(&job.job_id).map(|r| r.updates.clone());
        // The job's task drops the sender once the job is terminal: the stream yields the last state and ends. A
        // job not running here (finished, or interrupted and not resumed) is sent once, as stored.
        let stream: Self::WatchJobStream = match receiver {
            Some(receiver) => {
                Box::pin(tokio_stream::StreamExt::map(tokio_stream::wrappers::WatchStream::new(receiver), Ok))
            }
            None => Box::pin(tokio_stream::once(Ok(pb::JobProgress {
                job: Some(job),
                in_flight: Some(pb::StageCounts::default()),
                recorded: None,
            }))),
        };
        Ok(Response::new(stream))
    }

    async fn list_jobs(&self, request: Request<pb::ListJobsRequest>) -> Result<Response<pb::ListJobsResponse>, Status> {
        let request = request.into_inner();
        let before: Option<i64> = token("page_token", &request.page_token)?;
        let page_size = match request.page_size {
            0 => 50,
            n => n.min(500),
        };
        let state = (request.state != pb::JobState::Unspecified as i32).then_some(request.state);
        // One more than the page tells whether another page follows.
        let mut listed = self.store.list_jobs(before, state, page_size + 1).await.map_err(store_status)?;
        let more = listed.len() > page_size as usize;
        listed.truncate(page_size as usize);
        let next_page_token = match listed.last() {
            Some(last) if more => last.seq.to_string(),
            _ => String::new(),
        };
        Ok(Response::new(pb::ListJobsResponse { jobs: listed.into_iter().map(|l| l.job).collect(), next_page_token }))
    }

    async fn resume_job(&self, request: Request<pb::ResumeJobRequest>) -> Result<Response<pb::Job>, Status> {
        Ok(Response::new(self.resume(&request.into_inner().job_id).await?))
    }

    async fn cancel_job(&self, request: Request<pb::CancelJobRequest>) -> Result<Response<pb::Job>, Status> {
        let mut job = self.job(&request.into_inner().job_id).await?;
        if is_terminal(job.state) {
            return Ok(Response::new(job));
        }
        let running = self.running().get(&job.job_id).map(|running| running.cancel.clone());
        if let Some(cancel) = running {
            // Its task records CANCELLED once its episodes have stopped.
            cancel.cancel();
            return Ok(Response::new(job));
        }
        // Not running here: an interrupted job (so that no start resumes it), unless a live instance runs it.
        let now_ms = lease_until(Duration::ZERO);
        if let Err((owner, _)) =
            self.store.claim(&job.job_id, &self.config.instance, now_ms, now_ms).await.map_err(store_status)?
        {
            let message = format!("{} runs on instance `{owner}`: cancel it there", job.job_id);
            return Err(OrchestratorError::Precondition(message).into());
        }
        job.state = pb::JobState::Cancelled.into();
        job.updated_at = Some(now());
        self.store.put_job(&job).await.map_err(store_status)?;
        Ok(Response::new(job))
    }

    async fn list_trajectories(
        &self,
        request: Request<pb::ListTrajectoriesRequest>,
    ) -> Result<Response<pb::ListTrajectoriesResponse>, Status> {
        let request = request.into_inner();
        let job = self.job(&request.job_id).await?;
        let offset: usize = token("page_token", &request.page_token)?.unwrap_or(0);
        let page_size = match request.page_size {
            0 => 100,
            n => n as usize,
        };
        let mut trajectories: Vec<pb::Trajectory> = Vec::new();
        for turn in self.store.turns(&job.job_id).await.map_err(store_status)? {
            if !request.task_id.is_empty() && turn.task_id != request.task_id {
                continue;
            }
            let id = format!("{}/{}/{}", job.job_id, turn.task_id, turn.trajectory);
            match trajectories.last_mut() {
                Some(last) if last.trajectory_id == id => last.turns.push(turn),
                _ => trajectories.push(pb::Trajectory {
                    trajectory_id: id,
                    task_id: turn.task_id.clone(),
                    turns: vec![turn],
                }),
            }
        }
        let total = trajectories.len();
        let page: Vec<pb::Trajectory> = trajectories.into_iter().skip(offset).take(page_size).collect();
        let next = offset + page.len();
        let next_page_token = if next < total { next.to_string() } else { String::new() };
        Ok(Response::new(pb::ListTrajectoriesResponse { trajectories: page, next_page_token }))
    }

    type ExportSamplesStream = BoxStream<pb::Sample>;

    async fn export_samples(
        &self,
        request: Request<pb::ExportSamplesRequest>,
    ) -> Result<Response<Self::ExportSamplesStream>, Status> {
        let request = request.into_inner();
        let job = self.job(&request.job_id).await?;
        let mut after = parse_cursor(&request.cursor)?;
        let mut left = match request.limit {
            0 => u64::MAX,
            n => u64::from(n),
        };
        let store = self.store.clone();
        // Pages of turns read one at a time, as the client takes them: a large job never sits in memory whole.
        let (sender, receiver) = tokio::sync::mpsc::channel(64);
        self.tracker.spawn(async move {
            const PAGE: u32 = 256;
            while left > 0 {
                let page = match store.turns_after(&job.job_id, after, PAGE.min(left as u32)).await {
                    Ok(page) => page,
                    Err(error) => {
                        let _ = sender.send(Err(store_status(error))).await;
                        return;
                    }
                };
                let full = page.len() as u32 == PAGE;
                for (position, turn) in page {
                    after = Some(position);
                    left -= 1;
                    if sender.send(Ok(sample(&job.job_id, position, turn))).await.is_err() {
                        return;
                    }
                }
                if !full {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(receiver))))
    }

    async fn start_episode(
        &self,
        request: Request<pb::StartEpisodeRequest>,
    ) -> Result<Response<pb::Observation>, Status> {
        let request = request.into_inner();
        let task = request.task.ok_or_else(|| OrchestratorError::invalid("task", "required"))?;
        let spec = pb::JobSpec {
            kind: pb::JobKind::Rollout.into(),
            recipe: request.recipe,
            task_set: "inline".into(),
            tasks: vec![task],
            model: job::STEP_MODEL.into(),
            trajectories_per_task: 1,
            turns: request.turns,
            backend: request.backend,
            policy: request.policy,
            reward: request.reward,
            strict_format: request.strict_format,
            ..Default::default()
        };
        // The episode's checks are the job's: name the request's fields, not the spec's.
        let plan = Plan::new(spec).map_err(|error| match error {
            OrchestratorError::InvalidArgument { field, message } => OrchestratorError::InvalidArgument {
                field: field.replace("spec.tasks[0]", "task").trim_start_matches("spec.").to_owned(),
                message,
            },
            other => other,
        })?;
        if plan.recipe == recipe::Recipe::CudaForge {
            // Its Judge is a second model the orchestrator asks through the gateway; a stepped episode has one, the
            // trainer's.
            return Err(OrchestratorError::invalid(
                "recipe",
                "cudaforge reviews each kernel with a Judge model through the gateway: submit it as a job \
                 (SubmitJob); stepped episodes take single-turn, kevin or drkernel",
            )
            .into());
        }
        let job = pb::Job {
            job_id: new_job_id(self.next_id.fetch_add(1, Ordering::Relaxed)),
            spec: Some(plan.spec.clone()),
            state: pb::JobState::Running.into(),
            episodes_total: 1,
            turns_total: plan.turns_total(),
            metrics: Some(metrics::job_metrics(None, &[], 0.0)),
            created_at: Some(now()),
            updated_at: Some(now()),
            ..Default::default()
        };
        // Owned apart from this instance's jobs: a restart has nothing to resume in it (the trainer steps it).
        let owner = format!("{}/step", self.config.instance);
        let existing = self
            .store
            .create_job(&job, &request.idempotency_key, &owner, 0, &plan.tasks)
            .await
            .map_err(store_status)?;
        // A retry gets the stored episode's first prompt, whatever this request says.
        let (job, plan) = match existing {
            Some(existing) => {
                let tasks = self.store.tasks(&existing.job_id).await.map_err(store_status)?;
                let plan = Plan::resumed(existing.spec.clone().unwrap_or_default(), tasks)?;
                (existing, plan)
            }
            None => (job, plan),
        };
        Ok(Response::new(pb::Observation {
            episode_id: job.job_id,
            turn: 0,
            prompt: job::first_prompt(&plan),
            ..Default::default()
        }))
    }

    async fn step(&self, request: Request<pb::StepRequest>) -> Result<Response<pb::Observation>, Status> {
        let request = request.into_inner();
        if request.episode_id.is_empty() {
            return Err(OrchestratorError::invalid("episode_id", "required").into());
        }
        let completion = request.completion.ok_or_else(|| OrchestratorError::invalid("completion", "required"))?;
        if request.idempotency_key.is_empty() {
            return Err(
                OrchestratorError::invalid("idempotency_key", "required: a retried step carries the same key").into()
            );
        }
        let job = self.job(&request.episode_id).await?;
        let spec = job.spec.clone().unwrap_or_default();
        if spec.model != job::STEP_MODEL {
            let message = format!("{} is a job, not a step-API episode", job.job_id);
            return Err(OrchestratorError::Precondition(message).into());
        }
        let tasks = self.store.tasks(&job.job_id).await.map_err(store_status)?;
        let plan = Arc::new(Plan::resumed(spec, tasks)?);
        let peers = self.connect(&plan).await?;
        let episode_id = job.job_id.clone();
        let stepped =
            job::step(plan, job, peers, self.store.clone(), request.turn, completion, &request.idempotency_key)
                .await
                .map_err(|error| match error {
                job::StepError::Store(error) => store_status(error),
                job::StepError::Precondition(message) => OrchestratorError::Precondition(message).into(),
                job::StepError::Credit(message) => Status::unavailable(format!(
                    "returns and advantages: {message} (the step is recorded: retry it with the same key)"
                )),
            })?;
        let record = stepped.record;
        Ok(Response::new(pb::Observation {
            episode_id,
            turn: stepped.next_turn,
            prompt: stepped.next_prompt,
            reward: record.score.unwrap_or(0.0),
            evaluation: record.evaluation.clone(),
            done: stepped.done,
            record: Some(pb::TurnRecord { prompt: Vec::new(), completion: None, evaluation: None, ..record }),
            turns: stepped.turns,
        }))
    }

    async fn reject_mismatched(
        &self,
        request: Request<pb::RejectMismatchedRequest>,
    ) -> Result<Response<pb::RejectMismatchedResponse>, Status> {
        let request = request.into_inner();
        let job = self.job(&request.job_id).await?;
        if request.samples.is_empty() {
            return Err(OrchestratorError::invalid("samples", "required: at least one").into());
        }
        let mut positions = Vec::with_capacity(request.samples.len());
        for (i, sample) in request.samples.iter().enumerate() {
            let field = || format!("samples[{i}].cursor");
            let position = parse_cursor(&sample.cursor)
                .map_err(|_| OrchestratorError::invalid(field(), "not a cursor from ExportSamples"))?;
            positions.push(position.ok_or_else(|| OrchestratorError::invalid(field(), "required"))?);
        }
        let stored: HashMap<store::TurnPosition, pb::TurnRecord> =
            self.store.turns_after(&job.job_id, None, u32::MAX).await.map_err(store_status)?.into_iter().collect();
        let mut inputs = Vec::with_capacity(request.samples.len());
        for (i, (sample, position)) in request.samples.iter().zip(&positions).enumerate() {
            let Some(turn) = stored.get(position) else {
                let message = format!("job {} has no recorded sample {}", job.job_id, sample.cursor);
                return Err(OrchestratorError::invalid(format!("samples[{i}].cursor"), message).into());
            };
            inputs.push(reward::mismatch_input(i, &sample.cursor, turn, &sample.logprobs)?);
        }
        let mrs = job.spec.as_ref().and_then(|s| s.reward.as_ref()).and_then(|r| r.mrs).unwrap_or_default();
        let mut reward = pb::reward_client::RewardClient::new(self.channel("reward", &self.config.peers.reward).await?);
        let decided = reward
            .rejection_sample(pb::RejectionSampleRequest {
                method: Some(pb::rejection_sample_request::Method::Mrs(mrs)),
                seed: 0,
                outcomes: Vec::new(),
                trajectories: inputs,
            })
            .await
            .map_err(|status| Status::new(status.code(), format!("reward RejectionSample: {}", status.message())))?
            .into_inner();
        for (position, decision) in positions.iter().zip(&decided.decisions) {
            let mut turn = stored[position].clone();
            turn.keep = Some(turn.keep.unwrap_or(true) && decision.keep);
            self.store.put_turn(&job.job_id, position.0, store::Stage::Recorded, &turn).await.map_err(store_status)?;
        }
        Ok(Response::new(pb::RejectMismatchedResponse { decisions: decided.decisions, kept: decided.kept }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_reject_what_they_did_not_write() {
        assert_eq!(parse_cursor("").expect("empty"), None);
        assert_eq!(parse_cursor(&cursor((3, 1, 7))).expect("parses"), Some((3, 1, 7)));
        for bad in ["x", "1.2", "1.2.3.4", "1.-2.3"] {
            assert!(parse_cursor(bad).expect_err(bad).to_string().starts_with("cursor:"), "{bad}");
        }
    }

    #[test]
    fn job_ids_differ_within_a_process() {
        assert_ne!(new_job_id(0), new_job_id(1));
    }
}
