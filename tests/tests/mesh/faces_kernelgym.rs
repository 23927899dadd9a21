//! The KernelGym face against real services: the evaluator on the CPU backend with the repository's venv
//! (`scripts/setup.sh --test`) and the orchestrator's HTTP port, driven as KernelGym's own client drives its server
//! (`POST {server_url}/evaluate`, then `/status/{id}` until a terminal status, then `/results/{id}`), with
//! `server_url` = `http://host:port/kernelgym`.

use std::time::Duration;

use kforge::mesh::{Mesh, Service};
use kforge_test_support::Wait;
use serde_json::{Value, json};

const TASK: &str = include_str!("../../../examples/tasks/relu/task.py");
const KERNEL: &str = include_str!("../../../examples/tasks/relu/candidates/cpu_loop.py");
/// Statuses after which KernelGym's client stops polling.
const TERMINAL: [&str; 4] = ["completed", "failed", "timeout", "cancelled"];
/// A bound on each wait: a few CPU evaluations on a 2-core machine shared with builds.
const PATIENCE: Duration = Duration::from_secs(300);

/// A kernel whose C++ source does not compile (a statement without its semicolon).
fn broken_kernel() -> String {
    let broken = KERNEL.replace("return output;", "return output");
    assert_ne!(broken, KERNEL, "the example still returns `output;`");
    broken
}

/// The evaluator (CPU) and the orchestrator with its HTTP port; the face's base URL.
async fn mesh(name: &str) -> (Mesh, String) {
    let config = kforge_tests::cpu_evaluator_config(&format!("faces-kernelgym/{name}"));
    let mesh = kforge_tests::start(&[Service::Evaluator, Service::Orchestrator], &config).await;
    let base = format!("{}/kernelgym", mesh.http_address().expect("the orchestrator serves its HTTP port"));
    (mesh, base)
}

/// The request KernelGym's client sends (its exact keys, `detect_decoy_kernel` among them), on the CPU backend.
fn request(task_id: &str, kernel: &str) -> Value {
    json!({
        "task_id": task_id, "reference_code": TASK, "kernel_code": kernel, "backend": "cpu",
        "num_correct_trials": 2, "num_perf_trials": 100, "timeout": 600, "priority": "normal", "entry_point": "Model",
        "is_valid": false, "verbose_errors": true, "enable_profiling": true, "detect_decoy_kernel": true,
        "reference_backend": null,
    })
}

async fn get(http: &reqwest::Client, url: &str) -> (u16, Value) {
    let response = http.get(url).send().await.expect("GET answered");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON body"))
}

async fn post(http: &reqwest::Client, url: &str, body: &Value) -> (u16, Value, reqwest::header::HeaderMap) {
    let response = http.post(url).json(body).send().await.expect("POST answered");
    let (status, headers) = (response.status().as_u16(), response.headers().clone());
    (status, response.json().await.expect("a JSON body"), headers)
}

/// KernelGym's client: submit, poll `/status` until terminal, then read `/results` (for `completed`). Returns the
/// last status body and the result.
async fn client_flow(http: &reqwest::Client, base: &str, body: &Value) -> (Value, Value) {
    let (status, _, _) = post(http, &format!("{base}/evaluate"), body).await;
    assert_eq!(status, 200, "submitted");
    let task_id = body["task_id"].as_str().expect("a task id");
    let status_url = format!("{base}/status/{task_id}");
    // The client's own poll, at a shorter period; while not terminal, the wait's message shows the last status.
    let state = Wait::new(format!("{task_id} to reach a terminal status"))
        .within(PATIENCE)
        .every(Duration::from_millis(200))
        .until(|| async {
            let (code, state) = get(http, &status_url).await;
            assert_eq!(code, 200, "{state}");
            if TERMINAL.contains(&state["status"].as_str().unwrap_or_default()) { Ok(state) } else { Err(state) }
        })
        .await;
    let (code, result) = get(http, &format!("{base}/results/{task_id}")).await;
    assert_eq!(code, 200, "{result}");
    (state, result)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_correct_kernel_is_processing_then_completed_with_its_timing_and_coverage() {
    let (mesh, base) = mesh("correct").await;
    let http = reqwest::Client::new();
    let body = request("relu-correct", KERNEL);

    // Submitted apart, so that `/status` is read while the evaluation runs: the first answer that is not a 404 is
    // `processing` (a CPU evaluation takes seconds; the task is recorded before it starts).
    let submit = tokio::spawn({
        let (http, url, body) = (http.clone(), format!("{base}/evaluate"), body.clone());
        async move { post(&http, &url, &body).await }
    });
    // Within the evaluation's own bound: the loop ends with it at the latest.
    let first = Wait::new("relu-correct's first status")
        .within(PATIENCE)
        .until(|| async {
            let (code, state) = get(&http, &format!("{base}/status/relu-correct")).await;
            if code != 404 {
                return Some(state);
            }
            assert!(!submit.is_finished(), "the evaluation ended before its status was read");
            None
        })
        .await;
    assert_eq!(first["status"], "processing", "{first}");
    let (code, answered, _) = submit.await.expect("the submission");
    assert_eq!(code, 200, "{answered}");

    let (state, result) = client_flow(&http, &base, &body).await;
    assert_eq!(state["status"], "completed");
    assert_eq!(result, answered, "/results holds what /evaluate answered");
    assert_eq!((result["compiled"].as_bool(), result["correctness"].as_bool()), (Some(true), Some(true)), "{result}");
    assert_eq!(result["decoy_kernel"], false);
    assert_eq!(result["error_code"], Value::Null);
    let number = |key: &str| result[key].as_f64().unwrap_or_else(|| panic!("{key} in {result}"));
    assert!(number("speedup") > 0.0 && number("kernel_runtime") > 0.0 && number("reference_runtime") > 0.0);
    assert!(number("processing_time") > 0.0);
    let metadata = &result["metadata"];
    assert_eq!(metadata["backend"], "cpu");
    assert_eq!(metadata["verdict"], "correct");
    let count = |key: &str| metadata[key].as_u64().unwrap_or_else(|| panic!("{key} in {metadata}"));
    assert!(
        count("num_custom_kernels") >= 1 && count("num_total_kernels") >= count("num_custom_kernels"),
        "{metadata}"
    );
    let micros = |key: &str| metadata[key].as_f64().unwrap_or_else(|| panic!("{key} in {metadata}"));
    assert!(micros("custom_kernel_cuda_time_in_profiling_us") <= micros("total_kernel_run_time_in_profiling_us"));

    // Upstream's cache: the same task id without force_refresh answers the stored result, not a new evaluation.
    let mut again = body.clone();
    again["kernel_code"] = broken_kernel().into();
    let (code, cached, _) = post(&http, &format!("{base}/evaluate"), &again).await;
    assert_eq!(code, 200);
    assert_eq!(cached, result, "the stored result, whatever the new kernel");
    mesh.shutdown().await.expect("mesh drains");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_compile_error_reaches_the_client_in_status_and_results() {
    let (mesh, base) = mesh("compile-error").await;
    let http = reqwest::Client::new();
    let (state, result) = client_flow(&http, &base, &request("relu-broken", &broken_kernel())).await;
    // The kernel's failure is a completed evaluation, as upstream's: the client reads it from /results.
    assert_eq!(state["status"], "completed", "{state}");
    assert_eq!(result["compiled"], false, "{result}");
    assert_eq!(result["correctness"], false);
    assert_eq!(result["speedup"], 0.0);
    assert_eq!(result["error_code"], "COMPILATION_ERROR");
    let message = result["error_message"].as_str().expect("the compiler's message");
    assert!(message.contains("expected"), "the compiler's complaint about the missing `;`: {message}");
    // Unlike upstream, /status keeps the message too.
    assert_eq!(state["error_message"], result["error_message"]);
    assert_eq!(state["error_code"], "COMPILATION_ERROR");
    assert_eq!(result["metadata"]["compilation_error"], result["error_message"]);
    mesh.shutdown().await.expect("mesh drains");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_evaluates_each_task_and_stores_it_under_its_id() {
    let (mesh, base) = mesh("batch").await;
    let http = reqwest::Client::new();
    let mut correct = request("batch-correct", KERNEL);
    correct["measure_performance"] = false.into();
    // A kernel that inherits the reference instead of replacing it: a hack, caught before anything runs.
    let decoy = "import torch\n\n\nclass ModelNew(Model):\n    pass\n";
    let batch = json!({"batch_id": "b1", "tasks": [correct, request("batch-decoy", decoy)]});
    let (code, answer, _) = post(&http, &format!("{base}/evaluate/batch"), &batch).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!((answer["batch_id"].as_str(), answer["total_tasks"].as_u64()), (Some("b1"), Some(2)));
    assert_eq!((answer["completed_tasks"].as_u64(), answer["failed_tasks"].as_u64()), (Some(2), Some(0)), "{answer}");
    let results = answer["results"].as_array().expect("results");
    assert_eq!(results[0]["task_id"], "batch-correct");
    assert_eq!(results[0]["correctness"], true, "{}", results[0]);
    assert_eq!(results[0]["kernel_runtime"], Value::Null, "not timed");
    assert_eq!(results[1]["task_id"], "batch-decoy");
    assert_eq!((results[1]["decoy_kernel"].as_bool(), results[1]["correctness"].as_bool()), (Some(true), Some(false)));
    for (id, result) in [("batch-correct", &results[0]), ("batch-decoy", &results[1])] {
        let (code, stored) = get(&http, &format!("{base}/results/{id}")).await;
        assert_eq!((code, &stored), (200, result), "{id} is stored as the batch answered it");
    }
    // DELETE forgets a finished task.
    let response = http.delete(format!("{base}/tasks/batch-decoy")).send().await.expect("DELETE answered");
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(get(&http, &format!("{base}/status/batch-decoy")).await.0, 404);
    mesh.shutdown().await.expect("mesh drains");
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_name_their_field_and_health_is_healthy() {
    let (mesh, base) = mesh("bad").await;
    let http = reqwest::Client::new();
    let (code, health) = get(&http, &format!("{base}/health")).await;
    assert_eq!((code, health["status"].as_str()), (200, Some("healthy")), "KernelGym's client checks this");
    // Upstream's `GET /`: at the base URL itself.
    let (code, about) = get(&http, &base).await;
    assert_eq!((code, about["name"].as_str()), (200, Some("KernelGym")));

    let mut missing = request("bad-1", KERNEL);
    missing.as_object_mut().expect("object").remove("kernel_code");
    let mut entry = request("bad-2", KERNEL);
    entry["entry_point"] = "Net".into();
    let mut typed = request("bad-3", KERNEL);
    typed["num_correct_trials"] = "five".into();
    let mut backend = request("bad-4", KERNEL);
    backend["backend"] = "rocm".into();
    for (body, field, task_id) in [
        (missing, "kernel_code", json!(null)),
        (entry, "entry_point", json!("bad-2")),
        (typed, "num_correct_trials", json!("bad-3")),
        (backend, "backend", json!("bad-4")),
    ] {
        let (code, error, headers) = post(&http, &format!("{base}/evaluate"), &body).await;
        assert_eq!(code, 400, "{error}");
        assert_eq!(error["field"], field, "{error}");
        assert_eq!(error["error_code"], "VALIDATION_ERROR");
        assert_eq!(error["error"], "RequestValidationError");
        assert_eq!(error["code"], "invalid_argument");
        assert!(error["timestamp"].is_string());
        assert_eq!(headers["x-error-code"], "VALIDATION_ERROR");
        if task_id.is_string() {
            assert_eq!(error["task_id"], task_id, "{error}");
        }
        // Nothing was recorded for a refused request.
        if let Some(id) = task_id.as_str() {
            assert_eq!(get(&http, &format!("{base}/status/{id}")).await.0, 404);
        }
    }
    let mut bad_task = request("batch-bad", KERNEL);
    bad_task["reference_code"] = "tiny".into();
    let batch = json!({"batch_id": "b2", "tasks": [request("batch-ok", KERNEL), bad_task]});
    let (code, error, _) = post(&http, &format!("{base}/evaluate/batch"), &batch).await;
    assert_eq!((code, error["field"].as_str()), (400, Some("tasks[1].reference_code")), "{error}");

    let (code, missing) = get(&http, &format!("{base}/results/never-submitted")).await;
    assert_eq!(code, 404);
    assert_eq!(missing["code"], "not_found");
    assert!(missing["detail"].as_str().is_some_and(|d| d.contains("never-submitted")), "{missing}");
    mesh.shutdown().await.expect("mesh drains");
}
