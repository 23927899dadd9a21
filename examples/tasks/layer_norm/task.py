import torch
import torch.nn as nn


class Model(nn.Module):
    """LayerNorm over the last dimension with learned scale and shift."""

    def __init__(self, features: int):
        super().__init__()
        self.norm = nn.LayerNorm(features)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def get_inputs():
    return [torch.randn(128, 1024)]


def get_init_inputs():
    return [1024]
