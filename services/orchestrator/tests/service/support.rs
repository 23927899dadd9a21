//! Test support: fake gateway, evaluator, reward and profiler services in one in-process server that count the
//! calls they receive and answer (the gateway answers a `judge` model with a cudaforge review), can hold a chosen call forever (so that a test can kill the orchestrator in the middle of
//! it) and can answer scripted failures; and a throwaway PostgreSQL cluster.

#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use kforge_proto::v1 as pb;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

/// A turn's key as the fakes see it: `task/trajectory/turn`.
pub fn key(task: &str, trajectory: u32, turn: u32) -> String {
    format!("{task}/{trajectory}/{turn}")
}

/// A call the fakes can hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hold {
    /// Gateway/Generate of this key.
    Generate(String),
    /// Evaluator/Evaluate of this key.
    Evaluate(String),
    /// The next Reward/ScoreKernels call.
    NextScore,
}

/// A scripted evaluator answer.
#[derive(Debug, Clone)]
pub enum Answer {
    /// RESOURCE_EXHAUSTED.
    Busy,
    /// VERDICT_INFRA_ERROR, retryable or not.
    Infra { retryable: bool },
    /// VERDICT_CORRECT at `speedup`, its paired timing unsteady (the notice `timing.unsteady`).
    Unsteady { speedup: f64 },
}

#[derive(Debug, Default)]
pub struct Counts {
    /// Calls received, by key (held ones included).
    pub received: HashMap<String, u32>,
    /// Calls answered, by key.
    pub answered: HashMap<String, u32>,
}

#[derive(Debug, Default)]
pub struct State {
    pub generate: Mutex<Counts>,
    pub evaluate: Mutex<Counts>,
    pub scores: Mutex<u32>,
    hold: Mutex<Option<Hold>>,
    held: Mutex<Option<mpsc::UnboundedSender<Hold>>>,
    release: tokio::sync::Notify,
    script: Mutex<HashMap<String, VecDeque<Answer>>>,
    failing_generations: Mutex<Vec<String>>,
    /// When set, every evaluation waits for a permit (the test releases them).
    gate: Mutex<Option<Arc<tokio::sync::Semaphore>>>,
    /// Evaluations inside the fake now, and the most there ever were.
    pub evaluating: std::sync::atomic::AtomicU32,
    pub max_evaluating: std::sync::atomic::AtomicU32,
    /// Keys of gated evaluations in the order they reached the fake.
    pub arrivals: Mutex<Vec<String>>,
    /// The last user message of each Judge request (a `judge` model), by key.
    pub judge_prompts: Mutex<HashMap<String, String>>,
    /// Profile requests received.
    pub profiles: Mutex<u32>,
    /// Each ScoreKernels call's formula (`kevin` or `drkernel`) and its outcome's profiling ratio.
    pub scored: Mutex<Vec<(String, Option<f64>)>>,
    /// Evaluations that asked for the census.
    pub census_requests: Mutex<u32>,
    /// RejectionSample requests received.
    pub rejections: Mutex<Vec<pb::RejectionSampleRequest>>,
}

impl State {
    /// Holds the next call matching `hold` until [`State::release`]; the returned receiver gets it once the call
    /// has arrived.
    pub fn hold(&self, hold: Hold) -> mpsc::UnboundedReceiver<Hold> {
        let (sender, receiver) = mpsc::unbounded_channel();
        *self.hold.lock().expect("lock") = Some(hold);
        *self.held.lock().expect("lock") = Some(sender);
        receiver
    }

    /// Lets the held call go on (it answers as it would have).
    pub fn release(&self) {
        self.release.notify_one();
    }

    /// Scripts the evaluator's first answers for `key`; later calls answer correct.
    pub fn script(&self, key: &str, answers: impl IntoIterator<Item = Answer>) {
        self.script.lock().expect("lock").insert(key.to_owned(), answers.into_iter().collect());
    }

    /// Generations of `key` fail with UNAVAILABLE.
    pub fn fail_generation(&self, key: &str) {
        self.failing_generations.lock().expect("lock").push(key.to_owned());
    }

    /// Makes every evaluation wait for a permit of the returned semaphore.
    pub fn gate_evaluations(&self) -> Arc<tokio::sync::Semaphore> {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        *self.gate.lock().expect("lock") = Some(gate.clone());
        gate
    }

    pub fn generate_counts(&self) -> (HashMap<String, u32>, HashMap<String, u32>) {
        let counts = self.generate.lock().expect("lock");
        (counts.received.clone(), counts.answered.clone())
    }

    pub fn evaluate_counts(&self) -> (HashMap<String, u32>, HashMap<String, u32>) {
        let counts = self.evaluate.lock().expect("lock");
        (counts.received.clone(), counts.answered.clone())
    }

    /// Whether this call is the held one: if so, tells the test and waits for [`State::release`] (or for the
    /// orchestrator to be killed, or to drop the call).
    async fn maybe_hold(&self, call: Hold) {
        let matched = {
            let mut hold = self.hold.lock().expect("lock");
            if hold.as_ref() == Some(&call) {
                hold.take();
                true
            } else {
                false
            }
        };
        if matched {
            if let Some(sender) = self.held.lock().expect("lock").take() {
                let _ = sender.send(call);
            }
            self.release.notified().await;
        }
    }
}

fn count(counts: &Mutex<Counts>, key: &str, answered: bool) {
    let mut counts = counts.lock().expect("lock");
    let map = if answered { &mut counts.answered } else { &mut counts.received };
    *map.entry(key.to_owned()).or_default() += 1;
}

/// The fake Judge's answer: the fields of both modes.
pub const REVIEW: &str = r#"{"critical_issue": "fake issue", "why_it_matters": "fake why", "minimal_fix_hint": "fake fix",
"bottleneck": "DRAM bandwidth", "optimisation_method": "vectorise the loads", "modification_plan": "use float4"}"#;

/// The fake profile's diagnosis text.
pub const DIAGNOSIS: &str = "fake_kernel is memory-bound: memory throughput is at 80.0% of peak";

/// The kernel every fake response holds.
pub const KERNEL: &str =
    "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x\n";

#[derive(Debug, Clone)]
struct Fakes(Arc<State>);

#[tonic::async_trait]
impl pb::gateway_server::Gateway for Fakes {
    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<pb::GenerateResponse>, Status> {
        let request = request.into_inner();
        let keys = request.keys.unwrap_or_default();
        let key = key(&keys.task_id, keys.trajectory, keys.turn);
        if request.model == "judge" {
            let prompt = match request.input {
                Some(pb::generate_request::Input::Chat(chat)) => chat.messages.last().map(|m| m.content.clone()),
                _ => None,
            };
            self.0.judge_prompts.lock().expect("lock").insert(key, prompt.unwrap_or_default());
            return Ok(Response::new(pb::GenerateResponse {
                completions: vec![pb::Completion { text: REVIEW.into(), ..Default::default() }],
                usage: Some(pb::Usage { prompt_tokens: 100, completion_tokens: 20, ..Default::default() }),
                ..Default::default()
            }));
        }
        count(&self.0.generate, &key, false);
        self.0.maybe_hold(Hold::Generate(key.clone())).await;
        if self.0.failing_generations.lock().expect("lock").contains(&key) {
            return Err(Status::unavailable("backend down"));
        }
        count(&self.0.generate, &key, true);
        Ok(Response::new(pb::GenerateResponse {
            completions: vec![pb::Completion {
                text: format!("Attempt {key}.\n\n```python\n{KERNEL}```\n"),
                reasoning: "Okay, a kernel.".into(),
                finish_reason: "stop".into(),
                token_ids: vec![1, 2, 3],
                logprobs: vec![-0.5, -0.25, -0.125],
                ..Default::default()
            }],
            usage: Some(pb::Usage { prompt_tokens: 10, completion_tokens: 3, ..Default::default() }),
            prompt_token_ids: vec![7, 8],
            ..Default::default()
        }))
    }

    type GenerateStreamStream = tonic::codegen::BoxStream<pb::GenerateStreamResponse>;

    async fn generate_stream(
        &self,
        _request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStreamStream>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn list_models(
        &self,
        _request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn control_backends(
        &self,
        _request: Request<pb::ControlBackendsRequest>,
    ) -> Result<Response<pb::ControlBackendsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

#[tonic::async_trait]
impl pb::evaluator_server::Evaluator for Fakes {
    async fn evaluate(&self, request: Request<pb::EvaluateRequest>) -> Result<Response<pb::EvaluateResponse>, Status> {
        let request = request.into_inner();
        let key = request.idempotency_key.strip_prefix(&format!("{}/", request.job_id)).unwrap_or("").to_owned();
        count(&self.0.evaluate, &key, false);
        if request.census {
            *self.0.census_requests.lock().expect("lock") += 1;
        }
        let census = |kernel: &str, own, total_ms| pb::KernelRecord {
            name: kernel.into(),
            own,
            launches: 2,
            total_ms,
            mode: "train/no_grad".into(),
        };
        let (kernels, profiling_ratio) = match request.census {
            true => (vec![census("my_kernel(float*)", true, 0.02), census("at::native::copy(int)", false, 0.01)], 0.67),
            false => (Vec::new(), 0.0),
        };
        self.0.maybe_hold(Hold::Evaluate(key.clone())).await;
        let gate = self.0.gate.lock().expect("lock").clone();
        if let Some(gate) = gate {
            use std::sync::atomic::Ordering::SeqCst;
            self.0.arrivals.lock().expect("lock").push(key.clone());
            let now = self.0.evaluating.fetch_add(1, SeqCst) + 1;
            self.0.max_evaluating.fetch_max(now, SeqCst);
            gate.acquire().await.expect("the gate is never closed").forget();
            self.0.evaluating.fetch_sub(1, SeqCst);
        }
        let scripted = self.0.script.lock().expect("lock").get_mut(&key).and_then(VecDeque::pop_front);
        count(&self.0.evaluate, &key, true);
        let timing = |ms| Some(pb::TimingStats { median_ms: ms, ..Default::default() });
        match scripted {
            Some(Answer::Busy) => Err(Status::resource_exhausted("evaluator queue full")),
            Some(Answer::Infra { retryable }) => Ok(Response::new(pb::EvaluateResponse {
                verdict: pb::Verdict::InfraError.into(),
                retryable,
                error: "device lost".into(),
                ..Default::default()
            })),
            Some(Answer::Unsteady { speedup }) => Ok(Response::new(pb::EvaluateResponse {
                verdict: pb::Verdict::Correct.into(),
                speedup_eager: speedup,
                candidate_timing: timing(2.0),
                eager_timing: timing(2.0 * speedup),
                findings: vec![pb::Finding {
                    code: "timing.unsteady".into(),
                    category: pb::FindingCategory::Notice.into(),
                    ..Default::default()
                }],
                ..Default::default()
            })),
            None => Ok(Response::new(pb::EvaluateResponse {
                verdict: pb::Verdict::Correct.into(),
                speedup_eager: 1.5,
                candidate_timing: timing(2.0),
                eager_timing: timing(3.0),
                kernels,
                profiling_ratio,
                ..Default::default()
            })),
        }
    }

    type EvaluateStreamStream = tonic::codegen::BoxStream<pb::EvaluateResponse>;

    async fn evaluate_stream(
        &self,
        _request: Request<tonic::Streaming<pb::EvaluateRequest>>,
    ) -> Result<Response<Self::EvaluateStreamStream>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn get_capabilities(
        &self,
        _request: Request<pb::GetCapabilitiesRequest>,
    ) -> Result<Response<pb::GetCapabilitiesResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

#[tonic::async_trait]
impl pb::reward_server::Reward for Fakes {
    async fn score_kernels(
        &self,
        request: Request<pb::ScoreKernelsRequest>,
    ) -> Result<Response<pb::ScoreKernelsResponse>, Status> {
        self.0.maybe_hold(Hold::NextScore).await;
        *self.0.scores.lock().expect("lock") += 1;
        let request = request.into_inner();
        let formula = match &request.formula {
            Some(pb::score_kernels_request::Formula::Drkernel(_)) => "drkernel",
            Some(pb::score_kernels_request::Formula::Kevin(_)) => "kevin",
            None => "none",
        };
        let ratio = request.outcomes.first().and_then(|o| o.profiling_ratio);
        self.0.scored.lock().expect("lock").push((formula.to_owned(), ratio));
        let scores = request
            .outcomes
            .iter()
            .map(|outcome| pb::KernelScore {
                score: if outcome.verdict() == pb::Verdict::Correct { 1.8 } else { 0.0 },
                speedup: outcome.speedup_eager.unwrap_or_default(),
                ..Default::default()
            })
            .collect();
        Ok(Response::new(pb::ScoreKernelsResponse { scores }))
    }

    /// Returns equal to the rewards (gamma 0).
    async fn compute_returns(
        &self,
        request: Request<pb::ComputeReturnsRequest>,
    ) -> Result<Response<pb::ComputeReturnsResponse>, Status> {
        Ok(Response::new(pb::ComputeReturnsResponse { trajectories: request.into_inner().trajectories }))
    }

    /// Advantages: each return less its group's mean.
    async fn compute_advantages(
        &self,
        request: Request<pb::ComputeAdvantagesRequest>,
    ) -> Result<Response<pb::ComputeAdvantagesResponse>, Status> {
        let mut groups = request.into_inner().groups;
        for group in &mut groups {
            let values: Vec<f64> = group.trajectories.iter().flat_map(|t| t.values.iter().copied()).collect();
            let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
            for value in group.trajectories.iter_mut().flat_map(|t| t.values.iter_mut()) {
                *value -= mean;
            }
        }
        Ok(Response::new(pb::ComputeAdvantagesResponse { groups }))
    }

    /// The real reward service's decisions (pure functions of the request), with the requests kept.
    async fn rejection_sample(
        &self,
        request: Request<pb::RejectionSampleRequest>,
    ) -> Result<Response<pb::RejectionSampleResponse>, Status> {
        self.0.rejections.lock().expect("lock").push(request.get_ref().clone());
        kforge_reward::RewardService.rejection_sample(request).await
    }

    async fn diagnose(&self, request: Request<pb::DiagnoseRequest>) -> Result<Response<pb::DiagnoseResponse>, Status> {
        let flags = request.into_inner().responses.iter().map(|_| pb::ResponseFlags::default()).collect();
        Ok(Response::new(pb::DiagnoseResponse { flags, ..Default::default() }))
    }
}

#[tonic::async_trait]
impl pb::profiler_server::Profiler for Fakes {
    async fn profile(&self, _request: Request<pb::ProfileRequest>) -> Result<Response<pb::ProfileResponse>, Status> {
        *self.0.profiles.lock().expect("lock") += 1;
        let metric = |name: &str, value, unit: &str| pb::MetricValue { name: name.into(), value, unit: unit.into() };
        let launch = |ms: f64, dram: f64| pb::KernelProfile {
            name: "fake_kernel".into(),
            duration_ms: ms,
            metrics: vec![metric("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", dram, "%")],
            ..Default::default()
        };
        Ok(Response::new(pb::ProfileResponse {
            verdict: pb::Verdict::Correct.into(),
            kernels: vec![launch(0.04, 79.0), launch(0.05, 80.0), launch(0.06, 81.0)],
            diagnosis: Some(pb::Diagnosis {
                bottleneck: pb::Bottleneck::Memory.into(),
                kernel: "fake_kernel".into(),
                summary: DIAGNOSIS.into(),
                ..Default::default()
            }),
            device: Some(pb::DeviceSpec { name: "Fake GPU".into(), sm_count: 7, ..Default::default() }),
            ..Default::default()
        }))
    }

    type StreamReportStream = tonic::codegen::BoxStream<pb::ReportChunk>;

    async fn stream_report(
        &self,
        _request: Request<pb::StreamReportRequest>,
    ) -> Result<Response<Self::StreamReportStream>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn get_device_spec(
        &self,
        _request: Request<pb::GetDeviceSpecRequest>,
    ) -> Result<Response<pb::GetDeviceSpecResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn select_metrics(
        &self,
        _request: Request<pb::SelectMetricsRequest>,
    ) -> Result<Response<pb::SelectMetricsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn get_capabilities(
        &self,
        _request: Request<pb::GetProfilerCapabilitiesRequest>,
    ) -> Result<Response<pb::ProfilerCapabilities>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

/// Starts the fakes on one ephemeral port; they serve until the test's runtime ends.
pub async fn start_fakes() -> (String, Arc<State>) {
    let state = Arc::new(State::default());
    let fakes = Fakes(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let server = tonic::transport::Server::builder()
        .add_service(pb::gateway_server::GatewayServer::new(fakes.clone()))
        .add_service(pb::evaluator_server::EvaluatorServer::new(fakes.clone()))
        .add_service(pb::reward_server::RewardServer::new(fakes.clone()))
        .add_service(pb::profiler_server::ProfilerServer::new(fakes))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    tokio::spawn(server);
    (format!("http://{address}"), state)
}

/// A valid KernelBench-format task.
pub const TASK: &str = "import torch\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n\n\
                    def get_inputs():\n    return [torch.randn(4)]\n\ndef get_init_inputs():\n    return []\n";

/// A single-turn rollout over inline copies of [`TASK`] named `tasks`, for the `fake` model.
pub fn spec(tasks: &[&str], trajectories: u32, turns: u32) -> pb::JobSpec {
    pb::JobSpec {
        kind: pb::JobKind::Rollout.into(),
        recipe: "single-turn".into(),
        task_set: "inline".into(),
        tasks: tasks.iter().map(|id| pb::Task { task_id: (*id).into(), source: TASK.into() }).collect(),
        model: "fake".into(),
        trajectories_per_task: trajectories,
        turns,
        ..Default::default()
    }
}

/// The orchestrator in this process: its real `serve_with_http` on an ephemeral port, an in-memory SQLite store,
/// every peer at `peers`, eight attempts per call with a backoff of 1-4 ms; `tune` changes the configuration first.
pub async fn orchestrator(peers: &str, tune: impl FnOnce(&mut kforge_orchestrator::OrchestratorConfig)) -> Running {
    let mut config = kforge_orchestrator::OrchestratorConfig {
        store: "sqlite::memory:".into(),
        peers: kforge_orchestrator::PeersConfig {
            gateway: peers.into(),
            evaluator: peers.into(),
            reward: peers.into(),
            profiler: peers.into(),
            client: Default::default(),
        },
        retry: kforge_orchestrator::RetryConfig { attempts: 8, initial_backoff_ms: 1, max_backoff_ms: 4 },
        ..Default::default()
    };
    tune(&mut config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let host_port = listener.local_addr().expect("address").to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        kforge_orchestrator::serve_with_http(config, listener, None, async {
            let _ = stopped.await;
        })
        .await
        .expect("serves");
    });
    let channel = wait_ready(&format!("http://{host_port}"), std::time::Duration::from_secs(30)).await;
    Running {
        client: pb::orchestrator_client::OrchestratorClient::new(channel.clone()),
        channel,
        address: host_port,
        stop: Some(stop),
        served,
    }
}

/// An orchestrator [`orchestrator`] started, until [`Running::shutdown`].
pub struct Running {
    pub client: pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    pub channel: tonic::transport::Channel,
    /// `host:port` it serves on (gRPC and `/metrics`).
    pub address: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops it and waits until it has drained.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.served).await.expect("the orchestrator stops");
    }
}

/// A port free now (bound and released): for a child process that must be told its address.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("address").port()
}

/// Waits until `address` accepts gRPC connections (a child that is starting), for at most `patience`.
pub async fn wait_ready(address: &str, patience: std::time::Duration) -> tonic::transport::Channel {
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        match tonic::transport::Endpoint::from_shared(address.to_owned()).expect("url").connect().await {
            Ok(channel) => return channel,
            Err(error) if tokio::time::Instant::now() > deadline => panic!("{address} never became ready: {error}"),
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    }
}

/// Whether tests must fail rather than skip when a tool is missing (scripts/test.sh sets it after set-up).
pub fn ci() -> bool {
    std::env::var("KFORGE_CI").is_ok_and(|v| v == "1")
}

/// A throwaway PostgreSQL cluster (initdb and pg_ctl on a temporary directory and a free port), run as the
/// `postgres` user when this process is root; stopped and removed on drop.
#[derive(Debug)]
pub struct Postgres {
    dir: PathBuf,
    bin: PathBuf,
    pub url: String,
}

impl Postgres {
    /// Starts a cluster, or prints `SKIP:` and returns None where the PostgreSQL binaries are missing (a failure
    /// under KFORGE_CI=1).
    pub fn start(test: &str) -> Option<Self> {
        let Some(bin) = postgres_bindir() else {
            let message = "SKIP: PostgreSQL binaries (initdb, pg_ctl) not found: scripts/setup.sh --test installs them";
            assert!(!ci(), "{message} (KFORGE_CI=1 requires them)");
            eprintln!("{message}");
            return None;
        };
        let dir = std::env::temp_dir().join(format!("kforge-pg-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("cluster dir");
        let root = is_root();
        if root {
            let status = Command::new("chown").arg("postgres:postgres").arg(&dir).status().expect("chown runs");
            assert!(status.success(), "chown postgres {}: is there a postgres user?", dir.display());
        }
        let port = free_port();
        let data = dir.join("data");
        run_as_postgres(
            root,
            &bin.join("initdb"),
            &["-D", path(&data), "-A", "trust", "-U", "kforge", "--no-sync", "-E", "UTF8"],
            &dir,
        );
        let options = format!("-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off", dir.display());
        let log = dir.join("log");
        run_as_postgres(
            root,
            &bin.join("pg_ctl"),
            &["-D", path(&data), "-o", &options, "-l", path(&log), "-w", "-t", "120", "start"],
            &dir,
        );
        Some(Self { url: format!("postgres://kforge@127.0.0.1:{port}/postgres"), dir, bin })
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let mut command = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(self.bin.join("pg_ctl"));
            c
        } else {
            Command::new(self.bin.join("pg_ctl"))
        };
        let _ = command.args(["-D", path(&data), "-m", "immediate", "-w", "stop"]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn run_as_postgres(root: bool, program: &Path, args: &[&str], dir: &Path) {
    let mut command = if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    };
    let output = command.args(args).current_dir(dir).output().expect("postgres tool runs");
    assert!(
        output.status.success(),
        "{} {args:?} failed: {}{}",
        program.display(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The directory holding initdb and pg_ctl: PATH first, then Debian's /usr/lib/postgresql/<version>/bin.
fn postgres_bindir() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").into_iter().flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>());
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|entry| entry.path().join("bin"));
    on_path.chain(debian).find(|dir| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file()).map(|dir| {
        // A symlink (/usr/local/bin/initdb) leads to the real directory, where the server binary is too.
        std::fs::canonicalize(dir.join("initdb")).ok().and_then(|p| p.parent().map(Path::to_path_buf)).unwrap_or(dir)
    })
}
