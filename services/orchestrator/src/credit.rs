//! Returns and advantages of a finished job's turns, by its recipe, computed by the reward service and written
//! into the stored turn records (`TurnRecord.return_value`, `.advantage`, and so the exported samples).
//!
//! | recipe | return | advantage (group: one task's trajectories) |
//! |---|---|---|
//! | `single-turn` | the turn's score | GRPO over the task's samples |
//! | `kevin` | discounted sum of later scores, gamma 0.4 | GRPO over the task's m x n samples |
//! | `drkernel` | sum of later scores (gamma 1) | TRLOO per turn index |
//! | `cudaforge` | none: a training-free agent's turns are not training samples | none |
//!
//! A trajectory's values are its turns' scores in order, a turn without a score (no kernel in the response)
//! counting 0. It ends before its first turn that failed on the way or whose evaluation was an infrastructure
//! error: that turn and any after it get neither return nor advantage, so no sample is trained on a reward the
//! evaluator never gave.

use std::collections::{BTreeMap, HashSet};

use kforge_proto::v1 as pb;
use kforge_proto::v1::reward_client::RewardClient;
use kforge_server::client::Channel;

use crate::recipe::Recipe;
use crate::store::{Stage, Store};

/// How a recipe turns scores into returns and advantages; `None` for a recipe that computes neither.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Credit {
    pub method: pb::ReturnMethod,
    pub gamma: f64,
    pub estimator: pb::AdvantageEstimator,
}

impl Credit {
    pub fn of(recipe: Recipe) -> Option<Self> {
        let (method, estimator) = (pb::ReturnMethod::Sum, pb::AdvantageEstimator::Grpo);
        match recipe {
            Recipe::SingleTurn => Some(Self { method, gamma: 0.0, estimator }),
            Recipe::Kevin => Some(Self { method, gamma: 0.4, estimator }),
            Recipe::DrKernel => Some(Self { method, gamma: 1.0, estimator: pb::AdvantageEstimator::Trloo }),
            Recipe::CudaForge => None,
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
    recipe: Recipe,
    reward: &mut RewardClient<Channel>,
    store: &Store,
    job_id: &str,
    position: impl Fn(&str) -> i64,
) -> Result<(), String> {
    let Some(credit) = Credit::of(recipe) else { return Ok(()) };
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
    fn each_training_recipe_has_its_papers_credit_and_cudaforge_none() {
        assert_eq!(
            Credit::of(Recipe::Kevin).map(|c| (c.gamma, c.estimator)),
            Some((0.4, pb::AdvantageEstimator::Grpo))
        );
        assert_eq!(Credit::of(Recipe::DrKernel).map(|c| c.estimator), Some(pb::AdvantageEstimator::Trloo));
        assert_eq!(Credit::of(Recipe::SingleTurn).map(|c| c.gamma), Some(0.0));
        assert_eq!(Credit::of(Recipe::CudaForge), None);
    }
}
