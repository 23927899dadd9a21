//! Static checks of candidate and task sources over a real Python parse (tree-sitter), never regular expressions.
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
//! downgrade against the task).

mod kernels;
mod library;
mod parse;
mod precision;
mod rules;
mod tensors;

pub use kernels::own_kernel_names;
pub use precision::precision_downgrade;

use parse::{Source, parse, syntax_error};

/// What kind of problem a finding is (the wire's `FindingCategory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    Hack,
    Policy,
    Notice,
}

/// One problem in a source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub code: &'static str,
    pub message: String,
    pub line: u32,
    pub category: Category,
}

/// A named, versioned static policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    pub name: &'static str,
    pub version: u32,
    strict: bool,
    /// Whether a candidate whose own kernels do not run in some census mode (or whose compiled extension forward
    /// never calls) is only a notice (a decoy, the work done by torch or another path, is otherwise a hack). No
    /// shipped policy relaxes it.
    unlaunched_kernels_allowed: bool,
    /// A profiling ratio below this is lazy work (`runtime.low_profiling_ratio`): a notice where the policy lets
    /// torch do the work, a hack where it does not. Candidates whose own code does the work measure about 0.99 on
    /// the CPU census and 1.0 on a GPU; the lazy ones seen measured 0.03-0.29 (and 0 without code of their own).
    min_profiling_ratio: f64,
}

/// The profiling ratio under which the shipped policies name lazy work: between the lazy candidates measured
/// (at most 0.29) and the ones doing their own work (about 0.99), with room on both sides.
pub const LAZY_WORK_RATIO: f64 = 0.5;

impl Policy {
    pub const PERMISSIVE: Policy = Policy {
        name: "permissive",
        version: 3,
        strict: false,
        unlaunched_kernels_allowed: false,
        min_profiling_ratio: LAZY_WORK_RATIO,
    };
    pub const KEVIN_STRICT: Policy = Policy {
        name: "kevin-strict",
        version: 2,
        strict: true,
        unlaunched_kernels_allowed: false,
        min_profiling_ratio: LAZY_WORK_RATIO,
    };
    pub const ALL: [Policy; 2] = [Self::PERMISSIVE, Self::KEVIN_STRICT];

    /// Whether the policy demands the candidate's own kernels do the work (Kevin's rules).
    pub fn strict(&self) -> bool {
        self.strict
    }

    /// Whether torch and libraries may do the work (a low profiling ratio is then a notice, not a hack).
    pub fn torch_compute_allowed(&self) -> bool {
        !self.strict
    }

    /// Whether own kernels that never run are a hack (see `census::analyse`).
    pub fn unlaunched_kernels_are_hacks(&self) -> bool {
        !self.unlaunched_kernels_allowed
    }

    /// The profiling ratio below which the census names lazy work.
    pub fn min_profiling_ratio(&self) -> f64 {
        self.min_profiling_ratio
    }

    /// The same policy with decoys relaxed to notices (no shipped policy does this).
    #[cfg(test)]
    pub(crate) fn relaxing_unlaunched_kernels(mut self) -> Policy {
        self.unlaunched_kernels_allowed = true;
        self
    }

    /// `name@version`.
    pub fn id(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }

    /// Resolves `name` or `name@version`.
    pub fn resolve(requested: &str) -> Option<Policy> {
        let (name, version) = match requested.split_once('@') {
            Some((name, version)) => (name, Some(version.parse::<u32>().ok()?)),
            None => (requested, None),
        };
        Self::ALL.into_iter().find(|p| p.name == name && version.is_none_or(|v| v == p.version))
    }
}

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

fn finding(code: &'static str, message: String, line: u32, category: Category) -> Finding {
    Finding { code, message, line, category }
}
#[cfg(test)]
mod tests;
