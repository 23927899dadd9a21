//! Soak: many evaluations, a share of them hostile or crashing, through one evaluator process.
//!
//! 1. A clean run: a fresh evaluator process evaluates each legitimate candidate once.
//! 2. The soak: another fresh evaluator process gets `--count` requests (`--hostile` of them exploits and failure
//!    fixtures, the rest legitimate candidates), `--concurrency` at a time, over gRPC.
//!
//! It passes when the soak's evaluator never exited, stayed SERVING, answered every request with a verdict, and
//! gave every legitimate candidate the verdict of the clean run. Hostile verdicts are reported against the
//! corpus headers' expectations. One JSON line per soak result goes to `--out`.
//!
//! ```text
//! evaluator-soak --evaluator target/release/kforge-evaluator [--python PY] [--work DIR] [--backend cpu|cuda]
//!                [--count 200] [--hostile 0.3] [--concurrency 8] [--run-timeout 40] [--correctness-only] [--out FILE]
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kforge_proto::v1 as pb;
use kforge_proto::v1::evaluator_client::EvaluatorClient;
use kforge_server::client::{self, Channel, ClientConfig};
use kforge_test_support::{ReservedPort, Wait};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Soak: many evaluations, a share of them hostile or crashing, through one evaluator process.
#[derive(Debug, clap::Parser)]
#[command(name = "evaluator-soak")]
struct Args {
    /// The evaluator binary (`kforge-evaluator`) to start, once for the clean run and once for the soak.
    #[arg(long)]
    evaluator: PathBuf,
    /// The Python that runs the candidates (default: the evaluator's default).
    #[arg(long)]
    python: Option<PathBuf>,
    /// The work directory; the clean run and the soak use its `clean/` and `soak/`.
    #[arg(long, default_value = ".kforge/bench-soak")]
    work: PathBuf,
    /// The backend the candidates are evaluated on: cpu or cuda.
    #[arg(long, default_value = "cpu", value_parser = backend)]
    backend: pb::Backend,
    /// Requests sent to the soak's evaluator.
    #[arg(long, default_value_t = 200)]
    count: usize,
    /// The share of the requests that are exploits and failure fixtures, in [0, 1].
    #[arg(long, default_value_t = 0.3)]
    hostile: f64,
    /// Requests in flight at once (at least 1).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// The evaluator's run timeout, in seconds.
    #[arg(long, default_value_t = 40)]
    run_timeout: u64,
    /// Checks correctness only: no timing, no census.
    #[arg(long = "correctness-only", action = clap::ArgAction::SetFalse)]
    measure: bool,
    /// Where the soak's JSON lines go.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn backend(text: &str) -> Result<pb::Backend, String> {
    match text {
        "cpu" => Ok(pb::Backend::Cpu),
        "cuda" => Ok(pb::Backend::Cuda),
        other => Err(format!("{other} (cpu or cuda)")),
    }
}

fn args() -> Result<Args, String> {
    let mut args = <Args as clap::Parser>::parse();
    args.concurrency = args.concurrency.max(1);
    if !(0.0..=1.0).contains(&args.hostile) {
        return Err("--hostile is a fraction in [0, 1]".into());
    }
    Ok(args)
}

/// One candidate of the pools, with what its corpus header expects.
#[derive(Debug, Clone)]
struct Candidate {
    name: String,
    task_id: String,
    task: String,
    source: String,
    policy: String,
    hostile: bool,
    expected: Vec<String>,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.retain(|f| f.extension().is_some_and(|e| e == "py"));
    files.sort();
    files
}

/// A corpus file (or failure fixture), or `None` when it needs something this run lacks: the Triton backend, or a
/// sandbox protection the soak's evaluator does not have (`active`: those it reports active).
fn candidate(file: &Path, hostile: bool, default_expect: &str, active: &[String]) -> Option<Candidate> {
    let source = std::fs::read_to_string(file).ok()?;
    let header = |key: &str| {
        source.lines().find_map(|line| line.strip_prefix(&format!("# {key}:")).map(|v| v.trim().to_owned()))
    };
    if header("backend").is_some() || header("requires").is_some_and(|needed| !active.contains(&needed)) {
        return None;
    }
    let task_id = header("task").unwrap_or_else(|| "relu".into());
    let task_path = match task_id.strip_prefix("corpus/") {
        Some(name) => repo().join("services/evaluator/tests/corpus/tasks").join(format!("{name}.py")),
        None => repo().join("examples/tasks").join(&task_id).join("task.py"),
    };
    // A file judged under several policies (`# expect[<policy>]: ...` lines) is soaked under the first.
    let per_policy = source
        .lines()
        .find_map(|line| line.strip_prefix("# expect[")?.split_once("]:"))
        .map(|(policy, expect)| (policy.trim().to_owned(), expect.trim().to_owned()));
    let expect = header("expect")
        .or_else(|| per_policy.as_ref().map(|(_, expect)| expect.clone()))
        .unwrap_or_else(|| default_expect.into());
    let verdicts = expect.split_whitespace().next().unwrap_or_default();
    let expected = verdicts.split('|').map(str::to_owned).collect();
    let policy = header("policy").or(per_policy.map(|(policy, _)| policy)).unwrap_or_else(|| "permissive".into());
    Some(Candidate {
        name: file.strip_prefix(repo()).unwrap_or(file).display().to_string(),
        task: std::fs::read_to_string(task_path).ok()?,
        task_id,
        source,
        policy,
        hostile,
        expected,
    })
}

/// (legitimate, hostile) candidates for the backend.
fn pools(cuda: bool, active: &[String]) -> (Vec<Candidate>, Vec<Candidate>) {
    let corpus = repo().join("services/evaluator/tests/corpus");
    let fixtures = repo().join("services/evaluator/tests/fixtures");
    let mut legitimate: Vec<Candidate> = python_files(&corpus.join("legitimate"))
        .iter()
        .filter_map(|f| candidate(f, false, "VERDICT_CORRECT", active))
        .collect();
    let mut hostile: Vec<Candidate> = python_files(&corpus.join("exploits"))
        .iter()
        .filter_map(|f| candidate(f, true, "VERDICT_HACK", active))
        .collect();
    // Failure fixtures (their headers say what they expect); those that end CORRECT are not hostile.
    let failures =
        ["raises", "aborts", "exits_early", "hangs", "wrong_result", "nan_output", "wrong_shape", "compile_error"];
    hostile.extend(
        failures
            .iter()
            .filter_map(|name| candidate(&fixtures.join(format!("{name}.py")), true, "VERDICT_HACK", active)),
    );
    if cuda {
        for file in python_files(&corpus.join("cuda")) {
            let legit = file.file_name().is_some_and(|n| n.to_string_lossy().starts_with("legit"));
            let expect = if legit { "VERDICT_CORRECT" } else { "VERDICT_HACK" };
            let pool = if legit { &mut legitimate } else { &mut hostile };
            pool.extend(candidate(&file, !legit, expect, active));
        }
    } else {
        // The example tasks' own candidates: C++ extensions built on the CPU backend.
        for task in subdirectories(&repo().join("examples/tasks")) {
            let name = task.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            for file in python_files(&task.join("candidates")) {
                if let Some(mut c) = candidate(&file, false, "VERDICT_CORRECT", active) {
                    c.task_id = name.clone();
                    c.task = std::fs::read_to_string(task.join("task.py")).unwrap_or_default();
                    legitimate.push(c);
                }
            }
        }
    }
    (legitimate, hostile)
}

fn subdirectories(dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_dir()).collect())
        .unwrap_or_default();
    dirs.sort();
    dirs
}

/// A deterministic shuffle (xorshift), so that two runs send the same sequence.
fn shuffle<T>(items: &mut [T], mut state: u64) {
    for i in (1..items.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        items.swap(i, (state % (i as u64 + 1)) as usize);
    }
}

/// An evaluator process of its own, on a loopback port reserved for it.
struct Service {
    child: tokio::process::Child,
    address: String,
    port: ReservedPort,
}

impl Service {
    async fn start(args: &Args, work: &Path) -> Result<Self, String> {
        std::fs::create_dir_all(work).map_err(|e| format!("{}: {e}", work.display()))?;
        let port = ReservedPort::new();
        let python = args.python.as_ref().map(|p| format!("python = {:?}\n", p.display().to_string()));
        let config = format!(
            "[evaluator]\n{}work_dir = {:?}\nbaseline_torch_compile = false\nrun_timeout_secs = {}\n\
             [evaluator.server]\nlisten = \"{}\"\n\
             [evaluator.timing]\nmax_runs = 40\nmax_seconds = 1.0\n",
            python.unwrap_or_default(),
            work.join("evaluator").display().to_string(),
            args.run_timeout,
            port.addr(),
        );
        let config_path = work.join("evaluator.toml");
        std::fs::write(&config_path, config).map_err(|e| format!("{}: {e}", config_path.display()))?;
        let log = std::fs::File::create(work.join("evaluator.log")).map_err(|e| format!("log: {e}"))?;
        let child = tokio::process::Command::new(&args.evaluator)
            .arg("--config")
            .arg(&config_path)
            .stdout(log.try_clone().map_err(|e| format!("log: {e}"))?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("{}: {e}", args.evaluator.display()))?;
        let service = Self { child, address: port.url(), port };
        Wait::new("the evaluator to become SERVING")
            .within(Duration::from_secs(300))
            .every(Duration::from_millis(200))
            .try_until(|| async { service.health().await == Some(ServingStatus::Serving) })
            .await
            .map_err(|timed_out| timed_out.to_string())?;
        Ok(service)
    }

    async fn channel(&self) -> Option<Channel> {
        client::connect(&self.address, &ClientConfig::default()).await.ok()
    }

    /// The names of the sandbox protections the evaluator reports active.
    async fn active_protections(&self) -> Vec<String> {
        let Some(channel) = self.channel().await else { return Vec::new() };
        match EvaluatorClient::new(channel).get_capabilities(pb::GetCapabilitiesRequest {}).await {
            Ok(reply) => reply.into_inner().sandbox.into_iter().filter(|p| p.active).map(|p| p.name).collect(),
            Err(_) => Vec::new(),
        }
    }

    async fn health(&self) -> Option<ServingStatus> {
        let mut health = HealthClient::new(self.channel().await?);
        let response = health.check(HealthCheckRequest { service: "kforge.v1.Evaluator".into() }).await.ok()?;
        ServingStatus::try_from(response.into_inner().status).ok()
    }

    /// The lines of `/metrics` that start with one of `prefixes`.
    async fn metrics(&self, prefixes: &[&str]) -> Vec<String> {
        let Ok(mut stream) = tokio::net::TcpStream::connect(self.port.addr()).await else { return vec![] };
        let request = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
        let mut text = String::new();
        if stream.write_all(request.as_bytes()).await.is_err() || stream.read_to_string(&mut text).await.is_err() {
            return vec![];
        }
        text.lines().filter(|l| prefixes.iter().any(|p| l.starts_with(p))).map(str::to_owned).collect()
    }
}

/// The result of one request: the verdict's name, or how the call failed.
#[derive(Debug, Clone)]
struct Outcome {
    verdict: Result<String, String>,
    error: String,
    seconds: f64,
}

async fn evaluate_all(service: &Service, work: &[Candidate], args: &Args) -> Vec<Outcome> {
    let (backend, concurrency, measure) = (args.backend, args.concurrency, args.measure);
    let channel = service.channel().await.expect("the evaluator accepts connections");
    let semaphore = std::sync::Arc::new(tokio::sync::Semaphore::new(concurrency));
    let mut runs = tokio::task::JoinSet::new();
    for (index, candidate) in work.iter().cloned().enumerate() {
        // Responses carry every timing sample; allow more than tonic's 4 MiB default.
        let mut client = EvaluatorClient::new(channel.clone()).max_decoding_message_size(64 << 20);
        let semaphore = semaphore.clone();
        runs.spawn(async move {
            let _permit = semaphore.acquire().await.expect("never closed");
            let started = Instant::now();
            let request = pb::EvaluateRequest {
                request_id: format!("soak-{index}"),
                task: Some(pb::Task { task_id: candidate.task_id.clone(), source: candidate.task.clone() }),
                candidate_source: candidate.source.clone(),
                backend: backend.into(),
                policy: candidate.policy.clone(),
                correctness_trials: 3,
                measure_performance: measure,
                census: measure,
                ..Default::default()
            };
            let (verdict, error) = match client.evaluate(request).await {
                Ok(response) => {
                    let response = response.into_inner();
                    let verdict = pb::Verdict::try_from(response.verdict).map_or("UNKNOWN", |v| v.as_str_name());
                    (Ok(verdict.to_owned()), response.error)
                }
                Err(status) => (Err(status.to_string()), String::new()),
            };
            (index, Outcome { verdict, error, seconds: started.elapsed().as_secs_f64() })
        });
    }
    let mut outcomes: Vec<Option<Outcome>> = vec![None; work.len()];
    while let Some(joined) = runs.join_next().await {
        let (index, outcome) = joined.expect("request task");
        let verdict = outcome.verdict.as_deref().unwrap_or("CALL FAILED");
        println!("  {index:>4} {verdict:<24} {:>6.1} s {}", outcome.seconds, work[index].name);
        outcomes[index] = Some(outcome);
    }
    outcomes.into_iter().map(|o| o.expect("every request answered")).collect()
}

fn main() -> ExitCode {
    let args = match args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("evaluator-soak: {message}");
            return ExitCode::from(2);
        }
    };
    tokio::runtime::Runtime::new().expect("runtime").block_on(run(args))
}

async fn run(args: Args) -> ExitCode {
    let cuda = args.backend == pb::Backend::Cuda;
    let started = Instant::now();
    let clean_service = match Service::start(&args, &args.work.join("clean")).await {
        Ok(service) => service,
        Err(error) => {
            eprintln!("evaluator-soak: clean evaluator: {error}");
            return ExitCode::FAILURE;
        }
    };
    // Entries whose defence needs a sandbox protection join the pools where the evaluator has it (both evaluators
    // run on this host with the same configuration).
    let active = clean_service.active_protections().await;
    println!("active sandbox protections: {}", active.join(", "));
    let (legitimate, hostile) = pools(cuda, &active);
    // Hostile candidates alternate between kinds (exploits, failure fixtures, GPU entries), so a short run has
    // some of each.
    let hostile = {
        let mut groups: Vec<Vec<Candidate>> = Vec::new();
        for candidate in hostile {
            let kind = candidate.name.rsplit('/').nth(1).unwrap_or_default().to_owned();
            match groups.iter_mut().find(|g| g[0].name.rsplit('/').nth(1) == Some(kind.as_str())) {
                Some(group) => group.push(candidate),
                None => groups.push(vec![candidate]),
            }
        }
        let longest = groups.iter().map(Vec::len).max().unwrap_or(0);
        (0..longest).flat_map(|i| groups.iter().filter_map(move |g| g.get(i).cloned())).collect::<Vec<_>>()
    };
    println!(
        "pools: {} legitimate, {} hostile candidates ({:?} backend)",
        legitimate.len(),
        hostile.len(),
        args.backend
    );
    let hostile_count = (args.count as f64 * args.hostile).round() as usize;
    let mut work: Vec<Candidate> = (0..hostile_count)
        .map(|i| hostile[i % hostile.len()].clone())
        .chain((0..args.count - hostile_count).map(|i| legitimate[i % legitimate.len()].clone()))
        .collect();
    shuffle(&mut work, 0x9e37_79b9_7f4a_7c15);

    // 1. The clean run.
    let clean = evaluate_all(&clean_service, &legitimate, &args).await;
    drop(clean_service);
    let clean: HashMap<&str, &Outcome> = legitimate.iter().map(|c| c.name.as_str()).zip(clean.iter()).collect();
    println!("clean run: {} legitimate candidates in {:.0} s", clean.len(), started.elapsed().as_secs_f64());

    // 2. The soak, through one evaluator process.
    let started = Instant::now();
    let mut service = match Service::start(&args, &args.work.join("soak")).await {
        Ok(service) => service,
        Err(error) => {
            eprintln!("evaluator-soak: soak evaluator: {error}");
            return ExitCode::FAILURE;
        }
    };
    let pid = service.child.id();
    let outcomes = evaluate_all(&service, &work, &args).await;
    let soak_seconds = started.elapsed().as_secs_f64();
    let exited = service.child.try_wait().ok().flatten();
    let health = service.health().await;
    let metrics = service
        .metrics(&[
            "kforge_evaluator_verdicts",
            "kforge_evaluator_device_probes",
            "kforge_evaluator_devices_quarantined",
        ])
        .await;

    let mut lines = Vec::new();
    let (mut answered, mut legit_total, mut legit_same, mut hostile_total, mut hostile_expected) = (0, 0, 0, 0, 0);
    let mut problems = Vec::new();
    let mut verdicts: HashMap<String, usize> = HashMap::new();
    for (candidate, outcome) in work.iter().zip(&outcomes) {
        let verdict = outcome.verdict.clone().unwrap_or_else(|e| format!("CALL FAILED: {e}"));
        answered += usize::from(outcome.verdict.is_ok());
        *verdicts.entry(verdict.clone()).or_default() += 1;
        let clean_verdict = clean.get(candidate.name.as_str()).and_then(|o| o.verdict.clone().ok());
        if candidate.hostile {
            hostile_total += 1;
            if candidate.expected.contains(&verdict) {
                hostile_expected += 1;
            } else {
                problems.push(format!("hostile {} got {verdict}, expected {:?}", candidate.name, candidate.expected));
            }
        } else {
            legit_total += 1;
            if clean_verdict.as_deref() == Some(verdict.as_str()) {
                legit_same += 1;
            } else {
                problems.push(format!("legitimate {} got {verdict}, clean run {clean_verdict:?}", candidate.name));
            }
        }
        lines.push(json!({
            "candidate": candidate.name,
            "hostile": candidate.hostile,
            "verdict": verdict,
            "expected": candidate.expected,
            "clean_verdict": clean_verdict,
            "seconds": outcome.seconds,
            "error": outcome.error.chars().take(300).collect::<String>(),
        }));
    }
    if let Some(out) = &args.out {
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        if let Err(error) = std::fs::write(out, text) {
            eprintln!("evaluator-soak: {}: {error}", out.display());
        }
    }
    let mut verdicts: Vec<(String, usize)> = verdicts.into_iter().collect();
    verdicts.sort();
    println!("soak: {} requests ({hostile_total} hostile) in {soak_seconds:.0} s", work.len());
    println!(
        "  evaluator pid {pid:?}: {}",
        match exited {
            None => "still running".to_owned(),
            Some(status) => format!("EXITED ({status})"),
        }
    );
    println!("  health after the soak: {health:?}");
    println!("  answered with a verdict: {answered} of {}", work.len());
    println!("  legitimate verdicts equal to the clean run: {legit_same} of {legit_total}");
    println!("  hostile verdicts as the corpus expects: {hostile_expected} of {hostile_total}");
    println!("  verdicts: {verdicts:?}");
    for line in &metrics {
        println!("  {line}");
    }
    for problem in &problems {
        println!("  - {problem}");
    }
    let passed = exited.is_none()
        && health == Some(ServingStatus::Serving)
        && answered == work.len()
        && legit_same == legit_total;
    println!("soak {}", if passed { "PASSED" } else { "FAILED" });
    if passed { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
