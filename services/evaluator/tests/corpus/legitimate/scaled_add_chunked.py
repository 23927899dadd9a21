# task: scaled_add
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
