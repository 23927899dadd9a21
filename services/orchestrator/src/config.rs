//! The orchestrator's configuration, the `[orchestrator]` section of kforge.toml: where it listens, its peers and
//! how many calls each may take at once, its store, its instance name and leases, the GPU pools to discover, how a
//! busy evaluator is retried, the limits on a job's size, the named callers' quotas, and the failing-turns breaker. Deserialized with unknown keys refused; every field has a default, so an empty
//! section serves on loopback with the default ports (docs/ORCHESTRATOR.md, "Configuration").

use std::sync::Arc;

use kforge_server::client::ClientConfig;
use kforge_server::{ServerConfig, ServiceConfig};
use serde::{Deserialize, Serialize};

use crate::store;

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
    /// The largest job a submission may ask for (`[orchestrator.limits]`).
    pub limits: LimitsConfig,
    /// What each named caller may have at once and per hour (`[orchestrator.quotas]`).
    pub quotas: QuotasConfig,
    /// When a job whose turns keep failing is failed (`[orchestrator.breaker]`).
    pub breaker: BreakerConfig,
    /// The HTTP port and its protocol faces: KernelGym, OpenEnv, NeMo Gym, the Open Reward Standard
    /// (`[orchestrator.http]`, docs/faces/).
    pub http: HttpConfig,
}

/// The orchestrator's HTTP port: the protocol faces (each a thin layer over the step API and the evaluator) and
/// the JSON face of every unary method, behind the same bearer tokens as the gRPC port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Address of the HTTP port; empty: no HTTP port. Default `127.0.0.1:50056`.
    pub listen: String,
    /// The tasks the faces offer (an OpenEnv reset, a NeMo Gym seed or an ORS task names one by its id or
    /// index): `examples`, a KernelBench directory or a `.jsonl` file, as a job's `task_set`. Default `examples`.
    pub task_set: String,
    /// The recipe of a face's episodes: `single-turn`, `kevin` or `drkernel`. Default `kevin`.
    pub recipe: String,
    /// Turns of a face's episode (each submission of a kernel is one). Default 4.
    pub turns: u32,
    /// KernelGym evaluations remembered for `/status` and `/results`, the oldest forgotten first. Default 10000.
    pub kernelgym_results: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50056".into(),
            task_set: "examples".into(),
            recipe: "kevin".into(),
            turns: 4,
            kernelgym_results: 10_000,
        }
    }
}

/// The largest job SubmitJob and StartEpisode accept; a spec over one is INVALID_ARGUMENT naming its field and the
/// key. Each bounds what one job can make the orchestrator do and store: with the measured size of a turn in the
/// store, `total_turns` bounds a job's share of the disk (docs/orchestrator/LIMITS.md, "Limits"). 0: no limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Tasks, counted after resolving (`max_tasks` and `levels` applied). Default 10000 (KernelBench has 250).
    pub tasks: u64,
    /// `spec.trajectories_per_task`. Default 64 (GRPO groups are 4 to 16).
    pub trajectories_per_task: u64,
    /// `spec.turns`. Default 32 (Kevin trains on 4 to 8, CudaForge refines for 10).
    pub turns: u64,
    /// Tasks x trajectories x turns. Default 100000.
    pub total_turns: u64,
    /// Bytes of one task's source. Default 262144, the evaluator's default `max_source_bytes`: a larger source is
    /// refused by the evaluator at every turn. Set both together.
    pub task_source_bytes: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            tasks: 10_000,
            trajectories_per_task: 64,
            turns: 32,
            total_turns: 100_000,
            task_source_bytes: 256 * 1024,
        }
    }
}

/// Per named caller (a token of the server's `callers`): jobs in flight and turns asked for per hour. Calls with
/// the shared token, or without auth, name no caller and no quota applies to them. 0: no quota.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuotasConfig {
    /// The caller's queued and running jobs (step-API episodes not counted: a trainer may leave them unfinished).
    pub jobs_in_flight: u64,
    /// Turns (`turns_total`) of the jobs and episodes the caller submitted in the last hour, this one included.
    pub turns_per_hour: u64,
}

/// The failing-turns breaker: a job whose last `failed_turns` recorded turns all failed on a service call for the
/// same reason (the peer and the status code) is failed, instead of recording one failed episode after another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive failed turns that fail the job. Default 32; 0: off.
    pub failed_turns: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self { failed_turns: 32 }
    }
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

/// Why a [`DiscoveryConfig`] could not start; `key` is its config path (`orchestrator.discovery.evaluator`).
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("{key}.endpoints[{index}]: {text:?} is not an ip:port: {source}")]
    BadEndpoint { key: &'static str, index: usize, text: String, source: std::net::AddrParseError },
    #[error("{key}.service: no Kubernetes API client (a pod's service account, or KUBECONFIG): {source}")]
    NoKubeClient { key: &'static str, source: kforge_discovery::KubeError },
    #[error("{key}: name exactly one of `endpoints` (a static list) and `service` (Kubernetes)")]
    NotExactlyOne { key: &'static str },
}

impl DiscoveryConfig {
    /// Starts the discovery this config names; `key` is its config path, for errors.
    pub(crate) async fn start(
        &self,
        key: &'static str,
    ) -> Result<Arc<dyn kforge_discovery::Discovery>, DiscoveryError> {
        match (self.endpoints.is_empty(), self.service.is_empty()) {
            (false, true) => {
                let mut addresses = Vec::new();
                for (index, text) in self.endpoints.iter().enumerate() {
                    let address: std::net::SocketAddr = text.parse().map_err(|source| DiscoveryError::BadEndpoint {
                        key,
                        index,
                        text: text.clone(),
                        source,
                    })?;
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
                let discovery = kforge_discovery::KubeDiscovery::start_in_environment(target)
                    .await
                    .map_err(|source| DiscoveryError::NoKubeClient { key, source })?;
                Ok(Arc::new(discovery))
            }
            _ => Err(DiscoveryError::NotExactlyOne { key }),
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
            limits: LimitsConfig::default(),
            quotas: QuotasConfig::default(),
            breaker: BreakerConfig::default(),
            http: HttpConfig::default(),
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
