//! Scores of evaluated kernels: the Kevin score and the Dr. Kernel reward.

use crate::{InvalidInput, Outcome, Verdict, finite, non_empty};

/// Which baseline the speedup is measured against.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Baseline {
    #[default]
    Eager,
    Compile,
}

/// A scoring formula with its weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Formula {
    /// Kevin: `S = w_c * 1[correct] + 1[correct] * speedup`.
    Kevin { correctness_weight: f64 },
    /// Dr. Kernel: `R = w_c * C + w_s * C * min(speedup, cap) + w_p * C * PR`, with `C = 1[correct]`.
    DrKernel { correctness_weight: f64, speedup_weight: f64, profiling_weight: f64, speedup_cap: f64 },
}

impl Formula {
    /// Kevin with its published weight, w_c = 0.3.
    pub const KEVIN: Self = Self::Kevin { correctness_weight: 0.3 };
    /// Dr. Kernel with weights 1, 1, 1 and cap 3.
    pub const DRKERNEL: Self =
        Self::DrKernel { correctness_weight: 1.0, speedup_weight: 1.0, profiling_weight: 1.0, speedup_cap: 3.0 };
}

/// Everything that parameterises scoring.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreParams {
    pub formula: Formula,
    pub baseline: Baseline,
    /// Score of a hack; 0 by default.
    pub hack_penalty: f64,
}

/// The score of one outcome.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score {
    /// `None` for an infrastructure error: the evaluator failed, so there is nothing to score (retry it instead).
    pub score: Option<f64>,
    /// Whether the outcome was a hack and scored the penalty.
    pub hack: bool,
    /// The speedup used (after deriving it from times); 0 for non-correct outcomes and when it is missing.
    pub speedup: f64,
    /// A correct outcome without a speedup against the chosen baseline (torch.compile failed on the task, or the
    /// kernel was not timed): it scores without its speedup term.
    pub speedup_missing: bool,
}

/// Scores each outcome. Non-correct outcomes score 0, hacks score `hack_penalty`, infrastructure errors get no
/// score. A correct outcome's speedup against `params.baseline` is given directly or derived as baseline median /
/// candidate median; when neither is possible its speedup term is 0 and `speedup_missing` says so. The baseline is
/// a property of the task, so every correct candidate of a task loses the same term: a group still ranks them by
/// correctness (and PR), and no speed is invented for a kernel nobody could compare.
pub fn score_kernels(params: &ScoreParams, outcomes: &[Outcome]) -> Result<Vec<Score>, InvalidInput> {
    validate_params(params)?;
    non_empty("outcomes", outcomes)?;
    outcomes.iter().enumerate().map(|(i, outcome)| score_one(params, outcome, &format!("outcomes[{i}]"))).collect()
}

fn validate_params(params: &ScoreParams) -> Result<(), InvalidInput> {
    finite(|| "hack_penalty".into(), params.hack_penalty)?;
    match params.formula {
        Formula::Kevin { correctness_weight } => {
            finite(|| "kevin.correctness_weight".into(), correctness_weight)?;
        }
        Formula::DrKernel { correctness_weight, speedup_weight, profiling_weight, speedup_cap } => {
            finite(|| "drkernel.correctness_weight".into(), correctness_weight)?;
            finite(|| "drkernel.speedup_weight".into(), speedup_weight)?;
            finite(|| "drkernel.profiling_weight".into(), profiling_weight)?;
            crate::positive(|| "drkernel.speedup_cap".into(), speedup_cap)?;
        }
    }
    Ok(())
}

fn score_one(params: &ScoreParams, outcome: &Outcome, path: &str) -> Result<Score, InvalidInput> {
    outcome.validate(path)?;
    let unscored = |score| Score { score, hack: false, speedup: 0.0, speedup_missing: false };
    if outcome.verdict == Verdict::InfraError {
        return Ok(unscored(None));
    }
    if outcome.is_hack() {
        return Ok(Score { hack: true, ..unscored(Some(params.hack_penalty)) });
    }
    if !outcome.is_correct() {
        return Ok(unscored(Some(0.0)));
    }
    let found = speedup(outcome, params.baseline, path)?;
    let speedup = found.unwrap_or(0.0);
    let score = match params.formula {
        Formula::Kevin { correctness_weight } => correctness_weight + speedup,
        Formula::DrKernel { correctness_weight, speedup_weight, profiling_weight, speedup_cap } => {
            let profiling = if profiling_weight == 0.0 {
                0.0
            } else {
                let pr = outcome.profiling_ratio.ok_or_else(|| {
                    InvalidInput::new(format!("{path}.profiling_ratio"), "required by drkernel for a correct outcome")
                })?;
                profiling_weight * pr
            };
            correctness_weight + speedup_weight * speedup.min(speedup_cap) + profiling
        }
    };
    Ok(Score { score: Some(score), hack: false, speedup, speedup_missing: found.is_none() })
}

/// The outcome's speedup against `baseline`: the given one, or baseline median / candidate median; `None` when
/// neither is there.
fn speedup(outcome: &Outcome, baseline: Baseline, path: &str) -> Result<Option<f64>, InvalidInput> {
    let (given, baseline_ms) = match baseline {
        Baseline::Eager => (outcome.speedup_eager, outcome.eager_median_ms),
        Baseline::Compile => (outcome.speedup_compile, outcome.compile_median_ms),
    };
    if given.is_some() {
        return Ok(given);
    }
    match (baseline_ms, outcome.candidate_median_ms) {
        (Some(base), Some(candidate)) => {
            let speedup = base / candidate;
            if speedup.is_finite() {
                Ok(Some(speedup))
            } else {
                Err(InvalidInput::new(format!("{path}.candidate_median_ms"), "too small: the speedup overflows"))
            }
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn correct(speedup: f64, pr: f64) -> Outcome {
        Outcome {
            verdict: Verdict::Correct,
            speedup_eager: Some(speedup),
            profiling_ratio: Some(pr),
            ..Outcome::default()
        }
    }

    fn params(formula: Formula) -> ScoreParams {
        ScoreParams { formula, baseline: Baseline::Eager, hack_penalty: 0.0 }
    }

    fn scores(params: &ScoreParams, outcomes: &[Outcome]) -> Vec<f64> {
        score_kernels(params, outcomes).expect("valid").iter().map(|s| s.score.expect("scored")).collect()
    }

    #[test]
    fn kevin_worked_example() {
        // A correct kernel 2x faster than eager: 0.3 + 2 = 2.3; a correct one at 0.5x: 0.8; incorrect: 0.
        let outcomes =
            [correct(2.0, 0.9), correct(0.5, 0.9), Outcome { verdict: Verdict::Incorrect, ..Outcome::default() }];
        assert_eq!(scores(&params(Formula::KEVIN), &outcomes), vec![2.3, 0.8, 0.0]);
    }

    #[test]
    fn drkernel_worked_example_caps_the_speedup() {
        // 1 + min(5, 3) + 0.8 = 4.8; 1 + 1.5 + 0.25 = 2.75.
        let outcomes = [correct(5.0, 0.8), correct(1.5, 0.25)];
        assert_eq!(scores(&params(Formula::DRKERNEL), &outcomes), vec![4.8, 2.75]);
    }

    #[test]
    fn kernelgym_weights_are_parameters() {
        let half =
            Formula::DrKernel { correctness_weight: 0.5, speedup_weight: 0.5, profiling_weight: 0.5, speedup_cap: 3.0 };
        assert_eq!(scores(&params(half), &[correct(2.0, 0.5)]), vec![0.5 + 1.0 + 0.25]);
    }

    #[test]
    fn hacks_score_the_penalty_and_non_correct_score_zero() {
        let p = ScoreParams { hack_penalty: -1.0, ..params(Formula::KEVIN) };
        let hack = Outcome { verdict: Verdict::Hack, ..Outcome::default() };
        let static_hack = Outcome { verdict: Verdict::Rejected, hack_finding: true, ..Outcome::default() };
        let policy_reject = Outcome { verdict: Verdict::Rejected, ..Outcome::default() };
        let infra = Outcome { verdict: Verdict::InfraError, ..Outcome::default() };
        let result = score_kernels(&p, &[hack, static_hack, policy_reject, infra]).expect("valid");
        let got: Vec<(Option<f64>, bool)> = result.iter().map(|s| (s.score, s.hack)).collect();
        assert_eq!(got, vec![(Some(-1.0), true), (Some(-1.0), true), (Some(0.0), false), (None, false)]);
    }

    #[test]
    fn a_missing_baseline_drops_only_the_speedup_term() {
        // torch.compile failed on the task: no compile speedup and no compile time.
        let outcome = Outcome { speedup_compile: None, compile_median_ms: None, ..correct(2.0, 0.5) };
        let compile = ScoreParams { baseline: Baseline::Compile, ..params(Formula::DRKERNEL) };
        let got = score_kernels(&compile, &[outcome.clone(), correct(2.0, 0.5)]).expect("valid");
        assert_eq!((got[0].score, got[0].speedup, got[0].speedup_missing), (Some(1.0 + 0.5), 0.0, true));
        assert!(got[1].speedup_missing, "the second lacks the compile baseline too");
        let kevin = ScoreParams { baseline: Baseline::Compile, ..params(Formula::KEVIN) };
        assert_eq!(score_kernels(&kevin, std::slice::from_ref(&outcome)).expect("valid")[0].score, Some(0.3));
        // Against eager the same outcome has its speedup.
        let eager = score_kernels(&params(Formula::KEVIN), &[outcome]).expect("valid");
        assert_eq!((eager[0].score, eager[0].speedup_missing), (Some(2.3), false));
    }

    #[test]
    fn speedup_is_derived_from_times_for_the_chosen_baseline() {
        let outcome = Outcome {
            verdict: Verdict::Correct,
            candidate_median_ms: Some(2.0),
            eager_median_ms: Some(3.0),
            compile_median_ms: Some(1.0),
            ..Outcome::default()
        };
        let eager = ScoreParams { baseline: Baseline::Eager, ..params(Formula::KEVIN) };
        let compile = ScoreParams { baseline: Baseline::Compile, ..params(Formula::KEVIN) };
        assert_eq!(score_kernels(&eager, std::slice::from_ref(&outcome)).expect("valid")[0].speedup, 1.5);
        assert_eq!(score_kernels(&compile, &[outcome]).expect("valid")[0].speedup, 0.5);
    }

    #[test]
    fn bad_numbers_name_their_field() {
        let cases = [
            (Outcome { speedup_eager: Some(f64::NAN), ..correct(1.0, 0.5) }, "outcomes[1].speedup_eager"),
            (Outcome { speedup_eager: Some(f64::INFINITY), ..correct(1.0, 0.5) }, "outcomes[1].speedup_eager"),
            (Outcome { candidate_median_ms: Some(-1.0), ..correct(1.0, 0.5) }, "outcomes[1].candidate_median_ms"),
            (Outcome { profiling_ratio: Some(1.5), ..correct(1.0, 0.5) }, "outcomes[1].profiling_ratio"),
            (
                Outcome { verdict: Verdict::Incorrect, speedup_eager: Some(f64::NAN), ..Outcome::default() },
                "outcomes[1].speedup_eager",
            ),
            (Outcome { profiling_ratio: None, ..correct(1.0, 0.5) }, "outcomes[1].profiling_ratio"),
        ];
        for (bad, field) in cases {
            let err = score_kernels(&params(Formula::DRKERNEL), &[correct(1.0, 0.5), bad]).expect_err(field);
            assert_eq!(err.field, field);
        }
        let err = score_kernels(&params(Formula::KEVIN), &[]).expect_err("empty");
        assert_eq!(err.field, "outcomes");
        let zero_cap =
            Formula::DrKernel { correctness_weight: 1.0, speedup_weight: 1.0, profiling_weight: 1.0, speedup_cap: 0.0 };
        let err = score_kernels(&params(zero_cap), &[correct(1.0, 0.5)]).expect_err("zero cap");
        assert_eq!(err.field, "drkernel.speedup_cap");
    }
}
