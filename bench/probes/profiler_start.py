"""What the census's profiler costs to start, stop and read, on one GPU: the numbers behind the census's
`census_start` phase (docs/evaluator/DEVICES.md, "Throughput and the performance model").

    python bench/probes/profiler_start.py

Each variant runs in a fresh interpreter (a harness stage starts the profiler once), after CUDA is initialised and a
small model has run, as in the candidate stage. Prints one JSON object per variant: seconds to start, to run the
recorded calls, to stop and to read the events.
"""

import json
import subprocess
import sys

VARIANT = r"""
import json, sys, time
import torch
from torch.profiler import ProfilerActivity, profile, record_function

activities = {"cpu+cuda": [ProfilerActivity.CPU, ProfilerActivity.CUDA], "cuda": [ProfilerActivity.CUDA],
              "cpu": [ProfilerActivity.CPU]}[sys.argv[1]]
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU()).cuda()
x = torch.randn(256, 1024, device="cuda")
model(x); torch.cuda.synchronize()
out = {"variant": sys.argv[1], "sessions": []}
for session in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    prof = profile(activities=activities)
    prof.start()
    t1 = time.perf_counter()
    with record_function("kforge.mode"):
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    prof.stop()
    t3 = time.perf_counter()
    events = prof.events()
    t4 = time.perf_counter()
    out["sessions"].append({"start_s": t1 - t0, "calls_s": t2 - t1, "stop_s": t3 - t2, "read_s": t4 - t3,
                            "events": len(events)})
print(json.dumps(out))
"""

for variant in ["cpu+cuda", "cuda", "cpu"]:
    done = subprocess.run([sys.executable, "-c", VARIANT, variant, "2"], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    print(lines[-1] if lines else json.dumps({"variant": variant, "error": done.stderr[-2000:]}), flush=True)
