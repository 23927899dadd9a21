"""Does the census's profiler session slow the launches of the timed calls that follow it in the same process?

The candidate's stage runs the census (torch's autograd profiler with Kineto, so CUPTI) and then, in the same turn
alone, the timed loop; the baselines' stages time without a census. Kineto leaves CUPTI attached after a session
unless TEARDOWN_CUPTI=1 (then it calls cuptiFinalize), and an attached CUPTI adds host time to every launch. Where
the host's launch is hidden behind device work (the cover), that changes nothing; where it is not (calls of a few
microseconds, and calls that make the host wait mid-call), it is timed.

Each (model, config) in a fresh process, kforge's timed step (`Timer.time_ms` with `cover_ms`, blocking-sync
context switched to spin for the loop, as the harness does; no gate, no perturbation) over `--calls` calls after 25
warm-up calls (the harness warms up 10 by default). Models: `relu` (torch.relu on examples/tasks/relu's 64x4096
input), `triton_relu` (a Triton kernel on the same input), `hostsync` (level2/68's shape with `float()` of a CUDA
scalar between GEMM and epilogue), `graph_relu` (torch.relu captured in a CUDA graph before any profiler session,
replayed), `graph_lazy` (the same captured at its first call, inside the session). Configs: `plain` (no profiler),
`census` (a profiler session as the census opens it, 2 x 10 recorded calls, then closed, before the loop),
`teardown` (the same with TEARDOWN_CUPTI=1 set just before the session, as the harness's census does).

Per process one JSON line: median and p90 of the event times and of the host's time inside the call (`launch`),
the cover's last size, and how long closing the profiler took.

    python3 bench/probes/launch_after_census.py --out-dir OUT [--repeats 2] [--calls 600]

Without CUDA it says so and exits 0.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "crates" / "execution" / "harness"))
from kforge_harness import process, timing

MODELS = ["relu", "triton_relu", "hostsync", "graph_relu", "graph_lazy"]
CONFIGS = ["plain", "census", "teardown"]


def model_fn(name, torch):
    device = torch.device("cuda")
    if name in ("relu", "triton_relu", "graph_relu", "graph_lazy"):
        x = torch.randn(64, 4096, device=device)
        if name == "relu":
            return lambda: torch.relu(x)
        if name == "graph_relu":
            # Captured before the profiler session, replayed after it: CUPTI's teardown must not break a graph.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                y = torch.relu(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = torch.relu(x)

            def replay():
                graph.replay()
                return y

            return replay
        if name == "graph_lazy":
            # Captured at its first call, which runs inside the profiler session (as the census's untimed first
            # call of a mode does), replayed after the session ended.
            made = {}

            def lazy():
                if not made:
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        torch.relu(x)
                    torch.cuda.current_stream().wait_stream(stream)
                    made["graph"] = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(made["graph"]):
                        made["y"] = torch.relu(x)
                made["graph"].replay()
                return made["y"]

            return lazy
        import triton
        import triton.language as tl

        @triton.jit
        def relu_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            tl.store(y_ptr + offsets, tl.maximum(tl.load(x_ptr + offsets, mask=mask), 0.0), mask=mask)

        def call():
            y = torch.empty_like(x)
            # A constexpr parameter takes a plain value at launch; triton's annotation says otherwise.
            relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)  # pyright: ignore[reportArgumentType]
            return y

        return call
    torch.manual_seed(0)
    x = torch.rand(128, 16384, device=device)
    linear = torch.nn.Linear(16384, 16384).to(device)
    c = torch.nn.Parameter(torch.tensor(2.0, device=device))

    def hostsync():
        y = torch.nn.functional.linear(x, linear.weight, linear.bias)
        k = float(c)
        return torch.clamp(y, max=k) - k

    return hostsync


def child(model, config, calls):
    os.environ.pop("TEARDOWN_CUPTI", None)  # set (below) only by the teardown configuration
    process.BLOCKING_SYNC = process.blocking_sync()
    import torch

    device = torch.device("cuda")
    fn = model_fn(model, torch)
    close_ms = None
    with torch.no_grad():
        if model != "graph_lazy":
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        if config != "plain":
            from torch.autograd import profiler

            if config == "teardown":
                os.environ["TEARDOWN_CUPTI"] = "1"  # where the harness sets it: torch imported, CUDA initialised
            session = profiler.profile(use_device="cuda", use_kineto=True)
            session.__enter__()
            for _ in range(2):
                fn()
                torch.cuda.synchronize()
                with torch.profiler.record_function("kforge.mode"):
                    for _ in range(10):
                        fn()
                        torch.cuda.synchronize()
            began = time.perf_counter()
            session.__exit__(None, None, None)
            close_ms = (time.perf_counter() - began) * 1e3
            _ = session.function_events
        timer = timing.Timer(device)
        spinning = process.set_sync(spin=True)
        events, launches, device_ms = [], [], []
        for call in range(calls + 25):
            elapsed, _, launch, _ = timer.time_ms(fn, timing.cover_ms(launches, device_ms))
            launches.append(launch)
            device_ms.append(elapsed)
            if call >= 25:
                events.append(elapsed)
        if spinning:
            process.set_sync(spin=False)

    def pct(values, q):
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "model": model,
        "config": config,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "spin": spinning,
        "close_ms": close_ms,
        "cover_ms": timing.cover_ms(launches, device_ms),
        "event_median_ms": statistics.median(events),
        "event_p90_ms": pct(events, 0.9),
        "launch_median_ms": statistics.median(launches[25:]),
        "launch_p90_ms": pct(launches[25:], 0.9),
        "events_ms": events,
        "launches_ms": launches[25:],
    }


def main():
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out-dir", type=Path)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of the models")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of the configurations")
    ap.add_argument("--one", help="MODEL:CONFIG: one process's measurement, printed as a JSON line")
    args = ap.parse_args()
    if args.one:
        model, config = args.one.split(":")
        print(json.dumps(child(model, config, args.calls)), flush=True)
        os._exit(0)  # as the harness ends a stage: Kineto's CUPTI left attached can crash the interpreter's shutdown
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        "| model | config | repeat | event median / p90 ms | launch median / p90 ms | cover ms | close ms |",
        "|---|---|---|---|---|---|---|",
    ]
    with open(args.out_dir / "results.jsonl", "a") as out:
        for repeat in range(args.repeats):
            for model in args.models.split(","):
                for config in args.configs.split(","):
                    run = subprocess.run(
                        [sys.executable, __file__, "--one", f"{model}:{config}", "--calls", str(args.calls)],
                        capture_output=True,
                        text=True,
                        timeout=300,
                    )
                    if run.returncode != 0:
                        print(f"{model}:{config} repeat {repeat} failed: {run.stderr[-2000:]}")
                        continue
                    r = json.loads(run.stdout.strip().splitlines()[-1])
                    r.update(repeat=repeat, unix=time.time())
                    out.write(json.dumps(r) + "\n")
                    out.flush()
                    close = "-" if r["close_ms"] is None else f"{r['close_ms']:.0f}"
                    rows.append(
                        f"| {model} | {config} | {repeat} | {r['event_median_ms']:.4f} / "
                        f"{r['event_p90_ms']:.4f} | {r['launch_median_ms']:.4f} / {r['launch_p90_ms']:.4f} | "
                        f"{r['cover_ms']:.4f} | {close} |"
                    )
                    print(rows[-1], flush=True)
    (args.out_dir / "table.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
