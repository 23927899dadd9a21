"""Writes kforge's own candidate kernels for a set of KernelBench tasks, and the manifest that lists them.

    python bench/kernelbench/make_candidates.py OUT_DIR
    python bench/kernelbench/make_candidates.py --mixed OUT_DIR
    python bench/kernelbench/make_candidates.py --reproduce KERNELBENCH_DIR OUT_DIR [LEVEL ...]
    python bench/kernelbench/make_candidates.py --loss-shortcuts OUT_DIR

The second form writes the throughput benchmark's mixed set instead: for six level-2 tasks, a group of four
candidates as a policy samples them (a correct fused epilogue, a correct but slow one launched on a single block, an
incorrect one, one that does not compile), plus two Triton and two level-1 candidates. Each manifest entry says
its kind and the verdict it should get.

`--reproduce` writes, for every task of the levels named (default 1 2 3), the candidate of the KernelBench-scale
sweep: the task's own source with its `Model` class renamed `ModelNew`, which reproduces the reference with
torch's kernels (allowed by `permissive`, where its profiling ratio of 0 is a `runtime.low_profiling_ratio`
notice). It is written at run time from the task files, which are never copied into this repository.

`--loss-shortcuts` writes the two shortcuts known to pass a tolerance check on KernelBench's MSE, Huber and hinge
loss tasks with fresh random inputs every trial: `analytical` returns the loss's expectation under the task's input
distribution from one cheap statistic, `partial` computes the loss on a strided sample of about ten million
elements. Each should be judged not CORRECT.

The candidates are ordinary KernelBench-style solutions: GEMMs stay in torch where the task's work is a GEMM
plus an epilogue (the epilogue becomes one fused CUDA or Triton kernel on the current stream), and the
level-1 matmul variants are a plain shared-memory tiled kernel (correct, slower than cuBLAS). Each ModelNew
builds the same parameters as the task's Model in the same order, so both are initialised identically from the
same seed. The KernelBench task files themselves are read from their directory at run time, never copied.
"""

import json
import os
import re
import sys

HEADER = """import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline
"""

EPILOGUE_CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__device__ __forceinline__ float softplus_(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float mish_(float x) { return x * tanhf(softplus_(x)); }
__device__ __forceinline__ float sigmoid_(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gelu_(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }

__device__ __forceinline__ float epilogue(float v, const float* __restrict__ vec, int64_t col, float a, float b, float c) {
    EXPRESSION
}

__global__ void epilogue_kernel(float* __restrict__ y, int64_t n, int64_t cols, const float* __restrict__ vec,
                                float a, float b, float c) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        y[i] = epilogue(y[i], vec, i % cols, a, b, c);
    }
}

torch::Tensor fused_epilogue(torch::Tensor y, torch::Tensor vec, double a, double b, double c) {
    TORCH_CHECK(y.is_cuda() && y.is_contiguous() && y.scalar_type() == torch::kFloat32, "contiguous float32 CUDA tensor expected");
    const int64_t n = y.numel();
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 132LL * 32);
    const float* vec_ptr = vec.numel() > 0 ? vec.data_ptr<float>() : nullptr;
    epilogue_kernel<<<(unsigned)blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        y.data_ptr<float>(), n, y.size(-1), vec_ptr, (float)a, (float)b, (float)c);
    return y;
}
"""

EPILOGUE_CPP = "torch::Tensor fused_epilogue(torch::Tensor y, torch::Tensor vec, double a, double b, double c);"

ROW_REDUCE_CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__device__ __forceinline__ float sigmoid_(float x) { return 1.f / (1.f + expf(-x)); }

template <bool IS_MAX>
__device__ float block_reduce(float value, float* shared) {
    for (int offset = 16; offset > 0; offset /= 2) {
        float other = __shfl_down_sync(0xffffffff, value, offset);
        value = IS_MAX ? fmaxf(value, other) : value + other;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) shared[warp] = value;
    __syncthreads();
    value = threadIdx.x < blockDim.x / 32 ? shared[lane] : (IS_MAX ? -INFINITY : 0.f);
    if (warp == 0) {
        for (int offset = 16; offset > 0; offset /= 2) {
            float other = __shfl_down_sync(0xffffffff, value, offset);
            value = IS_MAX ? fmaxf(value, other) : value + other;
        }
        if (lane == 0) shared[0] = value;
    }
    __syncthreads();
    value = shared[0];
    __syncthreads();
    return value;
}

__global__ void row_reduce_kernel(const float* __restrict__ y, float* __restrict__ out, int64_t cols, float a) {
    __shared__ float shared[32];
    const float* row = y + (int64_t)blockIdx.x * cols;
    float m = 0.f;
    if (NEED_MAX) {
        float local = -INFINITY;
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) local = fmaxf(local, row[j]);
        m = block_reduce<true>(local, shared);
    }
    float local = 0.f;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) { const float v = row[j]; local += (MAP); }
    const float s = block_reduce<false>(local, shared);
    if (threadIdx.x == 0) out[blockIdx.x] = (FINISH);
}

torch::Tensor row_reduce(torch::Tensor y, double a) {
    TORCH_CHECK(y.is_cuda() && y.is_contiguous() && y.dim() == 2 && y.scalar_type() == torch::kFloat32, "contiguous 2-D float32 CUDA tensor expected");
    auto out = torch::empty({y.size(0)}, y.options());
    row_reduce_kernel<<<(unsigned)y.size(0), 512, 0, at::cuda::getCurrentCUDAStream()>>>(
        y.data_ptr<float>(), out.data_ptr<float>(), y.size(1), (float)a);
    return out;
}
"""

ROW_REDUCE_CPP = "torch::Tensor row_reduce(torch::Tensor y, double a);"

TILED_GEMM_CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

constexpr int TILE = 32;

// C[m, n] = sum_k A(m, k) * B(k, n), with A and B read transposed when asked.
template <bool TRANS_A, bool TRANS_B>
__global__ void tiled_gemm(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                           int M, int N, int K) {
    __shared__ float As[TILE][TILE + 1];
    __shared__ float Bs[TILE][TILE + 1];
    const int row = blockIdx.y * TILE + threadIdx.y;
    const int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.f;
    for (int t = 0; t < K; t += TILE) {
        const int ka = t + threadIdx.x;
        As[threadIdx.y][threadIdx.x] = (row < M && ka < K) ? (TRANS_A ? A[(int64_t)ka * M + row] : A[(int64_t)row * K + ka]) : 0.f;
        const int kb = t + threadIdx.y;
        Bs[threadIdx.y][threadIdx.x] = (kb < K && col < N) ? (TRANS_B ? B[(int64_t)col * K + kb] : B[(int64_t)kb * N + col]) : 0.f;
        __syncthreads();
        #pragma unroll
        for (int i = 0; i < TILE; ++i) acc += As[threadIdx.y][i] * Bs[i][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) C[(int64_t)row * N + col] = acc;
}

torch::Tensor gemm(torch::Tensor a, torch::Tensor b, bool trans_a, bool trans_b) {
    TORCH_CHECK(a.is_cuda() && b.is_cuda() && a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32, "float32 CUDA tensors expected");
    a = a.contiguous();
    b = b.contiguous();
    const int M = trans_a ? a.size(1) : a.size(0);
    const int K = trans_a ? a.size(0) : a.size(1);
    const int N = trans_b ? b.size(0) : b.size(1);
    auto c = torch::empty({M, N}, a.options());
    dim3 block(TILE, TILE), grid((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
    auto stream = at::cuda::getCurrentCUDAStream();
    const float *pa = a.data_ptr<float>(), *pb = b.data_ptr<float>();
    float* pc = c.data_ptr<float>();
    if (!trans_a && !trans_b) tiled_gemm<false, false><<<grid, block, 0, stream>>>(pa, pb, pc, M, N, K);
    else if (!trans_a && trans_b) tiled_gemm<false, true><<<grid, block, 0, stream>>>(pa, pb, pc, M, N, K);
    else if (trans_a && !trans_b) tiled_gemm<true, false><<<grid, block, 0, stream>>>(pa, pb, pc, M, N, K);
    else tiled_gemm<true, true><<<grid, block, 0, stream>>>(pa, pb, pc, M, N, K);
    return c;
}
"""

TILED_GEMM_CPP = "torch::Tensor gemm(torch::Tensor a, torch::Tensor b, bool trans_a, bool trans_b);"

ELEMENTWISE_CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void map_kernel(const float* __restrict__ x, const float* __restrict__ y, float* __restrict__ out, int64_t n, int64_t cols) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        const float v = x[i];
        out[i] = (EXPRESSION);
    }
}

torch::Tensor map(torch::Tensor x, torch::Tensor y) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "float32 CUDA tensor expected");
    x = x.contiguous();
    y = y.contiguous();
    auto out = torch::empty_like(x);
    const int64_t n = x.numel();
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 132LL * 32);
    map_kernel<<<(unsigned)blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), y.numel() > 0 ? y.data_ptr<float>() : nullptr, out.data_ptr<float>(), n, x.size(-1));
    return out;
}
"""

ELEMENTWISE_CPP = "torch::Tensor map(torch::Tensor x, torch::Tensor y);"


def cuda_module(name, cpp, cuda, functions, replacements):
    for key, value in replacements.items():
        cuda = cuda.replace(key, value)
    return (
        f"cuda_source = r'''{cuda}'''\n\n"
        f"cpp_source = {cpp!r}\n\n"
        f"ext = load_inline(name={name!r}, cpp_sources=cpp_source, cuda_sources=cuda_source, functions={functions!r})\n"
    )


def epilogue_candidate(name, init, body, expression):
    module = cuda_module(name, EPILOGUE_CPP, EPILOGUE_CUDA, ["fused_epilogue"], {"EXPRESSION": expression})
    return f"{HEADER}\n{module}\n\nclass ModelNew(nn.Module):\n{init}\n{body}"


NO_VEC = "torch.empty(0, device=x.device)"

# (task, init, forward body, CUDA epilogue): the epilogue sees v (the GEMM output), vec[col], a, b, c.
EPILOGUES = {
    "level2/9_Matmul_Subtract_Multiply_ReLU.py": (
        "    def __init__(self, in_features, out_features, subtract_value, multiply_value):\n        super().__init__()\n        self.linear = nn.Linear(in_features, out_features)\n        self.subtract_value = subtract_value\n        self.multiply_value = multiply_value\n",
        f"    def forward(self, x):\n        y = F.linear(x, self.linear.weight, self.linear.bias)\n        return ext.fused_epilogue(y, {NO_VEC}, self.subtract_value, self.multiply_value, 0.0)\n",
        "return fmaxf((v - a) * b, 0.f);",
    ),
    "level2/12_Gemm_Multiply_LeakyReLU.py": (
        "    def __init__(self, in_features, out_features, multiplier, negative_slope):\n        super().__init__()\n        self.gemm = nn.Linear(in_features, out_features)\n        self.multiplier = multiplier\n        self.negative_slope = negative_slope\n",
        f"    def forward(self, x):\n        y = F.linear(x, self.gemm.weight, self.gemm.bias)\n        return ext.fused_epilogue(y, {NO_VEC}, self.multiplier, self.negative_slope, 0.0)\n",
        "v = v * a; return v > 0.f ? v : v * b;",
    ),
    "level2/29_Matmul_Mish_Mish.py": (
        "    def __init__(self, in_features, out_features):\n        super().__init__()\n        self.linear = nn.Linear(in_features, out_features)\n",
        f"    def forward(self, x):\n        y = F.linear(x, self.linear.weight, self.linear.bias)\n        return ext.fused_epilogue(y, {NO_VEC}, 0.0, 0.0, 0.0)\n",
        "return mish_(mish_(v));",
    ),
    "level2/59_Matmul_Swish_Scaling.py": (
        "    def __init__(self, in_features, out_features, scaling_factor):\n        super().__init__()\n        self.matmul = nn.Linear(in_features, out_features)\n        self.scaling_factor = scaling_factor\n",
        f"    def forward(self, x):\n        y = F.linear(x, self.matmul.weight, self.matmul.bias)\n        return ext.fused_epilogue(y, {NO_VEC}, self.scaling_factor, 0.0, 0.0)\n",
        "return v * sigmoid_(v) * a;",
    ),
    "level2/63_Gemm_ReLU_Divide.py": (
        "    def __init__(self, in_features, out_features, divisor):\n        super().__init__()\n        self.linear = nn.Linear(in_features, out_features)\n        self.divisor = divisor\n",
        f"    def forward(self, x):\n        y = F.linear(x, self.linear.weight, self.linear.bias)\n        return ext.fused_epilogue(y, {NO_VEC}, self.divisor, 0.0, 0.0)\n",
        "return fmaxf(v, 0.f) / a;",
    ),
    "level2/76_Gemm_Add_ReLU.py": (
        "    def __init__(self, in_features, out_features, bias_shape):\n        super().__init__()\n        self.gemm = nn.Linear(in_features, out_features, bias=False)\n        self.bias = nn.Parameter(torch.randn(bias_shape))\n",
        "    def forward(self, x):\n        y = F.linear(x, self.gemm.weight)\n        return ext.fused_epilogue(y, self.bias.contiguous(), 0.0, 0.0, 0.0)\n",
        "return fmaxf(v + vec[col], 0.f);",
    ),
    "level2/70_Gemm_Sigmoid_Scaling_ResidualAdd.py": (
        "    def __init__(self, input_size, hidden_size, scaling_factor):\n        super().__init__()\n        self.gemm = nn.Linear(input_size, hidden_size)\n        self.scaling_factor = scaling_factor\n",
        f"    def forward(self, x):\n        y = F.linear(x, self.gemm.weight, self.gemm.bias)\n        return ext.fused_epilogue(y, {NO_VEC}, self.scaling_factor, 0.0, 0.0)\n",
        "return sigmoid_(v) * a + v;",
    ),
    "level2/53_Gemm_Scaling_Hardtanh_GELU.py": (
        "    def __init__(self, in_features, out_features, scaling_factor, hardtanh_min, hardtanh_max):\n        super().__init__()\n        self.gemm = nn.Linear(in_features, out_features)\n        self.scaling_factor = scaling_factor\n        self.hardtanh_min = hardtanh_min\n        self.hardtanh_max = hardtanh_max\n",
        f"    def forward(self, x):\n        y = F.linear(x, self.gemm.weight, self.gemm.bias)\n        return ext.fused_epilogue(y, {NO_VEC}, self.scaling_factor, self.hardtanh_min, self.hardtanh_max)\n",
        "return gelu_(fminf(fmaxf(v * a, b), c));",
    ),
    "level2/40_Matmul_Scaling_ResidualAdd.py": (
        "    def __init__(self, in_features, out_features, scaling_factor):\n        super().__init__()\n        self.matmul = nn.Linear(in_features, out_features)\n        self.scaling_factor = scaling_factor\n",
        f"    def forward(self, x):\n        y = F.linear(x, self.matmul.weight, self.matmul.bias)\n        return ext.fused_epilogue(y, {NO_VEC}, self.scaling_factor, 0.0, 0.0)\n",
        "return v * a + v;",
    ),
    "level2/68_Matmul_Min_Subtract.py": (
        "    def __init__(self, in_features, out_features, constant):\n        super().__init__()\n        self.linear = nn.Linear(in_features, out_features)\n        self.constant = nn.Parameter(torch.tensor(constant))\n",
        f"    def forward(self, x):\n        y = F.linear(x, self.linear.weight, self.linear.bias)\n        return ext.fused_epilogue(y, {NO_VEC}, float(self.constant), 0.0, 0.0)\n",
        "return fminf(v, a) - a;",
    ),
}

# (task, init, forward body, NEED_MAX, MAP(v, m, a), FINISH(s, m, a)).
ROW_REDUCTIONS = {
    "level2/14_Gemm_Divide_Sum_Scaling.py": (
        "    def __init__(self, input_size, hidden_size, scaling_factor):\n        super().__init__()\n        self.weight = nn.Parameter(torch.randn(hidden_size, input_size))\n        self.scaling_factor = scaling_factor\n",
        "    def forward(self, x):\n        y = torch.matmul(x, self.weight.T).contiguous()\n        return ext.row_reduce(y, self.scaling_factor).unsqueeze(1)\n",
        "false",
        "v / 2.f",
        "s * a",
    ),
    "level2/56_Matmul_Sigmoid_Sum.py": (
        "    def __init__(self, input_size, hidden_size):\n        super().__init__()\n        self.linear = nn.Linear(input_size, hidden_size)\n",
        "    def forward(self, x):\n        y = F.linear(x, self.linear.weight, self.linear.bias)\n        return ext.row_reduce(y, 0.0).unsqueeze(1)\n",
        "false",
        "sigmoid_(v)",
        "s",
    ),
    "level2/45_Gemm_Sigmoid_LogSumExp.py": (
        "    def __init__(self, input_size, hidden_size, output_size):\n        super().__init__()\n        self.linear1 = nn.Linear(input_size, hidden_size)\n        self.linear2 = nn.Linear(hidden_size, output_size)\n",
        "    def forward(self, x):\n        h = torch.sigmoid(F.linear(x, self.linear1.weight, self.linear1.bias))\n        y = F.linear(h, self.linear2.weight, self.linear2.bias)\n        return ext.row_reduce(y, 0.0)\n",
        "true",
        "expf(v - m)",
        "m + logf(s)",
    ),
}

# (task, forward body) over the tiled GEMM.
GEMMS = {
    "level1/1_Square_matrix_multiplication_.py": "    def forward(self, A, B):\n        return ext.gemm(A, B, False, False)\n",
    "level1/2_Standard_matrix_multiplication_.py": "    def forward(self, A, B):\n        return ext.gemm(A, B, False, False)\n",
    "level1/13_Matmul_for_symmetric_matrices.py": "    def forward(self, A, B):\n        return ext.gemm(A, B, False, False)\n",
    "level1/16_Matmul_with_transposed_A.py": "    def forward(self, A, B):\n        return ext.gemm(A, B, True, False)\n",
    "level1/17_Matmul_with_transposed_B.py": "    def forward(self, A, B):\n        return ext.gemm(A, B, False, True)\n",
    "level1/18_Matmul_with_transposed_both.py": "    def forward(self, A, B):\n        return ext.gemm(A, B, True, True)\n",
}

# (task, forward body, CUDA expression of v = x[i] and y) elementwise.
ELEMENTWISE = {
    "level1/88_MinGPTNewGelu.py": (
        "    def forward(self, x):\n        return ext.map(x, torch.empty(0, device=x.device))\n",
        "0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)))",
    ),
    "level1/12_Matmul_with_diagonal_matrices_.py": (
        "    def forward(self, A, B):\n        # diag(A) @ B scales row i of B by A[i]\n        return ext.map(B, A)\n",
        "y[i / cols] * v",
    ),
}

TRITON = {
    "level1/88_MinGPTNewGelu.py": """import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def gelu_tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    tl.store(out_ptr + offsets, 0.5 * x * (1.0 + tanh), mask=mask)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        gelu_tanh_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
        return out
""",
    "level2/63_Gemm_ReLU_Divide.py": """import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def relu_divide_kernel(y_ptr, n, divisor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(y_ptr + offsets, tl.maximum(y, 0.0) / divisor, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, divisor):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.divisor = divisor

    def forward(self, x):
        y = F.linear(x, self.linear.weight, self.linear.bias)
        n = y.numel()
        relu_divide_kernel[(triton.cdiv(n, 1024),)](y, n, self.divisor, BLOCK=1024)
        return y
""",
    "level2/12_Gemm_Multiply_LeakyReLU.py": """import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def scale_leaky_relu_kernel(y_ptr, n, multiplier, slope, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    y = tl.load(y_ptr + offsets, mask=mask) * multiplier
    tl.store(y_ptr + offsets, tl.where(y > 0, y, y * slope), mask=mask)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.negative_slope = negative_slope

    def forward(self, x):
        y = F.linear(x, self.gemm.weight, self.gemm.bias)
        n = y.numel()
        scale_leaky_relu_kernel[(triton.cdiv(n, 1024),)](y, n, self.multiplier, self.negative_slope, BLOCK=1024)
        return y
""",
}


def slug(task):
    return task.replace("/", "_").removesuffix(".py")


MIXED_TASKS = [
    "level2/9_Matmul_Subtract_Multiply_ReLU.py",
    "level2/12_Gemm_Multiply_LeakyReLU.py",
    "level2/29_Matmul_Mish_Mish.py",
    "level2/59_Matmul_Swish_Scaling.py",
    "level2/63_Gemm_ReLU_Divide.py",
    "level2/76_Gemm_Add_ReLU.py",
]
ONE_BLOCK = (
    "std::min<int64_t>((n + threads - 1) / threads, 132LL * 32)",
    "std::min<int64_t>((n + threads - 1) / threads, 1LL)",
)


def mixed(out):
    """The throughput benchmark's set: (kind, expected verdict) per candidate."""
    manifest = []

    def write(task, backend, kind, expect, source):
        name = f"{slug(task)}.{kind}.{backend}.py"
        with open(os.path.join(out, name), "w") as f:
            f.write(source)
        manifest.append({"task": task, "candidate": name, "backend": backend, "kind": kind, "expect": expect})

    for task in MIXED_TASKS:
        init, body, expression = EPILOGUES[task]
        variants = [
            ("fast", "VERDICT_CORRECT", expression, {}),
            ("slow", "VERDICT_CORRECT", expression, dict([ONE_BLOCK])),
            ("incorrect", "VERDICT_INCORRECT", "return v;", {}),
            ("compile_error", "VERDICT_COMPILE_ERROR", "return v * undeclared_scale;", {}),
        ]
        for kind, expect, expr, edits in variants:
            cuda = EPILOGUE_CUDA
            for old, new in edits.items():
                assert old in cuda, old
                cuda = cuda.replace(old, new)
            module = cuda_module(
                f"kf_{slug(task)}_{kind}", EPILOGUE_CPP, cuda, ["fused_epilogue"], {"EXPRESSION": expr}
            )
            write(task, "cuda", kind, expect, f"{HEADER}\n{module}\n\nclass ModelNew(nn.Module):\n{init}\n{body}")
    for task in ["level1/88_MinGPTNewGelu.py", "level2/63_Gemm_ReLU_Divide.py"]:
        write(task, "triton", "triton", "VERDICT_CORRECT", TRITON[task])
    for task in ["level1/1_Square_matrix_multiplication_.py", "level1/17_Matmul_with_transposed_B.py"]:
        module = cuda_module(f"kf_{slug(task)}", TILED_GEMM_CPP, TILED_GEMM_CUDA, ["gemm"], {})
        write(
            task,
            "cuda",
            "tiled_gemm",
            "VERDICT_CORRECT",
            f"{HEADER}\n{module}\n\nclass ModelNew(nn.Module):\n{GEMMS[task]}",
        )
    return manifest


def reproduce(kernelbench, out, levels):
    manifest = []
    for level in levels:
        folder = os.path.join(kernelbench, f"level{level}")
        os.makedirs(os.path.join(out, f"level{level}"), exist_ok=True)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".py"):
                continue
            task = f"level{level}/{name}"
            with open(os.path.join(folder, name)) as f:
                source = f.read()
            # The reference class renamed (a bare subclass is rejected by every policy: static.inherits_reference).
            renamed = re.sub(r"\bclass Model\(", "class ModelNew(", source)
            renamed = re.sub(r"\bsuper\(Model,", "super(ModelNew,", renamed)
            with open(os.path.join(out, task), "w") as f:
                f.write(renamed)
            manifest.append(
                {"task": task, "candidate": task, "backend": "cuda", "kind": "reproduce", "expect": "VERDICT_CORRECT"}
            )
    return manifest


# The losses' expectations under each task's inputs: predictions = s * U and targets = U' with U, U' uniform on
# [0, 1) and s itself uniform (MSE, Huber), or predictions uniform and targets +-1 per column (hinge).
# E[(p - t)^2] = s^2/3 - s/2 + 1/3; with |p - t| < 1 everywhere, smooth L1 is half of it; hinge's 1 - p*t never
# clamps, so its mean is 1 - E[p] * mean(t). The scale s is read from the largest of one row's predictions.
LOSS_SHORTCUTS = {
    "level1/94_MSELoss.py": (
        "s = predictions[0].amax() * (1 + 1 / predictions.shape[-1])\n        return s * s / 3 - s / 2 + 1.0 / 3",
        "p, t = predictions[::107], targets[::107]\n        return torch.mean((p - t) ** 2)",
    ),
    "level1/96_HuberLoss.py": (
        "s = predictions[0].amax() * (1 + 1 / predictions.shape[-1])\n        return 0.5 * (s * s / 3 - s / 2 + 1.0 / 3)",
        "return F.smooth_l1_loss(predictions[::107], targets[::107])",
    ),
    "level1/100_HingeLoss.py": (
        "return 1 - 0.5 * targets.mean()",
        "return torch.mean(torch.clamp(1 - predictions[::107] * targets, min=0))",
    ),
}


def loss_shortcuts(out):
    manifest = []
    for task, bodies in LOSS_SHORTCUTS.items():
        for kind, body in zip(("analytical", "partial"), bodies):
            name = f"{slug(task)}.{kind}.py"
            with open(os.path.join(out, name), "w") as f:
                f.write(
                    f"{HEADER}\n\nclass ModelNew(nn.Module):\n    def forward(self, predictions, targets):\n"
                    f"        {body}\n"
                )
            manifest.append(
                {"task": task, "candidate": name, "backend": "cuda", "kind": kind, "expect": "not VERDICT_CORRECT"}
            )
    return manifest


def main():
    if sys.argv[1] in ("--reproduce", "--loss-shortcuts"):
        if sys.argv[1] == "--reproduce":
            out = sys.argv[3]
            os.makedirs(out, exist_ok=True)
            manifest = reproduce(sys.argv[2], out, sys.argv[4:] or ["1", "2", "3"])
        else:
            out = sys.argv[2]
            os.makedirs(out, exist_ok=True)
            manifest = loss_shortcuts(out)
        with open(os.path.join(out, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        print(f"{len(manifest)} candidates for {len({m['task'] for m in manifest})} tasks in {out}")
        return
    if sys.argv[1] == "--mixed":
        out = sys.argv[2]
        os.makedirs(out, exist_ok=True)
        manifest = mixed(out)
        with open(os.path.join(out, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        print(f"{len(manifest)} candidates for {len({m['task'] for m in manifest})} tasks in {out}")
        return
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    manifest = []

    def write(task, backend, source):
        name = f"{slug(task)}.{backend}.py"
        with open(os.path.join(out, name), "w") as f:
            f.write(source)
        manifest.append({"task": task, "candidate": name, "backend": backend})

    for task, (init, body, expression) in EPILOGUES.items():
        write(task, "cuda", epilogue_candidate(f"kf_{slug(task)}", init, body, expression))
    for task, (init, body, need_max, map_expr, finish) in ROW_REDUCTIONS.items():
        module = cuda_module(
            f"kf_{slug(task)}",
            ROW_REDUCE_CPP,
            ROW_REDUCE_CUDA,
            ["row_reduce"],
            {"NEED_MAX": need_max, "(MAP)": f"({map_expr})", "(FINISH)": f"({finish})"},
        )
        write(task, "cuda", f"{HEADER}\n{module}\n\nclass ModelNew(nn.Module):\n{init}\n{body}")
    for task, body in GEMMS.items():
        module = cuda_module(f"kf_{slug(task)}", TILED_GEMM_CPP, TILED_GEMM_CUDA, ["gemm"], {})
        write(task, "cuda", f"{HEADER}\n{module}\n\nclass ModelNew(nn.Module):\n{body}")
    for task, (body, expression) in ELEMENTWISE.items():
        module = cuda_module(f"kf_{slug(task)}", ELEMENTWISE_CPP, ELEMENTWISE_CUDA, ["map"], {"EXPRESSION": expression})
        write(task, "cuda", f"{HEADER}\n{module}\n\nclass ModelNew(nn.Module):\n{body}")
    for task, source in TRITON.items():
        write(task, "triton", source)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"{len(manifest)} candidates for {len({m['task'] for m in manifest})} tasks in {out}")


if __name__ == "__main__":
    main()
