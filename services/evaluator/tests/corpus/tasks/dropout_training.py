import torch
import torch.nn as nn


class Model(nn.Module):
    """Dropout in training mode: every call draws a new mask from torch's generator, so the output of a call depends
    on how many calls came before it (as in KernelBench level2/66)."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(p=0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.dropout(x), dim=1)


def get_inputs():
    return [torch.randn(64, 256)]


def get_init_inputs():
    return []
