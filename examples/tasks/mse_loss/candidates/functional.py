import torch
import torch.nn.functional as F


class ModelNew(torch.nn.Module):
    def forward(self, predictions, targets):
        return F.mse_loss(predictions, targets)
