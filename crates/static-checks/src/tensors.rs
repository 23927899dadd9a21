//! Which expressions of a strict candidate's `forward` are tensors: how torch compute is told from arithmetic on
//! numbers and shapes.

use tree_sitter::Node;

use super::parse::{Source, walk};

/// `torch.<namespace>...(...)` calls that compute (besides `torch.<op>` itself, checked against the allocations).
pub(super) const TORCH_COMPUTE_NAMESPACES: &[&str] =
    &["nn.", "linalg.", "fft.", "special.", "sparse.", "ops.aten.", "ops.prims.", "_C.", "_VF.", "Tensor."];

/// Tensor methods that describe a tensor rather than make one: their results are Python numbers, shapes or
/// pointers, and arithmetic on them is not torch compute.
pub(super) const NON_TENSOR_METHODS: &[&str] = &[
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
pub(super) const NON_TENSOR_TORCH: &[&str] = &[
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
pub(super) const TENSOR_ATTRIBUTES: &[&str] = &["T", "mT", "H", "mH", "real", "imag", "data", "grad"];

/// Which expressions of `forward` are tensors: how the strict policy tells tensor operators (torch compute) from
/// arithmetic on numbers and shapes (`x.shape[0] * 2`, `n + 1`). A name is a tensor when it is a parameter of
/// `forward` (the task's inputs), or is assigned a tensor expression; an attribute of `self` when `__init__`
/// assigns it a `Parameter`, a torch call or registers it as a buffer. An expression is a tensor when it is one of
/// those, an index or view attribute (`.T`) of one, a call of torch (but for `torch.Size`, `torch.numel`, ...),
/// `torch.nn.functional`, a layer or an extension, a method call on a tensor other than a query (`.size()`,
/// `.item()`, `.data_ptr()`, ...), or an operator with a tensor operand. Everything else (literals, `len()`,
/// `int()`, `x.shape`, unknown helpers) is not.
pub(super) struct Tensors<'s, 'a> {
    src: &'s Source<'a>,
    names: Vec<String>,
    attributes: Vec<String>,
    layers: Vec<String>,
    extensions: Vec<String>,
}

impl<'s, 'a> Tensors<'s, 'a> {
    pub(super) fn of_forward(
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
    pub(super) fn operator_on_tensors(&self, node: Node<'_>) -> Option<String> {
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
