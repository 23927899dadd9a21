import math

import torch

# 0.5 * (1 + tanh(z)) is sigmoid(2z): the same GELU in fewer passes.
TWO_C = 2.0 * math.sqrt(2.0 / math.pi)


class ModelNew(torch.nn.Module):
    def forward(self, x):
        # One buffer of our own, updated in place: five passes over it, no temporaries.
        y = x * x
        y.mul_(TWO_C * 0.044715).add_(TWO_C).mul_(x).sigmoid_().mul_(x)
        return y
