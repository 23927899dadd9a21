//! The OpenEnv face (docs/faces/OPENENV.md): kforge as one OpenEnv environment, nested at `/openenv`, so an
//! `openenv` client (`GenericEnvClient(base_url="http://host:port/openenv")`) drives kforge's episodes. A kernel task
//! is the environment's problem; a session is a step-API episode (StartEpisode, Step, GetEpisode), stored, resumable,
//! exported and traced like any other.
//!
//! - `GET /ws`: the session protocol (`session`): `reset`, `step`, `state` and `close` messages, one reply each, in
//!   order. A reset naming an existing `episode_id` resumes that episode, after any step of it still evaluating.
//! - `POST /reset`, `POST /step`, `GET /state`: the same over plain HTTP, stateful where upstream's are not: the
//!   episode is named by `episode_id` in the body or query.
//! - `GET /health`, `GET /schema`, `GET /metadata`.
//!
//! A step runs in a task of its own: a client that disconnects (or an HTTP request dropped) mid-step does not
//! cancel it; it is recorded, and a reset with the episode's id later answers with the observation after it.

mod session;
mod wire;

use crate::faces::only_authorization;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::body::Bytes;
use axum::extract::{RawQuery, State, WebSocketUpgrade};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::HeaderMap;
use kforge_proto::v1 as pb;
use kforge_server::json::JsonError;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::watch;
use tonic::Code;

use super::{Faces, parse};
use wire::{Submission, invalid};

pub(super) fn router(faces: Faces) -> Router {
    let env = OpenEnv { faces, steps: Arc::new(Steps::default()) };
    Router::new()
        .route("/ws", get(websocket))
        .route("/health", get(|| async { Json(json!({"status": "healthy"})) }))
        .route("/schema", get(|| async { Json(wire::schema()) }))
        .route("/metadata", get(metadata))
        .route("/reset", post(http_reset))
        .route("/step", post(http_step))
        .route("/state", get(http_state))
        .with_state(env)
}

/// The face: the shared layer and the steps running through it.
#[derive(Clone)]
struct OpenEnv {
    faces: Faces,
    steps: Arc<Steps>,
}

/// Where a session's episode stands, as its replies describe it.
#[derive(Clone, Debug)]
struct Episode {
    id: String,
    task_id: String,
    max_turns: u32,
    /// The turn the next step answers.
    turn: u32,
    done: bool,
}

impl Episode {
    fn after(mut self, observation: &pb::Observation) -> Self {
        self.turn = observation.turn;
        self.done = observation.done;
        self
    }
}

/// What a reset names: a task (by id or index, or by seed), or an episode to resume. Other keys are ignored, as
/// upstream ignores the keyword arguments its environment's `reset` does not take.
#[derive(Debug, Default, Deserialize)]
struct ResetArgs {
    #[serde(default)]
    task_id: Option<Value>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    episode_id: Option<String>,
}

impl OpenEnv {
    /// Starts an episode of the task `args` names, or resumes the episode it names (once a step of it still running
    /// here has been recorded). `at` prefixes the fields errors name (`data.` on the WebSocket).
    async fn reset(
        &self,
        headers: &HeaderMap,
        args: ResetArgs,
        at: &str,
    ) -> Result<(pb::Observation, Episode), JsonError> {
        if let Some(id) = args.episode_id.filter(|id| !id.is_empty()) {
            return self.resume(headers, &id, &format!("{at}episode_id")).await;
        }
        let task = self.pick(&args.task_id, args.seed, &format!("{at}task_id"))?;
        let observation = self.faces.start(headers, task.clone(), "").await?;
        let episode = Episode {
            id: observation.episode_id.clone(),
            task_id: task.task_id,
            max_turns: self.faces.config().turns,
            turn: observation.turn,
            done: observation.done,
        };
        Ok((observation, episode))
    }

    /// The current observation of episode `id`, after any step of it running here.
    async fn resume(
        &self,
        headers: &HeaderMap,
        id: &str,
        field: &str,
    ) -> Result<(pb::Observation, Episode), JsonError> {
        self.steps.settled(id).await;
        self.describe(headers, id, field).await
    }

    /// The current observation of episode `id` (`field` names it in errors), and where it stands.
    async fn describe(
        &self,
        headers: &HeaderMap,
        id: &str,
        field: &str,
    ) -> Result<(pb::Observation, Episode), JsonError> {
        let observation = self.faces.current(headers, id).await.map_err(|error| naming(error, field, id))?;
        let job = self
            .faces
            .orchestrator(headers)
            .get_job(pb::GetJobRequest { job_id: id.to_owned() })
            .await
            .map_err(|status| naming(JsonError::from_status(&status), field, id))?
            .into_inner();
        let spec = job.spec.unwrap_or_default();
        let task_id = spec.tasks.first().map(|task| task.task_id.clone()).unwrap_or_default();
        let episode = Episode { id: id.to_owned(), task_id, max_turns: spec.turns, turn: 0, done: false };
        let episode = episode.after(&observation);
        Ok((observation, episode))
    }

    /// The task a reset names: `task_id` (an id, or an index into the task set), else the one `seed` picks, else
    /// one at random.
    fn pick(&self, task_id: &Option<Value>, seed: Option<u64>, field: &str) -> Result<pb::Task, JsonError> {
        let tasks = self.faces.tasks();
        if tasks.is_empty() {
            let message = format!("the task set `{}` has no tasks", self.faces.config().task_set);
            return Err(JsonError::new(Code::FailedPrecondition, message, None));
        }
        let index = |n: u64| (n % tasks.len() as u64) as usize;
        match task_id {
            Some(Value::String(id)) => self.faces.task(id, field).cloned(),
            Some(Value::Number(n)) if n.as_u64().is_some() => self.faces.task(&n.to_string(), field).cloned(),
            None | Some(Value::Null) => Ok(tasks[index(seed.unwrap_or_else(random))].clone()),
            Some(other) => Err(invalid(field, &format!("a task id or an index into the task set, got {other}"))),
        }
    }

    /// Submits one action as the episode's next turn, in a task of its own (registered before this returns): a
    /// caller that goes away does not cancel it.
    fn spawn_step(
        &self,
        headers: HeaderMap,
        episode: Episode,
        submission: Submission,
    ) -> tokio::task::JoinHandle<Result<(pb::Observation, Episode), JsonError>> {
        let running = self.steps.begin(&episode.id);
        let faces = self.faces.clone();
        tokio::spawn(async move {
            let _running = running;
            let Submission { completion, prompt_token_ids } = submission;
            let observation = faces.step(&headers, &episode.id, episode.turn, completion, prompt_token_ids).await?;
            let episode = episode.after(&observation);
            Ok((observation, episode))
        })
    }

    /// [`OpenEnv::spawn_step`], awaited; an episode already over is refused here.
    async fn step(
        &self,
        headers: &HeaderMap,
        episode: Episode,
        submission: Submission,
    ) -> Result<(pb::Observation, Episode), JsonError> {
        if episode.done {
            let message = "the episode is over: reset to start another";
            return Err(JsonError::new(Code::FailedPrecondition, message, None));
        }
        let handle = self.spawn_step(only_authorization(headers), episode, submission);
        handle.await.map_err(|error| JsonError::new(Code::Internal, format!("the step failed: {error}"), None))?
    }
}

/// The steps running through this face, by episode, so a resume waits for the one its client lost.
#[derive(Debug, Default)]
struct Steps {
    next: AtomicU64,
    running: Mutex<HashMap<String, (u64, watch::Receiver<bool>)>>,
}

impl Steps {
    /// Registers a step of `episode` as running until the returned guard is dropped.
    fn begin(self: &Arc<Self>, episode: &str) -> Running {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (done, receiver) = watch::channel(false);
        self.running.lock().unwrap_or_else(PoisonError::into_inner).insert(episode.to_owned(), (id, receiver));
        Running { steps: self.clone(), episode: episode.to_owned(), id, done }
    }

    /// Returns once no step of `episode` that started here is running.
    async fn settled(&self, episode: &str) {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner).get(episode).map(|(_, r)| r.clone());
        if let Some(mut running) = running {
            // An error means the step's guard is gone: it ended too.
            let _ = running.wait_for(|done| *done).await;
        }
    }
}

/// A running step; dropping it (the step ended, or its task panicked) marks it done.
#[derive(Debug)]
struct Running {
    steps: Arc<Steps>,
    episode: String,
    id: u64,
    done: watch::Sender<bool>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut running = self.steps.running.lock().unwrap_or_else(PoisonError::into_inner);
        if running.get(&self.episode).is_some_and(|(id, _)| *id == self.id) {
            running.remove(&self.episode);
        }
        drop(running);
        let _ = self.done.send(true);
    }
}

/// The error of a call about episode `id`, naming `field` when the episode does not exist.
fn naming(error: JsonError, field: &str, id: &str) -> JsonError {
    match error.code() {
        Code::NotFound => JsonError::new(Code::NotFound, format!("{field}: no episode `{id}`"), Some(field)),
        Code::InvalidArgument if error.field().is_some() => {
            JsonError::new(Code::InvalidArgument, format!("{field}: {}", tail(error.message())), Some(field))
        }
        Code::FailedPrecondition => JsonError::new(Code::FailedPrecondition, error.message(), Some(field)),
        _ => error,
    }
}

/// A message without the field it names first.
fn tail(message: &str) -> &str {
    match kforge_server::json::field_of(message) {
        Some(field) => message[field.len()..].trim_start_matches(": "),
        None => message,
    }
}

/// The value of `key` in a URL's query (`a=1&episode_id=job-1`), percent-decoded.
fn query_value(query: &str, key: &str) -> Option<String> {
    let decode = |text: &str| {
        let bytes = text.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let hex = |at: usize| bytes.get(at).and_then(|b| (*b as char).to_digit(16));
            match bytes[i] {
                b'+' => out.push(b' '),
                b'%' if hex(i + 1).is_some() && hex(i + 2).is_some() => {
                    out.push((hex(i + 1).unwrap_or(0) * 16 + hex(i + 2).unwrap_or(0)) as u8);
                    i += 2;
                }
                byte => out.push(byte),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    query.split('&').filter_map(|pair| pair.split_once('=')).find(|(k, _)| decode(k) == key).map(|(_, v)| decode(v))
}

/// A random number (a task for a reset that names none).
fn random() -> u64 {
    use std::hash::{BuildHasher as _, Hasher as _};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    hasher.finish()
}

async fn websocket(State(env): State<OpenEnv>, headers: HeaderMap, upgrade: WebSocketUpgrade) -> Response {
    let headers = only_authorization(&headers);
    upgrade.on_upgrade(move |socket| session::run(env, socket, headers))
}

async fn metadata(State(env): State<OpenEnv>) -> Json<Value> {
    let config = env.faces.config();
    Json(json!({
        "name": "kforge",
        "description": format!(
            "Write a faster kernel for a PyTorch reference: each step submits ModelNew's source, which kforge \
             compiles, checks against the reference and times ({} tasks from `{}`, recipe `{}`, {} turns).",
            env.faces.tasks().len(), config.task_set, config.recipe, config.turns
        ),
        "readme_content": null,
        "version": env!("CARGO_PKG_VERSION"),
        "author": "kforge",
        "documentation_url": null,
        "task_set": config.task_set,
        "tasks": env.faces.tasks().len(),
        "recipe": config.recipe,
        "max_turns": config.turns,
    }))
}

async fn http_reset(State(env): State<OpenEnv>, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        let args: ResetArgs = parse(&body)?;
        env.reset(&headers, args, "").await
    };
    match result.await {
        Ok((observation, episode)) => Json(wire::observation(&observation, &episode)).into_response(),
        Err(error) => error.into_response(),
    }
}

/// `POST /step`: upstream's `{"action": {...}}`, with the episode's id (required here) and, optionally, the turn the
/// action answers (a retry with it is answered with the recorded step instead of taking another).
#[derive(Debug, Deserialize)]
struct HttpStep {
    episode_id: String,
    action: Value,
    #[serde(default)]
    turn: Option<u32>,
}

async fn http_step(State(env): State<OpenEnv>, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        let request: HttpStep = parse(&body)?;
        let submission = wire::submission(&request.action, "action")?;
        let id = &request.episode_id;
        let episode = match request.turn {
            None => env.resume(&headers, id, "episode_id").await?.1,
            // A retry of a step taken is answered with the recorded one; one racing the step shares it.
            Some(turn) => Episode { turn, done: false, ..env.describe(&headers, id, "episode_id").await?.1 },
        };
        env.step(&headers, episode, submission).await
    };
    match result.await {
        Ok((observation, episode)) => Json(wire::observation(&observation, &episode)).into_response(),
        Err(error) => error.into_response(),
    }
}

async fn http_state(State(env): State<OpenEnv>, headers: HeaderMap, RawQuery(query): RawQuery) -> Response {
    let id = query.as_deref().and_then(|query| query_value(query, "episode_id")).filter(|id| !id.is_empty());
    let Some(id) = id.as_deref() else {
        return invalid("episode_id", "required: GET /state?episode_id=<the episode's id>").into_response();
    };
    match env.describe(&headers, id, "episode_id").await {
        Ok((observation, episode)) => Json(wire::state(Some((&observation, &episode)))).into_response(),
        Err(error) => error.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_s_value_is_percent_decoded() {
        assert_eq!(query_value("episode_id=job-1-a-0", "episode_id").as_deref(), Some("job-1-a-0"));
        assert_eq!(query_value("x=1&episode_id=job%2F1+2", "episode_id").as_deref(), Some("job/1 2"));
        assert_eq!(query_value("x=1", "episode_id"), None);
        assert_eq!(query_value("episode_id=%zz", "episode_id").as_deref(), Some("%zz"));
    }
}
