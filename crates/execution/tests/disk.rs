//! The disk budget's dry run: a task's input and output bytes from its shapes on the meta device, in the sandbox,
//! and an honest "unknown" where the shapes cannot tell, until the task's reference has written its outputs.

use std::path::PathBuf;

use kforge_execution::disk::{DiskBudget, OutputPlan, TaskSizes};
use kforge_execution::python::PythonEnv;
use kforge_sandbox::{Sandbox, SandboxOptions};
use kforge_test_support::python;

const SHAPES: &str = r#"import torch
class Model(torch.nn.Module):
    def __init__(self, features):
        super().__init__()
        self.linear = torch.nn.Linear(features, 2 * features)
    def forward(self, x, y):
        return self.linear(x), y.sum(dim=1)
def get_inputs():
    return [torch.randn(64, 512), torch.randn(64, 256, dtype=torch.float16)]
def get_init_inputs():
    return [512]
"#;

/// Reads a value: nothing on the meta device has one.
const READS_A_VALUE: &str = r#"import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x * float(x.max())
def get_inputs():
    return [torch.randn(1 << 20)]
def get_init_inputs():
    return []
"#;

#[tokio::test]
async fn a_task_s_sizes_come_from_its_shapes_and_one_that_reads_values_writes_alone_until_its_reference_ran() {
    let Some(python) = python::or_skip(&[]) else { return };
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("disk-dry-run");
    let env = PythonEnv::probe(&python, &scratch.join("probe")).await.expect("python with torch");
    let sandbox = Sandbox::detect_with(SandboxOptions::default()).await;
    let budget = DiskBudget::new(1 << 30);

    let sizes = budget.task_sizes("shapes", SHAPES, &sandbox, &env, &scratch.join("shapes")).await;
    let inputs = 64 * 512 * 4 + 64 * 256 * 2;
    let outputs = 64 * 1024 * 4 + 64 * 2;
    assert_eq!(sizes, Some(TaskSizes { input_bytes: inputs, output_bytes: outputs }));
    let plan = OutputPlan { trials: 8, budget: 12 << 30, new_reference: true };
    assert_eq!(budget.need(sizes, plan), 21 * outputs, "eight trials a side and five timed calls' outputs");

    let unknown = budget.task_sizes("reads", READS_A_VALUE, &sandbox, &env, &scratch.join("reads")).await;
    assert_eq!(unknown, None);
    assert_eq!(budget.need(unknown, plan), budget.capacity(), "unknown: the whole budget");

    // Once its reference has written a trial's outputs, the task reserves what its files take.
    budget.note_reference_outputs("reads", 4 << 20);
    let measured = budget.task_sizes("reads", READS_A_VALUE, &sandbox, &env, &scratch.join("reads")).await;
    assert_eq!(measured, Some(TaskSizes { input_bytes: 0, output_bytes: 4 << 20 }));
    assert_eq!(budget.need(measured, plan), 21 * (4 << 20));
}

/// Evaluations that meet a task at once share its one dry run: the second waits for the first's, whose scratch alone
/// holds the task it ran.
#[tokio::test]
async fn concurrent_first_evaluations_of_a_task_share_one_dry_run() {
    let Some(python) = python::or_skip(&[]) else { return };
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("disk-dry-run-shared");
    let _ = std::fs::remove_dir_all(&scratch);
    let env = PythonEnv::probe(&python, &scratch.join("probe")).await.expect("python with torch");
    let sandbox = Sandbox::detect_with(SandboxOptions::default()).await;
    let budget = DiskBudget::new(1 << 30);
    let (a, b) = (scratch.join("a"), scratch.join("b"));
    let (first, second) = tokio::join!(
        budget.task_sizes("shared", SHAPES, &sandbox, &env, &a),
        budget.task_sizes("shared", SHAPES, &sandbox, &env, &b),
    );
    assert!(first.is_some() && first == second, "{first:?} {second:?}");
    let ran = [&a, &b].map(|dir| dir.join("task.py").is_file());
    assert_eq!(ran.iter().filter(|r| **r).count(), 1, "one dry run for both: {ran:?}");
}
