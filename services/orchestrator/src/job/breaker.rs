//! The failing-turns breaker: counts a job's recorded turns, in the order they are recorded across its episodes,
//! that failed on a service call for the same reason, and says when there have been enough of them in a row to fail
//! the job. A turn fails on a service call when it has a [`TurnFailure`] (a peer refused or could not be reached:
//! the episode ends there); what a model does wrong (a format error, a kernel that does not compile, an incorrect
//! one) is a verdict, not a failure, and resets the count like any turn that did not fail. An evaluation that ended
//! in VERDICT_INFRA_ERROR after its retries counts as a failure of the evaluator (`evaluator: INFRA_ERROR`): a kernel
//! that faults its device causes one, but an evaluator that cannot run anything (its Python broken, its disk full)
//! fails every turn so, and the job would otherwise run to its end.

use std::borrow::Cow;
use std::fmt;

use kforge_proto::v1 as pb;

use crate::failure::TurnFailure;

/// The most of the last failure's text that the job's error quotes (it is stored, and sent with every update).
const LAST_ERROR_BYTES: usize = 512;

/// A streak of turns that failed for the same reason.
#[derive(Debug, Default)]
pub(super) struct Breaker {
    /// Failed turns in a row that make the job fail; 0: never.
    threshold: u32,
    /// The streak's reason and length (0: no streak).
    class: Option<Class>,
    failed: u32,
}

/// What a recorded turn did to the streak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Observed {
    /// The turn did not fail: no streak.
    Passed,
    /// The turn failed for another reason than the turn before (or the first): a streak of one starts.
    NewStreak,
    /// The turn failed as the ones before it did: the streak is this long, short of the threshold.
    Again(u32),
    /// The streak reached the threshold: the job fails with this reason.
    Tripped(String),
}

/// What a recorded turn failed on, as the breaker counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Failure<'a> {
    /// A call of the turn's failed.
    Call(&'a TurnFailure),
    /// Its evaluation ended in VERDICT_INFRA_ERROR after its retries: the evaluator's failure, with the first line
    /// of the evaluation's error.
    Infrastructure(&'a str),
}

impl<'a> Failure<'a> {
    /// What `turn`, recorded with `failure`, failed on; `None`: nothing (its verdict is the model's).
    pub(super) fn of(failure: Option<&'a TurnFailure>, turn: &'a pb::TurnRecord) -> Option<Self> {
        match (failure, &turn.evaluation) {
            (Some(failure), _) => Some(Self::Call(failure)),
            (None, Some(evaluation)) if evaluation.verdict() == pb::Verdict::InfraError => {
                Some(Self::Infrastructure(evaluation.error.lines().next().unwrap_or_default()))
            }
            (None, _) => None,
        }
    }

    /// The failure without what differs from turn to turn.
    fn class(self) -> Class {
        match self {
            Self::Call(TurnFailure::Generation(refusal)) => Class::Generation(refusal.code),
            Self::Call(TurnFailure::NoCompletion) => Class::NoCompletion,
            Self::Call(TurnFailure::Evaluation(refusal)) => Class::Evaluation(refusal.code),
            Self::Call(TurnFailure::Reward(refusal)) => Class::Reward(refusal.code),
            Self::Call(TurnFailure::Unrecognized(text)) => Class::Unrecognized(text.clone()),
            Self::Infrastructure(_) => Class::Infrastructure,
        }
    }
}

/// `evaluator: INFRA_ERROR: <the first line>` for an infrastructure verdict; a call's failure as it is stored.
impl fmt::Display for Failure<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Call(failure) => write!(f, "{failure}"),
            Self::Infrastructure(line) => write!(f, "evaluator: INFRA_ERROR: {line}"),
        }
    }
}

/// A failure's reason, as a streak shares it: the peer and the status code of a refusal, whatever its message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Class {
    Generation(tonic::Code),
    NoCompletion,
    Evaluation(tonic::Code),
    Reward(tonic::Code),
    Infrastructure,
    /// A failure whose text is all there is to it (never a turn this orchestrator takes: only a stored one).
    Unrecognized(String),
}

/// `gateway: NotFound`, as the breaker's reason names it.
impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Generation(code) => write!(f, "gateway: {code:?}"),
            Self::NoCompletion => write!(f, "{}", TurnFailure::NoCompletion),
            Self::Evaluation(code) => write!(f, "evaluator: {code:?}"),
            Self::Reward(code) => write!(f, "reward: {code:?}"),
            Self::Infrastructure => f.write_str("evaluator: INFRA_ERROR"),
            Self::Unrecognized(text) => f.write_str(text),
        }
    }
}

impl Breaker {
    pub(super) fn new(threshold: u32) -> Self {
        Self { threshold, ..Self::default() }
    }

    /// Counts a recorded turn that failed on this (`None`: it did not fail).
    pub(super) fn observe(&mut self, failure: Option<Failure<'_>>) -> Observed {
        let Some(failure) = failure else {
            self.failed = 0;
            self.class = None;
            return Observed::Passed;
        };
        let class = failure.class();
        let observed = if self.class.as_ref() == Some(&class) {
            self.failed += 1;
            Observed::Again(self.failed)
        } else {
            self.failed = 1;
            Observed::NewStreak
        };
        let observed = match self.threshold > 0 && self.failed >= self.threshold {
            true => Observed::Tripped(format!(
                "breaker: {} consecutive turns failed with {class} (the last: \"{}\")",
                self.failed,
                head(&failure.to_string(), LAST_ERROR_BYTES)
            )),
            false => observed,
        };
        self.class = Some(class);
        observed
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::failure::Refusal;

    fn refused(code: tonic::Code, message: &str) -> Refusal {
        Refusal { code, message: message.to_owned() }
    }

    fn missing(key: &str) -> TurnFailure {
        TurnFailure::Generation(refused(tonic::Code::NotFound, &format!("replay file has no response for {key}")))
    }

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
        let failure = Failure::of(None, &infra).expect("an infrastructure verdict is a failure");
        assert_eq!(failure, Failure::Infrastructure("device lost"));
        assert_eq!(failure.to_string(), "evaluator: INFRA_ERROR: device lost");
        assert_eq!(failure.class().to_string(), "evaluator: INFRA_ERROR");
        assert_eq!(Failure::of(None, &evaluated(pb::Verdict::CompileError)), None, "the model's failure is a verdict");
        let down = TurnFailure::Evaluation(refused(tonic::Code::Unavailable, "down"));
        assert_eq!(Failure::of(Some(&down), &infra), Some(Failure::Call(&down)), "the call's failure comes first");
        assert_eq!(Failure::Call(&down).to_string(), "evaluator: Unavailable: down");
    }

    #[test]
    fn the_trip_quotes_the_last_failure_bounded() {
        let mut breaker = Breaker::new(1);
        let failure = TurnFailure::Generation(refused(tonic::Code::Unknown, &"é".repeat(1000)));
        let Observed::Tripped(reason) = breaker.observe(Some(Failure::Call(&failure))) else {
            panic!("a threshold of one trips at once")
        };
        assert!(reason.len() < 700 && reason.ends_with("[...]\")"), "{} bytes: {reason}", reason.len());
    }

    #[test]
    fn a_failure_s_class_is_its_peer_and_code() {
        let class = |failure: &TurnFailure| Failure::Call(failure).class().to_string();
        assert_eq!(class(&missing("j/t/0/1")), "gateway: NotFound");
        assert_eq!(class(&TurnFailure::NoCompletion), "gateway: the response held no completion");
        assert_eq!(
            class(&TurnFailure::Evaluation(refused(tonic::Code::Unavailable, "a: b: c"))),
            "evaluator: Unavailable"
        );
        assert_eq!(class(&TurnFailure::Reward(refused(tonic::Code::Internal, "x"))), "reward: Internal");
    }

    #[test]
    fn the_breaker_trips_on_the_nth_failure_in_a_row_of_one_class_only() {
        let mut breaker = Breaker::new(3);
        let mut observe = |failure: Option<&TurnFailure>| breaker.observe(failure.map(Failure::Call));
        assert_eq!(observe(Some(&missing("a"))), Observed::NewStreak);
        assert_eq!(observe(Some(&missing("b"))), Observed::Again(2), "the same class, another key");
        assert_eq!(observe(None), Observed::Passed, "a turn that did not fail ends the streak");
        assert_eq!(observe(Some(&missing("c"))), Observed::NewStreak);
        assert_eq!(observe(Some(&missing("d"))), Observed::Again(2));
        let down = TurnFailure::Evaluation(refused(tonic::Code::Unavailable, "down"));
        assert_eq!(observe(Some(&down)), Observed::NewStreak, "another class restarts");
        assert_eq!(observe(Some(&missing("e"))), Observed::NewStreak);
        assert_eq!(observe(Some(&missing("f"))), Observed::Again(2));
        assert_eq!(
            observe(Some(&missing("g"))),
            Observed::Tripped(
                "breaker: 3 consecutive turns failed with gateway: NotFound (the last: \
                 \"gateway: NotFound: replay file has no response for g\")"
                    .into()
            )
        );
        assert!(matches!(observe(Some(&missing("h"))), Observed::Tripped(_)), "past the threshold, still tripped");
    }

    #[test]
    fn a_threshold_of_zero_never_trips() {
        let mut breaker = Breaker::new(0);
        let down = TurnFailure::Generation(refused(tonic::Code::Unavailable, "down"));
        for _ in 0..1000 {
            assert!(!matches!(breaker.observe(Some(Failure::Call(&down))), Observed::Tripped(_)));
        }
    }
}
