//! A NeMo Gym resources server (NVIDIA-NeMo/Gym) at the root of the HTTP port (docs/faces/NEMO_GYM.md): a session is
//! a step-API episode, its id in a cookie re-sent on every response.
//!
//! - Tool style (`simple_agent`): `POST /seed_session` starts the episode of the row's task; each call of the
//!   `submit_kernel` tool (`POST /submit_kernel`) is one Step; `POST /verify` rewards the rollout with the episode's
//!   best score, stepping the last assistant message first when no kernel was submitted by the tool.
//! - Gymnasium style (`gymnasium_agent`): `POST /reset` starts the episode, each `POST /step` is one Step, `POST
//!   /close` ends the session (the episode stays in the store).
//!
//! Every route also answers under NeMo Gym's `/ng-rollout/{id}` prefix.

mod wire;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderMap, Uri, header};
use kforge_proto::v1 as pb;
use kforge_server::json::JsonError;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tonic::Code;

use super::{Faces, answer_with, parse, prompt_text};
use crate::failure::TurnFailure;
use wire::{KernelArgs, Row, Session, WithResponse};

use super::{fingerprint, unique_key, verdict_name};

/// The largest body: `/verify` carries a rollout's every output item, with token ids and log-probabilities.
const BODY_BYTES: usize = 64 << 20;

pub(super) fn router(faces: Faces) -> axum::Router {
    let mut router = axum::Router::new();
    for prefix in ["", "/ng-rollout/{rollout}"] {
        router = router
            .route(&format!("{prefix}/seed_session"), post(seed_session))
            .route(&format!("{prefix}/{}", wire::TOOL), post(submit_kernel))
            .route(&format!("{prefix}/verify"), post(verify))
            .route(&format!("{prefix}/aggregate_metrics"), post(aggregate_metrics))
            .route(&format!("{prefix}/reset"), post(reset))
            .route(&format!("{prefix}/step"), post(step))
            .route(&format!("{prefix}/close"), post(close))
            .route(&format!("{prefix}/"), get(alive));
    }
    router.route("/ng-rollout/{rollout}", get(alive)).layer(DefaultBodyLimit::max(BODY_BYTES)).with_state(faces)
}

/// The answer, with the session's cookie (NeMo Gym's agents keep only the cookies of the last response).
fn reply(session: Option<&Session>, result: Result<Value, JsonError>) -> Response {
    let mut response = match result {
        Ok(body) => Json(body).into_response(),
        Err(error) => error.into_response(),
    };
    if let Some(cookie) = session.and_then(Session::cookie) {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    response
}

/// The session of the request's cookie, or a new one of the row's task.
async fn session_for(
    faces: &Faces,
    headers: &HeaderMap,
    uri: &Uri,
    body: &[u8],
    session: &mut Option<Session>,
) -> Result<(), JsonError> {
    if session.is_none() {
        let row: Row = parse(body)?;
        let observation = open(faces, headers, uri, &row, body).await?;
        *session = Some(Session { episode: observation.episode_id, turn: Some(0) });
    }
    Ok(())
}

/// Starts (or finds again) the episode of `row`. A rollout that something identifies (its `/ng-rollout/` prefix,
/// `_ng_rollout_id`, or `_ng_task_index` with `_ng_rollout_index`) gets one episode however often it is seeded,
/// until that episode takes a step: the same identity seeded then is a later rollout (another epoch), and gets a
/// new episode. A rollout nothing identifies gets a new episode at each seed.
async fn open(
    faces: &Faces,
    headers: &HeaderMap,
    uri: &Uri,
    row: &Row,
    body: &[u8],
) -> Result<pb::Observation, JsonError> {
    let (id, field) = row.task()?;
    let task = faces.task(&id, field)?.clone();
    let Some(identity) = row.identity(uri) else {
        return faces.start(headers, task, &format!("nemo-gym/{}", unique_key())).await;
    };
    // The row as seeded: `/verify` (which may open the session itself) adds the response.
    let mut content: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    if let Some(object) = content.as_object_mut() {
        object.remove("response");
    }
    let key = format!(
        "nemo-gym/{}",
        fingerprint(&[task.task_id.as_bytes(), identity.as_bytes(), content.to_string().as_bytes()])
    );
    let observation = faces.start(headers, task.clone(), &key).await?;
    let current = faces.current(headers, &observation.episode_id).await?;
    if current.record.is_none() && !current.done {
        return Ok(observation);
    }
    faces.start(headers, task, &format!("{key}/{}", unique_key())).await
}

/// The episode's recorded turns, in order.
async fn recorded(faces: &Faces, headers: &HeaderMap, episode: &str) -> Result<Vec<pb::TurnRecord>, JsonError> {
    let request = pb::ListTrajectoriesRequest { job_id: episode.to_owned(), ..Default::default() };
    let response =
        faces.orchestrator(headers).list_trajectories(request).await.map_err(|s| JsonError::from_status(&s))?;
    Ok(response.into_inner().trajectories.into_iter().flat_map(|t| t.turns).collect())
}

/// Steps the session's episode with `completion`: at the episode's next turn, or, for a retry (the cookie's turn is
/// behind the episode and that turn was stepped with this very answer), at the cookie's turn, which replays it.
async fn take_step(
    faces: &Faces,
    headers: &HeaderMap,
    session: &mut Session,
    completion: pb::Completion,
    prompt_token_ids: Vec<u32>,
) -> Result<pb::Observation, JsonError> {
    let current = faces.current(headers, &session.episode).await?;
    let mut turn = current.turn;
    if let Some(expected) = session.turn.filter(|t| *t < current.turn) {
        let turns = recorded(faces, headers, &session.episode).await?;
        let stepped = turns.iter().find(|t| t.turn == expected).and_then(|t| t.completion.as_ref());
        if stepped.is_some_and(|c| c.text == completion.text) {
            turn = expected;
        }
    }
    let observation = faces.step(headers, &session.episode, turn, completion, prompt_token_ids).await?;
    session.turn = Some(observation.turn);
    Ok(observation)
}

/// What the model reads after a step: the verdict, score, feedback and the next turn's prompt.
fn step_result(observation: &pb::Observation) -> Value {
    let record = observation.record.clone().unwrap_or_default();
    let mut result = json!({
        "episode_id": observation.episode_id,
        "turn": record.turn,
        "verdict": verdict_name(record.verdict),
        "score": record.score,
        "reward": observation.reward,
        "speedup": record.speedup,
        "feedback": record.feedback,
        "done": observation.done,
        "next_turn": observation.turn,
        "prompt": if observation.done { Value::Null } else { prompt_text(&observation.prompt).into() },
    });
    for (key, text) in [("error", &record.error), ("format_error", &record.format_error)] {
        if !text.is_empty() {
            result[key] = text.clone().into();
        }
    }
    result
}

/// A kernel as the answer a recipe reads: fenced, unless the model fenced it already.
fn fenced(kernel: &str) -> String {
    if kernel.trim_start().starts_with("```") { kernel.to_owned() } else { answer_with(kernel) }
}

async fn alive() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn seed_session(State(faces): State<Faces>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        let row: Row = parse(&body)?;
        let observation = open(&faces, &headers, &uri, &row, &body).await?;
        Ok(Session { episode: observation.episode_id, turn: Some(0) })
    }
    .await;
    match result {
        Ok(session) => reply(Some(&session), Ok(json!({}))),
        Err(error) => reply(Session::of(&headers).as_ref(), Err(error)),
    }
}

async fn submit_kernel(State(faces): State<Faces>, headers: HeaderMap, body: Bytes) -> Response {
    let mut session = Session::of(&headers);
    let result = async {
        let Some(session) = session.as_mut() else {
            let message =
                format!("no session: POST /seed_session first (its `{}` cookie names the episode)", wire::COOKIE);
            return Err(JsonError::new(Code::FailedPrecondition, message, None));
        };
        let kernel = parse::<KernelArgs>(&body)?.kernel()?;
        let completion = pb::Completion { text: fenced(&kernel), finish_reason: "stop".into(), ..Default::default() };
        let observation = take_step(&faces, &headers, session, completion, Vec::new()).await?;
        Ok(step_result(&observation))
    }
    .await;
    reply(session.as_ref(), result)
}

async fn verify(State(faces): State<Faces>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let mut session = Session::of(&headers);
    let result = verified(&faces, &uri, &headers, &body, &mut session).await;
    reply(session.as_ref(), result)
}

async fn verified(
    faces: &Faces,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
    session: &mut Option<Session>,
) -> Result<Value, JsonError> {
    let WithResponse { response } = parse(body)?;
    let mut echo: Value = parse(body)?;
    session_for(faces, headers, uri, body, session).await?;
    let session = session.as_mut().expect("opened above");
    let mut turns = recorded(faces, headers, &session.episode).await?;
    // No tool call made (and no turn taken): the model's answer is its last message.
    if turns.is_empty()
        && !response.called()
        && let Some(text) = response.last_message()
    {
        let (completion, prompt_token_ids) = response.completion(text)?;
        take_step(faces, headers, session, completion, prompt_token_ids).await?;
        turns = recorded(faces, headers, &session.episode).await?;
    }
    let score = |t: &pb::TurnRecord| t.score.unwrap_or(0.0);
    let best = turns.iter().map(score).fold(0.0, f64::max);
    let correct = turns.iter().any(|t| t.verdict() == pb::Verdict::Correct);
    let best_speedup =
        turns.iter().filter(|t| t.verdict() == pb::Verdict::Correct).filter_map(|t| t.speedup).fold(0.0, f64::max);
    let object =
        echo.as_object_mut().ok_or_else(|| JsonError::new(Code::InvalidArgument, "the body is not an object", None))?;
    object.insert("reward".into(), best.into());
    object.insert(
        "reward_components".into(),
        json!({
            "best_score": best,
            "last_score": turns.last().map_or(0.0, score),
            "correct": if correct { 1.0 } else { 0.0 },
            "best_speedup": best_speedup,
            "turns": turns.len() as f64,
        }),
    );
    // Not a measurement of the model when no turn was scored because every one failed on the way (an evaluator
    // or service failure, never the kernel's fault).
    let failed = |t: &pb::TurnRecord| {
        t.score.is_none() && (t.verdict() == pb::Verdict::InfraError || TurnFailure::of(t).is_some())
    };
    if let Some(last) = turns.last().filter(|_| turns.iter().all(failed)) {
        object.insert("mask_sample".into(), true.into());
        let reason = TurnFailure::of(last).map_or_else(|| "an evaluator failure".to_owned(), |f| f.to_string());
        object.insert("failure_reason".into(), format!("no turn was scored: {reason}").into());
    }
    let summary: Vec<Value> = turns
        .iter()
        .map(|t| json!({"turn": t.turn, "verdict": verdict_name(t.verdict), "score": t.score, "speedup": t.speedup}))
        .collect();
    object.insert("kforge".into(), json!({"episode_id": session.episode, "turns": summary}));
    Ok(echo)
}

#[derive(Debug, Deserialize)]
struct Aggregate {
    #[serde(default)]
    verify_responses: Vec<Map<String, Value>>,
}

/// Means over the verified rollouts (those not masked): the reward and each reward component, overall
/// (`agent_metrics`, `key_metrics`) and per task (`group_level_metrics`, grouped by `_ng_task_index`, else
/// `task_id`).
async fn aggregate_metrics(body: Bytes) -> Response {
    let result = parse::<Aggregate>(&body).map(|aggregate| {
        let kept: Vec<&Map<String, Value>> =
            aggregate.verify_responses.iter().filter(|r| r.get("mask_sample") != Some(&Value::Bool(true))).collect();
        let overall = means(&kept);
        let mut groups: Vec<(Value, Vec<&Map<String, Value>>)> = Vec::new();
        for response in &kept {
            let key =
                response.get("_ng_task_index").or_else(|| response.get("task_id")).cloned().unwrap_or(Value::Null);
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push(response),
                None => groups.push((key, vec![response])),
            }
        }
        let group_level: Vec<Value> = groups
            .into_iter()
            .map(|(key, members)| {
                let mut metrics = means(&members);
                metrics.insert("group".into(), key);
                Value::Object(metrics)
            })
            .collect();
        let mut agent = overall.clone();
        agent.insert("masked".into(), (aggregate.verify_responses.len() - kept.len()).into());
        let key: Map<String, Value> =
            overall.into_iter().filter(|(k, _)| k == "mean/reward" || k == "mean/correct").collect();
        json!({"group_level_metrics": group_level, "agent_metrics": agent, "key_metrics": key})
    });
    reply(None, result)
}

/// `count`, `mean/reward`, `max/reward` and the mean of each reward component.
fn means(responses: &[&Map<String, Value>]) -> Map<String, Value> {
    let mut metrics = Map::new();
    metrics.insert("count".into(), responses.len().into());
    let rewards: Vec<f64> = responses.iter().filter_map(|r| r.get("reward")?.as_f64()).collect();
    if !rewards.is_empty() {
        metrics.insert("mean/reward".into(), (rewards.iter().sum::<f64>() / rewards.len() as f64).into());
        metrics.insert("max/reward".into(), rewards.iter().copied().fold(f64::MIN, f64::max).into());
    }
    let mut sums: Vec<(String, f64, usize)> = Vec::new();
    for response in responses {
        let Some(Value::Object(components)) = response.get("reward_components") else { continue };
        for (name, value) in components {
            let Some(value) = value.as_f64() else { continue };
            match sums.iter_mut().find(|(n, _, _)| n == name) {
                Some((_, sum, count)) => {
                    *sum += value;
                    *count += 1;
                }
                None => sums.push((name.clone(), value, 1)),
            }
        }
    }
    for (name, sum, count) in sums {
        metrics.insert(format!("mean/{name}"), (sum / count as f64).into());
    }
    metrics
}

/// Gymnasium's reset: starts the row's episode. Its observation is kforge's prompt when the row has none (else the
/// agent's prompt is the row's own, and kforge's is in `info.prompt`).
async fn reset(State(faces): State<Faces>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        let row: Row = parse(&body)?;
        let observation = open(&faces, &headers, &uri, &row, &body).await?;
        let prompt = prompt_text(&observation.prompt);
        let body = json!({
            "observation": if row.prompt_is_empty() { Value::from(prompt.clone()) } else { Value::Null },
            "info": {
                "episode_id": observation.episode_id, "turn": 0, "prompt": prompt, "tool": wire::TOOL,
                "supports_explicit_close": true,
            },
        });
        Ok((Session { episode: observation.episode_id, turn: Some(0) }, body))
    }
    .await;
    match result {
        Ok((session, body)) => reply(Some(&session), Ok(body)),
        Err(error) => reply(Session::of(&headers).as_ref(), Err(error)),
    }
}

/// Gymnasium's step: the response's `submit_kernel` call (its output returned in `info.tool_outputs`), else its last
/// message, is one Step. The observation is the step's feedback (none once the episode is done, or when the tool's
/// output carries it); the reward is the turn's score (the agent sums them).
async fn step(State(faces): State<Faces>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let mut session = Session::of(&headers);
    let result = async {
        let WithResponse { response } = parse(&body)?;
        session_for(&faces, &headers, &uri, &body, &mut session).await?;
        let session = session.as_mut().expect("opened above");
        let call = response.last_call();
        let text = match &call {
            Some(call) => match serde_json::from_str::<KernelArgs>(&call.arguments).map(KernelArgs::kernel) {
                Ok(Ok(kernel)) => fenced(&kernel),
                // Arguments that are not the tool's: the model's answer as it wrote it.
                _ => call.arguments.clone(),
            },
            None => response.last_message().unwrap_or_default(),
        };
        let (completion, prompt_token_ids) = response.completion(text)?;
        let observation = take_step(&faces, &headers, session, completion, prompt_token_ids).await?;
        let result = step_result(&observation);
        let feedback = observation.record.as_ref().map(|r| r.feedback.clone()).filter(|f| !f.is_empty());
        let mut info = result.clone();
        if let Some(call) = &call {
            info["tool_outputs"] = json!([{"call_id": call.call_id, "output": result.to_string()}]);
        }
        let observation_text = match (&call, observation.done) {
            (None, false) => feedback.map_or(Value::Null, Value::from),
            _ => Value::Null,
        };
        Ok(json!({
            "observation": observation_text,
            "reward": observation.reward,
            "terminated": observation.done,
            "truncated": false,
            "info": info,
        }))
    }
    .await;
    reply(session.as_ref(), result)
}

/// Gymnasium's close: nothing to free (the episode stays in the store, an unfinished one as any trainer may leave).
async fn close(headers: HeaderMap) -> Response {
    reply(Session::of(&headers).as_ref(), Ok(json!({})))
}
