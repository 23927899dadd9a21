//! The static checks, through their public entry points.

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
    assert!(first.message.contains("`+`"), "one finding for `a * alpha + b`, named by its outer operator: {first:?}");
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
    assert_eq!(cuda_kernel_names(source), vec!["add_one", "scale_kernel"]);
    assert_eq!(triton_kernel_names(source), vec!["fused_kernel"]);
}

#[test]
fn introspection_and_precision_downgrades_are_hacks() {
    for source in [
        "Model = [c for c in torch.nn.Module.__subclasses__() if c.__name__ == 'Model'][0]\n",
        "f = (lambda: 0).__globals__\n",
        "b = __builtins__['__import__']\n",
    ] {
        assert_eq!(codes(source, Policy::PERMISSIVE), vec!["static.introspection", "static.no_model_new"], "{source}");
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
    assert_eq!(check_task(&no_inputs), Err(NotATask("defines no get_inputs()".into())));
    assert!(check_task("class Model(:\n").expect_err("syntax").to_string().starts_with("syntax error at line 1"));
}
