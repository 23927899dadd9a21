"""Where the census's profiler start goes: torch's profiler started (CPU and CUDA activities) in a fresh process,
step by step, under variants — outside kforge, and inside the evaluator's sandbox (a candidate whose import times
the same steps and reports them as its error, so the stage's sandbox is exactly an evaluation's).

From the repository root on a GPU machine, with target/release/kforge built:

    python3 bench/probes/census_start.py --out "$OUT"

Writes OUT/results.jsonl. Stdlib only (the probe itself imports torch).
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profiler"))
from profile_live import Run, kforge_arguments, log, start_kforge, stop_kforge

# Times each step of starting torch's profiler; prints (or raises, inside kforge) a JSON line of seconds.
PROBE = r"""
import json, os, time
T = {}
_t = time.monotonic()
def step(name):
    global _t
    now = time.monotonic()
    T[name] = round(now - _t, 4)
    _t = now
import torch
step("import_torch")
import torch.profiler
from torch.profiler import ProfilerActivity, profile
step("import_profiler")
BEFORE_CUDA = os.environ.get("PROBE_PROFILER_FIRST") == "1"
activities = [ProfilerActivity.CPU] + ([] if os.environ.get("PROBE_CPU_ONLY") == "1" else [ProfilerActivity.CUDA])
if BEFORE_CUDA:
    p = profile(activities=activities)
    p.start()
    step("profiler_start_before_cuda")
x = torch.randn(1 << 20, device="cuda")
torch.cuda.synchronize()
step("cuda_init")
if not BEFORE_CUDA:
    p = profile(activities=activities)
    step("profiler_construct")
    p.start()
    step("profiler_start")
for _ in range(3):
    y = x * 2
torch.cuda.synchronize()
step("calls")
p.stop()
step("profiler_stop")
events = p.events()
step("events")
q = profile(activities=activities)
q.start()
step("second_start")
y = x * 2
torch.cuda.synchronize()
q.stop()
step("second_stop")
T["kernels"] = sum(1 for e in events if str(e.device_type).endswith("CUDA"))
"""

CANDIDATE = (
    """import torch
import torch.nn as nn
"""
    + PROBE
    + """
raise RuntimeError("PROBE " + json.dumps(T))


class ModelNew(nn.Module):
    def forward(self, A, B):
        return A
"""
)

TASK = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, A, B):
        return A


def get_inputs():
    return [torch.randn(64), torch.randn(64)]


def get_init_inputs():
    return []
"""


def main():
    args = kforge_arguments("/tmp/kforge-census-start", tasks_required=False).parse_args()
    run = Run(args)
    probe = Path(args.scratch) / "probe.py"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text(PROBE + "\nprint('PROBE ' + json.dumps(T))\n")
    variants = [
        ("default", {}),
        ("default again", {}),
        ("CPU activities only", {"PROBE_CPU_ONLY": "1"}),
        ("profiler before CUDA", {"PROBE_PROFILER_FIRST": "1"}),
        ("eager module loading", {"CUDA_MODULE_LOADING": "EAGER"}),
    ]
    for label, env in variants:
        started = time.monotonic()
        proc = subprocess.run([args.python, str(probe)], env={**os.environ, **env}, capture_output=True, text=True)
        line = next((text for text in proc.stdout.splitlines() if text.startswith("PROBE ")), None)
        steps = json.loads(line[6:]) if line else None
        run.record(
            where="outside", variant=label, seconds=time.monotonic() - started, steps=steps, stderr=proc.stderr[-400:]
        )
        log(f"outside {label}: {steps} {proc.stderr[-200:] if not steps else ''}")

    up = start_kforge(run, args, Path(args.scratch))
    try:
        for attempt in range(2):
            request = {
                "task": {"taskId": "probe", "source": TASK},
                "candidateSource": CANDIDATE,
                "backend": "BACKEND_CUDA",
                "correctnessTrials": 1,
                "requestId": f"probe-{attempt}",
            }
            ok, response, seconds = run.call("Evaluator/Evaluate", request, addr="http://127.0.0.1:50051")
            error = response.get("error", "") if ok else response
            steps = None
            if "PROBE {" in error:
                text = error[error.index("PROBE {") + 6 :]
                try:
                    # (A long error line may come back broken by the stage's log handling.)
                    steps = json.loads(re.sub(r"\s+", " ", text[: text.index("}") + 1]))
                except ValueError:
                    steps = None
            run.record(
                where="sandbox",
                variant=f"evaluation {attempt}",
                seconds=seconds,
                steps=steps,
                verdict=response.get("verdict") if ok else None,
                error=error[-1500:],
            )
            log(f"sandbox #{attempt}: {steps} {'' if steps else error[-600:]}")
    finally:
        stop_kforge(up)


if __name__ == "__main__":
    main()
