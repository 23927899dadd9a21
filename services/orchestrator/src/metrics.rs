//! A job's metrics from its recorded turns. The figures are reward-core's (`kforge_reward_core::job_metrics`,
//! pure and property-tested, definitions in docs/REWARDS.md); this module only turns records into its samples
//! (through `kforge_reward_proto`, which also converts the result to the message) and names each task's
//! KernelBench level. Recomputed over every recorded turn as turns arrive.

use kforge_proto::v1 as pb;
use kforge_reward_core::{MetricsParams, TurnSample};
use kforge_reward_proto::{Checked, job_metrics_to_proto, turn_sample};

/// Metrics over `turns` of a job of `spec`, with `wall_time_s` since the job started as measured by the caller.
pub fn job_metrics(spec: Option<&pb::JobSpec>, turns: &[pb::TurnRecord], wall_time_s: f64) -> pb::JobMetrics {
    match kforge_reward_core::job_metrics(&params(wall_time_s), &samples(spec, turns)) {
        Ok(metrics) => job_metrics_to_proto(&metrics),
        Err(error) => {
            // A turn the metrics refuse (a non-finite speedup from a faulty evaluator, say) must not stop the job:
            // its turns stay stored and the metrics say only how many there are.
            tracing::error!(%error, "job metrics not computed");
            pb::JobMetrics { turns: turns.len() as u64, wall_time_s, ..Default::default() }
        }
    }
}

/// The metrics' samples of recorded turns of a job of `spec`, one per turn (the job report plots them too). Its
/// responses were checked for their opening unless the spec switched not-okay detection off
/// (`JobSpec.diagnose.not_okay_off`): then the not-okay ratio has no denominator; likewise the format-error ratio
/// without the strict format policy.
pub fn samples(spec: Option<&pb::JobSpec>, turns: &[pb::TurnRecord]) -> Vec<TurnSample> {
    let checked = Checked { not_okay: opening_checked(spec), format: spec.is_some_and(crate::recipe::strict_format) };
    turns.iter().map(|t| turn_sample(t, level(&t.task_id), t.wall_time_s.max(0.0), checked)).collect()
}

/// Whether a job of `spec` checks its responses' openings (`JobSpec.diagnose.not_okay_off` unset).
pub fn opening_checked(spec: Option<&pb::JobSpec>) -> bool {
    !spec.and_then(|s| s.diagnose.as_ref()).is_some_and(|d| d.not_okay_off)
}

/// The metrics' parameters for a job that has run `wall_time_s`.
pub fn params(wall_time_s: f64) -> MetricsParams {
    MetricsParams { elapsed_s: wall_time_s.max(0.0), ..MetricsParams::default() }
}

/// The KernelBench level of a task id (`level2/17_conv` is 2); 0 for tasks without one.
fn level(task_id: &str) -> u32 {
    task_id.strip_prefix("level").and_then(|rest| rest.split('/').next()).and_then(|n| n.parse().ok()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(task: &str, verdict: pb::Verdict, speedup: f64, kernel: &str, flags: pb::ResponseFlags) -> pb::TurnRecord {
        pb::TurnRecord {
            task_id: task.into(),
            verdict: verdict as i32,
            evaluation: (verdict != pb::Verdict::Unspecified).then(|| pb::EvaluateResponse {
                verdict: verdict as i32,
                speedup_eager: speedup,
                ..Default::default()
            }),
            kernel: kernel.into(),
            flags: Some(flags),
            usage: Some(pb::Usage { prompt_tokens: 10, completion_tokens: 5, ..Default::default() }),
            wall_time_s: 2.0,
            ..Default::default()
        }
    }

    #[test]
    fn levels_come_from_kernelbench_task_ids() {
        assert_eq!(
            (level("level2/17_conv"), level("level10/x"), level("examples/relu"), level("levelx/a")),
            (2, 10, 0, 0)
        );
    }

    #[test]
    fn records_become_reward_core_metrics_with_their_denominators() {
        let none = pb::ResponseFlags::default;
        let turns = [
            turn("level1/a", pb::Verdict::Correct, 2.0, "k", none()),
            turn("level1/a", pb::Verdict::Correct, 0.5, "k", none()),
            turn("level1/b", pb::Verdict::Correct, 1.3, "k", none()),
            turn("level2/c", pb::Verdict::Incorrect, 0.0, "k", pb::ResponseFlags { not_okay: true, ..none() }),
            turn("level2/c", pb::Verdict::CompileError, 0.0, "k", none()),
            turn("level2/c", pb::Verdict::Hack, 0.0, "k", pb::ResponseFlags { hack: true, ..none() }),
            // Not evaluated: no kernel (junk), and an infrastructure error: outside the evaluated denominator.
            turn(
                "level2/d",
                pb::Verdict::Unspecified,
                0.0,
                "",
                pb::ResponseFlags { junk: true, no_kernel: true, ..none() },
            ),
            turn("level2/d", pb::Verdict::InfraError, 0.0, "k", none()),
        ];
        // One trajectory per task, its turns in order.
        let mut turns = turns.to_vec();
        for i in 1..turns.len() {
            if turns[i].task_id == turns[i - 1].task_id {
                turns[i].turn = turns[i - 1].turn + 1;
            }
        }
        let m = job_metrics(None, &turns, 12.5);
        assert_eq!((m.turns, m.evaluated, m.correct, m.no_kernel, m.infra_errors), (8, 6, 3, 1, 1));
        assert_eq!(m.correctness, 0.5);
        assert_eq!(m.fast_p["1"], 2.0 / 6.0);
        assert_eq!(m.fast_p["2"], 0.0, "fast_p is strictly faster than p");
        assert_eq!(m.median_speedup, 1.3);
        assert_eq!((m.hacks, m.junk, m.not_okay), (1, 1, 1));
        assert_eq!((m.hack_ratio, m.compile_error_rate), (1.0 / 6.0, 1.0 / 6.0));
        assert_eq!(m.usage.map(|u| (u.prompt_tokens, u.completion_tokens)), Some((80, 40)));
        assert_eq!(m.wall_time_s, 12.5);
        let levels: Vec<(u32, u64)> =
            m.by_level.iter().map(|l| (l.level, l.rates.as_ref().map_or(0, |r| r.turns))).collect();
        assert_eq!(levels, [(1, 3), (2, 5)]);
        assert_eq!(m.tasks, 4);
        assert_eq!(m.cost.map(|c| c.turn_seconds), Some(16.0));
    }

    #[test]
    fn no_turns_gives_zeros_not_nan() {
        let m = job_metrics(None, &[], 0.0);
        assert_eq!(
            (m.evaluated, m.correctness, m.mean_speedup, m.geomean_speedup, m.junk_ratio),
            (0, 0.0, 0.0, 0.0, 0.0)
        );
        assert!(m.fast_p.values().all(|v| *v == 0.0));
    }
}
