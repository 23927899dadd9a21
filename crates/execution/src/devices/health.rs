//! Device health: telling a device fault from a fault of the candidate's host code ([`fault`]), and the probe that
//! decides whether a device that faulted can go on serving.
//!
//! After a CUDA-level fault on a GPU (an illegal address, a launch failure, a kernel killed at its time limit, a
//! crash) the device is probed before anything else runs on it: `kforge-device-probe` (this crate's binary,
//! `src/bin/kforge-device-probe.rs`), a short-lived process that creates a context, runs a tiny kernel and checks
//! its result, under a timeout. What a failed probe does to the
//! device's lane (quarantine, and probes again until it passes) is the lanes' part (`super::lanes`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use kforge_sandbox::Exit;

use crate::config::DeviceProbeConfig;

/// The probe's name, looked up next to the running executable and then on PATH.
pub const PROBE_PROGRAM: &str = "kforge-device-probe";

/// Why a stage's end looks like a device fault rather than a fault of the candidate's host code; `None` when it
/// does not (an exception, a wrong shape, an out-of-memory error leave the device usable).
pub fn fault(exit: Exit, error_text: &str) -> Option<String> {
    const SIGNATURES: &[&str] = &[
        "illegal memory access",
        "illegal address",
        "illegal instruction",
        "misaligned address",
        "unspecified launch failure",
        "launch timed out",
        "device-side assert",
        "hardware stack error",
        "invalid program counter",
        "uncorrectable ecc",
        "ecc error",
        "fallen off the bus",
        "cuda error: unknown error",
        "cuda_error_",
        "cudaerror",
    ];
    match exit {
        Exit::Cancelled => None,
        Exit::TimedOut => Some("a stage ran past its time limit and was killed".into()),
        Exit::Signal(signal) => Some(format!("a stage was killed by signal {signal}")),
        Exit::Code(_) => {
            let text = error_text.to_lowercase();
            SIGNATURES.iter().find(|s| text.contains(*s)).map(|s| format!("a stage failed with a CUDA fault ({s})"))
        }
    }
}

/// There is no probe program to run: GPU faults are not followed by a health probe.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{PROBE_PROGRAM} is neither next to this executable nor on PATH")]
pub struct ProbeMissing;

/// Why a device failed its health probe.
#[derive(Debug, thiserror::Error)]
pub enum ProbeFailed {
    #[error("the probe did not finish within {secs} s")]
    TimedOut { secs: u64 },
    #[error("could not run {}: {source}", program.display())]
    Spawn { program: PathBuf, source: std::io::Error },
    /// The probe's own error, or its exit status and stderr where it gave none.
    #[error("{0}")]
    Failed(String),
}

/// The health probe of this engine's GPUs: its program, or why there is none, and how long it may take.
#[derive(Debug)]
pub(super) struct Probe {
    program: Result<PathBuf, ProbeMissing>,
    timeout_secs: u64,
}

impl Probe {
    pub(super) fn new(config: &DeviceProbeConfig) -> Self {
        let program = match &config.command {
            Some(command) => Ok(command.clone()),
            None => find_probe(),
        };
        Self { program, timeout_secs: config.timeout_secs }
    }

    /// The probe program, or why there is none.
    pub(super) fn program(&self) -> Result<&Path, &ProbeMissing> {
        self.program.as_deref()
    }

    /// Runs the probe on `gpu` in its own process, killed at the timeout.
    pub(super) async fn run(&self, program: &Path, gpu: usize) -> Result<(), ProbeFailed> {
        let mut command = tokio::process::Command::new(program);
        command
            .args(["--ordinal", "0"])
            .env_clear()
            .env("CUDA_VISIBLE_DEVICES", gpu.to_string())
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let timeout = Duration::from_secs(self.timeout_secs);
        match tokio::time::timeout(timeout, command.output()).await {
            Err(_) => Err(ProbeFailed::TimedOut { secs: self.timeout_secs }),
            Ok(Err(source)) => Err(ProbeFailed::Spawn { program: program.to_owned(), source }),
            Ok(Ok(output)) if output.status.success() => Ok(()),
            Ok(Ok(output)) => {
                let report: Option<serde_json::Value> = serde_json::from_slice(&output.stdout).ok();
                let error = report.as_ref().and_then(|r| r.get("error")).and_then(|e| e.as_str()).map(str::to_owned);
                Err(ProbeFailed::Failed(error.unwrap_or_else(|| {
                    format!("{} ({})", output.status, String::from_utf8_lossy(&output.stderr).trim())
                })))
            }
        }
    }
}

/// `kforge-device-probe` next to the running executable, else on PATH.
fn find_probe() -> Result<PathBuf, ProbeMissing> {
    let beside = std::env::current_exe().ok().and_then(|exe| Some(exe.parent()?.join(PROBE_PROGRAM)));
    beside
        .filter(|p| p.is_file())
        .or_else(|| kforge_sandbox::resolve_on_path(Path::new(PROBE_PROGRAM)))
        .ok_or(ProbeMissing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_faults_are_told_from_candidate_errors() {
        assert!(fault(Exit::TimedOut, "").is_some());
        assert!(fault(Exit::Signal(11), "").is_some());
        assert!(fault(Exit::Code(1), "RuntimeError: CUDA error: an illegal memory access was encountered").is_some());
        assert!(fault(Exit::Code(1), "triton: CUDA_ERROR_LAUNCH_FAILED").is_some());
        assert!(fault(Exit::Code(1), "torch.OutOfMemoryError: CUDA out of memory.").is_none());
        assert!(fault(Exit::Code(1), "ValueError: shapes do not match").is_none());
        assert!(fault(Exit::Cancelled, "illegal memory access").is_none());
    }

    #[tokio::test]
    async fn a_probe_s_own_error_is_its_reason_and_a_passing_probe_passes() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("kforge-devices-{}-probe", std::process::id()));
        std::fs::create_dir_all(&dir).expect("test dir");
        let script = |name: &str, text: &str| {
            let script = dir.join(name);
            std::fs::write(&script, text).expect("script");
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
            script
        };
        let probe = |command: PathBuf| {
            Probe::new(&DeviceProbeConfig { command: Some(command), timeout_secs: 1, retry_secs: 3600 })
        };
        let reports = probe(script("report.sh", "#!/bin/sh\necho '{\"ok\":false,\"error\":\"no context\"}'; exit 1\n"));
        let failed = reports.run(reports.program().expect("named"), 0).await.expect_err("a failing probe fails");
        assert_eq!(failed.to_string(), "no context");
        let passes = probe(script("pass.sh", "#!/bin/sh\necho '{\"ok\":true}'\n"));
        passes.run(passes.program().expect("named"), 0).await.expect("a passing probe passes");
    }
}
