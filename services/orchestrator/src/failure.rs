//! Why a turn failed: a call of its stages that a peer refused or answered with nothing usable. A failed turn ends
//! its episode (not the job), is never credited, and counts towards the failing-turns breaker; what a model does
//! wrong (a format error, a kernel that does not compile) is a verdict, not a failure. The job's code carries the
//! failure typed and decides on it; the store and the wire keep its text (`TurnRecord.error`, empty for a turn that
//! did not fail), rendered once where the turn is recorded and read back by [`TurnFailure::of`] for the recorded
//! turns a job resumes from, a step replays, the credit skips and the protocol faces show.

use std::fmt;

use kforge_proto::v1 as pb;

/// Why a turn failed. Its text (`Display`) is what the store and the wire keep, unchanged since the first stored
/// turn: `peer: Code: message` for a refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnFailure {
    /// The gateway refused the generation or could not be reached.
    Generation(Refusal),
    /// The gateway answered with no completion in its response.
    NoCompletion,
    /// The evaluator refused the evaluation or could not be reached (after the retries its policy allows).
    Evaluation(Refusal),
    /// The reward service refused to score or to diagnose the turn, or could not be reached.
    Reward(Refusal),
    /// A stored failure in a text none of the above renders (a record written otherwise): a failure all the same,
    /// kept whole.
    Unrecognized(String),
}

/// A peer's refusal of a call: its status's code and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: tonic::Code,
    pub message: String,
}

impl From<&tonic::Status> for Refusal {
    fn from(status: &tonic::Status) -> Self {
        Self { code: status.code(), message: status.message().to_owned() }
    }
}

/// `ResourceExhausted: queue full`: the code as its Rust name, which is what stored failures have always said.
impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)
    }
}

/// What the gateway's answer without a completion is stored as, after `gateway: `.
const NO_COMPLETION: &str = "the response held no completion";

impl fmt::Display for TurnFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Generation(refusal) => write!(f, "gateway: {refusal}"),
            Self::NoCompletion => write!(f, "gateway: {NO_COMPLETION}"),
            Self::Evaluation(refusal) => write!(f, "evaluator: {refusal}"),
            Self::Reward(refusal) => write!(f, "reward: {refusal}"),
            Self::Unrecognized(text) => f.write_str(text),
        }
    }
}

impl TurnFailure {
    /// A recorded turn's failure, read back from the text it was stored as; `None`: the turn did not fail.
    pub fn of(record: &pb::TurnRecord) -> Option<Self> {
        Self::read(&record.error)
    }

    /// The failure whose text is `text` (the inverse of `Display`); `None` for the empty text of a turn that did not
    /// fail, `Unrecognized` for a text no other variant renders.
    fn read(text: &str) -> Option<Self> {
        if text.is_empty() {
            return None;
        }
        let refusal = |rest: &str| {
            let (name, message) = rest.split_once(": ")?;
            Some(Refusal { code: code_named(name)?, message: message.to_owned() })
        };
        let read = match text.split_once(": ") {
            Some(("gateway", NO_COMPLETION)) => Some(Self::NoCompletion),
            Some(("gateway", rest)) => refusal(rest).map(Self::Generation),
            Some(("evaluator", rest)) => refusal(rest).map(Self::Evaluation),
            Some(("reward", rest)) => refusal(rest).map(Self::Reward),
            _ => None,
        };
        Some(read.unwrap_or_else(|| Self::Unrecognized(text.to_owned())))
    }
}

/// The gRPC code whose Rust name (`Debug`) is `name`.
fn code_named(name: &str) -> Option<tonic::Code> {
    // The codes are 0 (Ok) to 16 (Unauthenticated); `from_i32` maps anything else to Unknown.
    (0..=16).map(tonic::Code::from_i32).find(|code| format!("{code:?}") == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(code: tonic::Code, message: &str) -> Refusal {
        Refusal { code, message: message.to_owned() }
    }

    #[test]
    fn each_failure_is_stored_in_the_text_turns_have_always_had() {
        let cases = [
            (TurnFailure::Generation(refusal(tonic::Code::Unavailable, "down")), "gateway: Unavailable: down"),
            (TurnFailure::NoCompletion, "gateway: the response held no completion"),
            (
                TurnFailure::Evaluation(refusal(tonic::Code::ResourceExhausted, "queue full")),
                "evaluator: ResourceExhausted: queue full",
            ),
            (TurnFailure::Reward(refusal(tonic::Code::Unknown, "")), "reward: Unknown: "),
            (TurnFailure::Unrecognized("gateway: unavailable".into()), "gateway: unavailable"),
        ];
        for (failure, text) in cases {
            assert_eq!(failure.to_string(), text);
            assert_eq!(TurnFailure::read(text), Some(failure), "{text} reads back as the failure it renders");
        }
    }

    #[test]
    fn a_refusal_renders_its_status_code_and_message() {
        let status = tonic::Status::not_found("replay file has no response for j/t/0/1");
        let failure = TurnFailure::Generation(Refusal::from(&status));
        assert_eq!(failure.to_string(), "gateway: NotFound: replay file has no response for j/t/0/1");
    }

    #[test]
    fn every_stored_text_reads_back_to_itself_and_only_the_empty_one_is_no_failure() {
        assert_eq!(TurnFailure::of(&pb::TurnRecord::default()), None);
        for text in [
            "evaluator: Unavailable: a: b: c",
            "gateway: Ok: ",
            "reward: NotACode: x",
            "reward: Unavailable",
            "judge: Unknown: x",
            "gateway: the response held no completion, twice",
            "no separator",
        ] {
            let failure = TurnFailure::read(text).expect("a text is a failure");
            assert_eq!(failure.to_string(), text);
        }
        assert_eq!(
            TurnFailure::read("evaluator: Unavailable: a: b: c"),
            Some(TurnFailure::Evaluation(refusal(tonic::Code::Unavailable, "a: b: c")))
        );
        assert_eq!(
            TurnFailure::read("reward: NotACode: x"),
            Some(TurnFailure::Unrecognized("reward: NotACode: x".into()))
        );
    }

    #[test]
    fn every_code_is_named_as_stored() {
        for i in 0..=16 {
            let code = tonic::Code::from_i32(i);
            assert_eq!(code_named(&format!("{code:?}")), Some(code));
        }
        assert_eq!(code_named("Teapot"), None);
    }
}
