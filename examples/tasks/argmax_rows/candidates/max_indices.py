import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return torch.max(x, dim=1).indices
