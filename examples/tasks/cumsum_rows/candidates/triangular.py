import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        n = x.shape[1]
        upper = torch.ones(n, n, dtype=x.dtype, device=x.device).triu()
        return x @ upper
