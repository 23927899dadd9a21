"""Which part of a host-synchronising call carries its two cost levels: the GEMM, the wait, or the epilogue.

`host_sync_probe.py` found that level2/68's shape with a `float()` of a CUDA scalar between its GEMM and its
epilogue costs about 1.49 or about 1.62 ms a call, whichever timer measures it, switching within a process. This
splits each call with CUDA events, in a do_bench-style loop (default context flags, a 2x-L2 buffer zeroed before
each call, no cover), so each part is the device's own time:

  gemm      start event -> event after F.linear (the GEMM's device time, queued behind the zeroing)
  wait      -> event recorded by the host right after `float()` returned (the 4-byte copy, the host's wake-up and
            its next launch: the device has nothing queued meanwhile)
  epilogue  -> end event after clamp and subtract
  total     start -> end, what a timer of the whole call reads

Models: `hostsync` (the float between GEMM and epilogue) and `eager` (the same kernels, min/sub with the 0-dim
tensor, no wait; its `wait` is the gap between two events recorded back to back). Each (model, repeat) runs in a
fresh process. Per process, one JSON line: every part's samples and medians, and the calls split into two levels by
total (exact 1-D 2-means on the 2nd-98th percentiles, so each process is split at its own threshold, even one that
ran wholly in one level), with each part's median per level, so the part whose median moves with the level is the
one that carries it. `--split-ms` splits every process at one threshold instead (in the table; `--summary-only`
re-renders OUT/results.jsonl).

    python3 bench/probes/host_sync_parts.py --out-dir OUT [--repeats 3] [--calls 600] [--split-ms 1.55]
    python3 bench/probes/host_sync_parts.py --out-dir OUT --summary-only [--split-ms 1.55]

Without CUDA it says so and exits 0.
"""

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PARTS = ["gemm", "wait", "epilogue", "total"]


def two_means_split(values):
    """The threshold of an exact 1-D 2-means on the values clipped to their 2nd-98th percentiles (prefix sums)."""
    ordered = sorted(values)
    lo, hi = ordered[len(ordered) * 2 // 100], ordered[len(ordered) * 98 // 100]
    points = sorted(min(max(v, lo), hi) for v in values)
    total, total_sq, n = sum(points), sum(v * v for v in points), len(points)
    best, split, run, run_sq = None, points[0], 0.0, 0.0
    for i in range(1, n):
        run, run_sq = run + points[i - 1], run_sq + points[i - 1] ** 2
        rest, rest_sq = total - run, total_sq - run_sq
        cost = (run_sq - run * run / i) + (rest_sq - rest * rest / (n - i))
        if best is None or cost < best:
            best, split = cost, (points[i - 1] + points[i]) / 2
    return split


def levels(samples, split):
    """Each part's median over the calls whose total is at most `split` (low) and above it (high)."""
    totals = samples["total"]
    out = {}
    for name, idx in (
        ("low", [i for i, v in enumerate(totals) if v <= split]),
        ("high", [i for i, v in enumerate(totals) if v > split]),
    ):
        out[name] = {"count": len(idx)}
        for p in PARTS:
            out[name][p] = statistics.median([samples[p][i] for i in idx]) if idx else None
    return out


def child(model, calls, warmup):
    import torch
    import torch.nn.functional as F

    device = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.rand(128, 16384, device=device)
    linear = torch.nn.Linear(16384, 16384).to(device)
    c = torch.nn.Parameter(torch.tensor(2.0, device=device))
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.uint8, device=device)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(calls + warmup)]
    with torch.no_grad():
        for e in events:
            flush.zero_()
            e[0].record()
            y = F.linear(x, linear.weight, linear.bias)
            e[1].record()
            if model == "hostsync":
                k = float(c)
                e[2].record()
                out = torch.clamp(y, max=k) - k
            else:
                e[2].record()
                out = torch.min(y, c) - c
            e[3].record()
        torch.cuda.synchronize()
    del out  # pyright: ignore[reportPossiblyUnboundVariable] (the loop above runs at least once)
    samples = {p: [] for p in PARTS}
    for e in events[warmup:]:
        samples["gemm"].append(e[0].elapsed_time(e[1]))
        samples["wait"].append(e[1].elapsed_time(e[2]))
        samples["epilogue"].append(e[2].elapsed_time(e[3]))
        samples["total"].append(e[0].elapsed_time(e[3]))
    split = two_means_split(samples["total"])
    return {
        "model": model,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "median": {p: statistics.median(samples[p]) for p in PARTS},
        "split_ms": split,
        "levels": levels(samples, split),
        "switches": sum(1 for a, b in zip(samples["total"], samples["total"][1:]) if (a <= split) != (b <= split)),
        "samples": samples,
    }


def table(lines, split=None):
    """Per process, each part's median in the two levels: split at the process's own 2-means threshold, or at
    `split` (ms) for every process, so that the levels mean the same across processes."""
    rows = [
        "| model | repeat | total median | low: n, gemm / wait / epilogue / total | high: n, gemm / wait / epilogue "
        "/ total | switches |",
        "|---|---|---|---|---|---|",
    ]
    for r in lines:
        cells = []
        split_ms = split if split is not None else r["split_ms"]
        lines_levels = levels(r["samples"], split_ms)
        for name in ("low", "high"):
            lv = lines_levels[name]
            parts = " / ".join("-" if lv[p] is None else f"{lv[p]:.4f}" for p in PARTS)
            cells.append(f"{lv['count']}, {parts}")
        totals = r["samples"]["total"]
        switches = sum(1 for a, b in itertools.pairwise(totals) if (a <= split_ms) != (b <= split_ms))
        rows.append(
            f"| {r['model']} | {r['repeat']} | {r['median']['total']:.4f} | {cells[0]} | {cells[1]} | {switches} |"
        )
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out-dir", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--split-ms", type=float, help="split every process's calls at this total (ms) in the table")
    ap.add_argument("--summary-only", action="store_true", help="only print the table of OUT/results.jsonl")
    ap.add_argument("--one", help="MODEL: run one process's measurement and print its JSON line")
    args = ap.parse_args()
    if args.summary_only:
        with open(args.out_dir / "results.jsonl") as f:
            lines = [json.loads(line) for line in f]
        print(table(lines, args.split_ms))
        return
    if args.one:
        print(json.dumps(child(args.one, args.calls, args.warmup)))
        return
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    with open(args.out_dir / "results.jsonl", "a") as out:
        for repeat in range(args.repeats):
            for model in ("hostsync", "eager"):
                run = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--one",
                        model,
                        "--calls",
                        str(args.calls),
                        "--warmup",
                        str(args.warmup),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if run.returncode != 0:
                    print(f"{model} repeat {repeat} failed: {run.stderr[-2000:]}")
                    continue
                line = json.loads(run.stdout.strip().splitlines()[-1])
                line.update(repeat=repeat, unix=time.time())
                out.write(json.dumps(line) + "\n")
                out.flush()
                lines.append(line)
    text = table(lines, args.split_ms)
    (args.out_dir / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
