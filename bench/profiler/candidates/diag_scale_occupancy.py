# task: level1/12_Matmul_with_diagonal_matrices_
# backend: cuda
# The same row scale, with 64 threads per block each reserving 150 KiB of shared memory it barely uses: one block
# (two warps) per SM, so the memory system is starved by occupancy.
import torch
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

constexpr int SMEM_BYTES = 150 * 1024;

__global__ void row_scale_hog(const float* __restrict__ d, const float* __restrict__ b, float* __restrict__ c,
                              int64_t rows, int64_t cols) {
    extern __shared__ float scratch[];
    int64_t total = rows * cols;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        scratch[threadIdx.x] = b[i];
        c[i] = scratch[threadIdx.x] * d[i / cols];
    }
}

torch::Tensor scale_rows(torch::Tensor d, torch::Tensor b) {
    TORCH_CHECK(b.is_cuda() && b.dim() == 2 && b.scalar_type() == torch::kFloat32);
    d = d.contiguous();
    b = b.contiguous();
    auto c = torch::empty_like(b);
    cudaFuncSetAttribute(row_scale_hog, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    row_scale_hog<<<sms, 64, SMEM_BYTES, at::cuda::getCurrentCUDAStream()>>>(
        d.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), b.size(0), b.size(1));
    return c;
}
"""

ext = load_inline(
    name="kforge_bench_diag_scale_occupancy",
    cpp_sources="torch::Tensor scale_rows(torch::Tensor d, torch::Tensor b);",
    cuda_sources=cuda_source,
    functions=["scale_rows"],
)


class ModelNew(torch.nn.Module):
    def forward(self, A, B):
        return ext.scale_rows(A, B)
