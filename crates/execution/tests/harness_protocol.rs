//! The evaluator and its harness refuse each other across protocol versions, and list the same spec fields.
//! Against the real harness file (and copies of it that claim another version), with the Python environment of
//! `scripts/setup.sh --test`.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kforge_execution::protocol::{self, CompileSpec, PROTOCOL_VERSION, REFUSED_EXIT};
use kforge_execution::python::PythonEnv;
use kforge_execution::stage::{self, Request, Stage, StageError};
use kforge_sandbox::Sandbox;
use tokio_util::sync::CancellationToken;

const HARNESS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/harness/kforge_harness.py");

/// A fresh directory for `name`.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("harness-protocol-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch");
    dir
}

/// A copy of the harness in `dir` with `edit` applied (`from` must occur in it).
fn harness_copy(dir: &Path, from: &str, to: &str) -> PathBuf {
    let source = std::fs::read_to_string(HARNESS).expect("harness");
    assert_eq!(source.matches(from).count(), 1, "the harness has `{from}` once");
    let path = dir.join("kforge_harness.py");
    std::fs::write(&path, source.replace(from, to)).expect("harness copy");
    let nvcc = Path::new(HARNESS).with_file_name("kforge_nvcc.py");
    std::fs::copy(nvcc, dir.join("kforge_nvcc.py")).expect("kforge_nvcc.py beside it");
    path
}

/// Runs a compile stage of a trivial candidate with `harness`.
async fn compile_with(harness: &Path, dir: &Path) -> Result<String, StageError> {
    let python = support::python().expect("checked by the caller");
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
    if support::python().is_none() {
        return;
    }
    let dir = scratch("same");
    assert_eq!(compile_with(Path::new(HARNESS), &dir).await.expect("same version"), "compiled");
}

#[tokio::test]
async fn the_evaluator_refuses_a_harness_that_answers_in_another_version() {
    if support::python().is_none() {
        return;
    }
    let dir = scratch("answers-other");
    // A harness that reads this evaluator's requests but answers in the next version.
    let other = PROTOCOL_VERSION + 1;
    let harness =
        harness_copy(&dir, "result[\"protocol\"] = PROTOCOL_VERSION", &format!("result[\"protocol\"] = {other}"));
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
    if support::python().is_none() {
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
    let python = support::python().expect("checked above");
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
    let Some(python) = support::python() else { return };
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
    let Some(python) = support::python() else { return };
    let output = Command::new(python).arg(HARNESS).arg("--specs").output().expect("harness runs");
    assert!(output.status.success(), "{output:?}");
    let harness: std::collections::BTreeMap<String, Vec<String>> =
        serde_json::from_slice(&output.stdout).expect("the harness's specs");
    let evaluator: std::collections::BTreeMap<String, Vec<String>> =
        protocol::spec_fields().into_iter().map(|(mode, fields)| (mode.to_owned(), fields)).collect();
    assert_eq!(harness, evaluator);
}
