//! The orchestrator's own cost per turn: a job of many trajectories in flight at once against peers in this
//! process that do no work but take time: a generation and an evaluation each take a time drawn uniformly between
//! a quarter and seven quarters of `--generate-ms` and `--evaluate-ms` (so that a thousand trajectories started
//! together spread out, as real ones do), scoring answers at once. A turn's overhead is its wall time
//! (`TurnRecord.wall_time_s`: the three calls, the prompt, three store commits, any wait for the orchestrator's CPU
//! or store) less the generation and evaluation time its fakes measured (they run on a runtime of their own).
//! With both at 0 every turn contends for the orchestrator at once: the figures are then its capacity (turns per
//! second), not a turn's overhead. Prints JSON: overhead per turn p50/p99/max, the job's wall time, turns per second.
//!
//! ```text
//! orchestrator-overhead [--trajectories 1000] [--turns 3] [--recipe kevin] [--generate-ms 2000]
//!                       [--evaluate-ms 2000] [--store PATH|sqlite::memory:]
//!                       [--durability process|power_loss]
//! ```
//! The store defaults to a SQLite file in a fresh temporary directory (the orchestrator's default kind of store).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kforge_orchestrator::store::Durability;
use kforge_orchestrator::{InFlightConfig, OrchestratorConfig, PeersConfig};
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_test_support::health;
use kforge_test_support::peers::{self, Answers};
use serde_json::json;
use tonic::Status;

const TASK: &str = "import torch\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n\n\
                    def get_inputs():\n    return [torch.randn(4)]\n\ndef get_init_inputs():\n    return []\n";
const ANSWER: &str = "Returns its input.\n\n```python\nimport torch\n\nclass ModelNew(torch.nn.Module):\n    \
                      def forward(self, x):\n        return x\n```\n";
/// Trajectories per task: the job's trajectories are spread over `trajectories / PER_TASK` tasks.
const PER_TASK: u32 = 8;

/// How long each generation took, by (task, trajectory, turn), in milliseconds.
type Generated = Arc<Mutex<BTreeMap<(String, u32, u32), f64>>>;

/// What the fake peers answer: a generation and an evaluation each take a drawn time around these means.
#[derive(Debug, Clone)]
struct Timed {
    generate: std::time::Duration,
    evaluate: std::time::Duration,
    generated: Generated,
}

/// A time between a quarter and seven quarters of `mean`, from a hash of the call's keys (splitmix64): the same
/// keys give the same time, so the overhead can take each turn's own times off.
fn drawn(mean: std::time::Duration, task_id: &str, trajectory: u32, turn: u32) -> std::time::Duration {
    let mut z =
        task_id.bytes().fold(u64::from(trajectory) << 32 | u64::from(turn), |h, b| h.rotate_left(5) ^ u64::from(b));
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    mean.mul_f64(0.25 + 1.5 * (z >> 11) as f64 / (1u64 << 53) as f64)
}

/// The shared fake peers' plumbing (`kforge_test_support::peers`) with answers that take time; scores are 1.8.
impl Answers for Timed {
    async fn generate(&self, request: pb::GenerateRequest) -> Result<pb::GenerateResponse, Status> {
        let keys = request.keys.unwrap_or_default();
        let took = drawn(self.generate, &keys.task_id, keys.trajectory, keys.turn);
        let started = std::time::Instant::now();
        tokio::time::sleep(took).await;
        let key = (keys.task_id, keys.trajectory, keys.turn);
        self.generated.lock().expect("never poisoned").insert(key, started.elapsed().as_secs_f64() * 1e3);
        Ok(pb::GenerateResponse {
            completions: vec![pb::Completion {
                text: ANSWER.into(),
                finish_reason: "stop".into(),
                ..Default::default()
            }],
            usage: Some(pb::Usage { prompt_tokens: 200, completion_tokens: 40, ..Default::default() }),
            ..Default::default()
        })
    }

    async fn evaluate(&self, request: pb::EvaluateRequest) -> Result<pb::EvaluateResponse, Status> {
        let took = drawn(self.evaluate, &request.idempotency_key, 0, 0);
        let started = std::time::Instant::now();
        tokio::time::sleep(took).await;
        let took = started.elapsed();
        let timing = |ms| Some(pb::TimingStats { median_ms: ms, ..Default::default() });
        Ok(pb::EvaluateResponse {
            // The time it took (the sleep as it ran), for the overhead: the turn keeps the evaluation.
            stage_ms: [("fake".to_owned(), took.as_secs_f64() * 1e3)].into(),
            verdict: pb::Verdict::Correct.into(),
            speedup_eager: 1.5,
            candidate_timing: timing(2.0),
            eager_timing: timing(3.0),
            ..Default::default()
        })
    }

    fn score(&self, _outcome: &pb::KernelOutcome) -> f64 {
        1.8
    }
}

/// The orchestrator's own cost per turn, with many trajectories in flight against peers that take time.
#[derive(clap::Parser)]
#[command(name = "orchestrator-overhead")]
struct Args {
    /// Trajectories in the job, all in flight at once.
    #[arg(long, default_value_t = 1000)]
    trajectories: u32,
    /// Turns per trajectory.
    #[arg(long, default_value_t = 3)]
    turns: u32,
    /// The job's recipe.
    #[arg(long, default_value = "kevin")]
    recipe: String,
    /// A generation's mean time in the fake gateway, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    generate_ms: u64,
    /// An evaluation's mean time in the fake evaluator, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    evaluate_ms: u64,
    /// The store: a SQLite file's path or `sqlite::memory:` (default: a file in a fresh temporary directory).
    #[arg(long)]
    store: Option<String>,
    /// The store's durability: process or power_loss.
    #[arg(long, default_value = "process", value_parser = durability)]
    durability: Durability,
}

fn durability(text: &str) -> Result<Durability, String> {
    match text {
        "process" => Ok(Durability::Process),
        "power_loss" => Ok(Durability::PowerLoss),
        other => Err(format!("process or power_loss, not {other}")),
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[tokio::main]
async fn main() {
    let Args { trajectories, turns, recipe, generate_ms, evaluate_ms, store, durability } = clap::Parser::parse();
    let ms = std::time::Duration::from_millis;
    let peer = Timed { generate: ms(generate_ms), evaluate: ms(evaluate_ms), generated: Arc::default() };
    let generated = peer.generated.clone();
    let dir = std::env::temp_dir().join(format!("kforge-orchestrator-overhead-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let store = store.unwrap_or_else(|| dir.join("orchestrator.db").display().to_string());

    // The fakes run on a runtime of their own (one thread), apart from the orchestrator's workers.
    let peers = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    peers.set_nonblocking(true).expect("non-blocking");
    let peers_url = format!("http://{}", peers.local_addr().expect("address"));
    let answers = peer.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build();
        runtime.expect("the fakes' runtime").block_on(async move {
            let peers = tokio::net::TcpListener::from_std(peers).expect("listener");
            let (_state, server) = peers::serve(peers, answers);
            server.await
        })
    });
    let config = OrchestratorConfig {
        store: store.clone(),
        store_durability: durability,
        peers: PeersConfig {
            gateway: peers_url.clone(),
            evaluator: peers_url.clone(),
            reward: peers_url.clone(),
            profiler: peers_url,
            client: Default::default(),
        },
        max_concurrent_episodes: trajectories,
        max_in_flight: InFlightConfig {
            gateway: trajectories,
            evaluator: trajectories,
            reward: trajectories,
            ..Default::default()
        },
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(kforge_orchestrator::serve_with_http(config, listener, None, std::future::pending()));
    let channel = health::connected(&address, std::time::Duration::from_secs(60)).await;
    let mut client = OrchestratorClient::new(channel).max_decoding_message_size(1 << 30);

    let tasks = trajectories.div_ceil(PER_TASK);
    let spec = pb::JobSpec {
        kind: pb::JobKind::Rollout.into(),
        recipe: recipe.clone(),
        task_set: "inline".into(),
        tasks: (0..tasks).map(|i| pb::Task { task_id: format!("bench/{i}"), source: TASK.into() }).collect(),
        model: "instant".into(),
        trajectories_per_task: PER_TASK,
        turns,
        max_concurrent_episodes: trajectories,
        ..Default::default()
    };
    let started = Instant::now();
    let job = client
        .submit_job(pb::SubmitJobRequest { spec: Some(spec), idempotency_key: String::new() })
        .await
        .expect("submitted")
        .into_inner();
    let mut updates =
        client.watch_job(pb::WatchJobRequest { job_id: job.job_id.clone() }).await.expect("watched").into_inner();
    while updates.message().await.expect("an update").is_some() {}
    let wall = started.elapsed().as_secs_f64();
    let mut per_turn: Vec<f64> = Vec::new();
    let mut page_token = String::new();
    loop {
        let request = pb::ListTrajectoriesRequest { job_id: job.job_id.clone(), page_token, ..Default::default() };
        let page = client.list_trajectories(request).await.expect("listed").into_inner();
        for turn in page.trajectories.iter().flat_map(|t| &t.turns) {
            let key = (turn.task_id.clone(), turn.trajectory, turn.turn);
            let generated = generated.lock().expect("never poisoned").get(&key).copied().unwrap_or(0.0);
            let evaluated = turn.evaluation.as_ref().and_then(|e| e.stage_ms.get("fake")).copied().unwrap_or(0.0);
            per_turn.push(turn.wall_time_s * 1e3 - generated - evaluated);
        }
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    per_turn.sort_by(f64::total_cmp);
    let report = json!({
        "trajectories": tasks * PER_TASK,
        "turns_per_trajectory": turns,
        "recipe": recipe,
        "store": store,
        "durability": format!("{durability:?}"),
        "turns": per_turn.len(),
        "generate_ms": peer.generate.as_millis() as u64,
        "evaluate_ms": peer.evaluate.as_millis() as u64,
        "overhead_ms_per_turn": { "p50": quantile(&per_turn, 0.5), "p99": quantile(&per_turn, 0.99), "max": per_turn.last() },
        "job_wall_s": wall,
        "turns_per_s": per_turn.len() as f64 / wall,
    });
    println!("{report:#}");
    let _ = std::fs::remove_dir_all(&dir);
}
