import torch
import torch.nn as nn


class Model(nn.Module):
    """A near-degenerate output: row means of small values, all far below an fp32 atol of 1e-3."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1e-5).mean(dim=1)


def get_inputs():
    return [torch.randn(128, 512)]


def get_init_inputs():
    return []
