//! `report.json`: the metrics as data, every ratio with its numerator, denominator and value.

use kforge_reward_core::{AtKValue, JobMetrics, Rates, Ratio, SpeedupStats, Spend, TurnSample};
use serde_json::{Value, json};

use crate::{ReportMeta, SPEEDUP_BINS, speedup_histogram, task_lines, usage_by_turn};

/// The report as JSON: `job`, `metrics` (overall, by turn, by level, speedups, at_k, cost), `speedup_histogram`,
/// `usage_by_turn` and `tasks`.
pub fn report_json(meta: &ReportMeta, metrics: &JobMetrics, samples: &[TurnSample]) -> Value {
    let histogram = |speedup: fn(&TurnSample) -> Option<f64>| {
        let counts = speedup_histogram(samples, speedup);
        SPEEDUP_BINS
            .iter()
            .zip(counts)
            .map(|((label, _, _), count)| json!({"bin": label, "count": count}))
            .collect::<Vec<_>>()
    };
    json!({
        "job": {
            "job_id": meta.job_id,
            "recipe": meta.recipe,
            "model": meta.model,
            "task_set": meta.task_set,
            "generated_at": meta.generated_at,
            "pricing": meta.pricing,
        },
        "metrics": {
            "tasks": metrics.tasks,
            "trajectories": metrics.trajectories,
            "overall": rates(&metrics.overall),
            "by_turn": metrics.by_turn.iter().map(|(turn, r)| json!({"turn": turn, "rates": rates(r)})).collect::<Vec<_>>(),
            "by_level": metrics.by_level.iter().map(|(level, r)| json!({"level": level, "rates": rates(r)})).collect::<Vec<_>>(),
            "speedup_eager": speedups(&metrics.speedup_eager),
            "speedup_compile": speedups(&metrics.speedup_compile),
            "at_k": metrics.at_k.iter().map(|a| json!({
                "k": a.k,
                "turns": a.turns,
                "correct": at_k(&a.correct),
                "speedup_eager": at_k(&a.speedup_eager),
                "speedup_compile": at_k(&a.speedup_compile),
            })).collect::<Vec<_>>(),
            "cost": {
                "prompt_tokens": metrics.cost.usage.prompt_tokens,
                "completion_tokens": metrics.cost.usage.completion_tokens,
                "cached_prompt_tokens": metrics.cost.usage.cached_prompt_tokens,
                "reasoning_tokens": metrics.cost.usage.reasoning_tokens,
                "cost_usd": metrics.cost.usage.cost_usd,
                "turn_seconds": metrics.cost.turn_seconds,
                "elapsed_s": metrics.cost.elapsed_s,
                "per_task": spend(&metrics.cost.per_task),
                "per_evaluated": spend(&metrics.cost.per_evaluated),
                "per_correct": spend(&metrics.cost.per_correct),
            },
        },
        "speedup_histogram": {"eager": histogram(|s| s.speedup_eager), "compile": histogram(|s| s.speedup_compile)},
        "usage_by_turn": usage_by_turn(samples).into_iter().map(|(turn, prompt, completion, cost)| json!({
            "turn": turn, "prompt_tokens": prompt, "completion_tokens": completion, "cost_usd": cost,
        })).collect::<Vec<_>>(),
        "tasks": task_lines(samples).into_iter().map(|t| json!({
            "task": t.task,
            "level": t.level,
            "trajectories": t.trajectories,
            "turns": t.turns,
            "correct_turns": t.correct_turns,
            "best_speedup_eager": t.best_speedup_eager,
            "best_speedup_compile": t.best_speedup_compile,
        })).collect::<Vec<_>>(),
    })
}

pub(crate) fn ratio(r: &Ratio) -> Value {
    json!({"numerator": r.numerator, "denominator": r.denominator, "value": r.value()})
}

fn rates(r: &Rates) -> Value {
    json!({
        "turns": r.turns,
        "infra_errors": r.infra_errors,
        "correct": ratio(&r.correct),
        "compile_error": ratio(&r.compile_error),
        "hack": ratio(&r.hack),
        "junk": ratio(&r.junk),
        "no_kernel": ratio(&r.no_kernel),
        "not_okay": r.not_okay.as_ref().map(ratio),
        "format_error": r.format_error.as_ref().map(ratio),
        "fast_p": r.fast_p.iter().map(|f| json!({
            "threshold": f.threshold, "eager": ratio(&f.eager), "compile": ratio(&f.compile),
        })).collect::<Vec<_>>(),
    })
}

fn speedups(s: &SpeedupStats) -> Value {
    json!({
        "count": s.count,
        "missing": s.missing,
        "mean": s.mean,
        "geomean": s.geomean,
        "median": s.median,
        "min": s.min,
        "max": s.max,
        "quantiles": s.quantiles.iter().map(|(q, v)| json!({"q": q, "value": v})).collect::<Vec<_>>(),
    })
}

fn at_k(v: &AtKValue) -> Value {
    json!({"best": v.best, "avg": v.avg, "tasks": v.tasks})
}

fn spend(s: &Spend) -> Value {
    json!({"count": s.count, "cost_usd": s.cost_usd, "seconds": s.seconds})
}
