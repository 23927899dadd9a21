//! Training-health diagnostics of model responses: junk, not-okay and hack flags, and their ratios.
//!
//! Definitions (also in docs/REWARDS.md):
//! - **truncated**: the finish reason is `length` (or `max_tokens`);
//! - **no kernel**: the answer has no fenced code block defining `class ModelNew`
//!   ([`kforge_model_text::extract_kernel`], the rule the orchestrator extracts kernels by);
//! - **degenerate**: [`repetition_ratio`] of the reasoning and answer above the threshold;
//! - **junk**: any of the three; **not-okay**: the reasoning does not open with the expected opening;
//! - **hack**: the outcome is `VERDICT_HACK` or a rejection with a hack-category finding.

use std::collections::HashSet;

use crate::{InvalidInput, Outcome, non_empty, within};

/// Kevin's expected opening of QwQ-style reasoning.
pub const DEFAULT_OPENING: &str = "Okay";
/// Repetition ratio above which a response is degenerate.
pub const DEFAULT_REPETITION_THRESHOLD: f64 = 0.5;
/// Responses shorter than this many words have repetition ratio 0: too short to call a loop.
const MIN_WORDS_FOR_REPETITION: usize = 50;

/// Parameters of [`diagnose`].
#[derive(Debug, Clone, PartialEq)]
pub struct DiagnoseParams {
    pub opening: String,
    pub repetition_threshold: f64,
}

impl Default for DiagnoseParams {
    fn default() -> Self {
        Self { opening: DEFAULT_OPENING.into(), repetition_threshold: DEFAULT_REPETITION_THRESHOLD }
    }
}

/// One model response.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ResponseInput {
    pub response_id: String,
    pub text: String,
    /// Reasoning, when the backend separates it; otherwise it is read from a `<think>` block in `text`, if any.
    pub reasoning: String,
    pub finish_reason: String,
    pub outcome: Option<Outcome>,
}

/// Flags of one response.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ResponseFlags {
    pub response_id: String,
    pub truncated: bool,
    pub no_kernel: bool,
    pub degenerate: bool,
    pub junk: bool,
    pub not_okay: bool,
    pub hack: bool,
    pub repetition_ratio: f64,
}

/// Flags and ratios of a batch.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Diagnosis {
    pub flags: Vec<ResponseFlags>,
    /// junk / all responses.
    pub junk_ratio: f64,
    /// not-okay / all responses.
    pub not_okay_ratio: f64,
    /// hacks / responses with an outcome; 0 when none has one.
    pub hack_ratio: f64,
    /// Responses with an outcome.
    pub evaluated: u64,
}

/// Diagnoses a batch of responses.
pub fn diagnose(params: &DiagnoseParams, responses: &[ResponseInput]) -> Result<Diagnosis, InvalidInput> {
    if params.opening.is_empty() {
        return Err(InvalidInput::new("params.opening", "must not be empty"));
    }
    within(|| "params.repetition_threshold".into(), params.repetition_threshold, 0.0, 1.0)?;
    non_empty("responses", responses)?;
    for (i, response) in responses.iter().enumerate() {
        if let Some(outcome) = &response.outcome {
            outcome.validate(&format!("responses[{i}].outcome"))?;
        }
    }
    let flags: Vec<ResponseFlags> = responses.iter().map(|r| flag(params, r)).collect();
    let total = flags.len() as f64;
    let evaluated = responses.iter().filter(|r| r.outcome.is_some()).count();
    let hacks = flags.iter().filter(|f| f.hack).count();
    Ok(Diagnosis {
        junk_ratio: flags.iter().filter(|f| f.junk).count() as f64 / total,
        not_okay_ratio: flags.iter().filter(|f| f.not_okay).count() as f64 / total,
        hack_ratio: if evaluated == 0 { 0.0 } else { hacks as f64 / evaluated as f64 },
        evaluated: evaluated as u64,
        flags,
    })
}

fn flag(params: &DiagnoseParams, response: &ResponseInput) -> ResponseFlags {
    let (reasoning, answer) = split_reasoning(response);
    let truncated = matches!(response.finish_reason.to_ascii_lowercase().as_str(), "length" | "max_tokens");
    let no_kernel = kforge_model_text::extract_kernel(answer).is_none();
    let repetition = repetition_ratio(&format!("{reasoning}\n{answer}"));
    let degenerate = repetition > params.repetition_threshold;
    ResponseFlags {
        response_id: response.response_id.clone(),
        truncated,
        no_kernel,
        degenerate,
        junk: truncated || no_kernel || degenerate,
        not_okay: !reasoning.trim_start().starts_with(params.opening.as_str()),
        hack: response.outcome.as_ref().is_some_and(Outcome::is_hack),
        repetition_ratio: repetition,
    }
}

/// (reasoning, answer): the separate reasoning field if set; else the text split by
/// [`kforge_model_text::split_reasoning`]; else the whole text is both (a model without a reasoning block is judged
/// on how its text opens).
fn split_reasoning(response: &ResponseInput) -> (&str, &str) {
    if !response.reasoning.is_empty() {
        return (&response.reasoning, &response.text);
    }
    let split = kforge_model_text::split_reasoning(&response.text);
    if split.found { (split.reasoning, split.answer) } else { (&response.text, &response.text) }
}

/// `1 - distinct / total` over word 4-grams (words split on whitespace); 0 for texts under 50 words. A response
/// that loops on one paragraph approaches 1; ordinary prose and code stay well under 0.3.
pub fn repetition_ratio(text: &str) -> f64 {
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.len() < MIN_WORDS_FOR_REPETITION {
        return 0.0;
    }
    let total = words.len() - 3;
    let distinct: HashSet<&[&str]> = words.windows(4).collect();
    1.0 - distinct.len() as f64 / total as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Verdict;

    const KERNEL_ANSWER: &str =
        "Here is the kernel.\n```python\nimport torch\nclass ModelNew(torch.nn.Module):\n    pass\n```\n";

    fn response(text: &str) -> ResponseInput {
        ResponseInput { response_id: "r".into(), text: text.into(), finish_reason: "stop".into(), ..Default::default() }
    }

    #[test]
    fn repetition_separates_loops_from_prose() {
        let prose: String = (0..200).map(|i| format!("word{i} ")).collect();
        assert_eq!(repetition_ratio(&prose), 0.0);
        let looped = "I will now try again to fix the kernel. ".repeat(40);
        assert!(repetition_ratio(&looped) > 0.8, "{}", repetition_ratio(&looped));
        assert_eq!(repetition_ratio("short text short text"), 0.0);
    }

    #[test]
    fn flags_and_ratios() {
        let good = ResponseInput {
            reasoning: "Okay, let me think.".into(),
            outcome: Some(Outcome { verdict: Verdict::Correct, ..Outcome::default() }),
            ..response(KERNEL_ANSWER)
        };
        let truncated = ResponseInput { finish_reason: "length".into(), ..response("<think>Okay so") };
        let no_kernel = response("<think>Hmm.</think>I cannot do this.");
        let hack = ResponseInput {
            outcome: Some(Outcome { verdict: Verdict::Hack, ..Outcome::default() }),
            ..response(&format!("<think>Okay.</think>{KERNEL_ANSWER}"))
        };
        let d = diagnose(&DiagnoseParams::default(), &[good, truncated, no_kernel, hack]).expect("valid");
        let summary: Vec<(bool, bool, bool, bool)> =
            d.flags.iter().map(|f| (f.truncated, f.no_kernel, f.not_okay, f.hack)).collect();
        assert_eq!(
            summary,
            vec![
                (false, false, false, false),
                (true, true, false, false),
                (false, true, true, false),
                (false, false, false, true)
            ]
        );
        assert_eq!((d.junk_ratio, d.not_okay_ratio, d.hack_ratio, d.evaluated), (0.5, 0.25, 0.5, 2));
    }

    #[test]
    fn custom_opening_and_bad_params() {
        let params = DiagnoseParams { opening: "Alright".into(), ..DiagnoseParams::default() };
        let d = diagnose(&params, &[response("Alright, the task is...")]).expect("valid");
        assert!(!d.flags[0].not_okay);
        let bad = DiagnoseParams { repetition_threshold: 2.0, ..DiagnoseParams::default() };
        assert_eq!(diagnose(&bad, &[response("x")]).expect_err("threshold").field, "params.repetition_threshold");
        assert_eq!(diagnose(&DiagnoseParams::default(), &[]).expect_err("empty").field, "responses");
    }
}
