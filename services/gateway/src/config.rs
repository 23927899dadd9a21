//! The `[gateway]` table: model pools, their backends, sampling defaults, limits and prices, and the retry,
//! breaker and health-check policies every pool shares. Checked once at start-up by [`GatewayConfig::validate`],
//! so a pool without backends or a replay backend without a file fails before anything serves.

use std::path::PathBuf;

use kforge_server::{ServerConfig, ServiceConfig};
use serde::{Deserialize, Serialize};

/// Configuration of the Gateway service (`[gateway]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    pub server: ServerConfig,
    /// One pool per routed model (`[[gateway.pools]]`).
    pub pools: Vec<PoolConfig>,
    /// Retries of failed upstream attempts (`[gateway.retry]`).
    pub retry: RetryConfig,
    /// Circuit breaker of each backend (`[gateway.breaker]`).
    pub breaker: BreakerConfig,
    /// Active health checks (`[gateway.health]`).
    pub health: HealthConfig,
    /// TCP connect timeout to a backend, in milliseconds. Default 2000.
    pub connect_timeout_ms: u64,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            server: ServerConfig::listening_on(([127, 0, 0, 1], 50054).into()),
            pools: Vec::new(),
            retry: RetryConfig::default(),
            breaker: BreakerConfig::default(),
            health: HealthConfig::default(),
            connect_timeout_ms: 2000,
        }
    }
}

impl ServiceConfig for GatewayConfig {
    const SECTION: &'static str = "gateway";
    fn server(&self) -> &ServerConfig {
        &self.server
    }
}

/// How a pool picks a backend for a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// The routable backend with the fewest requests in flight.
    LeastOutstanding,
    /// Two routable backends at random; the one with fewer requests in flight.
    PowerOfTwo,
    /// Consistent hashing of the episode with bounded load: an episode's turns go to one backend (its prefix
    /// cache) unless that backend is unroutable or over its load bound; requests without an episode fall back to
    /// power of two choices.
    #[default]
    Affinity,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Self::LeastOutstanding => "least_outstanding",
            Self::PowerOfTwo => "power_of_two",
            Self::Affinity => "affinity",
        }
    }
}

/// What serves a backend's requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// vLLM's OpenAI-compatible server: extra sampling fields, `return_token_ids`, sleep/wake/pause routes.
    #[default]
    Vllm,
    /// SGLang's OpenAI-compatible server: extra sampling fields, memory release/resume, cache flush, weights.
    Sglang,
    /// A hosted OpenAI-compatible API: only the standard fields are sent; no control routes.
    Openai,
    /// llama.cpp's OpenAI-compatible server (llama-cpp-python's `python -m llama_cpp.server`, or llama.cpp's
    /// `llama-server`): llama.cpp's names for the extra sampling fields (`repeat_penalty`), one completion per
    /// request, text prompts only; `/health`, where a 404 counts as healthy; no control routes.
    Llamacpp,
    /// Recorded responses from a JSONL file, keyed by (task, trajectory, turn).
    Replay,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
            Self::Openai => "openai",
            Self::Llamacpp => "llamacpp",
            Self::Replay => "replay",
        }
    }

    /// The health route checked when none is configured; hosted APIs get none (passive checks only). llama.cpp:
    /// `llama-server`'s `/health`; llama-cpp-python's server has none and its 404 counts as healthy
    /// (`OpenAiBackend::check_health`).
    fn default_health_path(self) -> Option<&'static str> {
        match self {
            Self::Vllm | Self::Sglang | Self::Llamacpp => Some("/health"),
            Self::Openai | Self::Replay => None,
        }
    }
}

/// One backend of a pool (`[[gateway.pools.backends]]`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackendConfig {
    pub kind: BackendKind,
    /// OpenAI base URL, as an OpenAI client takes it: `http://host:8000/v1`; a URL without a path gets `/v1`.
    /// Control and health routes go to the server root (the URL without `/v1`).
    pub url: String,
    /// For `replay`: the JSONL file of recorded responses.
    pub file: Option<PathBuf>,
    /// Environment variable holding the API key, sent as `Authorization: Bearer <key>`.
    pub api_key_env: Option<String>,
    /// File holding the API key (a mounted secret); wins over `api_key_env`.
    pub api_key_file: Option<PathBuf>,
    /// Requests in flight at most; more wait for a slot. 0: unlimited. Default 0.
    pub max_concurrency: u32,
    /// Route of the active health check (a 2xx is healthy; for llama.cpp a 404 too). Default `/health` for vLLM,
    /// SGLang and llama.cpp, none for hosted APIs; `""` turns the check off.
    pub health_path: Option<String>,
    /// Prompts given as token ids use the server's token-in-token-out route (vLLM `/inference/v1/generate`,
    /// SGLang `/generate` with `input_ids` and `return_logprob`) instead of `/v1/completions`. Default false.
    pub token_route: bool,
}

impl BackendConfig {
    /// The health route to check, if any.
    pub fn health_path(&self) -> Option<&str> {
        match &self.health_path {
            Some(path) if path.is_empty() => None,
            Some(path) => Some(path.as_str()),
            None => self.kind.default_health_path(),
        }
    }

    /// The backend's name on responses, metrics and logs: its URL, or `replay:<file>`.
    pub fn label(&self) -> String {
        match (self.kind, &self.file) {
            (BackendKind::Replay, Some(file)) => format!("replay:{}", file.display()),
            (BackendKind::Replay, None) => "replay:".to_owned(),
            _ => self.url.trim_end_matches('/').to_owned(),
        }
    }
}

/// One routed model (`[[gateway.pools]]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// The model name callers use. Required, unique.
    pub model: String,
    /// The `model` field sent upstream; default: `model`.
    pub upstream_model: Option<String>,
    pub policy: Policy,
    pub backends: Vec<BackendConfig>,
    /// Defaults of every sampling field a request leaves unset (`[gateway.pools.sampling]`).
    pub sampling: SamplingDefaults,
    /// Largest prompt, in characters (chat: all messages' contents). Default 1,000,000.
    pub max_prompt_chars: usize,
    /// Largest prompt given as token ids. Default 131,072.
    pub max_prompt_tokens: usize,
    /// Largest `max_tokens` a request may ask for. Default 131,072.
    pub max_tokens_limit: u32,
    /// Largest `n`. Default 64.
    pub max_n: u32,
    /// Split a leading `<think>` block out of the text when the backend does not separate reasoning. Default
    /// true.
    pub split_reasoning: bool,
    /// Bounded-load factor of affinity routing: a backend takes an episode's turns while its requests in flight
    /// stay under `max(affinity_min_load, factor * average)`. Default 1.25.
    pub affinity_load_factor: f64,
    /// See `affinity_load_factor`: below this many requests in flight a backend never spills an episode.
    /// Default 16 (an inference server batches far more than this).
    pub affinity_min_load: u32,
    /// Prices in US dollars per million tokens (`[gateway.pools.price]`); zero: unpriced.
    pub price: Price,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            model: String::new(),
            upstream_model: None,
            policy: Policy::default(),
            backends: Vec::new(),
            sampling: SamplingDefaults::default(),
            max_prompt_chars: 1_000_000,
            max_prompt_tokens: 131_072,
            max_tokens_limit: 131_072,
            max_n: 64,
            split_reasoning: true,
            affinity_load_factor: 1.25,
            affinity_min_load: 16,
            price: Price::default(),
        }
    }
}

/// Sampling values a request leaves unset. The documented defaults are the OpenAI API's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingDefaults {
    pub temperature: f64,
    pub top_p: f64,
    /// -1: off.
    pub top_k: i32,
    pub min_p: f64,
    pub max_tokens: u32,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    pub repetition_penalty: f64,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            max_tokens: 4096,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

/// Prices in US dollars per million tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Price {
    pub input_per_mtok: f64,
    /// Prompt tokens served from the backend's cache; default: `input_per_mtok`.
    pub cached_input_per_mtok: Option<f64>,
    pub output_per_mtok: f64,
}

/// Retries of failed upstream attempts: connection failures, 408, 429 and 5xx, never after tokens streamed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Upstream attempts per request at most, the first included. Default 3.
    pub max_attempts: u32,
    /// Retries earned per request: over time at most this fraction of requests are retried. Default 0.2.
    pub budget_ratio: f64,
    /// Retries allowed before any were earned, and the most that can be saved up. Default 20.
    pub budget_burst: u32,
    /// First backoff, in milliseconds; it doubles per retry, with full jitter. Default 25.
    pub backoff_base_ms: u64,
    /// Largest backoff, in milliseconds. Default 1000.
    pub backoff_max_ms: u64,
    /// Longest `Retry-After` the gateway waits for, in seconds; longer ones fail the request. Default 30.
    pub max_retry_after_secs: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            budget_ratio: 0.2,
            budget_burst: 20,
            backoff_base_ms: 25,
            backoff_max_ms: 1000,
            max_retry_after_secs: 30,
        }
    }
}

/// The circuit breaker of each backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive failed attempts that open the breaker. Default 5.
    pub failure_threshold: u32,
    /// How long an open breaker rejects before it lets one probe through, in milliseconds. Default 5000.
    pub open_ms: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self { failure_threshold: 5, open_ms: 5000 }
    }
}

/// Active health checks of backends that have a health route.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Time between checks of one backend, in milliseconds. Default 2000.
    pub interval_ms: u64,
    /// Time a check may take, in milliseconds. Default 1000.
    pub timeout_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self { interval_ms: 2000, timeout_ms: 1000 }
    }
}

/// What [`GatewayConfig::validate`] found wrong; each names the setting (`pools[i].backends[j].url`) and the value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("pools[{pool}].model must be set")]
    ModelUnset { pool: usize },
    #[error("pools[{pool}].model `{model}` names two pools")]
    ModelTwice { pool: usize, model: String },
    #[error("pools[{pool}].backends: pool `{model}` has no backend")]
    NoBackend { pool: usize, model: String },
    #[error("pools[{pool}].affinity_load_factor must be >= 1, got {got}")]
    AffinityLoadFactor { pool: usize, got: f64 },
    #[error("pools[{pool}]: max_n and max_tokens_limit must be > 0")]
    ZeroLimit { pool: usize },
    #[error("pools[{pool}].backends[{backend}].file must name the replay JSONL file")]
    ReplayFileUnset { pool: usize, backend: usize },
    #[error("pools[{pool}].backends[{backend}].url must be an http(s) URL, got {url:?}")]
    NotHttpUrl { pool: usize, backend: usize, url: String },
    #[error("retry.max_attempts must be >= 1")]
    NoAttempts,
    #[error("retry.budget_ratio must be >= 0, got {got}")]
    BudgetRatio { got: f64 },
    #[error("breaker.failure_threshold must be >= 1")]
    BreakerThreshold,
    #[error("health.interval_ms and health.timeout_ms must be > 0")]
    HealthInterval,
}

impl GatewayConfig {
    /// Checks what serde cannot: names present and unique, backends complete, limits and factors sensible.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut seen = std::collections::HashSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            if pool.model.is_empty() {
                return Err(ConfigError::ModelUnset { pool: i });
            }
            if !seen.insert(pool.model.as_str()) {
                return Err(ConfigError::ModelTwice { pool: i, model: pool.model.clone() });
            }
            if pool.backends.is_empty() {
                return Err(ConfigError::NoBackend { pool: i, model: pool.model.clone() });
            }
            if !(pool.affinity_load_factor.is_finite() && pool.affinity_load_factor >= 1.0) {
                return Err(ConfigError::AffinityLoadFactor { pool: i, got: pool.affinity_load_factor });
            }
            if pool.max_n == 0 || pool.max_tokens_limit == 0 {
                return Err(ConfigError::ZeroLimit { pool: i });
            }
            for (j, backend) in pool.backends.iter().enumerate() {
                match backend.kind {
                    BackendKind::Replay => {
                        if backend.file.is_none() {
                            return Err(ConfigError::ReplayFileUnset { pool: i, backend: j });
                        }
                    }
                    BackendKind::Vllm | BackendKind::Sglang | BackendKind::Openai | BackendKind::Llamacpp => {
                        if !(backend.url.starts_with("http://") || backend.url.starts_with("https://")) {
                            return Err(ConfigError::NotHttpUrl { pool: i, backend: j, url: backend.url.clone() });
                        }
                    }
                }
            }
        }
        if self.retry.max_attempts == 0 {
            return Err(ConfigError::NoAttempts);
        }
        if !(self.retry.budget_ratio.is_finite() && self.retry.budget_ratio >= 0.0) {
            return Err(ConfigError::BudgetRatio { got: self.retry.budget_ratio });
        }
        if self.breaker.failure_threshold == 0 {
            return Err(ConfigError::BreakerThreshold);
        }
        if self.health.interval_ms == 0 || self.health.timeout_ms == 0 {
            return Err(ConfigError::HealthInterval);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_setting_and_the_value() {
        let pool = |backends| PoolConfig { model: "m".into(), backends, ..Default::default() };
        let config = |pools| GatewayConfig { pools, ..Default::default() };
        let replay = BackendConfig { kind: BackendKind::Replay, ..Default::default() };
        let error = config(vec![pool(vec![replay])]).validate().expect_err("no file");
        assert_eq!(error, ConfigError::ReplayFileUnset { pool: 0, backend: 0 });
        assert_eq!(error.to_string(), "pools[0].backends[0].file must name the replay JSONL file");
        let bare = BackendConfig { url: "localhost:8000".into(), ..Default::default() };
        let error = config(vec![pool(vec![bare])]).validate().expect_err("no scheme");
        assert_eq!(error.to_string(), "pools[0].backends[0].url must be an http(s) URL, got \"localhost:8000\"");
        let http = BackendConfig { url: "http://localhost:8000".into(), ..Default::default() };
        let error = config(vec![pool(vec![http.clone()]), pool(vec![http])]).validate().expect_err("twice");
        assert_eq!(error.to_string(), "pools[1].model `m` names two pools");
    }
}
