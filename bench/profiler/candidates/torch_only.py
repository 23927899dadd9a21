# task: level1/12_Matmul_with_diagonal_matrices_
# backend: cuda
# No kernel of its own: the census shows PyTorch's kernels and the profiler says there is nothing of its own.
import torch


class ModelNew(torch.nn.Module):
    def forward(self, A, B):
        return B * A[:, None]
