//! The evaluator's edge with the contract (`kforge.v1`): an evaluation's typed outcome (`record.rs`) made its
//! `EvaluateResponse` (once, when it ends). What it shares with the profiler (how a run ended, findings, kernel records, a request's
//! task and backend, the engine's capabilities, a refused request's status) is `kforge_execution_proto`'s; the
//! evaluator's own parts (timings, the mismatch, the speedups) are here. The messages built here are written out
//! field by field, so a new field of the contract fails to compile until it is handled; the request's own fields
//! are destructured in `pipeline/request.rs`.

use kforge_execution::protocol::MismatchRecord;
use kforge_execution::{Notes, Stop};
use kforge_execution_proto::{self as execution_proto, Ending};
use kforge_proto::v1 as pb;

use super::{Basis, Device, KernelCensus, Record, Timing};
use crate::stats::TimingStats;

/// The response to an evaluation that ended in `end`, from what its stages recorded.
pub(crate) fn response(request_id: String, record: Record, end: Result<(), Stop>) -> pb::EvaluateResponse {
    let Record { notes, device, lane_held: _, device_peak_bytes, mismatch, timing, census } = record;
    let Notes { times, findings, compile_cache_hit } = notes;
    let Ending { verdict, findings, error, compile_log, retryable } = execution_proto::ending(end, findings);
    let Device { name: device, reference_peak_bytes } = device.unwrap_or_default();
    let KernelCensus { kernels, profiling_ratio } = census.unwrap_or_default();
    let Timing { candidate, eager, compiled, speedup_eager, speedup_compile, basis, speedup_spread, against: _ } =
        timing.unwrap_or_default();
    pb::EvaluateResponse {
        request_id,
        verdict: verdict.into(),
        findings,
        compile_log,
        error,
        mismatch: mismatch.map(self::mismatch),
        candidate_timing: candidate.map(timing_stats),
        eager_timing: eager.map(timing_stats),
        compile_timing: compiled.map(timing_stats),
        speedup_eager,
        speedup_compile,
        kernels: kernels.into_iter().map(execution_proto::kernel).collect(),
        profiling_ratio,
        compile_cache_hit,
        stage_ms: times.wire().collect(),
        retryable,
        device,
        request_error: String::new(),
        device_peak_bytes,
        reference_peak_bytes,
        speedup_basis: match basis {
            None => pb::SpeedupBasis::Unspecified,
            Some(Basis::CachedBaseline) => pb::SpeedupBasis::CachedBaseline,
            Some(Basis::Paired) => pb::SpeedupBasis::Paired,
        }
        .into(),
        speedup_spread,
    }
}

fn timing_stats(stats: TimingStats) -> pb::TimingStats {
    let TimingStats { median_ms, iqr_ms, mean_ms, stderr_ms, samples_ms } = stats;
    pb::TimingStats { median_ms, iqr_ms, mean_ms, stderr_ms, samples_ms }
}

fn mismatch(record: MismatchRecord) -> pb::Mismatch {
    let MismatchRecord {
        trial,
        output_index,
        element_index,
        expected,
        got,
        max_abs_error,
        max_rel_error,
        detail,
        changed: _,
    } = record;
    pb::Mismatch {
        // A negative trial (the timed call) reads as none.
        trial: trial.and_then(|t| u64::try_from(t).ok()).unwrap_or(u32::MAX.into()) as u32,
        output_index: output_index.unwrap_or(0) as u32,
        element_index,
        expected,
        got,
        max_abs_error,
        max_rel_error,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use kforge_execution::times::{Stage, StageTimes};
    use kforge_execution::{Finding, Judgement};

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
        let trial = mismatch(record(Some(3)));
        assert_eq!((trial.trial, trial.output_index, &trial.element_index[..]), (3, 2, &[1, 4][..]));
        assert!(trial.expected.is_nan());
        assert_eq!((trial.got, trial.max_abs_error, trial.detail.as_str()), (1.5, f64::INFINITY, "shape"));
        assert_eq!(mismatch(record(Some(-1))).trial, u32::MAX);
        assert_eq!(mismatch(record(None)).trial, u32::MAX);
    }

    #[test]
    fn the_response_reports_the_stops_findings_after_the_runs_and_its_explanation() {
        let mut record = Record::default();
        record.notes.findings.push(Finding::notice("static.notice", "first"));
        record.notes.times.insert(Stage::Compile, 2.0);
        record.notes.compile_cache_hit = true;
        let stop = Judgement { error: "bad".into(), ..Judgement::hack(Finding::hack("runtime.x", "then")) };
        let response = response("r".into(), record, Err(stop.into()));
        assert_eq!(response.verdict(), pb::Verdict::Hack);
        let codes: Vec<&str> = response.findings.iter().map(|f| f.code.as_str()).collect();
        assert_eq!(codes, ["static.notice", "runtime.x"]);
        assert_eq!((response.error.as_str(), response.compile_cache_hit), ("bad", true));
        assert_eq!(response.stage_ms, [("compile".to_owned(), 2.0)].into());
        assert_eq!((response.speedup_basis(), response.retryable), (pb::SpeedupBasis::Unspecified, false));
        let infra = Stop::Infra(kforge_execution::InfraError::Cancelled);
        let response = super::response("r".into(), Record::default(), Err(infra));
        assert_eq!(
            (response.verdict(), response.error.as_str(), response.retryable),
            (pb::Verdict::InfraError, "cancelled", true)
        );
        assert_eq!(StageTimes::default().wire().count(), 0);
    }

    /// The contract's comment on `stage_ms` names every key the stages are timed by.
    #[test]
    fn the_contract_names_every_stage_key() {
        let proto = include_str!("../../../../proto/kforge/v1/evaluator.proto");
        let comment: String = proto
            .lines()
            .take_while(|line| !line.contains("stage_ms = "))
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .take_while(|line| line.trim_start().starts_with("//"))
            .collect();
        for stage in Stage::ALL {
            assert!(comment.contains(&format!("`{}`", stage.as_str())), "`{}` is not in the comment", stage.as_str());
        }
    }
}
