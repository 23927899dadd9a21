import torch
import torch.nn.functional as F


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")
