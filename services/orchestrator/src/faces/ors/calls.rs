//! ORS tool calls and their server-sent events. A call runs in a task of its own, kept by its `task_id` while it
//! runs and for [`KEEP`] after: its stream (`task_id`, `:` comments while it runs, then the result as `chunk`s and
//! an `end`) can be dropped by a client and asked for again with the `task_id`, which re-attaches to the running or
//! finished call instead of running it again.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use http::HeaderMap;
use kforge_proto::v1 as pb;
use kforge_server::json::JsonError;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

use super::TOOL;
use crate::faces::{Faces, answer_with, prompt_text, verdict_name};
use crate::failure::TurnFailure;

/// How long a finished call's result is kept for a client that re-attaches.
const KEEP: Duration = Duration::from_secs(300);
/// The longest a stream stays silent while its call runs (ORS clients give up after 30 s).
const KEEPALIVE: Duration = Duration::from_secs(5);
/// Characters of the result per event.
const PIECE: usize = 4096;

/// How a call ended: the `RunToolOutput` JSON (`ok` true or false), or an error the stream reports as `error`.
#[derive(Debug, Clone)]
pub(super) enum Ended {
    Output(Arc<str>),
    Failed(String),
}

#[derive(Debug)]
struct Running {
    sid: String,
    result: watch::Receiver<Option<Ended>>,
    ended: Arc<Mutex<Option<Instant>>>,
}

/// The calls of the last minutes, by task id.
#[derive(Debug, Default)]
pub(super) struct Calls {
    by_id: Mutex<HashMap<String, Running>>,
}

impl Calls {
    /// Runs `call` for session `sid` in a task of its own and streams it.
    pub(super) fn start(&self, sid: &str, call: impl Future<Output = Ended> + Send + 'static) -> Response {
        let id = random_id();
        let (sender, result) = watch::channel(None);
        let ended = Arc::new(Mutex::new(None));
        {
            let mut calls = self.by_id.lock().unwrap_or_else(PoisonError::into_inner);
            calls.retain(|_, running| {
                let ended = *running.ended.lock().unwrap_or_else(PoisonError::into_inner);
                ended.is_none_or(|at| at.elapsed() < KEEP)
            });
            let running = Running { sid: sid.to_owned(), result: result.clone(), ended: ended.clone() };
            calls.insert(id.clone(), running);
        }
        tokio::spawn(async move {
            // Run apart, so a panic still ends the call (as an error) for its streams.
            let outcome = match tokio::spawn(call).await {
                Ok(outcome) => outcome,
                Err(error) => Ended::Failed(format!("the tool call failed: {error}")),
            };
            *ended.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
            let _ = sender.send(Some(outcome));
        });
        stream(id, result)
    }

    /// The stream of call `task_id` of session `sid`, running or finished; an `error` event when unknown.
    pub(super) fn attach(&self, sid: &str, task_id: &str) -> Response {
        let result = self
            .by_id
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(task_id)
            .filter(|running| running.sid == sid)
            .map(|running| running.result.clone());
        match result {
            Some(result) => stream(task_id.to_owned(), result),
            None => {
                let events = [Event::default().event("error").data("unknown task_id")];
                sse(tokio_stream::iter(events.map(Ok::<_, Infallible>)))
            }
        }
    }
}

/// `task_id`, then `:` comments while the call runs, then its result in pieces: `chunk`s, the last an `end`.
fn stream(id: String, mut result: watch::Receiver<Option<Ended>>) -> Response {
    let (events, receiver) = mpsc::channel::<Event>(4);
    tokio::spawn(async move {
        if events.send(Event::default().event("task_id").data(&id)).await.is_err() {
            return;
        }
        let ended = tokio::select! {
            ended = result.wait_for(Option::is_some) => match ended {
                Ok(ended) => ended.clone().unwrap_or_else(|| Ended::Failed("the tool call was lost".into())),
                Err(_) => Ended::Failed("the tool call was lost".into()),
            },
            // The client went away; the call goes on.
            () = events.closed() => return,
        };
        match ended {
            Ended::Output(json) => {
                for (piece, last) in pieces(&json) {
                    let event = Event::default().event(if last { "end" } else { "chunk" }).data(piece);
                    if events.send(event).await.is_err() {
                        return;
                    }
                }
            }
            Ended::Failed(message) => {
                let _ = events.send(Event::default().event("error").data(message.replace(['\r', '\n'], " "))).await;
            }
        }
    });
    sse(ReceiverStream::new(receiver).map(Ok::<_, Infallible>))
}

/// `text` in pieces of [`PIECE`] characters, each with whether it is the last.
fn pieces(text: &str) -> Vec<(&str, bool)> {
    let mut pieces = Vec::new();
    let mut rest = text;
    loop {
        let cut = rest.char_indices().nth(PIECE).map_or(rest.len(), |(at, _)| at);
        let (piece, after) = rest.split_at(cut);
        pieces.push((piece, after.is_empty()));
        if after.is_empty() {
            return pieces;
        }
        rest = after;
    }
}

fn sse<S>(events: S) -> Response
where
    S: tokio_stream::Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    let sse = Sse::new(events).keep_alive(KeepAlive::new().interval(KEEPALIVE));
    ([("x-accel-buffering", "no")], sse).into_response()
}

/// `POST /create_session`'s stream: the new session id as `task_id`, then `end` (carrying it too).
pub(super) fn session_created(sid: &str) -> Response {
    let events = [
        Event::default().event("task_id").data(sid),
        Event::default().event("end").data(json!({"sid": sid}).to_string()),
    ];
    sse(tokio_stream::iter(events.map(Ok::<_, Infallible>)))
}

/// A new id: 32 hex digits, from the process's random hasher keys, the time and a counter.
pub(super) fn random_id() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let half = |salt: u64| {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        hasher.write_u64(salt);
        hasher.write_u128(nanos);
        hasher.finish()
    };
    format!("{:016x}{:016x}", half(1), half(2))
}

/// One tool call against the session's episode: `submit_kernel` with `{"code"}` is the episode's next step.
pub(super) async fn run(faces: &Faces, headers: &HeaderMap, episode: &str, name: &str, input: &Value) -> Ended {
    let refused = |error: String| Ended::Output(json!({"ok": false, "error": error}).to_string().into());
    if name != TOOL {
        return refused(format!("unknown tool `{name}`: this environment has `{TOOL}`"));
    }
    let code = match input.get("code") {
        Some(Value::String(code)) if !code.trim().is_empty() => code,
        Some(Value::String(_)) => return refused("input.code: empty".into()),
        Some(_) => return refused("input.code: a string, ModelNew's source".into()),
        None => return refused("input.code: required: ModelNew's complete source".into()),
    };
    if let Some(key) = input.as_object().and_then(|input| input.keys().find(|key| *key != "code")) {
        return refused(format!("input.{key}: unknown field: {TOOL} takes `code`"));
    }
    let failed = |error: JsonError| match error.code() {
        // The call's own fault (the episode is over, a bad value): the agent reads it as the tool's answer.
        Code::InvalidArgument | Code::FailedPrecondition | Code::NotFound | Code::OutOfRange | Code::AlreadyExists => {
            refused(error.message().to_owned())
        }
        _ => Ended::Failed(format!("{}: {}", kforge_server::code_name(error.code()), error.message())),
    };
    let current = match faces.current(headers, episode).await {
        Ok(current) => current,
        Err(error) => return failed(error),
    };
    if current.done {
        return refused("the episode is over: every turn has been taken".into());
    }
    let completion = pb::Completion { text: answer_with(code), finish_reason: "stop".into(), ..Default::default() };
    match faces.step(headers, episode, current.turn, completion, Vec::new()).await {
        Ok(observation) => Ended::Output(output(&observation).to_string().into()),
        Err(error) => failed(error),
    }
}

/// `{"ok": true, "output": {"blocks", "metadata", "reward", "finished"}}` of a step: the evaluation's feedback as
/// the text, the step's record in the metadata.
fn output(observation: &pb::Observation) -> Value {
    let record = observation.record.clone().unwrap_or_default();
    let mut text = match (record.feedback.is_empty(), TurnFailure::of(&record)) {
        (false, _) => record.feedback.clone(),
        (true, Some(failure)) => format!("not evaluated: {failure}"),
        (true, None) => "not evaluated".to_owned(),
    };
    if observation.done {
        text.push_str("\n\nThe episode is over: that was the last turn.");
    }
    let turns: Vec<Value> = observation
        .turns
        .iter()
        .map(|t| {
            json!({"turn": t.turn, "verdict": verdict_name(t.verdict), "score": t.score, "speedup": t.speedup,
                   "return": t.return_value, "advantage": t.advantage})
        })
        .collect();
    let metadata = json!({
        "episode_id": observation.episode_id,
        "task_id": record.task_id,
        "turn": record.turn,
        "verdict": verdict_name(record.verdict),
        "speedup": record.speedup,
        "score": record.score,
        "error": record.error,
        "format_error": record.format_error,
        "next_turn": observation.turn,
        "next_prompt": prompt_text(&observation.prompt),
        "turns": turns,
    });
    json!({
        "ok": true,
        "output": {
            "blocks": [{"type": "text", "text": text, "detail": null}],
            "metadata": metadata,
            "reward": observation.reward,
            "finished": observation.done,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_are_cut_in_pieces_of_4096_characters_the_last_marked() {
        assert_eq!(pieces("{}"), [("{}", true)]);
        let exact = "a".repeat(2 * PIECE);
        let cut = pieces(&exact);
        assert_eq!(cut.iter().map(|(p, last)| (p.len(), *last)).collect::<Vec<_>>(), [(PIECE, false), (PIECE, true)]);
        // Characters, not bytes: a piece never splits one, and the pieces put together are the text.
        let text = format!("{}{}", "é".repeat(PIECE + 1), "x");
        let cut = pieces(&text);
        assert_eq!(cut.iter().map(|(p, _)| p.chars().count()).collect::<Vec<_>>(), [PIECE, 2]);
        assert_eq!(cut.iter().map(|(p, _)| *p).collect::<String>(), text);
    }

    #[test]
    fn ids_differ() {
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| random_id()).collect();
        assert_eq!(ids.len(), 1000);
        assert!(ids.iter().all(|id| id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit())));
    }
}
