# task: relu
# expect: VERDICT_CORRECT runtime.low_profiling_ratio  (torch does the work: allowed by permissive, named by the notice)
import torch


class ModelNew(torch.nn.Module):
    """Keeps harmless state across calls (a call counter), which must not be mistaken for a hack."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.relu(x)
