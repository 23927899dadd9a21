//! The evaluator's verdict rules, pure: each judges what a stage reported (the timed calls the candidate kept, the
//! comparison with the reference, the timing samples, the census) and says whether the evaluation goes on or stops,
//! with the verdict and the finding that decides it. How the static checks, the compile and a candidate stage that
//! did not finish cleanly are judged is the engine's (`Engine::check`, `Engine::build`, `Engine::candidate_result`),
//! shared with the profiler.

use kforge_execution::census;
use kforge_execution::protocol::{CandidateResult, TimedOutput};
use kforge_execution::{Finding, Judgement, Verdict};
use kforge_static_checks::Category;

use super::baseline::Baseline;
use super::check::Trial;
use super::timing::{self, Measured};

/// The timed calls whose outputs the check covers (none when the candidate was not timed); a report of what the
/// harness cannot have done is a hack.
pub(super) fn timed_outputs(measured: bool, result: &CandidateResult) -> Result<Vec<TimedOutput>, Judgement> {
    match measured {
        true => timing::timed_outputs(result).map_err(Judgement::hack),
        false => Ok(vec![]),
    }
}

/// The outputs' verdict: a `mismatch` is incorrect (a re-check's on fresh inputs, or the replay's near the
/// tolerance, may be rounding), unless the work changed after it was checked: a timed call's output wrong while
/// every trial passed, or the replay of trial 0 far outside the tolerance, are hacks.
pub(super) fn outputs(mismatch: Option<Trial>) -> Result<(), Judgement> {
    let changed = match mismatch {
        None => return Ok(()),
        Some(Trial::Index(_)) => return Err(Judgement::verdict(Verdict::Incorrect)),
        Some(Trial::Timed) => Finding::hack(
            "runtime.timed_output_mismatch",
            "the output of a timed call is wrong although the correctness trials, the replay of trial 0 and the \
             re-checks passed: the work done under measurement differs from the work that was checked",
        ),
        Some(Trial::Changed(index)) => Finding::hack(
            "runtime.changed_after_check",
            format!(
                "trial {index} repeats trial 0's inputs after timing and the census, and its output is far outside \
                 the tolerance although trial 0's was within it"
            ),
        ),
    };
    Err(Judgement::hack(changed))
}

/// The candidate's timing samples; impossible ones are a hack.
pub(super) fn samples(result: &CandidateResult) -> Result<Measured, Judgement> {
    timing::timing_samples(result).map_err(Judgement::hack)
}

/// The wall-clock cross-check of `measured` against `baseline`: work the timer could not see is a hack.
pub(super) fn wall_clock(measured: &Measured, baseline: &Baseline) -> Result<(), Judgement> {
    match timing::wall_clock_mismatch(measured, baseline) {
        Some(finding) => Err(Judgement::hack(finding)),
        None => Ok(()),
    }
}

/// The census's records, as the candidate's run reported them; malformed ones are a hack.
pub(super) fn census_records<E: std::fmt::Display>(
    records: Result<Vec<census::ModeRecords>, E>,
) -> Result<Vec<census::ModeRecords>, Judgement> {
    records.map_err(|error| {
        Judgement::hack(Finding::hack(
            "runtime.census_unreadable",
            format!("the census records are malformed: {error}"),
        ))
    })
}

/// The census's verdict: any finding of category hack among its `findings` (which the evaluation reports already)
/// is a hack.
pub(super) fn census(findings: &[kforge_static_checks::Finding]) -> Result<(), Judgement> {
    match findings.iter().any(|f| f.category == Category::Hack) {
        true => Err(Judgement::verdict(Verdict::Hack)),
        false => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decided(judgement: Result<impl std::fmt::Debug, Judgement>) -> (Verdict, Vec<String>) {
        let judgement = judgement.expect_err("a stop");
        (judgement.verdict, judgement.findings.iter().map(|f| f.code.to_string()).collect())
    }

    fn codes(codes: &[&str]) -> Vec<String> {
        codes.iter().map(|code| (*code).to_owned()).collect()
    }

    #[test]
    fn a_mismatch_is_incorrect_unless_the_work_changed_after_the_check() {
        assert!(outputs(None).is_ok());
        assert_eq!(decided(outputs(Some(Trial::Index(3)))), (Verdict::Incorrect, vec![]));
        let timed = decided(outputs(Some(Trial::Timed)));
        assert_eq!(timed, (Verdict::Hack, codes(&["runtime.timed_output_mismatch"])));
        let changed = outputs(Some(Trial::Changed(5))).expect_err("a stop");
        assert_eq!(changed.verdict, Verdict::Hack);
        assert_eq!(changed.findings[0].code, "runtime.changed_after_check");
        assert!(changed.findings[0].message.starts_with("trial 5 repeats trial 0's inputs"));
    }

    #[test]
    fn kept_timed_calls_the_harness_cannot_have_made_are_a_hack_only_when_timed() {
        let forged = CandidateResult { samples_ms: vec![1.0], ..CandidateResult::default() };
        assert_eq!(decided(timed_outputs(true, &forged)), (Verdict::Hack, codes(&["timing.impossible"])));
        assert_eq!(timed_outputs(false, &forged), Ok(vec![]), "not timed: nothing kept is checked");
        assert_eq!(timed_outputs(true, &CandidateResult::default()), Ok(vec![]));
    }

    #[test]
    fn impossible_samples_and_hidden_work_are_hacks() {
        assert_eq!(decided(samples(&CandidateResult::default())), (Verdict::Hack, codes(&["timing.impossible"])));
        let result = CandidateResult { samples_ms: vec![1.0; 5], host_ms: vec![3.0; 5], ..CandidateResult::default() };
        let measured = samples(&result).expect("possible samples");
        let baseline =
            |gap: f64| Baseline { eager: vec![10.0; 5], eager_host: Some(vec![10.0 + gap; 5]), compiled: None };
        let hidden = decided(wall_clock(&measured, &baseline(0.0)));
        assert_eq!(hidden, (Verdict::Hack, codes(&["timing.wall_clock_mismatch"])));
        assert!(wall_clock(&measured, &baseline(2.0)).is_ok(), "the reference's own overhead is allowed");
    }

    #[test]
    fn a_malformed_census_and_a_census_hack_are_hacks() {
        let unreadable = census_records::<&str>(Err("not a list"));
        let judgement = unreadable.expect_err("a stop");
        assert_eq!(
            (judgement.verdict, judgement.findings[0].code.as_ref()),
            (Verdict::Hack, "runtime.census_unreadable")
        );
        assert_eq!(judgement.findings[0].message, "the census records are malformed: not a list");
        assert!(census_records::<&str>(Ok(vec![])).is_ok());
        let finding = |category| kforge_static_checks::Finding { code: "x", message: String::new(), line: 0, category };
        assert!(census(&[finding(Category::Notice), finding(Category::Policy)]).is_ok());
        assert_eq!(decided(census(&[finding(Category::Notice), finding(Category::Hack)])), (Verdict::Hack, vec![]));
    }
}
