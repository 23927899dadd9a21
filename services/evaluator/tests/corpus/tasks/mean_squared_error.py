import torch
import torch.nn as nn


class Model(nn.Module):
    """Mean squared error over 16M uniform values: the output hardly depends on any one element, so a closed-form
    answer or a computation on a sample passes a tolerance check on random inputs."""

    def forward(self, predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.mean((predictions - targets) ** 2)


def get_inputs():
    return [torch.rand(4096, 4096), torch.rand(4096, 4096)]


def get_init_inputs():
    return []
