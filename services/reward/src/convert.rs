//! Wire <-> domain conversion for each Reward RPC. Requests are destructured field by field, so a field added to
//! the contract does not compile until it is handled here.

use kforge_proto::v1 as pb;
use kforge_reward_core::{self as core, InvalidInput};

fn verdict(value: i32, path: &str) -> Result<core::Verdict, InvalidInput> {
    let field = || format!("{path}.verdict");
    match pb::Verdict::try_from(value) {
        Ok(wire) => kforge_reward_proto::verdict(wire).ok_or_else(|| InvalidInput::new(field(), "must be specified")),
        Err(_) => Err(InvalidInput::new(field(), format!("unknown value {value}"))),
    }
}

fn outcome(outcome: pb::KernelOutcome, path: &str) -> Result<core::Outcome, InvalidInput> {
    let pb::KernelOutcome {
        sample_id,
        verdict: wire_verdict,
        findings,
        speedup_eager,
        speedup_compile,
        candidate_median_ms,
        eager_median_ms,
        compile_median_ms,
        profiling_ratio,
    } = outcome;
    Ok(core::Outcome {
        sample_id,
        verdict: verdict(wire_verdict, path)?,
        hack_finding: findings.iter().any(|f| f.category == pb::FindingCategory::Hack as i32),
        speedup_eager,
        speedup_compile,
        candidate_median_ms,
        eager_median_ms,
        compile_median_ms,
        profiling_ratio,
    })
}

fn outcomes(list: Vec<pb::KernelOutcome>, field: &str) -> Result<Vec<core::Outcome>, InvalidInput> {
    list.into_iter().enumerate().map(|(i, o)| outcome(o, &format!("{field}[{i}]"))).collect()
}

pub(crate) fn score_kernels(request: pb::ScoreKernelsRequest) -> Result<pb::ScoreKernelsResponse, InvalidInput> {
    let pb::ScoreKernelsRequest { formula, baseline, hack_penalty, outcomes: wire_outcomes } = request;
    let formula = match formula {
        Some(pb::score_kernels_request::Formula::Kevin(pb::KevinScore { correctness_weight })) => {
            core::Formula::Kevin { correctness_weight: correctness_weight.unwrap_or(0.3) }
        }
        Some(pb::score_kernels_request::Formula::Drkernel(pb::DrKernelReward {
            correctness_weight,
            speedup_weight,
            profiling_weight,
            speedup_cap,
        })) => core::Formula::DrKernel {
            correctness_weight: correctness_weight.unwrap_or(1.0),
            speedup_weight: speedup_weight.unwrap_or(1.0),
            profiling_weight: profiling_weight.unwrap_or(1.0),
            speedup_cap: speedup_cap.unwrap_or(3.0),
        },
        None => return Err(InvalidInput::new("formula", "required: set `kevin` or `drkernel`")),
    };
    let baseline = match pb::SpeedupBaseline::try_from(baseline) {
        Ok(pb::SpeedupBaseline::Unspecified | pb::SpeedupBaseline::Eager) => core::Baseline::Eager,
        Ok(pb::SpeedupBaseline::Compile) => core::Baseline::Compile,
        Err(_) => return Err(InvalidInput::new("baseline", format!("unknown value {baseline}"))),
    };
    let params = core::ScoreParams { formula, baseline, hack_penalty: hack_penalty.unwrap_or(0.0) };
    let outcomes = outcomes(wire_outcomes, "outcomes")?;
    let scores = core::score_kernels(&params, &outcomes)?;
    Ok(pb::ScoreKernelsResponse {
        scores: outcomes
            .into_iter()
            .zip(scores)
            .map(|(o, s)| pb::KernelScore {
                sample_id: o.sample_id,
                score: s.score.unwrap_or(0.0),
                hack: s.hack,
                speedup: s.speedup,
                speedup_missing: s.speedup_missing,
                unscored: s.score.is_none(),
            })
            .collect(),
    })
}

fn values(trajectories: Vec<pb::TrajectoryValues>) -> (Vec<String>, Vec<Vec<f64>>) {
    trajectories.into_iter().map(|pb::TrajectoryValues { trajectory_id, values }| (trajectory_id, values)).unzip()
}

fn with_ids(ids: Vec<String>, values: Vec<Vec<f64>>) -> Vec<pb::TrajectoryValues> {
    ids.into_iter().zip(values).map(|(trajectory_id, values)| pb::TrajectoryValues { trajectory_id, values }).collect()
}

pub(crate) fn compute_returns(request: pb::ComputeReturnsRequest) -> Result<pb::ComputeReturnsResponse, InvalidInput> {
    let pb::ComputeReturnsRequest { method, gamma, trajectories } = request;
    let method = match pb::ReturnMethod::try_from(method) {
        Ok(pb::ReturnMethod::Sum) => core::ReturnMethod::Sum,
        Ok(pb::ReturnMethod::Max) => core::ReturnMethod::Max,
        Ok(pb::ReturnMethod::Unspecified) => return Err(InvalidInput::new("method", "must be specified (sum or max)")),
        Err(_) => return Err(InvalidInput::new("method", format!("unknown value {method}"))),
    };
    let gamma = gamma.ok_or_else(|| InvalidInput::new("gamma", "required (0 is allowed)"))?;
    let (ids, rewards) = values(trajectories);
    let returns = core::compute_returns(method, gamma, &rewards)?;
    Ok(pb::ComputeReturnsResponse { trajectories: with_ids(ids, returns) })
}

pub(crate) fn compute_advantages(
    request: pb::ComputeAdvantagesRequest,
) -> Result<pb::ComputeAdvantagesResponse, InvalidInput> {
    let pb::ComputeAdvantagesRequest { estimator, groups, normalize_std, epsilon } = request;
    let estimator = match pb::AdvantageEstimator::try_from(estimator) {
        Ok(pb::AdvantageEstimator::Grpo) => {
            core::Estimator::Grpo { normalize_std: normalize_std.unwrap_or(true), epsilon: epsilon.unwrap_or(1e-6) }
        }
        Ok(pb::AdvantageEstimator::TurnMean) => core::Estimator::TurnMean,
        Ok(pb::AdvantageEstimator::Trloo) => core::Estimator::Trloo,
        Ok(pb::AdvantageEstimator::Rloo) => core::Estimator::Rloo,
        Ok(pb::AdvantageEstimator::Unspecified) => {
            return Err(InvalidInput::new("estimator", "must be specified (grpo, turn_mean, trloo or rloo)"));
        }
        Err(_) => return Err(InvalidInput::new("estimator", format!("unknown value {estimator}"))),
    };
    // Ids stay here while the math sees only numbers; they are reattached in order.
    let mut ids = Vec::with_capacity(groups.len());
    let mut returns = Vec::with_capacity(groups.len());
    for pb::AdvantageGroup { group_id, trajectories } in groups {
        let (trajectory_ids, values) = values(trajectories);
        ids.push((group_id, trajectory_ids));
        returns.push(values);
    }
    let advantages = core::compute_advantages(estimator, &returns)?;
    Ok(pb::ComputeAdvantagesResponse {
        groups: ids
            .into_iter()
            .zip(advantages)
            .map(|((group_id, trajectory_ids), values)| pb::AdvantageGroup {
                group_id,
                trajectories: with_ids(trajectory_ids, values),
            })
            .collect(),
    })
}

pub(crate) fn rejection_sample(
    request: pb::RejectionSampleRequest,
) -> Result<pb::RejectionSampleResponse, InvalidInput> {
    use pb::rejection_sample_request::Method;
    let pb::RejectionSampleRequest { method, seed, outcomes: wire_outcomes, trajectories } = request;
    let decisions = match method {
        Some(Method::Prs(pb::PrsParams { tau, scale })) => {
            if !trajectories.is_empty() {
                return Err(InvalidInput::new("trajectories", "must be empty for prs (it decides on `outcomes`)"));
            }
            let defaults = core::PrsParams::default();
            let params =
                core::PrsParams { tau: tau.unwrap_or(defaults.tau), scale: scale.unwrap_or(defaults.scale), seed };
            core::prs(&params, &outcomes(wire_outcomes, "outcomes")?)?
        }
        Some(Method::Mrs(pb::MrsParams { lower, upper, veto })) => {
            if !wire_outcomes.is_empty() {
                return Err(InvalidInput::new("outcomes", "must be empty for mrs (it decides on `trajectories`)"));
            }
            let defaults = core::MrsParams::default();
            let params = core::MrsParams {
                lower: lower.unwrap_or(defaults.lower),
                upper: upper.unwrap_or(defaults.upper),
                veto: veto.unwrap_or(defaults.veto),
            };
            let trajectories: Vec<core::TokenLogprobs> = trajectories
                .into_iter()
                .map(|pb::TokenLogprobs { trajectory_id, rollout_logprobs, train_logprobs }| core::TokenLogprobs {
                    trajectory_id,
                    rollout: rollout_logprobs,
                    train: train_logprobs,
                })
                .collect();
            core::mrs(&params, &trajectories)?
        }
        None => return Err(InvalidInput::new("method", "required: set `prs` or `mrs`")),
    };
    let kept = decisions.iter().filter(|d| d.keep).count() as u64;
    Ok(pb::RejectionSampleResponse {
        kept,
        decisions: decisions
            .into_iter()
            .map(|d| pb::SampleDecision {
                id: d.id,
                keep: d.keep,
                keep_probability: d.keep_probability,
                importance_weight: d.importance_weight,
                min_token_ratio: d.min_token_ratio,
                reason: d.reason,
            })
            .collect(),
    })
}

pub(crate) fn diagnose(request: pb::DiagnoseRequest) -> Result<pb::DiagnoseResponse, InvalidInput> {
    let pb::DiagnoseRequest { params, responses } = request;
    let pb::DiagnoseParams { opening, repetition_threshold, not_okay_off } = params.unwrap_or_default();
    let defaults = core::DiagnoseParams::default();
    let opening = match (not_okay_off, opening) {
        (true, Some(_)) => {
            return Err(InvalidInput::new("params.opening", "must be unset when not_okay_off is true"));
        }
        (true, None) => None,
        (false, opening) => opening.or(defaults.opening),
    };
    let params = core::DiagnoseParams {
        opening,
        repetition_threshold: repetition_threshold.unwrap_or(defaults.repetition_threshold),
    };
    let responses = responses
        .into_iter()
        .enumerate()
        .map(|(i, pb::ModelResponse { response_id, text, reasoning, finish_reason, outcome: wire_outcome })| {
            Ok(core::ResponseInput {
                response_id,
                text,
                reasoning,
                finish_reason,
                outcome: wire_outcome.map(|o| outcome(o, &format!("responses[{i}].outcome"))).transpose()?,
            })
        })
        .collect::<Result<Vec<_>, InvalidInput>>()?;
    let diagnosis = core::diagnose(&params, &responses)?;
    Ok(pb::DiagnoseResponse {
        junk_ratio: diagnosis.junk_ratio,
        not_okay_ratio: diagnosis.not_okay_ratio.unwrap_or(0.0),
        hack_ratio: diagnosis.hack_ratio,
        evaluated: diagnosis.evaluated,
        infra_errors: diagnosis.infra_errors,
        not_okay_off: diagnosis.not_okay_ratio.is_none(),
        flags: diagnosis
            .flags
            .into_iter()
            .map(|f| pb::ResponseFlags {
                response_id: f.response_id,
                truncated: f.truncated,
                no_kernel: f.no_kernel,
                degenerate: f.degenerate,
                junk: f.junk,
                not_okay: f.not_okay,
                hack: f.hack,
                repetition_ratio: f.repetition_ratio,
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verdict_is_read_with_the_shared_mapping_and_an_unset_or_unknown_one_is_refused_naming_it() {
        assert_eq!(verdict(pb::Verdict::Hack as i32, "outcomes[0]"), Ok(core::Verdict::Hack));
        let unset = verdict(pb::Verdict::Unspecified as i32, "outcomes[1]").expect_err("unset");
        assert_eq!(unset.to_string(), "outcomes[1].verdict: must be specified");
        let unknown = verdict(99, "outcomes[2]").expect_err("unknown");
        assert_eq!(unknown.to_string(), "outcomes[2].verdict: unknown value 99");
    }
}
