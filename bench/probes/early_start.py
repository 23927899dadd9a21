"""Whether the census profiler can be started before a harness process knows its GPU: a process whose
CUDA_VISIBLE_DEVICES is set only after its first profiler start must still see exactly the one GPU it was given.

    python bench/probes/early_start.py      (on a machine with at least two GPUs)

For each activity set ("none": no early start, the control), a fresh interpreter starts and stops a profiler
session with no CUDA_VISIBLE_DEVICES, then sets CUDA_VISIBLE_DEVICES=1 (as the harness does when its request
arrives), then counts the devices torch sees and times a second profiler session on that device, and reports that
device's UUID (it must be GPU 1's, listed first).
Prints one JSON object per activity set.
"""

import json
import os
import subprocess
import sys

VARIANT = r"""
import json, os, sys, time
import torch
from torch.profiler import ProfilerActivity, profile

activities = {"none": None, "cpu": [ProfilerActivity.CPU],
              "cpu+cuda": [ProfilerActivity.CPU, ProfilerActivity.CUDA]}[sys.argv[1]]
t0 = time.perf_counter()
if activities is not None:  # "none": the control, as the harness runs today
    early = profile(activities=activities)
    early.start()
    early.stop()
t1 = time.perf_counter()
initialised_early = torch.cuda.is_initialized()
os.environ["CUDA_VISIBLE_DEVICES"] = "1"
count = torch.cuda.device_count()
x = torch.randn(256, 256, device="cuda")
t2 = time.perf_counter()
later = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
later.start()
y = x @ x
torch.cuda.synchronize()
later.stop()
t3 = time.perf_counter()
kernels = [e.name for e in later.events() if e.device_type.name == "CUDA"]
uuid = str(torch.cuda.get_device_properties(0).uuid)
print(json.dumps({"variant": sys.argv[1], "early_start_s": t1 - t0, "cuda_initialised_by_early_start": initialised_early,
                  "devices_seen_after": count, "later_session_s": t3 - t2, "later_kernels": len(kernels), "device_uuid": uuid}))
"""  # noqa: E501 (the child's source, run as written)

env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
# The device the process must end up on: the second GPU's UUID, as the driver lists it.
listed = subprocess.run(
    ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True, text=True
)
print(json.dumps({"gpus": listed.stdout.strip().splitlines()}), flush=True)
for variant in ["none", "cpu", "cpu+cuda"]:
    done = subprocess.run([sys.executable, "-c", VARIANT, variant], capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    print(lines[-1] if lines else json.dumps({"variant": variant, "error": done.stderr[-2000:]}), flush=True)
