import torch


class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return torch.einsum("ik,kj->ij", a, b)
