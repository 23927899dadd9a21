import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        ordered = torch.sort(x, dim=1).values
        return ordered[:, -1].contiguous(), ordered[:, 0].contiguous()
