//! The checks of a candidate's Python, by policy: imports, calls, attributes and strings that attack the harness,
//! `ModelNew` and its `forward` (torch compute under the strict policy), and the extensions it builds.

use tree_sitter::Node;

use super::findings::{Category, Finding, finding};
use super::library::library_calls;
use super::parse::{Source, line, walk};
use super::policy::Policy;
use super::tensors::{TORCH_COMPUTE_NAMESPACES, Tensors};
use super::torch_ops::{ALLOCATION_OPS, COMPUTE_METHODS};

/// The findings of the candidate `source` (parsed as `root`) under `policy`.
pub(super) fn check(source: &str, root: Node<'_>, policy: Policy) -> Vec<Finding> {
    let mut checker =
        Checker { src: Source { text: source.as_bytes() }, policy, findings: Vec::new(), extensions: Vec::new() };
    checker.check(root);
    checker.findings
}

/// Modules whose import is an attack on the harness under every policy.
pub(super) const HOSTILE_MODULES: &[&str] = &[
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
pub(super) const INTROSPECTION: &[&str] = &[
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
pub(super) const L2_PERSISTENCE: &[&str] =
    &["cudaLimitPersistingL2CacheSize", "accessPolicyWindow", "cudaAccessPropertyPersisting"];

/// Modules a strict candidate may import (and their submodules).
pub(super) const STRICT_ALLOWED_MODULES: &[&str] = &[
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
            "try_statement" if self.policy.strict() => self.add(
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
                if self.policy.strict() { Category::Policy } else { Category::Notice },
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
        if self.policy.strict() {
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
            if HOSTILE_MODULES.contains(&root.as_str()) || (root == "os" && self.policy.strict()) {
                self.add(
                    "static.forbidden_import",
                    format!("import of `{module}` is not allowed in a kernel"),
                    node,
                    Category::Hack,
                );
            } else if self.policy.strict() && !STRICT_ALLOWED_MODULES.contains(&root.as_str()) && root != "os" {
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
            "open" if self.policy.strict() => {
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
        if inherits_reference && (self.policy.strict() || forward.is_none()) {
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
        if let (true, Some(forward)) = (self.policy.strict(), forward) {
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
