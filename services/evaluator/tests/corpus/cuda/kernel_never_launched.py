# class: a kernel defined but never launched (the C++ entry point calls torch instead)
# task: relu
# expect[permissive]: VERDICT_HACK runtime.own_kernel_not_launched
# expect[kevin-strict]: VERDICT_REJECTED static.library_compute
import torch
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void relu_kernel(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}

torch::Tensor run(torch::Tensor x) {
    return at::relu(x);
}
"""

ext = load_inline(
    name="kforge_corpus_kernel_never_launched",
    cpp_sources="torch::Tensor run(torch::Tensor x);",
    cuda_sources=cuda_source,
    functions=["run"],
)


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return ext.run(x)
