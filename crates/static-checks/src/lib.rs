//! Static checks of candidate and task sources over a real Python parse (tree-sitter), never regular expressions.
//! Pure: no engine, no I/O. The evaluator and the profiler check candidates with it, and the engine
//! (`kforge-execution`) checks a request's task and reads a candidate's kernel names and policy for its census; the
//! orchestrator and `kforge-tasks` check tasks.
//!
//! A candidate is checked against a named, versioned policy; each problem is a [`Finding`] with a stable code, a
//! message and a line. Findings of category hack or policy reject the candidate (`VERDICT_REJECTED`); notices do
//! not. What cannot be seen in the source (work escaping the timer, memoisation, ...) is the run-time checks' job.
//!
//! Policies:
//! - `permissive@3`: the candidate must define `ModelNew`; anything that attacks the harness is a hack
//!   (process, thread, socket, ctypes, gc/inspect imports; patching torch or timers; `setattr` on torch; side
//!   streams; `exec`/`eval`; precision switches); `ModelNew` that only inherits the reference is a hack; at run
//!   time, a kernel the candidate defines and never launches, or an extension it compiles and forward never calls,
//!   is a hack (version 1 reported the kernel as a notice), and a profiling ratio below `LAZY_WORK_RATIO` is a
//!   notice (version 2 had none: torch doing the work went unnamed).
//! - `kevin-strict@2`: permissive, plus no `try`/`except`, no inheriting the reference at all, imports only
//!   from an allowlist, no files, no fast-math flags, no torch compute in `ModelNew.forward` (torch ops and their
//!   namespaces, `torch.nn.functional`, tensor compute methods, tensor operators, calls of torch layers built in
//!   `__init__`), no library compute in the extension's C++/CUDA sources (`static.library_compute`), and a
//!   profiling ratio below the threshold is a hack. Version 1 did not count tensor operators or library compute
//!   from C++, and had no threshold.
//!
//! By concern: [`parse`](self::parse) (the tree and its walk), [`rules`](self::rules) (the checks of a candidate's
//! Python: imports, calls, attributes, `ModelNew`), [`tensors`](self::tensors) (which expressions of a strict
//! `forward` are tensors), [`library`](self::library) (library compute called from an extension's C++/CUDA),
//! [`kernels`](self::kernels) (the kernels a candidate defines), [`precision`](self::precision) (a precision
//! downgrade against the task), [`torch_ops`](self::torch_ops) (torch's calls and methods as both rule sets
//! read them).

mod findings;
mod kernels;
mod library;
mod parse;
mod policy;
mod precision;
mod rules;
mod tensors;
mod torch_ops;

pub use findings::{Category, Finding};
pub use kernels::{cuda_kernel_names, triton_kernel_names};
pub use policy::{LAZY_WORK_RATIO, Policy};
pub use precision::precision_downgrade;

use findings::finding;
use parse::{Source, parse, syntax_error};

/// The static verdict on a candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CandidateReport {
    /// The source does not parse; the finding says where.
    pub syntax_error: bool,
    pub findings: Vec<Finding>,
}

impl CandidateReport {
    /// Whether any finding rejects the candidate.
    pub fn rejected(&self) -> bool {
        self.findings.iter().any(|f| f.category != Category::Notice)
    }
}

/// A source that is not a task in KernelBench format: what is missing or wrong (for INVALID_ARGUMENT).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotATask(String);

/// Checks a task in KernelBench format: it parses and defines `Model`, `get_inputs` and `get_init_inputs`.
/// The error names what is missing, for INVALID_ARGUMENT.
pub fn check_task(source: &str) -> Result<(), NotATask> {
    let not_a_task = |what: &str| NotATask(what.to_owned());
    let tree = parse(source).ok_or_else(|| not_a_task("could not be parsed"))?;
    let root = tree.root_node();
    if let Some((line, what)) = syntax_error(root) {
        return Err(NotATask(format!("syntax error at line {line}: {what}")));
    }
    let src = Source { text: source.as_bytes() };
    let mut cursor = root.walk();
    let top: Vec<(String, String)> = root
        .children(&mut cursor)
        .map(|n| if n.kind() == "decorated_definition" { n.child_by_field_name("definition").unwrap_or(n) } else { n })
        .filter_map(|n| Some((n.kind().to_owned(), src.text(n.child_by_field_name("name")?).to_owned())))
        .collect();
    let defines = |kind: &str, name: &str| top.iter().any(|(k, n)| k == kind && n == name);
    if !defines("class_definition", "Model") {
        return Err(not_a_task("defines no class Model"));
    }
    for function in ["get_inputs", "get_init_inputs"] {
        if !defines("function_definition", function) {
            return Err(NotATask(format!("defines no {function}()")));
        }
    }
    Ok(())
}

/// Checks a candidate against `policy`.
pub fn check_candidate(source: &str, policy: Policy) -> CandidateReport {
    let Some(tree) = parse(source) else {
        return CandidateReport {
            syntax_error: true,
            findings: vec![finding(
                "static.syntax_error",
                "the source could not be parsed".into(),
                1,
                Category::Policy,
            )],
        };
    };
    let root = tree.root_node();
    if let Some((line, what)) = syntax_error(root) {
        let message = format!("syntax error at line {line}: {what}");
        return CandidateReport {
            syntax_error: true,
            findings: vec![finding("static.syntax_error", message, line, Category::Policy)],
        };
    }
    CandidateReport { syntax_error: false, findings: rules::check(source, root, policy) }
}

#[cfg(test)]
mod tests;
