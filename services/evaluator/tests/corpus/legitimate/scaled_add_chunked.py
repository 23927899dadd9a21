# task: scaled_add
# expect: VERDICT_CORRECT runtime.low_profiling_ratio  (torch does the work: allowed by permissive, named by the notice)
import torch


class ModelNew(torch.nn.Module):
    """Works in row chunks into one preallocated output: a different memory pattern, the same values."""

    def __init__(self, alpha):
        super().__init__()
        self.alpha = alpha

    def forward(self, a, b):
        out = torch.empty_like(a)
        for start in range(0, a.shape[0], 64):
            rows = slice(start, start + 64)
            torch.add(b[rows], a[rows], alpha=self.alpha, out=out[rows])
        return out
