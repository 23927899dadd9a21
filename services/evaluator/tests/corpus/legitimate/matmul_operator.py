# task: matmul
# expect: VERDICT_CORRECT runtime.low_profiling_ratio  (torch does the work: allowed by permissive, named by the notice)
import torch


class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return a @ b
