//! One WebSocket connection: one session, driving at most one episode at a time. Requests are answered one at a
//! time, in order, exactly one reply each (none for `close`); the socket keeps being read while a request runs, so
//! its pings are answered (tungstenite answers them as it reads) and later requests wait in a queue. A request runs
//! in a task of its own: when the client goes away, the step it asked for still runs and is recorded.

use std::collections::VecDeque;

use axum::extract::ws::{Message, WebSocket};
use http::HeaderMap;
use kforge_proto::v1 as pb;
use kforge_server::json::JsonError;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tonic::Code;

use super::wire::{self, invalid, kind};
use super::{Episode, OpenEnv, ResetArgs};
use crate::faces::parse;

/// Requests a client may send ahead of their replies; past them the connection is closed.
const MAX_QUEUED: usize = 64;

/// What a request's task answers: the reply, and the session's episode after it (`None`: unchanged).
type Reply = (Value, Option<Episode>);

/// A request read from a text frame.
enum Request {
    Reset(Value),
    Step(Value),
    State,
    Close,
}

/// What the session does with a request.
enum Dispatch {
    Now(Value),
    Later(JoinHandle<Reply>),
    Close,
}

pub(super) async fn run(env: OpenEnv, mut socket: WebSocket, headers: HeaderMap) {
    let mut episode: Option<Episode> = None;
    let mut queue: VecDeque<String> = VecDeque::new();
    let mut pending: Option<JoinHandle<Reply>> = None;
    loop {
        while pending.is_none()
            && let Some(text) = queue.pop_front()
        {
            match dispatch(&env, &headers, &text, episode.as_ref()) {
                Dispatch::Now(reply) => {
                    if send(&mut socket, &reply).await.is_err() {
                        return;
                    }
                }
                Dispatch::Later(task) => pending = Some(task),
                Dispatch::Close => {
                    let _ = socket.send(Message::Close(None)).await;
                    return;
                }
            }
        }
        tokio::select! {
            incoming = socket.recv() => match incoming {
                Some(Ok(Message::Text(text))) => queue.push_back(text.as_str().to_owned()),
                Some(Ok(Message::Binary(bytes))) => queue.push_back(String::from_utf8_lossy(&bytes).into_owned()),
                // Pings are answered by the socket as it reads.
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                // Gone: a request still running finishes in its own task (a step is recorded).
                Some(Ok(Message::Close(_)) | Err(_)) | None => return,
            },
            joined = async {
                match pending.as_mut() {
                    Some(task) => task.await,
                    None => std::future::pending().await,
                }
            }, if pending.is_some() => {
                pending = None;
                let reply = match joined {
                    Ok((reply, next)) => {
                        if next.is_some() {
                            episode = next;
                        }
                        reply
                    }
                    Err(error) => {
                        let error = JsonError::new(Code::Internal, format!("the request failed: {error}"), None);
                        wire::error("EXECUTION_ERROR", &error)
                    }
                };
                if send(&mut socket, &reply).await.is_err() {
                    return;
                }
            }
        }
        if queue.len() > MAX_QUEUED {
            let error = JsonError::new(
                Code::ResourceExhausted,
                format!("more than {MAX_QUEUED} requests ahead of their replies: send one, read its reply"),
                None,
            );
            let _ = send(&mut socket, &wire::error("CAPACITY_REACHED", &error)).await;
            let _ = socket.send(Message::Close(None)).await;
            return;
        }
    }
}

async fn send(socket: &mut WebSocket, reply: &Value) -> Result<(), axum::Error> {
    socket.send(Message::Text(reply.to_string().into())).await
}

fn dispatch(env: &OpenEnv, headers: &HeaderMap, text: &str, episode: Option<&Episode>) -> Dispatch {
    let request = match request(text) {
        Ok(request) => request,
        Err((code, error)) => return Dispatch::Now(wire::error(code, &error)),
    };
    match request {
        Request::Close => Dispatch::Close,
        Request::Reset(data) => {
            let args: ResetArgs = match parse(data.to_string().as_bytes()) {
                Ok(args) => args,
                Err(error) => return Dispatch::Now(wire::error("VALIDATION_ERROR", &within("data", error))),
            };
            let (env, headers) = (env.clone(), headers.clone());
            Dispatch::Later(tokio::spawn(async move {
                match env.reset(&headers, args, "data.").await {
                    Ok((observation, episode)) => (observed(&observation, &episode), Some(episode)),
                    Err(error) => (failed(&error), None),
                }
            }))
        }
        Request::Step(data) => {
            let Some(episode) = episode.cloned() else {
                let error = JsonError::new(Code::FailedPrecondition, "no episode: send a reset first", None);
                return Dispatch::Now(wire::error("EXECUTION_ERROR", &error));
            };
            if episode.done {
                let message = "the episode is over: send a reset to start another";
                return Dispatch::Now(wire::error(
                    "EXECUTION_ERROR",
                    &JsonError::new(Code::FailedPrecondition, message, None),
                ));
            }
            let submission = match wire::submission(&data, "data") {
                Ok(submission) => submission,
                Err(error) => return Dispatch::Now(wire::error("VALIDATION_ERROR", &error)),
            };
            // Registered as running before the next frame is read: a reconnecting client's reset waits for it.
            let step = env.spawn_step(headers.clone(), episode, submission);
            Dispatch::Later(tokio::spawn(async move {
                match step.await {
                    Ok(Ok((observation, episode))) => (observed(&observation, &episode), Some(episode)),
                    Ok(Err(error)) => (failed(&error), None),
                    Err(error) => {
                        (failed(&JsonError::new(Code::Internal, format!("the step failed: {error}"), None)), None)
                    }
                }
            }))
        }
        Request::State => {
            let Some(episode) = episode.cloned() else {
                return Dispatch::Now(json!({"type": "state", "data": wire::state(None)}));
            };
            let (env, headers) = (env.clone(), headers.clone());
            Dispatch::Later(tokio::spawn(async move {
                match env.describe(&headers, &episode.id, "episode_id").await {
                    Ok((observation, episode)) => {
                        let state = wire::state(Some((&observation, &episode)));
                        (json!({"type": "state", "data": state}), Some(episode))
                    }
                    Err(error) => (failed(&error), None),
                }
            }))
        }
    }
}

/// Reads a frame: `{"type": ..., "data": {...}}`. Errors carry upstream's code: INVALID_JSON, VALIDATION_ERROR
/// naming the field, UNKNOWN_TYPE.
fn request(text: &str) -> Result<Request, (&'static str, JsonError)> {
    let value: Value = serde_json::from_str(text).map_err(|error| {
        ("INVALID_JSON", JsonError::new(Code::InvalidArgument, format!("malformed json: {error}"), None))
    })?;
    let validation = |field: &str, message: &str| ("VALIDATION_ERROR", invalid(field, message));
    let Value::Object(mut message) = value else {
        let message = format!("a message is an object, {{\"type\": ..., \"data\": {{...}}}}, got {}", kind(&value));
        return Err(("VALIDATION_ERROR", JsonError::new(Code::InvalidArgument, message, None)));
    };
    if let Some(key) = message.keys().find(|key| !matches!(key.as_str(), "type" | "data")) {
        return Err(validation(key, "unknown field: a message holds `type` and `data`"));
    }
    let data = message.remove("data");
    let kind_of = match message.get("type") {
        Some(Value::String(kind)) => kind.as_str(),
        None | Some(Value::Null) => return Err(validation("type", "required: reset, step, state or close")),
        Some(other) => return Err(validation("type", &format!("a string, got {}", kind(other)))),
    };
    let object = |data: Option<Value>, required: bool| match data {
        Some(data @ Value::Object(_)) => Ok(data),
        None | Some(Value::Null) if !required => Ok(Value::Object(Default::default())),
        None | Some(Value::Null) => Err(validation("data", "required: the action, {\"code\": ...}")),
        Some(other) => Err(validation("data", &format!("an object, got {}", kind(&other)))),
    };
    match kind_of {
        "reset" => Ok(Request::Reset(object(data, false)?)),
        "step" => Ok(Request::Step(object(data, true)?)),
        "state" => Ok(Request::State),
        "close" => Ok(Request::Close),
        other => {
            let message = format!("type: unknown message type `{other}`: reset, step, state or close");
            Err(("UNKNOWN_TYPE", JsonError::new(Code::InvalidArgument, message, Some("type"))))
        }
    }
}

/// An error about a field of the message's `data`, naming it from the message (`data.seed`).
fn within(prefix: &str, error: JsonError) -> JsonError {
    match error.field() {
        Some(field) => {
            let inner = format!("{prefix}.{field}");
            let message = error.message().strip_prefix(field).unwrap_or(error.message());
            JsonError::new(error.code(), format!("{inner}{message}"), Some(&inner))
        }
        None => error,
    }
}

fn observed(observation: &pb::Observation, episode: &Episode) -> Value {
    json!({"type": "observation", "data": wire::observation(observation, episode)})
}

/// A request's failure: a bad value (INVALID_ARGUMENT, or a task or episode a field names that does not exist) is
/// upstream's VALIDATION_ERROR, anything else its EXECUTION_ERROR.
fn failed(error: &JsonError) -> Value {
    let bad_value =
        error.code() == Code::InvalidArgument || (error.code() == Code::NotFound && error.field().is_some());
    let code = if bad_value { "VALIDATION_ERROR" } else { "EXECUTION_ERROR" };
    wire::error(code, error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(text: &str) -> (&'static str, Option<String>) {
        match request(text) {
            Ok(_) => panic!("{text} was read as a request"),
            Err((code, error)) => (code, error.field().map(str::to_owned)),
        }
    }

    #[test]
    fn frames_are_read_with_upstream_s_error_codes() {
        assert!(matches!(request(r#"{"type": "reset"}"#), Ok(Request::Reset(Value::Object(_)))));
        assert!(matches!(request(r#"{"type": "state", "data": null}"#), Ok(Request::State)));
        assert!(matches!(request(r#"{"type": "close"}"#), Ok(Request::Close)));
        assert_eq!(refused("{"), ("INVALID_JSON", None));
        assert_eq!(refused("[]"), ("VALIDATION_ERROR", None));
        assert_eq!(refused(r#"{"type": "step"}"#), ("VALIDATION_ERROR", Some("data".into())));
        assert_eq!(refused(r#"{"type": "step", "data": []}"#), ("VALIDATION_ERROR", Some("data".into())));
        assert_eq!(refused(r#"{"type": "mcp", "data": {}}"#), ("UNKNOWN_TYPE", Some("type".into())));
        assert_eq!(refused(r#"{"type": 1}"#), ("VALIDATION_ERROR", Some("type".into())));
        assert_eq!(refused(r#"{"type": "state", "id": 1}"#), ("VALIDATION_ERROR", Some("id".into())));
    }

    #[test]
    fn data_errors_name_the_field_within_the_message() {
        let error = parse::<ResetArgs>(br#"{"seed": "x"}"#).expect_err("a string seed");
        let error = within("data", error);
        assert_eq!(error.field(), Some("data.seed"));
        assert!(error.message().starts_with("data.seed: "), "{}", error.message());
    }
}
