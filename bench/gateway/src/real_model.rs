//! The gateway's overhead on a real inference server: llama.cpp's OpenAI-compatible server (llama-cpp-python)
//! serving SmolLM2-135M-Instruct on the CPU (`scripts/setup_model.sh`), called directly (HTTP + SSE, the body the
//! gateway's `llamacpp` backend sends) and through the gateway (gRPC `GenerateStream` in, the same HTTP + SSE out),
//! in alternating pairs so that both paths see the same machine load.
//!
//! Per request: time to first token (the first event carrying text), the whole request, the tokens (one SSE
//! event per token from this server; one `TextDelta` per upstream event through the gateway) and the decode rate,
//! tokens after the first / (end - first token). The pairs cycle through four prompts; within a pair the first
//! request's prompt is new to the server and the second's is its cached prefix (llama-cpp-python keeps the last
//! request's tokens), so each position is compared on its own; which path goes first flips every round of
//! prompts. Greedy sampling: from the same cache state both paths generate the same tokens, which the summary
//! checks.
//!
//! `cargo run --release -p kforge-bench-gateway --bin real-model-gateway -- --pairs 40 --max-tokens 128 --out DIR`
//! writes DIR/raw.jsonl (one line per request) and DIR/summary.json, and prints the summary.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kforge_gateway::config::{BackendConfig, BackendKind, GatewayConfig, PoolConfig};
use kforge_proto::v1 as pb;
use kforge_proto::v1::gateway_client::GatewayClient;
use kforge_test_support::model_server::{ModelSetup, ServerOptions};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_stream::StreamExt;

const PROMPTS: [&str; 4] = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works to a child.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about a trip to the sea.",
];

/// A figure of one request.
type Measure = fn(&Sample) -> f64;

/// One request's timings.
#[derive(Debug, Clone)]
struct Sample {
    path: &'static str,
    pair: usize,
    /// 0: the pair's first request, whose prompt the server has not seen last (a new prompt to process); 1: the
    /// second, whose prompt is the server's cached prefix.
    position: usize,
    prompt: usize,
    ttft_ms: f64,
    total_ms: f64,
    tokens: usize,
    text: String,
    /// CPU time of this process (the client, and on the gateway path the gateway too) during the request.
    cpu_ms: f64,
}

impl Sample {
    /// Tokens after the first over the time after the first token.
    fn decode_tps(&self) -> f64 {
        if self.tokens < 2 { 0.0 } else { (self.tokens - 1) as f64 / ((self.total_ms - self.ttft_ms) / 1e3) }
    }

    fn json(&self) -> Value {
        json!({
            "path": self.path, "pair": self.pair, "position": self.position, "prompt": self.prompt,
            "ttft_ms": self.ttft_ms, "total_ms": self.total_ms, "tokens": self.tokens,
            "decode_tokens_per_s": self.decode_tps(), "text_fnv1a": fnv1a(&self.text), "cpu_ms": self.cpu_ms,
        })
    }
}

/// The gateway's overhead on a real inference server (llama.cpp serving SmolLM2-135M on the CPU), in alternating
/// pairs of requests straight to the server and through the gateway.
#[derive(clap::Parser)]
#[command(name = "real-model-gateway")]
struct Args {
    /// Pairs of requests (one direct, one through the gateway).
    #[arg(long, default_value_t = 30)]
    pairs: usize,
    /// The most tokens a request generates.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// The inference server's threads.
    #[arg(long, default_value_t = 2)]
    threads: u32,
    /// Where raw.jsonl and summary.json go.
    #[arg(long, default_value = "real-model-gateway")]
    out: PathBuf,
}

/// The body the gateway's `llamacpp` backend sends for a greedy chat request (`backends/openai.rs`).
fn direct_body(prompt: &str, max_tokens: u32) -> Value {
    json!({
        "model": "smollm2", "messages": [{"role": "user", "content": prompt}],
        "stream": true, "stream_options": {"include_usage": true}, "n": 1, "max_tokens": max_tokens,
        "temperature": 0.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0,
    })
}

async fn direct(http: &reqwest::Client, url: &str, prompt: &str, max_tokens: u32) -> (f64, f64, usize, String) {
    let started = Instant::now();
    let response = http
        .post(format!("{url}/chat/completions"))
        .json(&direct_body(prompt, max_tokens))
        .send()
        .await
        .expect("the server answers");
    assert!(response.status().is_success(), "{}", response.status());
    let mut stream = response.bytes_stream();
    let (mut buffer, mut text, mut tokens, mut first) = (Vec::new(), String::new(), 0, None);
    while let Some(bytes) = stream.next().await {
        buffer.extend_from_slice(&bytes.expect("the stream reads"));
        while let Some(end) = buffer.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim_end().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let event: Value = serde_json::from_str(data).expect("an event");
            if let Some(content) = event["choices"][0]["delta"]["content"].as_str().filter(|c| !c.is_empty()) {
                first.get_or_insert_with(|| started.elapsed());
                tokens += 1;
                text.push_str(content);
            }
        }
    }
    let total = started.elapsed();
    (ms(first.unwrap_or(total)), ms(total), tokens, text)
}

async fn through(
    client: &mut GatewayClient<tonic::transport::Channel>,
    prompt: &str,
    max_tokens: u32,
) -> (f64, f64, usize, String) {
    let request = pb::GenerateRequest {
        model: "smollm2".into(),
        input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage { role: "user".into(), content: prompt.into() }],
        })),
        sampling: Some(pb::SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(max_tokens),
            ..Default::default()
        }),
        ..Default::default()
    };
    let started = Instant::now();
    let mut events = client.generate_stream(request).await.expect("the stream starts").into_inner();
    let (mut text, mut tokens, mut first) = (String::new(), 0, None);
    while let Some(event) = events.next().await {
        match event.expect("an event").event {
            Some(pb::generate_stream_response::Event::Delta(delta)) if !delta.text.is_empty() => {
                first.get_or_insert_with(|| started.elapsed());
                tokens += 1;
                text.push_str(&delta.text);
            }
            _ => {}
        }
    }
    let total = started.elapsed();
    (ms(first.unwrap_or(total)), ms(total), tokens, text)
}

/// FNV-1a of a text: which requests generated the same tokens, without the texts in the raw file.
fn fnv1a(text: &str) -> String {
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("{hash:016x}")
}

/// This process's CPU time (user and system, every thread) in ms, from /proc/self/stat (clock ticks of 10 ms).
fn cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // After the command name in parentheses: state is field 3, utime 14 and stime 15.
    let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
    let ticks = |i: usize| fields.get(i - 3).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(14) + ticks(15)) * 10.0
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn quantile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return 0.0;
    }
    let at = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (at - lo as f64)
}

fn stats(values: &[f64]) -> Value {
    let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
    json!({"mean": mean, "p10": quantile(values, 0.1), "p50": quantile(values, 0.5), "p90": quantile(values, 0.9)})
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Args = clap::Parser::parse();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let setup = ModelSetup::find(&root).expect("llama-cpp-python and the model: run scripts/setup_model.sh");
    let server = setup.start(ServerOptions { logits_all: false, threads: args.threads, ..ServerOptions::default() });
    let url = server.url();
    let config = GatewayConfig {
        pools: vec![PoolConfig {
            model: "smollm2".into(),
            backends: vec![BackendConfig { kind: BackendKind::Llamacpp, url: url.clone(), ..Default::default() }],
            ..Default::default()
        }],
        ..GatewayConfig::default()
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        kforge_gateway::serve(config, listener, std::future::pending::<()>()).await.expect("the gateway serves");
    });
    let mut client = GatewayClient::connect(addr).await.expect("connect");
    let http = reqwest::Client::new();

    // One warm-up request per prompt and path: the first request of a prompt processes it; later ones reuse the
    // server's cached prefix whichever path sent them.
    for prompt in PROMPTS {
        direct(&http, &url, prompt, 4).await;
        through(&mut client, prompt, 4).await;
    }
    let mut samples = Vec::new();
    let started = Instant::now();
    for pair in 0..args.pairs {
        let prompt = pair % PROMPTS.len();
        // Which path goes first flips every round of the prompts, so each prompt is sent first by both paths.
        let order: [&'static str; 2] =
            if (pair / PROMPTS.len()).is_multiple_of(2) { ["direct", "gateway"] } else { ["gateway", "direct"] };
        for (position, path) in order.into_iter().enumerate() {
            let cpu_before = cpu_ms();
            let (ttft_ms, total_ms, tokens, text) = match path {
                "direct" => direct(&http, &url, PROMPTS[prompt], args.max_tokens).await,
                _ => through(&mut client, PROMPTS[prompt], args.max_tokens).await,
            };
            let cpu_ms = cpu_ms() - cpu_before;
            samples.push(Sample { path, pair, position, prompt, ttft_ms, total_ms, tokens, text, cpu_ms });
        }
    }
    let elapsed = started.elapsed();

    // The two positions differ by the prompt's processing (new, or the cached prefix): compared within each.
    let of = |path: &str, position: usize| {
        samples.iter().filter(|s| s.path == path && s.position == position).cloned().collect::<Vec<Sample>>()
    };
    let field = |samples: &[Sample], f: fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<f64>>();
    let measures: [(&str, Measure); 3] =
        [("ttft_ms", |s| s.ttft_ms), ("total_ms", |s| s.total_ms), ("decode_tokens_per_s", Sample::decode_tps)];
    let mut positions = serde_json::Map::new();
    for (position, name) in [(0, "first_in_pair"), (1, "second_in_pair")] {
        let (direct, gateway) = (of("direct", position), of("gateway", position));
        let mut entry = serde_json::Map::new();
        for (measure, f) in measures {
            let (d, g) = (field(&direct, f), field(&gateway, f));
            let (dp50, gp50) = (quantile(&d, 0.5), quantile(&g, 0.5));
            entry.insert(
                measure.into(),
                json!({"direct": stats(&d), "gateway": stats(&g), "p50_difference": gp50 - dp50,
                       "p50_ratio": if dp50 == 0.0 { 0.0 } else { gp50 / dp50 }}),
            );
        }
        // Greedy decoding of the same prompt from the same cache state: the same tokens on both paths.
        let same = direct.iter().filter(|d| gateway.iter().any(|g| g.prompt == d.prompt && g.text == d.text)).count();
        entry.insert("direct_texts_also_seen_through_the_gateway".into(), json!(format!("{same}/{}", direct.len())));
        positions.insert(name.into(), Value::Object(entry));
    }
    // The gateway's own work, whatever the machine's load: this process's CPU time on the gateway path less on the
    // direct path (both include the client's), per request and per token.
    let cpu = |path: &str| samples.iter().filter(|s| s.path == path).map(|s| s.cpu_ms).sum::<f64>();
    let tokens = |path: &str| samples.iter().filter(|s| s.path == path).map(|s| s.tokens).sum::<usize>() as f64;
    let requests = args.pairs.max(1) as f64;
    let summary = json!({
        "cpu_ms_of_this_process": {
            "direct_total": cpu("direct"),
            "gateway_total": cpu("gateway"),
            "gateway_added_per_request": (cpu("gateway") - cpu("direct")) / requests,
            "gateway_added_per_token_us": (cpu("gateway") - cpu("direct")) * 1e3 / tokens("gateway").max(1.0),
        },
        "pairs": args.pairs,
        "max_tokens": args.max_tokens,
        "server_threads": args.threads,
        "elapsed_s": elapsed.as_secs_f64(),
        "tokens_per_request": stats(&field(&samples, |s| s.tokens as f64)),
        "by_position": positions,
    });
    std::fs::create_dir_all(&args.out).expect("output directory");
    let raw: String = samples.iter().map(|s| s.json().to_string() + "\n").collect();
    std::fs::write(args.out.join("raw.jsonl"), raw).expect("raw.jsonl");
    let text = serde_json::to_string_pretty(&summary).expect("json");
    std::fs::write(args.out.join("summary.json"), &text).expect("summary.json");
    println!("{text}");
}
