# task: scaled_add
import torch


class ModelNew(torch.nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.alpha = alpha

    def forward(self, a, b):
        out = b.clone()
        out.add_(a, alpha=self.alpha)
        return out
