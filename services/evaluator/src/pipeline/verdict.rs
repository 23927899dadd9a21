//! A mismatch in its proto form (how a candidate stage that did not finish cleanly is judged is the engine's:
//! `Engine::candidate_result`).

use kforge_execution::protocol::MismatchRecord;
use kforge_proto::v1 as pb;

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
            changed: false,
        };
        let trial = mismatch_proto(&record(Some(3)));
        assert_eq!((trial.trial, trial.output_index, &trial.element_index[..]), (3, 2, &[1, 4][..]));
        assert!(trial.expected.is_nan());
        assert_eq!((trial.got, trial.max_abs_error, trial.detail.as_str()), (1.5, f64::INFINITY, "shape"));
        assert_eq!(mismatch_proto(&record(Some(-1))).trial, u32::MAX);
        assert_eq!(mismatch_proto(&record(None)).trial, u32::MAX);
    }
}
