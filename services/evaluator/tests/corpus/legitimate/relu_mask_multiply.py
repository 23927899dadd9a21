# task: relu
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        torch.mul(x, (x > 0).to(x.dtype), out=out)
        return out
