import math

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, features):
        super().__init__()
        self.proj = torch.nn.Linear(features, features)

    def forward(self, x):
        h = torch.addmm(self.proj.bias, x, self.proj.weight.t())
        return x + 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
