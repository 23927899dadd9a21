//! Recipes: how a turn's prompt is built from the task and the trajectory's earlier turns. Prompts are rendered
//! from template files (`prompts/<recipe>/*.md`, embedded in the binary); a job's `prompt_dir` may override any of
//! them with a file of the same name under `<prompt_dir>/<recipe>/`.

use std::path::Path;

use kforge_proto::v1 as pb;

use crate::error::OrchestratorError;
use crate::failure::TurnFailure;

/// The recipes this orchestrator runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    /// One prompt per turn with the task only; turns are independent samples.
    SingleTurn,
    /// Kevin's multi-turn refinement: each turn sees the task and every earlier kernel with its evaluation.
    Kevin,
    /// CudaForge's Coder and Judge: each turn sees the task, the last kernel and the Judge's review of it only
    /// (`judge.rs`).
    CudaForge,
    /// Dr. Kernel's long refinement: each turn sees the best earlier turns by score within a window (the latest
    /// always), each evaluation with its kernel census and profiling ratio; scored with the Dr. Kernel reward.
    DrKernel,
}

impl Recipe {
    /// Parses the spec's recipe name.
    pub fn parse(name: &str) -> Result<Self, OrchestratorError> {
        match name {
            "single-turn" => Ok(Self::SingleTurn),
            "kevin" => Ok(Self::Kevin),
            "cudaforge" => Ok(Self::CudaForge),
            "drkernel" => Ok(Self::DrKernel),
            other => {
                Err(OrchestratorError::invalid("spec.recipe", format!("unknown recipe `{other}`; built: {BUILT}")))
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::SingleTurn => "single-turn",
            Self::Kevin => "kevin",
            Self::CudaForge => "cudaforge",
            Self::DrKernel => "drkernel",
        }
    }
}

/// The recipes built, as errors list them.
const BUILT: &str = "single-turn, kevin, cudaforge, drkernel";

/// drkernel's context window when the spec names none: earlier turns shown.
pub const DEFAULT_WINDOW: u32 = 4;

/// Built-in template files, by recipe and file name.
const BUILT_IN: &[(&str, &str, &str)] = &[
    ("single-turn", "system.md", include_str!("../prompts/single-turn/system.md")),
    ("single-turn", "task.md", include_str!("../prompts/single-turn/task.md")),
    ("kevin", "system.md", include_str!("../prompts/kevin/system.md")),
    ("kevin", "task.md", include_str!("../prompts/kevin/task.md")),
    ("kevin", "attempt.md", include_str!("../prompts/kevin/attempt.md")),
    ("kevin", "refine.md", include_str!("../prompts/kevin/refine.md")),
    ("drkernel", "system.md", include_str!("../prompts/drkernel/system.md")),
    ("drkernel", "task.md", include_str!("../prompts/drkernel/task.md")),
    ("drkernel", "attempt.md", include_str!("../prompts/drkernel/attempt.md")),
    ("drkernel", "refine.md", include_str!("../prompts/drkernel/refine.md")),
    ("cudaforge", "system.md", include_str!("../prompts/cudaforge/system.md")),
    ("cudaforge", "task.md", include_str!("../prompts/cudaforge/task.md")),
    ("cudaforge", "refine.md", include_str!("../prompts/cudaforge/refine.md")),
    ("cudaforge", "judge_system.md", include_str!("../prompts/cudaforge/judge_system.md")),
    ("cudaforge", "judge_correction.md", include_str!("../prompts/cudaforge/judge_correction.md")),
    ("cudaforge", "judge_optimization.md", include_str!("../prompts/cudaforge/judge_optimization.md")),
];

/// A recipe's templates, read once per job.
#[derive(Debug, Clone)]
pub struct Templates {
    recipe: Recipe,
    system: String,
    task: String,
    attempt: String,
    refine: String,
    /// The cudaforge Judge's templates (empty for other recipes).
    pub judge: JudgeTemplates,
    /// drkernel: earlier turns shown, the best by score and the latest ([`DEFAULT_WINDOW`] unless the spec says).
    pub window: u32,
    /// kevin and drkernel: the most characters the earlier attempts take in a prompt; the oldest are left out first,
    /// the latest always kept. 0: no limit.
    pub budget_chars: usize,
}

/// The Judge's system prompt and its two modes' user prompts.
#[derive(Debug, Clone, Default)]
pub struct JudgeTemplates {
    pub system: String,
    pub correction: String,
    pub optimization: String,
}

/// What an earlier turn leaves for the next one's prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Attempt {
    /// The extracted kernel; empty when the response held none.
    pub kernel: String,
    /// The evaluation, rendered for the model.
    pub feedback: String,
    /// The turn's score; `None` when it was not scored (no kernel, a failure on the way).
    pub score: Option<f64>,
    /// What the model wrote outside its code ([`change_summary`]); empty when nothing.
    pub summary: String,
}

impl Attempt {
    /// A recorded turn as the next prompt shows it.
    pub fn of(record: &pb::TurnRecord) -> Self {
        Self {
            kernel: record.kernel.clone(),
            feedback: record.feedback.clone(),
            score: record.score,
            summary: change_summary(record.completion.as_ref()),
        }
    }
}

/// The longest change summary a prompt shows, in characters.
const SUMMARY_CHARS: usize = 600;

/// The model's summary of its change: the answer's prose outside code blocks (reasoning left out), at most
/// [`SUMMARY_CHARS`] characters.
pub fn change_summary(completion: Option<&pb::Completion>) -> String {
    let Some(completion) = completion else { return String::new() };
    let prose = kforge_model_text::prose(kforge_model_text::split_reasoning(&completion.text).answer);
    match prose.char_indices().nth(SUMMARY_CHARS) {
        Some((cut, _)) => format!("{}...", &prose[..cut]),
        None => prose,
    }
}

impl Templates {
    /// The recipe's built-in templates, each overridden by `<prompt_dir>/<recipe>/<file>` when that file exists.
    pub fn load(recipe: Recipe, prompt_dir: Option<&Path>) -> Result<Self, OrchestratorError> {
        let read = |file: &str| -> Result<String, OrchestratorError> {
            if let Some(dir) = prompt_dir {
                let path = dir.join(recipe.name()).join(file);
                match std::fs::read_to_string(&path) {
                    Ok(text) => return Ok(text),
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                    Err(error) => {
                        return Err(OrchestratorError::invalid(
                            "spec.prompt_dir",
                            format!("cannot read {}: {error}", path.display()),
                        ));
                    }
                }
            }
            Ok(BUILT_IN
                .iter()
                .find(|(r, f, _)| *r == recipe.name() && *f == file)
                .map(|(_, _, text)| (*text).to_owned())
                .unwrap_or_default())
        };
        Ok(Self {
            recipe,
            system: read("system.md")?,
            task: read("task.md")?,
            attempt: read("attempt.md")?,
            refine: read("refine.md")?,
            judge: JudgeTemplates {
                system: read("judge_system.md")?,
                correction: read("judge_correction.md")?,
                optimization: read("judge_optimization.md")?,
            },
            window: DEFAULT_WINDOW,
            budget_chars: 0,
        })
    }

    /// The chat for a turn: the system message, then the task, then (multi-turn recipes) the earlier attempts:
    /// every one for `kevin`, the last one for `cudaforge` (its feedback carries the Judge's review).
    pub fn prompt(&self, task: &pb::Task, earlier: &[Attempt]) -> Vec<pb::ChatMessage> {
        let mut user = render(&self.task, &[("task_id", &task.task_id), ("task_source", task.source.trim_end())]);
        if let (Recipe::CudaForge, Some(last)) = (self.recipe, earlier.last()) {
            let kernel = if last.kernel.is_empty() { "(no kernel in the response)" } else { &last.kernel };
            user.push_str("\n\n");
            user.push_str(&render(
                &self.refine,
                &[("kernel", kernel.trim_end()), ("feedback", last.feedback.trim_end())],
            ));
        }
        if matches!(self.recipe, Recipe::Kevin | Recipe::DrKernel) && !earlier.is_empty() {
            let shown = match self.recipe {
                Recipe::DrKernel => best_within(earlier, self.window as usize),
                _ => (0..earlier.len()).collect(),
            };
            let attempts: Vec<String> = shown
                .into_iter()
                .map(|i| (i, &earlier[i]))
                .map(|(i, attempt)| {
                    let kernel =
                        if attempt.kernel.is_empty() { "(no kernel in the response)" } else { &attempt.kernel };
                    render(
                        &self.attempt,
                        &[
                            ("attempt", &(i + 1).to_string()),
                            ("kernel", kernel.trim_end()),
                            ("feedback", &attempt.feedback),
                            ("summary", if attempt.summary.is_empty() { "(nothing)" } else { &attempt.summary }),
                        ],
                    )
                })
                .collect();
            let attempts = within_budget(attempts, self.budget_chars);
            user.push_str("\n\n");
            user.push_str(&render(&self.refine, &[("attempts", attempts.join("\n").trim_end())]));
        }
        let mut messages = Vec::with_capacity(2);
        if !self.system.trim().is_empty() {
            messages.push(pb::ChatMessage { role: "system".into(), content: self.system.trim_end().to_owned() });
        }
        messages.push(pb::ChatMessage { role: "user".into(), content: user.trim_end().to_owned() });
        messages
    }
}

/// `attempts` (rendered, oldest first) with the oldest left out while they take more than `budget` characters
/// (0: no limit); the latest is always kept, and a line says how many were left out.
fn within_budget(mut attempts: Vec<String>, budget: usize) -> Vec<String> {
    let mut dropped = 0;
    while budget > 0 && attempts.len() > 1 && attempts.iter().map(|a| a.chars().count() + 1).sum::<usize>() > budget {
        attempts.remove(0);
        dropped += 1;
    }
    if dropped > 0 {
        attempts.insert(0, format!("({dropped} earlier attempts left out for the context budget.)\n"));
    }
    attempts
}

/// The earlier turns drkernel shows, in turn order: all of them within `window`; past it the latest, and the best
/// of the others by score (unscored turns last, a later turn before an earlier one of the same score).
fn best_within(earlier: &[Attempt], window: usize) -> Vec<usize> {
    let window = window.max(1);
    if earlier.len() <= window {
        return (0..earlier.len()).collect();
    }
    let latest = earlier.len() - 1;
    let mut others: Vec<usize> = (0..latest).collect();
    others.sort_by(|&a, &b| {
        let score = |i: usize| earlier[i].score.unwrap_or(f64::NEG_INFINITY);
        score(b).total_cmp(&score(a)).then(b.cmp(&a))
    });
    let mut shown: Vec<usize> = others.into_iter().take(window - 1).collect();
    shown.push(latest);
    shown.sort_unstable();
    shown
}

/// drkernel's addition to a turn's feedback: the census of the measured mode (own kernels, profiling ratio, where
/// the rest of the device time went). Empty without a census.
pub fn census_feedback(evaluation: &pb::EvaluateResponse) -> String {
    let Some(measured) = evaluation.kernels.first().map(|k| k.mode.clone()) else { return String::new() };
    let kernels: Vec<&pb::KernelRecord> = evaluation.kernels.iter().filter(|k| k.mode == measured).collect();
    let total: f64 = kernels.iter().map(|k| k.total_ms).sum();
    let own: Vec<String> = kernels.iter().filter(|k| k.own).map(|k| short_name(&k.name)).collect();
    let mut others: Vec<&&pb::KernelRecord> = kernels.iter().filter(|k| !k.own).collect();
    others.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
    let mut text = format!(
        "\nProfiling ratio {:.2}: your own kernels ({}) took {:.0}% of the time of a call ({:.3} ms counted).",
        evaluation.profiling_ratio,
        if own.is_empty() { "none ran".to_owned() } else { own.join(", ") },
        evaluation.profiling_ratio * 100.0,
        total,
    );
    if !others.is_empty() {
        let listed: Vec<String> =
            others.iter().take(3).map(|k| format!("{} ({:.3} ms)", short_name(&k.name), k.total_ms)).collect();
        text.push_str(&format!(" Most of the rest: {}.", listed.join(", ")));
    }
    text
}

/// A kernel's name without its parameter list, shortened for a prompt.
fn short_name(name: &str) -> String {
    let name = name.split('(').next().unwrap_or(name).trim();
    if name.chars().count() > 80 {
        format!("{}...", name.chars().take(80).collect::<String>())
    } else {
        name.to_owned()
    }
}

/// Replaces every `{{name}}` of `template` with its value, in one pass (a value is never re-expanded).
pub fn render(template: &str, values: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find("}}").map(|end| (&after[..end], &after[end + 2..])) {
            Some((name, tail)) if values.iter().any(|(n, _)| *n == name.trim()) => {
                let value = values.iter().find(|(n, _)| *n == name.trim()).map_or("", |(_, v)| v);
                out.push_str(value);
                rest = tail;
            }
            _ => {
                out.push_str("{{");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Whether a job of `spec` holds responses to the strict format: `JobSpec.strict_format`, else on for `kevin`.
pub fn strict_format(spec: &pb::JobSpec) -> bool {
    spec.strict_format.unwrap_or_else(|| Recipe::parse(&spec.recipe).is_ok_and(|recipe| recipe == Recipe::Kevin))
}

/// The feedback on a response that broke the strict format: why, and the shape asked for.
pub fn format_feedback(format_error: &str) -> String {
    format!(
        "not evaluated, scored 0: {format_error}. Answer with a short summary of your change, then the complete \
         ModelNew in exactly one ```python fenced block"
    )
}

/// The evaluation as the next turn's prompt shows it: the verdict, and what the model can act on; without one, why
/// there is none (the turn's `failure`, else no kernel in the response).
pub fn feedback(evaluation: Option<&pb::EvaluateResponse>, failure: Option<&TurnFailure>) -> String {
    let Some(evaluation) = evaluation else {
        return match failure {
            Some(failure) => format!("not evaluated: {failure}"),
            None => "no kernel was found: the response needs a ```python block defining ModelNew".into(),
        };
    };
    let verdict = pb::Verdict::try_from(evaluation.verdict).unwrap_or(pb::Verdict::Unspecified);
    let mut text = match verdict {
        pb::Verdict::Correct if evaluation.speedup_eager > 0.0 => {
            format!("correct, {:.2}x the speed of the PyTorch reference", evaluation.speedup_eager)
        }
        pb::Verdict::Correct => "correct".into(),
        pb::Verdict::Incorrect => "incorrect: the outputs differ from the reference".into(),
        pb::Verdict::CompileError => "compile error".into(),
        pb::Verdict::RuntimeError => "runtime error".into(),
        pb::Verdict::Timeout => "timed out".into(),
        pb::Verdict::Rejected => "rejected by the static checks".into(),
        pb::Verdict::Hack => "rejected as a reward hack".into(),
        pb::Verdict::InfraError => "not evaluated (infrastructure error)".into(),
        pb::Verdict::Unspecified => "no verdict".into(),
    };
    if let Some(m) = &evaluation.mismatch {
        text.push_str(&format!(
            "; output {} at {:?}: expected {}, got {} (max abs error {:.3e})",
            m.output_index, m.element_index, m.expected, m.got, m.max_abs_error
        ));
    }
    for finding in &evaluation.findings {
        if finding.category != pb::FindingCategory::Notice as i32 {
            text.push_str(&format!("; {} (line {}): {}", finding.code, finding.line, finding.message));
        }
    }
    let log = if evaluation.compile_log.is_empty() { &evaluation.error } else { &evaluation.compile_log };
    if verdict != pb::Verdict::Correct && !log.is_empty() {
        // The end of a log says what failed; its beginning is mostly the build's commands.
        let tail: Vec<&str> = log.lines().rev().take(12).collect();
        text.push('\n');
        text.push_str(&tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task() -> pb::Task {
        pb::Task { task_id: "examples/relu".into(), source: "class Model: pass\n".into() }
    }

    #[test]
    fn single_turn_prompt_holds_the_task_and_ignores_history() {
        let templates = Templates::load(Recipe::SingleTurn, None).expect("built-in templates");
        let earlier =
            [Attempt { kernel: "old".into(), feedback: "incorrect".into(), score: None, summary: String::new() }];
        let prompt = templates.prompt(&task(), &earlier);
        assert_eq!(prompt.len(), 2);
        assert_eq!(prompt[0].role, "system");
        assert!(prompt[1].content.contains("task examples/relu"), "{}", prompt[1].content);
        assert!(prompt[1].content.contains("```python\nclass Model: pass\n```"), "{}", prompt[1].content);
        assert!(!prompt[1].content.contains("old"));
        assert!(!prompt[1].content.contains("{{"), "every placeholder is filled: {}", prompt[1].content);
    }

    #[test]
    fn kevin_prompt_lists_earlier_attempts_in_order_with_feedback() {
        let templates = Templates::load(Recipe::Kevin, None).expect("built-in templates");
        assert_eq!(
            templates.prompt(&task(), &[]),
            Templates::load(Recipe::SingleTurn, None).expect("t").prompt(&task(), &[])
        );
        let earlier = [
            Attempt {
                kernel: "first_kernel".into(),
                feedback: "incorrect: the outputs differ".into(),
                score: Some(0.0),
                summary: String::new(),
            },
            Attempt {
                kernel: String::new(),
                feedback: "no kernel was found".into(),
                score: None,
                summary: String::new(),
            },
        ];
        let user = &templates.prompt(&task(), &earlier)[1].content;
        assert!(user.contains("What you said of it: (nothing)"), "{user}");
        let first = user.find("Attempt 1:").expect("attempt 1");
        let second = user.find("Attempt 2:").expect("attempt 2");
        assert!(first < second);
        assert!(user[first..second].contains("first_kernel") && user[first..second].contains("outputs differ"));
        assert!(user[second..].contains("(no kernel in the response)"));
        assert!(!user.contains("{{"), "{user}");
    }

    #[test]
    fn a_prompt_dir_overrides_single_files() {
        let dir = std::env::temp_dir().join(format!("kforge-prompts-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("single-turn")).expect("dir");
        std::fs::write(dir.join("single-turn/task.md"), "Speed up {{task_id}}: {{ task_source }} {{unknown}}")
            .expect("w");
        let templates = Templates::load(Recipe::SingleTurn, Some(&dir)).expect("templates");
        let prompt = templates.prompt(&task(), &[]);
        assert_eq!(prompt[1].content, "Speed up examples/relu: class Model: pass {{unknown}}");
        assert!(prompt[0].content.contains("expert"), "the system file stays built in");
        std::fs::remove_dir_all(dir).expect("cleanup");
    }

    #[test]
    fn recipes_by_name() {
        assert_eq!(Recipe::parse("kevin").expect("kevin"), Recipe::Kevin);
        let unknown = Recipe::parse("nope").expect_err("unknown").to_string();
        assert!(unknown.contains("spec.recipe") && unknown.contains("unknown recipe `nope`"), "{unknown}");
        assert_eq!(Recipe::parse("drkernel").expect("drkernel").name(), "drkernel");
        assert_eq!(Recipe::parse("cudaforge").expect("cudaforge").name(), "cudaforge");
    }

    #[test]
    fn drkernel_shows_the_best_earlier_turns_by_score_and_the_latest_in_turn_order() {
        let attempt = |kernel: &str, score: Option<f64>| Attempt {
            kernel: kernel.into(),
            feedback: "f".into(),
            score,
            summary: String::new(),
        };
        let earlier = [
            attempt("k0", Some(0.0)),
            attempt("k1", Some(2.5)),
            attempt("k2", None),
            attempt("k3", Some(1.0)),
            attempt("k4", Some(2.5)),
            attempt("k5", Some(0.0)),
        ];
        assert_eq!(best_within(&earlier, 3), [1, 4, 5], "the two best (a tie to the later) and the latest");
        assert_eq!(best_within(&earlier, 1), [5], "the latest always");
        assert_eq!(best_within(&earlier[..2], 4), [0, 1], "within the window: all");
        let mut templates = Templates::load(Recipe::DrKernel, None).expect("built-in templates");
        templates.window = 3;
        let user = &templates.prompt(&task(), &earlier)[1].content;
        let headings: Vec<&str> = user.lines().filter(|l| l.starts_with("Attempt ")).collect();
        assert_eq!(headings, ["Attempt 2:", "Attempt 5:", "Attempt 6:"], "numbered by their turns: {user}");
        assert!(user.contains("profiling ratio") && !user.contains("{{"), "{user}");
    }

    #[test]
    fn kevin_shows_change_summaries_and_drops_the_oldest_attempts_past_the_budget() {
        let completion = pb::Completion {
            text: "<think>hmm</think>I unrolled the loop by four.\n```python\nclass ModelNew: pass\n```".into(),
            ..Default::default()
        };
        assert_eq!(change_summary(Some(&completion)), "I unrolled the loop by four.");
        let long = pb::Completion { text: "x".repeat(700), ..Default::default() };
        assert_eq!(change_summary(Some(&long)).chars().count(), SUMMARY_CHARS + 3);
        let attempt = |kernel: &str| Attempt {
            kernel: kernel.repeat(50),
            feedback: "correct".into(),
            score: Some(1.0),
            summary: format!("summary of {kernel}"),
        };
        let earlier = [attempt("a"), attempt("b"), attempt("c")];
        let mut templates = Templates::load(Recipe::Kevin, None).expect("built-in templates");
        let full = templates.prompt(&task(), &earlier)[1].content.clone();
        assert!(full.contains("What you said of it: summary of a") && full.contains("Attempt 3:"), "{full}");
        templates.budget_chars = 300;
        let user = &templates.prompt(&task(), &earlier)[1].content;
        assert!(!user.contains("Attempt 1:") && user.contains("Attempt 3:"), "the oldest go first: {user}");
        assert!(user.contains("earlier attempts left out for the context budget"), "{user}");
        templates.budget_chars = 1;
        let user = &templates.prompt(&task(), &earlier)[1].content;
        assert!(
            user.contains("Attempt 3:") && user.contains("(2 earlier attempts left out"),
            "the latest stays: {user}"
        );
    }

    #[test]
    fn census_feedback_names_own_kernels_the_ratio_and_where_the_rest_went() {
        let kernel = |name: &str, own, total_ms, mode: &str| pb::KernelRecord {
            name: name.into(),
            own,
            launches: 2,
            total_ms,
            mode: mode.into(),
        };
        let evaluation = pb::EvaluateResponse {
            kernels: vec![
                kernel("relu_kernel(float const*, float*, long)", true, 0.02, "train/no_grad"),
                kernel("void at::native::vectorized_elementwise_kernel<4>(int)", false, 0.01, "train/no_grad"),
                kernel("relu_kernel(float const*, float*, long)", true, 9.0, "eval/grad"),
            ],
            profiling_ratio: 0.667,
            ..Default::default()
        };
        assert_eq!(
            census_feedback(&evaluation),
            "\nProfiling ratio 0.67: your own kernels (relu_kernel) took 67% of the time of a call (0.030 ms \
             counted). Most of the rest: void at::native::vectorized_elementwise_kernel<4> (0.010 ms)."
        );
        assert_eq!(census_feedback(&pb::EvaluateResponse::default()), "", "no census, nothing added");
    }

    #[test]
    fn cudaforge_prompt_carries_only_the_last_kernel_and_its_review() {
        let templates = Templates::load(Recipe::CudaForge, None).expect("built-in templates");
        assert!(!templates.judge.correction.is_empty() && !templates.judge.optimization.is_empty());
        let earlier = [
            Attempt {
                kernel: "first_kernel".into(),
                feedback: "compile error; judge: fix the typo".into(),
                score: None,
                summary: String::new(),
            },
            Attempt {
                kernel: "second_kernel".into(),
                feedback: "correct; judge: vectorise the loads".into(),
                score: None,
                summary: String::new(),
            },
        ];
        let user = &templates.prompt(&task(), &earlier)[1].content;
        assert!(user.contains("second_kernel") && user.contains("vectorise the loads"), "{user}");
        assert!(!user.contains("first_kernel") && !user.contains("fix the typo"), "only the last: {user}");
        assert!(user.contains("class Model: pass") && !user.contains("{{"), "{user}");
    }

    #[test]
    fn feedback_names_the_mismatch_and_the_speedup() {
        let incorrect = pb::EvaluateResponse {
            verdict: pb::Verdict::Incorrect as i32,
            mismatch: Some(pb::Mismatch { output_index: 0, expected: 1.0, got: 2.0, ..Default::default() }),
            ..Default::default()
        };
        let text = feedback(Some(&incorrect), None);
        assert!(text.starts_with("incorrect") && text.contains("expected 1, got 2"), "{text}");
        let correct =
            pb::EvaluateResponse { verdict: pb::Verdict::Correct as i32, speedup_eager: 1.5, ..Default::default() };
        assert_eq!(feedback(Some(&correct), None), "correct, 1.50x the speed of the PyTorch reference");
        assert!(feedback(None, None).starts_with("no kernel"));
    }

    #[test]
    fn a_failed_turn_s_feedback_says_why_it_was_not_evaluated() {
        let refused = TurnFailure::Evaluation(crate::failure::Refusal {
            code: tonic::Code::ResourceExhausted,
            message: "queue full".into(),
        });
        assert_eq!(feedback(None, Some(&refused)), "not evaluated: evaluator: ResourceExhausted: queue full");
        assert_eq!(
            feedback(None, Some(&TurnFailure::NoCompletion)),
            "not evaluated: gateway: the response held no completion"
        );
    }
}
