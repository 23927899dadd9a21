//! The evaluator and its harness refuse each other across protocol versions, and list the same spec and result
//! fields. Against the real harness package (and copies of it that claim another version), with the Python
//! environment of `scripts/setup.sh --test`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kforge_execution::protocol::{self, CompileSpec, PROTOCOL_VERSION, REFUSED_EXIT};
use kforge_execution::python::{HARNESS_FILES, HARNESS_PACKAGE, PythonEnv};
use kforge_execution::stage::{self, Request, Stage, StageError};
use kforge_sandbox::Sandbox;
use kforge_test_support::python;
use tokio_util::sync::CancellationToken;

/// The harness package, run as the engine runs it (`python harness/kforge_harness`).
const HARNESS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/harness/kforge_harness");

/// A fresh directory for `name`.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("harness-protocol-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch");
    dir
}

/// A copy of the harness's files in `dir`, as the engine writes them, with `edit` applied (`from` must occur once
/// in the package); the package's folder.
fn harness_copy(dir: &Path, from: &str, to: &str) -> PathBuf {
    let found: usize = HARNESS_FILES.iter().map(|(_, contents)| contents.matches(from).count()).sum();
    assert_eq!(found, 1, "the harness has `{from}` once");
    for (name, contents) in HARNESS_FILES {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().expect("a folder")).expect("the package's folder");
        std::fs::write(&path, contents.replace(from, to)).expect("harness copy");
    }
    dir.join(HARNESS_PACKAGE)
}

/// Runs a compile stage of a trivial candidate with `harness`.
async fn compile_with(harness: &Path, dir: &Path) -> Result<String, StageError> {
    let python = python::or_skip(&[]).expect("checked by the caller");
    let env = PythonEnv::probe(&python, &dir.join("probe")).await.expect("python with torch");
    let stage_dir = dir.join("stage");
    std::fs::create_dir_all(&stage_dir).expect("stage dir");
    std::fs::write(stage_dir.join("candidate.py"), "class ModelNew:\n    pass\n").expect("candidate");
    let stage = Stage {
        scratch: stage_dir.clone(),
        readable: vec![],
        writable: vec![],
        env: env.env_on(&stage_dir, None),
        wall: std::time::Duration::from_secs(300),
        background: false,
        launcher: vec![],
    };
    let started = stage::start(&Sandbox::basic(), &env, harness, stage, CancellationToken::new());
    let request = Request::plain(CompileSpec { candidate_path: stage_dir.join("candidate.py"), kernels: false });
    let outcome = started.run(request, None).await?;
    assert!(outcome.ok(), "the stage ran: {}", outcome.error_text());
    Ok("compiled".into())
}

#[tokio::test]
async fn the_evaluator_and_a_harness_of_its_version_understand_each_other() {
    if python::or_skip(&[]).is_none() {
        return;
    }
    let dir = scratch("same");
    assert_eq!(compile_with(Path::new(HARNESS), &dir).await.expect("same version"), "compiled");
}

#[tokio::test]
async fn the_evaluator_refuses_a_harness_that_answers_in_another_version() {
    if python::or_skip(&[]).is_none() {
        return;
    }
    let dir = scratch("answers-other");
    // A harness that reads this evaluator's requests but answers in the next version.
    let other = PROTOCOL_VERSION + 1;
    let harness =
        harness_copy(&dir, "written[\"protocol\"] = PROTOCOL_VERSION", &format!("written[\"protocol\"] = {other}"));
    let error = compile_with(&harness, &dir).await.expect_err("refused");
    assert!(
        matches!(error, StageError::Protocol { mode: "compile", harness: Some(v) } if v == u64::from(other)),
        "{error:?}"
    );
    let text = error.to_string();
    assert!(text.contains(&format!("protocol version {other}, this evaluator {PROTOCOL_VERSION}")), "{text}");
}

#[tokio::test]
async fn a_harness_of_another_version_refuses_the_evaluators_request() {
    if python::or_skip(&[]).is_none() {
        return;
    }
    let dir = scratch("speaks-other");
    let other = PROTOCOL_VERSION + 1;
    let from = format!("\nPROTOCOL_VERSION = {PROTOCOL_VERSION}\n");
    let harness = harness_copy(&dir, &from, &format!("\nPROTOCOL_VERSION = {other}\n"));
    // Through the evaluator: the harness refuses, and its answer (in its own version) is refused in turn.
    let error = compile_with(&harness, &dir).await.expect_err("refused");
    assert!(matches!(error, StageError::Protocol { harness: Some(v), .. } if v == u64::from(other)), "{error:?}");

    // What the harness itself says, to a request in this evaluator's version.
    let python = python::or_skip(&[]).expect("checked above");
    let result_path = dir.join("refused.json");
    let spec = CompileSpec { candidate_path: dir.join("candidate.py"), kernels: false };
    let request = protocol::encode(&spec, &result_path, protocol::GateRole::None, &[]);
    let mut child = Command::new(python)
        .arg(&harness)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("harness starts");
    std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), &request).expect("request");
    let output = child.wait_with_output().expect("harness ends");
    assert_eq!(output.status.code(), Some(REFUSED_EXIT), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let says = format!("speaks protocol version {other}, the evaluator sent {PROTOCOL_VERSION}");
    assert!(stderr.contains(&says), "{stderr}");
    let result: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&result_path).expect("a result")).expect("json");
    assert_eq!(result["ok"], false);
    assert_eq!(result["protocol"], other);
    assert!(result["error"].as_str().is_some_and(|e| e.contains(&says)), "{result}");
}

#[tokio::test]
async fn a_harness_refuses_a_spec_unlike_its_modes() {
    let Some(python) = python::or_skip(&[]) else { return };
    let dir = scratch("bad-spec");
    let result_path = dir.join("result.json");
    let request = serde_json::json!({
        "protocol": PROTOCOL_VERSION,
        "mode": "compile",
        "spec": { "candidate_path": 3, "kernels": false, "result_path": result_path, "gate": false },
        "env": {},
    });
    let mut child = Command::new(python)
        .arg(HARNESS)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("harness starts");
    let bytes = serde_json::to_vec(&request).expect("json");
    std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), &bytes).expect("request");
    let output = child.wait_with_output().expect("harness ends");
    assert_eq!(output.status.code(), Some(REFUSED_EXIT), "{output:?}");
    let result: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&result_path).expect("a result")).expect("json");
    assert!(result["error"].as_str().is_some_and(|e| e.contains("candidate_path is of type int")), "{result}");
}

#[test]
fn both_sides_list_the_same_spec_fields() {
    let Some(python) = python::or_skip(&[]) else { return };
    let output = Command::new(python).arg(HARNESS).arg("--specs").output().expect("harness runs");
    assert!(output.status.success(), "{output:?}");
    let harness: BTreeMap<String, Vec<String>> = serde_json::from_slice(&output.stdout).expect("the harness's specs");
    let evaluator: BTreeMap<String, Vec<String>> =
        protocol::spec_fields().into_iter().map(|(mode, fields)| (mode.to_owned(), fields)).collect();
    assert_eq!(harness, evaluator);
}

/// The result fields the harness writes for the evaluator are those the evaluator reads, mode by mode, both ways;
/// what the harness writes for the record only (`unread`: `blocking_sync`, the baseline's `timing_cpu`) the
/// evaluator does not read.
#[test]
fn both_sides_list_the_same_result_fields() {
    let Some(python) = python::or_skip(&[]) else { return };
    let output = Command::new(python).arg(HARNESS).arg("--results").output().expect("harness runs");
    assert!(output.status.success(), "{output:?}");
    #[derive(serde::Deserialize)]
    struct Listed {
        read: BTreeMap<String, Vec<String>>,
        unread: BTreeMap<String, Vec<String>>,
    }
    let harness: Listed = serde_json::from_slice(&output.stdout).expect("the harness's results");
    let evaluator: BTreeMap<String, Vec<String>> =
        protocol::result_fields().into_iter().map(|(mode, fields)| (mode.to_owned(), fields)).collect();
    assert_eq!(harness.read, evaluator);
    assert_eq!(harness.unread.keys().collect::<Vec<_>>(), evaluator.keys().collect::<Vec<_>>());
    for (mode, fields) in &harness.unread {
        let read: Vec<&String> = fields.iter().filter(|field| evaluator[mode].contains(field)).collect();
        assert!(
            read.is_empty(),
            "the harness writes {read:?} of {mode} for the record only, and the evaluator reads them"
        );
    }
}
