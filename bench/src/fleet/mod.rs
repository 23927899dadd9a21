//! A fleet simulated in one process: evaluator endpoints of unequal capacity whose evaluations take the recorded
//! KernelBench times (compressed), a fake gateway and reward service that answer at once, and 2-4 orchestrator
//! replicas on one PostgreSQL running jobs of thousands of trajectories, the jobs submitted round-robin over the
//! replicas. While it runs, a share of the endpoints can be lost and a replica killed; at the end every job's turns
//! are read back from the store and checked.
//!
//! Each replica runs on a tokio runtime of its own, so that killing it (`Runtime::shutdown_background`) stops its
//! jobs, lease renewals and store connections at once, as a killed pod's would; the others take its jobs over once
//! their lease has run out (`take_over_orphans`). The fakes run on the caller's runtime.
//!
//! Used by the `orchestrator-fleet` benchmark (`bench/src/orchestrator_fleet.rs`) and its CI version
//! (`bench/tests/fleet.rs`).

pub mod evaluators;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kforge_orchestrator::{BreakerConfig, InFlightConfig, OrchestratorConfig, PeersConfig};
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_test_support::health;
use kforge_test_support::peers::{self, Answers};
use serde_json::{Value, json};
use tonic::Status;
use tonic::transport::Channel;

pub use evaluators::{Evaluators, Loss};

/// What to simulate.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Evaluator endpoints.
    pub endpoints: usize,
    /// Capacities given to the endpoints in turn (endpoint i gets `capacities[i % len]`).
    pub capacities: Vec<u32>,
    /// Trajectories in all, spread over `jobs` jobs (rounded to whole tasks).
    pub trajectories: u32,
    pub jobs: u32,
    /// Trajectories per task.
    pub per_task: u32,
    /// Turns per trajectory.
    pub turns: u32,
    pub recipe: String,
    /// Orchestrator replicas, each on a runtime of `replica_threads` workers.
    pub replicas: usize,
    pub replica_threads: usize,
    /// An evaluation takes its recorded time times this.
    pub time_scale: f64,
    /// A generation's mean time (drawn between a quarter and seven quarters of it), in milliseconds.
    pub generate_ms: u64,
    /// The replicas' `lease_ms`.
    pub lease_ms: u64,
    /// The share of endpoints lost, when the evaluations answered reach `at` of the turns, and how.
    pub lose: Option<Lose>,
    /// The replica killed (replica 0) when the evaluations answered reach this share of the turns.
    pub kill_at: Option<f64>,
}

/// Endpoints lost mid-run.
#[derive(Debug, Clone, Copy)]
pub struct Lose {
    pub share: f64,
    pub at: f64,
    pub loss: Loss,
    /// How long a killed endpoint stays listed (the discovery's notice).
    pub notice: Duration,
}

/// What a run found, for the test's assertions; `report` is the whole of it as JSON.
#[derive(Debug)]
pub struct Outcome {
    pub report: Value,
    /// Jobs submitted and jobs that SUCCEEDED.
    pub jobs: usize,
    pub jobs_succeeded: usize,
    /// Trajectories whose recorded turns are not exactly 0..turns (none failed) or 0..=first failed turn.
    pub trajectories_incomplete: usize,
    /// Recorded turns, and those recorded with an error (the error texts counted).
    pub turns_recorded: usize,
    pub turns_expected: usize,
    pub turns_failed: BTreeMap<String, usize>,
    /// Per endpoint never lost: (capacity, its calls / capacity over the mean of that ratio).
    pub load: Vec<(u32, f64)>,
    /// Whether the killed replica's jobs were all taken over by others.
    pub taken_over: bool,
}

/// Generations take a drawn time; the time each took is kept by key, for the overhead.
#[derive(Debug, Clone)]
struct Generations {
    mean: Duration,
    took_ms: Arc<Mutex<HashMap<String, f64>>>,
}

impl Answers for Generations {
    async fn generate(&self, request: pb::GenerateRequest) -> Result<pb::GenerateResponse, Status> {
        let keys = request.keys.clone().unwrap_or_default();
        let key = peers::key(&keys.task_id, keys.trajectory, keys.turn);
        let started = Instant::now();
        if !self.mean.is_zero() {
            let draw = evaluators::unit(&format!("generate/{}/{key}", keys.job_id));
            tokio::time::sleep(self.mean.mul_f64(0.25 + 1.5 * draw)).await;
        }
        let took = started.elapsed().as_secs_f64() * 1e3;
        self.took_ms.lock().expect("never poisoned").insert(format!("{}/{key}", keys.job_id), took);
        Ok(peers::standard_generation(&request))
    }
}

/// One orchestrator replica on a runtime of its own.
struct Replica {
    instance: String,
    runtime: Option<tokio::runtime::Runtime>,
    client: OrchestratorClient<Channel>,
}

impl Replica {
    async fn start(
        index: usize,
        threads: usize,
        config: OrchestratorConfig,
        evaluators: Arc<evaluators::FleetDiscovery>,
    ) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name(format!("replica-{index}"))
            .enable_all()
            .build()
            .expect("a replica's runtime");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("non-blocking");
        let address = format!("http://{}", listener.local_addr().expect("address"));
        let instance = config.instance.clone();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            let discovery: Arc<dyn kforge_discovery::Discovery> = evaluators;
            let served = kforge_orchestrator::serve_with_discovery(
                config,
                listener,
                None,
                Some(discovery),
                std::future::pending(),
            )
            .await;
            if let Err(error) = served {
                eprintln!("replica {index} stopped: {error}");
            }
        });
        let channel = health::connected(&address, Duration::from_secs(60)).await;
        let client = OrchestratorClient::new(channel).max_decoding_message_size(1 << 30);
        Self { instance, runtime: Some(runtime), client }
    }

    /// Stops everything the replica runs at once, as a killed pod.
    fn kill(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// PostgreSQL's counters for the database, read from `pg_stat_database`.
#[derive(Debug, Clone, Copy, Default)]
struct PgCounters {
    commits: i64,
    inserted: i64,
    updated: i64,
    /// Milliseconds spent running statements (PostgreSQL 14 and later).
    active_ms: f64,
}

async fn pg_counters(pool: &sqlx::PgPool) -> PgCounters {
    // Backends flush their counters at most once a second, and when idle.
    let row: (i64, i64, i64, f64) = sqlx::query_as(
        "SELECT xact_commit, tup_inserted, tup_updated, active_time FROM pg_stat_database \
         WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await
    .expect("pg_stat_database");
    PgCounters { commits: row.0, inserted: row.1, updated: row.2, active_ms: row.3 }
}

/// CPU seconds (user and system) of `pid` ("self" for this process), from /proc.
fn cpu_s(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the command's closing parenthesis: state is the 3rd field, utime the 14th, stime the 15th.
    let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU seconds of the PostgreSQL server whose data directory is under the socket directory `dir`: its postmaster
/// and every process it started that is still alive.
fn postgres_cpu_s(dir: &str) -> f64 {
    let pid_file = std::path::Path::new(dir).join("data/postmaster.pid");
    let Some(postmaster) = std::fs::read_to_string(pid_file).ok().and_then(|s| s.lines().next().map(str::to_owned))
    else {
        return 0.0;
    };
    let children: f64 = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str().map(str::to_owned))
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()))
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().is_some_and(|stat| {
                stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)) == Some(postmaster.as_str())
            })
        })
        .map(|pid| cpu_s(&pid))
        .sum();
    cpu_s(&postmaster) + children
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn terminal(state: i32) -> bool {
    matches!(
        pb::JobState::try_from(state),
        Ok(pb::JobState::Succeeded | pb::JobState::Failed | pb::JobState::Cancelled)
    )
}

/// Runs the fleet against the PostgreSQL at `store_url` (a fresh database: its counters are read before and after).
pub async fn run(config: &FleetConfig, store_url: &str) -> Outcome {
    let capacities: Vec<u32> =
        (0..config.endpoints).map(|i| config.capacities[i % config.capacities.len()].max(1)).collect();
    let total_capacity: u32 = capacities.iter().sum();
    let fleet = Evaluators::start(&capacities, config.time_scale).await;
    let generations = Generations { mean: Duration::from_millis(config.generate_ms), took_ms: Arc::default() };
    let peers_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let peers_url = format!("http://{}", peers_listener.local_addr().expect("address"));
    let (peer_state, server) = peers::serve(peers_listener, generations.clone());
    let peers_server = tokio::spawn(server);

    let per_job = config.trajectories.div_ceil(config.jobs.max(1));
    let tasks_per_job = per_job.div_ceil(config.per_task.max(1));
    let trajectories_per_job = tasks_per_job * config.per_task;
    let mut replicas = Vec::new();
    for index in 0..config.replicas.max(1) {
        let orchestrator = OrchestratorConfig {
            store: store_url.to_owned(),
            instance: format!("replica-{index}"),
            take_over_orphans: true,
            lease_ms: config.lease_ms,
            peers: PeersConfig {
                gateway: peers_url.clone(),
                evaluator: peers_url.clone(),
                reward: peers_url.clone(),
                profiler: peers_url.clone(),
                client: Default::default(),
            },
            // The fleet's places bound the evaluations; the fakes answer the rest at once.
            max_in_flight: InFlightConfig {
                gateway: config.trajectories,
                evaluator: total_capacity,
                reward: config.trajectories,
                ..Default::default()
            },
            breaker: BreakerConfig::default(),
            ..Default::default()
        };
        replicas.push(Replica::start(index, config.replica_threads, orchestrator, fleet.discovery.clone()).await);
    }
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(store_url).await.expect("postgres");
    let socket_dir = store_url.split("host=").nth(1).unwrap_or("").to_owned();
    let counters_before = pg_counters(&pool).await;
    let cpu_before = (cpu_s("self"), postgres_cpu_s(&socket_dir));

    let started = Instant::now();
    let mut jobs: Vec<(String, usize)> = Vec::new();
    for j in 0..config.jobs.max(1) {
        let replica = j as usize % replicas.len();
        let spec = pb::JobSpec {
            kind: pb::JobKind::Rollout.into(),
            recipe: config.recipe.clone(),
            task_set: "inline".into(),
            tasks: (0..tasks_per_job)
                .map(|i| pb::Task { task_id: format!("fleet/{j}/{i}"), source: peers::TASK.into() })
                .collect(),
            model: "fleet".into(),
            trajectories_per_task: config.per_task,
            turns: config.turns,
            max_concurrent_episodes: trajectories_per_job,
            ..Default::default()
        };
        let request = pb::SubmitJobRequest { spec: Some(spec), idempotency_key: format!("fleet-{j}") };
        let job = replicas[replica].client.submit_job(request).await.expect("submitted").into_inner();
        jobs.push((job.job_id, replica));
    }
    let turns_total = jobs.len() * trajectories_per_job as usize * config.turns as usize;

    // Watch the run: lose endpoints and kill a replica when the evaluations answered reach their marks; wait for
    // every job to end.
    let mut lost_at: Option<(f64, Vec<usize>)> = None;
    let mut killed: Option<(usize, Instant, f64)> = None;
    let mut taken_over_after: Option<f64> = None;
    let mut states: HashMap<String, pb::Job> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let answered = fleet.answered_total.load(Ordering::Relaxed) as f64 / turns_total as f64;
        if let Some(lose) = config.lose.filter(|lose| lost_at.is_none() && answered >= lose.at) {
            let count = ((config.endpoints as f64 * lose.share).round() as usize).min(config.endpoints);
            // Every tenth endpoint (or so): every capacity loses its share.
            let step = config.endpoints as f64 / count.max(1) as f64;
            let lost: Vec<usize> = (0..count).map(|i| ((i as f64 * step) as usize).min(config.endpoints - 1)).collect();
            fleet.lose(&lost, lose.loss, lose.notice);
            lost_at = Some((started.elapsed().as_secs_f64(), lost));
        }
        if config.kill_at.is_some_and(|at| killed.is_none() && answered >= at) {
            replicas[0].kill();
            killed = Some((0, Instant::now(), started.elapsed().as_secs_f64()));
        }
        if let (Some((victim, when, _)), None) = (&killed, taken_over_after) {
            let (held,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM jobs WHERE owner = $1 AND state IN ($2, $3)")
                .bind(&replicas[*victim].instance)
                .bind(pb::JobState::Queued as i64)
                .bind(pb::JobState::Running as i64)
                .fetch_one(&pool)
                .await
                .expect("owners");
            if held == 0 {
                taken_over_after = Some(when.elapsed().as_secs_f64());
            }
        }
        let live = replicas.iter().position(|r| r.runtime.is_some()).expect("a live replica");
        let mut all_ended = true;
        for (job_id, _) in &jobs {
            if states.get(job_id).is_some_and(|job| terminal(job.state)) {
                continue;
            }
            let request = pb::GetJobRequest { job_id: job_id.clone() };
            match replicas[live].client.clone().get_job(request).await {
                Ok(job) => {
                    let job = job.into_inner();
                    all_ended &= terminal(job.state);
                    states.insert(job_id.clone(), job);
                }
                Err(_) => all_ended = false,
            }
        }
        if all_ended {
            break;
        }
    }
    let wall_s = started.elapsed().as_secs_f64();
    let cpu_after = (cpu_s("self"), postgres_cpu_s(&socket_dir));
    // Let every backend flush its counters (at most once a second).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let counters_after = pg_counters(&pool).await;

    // Read every job's turns back from the store.
    let store = kforge_orchestrator::store::Store::open(store_url).await.expect("the store");
    let generated = generations.took_ms.lock().expect("never poisoned").clone();
    let mut overhead_ms: Vec<f64> = Vec::new();
    let mut overhead_by_turn: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    let mut turns_recorded = 0;
    let mut turns_failed: BTreeMap<String, usize> = BTreeMap::new();
    let mut trajectories_incomplete = 0;
    for (job_id, _) in &jobs {
        let turns = store.turns(job_id).await.expect("the job's turns");
        turns_recorded += turns.len();
        let mut by_trajectory: BTreeMap<(String, u32), Vec<&pb::TurnRecord>> = BTreeMap::new();
        for turn in &turns {
            by_trajectory.entry((turn.task_id.clone(), turn.trajectory)).or_default().push(turn);
            if !turn.error.is_empty() {
                // The text without its key-specific parts: the first line, up to a colon.
                let reason = turn.error.lines().next().unwrap_or("").chars().take(120).collect::<String>();
                *turns_failed.entry(reason).or_default() += 1;
                continue;
            }
            let key = format!("{job_id}/{}", peers::key(&turn.task_id, turn.trajectory, turn.turn));
            let generate = generated.get(&key).copied().unwrap_or(0.0);
            let evaluate = turn.evaluation.as_ref().and_then(|e| e.stage_ms.get("fake")).copied().unwrap_or(0.0);
            let overhead = turn.wall_time_s * 1e3 - generate - evaluate;
            overhead_ms.push(overhead);
            overhead_by_turn.entry(turn.turn).or_default().push(overhead);
        }
        let complete = by_trajectory.values().filter(|turns| {
            let in_order = turns.iter().enumerate().all(|(i, t)| t.turn as usize == i);
            let failed_last = turns.last().is_some_and(|t| !t.error.is_empty());
            in_order && (turns.len() == config.turns as usize || failed_last)
        });
        trajectories_incomplete += trajectories_per_job as usize - complete.count();
    }
    overhead_ms.sort_by(f64::total_cmp);
    let by_turn: BTreeMap<String, Value> = overhead_by_turn
        .into_iter()
        .map(|(turn, mut ms)| {
            ms.sort_by(f64::total_cmp);
            (turn.to_string(), json!({ "p50": quantile(&ms, 0.5), "p99": quantile(&ms, 0.99) }))
        })
        .collect();

    // Repeated work: generations and evaluations answered more than once for one turn, scores beyond the turns.
    let (_, generate_answered) = peer_state.generate_counts();
    let generated_again = generate_answered.values().filter(|&&n| n > 1).count();
    let evaluated_again = fleet.answered.lock().expect("never poisoned").values().filter(|&&n| n > 1).count();
    let scores = *peer_state.scores.lock().expect("lock") as usize;

    // Load per endpoint never lost: calls / capacity, over the mean of that ratio.
    let alive: Vec<_> = fleet.endpoints.iter().filter(|e| !e.lost()).collect();
    let calls: u64 = alive.iter().map(|e| e.calls.load(Ordering::Relaxed)).sum();
    let capacity: u64 = alive.iter().map(|e| u64::from(e.capacity)).sum();
    let per_place = calls as f64 / capacity.max(1) as f64;
    let load: Vec<(u32, f64)> = alive
        .iter()
        .map(|e| (e.capacity, e.calls.load(Ordering::Relaxed) as f64 / f64::from(e.capacity) / per_place))
        .collect();
    let ratios: Vec<f64> = load.iter().map(|(_, r)| *r).collect();
    let mean = ratios.iter().sum::<f64>() / ratios.len().max(1) as f64;
    let cv = (ratios.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / ratios.len().max(1) as f64).sqrt() / mean;
    let mut by_capacity: BTreeMap<u32, (f64, usize, u64)> = BTreeMap::new();
    for e in &alive {
        let entry = by_capacity.entry(e.capacity).or_default();
        entry.0 += e.calls.load(Ordering::Relaxed) as f64 / f64::from(e.capacity) / per_place;
        entry.1 += 1;
        entry.2 = entry.2.max(e.peak.load(Ordering::Relaxed));
    }
    let lost_endpoints: Vec<_> = fleet.endpoints.iter().filter(|e| e.lost()).collect();
    let refused: u64 = lost_endpoints.iter().map(|e| e.refused.load(Ordering::Relaxed)).sum();

    let victim_jobs = killed.map_or(0, |(victim, _, _)| jobs.iter().filter(|(_, r)| *r == victim).count());
    let jobs_succeeded = states.values().filter(|j| j.state() == pb::JobState::Succeeded).count();
    let commits = counters_after.commits - counters_before.commits;
    let active_ms = counters_after.active_ms - counters_before.active_ms;
    let turns_ok = overhead_ms.len();
    let report = json!({
        "endpoints": config.endpoints,
        "capacities": config.capacities,
        "places": total_capacity,
        "replicas": replicas.len(),
        "replica_threads": config.replica_threads,
        "jobs": jobs.len(),
        "trajectories": jobs.len() * trajectories_per_job as usize,
        "turns_per_trajectory": config.turns,
        "recipe": config.recipe,
        "time_scale": config.time_scale,
        "evaluation_mean_ms": 26_461.0 * config.time_scale,
        "generate_ms": config.generate_ms,
        "lease_ms": config.lease_ms,
        "wall_s": wall_s,
        "turns_expected": turns_total,
        "turns_recorded": turns_recorded,
        "turns_per_s": turns_recorded as f64 / wall_s,
        "overhead_ms_per_turn": {
            "p50": quantile(&overhead_ms, 0.5),
            "p90": quantile(&overhead_ms, 0.9),
            "p99": quantile(&overhead_ms, 0.99),
            "max": overhead_ms.last(),
            "by_turn": by_turn,
        },
        "cpu_s": {
            "this_process": cpu_after.0 - cpu_before.0,
            "postgres": cpu_after.1 - cpu_before.1,
            "per_turn_ms_this_process": (cpu_after.0 - cpu_before.0) * 1e3 / turns_recorded.max(1) as f64,
            "per_turn_ms_postgres": (cpu_after.1 - cpu_before.1) * 1e3 / turns_recorded.max(1) as f64,
        },
        "store": {
            "commits": commits,
            "commits_per_s": commits as f64 / wall_s,
            "commits_per_turn": commits as f64 / turns_recorded.max(1) as f64,
            "rows_inserted_per_s": (counters_after.inserted - counters_before.inserted) as f64 / wall_s,
            "rows_updated_per_s": (counters_after.updated - counters_before.updated) as f64 / wall_s,
            "active_s": active_ms / 1e3,
            "active_ms_per_turn": active_ms / turns_recorded.max(1) as f64,
            // Statement time against the turns' own overhead (mean), and against the wall time of two cores.
            "share_of_overhead": active_ms / turns_ok.max(1) as f64
                / (overhead_ms.iter().sum::<f64>() / turns_ok.max(1) as f64),
            "share_of_machine": active_ms / 1e3 / (wall_s * std::thread::available_parallelism().map_or(1, |n| n.get()) as f64),
        },
        "load": {
            "endpoints_counted": ratios.len(),
            "calls_per_capacity_over_mean": {
                "cv": cv,
                "min": ratios.iter().copied().fold(f64::INFINITY, f64::min),
                "max": ratios.iter().copied().fold(0.0, f64::max),
            },
            "by_capacity": by_capacity.iter().map(|(capacity, (sum, n, peak))| json!({
                "capacity": capacity, "endpoints": n, "mean_ratio": sum / *n as f64, "peak_in_flight": peak,
            })).collect::<Vec<_>>(),
        },
        "endpoint_loss": config.lose.map(|lose| json!({
            "mode": format!("{:?}", lose.loss),
            "lost": lost_endpoints.len(),
            "at_s": lost_at.as_ref().map(|(at, _)| *at),
            "notice_ms": lose.notice.as_millis() as u64,
            "evaluations_refused": refused,
        })),
        "replica_kill": killed.map(|(victim, _, at)| json!({
            "replica": replicas[victim].instance,
            "at_s": at,
            "its_jobs": victim_jobs,
            "taken_over_after_s": taken_over_after,
        })),
        "turns_failed": turns_failed,
        "trajectories_incomplete": trajectories_incomplete,
        "jobs_succeeded": jobs_succeeded,
        "repeated": {
            "generations": generated_again,
            "evaluations": evaluated_again,
            "scores_beyond_turns": scores as i64 - turns_ok as i64,
        },
    });
    for replica in &mut replicas {
        replica.kill();
    }
    fleet.stop();
    peers_server.abort();
    Outcome {
        report,
        jobs: jobs.len(),
        jobs_succeeded,
        trajectories_incomplete,
        turns_recorded,
        turns_expected: turns_total,
        turns_failed,
        load,
        taken_over: killed.is_none() || taken_over_after.is_some(),
    }
}
