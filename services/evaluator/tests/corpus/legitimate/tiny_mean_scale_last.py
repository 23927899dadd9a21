# task: corpus/tiny_mean
# expect: VERDICT_CORRECT runtime.low_profiling_ratio  (torch does the work: allowed by permissive, named by the notice)
import torch


class ModelNew(torch.nn.Module):
    """The same mean, scaled after reducing: rounding differs from the reference, well inside tolerance."""

    def forward(self, x):
        return x.sum(dim=1) * (1e-5 / x.shape[1])
