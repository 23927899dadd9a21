//! The inference gateway's benchmark, all on loopback in one process:
//!
//! 1. **added latency**: an open-loop load at `--rate` requests/s for `--seconds`, first straight to a fast
//!    OpenAI-compatible server (HTTP + SSE, as a client without the gateway would call it), then through the
//!    gateway (gRPC in, the same HTTP + SSE out); percentiles of both and their differences;
//! 2. **affinity hit rate**: episodes of several turns at the same rate over four healthy backends; the share of
//!    turns served by the backend that served the episode's first turn, and the gateway's own hit counter;
//! 3. **routing around a dead backend**: the same load over four backends, one stopped mid-run; client-visible
//!    failures, and the time from the stop to the last request that still tried the dead backend (a request
//!    that needed more than one attempt) and to the gateway marking it unroutable.
//!
//! `cargo run --release -p kforge-bench-gateway -- [--rate 1000] [--seconds 10]`

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::Response;
use axum::routing::{get, post};
use kforge_gateway::config::{BackendConfig, BackendKind, GatewayConfig, Policy, PoolConfig};
use kforge_proto::v1 as pb;
use kforge_proto::v1::gateway_client::GatewayClient;
use kforge_test_support::Wait;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinSet;
use tonic::transport::Channel;

/// The fake model's whole answer: a reasoning piece, two text pieces with token ids, usage.
const STREAM: &str = concat!(
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"reasoning_content\":\"Okay.\"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"},\"token_ids\":[11]}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" world\"},\"token_ids\":[12],\"finish_reason\":\"stop\"}]}\n\n",
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n",
    "data: [DONE]\n\n",
);

/// A fast OpenAI-compatible server that can be stopped.
struct Upstream {
    url: String,
    stop: Option<oneshot::Sender<()>>,
    served: Arc<AtomicU64>,
}

impl Upstream {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr: SocketAddr = listener.local_addr().expect("addr");
        let served = Arc::new(AtomicU64::new(0));
        let counter = served.clone();
        let app = Router::new()
            .route(
                "/v1/chat/completions",
                post(move || {
                    let counter = counter.clone();
                    async move {
                        counter.fetch_add(1, Ordering::Relaxed);
                        Response::builder()
                            .header(header::CONTENT_TYPE, "text/event-stream")
                            .body(Body::from(Bytes::from_static(STREAM.as_bytes())))
                            .expect("response")
                    }
                }),
            )
            .route("/health", get(|| async { "ok" }));
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Self { url: format!("http://{addr}/v1"), stop: Some(stop), served }
    }

    fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn gateway(upstreams: &[&Upstream], policy: Policy) -> (GatewayClient<Channel>, String, oneshot::Sender<()>) {
    let pool = PoolConfig {
        model: "bench".into(),
        policy,
        backends: upstreams
            .iter()
            .map(|u| BackendConfig { kind: BackendKind::Vllm, url: u.url.clone(), ..BackendConfig::default() })
            .collect(),
        ..PoolConfig::default()
    };
    let config = GatewayConfig { pools: vec![pool], ..GatewayConfig::default() };
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = kforge_gateway::serve(config, listener, async {
            let _ = stopped.await;
        })
        .await;
    });
    let client = GatewayClient::connect(addr.clone()).await.expect("connect");
    (client, addr, stop)
}

fn request(episode: u64, turn: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        model: "bench".into(),
        input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage { role: "user".into(), content: format!("episode {episode} turn {turn}") }],
        })),
        keys: Some(pb::RequestKeys {
            job_id: "bench".into(),
            episode_id: format!("episode-{episode}"),
            task_id: "bench/task".into(),
            trajectory: 0,
            turn,
        }),
        ..Default::default()
    }
}

/// Outcome of one request: when it started (from the run's start), its latency, and what served it.
#[derive(Debug, Clone)]
struct Sample {
    /// The request's number in its run.
    index: u64,
    started: Duration,
    latency: Duration,
    result: Result<(String, u32), String>,
}

/// Starts `total` calls of `call(i)` at `rate` per second (open loop: a slow call does not delay the next).
async fn open_loop<F, Fut>(rate: u32, total: u64, call: F) -> Vec<Sample>
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = Result<(String, u32), String>> + Send + 'static,
{
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let origin = Instant::now();
    let mut tasks = JoinSet::new();
    for i in 0..total {
        ticks.tick().await;
        let call = call(i);
        tasks.spawn(async move {
            let start = Instant::now();
            let result = call.await;
            Sample { index: i, started: start - origin, latency: start.elapsed(), result }
        });
    }
    let mut samples = Vec::with_capacity(total as usize);
    while let Some(sample) = tasks.join_next().await {
        samples.push(sample.expect("a call task"));
    }
    samples.sort_by_key(|s| s.started);
    samples
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn latencies_ms(samples: &[Sample]) -> Vec<f64> {
    let mut ms: Vec<f64> = samples.iter().map(|s| s.latency.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    ms
}

async fn added_latency(rate: u32, total: u64) {
    let upstream = Upstream::start().await;
    let http = reqwest::Client::builder().tcp_nodelay(true).build().expect("client");
    let url = format!("{}/chat/completions", upstream.url);
    let body = serde_json::json!({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": true});
    let direct_call = |_: u64| {
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        async move {
            let response = http.post(url).json(&body).send().await.map_err(|e| e.to_string())?;
            let bytes = response.bytes().await.map_err(|e| e.to_string())?;
            if bytes.ends_with(b"[DONE]\n\n") { Ok((String::new(), 1)) } else { Err("short body".into()) }
        }
    };
    let (client, _, _stop) = gateway(&[&upstream], Policy::PowerOfTwo).await;
    let gateway_call = |i: u64| {
        let mut client = client.clone();
        async move {
            let response = client.generate(request(i, 0)).await.map_err(|s| s.message().to_owned())?.into_inner();
            Ok((response.backend, response.attempts))
        }
    };
    // Warm both paths (connections, allocator) before measuring.
    open_loop(rate, u64::from(rate), direct_call).await;
    open_loop(rate, u64::from(rate), gateway_call).await;
    let direct = open_loop(rate, total, direct_call).await;
    let through = open_loop(rate, total, gateway_call).await;
    let failures = |s: &[Sample]| s.iter().filter(|s| s.result.is_err()).count();
    let (d, g) = (latencies_ms(&direct), latencies_ms(&through));
    println!("## added latency: {rate} req/s for {total} requests per path (open loop, loopback)");
    println!("path     p50_ms  p90_ms  p99_ms  p999_ms  max_ms  failures");
    for (name, ms, samples) in [("direct ", &d, &direct), ("gateway", &g, &through)] {
        println!(
            "{name}  {:6.3}  {:6.3}  {:6.3}  {:7.3}  {:6.3}  {}",
            percentile(ms, 50.0),
            percentile(ms, 90.0),
            percentile(ms, 99.0),
            percentile(ms, 99.9),
            ms.last().copied().unwrap_or(f64::NAN),
            failures(samples)
        );
    }
    println!(
        "added    {:6.3}  {:6.3}  {:6.3}  {:7.3}   (gateway percentile minus direct percentile)",
        percentile(&g, 50.0) - percentile(&d, 50.0),
        percentile(&g, 90.0) - percentile(&d, 90.0),
        percentile(&g, 99.0) - percentile(&d, 99.0),
        percentile(&g, 99.9) - percentile(&d, 99.9),
    );
    println!();
}

async fn affinity(rate: u32, total: u64) {
    const BACKENDS: usize = 4;
    const TURNS: u64 = 4;
    let upstreams: Vec<Upstream> = futures_all(BACKENDS).await;
    let refs: Vec<&Upstream> = upstreams.iter().collect();
    let (client, addr, _stop) = gateway(&refs, Policy::Affinity).await;
    // Episodes interleave: request i is turn i / episodes of episode i % episodes.
    let episodes = (total / TURNS).max(1);
    let samples = open_loop(rate, episodes * TURNS, |i| {
        let mut client = client.clone();
        async move {
            let response = client
                .generate(request(i % episodes, (i / episodes) as u32))
                .await
                .map_err(|s| s.message().to_owned())?
                .into_inner();
            Ok((response.backend, response.attempts))
        }
    })
    .await;
    let mut first = std::collections::HashMap::new();
    let (mut same, mut later, mut failures) = (0u64, 0u64, 0u64);
    let mut in_order: Vec<&Sample> = samples.iter().collect();
    in_order.sort_by_key(|s| s.index);
    for sample in in_order {
        let Ok((backend, _)) = &sample.result else {
            failures += 1;
            continue;
        };
        let episode = sample.index % episodes;
        match first.get(&episode) {
            None => {
                first.insert(episode, backend.clone());
            }
            Some(home) => {
                later += 1;
                same += u64::from(home == backend);
            }
        }
    }
    let metrics = reqwest::get(format!("{addr}/metrics")).await.expect("scrape").text().await.expect("text");
    let counter = |result: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with("kforge_gateway_affinity_total") && l.contains(&format!("result=\"{result}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let (hits, misses) = (counter("hit"), counter("miss"));
    let spread: Vec<u64> = upstreams.iter().map(|u| u.served.load(Ordering::Relaxed)).collect();
    println!("## affinity: {episodes} episodes x {TURNS} turns over {BACKENDS} healthy backends at {rate} req/s");
    println!("later turns on the first turn's backend: {same}/{later} = {:.4}", same as f64 / later.max(1) as f64);
    println!("gateway affinity counter: {hits} hits, {misses} misses = {:.4}", hits / (hits + misses).max(1.0));
    println!("requests per backend: {spread:?}; failures: {failures}");
    println!();
}

async fn futures_all(n: usize) -> Vec<Upstream> {
    let mut upstreams = Vec::with_capacity(n);
    for _ in 0..n {
        upstreams.push(Upstream::start().await);
    }
    upstreams
}

async fn dead_backend(rate: u32, total: u64) {
    const BACKENDS: usize = 4;
    let mut upstreams: Vec<Upstream> = futures_all(BACKENDS).await;
    let refs: Vec<&Upstream> = upstreams.iter().collect();
    let (client, _, _stop) = gateway(&refs, Policy::Affinity).await;
    let victim = upstreams[0].url.clone();
    let kill_after = total / 3;
    let (killed_tx, killed_rx) = oneshot::channel::<()>();
    let origin = Instant::now();
    let kill_at = Arc::new(AtomicU64::new(0));
    let mut killer = {
        let kill_at = kill_at.clone();
        let wait = Duration::from_secs_f64(kill_after as f64 / f64::from(rate));
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            kill_at.store(origin.elapsed().as_nanos() as u64, Ordering::SeqCst);
            let _ = killed_tx.send(());
        })
    };
    // Watch ListModels every millisecond for the moment the victim becomes unroutable, within the run and a minute.
    let watcher = {
        let (client, victim) = (client.clone(), victim.clone());
        let run = Duration::from_secs_f64(total as f64 / f64::from(rate)) + Duration::from_secs(60);
        tokio::spawn(async move {
            Wait::new("the dead backend to become unroutable")
                .within(run)
                .every(Duration::from_millis(1))
                .until(|| {
                    let (mut client, victim) = (client.clone(), victim.clone());
                    async move {
                        let models = client.list_models(pb::ListModelsRequest {}).await.expect("list").into_inner();
                        let mut backends = models.models.into_iter().flat_map(|m| m.backends);
                        let routable = backends.any(|b| b.url == victim && b.routable);
                        (!routable).then(|| origin.elapsed())
                    }
                })
                .await
        })
    };
    let load = {
        let client = client.clone();
        tokio::spawn(async move {
            open_loop(rate, total, move |i| {
                let mut client = client.clone();
                async move {
                    let response =
                        client.generate(request(i % 500, 0)).await.map_err(|s| s.message().to_owned())?.into_inner();
                    Ok((response.backend, response.attempts))
                }
            })
            .await
        })
    };
    let _ = killed_rx.await;
    upstreams[0].stop();
    let _ = (&mut killer).await;
    let samples = load.await.expect("load");
    let unroutable_at = watcher.await.expect("watcher");
    let killed = Duration::from_nanos(kill_at.load(Ordering::SeqCst));
    let failures = samples.iter().filter(|s| s.result.is_err()).count();
    let last_retried = samples
        .iter()
        .filter(|s| matches!(&s.result, Ok((_, attempts)) if *attempts > 1))
        .map(|s| s.started + s.latency)
        .max();
    let retried = samples.iter().filter(|s| matches!(&s.result, Ok((_, attempts)) if *attempts > 1)).count();
    let after: Vec<&Sample> = samples.iter().filter(|s| s.started >= killed).collect();
    let on_victim = after.iter().filter(|s| matches!(&s.result, Ok((b, _)) if *b == victim)).count();
    println!(
        "## routing around a dead backend: {BACKENDS} backends, {rate} req/s, {total} requests, backend 0 stopped at request {kill_after}"
    );
    println!("client-visible failures: {failures}");
    println!("requests that needed a retry (tried the dead backend first): {retried}");
    match last_retried {
        Some(at) if at > killed => {
            println!(
                "time from stop to the last request that tried the dead backend: {:.1} ms",
                (at - killed).as_secs_f64() * 1e3
            )
        }
        _ => println!("time from stop to the last request that tried the dead backend: none tried it"),
    }
    println!(
        "time from stop to the gateway marking it unroutable: {:.1} ms",
        unroutable_at.saturating_sub(killed).as_secs_f64() * 1e3
    );
    println!("requests served by the dead backend after the stop: {on_victim} of {}", after.len());
    let mut ms: Vec<f64> = after.iter().map(|s| s.latency.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    println!(
        "latency after the stop: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        percentile(&ms, 50.0),
        percentile(&ms, 99.0),
        ms.last().copied().unwrap_or(f64::NAN)
    );
    println!();
}

/// The 1-minute load average, to show how busy the machine was.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map_or_else(|_| "unknown".into(), |l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// The inference gateway's benchmark on loopback: added latency, affinity hit rate, routing around a dead backend.
#[derive(clap::Parser)]
#[command(name = "gateway-bench")]
struct Args {
    /// The open-loop load of each phase, in requests per second.
    #[arg(long, default_value_t = 1000)]
    rate: u32,
    /// How long each phase lasts, in seconds.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
}

fn main() {
    let Args { rate, seconds } = clap::Parser::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let total = u64::from(rate) * seconds;
    runtime.block_on(async {
        println!(
            "gateway-bench: rate {rate} req/s, {seconds} s per phase, {} worker threads\n",
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        println!("load average before: {}\n", load_average());
        added_latency(rate, total).await;
        affinity(rate, total).await;
        dead_backend(rate, total).await;
        println!("load average after: {}", load_average());
    });
}
