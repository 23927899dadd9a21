//! A job's metrics, computed from its turn records: a pure function, recomputed as turns arrive.
//!
//! Denominators (docs/ORCHESTRATOR.md): `correctness`, `fast_p`, `hack_ratio` and `compile_error_rate` divide by
//! the evaluated turns (a kernel was extracted and got a verdict other than infrastructure error); `junk_ratio`
//! and `not_okay_ratio` by every recorded turn. Speedup statistics are over correct, timed kernels. The issue asks
//! for these definitions to move to reward-core with property tests; they live here until then.

use kforge_proto::v1 as pb;

/// The fast_p thresholds reported, as the map keys print them.
const FAST_P: [(&str, f64); 4] = [("1", 1.0), ("1.2", 1.2), ("1.5", 1.5), ("2", 2.0)];

/// Metrics over `turns`, with `wall_time_s` as measured by the caller.
pub fn job_metrics(turns: &[pb::TurnRecord], wall_time_s: f64) -> pb::JobMetrics {
    let verdict = |t: &pb::TurnRecord| pb::Verdict::try_from(t.verdict).unwrap_or(pb::Verdict::Unspecified);
    let evaluated: Vec<&pb::TurnRecord> =
        turns.iter().filter(|t| !matches!(verdict(t), pb::Verdict::Unspecified | pb::Verdict::InfraError)).collect();
    let correct: Vec<&pb::TurnRecord> =
        evaluated.iter().copied().filter(|t| verdict(t) == pb::Verdict::Correct).collect();
    let mut speedups: Vec<f64> = correct.iter().filter_map(|t| t.speedup).filter(|s| *s > 0.0).collect();
    speedups.sort_by(f64::total_cmp);
    let ratio = |count: usize, of: usize| if of == 0 { 0.0 } else { count as f64 / of as f64 };
    let flagged =
        |flag: fn(&pb::ResponseFlags) -> bool| turns.iter().filter(|t| t.flags.as_ref().is_some_and(flag)).count();
    let (hacks, junk, not_okay) = (flagged(|f| f.hack), flagged(|f| f.junk), flagged(|f| f.not_okay));
    let mut usage = pb::Usage::default();
    for turn in turns.iter().filter_map(|t| t.usage.as_ref()) {
        usage.prompt_tokens += turn.prompt_tokens;
        usage.completion_tokens += turn.completion_tokens;
        usage.cached_prompt_tokens += turn.cached_prompt_tokens;
        usage.reasoning_tokens += turn.reasoning_tokens;
        usage.cost_usd += turn.cost_usd;
    }
    pb::JobMetrics {
        evaluated: evaluated.len() as u64,
        correctness: ratio(correct.len(), evaluated.len()),
        fast_p: FAST_P
            .iter()
            .map(|(key, p)| ((*key).to_owned(), ratio(speedups.iter().filter(|s| **s > *p).count(), evaluated.len())))
            .collect(),
        mean_speedup: mean(&speedups),
        median_speedup: median(&speedups),
        geomean_speedup: if speedups.is_empty() {
            0.0
        } else {
            mean(&speedups.iter().map(|s| s.ln()).collect::<Vec<_>>()).exp()
        },
        hack_ratio: ratio(
            evaluated.iter().filter(|t| t.flags.as_ref().is_some_and(|f| f.hack)).count(),
            evaluated.len(),
        ),
        junk_ratio: ratio(junk, turns.len()),
        not_okay_ratio: ratio(not_okay, turns.len()),
        compile_error_rate: ratio(
            evaluated.iter().filter(|t| verdict(t) == pb::Verdict::CompileError).count(),
            evaluated.len(),
        ),
        usage: Some(usage),
        turns: turns.len() as u64,
        correct: correct.len() as u64,
        no_kernel: turns.iter().filter(|t| t.kernel.is_empty()).count() as u64,
        hacks: hacks as u64,
        junk: junk as u64,
        not_okay: not_okay as u64,
        infra_errors: turns.iter().filter(|t| verdict(t) == pb::Verdict::InfraError).count() as u64,
        wall_time_s,
        // The rates by turn and level, best@k, avg@k and cost come with reward-core's job metrics.
        ..Default::default()
    }
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() { 0.0 } else { values.iter().sum::<f64>() / values.len() as f64 }
}

/// Median of sorted values.
fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(verdict: pb::Verdict, speedup: Option<f64>, kernel: &str, flags: pb::ResponseFlags) -> pb::TurnRecord {
        pb::TurnRecord {
            verdict: verdict as i32,
            speedup,
            kernel: kernel.into(),
            flags: Some(flags),
            usage: Some(pb::Usage { prompt_tokens: 10, completion_tokens: 5, ..Default::default() }),
            ..Default::default()
        }
    }

    #[test]
    fn ratios_use_their_documented_denominators() {
        let none = pb::ResponseFlags::default;
        let turns = [
            turn(pb::Verdict::Correct, Some(2.0), "k", none()),
            turn(pb::Verdict::Correct, Some(0.5), "k", none()),
            turn(pb::Verdict::Correct, Some(1.3), "k", none()),
            turn(pb::Verdict::Incorrect, None, "k", pb::ResponseFlags { not_okay: true, ..none() }),
            turn(pb::Verdict::CompileError, None, "k", none()),
            turn(pb::Verdict::Hack, None, "k", pb::ResponseFlags { hack: true, ..none() }),
            // Not evaluated: no kernel (junk), and an infrastructure error: outside the evaluated denominator.
            turn(pb::Verdict::Unspecified, None, "", pb::ResponseFlags { junk: true, no_kernel: true, ..none() }),
            turn(pb::Verdict::InfraError, None, "k", none()),
        ];
        let m = job_metrics(&turns, 12.5);
        assert_eq!((m.turns, m.evaluated, m.correct, m.no_kernel, m.infra_errors), (8, 6, 3, 1, 1));
        assert_eq!(m.correctness, 0.5);
        assert_eq!(m.fast_p["1"], 2.0 / 6.0);
        assert_eq!(m.fast_p["1.2"], 2.0 / 6.0);
        assert_eq!(m.fast_p["1.5"], 1.0 / 6.0);
        assert_eq!(m.fast_p["2"], 0.0, "fast_p is strictly faster than p");
        assert!((m.mean_speedup - 3.8 / 3.0).abs() < 1e-12);
        assert_eq!(m.median_speedup, 1.3);
        assert!((m.geomean_speedup - 1.3f64.powf(1.0 / 3.0)).abs() < 1e-12);
        assert_eq!((m.hacks, m.junk, m.not_okay), (1, 1, 1));
        assert_eq!(m.hack_ratio, 1.0 / 6.0);
        assert_eq!(m.junk_ratio, 1.0 / 8.0);
        assert_eq!(m.not_okay_ratio, 1.0 / 8.0);
        assert_eq!(m.compile_error_rate, 1.0 / 6.0);
        assert_eq!(m.usage.map(|u| (u.prompt_tokens, u.completion_tokens)), Some((80, 40)));
        assert_eq!(m.wall_time_s, 12.5);
    }

    #[test]
    fn no_turns_gives_zeros_not_nan() {
        let m = job_metrics(&[], 0.0);
        assert_eq!(
            (m.evaluated, m.correctness, m.mean_speedup, m.geomean_speedup, m.junk_ratio),
            (0, 0.0, 0.0, 0.0, 0.0)
        );
        assert!(m.fast_p.values().all(|v| *v == 0.0));
    }
}
