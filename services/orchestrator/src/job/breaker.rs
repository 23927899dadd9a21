//! The failing-turns breaker: counts a job's recorded turns, in the order they are recorded across its episodes,
//! that failed on a service call for the same reason, and says when there have been enough of them in a row to fail
//! the job. A turn fails on a service call when its `error` is set (a peer refused or could not be reached: the
//! episode ends there); what a model does wrong (a format error, a kernel that does not compile, an incorrect one)
//! is a verdict, not an error, and resets the count like any turn without an error. So does an INFRA_ERROR verdict:
//! it is retried already, and a candidate can cause one (a kernel that faults its device).

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
                "breaker: {} consecutive turns failed with {class} (the last: \"{error}\")",
                self.failed
            ));
        }
        observed
    }
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
