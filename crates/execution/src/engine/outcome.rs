//! How a run of candidate code ends and what it reports, in the engine's own terms, for the evaluator and the
//! profiler alike: the [`Verdict`], the [`Finding`]s, and a [`Stop`] (a verdict short of correct with what explains
//! it, a [`Judgement`], or the engine's own failure). Each step of a run returns a [`Staged`] outcome: what it made
//! or why the run stops there, and the [`Notes`] (stage times and findings) it adds either way; the run collects the
//! notes with [`Notes::add`], so each step reads `notes.add(step(..))?`. The services turn these into their
//! responses at their gRPC edge, once.

use std::borrow::Cow;

use kforge_static_checks::Category;

use super::InfraError;
use crate::times::StageTimes;

/// What a run found of the candidate (the contract's verdicts, without the unspecified one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    Correct,
    Incorrect,
    CompileError,
    RuntimeError,
    Timeout,
    Rejected,
    Hack,
    /// The engine's own failure, never the candidate's.
    InfraError,
}

/// One thing a check found: by the static checks, the census, or at run time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Stable, dotted: `static.forbidden_import`, `runtime.input_mutation`, `timing.remeasured`.
    pub code: Cow<'static, str>,
    pub message: String,
    /// The source line, 1-based; 0 where the finding is not about a line.
    pub line: u32,
    pub category: Category,
}

impl Finding {
    /// A finding of category hack, about no line (those seen at run time).
    pub fn hack(code: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self { code: code.into(), message: message.into(), line: 0, category: Category::Hack }
    }

    /// A notice, about no line.
    pub fn notice(code: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self { code: code.into(), message: message.into(), line: 0, category: Category::Notice }
    }
}

impl From<kforge_static_checks::Finding> for Finding {
    fn from(finding: kforge_static_checks::Finding) -> Self {
        let kforge_static_checks::Finding { code, message, line, category } = finding;
        Self { code: code.into(), message, line, category }
    }
}

/// A verdict short of correct, and what explains it.
#[derive(Debug, Clone, PartialEq)]
pub struct Judgement {
    pub verdict: Verdict,
    /// The findings that decided it, reported after the run's others.
    pub findings: Vec<Finding>,
    /// What the candidate's stage said, or how it ended (the responses' `error`).
    pub error: String,
    /// What the compiler said (`compile_log`).
    pub compile_log: String,
}

impl Judgement {
    /// `verdict`, with nothing to add to the run's findings.
    pub fn verdict(verdict: Verdict) -> Self {
        Self { verdict, findings: vec![], error: String::new(), compile_log: String::new() }
    }

    /// A hack, decided by `finding`.
    pub fn hack(finding: Finding) -> Self {
        Self { findings: vec![finding], ..Self::verdict(Verdict::Hack) }
    }

    /// `verdict`, which `error` explains.
    pub fn error(verdict: Verdict, error: impl Into<String>) -> Self {
        Self { error: error.into(), ..Self::verdict(verdict) }
    }

    /// A compile error, which the compiler's `log` explains.
    pub fn compile_error(log: impl Into<String>) -> Self {
        Self { compile_log: log.into(), ..Self::verdict(Verdict::CompileError) }
    }
}

/// Why a run ends before its last step.
#[derive(Debug)]
pub enum Stop {
    /// The candidate's verdict.
    Judged(Judgement),
    /// The engine could not complete the run (`VERDICT_INFRA_ERROR`, never the candidate's).
    Infra(InfraError),
}

impl From<Judgement> for Stop {
    fn from(judgement: Judgement) -> Self {
        Stop::Judged(judgement)
    }
}

impl From<InfraError> for Stop {
    fn from(error: InfraError) -> Self {
        Stop::Infra(error)
    }
}

/// What the steps of a run report whatever becomes of it: stage times and findings, in the order they came, and
/// whether the build came from the artifact cache.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Notes {
    pub times: StageTimes,
    pub findings: Vec<Finding>,
    pub compile_cache_hit: bool,
}

impl Notes {
    /// Keeps a step's notes; its outcome: what it made, or why the run stops there.
    pub fn add<T>(&mut self, staged: Staged<T>) -> Result<T, Stop> {
        self.extend(staged.notes);
        staged.outcome
    }

    pub fn extend(&mut self, other: Notes) {
        self.times.extend(other.times);
        self.findings.extend(other.findings);
        self.compile_cache_hit |= other.compile_cache_hit;
    }
}

/// A step's outcome, and the notes it adds either way.
#[derive(Debug)]
#[must_use = "a step's notes and stop are the run's"]
pub struct Staged<T> {
    pub notes: Notes,
    pub outcome: Result<T, Stop>,
}

impl<T> Staged<T> {
    pub fn new(notes: Notes, outcome: Result<T, Stop>) -> Self {
        Self { notes, outcome }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::times::Stage;

    #[test]
    fn a_stop_keeps_the_notes_of_its_step() {
        let mut notes = Notes::default();
        let mut first = Notes::default();
        first.times.insert(Stage::Static, 1.0);
        first.findings.push(Finding::notice("a.notice", "said"));
        assert_eq!(notes.add(Staged::new(first, Ok(7))).ok(), Some(7));
        let mut second = Notes::default();
        second.times.insert(Stage::Compile, 2.0);
        let stop = Judgement::compile_error("log");
        let stopped = notes.add(Staged::<()>::new(second, Err(stop.clone().into())));
        assert!(matches!(stopped, Err(Stop::Judged(judgement)) if judgement == stop));
        assert_eq!((notes.times.get(Stage::Static), notes.times.get(Stage::Compile)), (Some(1.0), Some(2.0)));
        assert_eq!(notes.findings.len(), 1);
    }

    #[test]
    fn static_findings_keep_their_code_line_and_category() {
        let finding = kforge_static_checks::Finding {
            code: "policy.torch_op",
            message: "uses torch.matmul".into(),
            line: 7,
            category: Category::Policy,
        };
        let finding = Finding::from(finding);
        assert_eq!((finding.code.as_ref(), finding.line, finding.category), ("policy.torch_op", 7, Category::Policy));
        assert_eq!(Finding::hack("x", "y").category, Category::Hack);
        assert_eq!(Finding::notice("x", "y").category, Category::Notice);
    }
}
