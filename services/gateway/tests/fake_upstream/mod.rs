//! An OpenAI-compatible server for the gateway's tests, over real HTTP on a loopback port.
//!
//! Each request to a generation route takes the next scripted [`Behavior`] (a normal stream when the script is
//! empty): a stream, a plain JSON body, an HTTP error with an optional Retry-After, a connection dropped before
//! or after tokens, malformed JSON, or a response that hangs until released (reporting when the gateway gives
//! up on it). The fake counts every attempt, keeps the last request body, records control calls, tracks the most
//! requests it held at once, and can be stopped (connection refused) and started again on the same port, which it
//! keeps reserved meanwhile (`kforge_test_support::ReservedPort`: no other bind of port 0 can take it).

#![allow(dead_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kforge_test_support::ReservedPort;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;

/// What the fake does with one generation request.
#[derive(Debug)]
pub enum Behavior {
    /// A normal SSE stream.
    Stream,
    /// The whole response as one JSON body (a server that ignores `stream`).
    Json,
    /// An HTTP error status, with a `Retry-After` header when given.
    Status(u16, Option<&'static str>),
    /// One token, then the connection drops: once `trigger` fires when given (so that a test can see the token
    /// arrive first; a server may not flush data written just before the connection breaks), else at once.
    DropAfterTokens(Option<oneshot::Receiver<()>>),
    /// The connection drops before any token (headers sent, body broken).
    DropBeforeTokens,
    /// A `data:` line that is not JSON.
    MalformedEvent,
    /// A 200 whose body is not the API's JSON at all.
    Garbage,
    /// Headers, then nothing until `release` fires; `aborted` fires if the gateway closes the connection first.
    Hang { release: oneshot::Receiver<()>, aborted: oneshot::Sender<()> },
    /// Like `Stream`, but only after `release` fires (to hold a request in flight).
    Held { release: oneshot::Receiver<()> },
}

#[derive(Debug, Default)]
struct Shared {
    script: Mutex<VecDeque<Behavior>>,
    attempts: AtomicU32,
    in_flight: AtomicU32,
    max_in_flight: AtomicU32,
    last_body: Mutex<Option<Value>>,
    last_path: Mutex<String>,
    last_traceparent: Mutex<Option<String>>,
    control_calls: Mutex<Vec<String>>,
    unhealthy: AtomicBool,
}

/// A running fake.
#[derive(Debug)]
pub struct FakeUpstream {
    shared: Arc<Shared>,
    port: ReservedPort,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl FakeUpstream {
    pub async fn start() -> Self {
        let mut fake = Self { shared: Arc::default(), port: ReservedPort::new(), stop: None, server: None };
        fake.serve();
        fake
    }

    /// Serves on the reserved port.
    fn serve(&mut self) {
        let listener = self.port.listen();
        listener.set_nonblocking(true).expect("non-blocking");
        let listener = TcpListener::from_std(listener).expect("a tokio listener");
        let app = Router::new()
            .route("/v1/chat/completions", post(generate))
            .route("/v1/completions", post(generate))
            .route("/inference/v1/generate", post(generate))
            .route("/generate", post(sglang_generate))
            .route("/health", get(health))
            .fallback(control)
            .with_state(self.shared.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        self.stop = Some(stop);
        self.server = Some(tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        }));
    }

    /// Stops serving: new connections are refused, and open ones end once their responses do.
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }

    /// Serves again on the same port.
    pub async fn restart(&mut self) {
        self.serve();
    }

    /// The OpenAI base URL, as the gateway's config takes it.
    pub fn url(&self) -> String {
        format!("{}/v1", self.port.url())
    }

    /// The label the gateway gives this backend.
    pub fn label(&self) -> String {
        self.url()
    }

    pub fn push(&self, behavior: Behavior) {
        self.shared.script.lock().expect("script").push_back(behavior);
    }

    pub fn attempts(&self) -> u32 {
        self.shared.attempts.load(Ordering::SeqCst)
    }

    pub fn max_in_flight(&self) -> u32 {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }

    pub fn last_body(&self) -> Value {
        self.shared.last_body.lock().expect("body").clone().unwrap_or(Value::Null)
    }

    pub fn last_path(&self) -> String {
        self.shared.last_path.lock().expect("path").clone()
    }

    /// The `traceparent` header of the last generation request, if it had one.
    pub fn last_traceparent(&self) -> Option<String> {
        self.shared.last_traceparent.lock().expect("traceparent").clone()
    }

    pub fn control_calls(&self) -> Vec<String> {
        self.shared.control_calls.lock().expect("calls").clone()
    }

    pub fn set_healthy(&self, healthy: bool) {
        self.shared.unhealthy.store(!healthy, Ordering::SeqCst);
    }
}

async fn health(State(shared): State<Arc<Shared>>) -> StatusCode {
    if shared.unhealthy.load(Ordering::SeqCst) { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK }
}

async fn control(State(shared): State<Arc<Shared>>, uri: Uri) -> StatusCode {
    shared.control_calls.lock().expect("calls").push(uri.to_string());
    StatusCode::OK
}

/// Counts the request as in flight until dropped.
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(shared: &Arc<Shared>) -> Self {
        let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        shared.max_in_flight.fetch_max(now, Ordering::SeqCst);
        Self(shared.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn event(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// The chunks of a normal response with `n` choices: reasoning, two text pieces with token ids and logprobs,
/// a finish, then usage.
fn chunks(chat: bool, n: u32, prompt_ids: &Value) -> Vec<Value> {
    let mut out = vec![json!({"prompt_token_ids": prompt_ids, "choices": []})];
    for index in 0..n {
        let piece = |text: &str| if chat { json!({"delta": {"content": text}}) } else { json!({"text": text}) };
        let logprobs = |lp: f64| {
            if chat { json!({"content": [{"token": "t", "logprob": lp}]}) } else { json!({"token_logprobs": [lp]}) }
        };
        if chat {
            out.push(json!({"choices": [{"index": index, "delta": {"reasoning_content": "Okay, think."}}]}));
        }
        let mut first = piece("Hello");
        first["index"] = json!(index);
        first["token_ids"] = json!([11]);
        first["logprobs"] = logprobs(-0.25);
        out.push(json!({"choices": [first]}));
        let mut second = piece(" world");
        second["index"] = json!(index);
        second["token_ids"] = json!([12]);
        second["logprobs"] = logprobs(-0.5);
        second["finish_reason"] = json!("stop");
        out.push(json!({"choices": [second]}));
    }
    out.push(json!({"choices": [], "usage": {
        "prompt_tokens": 3, "completion_tokens": 2 * n,
        "prompt_tokens_details": {"cached_tokens": 1},
        "completion_tokens_details": {"reasoning_tokens": 1}
    }}));
    out
}

fn sse(rx: mpsc::Receiver<Result<Bytes, std::io::Error>>) -> Response {
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(ReceiverStream::new(rx)))
        .expect("response")
}

async fn generate(State(shared): State<Arc<Shared>>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    shared.attempts.fetch_add(1, Ordering::SeqCst);
    *shared.last_traceparent.lock().expect("traceparent") =
        headers.get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let in_flight = InFlight::new(&shared);
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    *shared.last_body.lock().expect("body") = Some(request.clone());
    *shared.last_path.lock().expect("path") = uri.path().to_owned();
    let chat = uri.path().ends_with("/chat/completions");
    let n = request["n"].as_u64().or_else(|| request["sampling_params"]["n"].as_u64()).unwrap_or(1) as u32;
    let prompt_ids = match (&request["prompt"], &request["token_ids"]) {
        (Value::Array(ids), _) | (_, Value::Array(ids)) => Value::Array(ids.clone()),
        _ => json!([1, 2, 3]),
    };
    let behavior = shared.script.lock().expect("script").pop_front().unwrap_or(Behavior::Stream);
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let broken = || Err(std::io::Error::other("connection dropped by the fake"));
    match behavior {
        Behavior::Status(status, retry_after) => {
            let mut response =
                (StatusCode::from_u16(status).expect("status"), "{\"error\": \"injected\"}").into_response();
            if let Some(seconds) = retry_after {
                response.headers_mut().insert(header::RETRY_AFTER, seconds.parse().expect("header"));
            }
            response
        }
        Behavior::Garbage => {
            (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], "<html>oops</html>").into_response()
        }
        Behavior::Json => {
            let mut choices = Vec::new();
            for index in 0..n {
                let choice = if chat {
                    json!({"index": index, "message": {"role": "assistant", "content": "Hello world"}, "finish_reason": "stop"})
                } else {
                    json!({"index": index, "text": "Hello world", "finish_reason": "stop"})
                };
                choices.push(choice);
            }
            let body = json!({"choices": choices, "usage": {"prompt_tokens": 3, "completion_tokens": 2 * n}});
            (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
        }
        Behavior::Stream => {
            tokio::spawn(async move {
                let _in_flight = in_flight;
                for chunk in chunks(chat, n, &prompt_ids) {
                    let _ = tx.send(Ok(event(&chunk))).await;
                }
                let _ = tx.send(Ok(Bytes::from("data: [DONE]\n\n"))).await;
            });
            sse(rx)
        }
        Behavior::Held { release } => {
            tokio::spawn(async move {
                let _in_flight = in_flight;
                let _ = release.await;
                for chunk in chunks(chat, n, &prompt_ids) {
                    let _ = tx.send(Ok(event(&chunk))).await;
                }
                let _ = tx.send(Ok(Bytes::from("data: [DONE]\n\n"))).await;
            });
            sse(rx)
        }
        Behavior::DropAfterTokens(trigger) => {
            tokio::spawn(async move {
                let _in_flight = in_flight;
                let first = &chunks(chat, n, &prompt_ids)[if chat { 2 } else { 1 }];
                let _ = tx.send(Ok(event(first))).await;
                if let Some(trigger) = trigger {
                    let _ = trigger.await;
                }
                let _ = tx.send(broken()).await;
            });
            sse(rx)
        }
        Behavior::DropBeforeTokens => {
            tokio::spawn(async move {
                let _in_flight = in_flight;
                let _ = tx.send(Ok(Bytes::from(": keep-alive\n\n"))).await;
                let _ = tx.send(broken()).await;
            });
            sse(rx)
        }
        Behavior::MalformedEvent => {
            tokio::spawn(async move {
                let _in_flight = in_flight;
                let _ = tx.send(Ok(Bytes::from("data: {\"choices\": [oops\n\n"))).await;
            });
            sse(rx)
        }
        Behavior::Hang { release, aborted } => {
            tokio::spawn(async move {
                let _in_flight = in_flight;
                let mut release = release;
                // A comment now and then: a server learns that its client left only when a write fails.
                loop {
                    if tx.send(Ok(Bytes::from(": waiting\n\n"))).await.is_err() {
                        let _ = aborted.send(());
                        return;
                    }
                    tokio::select! {
                        _ = &mut release => return,
                        () = tx.closed() => {
                            let _ = aborted.send(());
                            return;
                        }
                        () = tokio::time::sleep(std::time::Duration::from_millis(20)) => {}
                    }
                }
            });
            sse(rx)
        }
    }
}

/// SGLang's native `/generate`: one JSON body with output ids and per-token log-probabilities.
async fn sglang_generate(State(shared): State<Arc<Shared>>, uri: Uri, body: Bytes) -> Response {
    shared.attempts.fetch_add(1, Ordering::SeqCst);
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    *shared.last_body.lock().expect("body") = Some(request);
    *shared.last_path.lock().expect("path") = uri.path().to_owned();
    let answer = json!({"text": "Hello world", "output_ids": [21, 22], "meta_info": {
        "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 2,
        "finish_reason": {"type": "stop"},
        "output_token_logprobs": [[-0.125, 21, null], [-0.75, 22, null]]}});
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], answer.to_string()).into_response()
}
