//! Timing statistics, computed here from the raw samples a harness reports (never trusted from the child).

use kforge_proto::v1::TimingStats;

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
        assert_eq!(stats.iqr_ms, 2.0);
        assert_eq!(stats.mean_ms, 3.0);
        assert!((stats.stderr_ms - (2.5f64 / 5.0).sqrt()).abs() < 1e-12);
        assert_eq!(stats.samples_ms, vec![4.0, 1.0, 3.0, 2.0, 5.0], "raw samples keep their order");
    }

    #[test]
    fn forged_or_empty_samples_give_nothing() {
        assert!(timing_stats(vec![]).is_none());
        assert!(timing_stats(vec![1.0, f64::NAN]).is_none());
        assert!(timing_stats(vec![1.0, -0.5]).is_none());
        assert_eq!(timing_stats(vec![2.0]).expect("one sample").stderr_ms, 0.0);
    }
}
