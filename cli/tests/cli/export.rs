//! `kforge export` end to end: a small kevin job through the services in this process (replayed model, CPU
//! evaluator in the repository's venv), then the real binary exports its samples from that orchestrator as JSONL
//! and as Parquet. pyarrow, a reader independent of the writer, reads the Parquet file back: every row must say
//! what its JSONL line says, in the same order.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kforge::mesh::{MeshConfig, Service};
use kforge_gateway::config::{BackendConfig, BackendKind, PoolConfig};
use kforge_proto::v1 as pb;
use kforge_test_support::ReservedPort;
use serde_json::{Value, json};
use support::{python, start_mesh, submit_and_follow};

use crate::support;

/// The venv's interpreter with pyarrow (scripts/setup.sh --test installs it). Without it, reading the Parquet file
/// back is a visible `SKIP:`, or a failure under `KFORGE_CI=1`.
fn python_with_pyarrow() -> Option<PathBuf> {
    kforge_test_support::python::or_skip(&["pyarrow.parquet"])
}

const WRONG: &str =
    "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x * 2\n";
const RIGHT: &str =
    "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n";

/// relu/0: a wrong kernel, then the fix; relu/1: no kernel (not evaluated) in a response that loops on one
/// sentence and whose reasoning does not open with `Okay` (junk, degenerate and not-okay), then no record at all
/// (the gateway's NOT_FOUND fails the turn: no response, no diagnosis, no score, return or advantage). Four samples:
/// values set and unset, prompts of one message pair and of two turns (Kevin's second prompt shows the first
/// attempt).
fn replay_file(dir: &Path) -> PathBuf {
    let answers = [(0, 0, Some(WRONG)), (0, 1, Some(RIGHT)), (1, 0, None)];
    let lines: Vec<String> = answers
        .iter()
        .map(|(trajectory, turn, kernel)| {
            let (reasoning, text) = match kernel {
                Some(kernel) => ("Okay, relu.", format!("Here is ModelNew.\n\n```python\n{kernel}```\n")),
                None => ("Hmm, relu.", "I am not sure how to write this. ".repeat(30)),
            };
            json!({
                "task_id": "examples/relu", "trajectory": trajectory, "turn": turn,
                "completions": [{"reasoning": reasoning, "text": text}],
            })
            .to_string()
        })
        .collect();
    std::fs::create_dir_all(dir).expect("test dir");
    let file = dir.join("replay.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").expect("replay written");
    file
}

fn mesh_config(dir: &Path) -> MeshConfig {
    let mut config = MeshConfig::default();
    config.orchestrator.store = "sqlite::memory:".into();
    config.evaluator.python = python();
    config.evaluator.work_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-export-evaluator");
    kforge::run::evaluator_for_one_job(&mut config, false);
    config.gateway.pools.push(PoolConfig {
        model: "recorded".into(),
        backends: vec![BackendConfig { kind: BackendKind::Replay, file: Some(replay_file(dir)), ..Default::default() }],
        ..Default::default()
    });
    config
}

/// `kforge export` (the binary) with `args`, off the runtime's threads: the orchestrator it calls runs on them.
async fn kforge_export(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_kforge")).arg("export").args(args).output().expect("kforge runs")
    })
    .await
    .expect("joined")
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("written")
        .lines()
        .map(|line| serde_json::from_str(line).expect("one json object per line"))
        .collect()
}

/// The Parquet file as pyarrow reads it: its schema's column types, its row groups and its rows.
fn read_with_pyarrow(python: &Path, path: &Path) -> Value {
    const SCRIPT: &str = "
import json, sys
import pyarrow.parquet as pq
table = pq.read_table(sys.argv[1])
print(json.dumps({
    'types': {field.name: str(field.type) for field in table.schema},
    'row_groups': pq.ParquetFile(sys.argv[1]).num_row_groups,
    'rows': table.to_pylist(),
}))
";
    let output = Command::new(python).args(["-c", SCRIPT]).arg(path).output().expect("python runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).expect("the script prints JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_exports_as_parquet_with_the_rows_of_its_jsonl() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-export");
    let _ = std::fs::remove_dir_all(&dir);
    let (mesh, mut orchestrator) = start_mesh(&mesh_config(&dir)).await;
    let spec = pb::JobSpec {
        kind: pb::JobKind::Evaluation.into(),
        recipe: "kevin".into(),
        task_set: "examples".into(),
        model: "recorded".into(),
        trajectories_per_task: 2,
        turns: 2,
        backend: pb::Backend::Cpu.into(),
        max_tasks: 1,
        correctness_trials: 2,
        ..Default::default()
    };
    let (job, trajectories) = submit_and_follow(&mut orchestrator, spec).await;
    assert_eq!((job.state, job.turns_done), (pb::JobState::Succeeded as i32, 4), "{job:#?}");
    let addr = mesh.address(Service::Orchestrator).expect("runs").to_owned();
    let export = |out: &Path, extra: &[&str]| {
        let mut args = vec![job.job_id.clone(), "--addr".into(), addr.clone(), "--out".into()];
        args.push(out.to_str().expect("utf-8").to_owned());
        args.extend(extra.iter().map(|a| a.to_string()));
        kforge_export(args)
    };

    let (jsonl_path, parquet_path) = (dir.join("samples.jsonl"), dir.join("samples.parquet"));
    let exported = export(&jsonl_path, &[]).await;
    assert!(exported.status.success(), "{}", String::from_utf8_lossy(&exported.stderr));
    let lines = jsonl(&jsonl_path);
    // The extension chooses Parquet.
    let exported = export(&parquet_path, &[]).await;
    let stderr = String::from_utf8_lossy(&exported.stderr);
    assert!(exported.status.success() && stderr.contains("4 samples written to"), "{stderr}");
    // From the first sample's cursor: a new file with the three samples after it (a Parquet file is not appended to).
    let rest_path = dir.join("rest.pq");
    let cursor = lines[0]["cursor"].as_str().expect("a cursor").to_owned();
    let exported = export(&rest_path, &["--format", "parquet", "--after", &cursor]).await;
    assert!(exported.status.success(), "{}", String::from_utf8_lossy(&exported.stderr));
    // To stdout, its reader gone before the first line: the export ends quietly (`kforge export ... | head`).
    let args = vec![job.job_id.clone(), "--addr".into(), addr.clone(), "--out".into(), "-".into()];
    let closed = tokio::task::spawn_blocking(move || {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kforge"))
            .arg("export")
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("kforge runs");
        drop(child.stdout.take());
        child.wait_with_output().expect("kforge exits")
    })
    .await
    .expect("joined");
    let stderr = String::from_utf8_lossy(&closed.stderr);
    assert!(closed.status.success() && !stderr.contains("panicked"), "{:?} {stderr}", closed.status);
    mesh.shutdown().await.expect("drains");

    assert_eq!(lines.len(), 4);
    recompute_diagnosis(&lines, &job, &trajectories);
    let score_set: Vec<bool> = lines.iter().map(|l| l.get("score").is_some_and(Value::is_f64)).collect();
    assert!(score_set.contains(&true) && score_set.contains(&false), "scores set and unset: {lines:#?}");
    let magic = std::fs::read(&parquet_path).expect("written");
    assert!(magic.starts_with(b"PAR1") && magic.ends_with(b"PAR1"), "a complete parquet file");
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .expect("listed")
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|name| name.contains(".partial-"))
        .collect();
    assert!(leftovers.is_empty(), "the partial files were renamed: {leftovers:?}");

    let Some(python) = python_with_pyarrow() else { return };
    let table = read_with_pyarrow(&python, &parquet_path);
    let types = &table["types"];
    assert_eq!(types["prompt"], "list<element: struct<role: string not null, content: string not null> not null>");
    assert_eq!(types["prompt_token_ids"], "list<element: int64 not null>");
    assert_eq!(types["response_logprobs"], "list<element: double not null>");
    assert_eq!(
        (&types["score"], &types["keep"], &types["verdict"]),
        (&json!("double"), &json!("bool"), &json!("string"))
    );
    assert_eq!(table["row_groups"], 1);
    let rows = table["rows"].as_array().expect("rows");
    let cursors = |samples: &[Value]| samples.iter().map(|s| s["cursor"].clone()).collect::<Vec<_>>();
    assert_eq!(cursors(rows), cursors(&lines), "one row per sample, in the export's order");
    for (row, line) in rows.iter().zip(&lines) {
        for key in ["job_id", "task_id", "trajectory", "turn", "verdict", "kernel", "prompt", "error", "format_error"] {
            assert_eq!(row[key], line[key], "{key}: {row:#}\n{line:#}");
        }
        // Unset in the proto: absent from the JSON line, null in the row.
        for key in ["score", "return_value", "advantage", "keep"] {
            assert_eq!(row[key], line.get(key).cloned().unwrap_or(Value::Null), "{key}: {row:#}\n{line:#}");
        }
        // A turn without a response has empty text in the row.
        let text = |key: &str| line["response"].get(key).cloned().unwrap_or(json!(""));
        assert_eq!((&row["response"], &row["reasoning"]), (&text("text"), &text("reasoning")), "{row:#}\n{line:#}");
        let evaluation = row["evaluation"].as_str().map(|e| serde_json::from_str::<Value>(e).expect("JSON"));
        assert_eq!(evaluation.unwrap_or(Value::Null), line["evaluation"], "the evaluation, as proto3 JSON");
        // The Diagnose flags: a struct, null where the line has none.
        let flags = ["truncated", "no_kernel", "degenerate", "junk", "not_okay", "hack", "repetition_ratio"];
        match line.get("flags").filter(|f| !f.is_null()) {
            Some(expected) => flags.iter().for_each(|key| assert_eq!(row["flags"][key], expected[key], "{key}")),
            None => assert_eq!(row["flags"], Value::Null, "{row:#}"),
        }
    }
    assert_eq!(
        rows.iter().filter(|r| r["flags"]["degenerate"] == true).count(),
        1,
        "the Parquet rows give the same ratios"
    );
    let first_prompt = rows[0]["prompt"].as_array().expect("a list");
    assert!(first_prompt.iter().any(|m| m["role"] == "user"), "chat messages: {first_prompt:?}");

    let rest = read_with_pyarrow(&python, &rest_path);
    assert_eq!(cursors(rest["rows"].as_array().expect("rows")), cursors(&lines[1..]), "only the samples after it");
}

/// The job's junk and not-okay counts and ratios, recomputed from the exported samples alone, equal the job's
/// metrics; the degenerate flags equal the stored turns' (the metrics have no degenerate count: it is a part of junk).
fn recompute_diagnosis(lines: &[Value], job: &pb::Job, trajectories: &[pb::Trajectory]) {
    let flag = |line: &Value, key: &str| line["flags"][key].as_bool().unwrap_or_else(|| panic!("{key}: {line:#}"));
    // A sample without flags got no response: it is in no response ratio.
    let responses: Vec<&Value> = lines.iter().filter(|l| l.get("flags").is_some_and(|f| !f.is_null())).collect();
    let count = |key: &str| responses.iter().filter(|l| flag(l, key)).count() as u64;
    let (junk, not_okay, degenerate) = (count("junk"), count("not_okay"), count("degenerate"));
    let n = responses.len() as u64;
    for line in &responses {
        let parts = flag(line, "truncated") || flag(line, "no_kernel") || flag(line, "degenerate");
        assert_eq!(flag(line, "junk"), parts, "junk is truncated, no kernel or degenerate: {line:#}");
    }
    assert_eq!((n, junk, not_okay, degenerate), (3, 1, 1, 1), "the replay's one looping answer: {lines:#?}");

    let metrics = job.metrics.clone().expect("metrics");
    assert_eq!((metrics.junk, metrics.not_okay), (junk, not_okay));
    assert_eq!((metrics.junk_ratio, metrics.not_okay_ratio), (junk as f64 / n as f64, not_okay as f64 / n as f64));
    let overall = metrics.overall.expect("overall rates");
    let parts = |ratio: Option<pb::CountRatio>| ratio.map(|r| (r.numerator, r.denominator));
    assert_eq!((parts(overall.junk), parts(overall.not_okay)), (Some((junk, n)), Some((not_okay, n))));
    let stored: Vec<bool> = trajectories
        .iter()
        .flat_map(|t| &t.turns)
        .filter_map(|turn| turn.flags.as_ref().map(|f| f.degenerate))
        .collect();
    let exported: Vec<bool> = responses.iter().map(|l| flag(l, "degenerate")).collect();
    assert_eq!(exported, stored, "the degenerate flags, in the job's order");
}

/// A job that is not in the store: the error names the store searched, the one `--work-dir DIR` names, and a store
/// file that is not there is not created.
#[tokio::test]
async fn a_missing_job_names_the_store_searched() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-export-not-found");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test dir");
    let store = dir.join("orchestrator.db");
    let missing = |work_dir: &Path| {
        let args = ["job-none", "--out", "-", "--work-dir"].map(str::to_owned);
        kforge_export([args.as_slice(), &[work_dir.to_str().expect("utf-8").to_owned()]].concat())
    };
    let output = missing(&dir).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    let expected = format!("NOT_FOUND: job `job-none` not found in the store {} (no such file)", store.display());
    assert!(stderr.contains(&expected), "{stderr}");
    assert!(!store.exists(), "no empty store is made");

    // A store that is there but holds no such job.
    kforge_orchestrator::store::Store::open(store.to_str().expect("utf-8")).await.expect("a store");
    let output = missing(&dir).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    let expected = format!("NOT_FOUND: job `job-none` not found in the store {}", store.display());
    assert!(stderr.trim_end().ends_with(&expected), "{stderr}");
    assert!(output.stdout.is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Parquet file is read from its footer, written last: it cannot go to stdout, and the refusal comes before
/// anything is asked of an orchestrator (none listens at the address given).
#[tokio::test]
async fn parquet_to_stdout_is_refused() {
    let closed = ReservedPort::new();
    let args = ["job-1", "--out", "-", "--format", "parquet", "--addr"].map(str::to_owned);
    let output = kforge_export([args.as_slice(), &[closed.url()]].concat()).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("parquet cannot be written to stdout (--out -)"), "{stderr}");
    assert!(output.stdout.is_empty());
}
