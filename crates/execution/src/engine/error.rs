//! Failures of the engine itself, never the candidate's: answered as `VERDICT_INFRA_ERROR` (in the evaluator's
//! `Evaluator::evaluate` and the profiler's `profile`, each the one place that turns them into its response) and
//! counted by cause.

use std::time::Duration;

use crate::devices::Unavailable;
use crate::stage::StageError;

/// Why a run could not be completed by the engine.
#[derive(Debug, thiserror::Error)]
pub enum InfraError {
    /// A scratch directory, or a file the evaluation writes into one.
    #[error("{what}: {source}")]
    Files { what: String, source: std::io::Error },
    /// A cache's lock, pin, directory or entry (`what` names the cache and the operation).
    #[error("{what}: {source}")]
    Cache { what: &'static str, source: std::io::Error },
    /// A cache entry went between being found and being pinned (`what` names it).
    #[error("the {what} was evicted before use; retry")]
    Evicted { what: &'static str },
    /// A cached baseline that does not read.
    #[error("{0}")]
    UnreadableBaseline(String),
    /// A stage's process could not run, or its harness speaks another protocol version.
    #[error("{mode} stage: {source}")]
    Stage { mode: &'static str, source: StageError },
    /// A stage that runs no candidate code failed: the reference, the checker, the baseline (`what` says which).
    #[error("{what}: {error}")]
    TrustedStage { what: &'static str, error: String },
    /// No device lane can be had.
    #[error(transparent)]
    Device(#[from] Unavailable),
    /// The harness's own work, not the candidate's calls, used the candidate stage's time limit.
    #[error(
        "candidate stage: the evaluator's own work (making inputs, reading and checking outputs) used the stage's \
         time limit: {:.1} s of {:.1} s were in the candidate's calls",
        in_calls.as_secs_f64(),
        running.as_secs_f64()
    )]
    OwnTimeLimit { in_calls: Duration, running: Duration },
    #[error("cancelled")]
    Cancelled,
    /// A failure after which the candidate's device was quarantined.
    #[error("{source}\n[the device was quarantined after this: {reason}]")]
    Quarantined { source: Box<InfraError>, reason: String },
}

impl InfraError {
    /// The cause, as a metric label.
    pub fn cause(&self) -> &'static str {
        match self {
            InfraError::Files { .. } => "files",
            InfraError::Cache { .. } => "cache",
            InfraError::Evicted { .. } => "evicted",
            InfraError::UnreadableBaseline(_) => "unreadable_baseline",
            InfraError::Stage { source: StageError::Protocol { .. }, .. } => "protocol",
            InfraError::Stage { source: StageError::Sandbox(_), .. } => "stage",
            InfraError::TrustedStage { .. } => "trusted_stage",
            InfraError::Device(_) => "device",
            InfraError::OwnTimeLimit { .. } => "own_time_limit",
            InfraError::Cancelled => "cancelled",
            InfraError::Quarantined { source, .. } => source.cause(),
        }
    }

    /// Whether another try may succeed: not where the harness's own work does not fit the time limit (it would
    /// again), nor where the harness speaks another protocol version.
    pub fn retryable(&self) -> bool {
        match self {
            InfraError::OwnTimeLimit { .. } | InfraError::Stage { source: StageError::Protocol { .. }, .. } => false,
            InfraError::Quarantined { source, .. } => source.retryable(),
            InfraError::Files { .. }
            | InfraError::Cache { .. }
            | InfraError::Evicted { .. }
            | InfraError::UnreadableBaseline(_)
            | InfraError::Stage { .. }
            | InfraError::TrustedStage { .. }
            | InfraError::Device(_)
            | InfraError::Cancelled => true,
        }
    }

    /// A stage's failure to run, in `mode`.
    pub fn stage(mode: crate::protocol::Mode) -> impl FnOnce(StageError) -> Self {
        move |source| InfraError::Stage { mode: mode.name(), source }
    }

    /// A file operation's failure, `what` naming it.
    pub fn files(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| InfraError::Files { what, source }
    }

    /// A cache operation's failure, `what` naming the cache and the operation.
    pub fn cache(what: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| InfraError::Cache { what, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_and_retries_follow_the_variant() {
        let protocol =
            InfraError::Stage { mode: "check", source: StageError::Protocol { mode: "check", harness: Some(2) } };
        assert_eq!((protocol.cause(), protocol.retryable()), ("protocol", false));
        let own = InfraError::OwnTimeLimit { in_calls: Duration::from_secs(1), running: Duration::from_secs(10) };
        assert_eq!((own.cause(), own.retryable()), ("own_time_limit", false));
        assert!(own.to_string().contains("1.0 s of 10.0 s were in the candidate's calls"), "{own}");
        let quarantined =
            InfraError::Quarantined { source: Box::new(InfraError::Cancelled), reason: "probe failed".into() };
        assert_eq!((quarantined.cause(), quarantined.retryable()), ("cancelled", true));
        assert_eq!(quarantined.to_string(), "cancelled\n[the device was quarantined after this: probe failed]");
        let files = InfraError::files("writing task.py")(std::io::Error::other("disk full"));
        assert_eq!((files.to_string().as_str(), files.cause()), ("writing task.py: disk full", "files"));
    }
}
