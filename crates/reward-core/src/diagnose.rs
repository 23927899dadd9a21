//! Training-health diagnostics of model responses: junk, not-okay and hack flags, and their ratios.
//!
//! Definitions (also in docs/REWARDS.md):
//! - **truncated**: the finish reason is `length` (or `max_tokens`);
//! - **no kernel**: the answer has no fenced code block defining `class ModelNew`
//!   ([`kforge_model_text::extract_kernel`], the rule the orchestrator extracts kernels by);
//! - **degenerate**: [`repetition_ratio`] of the reasoning and answer above the threshold;
//! - **junk**: any of the three; **not-okay**: the reasoning does not open with the expected opening (off for
//!   models without a fixed opening);
//! - **hack**: the outcome is `VERDICT_HACK` or a rejection with a hack-category finding.
//!
//! An outcome with `VERDICT_INFRA_ERROR` is the evaluator's failure, not the candidate's: it is outside the hack
//! ratio (numerator and denominator). Junk and not-okay are read from the text alone, so they count every response.

use std::collections::HashSet;

use crate::{InvalidInput, Outcome, Verdict, non_empty, within};

/// Kevin's expected opening of QwQ-style reasoning.
pub const DEFAULT_OPENING: &str = "Okay";
/// Repetition ratio above which a response is degenerate.
pub const DEFAULT_REPETITION_THRESHOLD: f64 = 0.5;
/// Responses shorter than this many words have repetition ratio 0: too short to call a loop.
const MIN_WORDS_FOR_REPETITION: usize = 50;
/// The longest word, in characters, that [`repetition_ratio`] takes whole; a longer run without whitespace is
/// taken as words of this many characters, so that a loop with no word boundaries (`aaaa...`, `abcabc...`) repeats
/// like any other. Longer than almost every identifier, literal and path in code (which stay whole).
const MAX_WORD_CHARS: usize = 32;

/// Parameters of [`diagnose`].
#[derive(Debug, Clone, PartialEq)]
pub struct DiagnoseParams {
    /// The expected opening of the reasoning; `None` switches not-okay detection off (a model without a fixed
    /// opening would otherwise be flagged on every response).
    pub opening: Option<String>,
    pub repetition_threshold: f64,
}

impl Default for DiagnoseParams {
    fn default() -> Self {
        Self { opening: Some(DEFAULT_OPENING.into()), repetition_threshold: DEFAULT_REPETITION_THRESHOLD }
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
    /// Always false when not-okay detection is off.
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
    /// not-okay / all responses; `None` when not-okay detection is off.
    pub not_okay_ratio: Option<f64>,
    /// hacks / evaluated responses; 0 when none was evaluated.
    pub hack_ratio: f64,
    /// Responses with an outcome other than an infrastructure error: the hack ratio's denominator.
    pub evaluated: u64,
    /// Responses whose outcome is an infrastructure error.
    pub infra_errors: u64,
}

/// Diagnoses a batch of responses.
pub fn diagnose(params: &DiagnoseParams, responses: &[ResponseInput]) -> Result<Diagnosis, InvalidInput> {
    if params.opening.as_ref().is_some_and(String::is_empty) {
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
    let infra = |r: &ResponseInput| r.outcome.as_ref().is_some_and(|o| o.verdict == Verdict::InfraError);
    let infra_errors = responses.iter().filter(|r| infra(r)).count();
    let evaluated = responses.iter().filter(|r| r.outcome.is_some()).count() - infra_errors;
    // A hack verdict is never an infrastructure error, so every flagged hack is in the evaluated denominator.
    let hacks = flags.iter().filter(|f| f.hack).count();
    Ok(Diagnosis {
        junk_ratio: flags.iter().filter(|f| f.junk).count() as f64 / total,
        not_okay_ratio: params.opening.is_some().then(|| flags.iter().filter(|f| f.not_okay).count() as f64 / total),
        hack_ratio: if evaluated == 0 { 0.0 } else { hacks as f64 / evaluated as f64 },
        evaluated: evaluated as u64,
        infra_errors: infra_errors as u64,
        flags,
    })
}

fn flag(params: &DiagnoseParams, response: &ResponseInput) -> ResponseFlags {
    let (reasoning, answer) = split_reasoning(response);
    let truncated = matches!(response.finish_reason.to_ascii_lowercase().as_str(), "length" | "max_tokens");
    let no_kernel = kforge_model_text::extract_kernel(answer).is_none();
    // A text without a reasoning block is both: measured once, or each of its 4-grams would count as a repeat (every
    // such response over 50 words had a ratio near 0.5).
    let one_text = std::ptr::eq(reasoning, answer);
    let repetition =
        if one_text { repetition_ratio(answer) } else { repetition_ratio(&format!("{reasoning}\n{answer}")) };
    let degenerate = repetition > params.repetition_threshold;
    ResponseFlags {
        response_id: response.response_id.clone(),
        truncated,
        no_kernel,
        degenerate,
        junk: truncated || no_kernel || degenerate,
        not_okay: params.opening.as_ref().is_some_and(|opening| !reasoning.trim_start().starts_with(opening.as_str())),
        hack: response.outcome.as_ref().is_some_and(Outcome::is_hack),
        repetition_ratio: repetition,
    }
}

/// `word` cut into pieces of [`MAX_WORD_CHARS`] characters (the last shorter); a shorter word is one piece.
fn pieces(word: &str) -> impl Iterator<Item = &str> {
    let mut rest = word;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = rest.char_indices().nth(MAX_WORD_CHARS).map_or(rest.len(), |(at, _)| at);
        let (piece, after) = rest.split_at(end);
        rest = after;
        Some(piece)
    })
}

/// (reasoning, answer): the separate reasoning field if set; else the text split by
/// [`kforge_model_text::split_reasoning`]; else the whole text is both, the same `&str` (a model without a
/// reasoning block is judged on how its text opens).
fn split_reasoning(response: &ResponseInput) -> (&str, &str) {
    if !response.reasoning.is_empty() {
        return (&response.reasoning, &response.text);
    }
    let split = kforge_model_text::split_reasoning(&response.text);
    if split.found { (split.reasoning, split.answer) } else { (&response.text, &response.text) }
}

/// `1 - distinct / total` over word 4-grams (words split on whitespace, a word of more than 32 characters cut into
/// pieces of 32); 0 for texts under 50 words. A response that loops on one paragraph approaches 1, and so does
/// one that repeats a character or a short unit without a space (`"a"` ten million times is 312,500 words of 32
/// `a`s); ordinary prose and code stay well under 0.3. Linear in the text's length.
pub fn repetition_ratio(text: &str) -> f64 {
    let words: Vec<&str> = text.split_whitespace().flat_map(pieces).collect();
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
    fn a_loop_without_word_boundaries_is_degenerate() {
        let ten_mb = "a".repeat(10_000_000);
        let started = std::time::Instant::now();
        let ratio = repetition_ratio(&ten_mb);
        assert!(ratio > 0.99, "{ratio}");
        // Linear: a few hundred milliseconds even in a debug build (the word split once, each 4-gram hashed once).
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "{:?}", started.elapsed());
        for unit in ["ab", "xyz", "<|endoftext|>", "é", "🙂🙃"] {
            let looped = unit.repeat(20_000);
            assert!(repetition_ratio(&looped) > 0.9, "{unit}: {}", repetition_ratio(&looped));
        }
        // The loop dominates a response that opens and ends with prose: degenerate, and so junk.
        let text = format!("<think>Okay, let me write it.</think>{ten_mb} the end");
        let flags = diagnose(&DiagnoseParams::default(), &[response(&text)]).expect("valid").flags;
        assert!(flags[0].degenerate && flags[0].junk && !flags[0].not_okay, "{:?}", flags[0]);
        // A long word without a loop is not: 8 KB of hex without a space, no piece of it repeated.
        let hex: String = (0u32..1024).map(|i| format!("{:08x}", i.wrapping_mul(2_654_435_761))).collect();
        assert!(repetition_ratio(&hex) < 0.05, "{}", repetition_ratio(&hex));
    }

    #[test]
    fn ordinary_code_is_not_degenerate() {
        // Python with repeated idioms, C++/CUDA with long identifiers and literals, and this crate's own Rust.
        let sources = [
            include_str!("../../../examples/tasks/relu/story/0/2_unrolled.py"),
            include_str!("../../../examples/tasks/relu/candidates/cpu_loop.py"),
            include_str!("diagnose.rs"),
            include_str!("metrics.rs"),
        ];
        for source in sources {
            let ratio = repetition_ratio(source);
            assert!(ratio < 0.3, "{ratio}: {}", &source[..source.len().min(200)]);
        }
        let answer = format!("Here is the kernel.\n```python\n{}```\n", sources[0]);
        let flags = diagnose(&DiagnoseParams::default(), &[response(&answer)]).expect("valid").flags;
        assert!(!flags[0].degenerate, "{:?}", flags[0]);
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
        assert_eq!((d.junk_ratio, d.not_okay_ratio, d.hack_ratio, d.evaluated), (0.5, Some(0.25), 0.5, 2));
    }

    #[test]
    fn infra_errors_are_outside_the_hack_ratio() {
        let with = |verdict| ResponseInput {
            outcome: Some(Outcome { verdict, ..Outcome::default() }),
            ..response(&format!("<think>Okay.</think>{KERNEL_ANSWER}"))
        };
        let d = diagnose(
            &DiagnoseParams::default(),
            &[with(Verdict::Hack), with(Verdict::InfraError), with(Verdict::Correct)],
        )
        .expect("valid");
        assert_eq!((d.evaluated, d.infra_errors, d.hack_ratio), (2, 1, 0.5));
        assert_eq!(d.junk_ratio, 0.0, "all three responses count for junk: the text is the model's either way");
        let all_infra = diagnose(&DiagnoseParams::default(), &[with(Verdict::InfraError)]).expect("valid");
        assert_eq!((all_infra.evaluated, all_infra.hack_ratio), (0, 0.0));
    }

    #[test]
    fn not_okay_detection_can_be_off() {
        let params = DiagnoseParams { opening: None, ..DiagnoseParams::default() };
        let d =
            diagnose(&params, &[response("Hmm, no opening here."), response("<think>Sure.</think>x")]).expect("valid");
        assert!(d.flags.iter().all(|f| !f.not_okay));
        assert_eq!(d.not_okay_ratio, None);
        let on = diagnose(&DiagnoseParams::default(), &[response("Hmm, no opening here.")]).expect("valid");
        assert_eq!(on.not_okay_ratio, Some(1.0));
    }

    #[test]
    fn custom_opening_and_bad_params() {
        let params = DiagnoseParams { opening: Some("Alright".into()), ..DiagnoseParams::default() };
        let d = diagnose(&params, &[response("Alright, the task is...")]).expect("valid");
        assert!(!d.flags[0].not_okay);
        let bad = DiagnoseParams { repetition_threshold: 2.0, ..DiagnoseParams::default() };
        assert_eq!(diagnose(&bad, &[response("x")]).expect_err("threshold").field, "params.repetition_threshold");
        assert_eq!(diagnose(&DiagnoseParams::default(), &[]).expect_err("empty").field, "responses");
    }
}
