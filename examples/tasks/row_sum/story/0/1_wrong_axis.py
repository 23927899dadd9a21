import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        # One reduction instead of a matrix-vector product.
        return x.sum(dim=-2, keepdim=True)
