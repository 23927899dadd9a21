# task: cumsum_rows
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return x.cumsum(1)
