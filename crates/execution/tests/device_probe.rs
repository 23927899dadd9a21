//! The device health probe as the engine runs it: one JSON report on stdout and an exit code that agrees with
//! it, on any host. Without a CUDA driver (CI) it says so rather than panicking; on a GPU host it checks the device.

use std::process::Command;

#[test]
fn the_probe_reports_in_one_json_object_and_its_exit_code_agrees() {
    let output = Command::new(env!("CARGO_BIN_EXE_kforge-device-probe")).output().expect("the probe runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let ok = report["ok"].as_bool().expect("an `ok` field");
    let code = output.status.code().expect("exited, not killed");
    if ok {
        assert_eq!(code, 0);
        assert!(report["device"].as_str().is_some_and(|d| !d.is_empty()), "{report}");
        assert!(report["total_bytes"].as_u64().is_some_and(|b| b > 0), "{report}");
    } else {
        assert!(code == 1 || code == 2, "exit {code}: {report}");
        assert!(report["error"].as_str().is_some_and(|e| !e.is_empty()), "{report}");
    }
    assert!(!String::from_utf8_lossy(&output.stderr).contains("panicked"), "{output:?}");
}

#[test]
fn a_device_that_does_not_exist_fails_the_probe() {
    let output = Command::new(env!("CARGO_BIN_EXE_kforge-device-probe"))
        .args(["--ordinal", "4096"])
        .output()
        .expect("the probe runs");
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("a JSON report");
    assert_eq!(report["ok"], false, "{report}");
    assert_ne!(output.status.code(), Some(0));
}
