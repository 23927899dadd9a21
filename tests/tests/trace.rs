//! One trace follows a call across services: W3C trace context travels in gRPC metadata, and spans reach a real
//! OTLP/gRPC collector (an in-process `TraceService` server) through the exporter configured by OTEL_* variables.
//!
//! This file holds one test on purpose: telemetry is process-global, and the OTEL_* variables must be set before
//! any other thread exists.

#![allow(unsafe_code)]

use kforge::mesh::{MeshConfig, Service};
use kforge_proto::v1 as pb;
use otlp::{Collector, attribute};
use tracing::Instrument;

mod otlp;

#[test]
fn one_trace_spans_the_caller_and_both_services() {
    // SAFETY: no other thread exists yet in this test binary (one test, no runtime).
    let collector_listener = unsafe { otlp::point_exporter_here() };
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async move {
        let (collector, collector_task) = Collector::serve(collector_listener);

        let telemetry = kforge_telemetry::init("kforge-trace-test", "info").expect("telemetry");
        assert!(telemetry.exporting(), "OTEL_EXPORTER_OTLP_ENDPOINT switches export on");

        let mesh = kforge_tests::start(&[Service::Reward, Service::Orchestrator], &MeshConfig::default()).await;
        let client_config = Default::default();
        let reward = kforge_tests::connect(&mesh, Service::Reward, &client_config).await;
        let orchestrator = kforge_tests::connect(&mesh, Service::Orchestrator, &client_config).await;

        let step = tracing::info_span!("trainer.step");
        async {
            let request = pb::ComputeReturnsRequest {
                method: pb::ReturnMethod::Sum.into(),
                gamma: Some(1.0),
                trajectories: vec![pb::TrajectoryValues { trajectory_id: "t".into(), values: vec![1.0, 2.0] }],
            };
            pb::reward_client::RewardClient::new(reward).compute_returns(request).await.expect("returns computed");
            let job = pb::GetJobRequest { job_id: "job-1".into() };
            let status = pb::orchestrator_client::OrchestratorClient::new(orchestrator)
                .get_job(job)
                .await
                .expect_err("no jobs yet");
            assert_eq!(status.code(), tonic::Code::NotFound);
        }
        .instrument(step)
        .await;
        mesh.shutdown().await.expect("mesh drains");

        let telemetry = otlp::flush(telemetry).await;

        let spans = collector.spans();
        let root = spans.iter().find(|s| s.name == "trainer.step").expect("the caller's span reached the collector");
        let server_span = |service: &str, name: &str| {
            spans
                .iter()
                .find(|s| attribute(s, "kforge.service").as_deref() == Some(service) && s.name == name)
                .unwrap_or_else(|| {
                    panic!("no {name} span from {service}: {:?}", spans.iter().map(|s| &s.name).collect::<Vec<_>>())
                })
        };
        let reward_span = server_span("reward", "kforge.v1.Reward/ComputeReturns");
        let orchestrator_span = server_span("orchestrator", "kforge.v1.Orchestrator/GetJob");
        for span in [reward_span, orchestrator_span] {
            assert_eq!(span.trace_id, root.trace_id, "{} continues the caller's trace", span.name);
            assert_eq!(span.parent_span_id, root.span_id, "{} is a child of the caller's span", span.name);
        }
        drop(telemetry);
        collector_task.abort();
    });
}
