//! The evaluator's edge with the contract (`kforge.v1`): a request's task and backend made the engine's, an
//! evaluation's typed outcome made its `EvaluateResponse` (once, when it ends), the engine's capabilities, and a
//! refused request's status. The messages built here are written out field by field, so a new field of the contract
//! fails to compile until it is handled; the request's own fields are destructured in `pipeline/request.rs`.

use kforge_execution::census::KernelRecord;
use kforge_execution::engine::{Backend, Capabilities, RequestError, RequestedBackend, TaskSource};
use kforge_execution::protocol::MismatchRecord;
use kforge_execution::{Finding, Judgement, Notes, Stop, Verdict};
use kforge_proto::v1 as pb;
use kforge_static_checks::Category;
use tonic::Status;

use crate::pipeline::{Basis, Device, KernelCensus, Record, Timing};
use crate::stats::TimingStats;

/// The response to an evaluation that ended in `end`, from what its stages recorded.
pub(crate) fn response(request_id: String, record: Record, end: Result<(), Stop>) -> pb::EvaluateResponse {
    let Record { notes, device, lane_held: _, device_peak_bytes, mismatch, timing, census } = record;
    let Notes { times, mut findings, compile_cache_hit } = notes;
    let (verdict, error, compile_log, retryable) = match end {
        Ok(()) => (Verdict::Correct, String::new(), String::new(), false),
        Err(Stop::Judged(Judgement { verdict, findings: deciding, error, compile_log })) => {
            findings.extend(deciding);
            (verdict, error, compile_log, false)
        }
        Err(Stop::Infra(error)) => (Verdict::InfraError, error.to_string(), String::new(), error.retryable()),
    };
    let Device { name: device, reference_peak_bytes } = device.unwrap_or_default();
    let KernelCensus { kernels, profiling_ratio } = census.unwrap_or_default();
    let Timing { candidate, eager, compiled, speedup_eager, speedup_compile, basis, speedup_spread, against: _ } =
        timing.unwrap_or_default();
    pb::EvaluateResponse {
        request_id,
        verdict: self::verdict(verdict).into(),
        findings: findings.into_iter().map(self::finding).collect(),
        compile_log,
        error,
        mismatch: mismatch.map(self::mismatch),
        candidate_timing: candidate.map(timing_stats),
        eager_timing: eager.map(timing_stats),
        compile_timing: compiled.map(timing_stats),
        speedup_eager,
        speedup_compile,
        kernels: kernels.into_iter().map(kernel).collect(),
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

pub(crate) fn verdict(verdict: Verdict) -> pb::Verdict {
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

pub(crate) fn finding(finding: Finding) -> pb::Finding {
    let Finding { code, message, line, category } = finding;
    let category = match category {
        Category::Hack => pb::FindingCategory::Hack,
        Category::Policy => pb::FindingCategory::Policy,
        Category::Notice => pb::FindingCategory::Notice,
    };
    pb::Finding { code: code.into_owned(), message, line, category: category.into() }
}

fn kernel(record: KernelRecord) -> pb::KernelRecord {
    let KernelRecord { name, own, launches, total_ms, mode } = record;
    pb::KernelRecord { name, own, launches, total_ms, mode }
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

/// What the engine can run, as `GetCapabilities` answers it.
pub(crate) fn capabilities(capabilities: Capabilities) -> pb::GetCapabilitiesResponse {
    let Capabilities {
        backends,
        devices,
        policies,
        sandbox,
        versions,
        queue_capacity,
        python,
        disk_budget_bytes,
        memory_files_bytes,
    } = capabilities;
    let backend = |backend| match backend {
        Backend::Cpu => pb::Backend::Cpu,
        Backend::Cuda => pb::Backend::Cuda,
        Backend::Triton => pb::Backend::Triton,
    };
    pb::GetCapabilitiesResponse {
        backends: backends.into_iter().map(|b| backend(b).into()).collect(),
        devices,
        policies,
        sandbox: sandbox
            .into_iter()
            .map(|p| pb::SandboxProtection { name: p.name.into(), active: p.active, detail: p.detail })
            .collect(),
        versions: versions.into_iter().collect(),
        queue_capacity: queue_capacity as u32,
        python,
        disk_budget_bytes,
        memory_files_bytes,
    }
}

/// A request's task.
pub(crate) fn task(task: pb::Task) -> TaskSource {
    let pb::Task { task_id, source } = task;
    TaskSource { task_id, source }
}

/// A request's `backend`; a value the contract does not define is refused by the engine, naming it.
pub(crate) fn requested_backend(value: i32) -> RequestedBackend {
    match pb::Backend::try_from(value) {
        Ok(pb::Backend::Unspecified) => RequestedBackend::Any,
        Ok(pb::Backend::Cpu) => RequestedBackend::Cpu,
        Ok(pb::Backend::Cuda) => RequestedBackend::Cuda,
        Ok(pb::Backend::Triton) => RequestedBackend::Triton,
        Err(_) => RequestedBackend::Unknown(value),
    }
}

/// The status of a refused request: INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED with the queue's
/// `retry-after-ms` hint, UNAVAILABLE without a backend.
pub(crate) fn status(error: RequestError) -> Status {
    let message = error.to_string();
    match &error {
        RequestError::Invalid { .. } => Status::invalid_argument(message),
        RequestError::QueueFull { .. } => {
            let mut status = Status::resource_exhausted(message);
            let hint = error.retry_after().and_then(|after| after.as_millis().to_string().parse().ok());
            if let Some(value) = hint {
                status.metadata_mut().insert("retry-after-ms", value);
            }
            status
        }
        RequestError::Unavailable(_) => Status::unavailable(message),
    }
}

#[cfg(test)]
mod tests {
    use kforge_execution::times::{Stage, StageTimes};

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
    fn a_full_queue_answers_resource_exhausted_with_its_retry_hint() {
        let status = status(RequestError::QueueFull { capacity: 8, retry_after_secs: 30 });
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("queue is full"), "{}", status.message());
        let hint = status.metadata().get("retry-after-ms").and_then(|value| value.to_str().ok());
        assert_eq!(hint, Some("30000"));
        let invalid = super::status(RequestError::invalid("task.source", "required"));
        assert_eq!((invalid.code(), invalid.message()), (tonic::Code::InvalidArgument, "task.source: required"));
        assert!(invalid.metadata().get("retry-after-ms").is_none());
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
        let proto = include_str!("../../../proto/kforge/v1/evaluator.proto");
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
