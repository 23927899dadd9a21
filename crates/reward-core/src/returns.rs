//! Per-turn returns of a trajectory from its per-turn rewards.

use crate::{InvalidInput, finite, non_empty, within};

/// How later turns' rewards fold into a turn's return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReturnMethod {
    /// `R_t = sum_{i >= t} gamma^(i - t) * r_i`.
    Sum,
    /// `R_t = max_{i >= t} gamma^(i - t) * r_i`.
    Max,
}

/// Returns for each trajectory (lengths may differ). `gamma` must be in [0, 1].
///
/// Both methods run backwards in one pass: `R_t = r_t + gamma * R_{t+1}` for the sum and
/// `R_t = max(r_t, gamma * R_{t+1})` for the max, which equal the definitions because gamma >= 0.
pub fn compute_returns(
    method: ReturnMethod,
    gamma: f64,
    trajectories: &[Vec<f64>],
) -> Result<Vec<Vec<f64>>, InvalidInput> {
    within(|| "gamma".into(), gamma, 0.0, 1.0)?;
    non_empty("trajectories", trajectories)?;
    for (t, rewards) in trajectories.iter().enumerate() {
        non_empty(&format!("trajectories[{t}].values"), rewards)?;
        for (i, &r) in rewards.iter().enumerate() {
            finite(|| format!("trajectories[{t}].values[{i}]"), r)?;
        }
    }
    Ok(trajectories.iter().map(|rewards| returns_of(method, gamma, rewards)).collect())
}

fn returns_of(method: ReturnMethod, gamma: f64, rewards: &[f64]) -> Vec<f64> {
    let mut returns = vec![0.0; rewards.len()];
    let mut later: Option<f64> = None;
    for (t, &r) in rewards.iter().enumerate().rev() {
        let value = match (method, later) {
            (_, None) => r,
            (ReturnMethod::Sum, Some(next)) => r + gamma * next,
            (ReturnMethod::Max, Some(next)) => r.max(gamma * next),
        };
        returns[t] = value;
        later = Some(value);
    }
    returns
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kevin_sum_worked_example() {
        // gamma 0.4, rewards [0.3, 0, 1.3]: R_2 = 1.3, R_1 = 0 + 0.4 * 1.3 = 0.52, R_0 = 0.3 + 0.4 * 0.52 = 0.508.
        let got = compute_returns(ReturnMethod::Sum, 0.4, &[vec![0.3, 0.0, 1.3]]).expect("valid");
        let want = [0.508, 0.52, 1.3];
        for (g, w) in got[0].iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{got:?}");
        }
    }

    #[test]
    fn max_takes_the_best_discounted_later_score() {
        // gamma 0.5, rewards [1, 4, 0]: R_2 = 0, R_1 = max(4, 0) = 4, R_0 = max(1, 0.5 * 4) = 2.
        let got = compute_returns(ReturnMethod::Max, 0.5, &[vec![1.0, 4.0, 0.0]]).expect("valid");
        assert_eq!(got, vec![vec![2.0, 4.0, 0.0]]);
    }

    #[test]
    fn drkernel_reward_to_go_is_the_undiscounted_suffix_sum() {
        let got = compute_returns(ReturnMethod::Sum, 1.0, &[vec![1.0, 2.0, 3.0], vec![5.0]]).expect("valid");
        assert_eq!(got, vec![vec![6.0, 5.0, 3.0], vec![5.0]]);
    }

    #[test]
    fn bad_input_names_the_field() {
        let err = compute_returns(ReturnMethod::Sum, 1.5, &[vec![1.0]]).expect_err("gamma > 1");
        assert_eq!(err.field, "gamma");
        let err = compute_returns(ReturnMethod::Sum, 0.4, &[vec![1.0], vec![]]).expect_err("empty trajectory");
        assert_eq!(err.field, "trajectories[1].values");
        let err = compute_returns(ReturnMethod::Max, 0.4, &[vec![1.0, f64::NAN]]).expect_err("nan");
        assert_eq!(err.field, "trajectories[0].values[1]");
        let err = compute_returns(ReturnMethod::Max, 0.4, &[]).expect_err("no trajectories");
        assert_eq!(err.field, "trajectories");
    }
}
