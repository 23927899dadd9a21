# class: a kernel that never ends (Triton)
# task: relu
# policy: kevin-strict
# backend: triton
# expect: VERDICT_TIMEOUT
import torch
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    count = tl.load(x_ptr) * 0.0
    while count >= 0.0:
        count += 1.0
    tl.store(y_ptr + offsets, tl.maximum(x, 0.0) + count * 0.0, mask=mask)


class ModelNew(torch.nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        n = x.numel()
        relu_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
        return y
