//! A job's plan: its spec checked (INVALID_ARGUMENT naming the field) and resolved into what the job runs: the
//! recipe and its templates, how its turns are rewarded, and its tasks (the examples, inline tasks, a KernelBench
//! directory by level, or a JSONL file; every task's source checked as the evaluator checks it). A resumed job's
//! plan is its stored spec checked again with the tasks it was resolved to at submission. The orchestrator's limits
//! on a job's size (`Plan::check_limits`) apply at submission only: a job accepted once is not refused on resume.

use std::path::Path;

use kforge_proto::v1 as pb;

use crate::config::LimitsConfig;
use crate::error::OrchestratorError;
use crate::recipe::{self, Recipe, Templates};
use crate::reward::RewardPlan;

/// A checked spec, with its tasks resolved.
#[derive(Debug, Clone)]
pub struct Plan {
    pub spec: pb::JobSpec,
    pub recipe: Recipe,
    pub templates: Templates,
    /// How its turns are scored and credited.
    pub reward: RewardPlan,
    /// Whether its evaluations count the kernels that ran: drkernel's feedback, a formula's profiling ratio, PRS.
    pub census: bool,
    /// Whether responses must keep to the strict format to be evaluated (`JobSpec.strict_format`).
    pub strict_format: bool,
    pub tasks: Vec<pb::Task>,
}

impl Plan {
    /// Validates `spec` (INVALID_ARGUMENT naming the field) and resolves its task set.
    pub fn new(spec: pb::JobSpec) -> Result<Self, OrchestratorError> {
        Self::checked(spec, Sources::Check)
    }

    /// A submission's plan: what makes resolving costly checked first (inline tasks over `limits.tasks`, a task
    /// source over `limits.task_source_bytes`), then the spec checked and resolved, then the resolved job against
    /// the limits ([`Plan::check_limits`]).
    pub fn submitted(spec: pb::JobSpec, limits: &LimitsConfig) -> Result<Self, OrchestratorError> {
        check_inline_size(&spec, limits)?;
        let plan = Self::new(spec)?;
        plan.check_limits(limits)?;
        Ok(plan)
    }

    fn checked(spec: pb::JobSpec, sources: Sources) -> Result<Self, OrchestratorError> {
        match pb::JobKind::try_from(spec.kind) {
            Ok(pb::JobKind::Rollout | pb::JobKind::Evaluation) => {}
            Ok(pb::JobKind::Unspecified) => {
                return Err(OrchestratorError::invalid(
                    "spec.kind",
                    "required: JOB_KIND_ROLLOUT or JOB_KIND_EVALUATION",
                ));
            }
            Err(_) => return Err(OrchestratorError::unknown_enum("spec.kind", spec.kind)),
        }
        let recipe = Recipe::parse(&spec.recipe)?;
        if spec.model.is_empty() {
            return Err(OrchestratorError::invalid("spec.model", "required"));
        }
        if spec.trajectories_per_task == 0 {
            return Err(OrchestratorError::invalid("spec.trajectories_per_task", "must be at least 1"));
        }
        if spec.turns == 0 {
            return Err(OrchestratorError::invalid("spec.turns", "must be at least 1"));
        }
        // Each evaluation would be refused: a job of them would fail every turn.
        if pb::Backend::try_from(spec.backend).is_err() {
            return Err(OrchestratorError::unknown_enum("spec.backend", spec.backend));
        }
        if spec.correctness_trials > MAX_CORRECTNESS_TRIALS {
            return Err(OrchestratorError::invalid(
                "spec.correctness_trials",
                format!("{} is over the evaluator's limit of {MAX_CORRECTNESS_TRIALS}", spec.correctness_trials),
            ));
        }
        if let Some(sampling) = &spec.sampling {
            check_sampling(sampling)?;
        }
        let prompt_dir = (!spec.prompt_dir.is_empty()).then(|| Path::new(&spec.prompt_dir));
        if let Some(dir) = prompt_dir.filter(|d| !d.is_dir()) {
            return Err(OrchestratorError::invalid("spec.prompt_dir", format!("{} is not a directory", dir.display())));
        }
        // Templates are read from `<prompt_dir>/<recipe>/`: a directory without it would override nothing, the
        // job running on the built-ins while its owner believes otherwise.
        if let Some(dir) = prompt_dir.filter(|d| !d.join(recipe.name()).is_dir()) {
            return Err(OrchestratorError::invalid(
                "spec.prompt_dir",
                format!("{} has no `{}` directory of templates", dir.display(), recipe.name()),
            ));
        }
        let mut templates = Templates::load(recipe, prompt_dir)?;
        if spec.context_window > 0 {
            templates.window = spec.context_window;
        }
        templates.budget_chars = spec.context_budget_chars as usize;
        let reward = RewardPlan::new(recipe, spec.reward.as_ref(), spec.seed)?;
        if let Some(diagnose) = &spec.diagnose {
            check_diagnose(diagnose)?;
        }
        let mut tasks = resolve_tasks(&spec, sources)?;
        if spec.max_tasks > 0 {
            tasks.truncate(spec.max_tasks as usize);
        }
        let census = recipe == Recipe::DrKernel || reward.needs_census() || reward.prs.is_some();
        let strict_format = recipe::strict_format(&spec);
        Ok(Self { spec, recipe, templates, reward, census, strict_format, tasks })
    }

    /// The plan of a stored job: its spec checked again and its templates read again, with the tasks it was
    /// resolved to at submission (a task directory may have changed since).
    pub fn resumed(spec: pb::JobSpec, tasks: Vec<pb::Task>) -> Result<Self, OrchestratorError> {
        let inline = pb::JobSpec {
            task_set: "inline".into(),
            tasks: tasks.clone(),
            max_tasks: 0,
            levels: Vec::new(),
            ..spec.clone()
        };
        // Checked when the job was submitted (a job stored before the check existed is not refused now).
        let plan = Self::checked(inline, Sources::Trusted)?;
        Ok(Self { spec, tasks, ..plan })
    }

    /// Whether the job fits the orchestrator's `limits` (an OverLimit naming the field and the key otherwise):
    /// tasks (as resolved), trajectories per task, turns, and turns in all.
    pub fn check_limits(&self, limits: &LimitsConfig) -> Result<(), OrchestratorError> {
        let over = |field: &str, value: u64, unit: String, limit: u64, key: &'static str| {
            (limit > 0 && value > limit).then(|| OrchestratorError::OverLimit {
                field: field.to_owned(),
                value,
                unit,
                limit,
                key,
            })
        };
        let spec = &self.spec;
        let tasks = self.tasks.len() as u64;
        let (trajectories, turns) = (u64::from(spec.trajectories_per_task), u64::from(spec.turns));
        let tasks_field = if spec.task_set == "inline" { "spec.tasks" } else { "spec.task_set" };
        let tasks_unit = match spec.max_tasks {
            0 => " tasks".to_owned(),
            _ => " tasks (after max_tasks)".to_owned(),
        };
        let checks = [
            over("spec.trajectories_per_task", trajectories, String::new(), limits.trajectories_per_task, TRAJECTORIES),
            over("spec.turns", turns, String::new(), limits.turns, TURNS),
            over(tasks_field, tasks, tasks_unit, limits.tasks, TASKS),
            self.tasks.iter().enumerate().find_map(|(i, task)| {
                over(
                    &source_field(spec, i),
                    task.source.len() as u64,
                    " bytes".into(),
                    limits.task_source_bytes,
                    SOURCE_BYTES,
                )
            }),
            over(
                "spec",
                self.turns_total(),
                format!(" turns ({tasks} tasks x {trajectories} trajectories x {turns} turns)"),
                limits.total_turns,
                TOTAL_TURNS,
            ),
        ];
        match checks.into_iter().flatten().next() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    pub fn episodes(&self) -> u64 {
        (self.tasks.len() as u64).saturating_mul(u64::from(self.spec.trajectories_per_task))
    }

    /// Saturating: a spec of `u32::MAX` trajectories and turns is counted (and refused by the limits), not wrapped.
    pub fn turns_total(&self) -> u64 {
        self.episodes().saturating_mul(u64::from(self.spec.turns))
    }

    /// A new turn's record of `completion`: its kernel, and under the strict format policy what breaks it.
    pub(super) fn read_completion(&self, mut record: pb::TurnRecord, completion: pb::Completion) -> pb::TurnRecord {
        record.kernel = kforge_model_text::extract_kernel(&completion.text).unwrap_or_default().to_owned();
        if self.strict_format
            && let Err(error) = kforge_model_text::check_strict_format(&completion.text, &completion.finish_reason)
        {
            record.format_error = error.to_string();
        }
        record.completion = Some(completion);
        record
    }
}

/// The most correctness trials the evaluator runs (its request check refuses more).
const MAX_CORRECTNESS_TRIALS: u32 = 100;

/// The config keys of the limits, as errors name them.
const TASKS: &str = "orchestrator.limits.tasks";
const SOURCE_BYTES: &str = "orchestrator.limits.task_source_bytes";
const TRAJECTORIES: &str = "orchestrator.limits.trajectories_per_task";
const TURNS: &str = "orchestrator.limits.turns";
const TOTAL_TURNS: &str = "orchestrator.limits.total_turns";

/// Whether inline tasks' sources are checked: at submission they are; a stored job's were.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sources {
    Check,
    Trusted,
}

/// Where the source of the job's `index`th task comes from, as an error names it.
fn source_field(spec: &pb::JobSpec, index: usize) -> String {
    match spec.task_set.as_str() {
        "inline" => format!("spec.tasks[{index}].source"),
        _ => "spec.task_set".to_owned(),
    }
}

/// What makes an inline task list costly to check (each source is parsed, each id compared), checked before it is:
/// more tasks than `limits.tasks`, or a source over `limits.task_source_bytes` (the evaluator refuses a source
/// over its `max_source_bytes` at every turn).
fn check_inline_size(spec: &pb::JobSpec, limits: &LimitsConfig) -> Result<(), OrchestratorError> {
    let tasks = spec.tasks.len() as u64;
    if spec.task_set == "inline" && limits.tasks > 0 && tasks > limits.tasks {
        let (field, unit) = ("spec.tasks".to_owned(), " tasks".to_owned());
        return Err(OrchestratorError::OverLimit { field, value: tasks, unit, limit: limits.tasks, key: TASKS });
    }
    let limit = limits.task_source_bytes;
    match spec.tasks.iter().position(|task| limit > 0 && task.source.len() as u64 > limit) {
        Some(i) => Err(OrchestratorError::OverLimit {
            field: format!("spec.tasks[{i}].source"),
            value: spec.tasks[i].source.len() as u64,
            unit: " bytes".into(),
            limit,
            key: SOURCE_BYTES,
        }),
        None => Ok(()),
    }
}

/// Sampling as the gateway would refuse it at every generation (its ranges, `gateway.proto`'s
/// `SamplingParams`); the limits of the model's pool (`max_tokens`, `n`) are the gateway's to check.
fn check_sampling(sampling: &pb::SamplingParams) -> Result<(), OrchestratorError> {
    let pb::SamplingParams {
        temperature,
        top_p,
        top_k,
        min_p,
        max_tokens,
        stop,
        seed: _,
        n,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        extra_body,
    } = sampling;
    let range = |field: &str, value: Option<f64>, lo: f64, hi: f64, lo_open: bool| match value {
        Some(v) if !(v.is_finite() && (if lo_open { v > lo } else { v >= lo }) && v <= hi) => {
            let open = if lo_open { "(" } else { "[" };
            Err(OrchestratorError::invalid(
                format!("spec.sampling.{field}"),
                format!("must be in {open}{lo}, {hi}], got {v}"),
            ))
        }
        _ => Ok(()),
    };
    range("temperature", *temperature, 0.0, 100.0, false)?;
    range("top_p", *top_p, 0.0, 1.0, true)?;
    range("min_p", *min_p, 0.0, 1.0, false)?;
    range("presence_penalty", *presence_penalty, -2.0, 2.0, false)?;
    range("frequency_penalty", *frequency_penalty, -2.0, 2.0, false)?;
    range("repetition_penalty", *repetition_penalty, 0.0, 10.0, true)?;
    if let Some(top_k) = top_k.filter(|k| !(*k == -1 || *k >= 1)) {
        return Err(OrchestratorError::invalid(
            "spec.sampling.top_k",
            format!("must be -1 (off) or >= 1, got {top_k}"),
        ));
    }
    if *max_tokens == Some(0) {
        return Err(OrchestratorError::invalid("spec.sampling.max_tokens", "must be at least 1"));
    }
    if *n == Some(0) {
        return Err(OrchestratorError::invalid("spec.sampling.n", "must be at least 1"));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(OrchestratorError::invalid(format!("spec.sampling.stop[{i}]"), "must not be empty"));
    }
    let reserved = ["model", "messages", "prompt", "stream", "stream_options"];
    if let Some(key) = extra_body.iter().flat_map(|body| body.fields.keys()).find(|k| reserved.contains(&k.as_str())) {
        return Err(OrchestratorError::invalid(
            format!("spec.sampling.extra_body.{key}"),
            "is set by the gateway and cannot be overridden",
        ));
    }
    Ok(())
}

/// The job's diagnosis parameters, as the reward service would refuse them (INVALID_ARGUMENT naming the field).
fn check_diagnose(params: &pb::DiagnoseParams) -> Result<(), OrchestratorError> {
    if params.not_okay_off && params.opening.is_some() {
        return Err(OrchestratorError::invalid("spec.diagnose.opening", "must be unset when not_okay_off is true"));
    }
    if params.opening.as_deref().is_some_and(|opening| opening.trim().is_empty()) {
        return Err(OrchestratorError::invalid("spec.diagnose.opening", "empty: leave it unset for the default"));
    }
    if let Some(threshold) = params.repetition_threshold.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(OrchestratorError::invalid(
            "spec.diagnose.repetition_threshold",
            format!("must be in [0, 1], got {threshold}"),
        ));
    }
    Ok(())
}

/// The tasks of a task set (`examples`, a KernelBench directory, a `.jsonl` file), as a job's `task_set` resolves.
pub fn task_set(task_set: &str) -> Result<Vec<pb::Task>, OrchestratorError> {
    resolve_tasks(&pb::JobSpec { task_set: task_set.to_owned(), ..Default::default() }, Sources::Check)
}

fn resolve_tasks(spec: &pb::JobSpec, sources: Sources) -> Result<Vec<pb::Task>, OrchestratorError> {
    let field = "spec.task_set";
    if !spec.tasks.is_empty() && spec.task_set != "inline" {
        return Err(OrchestratorError::invalid("spec.tasks", "inline tasks need task_set `inline`"));
    }
    let tasks: Vec<pb::Task> = match spec.task_set.as_str() {
        "" => {
            return Err(OrchestratorError::invalid(
                field,
                "required: `tour`, `examples`, `inline`, a KernelBench directory or a JSONL file",
            ));
        }
        name @ ("examples" | "tour") => {
            let tasks = if name == "tour" { kforge_tasks::tour() } else { kforge_tasks::examples() };
            tasks.into_iter().map(|t| pb::Task { task_id: t.id, source: t.source }).collect()
        }
        "inline" => {
            let mut ids = std::collections::HashSet::with_capacity(spec.tasks.len());
            for (i, task) in spec.tasks.iter().enumerate() {
                if task.task_id.is_empty() || task.source.trim().is_empty() {
                    return Err(OrchestratorError::invalid(format!("spec.tasks[{i}]"), "needs a task_id and a source"));
                }
                if !ids.insert(task.task_id.as_str()) {
                    return Err(OrchestratorError::invalid(
                        format!("spec.tasks[{i}]"),
                        format!("task_id `{}` appears twice", task.task_id),
                    ));
                }
                // The evaluator's own check of a task (it parses as Python and defines Model, get_inputs and
                // get_init_inputs): a source it would refuse at every turn is refused once, here.
                if sources == Sources::Check
                    && let Err(reason) = kforge_static_checks::check_task(&task.source)
                {
                    return Err(OrchestratorError::invalid(
                        format!("spec.tasks[{i}].source"),
                        format!("not a task: {reason}"),
                    ));
                }
            }
            spec.tasks.clone()
        }
        path if path.ends_with(".jsonl") => jsonl_tasks(Path::new(path))?,
        path => {
            let dir = Path::new(path);
            if !dir.is_dir() {
                return Err(OrchestratorError::invalid(
                    field,
                    format!("{path} is not a directory (a KernelBench directory) or a .jsonl file"),
                ));
            }
            let (tasks, _rejected) =
                kforge_tasks::import_kernelbench(dir).map_err(|e| OrchestratorError::invalid(field, e.to_string()))?;
            tasks
                .into_iter()
                .filter(|t| {
                    spec.levels.is_empty() || spec.levels.iter().any(|l| t.id.starts_with(&format!("level{l}/")))
                })
                .map(|t| pb::Task { task_id: t.id, source: t.source })
                .collect()
        }
    };
    if !spec.levels.is_empty() && !Path::new(&spec.task_set).is_dir() {
        return Err(OrchestratorError::invalid("spec.levels", "only a KernelBench directory has levels"));
    }
    if tasks.is_empty() {
        return Err(OrchestratorError::invalid(field, format!("`{}` holds no tasks", spec.task_set)));
    }
    Ok(tasks)
}

/// A JSONL task set: one `{"task_id": "...", "source": "..."}` object per line (blank lines skipped), each source a
/// KernelBench-format task; the first line that is not one is INVALID_ARGUMENT naming it.
fn jsonl_tasks(path: &Path) -> Result<Vec<pb::Task>, OrchestratorError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        task_id: String,
        source: String,
    }
    let field = "spec.task_set";
    let text = std::fs::read_to_string(path)
        .map_err(|e| OrchestratorError::invalid(field, format!("cannot read {}: {e}", path.display())))?;
    let mut tasks: Vec<pb::Task> = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for (index, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = |message: String| {
            OrchestratorError::invalid(field, format!("{} line {}: {message}", path.display(), index + 1))
        };
        let task: Line = serde_json::from_str(line).map_err(|e| at(format!("not a task object: {e}")))?;
        if task.task_id.is_empty() {
            return Err(at("task_id is empty".into()));
        }
        if !ids.insert(task.task_id.clone()) {
            return Err(at(format!("task_id `{}` appears twice", task.task_id)));
        }
        kforge_static_checks::check_task(&task.source)
            .map_err(|reason| at(format!("source is not a task: {reason}")))?;
        tasks.push(pb::Task { task_id: task.task_id, source: task.source });
    }
    Ok(tasks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> pb::JobSpec {
        pb::JobSpec {
            kind: pb::JobKind::Evaluation.into(),
            recipe: "single-turn".into(),
            task_set: "examples".into(),
            model: "replay".into(),
            trajectories_per_task: 2,
            turns: 3,
            ..Default::default()
        }
    }

    fn invalid(spec: pb::JobSpec) -> String {
        Plan::new(spec).expect_err("invalid").to_string()
    }

    #[test]
    fn a_plan_resolves_the_examples_and_counts_its_turns() {
        let plan = Plan::new(pb::JobSpec { max_tasks: 2, ..spec() }).expect("valid");
        let ids: Vec<&str> = plan.tasks.iter().map(|t| t.task_id.as_str()).collect();
        assert_eq!(ids, ["examples/relu", "examples/gelu_tanh"]);
        assert_eq!((plan.episodes(), plan.turns_total()), (4, 12));
        assert_eq!(Plan::new(spec()).expect("valid").tasks.len(), 13);
    }

    #[test]
    fn a_stored_job_resumes_with_the_tasks_it_was_resolved_to() {
        let dir = std::env::temp_dir().join(format!("kforge-resumed-plan-{}", std::process::id()));
        let spec = pb::JobSpec { task_set: dir.display().to_string(), levels: vec![2], max_tasks: 1, ..spec() };
        let tasks = vec![pb::Task { task_id: "level2/1_a".into(), source: "class Model: pass".into() }];
        let plan = Plan::resumed(spec.clone(), tasks.clone()).expect("the directory need not exist any more");
        assert_eq!((plan.episodes(), plan.turns_total()), (2, 6));
        assert_eq!((plan.tasks, plan.spec), (tasks, spec));
    }

    #[test]
    fn bad_specs_name_their_field() {
        assert!(invalid(pb::JobSpec { kind: 0, ..spec() }).starts_with("spec.kind:"));
        assert!(invalid(pb::JobSpec { recipe: "x".into(), ..spec() }).starts_with("spec.recipe:"));
        assert!(invalid(pb::JobSpec { model: String::new(), ..spec() }).starts_with("spec.model:"));
        assert!(invalid(pb::JobSpec { trajectories_per_task: 0, ..spec() }).starts_with("spec.trajectories_per_task:"));
        assert!(invalid(pb::JobSpec { turns: 0, ..spec() }).starts_with("spec.turns:"));
        assert!(invalid(pb::JobSpec { task_set: "/nonexistent/dir".into(), ..spec() }).starts_with("spec.task_set:"));
        let empty = std::env::temp_dir().join(format!("kforge-empty-tasks-{}", std::process::id()));
        std::fs::create_dir_all(&empty).expect("dir");
        assert!(invalid(pb::JobSpec { task_set: empty.display().to_string(), ..spec() }).starts_with("spec.task_set:"));
        let task = |id: &str| pb::Task { task_id: id.into(), source: TASK.into() };
        let twice = pb::JobSpec { task_set: "inline".into(), tasks: vec![task("a"), task("a")], ..spec() };
        assert!(invalid(twice).starts_with("spec.tasks[1]:"));
        let inline = pb::JobSpec { task_set: "inline".into(), tasks: vec![task("a"), task("b")], ..spec() };
        assert_eq!(Plan::new(inline).expect("valid").tasks.len(), 2);
        assert!(invalid(pb::JobSpec { tasks: vec![task("a")], ..spec() }).starts_with("spec.tasks:"));
    }

    /// A KernelBench-format task the evaluator accepts.
    const TASK: &str = "import torch\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n\n\
                        def get_inputs():\n    return [torch.randn(4)]\n\ndef get_init_inputs():\n    return []\n";

    #[test]
    fn an_inline_task_the_evaluator_would_refuse_is_refused_naming_its_source() {
        let inline = |sources: &[&str]| pb::JobSpec {
            task_set: "inline".into(),
            tasks: sources
                .iter()
                .enumerate()
                .map(|(i, source)| pb::Task { task_id: format!("t{i}"), source: (*source).into() })
                .collect(),
            ..spec()
        };
        let refused = invalid(inline(&[TASK, "int main() { return 0; }"]));
        assert!(refused.starts_with("spec.tasks[1].source: not a task: syntax error at line 1"), "{refused}");
        let refused = invalid(inline(&["class Model: pass\n"]));
        assert_eq!(refused, "spec.tasks[0].source: not a task: defines no get_inputs()");
        assert!(Plan::new(inline(&[TASK, TASK])).is_ok());
        // A stored job's tasks were checked when it was submitted: resuming it does not check them again.
        let stored = vec![pb::Task { task_id: "old".into(), source: "class Model: pass".into() }];
        assert!(Plan::resumed(inline(&[TASK]), stored).is_ok());
    }

    #[test]
    fn limits_name_the_field_the_value_and_the_key() {
        let limits =
            LimitsConfig { tasks: 5, trajectories_per_task: 4, turns: 3, total_turns: 20, ..LimitsConfig::default() };
        let refused = |spec: pb::JobSpec| {
            Plan::new(spec).expect("a valid spec").check_limits(&limits).expect_err("over a limit").to_string()
        };
        assert_eq!(
            refused(pb::JobSpec { trajectories_per_task: 1_000_000_000, ..spec() }),
            "spec.trajectories_per_task: 1000000000 is over the limit of 4 (orchestrator.limits.trajectories_per_task)"
        );
        assert_eq!(
            refused(pb::JobSpec { turns: u32::MAX, ..spec() }),
            "spec.turns: 4294967295 is over the limit of 3 (orchestrator.limits.turns)"
        );
        assert_eq!(
            refused(pb::JobSpec { trajectories_per_task: 1, turns: 1, ..spec() }),
            "spec.task_set: 13 tasks is over the limit of 5 (orchestrator.limits.tasks)",
            "the examples are 13 tasks"
        );
        assert_eq!(
            refused(pb::JobSpec { max_tasks: 4, ..spec() }),
            "spec: 24 turns (4 tasks x 2 trajectories x 3 turns) is over the limit of 20 (orchestrator.limits.total_turns)"
        );
        // The tasks are counted after max_tasks; at the limits, a job is accepted; 0 is no limit.
        let at_limits = pb::JobSpec { max_tasks: 5, trajectories_per_task: 4, turns: 1, ..spec() };
        assert_eq!(Plan::new(at_limits.clone()).expect("valid").check_limits(&limits).ok(), Some(()));
        let inline = pb::JobSpec {
            task_set: "inline".into(),
            tasks: (0..6).map(|i| pb::Task { task_id: format!("t{i}"), source: TASK.into() }).collect(),
            trajectories_per_task: 1,
            turns: 1,
            ..spec()
        };
        assert_eq!(refused(inline), "spec.tasks: 6 tasks is over the limit of 5 (orchestrator.limits.tasks)");
        let none = LimitsConfig { tasks: 0, trajectories_per_task: 0, turns: 0, total_turns: 0, task_source_bytes: 0 };
        let huge = pb::JobSpec { trajectories_per_task: u32::MAX, turns: u32::MAX, ..spec() };
        assert_eq!(Plan::new(huge).expect("valid").check_limits(&none).ok(), Some(()));
        // The defaults take the default `kforge run` job (13 tasks x 1 x 1) and KernelBench x 16 x 8.
        let defaults = LimitsConfig::default();
        let run = pb::JobSpec { trajectories_per_task: 1, turns: 1, ..spec() };
        assert_eq!(Plan::new(run).expect("valid").check_limits(&defaults).ok(), Some(()));
        assert!(250 * 16 * 8 <= defaults.total_turns);
    }
}
