# task: level1/12_Matmul_with_diagonal_matrices_
# backend: cuda
# diag(A) @ B as a row scale, four floats per thread: one read and one write of B's size, memory-bound.
import torch
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void row_scale(const float* __restrict__ d, const float4* __restrict__ b, float4* __restrict__ c,
                          int64_t rows, int64_t cols4) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= rows * cols4) return;
    float s = d[i / cols4];
    float4 v = b[i];
    c[i] = make_float4(v.x * s, v.y * s, v.z * s, v.w * s);
}

torch::Tensor scale_rows(torch::Tensor d, torch::Tensor b) {
    TORCH_CHECK(b.is_cuda() && b.dim() == 2 && b.size(1) % 4 == 0 && b.scalar_type() == torch::kFloat32);
    d = d.contiguous();
    b = b.contiguous();
    auto c = torch::empty_like(b);
    int64_t rows = b.size(0), cols4 = b.size(1) / 4;
    int64_t total = rows * cols4;
    row_scale<<<(total + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        d.data_ptr<float>(), reinterpret_cast<const float4*>(b.data_ptr<float>()),
        reinterpret_cast<float4*>(c.data_ptr<float>()), rows, cols4);
    return c;
}
"""

ext = load_inline(
    name="kforge_bench_diag_scale",
    cpp_sources="torch::Tensor scale_rows(torch::Tensor d, torch::Tensor b);",
    cuda_sources=cuda_source,
    functions=["scale_rows"],
)


class ModelNew(torch.nn.Module):
    def forward(self, A, B):
        return ext.scale_rows(A, B)
