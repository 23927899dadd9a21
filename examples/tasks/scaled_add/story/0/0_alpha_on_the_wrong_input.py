import torch


class ModelNew(torch.nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.alpha = alpha

    def forward(self, a, b):
        # One fused multiply-add instead of a multiply and an add.
        return torch.add(a, b, alpha=self.alpha)
