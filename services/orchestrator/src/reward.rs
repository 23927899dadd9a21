//! How a job's turns are rewarded: each turn scored by the reward service with the job's formula as it is recorded,
//! and, when the job has run all its episodes, every turn's return and advantage computed by the reward service and
//! written into the stored turn records (`TurnRecord.return_value`, `.advantage`, and so the exported samples).
//!
//! The job's `RewardSpec` chooses each part; where it is silent, the recipe's defaults:
//!
//! | recipe | score | return | advantage (group: one task's trajectories) |
//! |---|---|---|---|
//! | `single-turn` | Kevin | the turn's score | GRPO over the task's samples |
//! | `kevin` | Kevin | discounted sum of later scores, gamma 0.4 | GRPO over the task's m x n samples |
//! | `drkernel` | Dr. Kernel (PR from the census) | sum of later scores (gamma 1) | TRLOO per turn index |
//! | `cudaforge` | Kevin | none unless the spec asks: a training-free agent's turns are not samples | none |
//!
//! A trajectory's values are its turns' scores in order, a turn without a score (no kernel in the response)
//! counting 0. It ends before its first turn that failed on the way or whose evaluation was an infrastructure
//! error: that turn and any after it get neither return nor advantage, so no sample is trained on a reward the
//! evaluator never gave.
//!
//! With PRS in the spec (Dr. Kernel's profiling-based rejection sampling), the same creditable turns get `keep`:
//! the reward service decides on each evaluated one by its verdict and profiling ratio, seeded by the job's seed
//! and the turn (`task/trajectory/turn`), so a rerun decides alike; a turn with no evaluation (no kernel, or a
//! response out of format) is kept, as the reward service keeps every sample that is not a correct kernel.

use std::collections::{BTreeMap, HashSet};

use kforge_proto::v1 as pb;
use kforge_proto::v1::reward_client::RewardClient;
use kforge_proto::v1::score_kernels_request::Formula;
use kforge_server::client::Channel;
use tonic::Code;

use crate::error::{OrchestratorError, store_code};
use crate::failure::TurnFailure;
use crate::recipe::Recipe;
use crate::store::{Stage, Store, StoreError};

/// Why a finished job's turns could not be credited (returns, advantages, PRS decisions). Computing again gives the
/// same values, so every one of them may be retried.
#[derive(Debug, thiserror::Error)]
pub enum CreditError {
    #[error("reading the turns: {0}")]
    ReadTurns(#[source] StoreError),
    #[error("storing a turn's return, advantage and keep: {0}")]
    StoreTurn(#[source] StoreError),
    /// A reward service call failed.
    #[error("reward {method}: {code:?}: {message}")]
    Reward { method: &'static str, code: Code, message: String },
    /// The reward service answered with a different number of PRS decisions than outcomes sent.
    #[error("reward RejectionSample: {decisions} decisions for {outcomes} outcomes")]
    DecisionCount { decisions: usize, outcomes: usize },
}

impl CreditError {
    fn reward(method: &'static str, status: &tonic::Status) -> Self {
        Self::Reward { method, code: status.code(), message: status.message().to_owned() }
    }

    /// The gRPC code of a step that this fails (the step itself stays recorded): the store's code, UNAVAILABLE
    /// for a reward service that could not answer, INTERNAL for one that answered wrong.
    pub fn code(&self) -> Code {
        match self {
            Self::ReadTurns(error) | Self::StoreTurn(error) => store_code(error),
            Self::Reward { .. } => Code::Unavailable,
            Self::DecisionCount { .. } => Code::Internal,
        }
    }
}

/// A job's scoring and credit: its spec's `reward`, the recipe's defaults where it is silent.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardPlan {
    pub formula: Formula,
    pub baseline: pb::SpeedupBaseline,
    pub hack_penalty: Option<f64>,
    /// Returns and advantages; `None`: the job's turns get neither.
    pub credit: Option<Credit>,
    /// Profiling-based rejection sampling of the job's turns, when asked for.
    pub prs: Option<pb::PrsParams>,
    /// The bounds of mismatch rejection sampling (`RejectMismatched`); `None` takes the reward service's.
    pub mrs: Option<pb::MrsParams>,
    /// The seed of PRS decisions: the job's.
    pub seed: u64,
}

/// How scores become returns and advantages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Credit {
    pub method: pb::ReturnMethod,
    pub gamma: f64,
    pub estimator: pb::AdvantageEstimator,
}

/// The formula's weights as the reward service checks them with every score (finite; Dr. Kernel's cap > 0): a job
/// whose weights it would refuse is refused at submission, not at each turn.
fn check_formula(formula: &Formula) -> Result<(), OrchestratorError> {
    let finite = |field: &str, value: Option<f64>| match value {
        Some(v) if !v.is_finite() => {
            Err(OrchestratorError::invalid(format!("spec.reward.{field}"), format!("must be finite, got {v}")))
        }
        _ => Ok(()),
    };
    match formula {
        Formula::Kevin(pb::KevinScore { correctness_weight }) => {
            finite("kevin.correctness_weight", *correctness_weight)
        }
        Formula::Drkernel(pb::DrKernelReward { correctness_weight, speedup_weight, profiling_weight, speedup_cap }) => {
            finite("drkernel.correctness_weight", *correctness_weight)?;
            finite("drkernel.speedup_weight", *speedup_weight)?;
            finite("drkernel.profiling_weight", *profiling_weight)?;
            match speedup_cap {
                Some(cap) if !(cap.is_finite() && *cap > 0.0) => Err(OrchestratorError::invalid(
                    "spec.reward.drkernel.speedup_cap",
                    format!("must be finite and > 0, got {cap}"),
                )),
                _ => Ok(()),
            }
        }
    }
}

impl RewardPlan {
    /// The plan of `spec` for `recipe`, PRS seeded by `seed`; a gamma outside [0, 1] or rejection-sampling
    /// parameters the reward service would refuse are INVALID_ARGUMENT naming them (the reward service checks the
    /// formula's weights with the first score).
    pub fn new(recipe: Recipe, spec: Option<&pb::RewardSpec>, seed: u64) -> Result<Self, OrchestratorError> {
        let default = pb::RewardSpec::default();
        let spec = spec.unwrap_or(&default);
        let formula = match (&spec.formula, recipe) {
            (Some(pb::reward_spec::Formula::Kevin(kevin)), _) => Formula::Kevin(*kevin),
            (Some(pb::reward_spec::Formula::Drkernel(drkernel)), _) => Formula::Drkernel(*drkernel),
            (None, Recipe::DrKernel) => Formula::Drkernel(pb::DrKernelReward::default()),
            (None, _) => Formula::Kevin(pb::KevinScore::default()),
        };
        check_formula(&formula)?;
        if let Some(penalty) = spec.hack_penalty.filter(|p| !p.is_finite()) {
            return Err(OrchestratorError::invalid(
                "spec.reward.hack_penalty",
                format!("must be finite, got {penalty}"),
            ));
        }
        // Unknown values would read as unspecified: refused instead, as the reward service refuses them.
        if pb::SpeedupBaseline::try_from(spec.baseline).is_err() {
            return Err(OrchestratorError::unknown_enum("spec.reward.baseline", spec.baseline));
        }
        if pb::ReturnMethod::try_from(spec.return_method).is_err() {
            return Err(OrchestratorError::unknown_enum("spec.reward.return_method", spec.return_method));
        }
        if pb::AdvantageEstimator::try_from(spec.estimator).is_err() {
            return Err(OrchestratorError::unknown_enum("spec.reward.estimator", spec.estimator));
        }
        let baseline = match spec.baseline() {
            pb::SpeedupBaseline::Unspecified => pb::SpeedupBaseline::Eager,
            chosen => chosen,
        };
        if let Some(gamma) = spec.gamma.filter(|g| !(0.0..=1.0).contains(g)) {
            return Err(OrchestratorError::invalid("spec.reward.gamma", format!("must be in [0, 1], got {gamma}")));
        }
        let grpo = pb::AdvantageEstimator::Grpo;
        let recipe_credit = match recipe {
            Recipe::SingleTurn => Some((0.0, grpo)),
            Recipe::Kevin => Some((0.4, grpo)),
            Recipe::DrKernel => Some((1.0, pb::AdvantageEstimator::Trloo)),
            Recipe::CudaForge => None,
        };
        let asked = spec.return_method() != pb::ReturnMethod::Unspecified;
        let credit = recipe_credit.or(asked.then_some((1.0, grpo))).map(|(gamma, estimator)| Credit {
            method: if asked { spec.return_method() } else { pb::ReturnMethod::Sum },
            gamma: spec.gamma.unwrap_or(gamma),
            estimator: match spec.estimator() {
                pb::AdvantageEstimator::Unspecified => estimator,
                chosen => chosen,
            },
        });
        if let Some(prs) = &spec.prs {
            if let Some(tau) = prs.tau.filter(|t| !t.is_finite()) {
                return Err(OrchestratorError::invalid("spec.reward.prs.tau", format!("must be finite, got {tau}")));
            }
            if let Some(scale) = prs.scale.filter(|s| !(s.is_finite() && *s > 0.0)) {
                return Err(OrchestratorError::invalid("spec.reward.prs.scale", format!("must be > 0, got {scale}")));
            }
        }
        if let Some(mrs) = &spec.mrs {
            let (lower, upper) = (mrs.lower.unwrap_or(0.999), mrs.upper.unwrap_or(1.001));
            if !(lower.is_finite() && upper.is_finite() && 0.0 < lower && lower <= upper) {
                let message = format!("needs 0 < lower <= upper, got lower {lower} and upper {upper}");
                return Err(OrchestratorError::invalid("spec.reward.mrs", message));
            }
            if let Some(veto) = mrs.veto.filter(|v| !(v.is_finite() && *v >= 0.0)) {
                return Err(OrchestratorError::invalid("spec.reward.mrs.veto", format!("must be >= 0, got {veto}")));
            }
        }
        Ok(Self { formula, baseline, hack_penalty: spec.hack_penalty, credit, prs: spec.prs, mrs: spec.mrs, seed })
    }

    /// Whether the formula needs the census's profiling ratio (the Dr. Kernel reward's PR).
    pub fn needs_census(&self) -> bool {
        matches!(&self.formula, Formula::Drkernel(d) if d.profiling_weight.is_none_or(|w| w != 0.0))
    }

    /// The request scoring one outcome.
    pub fn score_request(&self, outcome: pb::KernelOutcome) -> pb::ScoreKernelsRequest {
        pb::ScoreKernelsRequest {
            formula: Some(self.formula),
            baseline: self.baseline as i32,
            hack_penalty: self.hack_penalty,
            outcomes: vec![outcome],
        }
    }
}

/// One trajectory's creditable turns: indices into the job's turns, and their rewards.
#[derive(Debug, Clone, PartialEq)]
pub struct Creditable {
    pub task_id: String,
    pub trajectory: u32,
    pub turns: Vec<usize>,
    pub rewards: Vec<f64>,
}

/// The job's trajectories with at least one creditable turn, by task then trajectory.
pub fn creditable(turns: &[pb::TurnRecord]) -> Vec<Creditable> {
    let mut ordered: Vec<(usize, &pb::TurnRecord)> = turns.iter().enumerate().collect();
    ordered.sort_by(|(_, a), (_, b)| (&a.task_id, a.trajectory, a.turn).cmp(&(&b.task_id, b.trajectory, b.turn)));
    let mut by_trajectory: BTreeMap<(String, u32), Creditable> = BTreeMap::new();
    let mut ended: HashSet<(String, u32)> = HashSet::new();
    for (index, turn) in ordered {
        let key = (turn.task_id.clone(), turn.trajectory);
        if ended.contains(&key) {
            continue;
        }
        if TurnFailure::of(turn).is_some() || turn.verdict() == pb::Verdict::InfraError {
            ended.insert(key);
            continue;
        }
        let entry = by_trajectory.entry(key).or_insert_with(|| Creditable {
            task_id: turn.task_id.clone(),
            trajectory: turn.trajectory,
            turns: Vec::new(),
            rewards: Vec::new(),
        });
        entry.turns.push(index);
        entry.rewards.push(turn.score.unwrap_or(0.0));
    }
    by_trajectory.into_values().collect()
}

/// The evaluation as the reward service takes it; with `census`, its profiling ratio (0 included: no kernel of the
/// candidate's own ran) as the Dr. Kernel reward and PRS need it.
pub fn kernel_outcome(evaluation: &pb::EvaluateResponse, census: bool) -> pb::KernelOutcome {
    let positive = |v: f64| (v > 0.0).then_some(v);
    let median = |t: &Option<pb::TimingStats>| t.as_ref().and_then(|t| positive(t.median_ms));
    pb::KernelOutcome {
        sample_id: String::new(),
        verdict: evaluation.verdict,
        findings: evaluation.findings.clone(),
        speedup_eager: positive(evaluation.speedup_eager),
        speedup_compile: positive(evaluation.speedup_compile),
        candidate_median_ms: median(&evaluation.candidate_timing),
        eager_median_ms: median(&evaluation.eager_timing),
        compile_median_ms: median(&evaluation.compile_timing),
        profiling_ratio: if census { Some(evaluation.profiling_ratio) } else { positive(evaluation.profiling_ratio) },
    }
}

/// A turn's id in rejection sampling: `task/trajectory/turn`.
pub fn sample_id(turn: &pb::TurnRecord) -> String {
    format!("{}/{}/{}", turn.task_id, turn.trajectory, turn.turn)
}

/// Computes the returns and advantages of the finished job's recorded turns, and their PRS decisions when the plan
/// has PRS, through the reward service, and stores them in the turn records (see the module's documentation).
/// `position` gives a task's index in the job. Computing again gives the same values: a retry may.
pub async fn credit(
    plan: &RewardPlan,
    reward: &mut RewardClient<Channel>,
    store: &Store,
    job_id: &str,
    position: impl Fn(&str) -> i64,
) -> Result<(), CreditError> {
    if plan.credit.is_none() && plan.prs.is_none() {
        return Ok(());
    }
    let mut turns = store.turns(job_id).await.map_err(CreditError::ReadTurns)?;
    let found = creditable(&turns);
    if found.is_empty() {
        return Ok(());
    }
    if let Some(credit) = plan.credit {
        returns_and_advantages(credit, reward, &found, &mut turns).await?;
    }
    if let Some(prs) = plan.prs {
        let indices: Vec<usize> = found.iter().flat_map(|trajectory| trajectory.turns.iter().copied()).collect();
        keep_by_prs(prs, plan.seed, reward, &indices, &mut turns).await?;
    }
    for &index in found.iter().flat_map(|trajectory| &trajectory.turns) {
        let turn = &turns[index];
        store.put_turn(job_id, position(&turn.task_id), Stage::Recorded, turn).await.map_err(CreditError::StoreTurn)?;
    }
    Ok(())
}

/// Fills `turns`' returns and advantages of the creditable trajectories `found`.
async fn returns_and_advantages(
    credit: Credit,
    reward: &mut RewardClient<Channel>,
    found: &[Creditable],
    turns: &mut [pb::TurnRecord],
) -> Result<(), CreditError> {
    let trajectories = found
        .iter()
        .map(|c| pb::TrajectoryValues {
            trajectory_id: format!("{}/{}", c.task_id, c.trajectory),
            values: c.rewards.clone(),
        })
        .collect();
    let request = pb::ComputeReturnsRequest { method: credit.method as i32, gamma: Some(credit.gamma), trajectories };
    let returns =
        reward.compute_returns(request).await.map_err(|status| CreditError::reward("ComputeReturns", &status))?;
    let returns = returns.into_inner().trajectories;
    // `found` is ordered by task: each task's trajectories are one group.
    let mut groups: Vec<pb::AdvantageGroup> = Vec::new();
    for (trajectory, values) in found.iter().zip(&returns) {
        match groups.last_mut() {
            Some(group) if group.group_id == trajectory.task_id => group.trajectories.push(values.clone()),
            _ => groups
                .push(pb::AdvantageGroup { group_id: trajectory.task_id.clone(), trajectories: vec![values.clone()] }),
        }
    }
    let request =
        pb::ComputeAdvantagesRequest { estimator: credit.estimator as i32, groups, normalize_std: None, epsilon: None };
    let advantages =
        reward.compute_advantages(request).await.map_err(|status| CreditError::reward("ComputeAdvantages", &status))?;
    let advantages = advantages.into_inner().groups;
    let advantages = advantages.iter().flat_map(|group| &group.trajectories);
    for ((trajectory, returns), advantages) in found.iter().zip(&returns).zip(advantages) {
        for (k, &index) in trajectory.turns.iter().enumerate() {
            let turn = &mut turns[index];
            turn.return_value = returns.values.get(k).copied();
            turn.advantage = advantages.values.get(k).copied();
        }
    }
    Ok(())
}

/// Sets `keep` of `turns[indices]` by PRS: the reward service decides on the evaluated ones; the others are kept.
async fn keep_by_prs(
    prs: pb::PrsParams,
    seed: u64,
    reward: &mut RewardClient<Channel>,
    indices: &[usize],
    turns: &mut [pb::TurnRecord],
) -> Result<(), CreditError> {
    let evaluated: Vec<usize> = indices.iter().copied().filter(|&i| turns[i].evaluation.is_some()).collect();
    for &index in indices {
        turns[index].keep = Some(true);
    }
    if evaluated.is_empty() {
        return Ok(());
    }
    let outcomes = evaluated
        .iter()
        .map(|&i| {
            let turn = &turns[i];
            let evaluation = turn.evaluation.as_ref().expect("filtered on its evaluation");
            pb::KernelOutcome { sample_id: sample_id(turn), ..kernel_outcome(evaluation, true) }
        })
        .collect();
    let request = pb::RejectionSampleRequest {
        method: Some(pb::rejection_sample_request::Method::Prs(prs)),
        seed,
        outcomes,
        trajectories: Vec::new(),
    };
    let decided =
        reward.rejection_sample(request).await.map_err(|status| CreditError::reward("RejectionSample", &status))?;
    let decisions = decided.into_inner().decisions;
    if decisions.len() != evaluated.len() {
        return Err(CreditError::DecisionCount { decisions: decisions.len(), outcomes: evaluated.len() });
    }
    for (&index, decision) in evaluated.iter().zip(decisions) {
        turns[index].keep = Some(decision.keep);
    }
    Ok(())
}

/// MRS's input for the sample at `cursor` (the `index`th of a `RejectMismatched` request): the stored turn's
/// rollout log-probabilities and the trainer's `train` ones, which must be as many and finite.
pub fn mismatch_input(
    index: usize,
    cursor: &str,
    turn: &pb::TurnRecord,
    train: &[f64],
) -> Result<pb::TokenLogprobs, OrchestratorError> {
    let rollout = turn.completion.as_ref().map(|c| c.logprobs.as_slice()).unwrap_or_default();
    if rollout.is_empty() {
        return Err(OrchestratorError::Precondition(format!(
            "samples[{index}]: sample {cursor} has no rollout log-probabilities (the backend gave none, or the job \
             was not a rollout job, which asks for them)"
        )));
    }
    let field = format!("samples[{index}].logprobs");
    if train.len() != rollout.len() {
        let message = format!("{} values for the response's {} tokens", train.len(), rollout.len());
        return Err(OrchestratorError::invalid(field, message));
    }
    if let Some(k) = train.iter().position(|v| !v.is_finite()) {
        return Err(OrchestratorError::invalid(field, format!("value {k} is not finite")));
    }
    Ok(pb::TokenLogprobs {
        trajectory_id: cursor.to_owned(),
        rollout_logprobs: rollout.to_vec(),
        train_logprobs: train.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(task: &str, trajectory: u32, turn: u32, score: Option<f64>) -> pb::TurnRecord {
        pb::TurnRecord {
            task_id: task.into(),
            trajectory,
            turn,
            score,
            verdict: pb::Verdict::Correct as i32,
            ..Default::default()
        }
    }

    #[test]
    fn trajectories_end_before_a_failed_or_unevaluated_turn_and_unscored_turns_count_zero() {
        let infra = pb::TurnRecord { verdict: pb::Verdict::InfraError as i32, ..turn("a", 1, 1, None) };
        let failed = pb::TurnRecord { error: "gateway: Unavailable".into(), ..turn("b", 0, 1, None) };
        let turns = vec![
            turn("a", 0, 0, Some(1.3)),
            turn("a", 1, 0, None),
            infra,
            turn("a", 1, 2, Some(2.0)),
            turn("b", 0, 0, Some(0.3)),
            failed,
            turn("a", 0, 1, Some(0.0)),
        ];
        let found = creditable(&turns);
        let shape: Vec<(&str, u32, &[usize], &[f64])> =
            found.iter().map(|c| (c.task_id.as_str(), c.trajectory, &c.turns[..], &c.rewards[..])).collect();
        assert_eq!(
            shape,
            [("a", 0, &[0, 6][..], &[1.3, 0.0][..]), ("a", 1, &[1][..], &[0.0][..]), ("b", 0, &[4][..], &[0.3][..]),]
        );
    }

    #[test]
    fn each_recipe_has_its_papers_defaults_and_the_spec_overrides_them() {
        let plan = |recipe, spec: Option<pb::RewardSpec>| RewardPlan::new(recipe, spec.as_ref(), 0).expect("valid");
        let credit = |p: &RewardPlan| p.credit.map(|c| (c.method, c.gamma, c.estimator));
        let (sum, grpo, trloo) = (pb::ReturnMethod::Sum, pb::AdvantageEstimator::Grpo, pb::AdvantageEstimator::Trloo);
        let kevin = plan(Recipe::Kevin, None);
        assert!(matches!(kevin.formula, Formula::Kevin(_)) && kevin.baseline == pb::SpeedupBaseline::Eager);
        assert_eq!(credit(&kevin), Some((sum, 0.4, grpo)));
        let drkernel = plan(Recipe::DrKernel, None);
        assert!(matches!(drkernel.formula, Formula::Drkernel(_)) && drkernel.needs_census());
        assert_eq!(credit(&drkernel), Some((sum, 1.0, trloo)));
        assert_eq!(credit(&plan(Recipe::SingleTurn, None)), Some((sum, 0.0, grpo)));
        assert_eq!(credit(&plan(Recipe::CudaForge, None)), None, "a training-free agent's turns get no credit");

        let spec = pb::RewardSpec {
            formula: Some(pb::reward_spec::Formula::Drkernel(pb::DrKernelReward {
                profiling_weight: Some(0.0),
                ..Default::default()
            })),
            baseline: pb::SpeedupBaseline::Compile as i32,
            hack_penalty: Some(-1.0),
            return_method: pb::ReturnMethod::Max as i32,
            gamma: Some(0.9),
            estimator: pb::AdvantageEstimator::Rloo as i32,
            prs: None,
            mrs: None,
        };
        let custom = plan(Recipe::Kevin, Some(spec));
        assert!(matches!(custom.formula, Formula::Drkernel(_)) && !custom.needs_census(), "no PR weight, no census");
        assert_eq!((custom.baseline, custom.hack_penalty), (pb::SpeedupBaseline::Compile, Some(-1.0)));
        assert_eq!(credit(&custom), Some((pb::ReturnMethod::Max, 0.9, pb::AdvantageEstimator::Rloo)));
        let asked = plan(Recipe::CudaForge, Some(pb::RewardSpec { return_method: sum as i32, ..Default::default() }));
        assert_eq!(credit(&asked), Some((sum, 1.0, grpo)), "cudaforge's turns are credited when the spec asks");
        let bad = RewardPlan::new(Recipe::Kevin, Some(&pb::RewardSpec { gamma: Some(1.5), ..spec }), 0);
        assert!(bad.expect_err("gamma").to_string().starts_with("spec.reward.gamma: must be in [0, 1]"));
    }

    #[test]
    fn credit_errors_say_which_call_failed_and_map_to_a_code() {
        let refused = CreditError::reward("ComputeReturns", &tonic::Status::unavailable("down"));
        assert_eq!(refused.to_string(), "reward ComputeReturns: Unavailable: down");
        assert_eq!(refused.code(), Code::Unavailable);
        let short = CreditError::DecisionCount { decisions: 1, outcomes: 2 };
        assert_eq!(short.to_string(), "reward RejectionSample: 1 decisions for 2 outcomes");
        assert_eq!(short.code(), Code::Internal);
    }

    #[test]
    fn rejection_sampling_parameters_are_checked_at_submission_naming_the_field() {
        let with = |reward: pb::RewardSpec| RewardPlan::new(Recipe::DrKernel, Some(&reward), 7);
        let prs = |tau, scale| pb::RewardSpec { prs: Some(pb::PrsParams { tau, scale }), ..Default::default() };
        let mrs = |lower, upper, veto| pb::RewardSpec {
            mrs: Some(pb::MrsParams { lower, upper, veto }),
            ..Default::default()
        };
        let plan = with(prs(None, Some(0.2))).expect("valid");
        assert_eq!((plan.prs.and_then(|p| p.scale), plan.seed), (Some(0.2), 7));
        assert!(with(mrs(Some(0.9), Some(1.1), None)).is_ok());
        let cases = [
            (prs(Some(f64::NAN), None), "spec.reward.prs.tau"),
            (prs(None, Some(0.0)), "spec.reward.prs.scale"),
            (mrs(Some(1.2), Some(1.1), None), "spec.reward.mrs"),
            (mrs(Some(0.0), None, None), "spec.reward.mrs"),
            (mrs(None, None, Some(-1.0)), "spec.reward.mrs.veto"),
        ];
        for (reward, field) in cases {
            let error = with(reward).expect_err(field).to_string();
            assert!(error.starts_with(&format!("{field}: ")), "{error}");
        }
    }
}
