//! The gateway over real gRPC in front of fake OpenAI-compatible servers over real HTTP: generation (chat,
//! completions, streaming, token ids, log-probabilities), injected faults and the retry policy, deadlines and
//! cancellation reaching the upstream, routing, control fan-out, replay, bad input and metrics.

mod fake_upstream;
mod running;

use std::time::Duration;

use fake_upstream::{Behavior, FakeUpstream};
use kforge_gateway::config::{
    BackendConfig, BackendKind, GatewayConfig, HealthConfig, Policy, PoolConfig, Price, RetryConfig,
};
use kforge_proto::v1 as pb;
use kforge_proto::v1::gateway_client::GatewayClient;
use kforge_test_support::eventually;
use running::start;
use tokio::sync::oneshot;
use tonic::Code;
use tonic::transport::Channel;

fn vllm(fake: &FakeUpstream) -> BackendConfig {
    BackendConfig { kind: BackendKind::Vllm, url: fake.url(), ..BackendConfig::default() }
}

fn pool(backends: Vec<BackendConfig>, policy: Policy) -> PoolConfig {
    PoolConfig {
        model: "qwen".into(),
        upstream_model: Some("Qwen/Qwen3-8B".into()),
        policy,
        backends,
        ..PoolConfig::default()
    }
}

/// Fast backoff and health checks so that the tests do not wait on production timings.
fn config(pools: Vec<PoolConfig>) -> GatewayConfig {
    GatewayConfig {
        pools,
        retry: RetryConfig { backoff_base_ms: 1, backoff_max_ms: 5, ..RetryConfig::default() },
        health: HealthConfig { interval_ms: 20, timeout_ms: 500 },
        ..GatewayConfig::default()
    }
}

fn chat_request(text: &str) -> pb::GenerateRequest {
    pb::GenerateRequest {
        model: "qwen".into(),
        input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage { role: "user".into(), content: text.into() }],
        })),
        return_token_ids: true,
        return_logprobs: true,
        keys: Some(pb::RequestKeys {
            job_id: "job-1".into(),
            episode_id: "episode-1".into(),
            task_id: "level1/19_ReLU".into(),
            trajectory: 0,
            turn: 0,
        }),
        ..Default::default()
    }
}

fn with_timeout<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(timeout);
    request
}

async fn backend_status(client: &mut GatewayClient<Channel>, url: &str) -> pb::BackendStatus {
    let models = client.list_models(pb::ListModelsRequest {}).await.expect("list").into_inner();
    models.models.into_iter().flat_map(|m| m.backends).find(|b| b.url == url).expect("backend listed")
}

#[tokio::test]
async fn chat_returns_text_reasoning_token_ids_logprobs_and_timings() {
    let fake = FakeUpstream::start().await;
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::Affinity)])).await;
    let mut request = chat_request("write a relu kernel");
    let mut extra = prost_types::Struct::default();
    extra.fields.insert(
        "chat_template_kwargs".into(),
        prost_types::Value {
            kind: Some(prost_types::value::Kind::StructValue(prost_types::Struct {
                fields: [(
                    "enable_thinking".to_owned(),
                    prost_types::Value { kind: Some(prost_types::value::Kind::BoolValue(true)) },
                )]
                .into_iter()
                .collect(),
            })),
        },
    );
    request.sampling = Some(pb::SamplingParams {
        temperature: Some(0.6),
        top_k: Some(20),
        extra_body: Some(extra),
        ..Default::default()
    });
    let response = gateway.client.generate(request).await.expect("generates").into_inner();

    let completion = &response.completions[0];
    assert_eq!(completion.text, "Hello world");
    assert_eq!(completion.reasoning, "Okay, think.");
    assert_eq!(completion.finish_reason, "stop");
    assert_eq!(completion.token_ids, vec![11, 12]);
    assert_eq!(completion.logprobs, vec![-0.25, -0.5]);
    assert_eq!(completion.completion_tokens, 2);
    assert!(completion.ttft_ms > 0.0 && completion.ttft_ms <= completion.latency_ms, "{completion:?}");
    assert_eq!(response.prompt_token_ids, vec![1, 2, 3]);
    let usage = response.usage.expect("usage");
    assert_eq!(
        (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens, usage.reasoning_tokens),
        (3, 2, 1, 1)
    );
    assert_eq!((response.attempts, response.replay, response.backend.as_str()), (1, false, fake.label().as_str()));

    let body = fake.last_body();
    assert_eq!(fake.last_path(), "/v1/chat/completions");
    assert_eq!(body["model"], "Qwen/Qwen3-8B");
    assert_eq!(body["temperature"], 0.6);
    assert_eq!(body["top_k"], 20);
    assert_eq!(body["top_p"], 1.0, "an unset field is sent with the gateway's default");
    assert_eq!(body["max_tokens"], 4096);
    assert_eq!(body["return_token_ids"], true);
    assert_eq!(body["logprobs"], true);
    assert_eq!(body["chat_template_kwargs"]["enable_thinking"], true);
}

#[tokio::test]
async fn token_prompts_use_the_completions_route_and_echo_their_ids() {
    let fake = FakeUpstream::start().await;
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::PowerOfTwo)])).await;
    let request = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::PromptTokenIds(pb::TokenIds { ids: vec![7, 8, 9] })),
        sampling: Some(pb::SamplingParams { n: Some(2), ..Default::default() }),
        ..chat_request("")
    };
    let response = gateway.client.generate(request).await.expect("generates").into_inner();
    assert_eq!(fake.last_path(), "/v1/completions");
    assert_eq!(fake.last_body()["prompt"], serde_json::json!([7, 8, 9]));
    assert_eq!(response.prompt_token_ids, vec![7, 8, 9]);
    assert_eq!(response.completions.len(), 2);
    for completion in &response.completions {
        assert_eq!((completion.text.as_str(), completion.token_ids.clone()), ("Hello world", vec![11, 12]));
        assert_eq!(completion.logprobs, vec![-0.25, -0.5]);
    }
}

#[tokio::test]
async fn token_routes_of_vllm_and_sglang() {
    let (vllm_fake, sglang_fake) = (FakeUpstream::start().await, FakeUpstream::start().await);
    let tokens = |model: &str| pb::GenerateRequest {
        model: model.into(),
        input: Some(pb::generate_request::Input::PromptTokenIds(pb::TokenIds { ids: vec![7, 8, 9] })),
        ..chat_request("")
    };
    let vllm_pool = pool(vec![BackendConfig { token_route: true, ..vllm(&vllm_fake) }], Policy::Affinity);
    let sglang_pool = PoolConfig {
        model: "sglang".into(),
        ..pool(
            vec![BackendConfig { kind: BackendKind::Sglang, token_route: true, ..vllm(&sglang_fake) }],
            Policy::Affinity,
        )
    };
    let mut gateway = start(config(vec![vllm_pool, sglang_pool])).await;

    let response = gateway.client.generate(tokens("qwen")).await.expect("vllm").into_inner();
    assert_eq!(vllm_fake.last_path(), "/inference/v1/generate");
    assert_eq!(vllm_fake.last_body()["token_ids"], serde_json::json!([7, 8, 9]));
    assert_eq!(vllm_fake.last_body()["sampling_params"]["max_tokens"], 4096);
    assert_eq!(response.completions[0].token_ids, vec![11, 12]);

    let response = gateway.client.generate(tokens("sglang")).await.expect("sglang").into_inner();
    assert_eq!(sglang_fake.last_path(), "/generate");
    assert_eq!(sglang_fake.last_body()["input_ids"], serde_json::json!([7, 8, 9]));
    assert_eq!(sglang_fake.last_body()["return_logprob"], true);
    let completion = &response.completions[0];
    assert_eq!((completion.token_ids.clone(), completion.logprobs.clone()), (vec![21, 22], vec![-0.125, -0.75]));
    assert_eq!(response.prompt_token_ids, vec![7, 8, 9]);
    assert_eq!(response.usage.expect("usage").cached_prompt_tokens, 2);
}

#[tokio::test]
async fn a_server_that_does_not_stream_is_read_too() {
    let fake = FakeUpstream::start().await;
    fake.push(Behavior::Json);
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::Affinity)])).await;
    let response = gateway.client.generate(chat_request("hi")).await.expect("generates").into_inner();
    assert_eq!(response.completions[0].text, "Hello world");
    assert_eq!(response.usage.expect("usage").completion_tokens, 2);
}

#[tokio::test]
async fn streaming_sends_deltas_then_the_result() {
    let fake = FakeUpstream::start().await;
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::Affinity)])).await;
    let mut stream = gateway.client.generate_stream(chat_request("hi")).await.expect("stream").into_inner();
    let (mut text, mut reasoning, mut done) = (String::new(), String::new(), None);
    while let Some(event) = stream.message().await.expect("event") {
        match event.event.expect("set") {
            pb::generate_stream_response::Event::Delta(delta) => {
                assert!(done.is_none(), "no delta after the result");
                text.push_str(&delta.text);
                reasoning.push_str(&delta.reasoning);
            }
            pb::generate_stream_response::Event::Done(response) => done = Some(response),
        }
    }
    let done = done.expect("the stream ends with the result");
    assert_eq!((text.as_str(), reasoning.as_str()), ("Hello world", "Okay, think."));
    assert_eq!(done.completions[0].text, text);
}

#[tokio::test]
async fn rate_limits_are_retried_after_their_retry_after() {
    let fake = FakeUpstream::start().await;
    fake.push(Behavior::Status(429, Some("1")));
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::Affinity)])).await;
    let response = gateway.client.generate(chat_request("hi")).await.expect("succeeds on the retry").into_inner();
    assert_eq!((response.attempts, fake.attempts()), (2, 2));

    fake.push(Behavior::Status(429, Some("120")));
    let status = gateway.client.generate(chat_request("hi")).await.expect_err("waits longer than allowed");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains(&fake.label()), "{}", status.message());
    assert_eq!(fake.attempts(), 3, "a Retry-After beyond the limit is not retried");
}

#[tokio::test]
async fn server_errors_stop_at_max_attempts() {
    let fake = FakeUpstream::start().await;
    for _ in 0..5 {
        fake.push(Behavior::Status(500, None));
    }
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::Affinity)])).await;
    let status = gateway.client.generate(chat_request("hi")).await.expect_err("500s");
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains(&fake.label()) && status.message().contains("after 3 attempts"),
        "{}",
        status.message()
    );
    assert_eq!(fake.attempts(), 3, "max_attempts is 3");
}

#[tokio::test]
async fn a_failing_backend_is_retried_on_another() {
    let (bad, good) = (FakeUpstream::start().await, FakeUpstream::start().await);
    for _ in 0..3 {
        bad.push(Behavior::Status(503, None));
    }
    let mut gateway = start(config(vec![pool(vec![vllm(&bad), vllm(&good)], Policy::LeastOutstanding)])).await;
    for _ in 0..3 {
        let response = gateway.client.generate(chat_request("hi")).await.expect("served by the good one").into_inner();
        assert_eq!(response.backend, good.label());
        assert!(response.attempts <= 2, "{}", response.attempts);
    }
}

#[tokio::test]
async fn the_retry_budget_caps_retries_across_requests() {
    let fake = FakeUpstream::start().await;
    for _ in 0..10 {
        fake.push(Behavior::Status(500, None));
    }
    let mut config = config(vec![pool(vec![vllm(&fake)], Policy::Affinity)]);
    config.retry.budget_burst = 1;
    config.retry.budget_ratio = 0.0;
    let mut gateway = start(config).await;
    let first = gateway.client.generate(chat_request("hi")).await.expect_err("500");
    assert!(first.message().contains("after 2 attempts"), "{}", first.message());
    let second = gateway.client.generate(chat_request("hi")).await.expect_err("500");
    assert!(second.message().contains("after 1 attempt"), "{}", second.message());
    assert_eq!(fake.attempts(), 3);
}

#[tokio::test]
async fn a_stream_broken_after_tokens_is_never_retried() {
    let fake = FakeUpstream::start().await;
    let (drop_now, trigger) = oneshot::channel();
    fake.push(Behavior::DropAfterTokens(Some(trigger)));
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::Affinity)])).await;
    let mut stream = gateway.client.generate_stream(chat_request("hi")).await.expect("stream").into_inner();
    let first = stream.message().await.expect("a delta").expect("not ended");
    assert!(matches!(first.event, Some(pb::generate_stream_response::Event::Delta(_))), "{first:?}");
    drop_now.send(()).expect("the fake waits");
    let status = loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without an error"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("after tokens streamed"), "{}", status.message());
    assert_eq!(fake.attempts(), 1);
}

#[tokio::test]
async fn a_stream_broken_before_tokens_is_retried() {
    let fake = FakeUpstream::start().await;
    fake.push(Behavior::DropBeforeTokens);
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::Affinity)])).await;
    let response = gateway.client.generate(chat_request("hi")).await.expect("retried").into_inner();
    assert_eq!((response.attempts, fake.attempts()), (2, 2));
}

#[tokio::test]
async fn garbage_from_upstream_is_internal_and_names_the_backend() {
    let fake = FakeUpstream::start().await;
    fake.push(Behavior::MalformedEvent);
    fake.push(Behavior::Garbage);
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::Affinity)])).await;
    for _ in 0..2 {
        let status = gateway.client.generate(chat_request("hi")).await.expect_err("garbage");
        assert_eq!(status.code(), Code::Internal, "{status:?}");
        assert!(status.message().contains(&fake.label()), "{}", status.message());
    }
    assert_eq!(fake.attempts(), 2, "malformed responses are not retried");
}

#[tokio::test]
async fn a_deadline_aborts_the_upstream_request() {
    let fake = FakeUpstream::start().await;
    let (_release, release) = oneshot::channel();
    let (aborted, upstream_aborted) = oneshot::channel();
    fake.push(Behavior::Hang { release, aborted });
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::Affinity)])).await;
    let status = gateway
        .client
        // Long enough that the request reaches the fake even on a loaded machine, which the test needs.
        .generate(with_timeout(chat_request("hi"), Duration::from_secs(2)))
        .await
        .expect_err("the backend never answers");
    assert!(matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled), "{status:?}");
    tokio::time::timeout(Duration::from_secs(20), upstream_aborted)
        .await
        .expect("the upstream request is aborted")
        .expect("the fake reports it");
    assert_eq!(fake.attempts(), 1, "a deadline is not retried");
}

#[tokio::test]
async fn dropping_a_stream_aborts_the_upstream_request() {
    let fake = FakeUpstream::start().await;
    let (_release, release) = oneshot::channel();
    let (aborted, upstream_aborted) = oneshot::channel();
    fake.push(Behavior::Hang { release, aborted });
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::Affinity)])).await;
    let stream = gateway.client.generate_stream(chat_request("hi")).await.expect("stream").into_inner();
    eventually("the upstream request", || async { fake.attempts() == 1 }).await;
    drop(stream);
    tokio::time::timeout(Duration::from_secs(20), upstream_aborted)
        .await
        .expect("the upstream request is aborted")
        .expect("the fake reports it");
}

#[tokio::test]
async fn the_concurrency_limit_holds_requests_back() {
    let fake = FakeUpstream::start().await;
    let (release_first, first) = oneshot::channel();
    let (release_second, second) = oneshot::channel();
    fake.push(Behavior::Held { release: first });
    fake.push(Behavior::Held { release: second });
    let mut backend = vllm(&fake);
    backend.max_concurrency = 1;
    let mut gateway = start(config(vec![pool(vec![backend], Policy::Affinity)])).await;
    let calls: Vec<_> = (0..2)
        .map(|_| {
            let mut client = gateway.client.clone();
            tokio::spawn(async move { client.generate(chat_request("hi")).await })
        })
        .collect();
    let label = fake.label();
    eventually("both requests at the gateway", || {
        let mut client = gateway.client.clone();
        let label = label.clone();
        async move { backend_status(&mut client, &label).await.outstanding == 2 }
    })
    .await;
    assert_eq!(fake.attempts(), 1, "the second request waits for the slot");
    release_first.send(()).expect("held");
    eventually("the second request upstream", || async { fake.attempts() == 2 }).await;
    release_second.send(()).expect("held");
    for call in calls {
        call.await.expect("joined").expect("served");
    }
    assert_eq!(fake.max_in_flight(), 1);
    assert_eq!(backend_status(&mut gateway.client, &label).await.outstanding, 0);
}

#[tokio::test]
async fn a_backend_going_down_and_coming_back() {
    let (mut flaky, steady) = (FakeUpstream::start().await, FakeUpstream::start().await);
    let mut gateway = start(config(vec![pool(vec![vllm(&flaky), vllm(&steady)], Policy::LeastOutstanding)])).await;
    flaky.stop().await;
    for i in 0..20 {
        let response =
            gateway.client.generate(chat_request(&format!("down {i}"))).await.expect("routed around").into_inner();
        assert_eq!(response.backend, steady.label());
        assert!(response.attempts <= 3);
    }
    assert_eq!(steady.attempts(), 20, "each request reached the live backend once");
    let label = flaky.label();
    eventually("the health check to take it out", || {
        let mut client = gateway.client.clone();
        let label = label.clone();
        async move { !backend_status(&mut client, &label).await.healthy }
    })
    .await;

    flaky.restart().await;
    eventually("the health check to put it back", || {
        let mut client = gateway.client.clone();
        let label = label.clone();
        async move { backend_status(&mut client, &label).await.routable }
    })
    .await;
    for i in 0..40 {
        gateway.client.generate(chat_request(&format!("up {i}"))).await.expect("served");
    }
    assert!(flaky.attempts() > 0, "the recovered backend gets traffic again");
}

#[tokio::test]
async fn a_failing_health_check_takes_a_backend_out_of_routing() {
    let (sick, well) = (FakeUpstream::start().await, FakeUpstream::start().await);
    let mut gateway = start(config(vec![pool(vec![vllm(&sick), vllm(&well)], Policy::LeastOutstanding)])).await;
    sick.set_healthy(false);
    let label = sick.label();
    eventually("the health check to fail", || {
        let mut client = gateway.client.clone();
        let label = label.clone();
        async move { !backend_status(&mut client, &label).await.routable }
    })
    .await;
    for _ in 0..10 {
        let response = gateway.client.generate(chat_request("hi")).await.expect("served").into_inner();
        assert_eq!((response.backend.as_str(), response.attempts), (well.label().as_str(), 1));
    }
    assert_eq!(sick.attempts(), 0, "an unhealthy backend gets no request");
    sick.set_healthy(true);
    eventually("the health check to pass again", || {
        let mut client = gateway.client.clone();
        let label = label.clone();
        async move { backend_status(&mut client, &label).await.routable }
    })
    .await;
}

#[tokio::test]
async fn consecutive_failures_open_the_breaker() {
    let (failing, steady) = (FakeUpstream::start().await, FakeUpstream::start().await);
    for _ in 0..100 {
        failing.push(Behavior::Status(500, None));
    }
    let mut gateway = start(config(vec![pool(vec![vllm(&failing), vllm(&steady)], Policy::LeastOutstanding)])).await;
    let label = failing.label();
    let mut sent = 0;
    while backend_status(&mut gateway.client, &label).await.breaker != "open" {
        let response =
            gateway.client.generate(chat_request("hi")).await.expect("retried on the steady one").into_inner();
        assert_eq!(response.backend, steady.label());
        sent += 1;
        assert!(sent < 200, "the breaker never opened");
    }
    assert_eq!(failing.attempts(), 5, "the default threshold is five consecutive failures");
    for _ in 0..20 {
        let response = gateway.client.generate(chat_request("hi")).await.expect("served").into_inner();
        assert_eq!(response.attempts, 1, "an open breaker keeps requests away");
    }
    assert_eq!(failing.attempts(), 5);
}

#[tokio::test]
async fn mixed_faults_every_request_answers_within_the_retry_policy() {
    let (a, b) = (FakeUpstream::start().await, FakeUpstream::start().await);
    for (i, fake) in [&a, &b].into_iter().enumerate() {
        for j in 0..30 {
            fake.push(match (i + j) % 6 {
                0 => Behavior::Status(500, None),
                1 => Behavior::Status(429, Some("0")),
                2 => Behavior::DropBeforeTokens,
                3 => Behavior::DropAfterTokens(None),
                4 => Behavior::MalformedEvent,
                _ => Behavior::Stream,
            });
        }
    }
    let mut config = config(vec![pool(vec![vllm(&a), vllm(&b)], Policy::PowerOfTwo)]);
    config.retry.budget_burst = 1000;
    let gateway = start(config).await;
    let calls: Vec<_> = (0..40)
        .map(|i| {
            let mut client = gateway.client.clone();
            tokio::spawn(async move { client.generate(chat_request(&format!("request {i}"))).await })
        })
        .collect();
    let (mut ok, mut failed) = (0, 0);
    for call in calls {
        match call.await.expect("joined") {
            Ok(response) => {
                assert!(response.get_ref().attempts <= 3);
                ok += 1;
            }
            Err(status) => {
                assert!(
                    matches!(status.code(), Code::Unavailable | Code::Internal | Code::ResourceExhausted),
                    "{status:?}"
                );
                assert!(status.message().contains("backend http://127.0.0.1:"), "{}", status.message());
                failed += 1;
            }
        }
    }
    assert_eq!(ok + failed, 40, "every request answered");
    assert!(ok > 0);
    assert!(a.attempts() + b.attempts() <= 40 * 3, "{} attempts", a.attempts() + b.attempts());
}

#[tokio::test]
async fn bad_input_is_invalid_argument_naming_the_field() {
    let fake = FakeUpstream::start().await;
    let mut small = pool(vec![vllm(&fake)], Policy::Affinity);
    small.max_prompt_chars = 10;
    let mut gateway = start(config(vec![small])).await;
    let sampling = |s: pb::SamplingParams| pb::GenerateRequest { sampling: Some(s), ..chat_request("hi") };
    let cases = [
        (pb::GenerateRequest { model: "nope".into(), ..chat_request("hi") }, "model"),
        (
            pb::GenerateRequest {
                input: Some(pb::generate_request::Input::Chat(pb::ChatMessages { messages: vec![] })),
                ..chat_request("hi")
            },
            "chat.messages",
        ),
        (
            pb::GenerateRequest {
                input: Some(pb::generate_request::Input::Prompt("x".repeat(11))),
                ..chat_request("")
            },
            "prompt",
        ),
        (sampling(pb::SamplingParams { n: Some(0), ..Default::default() }), "sampling.n"),
        (sampling(pb::SamplingParams { temperature: Some(1e9), ..Default::default() }), "sampling.temperature"),
        (sampling(pb::SamplingParams { max_tokens: Some(u32::MAX), ..Default::default() }), "sampling.max_tokens"),
    ];
    for (request, field) in cases {
        let status = gateway.client.generate(request).await.expect_err("invalid");
        assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
        assert!(status.message().starts_with(field), "{field}: {}", status.message());
    }
    assert_eq!(fake.attempts(), 0, "nothing invalid reaches a backend");
}

#[tokio::test]
async fn episodes_keep_their_backend() {
    let fakes = [FakeUpstream::start().await, FakeUpstream::start().await, FakeUpstream::start().await];
    let mut gateway = start(config(vec![pool(fakes.iter().map(vllm).collect(), Policy::Affinity)])).await;
    let mut homes = std::collections::HashSet::new();
    for episode in 0..12 {
        let mut backend = None;
        for turn in 0..3 {
            let mut request = chat_request("turn");
            let keys = request.keys.as_mut().expect("keys");
            keys.episode_id = format!("episode-{episode}");
            keys.turn = turn;
            let response = gateway.client.generate(request).await.expect("served").into_inner();
            assert_eq!(*backend.get_or_insert(response.backend.clone()), response.backend, "episode {episode} moved");
        }
        homes.insert(backend.expect("served"));
    }
    assert!(homes.len() > 1, "episodes spread over the pool");
}

#[tokio::test]
async fn pause_holds_requests_until_resume() {
    let fake = FakeUpstream::start().await;
    let mut gateway = start(config(vec![pool(vec![vllm(&fake)], Policy::Affinity)])).await;
    let control = |action: pb::ControlAction| pb::ControlBackendsRequest {
        model: "qwen".into(),
        action: action.into(),
        ..Default::default()
    };
    let paused = gateway.client.control_backends(control(pb::ControlAction::Pause)).await.expect("pause").into_inner();
    assert!(paused.results[0].ok, "{:?}", paused.results);
    assert!(backend_status(&mut gateway.client, &fake.label()).await.paused);
    let status = gateway
        .client
        .generate(with_timeout(chat_request("hi"), Duration::from_millis(300)))
        .await
        .expect_err("held while paused");
    assert!(matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled), "{status:?}");
    assert_eq!(fake.attempts(), 0);

    let mut client = gateway.client.clone();
    let waiting = tokio::spawn(async move { client.generate(chat_request("hi")).await });
    gateway.client.control_backends(control(pb::ControlAction::Resume)).await.expect("resume");
    waiting.await.expect("joined").expect("served after resume");
    assert_eq!(fake.control_calls(), vec!["/pause".to_owned(), "/resume".to_owned()]);
}

#[tokio::test]
async fn sleep_wake_and_weight_versions_fan_out_per_kind() {
    let (vllm_fake, sglang_fake) = (FakeUpstream::start().await, FakeUpstream::start().await);
    let sglang = BackendConfig { kind: BackendKind::Sglang, ..vllm(&sglang_fake) };
    let mut gateway = start(config(vec![pool(vec![vllm(&vllm_fake), sglang], Policy::Affinity)])).await;
    let control = |action: pb::ControlAction| pb::ControlBackendsRequest {
        model: "qwen".into(),
        action: action.into(),
        ..Default::default()
    };
    let sleep = pb::ControlBackendsRequest { sleep_level: 2, ..control(pb::ControlAction::Sleep) };
    let results = gateway.client.control_backends(sleep).await.expect("sleep").into_inner().results;
    assert!(results.iter().all(|r| r.ok), "{results:?}");
    assert_eq!(backend_status(&mut gateway.client, &vllm_fake.label()).await.sleep_level, 2);
    gateway.client.control_backends(control(pb::ControlAction::Wake)).await.expect("wake");
    let version =
        pb::ControlBackendsRequest { weight_version: "step-7".into(), ..control(pb::ControlAction::SetWeightVersion) };
    gateway.client.control_backends(version).await.expect("version");
    gateway.client.control_backends(control(pb::ControlAction::ResetPrefixCache)).await.expect("reset");

    assert_eq!(vllm_fake.control_calls(), vec!["/sleep?level=2", "/wake_up", "/reset_prefix_cache"]);
    assert_eq!(
        sglang_fake.control_calls(),
        vec!["/release_memory_occupation", "/resume_memory_occupation", "/update_weight_version", "/flush_cache"]
    );
    let status = backend_status(&mut gateway.client, &vllm_fake.label()).await;
    assert_eq!((status.sleep_level, status.weight_version.as_str(), status.routable), (0, "step-7", true));
    let response = gateway.client.generate(chat_request("hi")).await.expect("served").into_inner();
    assert_eq!(response.weight_version, "step-7");

    let unknown = pb::ControlBackendsRequest { model: "nope".into(), ..control(pb::ControlAction::Pause) };
    let status = gateway.client.control_backends(unknown).await.expect_err("unknown model");
    assert_eq!(status.code(), Code::InvalidArgument);
    let status = gateway.client.control_backends(control(pb::ControlAction::Unspecified)).await.expect_err("no action");
    assert!(status.message().starts_with("action"), "{}", status.message());
}

#[tokio::test]
async fn replay_answers_from_its_file_and_says_so() {
    let dir = std::env::temp_dir().join(format!("kforge-gateway-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("rollouts.jsonl");
    std::fs::write(
        &file,
        r#"{"task_id": "level1/19_ReLU", "trajectory": 0, "turn": 0, "completions": [{"text": "<think>Okay.</think>```python\nclass ModelNew: pass\n```", "token_ids": [4, 5]}], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
"#,
    )
    .expect("write");
    let replay = BackendConfig { kind: BackendKind::Replay, file: Some(file.clone()), ..BackendConfig::default() };
    let mut replay_pool = pool(vec![replay], Policy::Affinity);
    replay_pool.price = Price { input_per_mtok: 1.0, cached_input_per_mtok: None, output_per_mtok: 1.0 };
    let mut gateway = start(config(vec![replay_pool])).await;
    let response = gateway.client.generate(chat_request("anything")).await.expect("recorded").into_inner();
    assert!(response.replay);
    assert_eq!(response.backend, format!("replay:{}", file.display()));
    let completion = &response.completions[0];
    assert_eq!((completion.reasoning.as_str(), completion.token_ids.clone()), ("Okay.", vec![4, 5]));
    assert!(completion.text.starts_with("```python"), "{}", completion.text);
    // 9 prompt and 2 completion tokens at $1 per million each: a replayed answer is priced at its pool's prices.
    let cost = response.usage.expect("usage").cost_usd;
    assert!((cost - 11e-6).abs() < 1e-12, "{cost}");

    let mut missing = chat_request("x");
    missing.keys.as_mut().expect("keys").turn = 5;
    let status = gateway.client.generate(missing).await.expect_err("no record");
    assert_eq!(status.code(), Code::NotFound);
    assert!(status.message().contains("turn 5"), "{}", status.message());
}

#[tokio::test]
async fn metrics_count_tokens_latency_and_cost_per_job() {
    let fake = FakeUpstream::start().await;
    let mut priced = pool(vec![vllm(&fake)], Policy::Affinity);
    priced.price =
        Price { input_per_mtok: 1_000_000.0, cached_input_per_mtok: Some(0.0), output_per_mtok: 1_000_000.0 };
    let mut gateway = start(config(vec![priced])).await;
    let label = fake.label();
    // Every series the request moves is there at 0 before it: `rate` counts increases, not a series' first value.
    let before = reqwest::get(format!("{}/metrics", gateway.addr)).await.expect("scrape").text().await.expect("text");
    for expected in [
        format!(
            "kforge_gateway_tokens_total{{service=\"gateway\",model=\"qwen\",backend=\"{label}\",kind=\"prompt\"}} 0"
        ),
        format!(
            "kforge_gateway_attempts_total{{service=\"gateway\",model=\"qwen\",backend=\"{label}\",outcome=\"ok\"}} 0"
        ),
        format!("kforge_gateway_ttft_seconds_count{{service=\"gateway\",model=\"qwen\",backend=\"{label}\"}} 0"),
        "kforge_gateway_requests_total{service=\"gateway\",model=\"qwen\",code=\"OK\"} 0".to_owned(),
        "kforge_gateway_affinity_total{service=\"gateway\",model=\"qwen\",result=\"hit\"} 0".to_owned(),
    ] {
        assert!(before.contains(&expected), "missing {expected} in\n{before}");
    }
    let response = gateway.client.generate(chat_request("hi")).await.expect("served").into_inner();
    // 3 prompt tokens of which 1 cached (free), 2 completion tokens, at $1 per token.
    assert_eq!(response.usage.expect("usage").cost_usd, 4.0);
    let metrics = reqwest::get(format!("{}/metrics", gateway.addr)).await.expect("scrape").text().await.expect("text");
    for expected in [
        format!(
            "kforge_gateway_tokens_total{{service=\"gateway\",model=\"qwen\",backend=\"{label}\",kind=\"prompt\"}} 3"
        ),
        format!(
            "kforge_gateway_tokens_total{{service=\"gateway\",model=\"qwen\",backend=\"{label}\",kind=\"completion\"}} 2"
        ),
        "kforge_gateway_cost_usd_total{service=\"gateway\",model=\"qwen\",job=\"job-1\"} 4.0".to_owned(),
        format!(
            "kforge_gateway_attempts_total{{service=\"gateway\",model=\"qwen\",backend=\"{label}\",outcome=\"ok\"}} 1"
        ),
        format!("kforge_gateway_ttft_seconds_count{{service=\"gateway\",model=\"qwen\",backend=\"{label}\"}} 1"),
        "kforge_gateway_requests_total{service=\"gateway\",model=\"qwen\",code=\"OK\"} 1".to_owned(),
        "kforge_gateway_affinity_total{service=\"gateway\",model=\"qwen\",result=\"hit\"} 1".to_owned(),
    ] {
        assert!(metrics.contains(&expected), "missing {expected} in\n{metrics}");
    }
}
