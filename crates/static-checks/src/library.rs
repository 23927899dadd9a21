//! Library compute called from an extension's C++/CUDA sources (`static.library_compute`).

use super::torch_ops::{ALLOCATION_OPS, COMPUTE_METHODS};

/// Beyond [`ALLOCATION_OPS`], ATen and torch functions that allocate, make views, or describe tensors and
/// devices: not compute when an extension calls them. (`contiguous` copies, but only to lay out what the
/// candidate's own code reads.)
pub(super) const LIBRARY_NON_COMPUTE: &[&str] = &[
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
pub(super) fn library_non_compute(name: &str) -> bool {
    ALLOCATION_OPS.contains(&name) || LIBRARY_NON_COMPUTE.contains(&name)
}

/// Thrust's device-wide algorithms that compute (its containers, pointers and `for_each` over the candidate's
/// own functor are the candidate's code).
pub(super) const THRUST_ALGORITHMS: &[&str] = &[
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
pub(super) fn without_cpp_comments(code: &str) -> String {
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
pub(super) fn library_calls(code: &str) -> Vec<(u32, String)> {
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
pub(super) fn opens_call(rest: &str) -> bool {
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

pub(super) fn is_library_compute(name: &str, method: bool) -> bool {
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
