//! `kforge call Gateway/Generate` as a new user runs it: the real binary with a config file naming a replay file
//! or an OpenAI-compatible URL (here a small server in the test, over real HTTP).

use std::io::Write;
use std::process::{Command, Stdio};

use axum::Router;
use axum::http::header;
use axum::routing::post;
use serde_json::Value;

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kforge-cli-gateway-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Runs `kforge --config <config> call Gateway/Generate` with `request` on stdin; (exit ok, stdout, stderr).
fn call(config: &std::path::Path, request: &str) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kforge"))
        .args(["--config", config.to_str().expect("utf-8 path"), "call", "Gateway/Generate"])
        .env("NO_COLOR", "1")
        .env("KFORGE_TEST_API_KEY", "sk-test")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kforge runs");
    child.stdin.take().expect("stdin").write_all(request.as_bytes()).expect("request written");
    let output = child.wait_with_output().expect("kforge ends");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn generate_from_a_replay_file() {
    let dir = temp_dir("replay");
    let replay = dir.join("rollouts.jsonl");
    std::fs::write(
        &replay,
        "{\"task_id\": \"examples/relu\", \"trajectory\": 1, \"turn\": 2, \"completions\": [{\"text\": \"recorded answer\"}]}\n",
    )
    .expect("write replay");
    let config = dir.join("kforge.toml");
    std::fs::write(
        &config,
        format!(
            "[[gateway.pools]]\nmodel = \"replay\"\n[[gateway.pools.backends]]\nkind = \"replay\"\nfile = {:?}\n",
            replay
        ),
    )
    .expect("write config");
    let request = r#"{"model": "replay", "chat": {"messages": [{"role": "user", "content": "relu"}]},
                      "keys": {"taskId": "examples/relu", "trajectory": 1, "turn": 2}}"#;
    let (ok, stdout, stderr) = call(&config, request);
    assert!(ok, "{stderr}");
    let response: Value = serde_json::from_str(&stdout).expect("json response");
    assert_eq!(response["completions"][0]["text"], "recorded answer");
    assert_eq!(response["replay"], true);

    let (ok, _, stderr) = call(&config, r#"{"model": "replay", "chat": {"messages": []}}"#);
    assert!(!ok && stderr.contains("INVALID_ARGUMENT") && stderr.contains("chat.messages"), "{stderr}");
}

#[test]
fn generate_from_an_openai_compatible_url() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let seen_key = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let addr = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let seen = seen_key.clone();
        let app = Router::new().route(
            "/v1/chat/completions",
            post(move |headers: axum::http::HeaderMap| {
                let seen = seen.clone();
                async move {
                    let auth = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or_default();
                    *seen.lock().expect("lock") = auth.to_owned();
                    (
                        [(header::CONTENT_TYPE, "text/event-stream")],
                        concat!(
                            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"live \"}}]}\n\n",
                            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"answer\"},\"finish_reason\":\"stop\"}]}\n\n",
                            "data: [DONE]\n\n"
                        ),
                    )
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await.expect("serves") });
        addr
    });
    let dir = temp_dir("openai");
    let config = dir.join("kforge.toml");
    std::fs::write(
        &config,
        format!(
            "[[gateway.pools]]\nmodel = \"hosted\"\nupstream_model = \"gpt-test\"\n[[gateway.pools.backends]]\n\
             kind = \"openai\"\nurl = \"http://{addr}/v1\"\napi_key_env = \"KFORGE_TEST_API_KEY\"\n"
        ),
    )
    .expect("write config");
    let (ok, stdout, stderr) =
        call(&config, r#"{"model": "hosted", "chat": {"messages": [{"role": "user", "content": "hi"}]}}"#);
    assert!(ok, "{stderr}");
    let response: Value = serde_json::from_str(&stdout).expect("json response");
    assert_eq!(response["completions"][0]["text"], "live answer");
    assert_eq!(response["backend"], format!("http://{addr}/v1"));
    assert_eq!(*seen_key.lock().expect("lock"), "Bearer sk-test");
}
