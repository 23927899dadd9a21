//! Builds the replay files of the embedded default job (`kforge run` with no model named), derived here so that
//! they never drift from examples/tasks/:
//!
//! - `default_replay.jsonl`, the `replay` model: for every example task and each of its candidates (sorted by file
//!   name; the candidate's index is the trajectory), records for turns 0 to `TURNS - 1`. Turn 0 is the candidate.
//!   Trajectory 0 of a task with a `turns/` folder follows its story there: `turns/<k>_<what>.py` is turn k (a
//!   failure, its fix, a faster kernel). A turn with no file keeps the previous turn's kernel.
//! - `default_judge_replay.jsonl`, the `replay-judge` model (the cudaforge Judge), keyed the same: the answer in
//!   `turns/<k>_<what>.judge.json` where the story has one, else a generic review that names itself a replay.
//!
//! Every completion is a short reasoning and the kernel in a ```python block.

use std::path::{Path, PathBuf};

/// Turns recorded per trajectory: enough for the default multi-turn job (3 turns) and one more.
const TURNS: usize = 4;

/// The generic review: every field of both Judge modes, so that it reads in either.
const GENERIC_REVIEW: &str = r#"{"critical_issue": "(replayed review) the evaluation above names the failure", "why_it_matters": "(replayed review) the outputs must match the reference", "minimal_fix_hint": "(replayed review) fix what the evaluation names and keep the rest", "bottleneck": "(replayed review) the diagnosis above names it", "optimisation_method": "(replayed review) act on the diagnosis above", "modification_plan": "(replayed review) change one thing, keep the outputs exact, measure again"}"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read when the script runs, not baked in when it is compiled: a checkout elsewhere sharing the target
    // directory reuses the compiled script with its own path.
    let examples = Path::new(&std::env::var("CARGO_MANIFEST_DIR")?).join("../examples/tasks");
    println!("cargo:rerun-if-changed={}", examples.display());
    let mut tasks = files(&examples, |p| p.join("task.py").is_file())?;
    tasks.sort();
    let (mut coder, mut judge) = (String::new(), String::new());
    for task in &tasks {
        let name = task.file_name().and_then(|n| n.to_str()).ok_or("example task names are utf-8")?;
        let story = story(task)?;
        let candidates = files(&task.join("candidates"), |p| p.extension().is_some_and(|e| e == "py"))?;
        for (trajectory, candidate) in candidates.iter().enumerate() {
            let mut kernel = candidate.clone();
            for turn in 0..TURNS {
                let told = story.iter().find(|told| trajectory == 0 && told.turn == turn);
                let review = told.and_then(|told| told.review.clone());
                if let Some(told) = told {
                    kernel = told.kernel.clone();
                }
                let kept = turn > 0 && told.is_none();
                let record = coder_record(name, trajectory, turn, &kernel, kept)?;
                coder.push_str(&serde_json::to_string(&record)?);
                coder.push('\n');
                let answer = match review {
                    Some(path) => std::fs::read_to_string(path)?,
                    None => GENERIC_REVIEW.to_owned(),
                };
                let record = serde_json::json!({
                    "task_id": format!("examples/{name}"),
                    "trajectory": trajectory,
                    "turn": turn,
                    "completions": [{"text": answer.trim_end(), "finish_reason": "stop"}],
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

/// The coder's record of one turn: the kernel in `source`, and a line saying what changed (or that nothing did).
fn coder_record(
    name: &str,
    trajectory: usize,
    turn: usize,
    source: &Path,
    kept: bool,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed={}", source.display());
    let code = std::fs::read_to_string(source)?;
    let stem = source.file_stem().and_then(|n| n.to_str()).ok_or("example file names are utf-8")?;
    let approach = stem.trim_start_matches(|c: char| c.is_ascii_digit() || c == '_').replace('_', " ");
    let (reasoning, text) = if kept {
        (
            format!("Okay, turn {turn} of {name}: the last kernel stands; I keep it unchanged."),
            format!("No change this turn: the kernel stays as it was.\n\n```python\n{}\n```\n", code.trim_end()),
        )
    } else {
        (
            format!(
                "Okay, the task is {name}. I will write ModelNew with the {approach} approach and keep the reference's \
                 outputs exactly."
            ),
            format!(
                "ModelNew below computes {name} with the {approach} approach.\n\n```python\n{}\n```\n",
                code.trim_end()
            ),
        )
    };
    Ok(serde_json::json!({
        "task_id": format!("examples/{name}"),
        "trajectory": trajectory,
        "turn": turn,
        "completions": [{"reasoning": reasoning, "text": text, "finish_reason": "stop"}],
    }))
}

/// One turn of a task's story for trajectory 0.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct StoryTurn {
    turn: usize,
    /// The kernel's file.
    kernel: PathBuf,
    /// The Judge's answer to that turn's evaluation, when the story has one.
    review: Option<PathBuf>,
}

/// A task's story for trajectory 0, by turn.
fn story(task: &Path) -> Result<Vec<StoryTurn>, Box<dyn std::error::Error>> {
    let dir = task.join("turns");
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut story = Vec::new();
    for file in files(&dir, |p| p.extension().is_some_and(|e| e == "py"))? {
        let stem = file.file_stem().and_then(|n| n.to_str()).ok_or("story file names are utf-8")?;
        let turn: usize = stem.split('_').next().and_then(|n| n.parse().ok()).ok_or("turns/<k>_<what>.py")?;
        if turn == 0 || turn >= TURNS {
            return Err(format!("{}: a story turn is 1 to {}", file.display(), TURNS - 1).into());
        }
        let judged = file.with_extension("judge.json");
        if judged.is_file() {
            println!("cargo:rerun-if-changed={}", judged.display());
        }
        story.push(StoryTurn { turn, kernel: file.clone(), review: judged.is_file().then_some(judged) });
    }
    story.sort();
    Ok(story)
}

/// The entries of `dir` that `keep` accepts, sorted by name.
fn files(dir: &Path, keep: impl Fn(&Path) -> bool) -> Result<Vec<PathBuf>, Box<dyn std::error::Error>> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter(|p| keep(p))
        .collect();
    found.sort();
    Ok(found)
}
