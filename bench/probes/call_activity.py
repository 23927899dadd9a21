"""How much CPU does a call into candidate code use while it waits on its GPU: a kernel that never ends against
legitimate calls that wait long (autotuning, cuDNN's benchmark)?

The evaluator stops a call into candidate code as hung when it runs past its call limit without using the CPU; a
call that uses enough CPU over its last 3 s runs on, checked every second, up to the limit for working calls. This
measures where the line between the two can lie. Each workload runs in a fresh process whose GPU context waits
asleep (CU_CTX_SCHED_BLOCKING_SYNC, as the harness sets it); the parent samples the process's CPU demand every
`--interval` seconds the way the evaluator does (utime + stime in clock ticks, the children's it waited for
included, plus each thread's run-queue wait from /proc/PID/task/TID/schedstat) and, beside it, the live threads'
schedstat run + wait time in nanoseconds (no tick rounding; threads that ended drop out of it).

Workloads:
- `hang`: a Triton kernel spinning on a flag that is never set, then `torch.cuda.synchronize()`; sampled for
  `--hang-secs` seconds, then killed. `hang_after_compile`: the same after a `torch.compile`d function ran (its
  compile workers alive); `hang_polling_thread`: the same with a Python thread waking every 50 ms.
- `autotune_warm:compute`: as below, a compute-bound kernel of about 40 ms per call (a long loop of sines).
- `autotune_cold`, `autotune_warm`: the first call of a Triton kernel autotuned over 16 configurations (block
  sizes and warps), on an elementwise op of about 1 ms per call (`mid`) and about 8 ms per call (`slow`); cold with
  an empty Triton cache (compiles included), warm with the cache the cold run left.
- `cudnn_benchmark`: the first call of a 3x3 convolution with `torch.backends.cudnn.benchmark = True`.

Per workload one JSON line in OUT/activity.jsonl: each sample's CPU demand share (ticks + wait) and schedstat share,
the call's length, and the least (legitimate) or greatest (hang) share over 3 s windows as the evaluator reads it
(`least_share_3s`, `greatest_share_3s`; the hangs' first window, which holds their launch, left out);
OUT/summary.md a table.

    python3 bench/probes/call_activity.py --out OUT [--interval 1.0] [--hang-secs 8]

Without CUDA it says so and exits 0.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "crates" / "execution" / "harness"))
from kforge_harness import process

WORKLOADS = [
    "hang",
    "hang_after_compile",
    "hang_polling_thread",
    "autotune_cold:mid",
    "autotune_warm:mid",
    "autotune_cold:slow",
    "autotune_warm:slow",
    "autotune_cold:compute",
    "autotune_warm:compute",
    "cudnn_benchmark",
]
# Elements per call: about 1 ms and 8 ms of memory traffic on an H100 (read and write, float32).
SIZES = {"mid": 1 << 28, "slow": 1 << 31, "compute": 1 << 24}
# Sines per element of the compute-bound kernel (about 40 ms per call on an H100).
COMPUTE_STEPS = 4000
WINDOW_S = 3.0


def child(workload):
    """Runs one workload; prints `call` as the call starts and `done` as it ends."""
    process.BLOCKING_SYNC = process.blocking_sync()
    import torch
    import triton
    import triton.language as tl

    name, _, size = workload.partition(":")
    device = torch.device("cuda")
    torch.zeros(1, device=device)
    if name == "hang_after_compile":
        torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.randn(1024, device=device))
    if name == "hang_polling_thread":
        import threading

        def poll():
            while True:
                time.sleep(0.05)

        threading.Thread(target=poll, daemon=True).start()
    if name.startswith("hang"):

        @triton.jit
        def spin(flag_ptr):
            while tl.load(flag_ptr, volatile=True) == 0:
                pass

        flag = torch.zeros(1, dtype=torch.int32, device=device)
        print("call", flush=True)
        spin[(1,)](flag)
        torch.cuda.synchronize()
    elif name.startswith("autotune"):
        configs = [
            triton.Config({"BLOCK": block}, num_warps=warps)
            for block in (256, 512, 1024, 2048)
            for warps in (1, 2, 4, 8)
        ]

        @triton.autotune(configs=configs, key=["n"])
        @triton.jit
        def scale(x_ptr, y_ptr, n, STEPS: tl.constexpr, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            v = tl.load(x_ptr + offsets, mask=mask)
            for _ in range(STEPS):
                v = tl.sin(v) + 1.0
            tl.store(y_ptr + offsets, v * 2.0, mask=mask)

        n = SIZES[size]
        x = torch.randn(n, device=device)
        y = torch.empty_like(x)
        torch.cuda.synchronize()
        print("call", flush=True)
        steps = COMPUTE_STEPS if size == "compute" else 0
        scale[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n, STEPS=steps)
        torch.cuda.synchronize()
    elif name == "cudnn_benchmark":
        torch.backends.cudnn.benchmark = True
        conv = torch.nn.Conv2d(64, 64, 3, padding=1).to(device)
        x = torch.randn(64, 64, 224, 224, device=device)
        torch.cuda.synchronize()
        print("call", flush=True)
        with torch.no_grad():
            conv(x)
        torch.cuda.synchronize()
    print("done", flush=True)


def demand(pid):
    """(CPU demand as the evaluator reads it, the live threads' schedstat run + wait) in seconds, or None once the
    process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")
        run_ns = wait_ns = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                run, wait, _ = (int(v) for v in (task / "schedstat").read_text().split())
            except (OSError, ValueError):
                continue
            run_ns += run
            wait_ns += wait
        return ticks + wait_ns / 1e9, (run_ns + wait_ns) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def measure(workload, interval, hang_secs, env):
    proc = subprocess.Popen([sys.executable, __file__, "--child", workload], stdout=subprocess.PIPE, text=True, env=env)
    # stdout=PIPE: proc.stdout is set.
    if proc.stdout.readline().strip() != "call":  # pyright: ignore[reportOptionalMemberAccess]
        proc.wait()
        return {"workload": workload, "error": f"the child ended before its call (rc {proc.returncode})"}
    start = time.monotonic()
    last = (start, demand(proc.pid))
    windows = []
    os.set_blocking(proc.stdout.fileno(), False)  # pyright: ignore[reportOptionalMemberAccess]
    ended = False
    while not ended:
        time.sleep(interval)
        line = proc.stdout.readline()  # pyright: ignore[reportOptionalMemberAccess]
        ended = line.strip() == "done" or proc.poll() is not None
        now = time.monotonic()
        sample = demand(proc.pid)
        if sample is None or last[1] is None:
            break
        wall = now - last[0]
        windows.append(
            {
                "at_s": round(now - start, 2),
                "demand_share": round((sample[0] - last[1][0]) / wall, 4),
                "schedstat_share": round((sample[1] - last[1][1]) / wall, 4),
            }
        )
        last = (now, sample)
        if workload.startswith("hang") and now - start >= hang_secs:
            proc.kill()
            break
    call_s = time.monotonic() - start
    proc.wait()
    record = {"workload": workload, "call_s": round(call_s, 2), "windows": windows}
    # Shares over WINDOW_S as the evaluator reads them: a hang's greatest after its first window (its launch, and
    # the kernel's compile, are in it); a legitimate call's least over windows before its last sample (which holds
    # its end).
    hang = workload.startswith("hang")
    samples = windows[1:] if hang else windows[:-1]
    per_window = max(1, round(WINDOW_S / interval))
    sums = [
        sum(w["demand_share"] for w in samples[i : i + per_window]) / per_window
        for i in range(len(samples) - per_window + 1)
    ]
    record["greatest_share_3s" if hang else "least_share_3s"] = round((max if hang else min)(sums), 4) if sums else None
    return record


def shares(windows, key):
    return " ".join(f"{w[key]:.3f}" for w in windows)


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", help="output directory")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default 1)")
    parser.add_argument("--hang-secs", type=float, default=8.0, help="how long the hangs are sampled (default 8)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="call-activity-triton-")
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    records = []
    with open(out / "activity.jsonl", "w") as lines:
        for workload in args.workloads.split(","):
            record = measure(workload, args.interval, args.hang_secs, env)
            records.append(record)
            lines.write(json.dumps(record) + "\n")
            lines.flush()
            print(json.dumps({k: v for k, v in record.items() if k != "windows"}), flush=True)
    rows = [
        "| workload | call (s) | samples | CPU demand share per sample (ticks + run-queue wait) | schedstat share "
        "(live threads' run + wait) | over 3 s (hang: greatest; others: least) |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        w = r.get("windows", [])
        rows.append(
            f"| {r['workload']} | {r.get('call_s', r.get('error'))} | {len(w)} | "
            f"{shares(w, 'demand_share')} | {shares(w, 'schedstat_share')} | "
            f"{r.get('greatest_share_3s', r.get('least_share_3s'))} |"
        )
    (out / "summary.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
