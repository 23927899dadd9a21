//! The gRPC face of the service: `kforge.v1.Orchestrator`'s handlers. Each checks its request (INVALID_ARGUMENT
//! naming the field; a job over the limits; a named caller over its quotas), then calls the service (`service.rs`:
//! submitting, resuming and cancelling jobs), the store (reading jobs, trajectories and samples), the step API
//! (`job::step`) or the reward service (RejectMismatched), and maps what fails to a gRPC status (`error.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_server::Orchestrator;
use kforge_server::auth::Caller;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};

use crate::LimitsConfig;
use crate::error::{OrchestratorError, store_status};
use crate::export::{self, parse_cursor};
use crate::job::{self, Plan};
use crate::service::{OrchestratorService, Submission, lease_until, now_ms};
use crate::{metrics, now, recipe, reward, store};

#[tonic::async_trait]
impl Orchestrator for OrchestratorService {
    async fn submit_job(&self, request: Request<pb::SubmitJobRequest>) -> Result<Response<pb::Job>, Status> {
        let caller = Caller::of(&request).map(|caller| caller.name().to_owned());
        let request = request.into_inner();
        let spec = request.spec.ok_or_else(|| OrchestratorError::invalid("spec", "required"))?;
        check_key(&request.idempotency_key)?;
        if let Some(job) = self.store.job_by_key(&request.idempotency_key).await.map_err(store_status)? {
            return Ok(Response::new(job));
        }
        // A KernelBench directory or a JSONL file is read from disk, and every task parsed: off the async threads.
        let limits = self.config.limits.clone();
        let plan = tokio::task::spawn_blocking(move || Plan::submitted(spec, &limits))
            .await
            .map_err(|error| Status::internal(format!("resolving the task set panicked: {error}")))??;
        let peers = self.connect(&plan).await?;
        // Held until the job is stored: the caller's next submission counts this one.
        let _admission = self.admit(caller.as_deref(), Submission::Job { turns: plan.turns_total() }).await?;
        let job = pb::Job {
            job_id: self.next_job_id(),
            spec: Some(plan.spec.clone()),
            state: pb::JobState::Queued.into(),
            episodes_total: plan.episodes(),
            turns_total: plan.turns_total(),
            metrics: Some(metrics::job_metrics(None, &[], 0.0)),
            created_at: Some(now()),
            updated_at: Some(now()),
            caller: caller.unwrap_or_default(),
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
        let job_id = request.into_inner().job_id;
        let receiver = self.running().get(&job_id).map(|r| r.updates.clone());
        // The job's task drops the sender once the job is terminal: the stream yields the last state and ends. A
        // job not running here (finished, or interrupted and not resumed) is sent once, as stored, read after its
        // task was found gone: a job that ends between the two reads is sent in its final state, not its last but one.
        let stream: Self::WatchJobStream = match receiver {
            Some(receiver) => {
                Box::pin(tokio_stream::StreamExt::map(tokio_stream::wrappers::WatchStream::new(receiver), Ok))
            }
            None => Box::pin(tokio_stream::once(Ok(pb::JobProgress {
                job: Some(self.job(&job_id).await?),
                in_flight: Some(pb::StageCounts::default()),
                recorded: None,
            }))),
        };
        Ok(Response::new(stream))
    }

    async fn list_jobs(&self, request: Request<pb::ListJobsRequest>) -> Result<Response<pb::ListJobsResponse>, Status> {
        let request = request.into_inner();
        let before: Option<i64> = parse_token("page_token", &request.page_token)?;
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
        let caller = Caller::of(&request).map(|caller| caller.name().to_owned());
        let job = self.job(&request.into_inner().job_id).await?;
        check_owner(caller.as_deref(), &job)?;
        // A failed or cancelled job resumed is in flight again: it counts against its caller's jobs in flight (its
        // turns counted when it was submitted). Held until it is stored as queued.
        let _admission = match is_terminal(job.state) && job.state != pb::JobState::Succeeded as i32 {
            true => self.admit(caller.as_deref(), Submission::Job { turns: 0 }).await?,
            false => None,
        };
        Ok(Response::new(self.resume(&job.job_id).await?))
    }

    async fn cancel_job(&self, request: Request<pb::CancelJobRequest>) -> Result<Response<pb::Job>, Status> {
        let caller = Caller::of(&request).map(|caller| caller.name().to_owned());
        let mut job = self.job(&request.into_inner().job_id).await?;
        check_owner(caller.as_deref(), &job)?;
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
        let at = now_ms();
        if let Err((owner, _)) =
            self.store.claim(&job.job_id, &self.config.instance, at, at).await.map_err(store_status)?
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
        let offset: usize = parse_token("page_token", &request.page_token)?.unwrap_or(0);
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
        let after = parse_cursor(&request.cursor)?;
        let left = match request.limit {
            0 => u64::MAX,
            n => u64::from(n),
        };
        // Pages of turns read one at a time, as the client takes them: a large job never sits in memory whole.
        let (sender, receiver) = tokio::sync::mpsc::channel(64);
        self.tracker.spawn(export::send_samples(self.store.clone(), job.job_id, after, left, sender));
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(receiver))))
    }

    async fn start_episode(
        &self,
        request: Request<pb::StartEpisodeRequest>,
    ) -> Result<Response<pb::Observation>, Status> {
        let caller = Caller::of(&request).map(|caller| caller.name().to_owned());
        let (spec, idempotency_key) = episode_spec(request.into_inner())?;
        let plan = episode_plan(spec, &self.config.limits)?;
        // A retry of a stored episode is not counted again.
        let retry = self.store.job_by_key(&idempotency_key).await.map_err(store_status)?.is_some();
        let turns = plan.turns_total();
        let _admission = match retry {
            true => None,
            false => self.admit(caller.as_deref(), Submission::Episode { turns }).await?,
        };
        let job = pb::Job {
            job_id: self.next_job_id(),
            spec: Some(plan.spec.clone()),
            state: pb::JobState::Running.into(),
            episodes_total: 1,
            turns_total: turns,
            metrics: Some(metrics::job_metrics(None, &[], 0.0)),
            created_at: Some(now()),
            updated_at: Some(now()),
            caller: caller.unwrap_or_default(),
            ..Default::default()
        };
        // Owned apart from this instance's jobs: a restart has nothing to resume in it (the trainer steps it).
        let owner = format!("{}/step", self.config.instance);
        let existing =
            self.store.create_job(&job, &idempotency_key, &owner, 0, &plan.tasks).await.map_err(store_status)?;
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
        crate::service::check_job_id("episode_id", &request.episode_id)?;
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
        let answer = job::Answer {
            turn: request.turn,
            completion,
            prompt_token_ids: request.prompt_token_ids,
            idempotency_key: request.idempotency_key,
        };
        let stepped = job::step(plan, job, peers, self.store.clone(), answer).await.map_err(|error| match error {
            job::StepError::Store(error) => store_status(error),
            job::StepError::Precondition(message) => OrchestratorError::Precondition(message).into(),
            job::StepError::Credit(error) => Status::new(
                error.code(),
                format!("returns and advantages: {error} (the step is recorded: retry it with the same key)"),
            ),
        })?;
        Ok(Response::new(stepped.observation(episode_id)))
    }

    async fn get_episode(&self, request: Request<pb::GetEpisodeRequest>) -> Result<Response<pb::Observation>, Status> {
        let request = request.into_inner();
        crate::service::check_job_id("episode_id", &request.episode_id)?;
        let job = self.job(&request.episode_id).await?;
        let spec = job.spec.clone().unwrap_or_default();
        if spec.model != job::STEP_MODEL {
            let message = format!("{} is a job, not a step-API episode", job.job_id);
            return Err(OrchestratorError::Precondition(message).into());
        }
        let tasks = self.store.tasks(&job.job_id).await.map_err(store_status)?;
        let plan = Plan::resumed(spec, tasks)?;
        let observation = job::current(&plan, &self.store, &job.job_id).await.map_err(|error| match error {
            job::StepError::Store(error) => store_status(error),
            other => Status::internal(other.to_string()),
        })?;
        Ok(Response::new(observation))
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

/// A step-API episode's request as the spec of a job of its one task and one trajectory, with its idempotency key;
/// what only the request can get wrong (no task, a bad key) refused first.
fn episode_spec(request: pb::StartEpisodeRequest) -> Result<(pb::JobSpec, String), OrchestratorError> {
    let pb::StartEpisodeRequest { recipe, task, turns, backend, idempotency_key, policy, reward, strict_format } =
        request;
    let task = task.ok_or_else(|| OrchestratorError::invalid("task", "required"))?;
    check_key(&idempotency_key)?;
    let spec = pb::JobSpec {
        kind: pb::JobKind::Rollout.into(),
        recipe,
        task_set: "inline".into(),
        tasks: vec![task],
        model: job::STEP_MODEL.into(),
        trajectories_per_task: 1,
        turns,
        backend,
        policy,
        reward,
        strict_format,
        ..Default::default()
    };
    Ok((spec, idempotency_key))
}

/// A step-API episode's plan: its spec checked and held to the limits as a job's is, the errors naming the
/// request's fields rather than the spec's; cudaforge refused.
fn episode_plan(spec: pb::JobSpec, limits: &LimitsConfig) -> Result<Plan, OrchestratorError> {
    let request_field = |field: String| match field.as_str() {
        "spec" => "turns".to_owned(),
        field => field.replace("spec.tasks[0]", "task").trim_start_matches("spec.").to_owned(),
    };
    let plan = Plan::submitted(spec, limits).map_err(|error| match error {
        OrchestratorError::InvalidArgument { field, message } => {
            OrchestratorError::InvalidArgument { field: request_field(field), message }
        }
        OrchestratorError::OverLimit { field, value, unit, limit, key } => {
            OrchestratorError::OverLimit { field: request_field(field), value, unit, limit, key }
        }
        other => other,
    })?;
    if plan.recipe == recipe::Recipe::CudaForge {
        // Its Judge is a second model the orchestrator asks through the gateway; a stepped episode has one, the
        // trainer's.
        return Err(OrchestratorError::invalid(
            "recipe",
            "cudaforge reviews each kernel with a Judge model through the gateway: submit it as a job \
             (SubmitJob); stepped episodes take single-turn, kevin or drkernel",
        ));
    }
    Ok(plan)
}

/// The longest idempotency key accepted, in bytes: a key is an id the caller chose, stored with the job and looked
/// up by equality.
const MAX_KEY_BYTES: usize = 256;

/// An idempotency key the store can keep and look up: at most [`MAX_KEY_BYTES`], no control characters (a NUL
/// is not text to PostgreSQL).
fn check_key(key: &str) -> Result<(), OrchestratorError> {
    if key.len() > MAX_KEY_BYTES {
        let message = format!("{} bytes, over the limit of {MAX_KEY_BYTES}", key.len());
        return Err(OrchestratorError::invalid("idempotency_key", message));
    }
    if key.chars().any(char::is_control) {
        return Err(OrchestratorError::invalid("idempotency_key", "contains a control character"));
    }
    Ok(())
}

/// Parses a page token or cursor this service wrote.
fn parse_token<T: std::str::FromStr>(field: &str, token: &str) -> Result<Option<T>, OrchestratorError> {
    if token.is_empty() {
        return Ok(None);
    }
    token.parse().map(Some).map_err(|_| OrchestratorError::invalid(field, "not a token this service wrote"))
}

/// A named caller acts only on its own jobs. A job without a caller (submitted with the shared token, or without
/// auth) is anyone's, and a request without one (the shared token: the operator's) may act on any job.
fn check_owner(caller: Option<&str>, job: &pb::Job) -> Result<(), OrchestratorError> {
    match caller {
        Some(caller) if !job.caller.is_empty() && job.caller != caller => {
            Err(OrchestratorError::NotOwner { caller: caller.to_owned(), job_id: job.job_id.clone() })
        }
        _ => Ok(()),
    }
}

/// Whether a job in `state` is over (succeeded, failed or cancelled).
fn is_terminal(state: i32) -> bool {
    matches!(
        pb::JobState::try_from(state),
        Ok(pb::JobState::Succeeded | pb::JobState::Failed | pb::JobState::Cancelled)
    )
}
