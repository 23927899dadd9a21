//! The caller's trace continues into the inference server: the gateway sends a W3C `traceparent` upstream in
//! the caller's trace (vLLM with an OTLP endpoint joins it), so one trace spans the episode's generation too.
//!
//! One test in its own binary on purpose: telemetry is process-global, and the OTEL_* variable that turns it on
//! must be set before any other thread exists.

#![allow(unsafe_code)]

mod fake_upstream;

use fake_upstream::FakeUpstream;
use kforge_gateway::config::{BackendConfig, BackendKind, GatewayConfig, PoolConfig};
use kforge_proto::v1 as pb;
use kforge_proto::v1::gateway_client::GatewayClient;

#[test]
fn the_upstream_request_carries_the_callers_trace() {
    // SAFETY: no other thread exists yet in this test binary (one test, no runtime), so nothing reads the
    // environment concurrently. Nothing listens on port 9 (discard): spans are never flushed (the guard is
    // forgotten below), the variable only turns the OpenTelemetry layer on.
    // A RUST_LOG from the environment would replace the filter below.
    unsafe {
        std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9");
        std::env::remove_var("RUST_LOG");
    }
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        // Spans are info-level: a filter that drops them drops the trace context with them.
        let filter = "warn,kforge_telemetry=info,kforge_gateway=info";
        let telemetry = kforge_telemetry::init("kforge-gateway-trace-test", filter).expect("telemetry");
        assert!(telemetry.exporting());
        std::mem::forget(telemetry);

        let fake = FakeUpstream::start().await;
        let pool = PoolConfig {
            model: "qwen".into(),
            backends: vec![BackendConfig { kind: BackendKind::Vllm, url: fake.url(), ..BackendConfig::default() }],
            ..PoolConfig::default()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = format!("http://{}", listener.local_addr().expect("addr"));
        let config = GatewayConfig { pools: vec![pool], ..GatewayConfig::default() };
        tokio::spawn(kforge_gateway::serve(config, listener, std::future::pending()));
        let mut client = GatewayClient::connect(addr).await.expect("connect");

        let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
        let mut request = tonic::Request::new(pb::GenerateRequest {
            model: "qwen".into(),
            input: Some(pb::generate_request::Input::Prompt("hello".into())),
            ..Default::default()
        });
        request
            .metadata_mut()
            .insert("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01").parse().expect("ascii"));
        client.generate(request).await.expect("served");

        let upstream = fake.last_traceparent().expect("the upstream request carries a traceparent");
        let parts: Vec<&str> = upstream.split('-').collect();
        assert_eq!(parts.len(), 4, "{upstream}");
        assert_eq!(parts[1], trace_id, "the caller's trace continues upstream");
        assert_ne!(parts[2], "00f067aa0ba902b7", "the gateway's own span is the parent, not the caller's");
    });
}
