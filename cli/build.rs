//! Builds the replay files of the embedded default job (`kforge run` with no model named), derived here so that
//! they never drift from examples/tasks/:
//!
//! - `default_replay.jsonl`, the `replay` model: for every example task, records for trajectories 0 to
//!   `TRAJECTORIES - 1` and turns 0 to `TURNS - 1`. A task's `story/<trajectory>/` folder, where it has one, tells
//!   that trajectory's turns: `<k>_<what>.py` is turn k's kernel and `<k>_<what>.txt` turn k's whole answer as
//!   written (a junk response, say). Turn 0 with no file is the task's candidate (`candidates/*.py`, by name, the
//!   trajectory's index modulo their count); a later turn with no file keeps the previous turn's kernel.
//! - `default_judge_replay.jsonl`, the `replay-judge` model (the cudaforge Judge), keyed the same: the answer in
//!   `story/<trajectory>/<k>_<what>.judge.json` where the story has one, else a generic review that names itself a
//!   replay.
//!
//! A kernel's answer is a short reasoning and the kernel in a ```python block. Every record carries its usage:
//! completion and reasoning tokens counted at 4 characters per token, the rough rate of a BPE tokenizer on code
//! and English. The prompt's tokens are left to the gateway, which counts the prompt it is sent at the same rate.

use std::path::{Path, PathBuf};

/// Trajectories recorded per task: the default job's 2.
const TRAJECTORIES: usize = 2;

/// Turns recorded per trajectory: enough for the default multi-turn job (3 turns) and one more.
const TURNS: usize = 4;

/// Characters per token of the recorded usage.
const CHARS_PER_TOKEN: usize = 4;

/// The generic review: every field of both Judge modes, so that it reads in either.
const GENERIC_REVIEW: &str = r#"{"critical_issue": "(replayed review) the evaluation above names the failure", "why_it_matters": "(replayed review) the outputs must match the reference", "minimal_fix_hint": "(replayed review) fix what the evaluation names and keep the rest", "bottleneck": "(replayed review) the diagnosis above names it", "optimisation_method": "(replayed review) act on the diagnosis above", "modification_plan": "(replayed review) change one thing, keep the outputs exact, measure again"}"#;

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    // Read when the script runs, not baked in when it is compiled: a checkout elsewhere sharing the target
    // directory reuses the compiled script with its own path.
    let examples = Path::new(&std::env::var("CARGO_MANIFEST_DIR")?).join("../examples/tasks");
    println!("cargo:rerun-if-changed={}", examples.display());
    let tasks = files(&examples, |p| p.join("task.py").is_file())?;
    let (mut coder, mut judge) = (String::new(), String::new());
    for task in &tasks {
        let name = task.file_name().and_then(|n| n.to_str()).ok_or("example task names are utf-8")?;
        let candidates = files(&task.join("candidates"), |p| p.extension().is_some_and(|e| e == "py"))?;
        if candidates.is_empty() {
            return Err(format!("{}: no candidates/*.py", task.display()).into());
        }
        for trajectory in 0..TRAJECTORIES {
            let story = story(&task.join("story").join(trajectory.to_string()))?;
            let mut kernel = candidates[trajectory % candidates.len()].clone();
            for turn in 0..TURNS {
                let told = story.iter().find(|told| told.turn == turn);
                let answer = match told {
                    Some(StoryTurn { answer: Answer::Verbatim(file), .. }) => verbatim(file)?,
                    Some(StoryTurn { answer: Answer::Kernel(file), .. }) => {
                        kernel = file.clone();
                        with_kernel(name, turn, &kernel, false)?
                    }
                    None => with_kernel(name, turn, &kernel, turn > 0)?,
                };
                let record = serde_json::json!({
                    "task_id": format!("examples/{name}"),
                    "trajectory": trajectory,
                    "turn": turn,
                    "completions": [{"reasoning": answer.reasoning, "text": answer.text, "finish_reason": "stop"}],
                    "usage": {
                        "completion_tokens": tokens(&answer.reasoning) + tokens(&answer.text),
                        "reasoning_tokens": tokens(&answer.reasoning),
                    },
                });
                coder.push_str(&serde_json::to_string(&record)?);
                coder.push('\n');
                let review = match told.and_then(|told| told.review.as_deref()) {
                    Some(path) => std::fs::read_to_string(path)?,
                    None => GENERIC_REVIEW.to_owned(),
                };
                let record = serde_json::json!({
                    "task_id": format!("examples/{name}"),
                    "trajectory": trajectory,
                    "turn": turn,
                    "completions": [{"text": review.trim_end(), "finish_reason": "stop"}],
                    "usage": {"completion_tokens": tokens(review.trim_end())},
                });
                judge.push_str(&serde_json::to_string(&record)?);
                judge.push('\n');
            }
        }
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("default_replay.jsonl"), coder)?;
    std::fs::write(out.join("default_judge_replay.jsonl"), judge)?;
    Ok(())
}

/// Tokens of `text` at [`CHARS_PER_TOKEN`], rounded up.
fn tokens(text: &str) -> usize {
    text.chars().count().div_ceil(CHARS_PER_TOKEN)
}

/// One recorded answer.
struct Recorded {
    reasoning: String,
    text: String,
}

/// An answer with the kernel in `source`: a line saying what it does (or that nothing changed) and the kernel.
fn with_kernel(name: &str, turn: usize, source: &Path, kept: bool) -> Result<Recorded, Error> {
    println!("cargo:rerun-if-changed={}", source.display());
    let code = std::fs::read_to_string(source)?;
    let approach = what(source)?;
    Ok(if kept {
        Recorded {
            reasoning: format!("Okay, turn {turn} of {name}: the last kernel stands; I keep it unchanged."),
            text: format!("No change this turn: the kernel stays as it was.\n\n```python\n{}\n```\n", code.trim_end()),
        }
    } else {
        Recorded {
            reasoning: format!(
                "Okay, the task is {name}. I will write ModelNew with the {approach} approach and keep the reference's \
                 outputs exactly."
            ),
            text: format!(
                "ModelNew below computes {name} with the {approach} approach.\n\n```python\n{}\n```\n",
                code.trim_end()
            ),
        }
    })
}

/// An answer written out whole in `file`.
fn verbatim(file: &Path) -> Result<Recorded, Error> {
    println!("cargo:rerun-if-changed={}", file.display());
    Ok(Recorded { reasoning: String::new(), text: std::fs::read_to_string(file)? })
}

/// What a story file's name says it is: `2_fused_in_place.py` is "fused in place".
fn what(file: &Path) -> Result<String, Error> {
    let stem = file.file_stem().and_then(|n| n.to_str()).ok_or("example file names are utf-8")?;
    Ok(stem.trim_start_matches(|c: char| c.is_ascii_digit() || c == '_').replace('_', " "))
}

/// What a story file answers with.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Answer {
    /// A kernel (`.py`), wrapped in a short answer.
    Kernel(PathBuf),
    /// The whole answer as written (`.txt`).
    Verbatim(PathBuf),
}

/// One turn of a trajectory's story.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct StoryTurn {
    turn: usize,
    answer: Answer,
    /// The Judge's answer to that turn's evaluation, when the story has one.
    review: Option<PathBuf>,
}

/// The story in `dir` (`story/<trajectory>/`), by turn; empty when there is none.
fn story(dir: &Path) -> Result<Vec<StoryTurn>, Error> {
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut story = Vec::new();
    for file in files(dir, |p| p.extension().is_some_and(|e| e == "py" || e == "txt"))? {
        let stem = file.file_stem().and_then(|n| n.to_str()).ok_or("story file names are utf-8")?;
        let turn: usize = stem.split('_').next().and_then(|n| n.parse().ok()).ok_or("<k>_<what>.py or .txt")?;
        if turn >= TURNS {
            return Err(format!("{}: a story turn is 0 to {}", file.display(), TURNS - 1).into());
        }
        if story.iter().any(|told: &StoryTurn| told.turn == turn) {
            return Err(format!("{}: turn {turn} is told twice", dir.display()).into());
        }
        let judged = file.with_extension("judge.json");
        if judged.is_file() {
            println!("cargo:rerun-if-changed={}", judged.display());
        }
        let answer = if file.extension().is_some_and(|e| e == "txt") {
            Answer::Verbatim(file.clone())
        } else {
            Answer::Kernel(file.clone())
        };
        story.push(StoryTurn { turn, answer, review: judged.is_file().then_some(judged) });
    }
    story.sort();
    Ok(story)
}

/// The entries of `dir` that `keep` accepts, sorted by name.
fn files(dir: &Path, keep: impl Fn(&Path) -> bool) -> Result<Vec<PathBuf>, Error> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter(|p| keep(p))
        .collect();
    found.sort();
    Ok(found)
}
