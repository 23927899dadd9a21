//! NeMo Gym's wire shapes as the face reads them: the dataset row (its task), the Responses-API object `/verify` and
//! `/step` carry (the model's last message, its `submit_kernel` calls, the token-in/token-out fields on its output
//! items), the session cookie, and the keys of a row's episode.

use http::{HeaderMap, HeaderValue, Uri, header};
use kforge_proto::v1 as pb;
use kforge_server::json::JsonError;
use serde::Deserialize;
use serde_json::Value;
use tonic::Code;

/// The session cookie: `<episode id>.<next turn>`.
pub(super) const COOKIE: &str = "kforge_nemo_gym";
/// The tool a model submits a kernel with.
pub(super) const TOOL: &str = "submit_kernel";

/// A dataset row: what the face reads of it (the rest is echoed by `/verify`, untouched).
#[derive(Debug, Deserialize)]
pub(super) struct Row {
    #[serde(default)]
    responses_create_params: Option<CreateParams>,
    #[serde(default)]
    task_id: Option<TaskRef>,
    #[serde(default)]
    verifier_metadata: Option<VerifierMetadata>,
    #[serde(default, rename = "_ng_rollout_id")]
    rollout_id: Option<String>,
    #[serde(default, rename = "_ng_task_index")]
    task_index: Option<i64>,
    #[serde(default, rename = "_ng_rollout_index")]
    rollout_index: Option<i64>,
}

#[derive(Debug, Deserialize)]
struct CreateParams {
    #[serde(default)]
    input: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct VerifierMetadata {
    #[serde(default)]
    task_id: Option<TaskRef>,
}

/// A task named by its id or its index in the faces' tasks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TaskRef {
    Id(String),
    Index(u64),
}

impl TaskRef {
    fn text(&self) -> String {
        match self {
            Self::Id(id) => id.clone(),
            Self::Index(index) => index.to_string(),
        }
    }
}

impl Row {
    /// The task's id or index and the field that named it: `task_id`, else `verifier_metadata.task_id`.
    pub(super) fn task(&self) -> Result<(String, &'static str), JsonError> {
        if let Some(task) = &self.task_id {
            return Ok((task.text(), "task_id"));
        }
        if let Some(task) = self.verifier_metadata.as_ref().and_then(|m| m.task_id.as_ref()) {
            return Ok((task.text(), "verifier_metadata.task_id"));
        }
        let message = "task_id: required: the task's id or index among the faces' tasks (`orchestrator.http.task_set`), \
                       in `task_id` or `verifier_metadata.task_id`";
        Err(JsonError::new(Code::InvalidArgument, message, Some("task_id")))
    }

    /// Whether the row's prompt is empty (then `/reset` answers kforge's prompt as its observation).
    pub(super) fn prompt_is_empty(&self) -> bool {
        match self.responses_create_params.as_ref().and_then(|p| p.input.as_ref()) {
            None | Some(Value::Null) => true,
            Some(Value::String(text)) => text.trim().is_empty(),
            Some(Value::Array(items)) => items.is_empty(),
            Some(_) => false,
        }
    }

    /// What tells this rollout from another of the same row: the `/ng-rollout/{id}` prefix, the row's
    /// `_ng_rollout_id`, or its `_ng_task_index` and `_ng_rollout_index`. `None`: nothing does.
    pub(super) fn identity(&self, uri: &Uri) -> Option<String> {
        if let Some(rollout) = rollout_prefix(uri) {
            return Some(format!("rollout {rollout}"));
        }
        if let Some(rollout) = self.rollout_id.as_deref().filter(|id| !id.is_empty()) {
            return Some(format!("rollout {rollout}"));
        }
        match (self.task_index, self.rollout_index) {
            (Some(task), Some(rollout)) => Some(format!("index {task}/{rollout}")),
            _ => None,
        }
    }
}

/// The rollout id of an `/ng-rollout/{id}/...` path.
fn rollout_prefix(uri: &Uri) -> Option<&str> {
    let rest = uri.path().strip_prefix("/ng-rollout/")?;
    let id = rest.split_once('/').map_or(rest, |(id, _)| id);
    (!id.is_empty()).then_some(id)
}

/// What `/verify` and `/step` read besides the row: the model's response.
#[derive(Debug, Deserialize)]
pub(super) struct WithResponse {
    pub(super) response: ResponseBody,
}

/// A Responses-API response: its output items and whether it was cut short.
#[derive(Debug, Deserialize)]
pub(super) struct ResponseBody {
    output: Vec<Item>,
    #[serde(default)]
    status: Option<String>,
}

/// One output item; NeMo Gym puts the token-in/token-out fields on the last item of each model turn.
#[derive(Debug, Deserialize)]
struct Item {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    summary: Option<Vec<Part>>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
    #[serde(default)]
    call_id: Option<String>,
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    generation_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    generation_log_probs: Option<Vec<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
struct Part {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

fn texts(parts: &[Part], kinds: &[&str]) -> String {
    parts.iter().filter(|p| kinds.contains(&p.kind.as_str())).filter_map(|p| p.text.as_deref()).collect()
}

/// A `submit_kernel` call of the response: its call id and arguments.
#[derive(Debug)]
pub(super) struct Call {
    pub(super) call_id: String,
    pub(super) arguments: String,
}

impl ResponseBody {
    /// The text of the last assistant message that has some.
    pub(super) fn last_message(&self) -> Option<String> {
        self.output
            .iter()
            .rev()
            .filter(|i| i.kind == "message" && i.role.as_deref().is_none_or(|r| r == "assistant"))
            .find_map(|item| {
                let text = match item.content.as_ref()? {
                    Content::Text(text) => text.clone(),
                    Content::Parts(parts) => texts(parts, &["output_text", "text"]),
                };
                (!text.trim().is_empty()).then_some(text)
            })
    }

    /// Whether the model called any function.
    pub(super) fn called(&self) -> bool {
        self.output.iter().any(|i| i.kind == "function_call")
    }

    /// The last `submit_kernel` call.
    pub(super) fn last_call(&self) -> Option<Call> {
        self.output.iter().rev().find(|i| i.kind == "function_call" && i.name.as_deref() == Some(TOOL)).map(|item| {
            Call {
                call_id: item.call_id.clone().unwrap_or_default(),
                arguments: item.arguments.clone().unwrap_or_default(),
            }
        })
    }

    /// The completion to step with `text` as its answer: the reasoning items' text, and the token ids and
    /// log-probabilities of the last output item that carries them (the model turn's last item), with that item's
    /// `prompt_token_ids` returned beside it.
    pub(super) fn completion(&self, text: String) -> Result<(pb::Completion, Vec<u32>), JsonError> {
        let reasoning: Vec<String> = self
            .output
            .iter()
            .filter(|i| i.kind == "reasoning")
            .map(|item| {
                let mut text = item.summary.as_deref().map(|s| texts(s, &["summary_text", "text"])).unwrap_or_default();
                if let Some(Content::Parts(parts)) = &item.content {
                    text.push_str(&texts(parts, &["reasoning_text", "text"]));
                }
                text
            })
            .filter(|text| !text.is_empty())
            .collect();
        let mut completion = pb::Completion {
            text,
            reasoning: reasoning.join("\n"),
            finish_reason: if self.status.as_deref() == Some("incomplete") { "length" } else { "stop" }.into(),
            ..Default::default()
        };
        let mut prompt_token_ids = Vec::new();
        let tito = self.output.iter().enumerate().rev().find(|(_, i)| i.generation_token_ids.is_some());
        if let Some((index, item)) = tito {
            let tokens = item.generation_token_ids.clone().unwrap_or_default();
            let logprobs = item.generation_log_probs.clone().unwrap_or_default();
            if !logprobs.is_empty() && logprobs.len() != tokens.len() {
                let field = format!("response.output[{index}].generation_log_probs");
                let message =
                    format!("{field}: {} log-probabilities for {} generation_token_ids", logprobs.len(), tokens.len());
                return Err(JsonError::new(Code::InvalidArgument, message, Some(&field)));
            }
            completion.completion_tokens = tokens.len() as u64;
            completion.token_ids = tokens;
            completion.logprobs = logprobs;
            prompt_token_ids = item.prompt_token_ids.clone().unwrap_or_default();
        }
        Ok((completion, prompt_token_ids))
    }
}

/// The arguments of `submit_kernel`: the kernel's source as `code` (or `kernel`, or `source`).
#[derive(Debug, Deserialize)]
pub(super) struct KernelArgs {
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    kernel: Option<String>,
    #[serde(default)]
    source: Option<String>,
}

impl KernelArgs {
    pub(super) fn kernel(self) -> Result<String, JsonError> {
        [self.code, self.kernel, self.source].into_iter().flatten().find(|k| !k.trim().is_empty()).ok_or_else(|| {
            let message = "code: required: the kernel's Python source defining `ModelNew` (`code`, or `kernel`)";
            JsonError::new(Code::InvalidArgument, message, Some("code"))
        })
    }
}

/// A session: the episode and the turn its client steps next (a retry of a step whose answer was lost carries the
/// turn it was for).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Session {
    pub(super) episode: String,
    pub(super) turn: Option<u32>,
}

impl Session {
    /// The session the request's cookie names, if any.
    pub(super) fn of(headers: &HeaderMap) -> Option<Self> {
        let value = headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|cookies| cookies.split(';'))
            .filter_map(|cookie| cookie.trim().split_once('='))
            .find(|(name, _)| *name == COOKIE)
            .map(|(_, value)| value.trim_matches('"'))?;
        let (episode, turn) = match value.rsplit_once('.') {
            Some((episode, turn)) if turn.bytes().all(|b| b.is_ascii_digit()) => (episode, turn.parse().ok()),
            _ => (value, None),
        };
        let valid = !episode.is_empty() && episode.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        valid.then(|| Self { episode: episode.to_owned(), turn })
    }

    /// Its `Set-Cookie` header.
    pub(super) fn cookie(&self) -> Option<HeaderValue> {
        let value = match self.turn {
            Some(turn) => format!("{}.{turn}", self.episode),
            None => self.episode.clone(),
        };
        HeaderValue::from_str(&format!("{COOKIE}={value}; Path=/; HttpOnly; SameSite=Lax")).ok()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_cookie_carries_the_episode_and_its_next_turn() {
        let session = Session { episode: "job-1-abc-3".into(), turn: Some(2) };
        let cookie = session.cookie().expect("a header");
        assert!(cookie.to_str().expect("ascii").starts_with("kforge_nemo_gym=job-1-abc-3.2;"));
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_static("other=1; kforge_nemo_gym=job-1-abc-3.2"));
        assert_eq!(Session::of(&headers), Some(session));
        headers.insert(header::COOKIE, HeaderValue::from_static("kforge_nemo_gym=job-9"));
        assert_eq!(Session::of(&headers), Some(Session { episode: "job-9".into(), turn: None }));
        headers.insert(header::COOKIE, HeaderValue::from_static("kforge_nemo_gym=<script>.1"));
        assert_eq!(Session::of(&headers), None);
    }

    #[test]
    fn the_last_turn_s_tokens_and_the_last_message_are_read() {
        let response: ResponseBody = serde_json::from_value(json!({"status": "completed", "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "first"}],
             "prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.5]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "second"}],
             "prompt_token_ids": [1, 2, 3], "generation_token_ids": [4, 5], "generation_log_probs": [-0.1, -0.2]},
        ]}))
        .expect("a response");
        assert_eq!(response.last_message().as_deref(), Some("second"));
        let (completion, prompt) = response.completion("second".into()).expect("consistent");
        assert_eq!((completion.token_ids, completion.logprobs, prompt), (vec![4, 5], vec![-0.1, -0.2], vec![1, 2, 3]));
        assert_eq!(completion.reasoning, "think");
        let uneven: ResponseBody = serde_json::from_value(json!({"output": [
            {"type": "message", "generation_token_ids": [4, 5], "generation_log_probs": [-0.1]},
        ]}))
        .expect("a response");
        let error = uneven.completion(String::new()).expect_err("uneven");
        assert_eq!(error.field(), Some("response.output[0].generation_log_probs"));
    }

    #[test]
    fn a_rollout_is_identified_by_its_prefix_or_its_indices() {
        let row: Row =
            serde_json::from_value(json!({"task_id": 0, "_ng_task_index": 3, "_ng_rollout_index": 1})).expect("a row");
        assert_eq!(row.identity(&Uri::from_static("/seed_session")).as_deref(), Some("index 3/1"));
        assert_eq!(row.identity(&Uri::from_static("/ng-rollout/r7/seed_session")).as_deref(), Some("rollout r7"));
        assert_eq!(row.task().expect("named"), ("0".to_owned(), "task_id"));
        assert!(row.prompt_is_empty());
    }
}
