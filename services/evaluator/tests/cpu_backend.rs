//! The evaluator on the CPU backend with a real PyTorch: every verdict from real candidate code.
//!
//! Needs the Python environment that `scripts/setup.sh --test` creates (`.venv` with torch): without it each test
//! says `SKIP:` (and fails under `KFORGE_CI=1`). Compiled artifacts are cached under cargo's target directory, so the one C++ build is shared by every test and test process.

mod support;

use std::path::PathBuf;

use kforge_evaluator::config::{CallLimitsConfig, PairedOn, PairedTimingConfig};
use kforge_evaluator::{Evaluator, EvaluatorConfig, EvaluatorMetrics, RequestError};
use kforge_proto::v1 as pb;

const TASK: &str = include_str!("../../../examples/tasks/relu/task.py");
const CPU_LOOP: &str = include_str!("../../../examples/tasks/relu/candidates/cpu_loop.py");

fn fixture(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()))
}

/// The tests' configuration; `None` (a skip) without the Python environment.
fn config() -> Option<EvaluatorConfig> {
    let python = support::python()?;
    Some(EvaluatorConfig {
        python,
        work_dir: PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("evaluator-cache"),
        // torch.compile on a CPU needs minutes per task; the eager baseline is what these tests check.
        baseline_torch_compile: false,
        // Each test is a process of its own: a header build started by a short test would die with it, half done.
        // `the_bindings_header_is_precompiled_and_gcc_takes_it_for_load_inline_s_flags` builds it.
        bindings_pch: false,
        ..EvaluatorConfig::default()
    })
}

async fn evaluator(config: EvaluatorConfig) -> Evaluator {
    let metrics = EvaluatorMetrics::register(&mut prometheus_client::registry::Registry::default());
    Evaluator::new(config, metrics).await.expect("evaluator starts")
}

fn request(candidate: &str) -> pb::EvaluateRequest {
    pb::EvaluateRequest {
        request_id: "r".into(),
        task: Some(pb::Task { task_id: "examples/relu".into(), source: TASK.into() }),
        candidate_source: candidate.into(),
        backend: pb::Backend::Cpu.into(),
        correctness_trials: 3,
        ..Default::default()
    }
}

fn verdict(response: &pb::EvaluateResponse) -> pb::Verdict {
    pb::Verdict::try_from(response.verdict).expect("a known verdict")
}

#[tokio::test]
async fn a_compiled_kernel_is_correct_timed_and_cached() {
    let Some(base) = config() else { return };
    let evaluator = evaluator(base).await;
    let first = evaluator
        .evaluate(pb::EvaluateRequest { measure_performance: true, ..request(CPU_LOOP) })
        .await
        .expect("evaluates");
    assert_eq!(verdict(&first), pb::Verdict::Correct, "{first:#?}");
    let timing = first.candidate_timing.as_ref().expect("candidate timed");
    assert!(!timing.samples_ms.is_empty() && timing.median_ms > 0.0, "{timing:?}");
    assert!(first.eager_timing.as_ref().is_some_and(|eager| eager.median_ms > 0.0), "eager baseline timed");
    // On the CPU the candidate and a fresh baseline take turns, round by round.
    assert_eq!(first.speedup_basis(), pb::SpeedupBasis::Paired, "{first:#?}");
    assert!(first.speedup_eager > 0.0 && first.speedup_spread.is_finite() && first.speedup_spread >= 0.0);
    assert!(!first.findings.iter().any(|f| f.code == "timing.unpaired"), "{:?}", first.findings);
    assert_eq!(first.device, "cpu");

    let again = evaluator.evaluate(request(CPU_LOOP)).await.expect("evaluates");
    assert_eq!(verdict(&again), pb::Verdict::Correct);
    assert!(again.compile_cache_hit, "an identical candidate reuses its compiled artifact");
}

/// With paired timing off, the speedup is the cached baseline's eager median over the candidate's.
#[tokio::test]
async fn unpaired_speedups_are_against_the_cached_baseline() {
    let Some(base) = config() else { return };
    let unpaired = PairedTimingConfig { on: PairedOn::Off, ..PairedTimingConfig::default() };
    let evaluator = evaluator(EvaluatorConfig { paired_timing: unpaired, ..base }).await;
    let response = evaluator
        .evaluate(pb::EvaluateRequest { measure_performance: true, ..request(CPU_LOOP) })
        .await
        .expect("evaluates");
    assert_eq!(verdict(&response), pb::Verdict::Correct, "{response:#?}");
    let timing = response.candidate_timing.as_ref().expect("candidate timed");
    let eager = response.eager_timing.as_ref().expect("eager baseline timed");
    assert!((response.speedup_eager - eager.median_ms / timing.median_ms).abs() < 1e-9);
    assert_eq!(response.speedup_basis(), pb::SpeedupBasis::CachedBaseline);
    assert_eq!(response.speedup_spread, 0.0);
}

/// A call that never returns costs its call limit, not the stage's: asleep (as a process waiting on a kernel that
/// never ends) or spinning on the CPU, the candidate is stopped, with a timeout that names why.
#[tokio::test]
async fn a_call_that_never_returns_is_stopped_at_its_call_limit() {
    let Some(base) = config() else { return };
    let limits = CallLimitsConfig { floor_secs: 1.0, unmeasured_secs: 1.0, working_secs: 2.0, ..Default::default() };
    let evaluator = evaluator(EvaluatorConfig { run_timeout_secs: 600, call_limits: limits, ..base }).await;
    for (name, says) in
        [("sleeps_in_forward.py", "was waiting, not computing"), ("spins_in_forward.py", "using the CPU")]
    {
        let response = evaluator.evaluate(request(&fixture(name))).await.expect("evaluates");
        assert_eq!(verdict(&response), pb::Verdict::Timeout, "{name}: {response:#?}");
        assert!(response.error.contains(says), "{name}: {}", response.error);
        // What the candidate's threads were doing when it was stopped.
        assert!(response.error.contains("its threads then: "), "{name}: {}", response.error);
    }
}

/// A stage killed at its wall-clock limit is the candidate's timeout only when its calls used most of the time;
/// when the evaluator's own work (here, making the inputs) did, it is an infrastructure error naming the stage.
#[tokio::test]
async fn a_stage_limit_is_charged_to_whoever_used_the_time() {
    let Some(base) = config() else { return };
    let limits =
        CallLimitsConfig { floor_secs: 600.0, unmeasured_secs: 600.0, working_secs: 600.0, ..Default::default() };
    // Long enough for the stage's own start (imports, building the model) on a loaded 2-core machine: the
    // sleeping call then has most of it.
    let evaluator = evaluator(EvaluatorConfig { run_timeout_secs: 15, call_limits: limits, ..base }).await;

    let slow_candidate = evaluator.evaluate(request(&fixture("sleeps_in_forward.py"))).await.expect("evaluates");
    assert_eq!(verdict(&slow_candidate), pb::Verdict::Timeout, "{slow_candidate:#?}");
    assert!(slow_candidate.error.contains("in its own calls"), "{}", slow_candidate.error);

    let stalled_inputs = pb::EvaluateRequest {
        task: Some(pb::Task {
            task_id: "tests/inputs_stall_in_candidate_stage".into(),
            source: fixture("inputs_stall_in_candidate_stage.py"),
        }),
        ..request(&fixture("torch_relu.py"))
    };
    let response = evaluator.evaluate(stalled_inputs).await.expect("evaluates");
    assert_eq!(verdict(&response), pb::Verdict::InfraError, "{response:#?}");
    assert!(response.error.starts_with("candidate stage: the evaluator's own work"), "{}", response.error);
}

#[tokio::test]
async fn a_compile_error_comes_with_the_compiler_log() {
    let Some(base) = config() else { return };
    let evaluator = evaluator(base).await;
    let response = evaluator.evaluate(request(&fixture("compile_error.py"))).await.expect("evaluates");
    assert_eq!(verdict(&response), pb::Verdict::CompileError, "{response:#?}");
    assert!(response.compile_log.contains("error"), "{}", response.compile_log);
    // Failures are deterministic for the same source and are remembered.
    let again = evaluator.evaluate(request(&fixture("compile_error.py"))).await.expect("evaluates");
    assert_eq!(verdict(&again), pb::Verdict::CompileError);
    assert!(again.compile_cache_hit);
}

#[tokio::test]
async fn each_failure_gets_its_verdict_and_the_evaluator_keeps_serving() {
    let Some(base) = config() else { return };
    let evaluator = evaluator(base).await;
    let cases: [(&str, pb::Verdict, &str); 9] = [
        ("raises.py", pb::Verdict::RuntimeError, "kernel launch configuration is invalid"),
        ("aborts.py", pb::Verdict::RuntimeError, "SIGABRT"),
        ("exits_early.py", pb::Verdict::RuntimeError, "without reporting a result"),
        ("wrong_result.py", pb::Verdict::Incorrect, ""),
        ("nan_output.py", pb::Verdict::Incorrect, ""),
        ("wrong_shape.py", pb::Verdict::Incorrect, ""),
        ("mutates_input.py", pb::Verdict::Hack, ""),
        ("prints_megabytes.py", pb::Verdict::Correct, ""),
        ("torch_relu.py", pb::Verdict::Correct, ""),
    ];
    for (name, expected, error) in cases {
        let response = evaluator.evaluate(request(&fixture(name))).await.expect("evaluates");
        assert_eq!(verdict(&response), expected, "{name}: {response:#?}");
        assert!(response.error.contains(error), "{name}: {}", response.error);
        match name {
            "wrong_result.py" => {
                let mismatch = response.mismatch.as_ref().expect("mismatch reported");
                assert_eq!(mismatch.element_index.len(), 2, "{mismatch:?}");
                assert_eq!(mismatch.expected, 0.0, "relu of a negative input: {mismatch:?}");
                assert!(mismatch.got < 0.0 && mismatch.max_abs_error > 0.0, "{mismatch:?}");
            }
            "nan_output.py" => {
                let mismatch = response.mismatch.as_ref().expect("mismatch reported");
                assert_eq!(mismatch.element_index, vec![0, 0], "NaN never passes: {mismatch:?}");
            }
            "wrong_shape.py" => {
                let detail = &response.mismatch.as_ref().expect("mismatch reported").detail;
                assert!(detail.contains("shape"), "{detail}");
            }
            "mutates_input.py" => {
                assert!(
                    response.findings.iter().any(|f| f.code == "runtime.input_mutation"),
                    "{:?}",
                    response.findings
                );
            }
            _ => {}
        }
    }
}

#[tokio::test]
async fn a_hanging_candidate_times_out() {
    let Some(base) = config() else { return };
    let evaluator = evaluator(EvaluatorConfig { run_timeout_secs: 20, ..base }).await;
    let response = evaluator.evaluate(request(&fixture("hangs.py"))).await.expect("evaluates");
    assert_eq!(verdict(&response), pb::Verdict::Timeout, "{response:#?}");
}

#[tokio::test]
async fn static_rejections_run_nothing() {
    let Some(base) = config() else { return };
    let evaluator = evaluator(base).await;
    let strict = pb::EvaluateRequest { policy: "kevin-strict".into(), ..request(&fixture("try_except.py")) };
    let response = evaluator.evaluate(strict).await.expect("evaluates");
    assert_eq!(verdict(&response), pb::Verdict::Rejected);
    let finding = response.findings.iter().find(|f| f.code == "static.try_except").expect("try/except finding");
    assert_eq!((finding.line, finding.category), (6, pb::FindingCategory::Hack as i32));
    assert!(!response.stage_ms.contains_key("run"), "nothing ran: {:?}", response.stage_ms);

    let syntax = evaluator.evaluate(request("import torch\nclass ModelNew(:\n")).await.expect("evaluates");
    assert_eq!(verdict(&syntax), pb::Verdict::CompileError);
    assert_eq!(syntax.findings[0].code, "static.syntax_error");
}

#[tokio::test]
async fn bad_requests_name_the_field() {
    let Some(base) = config() else { return };
    let evaluator = evaluator(base).await;
    let field = |result: Result<pb::EvaluateResponse, RequestError>| match result {
        Err(RequestError::Invalid { field, .. }) => field,
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    };
    let no_inputs = TASK.replace("def get_inputs", "def make_inputs");
    let mut bad = request(CPU_LOOP);
    bad.task = Some(pb::Task { task_id: "t".into(), source: no_inputs });
    assert_eq!(field(evaluator.evaluate(bad).await), "task.source");
    assert_eq!(field(evaluator.evaluate(request("  ")).await), "candidate_source");
    assert_eq!(field(evaluator.evaluate(request(&"#".repeat(300 * 1024))).await), "candidate_source");
    assert_eq!(
        field(evaluator.evaluate(pb::EvaluateRequest { policy: "lenient".into(), ..request(CPU_LOOP) }).await),
        "policy"
    );
    assert_eq!(field(evaluator.evaluate(pb::EvaluateRequest { backend: 42, ..request(CPU_LOOP) }).await), "backend");
    assert_eq!(field(evaluator.evaluate(pb::EvaluateRequest { task: None, ..request(CPU_LOOP) }).await), "task");
    let capabilities = evaluator.capabilities();
    if !capabilities.backends.contains(&(pb::Backend::Cuda as i32)) {
        assert_eq!(
            field(
                evaluator
                    .evaluate(pb::EvaluateRequest { backend: pb::Backend::Cuda.into(), ..request(CPU_LOOP) })
                    .await
            ),
            "backend"
        );
    }
}

#[tokio::test]
async fn a_full_queue_answers_resource_exhausted() {
    let Some(base) = config() else { return };
    let evaluator = evaluator(EvaluatorConfig { queue_capacity: 0, ..base }).await;
    match evaluator.evaluate(request(CPU_LOOP)).await {
        Err(RequestError::QueueFull { retry_after_secs, .. }) => assert!(retry_after_secs > 0),
        other => panic!("expected a full queue, got {other:?}"),
    }
}

#[tokio::test]
async fn capabilities_report_backends_versions_and_the_sandbox() {
    let Some(base) = config() else { return };
    let evaluator = evaluator(base).await;
    let capabilities = evaluator.capabilities();
    assert!(capabilities.backends.contains(&(pb::Backend::Cpu as i32)));
    assert!(capabilities.versions.contains_key("torch"), "{:?}", capabilities.versions);
    assert_eq!(capabilities.policies, vec!["permissive@3", "kevin-strict@2"]);
    for protection in ["process_group", "rlimits", "network_namespace", "landlock"] {
        assert!(capabilities.sandbox.iter().any(|p| p.name == protection), "{protection} not reported");
    }
}

/// Every example task (the embedded default's task set) passes with every candidate shipped beside it: the
/// examples are real evaluations, and a false positive in the checker shows up here first.
#[tokio::test]
async fn every_example_task_passes_with_its_candidates() {
    let Some(base) = config() else { return };
    let evaluator = evaluator(base).await;
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/tasks");
    let mut tasks: Vec<PathBuf> =
        std::fs::read_dir(&examples).expect("examples").map(|e| e.expect("entry").path()).collect();
    tasks.sort();
    assert!(tasks.len() >= 12, "a dozen example tasks: {tasks:?}");
    for task_dir in tasks {
        let name = task_dir.file_name().expect("named").to_string_lossy().into_owned();
        let task = std::fs::read_to_string(task_dir.join("task.py")).expect("task.py");
        let mut candidates: Vec<PathBuf> = std::fs::read_dir(task_dir.join("candidates"))
            .expect("candidates")
            .map(|e| e.expect("entry").path())
            .collect();
        candidates.sort();
        assert!(!candidates.is_empty(), "{name} has no candidate");
        for candidate in candidates {
            let request = pb::EvaluateRequest {
                task: Some(pb::Task { task_id: format!("examples/{name}"), source: task.clone() }),
                candidate_source: std::fs::read_to_string(&candidate).expect("candidate"),
                correctness_trials: 2,
                ..request("")
            };
            let response = evaluator.evaluate(request).await.expect("evaluates");
            assert_eq!(verdict(&response), pb::Verdict::Correct, "{}: {response:#?}", candidate.display());
        }
    }
}

/// The warm-up precompiles torch/extension.h in a trusted stage; gcc takes it for exactly the flags torch gives an
/// extension's bindings (read from the ninja file torch writes, as the harness does), and for a candidate's
/// other flags reads the header itself; a compile with the header on its include path builds a working module.
#[tokio::test]
async fn the_bindings_header_is_precompiled_and_gcc_takes_it_for_load_inline_s_flags() {
    let Some(base) = config() else { return };
    let config = EvaluatorConfig { bindings_pch: true, ..base };
    let (python, work) = (config.python.clone(), config.work_dir.clone());
    let evaluator = evaluator(config).await;
    let dir = evaluator.warm_up().await.expect("the header is precompiled");
    for variant in ["default", "O3"] {
        let gch = dir.join(format!("torch/extension.h.gch/{variant}.gch"));
        assert!(gch.metadata().is_ok_and(|m| m.len() > 1 << 20), "{} is missing or small", gch.display());
    }
    // Which precompiled header gcc takes (`!`) or rejects (`x`) for a file that starts as main.cpp does.
    let search_path = std::env::var_os("PATH").unwrap_or_default();
    let taken = |extra_cflags: &str| {
        let script = format!(
            "import subprocess, sys\n\
             sys.path.insert(0, {harness:?})\n\
             import torch.utils.cpp_extension as ext\n\
             from kforge_harness import build\n\
             flags = build.bindings_flags({extra_cflags}, False)\n\
             run = subprocess.run([ext.get_cxx_compiler(), *flags, '-H', '-fsyntax-only', '-x', 'c++', '-'],\n\
                 input=b'#include <torch/extension.h>\\n', capture_output=True)\n\
             print(run.returncode, *[l for l in run.stderr.decode().splitlines() if '.gch' in l], sep='\\n')\n",
            harness = work.join("harness").display().to_string(),
        );
        // ninja, which torch asks for before it writes a ninja file, lives beside the interpreter.
        let path = python.parent().map(PathBuf::from).into_iter().chain(std::env::split_paths(&search_path));
        let output = std::process::Command::new(&python)
            .args(["-c", &script])
            .env("CPATH", &dir)
            .env("PATH", std::env::join_paths(path).expect("a PATH"))
            .output()
            .expect("python runs");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let default = taken("[]");
    assert!(default.starts_with("0\n"), "{default}");
    assert!(default.contains(&format!("! {}", dir.join("torch/extension.h.gch/default.gch").display())), "{default}");
    let o3 = taken("['-O3']");
    assert!(o3.contains(&format!("! {}", dir.join("torch/extension.h.gch/O3.gch").display())), "{o3}");
    // Flags the header was not precompiled for: every variant is rejected and the header is read as usual.
    let fast_math = taken("['-O3', '-ffast-math']");
    assert!(fast_math.starts_with("0\n") && !fast_math.contains("! "), "{fast_math}");

    // A compile with the header on its include path: the module works (a new source, so it really compiles).
    let candidate = format!("{CPU_LOOP}\n# bindings header: {}\n", std::process::id());
    let response = evaluator.evaluate(request(&candidate)).await.expect("evaluates");
    assert_eq!(verdict(&response), pb::Verdict::Correct, "{response:#?}");
    assert!(!response.compile_cache_hit);
}

/// The sensitivity trial catches what a tolerance check on random inputs cannot: a closed-form loss and a loss
/// computed on every other element pass every random trial (CORRECT with the check off) and are INCORRECT on the
/// sensitivity trial with it on; the whole computation summed in another order stays CORRECT.
#[tokio::test]
async fn the_sensitivity_trial_catches_closed_forms_and_samples() {
    let Some(base) = config() else { return };
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let read = |name: &str| std::fs::read_to_string(corpus.join(name)).expect("corpus file");
    let task = pb::Task { task_id: "corpus/mean_squared_error".into(), source: read("tasks/mean_squared_error.py") };
    let on = evaluator(base.clone()).await;
    let off = evaluator(EvaluatorConfig { sensitivity_check: false, ..base }).await;
    for name in ["exploits/loss_closed_form.py", "exploits/loss_strided_sample.py"] {
        let request = pb::EvaluateRequest { task: Some(task.clone()), ..request(&read(name)) };
        let unchecked = off.evaluate(request.clone()).await.expect("evaluates");
        assert_eq!(verdict(&unchecked), pb::Verdict::Correct, "{name} passes random trials: {unchecked:#?}");
        let checked = on.evaluate(request).await.expect("evaluates");
        assert_eq!(verdict(&checked), pb::Verdict::Incorrect, "{name}: {checked:#?}");
        let detail = checked.mismatch.as_ref().map(|m| m.detail.as_str()).unwrap_or_default();
        assert!(detail.starts_with("input sensitivity"), "{name}: {detail}");
    }
    let honest = pb::EvaluateRequest { task: Some(task), ..request(&read("legitimate/mse_large_two_pass.py")) };
    let response = on.evaluate(honest).await.expect("evaluates");
    assert_eq!(verdict(&response), pb::Verdict::Correct, "{response:#?}");
}
