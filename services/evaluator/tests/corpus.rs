//! The integrity corpus: every exploit gets its expected verdict and finding code, and every legitimate candidate
//! stays `VERDICT_CORRECT` with all the run-time checks on (timing, census, re-checks).
//!
//! Each corpus entry is a test of its own (this is a `harness = false` test run by libtest-mimic), named by its file
//! (and policy, where one file is judged under several): one entry can be run and retried alone, e.g.
//! `cargo test -p kforge-evaluator --test corpus -- exploits/input_mutation.py`. The entries of one process share one
//! evaluator; a run under cargo-nextest starts one per entry, sharing the caches in the work directory.
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
//! # requires: landlock | process_limit | command_user   (a defence that exists only where that sandbox protection is active;
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
//! An entry that needs a sandbox protection this host lacks fails on the CPU backend (CI's host has them all) and
//! is a `SKIP:` on a GPU host (some run jobs without one; GetCapabilities says why). Without the Python environment
//! every entry is a `SKIP:`, or a failure under `KFORGE_CI=1` (set-up installs it).
//!
//! On the CPU backend (the default, and CI) it runs `exploits/` and `legitimate/` plus every example candidate.
//! With `KFORGE_CORPUS_BACKEND=cuda` it adds `cuda/`; `KFORGE_CORPUS_PYTHON`, `KFORGE_CORPUS_WORK` and
//! `KFORGE_CORPUS_REPORT` (a JSON-lines file each result is appended to), `KFORGE_CORPUS_ONLY` and
//! `KFORGE_CORPUS_RUN_TIMEOUT` (seconds per run stage) and `KFORGE_CORPUS_ROOT` let the same binary run on a GPU
//! machine. Entries run 16 at a time unless `--test-threads` says otherwise.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kforge_evaluator::{Evaluator, EvaluatorConfig, EvaluatorMetrics, config::TimingBudget};
use kforge_proto::v1 as pb;
use kforge_test_support::python;
use libtest_mimic::{Arguments, Failed, Trial};

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
    /// The sandbox protection the defence needs (`landlock`, `process_limit`, `command_user`).
    requires: Option<String>,
    triton: bool,
}

impl Entry {
    /// The test's name: the file from the repository root (examples) or the corpus directory, and the policy where
    /// the file is judged under several.
    fn name(&self, several_policies: bool) -> String {
        let file = self.file.strip_prefix(root().join("tests/corpus")).unwrap_or(&self.file);
        let file = file.strip_prefix(root().join("tests")).unwrap_or(file);
        let file = file
            .strip_prefix(root().join("../../examples/tasks"))
            .map_or(file.to_owned(), |f| Path::new("examples").join(f.to_string_lossy().replace("/candidates/", "/")));
        if several_policies { format!("{}[{}]", file.display(), self.policy) } else { file.display().to_string() }
    }
}

/// The evaluator's package directory (`KFORGE_CORPUS_ROOT` where the binary runs from another checkout).
fn root() -> PathBuf {
    std::env::var_os("KFORGE_CORPUS_ROOT").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The `.venv` interpreter of the checkout the corpus is read from: this one's, or `KFORGE_CORPUS_ROOT`'s.
fn venv_python() -> PathBuf {
    match std::env::var_os("KFORGE_CORPUS_ROOT") {
        Some(_) => root().join("../../.venv/bin/python"),
        None => python::venv_python(),
    }
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

/// What every entry of this process shares: one runtime and one evaluator, started by the first entry that runs
/// (so that listing the entries starts nothing), with the sandbox protections it has.
struct Shared {
    runtime: tokio::runtime::Runtime,
    evaluator: Evaluator,
    active: Vec<String>,
    cuda: bool,
}

/// The shared evaluator, or why the entries cannot run: `Ok(None)` says SKIP (no Python environment, and none
/// expected).
fn shared() -> Result<Option<&'static Shared>, Failed> {
    static SHARED: OnceLock<Result<Option<Shared>, String>> = OnceLock::new();
    match SHARED.get_or_init(start) {
        Ok(shared) => Ok(shared.as_ref()),
        Err(error) => Err(error.into()),
    }
}

fn start() -> Result<Option<Shared>, String> {
    let backend = std::env::var("KFORGE_CORPUS_BACKEND").unwrap_or_else(|_| "cpu".into());
    // An interpreter named must be there; the `.venv` may be missing (a SKIP), except under `KFORGE_CI=1`.
    let named = std::env::var_os("KFORGE_CORPUS_PYTHON").map(PathBuf::from);
    let python = named.clone().unwrap_or_else(venv_python);
    if !python.exists() {
        let missing = format!("{} is missing: run scripts/setup.sh --test", python.display());
        if named.is_some() || python::ci() {
            return Err(missing);
        }
        return Ok(None);
    }
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
    let runtime = tokio::runtime::Runtime::new().map_err(|e| format!("a tokio runtime: {e}"))?;
    let metrics = EvaluatorMetrics::register(&mut prometheus_client::registry::Registry::default());
    let evaluator = runtime.block_on(Evaluator::new(config, metrics)).map_err(|e| format!("evaluator start: {e}"))?;
    let sandbox = evaluator.capabilities().sandbox;
    for protection in &sandbox {
        println!("SANDBOX {} {}: {}", protection.name, if protection.active { "on" } else { "off" }, protection.detail);
    }
    let active = sandbox.iter().filter(|p| p.active).map(|p| p.name.clone()).collect();
    Ok(Some(Shared { runtime, evaluator, active, cuda: backend == "cuda" }))
}

/// Evaluates one entry and checks its verdict, findings and profiling ratio.
fn run(entry: &Entry, name: &str) -> Result<(), Failed> {
    let Some(shared) = shared()? else {
        println!("SKIP: {name}: the Python environment (.venv) is missing: run scripts/setup.sh --test");
        return Ok(());
    };
    if let Some(protection) = entry.requires.as_ref().filter(|name| !shared.active.contains(name)) {
        if shared.cuda {
            // Recorded, not asserted: some GPU hosts run jobs without a protection (GetCapabilities says why).
            println!("SKIP: {name}: {protection} is inactive on this host, so its defence is absent");
            return Ok(());
        }
        return Err(format!("needs {protection}, which is inactive on this host").into());
    }
    let backend = match (shared.cuda, entry.triton) {
        (false, _) => pb::Backend::Cpu,
        (true, false) => pb::Backend::Cuda,
        (true, true) => pb::Backend::Triton,
    };
    let candidate = std::fs::read_to_string(&entry.file).map_err(|e| format!("{}: {e}", entry.file.display()))?;
    let request = pb::EvaluateRequest {
        request_id: format!("{} ({})", entry.file.display(), entry.policy),
        task: Some(pb::Task { task_id: entry.task_id.clone(), source: entry.task.clone() }),
        candidate_source: candidate,
        backend: backend.into(),
        policy: entry.policy.clone(),
        correctness_trials: 3,
        measure_performance: true,
        census: true,
        ..Default::default()
    };
    let response = shared.runtime.block_on(shared.evaluator.evaluate(request)).map_err(|e| format!("refused: {e}"))?;
    let codes: Vec<&str> = response.findings.iter().map(|f| f.code.as_str()).collect();
    let got = verdict_name(response.verdict);
    if let Some(path) = std::env::var_os("KFORGE_CORPUS_REPORT") {
        let line = serde_json::json!({
            "file": name, "class": entry.class, "policy": entry.policy, "got": got, "findings": codes,
            "expected": entry.verdicts.iter().map(|v| v.as_str_name()).collect::<Vec<_>>(), "codes": entry.codes,
            "profiling_ratio": response.profiling_ratio, "error": response.error.chars().take(300).collect::<String>(),
            "mismatch": response.mismatch.as_ref().map(|m| m.detail.clone()),
        });
        // One write of one line in append mode: lines of entries that end at once do not interleave.
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut report| report.write_all(format!("{line}\n").as_bytes()))
            .map_err(|e| format!("report {}: {e}", Path::new(&path).display()))?;
    }
    println!("{got:<24} {codes:?} {name} ({}, {}, PR {:.3})", entry.class, entry.policy, response.profiling_ratio);
    let verdict = pb::Verdict::try_from(response.verdict).unwrap_or(pb::Verdict::Unspecified);
    if !entry.verdicts.contains(&verdict) {
        return Err(format!(
            "{}: expected {:?}, got {got}; findings {codes:?}; error {}; mismatch {:?}",
            entry.class,
            entry.verdicts,
            response.error.chars().take(600).collect::<String>(),
            response.mismatch
        )
        .into());
    }
    // A mismatch carries no finding: the codes an entry names are looked for on the other verdicts.
    if verdict != pb::Verdict::Incorrect
        && !entry.codes.is_empty()
        && !entry.codes.iter().any(|code| codes.contains(&code.as_str()))
    {
        return Err(
            format!("{}, {}: expected finding {:?}, got {codes:?}", entry.class, entry.policy, entry.codes).into()
        );
    }
    let unnamed: Vec<&str> =
        codes.iter().copied().filter(|c| LAZY_WORK.contains(c) && !entry.codes.iter().any(|e| e == c)).collect();
    if verdict == pb::Verdict::Correct && !unnamed.is_empty() {
        return Err(format!(
            "{}, {}: lazy-work findings {unnamed:?} the entry does not name (profiling ratio {})",
            entry.class, entry.policy, response.profiling_ratio
        )
        .into());
    }
    if let Some(limit) = entry.profiling_ratio_below
        && (response.profiling_ratio >= limit || response.kernels.is_empty())
    {
        return Err(format!(
            "profiling ratio {} (kernels {}), expected below {limit}",
            response.profiling_ratio,
            response.kernels.len()
        )
        .into());
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let mut args = Arguments::from_args();
    // Entries wait on the evaluator's queue, not the CPU: more at once keeps its compile pool and lanes busy.
    args.test_threads =
        args.test_threads.or_else(|| std::env::var("RUST_TEST_THREADS").ok()?.parse().ok()).or(Some(16));
    let cuda = std::env::var("KFORGE_CORPUS_BACKEND").is_ok_and(|backend| backend == "cuda");
    let entries = corpus(cuda);
    let mut trials = Vec::new();
    for entry in entries.iter() {
        let several = entries.iter().filter(|other| other.file == entry.file).count() > 1;
        let name = entry.name(several);
        let entry = entry.clone();
        trials.push(Trial::test(name.clone(), move || run(&entry, &name)));
    }
    libtest_mimic::run(&args, trials).exit_code()
}
