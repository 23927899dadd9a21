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

use tree_sitter::{Node, Parser};

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

/// Modules whose import is an attack on the harness under every policy.
const HOSTILE_MODULES: &[&str] = &[
    "ctypes",
    "subprocess",
    "socket",
    "threading",
    "multiprocessing",
    "concurrent",
    "asyncio",
    "signal",
    "gc",
    "inspect",
    "importlib",
    "builtins",
    "marshal",
    "pickle",
    "shutil",
    "pty",
    "http",
    "urllib",
    "requests",
    "cffi",
    "mmap",
    "resource",
    "faulthandler",
    "sys",
    "_thread",
];

/// Attributes that reach other code's objects and frames: how a candidate would find the reference `Model`, the
/// harness's state or its caller's locals without importing anything forbidden.
const INTROSPECTION: &[&str] = &[
    "__subclasses__",
    "__globals__",
    "__code__",
    "__closure__",
    "__builtins__",
    "_getframe",
    "f_back",
    "f_locals",
    "f_globals",
    "gi_frame",
    "tb_frame",
];

/// CUDA APIs that pin data in L2 across kernel launches.
const L2_PERSISTENCE: &[&str] =
    &["cudaLimitPersistingL2CacheSize", "accessPolicyWindow", "cudaAccessPropertyPersisting"];

/// Low-precision types, in Python or in CUDA source strings.
const LOW_PRECISION: &[&str] = &[
    "float16",
    "bfloat16",
    ".half(",
    "torch.half",
    "__half",
    "half2",
    "__nv_bfloat16",
    "__float2half",
    "bf16",
    "fp16",
];

/// A candidate for a task that uses no low-precision type, but which does: computing an fp32 task in fp16 or bf16
/// can pass an fp32 tolerance on well-conditioned outputs while doing less work.
pub fn precision_downgrade(candidate: &str, task: &str) -> Option<Finding> {
    let task = task.to_ascii_lowercase();
    // `half` covers `.half(`, `torch.half` and `__half`; the rest name bf16 and fp16 types.
    if task.contains("half") || LOW_PRECISION.iter().any(|word| task.contains(word)) {
        return None;
    }
    candidate.lines().enumerate().find_map(|(index, text)| {
        let code = text.split('#').next().unwrap_or("");
        let word = LOW_PRECISION.iter().find(|word| code.contains(*word))?;
        Some(finding(
            "static.precision_downgrade",
            format!("`{word}` on a task without low-precision types downgrades its precision"),
            index as u32 + 1,
            Category::Hack,
        ))
    })
}

/// Modules a strict candidate may import (and their submodules).
const STRICT_ALLOWED_MODULES: &[&str] = &[
    "torch",
    "triton",
    "math",
    "numpy",
    "typing",
    "functools",
    "itertools",
    "collections",
    "dataclasses",
    "operator",
    "numbers",
    "enum",
    "abc",
    "__future__",
];

/// `torch.<name>(...)` calls that allocate or describe tensors rather than compute on them.
const ALLOCATION_OPS: &[&str] = &[
    "empty",
    "empty_like",
    "empty_strided",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "arange",
    "tensor",
    "as_tensor",
    "device",
    "Size",
    "finfo",
    "iinfo",
    "is_tensor",
    "numel",
    "get_default_dtype",
    "manual_seed",
];

/// Tensor methods that compute (rather than reshape, allocate or move) — forbidden in a strict `forward`.
const COMPUTE_METHODS: &[&str] = &[
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "einsum",
    "conv1d",
    "conv2d",
    "conv3d",
    "relu",
    "relu_",
    "gelu",
    "sigmoid",
    "tanh",
    "softmax",
    "log_softmax",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "pow",
    "sum",
    "mean",
    "var",
    "std",
    "max",
    "min",
    "amax",
    "amin",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "prod",
    "norm",
    "add",
    "add_",
    "sub",
    "mul",
    "mul_",
    "div",
    "div_",
    "abs",
    "clamp",
    "clamp_",
    "clip",
    "where",
    "masked_fill",
    "sort",
    "topk",
    "logsumexp",
    "softplus",
    "sin",
    "cos",
    "erf",
    "neg",
    "reciprocal",
    "square",
    "maximum",
    "minimum",
    "matrix_power",
    "tril",
    "triu",
    "diag",
    "outer",
    "dot",
    "mv",
    "lerp",
    "addcmul",
    "addcdiv",
    "scatter",
    "gather",
    "index_select",
];

struct Source<'a> {
    text: &'a [u8],
}

impl<'a> Source<'a> {
    fn text(&self, node: Node<'_>) -> &'a str {
        node.utf8_text(self.text).unwrap_or("")
    }
}

fn line(node: Node<'_>) -> u32 {
    node.start_position().row as u32 + 1
}

fn parse(source: &str) -> Option<tree_sitter::Tree> {
    let mut parser = Parser::new();
    parser.set_language(&tree_sitter_python::LANGUAGE.into()).ok()?;
    parser.parse(source, None)
}

/// The first syntax error: (line, what).
fn syntax_error(root: Node<'_>) -> Option<(u32, String)> {
    if !root.has_error() {
        return None;
    }
    let mut found = None;
    walk(root, &mut |node| {
        if found.is_none() && (node.is_error() || node.is_missing()) {
            let what =
                if node.is_missing() { format!("missing `{}`", node.kind()) } else { "invalid syntax".to_owned() };
            found = Some((line(node), what));
        }
    });
    Some(found.unwrap_or((1, "invalid syntax".to_owned())))
}

fn walk<'t>(node: Node<'t>, visit: &mut impl FnMut(Node<'t>)) {
    visit(node);
    let mut cursor = node.walk();
    for child in node.children(&mut cursor) {
        walk(child, visit);
    }
}

/// Checks a task in KernelBench format: it parses and defines `Model`, `get_inputs` and `get_init_inputs`.
/// The error names what is missing, for INVALID_ARGUMENT.
pub fn check_task(source: &str) -> Result<(), String> {
    let tree = parse(source).ok_or("could not be parsed")?;
    let root = tree.root_node();
    if let Some((line, what)) = syntax_error(root) {
        return Err(format!("syntax error at line {line}: {what}"));
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
        return Err("defines no class Model".into());
    }
    for function in ["get_inputs", "get_init_inputs"] {
        if !defines("function_definition", function) {
            return Err(format!("defines no {function}()"));
        }
    }
    Ok(())
}

/// Names of the kernels the candidate defines itself: CUDA `__global__` functions (in its source strings) and
/// Triton `@jit` functions. The kernel census counts device time of kernels with these names as the candidate's own.
pub fn own_kernel_names(source: &str) -> Vec<String> {
    let mut names = cuda_kernel_names(source);
    if let Some(tree) = parse(source) {
        let src = Source { text: source.as_bytes() };
        walk(tree.root_node(), &mut |node| {
            if node.kind() != "decorated_definition" {
                return;
            }
            let mut cursor = node.walk();
            // `torch.jit.script` and friends compile TorchScript, not a kernel of the candidate's own.
            let jit = node.children(&mut cursor).any(|child| {
                child.kind() == "decorator" && {
                    let text = src.text(child);
                    text.contains("jit") && !text.contains("torch.jit")
                }
            });
            if let Some(name) = node
                .child_by_field_name("definition")
                .filter(|_| jit)
                .and_then(|definition| definition.child_by_field_name("name"))
            {
                names.push(src.text(name).to_owned());
            }
        });
    }
    names.sort();
    names.dedup();
    names
}

/// The function name after each `__global__`: the identifier before the first `(` that does not open
/// `__launch_bounds__(...)`.
fn cuda_kernel_names(source: &str) -> Vec<String> {
    let identifier = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut names = Vec::new();
    for (at, _) in source.match_indices("__global__") {
        let mut rest = &source[at + "__global__".len()..];
        while let Some(open) = rest.find('(') {
            let before = rest[..open].trim_end();
            let name = &before[before.trim_end_matches(identifier).len()..];
            if name == "__launch_bounds__" {
                let Some(close) = rest[open..].find(')') else { break };
                rest = &rest[open + close + 1..];
                continue;
            }
            if !name.is_empty() && !name.starts_with(|c: char| c.is_ascii_digit()) {
                names.push(name.to_owned());
            }
            break;
        }
    }
    names
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
    let mut checker =
        Checker { src: Source { text: source.as_bytes() }, policy, findings: Vec::new(), extensions: Vec::new() };
    checker.check(root);
    CandidateReport { syntax_error: false, findings: checker.findings }
}

fn finding(code: &'static str, message: String, line: u32, category: Category) -> Finding {
    Finding { code, message, line, category }
}

struct Checker<'a> {
    src: Source<'a>,
    policy: Policy,
    findings: Vec<Finding>,
    /// Names bound to the candidate's compiled extensions (`x = load_inline(...)`): calls on them are its kernels.
    extensions: Vec<String>,
}

impl Checker<'_> {
    fn add(&mut self, code: &'static str, message: String, node: Node<'_>, category: Category) {
        self.findings.push(finding(code, message, line(node), category));
    }

    fn check(&mut self, root: Node<'_>) {
        let mut model_new = None;
        walk(root, &mut |node| match node.kind() {
            "class_definition" if node.child_by_field_name("name").is_some_and(|n| self.src.text(n) == "ModelNew") => {
                model_new = Some(node);
            }
            "try_statement" if self.policy.strict => self.add(
                "static.try_except",
                "try/except is not allowed: a fallback can hide a failing kernel".into(),
                node,
                Category::Hack,
            ),
            "import_statement" | "import_from_statement" => self.check_import(node),
            "call" => self.check_call(node),
            "attribute" => {
                let name = node.child_by_field_name("attribute").map(|n| self.src.text(n)).unwrap_or("");
                if INTROSPECTION.contains(&name) {
                    self.add(
                        "static.introspection",
                        format!("`{name}` reaches into the interpreter's state (the harness, the reference, frames)"),
                        node,
                        Category::Hack,
                    );
                }
            }
            "identifier" if self.src.text(node) == "__builtins__" => self.add(
                "static.introspection",
                "`__builtins__` reaches past the import checks".into(),
                node,
                Category::Hack,
            ),
            "assignment" | "augmented_assignment" => {
                self.check_assignment(node);
                self.note_extension(node);
            }
            "string" if L2_PERSISTENCE.iter().any(|word| self.src.text(node).contains(word)) => self.add(
                "static.l2_persistence",
                "persisting L2 lines survive the timer's cache flush".into(),
                node,
                Category::Hack,
            ),
            "string" if self.src.text(node).contains("use_fast_math") => self.add(
                "static.fast_math",
                "fast-math compilation trades accuracy for speed on an exact task".into(),
                node,
                if self.policy.strict { Category::Policy } else { Category::Notice },
            ),
            _ => {}
        });
        match model_new {
            None => self.findings.push(finding(
                "static.no_model_new",
                "the candidate defines no class ModelNew".into(),
                1,
                Category::Policy,
            )),
            Some(class) => self.check_model_new(class),
        }
        if self.policy.strict {
            self.check_library_compute(root);
        }
    }

    fn check_import(&mut self, node: Node<'_>) {
        let mut modules = Vec::new();
        if node.kind() == "import_from_statement" {
            if let Some(module) = node.child_by_field_name("module_name") {
                modules.push(self.src.text(module).to_owned());
            }
        } else {
            let mut cursor = node.walk();
            for name in node.children_by_field_name("name", &mut cursor) {
                let name = if name.kind() == "aliased_import" {
                    name.child_by_field_name("name").unwrap_or(name)
                } else {
                    name
                };
                modules.push(self.src.text(name).to_owned());
            }
        }
        for module in modules {
            let root = module.trim_start_matches('.').split('.').next().unwrap_or("").to_owned();
            if HOSTILE_MODULES.contains(&root.as_str()) || (root == "os" && self.policy.strict) {
                self.add(
                    "static.forbidden_import",
                    format!("import of `{module}` is not allowed in a kernel"),
                    node,
                    Category::Hack,
                );
            } else if self.policy.strict && !STRICT_ALLOWED_MODULES.contains(&root.as_str()) && root != "os" {
                self.add(
                    "static.import_not_allowed",
                    format!("`{module}` is outside the import allowlist"),
                    node,
                    Category::Policy,
                );
            }
        }
    }

    fn check_call(&mut self, node: Node<'_>) {
        let Some(function) = node.child_by_field_name("function") else { return };
        let callee = self.src.text(function).replace(char::is_whitespace, "");
        let first_argument =
            node.child_by_field_name("arguments").and_then(|a| a.named_child(0)).map(|a| self.src.text(a).to_owned());
        match callee.as_str() {
            "exec" | "eval" | "compile" | "__import__" | "globals" | "vars" => {
                self.add("static.dynamic_code", format!("`{callee}()` hides code from review"), node, Category::Hack)
            }
            "setattr" | "delattr"
                if first_argument.as_deref().is_some_and(|a| a.starts_with("torch") || a.starts_with("time")) =>
            {
                self.add(
                    "static.patch_torch",
                    format!("`{callee}` on torch or time changes the harness"),
                    node,
                    Category::Hack,
                )
            }
            "open" if self.policy.strict => {
                self.add("static.file_access", "kernels do not open files".into(), node, Category::Policy)
            }
            "torch.set_float32_matmul_precision" => self.add(
                "static.precision_downgrade",
                "changing float32 matmul precision downgrades an exact task".into(),
                node,
                Category::Hack,
            ),
            _ if callee.starts_with("torch.cuda.Stream")
                || callee.starts_with("torch.cuda.stream")
                || callee.starts_with("torch.cuda.set_stream")
                || callee.starts_with("torch.cuda.ExternalStream") =>
            {
                self.add("static.side_stream", "work on another stream escapes the timer".into(), node, Category::Hack)
            }
            _ if callee.starts_with("os.system")
                || callee.starts_with("os.popen")
                || callee.starts_with("os.exec")
                || callee.starts_with("os.fork")
                || callee.starts_with("os.spawn") =>
            {
                self.add("static.forbidden_call", format!("`{callee}` starts processes"), node, Category::Hack)
            }
            _ => {}
        }
    }

    fn check_assignment(&mut self, node: Node<'_>) {
        let Some(left) = node.child_by_field_name("left") else { return };
        let target = self.src.text(left).replace(char::is_whitespace, "");
        let patched = ["torch.", "time.", "triton.", "F.", "nn."].iter().any(|p| target.starts_with(p));
        if left.kind() == "attribute" && patched {
            let (code, message) =
                if target.contains("allow_tf32") || target.contains("allow_fp16") || target.contains("allow_bf16") {
                    ("static.precision_downgrade", format!("`{target}` lowers precision on an exact task"))
                } else {
                    ("static.patch_torch", format!("assigning `{target}` patches the library the harness relies on"))
                };
            self.add(code, message, node, Category::Hack);
        }
    }

    fn note_extension(&mut self, node: Node<'_>) {
        let (Some(left), Some(right)) = (node.child_by_field_name("left"), node.child_by_field_name("right")) else {
            return;
        };
        let loads = right.kind() == "call"
            && right.child_by_field_name("function").is_some_and(|f| {
                let callee = self.src.text(f);
                callee == "load_inline"
                    || callee == "load"
                    || callee.ends_with(".load_inline")
                    || callee.ends_with("cpp_extension.load")
            });
        if loads && left.kind() == "identifier" {
            self.extensions.push(self.src.text(left).to_owned());
        }
    }

    fn check_model_new(&mut self, class: Node<'_>) {
        let bases: Vec<String> = class
            .child_by_field_name("superclasses")
            .map(|list| {
                let mut cursor = list.walk();
                list.named_children(&mut cursor).map(|b| self.src.text(b).to_owned()).collect()
            })
            .unwrap_or_default();
        let inherits_reference = bases.iter().any(|b| b == "Model" || b.ends_with(".Model"));
        let body = class.child_by_field_name("body");
        let methods: Vec<Node<'_>> = body
            .map(|body| {
                let mut cursor = body.walk();
                body.named_children(&mut cursor)
                    .map(|n| {
                        if n.kind() == "decorated_definition" {
                            n.child_by_field_name("definition").unwrap_or(n)
                        } else {
                            n
                        }
                    })
                    .filter(|n| n.kind() == "function_definition")
                    .collect()
            })
            .unwrap_or_default();
        let src = Source { text: self.src.text };
        let method = |name: &str| {
            methods.iter().copied().find(|m| m.child_by_field_name("name").is_some_and(|n| src.text(n) == name))
        };
        let forward = method("forward");
        let init = method("__init__");
        if inherits_reference && (self.policy.strict || forward.is_none()) {
            let message = if forward.is_none() {
                "ModelNew only inherits the reference Model: it would run the reference".to_owned()
            } else {
                "ModelNew inherits the reference Model".to_owned()
            };
            self.add("static.inherits_reference", message, class, Category::Hack);
        }
        if forward.is_none() && !inherits_reference {
            self.add("static.no_forward", "ModelNew defines no forward()".into(), class, Category::Policy);
        }
        if let (true, Some(forward)) = (self.policy.strict, forward) {
            let layers = init.map(|init| self.torch_layers(init)).unwrap_or_default();
            self.check_strict_forward(forward, init, &layers);
        }
    }

    /// Attributes `self.X = nn.Layer(...)` / `torch.nn.Layer(...)` built in `__init__`.
    fn torch_layers(&self, init: Node<'_>) -> Vec<String> {
        let mut layers = Vec::new();
        walk(init, &mut |node| {
            if node.kind() != "assignment" {
                return;
            }
            let (Some(left), Some(right)) = (node.child_by_field_name("left"), node.child_by_field_name("right"))
            else {
                return;
            };
            let target = self.src.text(left);
            if right.kind() == "call"
                && let Some(function) = right.child_by_field_name("function")
            {
                let callee = self.src.text(function);
                let is_layer = (callee.starts_with("nn.") || callee.starts_with("torch.nn."))
                    && !callee.ends_with("Parameter")
                    && !callee.ends_with("ParameterList")
                    && !callee.ends_with("Buffer");
                if is_layer && let Some(attribute) = target.strip_prefix("self.") {
                    layers.push(attribute.to_owned());
                }
            }
        });
        layers
    }

    fn check_strict_forward(&mut self, forward: Node<'_>, init: Option<Node<'_>>, layers: &[String]) {
        let tensors = Tensors::of_forward(&self.src, forward, init, layers, &self.extensions);
        let mut found = Vec::new();
        let mut operator_lines = Vec::new();
        walk(forward, &mut |node| match node.kind() {
            "call" => {
                let Some(function) = node.child_by_field_name("function") else { return };
                let callee = self.src.text(function).replace(char::is_whitespace, "");
                if let Some(op) = callee.strip_prefix("torch.") {
                    let namespaced = TORCH_COMPUTE_NAMESPACES.iter().any(|ns| op.starts_with(ns));
                    if namespaced || (!op.contains('.') && !ALLOCATION_OPS.contains(&op)) {
                        found.push((node, format!("torch op `{callee}` does the work in forward")));
                    }
                } else if callee.starts_with("F.") || callee.starts_with("nn.functional.") {
                    found.push((node, format!("`{callee}` does the work in forward")));
                } else if callee.starts_with("triton.ops.") {
                    found.push((node, format!("Triton's library kernel `{callee}` does the work in forward")));
                } else if let Some(attribute) = callee.strip_prefix("self.")
                    && layers.iter().any(|l| l == attribute)
                {
                    found.push((node, format!("torch layer `{callee}` does the work in forward")));
                } else if function.kind() == "attribute"
                    && let Some(method) = function.child_by_field_name("attribute")
                    && COMPUTE_METHODS.contains(&self.src.text(method))
                    && !callee.starts_with("self.")
                    && !function
                        .child_by_field_name("object")
                        .is_some_and(|o| self.extensions.iter().any(|e| e == self.src.text(o)))
                {
                    found
                        .push((node, format!("tensor method `.{}()` does the work in forward", self.src.text(method))));
                }
            }
            "binary_operator" if node.child_by_field_name("operator").is_some_and(|o| self.src.text(o) == "@") => {
                found.push((node, "`@` (torch matmul) does the work in forward".to_owned()));
            }
            "binary_operator" | "unary_operator" | "comparison_operator" | "augmented_assignment" => {
                // One finding per line: `a * alpha + b` is one piece of torch work, not two.
                if let Some(operator) = tensors.operator_on_tensors(node)
                    && !operator_lines.contains(&line(node))
                {
                    operator_lines.push(line(node));
                    found
                        .push((node, format!("tensor operator `{operator}` (torch compute) does the work in forward")));
                }
            }
            _ => {}
        });
        for (node, message) in found {
            self.add("static.torch_compute_in_forward", message, node, Category::Policy);
        }
    }

    /// Library compute in the C++/CUDA sources (strict): ATen and torch operators, tensor compute methods, cuBLAS,
    /// cuDNN and the other CUDA math libraries, device-wide CUB and Thrust algorithms. Every string of the source is
    /// read as C++ (docstrings aside), comments removed.
    fn check_library_compute(&mut self, root: Node<'_>) {
        let mut found = Vec::new();
        walk(root, &mut |node| {
            if node.kind() != "string" || node.parent().is_some_and(|p| p.kind() == "expression_statement") {
                return;
            }
            let mut seen: Vec<String> = Vec::new();
            for (offset, call) in library_calls(self.src.text(node)) {
                if !seen.contains(&call) {
                    found.push((line(node) + offset, call.clone()));
                    seen.push(call);
                }
            }
        });
        for (line, call) in found {
            self.findings.push(finding(
                "static.library_compute",
                format!(
                    "`{call}` in the extension's source is library compute: the candidate's own code must do the work"
                ),
                line,
                Category::Policy,
            ));
        }
    }
}

/// `torch.<namespace>...(...)` calls that compute (besides `torch.<op>` itself, checked against the allocations).
const TORCH_COMPUTE_NAMESPACES: &[&str] =
    &["nn.", "linalg.", "fft.", "special.", "sparse.", "ops.aten.", "ops.prims.", "_C.", "_VF.", "Tensor."];

/// Tensor methods that describe a tensor rather than make one: their results are Python numbers, shapes or
/// pointers, and arithmetic on them is not torch compute.
const NON_TENSOR_METHODS: &[&str] = &[
    "size",
    "dim",
    "ndimension",
    "numel",
    "nelement",
    "element_size",
    "item",
    "tolist",
    "stride",
    "storage_offset",
    "data_ptr",
    "is_contiguous",
    "is_floating_point",
    "is_complex",
    "get_device",
    "__len__",
];

/// `torch.<name>(...)` calls whose results are not tensors.
const NON_TENSOR_TORCH: &[&str] = &[
    "Size",
    "device",
    "finfo",
    "iinfo",
    "is_tensor",
    "numel",
    "get_default_dtype",
    "is_grad_enabled",
    "is_floating_point",
    "result_type",
    "promote_types",
];

/// Attributes of a tensor that are tensors too (views); every other attribute (`shape`, `dtype`, `device`, ...)
/// describes it.
const TENSOR_ATTRIBUTES: &[&str] = &["T", "mT", "H", "mH", "real", "imag", "data", "grad"];

/// Which expressions of `forward` are tensors: how the strict policy tells tensor operators (torch compute) from
/// arithmetic on numbers and shapes (`x.shape[0] * 2`, `n + 1`). A name is a tensor when it is a parameter of
/// `forward` (the task's inputs), or is assigned a tensor expression; an attribute of `self` when `__init__`
/// assigns it a `Parameter`, a torch call or registers it as a buffer. An expression is a tensor when it is one of
/// those, an index or view attribute (`.T`) of one, a call of torch (but for `torch.Size`, `torch.numel`, ...),
/// `torch.nn.functional`, a layer or an extension, a method call on a tensor other than a query (`.size()`,
/// `.item()`, `.data_ptr()`, ...), or an operator with a tensor operand. Everything else (literals, `len()`,
/// `int()`, `x.shape`, unknown helpers) is not.
struct Tensors<'s, 'a> {
    src: &'s Source<'a>,
    names: Vec<String>,
    attributes: Vec<String>,
    layers: Vec<String>,
    extensions: Vec<String>,
}

impl<'s, 'a> Tensors<'s, 'a> {
    fn of_forward(
        src: &'s Source<'a>,
        forward: Node<'_>,
        init: Option<Node<'_>>,
        layers: &[String],
        extensions: &[String],
    ) -> Self {
        let mut tensors = Tensors {
            src,
            names: Vec::new(),
            attributes: Vec::new(),
            layers: layers.to_vec(),
            extensions: extensions.to_vec(),
        };
        if let Some(parameters) = forward.child_by_field_name("parameters") {
            let mut cursor = parameters.walk();
            for parameter in parameters.named_children(&mut cursor) {
                let name = match parameter.kind() {
                    "identifier" => Some(parameter),
                    "list_splat_pattern" | "typed_parameter" | "default_parameter" | "typed_default_parameter" => {
                        parameter.child_by_field_name("name").or_else(|| parameter.named_child(0))
                    }
                    _ => None,
                };
                if let Some(name) = name.filter(|n| n.kind() == "identifier").map(|n| src.text(n))
                    && name != "self"
                {
                    tensors.names.push(name.to_owned());
                }
            }
        }
        if let Some(init) = init {
            tensors.attributes = tensors.init_attributes(init);
        }
        // Assignments in document order, again until nothing changes (a loop may use a name assigned below).
        loop {
            let before = tensors.names.len();
            walk(forward, &mut |node| {
                let (targets, value) = match node.kind() {
                    "assignment" => (node.child_by_field_name("left"), node.child_by_field_name("right")),
                    "for_statement" => (node.child_by_field_name("left"), node.child_by_field_name("right")),
                    _ => return,
                };
                if let (Some(targets), Some(value)) = (targets, value)
                    && tensors.is_tensor(value)
                {
                    walk(targets, &mut |target| {
                        let name = src.text(target);
                        if target.kind() == "identifier" && !tensors.names.iter().any(|n| n == name) {
                            tensors.names.push(name.to_owned());
                        }
                    });
                }
            });
            if tensors.names.len() == before {
                break;
            }
        }
        tensors
    }

    /// `self.X` that `__init__` makes a tensor: `nn.Parameter(...)`, a torch call, `register_buffer("X", ...)`.
    fn init_attributes(&self, init: Node<'_>) -> Vec<String> {
        let mut attributes = Vec::new();
        walk(init, &mut |node| {
            if node.kind() == "assignment"
                && let (Some(left), Some(right)) = (node.child_by_field_name("left"), node.child_by_field_name("right"))
                && let Some(attribute) = self.src.text(left).strip_prefix("self.")
                && right.kind() == "call"
                && let Some(function) = right.child_by_field_name("function")
            {
                let callee = self.src.text(function).replace(char::is_whitespace, "");
                if callee.ends_with("Parameter") || callee.starts_with("torch.") {
                    attributes.push(attribute.to_owned());
                }
            }
            if node.kind() == "call"
                && node.child_by_field_name("function").is_some_and(|f| self.src.text(f).ends_with("register_buffer"))
                && let Some(name) = node.child_by_field_name("arguments").and_then(|a| a.named_child(0))
                && name.kind() == "string"
            {
                attributes.push(self.src.text(name).trim_matches(['"', '\'']).to_owned());
            }
        });
        attributes
    }

    fn is_tensor(&self, node: Node<'_>) -> bool {
        let text = |n: Node<'_>| self.src.text(n);
        match node.kind() {
            "identifier" => self.names.iter().any(|n| n == text(node)),
            "attribute" => {
                let (Some(object), Some(attribute)) =
                    (node.child_by_field_name("object"), node.child_by_field_name("attribute"))
                else {
                    return false;
                };
                let attribute = text(attribute);
                if text(object) == "self" {
                    return self.attributes.iter().any(|a| a == attribute);
                }
                let layer_weight =
                    text(object).strip_prefix("self.").is_some_and(|layer| self.layers.iter().any(|l| l == layer))
                        && matches!(attribute, "weight" | "bias");
                layer_weight || (TENSOR_ATTRIBUTES.contains(&attribute) && self.is_tensor(object))
            }
            "call" => {
                let Some(function) = node.child_by_field_name("function") else { return false };
                let callee = text(function).replace(char::is_whitespace, "");
                if let Some(op) = callee.strip_prefix("torch.") {
                    return !NON_TENSOR_TORCH.contains(&op) && !op.starts_with("cuda.") && !op.starts_with("backends.");
                }
                if callee.starts_with("F.") || callee.starts_with("nn.functional.") {
                    return true;
                }
                if callee.strip_prefix("self.").is_some_and(|layer| self.layers.iter().any(|l| l == layer)) {
                    return true;
                }
                if function.kind() != "attribute" {
                    return false;
                }
                let (Some(object), Some(method)) =
                    (function.child_by_field_name("object"), function.child_by_field_name("attribute"))
                else {
                    return false;
                };
                if self.extensions.iter().any(|e| e == text(object)) {
                    return true;
                }
                !NON_TENSOR_METHODS.contains(&text(method)) && self.is_tensor(object)
            }
            "subscript" => node.child_by_field_name("value").is_some_and(|value| self.is_tensor(value)),
            "parenthesized_expression"
            | "binary_operator"
            | "unary_operator"
            | "conditional_expression"
            | "comparison_operator" => {
                let mut cursor = node.walk();
                node.named_children(&mut cursor).any(|child| self.is_tensor(child))
            }
            _ => false,
        }
    }

    /// The operator of an arithmetic, bitwise or comparison node with a tensor operand, if it has one.
    fn operator_on_tensors(&self, node: Node<'_>) -> Option<String> {
        let operands: Vec<Node<'_>> = match node.kind() {
            "binary_operator" => vec![node.child_by_field_name("left")?, node.child_by_field_name("right")?],
            "unary_operator" => vec![node.child_by_field_name("argument")?],
            "augmented_assignment" => vec![node.child_by_field_name("left")?, node.child_by_field_name("right")?],
            "comparison_operator" => {
                let mut cursor = node.walk();
                node.named_children(&mut cursor).collect()
            }
            _ => return None,
        };
        let operator = match node.kind() {
            "comparison_operator" => {
                let mut cursor = node.walk();
                let operators: Vec<String> = node
                    .children_by_field_name("operators", &mut cursor)
                    .map(|o| self.src.text(o).to_owned())
                    .collect();
                operators.join(" ")
            }
            _ => node.child_by_field_name("operator").map(|o| self.src.text(o).to_owned())?,
        };
        // `not`, `and`, `or`, `in` and `is` are Python's, whatever their operands.
        if matches!(operator.as_str(), "not" | "in" | "not in" | "is" | "is not") || operator.is_empty() {
            return None;
        }
        operands.iter().any(|o| self.is_tensor(*o)).then_some(operator)
    }
}

/// Beyond [`ALLOCATION_OPS`], ATen and torch functions that allocate, make views, or describe tensors and
/// devices: not compute when an extension calls them. (`contiguous` copies, but only to lay out what the
/// candidate's own code reads.)
const LIBRARY_NON_COMPUTE: &[&str] = &[
    "from_blob",
    "scalar_tensor",
    "device",
    "dtype",
    "device_of",
    "ceil_div",
    "parallel_for",
    "get_num_threads",
    "globalContext",
    "toString",
    "elementSize",
    "isFloatingType",
    "typeMetaToScalarType",
    "view",
    "reshape",
    "as_strided",
    "narrow",
    "select",
    "slice",
    "transpose",
    "permute",
    "squeeze",
    "unsqueeze",
    "expand",
    "expand_as",
    "flatten",
    "t",
    "contiguous",
    "detach",
    "alias",
    "view_as_real",
    "view_as_complex",
    "requires_grad",
];

/// Whether an extension's call of ATen or torch function `name` allocates, views or describes rather than computes.
fn library_non_compute(name: &str) -> bool {
    ALLOCATION_OPS.contains(&name) || LIBRARY_NON_COMPUTE.contains(&name)
}

/// Thrust's device-wide algorithms that compute (its containers, pointers and `for_each` over the candidate's
/// own functor are the candidate's code).
const THRUST_ALGORITHMS: &[&str] = &[
    "transform",
    "reduce",
    "reduce_by_key",
    "transform_reduce",
    "inner_product",
    "sort",
    "sort_by_key",
    "stable_sort",
    "stable_sort_by_key",
    "inclusive_scan",
    "exclusive_scan",
    "transform_inclusive_scan",
    "transform_exclusive_scan",
    "max_element",
    "min_element",
    "minmax_element",
    "count",
    "count_if",
];

/// C++ source without its comments.
fn without_cpp_comments(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |end| &after[end..]);
        } else if let Some(after) = rest.strip_prefix("/*") {
            // Keep the newlines, so that lines still count.
            let end = after.find("*/").map_or(after.len(), |end| end + 2);
            out.extend(after[..end].chars().filter(|c| *c == '\n'));
            rest = &after[end.min(after.len())..];
        } else {
            let c = rest.chars().next().expect("not empty");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// The library compute a C++/CUDA source calls, each with its line offset in `code`: `at::`/`torch::` functions
/// other than allocation, views and descriptions (types, capitalised, are not calls of compute), `at::native`,
/// `at::cuda::blas`, `torch::linalg`/`fft`/`special`/`nn::functional`; tensor compute methods (`.matmul(...)`);
/// cuBLAS, cuBLASLt, cuDNN, cuFFT, cuSPARSE and cuSOLVER functions; CUB's device-wide algorithms and Thrust's.
/// `c10::` and `at::cuda::` otherwise hold streams, guards and device properties: not compute.
fn library_calls(code: &str) -> Vec<(u32, String)> {
    let code = without_cpp_comments(code);
    let bytes = code.as_bytes();
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut calls = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        if !(bytes[at].is_ascii_alphabetic() || bytes[at] == b'_') || (at > 0 && word(bytes[at - 1])) {
            at += 1;
            continue;
        }
        // A name, qualified with `::`.
        let start = at;
        loop {
            while at < bytes.len() && word(bytes[at]) {
                at += 1;
            }
            if code[at..].starts_with("::") && code[at + 2..].starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            {
                at += 2;
            } else {
                break;
            }
        }
        let name = &code[start..at];
        if !opens_call(&code[at..]) {
            continue;
        }
        let before = code[..start].trim_end_matches([' ', '\t']);
        let method = before.ends_with('.') || before.ends_with("->");
        let line = code[..start].matches('\n').count() as u32;
        if is_library_compute(name, method) {
            calls.push((line, if method { format!(".{name}()") } else { name.to_owned() }));
        }
    }
    calls
}

/// Whether `rest`, after a name, opens its call: `(`, or template arguments and then `(` (`gemm<float>(`).
fn opens_call(rest: &str) -> bool {
    let rest = rest.trim_start_matches([' ', '\t']);
    let Some(arguments) = rest.strip_prefix('<') else { return rest.starts_with('(') };
    let mut depth = 1;
    for (index, c) in arguments.char_indices().take(200) {
        match c {
            '<' => depth += 1,
            '>' => {
                depth -= 1;
                if depth == 0 {
                    return arguments[index + 1..].trim_start_matches([' ', '\t']).starts_with('(');
                }
            }
            ';' | '{' | '}' | '(' | ')' => return false,
            _ => {}
        }
    }
    false
}

fn is_library_compute(name: &str, method: bool) -> bool {
    if method {
        return COMPUTE_METHODS.contains(&name);
    }
    const MATH_LIBRARIES: [&str; 5] = ["cublas", "cudnn", "cufft", "cusparse", "cusolver"];
    if MATH_LIBRARIES.iter().any(|library| name.starts_with(library)) {
        return true;
    }
    let parts: Vec<&str> = name.trim_start_matches("::").split("::").collect();
    let last = *parts.last().expect("split gives one part");
    match parts.as_slice() {
        ["cub", device, ..] => device.starts_with("Device"),
        ["thrust", .., algorithm] => THRUST_ALGORITHMS.contains(algorithm),
        ["at", "cuda", "blas", ..] | ["at", "native", ..] | ["at", "_ops", ..] => !library_non_compute(last),
        ["torch", "linalg" | "fft" | "special", ..] | ["torch", "nn", "functional", ..] => true,
        ["at" | "torch", function] => {
            function.starts_with(|c: char| c.is_ascii_lowercase()) && !library_non_compute(function)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
import torch
from torch.utils.cpp_extension import load_inline

source = "torch::Tensor relu(torch::Tensor x) { return x; }"
module = load_inline(name="relu", cpp_sources=source, functions=["relu"])

class ModelNew(torch.nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        out = torch.empty_like(x)
        return module.relu(x.contiguous())
"#;

    fn codes(source: &str, policy: Policy) -> Vec<&'static str> {
        check_candidate(source, policy).findings.iter().map(|f| f.code).collect()
    }

    #[test]
    fn a_clean_candidate_passes_both_policies() {
        for policy in Policy::ALL {
            let report = check_candidate(GOOD, policy);
            assert!(!report.rejected(), "{policy:?}: {:?}", report.findings);
        }
    }

    #[test]
    fn syntax_errors_carry_their_line() {
        let report = check_candidate("import torch\nclass ModelNew(:\n    pass\n", Policy::PERMISSIVE);
        assert!(report.syntax_error);
        assert_eq!(report.findings[0].code, "static.syntax_error");
        assert_eq!(report.findings[0].line, 2);
    }

    #[test]
    fn missing_model_new_is_rejected() {
        assert_eq!(
            codes("import torch\nclass Other(torch.nn.Module):\n    pass\n", Policy::PERMISSIVE),
            vec!["static.no_model_new"]
        );
    }

    #[test]
    fn inheriting_the_reference() {
        let only = "class ModelNew(Model):\n    pass\n";
        assert_eq!(codes(only, Policy::PERMISSIVE), vec!["static.inherits_reference"]);
        let overriding = "class ModelNew(Model):\n    def forward(self, x):\n        return x\n";
        assert!(codes(overriding, Policy::PERMISSIVE).is_empty());
        assert_eq!(codes(overriding, Policy::KEVIN_STRICT), vec!["static.inherits_reference"]);
    }

    #[test]
    fn strict_rejects_try_except_and_torch_compute_in_forward() {
        let source = r#"
import torch
import torch.nn.functional as F
class ModelNew(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3)
        self.weight = torch.nn.Parameter(torch.ones(3))
    def forward(self, x, y):
        try:
            z = torch.matmul(x, y)
        except Exception:
            z = x @ y
        z = F.relu(z) + x.sum() + self.conv(x)
        return torch.empty_like(z), z.view(-1), self.weight
"#;
        let report = check_candidate(source, Policy::KEVIN_STRICT);
        let lines: Vec<(&str, u32)> = report.findings.iter().map(|f| (f.code, f.line)).collect();
        assert!(lines.contains(&("static.try_except", 10)), "{lines:?}");
        for line in [11, 13, 14] {
            assert!(lines.contains(&("static.torch_compute_in_forward", line)), "line {line}: {lines:?}");
        }
        assert_eq!(lines.iter().filter(|(_, l)| *l == 14).count(), 4, "F.relu, .sum(), self.conv, `+`: {lines:?}");
        assert!(!lines.iter().any(|(_, l)| *l == 15), "allocation and views are fine: {lines:?}");
        assert!(codes(source, Policy::PERMISSIVE).is_empty(), "permissive allows all of this");
    }

    /// The lines of `static.torch_compute_in_forward` findings in `source` under the strict policy.
    fn compute_lines(source: &str, code: &str) -> Vec<u32> {
        let report = check_candidate(source, Policy::KEVIN_STRICT);
        assert!(
            !check_candidate(source, Policy::PERMISSIVE).findings.iter().any(|f| f.code == code),
            "permissive lets torch and libraries do the work"
        );
        report.findings.iter().filter(|f| f.code == code).map(|f| f.line).collect()
    }

    #[test]
    fn strict_counts_tensor_operators_as_torch_compute_but_not_arithmetic_on_numbers_and_shapes() {
        let source = r#"
import torch
import triton
class ModelNew(torch.nn.Module):
    def __init__(self, alpha, features):
        super().__init__()
        self.alpha = alpha
        self.scale = torch.nn.Parameter(torch.ones(features))
        self.register_buffer("shift", torch.zeros(features))
        self.calls = 0
    def forward(self, a, b, *rest):
        self.calls += 1
        n = a.shape[0] * 2
        m = (a.numel() + 255) // 256 - 1
        k = len(rest) * n + m % 3 + int(a.size(1)) ** 2
        if a.dim() == 2 and n > 0 and -n < 0:
            m = triton.cdiv(n, 1024) * self.alpha
        flat = a.view(-1)
        out = ext.scaled_add(a, b, self.alpha * 2.0)
        y = a * self.alpha + b
        z = out - 1
        w = -flat
        mask = a > 0
        out += b
        t = a.T @ b
        u = rest[0] * 2
        v = a[0] / k
        s = self.scale * 3
        q = self.shift + m
        c = a.contiguous().view(n, -1) & 1
        for row in a:
            r = row * 2
        return out
ext = load_inline(name="ext", cpp_sources="", functions=["scaled_add"])
"#;
        let expected: Vec<u32> = (20..=30).chain([32]).collect();
        assert_eq!(compute_lines(source, "static.torch_compute_in_forward"), expected);
        let report = check_candidate(source, Policy::KEVIN_STRICT);
        let first = report.findings.iter().find(|f| f.line == 20).expect("the lazy line");
        assert!(
            first.message.contains("`+`"),
            "one finding for `a * alpha + b`, named by its outer operator: {first:?}"
        );
    }

    #[test]
    fn strict_counts_torch_namespaces_and_triton_library_kernels_as_compute() {
        let source = r#"
import torch
import triton
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        x = torch.linalg.matmul(a, b)
        y = torch.ops.aten.mm(a, b)
        z = torch.special.expit(a)
        w = torch.Tensor.add(a, b)
        v = triton.ops.matmul(a, b)
        stream = torch.cuda.current_stream()
        return torch.empty_like(a), stream
"#;
        assert_eq!(compute_lines(source, "static.torch_compute_in_forward"), vec![6, 7, 8, 9, 10]);
    }

    #[test]
    fn strict_finds_library_compute_in_extension_sources() {
        let source = r#"
import torch
from torch.utils.cpp_extension import load_inline
cpp = """
#include <torch/extension.h>
// at::matmul would be slower: comments are not code
torch::Tensor lazy(torch::Tensor A, torch::Tensor B) {
    return at::relu(at::matmul(A, B));
}
torch::Tensor also_lazy(torch::Tensor A, torch::Tensor B) {
    auto C = A.matmul(B);
    cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, a, m, b, k, &zero, c, m);
    at::cuda::blas::gemm<float>('n', 'n', m, n, k, 1.f, a, m, b, k, 0.f, c, m);
    thrust::reduce(thrust::device, p, p + n);
    cub::DeviceReduce::Sum(tmp, bytes, p, q, n);
    return torch::softmax(C, 1);
}
"""
cuda = """
#include <torch/types.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
__global__ void scale(const float* x, float* y, int64_t n) {
    typedef cub::BlockReduce<float, 256> Reduce;
    float m = fmaxf(x[0], 0.f) + std::max(1.f, 2.f);
}
torch::Tensor honest(torch::Tensor x, double alpha) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2, "a CUDA matrix — ünïcode");
    const c10::cuda::CUDAGuard guard(x.device());
    auto input = x.contiguous().view({-1});
    auto out = torch::empty_like(input);
    auto zeros = at::zeros_like(input, input.options().dtype(torch::kFloat32));
    auto options = torch::TensorOptions().device(x.device());
    int64_t n = input.numel(), rows = x.size(0), step = x.stride(0);
    auto stream = at::cuda::getCurrentCUDAStream();
    scale<<<at::ceil_div(n, (int64_t)256), 256, 0, stream>>>(input.data_ptr<float>(), out.data_ptr<float>(), n);
    return out.reshape(x.sizes());
}
"""
ext = load_inline(name="ext", cpp_sources=cpp, cuda_sources=cuda, functions=["lazy", "honest"])
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        """Calls at::matmul(a, b) through the extension (a docstring, not a source)."""
        return ext.lazy(a, b)
"#;
        let report = check_candidate(source, Policy::KEVIN_STRICT);
        let found: Vec<(u32, &str)> = report
            .findings
            .iter()
            .filter(|f| f.code == "static.library_compute")
            .map(|f| (f.line, f.message.split('`').nth(1).unwrap_or("")))
            .collect();
        assert_eq!(
            found,
            vec![
                (8, "at::relu"),
                (8, "at::matmul"),
                (11, ".matmul()"),
                (12, "cublasSgemm"),
                (13, "at::cuda::blas::gemm"),
                (14, "thrust::reduce"),
                (15, "cub::DeviceReduce::Sum"),
                (16, "torch::softmax"),
            ],
            "{:?}",
            report.findings
        );
        assert!(report.findings.iter().all(|f| f.category == Category::Policy), "{:?}", report.findings);
        assert!(
            !check_candidate(source, Policy::PERMISSIVE).findings.iter().any(|f| f.code == "static.library_compute"),
            "permissive lets libraries do the work"
        );
    }

    #[test]
    fn harness_attacks_are_hacks_under_every_policy() {
        let attacks = [
            ("import ctypes\n", "static.forbidden_import"),
            ("import threading\n", "static.forbidden_import"),
            ("from subprocess import run\n", "static.forbidden_import"),
            ("import gc\n", "static.forbidden_import"),
            ("torch.cuda.synchronize = lambda *a: None\n", "static.patch_torch"),
            ("torch.cuda.Event.elapsed_time = lambda *a: 0.001\n", "static.patch_torch"),
            ("setattr(torch, 'allclose', lambda *a, **k: True)\n", "static.patch_torch"),
            ("torch.backends.cuda.matmul.allow_tf32 = True\n", "static.precision_downgrade"),
            ("torch.set_float32_matmul_precision('medium')\n", "static.precision_downgrade"),
            ("s = torch.cuda.Stream()\n", "static.side_stream"),
            ("exec('print(1)')\n", "static.dynamic_code"),
        ];
        for (line, code) in attacks {
            let source = format!(
                "import torch\n{line}class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
            );
            for policy in Policy::ALL {
                let report = check_candidate(&source, policy);
                let found = report.findings.iter().find(|f| f.code == code);
                assert!(
                    found.is_some_and(|f| f.category == Category::Hack && f.line == 2),
                    "{policy:?} {line}: {:?}",
                    report.findings
                );
            }
        }
    }

    #[test]
    fn strict_import_allowlist() {
        let source = "import torch\nimport scipy\nimport os\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x\n";
        assert_eq!(codes(source, Policy::KEVIN_STRICT), vec!["static.import_not_allowed", "static.forbidden_import"]);
        assert!(codes(source, Policy::PERMISSIVE).is_empty());
    }

    #[test]
    fn own_kernels_are_found_in_cuda_strings_and_triton_functions() {
        let source = r#"
cuda = """
template <typename T>
__global__ void __launch_bounds__(256) scale_kernel(const T* x, T* y, int n) {}
extern "C" __global__ void add_one(float* x) {}
__device__ float helper(float v) { return v; }
"""
import triton
import triton.language as tl

@triton.autotune(configs=[], key=["n"])
@triton.jit
def fused_kernel(x_ptr, n: tl.constexpr):
    pass

def not_a_kernel():
    pass

@torch.jit.script
def torchscript_helper(x):
    return x
"#;
        assert_eq!(own_kernel_names(source), vec!["add_one", "fused_kernel", "scale_kernel"]);
    }

    #[test]
    fn introspection_and_precision_downgrades_are_hacks() {
        for source in [
            "Model = [c for c in torch.nn.Module.__subclasses__() if c.__name__ == 'Model'][0]\n",
            "f = (lambda: 0).__globals__\n",
            "b = __builtins__['__import__']\n",
        ] {
            assert_eq!(
                codes(source, Policy::PERMISSIVE),
                vec!["static.introspection", "static.no_model_new"],
                "{source}"
            );
        }
        assert_eq!(
            codes("src = 'cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 1 << 20);'\n", Policy::PERMISSIVE),
            vec!["static.l2_persistence", "static.no_model_new"]
        );
        let fp32_task = "import torch\ndef get_inputs():\n    return [torch.randn(4)]\n";
        let found = precision_downgrade("x = 1\ny = x.half()  # fast\n", fp32_task).expect("downgrade found");
        assert_eq!((found.code, found.line), ("static.precision_downgrade", 2));
        assert!(precision_downgrade("__global__ void k(__half* x) {}", fp32_task).is_some());
        let fp16_task = "def get_inputs():\n    return [torch.randn(4, dtype=torch.float16)]\n";
        assert!(precision_downgrade("y = x.half()", fp16_task).is_none(), "a half-precision task may use half");
        assert!(precision_downgrade("y = x.float()", fp32_task).is_none());
    }

    #[test]
    fn policies_resolve_by_name_and_version() {
        assert_eq!(Policy::resolve("kevin-strict"), Some(Policy::KEVIN_STRICT));
        assert_eq!(Policy::resolve("kevin-strict@2"), Some(Policy::KEVIN_STRICT));
        assert_eq!(Policy::resolve("kevin-strict@1"), None, "version 1 did not name lazy work");
        assert_eq!(Policy::resolve("permissive@3"), Some(Policy::PERMISSIVE));
        assert_eq!(Policy::resolve("lenient"), None);
    }

    #[test]
    fn tasks_must_define_the_kernelbench_interface() {
        let task = "import torch\nclass Model(torch.nn.Module):\n    pass\ndef get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n";
        assert_eq!(check_task(task), Ok(()));
        let no_inputs = task.replace("def get_inputs", "def make_inputs");
        assert_eq!(check_task(&no_inputs), Err("defines no get_inputs()".into()));
        assert!(check_task("class Model(:\n").expect_err("syntax").starts_with("syntax error at line 1"));
    }
}
