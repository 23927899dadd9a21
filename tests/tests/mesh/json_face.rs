//! The JSON face of every server, over real connections: a unary method as proto3 JSON over HTTP/1.1 (the Connect
//! protocol's unary shape) reaches the same handler as gRPC, behind the same bearer check, deadline and metrics,
//! and its errors are JSON naming the field.

use std::path::PathBuf;

use kforge::mesh::{MeshConfig, Service};
use kforge_server::config::AuthConfig;
use serde_json::{Value, json};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kforge-json-face-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

async fn post(
    url: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, Value, reqwest::header::HeaderMap) {
    let mut request = reqwest::Client::new().post(url).header("content-type", "application/json").body(body.to_owned());
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("http call");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.expect("body");
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("json body ({e}): {text}"));
    (status, value, headers)
}

/// The `kforge_grpc_requests_total` count of `method` with `code` on a server's `/metrics` page.
async fn requests_counted(base: &str, method: &str, code: &str) -> u64 {
    let page = reqwest::get(format!("{base}/metrics")).await.expect("metrics").text().await.expect("page");
    let series = format!("method=\"{method}\",code=\"{code}\"}} ");
    page.lines()
        .find(|line| line.starts_with("kforge_grpc_requests_total") && line.contains(&series))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no series {series} on the metrics page"))
}

#[tokio::test]
async fn a_unary_call_as_json_meets_the_grpc_handler_auth_and_metrics() {
    let dir = scratch("auth");
    std::fs::write(dir.join("token"), "s3cret\n").expect("token file");
    let mut config = MeshConfig::default();
    config.reward.server.auth = AuthConfig { token_file: Some(dir.join("token")), token_env: None };
    let mesh = kforge_tests::start(&[Service::Reward], &config).await;
    let base = mesh.address(Service::Reward).expect("reward runs").to_owned();
    let url = format!("{base}/kforge.v1.Reward/ComputeReturns");
    let request = r#"{"method": "RETURN_METHOD_SUM", "gamma": 0.4, "trajectories": [{"values": [0.3, 0, 1.3]}]}"#;

    let (status, body, _) = post(&url, None, &[], request).await;
    assert_eq!((status, body["code"].as_str()), (401, Some("unauthenticated")), "{body}");
    let (status, body, _) = post(&url, Some("guess"), &[], request).await;
    assert_eq!(status, 401, "{body}");

    let before = requests_counted(&base, "/kforge.v1.Reward/ComputeReturns", "Ok").await;
    let (status, body, _) = post(&url, Some("s3cret"), &[], request).await;
    assert_eq!(status, 200, "{body}");
    let values: Vec<f64> =
        body["trajectories"][0]["values"].as_array().expect("values").iter().filter_map(Value::as_f64).collect();
    assert_eq!(values.len(), 3, "{body}");
    assert!((values[0] - (0.3 + 0.4 * 1.3 * 0.4)).abs() < 1e-9 && (values[2] - 1.3).abs() < 1e-9, "{values:?}");
    let after = requests_counted(&base, "/kforge.v1.Reward/ComputeReturns", "Ok").await;
    assert_eq!(after, before + 1, "a JSON call counts as the method's call");

    // The service's own check, reached through JSON, names the field as it does over gRPC.
    let nan = r#"{"method": "RETURN_METHOD_SUM", "gamma": 1, "trajectories": [{"values": [1, "NaN"]}]}"#;
    let (status, body, _) = post(&url, Some("s3cret"), &[], nan).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["code"], "invalid_argument", "{body}");
    assert!(body["field"].as_str().is_some_and(|f| f.ends_with("values[1]")), "{body}");
    assert_eq!(requests_counted(&base, "/kforge.v1.Reward/ComputeReturns", "InvalidArgument").await, 1);

    // JSON that does not fit the message is refused before the call, naming the field.
    let (status, body, _) = post(&url, Some("s3cret"), &[], r#"{"gamma": "high"}"#).await;
    assert_eq!((status, body["field"].as_str()), (400, Some("gamma")), "{body}");
    let (status, body, _) = post(&url, Some("s3cret"), &[], r#"{"gama": 1}"#).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["message"].as_str().is_some_and(|m| m.contains("gama")), "{body}");
    let (status, body, _) = post(&url, Some("s3cret"), &[], "{").await;
    assert_eq!(status, 400, "{body}");
    assert!(body["message"].as_str().is_some_and(|m| m.starts_with("malformed json")), "{body}");
    let (status, body, _) = post(&url, Some("s3cret"), &[("connect-timeout-ms", "soon")], request).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("invalid_argument")), "{body}");

    let (status, body, _) = post(&format!("{base}/kforge.v1.Reward/Nope"), Some("s3cret"), &[], "{}").await;
    assert_eq!((status, body["code"].as_str()), (404, Some("not_found")), "{body}");
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn the_json_body_limit_streams_and_gets_are_refused_as_json() {
    let mut config = MeshConfig::default();
    config.reward.server.max_message_bytes = 1024;
    let mesh = kforge_tests::start(&[Service::Reward, Service::Orchestrator], &config).await;
    let reward = mesh.address(Service::Reward).expect("reward runs").to_owned();
    let values = vec!["1.0"; 2000].join(",");
    let large = format!(r#"{{"method": "RETURN_METHOD_SUM", "trajectories": [{{"values": [{values}]}}]}}"#);
    let (status, body, _) = post(&format!("{reward}/kforge.v1.Reward/ComputeReturns"), None, &[], &large).await;
    assert_eq!((status, body["code"].as_str()), (413, Some("resource_exhausted")), "{body}");

    // The orchestrator's HTTP port answers JSON calls too, and refuses a streaming method by name.
    let http = mesh.http_address().expect("the orchestrator serves its HTTP port").to_owned();
    let (status, body, _) = post(&format!("{http}/kforge.v1.Orchestrator/ExportSamples"), None, &[], "{}").await;
    assert_eq!((status, body["code"].as_str()), (501, Some("unimplemented")), "{body}");
    let (status, body, _) =
        post(&format!("{http}/kforge.v1.Orchestrator/GetJob"), None, &[], r#"{"jobId": "j-none"}"#).await;
    assert_eq!((status, body["code"].as_str()), (404, Some("not_found")), "{body}");
    let (status, body, _) = post(&format!("{http}/kforge.v1.Orchestrator/ListJobs"), None, &[], "").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({}), "an empty store lists nothing");
    let response = reqwest::get(format!("{http}/kforge.v1.Orchestrator/ListJobs")).await.expect("get");
    assert_eq!(response.status().as_u16(), 405);
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn a_deadline_in_connect_timeout_ms_stops_the_call() {
    let Some(python) = kforge_test_support::python::or_skip(&[]) else { return };
    let mut config = MeshConfig::default();
    config.evaluator.python = python;
    let mesh = kforge_tests::start(&[Service::Evaluator], &config).await;
    let base = mesh.address(Service::Evaluator).expect("evaluator runs").to_owned();
    let task =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/tasks/relu/task.py"))
            .expect("the relu example");
    let request = json!({
        "task": {"taskId": "examples/relu", "source": task},
        "candidateSource": "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n",
        "backend": "BACKEND_CPU",
        "measurePerformance": true,
    })
    .to_string();
    let (status, body, _) =
        post(&format!("{base}/kforge.v1.Evaluator/Evaluate"), None, &[("connect-timeout-ms", "1")], &request).await;
    assert_eq!((status, body["code"].as_str()), (504, Some("deadline_exceeded")), "{body}");
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn the_http_port_takes_the_token_as_a_bearer_or_an_api_key() {
    let dir = scratch("http-auth");
    std::fs::write(dir.join("token"), "s3cret\n").expect("token file");
    let mut config = MeshConfig::default();
    config.orchestrator.server.auth = AuthConfig { token_file: Some(dir.join("token")), token_env: None };
    let mesh = kforge_tests::start(&[Service::Orchestrator], &config).await;
    let url = format!("{}/kforge.v1.Orchestrator/ListJobs", mesh.http_address().expect("the HTTP port"));
    let (status, body, _) = post(&url, None, &[], "{}").await;
    assert_eq!((status, body["code"].as_str()), (401, Some("unauthenticated")), "{body}");
    let (status, body, _) = post(&url, None, &[("x-api-key", "guess")], "{}").await;
    assert_eq!(status, 401, "{body}");
    let (status, body, _) = post(&url, Some("s3cret"), &[], "{}").await;
    assert_eq!(status, 200, "{body}");
    // The key reaches the service the face calls as its bearer token.
    let (status, body, _) = post(&url, None, &[("x-api-key", "s3cret")], "{}").await;
    assert_eq!(status, 200, "{body}");
    mesh.shutdown().await.expect("drains");
}
