//! `kforge doctor` as a user runs it: the real binary on this machine (the repository's venv, no GPU needed), its
//! JSON and its text, a port another process holds, and an interpreter that cannot run candidates (exit status 1,
//! the fix named).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn python() -> PathBuf {
    kforge_test_support::python::required(&[])
}

/// `kforge doctor ARGS` with the repository's venv, a work directory of the tests' own, and `env` on top.
fn doctor(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kforge"));
    command
        .arg("doctor")
        .args(args)
        .env("KFORGE__EVALUATOR__PYTHON", python())
        .env("KFORGE__EVALUATOR__WORK_DIR", Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-doctor"))
        .env("KFORGE__EVALUATOR__BINDINGS_PCH", "false");
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().expect("kforge runs")
}

fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no check {name}: {report:#}"))
}

#[test]
fn on_this_machine_the_evaluator_runs_and_every_check_says_what_it_saw() {
    let held = TcpListener::bind("127.0.0.1:0").expect("a port to hold");
    let held_address = held.local_addr().expect("address").to_string();
    let output = doctor(&["--json"], &[("KFORGE__REWARD__SERVER__LISTEN", &held_address)]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&output.stdout).expect("JSON on stdout");
    assert_eq!(report["evaluator_can_run"], true, "{report:#}");

    let evaluator = check(&report, "evaluator");
    assert_eq!(evaluator["state"], "ok", "{evaluator}");
    let detail = evaluator["detail"].as_str().expect("detail");
    assert!(detail.starts_with("backends cpu"), "{detail}");
    assert!(detail.contains(".venv/bin/python"), "the interpreter is named: {detail}");
    assert!(check(&report, "versions")["detail"].as_str().is_some_and(|v| v.contains("torch ")), "{report:#}");
    for check in report["checks"].as_array().expect("checks") {
        let state = check["state"].as_str().expect("state");
        assert!(["ok", "warn", "off", "fail"].contains(&state), "{check}");
        assert!(check["detail"].as_str().is_some_and(|d| !d.is_empty()), "{check}");
        if state != "ok" {
            assert!(check["fix"].as_str().is_some() || state == "off", "a warning names its fix: {check}");
        }
    }
    // What the sandbox enforces is reported protection by protection, as the evaluator found it.
    assert!(check(&report, "sandbox landlock")["detail"].as_str().is_some());
    assert!(check(&report, "disk")["detail"].as_str().is_some_and(|d| d.contains("cli-doctor")), "{report:#}");
    // The held port is named, with the key that moves the service off it.
    let reward = check(&report, "port reward");
    assert_eq!(reward["state"], "warn", "{reward}");
    assert!(reward["detail"].as_str().is_some_and(|d| d.starts_with(&held_address)), "{reward}");
    assert!(reward["fix"].as_str().is_some_and(|f| f.contains("[reward.server].listen")), "{reward}");
    drop(held);

    // The text says the same, one line per check and the verdict last.
    let text = doctor(&[], &[]);
    assert!(text.status.success(), "{}", String::from_utf8_lossy(&text.stderr));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.lines().any(|line| line.starts_with("ok    evaluator ")), "{text}");
    assert!(text.trim_end().ends_with("The evaluator can run candidates here."), "{text}");
}

#[test]
fn an_interpreter_that_cannot_run_candidates_fails_with_status_1_and_names_the_fix() {
    let output = doctor(&[], &[("KFORGE__EVALUATOR__PYTHON", "/nonexistent/python3")]);
    assert_eq!(output.status.code(), Some(1), "{}", String::from_utf8_lossy(&output.stderr));
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().find(|line| line.starts_with("FAIL  evaluator")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("/nonexistent/python3"), "the reason names the interpreter: {line}");
    assert!(text.contains("fix: run scripts/setup.sh"), "{text}");
    assert!(text.contains("The evaluator cannot run candidates here"), "{text}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("kforge: the evaluator cannot run candidates here"), "{stderr}");
}
