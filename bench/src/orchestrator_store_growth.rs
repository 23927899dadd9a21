//! How much a job's turns make the orchestrator's SQLite store grow: a job of `--tasks` example tasks x
//! `--trajectories` x `--turns` runs into a fresh SQLite file against peers in this process; the file's size (the
//! database and its write-ahead log, after a TRUNCATE checkpoint) is read before and after, and the growth divided by
//! the turns recorded. With the limits (`orchestrator.limits.total_turns`), this bounds a job's share of the disk.
//!
//! `--mode failing`: every generation fails as the replay model's does for a turn its file lacks (NOT_FOUND): the
//! records are the prompt and the error, what a job whose turns all fail writes. `--mode answered`: every
//! generation answers with the example task's source as a `ModelNew` in a reasoning-and-code response, and every
//! evaluation is CORRECT with three timings of `--samples` timed calls each (the evaluator keeps every sample), stage
//! times and findings shaped as the evaluator's (without a compile log: the evaluator's logs of failed compiles and
//! runs add to a turn what they hold). The prompts are the recipe's,
//! built from the example tasks' sources (`kevin`'s grow with each earlier attempt). Prints JSON: the turns, the
//! store's bytes before and after, bytes per turn, the write-ahead log's bytes when the job ended (before the
//! checkpoint), the mean proto-encoded turn record's bytes.
//!
//! ```text
//! orchestrator-store-growth [--mode failing|answered] [--recipe single-turn] [--tasks 13] [--trajectories 8]
//!                           [--turns 1] [--samples 200] [--dir DIR (kept)]
//! ```

use std::path::Path;

use kforge_orchestrator::store::Store;
use kforge_orchestrator::{BreakerConfig, OrchestratorConfig, PeersConfig};
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_test_support::peers::{self, Answers};
use kforge_test_support::{Wait, health};
use prost::Message as _;
use serde_json::json;
use tonic::Status;

/// What the fake peers answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Failing,
    Answered,
}

#[derive(Debug, Clone, Copy)]
struct Peers {
    mode: Mode,
    /// Timed calls in each timing (the evaluator keeps every sample: 50 to 1000 by its defaults).
    samples: usize,
}

/// A response shaped as a model's: an opening, reasoning, a summary and the kernel in one fenced block.
fn response(task_id: &str, turn: u32) -> String {
    let candidate = kforge_tasks::examples()
        .into_iter()
        .find(|t| t.id == task_id)
        .map(|t| t.source.replace("class Model", "class ModelNew"))
        .unwrap_or_default();
    format!(
        "Okay, turn {turn}: the reference computes its output with PyTorch operators; a kernel that fuses them \
         reads the input once and writes the output once, so memory traffic halves. I keep the same signature and \
         dtypes, launch one thread per element, and check the bounds.\n\nSummary: fused the element-wise work into \
         one pass over the input.\n\n```python\n{candidate}```\n"
    )
}

/// The shared fake peers' plumbing (`kforge_test_support::peers`) with answers of a real job's size.
impl Answers for Peers {
    async fn generate(&self, request: pb::GenerateRequest) -> Result<pb::GenerateResponse, Status> {
        let keys = request.keys.unwrap_or_default();
        if self.mode == Mode::Failing {
            return Err(Status::not_found(format!(
                "replay file has no response for job {} task {} trajectory {} turn {}",
                keys.job_id, keys.task_id, keys.trajectory, keys.turn
            )));
        }
        Ok(pb::GenerateResponse {
            completions: vec![pb::Completion {
                text: response(&keys.task_id, keys.turn),
                reasoning: "Okay, let me look at what the reference does first.".into(),
                finish_reason: "stop".into(),
                ..Default::default()
            }],
            usage: Some(pb::Usage { prompt_tokens: 900, completion_tokens: 600, ..Default::default() }),
            ..Default::default()
        })
    }

    async fn evaluate(&self, _: pb::EvaluateRequest) -> Result<pb::EvaluateResponse, Status> {
        let samples = self.samples;
        let timing = |median_ms: f64| {
            Some(pb::TimingStats {
                median_ms,
                iqr_ms: median_ms * 0.04,
                mean_ms: median_ms * 1.02,
                stderr_ms: median_ms * 0.003,
                // Distinct values, as measured ones are (a constant would pack no smaller, but be honest).
                samples_ms: (0..samples).map(|i| median_ms * (0.95 + (i % 97) as f64 * 0.001)).collect(),
            })
        };
        let stages = ["queue", "compile", "reference", "correctness", "timing", "baseline", "census", "recheck"];
        let finding = |code: &str, message: &str| pb::Finding {
            code: code.into(),
            message: message.into(),
            line: 12,
            ..Default::default()
        };
        Ok(pb::EvaluateResponse {
            verdict: pb::Verdict::Correct.into(),
            findings: vec![
                finding("static.torch_fallback", "the candidate calls torch.relu inside forward"),
                finding("runtime.low_profiling_ratio", "the candidate's own kernels ran 40% of its device time"),
            ],
            candidate_timing: timing(2.0),
            eager_timing: timing(3.0),
            compile_timing: timing(2.6),
            speedup_eager: 1.5,
            speedup_compile: 1.3,
            stage_ms: stages.iter().enumerate().map(|(i, s)| ((*s).to_owned(), 100.0 * i as f64 + 3.25)).collect(),
            device: "cpu".into(),
            ..Default::default()
        })
    }

    fn score(&self, _outcome: &pb::KernelOutcome) -> f64 {
        1.8
    }

    /// Advantages as the returns: each turn gets a return and an advantage stored with it, as a real job's do.
    fn advantages(&self, groups: Vec<pb::AdvantageGroup>) -> Vec<pb::AdvantageGroup> {
        groups
    }
}

/// How much a job's turns make the orchestrator's SQLite store grow.
#[derive(clap::Parser)]
#[command(name = "orchestrator-store-growth")]
struct Args {
    /// What the fake peers answer: failing (every generation fails) or answered (every evaluation CORRECT).
    #[arg(long, default_value = "answered", value_parser = mode)]
    mode: Mode,
    /// The job's recipe.
    #[arg(long, default_value = "single-turn")]
    recipe: String,
    /// Example tasks in the job.
    #[arg(long, default_value_t = 13)]
    tasks: usize,
    /// Trajectories per task.
    #[arg(long, default_value_t = 8)]
    trajectories: u32,
    /// Turns per trajectory.
    #[arg(long, default_value_t = 1)]
    turns: u32,
    /// Timed calls per timing in an answered evaluation.
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// The directory of the store, emptied first and kept (default: a fresh temporary directory).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

fn mode(text: &str) -> Result<Mode, String> {
    match text {
        "failing" => Ok(Mode::Failing),
        "answered" => Ok(Mode::Answered),
        other => Err(format!("failing or answered, not {other}")),
    }
}

/// Checkpoints until the log is copied back whole and truncated (another connection's read can hold it up), at most
/// for ten seconds.
async fn checkpoint(store: &Store) {
    Wait::new("the write-ahead log checkpointed whole")
        .within(std::time::Duration::from_secs(10))
        .every(std::time::Duration::from_millis(100))
        .until(|| async { store.checkpoint().await.expect("checkpointed") })
        .await;
}

/// The store's bytes on disk: the database, its write-ahead log and its shared-memory index.
fn store_bytes(path: &Path) -> u64 {
    ["", "-wal", "-shm"]
        .iter()
        .map(|suffix| {
            let mut name = path.as_os_str().to_owned();
            name.push(suffix);
            std::fs::metadata(&name).map_or(0, |m| m.len())
        })
        .sum()
}

#[tokio::main]
async fn main() {
    let Args { mode, recipe, tasks, trajectories, turns, samples, dir } = clap::Parser::parse();
    let default_dir = std::env::temp_dir().join(format!("kforge-store-growth-{}", std::process::id()));
    let dir = dir.unwrap_or_else(|| default_dir.clone());
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a fresh directory");
    let path = dir.join("orchestrator.db");
    let url = path.display().to_string();

    // The empty store, migrated: what the job's turns are measured against.
    let store = Store::open(&url).await.expect("the store opens");
    checkpoint(&store).await;
    let before = store_bytes(&path);

    let (peers_url, _fakes) = peers::start_with(Peers { mode, samples }).await;
    let config = OrchestratorConfig {
        store: url.clone(),
        peers: PeersConfig {
            gateway: peers_url.clone(),
            evaluator: peers_url.clone(),
            reward: peers_url.clone(),
            profiler: peers_url,
            client: Default::default(),
        },
        // Every turn of a failing job is recorded, as it was before the breaker.
        breaker: BreakerConfig { failed_turns: 0 },
        limits: kforge_orchestrator::LimitsConfig {
            tasks: 0,
            trajectories_per_task: 0,
            turns: 0,
            total_turns: 0,
            task_source_bytes: 0,
        },
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = format!("http://{}", listener.local_addr().expect("address"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(kforge_orchestrator::serve_with_http(config, listener, None, async {
        let _ = stopped.await;
    }));
    let channel = health::connected(&address, std::time::Duration::from_secs(60)).await;
    let mut client = OrchestratorClient::new(channel).max_decoding_message_size(1 << 30);
    let spec = pb::JobSpec {
        kind: pb::JobKind::Rollout.into(),
        recipe: recipe.clone(),
        task_set: "examples".into(),
        max_tasks: tasks as u32,
        model: "replay".into(),
        trajectories_per_task: trajectories,
        turns,
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let job = client
        .submit_job(pb::SubmitJobRequest { spec: Some(spec), idempotency_key: String::new() })
        .await
        .expect("submitted")
        .into_inner();
    let mut updates =
        client.watch_job(pb::WatchJobRequest { job_id: job.job_id.clone() }).await.expect("watched").into_inner();
    let mut last = None;
    while let Some(update) = updates.message().await.expect("an update") {
        last = update.job;
    }
    let wall_s = started.elapsed().as_secs_f64();
    let finished = last.expect("the job's last state");
    // The write-ahead log as the job left it: the background checkpoints (PASSIVE, every second) copy it back but
    // never shrink it.
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let wal_at_end = std::fs::metadata(&wal).map_or(0, |m| m.len());
    let records = store.turns(&job.job_id).await.expect("the turns");
    let record_bytes: usize = records.iter().map(|r| r.encoded_len()).sum();
    let _ = stop.send(());
    served.await.expect("joined").expect("the orchestrator stops");
    checkpoint(&store).await;
    let after = store_bytes(&path);
    let recorded = records.len().max(1) as f64;
    let growth = after.saturating_sub(before);
    println!(
        "{}",
        json!({
            "mode": format!("{mode:?}").to_lowercase(),
            "samples_per_timing": if mode == Mode::Answered { samples } else { 0 },
            "recipe": recipe,
            "job_state": format!("{:?}", finished.state()),
            "turns_total": job.turns_total,
            "turns_recorded": records.len(),
            "store_bytes_before": before,
            "store_bytes_after": after,
            "bytes_per_turn": (growth as f64 / recorded).round(),
            "wal_bytes_at_end": wal_at_end,
            "record_bytes_mean": (record_bytes as f64 / recorded).round(),
            "wall_s": (wall_s * 10.0).round() / 10.0,
        })
    );
    drop(store);
    // A directory the command named is left for a look inside.
    if dir == default_dir {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
