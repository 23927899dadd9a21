# class: GPU out of memory
# task: relu
# policy: permissive
# expect: VERDICT_RUNTIME_ERROR
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        hoard = torch.empty(1 << 42, dtype=torch.uint8, device=x.device)
        return torch.relu(x) + hoard[0].float() * 0
