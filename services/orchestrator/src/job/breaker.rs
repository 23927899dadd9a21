//! The failing-turns breaker: counts a job's recorded turns, in the order they are recorded across its episodes,
//! that failed on a service call for the same reason, and says when there have been enough of them in a row to fail
//! the job. A turn fails on a service call when its `error` is set (a peer refused or could not be reached: the
//! episode ends there); what a model does wrong (a format error, a kernel that does not compile, an incorrect one)
//! is a verdict, not an error, and resets the count like any turn without an error. An evaluation that ended in
//! VERDICT_INFRA_ERROR after its retries counts as a failure of the evaluator (`evaluator: INFRA_ERROR`): a kernel
//! that faults its device causes one, but an evaluator that cannot run anything (its Python broken, its disk full)
//! fails every turn so, and the job would otherwise run to its end.

use std::borrow::Cow;

use kforge_proto::v1 as pb;

/// The most of the last failure's text that the job's error quotes (it is stored, and sent with every update).
const LAST_ERROR_BYTES: usize = 512;

/// A streak of turns that failed for the same reason.
#[derive(Debug, Default)]
pub(super) struct Breaker {
    /// Failed turns in a row that make the job fail; 0: never.
    threshold: u32,
    /// The streak's reason (`failure_class`) and length.
    class: String,
    failed: u32,
}

/// What a recorded turn did to the streak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Observed {
    /// The turn has no error: no streak.
    Passed,
    /// The turn failed for another reason than the turn before (or the first): a streak of one starts.
    NewStreak,
    /// The turn failed as the ones before it did: the streak is this long, short of the threshold.
    Again(u32),
    /// The streak reached the threshold: the job fails with this reason.
    Tripped(String),
}

impl Breaker {
    pub(super) fn new(threshold: u32) -> Self {
        Self { threshold, ..Self::default() }
    }

    /// Counts a recorded turn whose `error` is this (empty: none).
    pub(super) fn observe(&mut self, error: &str) -> Observed {
        if error.is_empty() {
            self.failed = 0;
            self.class.clear();
            return Observed::Passed;
        }
        let class = failure_class(error);
        let observed = if self.failed > 0 && self.class == class {
            self.failed += 1;
            Observed::Again(self.failed)
        } else {
            self.class = class.to_owned();
            self.failed = 1;
            Observed::NewStreak
        };
        if self.threshold > 0 && self.failed >= self.threshold {
            return Observed::Tripped(format!(
                "breaker: {} consecutive turns failed with {class} (the last: \"{}\")",
                self.failed,
                head(error, LAST_ERROR_BYTES)
            ));
        }
        observed
    }
}

/// What a recorded turn failed on, for the breaker (empty: nothing): its error, or its evaluation's infrastructure
/// error, as `evaluator: INFRA_ERROR: <its first line>`.
pub(super) fn turn_failure(turn: &pb::TurnRecord) -> Cow<'_, str> {
    match &turn.evaluation {
        _ if !turn.error.is_empty() => Cow::Borrowed(&turn.error),
        Some(evaluation) if evaluation.verdict() == pb::Verdict::InfraError => {
            let line = evaluation.error.lines().next().unwrap_or_default();
            Cow::Owned(format!("evaluator: INFRA_ERROR: {line}"))
        }
        _ => Cow::Borrowed(""),
    }
}

/// The start of `text`, at most `limit` bytes at a character boundary, marked where cut.
fn head(text: &str, limit: usize) -> Cow<'_, str> {
    if text.len() <= limit {
        return Cow::Borrowed(text);
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}[...]", &text[..end]))
}

/// A turn's failure without what differs from turn to turn: the peer and the status code of `peer: Code: message`
/// (the orchestrator's own errors read `peer: what happened` and are taken whole).
pub(super) fn failure_class(error: &str) -> &str {
    match error.match_indices(": ").nth(1) {
        Some((end, _)) => &error[..end],
        None => error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_infrastructure_verdict_is_the_evaluator_s_failure() {
        let evaluated = |verdict: pb::Verdict| pb::TurnRecord {
            evaluation: Some(pb::EvaluateResponse {
                verdict: verdict.into(),
                error: "device lost\ntraceback".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let infra = evaluated(pb::Verdict::InfraError);
        let failure = turn_failure(&infra);
        assert_eq!(failure, "evaluator: INFRA_ERROR: device lost");
        assert_eq!(failure_class(&failure), "evaluator: INFRA_ERROR");
        assert_eq!(turn_failure(&evaluated(pb::Verdict::CompileError)), "", "the model's failure is a verdict");
        let failed = pb::TurnRecord { error: "gateway: Unavailable: down".into(), ..Default::default() };
        assert_eq!(turn_failure(&failed), "gateway: Unavailable: down");
    }

    #[test]
    fn the_trip_quotes_the_last_failure_bounded() {
        let mut breaker = Breaker::new(1);
        let error = format!("gateway: Unknown: {}", "é".repeat(1000));
        let Observed::Tripped(reason) = breaker.observe(&error) else { panic!("a threshold of one trips at once") };
        assert!(reason.len() < 700 && reason.ends_with("[...]\")"), "{} bytes: {reason}", reason.len());
    }

    #[test]
    fn a_failure_s_class_is_its_peer_and_code() {
        assert_eq!(failure_class("gateway: NotFound: replay file has no response for j/t/0/1"), "gateway: NotFound");
        assert_eq!(
            failure_class("gateway: the response held no completion"),
            "gateway: the response held no completion"
        );
        assert_eq!(failure_class("evaluator: Unavailable: a: b: c"), "evaluator: Unavailable");
    }

    #[test]
    fn the_breaker_trips_on_the_nth_failure_in_a_row_of_one_class_only() {
        let mut breaker = Breaker::new(3);
        let missing = |key: &str| format!("gateway: NotFound: replay file has no response for {key}");
        assert_eq!(breaker.observe(&missing("a")), Observed::NewStreak);
        assert_eq!(breaker.observe(&missing("b")), Observed::Again(2), "the same class, another key");
        assert_eq!(breaker.observe(""), Observed::Passed, "a turn without an error ends the streak");
        assert_eq!(breaker.observe(&missing("c")), Observed::NewStreak);
        assert_eq!(breaker.observe(&missing("d")), Observed::Again(2));
        assert_eq!(breaker.observe("evaluator: Unavailable: down"), Observed::NewStreak, "another class restarts");
        assert_eq!(breaker.observe(&missing("e")), Observed::NewStreak);
        assert_eq!(breaker.observe(&missing("f")), Observed::Again(2));
        assert_eq!(
            breaker.observe(&missing("g")),
            Observed::Tripped(
                "breaker: 3 consecutive turns failed with gateway: NotFound (the last: \
                 \"gateway: NotFound: replay file has no response for g\")"
                    .into()
            )
        );
    }

    #[test]
    fn a_threshold_of_zero_never_trips() {
        let mut breaker = Breaker::new(0);
        for _ in 0..1000 {
            assert!(!matches!(breaker.observe("gateway: Unavailable: down"), Observed::Tripped(_)));
        }
    }
}
