//! The `cudaforge` recipe's Judge: after the Coder's kernel is evaluated, a second model reviews it in one of two
//! modes and its advice becomes the next turn's feedback (the Coder sees only its last kernel and that feedback).
//!
//! - **Correction** (a compile error, runtime error, timeout or mismatch): the Judge sees the task, the kernel and
//!   the evaluation, and names one critical issue, why it fails and a minimal fix, as JSON.
//! - **Optimisation** (a correct kernel): the kernel is profiled by the Profiler (Nsight Compute on its own kernels,
//!   CudaForge's metrics); the Judge sees the dominant kernel's metrics, the GPU's specification and the
//!   deterministic diagnosis, and names one bottleneck, one optimisation and a plan, as JSON. Without a profile (a
//!   CPU backend, the profiler's refusal or failure) the Judge is not asked and the feedback says so: the recipe
//!   falls back to correction-only feedback.
//!
//! A Judge answer that holds no JSON object with its mode's fields is recorded with the reason, and the next turn
//! sees the evaluation's own feedback: a malformed review never ends the episode.

use kforge_proto::v1 as pb;
use serde_json::{Map, Value};

use crate::recipe::{JudgeTemplates, render};

/// The Judge's modes, as the contract names them.
pub type Mode = pb::JudgeMode;

/// The fields each mode's JSON answer must carry, in the order the feedback shows them.
pub fn fields(mode: Mode) -> &'static [(&'static str, &'static str)] {
    match mode {
        Mode::Correction => {
            &[("critical_issue", "Critical issue"), ("why_it_matters", "Why"), ("minimal_fix_hint", "Minimal fix")]
        }
        Mode::Optimization => {
            &[("bottleneck", "Bottleneck"), ("optimisation_method", "Optimisation"), ("modification_plan", "Plan")]
        }
        Mode::None | Mode::Unspecified => &[],
    }
}

/// The mode a turn's evaluation calls for: correction for a failure the kernel's author can fix, optimisation for
/// a correct kernel, none where the evaluation explains itself (rejected, hack, infrastructure error).
pub fn mode_for(evaluation: &pb::EvaluateResponse) -> Mode {
    match pb::Verdict::try_from(evaluation.verdict).unwrap_or(pb::Verdict::Unspecified) {
        pb::Verdict::CompileError | pb::Verdict::RuntimeError | pb::Verdict::Timeout | pb::Verdict::Incorrect => {
            Mode::Correction
        }
        pb::Verdict::Correct => Mode::Optimization,
        pb::Verdict::Rejected | pb::Verdict::Hack | pb::Verdict::InfraError | pb::Verdict::Unspecified => Mode::None,
    }
}

/// The Judge's chat in correction mode.
pub fn correction_prompt(
    templates: &JudgeTemplates,
    task: &pb::Task,
    kernel: &str,
    evaluation: &str,
) -> Vec<pb::ChatMessage> {
    let user = render(
        &templates.correction,
        &[
            ("task_id", &task.task_id),
            ("task_source", task.source.trim_end()),
            ("kernel", kernel.trim_end()),
            ("evaluation", evaluation.trim_end()),
        ],
    );
    chat(templates, user)
}

/// What optimisation mode shows of a profile: the dominant kernel's name, launches and median time, its metrics
/// (the median over its launches of each metric), the device line and the diagnosis.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileView {
    pub kernel: String,
    pub launches: usize,
    pub median_ms: f64,
    pub metrics: Vec<pb::MetricValue>,
    pub device: String,
    pub diagnosis: Option<pb::Diagnosis>,
}

impl ProfileView {
    /// The view of a correct profile with at least one profiled launch; `None` when there is nothing to show.
    pub fn of(profile: &pb::ProfileResponse) -> Option<Self> {
        let diagnosis = profile.diagnosis.clone();
        // The diagnosis names the dominant kernel; without one, the longest launch's kernel.
        let kernel = diagnosis
            .as_ref()
            .map(|d| d.kernel.clone())
            .filter(|k| profile.kernels.iter().any(|l| &l.name == k))
            .or_else(|| {
                profile.kernels.iter().max_by(|a, b| a.duration_ms.total_cmp(&b.duration_ms)).map(|l| l.name.clone())
            })?;
        let launches: Vec<&pb::KernelProfile> = profile.kernels.iter().filter(|l| l.name == kernel).collect();
        let mut names: Vec<&str> = launches.iter().flat_map(|l| l.metrics.iter().map(|m| m.name.as_str())).collect();
        names.sort_unstable();
        names.dedup();
        let metrics = names
            .into_iter()
            .filter_map(|name| {
                let found: Vec<&pb::MetricValue> =
                    launches.iter().filter_map(|l| l.metrics.iter().find(|m| m.name == name)).collect();
                let unit = found.first()?.unit.clone();
                Some(pb::MetricValue { name: name.to_owned(), value: median(found.iter().map(|m| m.value)), unit })
            })
            .collect();
        Some(Self {
            median_ms: median(launches.iter().map(|l| l.duration_ms)),
            launches: launches.len(),
            kernel,
            metrics,
            device: profile.device.as_ref().map(device_line).unwrap_or_else(|| "(specification not read)".into()),
            diagnosis,
        })
    }
}

/// The Judge's chat in optimisation mode.
pub fn optimization_prompt(
    templates: &JudgeTemplates,
    task: &pb::Task,
    kernel: &str,
    evaluation: &str,
    view: &ProfileView,
) -> Vec<pb::ChatMessage> {
    let metrics: Vec<String> = view
        .metrics
        .iter()
        .map(|m| format!("- {}: {} {}", m.name, number(m.value), m.unit).trim_end().to_owned())
        .collect();
    let diagnosis = view.diagnosis.as_ref().map_or("(none)", |d| d.summary.as_str());
    let user = render(
        &templates.optimization,
        &[
            ("task_id", &task.task_id),
            ("task_source", task.source.trim_end()),
            ("kernel", kernel.trim_end()),
            ("evaluation", evaluation.trim_end()),
            ("device", &view.device),
            ("profiled_kernel", &view.kernel),
            ("launches", &view.launches.to_string()),
            ("kernel_ms", &number(view.median_ms)),
            ("metrics", &metrics.join("\n")),
            ("diagnosis", diagnosis),
        ],
    );
    chat(templates, user)
}

fn chat(templates: &JudgeTemplates, user: String) -> Vec<pb::ChatMessage> {
    let mut messages = Vec::with_capacity(2);
    if !templates.system.trim().is_empty() {
        messages.push(pb::ChatMessage { role: "system".into(), content: templates.system.trim_end().to_owned() });
    }
    messages.push(pb::ChatMessage { role: "user".into(), content: user.trim_end().to_owned() });
    messages
}

/// The device as the Judge reads it: name, SMs, memory bandwidth, FP32 and BF16 peaks, L2 and shared memory.
fn device_line(spec: &pb::DeviceSpec) -> String {
    let peak = |kind: &str| spec.peak_tflops.get(kind).map_or("?".to_owned(), |v| number(*v));
    format!(
        "{} (compute capability {}): {} SMs at {} MHz, {} GB/s peak memory bandwidth, {} TFLOP/s FP32 and {} TFLOP/s \
         BF16 tensor peak, {} MiB L2, {} KiB shared memory per SM, {} registers per SM, at most {} threads per SM",
        spec.name,
        spec.compute_capability,
        spec.sm_count,
        spec.sm_clock_khz / 1000,
        number(spec.peak_memory_bandwidth_gbps),
        peak("fp32"),
        peak("bf16_tensor"),
        spec.l2_cache_bytes >> 20,
        spec.shared_memory_per_sm_bytes >> 10,
        spec.registers_per_sm,
        spec.max_threads_per_sm,
    )
}

/// A number with at most four significant decimals, without trailing zeros.
fn number(value: f64) -> String {
    let text = format!("{value:.4}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text.is_empty() || text == "-" { "0".into() } else { text.to_owned() }
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.filter(|v| v.is_finite()).collect();
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 { values[mid] } else { (values[mid - 1] + values[mid]) / 2.0 }
}

/// Why a Judge answer gave no advice.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MalformedAnswer {
    #[error("no JSON object in the answer")]
    NoObject,
    /// The last JSON object in the answer lacks these fields of the mode.
    #[error("the JSON object lacks {} (a non-empty string each)", .missing.join(", "))]
    Lacks { missing: Vec<&'static str> },
}

/// The Judge's advice: its mode's fields, each a non-empty string, from the first JSON object in `text` that has
/// them (a bare object, or one in a fenced block, with prose around it). The error says what was missing.
pub fn parse(mode: Mode, text: &str) -> Result<Map<String, Value>, MalformedAnswer> {
    let wanted = fields(mode);
    let mut last_error = MalformedAnswer::NoObject;
    for object in json_objects(text) {
        let missing: Vec<&'static str> = wanted
            .iter()
            .map(|(key, _)| *key)
            .filter(|key| object.get(*key).and_then(Value::as_str).is_none_or(|v| v.trim().is_empty()))
            .collect();
        if missing.is_empty() {
            return Ok(wanted.iter().map(|(key, _)| ((*key).to_owned(), object[*key].clone())).collect());
        }
        last_error = MalformedAnswer::Lacks { missing };
    }
    Err(last_error)
}

/// Every JSON object in `text`, in order: each `{` tried as the start of one.
fn json_objects(text: &str) -> impl Iterator<Item = Map<String, Value>> + '_ {
    text.match_indices('{').filter_map(|(start, _)| {
        let mut stream = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
        match stream.next() {
            Some(Ok(Value::Object(object))) => Some(object),
            _ => None,
        }
    })
}

/// The next turn's feedback: the evaluation's own, then the Judge's advice under its mode's headings.
pub fn feedback(evaluation_feedback: &str, mode: Mode, advice: &Map<String, Value>) -> String {
    let heading = match mode {
        Mode::Correction => "Reviewer (correction)",
        _ => "Reviewer (optimisation, from the kernel's Nsight Compute profile)",
    };
    let mut text = format!("Evaluation: {}\n\n{heading}:", evaluation_feedback.trim_end());
    for (key, label) in fields(mode) {
        if let Some(value) = advice.get(*key).and_then(Value::as_str) {
            text.push_str(&format!("\n- {label}: {}", value.trim()));
        }
    }
    text
}

/// The next turn's feedback where the Judge gave no advice: the evaluation's own, and why.
pub fn feedback_without_review(evaluation_feedback: &str, why: &str) -> String {
    format!("Evaluation: {}\n\n(No review: {why}.)", evaluation_feedback.trim_end())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe::{Recipe, Templates};

    fn task() -> pb::Task {
        pb::Task { task_id: "level1/12_diag".into(), source: "class Model: pass\n".into() }
    }

    fn verdict(v: pb::Verdict) -> pb::EvaluateResponse {
        pb::EvaluateResponse { verdict: v as i32, ..Default::default() }
    }

    #[test]
    fn failures_are_corrected_correct_kernels_optimised_and_the_rest_left_alone() {
        for v in [pb::Verdict::CompileError, pb::Verdict::RuntimeError, pb::Verdict::Timeout, pb::Verdict::Incorrect] {
            assert_eq!(mode_for(&verdict(v)), Mode::Correction, "{v:?}");
        }
        assert_eq!(mode_for(&verdict(pb::Verdict::Correct)), Mode::Optimization);
        for v in [pb::Verdict::Rejected, pb::Verdict::Hack, pb::Verdict::InfraError, pb::Verdict::Unspecified] {
            assert_eq!(mode_for(&verdict(v)), Mode::None, "{v:?}");
        }
    }

    #[test]
    fn advice_is_read_from_prose_and_fences_and_malformed_answers_say_why() {
        let answer = "Looking at it...\n```json\n{\"critical_issue\": \"`len` is undeclared\", \
                      \"why_it_matters\": \"no build\", \"minimal_fix_hint\": \"use n\", \"extra\": 1}\n```\nDone.";
        let advice = parse(Mode::Correction, answer).expect("parsed");
        assert_eq!(advice.len(), 3, "only the mode's fields are kept: {advice:?}");
        assert_eq!(advice["minimal_fix_hint"], "use n");
        // A first object without the fields does not hide a later one that has them.
        let two = "{\"note\": 1} then {\"bottleneck\": \"dram\", \"optimisation_method\": \"vectorise\", \
                   \"modification_plan\": \"float4 loads\"}";
        assert_eq!(parse(Mode::Optimization, two).expect("second object")["bottleneck"], "dram");
        let none = parse(Mode::Correction, "I think the loop bound is wrong.").expect_err("no json");
        assert_eq!(none, MalformedAnswer::NoObject);
        assert_eq!(none.to_string(), "no JSON object in the answer");
        let partial =
            parse(Mode::Correction, "{\"critical_issue\": \"x\", \"why_it_matters\": \"\"}").expect_err("partial");
        assert_eq!(partial, MalformedAnswer::Lacks { missing: vec!["why_it_matters", "minimal_fix_hint"] });
        assert!(partial.to_string().contains("why_it_matters, minimal_fix_hint"), "{partial}");
        assert!(
            parse(Mode::Correction, "{\"critical_issue\": 3,").is_err(),
            "truncated JSON is malformed, not a panic"
        );
    }

    #[test]
    fn the_optimisation_prompt_shows_the_dominant_kernels_medians_the_device_and_the_diagnosis() {
        let launch = |name: &str, ms: f64, dram: f64| pb::KernelProfile {
            name: name.into(),
            duration_ms: ms,
            metrics: vec![pb::MetricValue { name: "dram__throughput".into(), value: dram, unit: "%".into() }],
            ..Default::default()
        };
        let profile = pb::ProfileResponse {
            verdict: pb::Verdict::Correct as i32,
            kernels: vec![
                launch("row_scale", 0.04, 80.0),
                launch("helper", 0.5, 1.0),
                launch("row_scale", 0.05, 82.0),
                launch("row_scale", 0.06, 90.0),
            ],
            diagnosis: Some(pb::Diagnosis {
                kernel: "row_scale".into(),
                summary: "row_scale is memory-bound".into(),
                ..Default::default()
            }),
            device: Some(pb::DeviceSpec {
                name: "NVIDIA H100 80GB HBM3".into(),
                sm_count: 132,
                peak_memory_bandwidth_gbps: 3352.32,
                ..Default::default()
            }),
            ..Default::default()
        };
        let view = ProfileView::of(&profile).expect("a view");
        assert_eq!((view.kernel.as_str(), view.launches, view.median_ms), ("row_scale", 3, 0.05));
        assert_eq!(view.metrics[0].value, 82.0, "the median over the kernel's launches");
        let templates = Templates::load(Recipe::CudaForge, None).expect("templates").judge;
        let prompt = optimization_prompt(&templates, &task(), "KERNEL", "correct, 1.20x", &view);
        let user = &prompt.last().expect("user").content;
        for needed in [
            "KERNEL",
            "correct, 1.20x",
            "- dram__throughput: 82 %",
            "132 SMs",
            "3352.32 GB/s",
            "row_scale is memory-bound",
            "3 launches profiled, median\n0.05 ms",
        ] {
            assert!(user.contains(needed), "{needed} in {user}");
        }
        assert!(!user.contains("{{"), "{user}");
        assert_eq!(ProfileView::of(&pb::ProfileResponse::default()), None, "nothing profiled, nothing to show");
    }

    #[test]
    fn feedback_puts_the_evaluation_before_the_advice() {
        let advice = parse(
            Mode::Correction,
            "{\"critical_issue\": \"a\", \"why_it_matters\": \"b\", \"minimal_fix_hint\": \"c\"}",
        )
        .expect("parsed");
        let text = feedback("compile error\nerror: `len` undeclared", Mode::Correction, &advice);
        assert_eq!(
            text,
            "Evaluation: compile error\nerror: `len` undeclared\n\nReviewer (correction):\n- Critical issue: a\n- Why: b\n- Minimal fix: c"
        );
        assert!(feedback_without_review("correct", "no GPU").ends_with("(No review: no GPU.)"));
    }
}
