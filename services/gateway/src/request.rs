//! A `GenerateRequest` checked and completed: every field validated against the pool's limits (failing with the
//! field's name), every unset sampling field filled from the pool's defaults. Backends only ever see a
//! [`GenerateSpec`], so they never decide a default or meet a value the contract forbids.

use kforge_proto::v1 as pb;
use serde_json::{Map, Value};

use crate::config::{BackendKind, PoolConfig};

/// A request field that violates its contract. Displays as `field: reason`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidField {
    pub field: String,
    pub reason: String,
}

impl InvalidField {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self { field: field.into(), reason: reason.into() }
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// What the model continues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// A conversation (the chat route; the backend applies the chat template).
    Chat(Vec<Message>),
    /// A prompt as text (the completions route).
    Prompt(String),
    /// A prompt as token ids (the completions route, token in, token out).
    PromptTokens(Vec<u32>),
}

/// Sampling with every value decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: i32,
    pub min_p: f64,
    pub max_tokens: u32,
    pub stop: Vec<String>,
    pub seed: Option<u64>,
    pub n: u32,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    pub repetition_penalty: f64,
    /// Merged into the upstream body last.
    pub extra_body: Map<String, Value>,
}

/// Who a request belongs to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Keys {
    pub job_id: String,
    pub episode_id: String,
    pub task_id: String,
    pub trajectory: u32,
    pub turn: u32,
}

impl Keys {
    /// The affinity key: the episode, else (job, task, trajectory) when a task is named; `None` when nothing
    /// identifies a trajectory.
    pub fn affinity(&self) -> Option<String> {
        if !self.episode_id.is_empty() {
            return Some(self.episode_id.clone());
        }
        (!self.task_id.is_empty()).then(|| format!("{}\u{1f}{}\u{1f}{}", self.job_id, self.task_id, self.trajectory))
    }
}

/// A validated generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateSpec {
    pub model: String,
    pub input: Input,
    pub sampling: Sampling,
    pub return_token_ids: bool,
    pub return_logprobs: bool,
    pub keys: Keys,
}

/// Checks `request` against `pool` and fills the defaults.
pub fn validate(request: pb::GenerateRequest, pool: &PoolConfig) -> Result<GenerateSpec, InvalidField> {
    let pb::GenerateRequest { model, input, sampling, return_token_ids, return_logprobs, keys } = request;
    let input = match input {
        None => return Err(InvalidField::new("input", "set one of chat, prompt or prompt_token_ids")),
        Some(pb::generate_request::Input::Chat(chat)) => {
            if chat.messages.is_empty() {
                return Err(InvalidField::new("chat.messages", "must not be empty"));
            }
            let mut chars = 0;
            let mut messages = Vec::with_capacity(chat.messages.len());
            for (i, pb::ChatMessage { role, content }) in chat.messages.into_iter().enumerate() {
                if !matches!(role.as_str(), "system" | "user" | "assistant" | "developer" | "tool") {
                    return Err(InvalidField::new(
                        format!("chat.messages[{i}].role"),
                        format!("must be system, user, assistant, developer or tool, got {role:?}"),
                    ));
                }
                chars += content.chars().count();
                messages.push(Message { role, content });
            }
            if chars > pool.max_prompt_chars {
                return Err(InvalidField::new(
                    "chat.messages",
                    format!("{chars} characters, over the pool's limit of {}", pool.max_prompt_chars),
                ));
            }
            Input::Chat(messages)
        }
        Some(pb::generate_request::Input::Prompt(prompt)) => {
            if prompt.is_empty() {
                return Err(InvalidField::new("prompt", "must not be empty"));
            }
            let chars = prompt.chars().count();
            if chars > pool.max_prompt_chars {
                return Err(InvalidField::new(
                    "prompt",
                    format!("{chars} characters, over the pool's limit of {}", pool.max_prompt_chars),
                ));
            }
            Input::Prompt(prompt)
        }
        Some(pb::generate_request::Input::PromptTokenIds(tokens)) => {
            if tokens.ids.is_empty() {
                return Err(InvalidField::new("prompt_token_ids.ids", "must not be empty"));
            }
            if tokens.ids.len() > pool.max_prompt_tokens {
                return Err(InvalidField::new(
                    "prompt_token_ids.ids",
                    format!("{} tokens, over the pool's limit of {}", tokens.ids.len(), pool.max_prompt_tokens),
                ));
            }
            Input::PromptTokens(tokens.ids)
        }
    };
    let sampling = sampling_of(sampling.unwrap_or_default(), pool)?;
    one_completion_of_text(pool, &input, &sampling)?;
    let keys = keys.map_or_else(Keys::default, |k| Keys {
        job_id: k.job_id,
        episode_id: k.episode_id,
        task_id: k.task_id,
        trajectory: k.trajectory,
        turn: k.turn,
    });
    Ok(GenerateSpec { model, input, sampling, return_token_ids, return_logprobs, keys })
}

/// llama.cpp's servers give one completion per request and take prompts as text: llama-cpp-python answers one
/// choice whatever `n` asks, and a token-id prompt with a 500. A pool with such a backend refuses both here, naming
/// the field, instead of the server dropping what was asked for or the gateway retrying a request that cannot pass.
fn one_completion_of_text(pool: &PoolConfig, input: &Input, sampling: &Sampling) -> Result<(), InvalidField> {
    if !pool.backends.iter().any(|b| b.kind == BackendKind::Llamacpp) {
        return Ok(());
    }
    if sampling.n > 1 {
        return Err(InvalidField::new(
            "sampling.n",
            format!(
                "must be 1 for a pool with a llamacpp backend (llama.cpp's server gives one completion per request), \
                 got {}",
                sampling.n
            ),
        ));
    }
    if matches!(input, Input::PromptTokens(_)) {
        return Err(InvalidField::new(
            "prompt_token_ids",
            "a pool with a llamacpp backend takes text (chat or prompt): llama.cpp's OpenAI server has no token prompts",
        ));
    }
    Ok(())
}

fn sampling_of(params: pb::SamplingParams, pool: &PoolConfig) -> Result<Sampling, InvalidField> {
    let pb::SamplingParams {
        temperature,
        top_p,
        top_k,
        min_p,
        max_tokens,
        stop,
        seed,
        n,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        extra_body,
    } = params;
    let defaults = &pool.sampling;
    let range = |field: &str, value: f64, lo: f64, hi: f64, lo_open: bool| {
        let above_lo = if lo_open { value > lo } else { value >= lo };
        if value.is_finite() && above_lo && value <= hi {
            Ok(value)
        } else {
            let open = if lo_open { "(" } else { "[" };
            Err(InvalidField::new(format!("sampling.{field}"), format!("must be in {open}{lo}, {hi}], got {value}")))
        }
    };
    let temperature = range("temperature", temperature.unwrap_or(defaults.temperature), 0.0, 100.0, false)?;
    let top_p = range("top_p", top_p.unwrap_or(defaults.top_p), 0.0, 1.0, true)?;
    let top_k = top_k.unwrap_or(defaults.top_k);
    if !(top_k == -1 || top_k >= 1) {
        return Err(InvalidField::new("sampling.top_k", format!("must be -1 (off) or >= 1, got {top_k}")));
    }
    let min_p = range("min_p", min_p.unwrap_or(defaults.min_p), 0.0, 1.0, false)?;
    let max_tokens = max_tokens.unwrap_or(defaults.max_tokens);
    if max_tokens == 0 || max_tokens > pool.max_tokens_limit {
        return Err(InvalidField::new(
            "sampling.max_tokens",
            format!("must be in [1, {}], got {max_tokens}", pool.max_tokens_limit),
        ));
    }
    let n = n.unwrap_or(1);
    if n == 0 || n > pool.max_n {
        return Err(InvalidField::new("sampling.n", format!("must be in [1, {}], got {n}", pool.max_n)));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(InvalidField::new(format!("sampling.stop[{i}]"), "must not be empty"));
    }
    let presence_penalty =
        range("presence_penalty", presence_penalty.unwrap_or(defaults.presence_penalty), -2.0, 2.0, false)?;
    let frequency_penalty =
        range("frequency_penalty", frequency_penalty.unwrap_or(defaults.frequency_penalty), -2.0, 2.0, false)?;
    let repetition_penalty =
        range("repetition_penalty", repetition_penalty.unwrap_or(defaults.repetition_penalty), 0.0, 10.0, true)?;
    let extra_body = match extra_body {
        None => Map::new(),
        Some(extra) => {
            let mut map = Map::new();
            for (key, value) in extra.fields {
                if matches!(key.as_str(), "model" | "messages" | "prompt" | "stream" | "stream_options") {
                    return Err(InvalidField::new(
                        format!("sampling.extra_body.{key}"),
                        "is set by the gateway and cannot be overridden",
                    ));
                }
                map.insert(key, json_of(value));
            }
            map
        }
    };
    Ok(Sampling {
        temperature,
        top_p,
        top_k,
        min_p,
        max_tokens,
        stop,
        seed,
        n,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        extra_body,
    })
}

/// A protobuf `Value` as JSON. Whole numbers become integers: a `Struct` carries every number as a double, and
/// backends reject `1.0` where they expect an integer (a `top_logprobs`, a token id).
fn json_of(value: prost_types::Value) -> Value {
    use prost_types::value::Kind;
    match value.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(b),
        Some(Kind::NumberValue(x)) => {
            if x.fract() == 0.0 && x.abs() < 9.0e15 {
                Value::from(x as i64)
            } else {
                serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)
            }
        }
        Some(Kind::StringValue(s)) => Value::String(s),
        Some(Kind::ListValue(list)) => Value::Array(list.values.into_iter().map(json_of).collect()),
        Some(Kind::StructValue(s)) => Value::Object(s.fields.into_iter().map(|(k, v)| (k, json_of(v))).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(text: &str) -> pb::GenerateRequest {
        pb::GenerateRequest {
            model: "m".into(),
            input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
                messages: vec![pb::ChatMessage { role: "user".into(), content: text.into() }],
            })),
            ..Default::default()
        }
    }

    fn field_of(request: pb::GenerateRequest) -> String {
        validate(request, &PoolConfig::default()).expect_err("invalid").field
    }

    #[test]
    fn defaults_fill_every_unset_sampling_field() {
        let spec = validate(chat("hi"), &PoolConfig::default()).expect("valid");
        assert_eq!(
            (spec.sampling.temperature, spec.sampling.top_p, spec.sampling.top_k, spec.sampling.n),
            (1.0, 1.0, -1, 1)
        );
        assert_eq!(spec.sampling.max_tokens, 4096);
    }

    #[test]
    fn bad_input_names_the_field() {
        assert_eq!(field_of(pb::GenerateRequest { model: "m".into(), ..Default::default() }), "input");
        let empty = pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Chat(pb::ChatMessages { messages: vec![] })),
            ..chat("")
        };
        assert_eq!(field_of(empty), "chat.messages");
        let long = chat(&"x".repeat(1_000_001));
        assert_eq!(field_of(long), "chat.messages");
        let with = |sampling: pb::SamplingParams| pb::GenerateRequest { sampling: Some(sampling), ..chat("hi") };
        assert_eq!(field_of(with(pb::SamplingParams { n: Some(0), ..Default::default() })), "sampling.n");
        assert_eq!(
            field_of(with(pb::SamplingParams { temperature: Some(f64::NAN), ..Default::default() })),
            "sampling.temperature"
        );
        assert_eq!(field_of(with(pb::SamplingParams { top_p: Some(0.0), ..Default::default() })), "sampling.top_p");
        assert_eq!(field_of(with(pb::SamplingParams { top_k: Some(0), ..Default::default() })), "sampling.top_k");
        assert_eq!(
            field_of(with(pb::SamplingParams { max_tokens: Some(u32::MAX), ..Default::default() })),
            "sampling.max_tokens"
        );
        let mut extra = prost_types::Struct::default();
        extra.fields.insert("stream".into(), prost_types::Value { kind: None });
        assert_eq!(
            field_of(with(pb::SamplingParams { extra_body: Some(extra), ..Default::default() })),
            "sampling.extra_body.stream"
        );
    }

    #[test]
    fn a_pool_with_a_llamacpp_backend_refuses_n_and_token_prompts() {
        let llamacpp = crate::config::BackendConfig {
            kind: BackendKind::Llamacpp,
            url: "http://127.0.0.1:8000/v1".into(),
            ..Default::default()
        };
        let pool = PoolConfig { backends: vec![llamacpp], ..PoolConfig::default() };
        let two = pb::GenerateRequest {
            sampling: Some(pb::SamplingParams { n: Some(2), ..Default::default() }),
            ..chat("hi")
        };
        let error = validate(two, &pool).expect_err("n = 2");
        assert_eq!(error.field, "sampling.n");
        assert!(error.reason.contains("one completion per request"), "{error}");
        let tokens = pb::GenerateRequest {
            input: Some(pb::generate_request::Input::PromptTokenIds(pb::TokenIds { ids: vec![1, 2] })),
            ..chat("")
        };
        assert_eq!(validate(tokens, &pool).expect_err("token prompt").field, "prompt_token_ids");
        assert!(validate(chat("hi"), &pool).is_ok());
        assert!(
            validate(
                pb::GenerateRequest {
                    sampling: Some(pb::SamplingParams { n: Some(2), ..Default::default() }),
                    ..chat("hi")
                },
                &PoolConfig::default()
            )
            .is_ok()
        );
    }

    #[test]
    fn whole_numbers_in_extra_body_stay_integers() {
        use prost_types::value::Kind;
        assert_eq!(json_of(prost_types::Value { kind: Some(Kind::NumberValue(5.0)) }), Value::from(5));
        assert_eq!(json_of(prost_types::Value { kind: Some(Kind::NumberValue(0.5)) }), Value::from(0.5));
    }

    #[test]
    fn affinity_key_prefers_the_episode() {
        let keys = Keys { episode_id: "e1".into(), task_id: "t".into(), ..Keys::default() };
        assert_eq!(keys.affinity().as_deref(), Some("e1"));
        assert_eq!(Keys::default().affinity(), None);
        let by_task = Keys { task_id: "t".into(), trajectory: 2, ..Keys::default() };
        assert!(by_task.affinity().is_some());
    }
}
