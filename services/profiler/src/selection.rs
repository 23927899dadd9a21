//! CudaForge's offline metric selection, over samples the caller profiled: within each task, the Pearson
//! correlation of every metric with runtime across that task's kernels and the `top_k` metrics by absolute
//! correlation; across tasks, the metrics whose correlation has one sign in every task that picked them, kept when
//! their mean absolute correlation is at or above the 75th percentile of those means.

use std::collections::BTreeMap;

/// One profiled kernel of one task.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub task: String,
    pub runtime_ms: f64,
    pub metrics: BTreeMap<String, f64>,
}

/// A selected metric.
#[derive(Debug, Clone, PartialEq)]
pub struct Selected {
    pub name: String,
    /// Mean correlation over the tasks that picked it.
    pub correlation: f64,
    pub tasks: usize,
}

/// Samples a task needs for its correlations to count.
pub const MIN_SAMPLES: usize = 3;

/// Pearson's r of `x` and `y`, or `None` where either is constant (or there are fewer than two points).
pub fn pearson(x: &[f64], y: &[f64]) -> Option<f64> {
    let n = x.len().min(y.len());
    if n < 2 {
        return None;
    }
    let mean = |v: &[f64]| v[..n].iter().sum::<f64>() / n as f64;
    let (mx, my) = (mean(x), mean(y));
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for i in 0..n {
        let (dx, dy) = (x[i] - mx, y[i] - my);
        sxy += dx * dy;
        sxx += dx * dx;
        syy += dy * dy;
    }
    (sxx > 0.0 && syy > 0.0).then(|| (sxy / (sxx * syy).sqrt()).clamp(-1.0, 1.0))
}

/// The selection described in this module's documentation, strongest mean absolute correlation first. Tasks with
/// fewer than [`MIN_SAMPLES`] samples, and metrics missing from any sample of a task, take no part in that task.
pub fn select(samples: &[Sample], top_k: usize) -> Vec<Selected> {
    let mut by_task: BTreeMap<&str, Vec<&Sample>> = BTreeMap::new();
    for sample in samples {
        by_task.entry(sample.task.as_str()).or_default().push(sample);
    }
    // Per metric: its correlation in each task that picked it.
    let mut picked: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for task in by_task.values().filter(|task| task.len() >= MIN_SAMPLES) {
        let runtimes: Vec<f64> = task.iter().map(|s| s.runtime_ms).collect();
        let mut correlations: Vec<(&str, f64)> = task[0]
            .metrics
            .keys()
            .filter_map(|name| {
                let values: Option<Vec<f64>> = task.iter().map(|s| s.metrics.get(name).copied()).collect();
                pearson(&values?, &runtimes).map(|r| (name.as_str(), r))
            })
            .collect();
        correlations.sort_by(|a, b| b.1.abs().total_cmp(&a.1.abs()).then(a.0.cmp(b.0)));
        for (name, r) in correlations.into_iter().take(top_k) {
            picked.entry(name).or_default().push(r);
        }
    }
    let consistent: Vec<Selected> = picked
        .into_iter()
        .filter(|(_, rs)| rs.iter().all(|r| *r > 0.0) || rs.iter().all(|r| *r < 0.0))
        .map(|(name, rs)| Selected {
            name: name.to_owned(),
            correlation: rs.iter().sum::<f64>() / rs.len() as f64,
            tasks: rs.len(),
        })
        .collect();
    let mut strengths: Vec<f64> = consistent.iter().map(|s| s.correlation.abs()).collect();
    strengths.sort_by(f64::total_cmp);
    let Some(threshold) = percentile(&strengths, 0.75) else { return vec![] };
    let mut kept: Vec<Selected> = consistent.into_iter().filter(|s| s.correlation.abs() >= threshold).collect();
    kept.sort_by(|a, b| b.correlation.abs().total_cmp(&a.correlation.abs()).then(a.name.cmp(&b.name)));
    kept
}

/// The `q` quantile of sorted values, interpolated linearly between neighbours.
fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let position = q * last as f64;
    let (low, high) = (position.floor() as usize, position.ceil() as usize);
    Some(sorted[low] + (sorted[high] - sorted[low]) * (position - low as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(task: &str, runtime_ms: f64, metrics: &[(&str, f64)]) -> Sample {
        Sample {
            task: task.into(),
            runtime_ms,
            metrics: metrics.iter().map(|(name, value)| ((*name).to_owned(), *value)).collect(),
        }
    }

    #[test]
    fn pearson_is_one_for_a_line_minus_one_for_its_mirror_and_none_for_a_constant() {
        let x = [1.0, 2.0, 3.0, 4.0];
        assert!((pearson(&x, &[2.0, 4.0, 6.0, 8.0]).expect("r") - 1.0).abs() < 1e-12);
        assert!((pearson(&x, &[8.0, 6.0, 4.0, 2.0]).expect("r") + 1.0).abs() < 1e-12);
        assert_eq!(pearson(&x, &[5.0; 4]), None);
        assert!((percentile(&[0.0, 1.0, 2.0, 3.0, 4.0], 0.75).expect("q") - 3.0).abs() < 1e-12);
    }

    #[test]
    fn consistent_strong_metrics_are_kept_and_sign_flips_weak_ones_and_thin_tasks_are_not() {
        let mut samples = Vec::new();
        for (task, flip) in [("t1", 1.0), ("t2", -1.0), ("t3", 1.0)] {
            for (i, runtime) in [1.0, 2.0, 3.0, 5.0, 8.0].into_iter().enumerate() {
                let wobble = [0.3, -0.2, 0.1, -0.4, 0.2][i];
                samples.push(sample(
                    task,
                    runtime,
                    &[
                        ("dram_bytes", 10.0 * runtime),                          // r = +1 everywhere
                        ("occupancy", 100.0 - 5.0 * runtime + wobble),           // r close to -1 everywhere
                        ("flips", flip * runtime),                               // +1 in t1 and t3, -1 in t2
                        ("weak", [3.0, 1.0, 4.0, 1.0, 2.5][i] + runtime * 0.05), // weakly related
                        ("constant", 7.0),                                       // no correlation at all
                    ],
                ));
            }
        }
        samples.push(sample("thin", 1.0, &[("only_in_thin", 1.0)]));
        samples.push(sample("thin", 2.0, &[("only_in_thin", 2.0)]));
        let selected = select(&samples, 4);
        let names: Vec<&str> = selected.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["dram_bytes"], "{selected:?}");
        assert_eq!(selected[0].tasks, 3);
        assert!((selected[0].correlation - 1.0).abs() < 1e-9);

        // With three picks per task, the weak metric is left out before the merge, and the 75th percentile of
        // {dram_bytes, occupancy} means keeps the stronger one only.
        let selected = select(&samples, 3);
        assert_eq!(selected.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["dram_bytes"]);
        assert!(select(&samples[..2], 4).is_empty(), "no task with three samples");
    }
}
