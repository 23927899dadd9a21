//! `kforge`: run one service, the whole mesh, the main job or an evaluation, or call any RPC.

use std::io::{IsTerminal as _, Read as _};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use kforge::call::{self, CallError};
use kforge::mesh::{Mesh, MeshConfig, Service};
use kforge::run::{ModelServer, Role, Routed};
use kforge_gateway::config::BackendKind;
use kforge_proto::v1 as pb;
use kforge_server::client::{self, ClientConfig};
use kforge_server::config::AuthConfig;

#[derive(Debug, Parser)]
#[command(name = "kforge", version, about = "The environment side of RL for LLM-written GPU kernels.", long_about = None)]
struct Cli {
    /// Config file with a table per service ([evaluator], [profiler], [reward], [gateway], [orchestrator]).
    /// Any key can be overridden as KFORGE__<TABLE>__<KEY>, e.g. KFORGE__REWARD__SERVER__LISTEN=0.0.0.0:50053.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one service until SIGTERM or Ctrl-C, then drain.
    Serve {
        /// The service to run.
        #[arg(value_enum)]
        service: Service,
    },
    /// Run all five services in this process on their configured loopback ports and print their addresses.
    Up,
    /// Call an RPC: read the request as proto3 JSON on stdin, print the response as proto3 JSON.
    ///
    /// Without --addr the service runs inside this command (like grpcurl without a server). Client-streaming
    /// methods read any number of JSON objects; streaming responses print one object each.
    #[command(
        after_help = "Example:\n  echo '{\"method\":\"RETURN_METHOD_SUM\",\"gamma\":0.4,\"trajectories\":[{\"values\":[0.3,0,1.3]}]}' \\\n    | kforge call Reward/ComputeReturns"
    )]
    Call {
        /// The RPC as Service/Method, e.g. Reward/ComputeAdvantages, kforge.v1.Evaluator/GetCapabilities, or
        /// Health/Check (grpc.health.v1) and ServerReflection/ServerReflectionInfo, which every server serves.
        target: String,
        /// The call's deadline in seconds, sent as its grpc-timeout: past it the server stops the work (a
        /// profile's or evaluation's processes are killed) and answers DEADLINE_EXCEEDED.
        #[arg(long, value_name = "SECONDS")]
        deadline: Option<f64>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Run the main job: every service in-process, a job over a task set, progress, and a report.
    // Boxed: its flags outweigh every other command's (clippy::large_enum_variant).
    Run(Box<RunArgs>),
    /// Evaluate one candidate kernel against one task and print the verdict.
    Eval(EvalArgs),
    /// Write a job's training samples as JSONL or Parquet, one sample per recorded turn.
    Export(kforge::export::ExportArgs),
    /// What this machine can do for kforge and, where it cannot, why and how to fix it: the evaluator's
    /// interpreter, GPUs and driver, compilers, Nsight Compute and its counters, the sandbox, disk, /dev/shm and the
    /// configured ports. Exits with 1 where the evaluator cannot run candidates.
    Doctor {
        /// Print the checks as JSON (`{"evaluator_can_run", "checks": [{"name", "state", "detail", "fix"}]}`).
        #[arg(long)]
        json: bool,
    },
}

/// Where a command's RPCs go.
#[derive(Debug, Args)]
struct Remote {
    /// Address of a running service (http://host:port or https://...); without it the service runs in-process.
    #[arg(long, value_name = "URL")]
    addr: Option<String>,
    /// File holding the bearer token to present (the same token as the server's auth.token_file).
    #[arg(long, value_name = "FILE", env = "KFORGE_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// CA certificate that signs the server's certificate, for https addresses.
    #[arg(long, value_name = "FILE")]
    ca_file: Option<PathBuf>,
}

impl Remote {
    fn client_config(&self) -> ClientConfig {
        ClientConfig {
            tls_ca_file: self.ca_file.clone(),
            tls_domain: None,
            auth: AuthConfig { token_file: self.token_file.clone(), token_env: None },
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendArg {
    Cpu,
    Cuda,
    Triton,
}

/// What serves a `--model-url`: the gateway's backend kinds that speak HTTP.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum ServerArg {
    /// vLLM's OpenAI-compatible server (`vllm serve`).
    Vllm,
    /// SGLang's OpenAI-compatible server (`python -m sglang.launch_server`).
    Sglang,
    /// A hosted OpenAI-compatible API: only the standard fields are sent, and no health route is checked.
    Openai,
    /// llama.cpp's OpenAI-compatible server (`python -m llama_cpp.server`, `llama-server`): llama.cpp's names for
    /// the extra sampling fields, one completion per request.
    Llamacpp,
}

impl ServerArg {
    fn kind(server: Option<Self>) -> BackendKind {
        match server {
            None | Some(Self::Vllm) => BackendKind::Vllm,
            Some(Self::Sglang) => BackendKind::Sglang,
            Some(Self::Openai) => BackendKind::Openai,
            Some(Self::Llamacpp) => BackendKind::Llamacpp,
        }
    }
}

/// `--temperature`: the gateway's range, checked before anything starts.
fn temperature(value: &str) -> Result<f64, String> {
    let temperature: f64 = value.parse().map_err(|e| format!("{e}"))?;
    if !(0.0..=100.0).contains(&temperature) {
        return Err(format!("must be in [0, 100], got {temperature}"));
    }
    Ok(temperature)
}

impl BackendArg {
    fn proto(backend: Option<Self>) -> pb::Backend {
        match backend {
            None => pb::Backend::Unspecified,
            Some(Self::Cpu) => pb::Backend::Cpu,
            Some(Self::Cuda) => pb::Backend::Cuda,
            Some(Self::Triton) => pb::Backend::Triton,
        }
    }
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Recipe: kevin, single-turn, cudaforge or drkernel.
    #[arg(long, default_value = "kevin")]
    recipe: String,
    /// Task set: `tour` (built in: the example tasks whose replayed answers tell a multi-turn story), `examples`
    /// (built in: all 13 example tasks), a KernelBench directory (level1/, level2/, ...) or a JSONL file (one
    /// {"task_id", "source"} object per line).
    #[arg(long, default_value = "tour")]
    tasks: String,
    /// KernelBench levels to take from a KernelBench directory, e.g. `--levels 1,2` (default: all).
    #[arg(long, value_delimiter = ',')]
    levels: Vec<u32>,
    /// Model name as routed by the gateway; `replay` with no such pool configured replays the embedded answers
    /// (per example task, trajectories 0-1 and turns 0-3; the tour's tell its stories) at example prices.
    #[arg(long, default_value = kforge::run::DEFAULT_MODEL)]
    model: String,
    /// cudaforge: the Judge's model (default: `replay-judge`, the embedded reviews, with the `replay` model; else
    /// the model itself).
    #[arg(long)]
    judge_model: Option<String>,
    /// The OpenAI-compatible server of --model for this run: its base URL as an OpenAI client takes it, e.g.
    /// http://host:8000/v1 (a URL without a path gets /v1). Adds a gateway pool for --model; a pool of that name in
    /// the config keeps its settings and gets this server as its only backend.
    #[arg(long, value_name = "URL")]
    model_url: Option<String>,
    /// What serves --model-url (default vllm); openai: a hosted API (standard fields only, no health checks);
    /// llamacpp: llama.cpp's server.
    #[arg(long, value_enum, value_name = "KIND", requires = "model_url")]
    model_server: Option<ServerArg>,
    /// Environment variable holding --model-url's API key, sent as `Authorization: Bearer` (a variable, so that
    /// the key never shows in a process list).
    #[arg(long, value_name = "VAR", requires = "model_url")]
    api_key_env: Option<String>,
    /// cudaforge: the OpenAI-compatible server of --judge-model, as --model-url.
    #[arg(long, value_name = "URL")]
    judge_model_url: Option<String>,
    /// What serves --judge-model-url (default: --model-server's kind).
    #[arg(long, value_enum, value_name = "KIND", requires = "judge_model_url")]
    judge_model_server: Option<ServerArg>,
    /// Environment variable holding --judge-model-url's API key.
    #[arg(long, value_name = "VAR", requires = "judge_model_url")]
    judge_api_key_env: Option<String>,
    /// Sampling temperature of every generation, in [0, 100] (default: the gateway pool's, 1.0 unless configured).
    #[arg(long, value_parser = temperature)]
    temperature: Option<f64>,
    /// Token limit of each generation (default: the gateway pool's, 4096 unless configured; a reasoning model
    /// needs more).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_tokens: Option<u32>,
    /// drkernel: earlier turns a prompt shows, the best by score and the latest (0: 4).
    #[arg(long, default_value_t = 0)]
    context_window: u32,
    /// kevin and drkernel: the most characters earlier attempts take in a prompt, oldest left out first (0: no limit).
    #[arg(long, default_value_t = 0)]
    context_budget_chars: u32,
    /// The opening the model's reasoning is expected to start with (the not-okay check; default `Okay`).
    #[arg(long, conflicts_with = "no_not_okay")]
    opening: Option<String>,
    /// No not-okay check, for a model without a fixed opening.
    #[arg(long)]
    no_not_okay: bool,
    /// Parallel trajectories per task (m); default 1 for single-turn, 2 for the multi-turn recipes.
    #[arg(long)]
    trajectories: Option<u32>,
    /// Refinement turns per trajectory (n); default 1 for single-turn, 3 for the multi-turn recipes.
    #[arg(long)]
    turns: Option<u32>,
    /// Evaluation backend; by default cuda when a GPU is present, cpu otherwise.
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,
    /// Take at most this many tasks (0: all).
    #[arg(long, default_value_t = 0)]
    max_tasks: u32,
    /// Correctness trials per evaluation (0: the evaluator's default).
    #[arg(long, default_value_t = 0)]
    correctness_trials: u32,
    /// Episodes run at once (0: the orchestrator's configured limit).
    #[arg(long, default_value_t = 0)]
    concurrency: u32,
    /// Seed of the job (sampling seeds are derived from it per trajectory); 0 leaves sampling unseeded.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also time torch.compile baselines in the in-process evaluator (minutes per task on a CPU; scores use eager).
    #[arg(long)]
    compile_baseline: bool,
    /// Resume this interrupted job (killed, stopped or cancelled) instead of submitting one; its stored spec applies.
    #[arg(long, value_name = "JOB")]
    resume: Option<String>,
    /// Where the in-process orchestrator keeps its store (DIR/orchestrator.db); by default the configured store,
    /// else ~/.local/state/kforge/orchestrator.db.
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,
    #[command(flatten)]
    remote: Remote,
}

#[derive(Debug, Args)]
struct EvalArgs {
    /// The task: a KernelBench-format Python file (Model, get_inputs, get_init_inputs).
    #[arg(long, value_name = "FILE")]
    task: PathBuf,
    /// The candidate: a Python file defining ModelNew.
    #[arg(long, value_name = "FILE")]
    candidate: PathBuf,
    /// Backend; by default cuda when a GPU is present, cpu otherwise.
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,
    /// Static policy, e.g. kevin-strict or permissive; the evaluator's default when unset.
    #[arg(long)]
    policy: Option<String>,
    /// Print the response as proto3 JSON instead of a summary.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    remote: Remote,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kforge: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        // `kforge call ... | head`: the reader took what it wanted.
        Err(error) if kforge::stdout::is_closed(&error) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kforge: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let config = MeshConfig::load(cli.config.as_deref())?;
    // Servers log at info; commands whose stdout is the product stay quiet unless RUST_LOG says otherwise.
    let quiet = matches!(
        cli.command,
        Command::Call { .. } | Command::Eval(_) | Command::Run(_) | Command::Export(_) | Command::Doctor { .. }
    );
    let _telemetry = kforge_telemetry::init("kforge", if quiet { "warn" } else { "info" })?;
    match cli.command {
        Command::Serve { service } => {
            Mesh::start(&[service], &config, false).await?.run_until(kforge_server::shutdown_signal()).await?;
        }
        Command::Up => {
            let mesh = Mesh::start(&Service::ALL, &config, false).await?;
            let listing: String = mesh
                .addresses()
                .iter()
                .map(|(service, address)| format!("{:<13} {address}\n", service.name()))
                .chain(mesh.http_address().map(|address| format!("{:<13} {address}\n", "orchestrator-http")))
                .collect();
            // The services are what `up` is for: a reader of the listing that went away does not stop them.
            match kforge::stdout::print(&listing) {
                Err(error) if !kforge::stdout::is_closed(&error) => return Err(error),
                _ => {}
            }
            mesh.run_until(kforge_server::shutdown_signal()).await?;
        }
        Command::Call { target, deadline, remote } => call_command(&config, &target, deadline, &remote).await?,
        Command::Run(args) => run_command(&config, *args).await?,
        Command::Eval(args) => eval_command(&config, args).await?,
        Command::Export(args) => kforge::export::command(&config, args).await?,
        Command::Doctor { json } => doctor_command(&config, json).await?,
    }
    Ok(())
}

/// Connects to `service`: at `remote.addr`, or to an instance started in this process (returned to be drained).
async fn connect(
    config: &MeshConfig,
    services: &[Service],
    target: Service,
    remote: &Remote,
) -> anyhow::Result<(client::Channel, Option<Mesh>)> {
    let client_config = remote.client_config();
    if let Some(addr) = &remote.addr {
        return Ok((client::connect(addr, &client_config).await?, None));
    }
    // A one-shot command's orchestrator serves its call: it resumes no stored job and opens no HTTP port.
    let mut config = config.clone();
    config.orchestrator.resume_on_start = false;
    config.orchestrator.http.listen.clear();
    let mesh = Mesh::start(services, &config, true).await?;
    let address = mesh.address(target).context("the in-process mesh runs the target service")?.to_owned();
    Ok((client::connect(&address, &client_config).await?, Some(mesh)))
}

async fn drain(mesh: Option<Mesh>) -> anyhow::Result<()> {
    if let Some(mesh) = mesh {
        mesh.shutdown().await?;
    }
    Ok(())
}

async fn call_command(config: &MeshConfig, target: &str, deadline: Option<f64>, remote: &Remote) -> anyhow::Result<()> {
    let method = call::resolve(target)?;
    let deadline = deadline
        .map(|seconds| std::time::Duration::try_from_secs_f64(seconds).context("--deadline: a number of seconds"))
        .transpose()?;
    let mut input = String::new();
    std::io::stdin().read_to_string(&mut input).context("reading the request from stdin")?;
    let requests = call::parse_requests(&method, &input)?;
    let service = call::in_process_service(&method, &requests);
    let (channel, mesh) = connect(config, &[service], service, remote).await?;
    let result = call::invoke(channel, &method, requests, deadline).await;
    drain(mesh).await?;
    for response in result? {
        kforge::stdout::println(&call::to_json(&response)?)?;
    }
    Ok(())
}

async fn doctor_command(config: &MeshConfig, json: bool) -> anyhow::Result<()> {
    let evidence = kforge::doctor::gather(config).await;
    let report = kforge::doctor::Report::new(kforge::doctor::checks(&evidence));
    if json {
        kforge::stdout::println(&serde_json::to_string_pretty(&report)?)?;
    } else {
        kforge::stdout::print(&report.render())?;
    }
    if !report.evaluator_can_run {
        bail!("the evaluator cannot run candidates here");
    }
    Ok(())
}

async fn run_command(config: &MeshConfig, args: RunArgs) -> anyhow::Result<()> {
    let servers = model_servers(&args)?;
    let spec = job_spec(&args);
    let mut config = config.clone();
    // Where the embedded replay files go, removed when this run ends; the next run removes a killed one's.
    let scratch = match args.remote.addr {
        Some(_) => None,
        None => Some(prepare_in_process(&mut config, &args, &servers, &spec).await?),
    };
    let (channel, mesh) = connect(&config, &Service::ALL, Service::Orchestrator, &args.remote).await?;
    if let Some(mesh) = &mesh {
        for (service, address) in mesh.addresses() {
            eprintln!("{:<13} {address}", service.name());
        }
    }
    let mut orchestrator = pb::orchestrator_client::OrchestratorClient::new(channel);
    let outcome = follow_job(&mut orchestrator, spec, args.resume.as_deref()).await;
    drain(mesh).await?;
    drop(scratch);
    let (job, trajectories) = outcome?;
    report_job(&config, &job, &trajectories)
}

/// The job `kforge run`'s flags describe; a multi-turn recipe defaults to 2 trajectories of 3 turns.
fn job_spec(args: &RunArgs) -> pb::JobSpec {
    let multi_turn = args.recipe != "single-turn";
    let judge_model = match &args.judge_model {
        Some(model) => model.clone(),
        None if args.recipe == "cudaforge" && args.model == kforge::run::DEFAULT_MODEL => {
            kforge::run::DEFAULT_JUDGE_MODEL.to_owned()
        }
        None => String::new(),
    };
    pb::JobSpec {
        kind: pb::JobKind::Evaluation.into(),
        recipe: args.recipe.clone(),
        task_set: args.tasks.clone(),
        model: args.model.clone(),
        judge_model,
        context_window: args.context_window,
        context_budget_chars: args.context_budget_chars,
        diagnose: (args.opening.is_some() || args.no_not_okay).then(|| pb::DiagnoseParams {
            opening: args.opening.clone(),
            repetition_threshold: None,
            not_okay_off: args.no_not_okay,
        }),
        reward: None,
        trajectories_per_task: args.trajectories.unwrap_or(if multi_turn { 2 } else { 1 }),
        turns: args.turns.unwrap_or(if multi_turn { 3 } else { 1 }),
        backend: BackendArg::proto(args.backend).into(),
        prompt_dir: String::new(),
        max_tasks: args.max_tasks,
        sampling: (args.temperature.is_some() || args.max_tokens.is_some()).then(|| pb::SamplingParams {
            temperature: args.temperature,
            max_tokens: args.max_tokens,
            ..Default::default()
        }),
        seed: args.seed,
        tasks: Vec::new(),
        policy: String::new(),
        correctness_trials: args.correctness_trials,
        measure_performance: None,
        max_concurrent_episodes: args.concurrency,
        levels: args.levels.clone(),
        strict_format: None,
    }
}

/// Readies the in-process mesh for one job: its store, the model servers the flags name, the embedded replay files
/// (in the scratch directory returned) and an evaluator sized for one job.
async fn prepare_in_process(
    config: &mut MeshConfig,
    args: &RunArgs,
    servers: &[ModelServer],
    spec: &pb::JobSpec,
) -> anyhow::Result<kforge::scratch::Scratch> {
    let scratch =
        kforge::scratch::Scratch::create(&std::env::temp_dir()).context("making the run's scratch directory")?;
    kforge::store::store_for_run(config, args.work_dir.as_deref());
    let (model, judge_model) = match &args.resume {
        Some(job_id) => {
            let stored = kforge::store::stored_spec(config, job_id).await?;
            (stored.model, stored.judge_model)
        }
        None => (spec.model.clone(), spec.judge_model.clone()),
    };
    for server in servers {
        let routed = match server.role {
            Role::Model => &model,
            Role::Judge if judge_model.is_empty() || judge_model == model => {
                bail!("--judge-model-url needs a Judge model other than the job's model `{model}`")
            }
            Role::Judge => &judge_model,
        };
        let note = match kforge::run::route_model_server(config, routed, server)? {
            Routed::Added => String::new(),
            Routed::Replaced { backends } => format!(" (replacing the {backends} backends of its configured pool)"),
        };
        eprintln!("{:<13} {routed} at {} ({}){note}", "model", server.url, server.kind.name());
    }
    for model in [model, judge_model] {
        kforge::run::route_default_replay(config, &model, scratch.path())
            .with_context(|| format!("writing the embedded replay file under {}", scratch.path().display()))?;
    }
    kforge::run::evaluator_for_one_job(config, args.compile_baseline);
    Ok(scratch)
}

/// Submits the job (or resumes `resume`), shows its progress until it ends and reads its trajectories. Ctrl-C or
/// SIGTERM cancels the job (its evaluations stop with their requests) and the report still follows.
async fn follow_job(
    orchestrator: &mut pb::orchestrator_client::OrchestratorClient<client::Channel>,
    spec: pb::JobSpec,
    resume: Option<&str>,
) -> anyhow::Result<(pb::Job, Vec<pb::Trajectory>)> {
    let job = kforge::run::submit_or_resume(orchestrator, spec, resume)
        .await
        .map_err(CallError::from)
        .context(if resume.is_some() { "resuming the job" } else { "submitting the job" })?;
    let verb = if resume.is_some() { "resumed" } else { "submitted" };
    eprintln!("job {} {verb}: {} episodes, {} turns", job.job_id, job.episodes_total, job.turns_total);
    let shown = std::cell::RefCell::new(kforge::run::Progress::new(std::io::stderr().is_terminal()));
    let mut watcher = orchestrator.clone();
    let follow = kforge::run::follow(&mut watcher, &job.job_id, |progress| {
        // A turn's stages, its record and its episode's end are separate updates: each change is shown once.
        if let Some(text) = shown.borrow_mut().update(progress) {
            eprint!("{text}");
        }
    });
    tokio::pin!(follow);
    let followed = tokio::select! {
        followed = &mut follow => followed,
        () = kforge_server::shutdown_signal() => {
            eprintln!("interrupted: cancelling job {} (resume it with kforge run --resume {0})", job.job_id);
            orchestrator
                .cancel_job(pb::CancelJobRequest { job_id: job.job_id.clone() })
                .await
                .map_err(CallError::from)
                .context("cancelling the job")?;
            follow.await
        }
    };
    eprint!("{}", shown.borrow().finish());
    let job = followed.map_err(CallError::from).context("following the job")?;
    let trajectories = kforge::run::trajectories(orchestrator, &job.job_id)
        .await
        .map_err(CallError::from)
        .context("reading the job's trajectories")?;
    Ok((job, trajectories))
}

/// Prints the job's report and writes its files; fails where the job did not succeed or every turn failed.
fn report_job(config: &MeshConfig, job: &pb::Job, trajectories: &[pb::Trajectory]) -> anyhow::Result<()> {
    // A reader of the report that went away changes nothing else: the files are written, the job's outcome decides
    // the status (a closed stdout alone ends quietly).
    let printed = kforge::stdout::print(&kforge::run::report(job, trajectories));
    let dir = kforge::store::report_dir(config, &job.job_id);
    let pricing = kforge::run::pricing(config, job.spec.as_ref().map_or("", |spec| spec.model.as_str()));
    let files = kforge::run::write_report(&dir, job, trajectories, &pricing)
        .with_context(|| format!("writing the job's report under {}", dir.display()))?;
    let printed = printed.and_then(|()| match pricing.as_str() {
        "" => Ok(()),
        pricing => kforge::stdout::println(&format!("priced at {pricing}")),
    });
    let printed = printed.and_then(|()| {
        kforge::stdout::println(&format!("report: {} ({})", files.html.display(), files.json.display()))
    });
    if job.state != pb::JobState::Succeeded as i32 {
        bail!("job {} did not succeed", job.job_id);
    }
    // A job whose every turn failed on the way (a model server down, a wrong URL) succeeded as a job but measured
    // nothing: say so, and fail.
    if let Some(error) = kforge::run::every_turn_failed(trajectories) {
        bail!("job {}: every turn failed before evaluation, the first with: {error}", job.job_id);
    }
    printed
}

/// The servers `--model-url` and `--judge-model-url` name, checked before anything starts.
fn model_servers(args: &RunArgs) -> anyhow::Result<Vec<ModelServer>> {
    let named = [
        (Role::Model, &args.model_url, args.model_server, &args.api_key_env),
        (Role::Judge, &args.judge_model_url, args.judge_model_server.or(args.model_server), &args.judge_api_key_env),
    ];
    let mut servers = Vec::new();
    for (role, url, server, api_key_env) in named {
        let Some(url) = url else { continue };
        if args.remote.addr.is_some() {
            bail!(
                "{} routes a model in the gateway this command starts; with --addr, the remote mesh's gateway \
                 routes models (its config's [[gateway.pools]])",
                role.url_flag()
            );
        }
        let server =
            ModelServer { role, url: url.clone(), kind: ServerArg::kind(server), api_key_env: api_key_env.clone() };
        server.check()?;
        servers.push(server);
    }
    // A resumed job's models are its stored spec's.
    if args.resume.is_none() {
        if args.model_url.is_some() && args.model == kforge::run::DEFAULT_MODEL {
            bail!("--model-url needs --model NAME: the name the server serves the model under");
        }
        if args.judge_model_url.is_some() && args.judge_model.is_none() {
            bail!("--judge-model-url needs --judge-model NAME: the name the server serves the Judge under");
        }
    }
    Ok(servers)
}

async fn eval_command(config: &MeshConfig, args: EvalArgs) -> anyhow::Result<()> {
    let read = |path: &PathBuf, what: &str| {
        std::fs::read_to_string(path).with_context(|| format!("cannot read the {what} file {}", path.display()))
    };
    let task_source = read(&args.task, "task")?;
    let candidate_source = read(&args.candidate, "candidate")?;
    if candidate_source.trim().is_empty() {
        bail!("the candidate file {} is empty", args.candidate.display());
    }
    let task_id = args.task.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let request = pb::EvaluateRequest {
        request_id: String::new(),
        task: Some(pb::Task { task_id, source: task_source }),
        candidate_source,
        backend: BackendArg::proto(args.backend).into(),
        policy: args.policy.unwrap_or_default(),
        correctness_trials: 0,
        measure_performance: true,
        census: true,
        idempotency_key: String::new(),
        priority: 0,
        job_id: String::new(),
    };
    let (channel, mesh) = connect(config, &[Service::Evaluator], Service::Evaluator, &args.remote).await?;
    let result = pb::evaluator_client::EvaluatorClient::new(channel).evaluate(request).await;
    drain(mesh).await?;
    let response = result.map_err(CallError::from).context("evaluating")?.into_inner();
    if args.json {
        let method = call::resolve("Evaluator/Evaluate")?;
        let message = prost_reflect::DynamicMessage::decode(
            method.output(),
            prost::Message::encode_to_vec(&response).as_slice(),
        )?;
        kforge::stdout::println(&call::to_json(&message)?)?;
    } else {
        kforge::stdout::print(&eval_summary(&response))?;
    }
    Ok(())
}

/// `kforge eval`'s summary of an evaluation: the verdict, the speedups, the mismatch, findings, the end of the
/// compile log and the error, a line each.
fn eval_summary(response: &pb::EvaluateResponse) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let verdict = pb::Verdict::try_from(response.verdict).map_or("unknown", |v| v.as_str_name());
    let _ = writeln!(out, "verdict   {verdict}");
    if response.speedup_eager > 0.0 {
        let basis = match response.speedup_basis() {
            pb::SpeedupBasis::Paired => format!("paired rounds, spread {:.0}%", response.speedup_spread * 100.0),
            _ => "cached baseline".to_owned(),
        };
        let _ = writeln!(
            out,
            "speedup   {:.3}x eager ({basis}), {:.3}x torch.compile",
            response.speedup_eager, response.speedup_compile
        );
    }
    if let Some(m) = &response.mismatch {
        let _ = writeln!(
            out,
            "mismatch  trial {} output {} at {:?}: expected {}, got {} (max abs error {:.3e}, max rel error {:.3e}) {}",
            m.trial, m.output_index, m.element_index, m.expected, m.got, m.max_abs_error, m.max_rel_error, m.detail
        );
    }
    for finding in &response.findings {
        let _ = writeln!(out, "finding   {} (line {}): {}", finding.code, finding.line, finding.message);
    }
    if !response.compile_log.is_empty() {
        let _ = writeln!(
            out,
            "compile   {}",
            response
                .compile_log
                .lines()
                .rev()
                .take(20)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n          ")
        );
    }
    if !response.error.is_empty() {
        let _ = writeln!(out, "error     {}", response.error);
    }
    out
}
