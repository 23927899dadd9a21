//! One turn's stages: the prompt built and generated through the gateway (stored at stage generated), the kernel
//! extracted and evaluated (stored at stage evaluated), scored and diagnosed by the reward service, and the feedback
//! the next turn shows made (with cudaforge's review, `review.rs`). The turn comes back, with its failure if a call
//! failed, for its episode to record.

use std::time::Instant;

use kforge_proto::v1 as pb;
use tracing::Instrument as _;

use super::episode::Episode;
use super::peers::{Peers, call_span, evaluate};
use super::progress::{StageGuard, TakenTurn};
use crate::failure::{Refusal, TurnFailure};
use crate::recipe::{self, Attempt, Recipe};
use crate::reward;
use crate::store::{Stage, StoreError};

impl Episode {
    /// Turn `turn` of the episode, `earlier` its recorded turns: generated (unless `resumed` brings its stored
    /// stage and record), evaluated, scored and diagnosed, with the feedback the next turn shows. A failed call is
    /// the returned turn's failure; only a store failure is an error.
    pub(super) async fn turn(
        &self,
        job_id: &str,
        turn: u32,
        earlier: &[Attempt],
        resumed: Option<(Stage, pb::TurnRecord)>,
    ) -> Result<TakenTurn, StoreError> {
        let started = Instant::now();
        // Clients are cheap handles on shared channels.
        let mut peers = self.peers.clone();
        let (stage, mut taken) = match resumed {
            Some((stage, record)) => {
                tracing::info!(job_id, task_id = %self.task.task_id, trajectory = self.trajectory, turn, ?stage,
                    "turn resumed from its stored stage");
                (Some(stage), TakenTurn { record, failure: None })
            }
            None => (None, self.generate(job_id, turn, earlier, &mut peers).await?),
        };
        if taken.failure.is_some() {
            // Its generation failed: there is nothing to evaluate, score or review.
            taken.record.wall_time_s = started.elapsed().as_secs_f64();
            return Ok(taken);
        }
        if stage < Some(Stage::Evaluated) {
            self.evaluate(job_id, turn, &mut taken, &peers).await?;
        }
        // The turn counts as scoring until it is recorded, its review included.
        let _stage = StageGuard::enter(&self.progress.in_flight.scoring, self.progress.metrics.in_flight("scoring"));
        self.progress.notify().await;
        let outcome = taken.record.evaluation.as_ref().map(|e| reward::kernel_outcome(e, self.plan.census));
        self.score(&mut taken, outcome.clone(), &mut peers).await;
        self.diagnose(&mut taken, outcome, &mut peers).await;
        // A turn resumed with its review keeps it: the Judge is not asked twice.
        if taken.record.judge.is_none() {
            self.feedback(job_id, turn, &mut taken, &mut peers).await?;
        }
        taken.record.wall_time_s = started.elapsed().as_secs_f64();
        tracing::info!(
            job_id, task_id = %self.task.task_id, trajectory = self.trajectory, turn,
            verdict = ?taken.record.verdict(), score = ?taken.record.score, "turn recorded"
        );
        Ok(taken)
    }

    /// Builds the prompt and generates; the response is stored (stage generated) before this returns. A failed
    /// generation comes back as the turn's failure, with the feedback that says so, for the caller to record.
    async fn generate(
        &self,
        job_id: &str,
        turn: u32,
        earlier: &[Attempt],
        peers: &mut Peers,
    ) -> Result<TakenTurn, StoreError> {
        let spec = &self.plan.spec;
        let prompt = self.plan.templates.prompt(&self.task, earlier);
        let mut record = pb::TurnRecord {
            turn,
            prompt: prompt.clone(),
            task_id: self.task.task_id.clone(),
            trajectory: self.trajectory,
            ..Default::default()
        };
        let not_generated = |mut record: pb::TurnRecord, failure: TurnFailure| {
            record.feedback = recipe::feedback(None, Some(&failure));
            TakenTurn { record, failure: Some(failure) }
        };
        let rollout = spec.kind() == pb::JobKind::Rollout;
        let episode_id = format!("{job_id}/{}/{}", self.task.task_id, self.trajectory);
        let request = self.generate_request(job_id, turn, &spec.model, prompt, episode_id, rollout);
        let generated = match self.ask(peers, request).await {
            Ok(response) => response.into_inner(),
            Err(status) => return Ok(not_generated(record, TurnFailure::Generation(Refusal::from(&status)))),
        };
        record.usage = generated.usage;
        record.prompt_token_ids = generated.prompt_token_ids;
        let Some(completion) = generated.completions.into_iter().next() else {
            return Ok(not_generated(record, TurnFailure::NoCompletion));
        };
        let record = self.plan.read_completion(record, completion);
        self.progress.stage(self.position, Stage::Generated, &record).await?;
        Ok(TakenTurn { record, failure: None })
    }

    /// Evaluates the turn's kernel, where its response has one in the expected format, and stores the evaluation
    /// (stage evaluated); a refused evaluation is the turn's failure.
    async fn evaluate(&self, job_id: &str, turn: u32, taken: &mut TakenTurn, peers: &Peers) -> Result<(), StoreError> {
        let record = &mut taken.record;
        if record.kernel.is_empty() || !record.format_error.is_empty() {
            return Ok(());
        }
        let spec = &self.plan.spec;
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
        match evaluate(&peers.evaluator, &peers.limits, request, &self.cancel).await {
            Ok(evaluation) => {
                record.verdict = evaluation.verdict;
                record.evaluation = Some(evaluation);
                self.progress.stage(self.position, Stage::Evaluated, record).await
            }
            Err(status) => {
                taken.fail(TurnFailure::Evaluation(Refusal::from(&status)));
                Ok(())
            }
        }
    }

    /// Scores the evaluated kernel (`outcome`; an infrastructure error is never scored), and a response out of the
    /// strict format 0; a refused score is the turn's failure.
    async fn score(&self, taken: &mut TakenTurn, outcome: Option<pb::KernelOutcome>, peers: &mut Peers) {
        if !taken.record.format_error.is_empty() {
            // Kevin's strict format: a response out of shape is worth nothing, whatever its code would do.
            taken.record.score = Some(0.0);
        }
        let Some(outcome) = outcome.filter(|o| o.verdict() != pb::Verdict::InfraError) else { return };
        let request = self.plan.reward.score_request(outcome);
        let scored = {
            let _permit = peers.limits.reward.acquire().await.expect("the reward semaphore is never closed");
            peers.reward.score_kernels(request).instrument(call_span("Reward/ScoreKernels")).await
        };
        match scored {
            Ok(response) => {
                if let Some(score) = response.into_inner().scores.into_iter().next() {
                    taken.record.score = Some(score.score);
                    taken.record.speedup = (score.speedup > 0.0).then_some(score.speedup);
                }
            }
            Err(status) => taken.fail(TurnFailure::Reward(Refusal::from(&status))),
        }
    }

    /// Has the reward service flag the response (junk, not okay, degenerate, a hack); a refusal is the turn's
    /// failure unless an earlier call failed.
    async fn diagnose(&self, taken: &mut TakenTurn, outcome: Option<pb::KernelOutcome>, peers: &mut Peers) {
        let completion = taken.record.completion.clone().unwrap_or_default();
        let request = pb::DiagnoseRequest {
            params: self.plan.spec.diagnose.clone(),
            responses: vec![pb::ModelResponse {
                response_id: String::new(),
                text: completion.text,
                reasoning: completion.reasoning,
                finish_reason: completion.finish_reason,
                outcome,
            }],
        };
        let diagnosed = {
            let _permit = peers.limits.reward.acquire().await.expect("the reward semaphore is never closed");
            peers.reward.diagnose(request).instrument(call_span("Reward/Diagnose")).await
        };
        match diagnosed {
            Ok(response) => taken.record.flags = response.into_inner().flags.into_iter().next(),
            Err(status) => taken.fail(TurnFailure::Reward(Refusal::from(&status))),
        }
    }

    /// The feedback the next turn shows: the evaluation's (or why there is none), with drkernel's census and, for
    /// a cudaforge turn that did not fail and is not the last, the Judge's review (stored with the evaluation).
    async fn feedback(
        &self,
        job_id: &str,
        turn: u32,
        taken: &mut TakenTurn,
        peers: &mut Peers,
    ) -> Result<(), StoreError> {
        let record = &mut taken.record;
        record.feedback = match record.format_error.is_empty() {
            true => recipe::feedback(record.evaluation.as_ref(), taken.failure.as_ref()),
            false => recipe::format_feedback(&record.format_error),
        };
        if let Some(evaluation) = record.evaluation.as_ref().filter(|_| self.plan.recipe == Recipe::DrKernel) {
            record.feedback.push_str(&recipe::census_feedback(evaluation));
        }
        let reviewed =
            self.plan.recipe == Recipe::CudaForge && turn + 1 < self.plan.spec.turns && taken.failure.is_none();
        if let Some(evaluation) = record.evaluation.clone().filter(|_| reviewed) {
            let (review, feedback) = self.review(job_id, turn, record, &evaluation, peers).await;
            record.judge = Some(review);
            record.feedback = feedback;
            self.progress.stage(self.position, Stage::Evaluated, record).await?;
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_s_failure_is_its_first_failed_call() {
        let refused = |code| TurnFailure::Reward(Refusal { code, message: "no".into() });
        let mut taken = TakenTurn { record: pb::TurnRecord::default(), failure: None };
        taken.fail(TurnFailure::Evaluation(Refusal { code: tonic::Code::Unavailable, message: "down".into() }));
        taken.fail(refused(tonic::Code::Internal));
        assert_eq!(taken.failure.map(|f| f.to_string()).as_deref(), Some("evaluator: Unavailable: down"));
    }
}
