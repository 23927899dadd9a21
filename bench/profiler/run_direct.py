"""A candidate run directly, outside kforge, for an independent Nsight Compute measurement: the task's inputs
(seeded), the candidate's ModelNew, one warm-up call, then `--calls` calls between cudaProfilerStart and
cudaProfilerStop. Run it under `ncu --profile-from-start off ...`; with --build-only it imports the candidate
(compiling its extension) and exits.

    python3 run_direct.py TASK.py CANDIDATE.py [--calls 3] [--build-only]
"""

import argparse
import importlib.util
import sys

import torch


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)  # a .py file's: never None, with a loader
    module = importlib.util.module_from_spec(spec)  # pyright: ignore[reportArgumentType]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # pyright: ignore[reportOptionalMemberAccess]
    return module


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("task")
    parser.add_argument("candidate")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    candidate = load(args.candidate, "candidate")
    if args.build_only:
        return
    task = load(args.task, "task")
    torch.manual_seed(0)
    inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in task.get_inputs()]
    model = candidate.ModelNew(*task.get_init_inputs()).cuda()
    with torch.no_grad():
        model(*inputs)
        torch.cuda.synchronize()
        # cudart() initialises CUDA, which loads it: not None.
        torch.cuda.cudart().cudaProfilerStart()  # pyright: ignore[reportOptionalMemberAccess]
        for _ in range(args.calls):
            model(*inputs)
            torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()  # pyright: ignore[reportOptionalMemberAccess]


if __name__ == "__main__":
    main()
