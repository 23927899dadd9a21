//! Job metrics at the wire boundary: stored turns in, `kforge.v1.JobMetrics` out.
//!
//! The orchestrator builds one [`core::TurnSample`] per recorded turn ([`turn_sample`]), calls
//! [`core::job_metrics`] and sends [`job_metrics_to_proto`]'s message. The figures are reward-core's; nothing here
//! decides a number.

use kforge_proto::v1 as pb;
use kforge_reward_core as core;

/// What a job checked of every response, which a turn's record cannot tell by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Checked {
    /// Not-okay detection was on for the job's model.
    pub not_okay: bool,
    /// The strict format policy held (`TurnRecord.format_error` says which responses broke it).
    pub format: bool,
}

/// The sample of one stored turn. `level` is the task's KernelBench level (0 for none), `wall_time_s` the turn's
/// duration.
pub fn turn_sample(record: &pb::TurnRecord, level: u32, wall_time_s: f64, checked: Checked) -> core::TurnSample {
    // A value this build does not know reads as no verdict, as an unevaluated turn does: the record is kept.
    let verdict = pb::Verdict::try_from(record.verdict).ok().and_then(crate::verdict);
    let evaluation = record.evaluation.as_ref();
    let positive = |v: f64| (v > 0.0).then_some(v);
    let correct = verdict == Some(core::Verdict::Correct);
    let hack_finding = evaluation
        .is_some_and(|e| e.findings.iter().any(|f| f.category == pb::FindingCategory::Hack as i32))
        && verdict == Some(core::Verdict::Rejected);
    // The turn's generations: the model's, and a cudaforge Judge's review of its kernel.
    let mut usage = core::Usage::default();
    for u in record.usage.iter().chain(record.judge.as_ref().and_then(|j| j.usage.as_ref())) {
        usage.prompt_tokens += u.prompt_tokens;
        usage.completion_tokens += u.completion_tokens;
        usage.cached_prompt_tokens += u.cached_prompt_tokens;
        usage.reasoning_tokens += u.reasoning_tokens;
        usage.cost_usd += u.cost_usd;
    }
    core::TurnSample {
        task: record.task_id.clone(),
        level,
        trajectory: record.trajectory,
        turn: record.turn,
        verdict,
        // Speedups of a kernel that was not correct are not speedups of anything; the evaluator's 0 means "none".
        speedup_eager: evaluation.filter(|_| correct).and_then(|e| positive(e.speedup_eager)),
        speedup_compile: evaluation.filter(|_| correct).and_then(|e| positive(e.speedup_compile)),
        hack: hack_finding || record.flags.as_ref().is_some_and(|f| f.hack),
        response: record.flags.as_ref().map(|f| core::ResponseSample {
            junk: f.junk,
            no_kernel: f.no_kernel,
            not_okay: checked.not_okay.then_some(f.not_okay),
            format_error: checked.format.then_some(!record.format_error.is_empty()),
        }),
        wall_time_s,
        usage,
    }
}

/// The wire form of a job's metrics: the summary fields the first slice had, and the full figures.
pub fn job_metrics_to_proto(metrics: &core::JobMetrics) -> pb::JobMetrics {
    let core::JobMetrics {
        tasks,
        trajectories,
        overall,
        by_turn,
        by_level,
        speedup_eager,
        speedup_compile,
        at_k,
        cost,
        best,
    } = metrics;
    let usage = usage(&cost.usage);
    pb::JobMetrics {
        evaluated: overall.evaluated(),
        correctness: overall.correct.value(),
        // `{}` prints 1.0 as `1` and 1.2 as `1.2`: the keys the first slice used.
        fast_p: overall.fast_p.iter().map(|f| (format!("{}", f.threshold), f.eager.value())).collect(),
        mean_speedup: speedup_eager.mean,
        median_speedup: speedup_eager.median,
        geomean_speedup: speedup_eager.geomean,
        hack_ratio: overall.hack.value(),
        junk_ratio: overall.junk.value(),
        not_okay_ratio: overall.not_okay.map_or(0.0, |r| r.value()),
        compile_error_rate: overall.compile_error.value(),
        usage: Some(usage),
        turns: overall.turns,
        correct: overall.correct.numerator,
        no_kernel: overall.no_kernel.numerator,
        format_errors: overall.format_error.map_or(0, |r| r.numerator),
        hacks: overall.hack.numerator,
        junk: overall.junk.numerator,
        not_okay: overall.not_okay.map_or(0, |r| r.numerator),
        infra_errors: overall.infra_errors,
        wall_time_s: cost.elapsed_s,
        tasks: *tasks,
        trajectories: *trajectories,
        overall: Some(rates(overall)),
        by_turn: by_turn.iter().map(|(turn, r)| pb::TurnRates { turn: *turn, rates: Some(rates(r)) }).collect(),
        by_level: by_level.iter().map(|(level, r)| pb::LevelRates { level: *level, rates: Some(rates(r)) }).collect(),
        speedup_eager: Some(speedups(speedup_eager)),
        speedup_compile: Some(speedups(speedup_compile)),
        at_k: at_k
            .iter()
            .map(|a| pb::AtKPoint {
                k: a.k,
                turns: a.turns,
                correct: Some(at_k_values(&a.correct)),
                speedup_eager: Some(at_k_values(&a.speedup_eager)),
                speedup_compile: Some(at_k_values(&a.speedup_compile)),
            })
            .collect(),
        cost: Some(pb::JobCost {
            usage: Some(usage),
            turn_seconds: cost.turn_seconds,
            elapsed_s: cost.elapsed_s,
            per_task: Some(cost_per(&cost.per_task)),
            per_evaluated: Some(cost_per(&cost.per_evaluated)),
            per_correct: Some(cost_per(&cost.per_correct)),
        }),
        best_kernels: best
            .iter()
            .map(|b| pb::BestKernel {
                task_id: b.task.clone(),
                trajectory: b.trajectory,
                turn: b.turn,
                speedup_eager: b.speedup_eager.unwrap_or(0.0),
                speedup_compile: b.speedup_compile.unwrap_or(0.0),
            })
            .collect(),
    }
}

fn usage(usage: &core::Usage) -> pb::Usage {
    pb::Usage {
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        cost_usd: usage.cost_usd,
        cached_prompt_tokens: usage.cached_prompt_tokens,
        reasoning_tokens: usage.reasoning_tokens,
    }
}

fn ratio(ratio: &core::Ratio) -> pb::CountRatio {
    pb::CountRatio { numerator: ratio.numerator, denominator: ratio.denominator, value: ratio.value() }
}

fn rates(rates: &core::Rates) -> pb::JobRates {
    let core::Rates {
        turns,
        infra_errors,
        correct,
        compile_error,
        hack,
        junk,
        no_kernel,
        not_okay,
        format_error,
        fast_p,
    } = rates;
    pb::JobRates {
        turns: *turns,
        infra_errors: *infra_errors,
        correct: Some(ratio(correct)),
        compile_error: Some(ratio(compile_error)),
        hack: Some(ratio(hack)),
        junk: Some(ratio(junk)),
        no_kernel: Some(ratio(no_kernel)),
        not_okay: not_okay.as_ref().map(ratio),
        format_error: format_error.as_ref().map(ratio),
        fast_p: fast_p
            .iter()
            .map(|f| pb::FastPRatio {
                threshold: f.threshold,
                eager: Some(ratio(&f.eager)),
                compile: Some(ratio(&f.compile)),
            })
            .collect(),
    }
}

fn speedups(stats: &core::SpeedupStats) -> pb::SpeedupStats {
    let core::SpeedupStats { count, missing, mean, geomean, median, min, max, quantiles } = stats;
    pb::SpeedupStats {
        count: *count,
        missing: *missing,
        mean: *mean,
        geomean: *geomean,
        median: *median,
        min: *min,
        max: *max,
        quantiles: quantiles.iter().map(|&(q, value)| pb::SpeedupQuantile { q, value }).collect(),
    }
}

fn at_k_values(values: &core::AtKValue) -> pb::AtKValues {
    pb::AtKValues { best: values.best, avg: values.avg, tasks: values.tasks }
}

fn cost_per(spend: &core::Spend) -> pb::CostPer {
    pb::CostPer { count: spend.count, cost_usd: spend.cost_usd, seconds: spend.seconds }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        task: &str,
        turn: u32,
        verdict: pb::Verdict,
        speedup_eager: f64,
        flags: pb::ResponseFlags,
    ) -> pb::TurnRecord {
        pb::TurnRecord {
            task_id: task.into(),
            turn,
            verdict: verdict as i32,
            evaluation: Some(pb::EvaluateResponse {
                verdict: verdict as i32,
                speedup_eager,
                speedup_compile: 0.0,
                ..Default::default()
            }),
            flags: Some(flags),
            usage: Some(pb::Usage { prompt_tokens: 10, completion_tokens: 5, cost_usd: 0.5, ..Default::default() }),
            ..Default::default()
        }
    }

    #[test]
    fn stored_turns_become_samples_and_the_metrics_keep_the_first_slice_fields() {
        let none = pb::ResponseFlags::default;
        let records = [
            record("a", 0, pb::Verdict::Correct, 2.0, none()),
            record("a", 1, pb::Verdict::Incorrect, 3.0, pb::ResponseFlags { not_okay: true, ..none() }),
            record("b", 0, pb::Verdict::InfraError, 0.0, none()),
            pb::TurnRecord {
                flags: Some(pb::ResponseFlags { junk: true, no_kernel: true, ..none() }),
                format_error: "the answer has no fenced code block".into(),
                evaluation: None,
                ..record("b", 1, pb::Verdict::Unspecified, 0.0, none())
            },
        ];
        let both = Checked { not_okay: true, format: true };
        let samples: Vec<core::TurnSample> = records.iter().map(|r| turn_sample(r, 1, 2.0, both)).collect();
        assert_eq!(samples[0].speedup_eager, Some(2.0));
        assert_eq!(samples[1].speedup_eager, None, "an incorrect kernel has no speedup");
        assert_eq!(samples[0].speedup_compile, None, "the evaluator's 0 means no torch.compile baseline");
        assert_eq!(samples[3].verdict, None);
        let params = core::MetricsParams { elapsed_s: 9.0, ..core::MetricsParams::default() };
        let m = job_metrics_to_proto(&core::job_metrics(&params, &samples).expect("valid"));
        assert_eq!((m.turns, m.evaluated, m.correct, m.infra_errors, m.junk, m.not_okay), (4, 2, 1, 1, 1, 1));
        assert_eq!((m.correctness, m.junk_ratio, m.not_okay_ratio, m.wall_time_s), (0.5, 0.25, 0.25, 9.0));
        let format = m.overall.as_ref().and_then(|o| o.format_error).expect("held to the format");
        assert_eq!((m.format_errors, format.numerator, format.denominator), (1, 1, 4));
        let mut keys: Vec<&str> = m.fast_p.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["1", "1.2", "1.5", "2"]);
        assert_eq!(m.fast_p["2"], 0.0);
        assert_eq!(m.fast_p["1.5"], 0.5);
        let overall = m.overall.expect("overall");
        let fast_1 = overall.fast_p[0].compile.expect("compile");
        assert_eq!((fast_1.numerator, fast_1.denominator), (0, 1), "the unmeasured correct kernel is left out");
        assert_eq!(m.speedup_compile.map(|s| (s.count, s.missing)), Some((0, 1)));
        assert_eq!(m.by_turn.iter().map(|t| t.turn).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(m.by_level.iter().map(|l| l.level).collect::<Vec<_>>(), [1]);
        let cost = m.cost.expect("cost");
        assert_eq!(cost.per_correct.map(|c| (c.count, c.cost_usd, c.seconds)), Some((1, 2.0, 8.0)));
        // Not-okay off: the ratio is not measured, so it is absent rather than 0 of something.
        let off: Vec<core::TurnSample> = records.iter().map(|r| turn_sample(r, 1, 2.0, Checked::default())).collect();
        let m = job_metrics_to_proto(&core::job_metrics(&params, &off).expect("valid"));
        assert_eq!((m.not_okay_ratio, m.overall.as_ref().expect("overall").not_okay), (0.0, None));
        assert_eq!((m.format_errors, m.overall.expect("overall").format_error), (0, None), "no format policy");
    }
}
