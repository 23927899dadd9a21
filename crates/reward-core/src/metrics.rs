//! Job metrics: pure functions from a job's per-turn samples to the figures a report and a dashboard show.
//!
//! The input is a plain list of [`TurnSample`]s, one per recorded turn, so the orchestrator can feed its stored
//! turns and a reader can recompute every figure from exported samples. Every ratio carries its numerator and
//! denominator ([`Ratio`]). Definitions, with their denominators, are in docs/METRICS.md; in short:
//! - a turn is *evaluated* when its kernel got a verdict other than an infrastructure error; infrastructure errors
//!   are counted apart and are in no denominator;
//! - correctness, compile errors, hacks and fast_p divide by evaluated turns; junk, no-kernel and not-okay by
//!   responses (turns whose generation returned text);
//! - a correct kernel without a speedup against a baseline (torch.compile failed on its task, say) is *unmeasured*
//!   against that baseline: outside that baseline's fast_p denominator and speedup statistics, counted as missing;
//! - best@k and avg@k follow Kevin's test-time scaling: a trajectory's value at a turn budget is its best turn so
//!   far; avg@k is the mean over a task's trajectories, best@k the expected best of k of them drawn at random.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::{InvalidInput, Verdict, within};

/// KernelBench's and Dr. Kernel's fast_p thresholds.
pub const DEFAULT_FAST_P: [f64; 4] = [1.0, 1.2, 1.5, 2.0];
/// Quantiles reported for speedups (0.5 is the median).
pub const DEFAULT_QUANTILES: [f64; 5] = [0.1, 0.25, 0.5, 0.75, 0.9];

/// One recorded turn of one trajectory.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TurnSample {
    pub task: String,
    /// KernelBench level; 0 when the task has none. Every sample of a task has the same level.
    pub level: u32,
    /// The trajectory's index within its task.
    pub trajectory: u32,
    /// 0-based turn index.
    pub turn: u32,
    /// The evaluation's verdict; `None` when nothing was evaluated (no kernel, or the turn failed before).
    pub verdict: Option<Verdict>,
    /// Speedup over eager PyTorch, when the kernel was correct and timed. Finite and > 0 when set.
    pub speedup_eager: Option<f64>,
    /// Speedup over torch.compile, when that baseline exists for the task. Finite and > 0 when set.
    pub speedup_compile: Option<f64>,
    /// The evaluation counted as a hack (`VERDICT_HACK`, or a rejection with a hack-category finding).
    pub hack: bool,
    /// Diagnose's flags of the model's response; `None` when the generation returned nothing.
    pub response: Option<ResponseSample>,
    /// Seconds this turn took (generation, evaluation, scoring). Finite and >= 0.
    pub wall_time_s: f64,
    pub usage: Usage,
}

/// The response flags a metric needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResponseSample {
    pub junk: bool,
    pub no_kernel: bool,
    /// `None` when not-okay detection was off for the model.
    pub not_okay: Option<bool>,
    /// Whether it broke the strict format policy; `None` when the job did not hold it to one.
    pub format_error: Option<bool>,
}

/// Tokens and cost of generations.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub reasoning_tokens: u64,
    /// US dollars; finite and >= 0.
    pub cost_usd: f64,
}

impl Usage {
    fn add(&mut self, other: &Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.cached_prompt_tokens += other.cached_prompt_tokens;
        self.reasoning_tokens += other.reasoning_tokens;
        self.cost_usd += other.cost_usd;
    }
}

/// What [`job_metrics`] reports besides the fixed definitions.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsParams {
    /// fast_p thresholds p (finite, >= 0): a kernel is fast when correct and its speedup is strictly above p.
    pub fast_p: Vec<f64>,
    /// Quantiles in [0, 1] of the speedup distributions.
    pub quantiles: Vec<f64>,
    /// Sizes k (>= 1) of best@k and avg@k; empty takes 1, 2, 4, ... up to and including the most trajectories
    /// any task has.
    pub ks: Vec<u32>,
    /// Seconds from the job's start to now or its end, as the caller measured them. Finite and >= 0.
    pub elapsed_s: f64,
}

impl Default for MetricsParams {
    fn default() -> Self {
        Self { fast_p: DEFAULT_FAST_P.to_vec(), quantiles: DEFAULT_QUANTILES.to_vec(), ks: Vec::new(), elapsed_s: 0.0 }
    }
}

/// `numerator / denominator`, both kept so a reader can check and aggregate them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ratio {
    pub numerator: u64,
    pub denominator: u64,
}

impl Ratio {
    /// The ratio; 0 when the denominator is 0 (read the denominator to tell "none" from "nothing measured").
    pub fn value(&self) -> f64 {
        if self.denominator == 0 { 0.0 } else { self.numerator as f64 / self.denominator as f64 }
    }

    fn of(numerator: usize, denominator: usize) -> Self {
        Self { numerator: numerator as u64, denominator: denominator as u64 }
    }
}

/// fast_p at one threshold, against each baseline.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FastP {
    pub threshold: f64,
    /// Correct kernels with eager speedup > p / evaluated turns less correct kernels without an eager speedup.
    pub eager: Ratio,
    /// The same against torch.compile.
    pub compile: Ratio,
}

/// Rates over a slice of turns (the whole job, one turn index, one level).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rates {
    /// Turns in the slice.
    pub turns: u64,
    /// Turns whose evaluation was an infrastructure error: in no denominator.
    pub infra_errors: u64,
    /// correct / evaluated.
    pub correct: Ratio,
    /// compile errors / evaluated.
    pub compile_error: Ratio,
    /// hacks / evaluated.
    pub hack: Ratio,
    /// junk responses / responses.
    pub junk: Ratio,
    /// responses without a kernel / responses.
    pub no_kernel: Ratio,
    /// not-okay responses / responses checked for it; `None` when none was.
    pub not_okay: Option<Ratio>,
    /// responses that broke the strict format / responses held to it; `None` when none was.
    pub format_error: Option<Ratio>,
    /// One entry per threshold, in the order asked.
    pub fast_p: Vec<FastP>,
}

impl Rates {
    /// Turns with a verdict other than an infrastructure error: the evaluation ratios' denominator.
    pub fn evaluated(&self) -> u64 {
        self.correct.denominator
    }
}

/// Distribution of the speedups of correct kernels against one baseline.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SpeedupStats {
    /// Correct kernels with a speedup against this baseline: the denominator of every figure below.
    pub count: u64,
    /// Correct kernels without one (the baseline failed or the kernel was not timed).
    pub missing: u64,
    /// Arithmetic mean; 0 when `count` is 0, like every figure here.
    pub mean: f64,
    /// `exp(mean(ln s))`.
    pub geomean: f64,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// (q, value) for each quantile asked, by linear interpolation between order statistics.
    pub quantiles: Vec<(f64, f64)>,
}

/// best@k and avg@k of one per-kernel value at one (k, turn budget).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AtKValue {
    /// Mean over tasks of the expected best of k trajectories.
    pub best: f64,
    /// Mean over tasks of the mean over trajectories.
    pub avg: f64,
    /// Tasks counted: those with at least k measured trajectories (and, for speedups, no unmeasured correct turn
    /// within the budget).
    pub tasks: u64,
}

/// best@k and avg@k at one trajectory count k and turn budget (turns `0..turns` of each trajectory).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AtK {
    pub k: u32,
    pub turns: u32,
    /// Correctness: 1 if any turn within the budget was correct.
    pub correct: AtKValue,
    /// Best eager speedup within the budget, 0 without a correct turn.
    pub speedup_eager: AtKValue,
    /// Best torch.compile speedup within the budget, 0 without a correct turn.
    pub speedup_compile: AtKValue,
}

/// What a job cost, with the per-kernel figures' denominators.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Cost {
    /// Totals over every turn.
    pub usage: Usage,
    /// Sum of the turns' wall times (turns run concurrently, so this exceeds `elapsed_s`).
    pub turn_seconds: f64,
    /// The caller's elapsed time of the job.
    pub elapsed_s: f64,
    /// Cost and turn seconds per task (CudaForge's "per kernel": one kernel is the job's answer for a task).
    pub per_task: Spend,
    /// Per evaluated candidate.
    pub per_evaluated: Spend,
    /// Per correct kernel.
    pub per_correct: Spend,
}

/// Totals divided by `count`; 0 when `count` is 0.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Spend {
    pub count: u64,
    pub cost_usd: f64,
    pub seconds: f64,
}

/// Every metric of a job.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct JobMetrics {
    pub tasks: u64,
    pub trajectories: u64,
    pub overall: Rates,
    /// (turn index, rates of the turns with that index), by turn.
    pub by_turn: Vec<(u32, Rates)>,
    /// (level, rates of its tasks' turns), by level; level 0 is "no level".
    pub by_level: Vec<(u32, Rates)>,
    pub speedup_eager: SpeedupStats,
    pub speedup_compile: SpeedupStats,
    /// By k, then turn budget 1..=n.
    pub at_k: Vec<AtK>,
    pub cost: Cost,
    /// Each task's best correct turn, by task.
    pub best: Vec<BestKernel>,
}

/// A task's best correct turn: the highest speedup against eager (a timed kernel before an untimed one), the
/// earliest trajectory and turn on a tie, so the same turns always give the same answer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BestKernel {
    pub task: String,
    pub trajectory: u32,
    pub turn: u32,
    pub speedup_eager: Option<f64>,
    pub speedup_compile: Option<f64>,
}

/// Computes every metric of a job from its turns. Empty input gives zero counts, never NaN.
pub fn job_metrics(params: &MetricsParams, samples: &[TurnSample]) -> Result<JobMetrics, InvalidInput> {
    validate(params, samples)?;
    let all: Vec<&TurnSample> = samples.iter().collect();
    let by = |key: fn(&TurnSample) -> u32| {
        let mut groups: BTreeMap<u32, Vec<&TurnSample>> = BTreeMap::new();
        for sample in samples {
            groups.entry(key(sample)).or_default().push(sample);
        }
        groups.into_iter().map(|(key, slice)| (key, rates(params, &slice))).collect()
    };
    let overall = rates(params, &all);
    let trajectories: BTreeSet<(&str, u32)> = samples.iter().map(|s| (s.task.as_str(), s.trajectory)).collect();
    let tasks: BTreeSet<&str> = samples.iter().map(|s| s.task.as_str()).collect();
    let correct: Vec<&TurnSample> = samples.iter().filter(|s| s.verdict == Some(Verdict::Correct)).collect();
    let cost = cost(params, samples, tasks.len(), &overall);
    Ok(JobMetrics {
        tasks: tasks.len() as u64,
        trajectories: trajectories.len() as u64,
        by_turn: by(|s| s.turn),
        by_level: by(|s| s.level),
        speedup_eager: speedup_stats(&params.quantiles, &correct, |s| s.speedup_eager),
        speedup_compile: speedup_stats(&params.quantiles, &correct, |s| s.speedup_compile),
        at_k: at_k(params, samples),
        best: best_kernels(&correct),
        overall,
        cost,
    })
}

fn best_kernels(correct: &[&TurnSample]) -> Vec<BestKernel> {
    let mut best: BTreeMap<&str, &TurnSample> = BTreeMap::new();
    for &sample in correct {
        let rank = |s: &TurnSample| (s.speedup_eager.unwrap_or(-1.0), std::cmp::Reverse((s.trajectory, s.turn)));
        let better = best.get(sample.task.as_str()).is_none_or(|kept| {
            let (a, b) = (rank(sample), rank(kept));
            a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).is_gt()
        });
        if better {
            best.insert(&sample.task, sample);
        }
    }
    best.into_values()
        .map(|s| BestKernel {
            task: s.task.clone(),
            trajectory: s.trajectory,
            turn: s.turn,
            speedup_eager: s.speedup_eager,
            speedup_compile: s.speedup_compile,
        })
        .collect()
}

fn validate(params: &MetricsParams, samples: &[TurnSample]) -> Result<(), InvalidInput> {
    for (i, &p) in params.fast_p.iter().enumerate() {
        if !(p.is_finite() && p >= 0.0) {
            return Err(InvalidInput::new(format!("fast_p[{i}]"), format!("must be finite and >= 0, got {p}")));
        }
    }
    for (i, &q) in params.quantiles.iter().enumerate() {
        within(|| format!("quantiles[{i}]"), q, 0.0, 1.0)?;
    }
    if let Some(i) = params.ks.iter().position(|&k| k == 0) {
        return Err(InvalidInput::new(format!("ks[{i}]"), "must be >= 1"));
    }
    non_negative(|| "elapsed_s".into(), params.elapsed_s)?;
    let mut seen: HashMap<(&str, u32, u32), usize> = HashMap::new();
    let mut levels: HashMap<&str, (u32, usize)> = HashMap::new();
    for (i, sample) in samples.iter().enumerate() {
        let field = |name: &str| format!("samples[{i}].{name}");
        for (name, value) in [("speedup_eager", sample.speedup_eager), ("speedup_compile", sample.speedup_compile)] {
            if let Some(v) = value {
                crate::positive(|| field(name), v)?;
            }
        }
        non_negative(|| field("wall_time_s"), sample.wall_time_s)?;
        non_negative(|| field("usage.cost_usd"), sample.usage.cost_usd)?;
        if let Some(first) = seen.insert((&sample.task, sample.trajectory, sample.turn), i) {
            return Err(InvalidInput::new(
                format!("samples[{i}]"),
                format!("repeats task, trajectory and turn of samples[{first}]"),
            ));
        }
        let (level, first) = *levels.entry(&sample.task).or_insert((sample.level, i));
        if level != sample.level {
            return Err(InvalidInput::new(
                field("level"),
                format!("is {} but samples[{first}] of the same task has {level}", sample.level),
            ));
        }
    }
    Ok(())
}

fn non_negative(field: impl FnOnce() -> String, value: f64) -> Result<f64, InvalidInput> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(InvalidInput::new(field(), format!("must be finite and >= 0, got {value}")))
    }
}

fn is_evaluated(sample: &TurnSample) -> bool {
    sample.verdict.is_some_and(|v| v != Verdict::InfraError)
}

fn is_hack(sample: &TurnSample) -> bool {
    sample.hack || sample.verdict == Some(Verdict::Hack)
}

fn rates(params: &MetricsParams, slice: &[&TurnSample]) -> Rates {
    let evaluated: Vec<&TurnSample> = slice.iter().copied().filter(|s| is_evaluated(s)).collect();
    let count = |f: &dyn Fn(&TurnSample) -> bool| evaluated.iter().filter(|s| f(s)).count();
    let correct = count(&|s| s.verdict == Some(Verdict::Correct));
    let responses: Vec<ResponseSample> = slice.iter().filter_map(|s| s.response).collect();
    let checked: Vec<bool> = responses.iter().filter_map(|r| r.not_okay).collect();
    let formats: Vec<bool> = responses.iter().filter_map(|r| r.format_error).collect();
    let fast = |p: f64, speedup: fn(&TurnSample) -> Option<f64>| {
        let unmeasured = count(&|s| s.verdict == Some(Verdict::Correct) && speedup(s).is_none());
        let fast = count(&|s| s.verdict == Some(Verdict::Correct) && speedup(s).is_some_and(|v| v > p));
        Ratio::of(fast, evaluated.len() - unmeasured)
    };
    Rates {
        turns: slice.len() as u64,
        infra_errors: slice.iter().filter(|s| s.verdict == Some(Verdict::InfraError)).count() as u64,
        correct: Ratio::of(correct, evaluated.len()),
        compile_error: Ratio::of(count(&|s| s.verdict == Some(Verdict::CompileError)), evaluated.len()),
        hack: Ratio::of(count(&|s| is_hack(s)), evaluated.len()),
        junk: Ratio::of(responses.iter().filter(|r| r.junk).count(), responses.len()),
        no_kernel: Ratio::of(responses.iter().filter(|r| r.no_kernel).count(), responses.len()),
        not_okay: (!checked.is_empty()).then(|| Ratio::of(checked.iter().filter(|&&b| b).count(), checked.len())),
        format_error: (!formats.is_empty()).then(|| Ratio::of(formats.iter().filter(|&&b| b).count(), formats.len())),
        fast_p: params
            .fast_p
            .iter()
            .map(|&p| FastP {
                threshold: p,
                eager: fast(p, |s| s.speedup_eager),
                compile: fast(p, |s| s.speedup_compile),
            })
            .collect(),
    }
}

fn speedup_stats(quantiles: &[f64], correct: &[&TurnSample], speedup: fn(&TurnSample) -> Option<f64>) -> SpeedupStats {
    let mut values: Vec<f64> = correct.iter().filter_map(|s| speedup(s)).collect();
    let missing = (correct.len() - values.len()) as u64;
    if values.is_empty() {
        return SpeedupStats {
            missing,
            quantiles: quantiles.iter().map(|&q| (q, 0.0)).collect(),
            ..SpeedupStats::default()
        };
    }
    values.sort_by(f64::total_cmp);
    let n = values.len() as f64;
    SpeedupStats {
        count: values.len() as u64,
        missing,
        mean: values.iter().sum::<f64>() / n,
        geomean: (values.iter().map(|v| v.ln()).sum::<f64>() / n).exp(),
        median: quantile(&values, 0.5),
        min: values[0],
        max: values[values.len() - 1],
        quantiles: quantiles.iter().map(|&q| (q, quantile(&values, q))).collect(),
    }
}

/// The q-quantile of sorted, non-empty values: linear interpolation between the order statistics around
/// `q * (n - 1)` (numpy's default).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    let position = q * (sorted.len() - 1) as f64;
    let below = position.floor() as usize;
    let above = position.ceil() as usize;
    let fraction = position - below as f64;
    if below == above { sorted[below] } else { sorted[below] + (sorted[above] - sorted[below]) * fraction }
}

/// The expected maximum of `k` values drawn without replacement from `values` (all equally likely subsets):
/// with `v_1 <= ... <= v_m`, `sum_{i >= k} v_i * C(i-1, k-1) / C(m, k)`. `k = 1` is the mean, `k = m` the maximum.
/// Needs `1 <= k <= values.len()`.
pub fn expected_best_of(values: &[f64], k: usize) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let m = sorted.len();
    // Weights from the top down: w_m = k / m, w_{i-1} = w_i * (i - k) / (i - 1), which stays in floating range.
    let mut weight = k as f64 / m as f64;
    let mut total = 0.0;
    for i in (k..=m).rev() {
        total += sorted[i - 1] * weight;
        if i > 1 {
            weight *= (i - k) as f64 / (i - 1) as f64;
        }
    }
    total
}

/// Per-kernel value for a best@k / avg@k: `None` when the kernel is correct but unmeasured.
type KernelValue = fn(&TurnSample) -> Option<f64>;

fn at_k(params: &MetricsParams, samples: &[TurnSample]) -> Vec<AtK> {
    // task -> trajectory -> turns in order.
    let mut tasks: BTreeMap<&str, BTreeMap<u32, Vec<&TurnSample>>> = BTreeMap::new();
    for sample in samples {
        tasks.entry(&sample.task).or_default().entry(sample.trajectory).or_default().push(sample);
    }
    for trajectories in tasks.values_mut() {
        for turns in trajectories.values_mut() {
            turns.sort_by_key(|s| s.turn);
        }
    }
    let max_m = tasks.values().map(BTreeMap::len).max().unwrap_or(0) as u32;
    let max_turns = samples.iter().map(|s| s.turn + 1).max().unwrap_or(0);
    let ks: Vec<u32> = if params.ks.is_empty() {
        let mut ks: Vec<u32> =
            std::iter::successors(Some(1u32), |k| k.checked_mul(2)).take_while(|&k| k < max_m).collect();
        if max_m > 0 {
            ks.push(max_m);
        }
        ks
    } else {
        params.ks.clone()
    };
    let correct: KernelValue = |s| Some(if s.verdict == Some(Verdict::Correct) { 1.0 } else { 0.0 });
    let eager: KernelValue = |s| if s.verdict == Some(Verdict::Correct) { s.speedup_eager } else { Some(0.0) };
    let compile: KernelValue = |s| if s.verdict == Some(Verdict::Correct) { s.speedup_compile } else { Some(0.0) };
    let mut out = Vec::new();
    for &k in &ks {
        for budget in 1..=max_turns {
            out.push(AtK {
                k,
                turns: budget,
                correct: at_k_value(&tasks, k, budget, correct),
                speedup_eager: at_k_value(&tasks, k, budget, eager),
                speedup_compile: at_k_value(&tasks, k, budget, compile),
            });
        }
    }
    out
}

fn at_k_value(
    tasks: &BTreeMap<&str, BTreeMap<u32, Vec<&TurnSample>>>,
    k: u32,
    budget: u32,
    value: KernelValue,
) -> AtKValue {
    let (mut best, mut avg, mut counted) = (0.0, 0.0, 0u64);
    'tasks: for trajectories in tasks.values() {
        let mut values = Vec::new();
        for turns in trajectories.values() {
            // Infrastructure errors measured nothing; a trajectory with only those (within the budget) is left out.
            let measured = turns.iter().filter(|s| s.turn < budget && s.verdict != Some(Verdict::InfraError));
            let mut trajectory_best: Option<f64> = None;
            for sample in measured {
                let Some(v) = value(sample) else { continue 'tasks };
                trajectory_best = Some(trajectory_best.map_or(v, |b: f64| b.max(v)));
            }
            // A turn with no verdict (no kernel) measured a failure: value 0.
            if let Some(v) = trajectory_best {
                values.push(v);
            }
        }
        if values.len() >= k as usize && !values.is_empty() {
            best += expected_best_of(&values, k as usize);
            avg += values.iter().sum::<f64>() / values.len() as f64;
            counted += 1;
        }
    }
    if counted == 0 {
        AtKValue::default()
    } else {
        AtKValue { best: best / counted as f64, avg: avg / counted as f64, tasks: counted }
    }
}

fn cost(params: &MetricsParams, samples: &[TurnSample], tasks: usize, overall: &Rates) -> Cost {
    let mut usage = Usage::default();
    for sample in samples {
        usage.add(&sample.usage);
    }
    let turn_seconds: f64 = samples.iter().map(|s| s.wall_time_s).sum();
    let spend = |count: u64| {
        if count == 0 {
            Spend::default()
        } else {
            Spend { count, cost_usd: usage.cost_usd / count as f64, seconds: turn_seconds / count as f64 }
        }
    };
    Cost {
        per_task: spend(tasks as u64),
        per_evaluated: spend(overall.evaluated()),
        per_correct: spend(overall.correct.numerator),
        usage,
        turn_seconds,
        elapsed_s: params.elapsed_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(task: &str, trajectory: u32, turn: u32, verdict: Option<Verdict>, eager: Option<f64>) -> TurnSample {
        TurnSample {
            task: task.into(),
            trajectory,
            turn,
            verdict,
            speedup_eager: eager,
            speedup_compile: eager.map(|s| s / 2.0),
            response: Some(ResponseSample { not_okay: Some(false), ..ResponseSample::default() }),
            wall_time_s: 2.0,
            usage: Usage { prompt_tokens: 100, completion_tokens: 10, cost_usd: 0.01, ..Usage::default() },
            ..TurnSample::default()
        }
    }

    const C: Option<Verdict> = Some(Verdict::Correct);
    const W: Option<Verdict> = Some(Verdict::Incorrect);

    #[test]
    fn worked_example_with_its_denominators() {
        let samples = vec![
            turn("a", 0, 0, W, None),
            turn("a", 0, 1, C, Some(1.5)),
            turn("a", 1, 0, C, Some(0.8)),
            turn("a", 1, 1, Some(Verdict::CompileError), None),
            // Task b lacks the torch.compile baseline, and one turn met an infrastructure error.
            TurnSample { speedup_compile: None, ..turn("b", 0, 0, C, Some(3.0)) },
            turn("b", 0, 1, Some(Verdict::InfraError), None),
            TurnSample { hack: true, ..turn("b", 1, 0, Some(Verdict::Rejected), None) },
            TurnSample {
                response: Some(ResponseSample {
                    junk: true,
                    no_kernel: true,
                    not_okay: Some(true),
                    format_error: None,
                }),
                ..turn("b", 1, 1, None, None)
            },
        ];
        let params = MetricsParams { elapsed_s: 5.0, ..MetricsParams::default() };
        let m = job_metrics(&params, &samples).expect("valid");
        let o = &m.overall;
        assert_eq!((m.tasks, m.trajectories, o.turns, o.infra_errors, o.evaluated()), (2, 4, 8, 1, 6));
        assert_eq!(o.correct, Ratio { numerator: 3, denominator: 6 });
        assert_eq!((o.compile_error.numerator, o.hack.numerator), (1, 1));
        assert_eq!(o.junk, Ratio { numerator: 1, denominator: 8 });
        assert_eq!(o.not_okay, Some(Ratio { numerator: 1, denominator: 8 }));
        // fast_1 against eager: 1.5 and 3.0 of 6; against compile: 0.75, 0.4 and b's unmeasured -> 0 of 5.
        assert_eq!((o.fast_p[0].eager, o.fast_p[0].compile), (Ratio::of(2, 6), Ratio::of(0, 5)));
        assert_eq!(o.fast_p[3].eager, Ratio::of(1, 6), "fast_2 is strictly above 2");
        let e = &m.speedup_eager;
        assert_eq!((e.count, e.missing, e.median, e.min, e.max), (3, 0, 1.5, 0.8, 3.0));
        assert!((e.geomean - (1.5f64 * 0.8 * 3.0).powf(1.0 / 3.0)).abs() < 1e-12);
        assert_eq!((m.speedup_compile.count, m.speedup_compile.missing), (2, 1));
        // By turn: turn 0 has a, a, b, b (correct 2 of 4); turn 1 has one infra error out of its denominator.
        assert_eq!(m.by_turn[0].1.correct, Ratio::of(2, 4));
        assert_eq!((m.by_turn[1].1.correct, m.by_turn[1].1.infra_errors), (Ratio::of(1, 2), 1));
        // at-k with k = 2 over both turns: a's trajectories are correct (1, 1), b's (1, 0).
        let full = m.at_k.iter().find(|a| a.k == 2 && a.turns == 2).expect("k = 2, two turns");
        assert_eq!((full.correct.best, full.correct.avg, full.correct.tasks), (1.0, 0.75, 2));
        // Eager speedups: a (1.5, 0.8) -> best 1.5, mean 1.15; b (3.0, 0) -> 3.0, 1.5.
        assert!((full.speedup_eager.best - 2.25).abs() < 1e-12 && (full.speedup_eager.avg - 1.325).abs() < 1e-12);
        // b has an unmeasured correct turn against torch.compile: only a counts.
        assert_eq!(full.speedup_compile.tasks, 1);
        let first = m.at_k.iter().find(|a| a.k == 1 && a.turns == 1).expect("k = 1, one turn");
        assert_eq!(first.correct.avg, 0.5);
        assert_eq!((m.cost.usage.prompt_tokens, m.cost.per_task.count, m.cost.per_correct.count), (800, 2, 3));
        assert!((m.cost.per_task.cost_usd - 0.04).abs() < 1e-12 && m.cost.per_task.seconds == 8.0);
        assert_eq!(m.cost.elapsed_s, 5.0);
        // Each task's answer: a's trajectory 0 turn 1 (1.5 beats 0.8), b's only correct turn.
        let best: Vec<(&str, u32, u32, Option<f64>)> =
            m.best.iter().map(|b| (b.task.as_str(), b.trajectory, b.turn, b.speedup_eager)).collect();
        assert_eq!(best, [("a", 0, 1, Some(1.5)), ("b", 0, 0, Some(3.0))]);
    }

    #[test]
    fn the_best_kernel_is_the_fastest_correct_turn_and_ties_go_to_the_earliest() {
        let samples = vec![
            turn("t", 1, 0, C, Some(2.0)),
            turn("t", 0, 2, C, Some(2.0)),
            turn("t", 0, 3, W, None),
            turn("t", 2, 0, C, None),
            turn("u", 0, 0, C, None),
            turn("u", 0, 1, C, Some(0.5)),
            turn("v", 0, 0, W, None),
        ];
        let m = job_metrics(&MetricsParams::default(), &samples).expect("valid");
        let best: Vec<(&str, u32, u32)> = m.best.iter().map(|b| (b.task.as_str(), b.trajectory, b.turn)).collect();
        // t: two at 2.0, trajectory 0 first; u: a timed kernel beats an untimed one; v: nothing correct.
        assert_eq!(best, [("t", 0, 2), ("u", 0, 1)]);
    }

    #[test]
    fn nothing_yet_gives_zeros() {
        let m = job_metrics(&MetricsParams::default(), &[]).expect("valid");
        assert_eq!((m.tasks, m.overall.correct.value(), m.speedup_eager.geomean, m.at_k.len()), (0, 0.0, 0.0, 0));
        assert_eq!(m.overall.not_okay, None);
    }

    #[test]
    fn bad_input_names_the_field() {
        let ok = turn("a", 0, 0, C, Some(1.0));
        let cases = [
            (vec![ok.clone(), TurnSample { speedup_eager: Some(f64::NAN), ..ok.clone() }], "samples[1].speedup_eager"),
            (vec![TurnSample { wall_time_s: -1.0, ..ok.clone() }], "samples[0].wall_time_s"),
            (vec![ok.clone(), ok.clone()], "samples[1]"),
            (vec![ok.clone(), TurnSample { turn: 1, level: 2, ..ok.clone() }], "samples[1].level"),
        ];
        for (samples, field) in cases {
            assert_eq!(job_metrics(&MetricsParams::default(), &samples).expect_err(field).field, field);
        }
        let bad = MetricsParams { ks: vec![0], ..MetricsParams::default() };
        assert_eq!(job_metrics(&bad, &[]).expect_err("k 0").field, "ks[0]");
        let bad = MetricsParams { quantiles: vec![1.5], ..MetricsParams::default() };
        assert_eq!(job_metrics(&bad, &[]).expect_err("q").field, "quantiles[0]");
    }

    #[test]
    fn expected_best_of_small_cases() {
        assert_eq!(expected_best_of(&[1.0, 3.0], 1), 2.0);
        assert_eq!(expected_best_of(&[1.0, 3.0], 2), 3.0);
        // Pairs of {0, 1, 2}: max 1, 2, 2 -> 5/3.
        assert!((expected_best_of(&[2.0, 0.0, 1.0], 2) - 5.0 / 3.0).abs() < 1e-12);
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0], 0.5), 2.5);
    }
}
