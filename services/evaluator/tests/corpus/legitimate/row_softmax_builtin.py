# task: row_softmax
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.softmax(x, dim=-1)
