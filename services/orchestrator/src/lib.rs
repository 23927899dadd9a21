//! The Orchestrator service: runs jobs of episodes (task x trajectory x turn) through the gateway, evaluator and
//! reward services and keeps every turn's record. This slice serves SubmitJob, GetJob, WatchJob, CancelJob and
//! ListTrajectories with the `single-turn` and `kevin` recipes and an in-memory store; ExportSamples and the step
//! API answer UNIMPLEMENTED until their part of the orchestrator work lands (docs/ORCHESTRATOR.md).

pub mod error;
pub mod job;
pub mod metrics;
pub mod recipe;
pub mod store;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_server::{Orchestrator, OrchestratorServer};
use kforge_server::client::ClientConfig;
use kforge_server::{Host, ServeError, ServerConfig, ServiceConfig, not_yet_implemented};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};

pub use error::OrchestratorError;
use job::{Peers, Plan};
use store::{JobStore, MemoryStore};

/// What brings the RPCs not built yet.
const CAPABILITY: &str = "the orchestrator's export and step API";

/// Configuration of the Orchestrator service (`[orchestrator]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OrchestratorConfig {
    pub server: ServerConfig,
    /// The services a job calls (`[orchestrator.peers]`).
    pub peers: PeersConfig,
    /// Episodes run at once per job when its spec names no limit. Default 4.
    pub max_concurrent_episodes: u32,
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
    /// TLS and token for calling them.
    pub client: ClientConfig,
}

impl Default for PeersConfig {
    fn default() -> Self {
        Self {
            gateway: "http://127.0.0.1:50054".into(),
            evaluator: "http://127.0.0.1:50051".into(),
            reward: "http://127.0.0.1:50053".into(),
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
        }
    }
}

impl ServiceConfig for OrchestratorConfig {
    const SECTION: &'static str = "orchestrator";
    fn server(&self) -> &ServerConfig {
        &self.server
    }
}

/// Serves the Orchestrator service on `listener` until `shutdown` completes. Running jobs are cancelled when
/// `shutdown` completes (before the drain, so that their watchers' streams end), and awaited before returning.
pub async fn serve(
    config: OrchestratorConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut host = Host::new("orchestrator", &config.server)?;
    let limit = host.max_message_bytes();
    let service = OrchestratorService::new(config, Arc::new(MemoryStore::default()));
    let (jobs, stop) = (service.tracker.clone(), service.stop.clone());
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
    updates: watch::Receiver<pb::Job>,
    cancel: CancellationToken,
}

/// The `kforge.v1.Orchestrator` implementation.
#[derive(Debug, Clone)]
pub struct OrchestratorService {
    config: Arc<OrchestratorConfig>,
    store: Arc<dyn JobStore>,
    running: Arc<Mutex<HashMap<String, Running>>>,
    /// Owner of every job's task: cancelled and awaited at shutdown.
    tracker: TaskTracker,
    stop: CancellationToken,
    next_id: Arc<AtomicU64>,
}

impl OrchestratorService {
    pub fn new(config: OrchestratorConfig, store: Arc<dyn JobStore>) -> Self {
        Self {
            config: Arc::new(config),
            store,
            running: Arc::default(),
            tracker: TaskTracker::new(),
            stop: CancellationToken::new(),
            next_id: Arc::default(),
        }
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, Running>> {
        // Inserts and lookups only: a panic elsewhere cannot leave the map half-changed.
        self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn connect(&self) -> Result<Peers, OrchestratorError> {
        let peers = &self.config.peers;
        let channel = |peer: &'static str, url: &str| {
            let url = url.to_owned();
            let client = peers.client.clone();
            async move {
                kforge_server::client::connect(&url, &client).await.map_err(|error| {
                    OrchestratorError::PeerUnavailable { peer, url: url.clone(), message: error.to_string() }
                })
            }
        };
        Ok(Peers {
            gateway: pb::gateway_client::GatewayClient::new(channel("gateway", &peers.gateway).await?),
            evaluator: pb::evaluator_client::EvaluatorClient::new(channel("evaluator", &peers.evaluator).await?),
            reward: pb::reward_client::RewardClient::new(channel("reward", &peers.reward).await?),
        })
    }

    async fn job(&self, job_id: &str) -> Result<pb::Job, Status> {
        if job_id.is_empty() {
            return Err(OrchestratorError::invalid("job_id", "required").into());
        }
        let job = self.store.job(job_id).await.map_err(store_status)?;
        Ok(job.ok_or_else(|| OrchestratorError::JobNotFound(job_id.to_owned()))?)
    }
}

fn store_status(error: store::StoreError) -> Status {
    match error {
        store::StoreError::Unavailable(_) => Status::unavailable(error.to_string()),
    }
}

fn is_terminal(state: i32) -> bool {
    matches!(
        pb::JobState::try_from(state),
        Ok(pb::JobState::Succeeded | pb::JobState::Failed | pb::JobState::Cancelled)
    )
}

/// Now as a protobuf timestamp.
pub(crate) fn now() -> prost_types::Timestamp {
    prost_types::Timestamp::from(std::time::SystemTime::now())
}

#[tonic::async_trait]
impl Orchestrator for OrchestratorService {
    async fn submit_job(&self, request: Request<pb::SubmitJobRequest>) -> Result<Response<pb::Job>, Status> {
        let request = request.into_inner();
        let spec = request.spec.ok_or_else(|| OrchestratorError::invalid("spec", "required"))?;
        if let Some(job) = self.store.job_by_key(&request.idempotency_key).await.map_err(store_status)? {
            return Ok(Response::new(job));
        }
        // A KernelBench directory is read from disk: off the async threads.
        let plan = tokio::task::spawn_blocking(move || Plan::new(spec))
            .await
            .map_err(|error| Status::internal(format!("resolving the task set panicked: {error}")))??;
        let plan = Arc::new(plan);
        let peers = self.connect().await?;
        let sequence = self.next_id.fetch_add(1, Ordering::Relaxed);
        let millis = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let job = pb::Job {
            job_id: format!("job-{millis}-{sequence}"),
            spec: Some(plan.spec.clone()),
            state: pb::JobState::Queued.into(),
            episodes_total: plan.episodes(),
            turns_total: plan.turns_total(),
            metrics: Some(metrics::job_metrics(&[], 0.0)),
            created_at: Some(now()),
            updated_at: Some(now()),
            ..Default::default()
        };
        self.store.put_job(&job, &request.idempotency_key).await.map_err(store_status)?;
        let task_ids: Vec<String> = plan.tasks.iter().map(|t| t.task_id.clone()).collect();
        self.store.put_task_order(&job.job_id, &task_ids).await.map_err(store_status)?;
        let (updates, receiver) = watch::channel(job.clone());
        let cancel = self.stop.child_token();
        self.running().insert(job.job_id.clone(), Running { updates: receiver, cancel: cancel.clone() });
        let max_concurrent = match plan.spec.max_concurrent_episodes {
            0 => self.config.max_concurrent_episodes,
            n => n,
        } as usize;
        tracing::info!(job_id = %job.job_id, episodes = job.episodes_total, turns = job.turns_total, "job submitted");
        self.tracker.spawn(job::run(plan, job.clone(), peers, self.store.clone(), updates, cancel, max_concurrent));
        Ok(Response::new(job))
    }

    async fn get_job(&self, request: Request<pb::GetJobRequest>) -> Result<Response<pb::Job>, Status> {
        Ok(Response::new(self.job(&request.into_inner().job_id).await?))
    }

    type WatchJobStream = BoxStream<pb::Job>;

    async fn watch_job(&self, request: Request<pb::GetJobRequest>) -> Result<Response<Self::WatchJobStream>, Status> {
        let job = self.job(&request.into_inner().job_id).await?;
        let receiver = self.running().get(&job.job_id).map(|r| r.updates.clone());
        // The job's task drops the sender once the job is terminal: the stream yields the last state and ends.
        let stream: Self::WatchJobStream = match receiver {
            Some(receiver) => {
                Box::pin(tokio_stream::StreamExt::map(tokio_stream::wrappers::WatchStream::new(receiver), Ok))
            }
            None => Box::pin(tokio_stream::once(Ok(job))),
        };
        Ok(Response::new(stream))
    }

    async fn cancel_job(&self, request: Request<pb::CancelJobRequest>) -> Result<Response<pb::Job>, Status> {
        let job = self.job(&request.into_inner().job_id).await?;
        if !is_terminal(job.state)
            && let Some(running) = self.running().get(&job.job_id)
        {
            running.cancel.cancel();
        }
        Ok(Response::new(job))
    }

    async fn list_trajectories(
        &self,
        request: Request<pb::ListTrajectoriesRequest>,
    ) -> Result<Response<pb::ListTrajectoriesResponse>, Status> {
        let request = request.into_inner();
        let job = self.job(&request.job_id).await?;
        let offset: usize = match request.page_token.as_str() {
            "" => 0,
            token => {
                token.parse().map_err(|_| OrchestratorError::invalid("page_token", "not a token from this job"))?
            }
        };
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

    async fn export_samples(
        &self,
        _request: Request<pb::ExportSamplesRequest>,
    ) -> Result<Response<pb::ExportSamplesResponse>, Status> {
        Err(not_yet_implemented("Orchestrator/ExportSamples", CAPABILITY))
    }

    async fn start_episode(
        &self,
        _request: Request<pb::StartEpisodeRequest>,
    ) -> Result<Response<pb::Observation>, Status> {
        Err(not_yet_implemented("Orchestrator/StartEpisode", CAPABILITY))
    }

    async fn step(&self, _request: Request<pb::StepRequest>) -> Result<Response<pb::Observation>, Status> {
        Err(not_yet_implemented("Orchestrator/Step", CAPABILITY))
    }
}
