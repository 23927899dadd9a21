//! Invariants of the reward math over random batches.

use kforge_reward_core::{
    Estimator, Outcome, PrsParams, ReturnMethod, Verdict, compute_advantages, compute_returns, prs,
};
use proptest::prelude::*;

fn scores(max_len: usize) -> impl Strategy<Value = Vec<f64>> {
    prop::collection::vec(-10.0f64..10.0, 1..=max_len)
}

fn trajectories() -> impl Strategy<Value = Vec<Vec<f64>>> {
    prop::collection::vec(scores(6), 1..8)
}

fn groups() -> impl Strategy<Value = Vec<Vec<Vec<f64>>>> {
    prop::collection::vec(trajectories(), 1..5)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

/// The definitions written out literally, O(n^2).
fn literal_returns(method: ReturnMethod, gamma: f64, rewards: &[f64]) -> Vec<f64> {
    (0..rewards.len())
        .map(|t| {
            let terms = (t..rewards.len()).map(|i| gamma.powi((i - t) as i32) * rewards[i]);
            match method {
                ReturnMethod::Sum => terms.sum(),
                ReturnMethod::Max => terms.fold(f64::NEG_INFINITY, f64::max),
            }
        })
        .collect()
}

proptest! {
    #[test]
    fn returns_match_the_literal_definitions(trajs in trajectories(), gamma in 0.0f64..=1.0) {
        for method in [ReturnMethod::Sum, ReturnMethod::Max] {
            let got = compute_returns(method, gamma, &trajs).expect("valid");
            for (rewards, returns) in trajs.iter().zip(&got) {
                let want = literal_returns(method, gamma, rewards);
                prop_assert!(returns.iter().zip(&want).all(|(a, b)| close(*a, *b)), "{method:?} {returns:?} {want:?}");
            }
        }
    }

    #[test]
    fn gamma_zero_gives_per_turn_scores(trajs in trajectories()) {
        prop_assert_eq!(compute_returns(ReturnMethod::Sum, 0.0, &trajs).expect("valid"), trajs.clone());
        let non_negative: Vec<Vec<f64>> = trajs.iter().map(|t| t.iter().map(|r| r.abs()).collect()).collect();
        prop_assert_eq!(compute_returns(ReturnMethod::Max, 0.0, &non_negative).expect("valid"), non_negative);
    }

    #[test]
    fn sum_is_at_least_max_for_non_negative_scores(trajs in trajectories(), gamma in 0.0f64..=1.0) {
        let non_negative: Vec<Vec<f64>> = trajs.iter().map(|t| t.iter().map(|r| r.abs()).collect()).collect();
        let sum = compute_returns(ReturnMethod::Sum, gamma, &non_negative).expect("valid");
        let max = compute_returns(ReturnMethod::Max, gamma, &non_negative).expect("valid");
        for (s, m) in sum.iter().flatten().zip(max.iter().flatten()) {
            prop_assert!(*s >= *m - 1e-12, "sum {s} < max {m}");
        }
    }

    #[test]
    fn grpo_groups_have_zero_mean(groups in groups(), normalize in any::<bool>()) {
        let got = compute_advantages(Estimator::Grpo { normalize_std: normalize, epsilon: 1e-6 }, &groups).expect("valid");
        for group in &got {
            let values: Vec<f64> = group.iter().flatten().copied().collect();
            let mean = values.iter().sum::<f64>() / values.len() as f64;
            prop_assert!(mean.abs() < 1e-9, "mean {mean}");
            prop_assert!(values.iter().all(|a| a.is_finite()));
        }
    }

    #[test]
    fn trloo_is_n_over_n_minus_one_times_the_mean_baseline(groups in groups()) {
        let trloo = compute_advantages(Estimator::Trloo, &groups).expect("valid");
        let turn_mean = compute_advantages(Estimator::TurnMean, &groups).expect("valid");
        for ((group, a_loo), a_mean) in groups.iter().zip(&trloo).zip(&turn_mean) {
            for ((returns, loo), mean) in group.iter().zip(a_loo).zip(a_mean) {
                for (k, g) in returns.iter().enumerate() {
                    let n = group.iter().filter(|t| t.len() > k).count();
                    let want = if n == 1 { *g } else { n as f64 / (n - 1) as f64 * mean[k] };
                    prop_assert!(close(loo[k], want), "turn {k}: {} vs {want}", loo[k]);
                }
            }
        }
    }

    #[test]
    fn prs_decisions_are_a_function_of_seed_and_id(
        prs_values in prop::collection::vec(0.0f64..=1.0, 1..50),
        seed in any::<u64>(),
    ) {
        let outcomes: Vec<Outcome> = prs_values
            .iter()
            .enumerate()
            .map(|(i, pr)| Outcome {
                sample_id: format!("sample-{i}"),
                verdict: Verdict::Correct,
                profiling_ratio: Some(*pr),
                ..Outcome::default()
            })
            .collect();
        let params = PrsParams { seed, ..PrsParams::default() };
        let first = prs(&params, &outcomes).expect("valid");
        let mut reversed = outcomes.clone();
        reversed.reverse();
        let mut second = prs(&params, &reversed).expect("valid");
        second.reverse();
        prop_assert_eq!(first, second);
    }
}
