//! One turn's stages: the prompt built and generated through the gateway (stored at stage generated), the kernel
//! extracted and evaluated (stored at stage evaluated), scored and diagnosed by the reward service, and the feedback
//! the next turn shows made (with cudaforge's review, `review.rs`). The turn comes back for its episode to record.

use std::time::Instant;

use kforge_proto::v1 as pb;
use tracing::Instrument as _;

use super::episode::Episode;
use super::peers::{Peers, call_span, evaluate, peer_error};
use super::progress::StageGuard;
use crate::recipe::{self, Attempt, Recipe};
use crate::reward;
use crate::store::{Stage, StoreError};

impl Episode {
    /// Turn `turn` of the episode, `earlier` its recorded turns: generated (unless `resumed` brings its stored
    /// stage and record), evaluated, scored and diagnosed, with the feedback the next turn shows. A failed call is
    /// recorded in the returned turn; only a store failure is an error.
    pub(super) async fn turn(
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

    /// A generation of `prompt` by `model` for this episode's `turn`, with the job's sampling (a seed offset by the
    /// trajectory, so that a task's trajectories differ and a rerun repeats them); token ids and log-probabilities
    /// asked for with `tokens`.
    pub(super) fn generate_request(
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
    pub(super) async fn ask(
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
}
