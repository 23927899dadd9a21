//! kill -9 in the middle of a job: the real orchestrator binary, against fake peers that count what they receive
//! and answer, is killed while a generation, an evaluation and a scoring call are in flight, and restarted on the
//! same store each time. The job must finish with every turn recorded once, and the peers must have answered each
//! (task, trajectory, turn) one generation and one evaluation: a response stored before its evaluation is reused
//! after a restart, and so is an evaluation stored before its scoring. Runs on SQLite, and on PostgreSQL in a
//! throwaway cluster (a visible SKIP where its binaries are missing; a failure under KFORGE_CI=1).

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kforge_orchestrator::store::Store;
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_test_support::{ReservedPort, health};
use support::{Hold, key};

const TASKS: [&str; 2] = ["a", "b"];
const TRAJECTORIES: u32 = 2;
const TURNS: u32 = 3;

/// How long a starting orchestrator may take to listen (a loaded CI machine included).
const START: Duration = Duration::from_secs(60);

struct Orchestrator {
    child: Child,
    /// The port it listens on, reserved while it lives (no other bind of port 0 can take it meanwhile).
    _port: ReservedPort,
}

impl Orchestrator {
    /// Starts the binary on a reserved port with this store and the fakes as peers; waits until it listens.
    async fn start(
        dir: &Path,
        store: &str,
        peers: &str,
        generation: u32,
    ) -> (Self, OrchestratorClient<tonic::transport::Channel>) {
        let port = ReservedPort::new();
        let config = dir.join(format!("orchestrator-{generation}.toml"));
        std::fs::write(
            &config,
            format!(
                "[orchestrator]\nstore = \"{store}\"\ninstance = \"durability\"\nmax_concurrent_episodes = 1\n\
                 [orchestrator.server]\nlisten = \"{}\"\n\
                 [orchestrator.peers]\ngateway = \"{peers}\"\nevaluator = \"{peers}\"\nreward = \"{peers}\"\n",
                port.addr()
            ),
        )
        .expect("config written");
        let log = std::fs::File::create(dir.join(format!("orchestrator-{generation}.log"))).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_kforge-orchestrator"))
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("the orchestrator starts");
        let channel = health::connected(&port.url(), START).await;
        (Self { child, _port: port }, OrchestratorClient::new(channel))
    }

    /// SIGKILL: no drain, no shutdown code runs.
    fn kill9(mut self) {
        self.child.kill().expect("SIGKILL sent");
        self.child.wait().expect("reaped");
    }
}

impl Drop for Orchestrator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spec() -> pb::JobSpec {
    let task = |id: &str| pb::Task {
        task_id: id.into(),
        source: format!(
            "# task {id}\nclass Model:\n    pass\n\ndef get_inputs():\n    return []\n\ndef get_init_inputs():\n    return []\n"
        ),
    };
    pb::JobSpec {
        kind: pb::JobKind::Rollout.into(),
        recipe: "kevin".into(),
        task_set: "inline".into(),
        tasks: TASKS.iter().map(|id| task(id)).collect(),
        model: "fake".into(),
        trajectories_per_task: TRAJECTORIES,
        turns: TURNS,
        ..Default::default()
    }
}

async fn killed_and_resumed(test: &str, store_url: &str) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("durability-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test dir");
    let (peers, fakes) = support::start_fakes().await;

    // 1. Killed while turn 1 of a/1 is being generated (nothing of it stored yet).
    let mut held = fakes.hold(Hold::Generate(key("a", 1, 1)));
    let (orchestrator, mut client) = Orchestrator::start(&dir, store_url, &peers, 1).await;
    let job = client
        .submit_job(pb::SubmitJobRequest { spec: Some(spec()), idempotency_key: format!("durability-{test}") })
        .await
        .expect("submitted")
        .into_inner();
    held.recv().await.expect("the generation was held");
    orchestrator.kill9();

    // 2. Restarted: it resumes the job by itself, and is killed while turn 1 of b/0 is being evaluated (its
    //    response is stored).
    let mut held = fakes.hold(Hold::Evaluate(key("b", 0, 1)));
    let (orchestrator, _) = Orchestrator::start(&dir, store_url, &peers, 2).await;
    held.recv().await.expect("the evaluation was held");
    orchestrator.kill9();

    // 3. Restarted: killed while that turn is being scored (its evaluation is stored).
    let mut held = fakes.hold(Hold::NextScore);
    let (orchestrator, _) = Orchestrator::start(&dir, store_url, &peers, 3).await;
    held.recv().await.expect("the scoring was held");
    orchestrator.kill9();

    // 4. Restarted: the job finishes.
    let (orchestrator, mut client) = Orchestrator::start(&dir, store_url, &peers, 4).await;
    let mut stream =
        client.watch_job(pb::WatchJobRequest { job_id: job.job_id.clone() }).await.expect("watched").into_inner();
    let mut last = None;
    while let Some(progress) = stream.message().await.expect("progress") {
        last = progress.job;
    }
    let finished = last.expect("at least one update");
    assert_eq!(finished.state(), pb::JobState::Succeeded, "{finished:?}\nlogs in {}", dir.display());
    let expected_turns = u64::from(TRAJECTORIES * TURNS) * TASKS.len() as u64;
    assert_eq!((finished.turns_done, finished.turns_total), (expected_turns, expected_turns));
    assert_eq!(finished.episodes_done, finished.episodes_total);
    let metrics = finished.metrics.expect("metrics");
    assert_eq!((metrics.turns, metrics.evaluated, metrics.correct), (expected_turns, expected_turns, expected_turns));

    // Every turn exists once, in order, complete.
    let listed = client
        .list_trajectories(pb::ListTrajectoriesRequest { job_id: job.job_id.clone(), ..Default::default() })
        .await
        .expect("listed")
        .into_inner();
    let mut seen = Vec::new();
    for trajectory in &listed.trajectories {
        for turn in &trajectory.turns {
            assert!(turn.error.is_empty(), "{turn:?}");
            assert_eq!((turn.verdict(), turn.score, turn.speedup), (pb::Verdict::Correct, Some(1.8), Some(1.5)));
            assert!(turn.completion.as_ref().is_some_and(|c| c.token_ids == [1, 2, 3]), "the response is kept");
            seen.push(key(&turn.task_id, turn.trajectory, turn.turn));
        }
    }
    let all: Vec<String> = TASKS
        .iter()
        .flat_map(|task| (0..TRAJECTORIES).flat_map(move |t| (0..TURNS).map(move |n| key(task, t, n))))
        .collect();
    assert_eq!(seen, all);
    let store = Store::open(store_url).await.expect("the test opens the store");
    assert_eq!(store.turns(&job.job_id).await.expect("read").len(), all.len(), "one row per turn");

    // The peers answered each turn's generation and evaluation once. The held calls were received a second time
    // (they never returned, so the restarted orchestrator asked again), and nothing else was.
    let (generate_received, generate_answered) = fakes.generate_counts();
    let (evaluate_received, evaluate_answered) = fakes.evaluate_counts();
    for key in &all {
        assert_eq!(generate_answered.get(key), Some(&1), "{key} generated once: {generate_answered:?}");
        assert_eq!(evaluate_answered.get(key), Some(&1), "{key} evaluated once: {evaluate_answered:?}");
        let held_generation = *key == support::key("a", 1, 1);
        let held_evaluation = *key == support::key("b", 0, 1);
        assert_eq!(generate_received.get(key), Some(&(1 + u32::from(held_generation))), "{key}");
        assert_eq!(evaluate_received.get(key), Some(&(1 + u32::from(held_evaluation))), "{key}");
    }
    assert_eq!((generate_answered.len(), evaluate_answered.len()), (all.len(), all.len()));
    drop(orchestrator);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_killed_three_times_finishes_with_every_turn_once_on_sqlite() {
    let dir: PathBuf = Path::new(env!("CARGO_TARGET_TMPDIR")).join("durability-sqlite-store");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("store dir");
    let url = format!("sqlite://{}", dir.join("kforge.db").display());
    killed_and_resumed("sqlite", &url).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_killed_three_times_finishes_with_every_turn_once_on_postgres() {
    let Some(postgres) = support::Postgres::start("durability") else { return };
    killed_and_resumed("postgres", &postgres.url).await;
}
