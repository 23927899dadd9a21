//! Verdicts and findings, pure: how a candidate stage that did not finish cleanly is judged, and the proto forms
//! of findings and mismatches.

use kforge_proto::v1 as pb;
use kforge_sandbox::{Exit, tail as cap};

use super::InfraError;
use crate::protocol::MismatchRecord;
use crate::stage::StageOutcome;
use crate::static_checks::{self, Category};

/// The verdict of a candidate stage that did not finish cleanly; `None` when it did; an error where the failure
/// is the evaluator's.
pub(super) fn candidate_failure<R>(
    outcome: &StageOutcome<R>,
    response: &mut pb::EvaluateResponse,
) -> Result<Option<pb::Verdict>, InfraError> {
    if outcome.ok() {
        return Ok(None);
    }
    if let Some(hung) = &outcome.hung {
        response.error = format!("the candidate was stopped: {hung}");
        return Ok(Some(pb::Verdict::Timeout));
    }
    let error = cap(&outcome.error_text(), 8000);
    let verdict = match outcome.finished.exit {
        Exit::TimedOut if outcome.candidate_used_its_time() => {
            response.error = format!(
                "the candidate exceeded its stage's time limit and was killed ({:.1} s of {:.1} s in its own calls)",
                outcome.in_calls.as_secs_f64(),
                outcome.running().as_secs_f64()
            );
            return Ok(Some(pb::Verdict::Timeout));
        }
        Exit::TimedOut => {
            return Err(InfraError::OwnTimeLimit { in_calls: outcome.in_calls, running: outcome.running() });
        }
        Exit::Cancelled => return Err(InfraError::Cancelled),
        Exit::Signal(signal) => {
            response.error = format!("the candidate was killed by signal {signal} ({})\n{error}", signal_name(signal));
            pb::Verdict::RuntimeError
        }
        Exit::Code(_) if outcome.result.is_none() => {
            response.error =
                format!("the candidate exited ({:?}) without reporting a result\n{error}", outcome.finished.exit);
            pb::Verdict::RuntimeError
        }
        Exit::Code(_) => {
            // Extensions build at import; Triton compiles a kernel at its first launch.
            let compile = outcome.error_type() == Some("CompilationError")
                || outcome.result.as_ref().and_then(|r| r.phase.as_deref()) == Some("import")
                    && error.contains("Error building extension");
            response.error = error;
            if compile { pb::Verdict::CompileError } else { pb::Verdict::RuntimeError }
        }
    };
    Ok(Some(verdict))
}

/// Whether a stage failed for want of device memory.
pub(super) fn out_of_memory<R>(outcome: &StageOutcome<R>) -> bool {
    !outcome.ok()
        && outcome.finished.exit != Exit::Cancelled
        && outcome.error_text().to_lowercase().contains("out of memory")
}

pub(super) fn signal_name(signal: i32) -> &'static str {
    match signal {
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        24 => "SIGXCPU",
        25 => "SIGXFSZ",
        _ => "signal",
    }
}

/// A run-time finding of category hack.
pub(super) fn hack_finding(code: impl Into<String>, message: impl Into<String>) -> pb::Finding {
    pb::Finding { code: code.into(), message: message.into(), line: 0, category: pb::FindingCategory::Hack as i32 }
}

pub(super) fn finding_proto(finding: &static_checks::Finding) -> pb::Finding {
    let category = match finding.category {
        Category::Hack => pb::FindingCategory::Hack,
        Category::Policy => pb::FindingCategory::Policy,
        Category::Notice => pb::FindingCategory::Notice,
    };
    pb::Finding {
        code: finding.code.into(),
        message: finding.message.clone(),
        line: finding.line,
        category: category as i32,
    }
}

pub(super) fn mismatch_proto(record: &MismatchRecord) -> pb::Mismatch {
    pb::Mismatch {
        // A negative trial (the timed call) reads as none.
        trial: record.trial.and_then(|t| u64::try_from(t).ok()).unwrap_or(u32::MAX.into()) as u32,
        output_index: record.output_index.unwrap_or(0) as u32,
        element_index: record.element_index.clone(),
        expected: record.expected,
        got: record.got,
        max_abs_error: record.max_abs_error,
        max_rel_error: record.max_rel_error,
        detail: record.detail.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatch_of_the_timed_call_names_no_trial() {
        let record = |trial| MismatchRecord {
            trial,
            output_index: Some(2),
            element_index: vec![1, 4],
            expected: f64::NAN,
            got: 1.5,
            max_abs_error: f64::INFINITY,
            max_rel_error: 0.25,
            detail: "shape".into(),
        };
        let trial = mismatch_proto(&record(Some(3)));
        assert_eq!((trial.trial, trial.output_index, &trial.element_index[..]), (3, 2, &[1, 4][..]));
        assert!(trial.expected.is_nan());
        assert_eq!((trial.got, trial.max_abs_error, trial.detail.as_str()), (1.5, f64::INFINITY, "shape"));
        assert_eq!(mismatch_proto(&record(Some(-1))).trial, u32::MAX);
        assert_eq!(mismatch_proto(&record(None)).trial, u32::MAX);
    }

    #[test]
    fn findings_keep_their_category() {
        let finding = static_checks::Finding {
            code: "policy.torch_op",
            message: "uses torch.matmul".into(),
            line: 7,
            category: Category::Policy,
        };
        let proto = finding_proto(&finding);
        assert_eq!((proto.code.as_str(), proto.line), ("policy.torch_op", 7));
        assert_eq!(proto.category, pb::FindingCategory::Policy as i32);
        assert_eq!(hack_finding("x", "y").category, pb::FindingCategory::Hack as i32);
    }

    #[test]
    fn signals_are_named() {
        assert_eq!((signal_name(11), signal_name(9), signal_name(64)), ("SIGSEGV", "SIGKILL", "signal"));
    }
}
