//! A job from spec to metrics: the spec checked and resolved into a plan (tasks, recipe, templates), then its
//! episodes (task x trajectory) run with bounded concurrency, each turn generated through the gateway, its kernel
//! extracted, evaluated, scored and diagnosed, and its record written to the store before the next turn starts.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use kforge_proto::v1 as pb;
use kforge_proto::v1::evaluator_client::EvaluatorClient;
use kforge_proto::v1::gateway_client::GatewayClient;
use kforge_proto::v1::reward_client::RewardClient;
use kforge_server::client::Channel;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::error::OrchestratorError;
use crate::metrics::job_metrics;
use crate::recipe::{self, Attempt, Recipe, Templates};
use crate::store::{JobStore, StoreError};

/// A checked spec, with its tasks resolved.
#[derive(Debug, Clone)]
pub struct Plan {
    pub spec: pb::JobSpec,
    pub recipe: Recipe,
    pub templates: Templates,
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
        let templates = Templates::load(recipe, prompt_dir)?;
        let mut tasks = resolve_tasks(&spec)?;
        if spec.max_tasks > 0 {
            tasks.truncate(spec.max_tasks as usize);
        }
        Ok(Self { spec, recipe, templates, tasks })
    }

    pub fn episodes(&self) -> u64 {
        self.tasks.len() as u64 * u64::from(self.spec.trajectories_per_task)
    }

    pub fn turns_total(&self) -> u64 {
        self.episodes() * u64::from(self.spec.turns)
    }
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
        path => {
            let dir = Path::new(path);
            if !dir.is_dir() {
                return Err(OrchestratorError::invalid(
                    field,
                    format!("{path} is not a directory (JSONL task sets are not built yet)"),
                ));
            }
            let (tasks, _rejected) = kforge_evaluator::tasks::import_kernelbench(dir)
                .map_err(|e| OrchestratorError::invalid(field, e.to_string()))?;
            tasks.into_iter().map(|t| pb::Task { task_id: t.id, source: t.source }).collect()
        }
    };
    if tasks.is_empty() {
        return Err(OrchestratorError::invalid(field, format!("`{}` holds no tasks", spec.task_set)));
    }
    Ok(tasks)
}

/// Clients of the services a job calls.
#[derive(Debug, Clone)]
pub struct Peers {
    pub gateway: GatewayClient<Channel>,
    pub evaluator: EvaluatorClient<Channel>,
    pub reward: RewardClient<Channel>,
}

/// Runs a submitted job to its end: episodes bounded by `max_concurrent`, each turn stored before the next, the
/// job's snapshot (state, progress, metrics) written to the store and sent to watchers after every turn.
pub async fn run(
    plan: Arc<Plan>,
    job: pb::Job,
    peers: Peers,
    store: Arc<dyn JobStore>,
    updates: watch::Sender<pb::Job>,
    cancel: CancellationToken,
    max_concurrent: usize,
) {
    let started = Instant::now();
    let progress = Progress { job: tokio::sync::Mutex::new(job), store: store.clone(), updates, started };
    progress.set_state(pb::JobState::Running, String::new()).await;
    let progress = Arc::new(progress);
    let limit = Arc::new(Semaphore::new(max_concurrent.max(1)));
    let mut episodes = JoinSet::new();
    for task in &plan.tasks {
        for trajectory in 0..plan.spec.trajectories_per_task {
            let episode = Episode {
                plan: plan.clone(),
                task: task.clone(),
                trajectory,
                peers: peers.clone(),
                progress: progress.clone(),
                cancel: cancel.clone(),
            };
            let limit = limit.clone();
            episodes.spawn(async move {
                let _permit = limit.acquire_owned().await.expect("the episode semaphore is never closed");
                episode.run().await
            });
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
        None if cancel.is_cancelled() => (pb::JobState::Cancelled, String::new()),
        None => (pb::JobState::Succeeded, String::new()),
    };
    progress.finish(state, error).await;
}

/// The job's snapshot, shared by its episodes.
#[derive(Debug)]
struct Progress {
    job: tokio::sync::Mutex<pb::Job>,
    store: Arc<dyn JobStore>,
    updates: watch::Sender<pb::Job>,
    started: Instant,
}

impl Progress {
    async fn set_state(&self, state: pb::JobState, error: String) {
        let mut job = self.job.lock().await;
        job.state = state.into();
        job.error = error;
        job.updated_at = Some(crate::now());
        self.publish(&job).await;
    }

    /// Records a turn, then refreshes the metrics from every stored turn (simple and exact; a job of thousands of
    /// turns will want incremental metrics).
    async fn record(&self, turn: &pb::TurnRecord) -> Result<(), StoreError> {
        let mut job = self.job.lock().await;
        self.store.put_turn(&job.job_id, turn).await?;
        let turns = self.store.turns(&job.job_id).await?;
        job.turns_done = turns.len() as u64;
        job.metrics = Some(job_metrics(&turns, self.started.elapsed().as_secs_f64()));
        job.updated_at = Some(crate::now());
        self.publish(&job).await;
        Ok(())
    }

    async fn episode_done(&self) {
        let mut job = self.job.lock().await;
        job.episodes_done += 1;
        self.publish(&job).await;
    }

    async fn finish(&self, state: pb::JobState, error: String) {
        let mut job = self.job.lock().await;
        if let Some(metrics) = job.metrics.as_mut() {
            metrics.wall_time_s = self.started.elapsed().as_secs_f64();
        }
        job.state = state.into();
        job.error = error;
        job.updated_at = Some(crate::now());
        self.publish(&job).await;
    }

    async fn publish(&self, job: &pb::Job) {
        if let Err(error) = self.store.put_job(job, "").await {
            tracing::error!(job_id = %job.job_id, %error, "job snapshot not stored");
        }
        self.updates.send_replace(job.clone());
    }
}

/// One trajectory of one task.
#[derive(Debug)]
struct Episode {
    plan: Arc<Plan>,
    task: pb::Task,
    trajectory: u32,
    peers: Peers,
    progress: Arc<Progress>,
    cancel: CancellationToken,
}

impl Episode {
    /// Runs the turns in order. A failing service call is recorded in the turn and ends the episode, not the job;
    /// only a store failure (the record would be lost) fails the job.
    async fn run(self) -> Result<(), StoreError> {
        let mut earlier = Vec::new();
        for turn in 0..self.plan.spec.turns {
            if self.cancel.is_cancelled() {
                break;
            }
            let record = tokio::select! {
                record = self.turn(turn, &earlier) => record,
                () = self.cancel.cancelled() => break,
            };
            self.progress.record(&record).await?;
            let failed = !record.error.is_empty();
            earlier.push(Attempt { kernel: record.kernel, feedback: record.feedback });
            if failed {
                break;
            }
        }
        self.progress.episode_done().await;
        Ok(())
    }

    async fn turn(&self, turn: u32, earlier: &[Attempt]) -> pb::TurnRecord {
        let spec = &self.plan.spec;
        // Clients are cheap handles on shared channels.
        let mut peers = self.peers.clone();
        let job_id = self.progress.job.lock().await.job_id.clone();
        let prompt = self.plan.templates.prompt(&self.task, earlier);
        let mut record = pb::TurnRecord {
            turn,
            prompt: prompt.clone(),
            task_id: self.task.task_id.clone(),
            trajectory: self.trajectory,
            ..Default::default()
        };
        let mut sampling = spec.sampling.clone().unwrap_or_default();
        let base_seed = sampling.seed.or((spec.seed != 0).then_some(spec.seed));
        sampling.seed = base_seed.map(|seed| seed.wrapping_add(u64::from(self.trajectory)));
        let request = pb::GenerateRequest {
            model: spec.model.clone(),
            input: Some(pb::generate_request::Input::Chat(pb::ChatMessages { messages: prompt })),
            sampling: Some(sampling),
            return_token_ids: spec.kind() == pb::JobKind::Rollout,
            return_logprobs: spec.kind() == pb::JobKind::Rollout,
            keys: Some(pb::RequestKeys {
                job_id: job_id.clone(),
                episode_id: format!("{job_id}/{}/{}", self.task.task_id, self.trajectory),
                task_id: self.task.task_id.clone(),
                trajectory: self.trajectory,
                turn,
            }),
        };
        let generated = match peers.gateway.generate(request).await {
            Ok(response) => response.into_inner(),
            Err(status) => {
                record.error = peer_error("gateway", &status);
                record.feedback = recipe::feedback(None, &record.error);
                return record;
            }
        };
        record.usage = generated.usage;
        let Some(completion) = generated.completions.into_iter().next() else {
            record.error = "gateway: the response held no completion".into();
            record.feedback = recipe::feedback(None, &record.error);
            return record;
        };
        record.kernel = kforge_model_text::extract_kernel(&completion.text).unwrap_or_default().to_owned();
        let mut outcome = None;
        if !record.kernel.is_empty() {
            let request = pb::EvaluateRequest {
                request_id: String::new(),
                task: Some(self.task.clone()),
                candidate_source: record.kernel.clone(),
                backend: spec.backend,
                policy: spec.policy.clone(),
                correctness_trials: spec.correctness_trials,
                measure_performance: spec.measure_performance.unwrap_or(true),
                census: false,
                idempotency_key: format!("{job_id}/{}/{}/{turn}", self.task.task_id, self.trajectory),
                priority: 0,
                job_id: job_id.clone(),
            };
            match peers.evaluator.evaluate(request).await {
                Ok(response) => {
                    let evaluation = response.into_inner();
                    record.verdict = evaluation.verdict;
                    outcome = Some(kernel_outcome(&evaluation));
                    record.evaluation = Some(evaluation);
                }
                Err(status) => record.error = peer_error("evaluator", &status),
            }
        }
        if let Some(outcome) = outcome.clone().filter(|o| o.verdict() != pb::Verdict::InfraError) {
            let request = pb::ScoreKernelsRequest {
                formula: Some(pb::score_kernels_request::Formula::Kevin(pb::KevinScore::default())),
                baseline: pb::SpeedupBaseline::Eager.into(),
                hack_penalty: None,
                outcomes: vec![outcome],
            };
            match peers.reward.score_kernels(request).await {
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
            params: None,
            responses: vec![pb::ModelResponse {
                response_id: String::new(),
                text: completion.text.clone(),
                reasoning: completion.reasoning.clone(),
                finish_reason: completion.finish_reason.clone(),
                outcome,
            }],
        };
        match peers.reward.diagnose(diagnose).await {
            Ok(response) => record.flags = response.into_inner().flags.into_iter().next(),
            Err(status) if record.error.is_empty() => {
                record.error = peer_error("reward", &status);
            }
            Err(_) => {}
        }
        record.feedback = recipe::feedback(record.evaluation.as_ref(), &record.error);
        record.completion = Some(completion);
        tracing::info!(
            job_id = %job_id, task_id = %self.task.task_id, trajectory = self.trajectory, turn,
            verdict = ?record.verdict(), score = ?record.score, "turn recorded"
        );
        record
    }
}

/// A peer's refusal as a turn records it: `evaluator: ResourceExhausted: queue full`.
fn peer_error(peer: &str, status: &tonic::Status) -> String {
    format!("{peer}: {:?}: {}", status.code(), status.message())
}

/// The evaluation as the Reward service takes it.
fn kernel_outcome(evaluation: &pb::EvaluateResponse) -> pb::KernelOutcome {
    let positive = |v: f64| (v > 0.0).then_some(v);
    let median = |t: &Option<pb::TimingStats>| t.as_ref().and_then(|t| positive(t.median_ms));
    pb::KernelOutcome {
        sample_id: String::new(),
        verdict: evaluation.verdict,
        findings: evaluation.findings.clone(),
        speedup_eager: positive(evaluation.speedup_eager),
        speedup_compile: positive(evaluation.speedup_compile),
        candidate_median_ms: median(&evaluation.candidate_timing),
        eager_median_ms: median(&evaluation.eager_timing),
        compile_median_ms: median(&evaluation.compile_timing),
        profiling_ratio: positive(evaluation.profiling_ratio),
    }
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
