//! The evaluation outcome as the reward functions see it.

use crate::{InvalidInput, positive, within};

/// The evaluator's verdict (the wire enum without its unspecified value).
/// The default (`Incorrect`) exists for struct-update syntax; it scores like every non-correct verdict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Verdict {
    Correct,
    #[default]
    Incorrect,
    CompileError,
    RuntimeError,
    Timeout,
    Rejected,
    Hack,
    InfraError,
}

/// One evaluated candidate.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Outcome {
    pub sample_id: String,
    pub verdict: Verdict,
    /// Whether any finding is in the hack category.
    pub hack_finding: bool,
    pub speedup_eager: Option<f64>,
    pub speedup_compile: Option<f64>,
    pub candidate_median_ms: Option<f64>,
    pub eager_median_ms: Option<f64>,
    pub compile_median_ms: Option<f64>,
    pub profiling_ratio: Option<f64>,
}

impl Outcome {
    /// A hack: `VERDICT_HACK`, or a static rejection with a hack-category finding.
    pub fn is_hack(&self) -> bool {
        self.verdict == Verdict::Hack || (self.verdict == Verdict::Rejected && self.hack_finding)
    }

    pub fn is_correct(&self) -> bool {
        self.verdict == Verdict::Correct
    }

    /// Checks every number present, whatever the verdict: a NaN is a caller bug even on a failed sample.
    pub(crate) fn validate(&self, path: &str) -> Result<(), InvalidInput> {
        let field = |name: &str| format!("{path}.{name}");
        let checks = [
            ("speedup_eager", self.speedup_eager),
            ("speedup_compile", self.speedup_compile),
            ("candidate_median_ms", self.candidate_median_ms),
            ("eager_median_ms", self.eager_median_ms),
            ("compile_median_ms", self.compile_median_ms),
        ];
        for (name, value) in checks {
            if let Some(v) = value {
                positive(|| field(name), v)?;
            }
        }
        if let Some(pr) = self.profiling_ratio {
            within(|| field("profiling_ratio"), pr, 0.0, 1.0)?;
        }
        Ok(())
    }
}
