# task: level1/12_Matmul_with_diagonal_matrices_
# backend: cuda
# Writes far outside its output: an illegal address, which the profiler must report as the candidate's runtime error.
import torch
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void row_scale_oob(const float* d, const float* b, float* c, int64_t rows, int64_t cols) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < rows * cols) c[i * 4096 + (1ll << 36)] = b[i] * d[i / cols];
}

torch::Tensor scale_rows(torch::Tensor d, torch::Tensor b) {
    auto c = torch::empty_like(b);
    int64_t total = b.numel();
    row_scale_oob<<<(total + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        d.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), b.size(0), b.size(1));
    return c;
}
"""

ext = load_inline(
    name="kforge_bench_crash",
    cpp_sources="torch::Tensor scale_rows(torch::Tensor d, torch::Tensor b);",
    cuda_sources=cuda_source,
    functions=["scale_rows"],
)


class ModelNew(torch.nn.Module):
    def forward(self, A, B):
        return ext.scale_rows(A, B)
