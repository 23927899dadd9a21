//! The Open Reward Standard face (docs/faces/ORS.md): kforge as the ORS environment `kforge`, at the root of the
//! HTTP port (ORS clients join absolute paths to their base URL, so they cannot use a prefix). Its one split,
//! `train`, is the faces' task set; its one tool, `submit_kernel`, takes ModelNew's source as a step of the
//! session's episode.
//!
//! An ORS session is a step-API episode: `POST /create` with `X-Session-ID` starts it with the idempotency key
//! `ors/<sid>`, so a retried (or repeated) create with the same sid reaches the same episode, after a restart too.
//! The face keeps in memory only which episode each sid has (forgotten after 900 s without a ping, the episode
//! staying in the store) and the tool calls of the last minutes, by their `task_id`, for clients that reconnect.
//!
//! Every env-scoped route is also served bare (`/prompt`, `/call`, ...), for the `openreward` client, which names
//! no environment.

mod calls;

use crate::faces::only_authorization;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::HeaderMap;
use kforge_proto::v1 as pb;
use kforge_server::json::JsonError;
use serde::Deserialize;
use serde_json::{Value, json};
use tonic::Code;

use super::{Faces, parse, prompt_text};
use calls::Calls;

/// The environment's name: the only one, so the default.
const ENV: &str = "kforge";
/// The split holding the task set.
const SPLIT: &str = "train";
/// The environment's tool.
const TOOL: &str = "submit_kernel";
/// A session unpinged this long is forgotten (its episode stays in the store).
const IDLE: Duration = Duration::from_secs(900);
/// How often idle sessions are looked for, at most.
const SWEEP: Duration = Duration::from_secs(5);
/// The longest a session id may be.
const MAX_SID_BYTES: usize = 200;
/// Sessions remembered at once: a new one past it is RESOURCE_EXHAUSTED until idle ones are forgotten (each
/// created one's episode stays in the store, reachable again by `POST /create` with its sid).
const MAX_SESSIONS: usize = 10_000;

pub(super) fn router(faces: Faces) -> Router {
    let ors = Arc::new(Ors { faces, sessions: Mutex::new(Sessions::default()), calls: Calls::default() });
    Router::new()
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/version", get(|| async { Json(json!({"version": env!("CARGO_PKG_VERSION"), "server": "kforge"})) }))
        .route("/list_environments", get(|| async { Json(json!([ENV])) }))
        .route("/create_session", post(create_session))
        .route("/create", post(create))
        .route("/ping", post(ping))
        .route("/delete", post(delete))
        .route("/delete_session", post(delete_session))
        .route("/{env}/tools", get(tools))
        .route("/tools", get(tools))
        .route("/{env}/task_tools", get(tools))
        .route("/task_tools", get(tools))
        .route("/{env}/splits", get(splits))
        .route("/splits", get(splits))
        .route("/{env}/tasks", post(tasks))
        .route("/tasks", post(tasks))
        .route("/{env}/num_tasks", post(num_tasks))
        .route("/num_tasks", post(num_tasks))
        .route("/{env}/task", post(task))
        .route("/task", post(task))
        .route("/{env}/task_range", post(task_range))
        .route("/task_range", post(task_range))
        .route("/{env}/prompt", get(prompt))
        .route("/prompt", get(prompt))
        .route("/{env}/call", post(call))
        .route("/call", post(call))
        .with_state(ors)
}

/// The face's state: the sessions' episodes and the tool calls of the last minutes.
#[derive(Debug)]
struct Ors {
    faces: Faces,
    sessions: Mutex<Sessions>,
    calls: Calls,
}

#[derive(Debug, Default)]
struct Sessions {
    by_id: HashMap<String, Session>,
    swept: Option<Instant>,
}

#[derive(Debug)]
struct Session {
    /// The episode, once created.
    episode: Option<String>,
    seen: Instant,
    /// Held by a tool call while it steps the episode: a session's calls take its turns one after another.
    turns: Arc<tokio::sync::Mutex<()>>,
}

impl Ors {
    /// Runs `f` on the sessions, after forgetting the idle ones.
    fn sessions<T>(&self, f: impl FnOnce(&mut HashMap<String, Session>) -> T) -> T {
        let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if sessions.swept.is_none_or(|swept| now.duration_since(swept) >= SWEEP) {
            sessions.swept = Some(now);
            sessions.by_id.retain(|_, session| now.duration_since(session.seen) < IDLE);
        }
        f(&mut sessions.by_id)
    }

    /// The session `sid` names, seen now: its episode and turn lock. NOT_FOUND when the face does not know it.
    fn session(&self, sid: &str) -> Result<(Option<String>, Arc<tokio::sync::Mutex<()>>), JsonError> {
        self.sessions(|sessions| {
            let session = sessions.get_mut(sid).ok_or_else(|| unknown_session(sid))?;
            session.seen = Instant::now();
            Ok((session.episode.clone(), session.turns.clone()))
        })
    }

    /// The episode of session `sid`; FAILED_PRECONDITION before `POST /create`.
    fn episode(&self, sid: &str) -> Result<(String, Arc<tokio::sync::Mutex<()>>), JsonError> {
        match self.session(sid)? {
            (Some(episode), turns) => Ok((episode, turns)),
            (None, _) => Err(JsonError::new(
                Code::FailedPrecondition,
                format!("X-Session-ID: session `{sid}` has no episode yet: POST /create first"),
                Some("X-Session-ID"),
            )),
        }
    }

    /// Remembers session `sid` (with its episode, once created); a new one past [`MAX_SESSIONS`] is refused.
    fn remember(&self, sid: &str, episode: Option<String>) -> Result<(), JsonError> {
        self.sessions(|sessions| {
            if sessions.len() >= MAX_SESSIONS && !sessions.contains_key(sid) {
                let message = format!(
                    "{MAX_SESSIONS} sessions are open: one is forgotten after {} s without a call",
                    IDLE.as_secs()
                );
                return Err(JsonError::new(Code::ResourceExhausted, message, None));
            }
            let session = sessions.entry(sid.to_owned()).or_insert_with(|| Session {
                episode: None,
                seen: Instant::now(),
                turns: Arc::default(),
            });
            session.seen = Instant::now();
            if episode.is_some() {
                session.episode = episode;
            }
            Ok(())
        })
    }
}

fn unknown_session(sid: &str) -> JsonError {
    let message = format!(
        "X-Session-ID: no session `{sid}` here (never created, deleted, or idle for {} s): POST /create with it \
         reaches its episode again",
        IDLE.as_secs()
    );
    JsonError::new(Code::NotFound, message, Some("X-Session-ID"))
}

/// The request's session id: `X-Session-ID`, required.
fn session_id(headers: &HeaderMap) -> Result<String, JsonError> {
    let field = "X-Session-ID";
    let bad = |message: &str| JsonError::new(Code::InvalidArgument, format!("{field}: {message}"), Some(field));
    let value = headers.get("x-session-id").ok_or_else(|| bad("required header (POST /create_session gives one)"))?;
    let sid = value.to_str().map_err(|_| bad("not text"))?.trim();
    if sid.is_empty() {
        return Err(bad("empty"));
    }
    if sid.len() > MAX_SID_BYTES {
        return Err(bad(&format!("{} bytes, over the limit of {MAX_SID_BYTES}", sid.len())));
    }
    Ok(sid.to_owned())
}

/// NOT_FOUND unless `env` (the path's, when the route names one) is this server's environment.
fn check_env(env: Option<&str>) -> Result<(), JsonError> {
    match env {
        None | Some(ENV) => Ok(()),
        Some(other) => {
            Err(JsonError::new(Code::NotFound, format!("no environment `{other}`: this server has `{ENV}`"), None))
        }
    }
}

fn respond(result: Result<Value, JsonError>) -> Response {
    match result {
        Ok(value) => Json(value).into_response(),
        Err(error) => error.into_response(),
    }
}

async fn create_session(State(ors): State<Arc<Ors>>) -> Response {
    let sid = calls::random_id();
    match ors.remember(&sid, None) {
        Ok(()) => calls::session_created(&sid),
        Err(error) => error.into_response(),
    }
}

/// `POST /create`: which task the session's episode is of. Other keys (`secrets`, `toolset_name`) are ignored.
#[derive(Debug, Deserialize)]
struct Create {
    #[serde(default)]
    task_spec: Option<Value>,
    #[serde(default)]
    split: Option<String>,
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    env_name: Option<String>,
}

async fn create(State(ors): State<Arc<Ors>>, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        let sid = session_id(&headers)?;
        let request: Create = parse(&body)?;
        if let Some(env) = request.env_name.as_deref() {
            check_env(Some(env))
                .map_err(|e| JsonError::new(e.code(), format!("env_name: {}", e.message()), Some("env_name")))?;
        }
        let task = match (&request.task_spec, &request.split) {
            (Some(spec), _) => task_of_spec(&ors.faces, spec)?,
            (None, Some(split)) => {
                check_split(Some(split))?;
                let index = request.index.ok_or_else(|| invalid("index", "required with `split`"))?;
                nth_task(&ors.faces, index, "index")?
            }
            (None, None) => return Err(invalid("task_spec", "required: a task_spec, or a split and an index")),
        };
        let observation = ors.faces.start(&headers, task, &format!("ors/{sid}")).await?;
        ors.remember(&sid, Some(observation.episode_id))?;
        Ok(json!({"sid": sid}))
    };
    respond(result.await)
}

async fn ping(State(ors): State<Arc<Ors>>, headers: HeaderMap) -> Response {
    let result = session_id(&headers).and_then(|sid| ors.session(&sid)).map(|_| json!({"status": "ok"}));
    respond(result)
}

/// `POST /delete`: the face forgets the session; its episode stays in the store.
async fn delete(State(ors): State<Arc<Ors>>, headers: HeaderMap) -> Response {
    let result = session_id(&headers).map(|sid| {
        ors.sessions(|sessions| sessions.remove(&sid));
        json!({"sid": sid})
    });
    respond(result)
}

async fn delete_session(State(ors): State<Arc<Ors>>, headers: HeaderMap) -> Response {
    delete(State(ors), headers).await
}

async fn tools(env: Option<Path<String>>) -> Response {
    respond(check_env(env.as_deref().map(String::as_str)).map(|()| json!({"tools": [tool_spec()]})))
}

fn tool_spec() -> Value {
    json!({
        "name": TOOL,
        "description": "Submit ModelNew's complete source as your next attempt. kforge compiles it, checks its outputs \
                        against the reference and times it; the result is the evaluation's feedback and the reward.",
        "input_schema": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the complete Python source defining ModelNew"}},
            "required": ["code"],
        },
    })
}

async fn splits(env: Option<Path<String>>) -> Response {
    respond(check_env(env.as_deref().map(String::as_str)).map(|()| json!([{"name": SPLIT, "type": SPLIT}])))
}

/// The bodies of the task listing routes.
#[derive(Debug, Deserialize)]
struct TaskQuery {
    #[serde(default)]
    split: Option<String>,
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    start: Option<i64>,
    #[serde(default)]
    stop: Option<i64>,
}

fn task_query(env: Option<&str>, body: &[u8]) -> Result<TaskQuery, JsonError> {
    check_env(env)?;
    let query: TaskQuery = parse(body)?;
    check_split(query.split.as_deref())?;
    Ok(query)
}

fn check_split(split: Option<&str>) -> Result<(), JsonError> {
    match split {
        Some(SPLIT) => Ok(()),
        None => Err(invalid("split", "required: `train`")),
        Some(other) => {
            let message = format!("split: no split `{other}`: {ENV} has `{SPLIT}`");
            Err(JsonError::new(Code::NotFound, message, Some("split")))
        }
    }
}

/// A task as ORS lists it: its id and its index in the split.
fn spec(index: usize, task: &pb::Task) -> Value {
    json!({"task_id": task.task_id, "index": index})
}

async fn tasks(State(ors): State<Arc<Ors>>, env: Option<Path<String>>, body: Bytes) -> Response {
    let result = task_query(env.as_deref().map(String::as_str), &body).map(|_| {
        let tasks: Vec<Value> = ors.faces.tasks().iter().enumerate().map(|(i, task)| spec(i, task)).collect();
        json!({"tasks": tasks, "env_name": ENV})
    });
    respond(result)
}

async fn num_tasks(State(ors): State<Arc<Ors>>, env: Option<Path<String>>, body: Bytes) -> Response {
    let result =
        task_query(env.as_deref().map(String::as_str), &body).map(|_| json!({"num_tasks": ors.faces.tasks().len()}));
    respond(result)
}

async fn task(State(ors): State<Arc<Ors>>, env: Option<Path<String>>, body: Bytes) -> Response {
    let result = task_query(env.as_deref().map(String::as_str), &body).and_then(|query| {
        let index = query.index.ok_or_else(|| invalid("index", "required"))?;
        let task = nth_task(&ors.faces, index, "index")?;
        Ok(json!({"task": spec(index as usize, &task)}))
    });
    respond(result)
}

async fn task_range(State(ors): State<Arc<Ors>>, env: Option<Path<String>>, body: Bytes) -> Response {
    let result = task_query(env.as_deref().map(String::as_str), &body).map(|query| {
        let all = ors.faces.tasks();
        // Python's slice bounds: negative ones count from the end, and both are clamped to the split.
        let len = all.len() as i64;
        let bound = |at: i64| if at < 0 { (at + len).max(0) } else { at.min(len) } as usize;
        let (start, stop) = (bound(query.start.unwrap_or(0)), bound(query.stop.unwrap_or(len)));
        let tasks: Vec<Value> = (start..stop.max(start)).map(|i| spec(i, &all[i])).collect();
        json!({"tasks": tasks})
    });
    respond(result)
}

fn invalid(field: &str, message: &str) -> JsonError {
    JsonError::new(Code::InvalidArgument, format!("{field}: {message}"), Some(field))
}

/// The task at `index` of the split.
fn nth_task(faces: &Faces, index: u64, field: &str) -> Result<pb::Task, JsonError> {
    let tasks = faces.tasks();
    usize::try_from(index).ok().and_then(|i| tasks.get(i)).cloned().ok_or_else(|| {
        let message = format!("{field}: invalid index {index}: the split `{SPLIT}` has {} tasks", tasks.len());
        JsonError::new(Code::InvalidArgument, message, Some(field))
    })
}

/// The task a `task_spec` names: `{"task_id": ...}` (as listed), else `{"index": ...}`.
fn task_of_spec(faces: &Faces, spec: &Value) -> Result<pb::Task, JsonError> {
    match (spec.get("task_id"), spec.get("index")) {
        (Some(Value::String(id)), _) => {
            let field = "task_spec.task_id";
            let found = faces.tasks().iter().find(|task| task.task_id == *id).cloned();
            found.ok_or_else(|| {
                let message = format!("{field}: no task `{id}` in the split `{SPLIT}` ({} tasks)", faces.tasks().len());
                JsonError::new(Code::NotFound, message, Some(field))
            })
        }
        (_, Some(index)) => match index.as_u64() {
            Some(index) => nth_task(faces, index, "task_spec.index"),
            None => Err(invalid("task_spec.index", &format!("an index, got {index}"))),
        },
        _ => Err(invalid("task_spec.task_id", "required: the task's id, as POST /kforge/tasks lists it")),
    }
}

async fn prompt(State(ors): State<Arc<Ors>>, env: Option<Path<String>>, headers: HeaderMap) -> Response {
    let result = async {
        check_env(env.as_deref().map(String::as_str))?;
        let sid = session_id(&headers)?;
        let (episode, _) = ors.episode(&sid)?;
        let observation = ors.faces.current(&headers, &episode).await?;
        // An episode that is over has no prompt left.
        let blocks: Vec<Value> = match observation.prompt.is_empty() {
            true => Vec::new(),
            false => vec![json!({"type": "text", "text": prompt_text(&observation.prompt), "detail": null})],
        };
        Ok(Value::Array(blocks))
    };
    respond(result.await)
}

/// `POST /{env}/call`: a tool call, and `task_id` to re-attach to one already made. Other keys are ignored.
#[derive(Debug, Deserialize)]
struct Call {
    name: String,
    #[serde(default)]
    input: Value,
    #[serde(default)]
    task_id: Option<String>,
}

async fn call(State(ors): State<Arc<Ors>>, env: Option<Path<String>>, headers: HeaderMap, body: Bytes) -> Response {
    let checked = async {
        check_env(env.as_deref().map(String::as_str))?;
        let sid = session_id(&headers)?;
        let call: Call = parse(&body)?;
        Ok::<_, JsonError>((sid, call))
    };
    let (sid, call) = match checked.await {
        Ok(checked) => checked,
        Err(error) => return error.into_response(),
    };
    if let Some(task_id) = call.task_id.filter(|id| !id.is_empty()) {
        return ors.calls.attach(&sid, &task_id);
    }
    let (episode, turns) = match ors.episode(&sid) {
        Ok(found) => found,
        Err(error) => return error.into_response(),
    };
    let faces = ors.faces.clone();
    let headers = only_authorization(&headers);
    ors.calls.start(&sid, async move {
        let _turn = turns.lock_owned().await;
        calls::run(&faces, &headers, &episode, &call.name, &call.input).await
    })
}
