import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        ones = torch.ones(x.shape[-1], 1, dtype=x.dtype, device=x.device)
        return x @ ones
