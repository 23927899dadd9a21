//! The backends a pool routes to, and what one upstream attempt produces or how it fails.
//!
//! [`openai`] speaks the OpenAI-compatible HTTP API of vLLM, SGLang and hosted services; [`replay`] answers from
//! a recorded JSONL file. An attempt reports its text as it arrives through a [`DeltaSink`] (which also records
//! whether any token arrived: a failure after that is never retried) and ends with a [`Generation`] or an
//! [`AttemptError`] that says whether a retry may help and whether the backend is to blame. A backend that cannot
//! be built from its configuration (an API key or a replay file that cannot be read) is a [`BackendError`].

pub mod openai;
pub mod replay;
pub mod token_route;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::request::GenerateSpec;

/// One completion as the backend produced it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompletionOut {
    pub text: String,
    pub reasoning: String,
    pub finish_reason: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<f64>,
    /// Tokens generated, when the backend counted them for this completion.
    pub completion_tokens: Option<u64>,
    pub first_token_at: Option<Instant>,
    pub finished_at: Option<Instant>,
}

/// Token counts as the backend reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsageOut {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub reasoning_tokens: u64,
}

/// What one successful attempt produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Generation {
    pub completions: Vec<CompletionOut>,
    pub prompt_token_ids: Vec<u32>,
    pub usage: UsageOut,
    /// Whether the backend reported `usage` at all (llama-cpp-python's server streams none): without it the counts
    /// are the gateway's own, and the response says so.
    pub usage_reported: bool,
}

/// New text of one completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    pub index: u32,
    pub text: String,
    pub reasoning: String,
}

/// Where an attempt reports text as it arrives: forwarded to a streaming caller, or only noted.
#[derive(Debug)]
pub struct DeltaSink {
    forward: Option<mpsc::Sender<Delta>>,
    streamed: bool,
}

impl DeltaSink {
    /// A sink that forwards deltas to `forward` (a streaming caller) or only notes that tokens arrived.
    pub fn new(forward: Option<mpsc::Sender<Delta>>) -> Self {
        Self { forward, streamed: false }
    }

    /// Reports new text; empty deltas are dropped. A caller that went away is not an error here: its request is
    /// being dropped and the attempt with it.
    pub async fn send(&mut self, delta: Delta) {
        if delta.text.is_empty() && delta.reasoning.is_empty() {
            return;
        }
        self.streamed = true;
        if let Some(forward) = &self.forward {
            let _ = forward.send(delta).await;
        }
    }

    /// Notes that tokens arrived without text to forward (token ids only).
    pub fn mark_streamed(&mut self) {
        self.streamed = true;
    }

    /// Whether any token arrived; after that an attempt is never retried.
    pub fn streamed(&self) -> bool {
        self.streamed
    }
}

/// Why a backend could not be built from its configuration; read at start-up, so the gateway does not start.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("a replay backend needs `file`")]
    ReplayFileUnset,
    #[error("replay file {}: {source}", .path.display())]
    ReplayRead { path: PathBuf, source: std::io::Error },
    #[error("replay file {} line {line}: {source}", .path.display())]
    ReplayLine { path: PathBuf, line: usize, source: serde_json::Error },
    #[error("replay file {} line {line}: no completions", .path.display())]
    ReplayNoCompletions { path: PathBuf, line: usize },
    #[error(
        "replay file {} line {line}: task {task_id:?}, trajectory {trajectory}, turn {turn} is recorded twice",
        .path.display()
    )]
    ReplayDuplicate { path: PathBuf, line: usize, task_id: String, trajectory: u32, turn: u32 },
    #[error("api key file {} of {url}: {source}", .path.display())]
    ApiKeyFile { path: PathBuf, url: String, source: std::io::Error },
    #[error("api key variable {variable} of {url} is not set")]
    ApiKeyUnset { variable: String, url: String },
    #[error("the api key of {url} is empty")]
    ApiKeyEmpty { url: String },
}

/// Why one upstream attempt failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AttemptError {
    /// No connection (refused, reset before a response, DNS, TLS).
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The attempt ran past the request's deadline.
    #[error("no response before the deadline")]
    Deadline,
    /// The backend answered with an HTTP error status.
    #[error("http {status}: {body}")]
    Status { status: u16, retry_after: Option<Duration>, body: String },
    /// The connection broke while the response was being read.
    #[error("connection broke mid-response{}: {message}", if *.after_tokens { " after tokens streamed" } else { "" })]
    Broken { after_tokens: bool, message: String },
    /// The response was not what the API promises (malformed JSON, a missing field, an error event).
    #[error("malformed response: {0}")]
    Protocol(String),
    /// A replay file has no record for the request's keys.
    #[error("no recorded response for task {task_id:?}, trajectory {trajectory}, turn {turn}")]
    NoRecord { task_id: String, trajectory: u32, turn: u32 },
    /// A replay record holds fewer completions than asked for.
    #[error("the record holds {recorded} completions, the request asks for {asked}")]
    TooFewRecorded { recorded: usize, asked: u32 },
}

impl AttemptError {
    /// Whether another attempt may succeed: connection failures, 408, 429 and 5xx, and a connection that broke
    /// before any token; never once tokens have streamed.
    pub fn retryable(&self) -> bool {
        match self {
            Self::Connect(_) => true,
            Self::Status { status, .. } => matches!(status, 408 | 429 | 500..=599),
            Self::Broken { after_tokens, .. } => !after_tokens,
            Self::Deadline | Self::Protocol(_) | Self::NoRecord { .. } | Self::TooFewRecorded { .. } => false,
        }
    }

    /// Whether the failure counts against the backend's circuit breaker. A 429 is the backend asking for
    /// patience (its Retry-After is honoured instead), and other 4xx are the request's fault.
    pub fn backend_fault(&self) -> bool {
        match self {
            Self::Connect(_) | Self::Deadline | Self::Broken { .. } | Self::Protocol(_) => true,
            Self::Status { status, .. } => *status >= 500,
            Self::NoRecord { .. } | Self::TooFewRecorded { .. } => false,
        }
    }

    /// The error class on metrics.
    pub fn class(&self) -> &'static str {
        match self {
            Self::Connect(_) => "connect",
            Self::Deadline => "deadline",
            Self::Status { status: 429, .. } => "rate_limited",
            Self::Status { status: 408, .. } => "upstream_timeout",
            Self::Status { status: 500..=599, .. } => "server_error",
            Self::Status { .. } => "client_error",
            Self::Broken { .. } => "broken_stream",
            Self::Protocol(_) => "malformed",
            Self::NoRecord { .. } | Self::TooFewRecorded { .. } => "replay_miss",
        }
    }
}

/// A backend's way of serving one attempt.
#[derive(Debug)]
pub enum BackendClient {
    OpenAi(openai::OpenAiBackend),
    Replay(replay::ReplayBackend),
}

impl BackendClient {
    /// One upstream attempt for `spec`, bounded by `deadline`.
    pub async fn generate(
        &self,
        spec: &GenerateSpec,
        upstream_model: &str,
        deadline: Option<Instant>,
        sink: &mut DeltaSink,
    ) -> Result<Generation, AttemptError> {
        match self {
            Self::OpenAi(backend) => backend.generate(spec, upstream_model, deadline, sink).await,
            Self::Replay(backend) => backend.generate(spec, sink).await,
        }
    }

    pub fn is_replay(&self) -> bool {
        matches!(self, Self::Replay(_))
    }
}
