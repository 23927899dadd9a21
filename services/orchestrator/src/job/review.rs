//! The cudaforge Judge's calls for a turn: the kernel profiled (optimisation mode), the Judge asked through the
//! gateway, and its advice made into the next turn's feedback. What the Judge is shown and how its answer is read
//! are `judge.rs`'s (pure); this module makes the calls and never fails the turn.

use std::time::Instant;

use kforge_proto::v1 as pb;
use kforge_proto::v1::profiler_client::ProfilerClient;
use tracing::Instrument as _;

use super::episode::Episode;
use super::peers::{Peers, call_span};
use super::progress::StageGuard;
use crate::failure::Refusal;
use crate::judge::{self, Mode, ProfileView};

/// Why a turn's kernel has no profile for the Judge; recorded as the review's `profile_note`.
#[derive(Debug, thiserror::Error)]
enum NoProfile {
    #[error("the job evaluates on the CPU, and Nsight Compute profiles GPU kernels")]
    CpuBackend,
    #[error("no profiler was reachable when the job started")]
    NoProfiler,
    /// The profiler (or its pool) answered with an error status.
    #[error("profiler: {code:?}: {message}")]
    Profiler { code: tonic::Code, message: String },
    #[error("the profile ended {verdict:?}: {first_line}")]
    Failed { verdict: pb::Verdict, first_line: String },
    #[error("Nsight Compute profiled no launch of the kernel's own kernels")]
    NoLaunch,
}

impl Episode {
    /// The cudaforge Judge's review of a turn's evaluated kernel (`judge.rs`) and the feedback it makes for the
    /// next turn. Never fails the turn: a missing profile, a failed generation or a malformed answer is recorded
    /// in the review, and the feedback is then the evaluation's own.
    pub(super) async fn review(
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
                Err(why) => {
                    let note = why.to_string();
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
                review.error = format!("gateway: {}", Refusal::from(&status));
                judge::feedback_without_review(&shown, "the reviewer could not be asked")
            }
        };
        review.wall_time_s = started.elapsed().as_secs_f64();
        (review, feedback)
    }

    /// The kernel's profile as the Judge is shown it, or why there is none.
    async fn profile(&self, job_id: &str, kernel: &str, peers: &mut Peers) -> Result<ProfileView, NoProfile> {
        let spec = &self.plan.spec;
        let Some(profilers) = peers.profiler.as_ref() else {
            return Err(if spec.backend() == pb::Backend::Cpu { NoProfile::CpuBackend } else { NoProfile::NoProfiler });
        };
        let request = pb::ProfileRequest {
            request_id: String::new(),
            task: Some(self.task.clone()),
            candidate_source: kernel.to_owned(),
            backend: spec.backend,
            metric_set: pb::MetricSet::Cudaforge as i32,
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
        let refused =
            |status: tonic::Status| NoProfile::Profiler { code: status.code(), message: status.message().to_owned() };
        let profile = profiled.map_err(refused)?.into_inner();
        if profile.verdict() != pb::Verdict::Correct {
            let first_line = profile.error.lines().next().unwrap_or("").to_owned();
            return Err(NoProfile::Failed { verdict: profile.verdict(), first_line });
        }
        ProfileView::of(&profile).ok_or(NoProfile::NoLaunch)
    }
}
