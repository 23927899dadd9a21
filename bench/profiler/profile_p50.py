"""How long a Profile of an already-compiled candidate takes, and where the time goes: `kforge up` (evaluator and
profiler on one engine), then per candidate through `kforge call`:

- one cold Profile (the compile included), which also leaves the build in the artifact cache;
- Profiles with the census measured: the task's source gets a distinct trailing comment each time, so the
  census cache (keyed by build and task) misses while the compile is cached;
- one timed Evaluate of the candidate (its census kept by the engine), then Profiles that reuse that census;

each at `--launches` (Nsight Compute's launch limit), with the stage and harness-phase times of every response.
First, each candidate outside kforge: `run_direct.py` alone, and under `ncu` with the default metrics at each
launch count, for Nsight Compute's own share.

From the repository root, with target/release/kforge built and KernelBench's tasks under --tasks-dir:

    python3 bench/profiler/profile_p50.py --out "$OUT" --tasks-dir .kb/kernelbench

Writes OUT/results.jsonl (a record per call, as it goes), OUT/summary.json (p50s) and OUT/machine.txt. Stdlib only.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_live import (
    HERE,
    Run,
    header,
    kforge_arguments,
    log,
    machine,
    start_kforge,
    stop_kforge,
    summarize_profile,
)

EVALUATOR = "http://127.0.0.1:50051"


def profile(run, request, kind, launches, candidate, index):
    ok, response, seconds = run.call("Profiler/Profile", {**request, "launchLimit": launches})
    summary = summarize_profile(response) if ok else {"error": response}
    reused = response.get("censusReused", False) if ok else None
    run.record(
        call="Profile",
        candidate=candidate,
        kind=kind,
        launches=launches,
        index=index,
        ok=ok,
        seconds=seconds,
        census_reused=reused,
        verdict=summary.get("verdict"),
        kernels_profiled=summary.get("kernels_profiled"),
        profiling_ratio=summary.get("profiling_ratio"),
        census=summary.get("census"),
        bottleneck=summary.get("bottleneck"),
        stage_ms=summary.get("stage_ms"),
        error=summary.get("error"),
    )
    log(
        f"{candidate} {kind} launches={launches} #{index}: {seconds:.2f} s {summary.get('verdict')} "
        f"reused={reused} kernels={summary.get('kernels_profiled')} stages={summary.get('stage_ms')} "
        f"{str(summary.get('error') or '')[:200]}"
    )
    return ok and summary.get("verdict") == "VERDICT_CORRECT", seconds


def main():
    parser = kforge_arguments("/tmp/kforge-profile-p50")
    parser.add_argument("--only", default="diag_scale,matmul_tiled")
    parser.add_argument("--launches", default="3,10", help="launch limits to time, comma-separated; 0 is the default")
    parser.add_argument("--measured", type=int, default=3, help="profiles with the census measured, per limit")
    parser.add_argument("--reused", type=int, default=4, help="profiles reusing the census, per limit")
    args = parser.parse_args()
    run = Run(args)
    log(" | ".join(machine(run.out, args.python)))
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    limits = [int(n) for n in args.launches.split(",")]
    names = args.only.split(",")
    times = {}  # (candidate, kind, launches) -> seconds

    # Outside kforge: the candidate alone, then under Nsight Compute with the same metrics.
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(scratch / "direct-ext"))
    # The default metric set, as the profiler's source names it, and the duration it adds to every list.
    source = (HERE.parents[1] / "services" / "profiler" / "src" / "nsight.rs").read_text()
    cudaforge = re.findall(r'"([a-z0-9_.]+)"', source[source.index("pub const CUDAFORGE") :].split("];")[0])
    cudaforge += ["gpu__time_duration.sum"] if cudaforge else []
    for name in names:
        path = HERE / "candidates" / f"{name}.py"
        task = Path(args.tasks_dir) / f"{header(path)['task']}.py"
        direct = [args.python, str(HERE / "run_direct.py"), str(task), str(path)]
        subprocess.run([*direct, "--build-only"], env=env, capture_output=True)
        variants = [("python alone", [], 10)] + [
            (
                f"ncu, {n} launches",
                ["ncu", "--profile-from-start", "off", "--launch-count", str(n)]
                + (["--metrics", ",".join(cudaforge)] if cudaforge else []),
                n,
            )
            for n in limits
        ]
        for label, prefix, calls in variants:
            started = time.monotonic()
            proc = subprocess.run(prefix + direct + ["--calls", str(calls)], env=env, capture_output=True, text=True)
            seconds = time.monotonic() - started
            run.record(
                call="Direct",
                candidate=name,
                variant=label,
                rc=proc.returncode,
                seconds=seconds,
                metrics=len(cudaforge),
                stderr=proc.stderr[-300:],
            )
            log(f"direct {name} {label}: rc {proc.returncode}, {seconds:.2f} s")

    up = start_kforge(run, args, scratch)
    try:
        for name in names:
            path = HERE / "candidates" / f"{name}.py"
            fields = header(path)
            request = {
                "task": run.task(fields["task"]),
                "candidateSource": path.read_text(),
                "backend": "BACKEND_" + fields.get("backend", "cuda").upper(),
                "requestId": name,
            }
            ok, _ = profile(run, request, "cold", limits[0], name, 0)
            if not ok:
                continue
            for launches in limits:
                for i in range(args.measured):
                    task = dict(request["task"], source=request["task"]["source"] + f"\n# variant {launches}-{i}\n")
                    ok, seconds = profile(run, {**request, "task": task}, "census measured", launches, name, i)
                    if ok:
                        times.setdefault((name, "census measured", launches), []).append(seconds)
            evaluate = {
                "requestId": name,
                "task": request["task"],
                "candidateSource": request["candidateSource"],
                "backend": request["backend"],
                "measurePerformance": True,
            }
            eok, evaluation, eseconds = run.call("Evaluator/Evaluate", evaluate, addr=EVALUATOR)
            run.record(
                call="Evaluate",
                candidate=name,
                ok=eok,
                seconds=eseconds,
                verdict=evaluation.get("verdict") if eok else evaluation,
                profiling_ratio=evaluation.get("profilingRatio") if eok else None,
                stage_ms=evaluation.get("stageMs") if eok else None,
            )
            log(f"{name} Evaluate: {eseconds:.1f} s {evaluation.get('verdict') if eok else evaluation}")
            for launches in limits:
                for i in range(args.reused):
                    ok, seconds = profile(run, request, "census reused", launches, name, i)
                    if ok:
                        times.setdefault((name, "census reused", launches), []).append(seconds)
    finally:
        stop_kforge(up)

    summary = {
        f"{name} | {kind} | {launches} launches": {
            "n": len(values),
            "p50_s": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
        }
        for (name, kind, launches), values in times.items()
    }
    (run.out / "summary.json").write_text(json.dumps(summary, indent=1))
    for line, figures in summary.items():
        log(f"{line}: {figures}")


if __name__ == "__main__":
    main()
