//! Rejection sampling: profiling-based (PRS) and mismatch (MRS).

use crate::{InvalidInput, Outcome, Verdict, finite, non_empty, positive};

/// PRS: a correct sample is kept with probability `clip((PR - tau) / scale, 0, 1)`; an infrastructure error is
/// always dropped (it has no score to train on); others are always kept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrsParams {
    pub tau: f64,
    pub scale: f64,
    /// Decisions are a pure function of (seed, sample id).
    pub seed: u64,
}

impl Default for PrsParams {
    fn default() -> Self {
        Self { tau: 0.3, scale: 0.1, seed: 0 }
    }
}

/// MRS: keep a trajectory iff `lower <= w <= upper`, `w = exp(mean(logp_train - logp_rollout))`, and no token has
/// `exp(logp_train - logp_rollout) < veto`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MrsParams {
    pub lower: f64,
    pub upper: f64,
    pub veto: f64,
}

impl Default for MrsParams {
    fn default() -> Self {
        Self { lower: 0.999, upper: 1.001, veto: 1e-4 }
    }
}

/// One trajectory's per-token log-probabilities under the rollout and training engines.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenLogprobs {
    pub trajectory_id: String,
    pub rollout: Vec<f64>,
    pub train: Vec<f64>,
}

/// A keep/drop decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub id: String,
    pub keep: bool,
    pub keep_probability: f64,
    /// MRS only.
    pub importance_weight: f64,
    /// MRS only.
    pub min_token_ratio: f64,
    /// Why it was dropped; empty when kept.
    pub reason: String,
}

/// The uniform draw in [0, 1) behind a PRS decision: SplitMix64 of `seed XOR FNV-1a-64(id)`, top 53 bits.
/// A sample is kept iff `uniform_draw(seed, id) < keep_probability`, so probability 0 always drops and 1 always keeps.
pub fn uniform_draw(seed: u64, id: &str) -> f64 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let hash = id.bytes().fold(FNV_OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME));
    let mut z = (seed ^ hash).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Profiling-based rejection sampling over evaluated outcomes.
pub fn prs(params: &PrsParams, outcomes: &[Outcome]) -> Result<Vec<Decision>, InvalidInput> {
    finite(|| "prs.tau".into(), params.tau)?;
    positive(|| "prs.scale".into(), params.scale)?;
    non_empty("outcomes", outcomes)?;
    outcomes
        .iter()
        .enumerate()
        .map(|(i, outcome)| {
            let path = format!("outcomes[{i}]");
            outcome.validate(&path)?;
            if outcome.verdict == Verdict::InfraError {
                return Ok(Decision {
                    id: outcome.sample_id.clone(),
                    keep: false,
                    keep_probability: 0.0,
                    importance_weight: 0.0,
                    min_token_ratio: 0.0,
                    reason: "infrastructure error: not scored, so not a training sample".into(),
                });
            }
            let keep_probability = if outcome.is_correct() {
                let pr = outcome.profiling_ratio.ok_or_else(|| {
                    InvalidInput::new(format!("{path}.profiling_ratio"), "required by prs for a correct outcome")
                })?;
                ((pr - params.tau) / params.scale).clamp(0.0, 1.0)
            } else {
                1.0
            };
            let keep = uniform_draw(params.seed, &outcome.sample_id) < keep_probability;
            let reason = if keep {
                String::new()
            } else {
                format!("profiling ratio gives keep probability {keep_probability:.3}")
            };
            Ok(Decision {
                id: outcome.sample_id.clone(),
                keep,
                keep_probability,
                importance_weight: 0.0,
                min_token_ratio: 0.0,
                reason,
            })
        })
        .collect()
}

/// Mismatch rejection sampling over per-trajectory token log-probabilities.
pub fn mrs(params: &MrsParams, trajectories: &[TokenLogprobs]) -> Result<Vec<Decision>, InvalidInput> {
    let lower = positive(|| "mrs.lower".into(), params.lower)?;
    let upper = positive(|| "mrs.upper".into(), params.upper)?;
    if lower > upper {
        return Err(InvalidInput::new("mrs.lower", format!("must be <= upper ({upper}), got {lower}")));
    }
    let veto = finite(|| "mrs.veto".into(), params.veto)?;
    if veto < 0.0 {
        return Err(InvalidInput::new("mrs.veto", format!("must be >= 0, got {veto}")));
    }
    non_empty("trajectories", trajectories)?;
    trajectories
        .iter()
        .enumerate()
        .map(|(t, trajectory)| {
            let path = format!("trajectories[{t}]");
            non_empty(&format!("{path}.rollout_logprobs"), &trajectory.rollout)?;
            if trajectory.train.len() != trajectory.rollout.len() {
                return Err(InvalidInput::new(
                    format!("{path}.train_logprobs"),
                    format!(
                        "has {} tokens but rollout_logprobs has {}",
                        trajectory.train.len(),
                        trajectory.rollout.len()
                    ),
                ));
            }
            let mut sum = 0.0;
            let mut min_log_ratio = f64::INFINITY;
            for (i, (&rollout, &train)) in trajectory.rollout.iter().zip(&trajectory.train).enumerate() {
                finite(|| format!("{path}.rollout_logprobs[{i}]"), rollout)?;
                finite(|| format!("{path}.train_logprobs[{i}]"), train)?;
                let log_ratio = train - rollout;
                sum += log_ratio;
                min_log_ratio = min_log_ratio.min(log_ratio);
            }
            let importance_weight = (sum / trajectory.rollout.len() as f64).exp();
            let min_token_ratio = min_log_ratio.exp();
            let reason = if !(lower..=upper).contains(&importance_weight) {
                format!("importance weight {importance_weight:.6} outside [{lower}, {upper}]")
            } else if min_token_ratio < veto {
                format!("token ratio {min_token_ratio:.3e} below veto {veto:e}")
            } else {
                String::new()
            };
            let keep = reason.is_empty();
            Ok(Decision {
                id: trajectory.trajectory_id.clone(),
                keep,
                keep_probability: if keep { 1.0 } else { 0.0 },
                importance_weight,
                min_token_ratio,
                reason,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn correct(id: &str, pr: f64) -> Outcome {
        Outcome { sample_id: id.into(), verdict: Verdict::Correct, profiling_ratio: Some(pr), ..Outcome::default() }
    }

    #[test]
    fn prs_keep_probability_follows_the_clip() {
        let outcomes = [
            correct("low", 0.2),
            correct("mid", 0.35),
            correct("high", 0.9),
            Outcome { sample_id: "wrong".into(), verdict: Verdict::Incorrect, ..Outcome::default() },
            Outcome { sample_id: "infra".into(), verdict: Verdict::InfraError, ..Outcome::default() },
        ];
        let decisions = prs(&PrsParams::default(), &outcomes).expect("valid");
        let probabilities: Vec<f64> = decisions.iter().map(|d| d.keep_probability).collect();
        assert!((probabilities[1] - 0.5).abs() < 1e-12);
        assert_eq!([probabilities[0], probabilities[2], probabilities[3], probabilities[4]], [0.0, 1.0, 1.0, 0.0]);
        assert!(!decisions[0].keep && decisions[2].keep && decisions[3].keep && !decisions[4].keep);
        assert!(decisions[4].reason.starts_with("infrastructure error"), "{:?}", decisions[4]);
    }

    #[test]
    fn prs_keeps_about_the_right_fraction() {
        let outcomes: Vec<Outcome> = (0..20_000).map(|i| correct(&format!("s{i}"), 0.35)).collect();
        let kept = prs(&PrsParams { seed: 7, ..PrsParams::default() }, &outcomes)
            .expect("valid")
            .iter()
            .filter(|d| d.keep)
            .count();
        // Binomial(20000, 0.5): 6 standard deviations is about 424.
        assert!((kept as i64 - 10_000).abs() < 424, "kept {kept}");
    }

    #[test]
    fn uniform_draw_is_in_range_and_depends_on_seed_and_id() {
        let a = uniform_draw(1, "x");
        assert_eq!(a, uniform_draw(1, "x"));
        assert_ne!(a, uniform_draw(2, "x"));
        assert_ne!(a, uniform_draw(1, "y"));
        assert!((0.0..1.0).contains(&a));
    }

    #[test]
    fn mrs_worked_example() {
        let same = TokenLogprobs { trajectory_id: "same".into(), rollout: vec![-1.0, -2.0], train: vec![-1.0, -2.0] };
        // Mean log ratio 0.01 -> w = 1.01005 > 1.001.
        let drift =
            TokenLogprobs { trajectory_id: "drift".into(), rollout: vec![-1.0, -2.0], train: vec![-0.99, -1.99] };
        // Mean 0, but one token ratio exp(-10) = 4.5e-5 < 1e-4.
        let veto = TokenLogprobs { trajectory_id: "veto".into(), rollout: vec![-1.0, -11.0], train: vec![-11.0, -1.0] };
        let decisions = mrs(&MrsParams::default(), &[same, drift, veto]).expect("valid");
        assert!(decisions[0].keep && decisions[0].importance_weight == 1.0);
        assert!(!decisions[1].keep && decisions[1].reason.contains("importance weight"));
        assert!(!decisions[2].keep && decisions[2].reason.contains("veto"), "{:?}", decisions[2]);
    }

    #[test]
    fn mrs_rejects_mismatched_lengths_by_path() {
        let bad = TokenLogprobs { trajectory_id: "t".into(), rollout: vec![-1.0, -1.0], train: vec![-1.0] };
        let err = mrs(&MrsParams::default(), &[bad]).expect_err("ragged");
        assert_eq!(err.field, "trajectories[0].train_logprobs");
    }
}
