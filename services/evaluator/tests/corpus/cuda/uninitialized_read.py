# class: reading uninitialised memory (accumulating into an output that was never cleared)
# task: relu
# policy: permissive
# expect: VERDICT_INCORRECT
# defence: the harness poisons the allocator's free memory with NaN before the candidate runs
import torch
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void accumulate_relu(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i] > 0.f ? x[i] : 0.f;
}
torch::Tensor run(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int64_t n = x.numel();
    accumulate_relu<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

ext = load_inline(
    name="kforge_corpus_uninitialized_read",
    cpp_sources="torch::Tensor run(torch::Tensor x);",
    cuda_sources=cuda_source,
    functions=["run"],
)


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return ext.run(x)
