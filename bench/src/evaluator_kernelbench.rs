//! Evaluates kforge's own candidates for KernelBench tasks through the evaluator library, all submitted at once
//! (the compile pool and the device lane schedule them), and writes one JSON line per result.
//!
//! ```text
//! evaluator-kernelbench --kernelbench DIR --candidates DIR [--python PY] [--work DIR] [--out FILE]
//!                       [--no-torch-compile] [--trials N] [--only SUBSTRING] [--gpu-slots N] [--in-flight N]
//!                       [--no-landlock]
//!                       [--no-network-namespace] [--again] [--memory-files-dir DIR]
//! ```
//! `--candidates` is what `bench/kernelbench/make_candidates.py` writes (candidates and manifest.json).
//! `--again` evaluates each candidate a second time as soon as its first evaluation ends (its compile, reference
//! outputs and baselines then cached): each line says its `pass`, `cold` or `warm`, so a sweep cut short still has
//! both figures for every task it finished. `--memory-files-dir ""` keeps candidates' outputs files on the disk
//! (the evaluator's `memory_files_dir`, by default `/dev/shm`). Each line also carries the GPUs' gate accounts so far
//! (`gates`), so a cut run still tells how long its devices ran something alone, drained, shared or were empty.

use std::path::PathBuf;
use std::time::Instant;

use kforge_evaluator::{Evaluator, EvaluatorConfig, EvaluatorMetrics};
use kforge_proto::v1 as pb;
use serde_json::json;

/// Evaluates kforge's own candidates for KernelBench tasks through the evaluator library and writes one JSON line
/// per result.
#[derive(clap::Parser)]
#[command(name = "evaluator-kernelbench")]
struct Args {
    /// KernelBench's tasks (the folder holding level1/, level2/, level3/).
    #[arg(long)]
    kernelbench: PathBuf,
    /// The candidates and their manifest.json, as `bench/kernelbench/make_candidates.py` writes them.
    #[arg(long)]
    candidates: PathBuf,
    /// The Python that runs the candidates.
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// The evaluator's work directory.
    #[arg(long, default_value = ".kforge/bench-evaluator")]
    work: PathBuf,
    /// The file the JSON lines go to, one per result (none without it; the table goes to standard output).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Leaves torch.compile out of the baselines.
    #[arg(long = "no-torch-compile", action = clap::ArgAction::SetFalse)]
    torch_compile: bool,
    /// Correctness trials per evaluation.
    #[arg(long, default_value_t = 5)]
    trials: u32,
    /// Evaluates only the candidates whose task contains this string.
    #[arg(long)]
    only: Option<String>,
    /// The evaluator's `gpu_slots` (default: the evaluator's default).
    #[arg(long)]
    gpu_slots: Option<usize>,
    /// How many evaluations are submitted at once (default: all of them).
    #[arg(long)]
    in_flight: Option<usize>,
    /// Runs the jobs without Landlock.
    #[arg(long = "no-landlock", action = clap::ArgAction::SetFalse)]
    landlock: bool,
    /// Runs the jobs without a network namespace.
    #[arg(long = "no-network-namespace", action = clap::ArgAction::SetFalse)]
    network_namespace: bool,
    /// Evaluates each candidate a second time as soon as its first evaluation ends (`pass`: `cold`, then `warm`).
    #[arg(long)]
    again: bool,
    /// The evaluator's `memory_files_dir` ("" keeps the outputs files on the disk; default `/dev/shm`).
    #[arg(long, value_parser = any_path)]
    memory_files_dir: Option<PathBuf>,
}

/// A path, the empty one included (clap's own path parser refuses it).
fn any_path(text: &str) -> Result<PathBuf, std::convert::Infallible> {
    Ok(PathBuf::from(text))
}

fn main() -> std::process::ExitCode {
    let args = <Args as clap::Parser>::parse();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(run(args))
}

async fn run(args: Args) -> std::process::ExitCode {
    let manifest: Vec<serde_json::Value> = match std::fs::read(args.candidates.join("manifest.json"))
        .map_err(|e| e.to_string())
        .and_then(|bytes| serde_json::from_slice(&bytes).map_err(|e| e.to_string()))
    {
        Ok(manifest) => manifest,
        Err(error) => {
            eprintln!("evaluator-kernelbench: manifest: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let config = EvaluatorConfig {
        python: args.python.clone(),
        work_dir: args.work.clone(),
        baseline_torch_compile: args.torch_compile,
        queue_capacity: 1024,
        sandbox: kforge_sandbox::SandboxOptions {
            landlock: args.landlock,
            network_namespace: args.network_namespace,
            ..Default::default()
        },
        ..EvaluatorConfig::default()
    };
    let config = EvaluatorConfig {
        gpu_slots: args.gpu_slots.unwrap_or(config.gpu_slots),
        memory_files_dir: args.memory_files_dir.clone().unwrap_or(config.memory_files_dir),
        ..config
    };
    let metrics = EvaluatorMetrics::register(&mut prometheus_client::registry::Registry::default());
    let evaluator = Evaluator::new(config, metrics).await.expect("evaluator starts");
    let capabilities = evaluator.capabilities();
    println!("# devices {:?} versions {:?}", capabilities.devices, capabilities.versions);
    println!("# sandbox {:?}", capabilities.sandbox.iter().map(|p| (p.name.as_str(), p.active)).collect::<Vec<_>>());

    let started = Instant::now();
    // With --in-flight, at most that many evaluations are submitted at once, so each one's wall time is its own
    // service time (beside the others in flight) rather than its wait behind the whole manifest.
    let in_flight = std::sync::Arc::new(tokio::sync::Semaphore::new(args.in_flight.unwrap_or(usize::MAX >> 4)));
    let mut running = tokio::task::JoinSet::new();
    for entry in manifest {
        let task = entry["task"].as_str().unwrap_or_default().to_owned();
        let kind = entry["kind"].as_str().unwrap_or_default().to_owned();
        if args.only.as_ref().is_some_and(|only| !task.contains(only.as_str())) {
            continue;
        }
        let backend = match entry["backend"].as_str() {
            Some("triton") => pb::Backend::Triton,
            Some("cpu") => pb::Backend::Cpu,
            _ => pb::Backend::Cuda,
        };
        let task_source = std::fs::read_to_string(args.kernelbench.join(&task));
        let candidate_source =
            std::fs::read_to_string(args.candidates.join(entry["candidate"].as_str().unwrap_or_default()));
        let (Ok(task_source), Ok(candidate_source)) = (task_source, candidate_source) else {
            eprintln!("skipping {task}: unreadable task or candidate");
            continue;
        };
        let evaluator = evaluator.clone();
        let trials = args.trials;
        let passes: &[&'static str] = if args.again { &["cold", "warm"] } else { &["cold"] };
        let in_flight = in_flight.clone();
        running.spawn(async move {
            let _permit = in_flight.acquire_owned().await.expect("never closed");
            let mut results = Vec::with_capacity(passes.len());
            for &pass in passes {
                let request = pb::EvaluateRequest {
                    request_id: format!("{task}:{}:{pass}", backend.as_str_name()),
                    task: Some(pb::Task { task_id: task.clone(), source: task_source.clone() }),
                    candidate_source: candidate_source.clone(),
                    backend: backend.into(),
                    correctness_trials: trials,
                    measure_performance: true,
                    census: true,
                    ..Default::default()
                };
                let began = Instant::now();
                let result = evaluator.evaluate(request).await;
                results.push((pass, result, began.elapsed()));
            }
            (task, kind, backend, results)
        });
    }
    // Each line is appended as it finishes, so a run cut short keeps what it measured.
    let mut out = args.out.as_ref().map(|path| std::fs::File::create(path).map(std::io::BufWriter::new));
    let mut lines = 0usize;
    while let Some(joined) = running.join_next().await {
        let Ok((task, kind, backend, results)) = joined else { continue };
        for (pass, result, elapsed) in results {
            let line = match result {
                Ok(r) => {
                    let verdict = pb::Verdict::try_from(r.verdict).map_or("?", |v| v.as_str_name());
                    let median = |t: &Option<pb::TimingStats>| t.as_ref().map(|t| t.median_ms);
                    let iqr = |t: &Option<pb::TimingStats>| t.as_ref().map(|t| t.iqr_ms);
                    let samples = |t: &Option<pb::TimingStats>| t.as_ref().map(|t| t.samples_ms.len());
                    println!(
                        "{task:<55} {pass:<4} {:<14} {verdict:<22} PR {:.3} eager x{:<7.3} compile x{:<7.3} cand {:>9.4} ms eager {:>9.4} ms compile {:>9.4} ms  wall {:>6.1} s",
                        backend.as_str_name(),
                        r.profiling_ratio,
                        r.speedup_eager,
                        r.speedup_compile,
                        median(&r.candidate_timing).unwrap_or(0.0),
                        median(&r.eager_timing).unwrap_or(0.0),
                        median(&r.compile_timing).unwrap_or(0.0),
                        elapsed.as_secs_f64()
                    );
                    for finding in &r.findings {
                        println!("    finding {}: {}", finding.code, finding.message);
                    }
                    if !r.error.is_empty() || !r.compile_log.is_empty() {
                        let text = if r.error.is_empty() { &r.compile_log } else { &r.error };
                        let tail: String = text.chars().rev().take(600).collect::<Vec<_>>().into_iter().rev().collect();
                        println!("    {}", tail.replace('\n', "\n    "));
                    }
                    json!({
                        "task": task, "kind": kind, "pass": pass, "backend": backend.as_str_name(), "verdict": verdict,
                        "device_peak_bytes": r.device_peak_bytes, "reference_peak_bytes": r.reference_peak_bytes,
                        "speedup_eager": r.speedup_eager, "speedup_compile": r.speedup_compile,
                        "candidate_median_ms": median(&r.candidate_timing), "candidate_iqr_ms": iqr(&r.candidate_timing),
                        "candidate_samples": samples(&r.candidate_timing),
                        "eager_median_ms": median(&r.eager_timing), "eager_iqr_ms": iqr(&r.eager_timing),
                        "eager_samples": samples(&r.eager_timing),
                        "compile_median_ms": median(&r.compile_timing),
                        "profiling_ratio": r.profiling_ratio,
                        "findings": r.findings.iter().map(|f| json!({"code": f.code, "message": f.message})).collect::<Vec<_>>(),
                        "kernels": r.kernels.iter().filter(|k| k.mode == "train/no_grad").map(|k| json!({"name": k.name, "own": k.own, "launches": k.launches, "total_ms": k.total_ms})).collect::<Vec<_>>(),
                        "stage_ms": r.stage_ms, "compile_cache_hit": r.compile_cache_hit, "device": r.device,
                        "mismatch": r.mismatch.map(|m| json!({"trial": m.trial, "index": m.element_index, "expected": m.expected, "got": m.got, "max_abs": m.max_abs_error, "detail": m.detail})),
                        "error": r.error.chars().take(2000).collect::<String>(),
                        "compile_log": r.compile_log.chars().rev().take(2000).collect::<String>().chars().rev().collect::<String>(),
                        "wall_s": elapsed.as_secs_f64(),
                        "gates": gates(&evaluator, started),
                    })
                }
                Err(error) => {
                    println!("{task:<55} {:<14} REFUSED {error}", backend.as_str_name());
                    json!({"task": task, "kind": kind, "pass": pass, "backend": backend.as_str_name(), "refused": error.to_string()})
                }
            };
            lines += 1;
            if let Some(Ok(writer)) = out.as_mut() {
                use std::io::Write;
                if let Err(error) = writeln!(writer, "{line}").and_then(|()| writer.flush()) {
                    eprintln!("evaluator-kernelbench: writing results: {error}");
                }
            }
        }
    }
    println!("# {lines} evaluations in {:.1} s", started.elapsed().as_secs_f64());
    match out {
        Some(Err(error)) => {
            eprintln!("evaluator-kernelbench: cannot create the results file: {error}");
            std::process::ExitCode::FAILURE
        }
        _ => std::process::ExitCode::SUCCESS,
    }
}

/// Each GPU's time so far by what its gate did (alone, draining, shared, empty; seconds since the evaluator
/// started), and the seconds since the sweep started: the gates' accounts over a run are the last line's, over a
/// stretch of it the difference of two lines'.
fn gates(evaluator: &Evaluator, started: Instant) -> serde_json::Value {
    let gpus: Vec<_> = evaluator
        .gpu_accounts()
        .iter()
        .map(|a| {
            json!({
                "alone": a.alone.as_secs_f64(), "draining": a.draining.as_secs_f64(),
                "shared": a.shared.as_secs_f64(), "empty": a.empty.as_secs_f64(),
            })
        })
        .collect();
    json!({ "since_start_s": started.elapsed().as_secs_f64(), "gpus": gpus })
}
