//! Timing statistics, computed here from the raw samples a harness reports (never trusted from the child).

use kforge_proto::v1::TimingStats;

/// The quantile of the samples a speedup divides: low enough that a call with two cost levels, which a timed loop
/// alternates between in shares that differ from process to process (a host wait mid-call), is measured at its
/// lower level whenever that holds a tenth of its calls; for a call with one level it sits within a fraction of a
/// percent under the median (`bench/results/timing-fidelity-2026-11-27b/`).
pub const SPEEDUP_QUANTILE: f64 = 0.1;

/// Median, 10th percentile, interquartile range, mean and standard error of `samples` (ms); the samples are kept in
/// order.
pub fn timing_stats(samples: Vec<f64>) -> Option<TimingStats> {
    if samples.is_empty() || samples.iter().any(|s| !s.is_finite() || *s < 0.0) {
        return None;
    }
    let mut sorted = samples.clone();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len() as f64;
    let mean = sorted.iter().sum::<f64>() / n;
    let variance =
        if sorted.len() > 1 { sorted.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    Some(TimingStats {
        median_ms: quantile(&sorted, 0.5),
        p10_ms: quantile(&sorted, SPEEDUP_QUANTILE),
        iqr_ms: quantile(&sorted, 0.75) - quantile(&sorted, 0.25),
        mean_ms: mean,
        stderr_ms: (variance / n).sqrt(),
        samples_ms: samples,
    })
}

/// Per-call wall-clock time the timer's events did not account for, beyond what the clean baseline shows, in ms.
///
/// Each timed step is measured twice: by the events (or the clock on a CPU) around the call, and by the host clock
/// around the whole step (cache flush, call, synchronisation). Their difference is the step's overhead, the same
/// for the candidate and the reference on one task and device; a candidate whose difference is larger did work
/// (or waited) where the events could not see it. `None` when a series is missing or the lengths differ.
pub fn unaccounted_host_ms(candidate: (&[f64], &[f64]), baseline: (&[f64], &[f64])) -> Option<f64> {
    let gap = |(events, host): (&[f64], &[f64])| -> Option<f64> {
        if events.is_empty() || events.len() != host.len() {
            return None;
        }
        let mut gaps: Vec<f64> = host.iter().zip(events).map(|(h, e)| h - e).collect();
        if gaps.iter().any(|g| !g.is_finite()) {
            return None;
        }
        gaps.sort_by(f64::total_cmp);
        Some(quantile(&gaps, 0.5))
    };
    Some(gap(candidate)? - gap(baseline)?.max(0.0))
}

/// Linear interpolation between closest ranks (the common "type 7" definition).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let position = q * (sorted.len() - 1) as f64;
    let (low, high) = (position.floor() as usize, position.ceil() as usize);
    sorted[low] + (sorted[high] - sorted[low]) * (position - low as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worked_example() {
        let stats = timing_stats(vec![4.0, 1.0, 3.0, 2.0, 5.0]).expect("valid samples");
        assert_eq!(stats.median_ms, 3.0);
        assert!((stats.p10_ms - 1.4).abs() < 1e-12, "type 7: 1 + 0.4 x (2 - 1)");
        assert_eq!(stats.iqr_ms, 2.0);
        assert_eq!(stats.mean_ms, 3.0);
        assert!((stats.stderr_ms - (2.5f64 / 5.0).sqrt()).abs() < 1e-12);
        assert_eq!(stats.samples_ms, vec![4.0, 1.0, 3.0, 2.0, 5.0], "raw samples keep their order");
    }

    #[test]
    fn a_call_with_two_cost_levels_is_measured_at_its_lower_level() {
        // Two processes of one call that costs 1.49 or 1.64 ms a call, in different shares (30% and 70% high): the
        // median jumps between the levels, the 10th percentile stays on the lower one.
        let process = |high: usize| {
            let mut samples: Vec<f64> = (0..100).map(|i| if i < high { 1.64 } else { 1.49 }).collect();
            samples.iter_mut().enumerate().for_each(|(i, s)| *s += i as f64 * 1e-5);
            timing_stats(samples).expect("valid samples")
        };
        let (fewer, more) = (process(30), process(70));
        assert!((more.median_ms - fewer.median_ms) / fewer.median_ms > 0.09);
        assert!((more.p10_ms - fewer.p10_ms).abs() / fewer.p10_ms < 0.01);
    }

    #[test]
    fn unaccounted_host_time_is_the_candidates_extra_gap() {
        let baseline_events = [1.0, 1.1, 0.9];
        let baseline_host = [1.1, 1.2, 1.0];
        // Honest: the same 0.1 ms of overhead per step.
        let honest = unaccounted_host_ms((&[0.5, 0.5, 0.6], &[0.6, 0.6, 0.7]), (&baseline_events, &baseline_host));
        assert!(honest.expect("both series").abs() < 1e-9);
        // Events that report 0.1 ms for steps that take 2 ms of wall-clock time.
        let hidden = unaccounted_host_ms((&[0.1, 0.1, 0.1], &[2.0, 2.1, 1.9]), (&baseline_events, &baseline_host));
        assert!((hidden.expect("both series") - 1.8).abs() < 1e-9);
        assert_eq!(unaccounted_host_ms((&[0.1], &[]), (&baseline_events, &baseline_host)), None);
        assert_eq!(unaccounted_host_ms((&[0.1], &[0.2]), (&[], &[])), None);
    }

    #[test]
    fn forged_or_empty_samples_give_nothing() {
        assert!(timing_stats(vec![]).is_none());
        assert!(timing_stats(vec![1.0, f64::NAN]).is_none());
        assert!(timing_stats(vec![1.0, -0.5]).is_none());
        assert_eq!(timing_stats(vec![2.0]).expect("one sample").stderr_ms, 0.0);
    }
}
