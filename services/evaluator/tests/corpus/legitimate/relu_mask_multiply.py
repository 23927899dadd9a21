# task: relu
# expect: VERDICT_CORRECT runtime.low_profiling_ratio  (torch does the work: allowed by permissive, named by the notice)
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        torch.mul(x, (x > 0).to(x.dtype), out=out)
        return out
