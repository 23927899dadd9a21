import torch
import torch.nn as nn


class Model(nn.Module):
    """A @ B."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)


def get_inputs():
    return [torch.randn(256, 512), torch.randn(512, 384)]


def get_init_inputs():
    return []
