//! A job's report: `report.json` (every metric with its denominators, and a line per task) and `report.html`, one
//! self-contained page with inline SVG plots and CSS that opens offline — no network, no external files, no
//! external scripts.
//!
//! The numbers are [`kforge_reward_core::job_metrics`]'s; this crate only lays them out. Plots: correctness and
//! fast_p per turn, the speedup distribution against both baselines, hack, junk and not-okay ratios per turn, and
//! tokens per turn with the job's cost. Each plot is a `<figure id="plot-...">` whose marks (points, bars) carry
//! `class="mark"` and their values as `data-` attributes, so a test can check a rendered page against the metrics.
//! One small inline script records each plot's rendered size in `data-rendered-width`; the page reads the same
//! without it.

mod html;
mod json;

use std::path::{Path, PathBuf};

use kforge_reward_core::{JobMetrics, TurnSample};

pub use html::{format_ratio, format_speedup, report_html};
pub use json::report_json;

/// What the report says about the job besides its metrics.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReportMeta {
    pub job_id: String,
    pub recipe: String,
    pub model: String,
    pub task_set: String,
    /// What the cost is priced at (`example prices: ...`), shown with the cost; empty: nothing to say.
    pub pricing: String,
    /// When the report was made, as the caller prints it (the report itself reads no clock).
    pub generated_at: String,
}

/// The files [`write_report`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportFiles {
    pub json: PathBuf,
    pub html: PathBuf,
}

/// A report that could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("cannot create report directory {path}: {source}")]
    CreateDir { path: PathBuf, source: std::io::Error },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
}

/// Writes `report.json` and `report.html` into `dir` (created if missing) and returns their paths.
pub fn write_report(
    dir: &Path,
    meta: &ReportMeta,
    metrics: &JobMetrics,
    samples: &[TurnSample],
) -> Result<ReportFiles, ReportError> {
    std::fs::create_dir_all(dir).map_err(|source| ReportError::CreateDir { path: dir.to_owned(), source })?;
    let files = ReportFiles { json: dir.join("report.json"), html: dir.join("report.html") };
    let json = serde_json::to_string_pretty(&report_json(meta, metrics, samples))
        .expect("a serde_json::Value always serialises");
    write(&files.json, json.as_bytes())?;
    write(&files.html, report_html(meta, metrics, samples).as_bytes())?;
    Ok(files)
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    std::fs::write(path, bytes).map_err(|source| ReportError::Write { path: path.to_owned(), source })
}

/// One task's line in the report: what its trajectories reached.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TaskLine {
    pub task: String,
    pub level: u32,
    pub trajectories: u64,
    pub turns: u64,
    pub correct_turns: u64,
    /// Best eager speedup of a correct turn; `None` without one.
    pub best_speedup_eager: Option<f64>,
    pub best_speedup_compile: Option<f64>,
}

pub(crate) fn task_lines(samples: &[TurnSample]) -> Vec<TaskLine> {
    use std::collections::{BTreeMap, BTreeSet};
    let mut tasks: BTreeMap<&str, Vec<&TurnSample>> = BTreeMap::new();
    for sample in samples {
        tasks.entry(&sample.task).or_default().push(sample);
    }
    let best = |turns: &[&TurnSample], speedup: fn(&TurnSample) -> Option<f64>| {
        turns
            .iter()
            .filter(|s| s.verdict == Some(kforge_reward_core::Verdict::Correct))
            .filter_map(|s| speedup(s))
            .reduce(f64::max)
    };
    tasks
        .into_iter()
        .map(|(task, turns)| TaskLine {
            task: task.to_owned(),
            level: turns[0].level,
            trajectories: turns.iter().map(|s| s.trajectory).collect::<BTreeSet<_>>().len() as u64,
            turns: turns.len() as u64,
            correct_turns: turns.iter().filter(|s| s.verdict == Some(kforge_reward_core::Verdict::Correct)).count()
                as u64,
            best_speedup_eager: best(&turns, |s| s.speedup_eager),
            best_speedup_compile: best(&turns, |s| s.speedup_compile),
        })
        .collect()
}

/// Per turn index: (turn, prompt tokens, completion tokens, cost in dollars), from the samples.
pub(crate) fn usage_by_turn(samples: &[TurnSample]) -> Vec<(u32, u64, u64, f64)> {
    let mut turns: std::collections::BTreeMap<u32, (u64, u64, f64)> = std::collections::BTreeMap::new();
    for sample in samples {
        let entry = turns.entry(sample.turn).or_default();
        entry.0 += sample.usage.prompt_tokens;
        entry.1 += sample.usage.completion_tokens;
        entry.2 += sample.usage.cost_usd;
    }
    turns.into_iter().map(|(turn, (prompt, completion, cost))| (turn, prompt, completion, cost)).collect()
}

/// Speedup histogram bins: (label, lower edge inclusive, upper edge exclusive). Finer around 1x, where a kernel
/// turns from slower to faster than its baseline.
pub(crate) const SPEEDUP_BINS: [(&str, f64, f64); 9] = [
    ("<0.25", 0.0, 0.25),
    ("0.25-0.5", 0.25, 0.5),
    ("0.5-0.8", 0.5, 0.8),
    ("0.8-1", 0.8, 1.0),
    ("1-1.2", 1.0, 1.2),
    ("1.2-1.5", 1.2, 1.5),
    ("1.5-2", 1.5, 2.0),
    ("2-4", 2.0, 4.0),
    (">=4", 4.0, f64::INFINITY),
];

/// Counts of correct kernels' speedups per bin.
pub(crate) fn speedup_histogram(samples: &[TurnSample], speedup: fn(&TurnSample) -> Option<f64>) -> [u64; 9] {
    let mut counts = [0u64; 9];
    for value in samples.iter().filter(|s| s.verdict == Some(kforge_reward_core::Verdict::Correct)).filter_map(speedup)
    {
        if let Some(bin) = SPEEDUP_BINS.iter().position(|&(_, lo, hi)| (lo..hi).contains(&value)) {
            counts[bin] += 1;
        }
    }
    counts
}
