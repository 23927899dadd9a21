//! Builds the replay file of the embedded default job (`kforge run` with no arguments): for every example task and
//! each of its candidates (sorted by file name; the candidate's index is the trajectory), one turn-0 record whose
//! completion is a short reasoning and the candidate in a ```python block. The gateway serves it as the `replay`
//! model; the file is derived here so that it never drifts from examples/tasks/.

use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tasks");
    println!("cargo:rerun-if-changed={}", examples.display());
    let mut tasks: Vec<PathBuf> =
        std::fs::read_dir(&examples)?.map(|e| e.map(|e| e.path())).collect::<Result<_, _>>()?;
    tasks.sort();
    let mut out = String::new();
    for task in tasks.iter().filter(|t| t.join("task.py").is_file()) {
        let name = task.file_name().and_then(|n| n.to_str()).ok_or("example task names are utf-8")?;
        let candidates_dir = task.join("candidates");
        println!("cargo:rerun-if-changed={}", candidates_dir.display());
        let mut candidates: Vec<PathBuf> = std::fs::read_dir(&candidates_dir)?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "py"))
            .collect();
        candidates.sort();
        for (trajectory, candidate) in candidates.iter().enumerate() {
            println!("cargo:rerun-if-changed={}", candidate.display());
            let source = std::fs::read_to_string(candidate)?;
            let stem = candidate.file_stem().and_then(|n| n.to_str()).ok_or("candidate names are utf-8")?;
            let approach = stem.replace('_', " ");
            let record = serde_json::json!({
                "task_id": format!("examples/{name}"),
                "trajectory": trajectory,
                "turn": 0,
                "completions": [{
                    "reasoning": format!(
                        "Okay, the task is {name}. I will write ModelNew with the {approach} approach and keep the \
                         reference's outputs exactly."
                    ),
                    "text": format!(
                        "ModelNew below computes {name} with the {approach} approach.\n\n```python\n{}\n```\n",
                        source.trim_end()
                    ),
                    "finish_reason": "stop",
                }],
            });
            out.push_str(&serde_json::to_string(&record)?);
            out.push('\n');
        }
    }
    std::fs::write(Path::new(&std::env::var("OUT_DIR")?).join("default_replay.jsonl"), out)?;
    Ok(())
}
