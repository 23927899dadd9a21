//! An evaluator lost mid-job (issue 51, "Scale out"): two `kforge serve evaluator` processes behind the
//! orchestrator's static pool (`[orchestrator.discovery.evaluator]`), and one of them killed with SIGKILL once both
//! have evaluations in flight. Its in-flight evaluations must be retried on the survivor (same idempotency key), no
//! turn lost or scored twice, the job must succeed; the time from the kill to the first rerouted evaluation reaching
//! the survivor is printed (`evaluator lost: ...`), not asserted: bench/results/evaluator-failover/ records it.
//!
//! The evaluators are real processes running real candidates on the CPU with the `.venv`'s torch (each evaluation
//! takes seconds, so evaluations are in flight on both when one dies); the gateway and the reward service are the
//! test-support fakes, which count generations and scores per turn. What is in flight where is read from each
//! evaluator's `/metrics` (`kforge_evaluator_admitted`: queued or running; `kforge_evaluator_verdicts_total`: done),
//! never guessed from a sleep.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kforge::mesh::{MeshConfig, Service};
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_server::client::ClientConfig;
use kforge_test_support::peers::{self, Answers};
use kforge_test_support::{ReservedPort, Wait, health, python};

/// Episodes of the job, all started at once: one more than an endpoint's places, so both evaluators get some.
const EPISODES: u32 = 4;
/// Places per evaluator endpoint in the orchestrator's pool.
const CAPACITY: u32 = 3;
/// One turn each: every evaluation is in flight from the start, so any evaluation reaching the survivor after the
/// kill is a rerouted one (and the test stays short: each evaluation starts a Python with torch).
const TURNS: u32 = 1;

/// A correct kernel that takes a moment in `forward`, so an evaluation is in flight long enough to be cut.
const SLOW_KERNEL: &str = "import time\n\nimport torch\n\n\nclass ModelNew(torch.nn.Module):\n    \
                           def forward(self, x):\n        time.sleep(0.1)\n        return x.clone()\n";

/// The fakes' answers, each generation holding [`SLOW_KERNEL`].
struct SlowKernels;

impl Answers for SlowKernels {
    fn generate(
        &self,
        request: pb::GenerateRequest,
    ) -> impl Future<Output = Result<pb::GenerateResponse, tonic::Status>> + Send {
        let mut response = peers::standard_generation(&request);
        for completion in &mut response.completions {
            completion.text = format!("A slow one.\n\n```python\n{SLOW_KERNEL}```\n");
        }
        std::future::ready(Ok(response))
    }
}

/// `kforge`, built beside this test's binary (target/<profile>/deps/kforge_tests-HASH): `cargo nextest run
/// --workspace` builds it, as the CLI's own tests need it; `cargo build -p kforge --bin kforge` otherwise.
fn kforge_binary() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|error| error.to_string())?;
    let binary = exe.parent().and_then(Path::parent).map(|dir| dir.join("kforge"));
    match binary {
        Some(binary) if binary.is_file() => Ok(binary),
        _ => Err("target/<profile>/kforge is missing: run cargo build -p kforge --bin kforge".into()),
    }
}

/// A `kforge serve evaluator` child on a reserved port, killed (SIGKILL) and reaped when dropped.
struct Evaluator {
    name: &'static str,
    child: Child,
    port: ReservedPort,
    /// One client for every scrape: its kept-alive connection makes a scrape a few milliseconds, the reroute time's
    /// resolution (a client per scrape costs tens).
    http: reqwest::Client,
}

impl Evaluator {
    fn spawn(kforge: &Path, python: &Path, name: &'static str) -> Self {
        let port = ReservedPort::new();
        let dir = python::repo_root().join("target/tmp/evaluator-lost");
        let work_dir = dir.join(name);
        std::fs::create_dir_all(&work_dir).expect("the evaluator's work dir");
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).expect("the evaluator's log");
        let child = Command::new(kforge)
            .args(["serve", "evaluator"])
            .env("NO_COLOR", "1")
            .env("KFORGE__EVALUATOR__SERVER__LISTEN", port.addr().to_string())
            .env("KFORGE__EVALUATOR__PYTHON", python)
            .env("KFORGE__EVALUATOR__WORK_DIR", &work_dir)
            // As `kforge run` configures an evaluator for one job (`kforge::run::evaluator_for_one_job`).
            .env("KFORGE__EVALUATOR__BINDINGS_PCH", "false")
            .env("KFORGE__EVALUATOR__BASELINE_TORCH_COMPILE", "false")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("kforge serve evaluator starts");
        Self { name, child, port, http: reqwest::Client::new() }
    }

    fn url(&self) -> String {
        self.port.url()
    }

    /// Its `/metrics` now.
    async fn scrape(&self) -> Result<Load, reqwest::Error> {
        let page = self.http.get(format!("{}/metrics", self.url())).send().await?.text().await?;
        Ok(Load::parse(&page))
    }

    /// SIGKILL, then reaps it; the instant it was killed.
    fn kill(&mut self) -> Instant {
        self.child.kill().expect("SIGKILL is sent");
        let killed = Instant::now();
        let status = self.child.wait().expect("reaped");
        assert!(!status.success(), "{} was killed: {status:?}", self.name);
        killed
    }
}

impl Drop for Evaluator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An evaluator's load as its `/metrics` says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Load {
    /// Evaluations queued or running.
    admitted: u64,
    /// Evaluations done, any verdict.
    done: u64,
    /// Evaluations done with a final verdict (not VERDICT_INFRA_ERROR).
    final_verdicts: u64,
}

impl Load {
    fn parse(page: &str) -> Self {
        let mut load = Self::default();
        for line in page.lines().filter(|line| !line.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else { continue };
            let value = value.parse::<f64>().unwrap_or(0.0) as u64;
            if series.starts_with("kforge_evaluator_admitted{") {
                load.admitted += value;
            } else if series.starts_with("kforge_evaluator_verdicts_total{") {
                load.done += value;
                if !series.contains("VERDICT_INFRA_ERROR") {
                    load.final_verdicts += value;
                }
            }
        }
        load
    }
}

fn spec() -> pb::JobSpec {
    pb::JobSpec {
        kind: pb::JobKind::Rollout.into(),
        recipe: "single-turn".into(),
        task_set: "inline".into(),
        tasks: (0..EPISODES).map(|i| pb::Task { task_id: format!("t{i}"), source: peers::TASK.into() }).collect(),
        model: "fake".into(),
        trajectories_per_task: 1,
        turns: TURNS,
        backend: pb::Backend::Cpu.into(),
        correctness_trials: 2,
        // Correctness only: no timing, so no `#retimed` second evaluation of an unsteady one.
        measure_performance: Some(false),
        max_concurrent_episodes: EPISODES,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evaluator_killed_mid_job_has_its_evaluations_rerouted_and_no_turn_lost_or_scored_twice() {
    let Some(python) = python::or_skip(&["torch"]) else { return };
    let kforge = match kforge_binary() {
        Ok(kforge) => kforge,
        Err(missing) => return python::skip(missing),
    };
    let mut evaluators = [Evaluator::spawn(&kforge, &python, "a"), Evaluator::spawn(&kforge, &python, "b")];
    for evaluator in &evaluators {
        health::connected(&evaluator.url(), Duration::from_secs(60)).await;
        let channel =
            kforge_server::client::connect(&evaluator.url(), &ClientConfig::default()).await.expect("connects");
        health::until_serving(channel, "kforge.v1.Evaluator").await;
    }

    let (fakes, counted) = peers::start_with(SlowKernels).await;
    let mut config = MeshConfig::default();
    config.orchestrator.peers.gateway.clone_from(&fakes);
    config.orchestrator.peers.reward.clone_from(&fakes);
    let mut pool = config.orchestrator.discovery.evaluator.take().unwrap_or_default();
    pool.endpoints = evaluators.iter().map(|e| e.port.addr().to_string()).collect();
    pool.capacity = CAPACITY;
    config.orchestrator.discovery.evaluator = Some(pool);
    let mesh = kforge_tests::start(&[Service::Orchestrator], &config).await;
    let channel = kforge_tests::connect(&mesh, Service::Orchestrator, &ClientConfig::default()).await;
    let mut orchestrator = OrchestratorClient::new(channel);

    let started = Instant::now();
    let submitted = orchestrator
        .submit_job(pb::SubmitJobRequest { spec: Some(spec()), idempotency_key: String::new() })
        .await
        .expect("submitted")
        .into_inner();
    let followed = tokio::spawn({
        let mut orchestrator = orchestrator.clone();
        let job_id = submitted.job_id.clone();
        async move { kforge::run::follow(&mut orchestrator, &job_id, |_| {}).await }
    });

    // Every episode's evaluation has arrived and both evaluators have some in flight; the one with more dies (so the
    // survivor has a free place in the pool: of EPISODES = CAPACITY + 1 calls, it holds at most two of its three).
    let loads = Wait::new("evaluations in flight on both evaluators")
        .within(Duration::from_secs(120))
        .every(Duration::from_millis(5))
        .until(|| async {
            let (a, b) = (evaluators[0].scrape().await.ok()?, evaluators[1].scrape().await.ok()?);
            let arrived = a.admitted + a.done + b.admitted + b.done;
            (a.admitted > 0 && b.admitted > 0 && arrived >= u64::from(EPISODES)).then_some([a, b])
        })
        .await;
    let victim = usize::from(loads[1].admitted > loads[0].admitted);
    let survivor = 1 - victim;
    let scraping = Instant::now();
    let survivor_at_kill = evaluators[survivor].scrape().await.expect("the survivor's metrics");
    // The reroute time's resolution: the poll below asks every 2 ms plus this.
    let scrape = scraping.elapsed();
    let victim_at_kill = evaluators[victim].scrape().await.expect("the victim's metrics");
    let killed = evaluators[victim].kill();

    // The first rerouted evaluation reaching the survivor: one more admitted there while none of its own has
    // finished (one finishing lowers the gauge, which would hide an arrival; not measured then: it did not come
    // within the seconds an evaluation takes).
    let rerouted = Wait::new("a rerouted evaluation on the survivor")
        .within(Duration::from_secs(120))
        .every(Duration::from_millis(2))
        .until(|| async {
            let now = evaluators[survivor].scrape().await.ok()?;
            if now.done > survivor_at_kill.done {
                return Some(None);
            }
            (now.admitted > survivor_at_kill.admitted).then(|| Some(killed.elapsed()))
        })
        .await;

    let job = tokio::time::timeout(Duration::from_secs(300), followed)
        .await
        .expect("the job ends")
        .expect("the follower")
        .expect("watched");
    assert_eq!(job.state(), pb::JobState::Succeeded, "{job:?}");
    let trajectories = kforge::run::trajectories(&mut orchestrator, &job.job_id).await.expect("listed");

    // Every turn stored once, with a verdict and a score; none failed.
    let mut turns: Vec<(String, u32, u32)> = Vec::new();
    for trajectory in &trajectories {
        for turn in &trajectory.turns {
            assert!(turn.error.is_empty(), "turn {} of {}: {}", turn.turn, trajectory.trajectory_id, turn.error);
            assert!(
                !matches!(turn.verdict(), pb::Verdict::Unspecified | pb::Verdict::InfraError),
                "turn {} of {}: {:?}",
                turn.turn,
                trajectory.trajectory_id,
                turn.verdict()
            );
            assert!(turn.score.is_some(), "turn {} of {} is scored", turn.turn, trajectory.trajectory_id);
            turns.push((turn.task_id.clone(), turn.trajectory, turn.turn));
        }
    }
    turns.sort();
    let expected: Vec<(String, u32, u32)> =
        (0..EPISODES).flat_map(|i| (0..TURNS).map(move |turn| (format!("t{i}"), 0, turn))).collect();
    assert_eq!(turns, expected, "every turn stored exactly once");
    let total = u64::from(EPISODES * TURNS);

    // Generated once and scored once per turn: a rerouted evaluation is not a second turn.
    let (generated, _) = counted.generate_counts();
    assert_eq!(generated.len() as u64, total, "{generated:?}");
    assert!(generated.values().all(|&n| n == 1), "each turn generated once: {generated:?}");
    assert_eq!(u64::from(*counted.scores.lock().expect("lock")), total, "each turn scored once");

    // Each turn's verdict came from one evaluator: what the survivor did not answer, the victim answered before it
    // died. Of the evaluations in flight on the victim at the kill, at least one (all of them, unless one finished
    // in the instant between the last scrape and the kill) was answered by the survivor.
    let survivor_final = evaluators[survivor].scrape().await.expect("the survivor's metrics");
    let answered_by_victim = total - survivor_final.final_verdicts;
    assert!(answered_by_victim >= victim_at_kill.final_verdicts, "{answered_by_victim} {victim_at_kill:?}");
    let finished_at_the_kill = answered_by_victim - victim_at_kill.final_verdicts;
    assert!(
        finished_at_the_kill < victim_at_kill.admitted,
        "the victim's {} in flight were answered by the survivor ({finished_at_the_kill} by the victim itself)",
        victim_at_kill.admitted
    );
    let moved = victim_at_kill.admitted - finished_at_the_kill;
    let reroute = match rerouted {
        Some(elapsed) => format!("{:.1} ms", elapsed.as_secs_f64() * 1e3),
        None => "not measured (a survivor evaluation finished first)".into(),
    };
    println!(
        "evaluator lost: reroute {reroute}; {moved} of {} in flight on the killed evaluator rerouted ({} in flight on \
         the survivor); the survivor answered {} of {total} turns; job {:.1} s; one scrape {:.1} ms",
        victim_at_kill.admitted,
        survivor_at_kill.admitted,
        survivor_final.final_verdicts,
        started.elapsed().as_secs_f64(),
        scrape.as_secs_f64() * 1e3
    );
    mesh.shutdown().await.expect("drains");
}
