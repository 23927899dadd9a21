//! Fake peers of the orchestrator: the gateway, evaluator, reward and profiler services in one in-process gRPC
//! server, for the orchestrator's tests and benchmarks.
//!
//! The server does what every user needs: it counts the calls it receives and answers by key
//! (`task/trajectory/turn`), can hold one chosen call until [`State::release`] (so that a test can kill the
//! orchestrator in the middle of it), can gate every evaluation behind a semaphore the test fills, scripts an
//! evaluator's first answers per key (busy, infrastructure errors, unsteady timings), fails chosen generations, and
//! records what the Judge, the profiler and the reward service were asked. What the peers answer otherwise is an
//! [`Answers`]: [`Standard`] (one small correct kernel, scored 1.8) unless a benchmark brings its own (responses that
//! take time, or the size of real ones).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use kforge_proto::v1 as pb;
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio_stream::StreamExt as _;
use tonic::{Request, Response, Status};

/// A turn's key as the fakes see it: `task/trajectory/turn`.
pub fn key(task: &str, trajectory: u32, turn: u32) -> String {
    format!("{task}/{trajectory}/{turn}")
}

/// The fake Judge's answer (to a `judge` model): the fields of both of its modes.
pub const REVIEW: &str = r#"{"critical_issue": "fake issue", "why_it_matters": "fake why", "minimal_fix_hint": "fake fix",
"bottleneck": "DRAM bandwidth", "optimisation_method": "vectorise the loads", "modification_plan": "use float4"}"#;

/// The fake profile's diagnosis text.
pub const DIAGNOSIS: &str = "fake_kernel is memory-bound: memory throughput is at 80.0% of peak";

/// The kernel every [`Standard`] response holds.
pub const KERNEL: &str =
    "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x\n";

/// A valid KernelBench-format task (its `forward` returns its input).
pub const TASK: &str = "import torch\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n\n\
                    def get_inputs():\n    return [torch.randn(4)]\n\ndef get_init_inputs():\n    return []\n";

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

/// What the peers answer once a call has been counted, held and gated. Every method has the [`Standard`] answer
/// as its default.
pub trait Answers: Send + Sync + 'static {
    /// Gateway/Generate of a model other than `judge`.
    fn generate(
        &self,
        request: pb::GenerateRequest,
    ) -> impl Future<Output = Result<pb::GenerateResponse, Status>> + Send {
        std::future::ready(Ok(standard_generation(&request)))
    }

    /// Evaluator/Evaluate, when no scripted [`Answer`] is left for its key.
    fn evaluate(
        &self,
        request: pb::EvaluateRequest,
    ) -> impl Future<Output = Result<pb::EvaluateResponse, Status>> + Send {
        std::future::ready(Ok(standard_evaluation(&request)))
    }

    /// A kernel's score: 1.8 when correct, else 0.
    fn score(&self, outcome: &pb::KernelOutcome) -> f64 {
        if outcome.verdict() == pb::Verdict::Correct { 1.8 } else { 0.0 }
    }

    /// Advantages from returns: each less its group's mean.
    fn advantages(&self, mut groups: Vec<pb::AdvantageGroup>) -> Vec<pb::AdvantageGroup> {
        for group in &mut groups {
            let values: Vec<f64> = group.trajectories.iter().flat_map(|t| t.values.iter().copied()).collect();
            let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
            for value in group.trajectories.iter_mut().flat_map(|t| t.values.iter_mut()) {
                *value -= mean;
            }
        }
        groups
    }
}

/// The answers of the orchestrator's tests: every generation `Attempt KEY.` with [`KERNEL`] (token ids 1-3 and
/// their log-probabilities), every evaluation correct at 1.5x (with a census when asked), scores 1.8.
#[derive(Debug, Clone, Copy, Default)]
pub struct Standard;

impl Answers for Standard {}

/// [`Standard`]'s generation.
pub fn standard_generation(request: &pb::GenerateRequest) -> pb::GenerateResponse {
    let keys = request.keys.clone().unwrap_or_default();
    let key = key(&keys.task_id, keys.trajectory, keys.turn);
    pb::GenerateResponse {
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
    }
}

/// [`Standard`]'s evaluation: correct at 1.5x; with the census when the request asks (one own kernel of two).
pub fn standard_evaluation(request: &pb::EvaluateRequest) -> pb::EvaluateResponse {
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
    pb::EvaluateResponse {
        verdict: pb::Verdict::Correct.into(),
        speedup_eager: 1.5,
        candidate_timing: timing(2.0),
        eager_timing: timing(3.0),
        kernels,
        profiling_ratio,
        ..Default::default()
    }
}

fn timing(median_ms: f64) -> Option<pb::TimingStats> {
    Some(pb::TimingStats { median_ms, ..Default::default() })
}

/// Calls received and answered, by key.
#[derive(Debug, Default)]
pub struct Counts {
    /// Calls received, by key (held ones included).
    pub received: HashMap<String, u32>,
    /// Calls answered, by key.
    pub answered: HashMap<String, u32>,
}

/// What the fakes saw and what the test asks of them.
#[derive(Debug, Default)]
pub struct State {
    pub generate: Mutex<Counts>,
    pub evaluate: Mutex<Counts>,
    pub scores: Mutex<u32>,
    hold: Mutex<Option<Hold>>,
    held: Mutex<Option<mpsc::UnboundedSender<Hold>>>,
    release: Notify,
    script: Mutex<HashMap<String, VecDeque<Answer>>>,
    failing_generations: Mutex<Vec<String>>,
    /// When set, every evaluation waits for a permit (the test releases them).
    gate: Mutex<Option<Arc<Semaphore>>>,
    /// Gated evaluations inside the fake now, and the most there ever were.
    pub evaluating: AtomicU32,
    pub max_evaluating: AtomicU32,
    /// Keys of gated evaluations in the order they reached the fake.
    pub arrivals: Mutex<Vec<String>>,
    /// The last user message of each Judge request (a `judge` model), by key.
    pub judge_prompts: Mutex<HashMap<String, String>>,
    /// Profile requests received.
    pub profiles: Mutex<u32>,
    /// Each ScoreKernels call's formula (`kevin` or `drkernel`) and its first outcome's profiling ratio.
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

    /// Scripts the evaluator's first answers for `key`; later calls answer as the [`Answers`] say.
    pub fn script(&self, key: &str, answers: impl IntoIterator<Item = Answer>) {
        self.script.lock().expect("lock").insert(key.to_owned(), answers.into_iter().collect());
    }

    /// Generations of `key` fail with UNAVAILABLE.
    pub fn fail_generation(&self, key: &str) {
        self.failing_generations.lock().expect("lock").push(key.to_owned());
    }

    /// Makes every evaluation wait for a permit of the returned semaphore.
    pub fn gate_evaluations(&self) -> Arc<Semaphore> {
        let gate = Arc::new(Semaphore::new(0));
        *self.gate.lock().expect("lock") = Some(gate.clone());
        gate
    }

    /// Generations received and answered, by key.
    pub fn generate_counts(&self) -> (HashMap<String, u32>, HashMap<String, u32>) {
        let counts = self.generate.lock().expect("lock");
        (counts.received.clone(), counts.answered.clone())
    }

    /// Evaluations received and answered, by key.
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

/// Starts the fakes with the [`Standard`] answers on an ephemeral port: their URL and state. They serve until the
/// runtime ends.
pub async fn start_fakes() -> (String, Arc<State>) {
    start_with(Standard).await
}

/// [`start_fakes`] with other answers.
pub async fn start_with<A: Answers>(answers: A) -> (String, Arc<State>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let (state, server) = serve(listener, answers);
    tokio::spawn(server);
    (url, state)
}

/// The fakes on `listener`, for a caller that runs the server itself (a benchmark's runtime of their own): their
/// state and the server, which serves until dropped.
pub fn serve<A: Answers>(
    listener: tokio::net::TcpListener,
    answers: A,
) -> (Arc<State>, impl Future<Output = Result<(), tonic::transport::Error>> + Send) {
    let state = Arc::new(State::default());
    let fakes = Fakes { state: state.clone(), answers: Arc::new(answers) };
    // As kforge's servers do: without TCP_NODELAY a reply can wait for a delayed ACK (40 ms).
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|stream| {
        stream.inspect(|stream| {
            let _ = stream.set_nodelay(true);
        })
    });
    let server = tonic::transport::Server::builder()
        .add_service(pb::gateway_server::GatewayServer::new(fakes.clone()))
        .add_service(pb::evaluator_server::EvaluatorServer::new(fakes.clone()))
        .add_service(pb::reward_server::RewardServer::new(fakes.clone()))
        .add_service(pb::profiler_server::ProfilerServer::new(fakes))
        .serve_with_incoming(incoming);
    (state, server)
}

#[derive(Debug)]
struct Fakes<A> {
    state: Arc<State>,
    answers: Arc<A>,
}

impl<A> Clone for Fakes<A> {
    fn clone(&self) -> Self {
        Self { state: self.state.clone(), answers: self.answers.clone() }
    }
}

#[tonic::async_trait]
impl<A: Answers> pb::gateway_server::Gateway for Fakes<A> {
    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<pb::GenerateResponse>, Status> {
        let request = request.into_inner();
        let keys = request.keys.clone().unwrap_or_default();
        let key = key(&keys.task_id, keys.trajectory, keys.turn);
        if request.model == "judge" {
            let prompt = match request.input {
                Some(pb::generate_request::Input::Chat(chat)) => chat.messages.last().map(|m| m.content.clone()),
                _ => None,
            };
            self.state.judge_prompts.lock().expect("lock").insert(key, prompt.unwrap_or_default());
            return Ok(Response::new(pb::GenerateResponse {
                completions: vec![pb::Completion { text: REVIEW.into(), ..Default::default() }],
                usage: Some(pb::Usage { prompt_tokens: 100, completion_tokens: 20, ..Default::default() }),
                ..Default::default()
            }));
        }
        count(&self.state.generate, &key, false);
        self.state.maybe_hold(Hold::Generate(key.clone())).await;
        if self.state.failing_generations.lock().expect("lock").contains(&key) {
            return Err(Status::unavailable("backend down"));
        }
        count(&self.state.generate, &key, true);
        self.answers.generate(request).await.map(Response::new)
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
impl<A: Answers> pb::evaluator_server::Evaluator for Fakes<A> {
    async fn evaluate(&self, request: Request<pb::EvaluateRequest>) -> Result<Response<pb::EvaluateResponse>, Status> {
        let request = request.into_inner();
        let key = request.idempotency_key.strip_prefix(&format!("{}/", request.job_id)).unwrap_or("").to_owned();
        count(&self.state.evaluate, &key, false);
        if request.census {
            *self.state.census_requests.lock().expect("lock") += 1;
        }
        self.state.maybe_hold(Hold::Evaluate(key.clone())).await;
        let gate = self.state.gate.lock().expect("lock").clone();
        if let Some(gate) = gate {
            self.state.arrivals.lock().expect("lock").push(key.clone());
            let now = self.state.evaluating.fetch_add(1, Ordering::SeqCst) + 1;
            self.state.max_evaluating.fetch_max(now, Ordering::SeqCst);
            gate.acquire().await.expect("the gate is never closed").forget();
            self.state.evaluating.fetch_sub(1, Ordering::SeqCst);
        }
        let scripted = self.state.script.lock().expect("lock").get_mut(&key).and_then(VecDeque::pop_front);
        count(&self.state.evaluate, &key, true);
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
            None => self.answers.evaluate(request).await.map(Response::new),
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
impl<A: Answers> pb::reward_server::Reward for Fakes<A> {
    async fn score_kernels(
        &self,
        request: Request<pb::ScoreKernelsRequest>,
    ) -> Result<Response<pb::ScoreKernelsResponse>, Status> {
        self.state.maybe_hold(Hold::NextScore).await;
        *self.state.scores.lock().expect("lock") += 1;
        let request = request.into_inner();
        let formula = match &request.formula {
            Some(pb::score_kernels_request::Formula::Drkernel(_)) => "drkernel",
            Some(pb::score_kernels_request::Formula::Kevin(_)) => "kevin",
            None => "none",
        };
        let ratio = request.outcomes.first().and_then(|o| o.profiling_ratio);
        self.state.scored.lock().expect("lock").push((formula.to_owned(), ratio));
        let scores = request
            .outcomes
            .iter()
            .map(|outcome| pb::KernelScore {
                score: self.answers.score(outcome),
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

    async fn compute_advantages(
        &self,
        request: Request<pb::ComputeAdvantagesRequest>,
    ) -> Result<Response<pb::ComputeAdvantagesResponse>, Status> {
        Ok(Response::new(pb::ComputeAdvantagesResponse {
            groups: self.answers.advantages(request.into_inner().groups),
        }))
    }

    /// The real reward service's decisions (pure functions of the request), with the requests kept.
    async fn rejection_sample(
        &self,
        request: Request<pb::RejectionSampleRequest>,
    ) -> Result<Response<pb::RejectionSampleResponse>, Status> {
        self.state.rejections.lock().expect("lock").push(request.get_ref().clone());
        kforge_reward::RewardService.rejection_sample(request).await
    }

    async fn diagnose(&self, request: Request<pb::DiagnoseRequest>) -> Result<Response<pb::DiagnoseResponse>, Status> {
        let flags = request.into_inner().responses.iter().map(|_| pb::ResponseFlags::default()).collect();
        Ok(Response::new(pb::DiagnoseResponse { flags, ..Default::default() }))
    }
}

#[tonic::async_trait]
impl<A: Answers> pb::profiler_server::Profiler for Fakes<A> {
    async fn profile(&self, _request: Request<pb::ProfileRequest>) -> Result<Response<pb::ProfileResponse>, Status> {
        *self.state.profiles.lock().expect("lock") += 1;
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
