//! The Evaluator service through its generated client, served in-process on an ephemeral port on the CPU backend
//! with a real PyTorch: idempotency keys and `EvaluateStream`.
//!
//! Needs the Python environment that `scripts/setup.sh --test` creates (`.venv` with torch): without it each test
//! says `SKIP:` (and fails under `KFORGE_CI=1`).

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kforge_evaluator::EvaluatorConfig;
use kforge_proto::v1 as pb;
use kforge_proto::v1::evaluator_client::EvaluatorClient;
use kforge_server::client::{self, Channel, ClientConfig};
use tokio::net::TcpListener;
use tokio_stream::wrappers::ReceiverStream;

const TASK: &str = include_str!("../../../examples/tasks/relu/task.py");
/// Correct without building an extension: the cheapest real evaluation.
const TORCH_RELU: &str = include_str!("fixtures/torch_relu.py");

/// The tests' configuration; `None` (a skip) without the Python environment.
fn config(work_dir: &str) -> Option<EvaluatorConfig> {
    let python = support::python()?;
    Some(EvaluatorConfig {
        python,
        work_dir: PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(work_dir),
        // torch.compile on a CPU needs minutes per task; these tests check the service, not the baselines.
        baseline_torch_compile: false,
        // Each test is a process of its own: a header build started by a short test would die with it, half done.
        bindings_pch: false,
        ..EvaluatorConfig::default()
    })
}

/// The service, served in this process until [`Served::stop`].
struct Served {
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), kforge_server::ServeError>>,
}

impl Served {
    /// Shuts the server down; it drains and ends without an error.
    async fn stop(self) {
        let _ = self.stop.send(());
        self.server.await.expect("the server task ends").expect("the server drains");
    }
}

/// Serves `config` on an ephemeral loopback port, with a client to it, once the evaluator has started.
async fn serve(config: EvaluatorConfig) -> (Served, EvaluatorClient<Channel>) {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await.expect("binds an ephemeral port");
    let address = format!("http://{}", listener.local_addr().expect("bound"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kforge_evaluator::serve(config, listener, async {
        let _ = stopped.await;
    }));
    let mut client = EvaluatorClient::new(client::connect(&address, &ClientConfig::default()).await.expect("connects"));
    // Answered once the evaluator has started (its probes done): the tests can change its work directory.
    let capabilities = client.get_capabilities(pb::GetCapabilitiesRequest {}).await.expect("capabilities");
    assert!(capabilities.into_inner().backends.contains(&pb::Backend::Cpu.into()), "the cpu backend is up");
    (Served { stop, server }, client)
}

fn request(request_id: &str) -> pb::EvaluateRequest {
    pb::EvaluateRequest {
        request_id: request_id.into(),
        task: Some(pb::Task { task_id: "examples/relu".into(), source: TASK.into() }),
        candidate_source: TORCH_RELU.into(),
        backend: pb::Backend::Cpu.into(),
        correctness_trials: 2,
        ..Default::default()
    }
}

fn keyed(request_id: &str, key: &str) -> pb::EvaluateRequest {
    pb::EvaluateRequest { idempotency_key: key.into(), ..request(request_id) }
}

fn verdict(response: &pb::EvaluateResponse) -> pb::Verdict {
    pb::Verdict::try_from(response.verdict).expect("a known verdict")
}

/// `response` as another request's replay of it: the same in every field but the caller's `request_id`.
fn replayed_as(response: &pb::EvaluateResponse, request_id: &str) -> pb::EvaluateResponse {
    pb::EvaluateResponse { request_id: request_id.into(), ..response.clone() }
}

/// Makes every evaluation fail before it runs anything, with a retryable infra error: the scratch root becomes a
/// file, so no evaluation's scratch directory can be made under it (whoever the test runs as, root included).
fn break_scratch(work_dir: &Path) {
    let scratch = work_dir.join("scratch");
    std::fs::remove_dir_all(&scratch).expect("scratch root removed");
    std::fs::write(&scratch, "not a directory").expect("scratch root replaced by a file");
}

fn repair_scratch(work_dir: &Path) {
    let scratch = work_dir.join("scratch");
    if scratch.is_file() {
        std::fs::remove_file(&scratch).expect("the file removed");
    }
    std::fs::create_dir_all(&scratch).expect("scratch root made");
}

/// A final result is replayed to the same key and request (with the caller's `request_id`) without evaluating
/// again; a retryable infra error is not kept: the retry after the cause is gone evaluates and succeeds.
#[tokio::test]
async fn a_final_result_is_replayed_and_a_retryable_infra_error_is_evaluated_again() {
    let Some(config) = config("service-idempotency") else { return };
    let work_dir = config.work_dir.clone();
    // A run that failed half-way may have left the scratch root broken.
    repair_scratch(&work_dir);
    let (served, mut client) = serve(config).await;
    let mut evaluate = async |request: pb::EvaluateRequest| client.evaluate(request).await.map(|r| r.into_inner());

    break_scratch(&work_dir);
    let failed = evaluate(keyed("first", "key")).await.expect("a verdict");
    assert_eq!(verdict(&failed), pb::Verdict::InfraError, "{failed:#?}");
    assert!(failed.retryable && failed.error.contains("scratch directory"), "{failed:#?}");

    repair_scratch(&work_dir);
    let retried = evaluate(keyed("second", "key")).await.expect("a verdict");
    assert_eq!(verdict(&retried), pb::Verdict::Correct, "the retry was evaluated: {retried:#?}");
    assert_eq!(retried.request_id, "second");

    // Every evaluation fails from here on, so a correct response is a replay.
    break_scratch(&work_dir);
    let replayed = evaluate(keyed("third", "key")).await.expect("a verdict");
    assert_eq!(replayed, replayed_as(&retried, "third"), "the final result, replayed");
    let unkeyed = evaluate(request("unkeyed")).await.expect("a verdict");
    assert_eq!(verdict(&unkeyed), pb::Verdict::InfraError, "evaluations do fail: {unkeyed:#?}");

    let other = pb::EvaluateRequest { correctness_trials: 3, ..keyed("fourth", "key") };
    let status = evaluate(other).await.expect_err("the key belongs to another request");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("idempotency_key: "), "{status:?}");

    repair_scratch(&work_dir);
    served.stop().await;
}

/// A request refused with a status is not remembered: its key is free for the next request, even another one.
#[tokio::test]
async fn a_refused_request_is_not_replayed() {
    // No admission slot: every request that passes validation is refused with RESOURCE_EXHAUSTED.
    let Some(config) = config("evaluator-cache") else { return };
    let (served, mut client) = serve(EvaluatorConfig { queue_capacity: 0, ..config }).await;
    let refused = client.evaluate(keyed("first", "key")).await.expect_err("the queue is full");
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
    assert!(refused.metadata().get("retry-after-ms").is_some(), "{refused:?}");

    // Had the refusal been kept, the key would still belong to the first request (INVALID_ARGUMENT).
    let other = pb::EvaluateRequest { correctness_trials: 3, ..keyed("second", "key") };
    let again = client.evaluate(other).await.expect_err("the queue is still full");
    assert_eq!(again.code(), tonic::Code::ResourceExhausted, "evaluated afresh: {again:?}");
    let same = client.evaluate(keyed("third", "key")).await.expect_err("the queue is still full");
    assert_eq!(same.code(), tonic::Code::ResourceExhausted, "{same:?}");
    served.stop().await;
}

/// Every accepted request gets exactly one response, a refused one gets one `request_error` item and does not end
/// the stream, and the stream ends cleanly once the client has closed its side and every response is out.
#[tokio::test]
async fn every_stream_request_gets_exactly_one_response_and_a_refusal_does_not_end_the_stream() {
    let Some(config) = config("evaluator-cache") else { return };
    let (served, mut client) = serve(config).await;
    let (requests, outgoing) = tokio::sync::mpsc::channel::<pb::EvaluateRequest>(16);
    let mut responses = client.evaluate_stream(ReceiverStream::new(outgoing)).await.expect("opens").into_inner();
    let send = async |request: pb::EvaluateRequest| requests.send(request).await.expect("the stream is open");

    send(request("a1")).await;
    send(keyed("a2", "stream-key")).await;
    send(request("")).await;
    send(pb::EvaluateRequest { policy: "lenient".into(), ..request("bad-policy") }).await;
    let mut received = Vec::new();
    while !(received.iter().any(|r: &pb::EvaluateResponse| r.request_id.is_empty())
        && received.iter().any(|r| r.request_id == "bad-policy"))
    {
        let response = responses.message().await.expect("the stream is healthy").expect("the stream goes on");
        received.push(response);
    }
    // Sent after both refusals were answered.
    send(request("b1")).await;
    send(keyed("b2", "stream-key")).await;
    drop(requests);
    while let Some(response) = responses.message().await.expect("the stream ends cleanly") {
        received.push(response);
    }

    let mut by_id: BTreeMap<&str, Vec<&pb::EvaluateResponse>> = BTreeMap::new();
    for response in &received {
        by_id.entry(response.request_id.as_str()).or_default().push(response);
    }
    let counts: Vec<(&str, usize)> = by_id.iter().map(|(id, responses)| (*id, responses.len())).collect();
    assert_eq!(counts, [("", 1), ("a1", 1), ("a2", 1), ("b1", 1), ("b2", 1), ("bad-policy", 1)], "{received:#?}");
    for id in ["a1", "a2", "b1", "b2"] {
        let response = by_id[id][0];
        assert_eq!(verdict(response), pb::Verdict::Correct, "{id}: {response:#?}");
        assert!(response.request_error.is_empty(), "{id}: {response:#?}");
    }
    assert_eq!(*by_id["b2"][0], replayed_as(by_id["a2"][0], "b2"), "the same key and request share one evaluation");
    for (id, error) in [("", "INVALID_ARGUMENT: request_id: "), ("bad-policy", "INVALID_ARGUMENT: policy: ")] {
        let response = by_id[id][0];
        assert_eq!(verdict(response), pb::Verdict::Unspecified, "{id:?}: {response:#?}");
        assert!(response.request_error.starts_with(error), "{id:?}: {response:#?}");
    }
    served.stop().await;
}
