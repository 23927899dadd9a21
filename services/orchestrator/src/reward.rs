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

use std::collections::{BTreeMap, HashSet};

use kforge_proto::v1 as pb;
use kforge_proto::v1::reward_client::RewardClient;
use kforge_proto::v1::score_kernels_request::Formula;
use kforge_server::client::Channel;

use crate::error::OrchestratorError;
use crate::recipe::Recipe;
use crate::store::{Stage, Store};

/// A job's scoring and credit: its spec's `reward`, the recipe's defaults where it is silent.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardPlan {
    pub formula: Formula,
    pub baseline: pb::SpeedupBaseline,
    pub hack_penalty: Option<f64>,
    /// Returns and advantages; `None`: the job's turns get neither.
    pub credit: Option<Credit>,
}

/// How scores become returns and advantages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Credit {
    pub method: pb::ReturnMethod,
    pub gamma: f64,
    pub estimator: pb::AdvantageEstimator,
}

impl RewardPlan {
    /// The plan of `spec` for `recipe`; a gamma outside [0, 1] is INVALID_ARGUMENT naming it (the reward service
    /// checks the formula's weights with the first score).
    pub fn new(recipe: Recipe, spec: Option<&pb::RewardSpec>) -> Result<Self, OrchestratorError> {
        let default = pb::RewardSpec::default();
        let spec = spec.unwrap_or(&default);
        let formula = match (&spec.formula, recipe) {
            (Some(pb::reward_spec::Formula::Kevin(kevin)), _) => Formula::Kevin(*kevin),
            (Some(pb::reward_spec::Formula::Drkernel(drkernel)), _) => Formula::Drkernel(*drkernel),
            (None, Recipe::DrKernel) => Formula::Drkernel(pb::DrKernelReward::default()),
            (None, _) => Formula::Kevin(pb::KevinScore::default()),
        };
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
        Ok(Self { formula, baseline, hack_penalty: spec.hack_penalty, credit })
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
        if !turn.error.is_empty() || turn.verdict() == pb::Verdict::InfraError {
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

/// Computes the returns and advantages of the finished job's recorded turns through the reward service and stores
/// them in the turn records (see the module's documentation). `position` gives a task's index in the job.
pub async fn credit(
    plan: &RewardPlan,
    reward: &mut RewardClient<Channel>,
    store: &Store,
    job_id: &str,
    position: impl Fn(&str) -> i64,
) -> Result<(), String> {
    let Some(credit) = plan.credit else { return Ok(()) };
    let mut turns = store.turns(job_id).await.map_err(|error| format!("reading the turns: {error}"))?;
    let found = creditable(&turns);
    if found.is_empty() {
        return Ok(());
    }
    let trajectories = found
        .iter()
        .map(|c| pb::TrajectoryValues {
            trajectory_id: format!("{}/{}", c.task_id, c.trajectory),
            values: c.rewards.clone(),
        })
        .collect();
    let request = pb::ComputeReturnsRequest { method: credit.method as i32, gamma: Some(credit.gamma), trajectories };
    let returns = reward.compute_returns(request).await.map_err(|status| peer("ComputeReturns", &status))?;
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
    let advantages = reward.compute_advantages(request).await.map_err(|status| peer("ComputeAdvantages", &status))?;
    let advantages = advantages.into_inner().groups;
    let advantages = advantages.iter().flat_map(|group| &group.trajectories);
    for ((trajectory, returns), advantages) in found.iter().zip(&returns).zip(advantages) {
        for (k, &index) in trajectory.turns.iter().enumerate() {
            let turn = &mut turns[index];
            turn.return_value = returns.values.get(k).copied();
            turn.advantage = advantages.values.get(k).copied();
            store
                .put_turn(job_id, position(&turn.task_id), Stage::Recorded, turn)
                .await
                .map_err(|error| format!("storing a turn's return and advantage: {error}"))?;
        }
    }
    Ok(())
}

fn peer(method: &str, status: &tonic::Status) -> String {
    format!("reward {method}: {:?}: {}", status.code(), status.message())
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
        let plan = |recipe, spec: Option<pb::RewardSpec>| RewardPlan::new(recipe, spec.as_ref()).expect("valid");
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
        };
        let custom = plan(Recipe::Kevin, Some(spec));
        assert!(matches!(custom.formula, Formula::Drkernel(_)) && !custom.needs_census(), "no PR weight, no census");
        assert_eq!((custom.baseline, custom.hack_penalty), (pb::SpeedupBaseline::Compile, Some(-1.0)));
        assert_eq!(credit(&custom), Some((pb::ReturnMethod::Max, 0.9, pb::AdvantageEstimator::Rloo)));
        let asked = plan(Recipe::CudaForge, Some(pb::RewardSpec { return_method: sum as i32, ..Default::default() }));
        assert_eq!(credit(&asked), Some((sum, 1.0, grpo)), "cudaforge's turns are credited when the spec asks");
        let bad = RewardPlan::new(Recipe::Kevin, Some(&pb::RewardSpec { gamma: Some(1.5), ..spec }));
        assert!(bad.expect_err("gamma").to_string().starts_with("spec.reward.gamma: must be in [0, 1]"));
    }
}
