# task: corpus/mean_squared_error
# expect: VERDICT_CORRECT runtime.low_profiling_ratio
# the whole input, in another order of summation (row sums first): its output moves as the reference's does
import torch


class ModelNew(torch.nn.Module):
    def forward(self, predictions, targets):
        rows = ((predictions - targets) ** 2).sum(dim=1)
        return rows.sum() / predictions.numel()
