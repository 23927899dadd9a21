//! One trace per episode: a job's episode is the root of its own trace, each turn a span under it, each call to a
//! peer a span under the turn's, and the peers' own server spans (gateway, evaluator, reward) continue it through
//! the W3C trace context in the calls' metadata. Every span reaches a real OTLP/gRPC collector (an in-process
//! `TraceService` server) through the exporter configured by OTEL_* variables.
//!
//! The services run in this process (as `kforge run` runs them): the gateway on a replay file, the evaluator on the
//! CPU backend with the repository's venv (`scripts/setup.sh --test`), reward and orchestrator. One test in this
//! file on purpose: telemetry is process-global, and the OTEL_* variables must be set before any other thread exists.

#![allow(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use kforge::mesh::{MeshConfig, Service};
use kforge_gateway::config::{BackendConfig, BackendKind, PoolConfig};
use kforge_proto::v1 as pb;
use opentelemetry_proto::tonic::trace::v1::Span;
use otlp::{Collector, attribute};

mod otlp;

const RELU_TASK: &str = include_str!("../../examples/tasks/relu/task.py");
const RELU: &str = include_str!("../../examples/tasks/relu/candidates/cpu_loop.py");

/// The replay file: task `relu`, trajectories 0 and 1, turns 0 and 1, each a kernel in one fenced block.
fn replay_file(dir: &Path) -> PathBuf {
    let text = format!("I wrote ModelNew.\n\n```python\n{RELU}```\n");
    let mut lines = String::new();
    for trajectory in 0..2 {
        for turn in 0..2 {
            let record = serde_json::json!({
                "task_id": "relu", "trajectory": trajectory, "turn": turn, "completions": [{"text": text}],
            });
            lines.push_str(&format!("{record}\n"));
        }
    }
    std::fs::create_dir_all(dir).expect("replay dir");
    let file = dir.join("replay.jsonl");
    std::fs::write(&file, lines).expect("replay written");
    file
}

#[test]
fn each_episode_is_one_trace_across_the_services() {
    let python = kforge_test_support::python::required(&[]);
    // SAFETY: no other thread exists yet in this test binary (one test, no runtime).
    let collector_listener = unsafe { otlp::point_exporter_here() };
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async move {
        let (collector, collector_task) = Collector::serve(collector_listener);
        let telemetry = kforge_telemetry::init("kforge-episode-trace-test", "info").expect("telemetry");
        assert!(telemetry.exporting(), "OTEL_EXPORTER_OTLP_ENDPOINT switches export on");

        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("episode-trace");
        let mut config = MeshConfig::default();
        config.evaluator.python = python;
        config.evaluator.work_dir = dir.join("evaluator");
        kforge::run::evaluator_for_one_job(&mut config, false);
        config.gateway.pools.push(PoolConfig {
            model: "recorded".into(),
            backends: vec![BackendConfig {
                kind: BackendKind::Replay,
                file: Some(replay_file(&dir)),
                ..Default::default()
            }],
            ..Default::default()
        });
        let services = [Service::Gateway, Service::Evaluator, Service::Reward, Service::Orchestrator];
        let mesh = kforge_tests::start(&services, &config).await;
        let channel = kforge_tests::connect(&mesh, Service::Orchestrator, &Default::default()).await;
        let mut orchestrator = pb::orchestrator_client::OrchestratorClient::new(channel);
        let spec = pb::JobSpec {
            kind: pb::JobKind::Evaluation.into(),
            recipe: "kevin".into(),
            task_set: "inline".into(),
            tasks: vec![pb::Task { task_id: "relu".into(), source: RELU_TASK.into() }],
            model: "recorded".into(),
            trajectories_per_task: 2,
            turns: 2,
            backend: pb::Backend::Cpu.into(),
            correctness_trials: 1,
            measure_performance: Some(false),
            ..Default::default()
        };
        let submitted = orchestrator
            .submit_job(pb::SubmitJobRequest { spec: Some(spec), idempotency_key: String::new() })
            .await
            .expect("submitted")
            .into_inner();
        let job = kforge::run::follow(&mut orchestrator, &submitted.job_id, |_| {}).await.expect("watched");
        assert_eq!(job.state(), pb::JobState::Succeeded, "{}", job.error);
        mesh.shutdown().await.expect("mesh drains");

        let telemetry = otlp::flush(telemetry).await;
        let spans = collector.spans();
        let names = || spans.iter().map(|s| s.name.as_str()).collect::<Vec<_>>();

        let episodes: Vec<&Span> = spans.iter().filter(|s| s.name == "episode").collect();
        assert_eq!(episodes.len(), 2, "one episode span per trajectory: {:?}", names());
        let traces: HashSet<&[u8]> = episodes.iter().map(|s| s.trace_id.as_slice()).collect();
        assert_eq!(traces.len(), 2, "each episode is a trace of its own");
        for episode in &episodes {
            assert!(episode.parent_span_id.is_empty(), "an episode is its trace's root");
            assert_eq!(attribute(episode, "job_id").as_deref(), Some(job.job_id.as_str()));
            let in_trace: Vec<&Span> = spans.iter().filter(|s| s.trace_id == episode.trace_id).collect();
            let by_id: HashMap<&[u8], &Span> = in_trace.iter().map(|s| (s.span_id.as_slice(), *s)).collect();
            let turns: Vec<&&Span> = in_trace.iter().filter(|s| s.name == "turn").collect();
            assert_eq!(turns.len(), 2, "a span per turn: {:?}", in_trace.iter().map(|s| &s.name).collect::<Vec<_>>());
            for turn in &turns {
                assert_eq!(turn.parent_span_id, episode.span_id, "a turn is the episode's child");
                // Each call of the turn, and the peer's server span under it.
                for (call, service, server) in [
                    ("Gateway/Generate", "gateway", "kforge.v1.Gateway/Generate"),
                    ("Evaluator/Evaluate", "evaluator", "kforge.v1.Evaluator/Evaluate"),
                    ("Reward/ScoreKernels", "reward", "kforge.v1.Reward/ScoreKernels"),
                    ("Reward/Diagnose", "reward", "kforge.v1.Reward/Diagnose"),
                ] {
                    let client = in_trace
                        .iter()
                        .find(|s| s.name == call && s.parent_span_id == turn.span_id)
                        .unwrap_or_else(|| panic!("no {call} call under a turn: {:?}", names()));
                    let served = in_trace
                        .iter()
                        .find(|s| s.name == server && s.parent_span_id == client.span_id)
                        .unwrap_or_else(|| panic!("no {server} span under the {call} call: {:?}", names()));
                    assert_eq!(attribute(served, "kforge.service").as_deref(), Some(service), "{server}");
                }
            }
            // Nothing of the trace hangs outside it: every span's parent is in the same trace.
            for span in &in_trace {
                assert!(
                    span.parent_span_id.is_empty() || by_id.contains_key(span.parent_span_id.as_slice()),
                    "{} has a parent outside the episode's trace",
                    span.name
                );
            }
        }
        drop(telemetry);
        collector_task.abort();
    });
}
