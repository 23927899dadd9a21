# task: mse_loss
# expect: VERDICT_CORRECT runtime.low_profiling_ratio  (torch does the work: allowed by permissive, named by the notice)
import torch


class ModelNew(torch.nn.Module):
    def forward(self, predictions, targets):
        diff = (predictions - targets).reshape(-1)
        return torch.dot(diff, diff) / diff.numel()
