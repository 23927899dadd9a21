//! A job from spec to metrics: the spec checked and resolved into a plan (tasks, recipe, templates), then its
//! episodes (task x trajectory) run with bounded concurrency, each turn generated through the gateway, its kernel
//! extracted, evaluated, scored and diagnosed, and its record written to the store before the next turn starts.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kforge_proto::v1 as pb;
use kforge_proto::v1::evaluator_client::EvaluatorClient;
use kforge_proto::v1::gateway_client::GatewayClient;
use kforge_proto::v1::profiler_client::ProfilerClient;
use kforge_proto::v1::reward_client::RewardClient;
use kforge_server::client::Channel;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::balance::Balancer;
use crate::error::OrchestratorError;
use crate::judge::{self, Mode, ProfileView};
use crate::metrics::job_metrics;
use crate::monitoring::OrchestratorMetrics;
use crate::recipe::{self, Attempt, Recipe, Templates};
use crate::reward::{self, RewardPlan};
use crate::store::{Stage, Store, StoreError};

/// A checked spec, with its tasks resolved.
#[derive(Debug, Clone)]
pub struct Plan {
    pub spec: pb::JobSpec,
    pub recipe: Recipe,
    pub templates: Templates,
    /// How its turns are scored and credited.
    pub reward: RewardPlan,
    /// Whether its evaluations count the kernels that ran: drkernel's feedback, a formula's profiling ratio, PRS.
    pub census: bool,
    /// Whether responses must keep to the strict format to be evaluated (`JobSpec.strict_format`).
    pub strict_format: bool,
    pub tasks: Vec<pb::Task>,
}

impl Plan {
    /// Validates `spec` (INVALID_ARGUMENT naming the field) and resolves its task set.
    pub fn new(spec: pb::JobSpec) -> Result<Self, OrchestratorError> {
        if spec.kind() == pb::JobKind::Unspecified {
            return Err(OrchestratorError::invalid("spec.kind", "required: JOB_KIND_ROLLOUT or JOB_KIND_EVALUATION"));
        }
        let recipe = Recipe::parse(&spec.recipe)?;
        if spec.model.is_empty() {
            return Err(OrchestratorError::invalid("spec.model", "required"));
        }
        if spec.trajectories_per_task == 0 {
            return Err(OrchestratorError::invalid("spec.trajectories_per_task", "must be at least 1"));
        }
        if spec.turns == 0 {
            return Err(OrchestratorError::invalid("spec.turns", "must be at least 1"));
        }
        let prompt_dir = (!spec.prompt_dir.is_empty()).then(|| Path::new(&spec.prompt_dir));
        if let Some(dir) = prompt_dir.filter(|d| !d.is_dir()) {
            return Err(OrchestratorError::invalid("spec.prompt_dir", format!("{} is not a directory", dir.display())));
        }
        let mut templates = Templates::load(recipe, prompt_dir)?;
        if spec.context_window > 0 {
            templates.window = spec.context_window;
        }
        templates.budget_chars = spec.context_budget_chars as usize;
        let reward = RewardPlan::new(recipe, spec.reward.as_ref(), spec.seed)?;
        if let Some(diagnose) = &spec.diagnose {
            check_diagnose(diagnose)?;
        }
        let mut tasks = resolve_tasks(&spec)?;
        if spec.max_tasks > 0 {
            tasks.truncate(spec.max_tasks as usize);
        }
        let census = recipe == Recipe::DrKernel || reward.needs_census() || reward.prs.is_some();
        let strict_format = recipe::strict_format(&spec);
        Ok(Self { spec, recipe, templates, reward, census, strict_format, tasks })
    }

    /// The plan of a stored job: its spec checked again and its templates read again, with the tasks it was
    /// resolved to at submission (a task directory may have changed since).
    pub fn resumed(spec: pb::JobSpec, tasks: Vec<pb::Task>) -> Result<Self, OrchestratorError> {
        let inline = pb::JobSpec {
            task_set: "inline".into(),
            tasks: tasks.clone(),
            max_tasks: 0,
            levels: Vec::new(),
            ..spec.clone()
        };
        let plan = Self::new(inline)?;
        Ok(Self { spec, tasks, ..plan })
    }

    pub fn episodes(&self) -> u64 {
        self.tasks.len() as u64 * u64::from(self.spec.trajectories_per_task)
    }

    pub fn turns_total(&self) -> u64 {
        self.episodes() * u64::from(self.spec.turns)
    }

    /// A new turn's record of `completion`: its kernel, and under the strict format policy what breaks it.
    fn read_completion(&self, mut record: pb::TurnRecord, completion: pb::Completion) -> pb::TurnRecord {
        record.kernel = kforge_model_text::extract_kernel(&completion.text).unwrap_or_default().to_owned();
        if self.strict_format
            && let Err(error) = kforge_model_text::check_strict_format(&completion.text, &completion.finish_reason)
        {
            record.format_error = error.to_string();
        }
        record.completion = Some(completion);
        record
    }
}

/// The job's diagnosis parameters, as the reward service would refuse them (INVALID_ARGUMENT naming the field).
fn check_diagnose(params: &pb::DiagnoseParams) -> Result<(), OrchestratorError> {
    if params.not_okay_off && params.opening.is_some() {
        return Err(OrchestratorError::invalid("spec.diagnose.opening", "must be unset when not_okay_off is true"));
    }
    if params.opening.as_deref().is_some_and(|opening| opening.trim().is_empty()) {
        return Err(OrchestratorError::invalid("spec.diagnose.opening", "empty: leave it unset for the default"));
    }
    if let Some(threshold) = params.repetition_threshold.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(OrchestratorError::invalid(
            "spec.diagnose.repetition_threshold",
            format!("must be in [0, 1], got {threshold}"),
        ));
    }
    Ok(())
}

fn resolve_tasks(spec: &pb::JobSpec) -> Result<Vec<pb::Task>, OrchestratorError> {
    let field = "spec.task_set";
    if !spec.tasks.is_empty() && spec.task_set != "inline" {
        return Err(OrchestratorError::invalid("spec.tasks", "inline tasks need task_set `inline`"));
    }
    let tasks: Vec<pb::Task> = match spec.task_set.as_str() {
        "" => {
            return Err(OrchestratorError::invalid(field, "required: `examples`, `inline` or a KernelBench directory"));
        }
        "examples" => kforge_evaluator::tasks::examples()
            .into_iter()
            .map(|t| pb::Task { task_id: t.id, source: t.source })
            .collect(),
        "inline" => {
            for (i, task) in spec.tasks.iter().enumerate() {
                if task.task_id.is_empty() || task.source.trim().is_empty() {
                    return Err(OrchestratorError::invalid(format!("spec.tasks[{i}]"), "needs a task_id and a source"));
                }
                if spec.tasks[..i].iter().any(|t| t.task_id == task.task_id) {
                    return Err(OrchestratorError::invalid(
                        format!("spec.tasks[{i}]"),
                        format!("task_id `{}` appears twice", task.task_id),
                    ));
                }
            }
            spec.tasks.clone()
        }
        path if path.ends_with(".jsonl") => jsonl_tasks(Path::new(path))?,
        path => {
            let dir = Path::new(path);
            if !dir.is_dir() {
                return Err(OrchestratorError::invalid(
                    field,
                    format!("{path} is not a directory (a KernelBench directory) or a .jsonl file"),
                ));
            }
            let (tasks, _rejected) = kforge_evaluator::tasks::import_kernelbench(dir)
                .map_err(|e| OrchestratorError::invalid(field, e.to_string()))?;
            tasks
                .into_iter()
                .filter(|t| {
                    spec.levels.is_empty() || spec.levels.iter().any(|l| t.id.starts_with(&format!("level{l}/")))
                })
                .map(|t| pb::Task { task_id: t.id, source: t.source })
                .collect()
        }
    };
    if !spec.levels.is_empty() && !Path::new(&spec.task_set).is_dir() {
        return Err(OrchestratorError::invalid("spec.levels", "only a KernelBench directory has levels"));
    }
    if tasks.is_empty() {
        return Err(OrchestratorError::invalid(field, format!("`{}` holds no tasks", spec.task_set)));
    }
    Ok(tasks)
}

/// A JSONL task set: one `{"task_id": "...", "source": "..."}` object per line (blank lines skipped), each source a
/// KernelBench-format task; the first line that is not one is INVALID_ARGUMENT naming it.
fn jsonl_tasks(path: &Path) -> Result<Vec<pb::Task>, OrchestratorError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        task_id: String,
        source: String,
    }
    let field = "spec.task_set";
    let text = std::fs::read_to_string(path)
        .map_err(|e| OrchestratorError::invalid(field, format!("cannot read {}: {e}", path.display())))?;
    let mut tasks: Vec<pb::Task> = Vec::new();
    for (index, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = |message: String| {
            OrchestratorError::invalid(field, format!("{} line {}: {message}", path.display(), index + 1))
        };
        let task: Line = serde_json::from_str(line).map_err(|e| at(format!("not a task object: {e}")))?;
        if task.task_id.is_empty() {
            return Err(at("task_id is empty".into()));
        }
        if tasks.iter().any(|t| t.task_id == task.task_id) {
            return Err(at(format!("task_id `{}` appears twice", task.task_id)));
        }
        kforge_evaluator::statics::check_task(&task.source)
            .map_err(|reason| at(format!("source is not a task: {reason}")))?;
        tasks.push(pb::Task { task_id: task.task_id, source: task.source });
    }
    Ok(tasks)
}

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

impl RetryPolicy {
    fn backoff(&self, failures: u32) -> Duration {
        let factor = 2u32.saturating_pow(failures.saturating_sub(1));
        self.initial_backoff.saturating_mul(factor).min(self.max_backoff)
    }
}

/// Turns in flight by stage, for WatchJob.
#[derive(Debug, Default)]
struct InFlight {
    generating: AtomicU64,
    evaluating: AtomicU64,
    scoring: AtomicU64,
}

/// Counts a turn into a stage, in its job's count and across jobs, for as long as it lives.
struct StageGuard<'a>(&'a AtomicU64, Gauge);

impl<'a> StageGuard<'a> {
    fn enter(counter: &'a AtomicU64, across_jobs: Gauge) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        across_jobs.inc();
        Self(counter, across_jobs)
    }
}

impl Drop for StageGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        self.1.dec();
    }
}

/// Runs a job to its end, from wherever its stored turns leave it (a new job has none): episodes bounded by
/// `max_concurrent`, each turn's stages stored as they complete and the turn recorded before the next starts, the
/// job's snapshot (state, progress, metrics) written to the store and sent to watchers after every turn. `cancel`
/// stops the job: CANCELLED, unless `shutdown` is cancelled too (the orchestrator is stopping), which leaves the
/// job RUNNING in the store for the next start to resume.
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
    let progress = Arc::new(Progress::new(job, recorded, store, updates, started, peers.metrics.clone()));
    progress.set_state(pb::JobState::Running, String::new()).await;
    let limit = Arc::new(Semaphore::new(max_concurrent.max(1)));
    let mut episodes = JoinSet::new();
    let job_id = progress.job_id.clone();
    // Episodes start in the job's order (task, then trajectory): each takes its permit before it is spawned.
    'start: for (position, task) in plan.tasks.iter().enumerate() {
        for trajectory in 0..plan.spec.trajectories_per_task {
            let permit = tokio::select! {
                permit = limit.clone().acquire_owned() => permit.expect("the episode semaphore is never closed"),
                () = cancel.cancelled() => break 'start,
            };
            let episode = Episode {
                plan: plan.clone(),
                task: task.clone(),
                position: position as i64,
                trajectory,
                peers: peers.clone(),
                progress: progress.clone(),
                cancel: cancel.clone(),
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
    let (state, error) = match failure {
        Some(error) => (pb::JobState::Failed, error),
        None if shutdown.is_cancelled() => {
            progress.stopped().await;
            let job_id = &progress.job_id;
            tracing::info!(%job_id, "job stopped here, left RUNNING to be resumed");
            return;
        }
        None if cancel.is_cancelled() => (pb::JobState::Cancelled, String::new()),
        None => {
            let position = |task_id: &str| plan.tasks.iter().position(|t| t.task_id == task_id).unwrap_or(0) as i64;
            let mut reward = peers.reward.clone();
            let store = &progress.store;
            match reward::credit(&plan.reward, &mut reward, store, &progress.job_id, position).await {
                Ok(()) => (pb::JobState::Succeeded, String::new()),
                Err(error) => (pb::JobState::Failed, format!("returns and advantages: {error}")),
            }
        }
    };
    progress.finish(state, error).await;
}

/// What the job's metrics need of a turn: the record without its prompt, completion, feedback and the bulk of its
/// evaluation.
fn slim(turn: &pb::TurnRecord) -> pb::TurnRecord {
    pb::TurnRecord {
        prompt: Vec::new(),
        completion: None,
        // The verdict, speedups and findings, without logs, outputs and timings.
        evaluation: turn.evaluation.as_ref().map(|e| pb::EvaluateResponse {
            verdict: e.verdict,
            speedup_eager: e.speedup_eager,
            speedup_compile: e.speedup_compile,
            findings: e.findings.clone(),
            ..Default::default()
        }),
        feedback: String::new(),
        prompt_token_ids: Vec::new(),
        ..turn.clone()
    }
}

/// The job's snapshot, shared by its episodes.
#[derive(Debug)]
struct Progress {
    job_id: String,
    job: tokio::sync::Mutex<Snapshot>,
    store: Store,
    updates: watch::Sender<pb::JobProgress>,
    started: Instant,
    in_flight: InFlight,
    /// The orchestrator's Prometheus metrics (every job's turns and stages count there too).
    metrics: OrchestratorMetrics,
}

#[derive(Debug)]
struct Snapshot {
    job: pb::Job,
    /// Every recorded turn, slim: the metrics are recomputed from them as turns arrive.
    turns: Vec<pb::TurnRecord>,
    /// When the metrics were last computed.
    metrics_at: Option<Instant>,
    /// When the snapshot was last written to the store.
    stored_at: Option<Instant>,
}

/// How often a running job's metrics and its stored snapshot are refreshed; exactly at every state change and at
/// the end. Each computation is over every recorded turn, under the lock every turn's record takes: recomputed at
/// each turn, a thousand trajectories finishing their turns together queued behind it (p99 overhead per turn 5.4 ms
/// against 3 ms; bench/results/orchestrator-overhead-2026-11-25-dev). The snapshot in the store is for readers in
/// other processes: the turns are the record, and a resumed job recomputes everything from them; watchers and
/// GetJob here see every recorded turn at once, and the metrics within this period.
const REFRESH_EVERY: Duration = Duration::from_secs(1);

impl Snapshot {
    fn refresh_metrics(&mut self, elapsed_s: f64, force: bool) {
        let due = self.metrics_at.is_none_or(|at| at.elapsed() >= REFRESH_EVERY);
        if force || due {
            self.job.metrics = Some(job_metrics(self.job.spec.as_ref(), &self.turns, elapsed_s));
            self.metrics_at = Some(Instant::now());
        }
    }
}

impl Progress {
    fn new(
        job: pb::Job,
        turns: Vec<pb::TurnRecord>,
        store: Store,
        updates: watch::Sender<pb::JobProgress>,
        started: Instant,
        metrics: OrchestratorMetrics,
    ) -> Self {
        Self {
            job_id: job.job_id.clone(),
            job: tokio::sync::Mutex::new(Snapshot { job, turns, metrics_at: None, stored_at: None }),
            store,
            updates,
            started,
            in_flight: InFlight::default(),
            metrics,
        }
    }

    async fn set_state(&self, state: pb::JobState, error: String) {
        let mut snapshot = self.job.lock().await;
        snapshot.refresh_metrics(self.started.elapsed().as_secs_f64(), true);
        let Snapshot { job, turns, .. } = &mut *snapshot;
        job.state = state.into();
        job.error = error;
        job.turns_done = turns.len() as u64;
        job.updated_at = Some(crate::now());
        self.publish(&mut snapshot, None, true).await;
    }

    /// Records a turn (committed before this returns), then refreshes the metrics over every recorded turn.
    async fn record(&self, position: i64, turn: &pb::TurnRecord) -> Result<(), StoreError> {
        // The write needs no lock: each (task, trajectory, turn) has one writer, its episode.
        self.store.put_turn(&self.job_id, position, Stage::Recorded, turn).await?;
        self.metrics.turn(turn);
        let turn = slim(turn);
        let mut snapshot = self.job.lock().await;
        snapshot.turns.push(turn.clone());
        snapshot.refresh_metrics(self.started.elapsed().as_secs_f64(), false);
        let Snapshot { job, turns, .. } = &mut *snapshot;
        job.turns_done = turns.len() as u64;
        job.updated_at = Some(crate::now());
        self.publish(&mut snapshot, Some(turn), false).await;
        Ok(())
    }

    /// Stores a turn's stage (committed before this returns) and tells watchers.
    async fn stage(&self, position: i64, stage: Stage, turn: &pb::TurnRecord) -> Result<(), StoreError> {
        self.store.put_turn(&self.job_id, position, stage, turn).await?;
        self.notify().await;
        Ok(())
    }

    /// Sends the current snapshot (in-flight counts changed).
    async fn notify(&self) {
        let snapshot = self.job.lock().await;
        self.updates.send_replace(self.progress(&snapshot.job, None));
    }

    async fn episode_done(&self) {
        let mut snapshot = self.job.lock().await;
        snapshot.job.episodes_done += 1;
        self.publish(&mut snapshot, None, false).await;
    }

    /// Stores the snapshot as it is (the job stops here without a verdict, to be resumed).
    async fn stopped(&self) {
        let mut snapshot = self.job.lock().await;
        snapshot.refresh_metrics(self.started.elapsed().as_secs_f64(), true);
        snapshot.job.updated_at = Some(crate::now());
        self.publish(&mut snapshot, None, true).await;
    }

    async fn finish(&self, state: pb::JobState, error: String) {
        let mut snapshot = self.job.lock().await;
        snapshot.refresh_metrics(self.started.elapsed().as_secs_f64(), true);
        let job = &mut snapshot.job;
        job.state = state.into();
        job.error = error;
        job.updated_at = Some(crate::now());
        self.publish(&mut snapshot, None, true).await;
    }

    fn progress(&self, job: &pb::Job, recorded: Option<pb::TurnRecord>) -> pb::JobProgress {
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
        pb::JobProgress {
            job: Some(job.clone()),
            in_flight: Some(pb::StageCounts {
                generating: count(&self.in_flight.generating),
                evaluating: count(&self.in_flight.evaluating),
                scoring: count(&self.in_flight.scoring),
            }),
            recorded,
        }
    }

    /// Sends the snapshot to watchers, and writes it to the store when `force`d (a state change) or due.
    async fn publish(&self, snapshot: &mut Snapshot, recorded: Option<pb::TurnRecord>, force: bool) {
        if force || snapshot.stored_at.is_none_or(|at| at.elapsed() >= REFRESH_EVERY) {
            match self.store.put_job(&snapshot.job).await {
                Ok(()) => snapshot.stored_at = Some(Instant::now()),
                Err(error) => tracing::error!(job_id = %self.job_id, %error, "job snapshot not stored"),
            }
        }
        self.updates.send_replace(self.progress(&snapshot.job, recorded));
    }
}

/// One trajectory of one task.
#[derive(Debug)]
struct Episode {
    plan: Arc<Plan>,
    task: pb::Task,
    /// The task's index in the job's task order.
    position: i64,
    trajectory: u32,
    peers: Peers,
    progress: Arc<Progress>,
    cancel: CancellationToken,
}

impl Episode {
    /// Runs the turns in order, from the first one not yet recorded; a stored response or evaluation of that
    /// turn (written before the orchestrator stopped) is reused, never asked for again. A failing service call is
    /// recorded in the turn and ends the episode, not the job; only a store failure (the record would be lost)
    /// fails the job.
    async fn run(self) -> Result<(), StoreError> {
        let job_id = self.progress.job_id.clone();
        let stored = self.progress.store.trajectory(&job_id, &self.task.task_id, self.trajectory).await?;
        let mut earlier = Vec::new();
        let mut first = 0;
        let mut ended = false;
        let mut pending = None;
        for (stage, record) in stored {
            if stage == Stage::Recorded {
                ended |= !record.error.is_empty();
                first = record.turn + 1;
                earlier.push(Attempt {
                    summary: recipe::change_summary(record.completion.as_ref()),
                    kernel: record.kernel,
                    feedback: record.feedback,
                    score: record.score,
                });
            } else if record.turn == first {
                pending = Some((stage, record));
            }
        }
        if !ended {
            for turn in first..self.plan.spec.turns {
                if self.cancel.is_cancelled() {
                    break;
                }
                let resumed = pending.take().filter(|(_, record)| record.turn == turn);
                let turn_span = tracing::info_span!("turn", turn);
                let record = tokio::select! {
                    record = self.turn(&job_id, turn, &earlier, resumed).instrument(turn_span) => record?,
                    () = self.cancel.cancelled() => break,
                };
                self.progress.record(self.position, &record).await?;
                let failed = !record.error.is_empty();
                earlier.push(Attempt {
                    summary: recipe::change_summary(record.completion.as_ref()),
                    kernel: record.kernel,
                    feedback: record.feedback,
                    score: record.score,
                });
                if failed {
                    break;
                }
            }
        }
        self.progress.episode_done().await;
        Ok(())
    }

    async fn turn(
        &self,
        job_id: &str,
        turn: u32,
        earlier: &[Attempt],
        resumed: Option<(Stage, pb::TurnRecord)>,
    ) -> Result<pb::TurnRecord, StoreError> {
        let started = Instant::now();
        let spec = &self.plan.spec;
        // Clients are cheap handles on shared channels.
        let mut peers = self.peers.clone();
        let limits = self.peers.limits.clone();
        let (stage, mut record) = match resumed {
            Some((stage, record)) => {
                tracing::info!(job_id, task_id = %self.task.task_id, trajectory = self.trajectory, turn, ?stage,
                    "turn resumed from its stored stage");
                (Some(stage), record)
            }
            None => (None, self.generate(job_id, turn, earlier, &mut peers).await?),
        };
        if !record.error.is_empty() {
            record.wall_time_s = started.elapsed().as_secs_f64();
            return Ok(record);
        }
        let completion = record.completion.clone().unwrap_or_default();
        let well_formed = record.format_error.is_empty();
        if !record.kernel.is_empty() && well_formed && stage < Some(Stage::Evaluated) {
            let request = pb::EvaluateRequest {
                request_id: String::new(),
                task: Some(self.task.clone()),
                candidate_source: record.kernel.clone(),
                backend: spec.backend,
                policy: spec.policy.clone(),
                correctness_trials: spec.correctness_trials,
                measure_performance: spec.measure_performance.unwrap_or(true),
                census: self.plan.census,
                idempotency_key: format!("{job_id}/{}/{}/{turn}", self.task.task_id, self.trajectory),
                priority: 0,
                job_id: job_id.to_owned(),
            };
            let _stage =
                StageGuard::enter(&self.progress.in_flight.evaluating, self.progress.metrics.in_flight("evaluating"));
            self.progress.notify().await;
            match evaluate(&peers.evaluator, &limits, request, &self.cancel).await {
                Ok(evaluation) => {
                    record.verdict = evaluation.verdict;
                    record.evaluation = Some(evaluation);
                }
                Err(status) => record.error = peer_error("evaluator", &status),
            }
            if record.error.is_empty() {
                self.progress.stage(self.position, Stage::Evaluated, &record).await?;
            }
        }
        let outcome = record.evaluation.as_ref().map(|e| reward::kernel_outcome(e, self.plan.census));
        let _stage = StageGuard::enter(&self.progress.in_flight.scoring, self.progress.metrics.in_flight("scoring"));
        self.progress.notify().await;
        if !well_formed {
            // Kevin's strict format: a response out of shape is worth nothing, whatever its code would do.
            record.score = Some(0.0);
        }
        if let Some(outcome) = outcome.clone().filter(|o| o.verdict() != pb::Verdict::InfraError) {
            let request = self.plan.reward.score_request(outcome);
            let _permit = limits.reward.acquire().await.expect("the reward semaphore is never closed");
            match peers.reward.score_kernels(request).instrument(call_span("Reward/ScoreKernels")).await {
                Ok(response) => {
                    if let Some(score) = response.into_inner().scores.into_iter().next() {
                        record.score = Some(score.score);
                        record.speedup = (score.speedup > 0.0).then_some(score.speedup);
                    }
                }
                Err(status) => record.error = peer_error("reward", &status),
            }
        }
        let diagnose = pb::DiagnoseRequest {
            params: spec.diagnose.clone(),
            responses: vec![pb::ModelResponse {
                response_id: String::new(),
                text: completion.text.clone(),
                reasoning: completion.reasoning.clone(),
                finish_reason: completion.finish_reason.clone(),
                outcome,
            }],
        };
        let diagnosed = {
            let _permit = limits.reward.acquire().await.expect("the reward semaphore is never closed");
            peers.reward.diagnose(diagnose).instrument(call_span("Reward/Diagnose")).await
        };
        match diagnosed {
            Ok(response) => record.flags = response.into_inner().flags.into_iter().next(),
            Err(status) if record.error.is_empty() => {
                record.error = peer_error("reward", &status);
            }
            Err(_) => {}
        }
        // A turn resumed with its review keeps it: the Judge is not asked twice.
        if record.judge.is_none() {
            record.feedback = match well_formed {
                true => recipe::feedback(record.evaluation.as_ref(), &record.error),
                false => recipe::format_feedback(&record.format_error),
            };
            if let Some(evaluation) = record.evaluation.as_ref().filter(|_| self.plan.recipe == Recipe::DrKernel) {
                record.feedback.push_str(&recipe::census_feedback(evaluation));
            }
            let reviewed = self.plan.recipe == Recipe::CudaForge && turn + 1 < spec.turns && record.error.is_empty();
            if let Some(evaluation) = record.evaluation.clone().filter(|_| reviewed) {
                let (review, feedback) = self.review(job_id, turn, &record, &evaluation, &mut peers).await;
                record.judge = Some(review);
                record.feedback = feedback;
                self.progress.stage(self.position, Stage::Evaluated, &record).await?;
            }
        }
        record.wall_time_s = started.elapsed().as_secs_f64();
        tracing::info!(
            job_id, task_id = %self.task.task_id, trajectory = self.trajectory, turn,
            verdict = ?record.verdict(), score = ?record.score, "turn recorded"
        );
        Ok(record)
    }

    /// Builds the prompt and generates; the response is stored (stage generated) before this returns. A failed
    /// generation comes back as a record with its `error` set, for the caller to record.
    async fn generate(
        &self,
        job_id: &str,
        turn: u32,
        earlier: &[Attempt],
        peers: &mut Peers,
    ) -> Result<pb::TurnRecord, StoreError> {
        let spec = &self.plan.spec;
        let prompt = self.plan.templates.prompt(&self.task, earlier);
        let mut record = pb::TurnRecord {
            turn,
            prompt: prompt.clone(),
            task_id: self.task.task_id.clone(),
            trajectory: self.trajectory,
            ..Default::default()
        };
        let rollout = spec.kind() == pb::JobKind::Rollout;
        let episode_id = format!("{job_id}/{}/{}", self.task.task_id, self.trajectory);
        let request = self.generate_request(job_id, turn, &spec.model, prompt, episode_id, rollout);
        let generated = self.ask(peers, request).await;
        let generated = match generated {
            Ok(response) => response.into_inner(),
            Err(status) => {
                record.error = peer_error("gateway", &status);
                record.feedback = recipe::feedback(None, &record.error);
                return Ok(record);
            }
        };
        record.usage = generated.usage;
        record.prompt_token_ids = generated.prompt_token_ids;
        let Some(completion) = generated.completions.into_iter().next() else {
            record.error = "gateway: the response held no completion".into();
            record.feedback = recipe::feedback(None, &record.error);
            return Ok(record);
        };
        let record = self.plan.read_completion(record, completion);
        self.progress.stage(self.position, Stage::Generated, &record).await?;
        Ok(record)
    }
}

impl Episode {
    /// The cudaforge Judge's review of a turn's evaluated kernel (`judge.rs`) and the feedback it makes for the
    /// next turn. Never fails the turn: a missing profile, a failed generation or a malformed answer is recorded
    /// in the review, and the feedback is then the evaluation's own.
    async fn review(
        &self,
        job_id: &str,
        turn: u32,
        record: &pb::TurnRecord,
        evaluation: &pb::EvaluateResponse,
        peers: &mut Peers,
    ) -> (pb::JudgeRecord, String) {
        let started = Instant::now();
        let templates = &self.plan.templates.judge;
        let shown = record.feedback.clone();
        let mode = judge::mode_for(evaluation);
        let mut review = pb::JudgeRecord { mode: mode as i32, ..Default::default() };
        let prompt = match mode {
            Mode::Correction => judge::correction_prompt(templates, &self.task, &record.kernel, &shown),
            Mode::Optimization => match self.profile(job_id, &record.kernel, peers).await {
                Ok(view) => {
                    review.diagnosis.clone_from(&view.diagnosis);
                    review.metrics.clone_from(&view.metrics);
                    judge::optimization_prompt(templates, &self.task, &record.kernel, &shown, &view)
                }
                Err(note) => {
                    let feedback = judge::feedback_without_review(
                        &shown,
                        &format!("no hardware profile, {note}; correction only"),
                    );
                    review.mode = Mode::None as i32;
                    review.profile_note = note;
                    review.wall_time_s = started.elapsed().as_secs_f64();
                    return (review, feedback);
                }
            },
            Mode::None | Mode::Unspecified => {
                review.wall_time_s = started.elapsed().as_secs_f64();
                return (review, shown);
            }
        };
        review.prompt.clone_from(&prompt);
        let spec = &self.plan.spec;
        let model = if spec.judge_model.is_empty() { &spec.model } else { &spec.judge_model };
        // Its own affinity key: the Judge's prompts share no prefix with the Coder's.
        let episode_id = format!("{job_id}/{}/{}/judge", self.task.task_id, self.trajectory);
        let request = self.generate_request(job_id, turn, model, prompt, episode_id, false);
        let generated = self.ask(peers, request).await;
        let feedback = match generated.map(tonic::Response::into_inner) {
            Ok(generated) => {
                review.usage = generated.usage;
                let text = generated.completions.first().map(|c| c.text.clone()).unwrap_or_default();
                review.completion = generated.completions.into_iter().next();
                match judge::parse(mode, &text) {
                    Ok(advice) => {
                        review.advice_json = serde_json::Value::Object(advice.clone()).to_string();
                        judge::feedback(&shown, mode, &advice)
                    }
                    Err(why) => {
                        review.error = format!("malformed answer: {why}");
                        judge::feedback_without_review(&shown, "the reviewer's answer was malformed")
                    }
                }
            }
            Err(status) => {
                review.error = peer_error("gateway", &status);
                judge::feedback_without_review(&shown, "the reviewer could not be asked")
            }
        };
        review.wall_time_s = started.elapsed().as_secs_f64();
        (review, feedback)
    }

    /// A generation of `prompt` by `model` for this episode's `turn`, with the job's sampling (a seed offset by the
    /// trajectory, so that a task's trajectories differ and a rerun repeats them); token ids and log-probabilities
    /// asked for with `tokens`.
    fn generate_request(
        &self,
        job_id: &str,
        turn: u32,
        model: &str,
        prompt: Vec<pb::ChatMessage>,
        episode_id: String,
        tokens: bool,
    ) -> pb::GenerateRequest {
        let spec = &self.plan.spec;
        let mut sampling = spec.sampling.clone().unwrap_or_default();
        let base_seed = sampling.seed.or((spec.seed != 0).then_some(spec.seed));
        sampling.seed = base_seed.map(|seed| seed.wrapping_add(u64::from(self.trajectory)));
        pb::GenerateRequest {
            model: model.to_owned(),
            input: Some(pb::generate_request::Input::Chat(pb::ChatMessages { messages: prompt })),
            sampling: Some(sampling),
            return_token_ids: tokens,
            return_logprobs: tokens,
            keys: Some(pb::RequestKeys {
                job_id: job_id.to_owned(),
                episode_id,
                task_id: self.task.task_id.clone(),
                trajectory: self.trajectory,
                turn,
            }),
        }
    }

    /// Sends a generation through the gateway, counted as generating and within the gateway's permits.
    async fn ask(
        &self,
        peers: &mut Peers,
        request: pb::GenerateRequest,
    ) -> Result<tonic::Response<pb::GenerateResponse>, tonic::Status> {
        let _stage =
            StageGuard::enter(&self.progress.in_flight.generating, self.progress.metrics.in_flight("generating"));
        self.progress.notify().await;
        let _permit = peers.limits.gateway.acquire().await.expect("the gateway semaphore is never closed");
        peers.gateway.generate(request).instrument(call_span("Gateway/Generate")).await
    }

    /// The kernel's profile as the Judge is shown it, or why there is none.
    async fn profile(&self, job_id: &str, kernel: &str, peers: &mut Peers) -> Result<ProfileView, String> {
        let spec = &self.plan.spec;
        let Some(profilers) = peers.profiler.as_ref() else {
            return Err(if spec.backend() == pb::Backend::Cpu {
                "the job evaluates on the CPU, and Nsight Compute profiles GPU kernels".into()
            } else {
                "no profiler was reachable when the job started".into()
            });
        };
        let request = pb::ProfileRequest {
            request_id: String::new(),
            task: Some(self.task.clone()),
            candidate_source: kernel.to_owned(),
            backend: spec.backend,
            metric_set: pb::MetricSet::Curated as i32,
            metrics: Vec::new(),
            lock_clocks: false,
            policy: spec.policy.clone(),
            launch_limit: 0,
            priority: 0,
            job_id: job_id.to_owned(),
        };
        let profiled = {
            let _stage =
                StageGuard::enter(&self.progress.in_flight.evaluating, self.progress.metrics.in_flight("evaluating"));
            let _permit = peers.limits.profiler.acquire().await.expect("the profiler semaphore is never closed");
            match profilers.acquire(&format!("{job_id}/{}", self.task.task_id)).await {
                Ok(place) => {
                    let mut client = ProfilerClient::new(place.channel());
                    client.profile(request).instrument(call_span("Profiler/Profile")).await
                }
                Err(status) => Err(status),
            }
        };
        let profile = profiled.map_err(|status| peer_error("profiler", &status))?.into_inner();
        if profile.verdict() != pb::Verdict::Correct {
            return Err(format!(
                "the profile ended {:?}: {}",
                profile.verdict(),
                profile.error.lines().next().unwrap_or("")
            ));
        }
        ProfileView::of(&profile).ok_or_else(|| "Nsight Compute profiled no launch of the kernel's own kernels".into())
    }
}

/// The span of one call to a peer (`Service/Method`), under the current turn's: the call carries its context, so
/// the peer's server span continues the episode's trace.
fn call_span(method: &'static str) -> tracing::Span {
    tracing::info_span!("call", otel.name = method, otel.kind = "client", rpc.method = method)
}

/// Evaluates, retrying with backoff while the evaluator is busy (RESOURCE_EXHAUSTED) or answers a retryable
/// VERDICT_INFRA_ERROR, up to the policy's attempts; the last answer is returned either way (a final infra error
/// is recorded, never scored). Retries reuse the idempotency key, so an evaluation the evaluator did finish is not
/// run again.
async fn evaluate(
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

/// The model a step-API episode's job names: its responses come from the trainer, not through the gateway.
pub const STEP_MODEL: &str = "(step api)";

/// Why a step was refused.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The step does not fit the episode (a turn ahead of it, a different response or key for a turn taken, an
    /// episode that is over).
    #[error("{0}")]
    Precondition(String),
    /// The episode ended, and its returns, advantages or PRS decisions could not be computed.
    #[error("{0}")]
    Credit(String),
}

/// A step taken (or replayed): the turn as recorded, the next turn's prompt (empty when done), and whether the
/// episode is over.
#[derive(Debug, Clone)]
pub struct Stepped {
    pub record: pb::TurnRecord,
    pub next_turn: u32,
    pub next_prompt: Vec<pb::ChatMessage>,
    pub done: bool,
    /// When done: every turn as stored, with its return, advantage and keep, without prompt, completion and
    /// evaluation (the trainer has them).
    pub turns: Vec<pb::TurnRecord>,
}

/// The first observation's prompt of a step-API episode.
pub fn first_prompt(plan: &Plan) -> Vec<pb::ChatMessage> {
    plan.tasks.first().map(|task| plan.templates.prompt(task, &[])).unwrap_or_default()
}

/// Applies the trainer's `completion` as turn `turn` of a step-API episode (a job of one task, one trajectory):
/// the response is stored, then evaluated, scored and diagnosed as a job's turn is, and recorded. The first
/// `idempotency_key` to claim a turn owns it: a retry with it returns the recorded turn (or finishes a step
/// interrupted after storing its response or evaluation); another key, or a turn ahead of the episode, is refused.
pub async fn step(
    plan: Arc<Plan>,
    job: pb::Job,
    peers: Peers,
    store: Store,
    turn: u32,
    completion: pb::Completion,
    idempotency_key: &str,
) -> Result<Stepped, StepError> {
    let task = plan.tasks.first().cloned().ok_or_else(|| StepError::Precondition("the episode has no task".into()))?;
    let stored = store.trajectory(&job.job_id, &task.task_id, 0).await?;
    let mut recorded = Vec::new();
    let mut pending = None;
    for (stage, record) in stored {
        if stage == Stage::Recorded {
            recorded.push(record);
        } else {
            pending = Some((stage, record));
        }
    }
    let attempts = |records: &[pb::TurnRecord]| -> Vec<Attempt> {
        records
            .iter()
            .map(|r| Attempt {
                kernel: r.kernel.clone(),
                feedback: r.feedback.clone(),
                score: r.score,
                summary: recipe::change_summary(r.completion.as_ref()),
            })
            .collect()
    };
    let outcome = |records: &[pb::TurnRecord], record: pb::TurnRecord| {
        let done = records.len() as u32 >= plan.spec.turns || !record.error.is_empty();
        Stepped {
            next_turn: record.turn + 1,
            next_prompt: if done { Vec::new() } else { plan.templates.prompt(&task, &attempts(records)) },
            done,
            record,
            turns: Vec::new(),
        }
    };
    let mut reward = peers.reward.clone();
    let next = recorded.len() as u32;
    if turn > next {
        return Err(StepError::Precondition(format!("turn {turn} is ahead of the episode: its next turn is {next}")));
    }
    if !store.claim_step(&job.job_id, turn, idempotency_key).await? {
        return Err(StepError::Precondition(format!("turn {turn} was already stepped with another idempotency key")));
    }
    if turn < next {
        let record = recorded[turn as usize].clone();
        let mut stepped = outcome(&recorded[..=turn as usize], record);
        if stepped.done {
            stepped.turns = credit_episode(&plan, &mut reward, &store, &job.job_id).await?;
        }
        return Ok(stepped);
    }
    if next >= plan.spec.turns || recorded.last().is_some_and(|r| !r.error.is_empty()) {
        return Err(StepError::Precondition("the episode is over".into()));
    }
    let earlier = attempts(&recorded);
    let resumed = match pending.filter(|(_, record)| record.turn == turn) {
        Some(pending) => pending,
        None => {
            let record = pb::TurnRecord {
                turn,
                prompt: plan.templates.prompt(&task, &earlier),
                task_id: task.task_id.clone(),
                trajectory: 0,
                ..Default::default()
            };
            let record = plan.read_completion(record, completion);
            store.put_turn(&job.job_id, 0, Stage::Generated, &record).await?;
            (Stage::Generated, record)
        }
    };
    let job_id = job.job_id.clone();
    let (updates, _) = watch::channel(pb::JobProgress::default());
    let progress = Arc::new(Progress::new(
        job,
        recorded.iter().map(slim).collect(),
        store,
        updates,
        Instant::now(),
        peers.metrics.clone(),
    ));
    let episode = Episode {
        plan: plan.clone(),
        task: task.clone(),
        position: 0,
        trajectory: 0,
        peers,
        progress: progress.clone(),
        cancel: CancellationToken::new(),
    };
    let record = episode.turn(&job_id, turn, &earlier, Some(resumed)).await?;
    progress.record(0, &record).await?;
    recorded.push(record.clone());
    let mut stepped = outcome(&recorded, record);
    if stepped.done {
        stepped.turns = credit_episode(&plan, &mut reward, &progress.store, &job_id).await?;
        progress.episode_done().await;
        progress.finish(pb::JobState::Succeeded, String::new()).await;
    }
    Ok(stepped)
}

/// Credits the turns of a step-API episode that has ended (again, for a retried last step: the same values) and
/// returns them as stored, without prompt, completion and evaluation (the trainer has them).
async fn credit_episode(
    plan: &Plan,
    reward: &mut RewardClient<Channel>,
    store: &Store,
    job_id: &str,
) -> Result<Vec<pb::TurnRecord>, StepError> {
    reward::credit(&plan.reward, reward, store, job_id, |_| 0).await.map_err(StepError::Credit)?;
    let turns = store.turns(job_id).await?;
    Ok(turns
        .into_iter()
        .map(|turn| pb::TurnRecord { prompt: Vec::new(), completion: None, evaluation: None, ..turn })
        .collect())
}

/// A peer's refusal as a turn records it: `evaluator: ResourceExhausted: queue full`.
fn peer_error(peer: &str, status: &tonic::Status) -> String {
    format!("{peer}: {:?}: {}", status.code(), status.message())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> pb::JobSpec {
        pb::JobSpec {
            kind: pb::JobKind::Evaluation.into(),
            recipe: "single-turn".into(),
            task_set: "examples".into(),
            model: "replay".into(),
            trajectories_per_task: 2,
            turns: 3,
            ..Default::default()
        }
    }

    fn invalid(spec: pb::JobSpec) -> String {
        Plan::new(spec).expect_err("invalid").to_string()
    }

    #[test]
    fn a_plan_resolves_the_examples_and_counts_its_turns() {
        let plan = Plan::new(pb::JobSpec { max_tasks: 2, ..spec() }).expect("valid");
        let ids: Vec<&str> = plan.tasks.iter().map(|t| t.task_id.as_str()).collect();
        assert_eq!(ids, ["examples/relu", "examples/gelu_tanh"]);
        assert_eq!((plan.episodes(), plan.turns_total()), (4, 12));
        assert_eq!(Plan::new(spec()).expect("valid").tasks.len(), 13);
    }

    #[test]
    fn a_stored_job_resumes_with_the_tasks_it_was_resolved_to() {
        let dir = std::env::temp_dir().join(format!("kforge-resumed-plan-{}", std::process::id()));
        let spec = pb::JobSpec { task_set: dir.display().to_string(), levels: vec![2], max_tasks: 1, ..spec() };
        let tasks = vec![pb::Task { task_id: "level2/1_a".into(), source: "class Model: pass".into() }];
        let plan = Plan::resumed(spec.clone(), tasks.clone()).expect("the directory need not exist any more");
        assert_eq!((plan.episodes(), plan.turns_total()), (2, 6));
        assert_eq!((plan.tasks, plan.spec), (tasks, spec));
    }

    #[test]
    fn bad_specs_name_their_field() {
        assert!(invalid(pb::JobSpec { kind: 0, ..spec() }).starts_with("spec.kind:"));
        assert!(invalid(pb::JobSpec { recipe: "x".into(), ..spec() }).starts_with("spec.recipe:"));
        assert!(invalid(pb::JobSpec { model: String::new(), ..spec() }).starts_with("spec.model:"));
        assert!(invalid(pb::JobSpec { trajectories_per_task: 0, ..spec() }).starts_with("spec.trajectories_per_task:"));
        assert!(invalid(pb::JobSpec { turns: 0, ..spec() }).starts_with("spec.turns:"));
        assert!(invalid(pb::JobSpec { task_set: "/nonexistent/dir".into(), ..spec() }).starts_with("spec.task_set:"));
        let empty = std::env::temp_dir().join(format!("kforge-empty-tasks-{}", std::process::id()));
        std::fs::create_dir_all(&empty).expect("dir");
        assert!(invalid(pb::JobSpec { task_set: empty.display().to_string(), ..spec() }).starts_with("spec.task_set:"));
        let task = |id: &str| pb::Task { task_id: id.into(), source: "class Model: pass".into() };
        let twice = pb::JobSpec { task_set: "inline".into(), tasks: vec![task("a"), task("a")], ..spec() };
        assert!(invalid(twice).starts_with("spec.tasks[1]:"));
        let inline = pb::JobSpec { task_set: "inline".into(), tasks: vec![task("a"), task("b")], ..spec() };
        assert_eq!(Plan::new(inline).expect("valid").tasks.len(), 2);
        assert!(invalid(pb::JobSpec { tasks: vec![task("a")], ..spec() }).starts_with("spec.tasks:"));
    }
}
