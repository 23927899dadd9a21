//! The protocol faces of the orchestrator's HTTP port: other projects' wire protocols, each a thin layer over the
//! step API (StartEpisode, Step, GetEpisode: a face's session is an episode, stored, resumable, exported and traced
//! as any) or the evaluator, so a trainer or environment hub that speaks one of them points at kforge by its URL.
//!
//! - `kernelgym`: KernelGym's evaluation server (`/kernelgym/evaluate`, `/status/{id}`, `/results/{id}`, ...).
//! - `openenv`: an OpenEnv environment (`/openenv/ws` sessions; `/openenv/reset`, `/step`, `/state`).
//! - `nemo_gym`: a NeMo Gym resources server (`/seed_session`, `/verify`, the `submit_kernel` tool) at the root.
//! - `ors`: an Open Reward Standard server (tasks, splits, sessions, tool calls over server-sent events) at the root.
//!
//! Every face answers a bad request with a 4xx and the JSON body of [`JsonError`] naming the field
//! (docs/faces/).

mod kernelgym;
mod nemo_gym;
mod openenv;
mod ors;

use std::sync::Arc;

use http::HeaderMap;
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_server::InProcess;
use kforge_server::json::JsonError;
use tonic::Code;

use crate::config::HttpConfig;
use crate::service::OrchestratorService;

/// What every face shares: the channel into this orchestrator's gRPC services, the service itself (for the
/// evaluator pool), the tasks the faces offer and their settings.
#[derive(Clone, Debug)]
pub struct Faces {
    channel: InProcess,
    service: OrchestratorService,
    tasks: Arc<[pb::Task]>,
    config: Arc<HttpConfig>,
}

/// Every face's routes on one router.
pub fn router(
    channel: InProcess,
    service: OrchestratorService,
    tasks: Vec<pb::Task>,
    config: HttpConfig,
) -> axum::Router {
    let faces = Faces { channel, service, tasks: tasks.into(), config: Arc::new(config) };
    axum::Router::new()
        .nest("/kernelgym", kernelgym::router(faces.clone()))
        .nest("/openenv", openenv::router(faces.clone()))
        .merge(nemo_gym::router(faces.clone()))
        .merge(ors::router(faces))
}

impl Faces {
    /// An orchestrator client presenting the HTTP request's `authorization` header, so each call is the caller's
    /// (its quotas, its episodes).
    pub(crate) fn orchestrator(&self, headers: &HeaderMap) -> OrchestratorClient<InProcess> {
        OrchestratorClient::new(self.channel.authorized(headers.get(http::header::AUTHORIZATION).cloned()))
    }

    /// The tasks the faces offer, in order.
    pub(crate) fn tasks(&self) -> &[pb::Task] {
        &self.tasks
    }

    /// The task named by `id`: its `task_id` or its index in [`Faces::tasks`]; `field` names the request's field in
    /// the NOT_FOUND.
    pub(crate) fn task(&self, id: &str, field: &str) -> Result<&pb::Task, JsonError> {
        let found = self
            .tasks
            .iter()
            .find(|task| task.task_id == id)
            .or_else(|| id.parse::<usize>().ok().and_then(|index| self.tasks.get(index)));
        found.ok_or_else(|| {
            let message = format!("no task `{id}` in {} ({} tasks)", self.config.task_set, self.tasks.len());
            JsonError::new(Code::NotFound, format!("{field}: {message}"), Some(field))
        })
    }

    pub(crate) fn config(&self) -> &HttpConfig {
        &self.config
    }

    /// Starts an episode of `task` with the faces' recipe and turns; a retry with the same `key` returns the same
    /// episode.
    pub(crate) async fn start(
        &self,
        headers: &HeaderMap,
        task: pb::Task,
        key: &str,
    ) -> Result<pb::Observation, JsonError> {
        let request = pb::StartEpisodeRequest {
            recipe: self.config.recipe.clone(),
            task: Some(task),
            turns: self.config.turns,
            idempotency_key: key.to_owned(),
            // A face's action carries a kernel, not the model's whole response: its format is not the recipe's.
            strict_format: Some(false),
            ..Default::default()
        };
        let observation =
            self.orchestrator(headers).start_episode(request).await.map_err(|s| JsonError::from_status(&s))?;
        Ok(observation.into_inner())
    }

    /// Submits `completion` as turn `turn` of `episode`; the key makes a retry a replay.
    pub(crate) async fn step(
        &self,
        headers: &HeaderMap,
        episode: &str,
        turn: u32,
        completion: pb::Completion,
        prompt_token_ids: Vec<u32>,
    ) -> Result<pb::Observation, JsonError> {
        let request = pb::StepRequest {
            episode_id: episode.to_owned(),
            completion: Some(completion),
            turn,
            idempotency_key: format!("{episode}/{turn}"),
            prompt_token_ids,
        };
        let observation = self.orchestrator(headers).step(request).await.map_err(|s| JsonError::from_status(&s))?;
        Ok(observation.into_inner())
    }

    /// The episode's current observation.
    pub(crate) async fn current(&self, headers: &HeaderMap, episode: &str) -> Result<pb::Observation, JsonError> {
        let request = pb::GetEpisodeRequest { episode_id: episode.to_owned() };
        let observation =
            self.orchestrator(headers).get_episode(request).await.map_err(|s| JsonError::from_status(&s))?;
        Ok(observation.into_inner())
    }

    /// Evaluates through this orchestrator's evaluator pool, with its retries of a busy evaluator.
    pub(crate) async fn evaluate(&self, request: pb::EvaluateRequest) -> Result<pb::EvaluateResponse, JsonError> {
        self.service.evaluate(request).await.map_err(|s| JsonError::from_status(&s))
    }
}

/// Reads a request body as `T`; malformed JSON or a field of the wrong shape is INVALID_ARGUMENT naming the field
/// (`task_id: invalid type: integer `3`, expected a string`), answered 400.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, JsonError> {
    let body = if body.iter().all(u8::is_ascii_whitespace) { &b"{}"[..] } else { body };
    let mut json = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut json).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return JsonError::new(Code::InvalidArgument, format!("malformed json: {inner}"), None);
        }
        let message = inner.to_string();
        // serde names a missing field in its message, at the path of the object that lacks it.
        let missing = message.strip_prefix("missing field `").and_then(|rest| rest.split_once('`')).map(|(f, _)| f);
        let field = match (path.as_str(), missing) {
            ("" | ".", None) => return JsonError::new(Code::InvalidArgument, message, None),
            ("" | ".", Some(missing)) => missing.to_owned(),
            (path, Some(missing)) => format!("{path}.{missing}"),
            (path, None) => path.to_owned(),
        };
        JsonError::new(Code::InvalidArgument, format!("{field}: {message}"), Some(&field))
    })
}

/// A verdict's name without its prefix, lowercase (`correct`, `compile_error`); `None` when nothing was evaluated.
pub(crate) fn verdict_name(verdict: i32) -> Option<String> {
    match pb::Verdict::try_from(verdict) {
        Ok(pb::Verdict::Unspecified) | Err(_) => None,
        Ok(verdict) => Some(verdict.as_str_name().trim_start_matches("VERDICT_").to_ascii_lowercase()),
    }
}

/// The request's `authorization` header alone: what a call made on the client's behalf presents.
pub(crate) fn only_authorization(headers: &HeaderMap) -> HeaderMap {
    let mut kept = HeaderMap::new();
    if let Some(value) = headers.get(http::header::AUTHORIZATION) {
        kept.insert(http::header::AUTHORIZATION, value.clone());
    }
    kept
}

/// A stable 128-bit fingerprint of `parts` (FNV-1a twice with different offsets, each part with its length): the
/// same content gives the same key across builds and processes.
pub(crate) fn fingerprint(parts: &[&[u8]]) -> String {
    let mut halves = [0xcbf2_9ce4_8422_2325_u64, 0x6c62_272e_07bb_0142_u64];
    for half in &mut halves {
        for part in parts {
            for byte in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
                *half ^= u64::from(*byte);
                *half = half.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    }
    format!("{:016x}{:016x}", halves[0], halves[1])
}

/// A key no other request gets: for work that nothing identifies as a retry.
pub(crate) fn unique_key() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    hasher.write_u128(now);
    hasher.write_u32(std::process::id());
    format!("{:016x}", hasher.finish())
}

/// A prompt as one text: each message's content, separated by a blank line (the faces whose observations are text).
pub(crate) fn prompt_text(prompt: &[pb::ChatMessage]) -> String {
    prompt.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n\n")
}

/// A kernel's source as the model's answer the recipes read: the code in a fenced Python block.
pub(crate) fn answer_with(kernel: &str) -> String {
    format!("```python\n{}\n```", kernel.trim_end())
}
