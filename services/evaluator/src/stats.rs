//! Timing statistics, computed here from the raw samples a harness reports (never trusted from the child).

/// Statistics of timing samples, in milliseconds (the contract's `TimingStats`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TimingStats {
    pub median_ms: f64,
    /// Interquartile range (p75 - p25).
    pub iqr_ms: f64,
    pub mean_ms: f64,
    /// Standard error of the mean.
    pub stderr_ms: f64,
    /// The samples, in the order they were taken.
    pub samples_ms: Vec<f64>,
}

/// Median, interquartile range, mean and standard error of `samples` (ms); the samples are kept in order.
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

/// The `q` quantile of sorted, non-empty `sorted`: linear interpolation between closest ranks (the common "type 7"
/// definition).
pub(crate) fn quantile(sorted: &[f64], q: f64) -> f64 {
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
        assert_eq!(stats.iqr_ms, 2.0);
        assert_eq!(stats.mean_ms, 3.0);
        assert!((stats.stderr_ms - (2.5f64 / 5.0).sqrt()).abs() < 1e-12);
        assert_eq!(stats.samples_ms, vec![4.0, 1.0, 3.0, 2.0, 5.0], "raw samples keep their order");
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
