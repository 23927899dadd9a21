//! The servers' own token-in-token-out routes, for prompts given as token ids when a backend sets
//! `token_route = true`: vLLM's `/inference/v1/generate` (token ids in, token ids and log-probabilities out,
//! streamed like the OpenAI routes) and SGLang's native `/generate` (`input_ids`, `return_logprob`; one JSON
//! body with `output_ids` and `meta_info.output_token_logprobs`). No chat template and no detokenisation stand
//! between the trainer's tokens and the sampled ones.

use std::time::Instant;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::{AttemptError, CompletionOut, Generation, UsageOut};
use crate::config::BackendKind;
use crate::request::{GenerateSpec, Input};

/// How the route answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Chunks shaped like the OpenAI routes' (vLLM): parsed by the same reader.
    OpenAiChunks,
    /// SGLang's native JSON body.
    SglangNative,
}

/// A request for a token route: the path under the server root, the body and how it answers.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRequest {
    pub path: &'static str,
    pub body: Value,
    pub answer: Answer,
}

/// The token-route request of `spec` for a backend of `kind`; `None` when `spec` has no token prompt or the
/// kind has no such route.
pub fn request(kind: BackendKind, spec: &GenerateSpec, upstream_model: &str) -> Option<TokenRequest> {
    let Input::PromptTokens(ids) = &spec.input else {
        return None;
    };
    let s = &spec.sampling;
    let mut sampling = Map::new();
    sampling.insert("temperature".into(), json!(s.temperature));
    sampling.insert("top_p".into(), json!(s.top_p));
    sampling.insert("top_k".into(), json!(s.top_k));
    sampling.insert("min_p".into(), json!(s.min_p));
    sampling.insert("n".into(), json!(s.n));
    sampling.insert("presence_penalty".into(), json!(s.presence_penalty));
    sampling.insert("frequency_penalty".into(), json!(s.frequency_penalty));
    sampling.insert("repetition_penalty".into(), json!(s.repetition_penalty));
    if !s.stop.is_empty() {
        sampling.insert("stop".into(), json!(s.stop));
    }
    let mut body = Map::new();
    let answer = match kind {
        BackendKind::Vllm => {
            sampling.insert("max_tokens".into(), json!(s.max_tokens));
            if let Some(seed) = s.seed {
                sampling.insert("seed".into(), json!(seed));
            }
            if spec.return_logprobs {
                sampling.insert("logprobs".into(), json!(0));
            }
            body.insert("model".into(), json!(upstream_model));
            body.insert("token_ids".into(), json!(ids));
            body.insert("stream".into(), json!(true));
            body.insert("stream_options".into(), json!({"include_usage": true}));
            Answer::OpenAiChunks
        }
        BackendKind::Sglang => {
            sampling.insert("max_new_tokens".into(), json!(s.max_tokens));
            if let Some(seed) = s.seed {
                sampling.insert("sampling_seed".into(), json!(seed));
            }
            body.insert("input_ids".into(), json!(ids));
            body.insert("return_logprob".into(), json!(spec.return_logprobs));
            body.insert("stream".into(), json!(false));
            Answer::SglangNative
        }
        BackendKind::Openai | BackendKind::Llamacpp | BackendKind::Replay => return None,
    };
    body.insert("sampling_params".into(), Value::Object(sampling));
    for (key, value) in &s.extra_body {
        body.insert(key.clone(), value.clone());
    }
    let path = if answer == Answer::SglangNative { "/generate" } else { "/inference/v1/generate" };
    Some(TokenRequest { path, body: Value::Object(body), answer })
}

#[derive(Debug, Deserialize)]
struct SglangOutput {
    #[serde(default)]
    text: String,
    #[serde(default)]
    output_ids: Vec<u32>,
    meta_info: SglangMeta,
}

#[derive(Debug, Deserialize)]
struct SglangMeta {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    cached_tokens: u64,
    finish_reason: Option<SglangFinish>,
    /// `[logprob, token_id, token_text_or_null]` per generated token.
    #[serde(default)]
    output_token_logprobs: Vec<(Option<f64>, u32, Value)>,
}

#[derive(Debug, Deserialize)]
struct SglangFinish {
    #[serde(rename = "type")]
    kind: String,
}

/// Reads SGLang's native answer: one object for `n = 1`, a list otherwise.
pub fn sglang_generation(body: &[u8], n: u32, at: Instant) -> Result<Generation, AttemptError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| AttemptError::Protocol(format!("the /generate body is not json: {e}")))?;
    let outputs: Vec<SglangOutput> = match value {
        Value::Array(items) => items.into_iter().map(serde_json::from_value).collect::<Result<_, _>>(),
        single => serde_json::from_value(single).map(|one| vec![one]),
    }
    .map_err(|e| AttemptError::Protocol(format!("the /generate body is not sglang's shape: {e}")))?;
    if outputs.len() < n as usize {
        return Err(AttemptError::Protocol(format!("/generate answered {} of {n} completions", outputs.len())));
    }
    let mut usage = UsageOut::default();
    let mut completions = Vec::with_capacity(outputs.len());
    for (i, output) in outputs.into_iter().enumerate() {
        let meta = output.meta_info;
        // Each output of a parallel sample repeats the prompt's counts.
        if i == 0 {
            usage.prompt_tokens = meta.prompt_tokens;
            usage.cached_prompt_tokens = meta.cached_tokens;
        }
        usage.completion_tokens += meta.completion_tokens;
        let token_ids = if output.output_ids.is_empty() {
            meta.output_token_logprobs.iter().map(|(_, id, _)| *id).collect()
        } else {
            output.output_ids
        };
        completions.push(CompletionOut {
            text: output.text,
            reasoning: String::new(),
            finish_reason: meta.finish_reason.map_or_else(|| "stop".to_owned(), |f| f.kind),
            logprobs: meta.output_token_logprobs.iter().map(|(lp, _, _)| lp.unwrap_or(f64::NAN)).collect(),
            completion_tokens: Some(meta.completion_tokens),
            token_ids,
            first_token_at: Some(at),
            finished_at: Some(at),
        });
    }
    Ok(Generation { completions, prompt_token_ids: Vec::new(), usage, usage_reported: true })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{Keys, Sampling};

    fn spec(input: Input) -> GenerateSpec {
        GenerateSpec {
            model: "m".into(),
            input,
            sampling: Sampling {
                temperature: 1.0,
                top_p: 1.0,
                top_k: -1,
                min_p: 0.0,
                max_tokens: 32,
                stop: Vec::new(),
                seed: Some(3),
                n: 1,
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                repetition_penalty: 1.0,
                extra_body: Map::new(),
            },
            return_token_ids: true,
            return_logprobs: true,
            keys: Keys::default(),
        }
    }

    #[test]
    fn routes_and_field_names_per_kind() {
        let tokens = spec(Input::PromptTokens(vec![1, 2]));
        let vllm = request(BackendKind::Vllm, &tokens, "m").expect("vllm has a token route");
        assert_eq!((vllm.path, vllm.answer), ("/inference/v1/generate", Answer::OpenAiChunks));
        assert_eq!(vllm.body["token_ids"], json!([1, 2]));
        assert_eq!(vllm.body["sampling_params"]["max_tokens"], json!(32));
        let sglang = request(BackendKind::Sglang, &tokens, "m").expect("sglang has one");
        assert_eq!((sglang.path, sglang.body["return_logprob"].clone()), ("/generate", json!(true)));
        assert_eq!(sglang.body["sampling_params"]["max_new_tokens"], json!(32));
        assert_eq!(sglang.body["sampling_params"]["sampling_seed"], json!(3));
        assert!(request(BackendKind::Openai, &tokens, "m").is_none());
        assert!(request(BackendKind::Vllm, &spec(Input::Prompt("text".into())), "m").is_none());
    }

    #[test]
    fn sglang_native_answers_are_read() {
        let body = json!({"text": "hi", "output_ids": [5, 6], "meta_info": {
            "prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 1,
            "finish_reason": {"type": "length", "length": 2},
            "output_token_logprobs": [[-0.1, 5, null], [-0.2, 6, null]]}});
        let generation = sglang_generation(body.to_string().as_bytes(), 1, Instant::now()).expect("parsed");
        let c = &generation.completions[0];
        assert_eq!(
            (c.token_ids.clone(), c.logprobs.clone(), c.finish_reason.as_str()),
            (vec![5, 6], vec![-0.1, -0.2], "length")
        );
        assert_eq!(generation.usage.cached_prompt_tokens, 1);
        let error = sglang_generation(b"{\"text\": 1}", 1, Instant::now()).expect_err("wrong shape");
        assert!(matches!(error, AttemptError::Protocol(_)));
    }
}
