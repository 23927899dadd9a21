# task: corpus/dropout_training
# expect: VERDICT_CORRECT runtime.low_profiling_ratio
# the reference's computation, drawing the same masks from the same generator: the correctness trials (seeded alike
# on both sides) agree, and the timed call, whose draw depends on how many calls timing made, is not held against it
import torch
import torch.nn.functional as F


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(F.dropout(x, p=0.25, training=True), dim=1)
