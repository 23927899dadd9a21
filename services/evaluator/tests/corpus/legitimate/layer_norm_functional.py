# task: layer_norm
# expect: VERDICT_CORRECT runtime.low_profiling_ratio  (torch does the work: allowed by permissive, named by the notice)
import torch


class ModelNew(torch.nn.Module):
    def __init__(self, features):
        super().__init__()
        self.norm = torch.nn.LayerNorm(features)
        with torch.no_grad():  # the task's own initialisation, in the same order
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.norm.normalized_shape, self.norm.weight, self.norm.bias, self.norm.eps)
