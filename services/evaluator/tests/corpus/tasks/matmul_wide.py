import torch
import torch.nn as nn


class Model(nn.Module):
    """A matrix product of non-square matrices, large enough (about 4 ms on two CPU cores) that the Python around a
    candidate's call is a small part of it."""

    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)


def get_inputs():
    return [torch.randn(512, 1024), torch.randn(1024, 768)]


def get_init_inputs():
    return []
