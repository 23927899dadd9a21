//! The orchestrator's Prometheus metrics, served at `/metrics` with the rest of the server's: every recorded turn
//! by turn index and verdict, its response flags (junk, not-okay, hack...), whether it was fast (correct and faster
//! than eager), how long it took, and turns in flight by stage across jobs. The ratios the dashboards plot are
//! quotients of these counters (docs/METRICS.md, "Prometheus").

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use kforge_proto::v1 as pb;

/// Turn indices at and past this one share the label `"15+"`: the label set stays bounded.
const LAST_TURN_LABEL: u32 = 15;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TurnVerdict {
    turn: String,
    verdict: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TurnFlag {
    turn: String,
    flag: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TurnIndex {
    turn: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabel {
    stage: String,
}

/// The orchestrator's metrics; cheap to clone (every handle is shared).
#[derive(Debug, Clone)]
pub struct OrchestratorMetrics {
    turns: Family<TurnVerdict, Counter>,
    flags: Family<TurnFlag, Counter>,
    fast: Family<TurnIndex, Counter>,
    turn_seconds: Histogram,
    in_flight: Family<StageLabel, Gauge>,
}

impl OrchestratorMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            turns: Family::default(),
            flags: Family::default(),
            fast: Family::default(),
            // 10 ms to ~3 h: a cached evaluation to a long generation and a cold compile.
            turn_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 20)),
            in_flight: Family::default(),
        };
        let registry = registry.sub_registry_with_prefix("kforge_orchestrator");
        registry.register(
            "turns",
            "Recorded turns by turn index and verdict (`none`: nothing evaluated; `failed`: a service error)",
            metrics.turns.clone(),
        );
        registry.register(
            "turn_flags",
            "Recorded turns by turn index and response flag (junk, not_okay, hack, no_kernel, truncated, degenerate)",
            metrics.flags.clone(),
        );
        registry.register(
            "fast_turns",
            "Recorded turns whose kernel was correct and faster than eager (fast_1), by turn index",
            metrics.fast.clone(),
        );
        registry.register(
            "turn_seconds",
            "Wall time of a turn: generation, evaluation, scoring",
            metrics.turn_seconds.clone(),
        );
        registry.register(
            "in_flight",
            "Turns in flight across jobs by stage (generating, evaluating, scoring)",
            metrics.in_flight.clone(),
        );
        metrics
    }

    /// Counts a recorded turn.
    pub fn turn(&self, record: &pb::TurnRecord) {
        let turn = turn_label(record.turn);
        let verdict = match pb::Verdict::try_from(record.verdict) {
            Ok(pb::Verdict::Unspecified) | Err(_) if !record.error.is_empty() => "failed".to_owned(),
            Ok(pb::Verdict::Unspecified) | Err(_) => "none".to_owned(),
            Ok(verdict) => verdict.as_str_name().trim_start_matches("VERDICT_").to_lowercase(),
        };
        self.turns.get_or_create(&TurnVerdict { turn: turn.clone(), verdict }).inc();
        if let Some(flags) = &record.flags {
            let raised = [
                ("junk", flags.junk),
                ("not_okay", flags.not_okay),
                ("hack", flags.hack),
                ("no_kernel", flags.no_kernel),
                ("truncated", flags.truncated),
                ("degenerate", flags.degenerate),
            ];
            for (flag, _) in raised.into_iter().filter(|(_, raised)| *raised) {
                self.flags.get_or_create(&TurnFlag { turn: turn.clone(), flag: flag.to_owned() }).inc();
            }
        }
        if record.verdict() == pb::Verdict::Correct && record.speedup.is_some_and(|s| s > 1.0) {
            self.fast.get_or_create(&TurnIndex { turn }).inc();
        }
        self.turn_seconds.observe(record.wall_time_s.max(0.0));
    }

    /// The gauge of turns in `stage` across jobs.
    pub fn in_flight(&self, stage: &str) -> Gauge {
        self.in_flight.get_or_create(&StageLabel { stage: stage.to_owned() }).clone()
    }
}

fn turn_label(turn: u32) -> String {
    if turn >= LAST_TURN_LABEL { format!("{LAST_TURN_LABEL}+") } else { turn.to_string() }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;

    #[test]
    fn turns_are_counted_by_index_verdict_flag_and_speed() {
        let mut registry = Registry::default();
        let metrics = OrchestratorMetrics::register(&mut registry);
        let turn = |turn, verdict: pb::Verdict, speedup, junk| pb::TurnRecord {
            turn,
            verdict: verdict.into(),
            speedup,
            flags: Some(pb::ResponseFlags { junk, ..Default::default() }),
            wall_time_s: 1.0,
            ..Default::default()
        };
        metrics.turn(&turn(0, pb::Verdict::Correct, Some(1.5), false));
        metrics.turn(&turn(0, pb::Verdict::Correct, Some(0.8), false));
        metrics.turn(&turn(1, pb::Verdict::Hack, None, true));
        metrics.turn(&turn(20, pb::Verdict::Unspecified, None, true));
        metrics.turn(&pb::TurnRecord { turn: 1, error: "gateway: unavailable".into(), ..Default::default() });
        let _evaluating = metrics.in_flight("evaluating");
        _evaluating.inc();
        let mut text = String::new();
        encode(&mut text, &registry).expect("encodes");
        for line in [
            "kforge_orchestrator_turns_total{turn=\"0\",verdict=\"correct\"} 2",
            "kforge_orchestrator_turns_total{turn=\"1\",verdict=\"hack\"} 1",
            "kforge_orchestrator_turns_total{turn=\"15+\",verdict=\"none\"} 1",
            "kforge_orchestrator_turns_total{turn=\"1\",verdict=\"failed\"} 1",
            "kforge_orchestrator_turn_flags_total{turn=\"1\",flag=\"junk\"} 1",
            "kforge_orchestrator_fast_turns_total{turn=\"0\"} 1",
            "kforge_orchestrator_turn_seconds_count 5",
            "kforge_orchestrator_in_flight{stage=\"evaluating\"} 1",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }
}
