//! kforge's reward math: pure, deterministic functions from evaluation outcomes to training signals, and the job
//! metrics computed from a job's recorded turns.
//!
//! The Reward service exposes these over gRPC and the orchestrator calls them in-process; both see the same
//! results. Every function validates its whole input first and returns [`InvalidInput`] naming the offending field
//! with the path the wire contract uses (`groups[3].trajectories[1].values[0]`), so a NaN can never leak into a
//! gradient. The formulas are stated on each function and in `docs/REWARDS.md`.

mod advantages;
mod diagnose;
mod metrics;
mod outcome;
mod rejection;
mod returns;
mod score;

pub use advantages::{Estimator, compute_advantages};
pub use diagnose::{
    DEFAULT_OPENING, DEFAULT_REPETITION_THRESHOLD, DiagnoseParams, Diagnosis, ResponseFlags, ResponseInput, diagnose,
    repetition_ratio,
};
pub use metrics::{
    AtK, AtKValue, Cost, DEFAULT_FAST_P, DEFAULT_QUANTILES, FastP, JobMetrics, MetricsParams, Rates, Ratio,
    ResponseSample, SpeedupStats, Spend, TurnSample, Usage, expected_best_of, job_metrics, quantile,
};
pub use outcome::{Outcome, Verdict};
pub use rejection::{Decision, MrsParams, PrsParams, TokenLogprobs, mrs, prs, uniform_draw};
pub use returns::{ReturnMethod, compute_returns};
pub use score::{Baseline, Formula, Score, ScoreParams, score_kernels};

/// A request field that violates its contract. Displays as `path: reason`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidInput {
    /// Path of the field, e.g. `outcomes[2].profiling_ratio`.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl InvalidInput {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self { field: field.into(), reason: reason.into() }
    }
}

/// Requires a finite value.
pub(crate) fn finite(field: impl FnOnce() -> String, value: f64) -> Result<f64, InvalidInput> {
    if value.is_finite() { Ok(value) } else { Err(InvalidInput::new(field(), format!("must be finite, got {value}"))) }
}

/// Requires a finite value > 0.
pub(crate) fn positive(field: impl FnOnce() -> String, value: f64) -> Result<f64, InvalidInput> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(InvalidInput::new(field(), format!("must be finite and > 0, got {value}")))
    }
}

/// Requires a finite value in `[lo, hi]`.
pub(crate) fn within(field: impl FnOnce() -> String, value: f64, lo: f64, hi: f64) -> Result<f64, InvalidInput> {
    if value.is_finite() && (lo..=hi).contains(&value) {
        Ok(value)
    } else {
        Err(InvalidInput::new(field(), format!("must be in [{lo}, {hi}], got {value}")))
    }
}

/// Requires a non-empty list.
pub(crate) fn non_empty<T>(field: &str, items: &[T]) -> Result<(), InvalidInput> {
    if items.is_empty() { Err(InvalidInput::new(field, "must not be empty")) } else { Ok(()) }
}
