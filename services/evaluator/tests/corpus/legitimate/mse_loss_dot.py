# task: mse_loss
import torch


class ModelNew(torch.nn.Module):
    def forward(self, predictions, targets):
        diff = (predictions - targets).reshape(-1)
        return torch.dot(diff, diff) / diff.numel()
