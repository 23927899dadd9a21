//! The `kforge.v1.Gateway` handlers: validate (INVALID_ARGUMENT naming the field), find the pool, run the
//! dispatch loop, and turn what the backend produced into the wire response (reasoning split, per-completion
//! token counts and timings, usage and cost).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kforge_proto::v1 as pb;
use kforge_proto::v1::gateway_server::Gateway;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::{CancellationToken, DropGuard};
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::accounting::{Accounting, cost_usd};
use crate::backends::{CompletionOut, DeltaSink, Generation, UsageOut};
use crate::config::{BackendKind, GatewayConfig, RetryConfig};
use crate::control::{self, Action};
use crate::dispatch::{self, Served};
use crate::error::{GatewayError, SetupError};
use crate::failures::FailureLog;
use crate::pool::Pool;
use crate::request::{self, GenerateSpec, Input, InvalidField};

/// How often each kind of failed request is logged (`failures.rs`).
const FAILURE_LOG_WINDOW: Duration = Duration::from_secs(60);

/// What the handlers share.
#[derive(Debug)]
struct State {
    pools: HashMap<String, Arc<Pool>>,
    order: Vec<String>,
    retry: RetryConfig,
    accounting: Accounting,
    /// Failed requests, logged one line per kind per minute.
    failures: FailureLog,
    /// Stops the health checks when the last handle goes; the set aborts any that did not stop.
    _stop: DropGuard,
    _health: Mutex<JoinSet<()>>,
}

/// The `kforge.v1.Gateway` implementation. Cheap to clone; the health checks run while a clone lives.
#[derive(Debug, Clone)]
pub struct GatewayService {
    state: Arc<State>,
}

impl GatewayService {
    /// Builds every pool (reading replay files and API keys now) and starts the health checks. Metrics join
    /// `registry`. Must run inside a Tokio runtime.
    pub fn new(config: &GatewayConfig, registry: &mut Registry) -> Result<Self, SetupError> {
        config.validate()?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
            .tcp_nodelay(true)
            .pool_max_idle_per_host(1024)
            .build()
            .map_err(SetupError::HttpClient)?;
        let mut pools = HashMap::new();
        let mut order = Vec::new();
        for pool in &config.pools {
            pools.insert(pool.model.clone(), Arc::new(Pool::new(pool, config, &http)?));
            order.push(pool.model.clone());
        }
        let stop = CancellationToken::new();
        let all: Vec<Arc<Pool>> = order.iter().filter_map(|m| pools.get(m).cloned()).collect();
        let health = crate::health::spawn(&all, &config.health, &stop);
        let accounting = Accounting::register(registry);
        for pool in &all {
            let backends: Vec<String> = pool.backends.iter().map(|b| b.label.clone()).collect();
            accounting.create_pool(
                &pool.config.model,
                &backends,
                pool.config.policy == crate::config::Policy::Affinity,
            );
        }
        Ok(Self {
            state: Arc::new(State {
                pools,
                order,
                retry: config.retry.clone(),
                accounting,
                failures: FailureLog::new(FAILURE_LOG_WINDOW),
                _stop: stop.drop_guard(),
                _health: Mutex::new(health),
            }),
        })
    }

    fn pool(&self, model: &str) -> Result<Arc<Pool>, InvalidField> {
        if model.is_empty() {
            return Err(InvalidField::new("model", "must be set"));
        }
        self.state.pools.get(model).cloned().ok_or_else(|| {
            InvalidField::new("model", format!("unknown model `{model}` (routed: {})", self.state.order.join(", ")))
        })
    }

    fn admit(&self, request: pb::GenerateRequest) -> Result<(Arc<Pool>, GenerateSpec), GatewayError> {
        let pool = self.pool(&request.model)?;
        let spec = request::validate(request, &pool.config)?;
        Ok((pool, spec))
    }

    /// Runs one request to its wire response.
    async fn run(
        &self,
        pool: &Pool,
        spec: &GenerateSpec,
        received: Instant,
        deadline: Option<Instant>,
        sink: &mut DeltaSink,
    ) -> Result<pb::GenerateResponse, GatewayError> {
        let accounting = &self.state.accounting;
        if pool.config.price != crate::config::Price::default() {
            accounting.job_request(&pool.config.model, &spec.keys.job_id);
        }
        let result = dispatch::generate(pool, &self.state.retry, accounting, spec, deadline, sink).await;
        let code = match &result {
            Ok(_) => "OK".to_owned(),
            Err(error) => {
                self.state.failures.failed(&pool.config.model, error);
                kforge_server::code_name(error.code())
            }
        };
        accounting.request(&pool.config.model, &code);
        Ok(respond(pool, spec, result?, received, accounting))
    }
}

/// The wire response of a served request.
fn respond(
    pool: &Pool,
    spec: &GenerateSpec,
    served: Served,
    received: Instant,
    accounting: &Accounting,
) -> pb::GenerateResponse {
    let Served { generation, backend, attempts } = served;
    let unsupported =
        if backend.client.is_replay() { Vec::new() } else { unsupported(spec, backend.kind, &generation) };
    let now = Instant::now();
    let since_received = |at: Option<Instant>| at.unwrap_or(now).saturating_duration_since(received);
    let mut usage: UsageOut = generation.usage;
    let even_share = usage.completion_tokens / generation.completions.len().max(1) as u64;
    let completions: Vec<pb::Completion> = generation
        .completions
        .into_iter()
        .map(|completion| completion_of(completion, spec, pool.config.split_reasoning, even_share, since_received))
        .collect();
    let prompt_token_ids = prompt_token_ids_of(generation.prompt_token_ids, &spec.input);
    count_unreported_tokens(&mut usage, &completions, &prompt_token_ids);
    // A replayed answer is priced like any other: a pool prices what it serves (a recorded run replayed at its
    // model's prices, or the embedded default's example prices).
    let cost = cost_usd(&pool.config.price, &usage);
    let timings: Vec<(f64, f64)> = completions.iter().map(|c| (c.ttft_ms / 1e3, c.latency_ms / 1e3)).collect();
    accounting.served(&pool.config.model, &backend.label, &spec.keys.job_id, &usage, &timings, cost);
    pb::GenerateResponse {
        completions,
        usage: Some(pb::Usage {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            cost_usd: cost,
            cached_prompt_tokens: usage.cached_prompt_tokens,
            reasoning_tokens: usage.reasoning_tokens,
        }),
        backend: backend.label.clone(),
        replay: backend.client.is_replay(),
        weight_version: backend.weight_version(),
        prompt_token_ids: if spec.return_token_ids { prompt_token_ids } else { Vec::new() },
        attempts,
        model: pool.config.model.clone(),
        unsupported,
    }
}

/// One completion on the wire: its reasoning split from its text where the pool asks for that and the backend did
/// not, its token count ([`completion_tokens`], else `even_share` of the usage), its first-token and finish times
/// (`since_received` of each), and token ids and log-probabilities only where the request asked for them.
fn completion_of(
    completion: CompletionOut,
    spec: &GenerateSpec,
    split_reasoning: bool,
    even_share: u64,
    since_received: impl Fn(Option<Instant>) -> Duration,
) -> pb::Completion {
    let completion_tokens = completion_tokens(&completion).unwrap_or(even_share);
    let CompletionOut {
        mut text, mut reasoning, finish_reason, token_ids, logprobs, first_token_at, finished_at, ..
    } = completion;
    if split_reasoning && reasoning.is_empty() {
        let split = kforge_model_text::split_reasoning(&text);
        if split.found {
            (reasoning, text) = (split.reasoning.to_owned(), split.answer.to_owned());
        }
    }
    pb::Completion {
        text,
        reasoning,
        finish_reason,
        token_ids: if spec.return_token_ids { token_ids } else { Vec::new() },
        logprobs: if spec.return_logprobs { logprobs } else { Vec::new() },
        completion_tokens,
        ttft_ms: since_received(first_token_at).as_secs_f64() * 1e3,
        latency_ms: since_received(finished_at).as_secs_f64() * 1e3,
    }
}

/// The tokens a completion generated: the backend's count, else its token ids or log-probabilities counted;
/// `None` when it returned neither.
fn completion_tokens(completion: &CompletionOut) -> Option<u64> {
    match (completion.completion_tokens, completion.token_ids.len(), completion.logprobs.len()) {
        (Some(count), _, _) => Some(count),
        (None, 0, 0) => None,
        (None, 0, logprobs) => Some(logprobs as u64),
        (None, ids, _) => Some(ids as u64),
    }
}

/// The prompt's token ids: the backend's, else those of a prompt given as token ids.
fn prompt_token_ids_of(reported: Vec<u32>, input: &Input) -> Vec<u32> {
    match input {
        Input::PromptTokens(ids) if reported.is_empty() => ids.clone(),
        _ => reported,
    }
}

/// Fills the token counts the backend left at 0 from what it returned: the completions' counts and the prompt's ids.
fn count_unreported_tokens(usage: &mut UsageOut, completions: &[pb::Completion], prompt_token_ids: &[u32]) {
    if usage.completion_tokens == 0 {
        usage.completion_tokens = completions.iter().map(|c| c.completion_tokens).sum();
    }
    if usage.prompt_tokens == 0 {
        usage.prompt_tokens = prompt_token_ids.len() as u64;
    }
}

/// What `spec` asked for that a live backend of `kind` did not give or was not sent (`GenerateResponse.unsupported`).
fn unsupported(spec: &GenerateSpec, kind: BackendKind, generation: &Generation) -> Vec<String> {
    let mut missing = Vec::new();
    if !generation.usage_reported {
        missing.push("usage");
    }
    // A completion that produced nothing has no token to give a log-probability or an id for.
    let produced = |c: &&CompletionOut| !c.text.is_empty() || !c.reasoning.is_empty();
    if spec.return_logprobs && generation.completions.iter().filter(produced).any(|c| c.logprobs.is_empty()) {
        missing.push("logprobs");
    }
    if spec.return_token_ids {
        if generation.completions.iter().filter(produced).any(|c| c.token_ids.is_empty()) {
            missing.push("token_ids");
        }
        if generation.prompt_token_ids.is_empty() && !matches!(spec.input, Input::PromptTokens(_)) {
            missing.push("prompt_token_ids");
        }
    }
    if kind == BackendKind::Openai {
        let s = &spec.sampling;
        for (field, neutral) in [
            ("sampling.top_k", s.top_k == -1),
            ("sampling.min_p", s.min_p == 0.0),
            ("sampling.repetition_penalty", s.repetition_penalty == 1.0),
        ] {
            if !neutral {
                missing.push(field);
            }
        }
    }
    missing.into_iter().map(str::to_owned).collect()
}

/// The caller's deadline from `grpc-timeout`, a little early so the gateway answers DEADLINE_EXCEEDED naming the
/// backend before the server's own timeout drops the call.
fn deadline_of(metadata: &tonic::metadata::MetadataMap, received: Instant) -> Option<Instant> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = digits.parse().ok()?;
    let timeout = match unit {
        "H" => Duration::from_secs(amount.saturating_mul(3600)),
        "M" => Duration::from_secs(amount.saturating_mul(60)),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    };
    let margin = (timeout / 50).min(Duration::from_millis(20));
    Some(received + timeout.saturating_sub(margin))
}

fn span(spec: &GenerateSpec) -> tracing::Span {
    let k = &spec.keys;
    tracing::info_span!("generate", model = %spec.model, job_id = %k.job_id, episode_id = %k.episode_id,
        task_id = %k.task_id, trajectory = k.trajectory, turn = k.turn)
}

/// A response stream that aborts its generation (and so the upstream request) when the caller drops it.
struct GenerationStream {
    events: ReceiverStream<Result<pb::GenerateStreamResponse, Status>>,
    task: JoinHandle<()>,
}

impl Stream for GenerationStream {
    type Item = Result<pb::GenerateStreamResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.events).poll_next(cx)
    }
}

impl Drop for GenerationStream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tonic::async_trait]
impl Gateway for GatewayService {
    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<pb::GenerateResponse>, Status> {
        let received = Instant::now();
        let deadline = deadline_of(request.metadata(), received);
        let (pool, spec) = self.admit(request.into_inner())?;
        let mut sink = DeltaSink::new(None);
        let span = span(&spec);
        let response = self.run(&pool, &spec, received, deadline, &mut sink).instrument(span).await?;
        Ok(Response::new(response))
    }

    type GenerateStreamStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateStreamResponse, Status>> + Send>>;

    async fn generate_stream(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStreamStream>, Status> {
        let received = Instant::now();
        let deadline = deadline_of(request.metadata(), received);
        let (pool, spec) = self.admit(request.into_inner())?;
        let (events, receiver) = mpsc::channel(64);
        let service = self.clone();
        let span = span(&spec);
        let task = tokio::spawn(
            async move {
                let (deltas, mut delta_receiver) = mpsc::channel(64);
                let forward_to = events.clone();
                let forward = async move {
                    while let Some(delta) = delta_receiver.recv().await {
                        let crate::backends::Delta { index, text, reasoning } = delta;
                        let event = pb::GenerateStreamResponse {
                            event: Some(pb::generate_stream_response::Event::Delta(pb::TextDelta {
                                index,
                                text,
                                reasoning,
                            })),
                        };
                        if forward_to.send(Ok(event)).await.is_err() {
                            break;
                        }
                    }
                };
                let run = async {
                    let mut sink = DeltaSink::new(Some(deltas));
                    service.run(&pool, &spec, received, deadline, &mut sink).await
                };
                let (result, ()) = tokio::join!(run, forward);
                let last = result
                    .map(|done| pb::GenerateStreamResponse {
                        event: Some(pb::generate_stream_response::Event::Done(done)),
                    })
                    .map_err(Status::from);
                let _ = events.send(last).await;
            }
            .instrument(span),
        );
        let stream = GenerationStream { events: ReceiverStream::new(receiver), task };
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_models(
        &self,
        _request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let now = Instant::now();
        let models = self
            .state
            .order
            .iter()
            .filter_map(|model| self.state.pools.get(model))
            .map(|pool| pb::ModelPool {
                model: pool.config.model.clone(),
                policy: pool.config.policy.name().into(),
                backends: pool
                    .backends
                    .iter()
                    .map(|b| pb::BackendStatus {
                        url: b.label.clone(),
                        kind: b.kind.name().into(),
                        healthy: b.healthy(),
                        breaker: b.breaker.name(now).into(),
                        outstanding: b.outstanding(),
                        max_concurrency: b.max_concurrency,
                        paused: b.paused(),
                        sleep_level: b.sleep_level(),
                        weight_version: b.weight_version(),
                        routable: b.routable(now),
                    })
                    .collect(),
            })
            .collect();
        Ok(Response::new(pb::ListModelsResponse { models }))
    }

    async fn control_backends(
        &self,
        request: Request<pb::ControlBackendsRequest>,
    ) -> Result<Response<pb::ControlBackendsResponse>, Status> {
        let request = request.into_inner();
        let pool = self.pool(&request.model).map_err(GatewayError::from)?;
        let action = Action::from_request(&request).map_err(GatewayError::from)?;
        tracing::info!(model = %request.model, ?action, "control");
        let results = control::fan_out(&pool, action).await;
        Ok(Response::new(pb::ControlBackendsResponse { results }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_s_tokens_are_the_backend_s_count_else_counted_from_what_it_returned() {
        let counted = CompletionOut { completion_tokens: Some(7), token_ids: vec![1, 2], ..Default::default() };
        assert_eq!(completion_tokens(&counted), Some(7));
        let ids = CompletionOut { token_ids: vec![1, 2], logprobs: vec![-0.1], ..Default::default() };
        assert_eq!(completion_tokens(&ids), Some(2));
        let logprobs = CompletionOut { logprobs: vec![-0.1, -0.2, -0.3], ..Default::default() };
        assert_eq!(completion_tokens(&logprobs), Some(3));
        assert_eq!(completion_tokens(&CompletionOut::default()), None);
    }

    #[test]
    fn a_token_prompt_stands_in_for_prompt_ids_the_backend_did_not_return() {
        let tokens = Input::PromptTokens(vec![5, 6]);
        assert_eq!(prompt_token_ids_of(Vec::new(), &tokens), [5, 6]);
        assert_eq!(prompt_token_ids_of(vec![9], &tokens), [9]);
        assert!(prompt_token_ids_of(Vec::new(), &Input::Prompt("hi".into())).is_empty());
        let mut usage = UsageOut { completion_tokens: 0, prompt_tokens: 4, ..Default::default() };
        let completion = pb::Completion { completion_tokens: 3, ..Default::default() };
        count_unreported_tokens(&mut usage, &[completion.clone(), completion], &[1, 2]);
        assert_eq!((usage.completion_tokens, usage.prompt_tokens), (6, 4));
    }

    #[test]
    fn grpc_timeout_becomes_a_slightly_earlier_deadline() {
        let mut metadata = tonic::metadata::MetadataMap::new();
        let now = Instant::now();
        assert_eq!(deadline_of(&metadata, now), None);
        metadata.insert("grpc-timeout", "2S".parse().expect("ascii"));
        let deadline = deadline_of(&metadata, now).expect("parsed");
        assert_eq!(deadline, now + Duration::from_millis(1980));
        metadata.insert("grpc-timeout", "bogus".parse().expect("ascii"));
        assert_eq!(deadline_of(&metadata, now), None);
    }

    #[test]
    fn what_the_backend_left_out_or_was_not_sent_is_named() {
        let request = pb::GenerateRequest {
            model: "m".into(),
            input: Some(pb::generate_request::Input::Prompt("hi".into())),
            sampling: Some(pb::SamplingParams { top_k: Some(20), ..Default::default() }),
            return_token_ids: true,
            return_logprobs: true,
            ..Default::default()
        };
        let spec = request::validate(request, &crate::config::PoolConfig::default()).expect("valid");
        let answered = CompletionOut { text: "hello".into(), ..Default::default() };
        let bare = Generation { completions: vec![answered.clone()], ..Default::default() };
        assert_eq!(
            unsupported(&spec, BackendKind::Openai, &bare),
            ["usage", "logprobs", "token_ids", "prompt_token_ids", "sampling.top_k"]
        );
        let full = Generation {
            completions: vec![CompletionOut { token_ids: vec![1], logprobs: vec![-0.5], ..answered }],
            prompt_token_ids: vec![7],
            usage_reported: true,
            ..Default::default()
        };
        assert!(unsupported(&spec, BackendKind::Vllm, &full).is_empty());
        // An empty completion has no token to give anything for.
        let empty = Generation { completions: vec![CompletionOut::default()], usage_reported: true, ..full };
        assert!(unsupported(&spec, BackendKind::Vllm, &empty).is_empty());
    }
}
