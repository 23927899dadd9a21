//! How a run ended and what it found, in the contract's terms: the fields every response about a run carries.

use kforge_execution::census::KernelRecord;
use kforge_execution::{Finding, Judgement, Stop, Verdict};
use kforge_proto::v1 as pb;
use kforge_static_checks::Category;

/// A run's end as its response reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Ending {
    pub verdict: pb::Verdict,
    /// The run's findings, then those that decided its verdict.
    pub findings: Vec<pb::Finding>,
    /// What the candidate's stage said, how it ended, or the engine's failure.
    pub error: String,
    pub compile_log: String,
    /// Whether the same request may succeed later: only an infrastructure failure that says so.
    pub retryable: bool,
}

/// The end of a run that ended in `end`, having found `findings` on the way: correct, a judgement (whose own
/// findings come after `findings`), or the engine's failure.
pub fn ending(end: Result<(), Stop>, mut findings: Vec<Finding>) -> Ending {
    let (verdict, error, compile_log, retryable) = match end {
        Ok(()) => (Verdict::Correct, String::new(), String::new(), false),
        Err(Stop::Judged(Judgement { verdict, findings: deciding, error, compile_log })) => {
            findings.extend(deciding);
            (verdict, error, compile_log, false)
        }
        Err(Stop::Infra(error)) => (Verdict::InfraError, error.to_string(), String::new(), error.retryable()),
    };
    Ending {
        verdict: self::verdict(verdict),
        findings: findings.into_iter().map(finding).collect(),
        error,
        compile_log,
        retryable,
    }
}

pub fn verdict(verdict: Verdict) -> pb::Verdict {
    match verdict {
        Verdict::Correct => pb::Verdict::Correct,
        Verdict::Incorrect => pb::Verdict::Incorrect,
        Verdict::CompileError => pb::Verdict::CompileError,
        Verdict::RuntimeError => pb::Verdict::RuntimeError,
        Verdict::Timeout => pb::Verdict::Timeout,
        Verdict::Rejected => pb::Verdict::Rejected,
        Verdict::Hack => pb::Verdict::Hack,
        Verdict::InfraError => pb::Verdict::InfraError,
    }
}

pub fn finding(finding: Finding) -> pb::Finding {
    let Finding { code, message, line, category } = finding;
    let category = match category {
        Category::Hack => pb::FindingCategory::Hack,
        Category::Policy => pb::FindingCategory::Policy,
        Category::Notice => pb::FindingCategory::Notice,
    };
    pb::Finding { code: code.into_owned(), message, line, category: category.into() }
}

/// A kernel of the census: the evaluator's `kernels`, the profiler's `census`.
pub fn kernel(record: KernelRecord) -> pb::KernelRecord {
    let KernelRecord { name, own, launches, total_ms, mode } = record;
    pb::KernelRecord { name, own, launches, total_ms, mode }
}

#[cfg(test)]
mod tests {
    use kforge_execution::InfraError;

    use super::*;

    #[test]
    fn a_judgement_reports_its_findings_after_the_runs_and_its_explanation() {
        let judgement = Judgement {
            error: "bad".into(),
            compile_log: "log".into(),
            ..Judgement::hack(Finding::hack("runtime.x", "then"))
        };
        let ending = ending(Err(judgement.into()), vec![Finding::notice("static.notice", "first")]);
        let codes: Vec<&str> = ending.findings.iter().map(|f| f.code.as_str()).collect();
        assert_eq!(codes, ["static.notice", "runtime.x"]);
        assert_eq!(ending.findings[0].category(), pb::FindingCategory::Notice);
        assert_eq!(ending.findings[1].category(), pb::FindingCategory::Hack);
        assert_eq!(
            (ending.verdict, ending.error.as_str(), ending.compile_log.as_str(), ending.retryable),
            (pb::Verdict::Hack, "bad", "log", false)
        );
    }

    #[test]
    fn a_correct_run_says_nothing_more_and_an_engine_failure_says_whether_to_retry() {
        let correct = ending(Ok(()), vec![]);
        assert_eq!(
            correct,
            Ending {
                verdict: pb::Verdict::Correct,
                findings: vec![],
                error: String::new(),
                compile_log: String::new(),
                retryable: false
            }
        );
        let cancelled = ending(Err(Stop::Infra(InfraError::Cancelled)), vec![]);
        assert_eq!(
            (cancelled.verdict, cancelled.error.as_str(), cancelled.retryable),
            (pb::Verdict::InfraError, "cancelled", true)
        );
    }

    #[test]
    fn a_kernel_record_keeps_every_field() {
        let record = KernelRecord { name: "k".into(), own: true, launches: 3, total_ms: 1.5, mode: "eval".into() };
        let wire = kernel(record);
        assert_eq!(
            (wire.name.as_str(), wire.own, wire.launches, wire.total_ms, wire.mode.as_str()),
            ("k", true, 3, 1.5, "eval")
        );
    }
}
