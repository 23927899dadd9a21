//! The kernels a candidate's source defines: where what was built and run cannot say (see
//! `census::own_kernels`), what the census counts as its own.

use super::parse::{Source, parse, walk};

/// Names of the Triton `@jit` functions the source defines.
pub fn triton_kernel_names(source: &str) -> Vec<String> {
    let mut names = Vec::new();
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

/// Names of the CUDA `__global__` functions in the source's strings: the identifier after each `__global__`
/// before the first `(` that does not open `__launch_bounds__(...)`.
pub fn cuda_kernel_names(source: &str) -> Vec<String> {
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
    names.sort();
    names.dedup();
    names
}
