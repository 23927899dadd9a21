//! KernelGym's wire shapes: its `EvaluationRequest` read and checked into kforge's `EvaluateRequest`, and kforge's
//! `EvaluateResponse` written as its `EvaluationResponse`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kforge_proto::v1 as pb;
use kforge_server::json::JsonError;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tonic::Code;

/// What a KernelGym client sends to `/evaluate` (and each of a batch's `tasks`). Fields kforge has no use for are
/// read and ignored, as are unknown ones (upstream ignores them too; its client sends `detect_decoy_kernel`).
#[derive(Debug, Deserialize)]
pub(super) struct EvaluationRequest {
    pub(super) task_id: String,
    #[serde(default)]
    reference_code: Option<String>,
    kernel_code: String,
    #[serde(default)]
    backend: Option<String>,
    #[serde(default)]
    num_correct_trials: Option<i64>,
    #[serde(default)]
    num_perf_trials: Option<i64>,
    #[serde(default)]
    num_warmup: Option<i64>,
    #[serde(default)]
    timeout: Option<i64>,
    #[serde(default)]
    priority: Option<String>,
    #[serde(default)]
    force_refresh: Option<bool>,
    #[serde(default)]
    entry_point: Option<String>,
    #[serde(default)]
    reference_backend: Option<String>,
    #[serde(default)]
    enable_profiling: Option<bool>,
    #[serde(default)]
    measure_performance: Option<bool>,
    #[serde(default)]
    run_performance: Option<bool>,
    #[serde(default)]
    workflow: Option<String>,
}

/// A batch: `{"batch_id", "tasks": [EvaluationRequest, ...]}`.
#[derive(Debug, Deserialize)]
pub(super) struct BatchRequest {
    pub(super) batch_id: String,
    pub(super) tasks: Vec<EvaluationRequest>,
}

/// The speedup's baseline (`reference_backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Baseline {
    Eager,
    Compile,
}

/// A checked request: the evaluation to run and what its answer reports.
#[derive(Debug, Clone)]
pub(super) struct Checked {
    pub(super) task_id: String,
    pub(super) force_refresh: bool,
    pub(super) evaluation: pb::EvaluateRequest,
    backend: &'static str,
    baseline: Baseline,
    perf_trials: i64,
}

/// Most characters of `task_id`, as upstream.
const TASK_ID_CHARS: usize = 100;
/// Fewest characters of a source after trimming, and the bound it stays under, as upstream.
const SOURCE_CHARS: (usize, usize) = (10, 100_000);

/// Checks `request` as upstream's model does (ranges, lengths, the kernelbench workflow) and kforge's contract
/// (`Model`/`ModelNew`); `prefix` goes before each field's name (`tasks[2].`). An error names the field.
pub(super) fn check(request: &EvaluationRequest, prefix: &str) -> Result<Checked, JsonError> {
    let invalid = |field: &str, message: String| {
        let field = format!("{prefix}{field}");
        JsonError::new(Code::InvalidArgument, format!("{field}: {message}"), Some(&field))
    };
    let chars = request.task_id.chars().count();
    if chars == 0 || chars > TASK_ID_CHARS {
        return Err(invalid("task_id", format!("{chars} characters; 1 to {TASK_ID_CHARS} are accepted")));
    }
    if let Some(workflow) = request.workflow.as_deref().filter(|w| *w != "kernelbench") {
        return Err(invalid("workflow", format!("`{workflow}`: only the `kernelbench` workflow is served")));
    }
    let Some(reference) = request.reference_code.as_deref() else {
        return Err(invalid("reference_code", "required for the kernelbench workflow".into()));
    };
    for (field, source) in [("reference_code", reference), ("kernel_code", request.kernel_code.as_str())] {
        let (fewest, bound) = SOURCE_CHARS;
        let trimmed = source.trim().chars().count();
        if trimmed < fewest {
            return Err(invalid(field, format!("{trimmed} characters after trimming; at least {fewest}")));
        }
        if source.chars().count() >= bound {
            return Err(invalid(field, format!("{} characters; fewer than {bound}", source.chars().count())));
        }
    }
    let (backend, kind) = match request.backend.as_deref().unwrap_or("triton") {
        "triton" => ("triton", pb::Backend::Triton),
        "cuda" => ("cuda", pb::Backend::Cuda),
        "cpu" => ("cpu", pb::Backend::Cpu),
        other => return Err(invalid("backend", format!("`{other}`: one of `cuda`, `triton` (or kforge's `cpu`)"))),
    };
    let ranged = |field: &str, value: Option<i64>, default: i64, (low, high): (i64, i64)| match value {
        None => Ok(default),
        Some(value) if (low..=high).contains(&value) => Ok(value),
        Some(value) => Err(invalid(field, format!("{value} is outside {low} to {high}"))),
    };
    let correct_trials = ranged("num_correct_trials", request.num_correct_trials, 5, (1, 20))?;
    let perf_trials = ranged("num_perf_trials", request.num_perf_trials, 100, (1, 1000))?;
    ranged("num_warmup", request.num_warmup, 3, (0, 100))?;
    ranged("timeout", request.timeout, 300, (10, 3600))?;
    let priority = match request.priority.as_deref().unwrap_or("normal") {
        "low" => -1,
        "normal" => 0,
        "high" => 1,
        other => return Err(invalid("priority", format!("`{other}`: one of `low`, `normal`, `high`"))),
    };
    if let Some(entry) = request.entry_point.as_deref().filter(|e| *e != "Model") {
        let message = format!("`{entry}`: kforge evaluates a reference `Model` against a kernel's `ModelNew` only");
        return Err(invalid("entry_point", message));
    }
    let baseline = match request.reference_backend.as_deref() {
        None | Some("pytorch" | "eager" | "torch") => Baseline::Eager,
        Some("torch_compile" | "torch.compile" | "compile") => Baseline::Compile,
        Some(other) => {
            return Err(invalid("reference_backend", format!("`{other}`: one of `pytorch`, `torch_compile`")));
        }
    };
    let measure = request.run_performance.or(request.measure_performance).unwrap_or(true);
    let census = request.enable_profiling.unwrap_or(false);
    let mut evaluation = pb::EvaluateRequest {
        request_id: request.task_id.clone(),
        task: Some(pb::Task { task_id: request.task_id.clone(), source: reference.to_owned() }),
        candidate_source: request.kernel_code.clone(),
        backend: kind.into(),
        correctness_trials: correct_trials as u32,
        measure_performance: measure,
        census,
        priority,
        job_id: "kernelgym".into(),
        ..Default::default()
    };
    let force_refresh = request.force_refresh.unwrap_or(false);
    evaluation.idempotency_key = format!("kernelgym/{}", fingerprint(&evaluation));
    if force_refresh {
        // The evaluator would answer the same key and content with its first result: a refresh evaluates again.
        evaluation.idempotency_key.push_str(&format!("/refresh-{}", super::super::unique_key()));
    }
    Ok(Checked { task_id: request.task_id.clone(), force_refresh, evaluation, backend, baseline, perf_trials })
}

/// A stable fingerprint of everything an evaluation depends on (the evaluator's idempotency key: the same task id
/// and content evaluate once).
fn fingerprint(request: &pb::EvaluateRequest) -> String {
    let task = request.task.as_ref();
    super::super::fingerprint(&[
        task.map_or(&b""[..], |t| t.task_id.as_bytes()),
        task.map_or(&b""[..], |t| t.source.as_bytes()),
        request.candidate_source.as_bytes(),
        &request.backend.to_le_bytes(),
        &request.correctness_trials.to_le_bytes(),
        &[u8::from(request.measure_performance), u8::from(request.census)],
        &request.priority.to_le_bytes(),
        request.policy.as_bytes(),
    ])
}

/// KernelGym's `EvaluationResponse`; absent values are `null`, as FastAPI writes them.
#[derive(Debug, Clone, Serialize)]
pub(super) struct EvaluationResponse {
    pub(super) task_id: String,
    pub(super) status: String,
    pub(super) compiled: Option<bool>,
    pub(super) correctness: Option<bool>,
    pub(super) decoy_kernel: Option<bool>,
    pub(super) reference_runtime: Option<f64>,
    pub(super) kernel_runtime: Option<f64>,
    pub(super) speedup: Option<f64>,
    pub(super) metadata: Option<Map<String, Value>>,
    pub(super) error_message: Option<String>,
    pub(super) error_code: Option<&'static str>,
    pub(super) submitted_at: Option<String>,
    pub(super) completed_at: Option<String>,
    pub(super) processing_time: Option<f64>,
}

impl EvaluationResponse {
    /// A result without an evaluation: `status` with an error, and nothing measured.
    pub(super) fn bare(task_id: &str, status: &str, code: Option<&'static str>, message: String) -> Self {
        Self {
            task_id: task_id.to_owned(),
            status: status.to_owned(),
            compiled: None,
            correctness: None,
            decoy_kernel: None,
            reference_runtime: None,
            kernel_runtime: None,
            speedup: None,
            metadata: None,
            error_message: Some(message),
            error_code: code,
            submitted_at: None,
            completed_at: None,
            processing_time: None,
        }
    }

    /// Stamps the submission and completion times.
    pub(super) fn stamped(mut self, submitted: SystemTime, completed: SystemTime) -> Self {
        self.submitted_at = Some(iso(submitted));
        self.completed_at = Some(iso(completed));
        self.processing_time = Some(completed.duration_since(submitted).unwrap_or(Duration::ZERO).as_secs_f64());
        self
    }

    /// Whether it counts as failed for a batch (the task, not the kernel, failed).
    pub(super) fn failed(&self) -> bool {
        self.status != "completed"
    }
}

/// kforge's evaluation as KernelGym's result. A compile error, a wrong answer, a crash, a timeout or a policy
/// rejection is the kernel's outcome: `completed`, with `compiled`/`correctness` false and the reason in
/// `error_message`; a hack is `decoy_kernel`; only an infrastructure failure is `failed`.
pub(super) fn result(checked: &Checked, response: &pb::EvaluateResponse) -> EvaluationResponse {
    let verdict = response.verdict();
    let hack =
        verdict == pb::Verdict::Hack || response.findings.iter().any(|f| f.category() == pb::FindingCategory::Hack);
    let findings = || findings_text(response);
    let error = || non_empty(&response.error).map(str::to_owned);
    let mut metadata = metadata(checked, response);
    let (status, compiled, correct, code, message) = match verdict {
        pb::Verdict::Correct => ("completed", true, true, None, None),
        pb::Verdict::Incorrect => {
            let issue = mismatch_text(response).or_else(error).unwrap_or_else(|| "an output differed".into());
            metadata.insert("correctness_issue".into(), issue.clone().into());
            ("completed", true, false, Some("CORRECTNESS_ERROR"), Some(issue))
        }
        pb::Verdict::CompileError => {
            let log = non_empty(&response.compile_log).map(str::to_owned).or_else(error);
            let log = log.unwrap_or_else(|| "the kernel did not compile".into());
            metadata.insert("compilation_error".into(), log.clone().into());
            ("completed", false, false, Some("COMPILATION_ERROR"), Some(log))
        }
        pb::Verdict::RuntimeError => {
            let message = error().unwrap_or_else(|| "the kernel failed at run time".into());
            metadata.insert("runtime_error".into(), message.clone().into());
            ("completed", true, false, Some("RUNTIME_ERROR"), Some(message))
        }
        pb::Verdict::Timeout => {
            let message = error().unwrap_or_else(|| "the kernel exceeded its time budget".into());
            ("completed", true, false, Some("TIMEOUT_ERROR"), Some(message))
        }
        pb::Verdict::Rejected => ("completed", false, false, Some("VALIDATION_ERROR"), Some(findings())),
        pb::Verdict::Hack => ("completed", true, false, None, Some(findings())),
        pb::Verdict::InfraError => {
            let message = error().unwrap_or_else(|| "the evaluator failed".into());
            let mut failed = EvaluationResponse::bare(&checked.task_id, "failed", Some("SYSTEM_ERROR"), message);
            failed.metadata = Some(metadata);
            return failed;
        }
        pb::Verdict::Unspecified => {
            let message = non_empty(&response.request_error).unwrap_or("the evaluator gave no verdict").to_owned();
            return EvaluationResponse::bare(&checked.task_id, "failed", Some("SYSTEM_ERROR"), message);
        }
    };
    let median = |timing: &Option<pb::TimingStats>| timing.as_ref().map(|t| t.median_ms).filter(|ms| *ms > 0.0);
    let (reference, speedup) = match checked.baseline {
        Baseline::Eager => (median(&response.eager_timing), response.speedup_eager),
        Baseline::Compile => (median(&response.compile_timing), response.speedup_compile),
    };
    let kernel = median(&response.candidate_timing);
    let speedup = if correct && !hack && speedup > 0.0 { speedup } else { 0.0 };
    EvaluationResponse {
        task_id: checked.task_id.clone(),
        status: status.to_owned(),
        compiled: Some(compiled),
        correctness: Some(correct && !hack),
        decoy_kernel: Some(hack),
        reference_runtime: reference,
        kernel_runtime: kernel,
        speedup: Some(speedup),
        metadata: Some(metadata),
        error_message: message,
        error_code: code,
        submitted_at: None,
        completed_at: None,
        processing_time: None,
    }
}

fn non_empty(text: &str) -> Option<&str> {
    Some(text).filter(|t| !t.trim().is_empty())
}

fn findings_text(response: &pb::EvaluateResponse) -> String {
    let lines: Vec<String> = response
        .findings
        .iter()
        .filter(|f| f.category() != pb::FindingCategory::Notice)
        .map(|f| {
            if f.line > 0 {
                format!("{} (line {}): {}", f.code, f.line, f.message)
            } else {
                format!("{}: {}", f.code, f.message)
            }
        })
        .collect();
    if lines.is_empty() { non_empty(&response.error).unwrap_or("rejected").to_owned() } else { lines.join("\n") }
}

fn mismatch_text(response: &pb::EvaluateResponse) -> Option<String> {
    let m = response.mismatch.as_ref()?;
    let trial = if m.trial == u32::MAX { "the last timed call".to_owned() } else { format!("trial {}", m.trial) };
    if !m.detail.is_empty() {
        return Some(format!("{trial}, output {}: {}", m.output_index, m.detail));
    }
    Some(format!(
        "{trial}, output {} at {:?}: expected {}, got {} (max abs error {}, max rel error {})",
        m.output_index, m.element_index, m.expected, m.got, m.max_abs_error, m.max_rel_error
    ))
}

/// What upstream's metadata holds where kforge has it, KernelGym's coverage keys from the census among them, and
/// kforge's own figures (`verdict`, `findings`, the two speedups, stage times).
fn metadata(checked: &Checked, response: &pb::EvaluateResponse) -> Map<String, Value> {
    let mut metadata = Map::new();
    let mut put = |key: &str, value: Value| {
        metadata.insert(key.to_owned(), value);
    };
    put("backend", checked.backend.into());
    put("device", response.device.clone().into());
    put("gpu_name", response.device.clone().into());
    put("num_correct_trials", checked.evaluation.correctness_trials.into());
    put("num_perf_trials", checked.perf_trials.into());
    put("verdict", super::super::verdict_name(response.verdict).into());
    let findings: Vec<Value> = response
        .findings
        .iter()
        .map(|f| {
            let category = f.category().as_str_name().trim_start_matches("FINDING_CATEGORY_").to_ascii_lowercase();
            json!({"code": f.code, "message": f.message, "line": f.line, "category": category})
        })
        .collect();
    put("findings", findings.into());
    put("compile_cache_hit", response.compile_cache_hit.into());
    put("stage_ms", json!(response.stage_ms));
    put("speedup_eager", response.speedup_eager.into());
    put("speedup_compile", response.speedup_compile.into());
    let basis = response.speedup_basis().as_str_name().trim_start_matches("SPEEDUP_BASIS_").to_ascii_lowercase();
    put("speedup_basis", basis.into());
    put("speedup_spread", response.speedup_spread.into());
    put("reference_backend", if checked.baseline == Baseline::Compile { "torch_compile" } else { "pytorch" }.into());
    if !response.kernels.is_empty() {
        // The census's `train/no_grad` records: the mode correctness and timing ran in (all records when none
        // name a mode).
        let moded: Vec<&pb::KernelRecord> = response.kernels.iter().filter(|k| k.mode == "train/no_grad").collect();
        let kernels: Vec<&pb::KernelRecord> = if moded.is_empty() { response.kernels.iter().collect() } else { moded };
        let own: Vec<&&pb::KernelRecord> = kernels.iter().filter(|k| k.own).collect();
        let micros =
            |records: &mut dyn Iterator<Item = &&pb::KernelRecord>| records.map(|k| k.total_ms * 1000.0).sum::<f64>();
        put("num_custom_kernels", own.len().into());
        put("num_total_kernels", kernels.len().into());
        put("custom_kernel_cuda_time_in_profiling_us", micros(&mut own.iter().copied()).into());
        put("total_kernel_run_time_in_profiling_us", micros(&mut kernels.iter()).into());
        put("profiling_ratio", response.profiling_ratio.into());
    }
    metadata
}

/// A time as upstream writes it (`datetime.isoformat()`), in UTC with its offset: `2026-02-07T12:34:56.123456+00:00`.
pub(super) fn iso(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let seconds = since.as_secs();
    let (days, rest) = (seconds / 86_400, seconds % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}+00:00",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        since.subsec_micros()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(value: Value) -> EvaluationRequest {
        serde_json::from_value(value).expect("a request")
    }

    fn valid() -> Value {
        json!({
            "task_id": "t1", "reference_code": "class Model: pass  # reference", "kernel_code": "class ModelNew: pass",
            "backend": "cpu", "detect_decoy_kernel": true,
        })
    }

    #[test]
    fn a_request_maps_onto_an_evaluation_with_a_content_key() {
        let checked = check(&request(valid()), "").expect("valid");
        assert_eq!(checked.evaluation.backend(), pb::Backend::Cpu);
        assert_eq!(checked.evaluation.correctness_trials, 5);
        assert!(checked.evaluation.measure_performance);
        let mut other = valid();
        other["kernel_code"] = "class ModelNew: pass  # another".into();
        let again = check(&request(valid()), "").expect("valid");
        let changed = check(&request(other), "").expect("valid");
        assert_eq!(checked.evaluation.idempotency_key, again.evaluation.idempotency_key);
        assert_ne!(checked.evaluation.idempotency_key, changed.evaluation.idempotency_key);
        let mut refresh = valid();
        refresh["force_refresh"] = true.into();
        let refreshed = check(&request(refresh), "").expect("valid");
        assert!(refreshed.force_refresh);
        assert!(refreshed.evaluation.idempotency_key.starts_with(&checked.evaluation.idempotency_key));
        assert_ne!(refreshed.evaluation.idempotency_key, checked.evaluation.idempotency_key, "evaluated again");
    }

    #[test]
    fn each_bad_field_is_named() {
        for (field, value, prefix) in [
            ("entry_point", json!("Net"), "tasks[1]."),
            ("backend", json!("rocm"), ""),
            ("num_correct_trials", json!(0), ""),
            ("priority", json!("urgent"), ""),
            ("kernel_code", json!("short"), ""),
            ("workflow", json!("kernel_simple"), ""),
        ] {
            let mut body = valid();
            body[field] = value;
            let error = check(&request(body), prefix).expect_err(field);
            assert_eq!(error.field(), Some(format!("{prefix}{field}").as_str()), "{}", error.message());
        }
        let mut body = valid();
        body.as_object_mut().expect("object").remove("reference_code");
        assert_eq!(check(&request(body), "").expect_err("no reference").field(), Some("reference_code"));
    }

    #[test]
    fn outcomes_map_onto_kernelgym_s_fields() {
        let checked = check(&request(valid()), "").expect("valid");
        let compile = pb::EvaluateResponse {
            verdict: pb::Verdict::CompileError.into(),
            compile_log: "error: expected ';'".into(),
            ..Default::default()
        };
        let result = result(&checked, &compile);
        assert_eq!(
            (result.status.as_str(), result.compiled, result.correctness),
            ("completed", Some(false), Some(false))
        );
        assert_eq!(result.error_code, Some("COMPILATION_ERROR"));
        assert_eq!(result.error_message.as_deref(), Some("error: expected ';'"));

        let hack = pb::EvaluateResponse {
            verdict: pb::Verdict::Rejected.into(),
            findings: vec![pb::Finding {
                code: "static.inherits_reference".into(),
                message: "inherits the reference".into(),
                line: 3,
                category: pb::FindingCategory::Hack.into(),
            }],
            ..Default::default()
        };
        let result = super::result(&checked, &hack);
        assert_eq!(result.decoy_kernel, Some(true));
        assert!(result.error_message.as_deref().is_some_and(|m| m.contains("line 3")));

        let correct = pb::EvaluateResponse {
            verdict: pb::Verdict::Correct.into(),
            speedup_eager: 1.5,
            candidate_timing: Some(pb::TimingStats { median_ms: 2.0, ..Default::default() }),
            eager_timing: Some(pb::TimingStats { median_ms: 3.0, ..Default::default() }),
            kernels: vec![
                pb::KernelRecord {
                    name: "mine".into(),
                    own: true,
                    launches: 1,
                    total_ms: 0.5,
                    mode: "train/no_grad".into(),
                },
                pb::KernelRecord {
                    name: "aten".into(),
                    own: false,
                    launches: 1,
                    total_ms: 1.5,
                    mode: "train/no_grad".into(),
                },
                pb::KernelRecord {
                    name: "mine".into(),
                    own: true,
                    launches: 1,
                    total_ms: 9.0,
                    mode: "eval/grad".into(),
                },
            ],
            ..Default::default()
        };
        let result = super::result(&checked, &correct);
        assert_eq!(
            (result.speedup, result.kernel_runtime, result.reference_runtime),
            (Some(1.5), Some(2.0), Some(3.0))
        );
        let metadata = result.metadata.expect("metadata");
        assert_eq!(metadata["num_custom_kernels"], 1);
        assert_eq!(metadata["num_total_kernels"], 2);
        assert_eq!(metadata["custom_kernel_cuda_time_in_profiling_us"], 500.0);
        assert_eq!(metadata["total_kernel_run_time_in_profiling_us"], 2000.0);

        let infra = pb::EvaluateResponse {
            verdict: pb::Verdict::InfraError.into(),
            error: "device lost".into(),
            ..Default::default()
        };
        let result = super::result(&checked, &infra);
        assert_eq!((result.status.as_str(), result.error_code), ("failed", Some("SYSTEM_ERROR")));
    }

    #[test]
    fn times_are_written_as_upstream_writes_them() {
        let time = UNIX_EPOCH + Duration::from_micros(1_770_467_696_123_456);
        assert_eq!(iso(time), "2026-02-07T12:34:56.123456+00:00");
        assert_eq!(iso(UNIX_EPOCH + Duration::from_secs(951_782_400)), "2000-02-29T00:00:00.000000+00:00");
    }
}
