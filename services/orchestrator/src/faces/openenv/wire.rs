//! The OpenEnv face's JSON: actions read, observations and states written, and their schemas.

use crate::faces::verdict_name;
use kforge_proto::v1 as pb;
use kforge_server::json::JsonError;
use serde_json::{Map, Value, json};
use tonic::Code;

use super::Episode;
use crate::faces::{answer_with, prompt_text};

/// An action as a step submits it.
#[derive(Debug)]
pub(super) struct Submission {
    pub(super) completion: pb::Completion,
    pub(super) prompt_token_ids: Vec<u32>,
}

/// INVALID_ARGUMENT about `field`.
pub(super) fn invalid(field: &str, message: &str) -> JsonError {
    JsonError::new(Code::InvalidArgument, format!("{field}: {message}"), Some(field))
}

/// The keys an action may hold.
const ACTION_KEYS: [&str; 5] = ["code", "text", "reasoning", "prompt_token_ids", "metadata"];

/// Reads an action, at `at` in its message: `{"code": <ModelNew's source>}` or `{"text": <the model's whole
/// response>}` (with its `reasoning` when separated), optionally `prompt_token_ids` (stored with the turn) and
/// `metadata` (ignored). Any other key is an error naming it, as upstream's actions forbid extra fields.
pub(super) fn submission(action: &Value, at: &str) -> Result<Submission, JsonError> {
    let Value::Object(action) = action else {
        return Err(invalid(
            at,
            &format!("an action object, {{\"code\": ...}} or {{\"text\": ...}}, got {}", kind(action)),
        ));
    };
    if let Some(key) = action.keys().find(|key| !ACTION_KEYS.contains(&key.as_str())) {
        let message =
            "unknown field: an action holds `code` or `text` (and `reasoning`, `prompt_token_ids`, `metadata`)";
        return Err(invalid(&format!("{at}.{key}"), message));
    }
    let string = |key: &str| -> Result<Option<&str>, JsonError> {
        match action.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(text)) => Ok(Some(text)),
            Some(other) => Err(invalid(&format!("{at}.{key}"), &format!("a string, got {}", kind(other)))),
        }
    };
    let (code, text, reasoning) = (string("code")?, string("text")?, string("reasoning")?);
    let text = match (code, text) {
        (Some(_), Some(_)) => return Err(invalid(&format!("{at}.text"), "give `code` or `text`, not both")),
        (Some(code), None) if code.trim().is_empty() => return Err(invalid(&format!("{at}.code"), "empty")),
        (Some(code), None) => answer_with(code),
        (None, Some(text)) if text.trim().is_empty() => return Err(invalid(&format!("{at}.text"), "empty")),
        (None, Some(text)) => text.to_owned(),
        (None, None) => {
            let message = "required: ModelNew's source (or `text`: the model's whole response)";
            return Err(invalid(&format!("{at}.code"), message));
        }
    };
    let prompt_token_ids = match action.get("prompt_token_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(ids)) => ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                id.as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| invalid(&format!("{at}.prompt_token_ids[{i}]"), &format!("a token id, got {id}")))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(invalid(&format!("{at}.prompt_token_ids"), &format!("an array, got {}", kind(other))));
        }
    };
    let completion = pb::Completion {
        text,
        reasoning: reasoning.unwrap_or_default().to_owned(),
        finish_reason: "stop".into(),
        ..Default::default()
    };
    Ok(Submission { completion, prompt_token_ids })
}

/// What a JSON value is, for an error.
pub(super) fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Upstream's `{"observation", "reward", "done"}` of an episode's observation. The reward is `null` before the
/// first step (a new or resumed episode that has none), as upstream's reset's.
pub(super) fn observation(observation: &pb::Observation, episode: &Episode) -> Value {
    let record = observation.record.as_ref();
    let text = |field: fn(&pb::TurnRecord) -> &str| record.map_or("", field).to_owned();
    let messages: Vec<Value> =
        observation.prompt.iter().map(|m| json!({"role": m.role, "content": m.content})).collect();
    let body = json!({
        "episode_id": observation.episode_id,
        "task_id": episode.task_id,
        "turn": observation.turn,
        "max_turns": episode.max_turns,
        "prompt": prompt_text(&observation.prompt),
        "messages": messages,
        "feedback": text(|r| &r.feedback),
        "verdict": record.and_then(|r| verdict_name(r.verdict)),
        "speedup": record.and_then(|r| r.speedup),
        "score": record.and_then(|r| r.score),
        "kernel": text(|r| &r.kernel),
        "error": text(|r| &r.error),
        "format_error": text(|r| &r.format_error),
        "turns": observation.turns.iter().map(turn).collect::<Vec<_>>(),
    });
    json!({
        "observation": body,
        "reward": record.map(|_| observation.reward),
        "done": observation.done,
    })
}

/// A turn of an ended episode, as credited.
fn turn(record: &pb::TurnRecord) -> Value {
    json!({
        "turn": record.turn,
        "verdict": verdict_name(record.verdict),
        "score": record.score,
        "speedup": record.speedup,
        "return": record.return_value,
        "advantage": record.advantage,
        "error": record.error,
    })
}

/// Upstream's state: `episode_id` and `step_count`, and where the episode stands; before a reset, no episode.
pub(super) fn state(current: Option<(&pb::Observation, &Episode)>) -> Value {
    let Some((observation, episode)) = current else {
        return json!({"episode_id": null, "step_count": 0});
    };
    json!({
        "episode_id": observation.episode_id,
        "step_count": observation.turn,
        "task_id": episode.task_id,
        "turn": observation.turn,
        "max_turns": episode.max_turns,
        "done": observation.done,
        "last_reward": observation.record.as_ref().map(|_| observation.reward),
    })
}

/// `GET /schema`: JSON schemas of the action, the observation and the state.
pub(super) fn schema() -> Value {
    let string = |description: &str| json!({"type": "string", "description": description});
    let number = |description: &str| json!({"type": ["number", "null"], "description": description});
    let ids = json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": u32::MAX}});
    let mut observation = Map::new();
    for (key, value) in [
        ("episode_id", string("the episode: a reset naming it resumes it")),
        ("task_id", string("the kernel task")),
        ("turn", json!({"type": "integer", "description": "the turn the prompt is for (steps taken)"})),
        ("max_turns", json!({"type": "integer"})),
        ("prompt", string("the prompt for the next turn, its messages joined; empty once done")),
        (
            "messages",
            json!({"type": "array", "items": {"type": "object", "properties": {
            "role": {"type": "string"}, "content": {"type": "string"}}}}),
        ),
        ("feedback", string("the evaluation of the step just taken, as the next prompt shows it")),
        (
            "verdict",
            json!({"type": ["string", "null"], "enum": [
            "correct", "incorrect", "compile_error", "runtime_error", "timeout", "rejected", "hack", "infra_error",
            null]}),
        ),
        ("speedup", number("against the score's baseline, when correct and timed")),
        ("score", number("the step's score (the reward)")),
        ("kernel", string("the kernel read from the action")),
        ("error", string("why the step has no evaluation, when it failed on the way")),
        ("format_error", string("why the response broke the strict format policy")),
        ("turns", json!({"type": "array", "description": "once done: every turn with its return and advantage"})),
    ] {
        observation.insert(key.into(), value);
    }
    json!({
        "action": {
            "type": "object",
            "properties": {
                "code": string("ModelNew's complete source"),
                "text": string("the model's whole response, ModelNew in a ```python block (instead of `code`)"),
                "reasoning": string("the response's separated reasoning, with `text`"),
                "prompt_token_ids": ids,
                "metadata": {"type": "object"},
            },
            "additionalProperties": false,
            "oneOf": [{"required": ["code"]}, {"required": ["text"]}],
        },
        "observation": {"type": "object", "properties": observation},
        "state": {
            "type": "object",
            "properties": {
                "episode_id": {"type": ["string", "null"]},
                "step_count": {"type": "integer", "minimum": 0},
                "task_id": {"type": "string"},
                "turn": {"type": "integer"},
                "max_turns": {"type": "integer"},
                "done": {"type": "boolean"},
                "last_reward": {"type": ["number", "null"]},
            },
        },
    })
}

/// `{"type": "error", "data": {"message", "code", ...}}`: upstream's `code`, kforge's status and the field.
pub(super) fn error(code: &str, error: &JsonError) -> Value {
    let mut data = json!({
        "message": error.message(),
        "code": code,
        "status": kforge_server::json::connect_code(error.code()),
    });
    if let Some(field) = error.field() {
        data["field"] = field.into();
    }
    json!({"type": "error", "data": data})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(action: Value) -> Option<String> {
        submission(&action, "data").err().and_then(|error| error.field().map(str::to_owned))
    }

    #[test]
    fn an_action_is_code_or_text_and_each_bad_key_is_named() {
        let code = submission(&json!({"code": "class ModelNew: pass", "metadata": {"k": 1}}), "data").expect("code");
        assert_eq!(code.completion.text, "```python\nclass ModelNew: pass\n```");
        let text = json!({"text": "I wrote it.\n```python\nx\n```", "reasoning": "hm", "prompt_token_ids": [1, 2]});
        let text = submission(&text, "action").expect("text");
        assert_eq!((text.completion.reasoning.as_str(), text.prompt_token_ids), ("hm", vec![1, 2]));
        assert_eq!(field(json!({"code": "x", "text": "y"})).as_deref(), Some("data.text"));
        assert_eq!(field(json!({})).as_deref(), Some("data.code"));
        assert_eq!(field(json!({"code": " "})).as_deref(), Some("data.code"));
        assert_eq!(field(json!({"code": "x", "timeout": 3})).as_deref(), Some("data.timeout"));
        assert_eq!(
            field(json!({"code": "x", "prompt_token_ids": [1, -2]})).as_deref(),
            Some("data.prompt_token_ids[1]")
        );
        assert_eq!(field(json!("x")).as_deref(), Some("data"));
    }
}
