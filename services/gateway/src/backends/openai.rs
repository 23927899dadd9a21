//! The OpenAI-compatible HTTP backend: vLLM, SGLang and hosted APIs.
//!
//! Every attempt streams (`stream: true` with `stream_options.include_usage`), so the gateway sees each
//! completion's first token (its TTFT), can forward text to a streaming caller, and knows whether tokens arrived
//! before a failure. A server that answers a streaming request with one JSON body is read the same way: a chat
//! `message` or a completions `text` is parsed like a delta. Field names are the ecosystem's: vLLM's
//! `return_token_ids` (`prompt_token_ids`, per-choice `token_ids`), `logprobs` (chat: `logprobs.content[].logprob`;
//! completions: `logprobs.token_logprobs`), reasoning in `reasoning_content` or `reasoning`, cached and reasoning
//! token counts in `usage.prompt_tokens_details.cached_tokens` and `usage.completion_tokens_details.reasoning_tokens`.
//! Dropping the attempt's future drops the HTTP connection, which vLLM and SGLang take as the request's abort.

use std::fmt;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio_stream::StreamExt;

use super::token_route::{self, Answer};
use super::{AttemptError, BackendError, CompletionOut, Delta, DeltaSink, Generation, UsageOut};
use crate::config::{BackendConfig, BackendKind};
use crate::request::{GenerateSpec, Input};

/// Largest error body kept for a message.
const ERROR_BODY_BYTES: usize = 2048;
/// Largest single SSE event or JSON body accepted from a backend.
const MAX_EVENT_BYTES: usize = 64 * 1024 * 1024;

/// An API key; `Debug` never shows it.
#[derive(Clone)]
struct ApiKey(String);

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Why a control call (`post_control`) got no 2xx answer.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No response: connection, TLS or timeout; the text is the whole cause chain.
    #[error("{}", describe(.0))]
    Send(reqwest::Error),
    /// The backend answered with an error status.
    #[error("http {status}: {body}")]
    Status { status: u16, body: String },
}

/// One OpenAI-compatible server.
#[derive(Debug)]
pub struct OpenAiBackend {
    kind: BackendKind,
    /// The OpenAI base URL, e.g. `http://host:8000/v1`.
    api_base: String,
    /// The server root, e.g. `http://host:8000`: control and health routes.
    root: String,
    http: reqwest::Client,
    api_key: Option<ApiKey>,
    /// Token prompts go to the server's token-in-token-out route.
    token_route: bool,
}

impl OpenAiBackend {
    /// A backend for `config`, reading its API key now. Errors name what is missing.
    pub fn new(config: &BackendConfig, http: reqwest::Client) -> Result<Self, BackendError> {
        let url = config.url.trim_end_matches('/');
        let (root, api_base) = match url.split_once("://").map(|(_, rest)| rest.contains('/')) {
            Some(true) => {
                let root = url.strip_suffix("/v1").unwrap_or(url).to_owned();
                (root, url.to_owned())
            }
            _ => (url.to_owned(), format!("{url}/v1")),
        };
        let api_key = if let Some(path) = &config.api_key_file {
            let raw = std::fs::read_to_string(path).map_err(|source| BackendError::ApiKeyFile {
                path: path.clone(),
                url: url.to_owned(),
                source,
            })?;
            Some(raw.trim().to_owned())
        } else if let Some(name) = &config.api_key_env {
            let unset = |_| BackendError::ApiKeyUnset { variable: name.clone(), url: url.to_owned() };
            Some(std::env::var(name).map_err(unset)?)
        } else {
            None
        };
        if api_key.as_ref().is_some_and(String::is_empty) {
            return Err(BackendError::ApiKeyEmpty { url: url.to_owned() });
        }
        Ok(Self {
            kind: config.kind,
            api_base,
            root,
            http,
            api_key: api_key.map(ApiKey),
            token_route: config.token_route,
        })
    }

    fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => request.bearer_auth(&key.0),
            None => request,
        }
    }

    /// `POST {root}{path}` with an optional JSON body, for control routes: the status, or why none came.
    pub async fn post_control(&self, path: &str, body: Option<Value>, timeout: Duration) -> Result<u16, ControlError> {
        let mut request = self.authorized(self.http.post(format!("{}{path}", self.root))).timeout(timeout);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.map_err(ControlError::Send)?;
        let status = response.status().as_u16();
        if response.status().is_success() {
            Ok(status)
        } else {
            Err(ControlError::Status { status, body: error_body(response).await })
        }
    }

    /// `GET {root}{path}`: whether it answered 2xx within `timeout`. A llama.cpp server may also answer 404:
    /// llama-cpp-python's has no health route (and its `/v1/models` waits behind the generation in progress), but it
    /// serves only once its model is loaded, so any answer says it is up; llama.cpp's `llama-server` answers
    /// `/health` with 200, or 503 while it loads.
    pub async fn check_health(&self, path: &str, timeout: Duration) -> bool {
        let request = self.authorized(self.http.get(format!("{}{path}", self.root))).timeout(timeout);
        let Ok(response) = request.send().await else { return false };
        let status = response.status();
        status.is_success() || (self.kind == BackendKind::Llamacpp && status == reqwest::StatusCode::NOT_FOUND)
    }

    /// One attempt: the request built for this backend's kind, streamed and parsed.
    pub async fn generate(
        &self,
        spec: &GenerateSpec,
        upstream_model: &str,
        deadline: Option<Instant>,
        sink: &mut DeltaSink,
    ) -> Result<Generation, AttemptError> {
        let native = if self.token_route { token_route::request(self.kind, spec, upstream_model) } else { None };
        let (url, body, answer) = match native {
            Some(native) => (format!("{}{}", self.root, native.path), native.body, native.answer),
            None => {
                let (route, body) = request_body(self.kind, spec, upstream_model);
                (format!("{}{route}", self.api_base), body, Answer::OpenAiChunks)
            }
        };
        // The request's trace continues into servers that trace (vLLM with an OTLP endpoint reads `traceparent`).
        let mut trace = tonic::metadata::MetadataMap::new();
        kforge_telemetry::inject_context(&mut trace);
        let mut request = self.authorized(self.http.post(url)).headers(trace.into_headers()).json(&body);
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(AttemptError::Deadline);
            }
            request = request.timeout(left);
        }
        let response = request.send().await.map_err(|e| send_error(&e))?;
        let status = response.status();
        if !status.is_success() {
            let retry_after = response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(parse_retry_after);
            return Err(AttemptError::Status {
                status: status.as_u16(),
                retry_after,
                body: error_body(response).await,
            });
        }
        if answer == Answer::SglangNative {
            let body = read_body(response, sink).await?;
            let generation = token_route::sglang_generation(&body, spec.sampling.n, Instant::now())?;
            for (index, completion) in generation.completions.iter().enumerate() {
                sink.send(Delta { index: index as u32, text: completion.text.clone(), reasoning: String::new() }).await;
            }
            return Ok(generation);
        }
        let is_sse = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let mut acc = Accumulator::default();
        if is_sse {
            read_events(response, &mut acc, sink).await?;
        } else {
            let body = read_body(response, sink).await?;
            let chunk: Chunk = serde_json::from_slice(&body)
                .map_err(|e| AttemptError::Protocol(format!("response body is not the API's json: {e}")))?;
            acc.apply(chunk, Instant::now(), sink).await?;
        }
        acc.finish(spec.sampling.n, sink.streamed())
    }
}

/// The route and JSON body of `spec` for a backend of `kind`. Every sampling value is explicit; kinds that
/// do not know vLLM's and SGLang's extra fields do not get them.
pub fn request_body(kind: BackendKind, spec: &GenerateSpec, upstream_model: &str) -> (&'static str, Value) {
    let s = &spec.sampling;
    let mut body = Map::new();
    body.insert("model".into(), json!(upstream_model));
    let chat = matches!(spec.input, Input::Chat(_));
    let route = match &spec.input {
        Input::Chat(messages) => {
            let messages: Vec<Value> = messages.iter().map(|m| json!({"role": m.role, "content": m.content})).collect();
            body.insert("messages".into(), Value::Array(messages));
            "/chat/completions"
        }
        Input::Prompt(prompt) => {
            body.insert("prompt".into(), json!(prompt));
            "/completions"
        }
        Input::PromptTokens(ids) => {
            body.insert("prompt".into(), json!(ids));
            "/completions"
        }
    };
    body.insert("stream".into(), json!(true));
    body.insert("stream_options".into(), json!({"include_usage": true}));
    body.insert("n".into(), json!(s.n));
    // Hosted chat APIs renamed the limit; vLLM and SGLang take the original name on both routes.
    let limit_name = if kind == BackendKind::Openai && chat { "max_completion_tokens" } else { "max_tokens" };
    body.insert(limit_name.into(), json!(s.max_tokens));
    body.insert("temperature".into(), json!(s.temperature));
    body.insert("top_p".into(), json!(s.top_p));
    body.insert("presence_penalty".into(), json!(s.presence_penalty));
    body.insert("frequency_penalty".into(), json!(s.frequency_penalty));
    if !s.stop.is_empty() {
        body.insert("stop".into(), json!(s.stop));
    }
    if let Some(seed) = s.seed {
        body.insert("seed".into(), json!(seed));
    }
    match kind {
        BackendKind::Vllm | BackendKind::Sglang => {
            body.insert("top_k".into(), json!(s.top_k));
            body.insert("min_p".into(), json!(s.min_p));
            body.insert("repetition_penalty".into(), json!(s.repetition_penalty));
        }
        BackendKind::Llamacpp => {
            // llama.cpp turns top-k off with 0 (llama-cpp-python refuses a negative value) and calls the
            // repetition penalty `repeat_penalty`; its own default is 1.1, so it is always sent.
            body.insert("top_k".into(), json!(s.top_k.max(0)));
            body.insert("min_p".into(), json!(s.min_p));
            body.insert("repeat_penalty".into(), json!(s.repetition_penalty));
        }
        BackendKind::Openai | BackendKind::Replay => {}
    }
    if spec.return_logprobs {
        if chat {
            body.insert("logprobs".into(), json!(true));
            body.insert("top_logprobs".into(), json!(0));
        } else {
            // The completions route takes a count of alternatives; 0 returns the sampled token's alone.
            body.insert("logprobs".into(), json!(0));
        }
    }
    if spec.return_token_ids && kind == BackendKind::Vllm {
        body.insert("return_token_ids".into(), json!(true));
    }
    for (key, value) in &s.extra_body {
        body.insert(key.clone(), value.clone());
    }
    (route, Value::Object(body))
}

/// One streamed chunk, or a whole non-streamed response; unknown fields are ignored.
#[derive(Debug, Default, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<UsageJson>,
    prompt_token_ids: Option<Vec<u32>>,
    error: Option<Value>,
    /// vLLM's error body: `{"object": "error", "message": ...}`.
    object: Option<String>,
    message: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
struct Choice {
    index: Option<u32>,
    delta: Option<MessageJson>,
    message: Option<MessageJson>,
    text: Option<String>,
    token_ids: Option<Vec<u32>>,
    logprobs: Option<LogprobsJson>,
    finish_reason: Option<String>,
    prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Default, Deserialize)]
struct MessageJson {
    content: Option<String>,
    reasoning_content: Option<String>,
    reasoning: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct LogprobsJson {
    content: Option<Vec<TokenLogprob>>,
    token_logprobs: Option<Vec<Option<f64>>>,
}

#[derive(Debug, Deserialize)]
struct TokenLogprob {
    logprob: f64,
}

#[derive(Debug, Default, Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    prompt_tokens_details: Option<PromptDetails>,
    completion_tokens_details: Option<CompletionDetails>,
}

#[derive(Debug, Default, Deserialize)]
struct PromptDetails {
    cached_tokens: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
struct CompletionDetails {
    reasoning_tokens: Option<u64>,
}

/// The completions of one attempt as their chunks arrive.
#[derive(Debug, Default)]
struct Accumulator {
    choices: Vec<CompletionOut>,
    prompt_token_ids: Vec<u32>,
    usage: Option<UsageOut>,
}

impl Accumulator {
    async fn apply(&mut self, chunk: Chunk, now: Instant, sink: &mut DeltaSink) -> Result<(), AttemptError> {
        if chunk.error.is_some() || chunk.object.as_deref() == Some("error") {
            let detail = chunk.error.or(chunk.message).unwrap_or(Value::Null);
            return Err(AttemptError::Broken {
                after_tokens: sink.streamed(),
                message: format!("the backend sent an error event: {}", truncate(&detail.to_string())),
            });
        }
        if let Some(ids) = chunk.prompt_token_ids {
            self.prompt_token_ids = ids;
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(UsageOut {
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                cached_prompt_tokens: usage.prompt_tokens_details.and_then(|d| d.cached_tokens).unwrap_or(0),
                reasoning_tokens: usage.completion_tokens_details.and_then(|d| d.reasoning_tokens).unwrap_or(0),
            });
        }
        for (position, choice) in chunk.choices.into_iter().enumerate() {
            let index = choice.index.unwrap_or(position as u32);
            // A malicious or broken backend must not make the gateway allocate for an absurd index.
            if index as usize > 4096 {
                return Err(AttemptError::Protocol(format!("choice index {index} is out of range")));
            }
            if let Some(ids) = choice.prompt_token_ids
                && self.prompt_token_ids.is_empty()
            {
                self.prompt_token_ids = ids;
            }
            let message = choice.delta.or(choice.message).unwrap_or_default();
            let text = message.content.or(choice.text).unwrap_or_default();
            let reasoning = message.reasoning_content.or(message.reasoning).unwrap_or_default();
            let out = self.choice(index as usize);
            let mut produced = !text.is_empty() || !reasoning.is_empty();
            out.text.push_str(&text);
            out.reasoning.push_str(&reasoning);
            if let Some(ids) = choice.token_ids {
                produced |= !ids.is_empty();
                out.token_ids.extend(ids);
            }
            if let Some(logprobs) = choice.logprobs {
                if let Some(content) = logprobs.content {
                    out.logprobs.extend(content.iter().map(|t| t.logprob));
                }
                if let Some(values) = logprobs.token_logprobs {
                    // The first prompt token of an echoed prompt has no log-probability; none is echoed here.
                    out.logprobs.extend(values.into_iter().map(|v| v.unwrap_or(f64::NAN)));
                }
            }
            if produced {
                out.first_token_at.get_or_insert(now);
            }
            if let Some(reason) = choice.finish_reason {
                out.finish_reason = reason;
                out.finished_at = Some(now);
                out.first_token_at.get_or_insert(now);
            }
            if produced {
                sink.mark_streamed();
                sink.send(Delta { index, text, reasoning }).await;
            }
        }
        Ok(())
    }

    fn choice(&mut self, index: usize) -> &mut CompletionOut {
        if self.choices.len() <= index {
            self.choices.resize_with(index + 1, CompletionOut::default);
        }
        &mut self.choices[index]
    }

    /// The generation, once the response ended: every asked-for choice present and finished.
    fn finish(self, n: u32, streamed: bool) -> Result<Generation, AttemptError> {
        if self.choices.len() < n as usize {
            return Err(if self.choices.is_empty() && !streamed {
                AttemptError::Protocol("the response holds no choices".into())
            } else {
                AttemptError::Broken {
                    after_tokens: streamed,
                    message: format!("the response ended with {} of {n} choices", self.choices.len()),
                }
            });
        }
        if let Some(i) = self.choices.iter().position(|c| c.finish_reason.is_empty()) {
            return Err(AttemptError::Broken {
                after_tokens: streamed,
                message: format!("the response ended before choice {i} finished"),
            });
        }
        Ok(Generation {
            completions: self.choices,
            prompt_token_ids: self.prompt_token_ids,
            usage_reported: self.usage.is_some(),
            usage: self.usage.unwrap_or_default(),
        })
    }
}

/// Reads a server-sent event stream: `data:` lines joined per event, events dispatched at blank lines, `[DONE]`
/// ending the stream.
async fn read_events(
    response: reqwest::Response,
    acc: &mut Accumulator,
    sink: &mut DeltaSink,
) -> Result<(), AttemptError> {
    let mut stream = response.bytes_stream();
    let mut buffer: Vec<u8> = Vec::new();
    let mut data = String::new();
    loop {
        let next = stream.next().await;
        let bytes = match next {
            Some(Ok(bytes)) => bytes,
            Some(Err(error)) => return Err(body_error(&error, sink.streamed())),
            None => break,
        };
        buffer.extend_from_slice(&bytes);
        while let Some(end) = buffer.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            let line = std::str::from_utf8(&line)
                .map_err(|_| AttemptError::Protocol("the event stream is not utf-8".into()))?
                .trim_end_matches(['\n', '\r']);
            if line.is_empty() {
                if dispatch(&mut data, acc, sink).await? {
                    return Ok(());
                }
            } else if let Some(value) = line.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(value.strip_prefix(' ').unwrap_or(value));
            }
            // Comments (`:`), `event:`, `id:` and `retry:` lines carry nothing the API uses.
        }
        if buffer.len() + data.len() > MAX_EVENT_BYTES {
            return Err(AttemptError::Protocol(format!("an event is over {MAX_EVENT_BYTES} bytes")));
        }
    }
    dispatch(&mut data, acc, sink).await?;
    Ok(())
}

/// Applies the pending event; true at `[DONE]`.
async fn dispatch(data: &mut String, acc: &mut Accumulator, sink: &mut DeltaSink) -> Result<bool, AttemptError> {
    if data.is_empty() {
        return Ok(false);
    }
    let event = std::mem::take(data);
    if event.trim() == "[DONE]" {
        return Ok(true);
    }
    let chunk: Chunk = serde_json::from_str(&event)
        .map_err(|e| AttemptError::Protocol(format!("event is not the API's json ({e}): {}", truncate(&event))))?;
    acc.apply(chunk, Instant::now(), sink).await?;
    Ok(false)
}

async fn read_body(response: reqwest::Response, sink: &DeltaSink) -> Result<Vec<u8>, AttemptError> {
    let mut stream = response.bytes_stream();
    let mut body = Vec::new();
    while let Some(next) = stream.next().await {
        let bytes = next.map_err(|e| body_error(&e, sink.streamed()))?;
        body.extend_from_slice(&bytes);
        if body.len() > MAX_EVENT_BYTES {
            return Err(AttemptError::Protocol(format!("the response body is over {MAX_EVENT_BYTES} bytes")));
        }
    }
    Ok(body)
}

fn send_error(error: &reqwest::Error) -> AttemptError {
    if error.is_timeout() { AttemptError::Deadline } else { AttemptError::Connect(describe(error)) }
}

fn body_error(error: &reqwest::Error, after_tokens: bool) -> AttemptError {
    if error.is_timeout() {
        AttemptError::Deadline
    } else {
        AttemptError::Broken { after_tokens, message: describe(error) }
    }
}

/// A reqwest error with its causes, which hold the useful part (`connection refused`).
fn describe(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

async fn error_body(response: reqwest::Response) -> String {
    match response.text().await {
        Ok(text) => truncate(text.trim()),
        Err(error) => format!("(body unreadable: {error})"),
    }
}

fn truncate(text: &str) -> String {
    if text.len() <= ERROR_BODY_BYTES {
        return text.to_owned();
    }
    let mut end = ERROR_BODY_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// `Retry-After` in seconds (the form inference servers and hosted APIs send) or as an HTTP date (RFC 9110: the
/// time until then, nothing for a date already past).
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    value
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
        .or_else(|| value.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0).map(Duration::from_secs_f64))
        .or_else(|| {
            let at = httpdate::parse_http_date(value).ok()?;
            Some(at.duration_since(std::time::SystemTime::now()).unwrap_or_default())
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{Keys, Message, Sampling};

    fn spec(input: Input) -> GenerateSpec {
        GenerateSpec {
            model: "m".into(),
            input,
            sampling: Sampling {
                temperature: 0.7,
                top_p: 0.9,
                top_k: 20,
                min_p: 0.05,
                max_tokens: 64,
                stop: vec!["</s>".into()],
                seed: Some(7),
                n: 2,
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                repetition_penalty: 1.1,
                extra_body: [("chat_template_kwargs".to_owned(), json!({"enable_thinking": false}))]
                    .into_iter()
                    .collect(),
            },
            return_token_ids: true,
            return_logprobs: true,
            keys: Keys::default(),
        }
    }

    #[test]
    fn vllm_chat_body_is_explicit_and_asks_for_token_ids() {
        let chat = Input::Chat(vec![Message { role: "user".into(), content: "hi".into() }]);
        let (route, body) = request_body(BackendKind::Vllm, &spec(chat), "org/model");
        assert_eq!(route, "/chat/completions");
        for (key, value) in [
            ("model", json!("org/model")),
            ("temperature", json!(0.7)),
            ("top_k", json!(20)),
            ("min_p", json!(0.05)),
            ("repetition_penalty", json!(1.1)),
            ("max_tokens", json!(64)),
            ("seed", json!(7)),
            ("n", json!(2)),
            ("logprobs", json!(true)),
            ("return_token_ids", json!(true)),
            ("stream", json!(true)),
            ("chat_template_kwargs", json!({"enable_thinking": false})),
        ] {
            assert_eq!(body[key], value, "{key}");
        }
    }

    #[test]
    fn hosted_chat_gets_only_standard_fields() {
        let chat = Input::Chat(vec![Message { role: "user".into(), content: "hi".into() }]);
        let (_, body) = request_body(BackendKind::Openai, &spec(chat), "gpt");
        for key in ["top_k", "min_p", "repetition_penalty", "return_token_ids", "max_tokens"] {
            assert!(body.get(key).is_none(), "{key} must not be sent to a hosted api");
        }
        assert_eq!(body["max_completion_tokens"], json!(64));
    }

    #[test]
    fn llamacpp_gets_llama_cpps_names_and_top_k_off_as_zero() {
        let chat = Input::Chat(vec![Message { role: "user".into(), content: "hi".into() }]);
        let mut spec = spec(chat);
        spec.sampling.top_k = -1;
        let (route, body) = request_body(BackendKind::Llamacpp, &spec, "smollm2");
        assert_eq!(route, "/chat/completions");
        for (key, value) in [
            ("max_tokens", json!(64)),
            ("top_k", json!(0)),
            ("min_p", json!(0.05)),
            ("repeat_penalty", json!(1.1)),
            ("logprobs", json!(true)),
            ("top_logprobs", json!(0)),
        ] {
            assert_eq!(body[key], value, "{key}");
        }
        for key in ["repetition_penalty", "return_token_ids", "max_completion_tokens"] {
            assert!(body.get(key).is_none(), "{key} is not llama.cpp's");
        }
    }

    #[test]
    fn token_prompts_go_to_the_completions_route() {
        let (route, body) = request_body(BackendKind::Sglang, &spec(Input::PromptTokens(vec![1, 2, 3])), "m");
        assert_eq!(route, "/completions");
        assert_eq!(body["prompt"], json!([1, 2, 3]));
        assert_eq!(body["logprobs"], json!(0));
        assert!(body.get("return_token_ids").is_none());
    }

    #[test]
    fn retry_after_in_seconds_or_as_an_http_date() {
        assert_eq!(parse_retry_after("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_retry_after("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), Some(Duration::ZERO), "a date past");
        let later = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(60));
        let wait = parse_retry_after(&later).expect("an HTTP date");
        assert!(wait > Duration::from_secs(30) && wait <= Duration::from_secs(60), "{wait:?}");
        assert_eq!(parse_retry_after("soon"), None);
        assert_eq!(parse_retry_after("-1"), None);
    }

    #[tokio::test]
    async fn chunks_accumulate_text_ids_logprobs_and_usage() {
        let mut acc = Accumulator::default();
        let mut sink = DeltaSink::new(None);
        let now = Instant::now();
        let first: Chunk = serde_json::from_value(json!({
            "prompt_token_ids": [5, 6],
            "choices": [{"index": 0, "delta": {"reasoning_content": "think"}, "token_ids": [1]}]
        }))
        .expect("chunk");
        acc.apply(first, now, &mut sink).await.expect("applies");
        let second: Chunk = serde_json::from_value(json!({
            "choices": [{"index": 0, "delta": {"content": "answer"}, "token_ids": [2],
                         "logprobs": {"content": [{"token": "a", "logprob": -0.5}]}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}
        }))
        .expect("chunk");
        acc.apply(second, now, &mut sink).await.expect("applies");
        assert!(sink.streamed());
        let generation = acc.finish(1, true).expect("complete");
        let c = &generation.completions[0];
        assert_eq!((c.text.as_str(), c.reasoning.as_str(), c.finish_reason.as_str()), ("answer", "think", "stop"));
        assert_eq!((c.token_ids.clone(), c.logprobs.clone()), (vec![1, 2], vec![-0.5]));
        assert_eq!(generation.prompt_token_ids, vec![5, 6]);
        assert_eq!(generation.usage.cached_prompt_tokens, 1);
    }

    #[tokio::test]
    async fn an_unfinished_response_is_broken_and_an_error_event_fails() {
        let mut acc = Accumulator::default();
        let mut sink = DeltaSink::new(None);
        let chunk: Chunk = serde_json::from_value(json!({"choices": [{"index": 0, "text": "par"}]})).expect("chunk");
        acc.apply(chunk, Instant::now(), &mut sink).await.expect("applies");
        let error = acc.finish(1, sink.streamed()).expect_err("unfinished");
        assert!(matches!(error, AttemptError::Broken { after_tokens: true, .. }), "{error:?}");
        let mut acc = Accumulator::default();
        let event: Chunk = serde_json::from_value(json!({"object": "error", "message": "oom"})).expect("chunk");
        let error = acc.apply(event, Instant::now(), &mut DeltaSink::new(None)).await.expect_err("error event");
        assert!(error.retryable(), "an error before any token may be retried: {error:?}");
    }
}
