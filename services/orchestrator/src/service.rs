//! The service's state and the jobs it runs: the store, the peers' pools and in-flight limits, and the jobs running
//! in this process. Starting a job (its task, its lease renewed beside it), resuming one from the store (at start,
//! on ResumeJob, or taking over another instance's whose lease ran out), and connecting a job's peers live here;
//! the gRPC handlers (`grpc.rs`) validate requests and call these.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kforge_proto::v1 as pb;
use kforge_server::client::Channel;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;

use crate::balance::Balancer;
use crate::config::OrchestratorConfig;
use crate::error::{OrchestratorError, store_status};
use crate::job::{self, Limits, Peers, Plan};
use crate::monitoring::OrchestratorMetrics;
use crate::store::Store;
use crate::{now, recipe};

/// A job's live handles.
#[derive(Debug)]
pub(crate) struct Running {
    pub(crate) updates: watch::Receiver<pb::JobProgress>,
    pub(crate) cancel: CancellationToken,
}

/// The `kforge.v1.Orchestrator` implementation.
#[derive(Debug, Clone)]
pub struct OrchestratorService {
    pub(crate) config: Arc<OrchestratorConfig>,
    pub(crate) store: Store,
    limits: Arc<Limits>,
    /// The evaluator and profiler pools every job's calls are spread over.
    evaluators: Arc<Balancer>,
    profilers: Arc<Balancer>,
    running: Arc<Mutex<HashMap<String, Running>>>,
    /// Owner of every job's task (and of every export's reader): cancelled and awaited at shutdown.
    pub(crate) tracker: TaskTracker,
    pub(crate) stop: CancellationToken,
    next_id: Arc<AtomicU64>,
    metrics: OrchestratorMetrics,
    /// Held from a named caller's quota check until its job is stored, so that two submissions of one caller do
    /// not both fit the room left for one (within this process; replicas sharing a store each check apart).
    admission: Arc<tokio::sync::Mutex<()>>,
}

/// What a submission counts against its caller's quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Submission {
    /// A job: one in flight, and its turns.
    Job { turns: u64 },
    /// A step-API episode: its turns only (a trainer may leave an episode unfinished).
    Episode { turns: u64 },
}

/// The window of `quotas.turns_per_hour`.
const HOUR_MS: i64 = 3_600_000;

impl OrchestratorService {
    pub fn new(config: OrchestratorConfig, store: Store, metrics: OrchestratorMetrics) -> Self {
        let limits = Limits::new(&config.max_in_flight, &config.retry);
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
            admission: Arc::default(),
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

    pub(crate) fn lease(&self) -> Duration {
        Duration::from_millis(self.config.lease_ms.max(3))
    }

    pub(crate) fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, Running>> {
        // Inserts, removals and lookups only: a panic elsewhere cannot leave the map half-changed.
        self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A job id not used before (`new_job_id`).
    pub(crate) fn next_job_id(&self) -> String {
        new_job_id(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// A channel to `peer` at `url` (UNAVAILABLE naming both when it cannot be reached).
    pub(crate) async fn channel(&self, peer: &'static str, url: &str) -> Result<Channel, OrchestratorError> {
        kforge_server::client::connect(url, &self.config.peers.client).await.map_err(|error| {
            OrchestratorError::PeerUnavailable { peer, url: url.to_owned(), message: error.to_string() }
        })
    }

    /// Clients of the services `plan` calls. The profiler is one of them for `cudaforge` on a GPU backend (a
    /// missing one is UNAVAILABLE), and is tried for `cudaforge` on the evaluator's default backend (which is the
    /// CPU where no GPU is: then the recipe gives correction-only feedback and says so).
    pub(crate) async fn connect(&self, plan: &Plan) -> Result<Peers, OrchestratorError> {
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

    /// Evaluates `request` on this orchestrator's evaluator pool, retrying a busy evaluator as a turn's call does
    /// (the KernelGym face's evaluations).
    pub async fn evaluate(&self, request: pb::EvaluateRequest) -> Result<pb::EvaluateResponse, Status> {
        self.evaluators.check().await?;
        crate::job::evaluate(&self.evaluators, &self.limits, request, &self.stop).await
    }

    /// Checks a named caller's quotas for `submission` (RESOURCE_EXHAUSTED naming the quota, with `retry-after-ms`
    /// when the turns of the last hour leave room later) and returns the admission lock, to hold until the job is
    /// stored. Without a caller (the shared token, or no auth) or without quotas, nothing is checked.
    pub(crate) async fn admit(
        &self,
        caller: Option<&str>,
        submission: Submission,
    ) -> Result<Option<tokio::sync::OwnedMutexGuard<()>>, Status> {
        let quotas = &self.config.quotas;
        let Some(caller) = caller.filter(|_| quotas.jobs_in_flight > 0 || quotas.turns_per_hour > 0) else {
            return Ok(None);
        };
        let over = |detail: String, key: &'static str, retry_after: Option<Duration>| -> Status {
            OrchestratorError::OverQuota { caller: caller.to_owned(), detail, key, retry_after }.into()
        };
        let admission = self.admission.clone().lock_owned().await;
        let turns = match submission {
            Submission::Job { turns } if quotas.jobs_in_flight > 0 => {
                let in_flight = self.store.caller_jobs_in_flight(caller).await.map_err(store_status)?;
                if in_flight >= quotas.jobs_in_flight {
                    // No time to suggest: room comes when one of the caller's jobs ends.
                    let detail = format!("{in_flight} jobs queued or running, the quota is {}", quotas.jobs_in_flight);
                    return Err(over(detail, "orchestrator.quotas.jobs_in_flight", None));
                }
                turns
            }
            Submission::Job { turns } => turns,
            Submission::Episode { turns } => turns,
        };
        if quotas.turns_per_hour > 0 {
            let key = "orchestrator.quotas.turns_per_hour";
            if turns > quotas.turns_per_hour {
                let detail =
                    format!("{turns} turns asked for, more than the quota of {} per hour", quotas.turns_per_hour);
                return Err(over(detail, key, None));
            }
            let now = now_ms();
            let recent = self.store.caller_turns_since(caller, now - HOUR_MS).await.map_err(store_status)?;
            if let Some(wait) = turns_quota_wait(&recent, turns, quotas.turns_per_hour, now) {
                let used: u64 = recent.iter().map(|(_, turns)| turns).sum();
                let detail = format!(
                    "{used} turns asked for in the last hour and {turns} now, the quota is {} per hour",
                    quotas.turns_per_hour
                );
                return Err(over(detail, key, Some(wait)));
            }
        }
        Ok(Some(admission))
    }

    /// The stored job `job_id` (INVALID_ARGUMENT when empty, NOT_FOUND when unknown).
    pub(crate) async fn job(&self, job_id: &str) -> Result<pb::Job, Status> {
        check_job_id("job_id", job_id)?;
        let job = self.store.job(job_id).await.map_err(store_status)?;
        Ok(job.ok_or_else(|| OrchestratorError::JobNotFound(job_id.to_owned()))?)
    }

    /// Starts the job's task here (its turns so far are in the store), unless it already runs here.
    pub(crate) fn start(&self, plan: Plan, job: pb::Job, peers: Peers) {
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
        let failed_turns = self.config.breaker.failed_turns;
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
            job::run(Arc::new(plan), job, peers, store, updates, cancel, halt, max_concurrent, failed_turns).await;
            finished.cancel();
            if let Err(error) = renewal.await {
                tracing::error!(%job_id, %error, "the lease renewal task failed");
            }
            // A finished job is read from the store from now on; ResumeJob may start it again.
            running.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&job_id);
        });
    }

    /// Takes the job over and runs its unfinished turns here.
    pub(crate) async fn resume(&self, job_id: &str) -> Result<pb::Job, Status> {
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
            .claim(job_id, &self.config.instance, now_ms(), lease_until(self.lease()))
            .await
            .map_err(store_status)?;
        if let Err((owner, until_ms)) = claimed {
            let left_s = (until_ms - now_ms()).max(0) as f64 / 1000.0;
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
    pub(crate) async fn take_over_orphans(&self) {
        let mut sweep = tokio::time::interval(self.lease() / 3);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = sweep.tick() => {}
                () = self.stop.cancelled() => return,
            }
            let orphans = match self.store.orphaned_jobs(&self.config.instance, now_ms()).await {
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

/// How long until `turns` more fit a quota of `per_hour` beside `recent` (each job's creation time and turns, oldest
/// first, all within the hour before `now_ms`): as each leaves the hour, its turns free up. None when they fit now.
fn turns_quota_wait(recent: &[(i64, u64)], turns: u64, per_hour: u64, now_ms: i64) -> Option<Duration> {
    let mut used: u64 = recent.iter().map(|(_, turns)| turns).sum();
    if used.saturating_add(turns) <= per_hour {
        return None;
    }
    for (created_ms, job_turns) in recent {
        used = used.saturating_sub(*job_turns);
        if used.saturating_add(turns) <= per_hour {
            let leaves = created_ms + HOUR_MS - now_ms;
            return Some(Duration::from_millis(u64::try_from(leaves).unwrap_or(0).max(1)));
        }
    }
    // Only a turns count above the quota itself never fits; the caller refuses that apart.
    Some(Duration::from_millis(u64::try_from(HOUR_MS).unwrap_or(0)))
}

/// `lease` from now, in milliseconds since the Unix epoch.
pub(crate) fn lease_until(lease: Duration) -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from((now + lease).as_millis()).unwrap_or(i64::MAX)
}

/// Now, in milliseconds since the Unix epoch (the clock leases are compared with).
pub(crate) fn now_ms() -> i64 {
    lease_until(Duration::ZERO)
}

/// A job id unique across restarts and orchestrators sharing a store: the time, a per-process random part and a
/// sequence.
/// The longest job id looked up, in bytes; ids this service writes are about 30.
const MAX_JOB_ID_BYTES: usize = 128;

/// A job id worth looking up (`field` names where it came from): present, not longer than any id, and without
/// control characters (a NUL is not text to PostgreSQL). Anything else that no job has is NOT_FOUND.
pub(crate) fn check_job_id(field: &str, job_id: &str) -> Result<(), OrchestratorError> {
    if job_id.is_empty() {
        return Err(OrchestratorError::invalid(field, "required"));
    }
    if job_id.len() > MAX_JOB_ID_BYTES {
        let message = format!("{} bytes, longer than any job id (at most {MAX_JOB_ID_BYTES})", job_id.len());
        return Err(OrchestratorError::invalid(field, message));
    }
    if job_id.chars().any(char::is_control) {
        return Err(OrchestratorError::invalid(field, "contains a control character"));
    }
    Ok(())
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_turns_quota_frees_as_the_hour_s_jobs_leave_it() {
        let hour = HOUR_MS;
        let recent = [(1_000, 60), (5_000, 30)];
        let now = 10_000;
        assert_eq!(turns_quota_wait(&recent, 10, 100, now), None, "90 + 10 fit 100");
        assert_eq!(
            turns_quota_wait(&recent, 11, 100, now),
            Some(Duration::from_millis((1_000 + hour - now) as u64)),
            "room once the first job leaves the hour"
        );
        assert_eq!(
            turns_quota_wait(&recent, 80, 100, now),
            Some(Duration::from_millis((5_000 + hour - now) as u64)),
            "room once both have left"
        );
        assert_eq!(turns_quota_wait(&[], 100, 100, now), None);
    }

    #[test]
    fn job_ids_differ_within_a_process() {
        assert_ne!(new_job_id(0), new_job_id(1));
    }
}
