# task: gelu_tanh
# expect: VERDICT_CORRECT runtime.low_profiling_ratio  (torch does the work: allowed by permissive, named by the notice)
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x, approximate="tanh")
