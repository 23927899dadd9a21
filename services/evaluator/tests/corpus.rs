//! The integrity corpus: every exploit gets its expected verdict and finding code, and every legitimate candidate
//! stays `VERDICT_CORRECT` with all the run-time checks on (timing, census, re-checks).
//!
//! Each corpus file says what it is in its header comments:
//!
//! ```text
//! # class: <the exploit class>
//! # task: relu | corpus/<name>        (examples/tasks/<name>/task.py or tests/corpus/tasks/<name>.py)
//! # policy: permissive | kevin-strict
//! # expect[permissive]: VERDICT_CORRECT runtime.low_profiling_ratio   (one entry per policy so named, instead of
//! # expect[kevin-strict]: VERDICT_REJECTED static.library_compute      `policy` and `expect`: the same candidate
//!                                                                       judged under each)
//! # requires: landlock | process_limit | job_user   (a defence that exists only where that sandbox protection is active;
//!                                       such an entry is not run where it is not: a fork bomb would reach the host)
//! # backend: triton                   (GPU entries: evaluated on the Triton backend rather than CUDA)
//! # expect: VERDICT_HACK runtime.input_mutation   (verdicts and codes may be alternatives: A|B)
//! # expect-profiling-ratio-below: 0.5
//! ```
//!
//! The codes an entry expects are checked whatever its verdict (a notice on a correct candidate too), but for
//! `VERDICT_INCORRECT`, which a mismatch gives with no finding: an entry whose defences may end it either way
//! (`VERDICT_INCORRECT|VERDICT_HACK code`) names the codes of the hack. Lazy work
//! is named exactly: an entry expected correct may carry a lazy-work finding (`LAZY_WORK`) only where its header
//! names it, so no candidate doing its own work gets one, and those that let torch do it (allowed by permissive)
//! get the low-ratio notice. Example candidates that compile no code of their own are the reference's math in
//! torch, as a sweep's reproducing candidate is: they expect exactly that notice.
//!
//! On the CPU backend (the default, and CI) it runs `exploits/` and `legitimate/` plus every example candidate.
//! With `KFORGE_CORPUS_BACKEND=cuda` it adds `cuda/`; `KFORGE_CORPUS_PYTHON`, `KFORGE_CORPUS_WORK` and
//! `KFORGE_CORPUS_REPORT` (a JSON-lines file of every result), `KFORGE_CORPUS_ONLY` and
//! `KFORGE_CORPUS_RUN_TIMEOUT` (seconds per run stage) and `KFORGE_CORPUS_ROOT` let the same binary run on a GPU machine.

use std::path::{Path, PathBuf};

use kforge_evaluator::{Evaluator, EvaluatorConfig, EvaluatorMetrics, config::TimingBudget};
use kforge_proto::v1 as pb;

/// Findings that name lazy work: the candidate's own code does not do the work.
const LAZY_WORK: &[&str] = &[
    "runtime.low_profiling_ratio",
    "runtime.own_kernel_not_launched",
    "static.torch_compute_in_forward",
    "static.library_compute",
];

#[derive(Debug, Clone)]
struct Entry {
    file: PathBuf,
    class: String,
    task_id: String,
    task: String,
    policy: String,
    verdicts: Vec<pb::Verdict>,
    codes: Vec<String>,
    profiling_ratio_below: Option<f64>,
    /// The sandbox protection the defence needs (`landlock`, `process_limit`, `job_user`).
    requires: Option<String>,
    triton: bool,
}

/// The evaluator's package directory (`KFORGE_CORPUS_ROOT` where the binary runs from another checkout).
fn root() -> PathBuf {
    std::env::var_os("KFORGE_CORPUS_ROOT").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

fn task_source(name: &str) -> String {
    let path = match name.strip_prefix("corpus/") {
        Some(corpus) => root().join("tests/corpus/tasks").join(format!("{corpus}.py")),
        None => root().join("../../examples/tasks").join(name).join("task.py"),
    };
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("task {}: {e}", path.display()))
}

/// Parses an expectation: verdicts (`A|B`), then optionally codes (`a|b`; a parenthesised remark is not one).
fn expectation(file: &Path, expect: &str) -> (Vec<pb::Verdict>, Vec<String>) {
    let mut parts = expect.split_whitespace();
    let verdicts = parts
        .next()
        .expect("a verdict")
        .split('|')
        .map(|v| pb::Verdict::from_str_name(v).unwrap_or_else(|| panic!("{}: verdict {v}", file.display())))
        .collect();
    let codes = parts.next().filter(|codes| !codes.starts_with('(')).map(|codes| codes.split('|').map(str::to_owned));
    (verdicts, codes.map(Iterator::collect).unwrap_or_default())
}

/// Reads one corpus file, one entry per policy it is judged under; `default_task` is used when the header names
/// none.
fn entry(file: &Path, default_task: Option<&str>) -> Vec<Entry> {
    let source = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let header = |key: &str| {
        source.lines().find_map(|line| line.strip_prefix(&format!("# {key}:")).map(|v| v.trim().to_owned()))
    };
    let task_id = header("task").or(default_task.map(str::to_owned)).expect("a task");
    let (verdicts, codes) = match header("expect") {
        Some(expect) => expectation(file, &expect),
        None => (vec![pb::Verdict::Correct], Vec::new()),
    };
    let base = Entry {
        file: file.to_owned(),
        class: header("class").unwrap_or_else(|| "legitimate".into()),
        task: task_source(&task_id),
        task_id,
        policy: header("policy").unwrap_or_else(|| "permissive".into()),
        verdicts,
        codes,
        profiling_ratio_below: header("expect-profiling-ratio-below").map(|v| v.parse().expect("a ratio")),
        requires: header("requires"),
        triton: header("backend").as_deref() == Some("triton"),
    };
    let per_policy: Vec<Entry> = source
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("# expect[")?;
            let (policy, expect) = rest.split_once("]:")?;
            let (verdicts, codes) = expectation(file, expect);
            Some(Entry { policy: policy.trim().to_owned(), verdicts, codes, ..base.clone() })
        })
        .collect();
    if per_policy.is_empty() { vec![base] } else { per_policy }
}

fn python_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "py"))
        .collect();
    files.sort();
    files
}

/// The corpus parts: `exploits`, `legitimate`, `examples` (every example candidate), and on a GPU `cuda` and
/// `failures` (the CPU suite's failure fixtures).
/// `KFORGE_CORPUS_ONLY=cuda,exploits` selects some (a GPU run is split to fit its command time).
fn corpus(cuda: bool) -> Vec<Entry> {
    let only = std::env::var("KFORGE_CORPUS_ONLY").ok();
    let wanted = |part: &str| only.as_deref().is_none_or(|only| only.split(',').any(|p| p.trim() == part));
    let corpus = root().join("tests/corpus");
    let mut entries = Vec::new();
    for part in ["exploits", "legitimate"].into_iter().chain(cuda.then_some("cuda")) {
        if wanted(part) {
            entries.extend(python_files(&corpus.join(part)).iter().flat_map(|f| entry(f, None)));
        }
    }
    if cuda && wanted("failures") {
        // The CPU suite's failure fixtures (exceptions, aborts, early exits, megabytes of output, hangs), on the GPU;
        // each file's header says what it expects.
        let fixtures = [
            "raises",
            "aborts",
            "exits_early",
            "prints_megabytes",
            "torch_relu",
            "hangs",
            "wrong_result",
            "nan_output",
            "wrong_shape",
        ];
        for name in fixtures {
            for mut fixture in entry(&root().join("tests/fixtures").join(format!("{name}.py")), Some("relu")) {
                fixture.class = format!("failure fixture {name}.py");
                entries.push(fixture);
            }
        }
    }
    if wanted("examples") {
        let examples = root().join("../../examples/tasks");
        let mut tasks: Vec<PathBuf> =
            std::fs::read_dir(&examples).expect("examples").map(|e| e.expect("entry").path()).collect();
        tasks.sort();
        for task in tasks {
            let name = task.file_name().and_then(|n| n.to_str()).expect("a task name").to_owned();
            for candidate in python_files(&task.join("candidates")) {
                let compiles = std::fs::read_to_string(&candidate).expect("a candidate").contains("load_inline");
                entries.extend(entry(&candidate, Some(&name)).into_iter().map(|mut entry| {
                    if !compiles && entry.codes.is_empty() {
                        entry.codes = vec!["runtime.low_profiling_ratio".into()];
                    }
                    entry
                }));
            }
        }
    }
    entries
}

fn verdict_name(verdict: i32) -> &'static str {
    pb::Verdict::try_from(verdict).map_or("?", |v| v.as_str_name())
}

#[tokio::test(flavor = "multi_thread")]
async fn exploits_get_their_verdicts_and_legitimate_candidates_stay_correct() {
    let backend = std::env::var("KFORGE_CORPUS_BACKEND").unwrap_or_else(|_| "cpu".into());
    let cuda = backend == "cuda";
    let python = std::env::var_os("KFORGE_CORPUS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("../../.venv/bin/python"));
    assert!(python.exists(), "{} is missing: run scripts/setup.sh --test", python.display());
    let work_dir = std::env::var_os("KFORGE_CORPUS_WORK")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("evaluator-cache"));
    let config = EvaluatorConfig {
        python,
        work_dir,
        baseline_torch_compile: false,
        // Built by a test of its own (cpu_backend); a GPU run of the corpus may turn it on.
        bindings_pch: std::env::var_os("KFORGE_CORPUS_BINDINGS_PCH").is_some(),
        // Enough samples for every timing check; the corpus is about verdicts, not precise medians.
        timing: TimingBudget { max_runs: 40, max_seconds: 1.0, ..TimingBudget::default() },
        // A kernel that never ends is one of the entries.
        run_timeout_secs: std::env::var("KFORGE_CORPUS_RUN_TIMEOUT").ok().and_then(|t| t.parse().ok()).unwrap_or(120),
        ..EvaluatorConfig::default()
    };
    let metrics = EvaluatorMetrics::register(&mut prometheus_client::registry::Registry::default());
    let evaluator = Evaluator::new(config, metrics).await.expect("evaluator starts");
    let sandbox = evaluator.capabilities().sandbox;
    for protection in &sandbox {
        println!("SANDBOX {} {}: {}", protection.name, if protection.active { "on" } else { "off" }, protection.detail);
    }
    let active: Vec<String> = sandbox.iter().filter(|p| p.active).map(|p| p.name.clone()).collect();
    let unprotected = |entry: &Entry| entry.requires.as_ref().filter(|name| !active.contains(name)).cloned();

    let entries = corpus(cuda);
    let mut runs = tokio::task::JoinSet::new();
    for (index, entry) in entries.iter().cloned().enumerate() {
        if unprotected(&entry).is_some() {
            continue;
        }
        let evaluator = evaluator.clone();
        let backend = match (cuda, entry.triton) {
            (false, _) => pb::Backend::Cpu,
            (true, false) => pb::Backend::Cuda,
            (true, true) => pb::Backend::Triton,
        };
        runs.spawn(async move {
            let candidate = std::fs::read_to_string(&entry.file).expect("candidate source");
            let response = evaluator
                .evaluate(pb::EvaluateRequest {
                    request_id: format!("{} ({})", entry.file.display(), entry.policy),
                    task: Some(pb::Task { task_id: entry.task_id.clone(), source: entry.task.clone() }),
                    candidate_source: candidate,
                    backend: backend.into(),
                    policy: entry.policy.clone(),
                    correctness_trials: 3,
                    measure_performance: true,
                    census: true,
                    ..Default::default()
                })
                .await;
            (index, response)
        });
    }
    let mut results = Vec::new();
    while let Some(joined) = runs.join_next().await {
        results.push(joined.expect("evaluation task"));
    }
    results.sort_by_key(|(index, _)| *index);

    let mut failures = Vec::new();
    let mut report = String::new();
    for entry in &entries {
        let Some(protection) = unprotected(entry) else { continue };
        let name = entry.file.display();
        if cuda {
            // Recorded, not asserted: some GPU hosts run jobs without a protection (GetCapabilities says why).
            println!("NOT RUN {name}: {protection} is inactive on this host, so its defence is absent");
        } else {
            failures.push(format!("{name}: needs {protection}, which is inactive on this host"));
        }
    }
    for (index, response) in results {
        let entry = &entries[index];
        let name = entry.file.strip_prefix(root().join("../..")).unwrap_or(&entry.file).display().to_string();
        let response = match response {
            Ok(response) => response,
            Err(error) => {
                failures.push(format!("{name}: refused: {error}"));
                continue;
            }
        };
        let codes: Vec<&str> = response.findings.iter().map(|f| f.code.as_str()).collect();
        let got = verdict_name(response.verdict);
        report.push_str(
            &serde_json::json!({
                "file": name, "class": entry.class, "policy": entry.policy, "got": got, "findings": codes,
                "expected": entry.verdicts.iter().map(|v| v.as_str_name()).collect::<Vec<_>>(), "codes": entry.codes,
                "profiling_ratio": response.profiling_ratio, "error": response.error.chars().take(300).collect::<String>(),
                "mismatch": response.mismatch.as_ref().map(|m| m.detail.clone()),
            })
            .to_string(),
        );
        report.push('\n');
        println!("{got:<24} {codes:?} {name} ({}, {}, PR {:.3})", entry.class, entry.policy, response.profiling_ratio);
        let verdict = pb::Verdict::try_from(response.verdict).unwrap_or(pb::Verdict::Unspecified);
        if !entry.verdicts.contains(&verdict) {
            failures.push(format!(
                "{name} ({}): expected {:?}, got {got}; findings {codes:?}; error {}; mismatch {:?}",
                entry.class,
                entry.verdicts,
                response.error.chars().take(600).collect::<String>(),
                response.mismatch
            ));
            continue;
        }
        // A mismatch carries no finding: the codes an entry names are looked for on the other verdicts.
        if verdict != pb::Verdict::Incorrect
            && !entry.codes.is_empty()
            && !entry.codes.iter().any(|code| codes.contains(&code.as_str()))
        {
            failures.push(format!(
                "{name} ({}, {}): expected finding {:?}, got {codes:?}",
                entry.class, entry.policy, entry.codes
            ));
        }
        let unnamed: Vec<&str> =
            codes.iter().copied().filter(|c| LAZY_WORK.contains(c) && !entry.codes.iter().any(|e| e == c)).collect();
        if verdict == pb::Verdict::Correct && !unnamed.is_empty() {
            failures.push(format!(
                "{name} ({}, {}): lazy-work findings {unnamed:?} the entry does not name (profiling ratio {})",
                entry.class, entry.policy, response.profiling_ratio
            ));
        }
        if let Some(limit) = entry.profiling_ratio_below
            && (response.profiling_ratio >= limit || response.kernels.is_empty())
        {
            failures.push(format!(
                "{name}: profiling ratio {} (kernels {}), expected below {limit}",
                response.profiling_ratio,
                response.kernels.len()
            ));
        }
    }
    if let Some(path) = std::env::var_os("KFORGE_CORPUS_REPORT") {
        std::fs::write(path, &report).expect("report written");
    }
    assert!(
        failures.is_empty(),
        "{} of {} corpus entries failed:\n{}",
        failures.len(),
        entries.len(),
        failures.join("\n")
    );
}
