//! Task sets: kforge's own example tasks (embedded in the binary from `examples/tasks/<name>/task.py`), the tour, and
//! an importer for a KernelBench directory. An imported file is checked as the evaluator checks a task
//! (`kforge_static_checks::check_task`): one that is not a task comes back rejected, with the reason.

use std::path::{Path, PathBuf};

use kforge_static_checks::check_task;

/// A task in KernelBench format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskSource {
    /// `examples/relu`, `level1/19_ReLU`, ...
    pub id: String,
    pub source: String,
}

/// A file that is not a usable task, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub path: PathBuf,
    pub reason: String,
}

/// Why a directory could not be imported at all.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{0}: no level directories (level1, level2, ...) with task files")]
    Empty(PathBuf),
}

macro_rules! examples {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_str!(concat!("../../../examples/tasks/", $name, "/task.py")))),*]
    };
}

/// The example tasks, in a fixed order: elementwise, reductions, matmul, fused chains, and integer, scalar and
/// tuple outputs. `examples/tasks/<name>/candidates/` holds a reference candidate for each.
const EXAMPLES: &[(&str, &str)] = examples![
    "relu",
    "gelu_tanh",
    "scaled_add",
    "row_softmax",
    "row_sum",
    "layer_norm",
    "matmul",
    "linear_relu",
    "bias_gelu_residual",
    "mse_loss",
    "argmax_rows",
    "cumsum_rows",
    "tuple_outputs",
];

/// The example tasks of the tour, the default job's task set: each has a replayed story per trajectory
/// (`examples/tasks/<name>/story/`) in which a kernel gets faster turn by turn, a compile error and a wrong answer are
/// fixed, a hack is caught and a junk answer scores nothing.
const TOUR: &[&str] = &["gelu_tanh", "scaled_add"];

/// kforge's own example tasks.
pub fn examples() -> Vec<TaskSource> {
    EXAMPLES
        .iter()
        .map(|(name, source)| TaskSource { id: format!("examples/{name}"), source: (*source).to_owned() })
        .collect()
}

/// The tour: the example tasks whose replayed answers tell a multi-turn story, in the examples' order.
pub fn tour() -> Vec<TaskSource> {
    examples().into_iter().filter(|task| TOUR.iter().any(|name| task.id == format!("examples/{name}"))).collect()
}

/// Reads every `level*/<n>_<name>.py` under `dir`, ordered by level and then task number. Files that do not parse
/// or lack `Model`, `get_inputs` or `get_init_inputs` are returned as rejected, with the reason.
pub fn import_kernelbench(dir: &Path) -> Result<(Vec<TaskSource>, Vec<Rejected>), ImportError> {
    let read_dir =
        |path: &Path| std::fs::read_dir(path).map_err(|source| ImportError::Read { path: path.to_owned(), source });
    let mut levels: Vec<(u32, PathBuf)> = read_dir(dir)?
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let level = name.strip_prefix("level")?.parse().ok()?;
            entry.path().is_dir().then(|| (level, entry.path()))
        })
        .collect();
    levels.sort();
    let (mut tasks, mut rejected) = (Vec::new(), Vec::new());
    for (level, path) in levels {
        let mut files: Vec<(u32, String, PathBuf)> = read_dir(&path)?
            .filter_map(Result::ok)
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let stem = name.strip_suffix(".py")?.to_owned();
                let number = stem.split('_').next()?.parse().ok()?;
                Some((number, stem, entry.path()))
            })
            .collect();
        files.sort();
        for (_, stem, file) in files {
            let source =
                std::fs::read_to_string(&file).map_err(|source| ImportError::Read { path: file.clone(), source })?;
            match check_task(&source) {
                Ok(()) => tasks.push(TaskSource { id: format!("level{level}/{stem}"), source }),
                Err(reason) => rejected.push(Rejected { path: file, reason: reason.to_string() }),
            }
        }
    }
    if tasks.is_empty() && rejected.is_empty() {
        return Err(ImportError::Empty(dir.to_owned()));
    }
    Ok((tasks, rejected))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TASK: &str = "import torch\nclass Model(torch.nn.Module):\n    pass\ndef get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n";

    #[test]
    fn examples_are_valid_tasks() {
        let examples = examples();
        assert!(examples.len() >= 12);
        for task in &examples {
            assert_eq!(check_task(&task.source), Ok(()), "{}", task.id);
        }
        assert_eq!(examples[0].id, "examples/relu");
        let tour: Vec<String> = tour().into_iter().map(|task| task.id).collect();
        assert_eq!(tour, ["examples/gelu_tanh", "examples/scaled_add"], "every name of TOUR is an example");
    }

    #[test]
    fn imports_levels_in_numeric_order_and_reports_bad_files() {
        let dir = std::env::temp_dir().join(format!("kforge-kernelbench-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, source) in [
            ("level2/1_Fused.py", TASK),
            ("level1/10_Second.py", TASK),
            ("level1/2_First.py", TASK),
            ("level1/3_Broken.py", "class Model(:\n"),
            ("level1/README.md", "not a task"),
            ("notes/1_Other.py", TASK),
        ] {
            let file = dir.join(path);
            std::fs::create_dir_all(file.parent().expect("has a parent")).expect("dir");
            std::fs::write(file, source).expect("write");
        }
        let (tasks, rejected) = import_kernelbench(&dir).expect("imports");
        let ids: Vec<&str> = tasks.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(ids, ["level1/2_First", "level1/10_Second", "level2/1_Fused"]);
        assert_eq!(rejected.len(), 1);
        assert!(rejected[0].path.ends_with("level1/3_Broken.py") && rejected[0].reason.starts_with("syntax error"));
        assert!(matches!(import_kernelbench(&dir.join("level1")), Err(ImportError::Empty(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
