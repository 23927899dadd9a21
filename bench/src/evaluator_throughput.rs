//! Evaluations per hour of kforge's pipeline against a serial evaluator, side by side, on one machine.
//!
//! ```text
//! evaluator-throughput --kernelbench DIR --candidates DIR [--python PY] [--work DIR] [--out DIR]
//!                      [--serial N] [--repeat N] [--limit N] [--no-landlock] [--pipeline-from FILE]
//!                      [--gpu-slots N] [--compile-workers N] [--serial-builds stock|kforge] [--alone N]
//! ```
//! `--candidates` is what `bench/kernelbench/make_candidates.py --mixed` writes (candidates and manifest.json).
//!
//! - **pipeline**: one evaluator with its defaults (a compile pool of one worker per core, warm starts, the
//!   artifact, reference and baseline caches, baselines computed ahead, CPU threads divided among the GPU slots),
//!   every candidate submitted at once, from a cold work directory, once the evaluator's warm-up (precompiling the
//!   bindings' header, reported as `pipeline.warm_up`) is over: a service starts once and serves for hours;
//! - **serial**: the design kforge replaces: one candidate at a time, each in a fresh evaluator with a fresh work
//!   directory (nothing cached: not its extension build, not the reference outputs, not the baselines, no
//!   precompiled header), one compile worker, one GPU slot (so torch's own thread count) and nothing computed
//!   ahead. Its extensions are built as load_inline builds them (`--serial-builds stock`, the default: the design
//!   as such services run it), or with kforge's build recipe (`--serial-builds kforge`: the serial design given
//!   kforge's faster compiles, a stricter comparison). Same stages, sandbox and checks, so the verdicts must be the
//!   same. `--serial N` evaluates the first N candidates of the manifest in turn across their kinds (it is slow;
//!   rates are per evaluation).
//! - `--repeat N` evaluates N candidates again through the pipeline's warm evaluator: compile cache hits.
//! - `--alone N` then compiles N CUDA candidates that build (a comment added, so their sources are new to the cache)
//!   one at a time through the warm pipeline: a compile's latency on a machine with nothing else to do, cold
//!   (no artifact) but with the evaluator's start-up headers ready (`compile_alone_s`).
//! - `--limit N` keeps the manifest's first N candidates (the level-2 groups come first, four per task).
//! - `--gpu-slots N` sets the pipeline evaluator's `gpu_slots` (default: the evaluator's default).
//! - `--compile-workers N` sets the pipeline evaluator's `compile_workers` (default: the evaluator's default).
//! - `--pipeline-from FILE` takes the pipeline's evaluations from an earlier run's `evaluations.jsonl` on the same
//!   machine instead of running it, so the two modes can be measured in separate device commands.
//!
//! Reported: evaluations per hour of each mode and their ratio; the device's busy fraction (lane held) over the
//! pipeline's device window and while compiled work waited for it; compile time p50/p95 (cold, and cache hits);
//! device time per evaluation; the machine's CPU busy fraction over the pipeline's run (all cores, from
//! /proc/stat); the stages' CPU seconds per evaluation; where each GPU's time went by its gate (alone, draining,
//! shared, empty); and whether both modes reached the same verdicts (and the manifest's).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kforge_evaluator::config::BuildRecipe;
use kforge_evaluator::{Evaluator, EvaluatorConfig, EvaluatorMetrics};
use kforge_execution::devices::GateAccount;
use kforge_proto::v1 as pb;
use serde_json::{Value, json};

/// Evaluations per hour of kforge's pipeline against a serial evaluator, side by side, on one machine.
#[derive(clap::Parser)]
#[command(name = "evaluator-throughput")]
struct Args {
    /// KernelBench's tasks (the folder holding level1/, level2/, level3/).
    #[arg(long)]
    kernelbench: PathBuf,
    /// The candidates and their manifest.json, as `bench/kernelbench/make_candidates.py --mixed` writes them.
    #[arg(long)]
    candidates: PathBuf,
    /// The Python that runs the candidates.
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// The evaluators' work directory.
    #[arg(long, default_value = ".kforge/bench-throughput")]
    work: PathBuf,
    /// Where the report (summary.json) and the pipeline's evaluations.jsonl go.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Evaluates the manifest's first N candidates in turn through the serial design.
    #[arg(long, default_value_t = 4)]
    serial: usize,
    /// Evaluates N candidates again through the pipeline's warm evaluator (compile cache hits).
    #[arg(long, default_value_t = 4)]
    repeat: usize,
    /// Compiles N CUDA candidates one at a time through the warm pipeline (`compile_alone_s`).
    #[arg(long, default_value_t = 0)]
    alone: usize,
    /// Runs the jobs without Landlock.
    #[arg(long = "no-landlock", action = clap::ArgAction::SetFalse)]
    landlock: bool,
    /// Takes the pipeline's evaluations from an earlier run's evaluations.jsonl instead of running it.
    #[arg(long)]
    pipeline_from: Option<PathBuf>,
    /// Keeps the manifest's first N candidates (default: all).
    #[arg(long, default_value_t = usize::MAX, hide_default_value = true)]
    limit: usize,
    /// The pipeline evaluator's `gpu_slots` (default: the evaluator's default).
    #[arg(long)]
    gpu_slots: Option<usize>,
    /// The pipeline evaluator's `compile_workers` (0: the evaluator's default).
    #[arg(long, default_value_t = 0)]
    compile_workers: usize,
    /// How the serial design builds extensions: stock (as load_inline builds them) or kforge (kforge's recipe).
    #[arg(long, default_value = "stock")]
    serial_builds: BuildRecipe,
}

/// One candidate of the manifest, with its sources read.
#[derive(Clone)]
struct Candidate {
    task: String,
    name: String,
    kind: String,
    expect: String,
    request: pb::EvaluateRequest,
}

/// One evaluation as measured: its verdict, stage times and when it ended (seconds from its mode's start).
struct Outcome {
    name: String,
    kind: String,
    expect: String,
    verdict: String,
    stage_ms: BTreeMap<String, f64>,
    compile_cache_hit: bool,
    ended_s: f64,
    wall_s: f64,
}

impl Outcome {
    fn from_json(value: &Value) -> Option<Self> {
        let text = |name: &str| value[name].as_str().map(str::to_owned);
        Some(Self {
            name: text("candidate")?,
            kind: text("kind")?,
            expect: text("expect")?,
            verdict: text("verdict")?,
            stage_ms: serde_json::from_value(value["stage_ms"].clone()).ok()?,
            compile_cache_hit: value["compile_cache_hit"].as_bool()?,
            ended_s: value["ended_s"].as_f64()?,
            wall_s: value["wall_s"].as_f64()?,
        })
    }

    fn json(&self, mode: &str) -> Value {
        json!({
            "mode": mode, "candidate": self.name, "kind": self.kind, "expect": self.expect, "verdict": self.verdict,
            "compile_cache_hit": self.compile_cache_hit, "stage_ms": self.stage_ms, "ended_s": self.ended_s,
            "wall_s": self.wall_s,
        })
    }
}

fn load(args: &Args) -> Result<Vec<Candidate>, String> {
    let manifest: Vec<Value> = std::fs::read(args.candidates.join("manifest.json"))
        .map_err(|e| e.to_string())
        .and_then(|bytes| serde_json::from_slice(&bytes).map_err(|e| e.to_string()))
        .map_err(|e| format!("manifest: {e}"))?;
    manifest
        .iter()
        .map(|entry| {
            let field = |name: &str| entry[name].as_str().unwrap_or_default().to_owned();
            let (task, name) = (field("task"), field("candidate"));
            let task_source =
                std::fs::read_to_string(args.kernelbench.join(&task)).map_err(|e| format!("{task}: {e}"))?;
            let source = std::fs::read_to_string(args.candidates.join(&name)).map_err(|e| format!("{name}: {e}"))?;
            let backend = if field("backend") == "triton" { pb::Backend::Triton } else { pb::Backend::Cuda };
            let request = pb::EvaluateRequest {
                request_id: name.clone(),
                task: Some(pb::Task { task_id: task.clone(), source: task_source }),
                candidate_source: source,
                backend: backend.into(),
                measure_performance: true,
                census: true,
                ..Default::default()
            };
            Ok(Candidate { task, name, kind: field("kind"), expect: field("expect"), request })
        })
        .collect()
}

/// Which evaluator design a mode measures.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Design {
    /// kforge's: `--compile-workers`, baselines computed ahead, the bindings' header precompiled.
    Pipeline,
    /// One compile worker, nothing ahead or precompiled, one slot per GPU; `--serial-builds`.
    Serial,
}

/// An evaluator of `design` with a fresh work directory.
async fn evaluator(args: &Args, work: &Path, design: Design) -> Evaluator {
    let _ = std::fs::remove_dir_all(work);
    let config = EvaluatorConfig {
        python: args.python.clone(),
        work_dir: work.to_owned(),
        queue_capacity: 1024,
        compile_workers: if design == Design::Pipeline { args.compile_workers } else { 1 },
        baselines_ahead: design == Design::Pipeline,
        // The serial design has each evaluation's GPU to itself, and torch's own thread count.
        gpu_slots: match design {
            Design::Pipeline => args.gpu_slots.unwrap_or(EvaluatorConfig::default().gpu_slots),
            Design::Serial => 1,
        },
        build_recipe: match design {
            Design::Pipeline => BuildRecipe::Kforge,
            Design::Serial => args.serial_builds,
        },
        bindings_pch: design == Design::Pipeline,
        sandbox: kforge_sandbox::SandboxOptions { landlock: args.landlock, ..Default::default() },
        ..EvaluatorConfig::default()
    };
    let metrics = EvaluatorMetrics::register(&mut prometheus_client::registry::Registry::default());
    Evaluator::new(config, metrics).await.expect("the evaluator starts")
}

/// Appends `outcome` to `--out`'s evaluations.jsonl, so a run cut short keeps what it measured.
fn record(args: &Args, mode: &str, outcome: &Outcome) {
    let Some(out) = &args.out else { return };
    use std::io::Write;
    let written = std::fs::create_dir_all(out).and_then(|()| {
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(out.join("evaluations.jsonl"))?;
        writeln!(file, "{}", outcome.json(mode))
    });
    if let Err(error) = written {
        eprintln!("evaluator-throughput: writing results: {error}");
    }
}

async fn evaluate(evaluator: &Evaluator, candidate: Candidate, epoch: Instant) -> Outcome {
    let began = Instant::now();
    let result = evaluator.evaluate(candidate.request).await;
    let (verdict, stage_ms, compile_cache_hit) = match result {
        Ok(r) => {
            let verdict = pb::Verdict::try_from(r.verdict).map_or("?", |v| v.as_str_name()).to_owned();
            if verdict != candidate.expect {
                let text = if r.error.is_empty() { &r.compile_log } else { &r.error };
                let tail: String = text.chars().rev().take(400).collect::<Vec<_>>().into_iter().rev().collect();
                println!("    {} got {verdict}, expected {}: {tail}", candidate.name, candidate.expect);
                for finding in &r.findings {
                    println!("      finding {}: {}", finding.code, finding.message);
                }
            }
            (verdict, r.stage_ms.into_iter().collect(), r.compile_cache_hit)
        }
        Err(error) => (format!("REFUSED {error}"), BTreeMap::new(), false),
    };
    Outcome {
        name: candidate.name,
        kind: candidate.kind,
        expect: candidate.expect,
        verdict,
        stage_ms,
        compile_cache_hit,
        ended_s: epoch.elapsed().as_secs_f64(),
        wall_s: began.elapsed().as_secs_f64(),
    }
}

fn percentile(values: &[f64], p: f64) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    (!sorted.is_empty()).then(|| sorted[((sorted.len() - 1) as f64 * p).round() as usize])
}

/// Total length of the union of `intervals`.
fn covered(mut intervals: Vec<(f64, f64)>) -> f64 {
    intervals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut total, mut end) = (0.0, f64::NEG_INFINITY);
    for (start, stop) in intervals {
        if stop > end {
            total += stop - start.max(end);
            end = stop;
        }
    }
    total
}

/// The summary of one mode's outcomes over `makespan_s`.
fn summary(outcomes: &[Outcome], makespan_s: f64) -> Value {
    let stage = |o: &Outcome, name: &str| o.stage_ms.get(name).copied();
    let cold: Vec<f64> = outcomes
        .iter()
        .filter(|o| !o.compile_cache_hit)
        .filter_map(|o| stage(o, "compile"))
        .map(|ms| ms / 1e3)
        .collect();
    let device: Vec<f64> = outcomes.iter().filter_map(|o| stage(o, "device")).map(|ms| ms / 1e3).collect();
    // The lane was held over [end - device, end]; before that the evaluation waited for it.
    let busy: Vec<(f64, f64)> =
        outcomes.iter().filter_map(|o| stage(o, "device").map(|d| (o.ended_s - d / 1e3, o.ended_s))).collect();
    let waiting_or_busy: Vec<(f64, f64)> = outcomes
        .iter()
        .filter_map(|o| {
            let (d, q) = (stage(o, "device")? / 1e3, stage(o, "queue_device").unwrap_or(0.0) / 1e3);
            Some((o.ended_s - d - q, o.ended_s))
        })
        .collect();
    let window = busy.iter().map(|b| b.0).fold(f64::INFINITY, f64::min);
    let window = busy.iter().map(|b| b.1).fold(f64::NEG_INFINITY, f64::max) - window;
    let busy_s = covered(busy);
    let mean = |v: &[f64]| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
    let mut phases: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for outcome in outcomes {
        for (name, ms) in &outcome.stage_ms {
            phases.entry(name.clone()).or_default().push(*ms);
        }
    }
    let verdicts_as_expected = outcomes.iter().filter(|o| o.verdict == o.expect).count();
    // CPU seconds the harness stages reported (each process and the compilers it waited for), over all outcomes.
    let stage_cpu_s: f64 =
        outcomes.iter().flat_map(|o| &o.stage_ms).filter(|(k, _)| k.starts_with("cpu.")).map(|(_, ms)| ms / 1e3).sum();
    json!({
        "evaluations": outcomes.len(),
        "makespan_s": makespan_s,
        "evaluations_per_hour": outcomes.len() as f64 / makespan_s * 3600.0,
        "compile_cold_s": {"n": cold.len(), "p50": percentile(&cold, 0.5), "p95": percentile(&cold, 0.95)},
        "device_s_per_evaluation": {"n": device.len(), "mean": mean(&device), "p50": percentile(&device, 0.5)},
        "device_busy_over_device_window": if window > 0.0 { busy_s / window } else { 0.0 },
        "device_busy_while_work_waited": busy_s / covered(waiting_or_busy).max(f64::MIN_POSITIVE),
        "verdicts_as_expected": verdicts_as_expected,
        "stage_cpu_s_per_evaluation": stage_cpu_s / outcomes.len().max(1) as f64,
        "stage_ms_mean": phases.iter().map(|(k, v)| (k.clone(), mean(v))).collect::<BTreeMap<_, _>>(),
    })
}

fn main() -> std::process::ExitCode {
    let args = <Args as clap::Parser>::parse();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(run(args))
}

/// The machine's busy and total CPU time so far, in clock ticks (the first line of /proc/stat: busy is all but
/// idle and iowait); None where there is no /proc/stat.
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> =
        stat.lines().next()?.split_whitespace().skip(1).take(8).filter_map(|f| f.parse().ok()).collect();
    let total: u64 = ticks.iter().sum();
    let idle = ticks.get(3)? + ticks.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// The fraction of the machine's CPU time that was busy between two [`cpu_ticks`] samples.
fn cpu_busy(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    let ((busy0, total0), (busy1, total1)) = (before?, after?);
    (total1 > total0).then(|| (busy1 - busy0) as f64 / (total1 - total0) as f64)
}

/// What the pipeline mode measured.
struct PipelineRun {
    outcomes: Vec<Outcome>,
    makespan_s: f64,
    /// The cache hits (`--repeat`).
    repeats: Vec<Outcome>,
    /// Cold compiles one at a time (`--alone`).
    alone: Vec<Outcome>,
    capabilities: pb::GetCapabilitiesResponse,
    /// The machine's CPU busy fraction over the makespan; None when taken from an earlier run.
    cpu_busy: Option<f64>,
    /// Where each GPU's time went over the makespan (its gate's account); None when taken from an earlier run.
    gpu_time: Option<Value>,
    /// How long the warm-up took and what it made; None when taken from an earlier run.
    warm_up: Option<Value>,
}

/// A GPU's time by what its gate was doing, in seconds and as fractions of `makespan_s`.
fn gpu_time(account: &GateAccount, makespan_s: f64) -> Value {
    let parts = [
        ("alone", account.alone),
        ("draining", account.draining),
        ("shared", account.shared),
        ("empty", account.empty),
    ];
    let seconds: BTreeMap<&str, f64> = parts.iter().map(|(name, d)| (*name, d.as_secs_f64())).collect();
    let fractions: BTreeMap<&str, f64> = seconds.iter().map(|(name, s)| (*name, s / makespan_s.max(1e-9))).collect();
    json!({ "seconds": seconds, "fraction_of_makespan": fractions })
}

/// The pipeline's run over every candidate, then `--repeat` of them again (cache hits); with its makespan.
async fn pipeline(args: &Args, candidates: &[Candidate]) -> PipelineRun {
    // Everything at once, cold caches.
    let pipeline = evaluator(args, &args.work.join("pipeline"), Design::Pipeline).await;
    let capabilities = pipeline.capabilities();
    println!("# devices {:?} versions {:?}", capabilities.devices, capabilities.versions);
    let warming = Instant::now();
    let warm = pipeline.warm_up().await;
    let warm_up = json!({
        "seconds": warming.elapsed().as_secs_f64(),
        "bindings_pch": match &warm { Ok(dir) => dir.display().to_string(), Err(reason) => format!("none: {reason}") },
    });
    println!("# warm-up {warm_up}");
    let epoch = Instant::now();
    let ticks = cpu_ticks();
    let mut running = tokio::task::JoinSet::new();
    for candidate in candidates.iter().cloned() {
        let evaluator = pipeline.clone();
        running.spawn(async move { evaluate(&evaluator, candidate, epoch).await });
    }
    let mut piped = Vec::new();
    while let Some(Ok(outcome)) = running.join_next().await {
        println!("pipeline {:<70} {:<24} {:>6.1} s", outcome.name, outcome.verdict, outcome.wall_s);
        record(args, "pipeline", &outcome);
        piped.push(outcome);
    }
    let pipeline_s = epoch.elapsed().as_secs_f64();
    let cpu = cpu_busy(ticks, cpu_ticks());
    let gpus: Vec<Value> = pipeline.gpu_accounts().iter().map(|account| gpu_time(account, pipeline_s)).collect();

    // Cache hits: the same candidates again, one at a time, through the warm pipeline.
    let mut repeated = Vec::new();
    for candidate in candidates.iter().filter(|c| c.kind != "triton").take(args.repeat).cloned() {
        let outcome = evaluate(&pipeline, candidate, Instant::now()).await;
        println!(
            "repeat   {:<70} {:<24} compile {:>7.1} ms (hit: {})",
            outcome.name,
            outcome.verdict,
            outcome.stage_ms.get("compile").copied().unwrap_or(0.0),
            outcome.compile_cache_hit
        );
        record(args, "repeat", &outcome);
        repeated.push(outcome);
    }
    // Cold compiles alone: new sources (a comment added), one at a time, through the warm pipeline.
    let mut alone = Vec::new();
    let builds = candidates.iter().filter(|c| c.kind != "triton" && c.expect != "VERDICT_COMPILE_ERROR");
    for candidate in builds.take(args.alone).cloned() {
        let mut candidate = candidate;
        candidate.request.candidate_source.push_str("\n# compiled alone: a source new to the artifact cache\n");
        candidate.request.request_id.push_str("-alone");
        let outcome = evaluate(&pipeline, candidate, Instant::now()).await;
        println!(
            "alone    {:<70} {:<24} compile {:>7.1} s (hit: {})",
            outcome.name,
            outcome.verdict,
            outcome.stage_ms.get("compile").copied().unwrap_or(0.0) / 1e3,
            outcome.compile_cache_hit
        );
        record(args, "alone", &outcome);
        alone.push(outcome);
    }
    PipelineRun {
        outcomes: piped,
        makespan_s: pipeline_s,
        repeats: repeated,
        alone,
        capabilities,
        cpu_busy: cpu,
        gpu_time: Some(json!(gpus)),
        warm_up: Some(warm_up),
    }
}

async fn run(args: Args) -> std::process::ExitCode {
    if let Some(out) = &args.out {
        let _ = std::fs::remove_file(out.join("evaluations.jsonl"));
    }
    let candidates = match load(&args) {
        Ok(mut candidates) => {
            candidates.truncate(args.limit);
            candidates
        }
        Err(error) => {
            eprintln!("evaluator-throughput: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let tasks: std::collections::BTreeSet<&str> = candidates.iter().map(|c| c.task.as_str()).collect();
    println!("# {} candidates over {} tasks", candidates.len(), tasks.len());

    let PipelineRun {
        outcomes: piped,
        makespan_s: pipeline_s,
        repeats: repeated,
        alone,
        capabilities,
        cpu_busy,
        gpu_time,
        warm_up,
    } = match &args.pipeline_from {
        Some(path) => {
            let text = match std::fs::read_to_string(path) {
                Ok(text) => text,
                Err(error) => {
                    eprintln!("evaluator-throughput: {}: {error}", path.display());
                    return std::process::ExitCode::FAILURE;
                }
            };
            let values: Vec<Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
            let of = |mode: &str| -> Vec<Outcome> {
                values.iter().filter(|v| v["mode"] == mode).filter_map(Outcome::from_json).collect()
            };
            let piped = of("pipeline");
            let makespan = piped.iter().map(|o| o.ended_s).fold(0.0, f64::max);
            let probe = evaluator(&args, &args.work.join("capabilities"), Design::Serial).await;
            PipelineRun {
                outcomes: piped,
                makespan_s: makespan,
                repeats: of("repeat"),
                alone: of("alone"),
                capabilities: probe.capabilities(),
                cpu_busy: None,
                gpu_time: None,
                warm_up: None,
            }
        }
        None => pipeline(&args, &candidates).await,
    };

    // Serial: one at a time, nothing shared; the first candidates of each kind in turn.
    let mut by_kind: BTreeMap<&str, Vec<&Candidate>> = BTreeMap::new();
    for candidate in &candidates {
        by_kind.entry(candidate.kind.as_str()).or_default().push(candidate);
    }
    let mut order = Vec::new();
    for round in 0.. {
        let before = order.len();
        order.extend(by_kind.values().filter_map(|list| list.get(round).copied()));
        if order.len() == before || order.len() >= args.serial {
            break;
        }
    }
    order.truncate(args.serial);
    let epoch = Instant::now();
    let mut serial = Vec::new();
    for (index, candidate) in order.into_iter().enumerate() {
        let evaluator = evaluator(&args, &args.work.join(format!("serial-{index}")), Design::Serial).await;
        let outcome = evaluate(&evaluator, candidate.clone(), epoch).await;
        println!("serial   {:<70} {:<24} {:>6.1} s", outcome.name, outcome.verdict, outcome.wall_s);
        record(&args, "serial", &outcome);
        serial.push(outcome);
    }
    let serial_s = epoch.elapsed().as_secs_f64();

    let by_name: BTreeMap<&str, &str> = piped.iter().map(|o| (o.name.as_str(), o.verdict.as_str())).collect();
    let differing: Vec<String> = serial
        .iter()
        .filter(|o| by_name.get(o.name.as_str()) != Some(&o.verdict.as_str()))
        .map(|o| format!("{}: serial {} pipeline {:?}", o.name, o.verdict, by_name.get(o.name.as_str())))
        .collect();
    let mut pipeline_summary = summary(&piped, pipeline_s);
    pipeline_summary["machine_cpu_busy"] = json!(cpu_busy);
    pipeline_summary["gpu_time"] = json!(gpu_time);
    pipeline_summary["warm_up"] = json!(warm_up);
    let serial_summary = summary(&serial, serial_s);
    let rate = |s: &Value| s["evaluations_per_hour"].as_f64().unwrap_or(0.0);
    let hits: Vec<f64> =
        repeated.iter().filter(|o| o.compile_cache_hit).filter_map(|o| o.stage_ms.get("compile").copied()).collect();
    let alone_s: Vec<f64> = alone
        .iter()
        .filter(|o| !o.compile_cache_hit && o.verdict == o.expect)
        .filter_map(|o| o.stage_ms.get("compile").map(|ms| ms / 1e3))
        .collect();
    let report = json!({
        "devices": capabilities.devices,
        "versions": capabilities.versions.iter().collect::<BTreeMap<_, _>>(),
        "cores": std::thread::available_parallelism().map(usize::from).unwrap_or(0),
        "pipeline": pipeline_summary,
        "serial": serial_summary,
        "serial_builds": args.serial_builds.name(),
        "throughput_ratio": if rate(&serial_summary) > 0.0 { rate(&pipeline_summary) / rate(&serial_summary) } else { 0.0 },
        "compile_cache_hit_ms": {"n": hits.len(), "max": hits.iter().copied().fold(0.0, f64::max)},
        "compile_alone_s": {
            "n": alone_s.len(), "p50": percentile(&alone_s, 0.5), "p95": percentile(&alone_s, 0.95), "each": alone_s,
        },
        "serial_candidates": serial.iter().map(|o| o.name.clone()).collect::<Vec<_>>(),
        "same_verdicts_in_both_modes": differing.is_empty(),
        "differing_verdicts": differing,
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
    if let Some(out) = &args.out
        && let Err(error) =
            std::fs::write(out.join("summary.json"), serde_json::to_string_pretty(&report).unwrap_or_default())
    {
        eprintln!("evaluator-throughput: writing results: {error}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}
