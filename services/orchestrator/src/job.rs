//! Running a job, from its checked spec to its final state: `run` (here) starts the job's episodes (task x
//! trajectory) in the job's order with bounded concurrency, waits for them, has the turns credited (returns and
//! advantages) once every episode has ended, and stores the job's final state. The service calls `run` for
//! submitted and resumed jobs and `step` for the step API; the parts of a job are submodules:
//!
//! - `plan`: the spec checked and resolved into what the job runs (tasks, recipe and templates, reward).
//! - `episode`: one trajectory's turns in order, each recorded before the next, resumed from the store.
//! - `turn`: one turn's stages: generated, evaluated, scored, diagnosed, its feedback made; `review`: cudaforge's
//!   profile and Judge calls for it; `failure`: why a turn failed (a call refused), typed, and its stored text.
//! - `progress`: the job's snapshot shared by its episodes, sent to watchers and stored; `breaker`: when turns that
//!   keep failing the same way fail the job.
//! - `peers`: the clients a turn calls, the limits on calls in flight, the retried evaluation.
//! - `step`: the step API: a trainer's responses run through the same turns.

mod breaker;
mod episode;
mod peers;
mod plan;
mod progress;
mod review;
mod step;
mod turn;

use std::sync::Arc;
use std::time::Instant;

use kforge_proto::v1 as pb;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

pub(crate) use peers::evaluate;
pub use peers::{Limits, Peers, RetryPolicy};
pub use plan::{Plan, task_set};
pub use step::{Answer, STEP_MODEL, StepError, Stepped, current, first_prompt, step};

use crate::reward;
use crate::store::{Store, StoreError};
use episode::Episode;
use progress::{Progress, slim};

/// Runs a job to its end, from wherever its stored turns leave it (a new job has none): episodes bounded by
/// `max_concurrent`, each turn's stages stored as they complete and the turn recorded before the next starts, the
/// job's snapshot (state, progress, metrics) written to the store and sent to watchers after every turn. `cancel`
/// stops the job: CANCELLED, unless `shutdown` is cancelled too (the orchestrator is stopping), which leaves the
/// job RUNNING in the store for the next start to resume. `failed_turns` recorded turns in a row that failed on a
/// service call for the same reason stop the job's episodes and fail it (0: never).
#[allow(clippy::too_many_arguments)]
pub async fn run(
    plan: Arc<Plan>,
    job: pb::Job,
    peers: Peers,
    store: Store,
    updates: watch::Sender<pb::JobProgress>,
    cancel: CancellationToken,
    shutdown: CancellationToken,
    max_concurrent: usize,
    failed_turns: u32,
) {
    let started = Instant::now();
    // A resumed job starts from its recorded turns; its episodes count again as each finds itself done.
    let recorded = match store.turns(&job.job_id).await {
        Ok(turns) => turns.iter().map(slim).collect(),
        Err(error) => {
            let progress = Progress::new(job, Vec::new(), store, updates, started, peers.metrics.clone());
            progress.finish(pb::JobState::Failed, format!("reading the job's turns: {error}")).await;
            return;
        }
    };
    let mut job = job;
    job.episodes_done = 0;
    // The episodes stop when the job is cancelled or when the breaker trips.
    let stop_episodes = cancel.child_token();
    let progress = Progress::new(job, recorded, store, updates, started, peers.metrics.clone());
    let progress = Arc::new(progress.with_breaker(failed_turns, stop_episodes.clone()));
    progress.set_state(pb::JobState::Running, String::new()).await;
    let episodes = start_episodes(&plan, &peers, &progress, &stop_episodes, max_concurrent).await;
    let failure = join_episodes(episodes).await;
    // The breaker's reason, where nothing else failed the job, comes before a stop or a cancel that came after it.
    match failure.or_else(|| progress.tripped().map(str::to_owned)) {
        Some(error) => progress.finish(pb::JobState::Failed, error).await,
        None if shutdown.is_cancelled() => {
            progress.stopped().await;
            let job_id = &progress.job_id;
            tracing::info!(%job_id, "job stopped here, left RUNNING to be resumed");
        }
        None if cancel.is_cancelled() => progress.finish(pb::JobState::Cancelled, String::new()).await,
        None => {
            let (state, error) = credit(&plan, &peers, &progress).await;
            progress.finish(state, error).await;
        }
    }
}

/// Spawns the job's episodes in its order (task, then trajectory), each once it holds one of `max_concurrent`
/// permits, until they are all started or `stop` is cancelled.
async fn start_episodes(
    plan: &Arc<Plan>,
    peers: &Peers,
    progress: &Arc<Progress>,
    stop: &CancellationToken,
    max_concurrent: usize,
) -> JoinSet<Result<(), StoreError>> {
    let limit = Arc::new(Semaphore::new(max_concurrent.max(1)));
    let mut episodes = JoinSet::new();
    let job_id = &progress.job_id;
    for (position, task) in plan.tasks.iter().enumerate() {
        for trajectory in 0..plan.spec.trajectories_per_task {
            let permit = tokio::select! {
                permit = limit.clone().acquire_owned() => permit.expect("the episode semaphore is never closed"),
                () = stop.cancelled() => return episodes,
            };
            let episode = Episode {
                plan: plan.clone(),
                task: task.clone(),
                position: position as i64,
                trajectory,
                peers: peers.clone(),
                progress: progress.clone(),
                cancel: stop.clone(),
            };
            // One trace per episode: its root span, a span per turn under it, and one per call to a peer under
            // the turn's, which the peer's own server span continues (W3C trace context in the call's metadata).
            let span =
                tracing::info_span!(parent: None, "episode", job_id = %job_id, task_id = %task.task_id, trajectory);
            episodes.spawn(
                async move {
                    let _permit = permit;
                    episode.run().await
                }
                .instrument(span),
            );
        }
    }
    episodes
}

/// Waits for every episode; the first failure among them (a store failure, a panic) is the job's.
async fn join_episodes(mut episodes: JoinSet<Result<(), StoreError>>) -> Option<String> {
    let mut failure = None;
    while let Some(joined) = episodes.join_next().await {
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                failure.get_or_insert(error.to_string());
            }
            Err(panic) => {
                failure.get_or_insert(format!("an episode panicked: {panic}"));
            }
        }
    }
    failure
}

/// Credits the turns of a job whose episodes have all ended (returns and advantages): the job's final state and
/// error.
async fn credit(plan: &Plan, peers: &Peers, progress: &Progress) -> (pb::JobState, String) {
    let position = |task_id: &str| plan.tasks.iter().position(|t| t.task_id == task_id).unwrap_or(0) as i64;
    let mut reward = peers.reward.clone();
    match reward::credit(&plan.reward, &mut reward, &progress.store, &progress.job_id, position).await {
        Ok(()) => (pb::JobState::Succeeded, String::new()),
        Err(error) => (pb::JobState::Failed, format!("returns and advantages: {error}")),
    }
}
