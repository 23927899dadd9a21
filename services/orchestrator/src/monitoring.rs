//! The orchestrator's Prometheus metrics, served at `/metrics` with the rest of the server's: every recorded turn
//! by turn index and verdict, its response flags (junk, not-okay, hack...), its response (the junk and not-okay
//! ratios' denominators), whether it was fast (correct and faster than eager), how long it took, and turns in
//! flight by stage across jobs. The ratios the dashboards plot are quotients of these counters (docs/METRICS.md,
//! "Prometheus").
//!
//! Every label set a dashboard reads exists from registration at 0: every turn label (`0`..`14`, `15+`) by every
//! verdict, flag and response kind, and every stage. Prometheus's `rate` and `increase` count a series' increases
//! between scrapes, so a series created by its first event would hide that event from every panel.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use kforge_proto::v1 as pb;

use crate::failure::TurnFailure;

/// Turn indices at and past this one share the label `"15+"`: the label set stays bounded.
const LAST_TURN_LABEL: u32 = 15;

/// The `verdict` label of each verdict a recorded turn can have: the evaluator's (`VERDICT_` dropped, lowercase),
/// `none` (nothing evaluated) and `failed` (a service error).
const VERDICT_LABELS: [&str; 10] = [
    "correct",
    "incorrect",
    "compile_error",
    "runtime_error",
    "timeout",
    "rejected",
    "hack",
    "infra_error",
    "none",
    "failed",
];

/// The `flag` label of each response flag.
const FLAG_LABELS: [&str; 6] = ["junk", "not_okay", "hack", "no_kernel", "truncated", "degenerate"];

/// The stages a turn is in flight in.
const STAGE_LABELS: [&str; 3] = ["generating", "evaluating", "scoring"];

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
struct TurnResponse {
    turn: String,
    /// `true` when the response's opening was checked (the job's not-okay detection is on): the not-okay ratio's
    /// denominator counts these only.
    opening_checked: String,
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
    responses: Family<TurnResponse, Counter>,
    fast: Family<TurnIndex, Counter>,
    turn_seconds: Histogram,
    in_flight: Family<StageLabel, Gauge>,
}

impl OrchestratorMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            turns: Family::default(),
            flags: Family::default(),
            responses: Family::default(),
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
            "Recorded turns by turn index and flag: the response's (junk, not_okay, no_kernel, truncated, degenerate), and \
             hack (a hack verdict, or a rejection with a hack-category finding)",
            metrics.flags.clone(),
        );
        registry.register(
            "responses",
            "Recorded turns whose generation returned a response, by turn index and whether its opening was checked \
             (the junk and not-okay ratios' denominators)",
            metrics.responses.clone(),
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
        metrics.create_every_label_set();
        metrics
    }

    /// Creates every series at 0: 16 turn labels by 10 verdicts, 6 flags, 2 response kinds and fast, plus 3
    /// stages; 307 series in all, whatever the jobs.
    fn create_every_label_set(&self) {
        for turn in (0..=LAST_TURN_LABEL).map(turn_label) {
            for verdict in VERDICT_LABELS {
                let _ = self.turns.get_or_create(&TurnVerdict { turn: turn.clone(), verdict: verdict.to_owned() });
            }
            for flag in FLAG_LABELS {
                let _ = self.flags.get_or_create(&TurnFlag { turn: turn.clone(), flag: flag.to_owned() });
            }
            for opening_checked in ["true", "false"] {
                let label = TurnResponse { turn: turn.clone(), opening_checked: opening_checked.to_owned() };
                let _ = self.responses.get_or_create(&label);
            }
            let _ = self.fast.get_or_create(&TurnIndex { turn });
        }
        for stage in STAGE_LABELS {
            let _ = self.in_flight.get_or_create(&StageLabel { stage: stage.to_owned() });
        }
    }

    /// Counts a recorded turn, `failure` why it failed if it did, of a job whose responses' openings are checked
    /// (not-okay detection on) or not.
    pub fn turn(&self, record: &pb::TurnRecord, failure: Option<&TurnFailure>, opening_checked: bool) {
        let turn = turn_label(record.turn);
        let verdict = match pb::Verdict::try_from(record.verdict) {
            Ok(pb::Verdict::Unspecified) | Err(_) if failure.is_some() => "failed".to_owned(),
            Ok(pb::Verdict::Unspecified) | Err(_) => "none".to_owned(),
            Ok(verdict) => verdict.as_str_name().trim_start_matches("VERDICT_").to_lowercase(),
        };
        self.turns.get_or_create(&TurnVerdict { turn: turn.clone(), verdict }).inc();
        let flags = record.flags.clone().unwrap_or_default();
        if record.flags.is_some() {
            let opening_checked = opening_checked.to_string();
            self.responses.get_or_create(&TurnResponse { turn: turn.clone(), opening_checked }).inc();
        }
        // A hack as the job's metrics count it: the Diagnose flag, or the evaluation itself where Diagnose failed.
        let hack_finding =
            |e: &pb::EvaluateResponse| e.findings.iter().any(|f| f.category == pb::FindingCategory::Hack as i32);
        let hack = flags.hack
            || record.verdict() == pb::Verdict::Hack
            || (record.verdict() == pb::Verdict::Rejected && record.evaluation.as_ref().is_some_and(hack_finding));
        let raised = [
            ("junk", flags.junk),
            ("not_okay", flags.not_okay),
            ("hack", hack),
            ("no_kernel", flags.no_kernel),
            ("truncated", flags.truncated),
            ("degenerate", flags.degenerate),
        ];
        for (flag, _) in raised.into_iter().filter(|(_, raised)| *raised) {
            self.flags.get_or_create(&TurnFlag { turn: turn.clone(), flag: flag.to_owned() }).inc();
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
    use crate::failure::Refusal;

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
        metrics.turn(&turn(0, pb::Verdict::Correct, Some(1.5), false), None, true);
        metrics.turn(&turn(0, pb::Verdict::Correct, Some(0.8), false), None, true);
        metrics.turn(&turn(1, pb::Verdict::Hack, None, true), None, true);
        metrics.turn(&turn(20, pb::Verdict::Unspecified, None, true), None, false);
        let refused = TurnFailure::Generation(Refusal { code: tonic::Code::Unavailable, message: "down".into() });
        metrics.turn(&pb::TurnRecord { turn: 1, ..Default::default() }, Some(&refused), true);
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
            "kforge_orchestrator_responses_total{turn=\"0\",opening_checked=\"true\"} 2",
            "kforge_orchestrator_responses_total{turn=\"15+\",opening_checked=\"false\"} 1",
            "kforge_orchestrator_fast_turns_total{turn=\"0\"} 1",
            "kforge_orchestrator_turn_seconds_count 5",
            "kforge_orchestrator_in_flight{stage=\"evaluating\"} 1",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }

    /// Every series, by name and labels, with its value.
    fn series(registry: &Registry) -> std::collections::BTreeMap<String, f64> {
        let mut text = String::new();
        encode(&mut text, registry).expect("encodes");
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.rsplit_once(' '))
            .map(|(series, value)| (series.to_owned(), value.parse().expect("a number")))
            .collect()
    }

    /// `rate` and `increase` count a series' increases between scrapes: a series created by its first event (at 1)
    /// hides that event. Every series one turn of each kind moves must have been there, at 0, before it.
    #[test]
    fn every_series_a_turn_moves_exists_at_zero_from_registration() {
        let mut registry = Registry::default();
        let metrics = OrchestratorMetrics::register(&mut registry);
        let before = series(&registry);
        assert!(before.values().all(|&v| v == 0.0), "{before:#?}");
        let every_flag = pb::ResponseFlags {
            junk: true,
            not_okay: true,
            hack: true,
            no_kernel: true,
            truncated: true,
            degenerate: true,
            ..Default::default()
        };
        let turns: Vec<pb::TurnRecord> = (0..=8)
            .filter_map(|v| pb::Verdict::try_from(v).ok())
            .flat_map(|verdict| {
                [0, 1, 14, 15, 99].map(|turn| pb::TurnRecord {
                    turn,
                    verdict: verdict.into(),
                    speedup: Some(2.0),
                    flags: Some(every_flag.clone()),
                    ..Default::default()
                })
            })
            .collect();
        let refused = TurnFailure::Evaluation(Refusal { code: tonic::Code::Unavailable, message: "down".into() });
        for (i, turn) in turns.iter().enumerate() {
            metrics.turn(turn, None, i % 2 == 0);
        }
        metrics.turn(&pb::TurnRecord { turn: 3, ..Default::default() }, Some(&refused), true);
        for stage in STAGE_LABELS {
            metrics.in_flight(stage).inc();
        }
        let after = series(&registry);
        let moved: Vec<&String> = after.iter().filter(|&(k, v)| before.get(k) != Some(v)).map(|(k, _)| k).collect();
        assert!(moved.len() > 60, "{moved:#?}");
        for name in moved {
            assert_eq!(before.get(name), Some(&0.0), "{name} was not at 0 before its first event");
        }
        let per_turn = 10 + 6 + 2 + 1;
        let labelled = before.keys().filter(|k| k.contains("turn=\"") || k.contains("stage=\"")).count();
        assert_eq!(labelled, 16 * per_turn + 3, "the documented cardinality");
    }
}
