//! The gateway over real gRPC in front of a real inference server: llama.cpp's OpenAI-compatible server
//! (llama-cpp-python) serving SmolLM2-135M-Instruct on the CPU, installed by `scripts/setup_model.sh`. Where it is
//! not installed each test says `SKIP:` (a failure under `KFORGE_CI=1`).
//!
//! What a fake server cannot show: a real chat template and tokenizer, real streaming with llama.cpp's chunking,
//! stop sequences and token limits applied by the server, log-probabilities computed by it, what it leaves out
//! (`usage` when streaming, token ids, more than one completion), its one-request-at-a-time queue under 8
//! concurrent callers, and a server process killed mid-answer and started again. Generations are greedy
//! (temperature 0) and short: about 2 minutes for the file on 2 cores, most of it log-probabilities (llama-cpp-python
//! sorts the whole vocabulary in Python for each token, about 50 ms).

mod running;

use std::time::{Duration, Instant};

use kforge_gateway::config::{BackendConfig, BackendKind, GatewayConfig, HealthConfig, PoolConfig, RetryConfig};
use kforge_proto::v1 as pb;
use kforge_test_support::Wait;
use kforge_test_support::model_server::{ModelServer, ModelSetup, ServerOptions};
use running::Gateway;
use tokio_stream::StreamExt;
use tonic::Code;

/// Every call's deadline: a call that hangs fails the test instead.
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A gateway on a loopback port routing `smollm2` to one llama.cpp server; stopped when dropped.
async fn gateway(server: &ModelServer) -> Gateway {
    let config = GatewayConfig {
        pools: vec![PoolConfig {
            model: server.alias().into(),
            backends: vec![BackendConfig { kind: BackendKind::Llamacpp, url: server.url(), ..Default::default() }],
            ..Default::default()
        }],
        retry: RetryConfig { backoff_base_ms: 1, backoff_max_ms: 5, ..RetryConfig::default() },
        health: HealthConfig { interval_ms: 100, timeout_ms: 2000 },
        ..GatewayConfig::default()
    };
    running::start(config).await
}

/// The server and a gateway in front of it, or `None` after a `SKIP:` line.
async fn start() -> Option<(ModelServer, Gateway)> {
    let setup = ModelSetup::find(&root())?;
    let server = setup.start(ServerOptions::default());
    let gateway = gateway(&server).await;
    Some((server, gateway))
}

fn sampling(max_tokens: u32) -> pb::SamplingParams {
    pb::SamplingParams { temperature: Some(0.0), max_tokens: Some(max_tokens), ..Default::default() }
}

fn chat(text: &str, sampling: pb::SamplingParams) -> pb::GenerateRequest {
    pb::GenerateRequest {
        model: "smollm2".into(),
        input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage { role: "user".into(), content: text.into() }],
        })),
        sampling: Some(sampling),
        ..Default::default()
    }
}

fn timed<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(CALL_TIMEOUT);
    request
}

async fn generate(gateway: &mut Gateway, request: pb::GenerateRequest) -> pb::GenerateResponse {
    gateway.client.generate(timed(request)).await.expect("generated").into_inner()
}

/// The deltas' text and the final response of a GenerateStream call, or the status it ended with.
async fn stream(
    gateway: &mut Gateway,
    request: pb::GenerateRequest,
) -> (String, Result<pb::GenerateResponse, tonic::Status>) {
    let mut events = match gateway.client.generate_stream(timed(request)).await {
        Ok(response) => response.into_inner(),
        Err(status) => return (String::new(), Err(status)),
    };
    let mut text = String::new();
    while let Some(event) = events.next().await {
        match event.map(|e| e.event) {
            Ok(Some(pb::generate_stream_response::Event::Delta(delta))) => text.push_str(&delta.text),
            Ok(Some(pb::generate_stream_response::Event::Done(done))) => return (text, Ok(done)),
            Ok(None) => {}
            Err(status) => return (text, Err(status)),
        }
    }
    (text, Err(tonic::Status::internal("the stream ended without its final response")))
}

#[tokio::test]
async fn chat_through_the_gateway_gives_text_finish_reason_logprobs_and_says_what_is_missing() {
    let Some((_server, mut gateway)) = start().await else { return };

    // A token limit the answer reaches: `length`, the limit's count of log-probabilities, one per token.
    let mut request = chat("Write a poem about the sea.", sampling(12));
    request.return_logprobs = true;
    let response = generate(&mut gateway, request).await;
    let completion = &response.completions[0];
    assert_eq!(response.completions.len(), 1);
    assert_eq!(completion.finish_reason, "length", "{completion:?}");
    assert!(!completion.text.is_empty());
    assert_eq!(completion.logprobs.len(), 12, "one log-probability per generated token: {completion:?}");
    assert!(completion.logprobs.iter().all(|lp| lp.is_finite() && *lp <= 0.0), "{:?}", completion.logprobs);
    // llama-cpp-python streams no `usage`: the gateway says so and counts the tokens it saw.
    assert_eq!(response.unsupported, ["usage"], "{response:?}");
    assert_eq!(completion.completion_tokens, 12);
    let usage = response.usage.expect("usage");
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (0, 12), "no prompt count from this server");
    assert!(completion.ttft_ms > 0.0 && completion.ttft_ms <= completion.latency_ms, "{completion:?}");
    assert_eq!((response.attempts, response.replay, response.model.as_str()), (1, false, "smollm2"));

    // Asked for token ids, which this server never gives: named, not an empty list passed off as an answer.
    let mut request = chat("Name a colour.", sampling(4));
    request.return_token_ids = true;
    let response = generate(&mut gateway, request).await;
    assert_eq!(response.unsupported, ["usage", "token_ids", "prompt_token_ids"], "{response:?}");
    assert!(response.completions[0].token_ids.is_empty() && response.prompt_token_ids.is_empty());
    // Without log-probabilities nothing counts the tokens: 0, and `usage` among the unsupported says it is unknown.
    assert_eq!(response.completions[0].completion_tokens, 0);
}

#[tokio::test]
async fn a_stop_sequence_ends_the_answer_before_it_and_a_limit_of_one_gives_one_token() {
    let Some((_server, mut gateway)) = start().await else { return };
    let prompt = "List the numbers from 1 to 30, separated by commas.";
    let free = generate(&mut gateway, chat(prompt, sampling(40))).await.completions.remove(0);
    // A stop sequence taken from the greedy answer itself: the same answer then ends just before it.
    let chars: Vec<char> = free.text.chars().collect();
    assert!(chars.len() >= 8, "a greedy answer long enough to cut: {free:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut_at = free.text.find(&stop).expect("the stop sequence is in the answer");
    let mut with_stop = sampling(40);
    with_stop.stop = vec![stop.clone()];
    let stopped = generate(&mut gateway, chat(prompt, with_stop)).await.completions.remove(0);
    assert_eq!(stopped.finish_reason, "stop", "{stopped:?}");
    assert_eq!(stopped.text, free.text[..cut_at], "the answer up to the stop sequence {stop:?}, without it");

    let mut one = chat(prompt, sampling(1));
    one.return_logprobs = true;
    let one = generate(&mut gateway, one).await.completions.remove(0);
    assert_eq!((one.finish_reason.as_str(), one.logprobs.len()), ("length", 1), "{one:?}");
}

#[tokio::test]
async fn a_streamed_chat_sends_deltas_that_add_up_to_the_final_text() {
    let Some((_server, mut gateway)) = start().await else { return };
    let started = Instant::now();
    let (deltas, done) = stream(&mut gateway, chat("Write a haiku about autumn.", sampling(24))).await;
    let done = done.expect("the stream ends with its response");
    let completion = &done.completions[0];
    assert!(!deltas.is_empty());
    assert_eq!(deltas, completion.text, "the deltas are the text");
    assert!(["stop", "length"].contains(&completion.finish_reason.as_str()), "{completion:?}");
    assert!(completion.ttft_ms < completion.latency_ms, "the first token before the end: {completion:?}");
    assert!(completion.latency_ms <= started.elapsed().as_secs_f64() * 1e3);
    assert_eq!(done.unsupported, ["usage"]);

    // The completions route: a text prompt continued as it is, no chat template.
    let mut request = chat("", sampling(6));
    request.input = Some(pb::generate_request::Input::Prompt("1, 2, 3, 4,".into()));
    request.return_logprobs = true;
    let (deltas, done) = stream(&mut gateway, request).await;
    let done = done.expect("completed");
    assert_eq!(deltas, done.completions[0].text);
    assert!(done.completions[0].text.contains('5'), "greedy counting goes on: {:?}", done.completions[0].text);
    assert_eq!(done.completions[0].logprobs.len(), 6);
}

#[tokio::test]
async fn what_llama_cpp_cannot_do_is_refused_by_name_before_it_reaches_the_server() {
    let Some((server, mut gateway)) = start().await else { return };
    // The server itself answers one choice for any n (llama-cpp-python ignores the field)...
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Say hi."}], "n": 2, "max_tokens": 2, "temperature": 0,
    });
    let direct: serde_json::Value = reqwest::Client::new()
        .post(format!("{}/chat/completions", server.url()))
        .json(&body)
        .send()
        .await
        .expect("the server answers")
        .json()
        .await
        .expect("json");
    assert_eq!(direct["choices"].as_array().map(Vec::len), Some(1), "{direct}");
    // ...so the gateway refuses n > 1 for a llamacpp pool instead of answering one completion of two.
    let mut two = sampling(2);
    two.n = Some(2);
    let error = gateway.client.generate(timed(chat("Say hi.", two))).await.expect_err("n = 2");
    assert_eq!(error.code(), Code::InvalidArgument, "{error:?}");
    assert!(error.message().starts_with("sampling.n: must be 1"), "{}", error.message());
    // Token prompts: llama-cpp-python answers them with a 500, which would be retried; refused instead.
    let mut tokens = chat("", sampling(2));
    tokens.input = Some(pb::generate_request::Input::PromptTokenIds(pb::TokenIds { ids: vec![1, 2, 3] }));
    let error = gateway.client.generate(timed(tokens)).await.expect_err("token prompt");
    assert_eq!(error.code(), Code::InvalidArgument, "{error:?}");
    assert!(error.message().starts_with("prompt_token_ids:"), "{}", error.message());
}

#[tokio::test]
async fn a_seed_makes_sampling_repeatable() {
    let Some((_server, mut gateway)) = start().await else { return };
    let seeded = |seed| {
        let mut s = sampling(16);
        s.temperature = Some(1.0);
        s.seed = Some(seed);
        chat("Invent a name for a cat.", s)
    };
    let first = generate(&mut gateway, seeded(7)).await.completions.remove(0).text;
    let again = generate(&mut gateway, seeded(7)).await.completions.remove(0).text;
    assert_eq!(first, again, "the same seed samples the same tokens");
    let others: Vec<String> = texts_of(&mut gateway, [seeded(8), seeded(9), seeded(10)]).await;
    assert!(others.iter().any(|t| *t != first), "other seeds sample something else: {first:?} vs {others:?}");
}

async fn texts_of(gateway: &mut Gateway, requests: [pb::GenerateRequest; 3]) -> Vec<String> {
    let mut texts = Vec::new();
    for request in requests {
        texts.push(generate(gateway, request).await.completions.remove(0).text);
    }
    texts
}

#[tokio::test]
async fn eight_concurrent_requests_all_finish_through_the_servers_queue() {
    let Some((_server, gateway)) = start().await else { return };
    let started = Instant::now();
    let calls: Vec<_> = (0..8)
        .map(|i| {
            let mut client = gateway.client.clone();
            tokio::spawn(async move {
                let request = chat(&format!("Give me fact number {i} about the moon."), sampling(16));
                if i % 2 == 0 {
                    client.generate(timed(request)).await.map(|r| r.into_inner().completions.remove(0))
                } else {
                    let mut events = client.generate_stream(timed(request)).await?.into_inner();
                    let mut done = None;
                    while let Some(event) = events.next().await {
                        if let Some(pb::generate_stream_response::Event::Done(d)) = event?.event {
                            done = d.completions.into_iter().next();
                        }
                    }
                    done.ok_or_else(|| tonic::Status::internal("no final response"))
                }
            })
        })
        .collect();
    let mut finishes = Vec::new();
    for call in calls {
        let completion = call.await.expect("joined").expect("every request is served");
        assert!(!completion.text.is_empty(), "{completion:?}");
        finishes.push(completion.finish_reason);
    }
    assert!(finishes.iter().all(|f| f == "stop" || f == "length"), "{finishes:?}");
    println!("8 concurrent requests of at most 16 tokens: {:?}", started.elapsed());
    let mut client = gateway.client.clone();
    let models = client.list_models(pb::ListModelsRequest {}).await.expect("listed").into_inner();
    let backend = &models.models[0].backends[0];
    assert_eq!((backend.kind.as_str(), backend.outstanding, backend.healthy), ("llamacpp", 0, true), "{backend:?}");
}

/// Polls ListModels until the backend's routability is `routable` (the gateway's health check every 100 ms).
async fn until_routable(gateway: &mut Gateway, routable: bool) {
    let what = format!("the backend to become {}", if routable { "routable" } else { "unroutable" });
    Wait::new(what)
        .every(Duration::from_millis(20))
        .until(|| {
            let mut client = gateway.client.clone();
            async move {
                let models = client.list_models(pb::ListModelsRequest {}).await.expect("listed").into_inner();
                models.models[0].backends[0].routable == routable
            }
        })
        .await;
}

#[tokio::test]
async fn a_server_killed_mid_answer_fails_the_request_without_a_retry_and_serves_again_once_restarted() {
    let Some((mut server, mut gateway)) = start().await else { return };
    let mut events = gateway
        .client
        .generate_stream(timed(chat("Tell me a very long story about a dragon.", sampling(400))))
        .await
        .expect("the stream starts")
        .into_inner();
    // The first delta: tokens have reached the caller, so the gateway may no longer retry (a retry would send
    // the caller a second answer's tokens after the first's).
    let first = events.next().await.expect("an event").expect("a delta");
    assert!(matches!(first.event, Some(pb::generate_stream_response::Event::Delta(_))), "{first:?}");
    let killed = Instant::now();
    server.kill();
    let end = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match events.next().await {
                Some(Ok(event)) => assert!(
                    !matches!(event.event, Some(pb::generate_stream_response::Event::Done(_))),
                    "a killed server cannot finish the answer"
                ),
                Some(Err(status)) => return status,
                None => panic!("the stream ended without an error"),
            }
        }
    })
    .await
    .expect("the stream fails soon after the kill, never hangs");
    assert_eq!(end.code(), Code::Unavailable, "{end:?}");
    assert!(end.message().contains("after tokens streamed") && end.message().contains("(after 1 attempt)"), "{end:?}");
    println!("failed {:?} after the kill: {}", killed.elapsed(), end.message());

    // While it is down: UNAVAILABLE naming the backend, at once, whichever comes first of the health check
    // (unroutable) and the connection refused on each allowed attempt.
    let down = gateway.client.generate(timed(chat("Hello?", sampling(4)))).await.expect_err("the server is down");
    assert_eq!(down.code(), Code::Unavailable, "{down:?}");
    assert!(down.message().contains(&server.url()), "{down:?}");
    println!("while down: {}", down.message());
    until_routable(&mut gateway, false).await;

    server.restart();
    until_routable(&mut gateway, true).await;
    let response = generate(&mut gateway, chat("Hello again.", sampling(4))).await;
    assert_eq!(response.attempts, 1);
    assert!(!response.completions[0].text.is_empty(), "{response:?}");
}
