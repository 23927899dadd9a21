"""Host-sync timing probe: why kforge's timer is noisy for a candidate that synchronises with the host mid-call.

KernelBench level2/68_Matmul_Min_Subtract's candidate calls `float(self.constant)` (a CUDA parameter) after launching
its GEMM; kforge timed it at 1.503 ms in one process and 1.611 in another (IQR 5.5%), do_bench at ~1.53. Hypotheses:
the wake-up from that sync is a blocking (futex) wait because cuCtxSetFlags' switch to spin does not reach it, or
kforge's pinning or cover adds jitter. Models (inline; x = torch.rand(128, 16384), Linear(16384, 16384) after
torch.manual_seed(0), c a 0-dim parameter = 2.0; all on cuda, under no_grad):
  eager:    y = F.linear(x, W, b); y = torch.min(y, c); y - c
  hostsync: y = F.linear(x, W, b); k = float(c); torch.clamp(y, max=k) - k   (the host waits for the GEMM mid-call)
Configurations, each (model, config) in its own fresh process (`--one MODEL:CONFIG --out FILE`):
  dobench     triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="all"); default context flags.
  kf_spin     as kforge: cuInit + cuDevicePrimaryCtxSetFlags_v2(dev0, 4) (blocking sync) before any torch CUDA call,
              cuCtxSetFlags(1) (spin) for the timed loop and 4 after (harness set_sync); loop as Timer.time_ms (zero a
              2x-L2 uint8 buffer, `flushed` event, torch.cuda._sleep cover from cover_ms of the earlier calls, start
              event, fn, end event, synchronize) with measure's perturbation of 4 elements of x per call; 25 warm-up
              calls, then 300 samples (one input set: kforge rotates several).
  kf_block    as kf_spin without the switch: blocking sync through the loop.
  kf_default  as kf_spin with default context flags and no switch (set_sync does nothing without blocking sync).
  kf_nocover  as kf_spin with cover 0 (no _sleep before the start event).
  kf_pinned   as kf_spin with the thread pinned to the last allowed CPU (os.sched_setaffinity) during the loop.
Per process, one JSON line: median, p20, p80, IQR/median % (ms), the raw samples, median host time inside fn
(`launch_ms`), cuCtxGetFlags before the switch > after it > at the loop's end > after switching back (8, MAP_HOST, is
always set: 12 = blocking sync, 9 = spin, 8 = auto), the primary context's (flags, active), the driver calls' return
codes, and over the 300 sampled calls (do_bench: over the whole do_bench call, per returned sample): schedstat on-CPU
and run-queue wait, voluntary/involuntary context switches (getrusage RUSAGE_THREAD). About one voluntary switch per
call more than eager means the thread slept (futex) in the in-forward sync; on-CPU near 100% of the loop: it spun.

On the GPU machine, from the repository root (each process takes 5-7 s on an H200, so the default deadline of
240 s may cut the last few of 36; `--deadline-s 300` runs them all):

    python3 bench/timing/host_sync_probe.py --out-dir OUT --repeats 3

Runs are interleaved (every (model, config) of repeat 0, then repeat 1, ...), appended to OUT/results.jsonl as each
ends; none starts after `--deadline-s`. The table: per (model, config) the median of the per-process medians, their
spread (max-min, % of it), mean IQR %, voluntary switches per call, on-CPU %, launch ms, flags read back. Select
with `--only kf_spin,dobench` and `--models hostsync`; `--summary-only` reprints the table. Without CUDA it says so
and exits 0.
"""

import argparse, ctypes, json, os, resource, statistics, subprocess, sys, time  # noqa: E401 (stdlib only)
from pathlib import Path

# The harness's own sizing of the cover before each timed call (stdlib at import: torch loads where used).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "crates" / "execution" / "harness"))
from kforge_harness import cover_ms  # noqa: E402

CONFIGS = ["dobench", "kf_spin", "kf_block", "kf_default", "kf_nocover", "kf_pinned"]
MODELS = ["eager", "hostsync"]
WARMUP, SAMPLES, CHILD_TIMEOUT_S = 25, 300, 180


def cuda_driver():
    """libcuda.so.1 with the prototypes of NVIDIA's driver API for the calls used here, or None."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    u, i, pu, pi = ctypes.c_uint, ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_int)
    for name, args in {"cuInit": [u], "cuDeviceGet": [pi, i], "cuDeviceGetCount": [pi], "cuDriverGetVersion": [pi],
                       "cuDevicePrimaryCtxSetFlags_v2": [i, u], "cuDevicePrimaryCtxGetState": [i, pu, pi],
                       "cuCtxGetFlags": [pu], "cuCtxSetFlags": [u]}.items():
        fn = getattr(cu, name, None)  # cuCtxSetFlags: CUDA 12.1 and later
        if fn is not None:
            fn.argtypes, fn.restype = args, ctypes.c_int
    return cu


def no_cuda_reason(cu):
    n = ctypes.c_int()
    if cu is None:
        return "libcuda.so.1 cannot be loaded"
    return None if cu.cuInit(0) == 0 and cu.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0 else "no CUDA device"


def ctx_flags(cu):
    """The current context's flags (cuCtxGetFlags), None if the call fails (no current context)."""
    f = ctypes.c_uint()
    return f.value if cu.cuCtxGetFlags(ctypes.byref(f)) == 0 else None


def primary_state(cu, dev):
    f, on = ctypes.c_uint(), ctypes.c_int()
    return [f.value, on.value] if cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(f), ctypes.byref(on)) == 0 else None


def set_flags(cu, flags):
    return cu.cuCtxSetFlags(flags) if getattr(cu, "cuCtxSetFlags", None) is not None else "missing"


def thread_stats():
    try:
        with open("/proc/thread-self/schedstat") as f:
            oncpu, wait = (int(v) / 1e6 for v in f.read().split()[:2])
    except (OSError, ValueError):
        oncpu = wait = float("nan")
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return {"oncpu_ms": oncpu, "wait_ms": wait, "vol": r.ru_nvcsw, "invol": r.ru_nivcsw,
            "wall_ms": time.perf_counter_ns() / 1e6}


def quantile(values, p):
    s, x = sorted(values), p * (len(values) - 1)
    return s[int(x)] + (s[min(int(x) + 1, len(s) - 1)] - s[int(x)]) * (x - int(x))


def summary(values):
    med = quantile(values, 0.5)
    return {"n": len(values), "median": med, "p20": quantile(values, 0.2), "p80": quantile(values, 0.8),
            "iqr_pct": 100 * (quantile(values, 0.75) - quantile(values, 0.25)) / med if med else None}


def one(spec, out):
    """Measures one (model, config) in this process; writes one JSON line to `out`."""
    model_name, config = spec.split(":")
    cu = cuda_driver()
    reason = no_cuda_reason(cu)  # cuInit first, as kforge's blocking_sync
    if reason:
        print(f"no CUDA: {reason}; nothing measured")
        return
    import torch
    import torch.nn.functional as F

    dev, version = ctypes.c_int(), ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    blocking = config not in ("dobench", "kf_default")
    rec = {"model": model_name, "config": config, "pid": os.getpid(), "torch": torch.__version__}
    if blocking:  # before torch creates the primary context, as kforge_harness.blocking_sync
        rec["primary_set_rc"] = cu.cuDevicePrimaryCtxSetFlags_v2(dev, 4)
    if not torch.cuda.is_available():
        print("no CUDA: torch.cuda.is_available() is False; nothing measured")
        return
    cu.cuDriverGetVersion(ctypes.byref(version))
    rec.update(gpu=torch.cuda.get_device_name(0), driver=version.value)

    class Model(torch.nn.Module):
        def __init__(self, hostsync):
            super().__init__()
            linear = torch.nn.Linear(16384, 16384, device="cuda")
            self.weight, self.bias, self.hostsync = linear.weight, linear.bias, hostsync
            self.constant = torch.nn.Parameter(torch.tensor(2.0, device="cuda"))

        def forward(self, x):
            y = F.linear(x, self.weight, self.bias)
            if self.hostsync:
                k = float(self.constant)  # host synchronisation between the GEMM and the epilogue
                return torch.clamp(y, max=k) - k
            return torch.min(y, self.constant) - self.constant

    torch.manual_seed(0)
    model, x = Model(model_name == "hostsync"), torch.rand(128, 16384).cuda()
    rec.update(primary_state=primary_state(cu, dev), flags_before=ctx_flags(cu))
    with torch.no_grad():
        if config == "dobench":
            import triton.testing

            s0 = thread_stats()
            times = triton.testing.do_bench(lambda: model(x), warmup=25, rep=200, return_mode="all")
            rec["loop"] = {k: v - s0[k] for k, v in thread_stats().items()}
            rec.update(summary(times), loop_calls=len(times), flags_end=ctx_flags(cu), samples=times)
        else:
            samples, launches, device_ms, hosts = kforge_loop(torch, cu, model, x, config, blocking, rec)
            rec.update(summary(samples), launch_ms=quantile(launches[WARMUP:], 0.5), host_ms=quantile(hosts, 0.5),
                       cover_ms=cover_ms(launches, device_ms), loop_calls=SAMPLES, samples=samples)
    rec["samples"] = [round(v, 5) for v in rec["samples"]]  # raw, in call order
    with open(out, "w") as f:
        f.write(json.dumps(rec) + "\n")


def kforge_loop(torch, cu, model, x, config, blocking, rec):
    """kforge_harness.measure + Timer.time_ms for one input set, with the config's variations."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flush = torch.empty(max(2 * l2, 1 << 20), dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(1_000_000)  # spin_rate: the first launch loads the kernel
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(1_000_000)
    b.record()
    torch.cuda.synchronize()
    rate = 1_000_000 / a.elapsed_time(b)
    spin = blocking and config != "kf_block"
    if spin:
        rec["set_spin_rc"] = set_flags(cu, 1)
    rec["flags_spin"] = ctx_flags(cu)
    affinity = os.sched_getaffinity(0)
    if config == "kf_pinned":
        os.sched_setaffinity(0, {max(affinity)})
        rec["pinned_cpu"] = max(affinity)
    samples, hosts, launches, device_ms, output = [], [], [], [], None
    for call in range(WARMUP + SAMPLES):
        if call == WARMUP:
            s0 = thread_stats()
        g = torch.Generator().manual_seed(call)  # kforge_harness.perturb: 4 elements take others' values
        positions = torch.randint(x.numel(), (2, 4), generator=g).to(x.device)
        x.view(-1)[positions[0]] = x.view(-1)[positions[1]].clone()
        cover = 0.0 if config == "kf_nocover" else cover_ms(launches, device_ms)
        begin = time.perf_counter_ns()  # Timer.time_ms from here
        flush.zero_()
        flushed, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        flushed.record()
        cycles = int(cover * rate)
        if cycles > 0:
            torch.cuda._sleep(cycles)
        start.record()
        launch = time.perf_counter_ns()
        output = model(x)
        launch = (time.perf_counter_ns() - launch) / 1e6
        end.record()
        torch.cuda.synchronize()
        host = (time.perf_counter_ns() - begin) / 1e6 - flushed.elapsed_time(start)
        launches.append(launch)
        device_ms.append(start.elapsed_time(end))
        if call >= WARMUP:
            samples.append(device_ms[-1])
            hosts.append(host)
    rec.update(loop={k: v - s0[k] for k, v in thread_stats().items()}, flags_end=ctx_flags(cu))
    del output
    if config == "kf_pinned":
        os.sched_setaffinity(0, affinity)
    if spin:
        rec["set_back_rc"] = set_flags(cu, 4)
    rec["flags_after"] = ctx_flags(cu)
    return samples, launches, device_ms, hosts


def table(path):
    groups = {}
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            groups.setdefault((r["model"], r["config"]), []).append(r)
    print(f"{'model':9} {'config':10} {'n':>2} {'med_ms':>7} {'sprd%':>6} {'iqr%':>5} {'vol/call':>8} {'oncpu%':>6} "
          f"{'launch':>7}  flags before>spin>end>after  rc set/back")
    order = lambda k: (MODELS.index(k[0]) if k[0] in MODELS else 9, CONFIGS.index(k[1]) if k[1] in CONFIGS else 9)
    for (m, c), rs in sorted(groups.items(), key=lambda kv: order(kv[0])):
        ok = [r for r in rs if r.get("median")]
        if not ok:
            print(f"{m:9} {c:10} failed x{len(rs)}: {str(rs[-1].get('error', ''))[-70:]!r}")
            continue
        meds = [r["median"] for r in ok]
        mm = statistics.median(meds)
        vol = statistics.median(r["loop"]["vol"] / r["loop_calls"] for r in ok)
        oncpu = statistics.median(100 * r["loop"]["oncpu_ms"] / r["loop"]["wall_ms"] for r in ok)
        launch = statistics.median(r.get("launch_ms") or 0.0 for r in ok)
        flags = {">".join(str(r.get(k, "-")) for k in ("flags_before", "flags_spin", "flags_end", "flags_after"))
                 for r in ok}
        rcs = {f"{r.get('set_spin_rc', '-')}/{r.get('set_back_rc', '-')}" for r in ok}
        print(f"{m:9} {c:10} {len(ok):>2} {mm:7.4f} {100 * (max(meds) - min(meds)) / mm:6.2f} "
              f"{statistics.mean(r['iqr_pct'] for r in ok):5.2f} {vol:8.3f} {oncpu:6.1f} {launch:7.4f}  "
              f"{' | '.join(sorted(flags)):27}  {' | '.join(sorted(rcs))}" + (f"  ({len(rs) - len(ok)} failed)"
                                                                             if len(rs) > len(ok) else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, help="where results.jsonl goes (appended to)")
    ap.add_argument("--repeats", type=int, default=3, help="processes per (model, config) (default 3)")
    ap.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configs (default all)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated models (default all)")
    ap.add_argument("--deadline-s", type=float, default=240, help="no new process after this (default 240)")
    ap.add_argument("--summary-only", action="store_true", help="print the table of OUT/results.jsonl")
    ap.add_argument("--one", metavar="MODEL:CONFIG", help="internal: measure one in this process")
    ap.add_argument("--out", help="internal: --one's JSON line goes here")
    args = ap.parse_args()
    if args.one:
        one(args.one, args.out)
        return
    if args.out_dir is None:
        ap.error("--out-dir is required")
    results = args.out_dir / "results.jsonl"
    if args.summary_only:
        table(results)
        return
    configs, models = args.only.split(","), args.models.split(",")
    unknown = [c for c in configs if c not in CONFIGS] + [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown config or model: {unknown}")
    reason = no_cuda_reason(cuda_driver())
    if reason:
        print(f"no CUDA on this machine ({reason}): nothing to measure; run this on a GPU machine.")
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    plan = [(rep, c, m) for rep in range(args.repeats) for c in configs for m in models]
    for index, (rep, config, model) in enumerate(plan):
        if time.monotonic() - started > args.deadline_s:
            print(f"deadline {args.deadline_s} s passed: {len(plan) - index} of {len(plan)} processes not started")
            break
        tmp = args.out_dir / f"one-{model}-{config}-{rep}.json"
        tmp.unlink(missing_ok=True)
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", f"{model}:{config}",
                                   "--out", str(tmp)], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            error = (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            error = f"timed out after {CHILD_TIMEOUT_S} s"
        rec = json.loads(tmp.read_text()) if tmp.exists() else {"model": model, "config": config, "error": error}
        tmp.unlink(missing_ok=True)
        rec.update(rep=rep, order=index)
        with open(results, "a") as f:
            f.write(json.dumps(rec) + "\n")
        got = f"median {rec['median']:.4f} ms iqr {rec['iqr_pct']:.2f}%" if rec.get("median") else \
            f"FAILED: {error.strip().splitlines()[-1:] if error else ''}"
        print(f"[{time.monotonic() - started:6.1f}s] {model}:{config} rep {rep}: {got}", flush=True)
    table(results)


if __name__ == "__main__":
    main()
