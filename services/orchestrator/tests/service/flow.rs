//! The orchestrator in this process (its real `serve`, an in-memory SQLite store) against fake peers: flow
//! control (retries of a busy evaluator and of retryable infrastructure errors, never scored; a failed episode
//! recorded, not fatal; evaluations in flight bounded across episodes), bad input named by field or line, a
//! missing peer named, and the job API (ListJobs, WatchJob's stages, ExportSamples' cursor, ResumeJob).

use crate::support::{self, TASK, spec};

use std::path::Path;

use kforge_orchestrator::OrchestratorConfig;
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_test_support::{ReservedPort, eventually};
use support::{Answer, Hold, key, orchestrator};
use tonic::transport::Channel;

async fn submit(client: &mut OrchestratorClient<Channel>, spec: pb::JobSpec) -> Result<pb::Job, tonic::Status> {
    client
        .submit_job(pb::SubmitJobRequest { spec: Some(spec), idempotency_key: String::new() })
        .await
        .map(|r| r.into_inner())
}

/// Every update of the job until it ends.
async fn watch(client: &mut OrchestratorClient<Channel>, job_id: &str) -> Vec<pb::JobProgress> {
    let mut stream =
        client.watch_job(pb::WatchJobRequest { job_id: job_id.into() }).await.expect("watched").into_inner();
    let mut updates = Vec::new();
    while let Some(update) = stream.message().await.expect("an update") {
        updates.push(update);
    }
    updates
}

async fn turns(client: &mut OrchestratorClient<Channel>, job_id: &str) -> Vec<pb::TurnRecord> {
    let request = pb::ListTrajectoriesRequest { job_id: job_id.into(), ..Default::default() };
    let listed = client.list_trajectories(request).await.expect("listed").into_inner();
    listed.trajectories.into_iter().flat_map(|t| t.turns).collect()
}

/// Reads updates until the turns in flight by stage are `(generating, evaluating, scoring)`.
async fn until_in_flight(stream: &mut tonic::Streaming<pb::JobProgress>, stages: (u64, u64, u64)) {
    loop {
        let update = stream.message().await.expect("an update").expect("the job is not over");
        if update.in_flight.is_some_and(|s| (s.generating, s.evaluating, s.scoring) == stages) {
            return;
        }
    }
}

fn last_job(updates: &[pb::JobProgress]) -> pb::Job {
    updates.last().and_then(|u| u.job.clone()).expect("an update with the job")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_evaluator_and_retryable_infra_errors_are_retried_and_never_scored() {
    let (peers, fakes) = support::start_fakes().await;
    fakes.script(&key("a", 0, 0), [Answer::Busy, Answer::Busy]);
    fakes.script(&key("a", 0, 1), [Answer::Infra { retryable: true }]);
    fakes.script(&key("a", 0, 2), vec![Answer::Infra { retryable: true }; 5]);
    fakes.script(&key("a", 0, 3), [Answer::Infra { retryable: false }]);
    let mut running = orchestrator(&peers, |c| c.retry.attempts = 3).await;
    let job = submit(&mut running.client, spec(&["a"], 1, 4)).await.expect("submitted");
    let finished = last_job(&watch(&mut running.client, &job.job_id).await);
    assert_eq!(finished.state(), pb::JobState::Succeeded, "{finished:?}");

    let turns = turns(&mut running.client, &job.job_id).await;
    let outcome: Vec<(pb::Verdict, Option<f64>)> = turns.iter().map(|t| (t.verdict(), t.score)).collect();
    assert_eq!(
        outcome,
        [
            (pb::Verdict::Correct, Some(1.8)),
            (pb::Verdict::Correct, Some(1.8)),
            (pb::Verdict::InfraError, None),
            (pb::Verdict::InfraError, None)
        ],
        "busy and retryable answers retried until correct; retries spent or not retryable: recorded, not scored"
    );
    let (received, _) = fakes.evaluate_counts();
    let calls: Vec<u32> = (0..4).map(|turn| received[&key("a", 0, turn)]).collect();
    assert_eq!(calls, [3, 2, 3, 1]);
    assert_eq!(*fakes.scores.lock().expect("lock"), 2, "only the two correct evaluations reached the reward service");
    let metrics = finished.metrics.expect("metrics");
    assert_eq!((metrics.turns, metrics.evaluated, metrics.infra_errors, metrics.correctness), (4, 2, 2, 1.0));
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsteady_timing_is_measured_again_before_it_is_scored() {
    let (peers, fakes) = support::start_fakes().await;
    // Turn 0: unsteady, then steady (the fakes' 1.5x) when measured again; turn 1: unsteady both times.
    fakes.script(&key("a", 0, 0), [Answer::Unsteady { speedup: 9.0 }]);
    fakes.script(&key("a", 0, 1), [Answer::Unsteady { speedup: 7.0 }]);
    fakes.script(&format!("{}#retimed", key("a", 0, 1)), [Answer::Unsteady { speedup: 6.0 }]);
    let mut running = orchestrator(&peers, |_| {}).await;
    let job = submit(&mut running.client, spec(&["a"], 1, 2)).await.expect("submitted");
    let finished = last_job(&watch(&mut running.client, &job.job_id).await);
    assert_eq!(finished.state(), pb::JobState::Succeeded, "{finished:?}");
    let turns = turns(&mut running.client, &job.job_id).await;
    let speedups: Vec<f64> = turns.iter().map(|t| t.evaluation.as_ref().expect("evaluated").speedup_eager).collect();
    assert_eq!(speedups, [1.5, 6.0], "the second measurement is the turn's");
    let unsteady = |turn: &pb::TurnRecord| {
        turn.evaluation.as_ref().expect("evaluated").findings.iter().any(|f| f.code == "timing.unsteady")
    };
    assert!(!unsteady(&turns[0]) && unsteady(&turns[1]), "a second unsteady answer keeps its notice");
    let (received, _) = fakes.evaluate_counts();
    for turn in 0..2 {
        let key = key("a", 0, turn);
        assert_eq!((received[&key], received[&format!("{key}#retimed")]), (1, 1), "{key}");
    }
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_episode_is_recorded_and_the_job_goes_on() {
    let (peers, fakes) = support::start_fakes().await;
    fakes.fail_generation(&key("a", 0, 0));
    let mut running = orchestrator(&peers, |_| {}).await;
    let job = submit(&mut running.client, spec(&["a", "b"], 1, 2)).await.expect("submitted");
    let finished = last_job(&watch(&mut running.client, &job.job_id).await);
    assert_eq!(finished.state(), pb::JobState::Succeeded, "{finished:?}");
    assert_eq!((finished.episodes_done, finished.turns_done, finished.turns_total), (2, 3, 4));
    let turns = turns(&mut running.client, &job.job_id).await;
    let keys: Vec<String> = turns.iter().map(|t| key(&t.task_id, t.trajectory, t.turn)).collect();
    assert_eq!(keys, [key("a", 0, 0), key("b", 0, 0), key("b", 0, 1)], "the failed episode ended at its failure");
    assert!(turns[0].error.starts_with("gateway: Unavailable: backend down"), "{}", turns[0].error);
    assert_eq!((turns[0].verdict(), turns[0].score), (pb::Verdict::Unspecified, None));
    // At the job's end each creditable turn gets a return and an advantage (the fakes': the score, less the task's
    // mean); the failed turn gets neither.
    assert_eq!((turns[0].return_value, turns[0].advantage), (None, None));
    assert_eq!((turns[1].return_value, turns[1].advantage), (Some(1.8), Some(0.0)));
    assert_eq!((turns[2].return_value, turns[2].advantage), (Some(1.8), Some(0.0)));

    // The same turns on /metrics: by turn index and verdict (the failed one as `failed`), fast ones (the fake
    // evaluator's kernels are 1.5x eager), and nothing left in flight.
    let metrics = scrape(&running.address).await;
    for line in [
        "kforge_orchestrator_turns_total{service=\"orchestrator\",turn=\"0\",verdict=\"failed\"} 1",
        "kforge_orchestrator_turns_total{service=\"orchestrator\",turn=\"0\",verdict=\"correct\"} 1",
        "kforge_orchestrator_turns_total{service=\"orchestrator\",turn=\"1\",verdict=\"correct\"} 1",
        "kforge_orchestrator_fast_turns_total{service=\"orchestrator\",turn=\"1\"} 1",
        "kforge_orchestrator_in_flight{service=\"orchestrator\",stage=\"evaluating\"} 0",
        "kforge_orchestrator_turn_seconds_count{service=\"orchestrator\"} 3",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    running.shutdown().await;
}

/// The orchestrator's `/metrics` page.
async fn scrape(address: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.expect("connect");
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: kforge\r\nConnection: close\r\n\r\n").await.expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("response");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluations_in_flight_are_bounded_across_episodes() {
    let (peers, fakes) = support::start_fakes().await;
    let gate = fakes.gate_evaluations();
    let mut running = orchestrator(&peers, |c| {
        c.max_in_flight.evaluator = 2;
        c.max_concurrent_episodes = 8;
    })
    .await;
    let job = submit(&mut running.client, spec(&["a", "b", "c", "d"], 2, 1)).await.expect("submitted");
    let mut stream = running
        .client
        .watch_job(pb::WatchJobRequest { job_id: job.job_id.clone() })
        .await
        .expect("watched")
        .into_inner();
    // Every turn reaches the evaluating stage; only two reach the evaluator.
    loop {
        let update = stream.message().await.expect("an update").expect("the job is not over");
        if update.in_flight.is_some_and(|s| s.evaluating == 8) {
            break;
        }
    }
    eventually("two evaluations at the evaluator", || async {
        fakes.evaluating.load(std::sync::atomic::Ordering::SeqCst) >= 2
    })
    .await;
    let (received, _) = fakes.evaluate_counts();
    assert_eq!(received.values().sum::<u32>(), 2, "{received:?}");
    gate.add_permits(8);
    let finished = last_job(&watch(&mut running.client, &job.job_id).await);
    assert_eq!((finished.state(), finished.turns_done), (pb::JobState::Succeeded, 8));
    assert_eq!(fakes.max_evaluating.load(std::sync::atomic::Ordering::SeqCst), 2);
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_invalid_argument_naming_the_field_or_the_line() {
    let (peers, _fakes) = support::start_fakes().await;
    let mut running = orchestrator(&peers, |_| {}).await;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("flow-bad-input");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("empty")).expect("dirs");
    let jsonl = |name: &str, lines: &[String]| {
        let path = dir.join(name);
        std::fs::write(&path, lines.join("\n")).expect("written");
        path.display().to_string()
    };
    let good = serde_json::json!({"task_id": "t1", "source": TASK}).to_string();
    let base = spec(&["a"], 1, 1);
    let on = |task_set: String| pb::JobSpec { task_set, tasks: Vec::new(), ..base.clone() };
    let cases = [
        (pb::JobSpec { recipe: "nope".into(), ..base.clone() }, "spec.recipe: unknown recipe `nope`"),
        (pb::JobSpec { trajectories_per_task: 0, ..base.clone() }, "spec.trajectories_per_task: must be at least 1"),
        (pb::JobSpec { turns: 0, ..base.clone() }, "spec.turns: must be at least 1"),
        (on(dir.join("missing").display().to_string()), "spec.task_set: "),
        (on(dir.join("empty").display().to_string()), "spec.task_set: "),
        (on(jsonl("bad.jsonl", &[good.clone(), "{not json".into()])), "bad.jsonl line 2: not a task object"),
        (
            on(jsonl("no_source.jsonl", &[serde_json::json!({"task_id": "x"}).to_string()])),
            "no_source.jsonl line 1: not a task object",
        ),
        (
            on(jsonl("not_a_task.jsonl", &[serde_json::json!({"task_id": "x", "source": "print(1)"}).to_string()])),
            "not_a_task.jsonl line 1: source is not a task",
        ),
        (on(jsonl("twice.jsonl", &[good.clone(), good.clone()])), "twice.jsonl line 2: task_id `t1` appears twice"),
        (on(jsonl("blank.jsonl", &["".into()])), "spec.task_set: "),
        (pb::JobSpec { levels: vec![1], ..on("examples".into()) }, "spec.levels: only a KernelBench directory"),
        (
            pb::JobSpec { reward: Some(pb::RewardSpec { gamma: Some(-0.1), ..Default::default() }), ..base.clone() },
            "spec.reward.gamma: must be in [0, 1]",
        ),
    ];
    for (spec, expected) in cases {
        let status = submit(&mut running.client, spec).await.expect_err(expected);
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(expected), "{expected}: {}", status.message());
    }
    // A good JSONL file and a KernelBench directory with one level selected are accepted.
    let job = submit(&mut running.client, on(jsonl("good.jsonl", &[good, String::new()]))).await.expect("accepted");
    assert_eq!(job.turns_total, 1);
    for (level, name) in [(1, "1_first.py"), (2, "1_second.py"), (2, "2_third.py")] {
        std::fs::create_dir_all(dir.join(format!("kb/level{level}"))).expect("level dir");
        std::fs::write(dir.join(format!("kb/level{level}/{name}")), TASK).expect("task file");
    }
    let kernelbench = pb::JobSpec { levels: vec![2], ..on(dir.join("kb").display().to_string()) };
    let job = submit(&mut running.client, kernelbench).await.expect("accepted");
    assert_eq!(job.episodes_total, 2, "level 2's two tasks only");
    running.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_peer_is_unavailable_naming_it() {
    let (peers, _fakes) = support::start_fakes().await;
    // A port nobody serves, reserved for the test so that no other server takes it meanwhile.
    let port = ReservedPort::new();
    let closed = port.url();
    let mut running = orchestrator(&peers, |c| c.peers.evaluator = closed.clone()).await;
    let status = submit(&mut running.client, spec(&["a"], 1, 1)).await.expect_err("no evaluator");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().starts_with(&format!("evaluator at {closed} is unavailable")), "{status:?}");
    running.shutdown().await;
}

/// cudaforge on a GPU backend against the fakes: each correct kernel but the last is profiled, the Judge is shown
/// the dominant kernel's medians, the device and the diagnosis, and its advice is the next turn's feedback; the
/// Judge's tokens count in the job's usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cudaforge_job_profiles_correct_kernels_and_shows_the_judge_the_profile() {
    let (peers, fakes) = support::start_fakes().await;
    let mut running = orchestrator(&peers, |_| {}).await;
    let spec = pb::JobSpec {
        recipe: "cudaforge".into(),
        judge_model: "judge".into(),
        backend: pb::Backend::Cuda.into(),
        ..spec(&["a"], 1, 3)
    };
    let job = submit(&mut running.client, spec).await.expect("submitted");
    let finished = last_job(&watch(&mut running.client, &job.job_id).await);
    assert_eq!(finished.state(), pb::JobState::Succeeded, "{finished:?}");
    let turns = turns(&mut running.client, &job.job_id).await;
    assert_eq!(*fakes.profiles.lock().expect("lock"), 2, "turns 0 and 1 are reviewed, the last is not");
    let review = turns[0].judge.as_ref().expect("reviewed");
    assert_eq!((review.mode(), review.error.as_str()), (pb::JudgeMode::Optimization, ""));
    assert_eq!(review.diagnosis.as_ref().map(|d| d.summary.as_str()), Some(support::DIAGNOSIS));
    assert_eq!(review.metrics.iter().map(|m| m.value).collect::<Vec<_>>(), [80.0], "the median of three launches");
    let prompt = fakes.judge_prompts.lock().expect("lock")[&key("a", 0, 0)].clone();
    for shown in [
        "Fake GPU",
        "7 SMs",
        "`fake_kernel` (3 launches profiled, median\n0.05 ms)",
        support::DIAGNOSIS,
        "- gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed: 80 %",
        "1.50x",
    ] {
        assert!(prompt.contains(shown), "{shown} in {prompt}");
    }
    let next = &turns[1].prompt.last().expect("a user message").content;
    assert!(next.contains("Reviewer (optimisation") && next.contains("- Optimisation: vectorise the loads"), "{next}");
    assert!(turns[2].judge.is_none());
    let usage = finished.metrics.and_then(|m| m.usage).expect("usage");
    assert_eq!(usage.prompt_tokens, 3 * 10 + 2 * 100, "the coder's three generations and the Judge's two");
    running.shutdown().await;
}

/// drkernel against the fakes: every evaluation asks for the census, its profiling ratio reaches the reward as the
/// Dr. Kernel formula's PR and the next turn's feedback, and a prompt shows only the window's turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drkernel_job_scores_with_the_profiling_ratio_and_shows_a_window_of_turns() {
    let (peers, fakes) = support::start_fakes().await;
    let mut running = orchestrator(&peers, |_| {}).await;
    let spec = pb::JobSpec { recipe: "drkernel".into(), context_window: 2, ..spec(&["a"], 1, 4) };
    let job = submit(&mut running.client, spec).await.expect("submitted");
    let finished = last_job(&watch(&mut running.client, &job.job_id).await);
    assert_eq!(finished.state(), pb::JobState::Succeeded, "{finished:?}");
    assert_eq!(*fakes.census_requests.lock().expect("lock"), 4);
    let scored = fakes.scored.lock().expect("lock").clone();
    assert_eq!(scored, vec![("drkernel".to_owned(), Some(0.67)); 4]);
    let turns = turns(&mut running.client, &job.job_id).await;
    assert!(turns[0].feedback.contains("Profiling ratio 0.67: your own kernels (my_kernel)"), "{}", turns[0].feedback);
    let last = &turns[3].prompt.last().expect("a user message").content;
    let headings: Vec<&str> = last.lines().filter(|l| l.starts_with("Attempt ")).collect();
    assert_eq!(headings.len(), 2, "the window's two turns: {last}");
    assert_eq!(headings.last(), Some(&"Attempt 3:"), "the latest always: {last}");
    running.shutdown().await;
}

/// A job's reward spec replaces its recipe's defaults: a kevin job scored with the Dr. Kernel reward asks for the
/// census (its PR) and sends that formula.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reward_spec_chooses_the_formula_over_the_recipe() {
    let (peers, fakes) = support::start_fakes().await;
    let mut running = orchestrator(&peers, |_| {}).await;
    let reward = pb::RewardSpec {
        formula: Some(pb::reward_spec::Formula::Drkernel(pb::DrKernelReward::default())),
        ..Default::default()
    };
    let spec = pb::JobSpec { recipe: "kevin".into(), reward: Some(reward), ..spec(&["a"], 1, 2) };
    let job = submit(&mut running.client, spec).await.expect("submitted");
    let finished = last_job(&watch(&mut running.client, &job.job_id).await);
    assert_eq!(finished.state(), pb::JobState::Succeeded, "{finished:?}");
    assert_eq!(*fakes.census_requests.lock().expect("lock"), 2, "the formula's PR needs the census");
    assert_eq!(*fakes.scored.lock().expect("lock"), vec![("drkernel".to_owned(), Some(0.67)); 2]);
    running.shutdown().await;
}

/// A cudaforge job on a GPU backend needs the profiler: missing, it is UNAVAILABLE naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cudaforge_job_without_its_profiler_is_unavailable_naming_it() {
    let (peers, _fakes) = support::start_fakes().await;
    // A port nobody serves, reserved for the test so that no other server takes it meanwhile.
    let port = ReservedPort::new();
    let closed = port.url();
    let mut running = orchestrator(&peers, |c| c.peers.profiler = closed.clone()).await;
    let gpu = pb::JobSpec { recipe: "cudaforge".into(), backend: pb::Backend::Cuda.into(), ..spec(&["a"], 1, 2) };
    let status = submit(&mut running.client, gpu).await.expect_err("no profiler");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().starts_with(&format!("profiler at {closed} is unavailable")), "{status:?}");
    // Without a GPU backend it is not needed.
    let cpu = pb::JobSpec { recipe: "cudaforge".into(), backend: pb::Backend::Cpu.into(), ..spec(&["a"], 1, 1) };
    submit(&mut running.client, cpu).await.expect("a CPU cudaforge job runs without a profiler");
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_listed_watched_by_stage_exported_from_a_cursor_and_resumed_after_a_cancel() {
    job_api("sqlite::memory:").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_job_api_on_postgres() {
    let Some(postgres) = support::Postgres::start("flow") else { return };
    job_api(&postgres.url).await;
}

async fn job_api(store: &str) {
    let (peers, fakes) = support::start_fakes().await;
    let mut running = orchestrator(&peers, |c| {
        c.max_concurrent_episodes = 1;
        c.store = store.into();
    })
    .await;

    // Cancelled while its second turn is being generated, then resumed: it finishes with every turn once. Each
    // stage shows in WatchJob while a call of that stage is held.
    let mut held = fakes.hold(Hold::Generate(key("a", 0, 1)));
    let first = submit(&mut running.client, spec(&["a", "b"], 1, 2)).await.expect("submitted");
    held.recv().await.expect("held");
    let mut stream = running
        .client
        .watch_job(pb::WatchJobRequest { job_id: first.job_id.clone() })
        .await
        .expect("watched")
        .into_inner();
    until_in_flight(&mut stream, (1, 0, 0)).await;
    running.client.cancel_job(pb::CancelJobRequest { job_id: first.job_id.clone() }).await.expect("cancelled");
    let cancelled = last_job(&watch(&mut running.client, &first.job_id).await);
    assert_eq!((cancelled.state(), cancelled.turns_done), (pb::JobState::Cancelled, 1));

    let mut held = fakes.hold(Hold::Evaluate(key("a", 0, 1)));
    let resumed = running
        .client
        .resume_job(pb::ResumeJobRequest { job_id: first.job_id.clone() })
        .await
        .expect("resumed")
        .into_inner();
    assert_eq!(resumed.state(), pb::JobState::Queued);
    let mut stream = running
        .client
        .watch_job(pb::WatchJobRequest { job_id: first.job_id.clone() })
        .await
        .expect("watched")
        .into_inner();
    held.recv().await.expect("held");
    until_in_flight(&mut stream, (0, 1, 0)).await;
    let mut held = fakes.hold(Hold::NextScore);
    fakes.release();
    held.recv().await.expect("held");
    until_in_flight(&mut stream, (0, 0, 1)).await;
    fakes.release();
    let mut recorded = Vec::new();
    let mut finished = None;
    while let Some(update) = stream.message().await.expect("an update") {
        recorded.extend(update.recorded.map(|t| key(&t.task_id, t.trajectory, t.turn)));
        finished = update.job;
    }
    let finished = finished.expect("the job");
    assert_eq!((finished.state(), finished.turns_done, finished.episodes_done), (pb::JobState::Succeeded, 4, 2));
    // A watcher sees the latest progress (it may skip updates it was too slow for): recorded turns in order.
    let order = [key("a", 0, 1), key("b", 0, 0), key("b", 0, 1)];
    let positions: Vec<usize> =
        recorded.iter().map(|k| order.iter().position(|o| o == k).expect("a turn of this run")).collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "{recorded:?}");
    let (_, generated) = fakes.generate_counts();
    assert!(generated.values().all(|n| *n == 1), "{generated:?}");
    let again = running
        .client
        .resume_job(pb::ResumeJobRequest { job_id: first.job_id.clone() })
        .await
        .expect("a finished job")
        .into_inner();
    assert_eq!(again.state(), pb::JobState::Succeeded, "resuming a finished job changes nothing");

    // Samples: all, then two at a time from cursors.
    let export = |cursor: String, limit: u32| {
        let mut client = running.client.clone();
        let job_id = first.job_id.clone();
        async move {
            let request = pb::ExportSamplesRequest { job_id, cursor, limit };
            let mut stream = client.export_samples(request).await.expect("exported").into_inner();
            let mut samples = Vec::new();
            while let Some(sample) = stream.message().await.expect("a sample") {
                samples.push(sample);
            }
            samples
        }
    };
    let all = export(String::new(), 0).await;
    let keys: Vec<String> = all.iter().map(|s| key(&s.task_id, s.trajectory, s.turn)).collect();
    assert_eq!(keys, [key("a", 0, 0), key("a", 0, 1), key("b", 0, 0), key("b", 0, 1)]);
    let sample = &all[0];
    assert_eq!(sample.job_id, first.job_id);
    assert_eq!(
        (sample.verdict(), sample.score, sample.kernel.as_str()),
        (pb::Verdict::Correct, Some(1.8), support::KERNEL)
    );
    let response = sample.response.as_ref().expect("the response");
    assert_eq!((response.token_ids.as_slice(), response.logprobs.len()), (&[1, 2, 3][..], 3));
    assert_eq!(sample.prompt_token_ids, [7, 8]);
    assert!(!sample.prompt.is_empty() && sample.evaluation.is_some());
    let page = export(String::new(), 2).await;
    let rest = export(page[1].cursor.clone(), 2).await;
    let paged: Vec<&str> = page.iter().chain(&rest).map(|s| s.cursor.as_str()).collect();
    assert_eq!(paged, all.iter().map(|s| s.cursor.as_str()).collect::<Vec<_>>());
    assert!(export(all[3].cursor.clone(), 0).await.is_empty());
    let bad = running
        .client
        .export_samples(pb::ExportSamplesRequest { job_id: first.job_id.clone(), cursor: "x".into(), limit: 0 })
        .await
        .expect_err("a bad cursor");
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);

    // Listing: newest first, a page at a time.
    let second = submit(&mut running.client, spec(&["c"], 1, 1)).await.expect("submitted");
    let third = submit(&mut running.client, spec(&["d"], 1, 1)).await.expect("submitted");
    let mut listed = Vec::new();
    let mut page_token = String::new();
    loop {
        let request = pb::ListJobsRequest { page_size: 2, page_token, ..Default::default() };
        let page = running.client.list_jobs(request).await.expect("listed").into_inner();
        assert!(page.jobs.len() <= 2);
        listed.extend(page.jobs.into_iter().map(|j| j.job_id));
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    assert_eq!(listed, [third.job_id.clone(), second.job_id.clone(), first.job_id.clone()]);
    let succeeded = pb::ListJobsRequest { state: pb::JobState::Succeeded.into(), ..Default::default() };
    let succeeded = running.client.list_jobs(succeeded).await.expect("listed").into_inner();
    assert!(succeeded.jobs.iter().any(|j| j.job_id == first.job_id));
    assert!(succeeded.jobs.iter().all(|j| j.state() == pb::JobState::Succeeded));
    for job in [&second, &third] {
        watch(&mut running.client, &job.job_id).await;
    }
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_steps_an_episode_and_retried_steps_are_idempotent() {
    let (peers, fakes) = support::start_fakes().await;
    let mut running = orchestrator(&peers, |_| {}).await;
    let start = pb::StartEpisodeRequest {
        recipe: "kevin".into(),
        task: Some(pb::Task { task_id: "a".into(), source: TASK.into() }),
        turns: 3,
        backend: pb::Backend::Cpu.into(),
        idempotency_key: "episode-1".into(),
        policy: String::new(),
        // PRS with a bar (tau 0.9) above the fake's profiling ratio (0.67): its correct kernels are dropped.
        reward: Some(pb::RewardSpec {
            prs: Some(pb::PrsParams { tau: Some(0.9), scale: Some(0.1) }),
            ..Default::default()
        }),
        strict_format: None,
    };
    let first = running.client.start_episode(start.clone()).await.expect("started").into_inner();
    assert_eq!((first.turn, first.done, first.reward), (0, false, 0.0));
    assert!(first.prompt.iter().any(|m| m.content.contains("# task") || m.content.contains("class Model")));
    let other_task = pb::Task { task_id: "z".into(), source: TASK.replace("return x", "return -x") };
    let retry = pb::StartEpisodeRequest { task: Some(other_task), ..start.clone() };
    let again = running.client.start_episode(retry).await.expect("started again").into_inner();
    assert_eq!(again.episode_id, first.episode_id, "the idempotency key returns the same episode");
    assert_eq!(again.prompt, first.prompt, "with its own first prompt");

    let respond = |text: &str| pb::Completion { text: text.into(), reasoning: "Okay.".into(), ..Default::default() };
    let kernel = respond(&format!("Here.\n\n```python\n{}```\n", support::KERNEL));
    let step = |turn: u32, completion: pb::Completion, key: &str| pb::StepRequest {
        episode_id: first.episode_id.clone(),
        completion: Some(completion),
        turn,
        idempotency_key: key.into(),
        prompt_token_ids: vec![7, turn + 8],
    };
    let current = |client: &mut OrchestratorClient<Channel>| {
        let request = pb::GetEpisodeRequest { episode_id: first.episode_id.clone() };
        let mut client = client.clone();
        async move { client.get_episode(request).await.map(tonic::Response::into_inner) }
    };
    assert_eq!(current(&mut running.client).await.expect("the episode"), first, "before a step: the first observation");
    let stepped = running.client.step(step(0, kernel.clone(), "s0")).await.expect("stepped").into_inner();
    assert_eq!(
        current(&mut running.client).await.expect("the episode"),
        stepped,
        "a reconnecting trainer's observation"
    );
    assert_eq!((stepped.turn, stepped.done, stepped.reward), (1, false, 1.8));
    assert_eq!(stepped.evaluation.as_ref().map(|e| e.verdict()), Some(pb::Verdict::Correct));
    let record = stepped.record.clone().expect("the record");
    assert_eq!((record.turn, record.kernel.as_str()), (0, support::KERNEL));
    let next_prompt = &stepped.prompt.last().expect("a prompt").content;
    assert!(next_prompt.contains("return x"), "kevin's next prompt shows the first kernel: {next_prompt}");

    // ResumeJob runs jobs through the gateway; an episode is advanced by its trainer.
    let status = running
        .client
        .resume_job(pb::ResumeJobRequest { job_id: first.episode_id.clone() })
        .await
        .expect_err("an episode is not resumed");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);

    // A retry of the same step replays it: no second evaluation.
    let retried = running.client.step(step(0, kernel.clone(), "s0")).await.expect("retried").into_inner();
    assert_eq!((retried.turn, retried.reward, &retried.prompt), (1, 1.8, &stepped.prompt));
    assert_eq!(fakes.evaluate_counts().1.get(&key("a", 0, 0)), Some(&1));
    let refused = [
        (step(0, kernel.clone(), "another"), "already stepped with another idempotency key"),
        (step(0, respond("Another answer."), "s0"), "already stepped with another response"),
        (step(2, kernel.clone(), "s2"), "ahead of the episode"),
    ];
    for (request, expected) in refused {
        let status = running.client.step(request).await.expect_err(expected);
        assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
        assert!(status.message().contains(expected), "{status:?}");
    }

    // No kernel: out of kevin's strict format, recorded, not evaluated, scored 0, and told why; then the last turn
    // ends the episode.
    let stepped = running.client.step(step(1, respond("I cannot."), "s1")).await.expect("stepped").into_inner();
    assert_eq!((stepped.turn, stepped.done, stepped.reward, stepped.evaluation.is_none()), (2, false, 0.0, true));
    let record = stepped.record.expect("the record");
    assert_eq!((record.format_error.as_str(), record.score), ("the answer has no fenced code block", Some(0.0)));
    assert!(record.feedback.starts_with("not evaluated, scored 0: the answer has no fenced code block"));
    assert!(stepped.turns.is_empty(), "turns are credited when the episode ends");
    let last = running.client.step(step(2, kernel.clone(), "s2")).await.expect("stepped").into_inner();
    assert_eq!((last.turn, last.done, last.prompt.is_empty(), last.reward), (3, true, true, 1.8));
    // Once done, the last step's record is read as credited (its return, advantage and keep).
    let credited_last = pb::Observation { record: last.turns.last().cloned(), ..last.clone() };
    assert_eq!(current(&mut running.client).await.expect("the episode"), credited_last, "and every credited turn");
    let stored = turns(&mut running.client, &first.episode_id).await;
    let prompt_ids: Vec<Vec<u32>> = stored.iter().map(|t| t.prompt_token_ids.clone()).collect();
    assert_eq!(prompt_ids, [vec![7, 8], vec![7, 9], vec![7, 10]], "each step's prompt token ids are stored");
    // The end credits the episode's turns (the fake's returns are the scores, its advantages less their mean) and
    // decides PRS: the correct kernels' profiling ratio is under the bar; the unevaluated turn is kept.
    let credited: Vec<(f64, f64, Option<bool>)> = last
        .turns
        .iter()
        .map(|t| (t.return_value.expect("a return"), t.advantage.expect("an advantage"), t.keep))
        .collect();
    let expected = [(1.8, 0.6, Some(false)), (0.0, -1.2, Some(true)), (1.8, 0.6, Some(false))];
    assert_eq!(credited.len(), expected.len(), "{credited:?}");
    for ((r, a, keep), (er, ea, ekeep)) in credited.iter().zip(expected) {
        assert!((r - er).abs() < 1e-9 && (a - ea).abs() < 1e-9 && *keep == ekeep, "{credited:?}");
    }
    let prs = fakes.rejections.lock().expect("lock").clone();
    assert_eq!(prs.len(), 1, "one PRS call, over the evaluated turns");
    assert_eq!(prs[0].outcomes.iter().map(|o| o.sample_id.as_str()).collect::<Vec<_>>(), ["a/0/0", "a/0/2"]);
    assert!(prs[0].outcomes.iter().all(|o| o.profiling_ratio == Some(0.67)), "PRS asks for the census");
    // A retried last step returns the same credited turns.
    let again = running.client.step(step(2, kernel.clone(), "s2")).await.expect("retried").into_inner();
    assert_eq!(again.turns, last.turns);
    let status = running.client.step(step(3, kernel, "s3")).await.expect_err("over");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    let job = running.client.get_job(pb::GetJobRequest { job_id: first.episode_id.clone() }).await.expect("a job");
    let job = job.into_inner();
    assert_eq!((job.state(), job.turns_done, job.episodes_done), (pb::JobState::Succeeded, 3, 1));
    // Bad requests name their field.
    let no_task = pb::StartEpisodeRequest { task: None, ..start.clone() };
    let no_turns = pb::StartEpisodeRequest { turns: 0, idempotency_key: String::new(), ..start.clone() };
    let bad_recipe = pb::StartEpisodeRequest { recipe: "x".into(), idempotency_key: String::new(), ..start };
    for (request, expected) in [(no_task, "task: required"), (no_turns, "turns: "), (bad_recipe, "recipe: ")] {
        let status = running.client.start_episode(request).await.expect_err(expected);
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().starts_with(expected), "{status:?}");
    }
    let keyless = pb::StepRequest { idempotency_key: String::new(), ..step(0, respond("x"), "") };
    let status = running.client.step(keyless).await.expect_err("no key");
    assert!(status.message().starts_with("idempotency_key: required"), "{status:?}");
    let unknown = pb::GetEpisodeRequest { episode_id: "j-unknown".into() };
    let status = running.client.get_episode(unknown).await.expect_err("no such episode");
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_dropped_during_its_evaluation_is_finished_by_its_retry_with_one_answered_evaluation() {
    let (peers, fakes) = support::start_fakes().await;
    let mut running = orchestrator(&peers, |_| {}).await;
    let start = pb::StartEpisodeRequest {
        recipe: "single-turn".into(),
        task: Some(pb::Task { task_id: "a".into(), source: TASK.into() }),
        turns: 1,
        ..Default::default()
    };
    let episode = running.client.start_episode(start).await.expect("started").into_inner().episode_id;
    let step = pb::StepRequest {
        episode_id: episode.clone(),
        completion: Some(pb::Completion { text: format!("```python\n{}```\n", support::KERNEL), ..Default::default() }),
        turn: 0,
        idempotency_key: "s0".into(),
        prompt_token_ids: Vec::new(),
    };
    // The trainer gives up while the evaluation runs: its call, and the orchestrator's work on it, are dropped.
    let mut held = fakes.hold(Hold::Evaluate(key("a", 0, 0)));
    let mut client = running.client.clone();
    let first = client.step(step.clone());
    tokio::select! {
        answered = first => panic!("the held step answered: {answered:?}"),
        reached = held.recv() => assert!(reached.is_some()),
    }
    let retried = running.client.step(step).await.expect("the retry finishes the step").into_inner();
    assert_eq!((retried.done, retried.reward), (true, 1.8));
    let (received, answered) = fakes.evaluate_counts();
    assert_eq!((received[&key("a", 0, 0)], answered[&key("a", 0, 0)]), (2, 1), "asked again, answered once");
    let job = running.client.get_job(pb::GetJobRequest { job_id: episode }).await.expect("a job").into_inner();
    assert_eq!((job.state(), job.turns_done), (pb::JobState::Succeeded, 1));
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_stopped_with_its_orchestrator_is_resumed_by_the_next_start_unless_cancelled_meanwhile() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("flow-graceful-stop");
    let _ = std::fs::remove_dir_all(&dir);
    let store = format!("sqlite://{}", dir.join("kforge.db").display());
    let (peers, fakes) = support::start_fakes().await;
    let mut held = fakes.hold(Hold::Generate(key("a", 0, 1)));
    let mut first = orchestrator(&peers, |c| c.store = store.clone()).await;
    let job = submit(&mut first.client, spec(&["a"], 1, 3)).await.expect("submitted");
    held.recv().await.expect("held");
    first.shutdown().await;
    let opened = kforge_orchestrator::store::Store::open(&store).await.expect("opens");
    let mut stored = opened.job(&job.job_id).await.expect("read").expect("stored");
    assert_eq!((stored.state(), stored.turns_done), (pb::JobState::Running, 1), "a stop is not a cancel");
    // The first run's wall time, as its stop stored it, made long enough to tell from the second run's alone.
    let metrics = stored.metrics.as_mut().expect("a stop stores the metrics");
    assert!(metrics.wall_time_s > 0.0, "{metrics:?}");
    metrics.wall_time_s = 1000.0;
    opened.put_job(&stored).await.expect("stored");
    drop(opened);

    let resumed_at = std::time::Instant::now();
    let mut second = orchestrator(&peers, |c| c.store = store.clone()).await;
    let finished = last_job(&watch(&mut second.client, &job.job_id).await);
    assert_eq!((finished.state(), finished.turns_done), (pb::JobState::Succeeded, 3));
    // A resumed job's wall time is its runs' together: the first run's and the second's.
    let wall_time_s = finished.metrics.as_ref().expect("metrics").wall_time_s;
    let second_run_s = resumed_at.elapsed().as_secs_f64();
    assert!((1000.0..=1000.0 + second_run_s).contains(&wall_time_s), "{wall_time_s} after {second_run_s} s");
    let (_, generated) = fakes.generate_counts();
    assert!((0..3).all(|turn| generated[&key("a", 0, turn)] == 1), "{generated:?}");

    // An interrupted job cancelled while nothing runs it is not resumed by the next start.
    let mut held = fakes.hold(Hold::Generate(key("b", 0, 0)));
    let interrupted = submit(&mut second.client, spec(&["b"], 1, 1)).await.expect("submitted");
    held.recv().await.expect("held");
    second.shutdown().await;
    let mut third = orchestrator(&peers, |c| {
        c.store = store.clone();
        c.resume_on_start = false;
    })
    .await;
    let cancelled = third
        .client
        .cancel_job(pb::CancelJobRequest { job_id: interrupted.job_id.clone() })
        .await
        .expect("cancelled")
        .into_inner();
    assert_eq!(cancelled.state(), pb::JobState::Cancelled);
    third.shutdown().await;
    let fourth = orchestrator(&peers, |c| c.store = store.clone()).await;
    let stored = kforge_orchestrator::store::Store::open(&store).await.expect("opens").job(&interrupted.job_id).await;
    assert_eq!(stored.expect("read").expect("stored").state(), pb::JobState::Cancelled, "not resumed");
    fourth.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_job_waits_for_the_evaluator_behind_what_is_queued_not_behind_a_whole_earlier_job() {
    let (peers, fakes) = support::start_fakes().await;
    let gate = fakes.gate_evaluations();
    let mut running = orchestrator(&peers, |c| {
        c.max_in_flight.evaluator = 1;
        c.max_concurrent_episodes = 4;
    })
    .await;
    let tasks: Vec<String> = (0..10).map(|i| format!("a{i}")).collect();
    let big = submit(&mut running.client, spec(&tasks.iter().map(String::as_str).collect::<Vec<_>>(), 1, 1))
        .await
        .expect("submitted");
    let mut big_stream = running
        .client
        .watch_job(pb::WatchJobRequest { job_id: big.job_id.clone() })
        .await
        .expect("watched")
        .into_inner();
    // Four episodes of the big job wait for the evaluator: one inside it, three queued for its one permit.
    until_in_flight(&mut big_stream, (0, 4, 0)).await;
    let small = submit(&mut running.client, spec(&["b"], 1, 1)).await.expect("submitted");
    let mut small_stream = running
        .client
        .watch_job(pb::WatchJobRequest { job_id: small.job_id.clone() })
        .await
        .expect("watched")
        .into_inner();
    until_in_flight(&mut small_stream, (0, 1, 0)).await;
    // Let evaluations through one at a time until the small job's arrives.
    let arrived = |key: &str| fakes.arrivals.lock().expect("lock").iter().any(|k| k == key);
    while !arrived(&key("b", 0, 0)) {
        let before = fakes.arrivals.lock().expect("lock").len();
        gate.add_permits(1);
        eventually("the next evaluation at the evaluator", || async {
            fakes.arrivals.lock().expect("lock").len() > before
        })
        .await;
    }
    let arrivals = fakes.arrivals.lock().expect("lock").clone();
    assert_eq!(
        arrivals.len(),
        5,
        "the small job came after the four queued before it, not after all ten: {arrivals:?}"
    );
    gate.add_permits(100);
    for job in [&big, &small] {
        let finished = last_job(&watch(&mut running.client, &job.job_id).await);
        assert_eq!(finished.state(), pb::JobState::Succeeded);
    }
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_takes_a_job_over_only_once_its_owner_s_lease_runs_out() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("flow-lease");
    let _ = std::fs::remove_dir_all(&dir);
    let store = format!("sqlite://{}", dir.join("kforge.db").display());
    let (peers, fakes) = support::start_fakes().await;
    let instance = |name: &'static str, lease_ms: u64| {
        let store = store.clone();
        move |c: &mut OrchestratorConfig| {
            c.store = store;
            c.instance = name.into();
            c.lease_ms = lease_ms;
        }
    };
    let mut held = fakes.hold(Hold::Generate(key("a", 0, 1)));
    let mut first = orchestrator(&peers, instance("one", 300)).await;
    let job = submit(&mut first.client, spec(&["a"], 1, 2)).await.expect("submitted");
    held.recv().await.expect("held");
    let mut second = orchestrator(&peers, instance("two", 300)).await;
    let status = second
        .client
        .resume_job(pb::ResumeJobRequest { job_id: job.job_id.clone() })
        .await
        .expect_err("the first instance runs it and renews its lease");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("held by instance `one`"), "{status:?}");

    // The first instance stops (its job stays RUNNING); the second takes it over once the lease has run out.
    first.shutdown().await;
    let resumed = eventually("the first instance's lease to run out", || {
        let mut client = second.client.clone();
        let job_id = job.job_id.clone();
        async move {
            match client.resume_job(pb::ResumeJobRequest { job_id }).await {
                Ok(resumed) => Some(resumed.into_inner()),
                Err(status) if status.code() == tonic::Code::FailedPrecondition => None,
                Err(status) => panic!("{status:?}"),
            }
        }
    })
    .await;
    assert_eq!(resumed.job_id, job.job_id);
    let finished = last_job(&watch(&mut second.client, &job.job_id).await);
    assert_eq!((finished.state(), finished.turns_done), (pb::JobState::Succeeded, 2));
    second.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatch_rejection_compares_the_trainers_log_probabilities_with_the_stored_ones() {
    let (peers, fakes) = support::start_fakes().await;
    let mut running = orchestrator(&peers, |_| {}).await;
    let mrs = pb::MrsParams { lower: Some(0.99), upper: Some(1.01), veto: None };
    let spec = pb::JobSpec {
        reward: Some(pb::RewardSpec { mrs: Some(mrs), ..Default::default() }),
        ..spec(&["a", "b"], 1, 1)
    };
    let job = submit(&mut running.client, spec).await.expect("submitted");
    watch(&mut running.client, &job.job_id).await;
    let request = pb::ExportSamplesRequest { job_id: job.job_id.clone(), cursor: String::new(), limit: 0 };
    let mut stream = running.client.export_samples(request).await.expect("exported").into_inner();
    let mut cursors = Vec::new();
    while let Some(sample) = stream.message().await.expect("a sample") {
        assert_eq!(sample.keep, None, "undecided before");
        cursors.push(sample.cursor);
    }
    assert_eq!(cursors.len(), 2);
    // The fake's rollout log-probabilities are [-0.5, -0.25, -0.125]: the same under training keeps the sample; a
    // mean shift of 0.1 (w = e^0.1) drops it.
    let sample = |cursor: &str, logprobs: Vec<f64>| pb::TrainLogprobs { cursor: cursor.into(), logprobs };
    let request = |samples| pb::RejectMismatchedRequest { job_id: job.job_id.clone(), samples };
    let decided = running
        .client
        .reject_mismatched(request(vec![
            sample(&cursors[0], vec![-0.5, -0.25, -0.125]),
            sample(&cursors[1], vec![-0.4, -0.15, -0.025]),
        ]))
        .await
        .expect("decided")
        .into_inner();
    let keeps: Vec<(String, bool)> = decided.decisions.iter().map(|d| (d.id.clone(), d.keep)).collect();
    assert_eq!(keeps, [(cursors[0].clone(), true), (cursors[1].clone(), false)]);
    assert_eq!(decided.kept, 1);
    let mrs_asked = fakes.rejections.lock().expect("lock").last().cloned().expect("a call");
    assert_eq!(mrs_asked.method, Some(pb::rejection_sample_request::Method::Mrs(mrs)), "the job's bounds");
    let stored: Vec<Option<bool>> = turns(&mut running.client, &job.job_id).await.iter().map(|t| t.keep).collect();
    assert_eq!(stored, [Some(true), Some(false)], "the decisions are stored in the turns");

    let refused = [
        (vec![], "samples: required", tonic::Code::InvalidArgument),
        (vec![sample("x", vec![0.0])], "samples[0].cursor: not a cursor", tonic::Code::InvalidArgument),
        (vec![sample("9.0.0", vec![0.0])], "samples[0].cursor: job", tonic::Code::InvalidArgument),
        (
            vec![sample(&cursors[0], vec![-0.5])],
            "samples[0].logprobs: 1 values for the response's 3",
            tonic::Code::InvalidArgument,
        ),
        (
            vec![sample(&cursors[0], vec![-0.5, f64::NAN, 0.0])],
            "samples[0].logprobs: value 1",
            tonic::Code::InvalidArgument,
        ),
    ];
    for (samples, expected, code) in refused {
        let status = running.client.reject_mismatched(request(samples)).await.expect_err(expected);
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().starts_with(expected), "{status:?}");
    }
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_take_over_the_jobs_of_one_that_died_and_each_job_runs_on_one_of_them() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("flow-take-over");
    let _ = std::fs::remove_dir_all(&dir);
    let store = format!("sqlite://{}", dir.join("kforge.db").display());
    let (peers, fakes) = support::start_fakes().await;
    let replica = |name: &'static str, take_over: bool| {
        let store = store.clone();
        move |c: &mut OrchestratorConfig| {
            c.store = store;
            c.instance = name.into();
            c.lease_ms = 300;
            c.take_over_orphans = take_over;
        }
    };
    // Readiness by polling the fakes' counters: the calls in question have reached them.
    let arrived = |n: usize| {
        let fakes = fakes.clone();
        async move {
            eventually(format!("{n} evaluations at the evaluator"), || async {
                fakes.arrivals.lock().expect("lock").len() >= n
            })
            .await;
        }
    };
    // Two jobs on the first replica, each waiting in its first evaluation when the replica dies.
    let gate = fakes.gate_evaluations();
    let mut first = orchestrator(&peers, replica("one", false)).await;
    let a = submit(&mut first.client, spec(&["a"], 1, 2)).await.expect("submitted");
    let b = submit(&mut first.client, spec(&["b"], 1, 2)).await.expect("submitted");
    arrived(2).await;
    first.shutdown().await;
    // Two replicas that take orphans over: once the dead one's lease has run out, each job is claimed by one.
    let second = orchestrator(&peers, replica("two", true)).await;
    let third = orchestrator(&peers, replica("three", true)).await;
    arrived(4).await;
    gate.add_permits(100);
    for job in [&a, &b] {
        let finished = eventually(format!("job {} finished by a taker", job.job_id), || {
            let mut client = second.client.clone();
            let job_id = job.job_id.clone();
            async move {
                let got = client.get_job(pb::GetJobRequest { job_id }).await.expect("read").into_inner();
                (got.state() == pb::JobState::Succeeded).then_some(got)
            }
        })
        .await;
        assert_eq!(finished.turns_done, 2);
    }
    // Each turn-0 evaluation reached the fakes twice, the dead replica's and one taker's (never both takers'), and
    // each turn-1 evaluation once.
    let mut arrivals = fakes.arrivals.lock().expect("lock").clone();
    arrivals.sort();
    let (a0, a1, b0, b1) = (key("a", 0, 0), key("a", 0, 1), key("b", 0, 0), key("b", 0, 1));
    assert_eq!(arrivals, [a0.clone(), a0, a1, b0.clone(), b0, b1]);
    let (_, generated) = fakes.generate_counts();
    assert_eq!((generated[&key("a", 0, 1)], generated[&key("b", 0, 1)]), (1, 1), "turn 1 generated once each");
    second.shutdown().await;
    third.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluations_spread_over_a_static_pool_within_each_endpoints_capacity() {
    let (peers, fakes) = support::start_fakes().await;
    let (other, other_fakes) = support::start_fakes().await;
    let gates = [fakes.gate_evaluations(), other_fakes.gate_evaluations()];
    let endpoint = |url: &str| url.trim_start_matches("http://").to_owned();
    let mut running = orchestrator(&peers, |c| {
        c.max_concurrent_episodes = 8;
        c.discovery.evaluator = Some(kforge_orchestrator::DiscoveryConfig {
            endpoints: vec![endpoint(&peers), endpoint(&other)],
            capacity: 1,
            ..Default::default()
        });
    })
    .await;
    let job = submit(&mut running.client, spec(&["a", "b", "c", "d"], 2, 1)).await.expect("submitted");
    // Readiness by polling: one evaluation waits at each endpoint (its capacity), the other six in the orchestrator.
    let waiting = |f: &support::State| f.evaluating.load(std::sync::atomic::Ordering::SeqCst);
    eventually("both endpoints busy", || async { waiting(&fakes) + waiting(&other_fakes) >= 2 }).await;
    for gate in &gates {
        gate.add_permits(100);
    }
    let finished = last_job(&watch(&mut running.client, &job.job_id).await);
    assert_eq!((finished.state(), finished.turns_done), (pb::JobState::Succeeded, 8));
    let answered = |f: &support::State| f.evaluate_counts().1.values().sum::<u32>();
    assert_eq!(answered(&fakes) + answered(&other_fakes), 8);
    assert!(answered(&fakes) > 0 && answered(&other_fakes) > 0, "both endpoints took calls");
    let most = |f: &support::State| f.max_evaluating.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!((most(&fakes), most(&other_fakes)), (1, 1), "never more than an endpoint's capacity at once");
    running.shutdown().await;
}
