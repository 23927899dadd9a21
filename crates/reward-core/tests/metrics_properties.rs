//! Invariants of the job metrics over random jobs.

use kforge_reward_core::{
    MetricsParams, Rates, Ratio, ResponseSample, TurnSample, Verdict, expected_best_of, job_metrics, quantile,
};
use proptest::prelude::*;

fn verdict() -> impl Strategy<Value = Option<Verdict>> {
    prop_oneof![
        3 => Just(Some(Verdict::Correct)),
        2 => Just(Some(Verdict::Incorrect)),
        1 => Just(Some(Verdict::CompileError)),
        1 => Just(Some(Verdict::Hack)),
        1 => Just(Some(Verdict::Rejected)),
        1 => Just(Some(Verdict::InfraError)),
        1 => Just(None),
    ]
}

fn speedup() -> impl Strategy<Value = Option<f64>> {
    prop::option::weighted(0.8, 0.05f64..10.0)
}

/// One turn's contents; its task, trajectory and turn come from where it sits in the job.
fn turn() -> impl Strategy<Value = TurnSample> {
    (
        verdict(),
        speedup(),
        speedup(),
        any::<bool>(),
        prop::option::weighted(
            0.9,
            (any::<bool>(), any::<bool>(), prop::option::of(any::<bool>()), prop::option::of(any::<bool>())),
        ),
        0.0f64..30.0,
        0.0f64..0.1,
    )
        .prop_map(|(verdict, eager, compile, hack, response, wall, cost)| TurnSample {
            verdict,
            speedup_eager: eager,
            speedup_compile: compile,
            hack,
            response: response.map(|(junk, no_kernel, not_okay, format_error)| ResponseSample {
                junk,
                no_kernel,
                not_okay,
                format_error,
            }),
            wall_time_s: wall,
            usage: kforge_reward_core::Usage { completion_tokens: 7, cost_usd: cost, ..Default::default() },
            ..TurnSample::default()
        })
}

/// tasks -> trajectories -> turns (ragged), flattened with their keys.
fn job() -> impl Strategy<Value = Vec<TurnSample>> {
    prop::collection::vec(prop::collection::vec(prop::collection::vec(turn(), 1..4), 1..5), 1..4).prop_map(|tasks| {
        let mut samples = Vec::new();
        for (t, trajectories) in tasks.into_iter().enumerate() {
            for (j, turns) in trajectories.into_iter().enumerate() {
                for (n, sample) in turns.into_iter().enumerate() {
                    samples.push(TurnSample {
                        task: format!("task{t}"),
                        level: (t % 2) as u32 + 1,
                        trajectory: j as u32,
                        turn: n as u32,
                        ..sample
                    });
                }
            }
        }
        samples
    })
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

fn ratios(r: &Rates) -> Vec<Ratio> {
    let mut all = vec![r.correct, r.compile_error, r.hack, r.junk, r.no_kernel];
    all.extend(r.not_okay);
    all.extend(r.fast_p.iter().flat_map(|f| [f.eager, f.compile]));
    all
}

/// The expected best of k by enumerating every k-subset.
fn brute_best_of(values: &[f64], k: usize) -> f64 {
    let m = values.len();
    let (mut total, mut subsets) = (0.0, 0u64);
    for mask in 0u32..(1 << m) {
        if mask.count_ones() as usize == k {
            let best = (0..m).filter(|i| mask & (1 << i) != 0).map(|i| values[i]).fold(f64::NEG_INFINITY, f64::max);
            total += best;
            subsets += 1;
        }
    }
    total / subsets as f64
}

proptest! {
    #[test]
    fn expected_best_of_matches_enumeration(values in prop::collection::vec(0.0f64..5.0, 1..8), k in 1usize..8) {
        let k = k.min(values.len());
        prop_assert!(close(expected_best_of(&values, k), brute_best_of(&values, k)));
    }

    #[test]
    fn every_ratio_is_within_its_denominator_and_slices_add_up(samples in job()) {
        let m = job_metrics(&MetricsParams::default(), &samples).expect("valid");
        for rates in std::iter::once(&m.overall).chain(m.by_turn.iter().map(|(_, r)| r)).chain(m.by_level.iter().map(|(_, r)| r)) {
            for ratio in ratios(rates) {
                prop_assert!(ratio.numerator <= ratio.denominator, "{ratio:?}");
                prop_assert!((0.0..=1.0).contains(&ratio.value()));
            }
            prop_assert!(rates.correct.denominator + rates.infra_errors <= rates.turns);
            for f in &rates.fast_p {
                prop_assert!(f.eager.numerator <= rates.correct.numerator && f.compile.numerator <= rates.correct.numerator);
            }
            for pair in rates.fast_p.windows(2) {
                prop_assert!(pair[0].eager.numerator >= pair[1].eager.numerator, "fast_p falls as p rises");
            }
        }
        for slices in [&m.by_turn, &m.by_level] {
            let sum = |f: fn(&Rates) -> Ratio| slices.iter().fold((0, 0), |(n, d), (_, r)| (n + f(r).numerator, d + f(r).denominator));
            for f in [|r: &Rates| r.correct, |r: &Rates| r.hack, |r: &Rates| r.junk, |r: &Rates| r.fast_p[0].compile] {
                let overall = f(&m.overall);
                prop_assert_eq!(sum(f), (overall.numerator, overall.denominator));
            }
            prop_assert_eq!(slices.iter().map(|(_, r)| r.turns).sum::<u64>(), samples.len() as u64);
        }
    }

    #[test]
    fn infra_errors_change_no_evaluation_ratio(samples in job()) {
        let before = job_metrics(&MetricsParams::default(), &samples).expect("valid");
        let mut with_infra = samples.clone();
        for sample in &samples {
            with_infra.push(TurnSample {
                turn: sample.turn + 100,
                verdict: Some(Verdict::InfraError),
                speedup_eager: Some(50.0),
                hack: true,
                ..sample.clone()
            });
        }
        let after = job_metrics(&MetricsParams::default(), &with_infra).expect("valid");
        let evaluation = |r: &Rates| (r.correct, r.compile_error, r.hack, r.fast_p.clone());
        prop_assert_eq!(evaluation(&before.overall), evaluation(&after.overall));
        prop_assert_eq!(after.overall.infra_errors, before.overall.infra_errors + samples.len() as u64);
        prop_assert_eq!(&before.speedup_eager, &after.speedup_eager);
        // The longest budget before still gives the same best@k and avg@k: infra turns measured nothing.
        for a in &before.at_k {
            let b = after.at_k.iter().find(|b| b.k == a.k && b.turns == a.turns).expect("same grid");
            prop_assert_eq!(a, b);
        }
    }

    #[test]
    fn best_at_k_grows_with_k_and_turns_and_tops_avg(samples in job()) {
        // Without infrastructure errors every trajectory is measured from its first turn, so a longer budget
        // covers the same trajectories (an infra-only start joins later, which may lower an average).
        let samples: Vec<TurnSample> = samples
            .into_iter()
            .map(|s| if s.verdict == Some(Verdict::InfraError) { TurnSample { verdict: Some(Verdict::Incorrect), ..s } } else { s })
            .collect();
        let m = job_metrics(&MetricsParams { ks: vec![1, 2, 3, 4], ..MetricsParams::default() }, &samples).expect("valid");
        for a in &m.at_k {
            for v in [a.correct, a.speedup_eager, a.speedup_compile] {
                prop_assert!(v.best + 1e-12 >= v.avg, "{a:?}");
            }
            if a.k == 1 {
                prop_assert!(close(a.correct.best, a.correct.avg));
            }
            // More turns never lower a trajectory's best so far, for the same tasks.
            if let Some(next) = m.at_k.iter().find(|b| b.k == a.k && b.turns == a.turns + 1)
                && next.correct.tasks == a.correct.tasks
            {
                prop_assert!(next.correct.best + 1e-12 >= a.correct.best && next.correct.avg + 1e-12 >= a.correct.avg);
            }
            // A larger k over the same tasks never lowers the expected best.
            if let Some(bigger) = m.at_k.iter().find(|b| b.k == a.k + 1 && b.turns == a.turns)
                && bigger.correct.tasks == a.correct.tasks
            {
                prop_assert!(bigger.correct.best + 1e-12 >= a.correct.best);
            }
        }
    }

    #[test]
    fn speedup_statistics_are_ordered(samples in job()) {
        let params = MetricsParams { quantiles: vec![0.0, 0.1, 0.5, 0.9, 1.0], ..MetricsParams::default() };
        let m = job_metrics(&params, &samples).expect("valid");
        for s in [&m.speedup_eager, &m.speedup_compile] {
            prop_assert_eq!(s.count + s.missing, m.overall.correct.numerator);
            if s.count == 0 {
                continue;
            }
            prop_assert!(s.min <= s.geomean + 1e-12 && s.geomean <= s.mean + 1e-9 && s.mean <= s.max + 1e-12);
            prop_assert!(s.quantiles.windows(2).all(|w| w[0].1 <= w[1].1));
            prop_assert_eq!((s.quantiles[0].1, s.quantiles[4].1, s.quantiles[2].1), (s.min, s.max, s.median));
        }
    }

    #[test]
    fn order_of_samples_does_not_matter(samples in job()) {
        let forward = job_metrics(&MetricsParams::default(), &samples).expect("valid");
        let reversed: Vec<TurnSample> = samples.iter().rev().cloned().collect();
        let backward = job_metrics(&MetricsParams::default(), &reversed).expect("valid");
        prop_assert_eq!((&forward.overall, &forward.by_turn, &forward.by_level), (&backward.overall, &backward.by_turn, &backward.by_level));
        prop_assert_eq!((&forward.speedup_eager, &forward.at_k), (&backward.speedup_eager, &backward.at_k));
        prop_assert!(close(forward.cost.usage.cost_usd, backward.cost.usage.cost_usd));
    }
}

#[test]
fn quantile_interpolates_like_numpy() {
    let values = [1.0, 2.0, 4.0, 8.0];
    assert_eq!(quantile(&values, 0.0), 1.0);
    assert_eq!(quantile(&values, 1.0), 8.0);
    // Position 0.25 * 3 = 0.75: 1 + 0.75 * (2 - 1).
    assert_eq!(quantile(&values, 0.25), 1.75);
}
