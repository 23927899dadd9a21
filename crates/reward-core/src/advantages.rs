//! Advantages from per-turn returns, within groups (one task's trajectories in one step).

use crate::{InvalidInput, finite, non_empty};

/// How returns become advantages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Estimator {
    /// Over every turn-sample of the group: `A = (G - mean) / (std + eps)` with the unbiased standard deviation
    /// (0 for a single sample), or `A = G - mean` without normalisation. A constant group gives exact zeros.
    Grpo { normalize_std: bool, epsilon: f64 },
    /// Per (group, turn index): `A = G - mean` over the trajectories that reached that turn.
    TurnMean,
    /// Per (group, turn index) with N samples: `A = G - mean of the other N - 1` (`= N / (N - 1) * (G - mean)`);
    /// `A = G` when N = 1.
    Trloo,
    /// Leave-one-out over every turn-sample of the group: `A = G - mean of the others`; `A = G` when N = 1.
    Rloo,
}

impl Estimator {
    /// GRPO with std normalisation and eps = 1e-6.
    pub const GRPO: Self = Self::Grpo { normalize_std: true, epsilon: 1e-6 };
}

/// Advantages with the same shape as `groups` (group -> trajectory -> turn).
pub fn compute_advantages(estimator: Estimator, groups: &[Vec<Vec<f64>>]) -> Result<Vec<Vec<Vec<f64>>>, InvalidInput> {
    if let Estimator::Grpo { epsilon, .. } = estimator
        && !(epsilon.is_finite() && epsilon >= 0.0)
    {
        return Err(InvalidInput::new("epsilon", format!("must be finite and >= 0, got {epsilon}")));
    }
    validate(groups)?;
    Ok(groups
        .iter()
        .map(|group| match estimator {
            Estimator::Grpo { normalize_std, epsilon } => grpo(group, normalize_std, epsilon),
            Estimator::Rloo => rloo(group),
            Estimator::TurnMean => per_turn(group, |g, sum, n| g - sum / n as f64),
            Estimator::Trloo => per_turn(group, leave_one_out),
        })
        .collect())
}

fn validate(groups: &[Vec<Vec<f64>>]) -> Result<(), InvalidInput> {
    non_empty("groups", groups)?;
    for (g, group) in groups.iter().enumerate() {
        non_empty(&format!("groups[{g}].trajectories"), group)?;
        for (t, returns) in group.iter().enumerate() {
            non_empty(&format!("groups[{g}].trajectories[{t}].values"), returns)?;
            for (i, &value) in returns.iter().enumerate() {
                finite(|| format!("groups[{g}].trajectories[{t}].values[{i}]"), value)?;
            }
        }
    }
    Ok(())
}

/// `G - mean of the others`, or `G` alone.
fn leave_one_out(g: f64, sum: f64, n: usize) -> f64 {
    if n == 1 { g } else { g - (sum - g) / (n - 1) as f64 }
}

fn is_constant(group: &[Vec<f64>]) -> bool {
    let mut values = group.iter().flatten();
    let first = values.next().copied();
    values.all(|&v| Some(v) == first)
}

fn map_group(group: &[Vec<f64>], f: impl Fn(f64) -> f64) -> Vec<Vec<f64>> {
    group.iter().map(|returns| returns.iter().map(|&g| f(g)).collect()).collect()
}

fn grpo(group: &[Vec<f64>], normalize_std: bool, epsilon: f64) -> Vec<Vec<f64>> {
    // Exact zeros for a constant group: the computed mean of identical values can differ from them by an ulp.
    if is_constant(group) {
        return map_group(group, |_| 0.0);
    }
    let n = group.iter().map(Vec::len).sum::<usize>();
    let mean = group.iter().flatten().sum::<f64>() / n as f64;
    if !normalize_std {
        return map_group(group, |g| g - mean);
    }
    let variance = group.iter().flatten().map(|g| (g - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let scale = variance.sqrt() + epsilon;
    map_group(group, |g| (g - mean) / scale)
}

fn rloo(group: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let n = group.iter().map(Vec::len).sum::<usize>();
    let sum = group.iter().flatten().sum::<f64>();
    map_group(group, |g| leave_one_out(g, sum, n))
}

/// Applies `f(G, sum of returns at this turn, samples at this turn)` per turn index.
fn per_turn(group: &[Vec<f64>], f: impl Fn(f64, f64, usize) -> f64) -> Vec<Vec<f64>> {
    let turns = group.iter().map(Vec::len).max().unwrap_or(0);
    let mut sums = vec![0.0; turns];
    let mut counts = vec![0usize; turns];
    for returns in group {
        for (k, &g) in returns.iter().enumerate() {
            sums[k] += g;
            counts[k] += 1;
        }
    }
    group.iter().map(|returns| returns.iter().enumerate().map(|(k, &g)| f(g, sums[k], counts[k])).collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[Vec<Vec<f64>>], b: &[Vec<Vec<f64>>]) -> bool {
        a.iter().flatten().flatten().zip(b.iter().flatten().flatten()).all(|(x, y)| (x - y).abs() < 1e-9)
    }

    #[test]
    fn grpo_worked_example() {
        // Returns 1, 2, 3 (two trajectories): mean 2, unbiased std 1 -> -1, 0, 1 (eps 0).
        let groups = vec![vec![vec![1.0, 2.0], vec![3.0]]];
        let got = compute_advantages(Estimator::Grpo { normalize_std: true, epsilon: 0.0 }, &groups).expect("valid");
        assert!(close(&got, &[vec![vec![-1.0, 0.0], vec![1.0]]]), "{got:?}");
        let raw = compute_advantages(Estimator::Grpo { normalize_std: false, epsilon: 0.0 }, &groups).expect("valid");
        assert!(close(&raw, &[vec![vec![-1.0, 0.0], vec![1.0]]]), "{raw:?}");
    }

    #[test]
    fn constant_group_gives_exact_zeros() {
        let groups = vec![vec![vec![0.1, 0.1], vec![0.1]], vec![vec![7.0]]];
        for estimator in [Estimator::GRPO, Estimator::Grpo { normalize_std: true, epsilon: 0.0 }] {
            let got = compute_advantages(estimator, &groups).expect("valid");
            assert!(got.iter().flatten().flatten().all(|&a| a == 0.0), "{got:?}");
        }
    }

    #[test]
    fn trloo_worked_example() {
        // Turn 0: returns 1, 2, 6 -> 1 - 4 = -3, 2 - 3.5 = -1.5, 6 - 1.5 = 4.5. Turn 1: only one sample (4) -> 4.
        let groups = vec![vec![vec![1.0, 4.0], vec![2.0], vec![6.0]]];
        let got = compute_advantages(Estimator::Trloo, &groups).expect("valid");
        assert!(close(&got, &[vec![vec![-3.0, 4.0], vec![-1.5], vec![4.5]]]), "{got:?}");
    }

    #[test]
    fn turn_mean_worked_example() {
        let groups = vec![vec![vec![1.0, 4.0], vec![3.0, 2.0]]];
        let got = compute_advantages(Estimator::TurnMean, &groups).expect("valid");
        assert!(close(&got, &[vec![vec![-1.0, 1.0], vec![1.0, -1.0]]]), "{got:?}");
    }

    #[test]
    fn rloo_leaves_one_out_over_the_whole_group() {
        // Samples 1, 2, 6: 1 - 4 = -3, 2 - 3.5 = -1.5, 6 - 1.5 = 4.5, whatever their turn.
        let groups = vec![vec![vec![1.0, 2.0], vec![6.0]], vec![vec![5.0]]];
        let got = compute_advantages(Estimator::Rloo, &groups).expect("valid");
        assert!(close(&got, &[vec![vec![-3.0, -1.5], vec![4.5]], vec![vec![5.0]]]), "{got:?}");
    }

    #[test]
    fn bad_input_names_the_field() {
        let err = compute_advantages(Estimator::GRPO, &[vec![vec![1.0]], vec![]]).expect_err("empty group");
        assert_eq!(err.field, "groups[1].trajectories");
        let err = compute_advantages(Estimator::Trloo, &[vec![vec![1.0], vec![2.0, f64::INFINITY]]]).expect_err("inf");
        assert_eq!(err.field, "groups[0].trajectories[1].values[1]");
        let err = compute_advantages(Estimator::Grpo { normalize_std: true, epsilon: -1.0 }, &[vec![vec![1.0]]])
            .expect_err("negative eps");
        assert_eq!(err.field, "epsilon");
        assert_eq!(compute_advantages(Estimator::Rloo, &[]).expect_err("no groups").field, "groups");
    }
}
