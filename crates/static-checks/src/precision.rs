//! A precision downgrade: a candidate in a low-precision type for a task that uses none.

use super::findings::{Category, Finding, finding};

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
