"""Does a process's state after timing-like work change level2/14's candidate output on the same inputs? Outputs for
seeds 0-9, then the census's kind of profiler session over 20 calls and 300 calls timed with events between L2
flushes, then the same seeds again: bitwise equal or not, and the largest difference.

    TORCH_EXTENSIONS_DIR=... python3 bench/probes/replay_probe.py TASK.py CANDIDATE.py
"""

import importlib.util
import sys

import torch


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)  # a .py file's: never None, with a loader
    module = importlib.util.module_from_spec(spec)  # pyright: ignore[reportArgumentType]
    spec.loader.exec_module(module)  # pyright: ignore[reportOptionalMemberAccess]
    return module


task, cand = load(sys.argv[1], "t"), load(sys.argv[2], "c")
dev = torch.device("cuda")
torch.manual_seed(0)
model = cand.ModelNew(*task.get_init_inputs()).to(dev)


def outputs():
    out = []
    with torch.no_grad():
        for seed in range(10):
            torch.manual_seed(seed)
            out.append(model(*[x.to(dev) for x in task.get_inputs()]).cpu())
    return out


before = outputs()
inputs = [x.to(dev) for x in task.get_inputs()]
flush = torch.empty(2 * 60 * 2**20, dtype=torch.uint8, device=dev)
with torch.no_grad():
    from torch.autograd import profiler

    with profiler.profile(use_device="cuda", use_kineto=True):
        for _ in range(20):
            model(*inputs)
        torch.cuda.synchronize()
    for _ in range(300):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(*inputs)
        end.record()
    torch.cuda.synchronize()
after = outputs()
diffs = [float((a.double() - b.double()).abs().max()) for a, b in zip(before, after)]
print("bitwise equal:", all(torch.equal(a, b) for a, b in zip(before, after)), "largest difference:", max(diffs))
