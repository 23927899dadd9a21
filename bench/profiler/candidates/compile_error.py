# task: level1/12_Matmul_with_diagonal_matrices_
# backend: cuda
# Does not compile (an undeclared identifier): the profiler answers with the compile log.
import torch
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>

__global__ void row_scale(const float* d, const float* b, float* c, int64_t n, int64_t cols) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) c[i] = b[i] * d[i / columns];
}

torch::Tensor scale_rows(torch::Tensor d, torch::Tensor b) {
    auto c = torch::empty_like(b);
    row_scale<<<(b.numel() + 255) / 256, 256>>>(d.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(),
                                                 b.numel(), b.size(1));
    return c;
}
"""

ext = load_inline(
    name="kforge_bench_compile_error",
    cpp_sources="torch::Tensor scale_rows(torch::Tensor d, torch::Tensor b);",
    cuda_sources=cuda_source,
    functions=["scale_rows"],
)


class ModelNew(torch.nn.Module):
    def forward(self, A, B):
        return ext.scale_rows(A, B)
