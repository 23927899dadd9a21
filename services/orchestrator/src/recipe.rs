//! Recipes: how a turn's prompt is built from the task and the trajectory's earlier turns. Prompts are rendered
//! from template files (`prompts/<recipe>/*.md`, embedded in the binary); a job's `prompt_dir` may override any of
//! them with a file of the same name under `<prompt_dir>/<recipe>/`.

use std::path::Path;

use kforge_proto::v1 as pb;

use crate::error::OrchestratorError;

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
}

impl Recipe {
    /// Parses the spec's recipe name; `drkernel` is named by the contract but not built yet.
    pub fn parse(name: &str) -> Result<Self, OrchestratorError> {
        match name {
            "single-turn" => Ok(Self::SingleTurn),
            "kevin" => Ok(Self::Kevin),
            "cudaforge" => Ok(Self::CudaForge),
            "drkernel" => {
                Err(OrchestratorError::invalid("spec.recipe", format!("`{name}` is not built yet; built: {BUILT}")))
            }
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
        }
    }
}

/// The recipes built, as errors list them.
const BUILT: &str = "single-turn, kevin, cudaforge";

/// Built-in template files, by recipe and file name.
const BUILT_IN: &[(&str, &str, &str)] = &[
    ("single-turn", "system.md", include_str!("../prompts/single-turn/system.md")),
    ("single-turn", "task.md", include_str!("../prompts/single-turn/task.md")),
    ("kevin", "system.md", include_str!("../prompts/kevin/system.md")),
    ("kevin", "task.md", include_str!("../prompts/kevin/task.md")),
    ("kevin", "attempt.md", include_str!("../prompts/kevin/attempt.md")),
    ("kevin", "refine.md", include_str!("../prompts/kevin/refine.md")),
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
        if self.recipe == Recipe::Kevin && !earlier.is_empty() {
            let attempts: Vec<String> = earlier
                .iter()
                .enumerate()
                .map(|(i, attempt)| {
                    let kernel =
                        if attempt.kernel.is_empty() { "(no kernel in the response)" } else { &attempt.kernel };
                    render(
                        &self.attempt,
                        &[
                            ("attempt", &(i + 1).to_string()),
                            ("kernel", kernel.trim_end()),
                            ("feedback", &attempt.feedback),
                        ],
                    )
                })
                .collect();
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

/// The evaluation as the next turn's prompt shows it: the verdict, and what the model can act on.
pub fn feedback(evaluation: Option<&pb::EvaluateResponse>, error: &str) -> String {
    let Some(evaluation) = evaluation else {
        return if error.is_empty() {
            "no kernel was found: the response needs a ```python block defining ModelNew".into()
        } else {
            format!("not evaluated: {error}")
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
        let earlier = [Attempt { kernel: "old".into(), feedback: "incorrect".into() }];
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
            Attempt { kernel: "first_kernel".into(), feedback: "incorrect: the outputs differ".into() },
            Attempt { kernel: String::new(), feedback: "no kernel was found".into() },
        ];
        let user = &templates.prompt(&task(), &earlier)[1].content;
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
        assert!(Recipe::parse("drkernel").expect_err("not built").to_string().contains("not built yet"));
        assert_eq!(Recipe::parse("cudaforge").expect("cudaforge").name(), "cudaforge");
    }

    #[test]
    fn cudaforge_prompt_carries_only_the_last_kernel_and_its_review() {
        let templates = Templates::load(Recipe::CudaForge, None).expect("built-in templates");
        assert!(!templates.judge.correction.is_empty() && !templates.judge.optimization.is_empty());
        let earlier = [
            Attempt { kernel: "first_kernel".into(), feedback: "compile error; judge: fix the typo".into() },
            Attempt { kernel: "second_kernel".into(), feedback: "correct; judge: vectorise the loads".into() },
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
        let text = feedback(Some(&incorrect), "");
        assert!(text.starts_with("incorrect") && text.contains("expected 1, got 2"), "{text}");
        let correct =
            pb::EvaluateResponse { verdict: pb::Verdict::Correct as i32, speedup_eager: 1.5, ..Default::default() };
        assert_eq!(feedback(Some(&correct), ""), "correct, 1.50x the speed of the PyTorch reference");
        assert!(feedback(None, "").starts_with("no kernel"));
    }
}
