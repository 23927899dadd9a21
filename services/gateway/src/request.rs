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

/// `params` with every unset field taken from the pool's defaults, every field checked against its contract. The
/// fields are checked in the order below, so of several bad fields the first is the one named.
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
    Ok(Sampling {
        temperature: in_range("temperature", temperature.unwrap_or(defaults.temperature), Low::Closed, 0.0, 100.0)?,
        top_p: in_range("top_p", top_p.unwrap_or(defaults.top_p), Low::Open, 0.0, 1.0)?,
        top_k: checked_top_k(top_k.unwrap_or(defaults.top_k))?,
        min_p: in_range("min_p", min_p.unwrap_or(defaults.min_p), Low::Closed, 0.0, 1.0)?,
        max_tokens: checked_count("max_tokens", max_tokens.unwrap_or(defaults.max_tokens), pool.max_tokens_limit)?,
        n: checked_count("n", n.unwrap_or(1), pool.max_n)?,
        stop: checked_stop(stop)?,
        seed,
        presence_penalty: in_range(
            "presence_penalty",
            presence_penalty.unwrap_or(defaults.presence_penalty),
            Low::Closed,
            -2.0,
            2.0,
        )?,
        frequency_penalty: in_range(
            "frequency_penalty",
            frequency_penalty.unwrap_or(defaults.frequency_penalty),
            Low::Closed,
            -2.0,
            2.0,
        )?,
        repetition_penalty: in_range(
            "repetition_penalty",
            repetition_penalty.unwrap_or(defaults.repetition_penalty),
            Low::Open,
            0.0,
            10.0,
        )?,
        extra_body: extra_body_of(extra_body)?,
    })
}

/// Whether a range includes its lower end: `[lo, hi]` or `(lo, hi]`.
#[derive(Debug, Clone, Copy)]
enum Low {
    Closed,
    Open,
}

/// `value` when it is a finite number in the range from `lo` to `hi`, else why `sampling.<field>` is not.
fn in_range(field: &str, value: f64, low: Low, lo: f64, hi: f64) -> Result<f64, InvalidField> {
    let above_lo = match low {
        Low::Closed => value >= lo,
        Low::Open => value > lo,
    };
    if value.is_finite() && above_lo && value <= hi {
        return Ok(value);
    }
    let open = match low {
        Low::Closed => "[",
        Low::Open => "(",
    };
    Err(InvalidField::new(format!("sampling.{field}"), format!("must be in {open}{lo}, {hi}], got {value}")))
}

/// `top_k` when it is -1 (off) or a number of tokens.
fn checked_top_k(top_k: i32) -> Result<i32, InvalidField> {
    if top_k == -1 || top_k >= 1 {
        Ok(top_k)
    } else {
        Err(InvalidField::new("sampling.top_k", format!("must be -1 (off) or >= 1, got {top_k}")))
    }
}

/// `count` when it is in `[1, limit]`, else why `sampling.<field>` is not.
fn checked_count(field: &str, count: u32, limit: u32) -> Result<u32, InvalidField> {
    if count == 0 || count > limit {
        return Err(InvalidField::new(format!("sampling.{field}"), format!("must be in [1, {limit}], got {count}")));
    }
    Ok(count)
}

/// The stop strings, when none is empty (an empty one would stop every generation at once).
fn checked_stop(stop: Vec<String>) -> Result<Vec<String>, InvalidField> {
    match stop.iter().position(String::is_empty) {
        Some(i) => Err(InvalidField::new(format!("sampling.stop[{i}]"), "must not be empty")),
        None => Ok(stop),
    }
}

/// The fields merged into the upstream body, as JSON; the fields the gateway sets itself are refused.
fn extra_body_of(extra: Option<prost_types::Struct>) -> Result<Map<String, Value>, InvalidField> {
    let mut map = Map::new();
    for (key, value) in extra.map(|extra| extra.fields).unwrap_or_default() {
        if matches!(key.as_str(), "model" | "messages" | "prompt" | "stream" | "stream_options") {
            return Err(InvalidField::new(
                format!("sampling.extra_body.{key}"),
                "is set by the gateway and cannot be overridden",
            ));
        }
        map.insert(key, json_of(value));
    }
    Ok(map)
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

    #[test]
    fn a_range_names_its_ends_and_refuses_what_is_not_a_number() {
        assert_eq!(in_range("top_p", 1.0, Low::Open, 0.0, 1.0), Ok(1.0));
        assert_eq!(in_range("min_p", 0.0, Low::Closed, 0.0, 1.0), Ok(0.0));
        let open = in_range("top_p", 0.0, Low::Open, 0.0, 1.0).expect_err("0 is outside (0, 1]");
        assert_eq!(open.to_string(), "sampling.top_p: must be in (0, 1], got 0");
        let closed = in_range("temperature", 101.0, Low::Closed, 0.0, 100.0).expect_err("over 100");
        assert_eq!(closed.reason, "must be in [0, 100], got 101");
        assert!(in_range("temperature", f64::INFINITY, Low::Closed, 0.0, f64::INFINITY).is_err());
    }

    #[test]
    fn counts_and_stops_are_checked_by_their_own_rules() {
        assert_eq!(checked_top_k(-1), Ok(-1));
        assert_eq!(checked_top_k(-2).expect_err("-2").field, "sampling.top_k");
        assert_eq!(checked_count("n", 64, 64), Ok(64));
        assert_eq!(checked_count("n", 0, 64).expect_err("0").reason, "must be in [1, 64], got 0");
        let stops = vec!["</s>".to_owned(), String::new()];
        assert_eq!(checked_stop(stops).expect_err("empty stop").field, "sampling.stop[1]");
    }

    #[test]
    fn the_first_bad_sampling_field_is_the_one_named() {
        let params = pb::SamplingParams { top_k: Some(0), n: Some(0), ..Default::default() };
        assert_eq!(sampling_of(params, &PoolConfig::default()).expect_err("two bad").field, "sampling.top_k");
    }
}
