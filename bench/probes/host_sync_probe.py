"""Host-sync timing probe: why kforge's timer is noisy for a candidate that synchronises with the host mid-call.

KernelBench level2/68_Matmul_Min_Subtract's candidate calls `float(self.constant)` (a CUDA parameter) after launching
its GEMM; kforge timed it at 1.503 ms in one process and 1.611 in another (IQR 5.5%), do_bench at ~1.53. Hypotheses:
the wake-up from that sync is a blocking (futex) wait because cuCtxSetFlags' switch to spin does not reach it, or
kforge's pinning or cover adds jitter. Models (inline; x = torch.rand(128, 16384), Linear(16384, 16384) after
torch.manual_seed(0), c a 0-dim parameter = 2.0; all on cuda, under no_grad):
  eager:    y = F.linear(x, W, b); y = torch.min(y, c); y - c
  hostsync: y = F.linear(x, W, b); k = float(c); torch.clamp(y, max=k) - k   (the host waits for the GEMM mid-call)
  synconly: y = F.linear(x, W, b); torch.cuda.synchronize(); torch.clamp(y, max=2.0) - 2.0   (the wait, no copy)
  scalar:   y = F.linear(x, W, b); torch.clamp(y, max=2.0) - 2.0   (hostsync's kernels, no wait)
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

Clocks (is the level the GPU's SM clock or power state?): a background thread reads NVML (pynvml, from the package
nvidia-ml-py, imported lazily) for the process's GPU (found by PCI bus id, as CUDA_VISIBLE_DEVICES renumbers CUDA's
devices and not NVML's) every `--nvml-period-ms` (default 2; 0: off) from 20 ms before do_bench or kforge's loop
(warm-up included) to their end: host time (perf_counter_ns, middle of the read), SM and memory clock (MHz), power
(mW: nvmlDeviceGetPowerUsage, which newer GPUs average over about 1 s, and the instant field NVML_FI_DEV_POWER_INSTANT
where supported), pstate, clocks event (throttle) reasons bitmask, temperature. It sleeps between reads, and NVML's
ctypes calls release the GIL. Each timed call gets a host time: kforge's loop, right after its synchronize; do_bench
(which returns only times), when `fn` returns (a wrapper appends it; the last len(times) are the timed calls): for
hostsync that is just after its GEMM ended, for eager the host runs ahead of the GPU, so its join is only rough. Each
call is joined to the nearest earlier reading. In the line: `nvml` (null, with `nvml_reason`, when pynvml is missing,
NVML fails, or it is off): device (name, bus id and how it was mapped, limits), reads and their cost (read_us median,
max), `series` (the raw readings as lists of ints, t_us from the sampler's start), `window_us` (the timed part),
`sample_t_us` and `sample_sm` (per timed call), Spearman rank correlation of the call's ms with its SM clock
(`rho_sm`) and power (`rho_power`); and `levels`: the samples split in two cost levels (exact 1-D 2-means on the
samples clipped to their 2nd-98th percentiles, so a lone outlier is no level), each with count, median ms, median SM
clock, median power, the pstates seen and the OR of the event reasons, plus the split, the gap between the levels'
medians (%) and how often consecutive calls change level (`switches`).

On the GPU machine, from the repository root (each process takes 5-7 s on an H200, so the default deadline of
240 s may cut the last few of 36; `--deadline-s 300` runs them all):

    python3 bench/probes/host_sync_probe.py --out-dir OUT --repeats 3

Runs are interleaved (every (model, config) of repeat 0, then repeat 1, ...), appended to OUT/results.jsonl as each
ends; none starts after `--deadline-s`. The table: per (model, config) the median of the per-process medians, their
spread (max-min, % of it), mean IQR %, voluntary switches per call, on-CPU %, launch ms, flags read back, and, over
the samples of its processes pooled, the two levels' medians (lo, hi ms), the share of calls in the high one, their
median SM clocks (MHz) and the Spearman correlation of ms with SM clock (- without NVML). Select with
`--only kf_spin,dobench` and `--models hostsync`; `--summary-only` reprints the table. Without CUDA it says so and
exits 0.
"""

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# The harness's own sizing of the cover before each timed call (stdlib at import: torch loads where used).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "crates" / "execution" / "harness"))
from host_sync_stats import join_earlier, levels, quantile, spearman, summary
from kforge_harness.timing import cover_ms

CONFIGS = ["dobench", "kf_spin", "kf_block", "kf_default", "kf_nocover", "kf_pinned"]
MODELS = ["eager", "hostsync", "synconly", "scalar"]
WARMUP, SAMPLES, CHILD_TIMEOUT_S = 25, 300, 180
NVML_LEAD_S = 0.02  # the sampler's readings before the timed part


def cuda_driver():
    """libcuda.so.1 with the prototypes of NVIDIA's driver API for the calls used here, or None."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    u, i, pu, pi = ctypes.c_uint, ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_int)
    for name, args in {
        "cuInit": [u],
        "cuDeviceGet": [pi, i],
        "cuDeviceGetCount": [pi],
        "cuDriverGetVersion": [pi],
        "cuDevicePrimaryCtxSetFlags_v2": [i, u],
        "cuDevicePrimaryCtxGetState": [i, pu, pi],
        "cuCtxGetFlags": [pu],
        "cuCtxSetFlags": [u],
        "cuDeviceGetPCIBusId": [ctypes.c_char_p, i, i],
    }.items():
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
    return {
        "oncpu_ms": oncpu,
        "wait_ms": wait,
        "vol": r.ru_nvcsw,
        "invol": r.ru_nivcsw,
        "wall_ms": time.perf_counter_ns() / 1e6,
    }


def nvml_handle(nv, cu, dev, torch):
    """NVML's handle for the GPU this process's CUDA calls device 0 (CUDA_VISIBLE_DEVICES renumbers CUDA's devices,
    not NVML's), and how it was found."""
    tried, notes = [], []
    p = torch.cuda.get_device_properties(0)
    if all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        tried.append(("torch properties", f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"))
    buf = ctypes.create_string_buffer(64)
    if getattr(cu, "cuDeviceGetPCIBusId", None) is not None and cu.cuDeviceGetPCIBusId(buf, 64, dev) == 0:
        tried.append(("cuDeviceGetPCIBusId", buf.value.decode()))
    for how, bus in tried:
        try:
            return nv.nvmlDeviceGetHandleByPciBusId(bus.encode()), {"mapped_by": how, "cuda_bus_ids": dict(tried)}
        except Exception as e:  # pynvml.NVMLError and anything odd
            notes.append(f"{how} {bus}: {type(e).__name__}: {e}")
    uuid = str(getattr(p, "uuid", "") or "")
    if uuid:
        try:
            name = uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid
            return nv.nvmlDeviceGetHandleByUUID(name.encode()), {"mapped_by": "uuid", "notes": notes}
        except Exception as e:
            notes.append(f"uuid {uuid}: {type(e).__name__}: {e}")
    return nv.nvmlDeviceGetHandleByIndex(0), {
        "mapped_by": "NVML index 0 (no bus id or uuid matched; may be another GPU under CUDA_VISIBLE_DEVICES)",
        "notes": notes,
    }


def field_value(v):
    """The number in a pynvml c_nvmlFieldValue_t."""
    return [v.value.dVal, v.value.uiVal, v.value.ulVal, v.value.ullVal, v.value.sllVal, v.value.siVal, v.value.usVal][
        v.valueType
    ]


class NvmlSampler:
    """NVML readings of this process's GPU from a background thread (module docstring: Clocks). Never raises: when
    pynvml is missing or NVML fails, `error` says why and start/stop do nothing."""

    def __init__(self, cu, dev, torch, period_ms):
        self.period_s, self.error, self.device, self.unsupported = period_ms / 1e3, None, {}, {}
        self.readers, self.series, self.read_ns, self.t0 = {}, {"t": []}, [], None
        self.stopping, self.thread = threading.Event(), None
        if period_ms <= 0:
            self.error = "off (--nvml-period-ms 0)"
            return
        try:
            import pynvml as nv  # pyright: ignore[reportMissingImports] (nvidia-ml-py, on the GPU machines only)
        except Exception as e:
            self.error = f"pynvml cannot be imported ({type(e).__name__}: {e}); pip install nvidia-ml-py"
            return
        try:
            nv.nvmlInit()
            h, self.device = nvml_handle(nv, cu, dev, torch)
            self.device.update(self.static(nv, h))
            self.readers = self.probe_readers(nv, h)
            if "sm" not in self.readers:
                raise RuntimeError(f"the SM clock cannot be read: {self.unsupported.get('sm')}")
        except Exception as e:
            self.error, self.readers = f"NVML failed ({type(e).__name__}: {e})", {}
        self.series.update({k: [] for k in self.readers})

    @staticmethod
    def static(nv, h):
        """What does not change during the run, each None where NVML refuses it."""

        def get(fn, *a) -> Any:
            try:
                v = getattr(nv, fn)(h, *a)
                return v.decode() if isinstance(v, bytes) else v
            except Exception:
                return None

        pci = get("nvmlDeviceGetPciInfo")
        try:
            driver = nv.nvmlSystemGetDriverVersion()
        except Exception:
            driver = None
        return {
            "name": get("nvmlDeviceGetName"),
            "uuid": get("nvmlDeviceGetUUID"),
            "nvml_bus_id": None if pci is None else (pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId),
            "driver": driver.decode() if isinstance(driver, bytes) else driver,
            "max_sm_mhz": get("nvmlDeviceGetMaxClockInfo", nv.NVML_CLOCK_SM),
            "app_sm_mhz": get("nvmlDeviceGetApplicationsClock", nv.NVML_CLOCK_SM),
            "power_limit_mw": get("nvmlDeviceGetEnforcedPowerLimit"),
            "persistence": get("nvmlDeviceGetPersistenceMode"),
        }

    def probe_readers(self, nv, h):
        """The readings this GPU answers (one trial read each); the others go to `unsupported`."""
        reasons = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        instant = [getattr(nv, "NVML_FI_DEV_POWER_INSTANT", 186)]

        def power_instant():
            v = nv.nvmlDeviceGetFieldValues(h, instant)[0]
            if v.nvmlReturn != 0:
                raise RuntimeError(f"field value return {v.nvmlReturn}")
            return field_value(v)

        candidates = {
            "sm": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "mem": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
            "pw": lambda: nv.nvmlDeviceGetPowerUsage(h),
            "pwi": power_instant,
            "ps": lambda: nv.nvmlDeviceGetPerformanceState(h),
            "rsn": lambda: reasons(h),
            "temp": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        }
        ok = {}
        for name, read in candidates.items():
            try:
                int(read())
                ok[name] = read
            except Exception as e:
                self.unsupported[name] = f"{type(e).__name__}: {e}"
        return ok

    def run(self):
        readers, series, read_ns, period = list(self.readers.items()), self.series, self.read_ns, self.period_s
        due = time.perf_counter()
        while not self.stopping.is_set():
            a = time.perf_counter_ns()
            for name, read in readers:
                try:
                    series[name].append(int(read()))
                except Exception:
                    series[name].append(None)  # one failed read: a gap
            b = time.perf_counter_ns()
            series["t"].append((a + b) // 2)
            read_ns.append(b - a)
            due += period
            wait = due - time.perf_counter()
            if wait > 0:
                self.stopping.wait(wait)  # sleeps: the measuring thread has the GIL meanwhile
            else:
                due = time.perf_counter()  # reads slower than the period: as fast as they go

    def start(self):
        """Starts reading, then waits NVML_LEAD_S so that the series begins before the timed part."""
        if self.error:
            return
        self.t0 = time.perf_counter_ns()
        self.thread = threading.Thread(target=self.run, name="nvml-sampler", daemon=True)
        self.thread.start()
        time.sleep(NVML_LEAD_S)

    def stop(self):
        if self.thread is not None:
            self.stopping.set()
            self.thread.join()

    def record(self, samples, stamps, window, stamped):
        """The line's `nvml` (or None and `nvml_reason`) and `levels` for the timed calls' samples (ms) and host
        times (perf_counter_ns, parallel to samples); window: the timed part's (begin, end) host times."""
        if self.error or not self.series["t"]:
            return {"nvml": None, "nvml_reason": self.error or "the sampler read nothing", "levels": levels(samples)}
        s, us = self.series, (lambda ns: (ns - self.t0) // 1000)
        idx = join_earlier(s["t"], stamps)
        col = {k: [None if i is None else s[k][i] for i in idx] for k in self.readers}
        power = col.get("pwi") or col.get("pw")
        nvml = {
            "device": self.device,
            "unsupported": self.unsupported,
            "period_ms": self.period_s * 1e3,
            "reads": len(s["t"]),
            "read_us": [round(quantile(self.read_ns, 0.5) / 1e3, 1), round(max(self.read_ns) / 1e3, 1)],
            "stamped": stamped,
            "power_field": "pwi" if col.get("pwi") else "pw",
            "window_us": [us(window[0]), us(window[1])],
            "sample_t_us": [us(t) for t in stamps],
            "sample_sm": col["sm"],
            "rho_sm": spearman(samples, col["sm"]),
            "rho_power": spearman(samples, power),
            "series": {"t_us": [us(t) for t in s["t"]], **{k: s[k] for k in self.readers}},
        }
        return {"nvml": nvml, "levels": levels(samples, col["sm"], power, col.get("ps"), col.get("rsn"))}


def one(spec, out, nvml_period_ms=2.0):
    """Measures one (model, config) in this process; writes one JSON line to `out`."""
    model_name, config = spec.split(":")
    cu = cuda_driver()
    reason = no_cuda_reason(cu)  # cuInit first, as kforge's blocking_sync
    if reason:
        print(f"no CUDA: {reason}; nothing measured")
        return
    import torch
    import torch.nn.functional as F

    # no_cuda_reason() is None only where cu is loaded.
    dev, version = ctypes.c_int(), ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), 0)  # pyright: ignore[reportOptionalMemberAccess]
    blocking = config not in ("dobench", "kf_default")
    rec = {"model": model_name, "config": config, "pid": os.getpid(), "torch": torch.__version__}
    if blocking:  # before torch creates the primary context, as kforge_harness.process.blocking_sync
        rec["primary_set_rc"] = cu.cuDevicePrimaryCtxSetFlags_v2(dev, 4)  # pyright: ignore[reportOptionalMemberAccess]
    if not torch.cuda.is_available():
        print("no CUDA: torch.cuda.is_available() is False; nothing measured")
        return
    cu.cuDriverGetVersion(ctypes.byref(version))  # pyright: ignore[reportOptionalMemberAccess]
    rec.update(gpu=torch.cuda.get_device_name(0), driver=version.value)

    class Model(torch.nn.Module):
        def __init__(self, kind):
            super().__init__()
            linear = torch.nn.Linear(16384, 16384, device="cuda")
            self.weight, self.bias, self.kind = linear.weight, linear.bias, kind
            self.constant = torch.nn.Parameter(torch.tensor(2.0, device="cuda"))

        def forward(self, x):
            y = F.linear(x, self.weight, self.bias)
            if self.kind == "hostsync":
                k = float(self.constant)  # host synchronisation between the GEMM and the epilogue
                return torch.clamp(y, max=k) - k
            if self.kind == "synconly":
                torch.cuda.synchronize()  # the same wait, without copying a value back
                return torch.clamp(y, max=2.0) - 2.0
            if self.kind == "scalar":
                return torch.clamp(y, max=2.0) - 2.0  # hostsync's kernels, without the wait
            return torch.min(y, self.constant) - self.constant

    torch.manual_seed(0)
    model, x = Model(model_name), torch.rand(128, 16384).cuda()
    rec.update(primary_state=primary_state(cu, dev), flags_before=ctx_flags(cu))
    sampler = NvmlSampler(cu, dev, torch, nvml_period_ms)
    sampler.start()  # NVML_LEAD_S of readings before the timed part (nothing when NVML is unavailable)
    with torch.no_grad():
        if config == "dobench":
            import triton.testing

            stamps = []

            def fn():  # do_bench returns only times: the host time at which each call returned
                model(x)
                stamps.append(time.perf_counter_ns())

            s0 = thread_stats()
            begin = time.perf_counter_ns()
            # return_mode="all": a list of times, which do_bench's annotation does not say.
            times: Any = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="all")
            window = (begin, time.perf_counter_ns())
            rec["loop"] = {k: v - s0[k] for k, v in thread_stats().items()}
            sampler.stop()
            rec.update(
                summary(times), loop_calls=len(times), flags_end=ctx_flags(cu), samples=times, fn_calls=len(stamps)
            )
            stamps, stamped = stamps[-len(times) :], "when fn returned (eager: the host runs ahead of the GPU)"
        else:
            clock = {"stamps": []}
            samples, launches, device_ms, hosts = kforge_loop(torch, cu, model, x, config, blocking, rec, clock)
            sampler.stop()
            rec.update(
                summary(samples),
                launch_ms=quantile(launches[WARMUP:], 0.5),
                host_ms=quantile(hosts, 0.5),
                cover_ms=cover_ms(launches, device_ms),
                loop_calls=SAMPLES,
                samples=samples,
            )
            stamps, window, stamped = clock["stamps"], (clock["begin"], clock["end"]), "after the call's synchronize"
    rec.update(sampler.record(rec["samples"], stamps, window, stamped))
    rec["samples"] = [round(v, 5) for v in rec["samples"]]  # raw, in call order
    with open(out, "w") as f:
        f.write(json.dumps(rec) + "\n")


def kforge_loop(torch, cu, model, x, config, blocking, rec, clock):
    """kforge_harness.timing.measure + Timer.time_ms for one input set, with the config's variations. Fills clock: the
    host times (perf_counter_ns) of the timed part's begin and end and, per sample, right after its synchronize."""
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
            clock["begin"] = time.perf_counter_ns()
        g = torch.Generator().manual_seed(call)  # kforge_harness.inputs.perturb: 4 elements take others' values
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
        done = time.perf_counter_ns()
        host = (done - begin) / 1e6 - flushed.elapsed_time(start)
        launches.append(launch)
        device_ms.append(start.elapsed_time(end))
        if call >= WARMUP:
            samples.append(device_ms[-1])
            hosts.append(host)
            clock["stamps"].append(done)
    clock["end"] = time.perf_counter_ns()
    # s0 is set at call WARMUP, which the loop reaches.
    rec.update(loop={k: v - s0[k] for k, v in thread_stats().items()}, flags_end=ctx_flags(cu))  # pyright: ignore[reportPossiblyUnboundVariable]
    del output
    if config == "kf_pinned":
        os.sched_setaffinity(0, affinity)
    if spin:
        rec["set_back_rc"] = set_flags(cu, 4)
    rec["flags_after"] = ctx_flags(cu)
    return samples, launches, device_ms, hosts


def fmt(v, spec, width):
    return ("-" if v is None else format(v, spec)).rjust(width)


def pooled_levels(recs):
    """levels and Spearman(ms, SM clock) over the samples of recs pooled, with their joined SM clocks (None without
    NVML): the table's last columns."""
    ms, sm = [], []
    for r in recs:
        ms += r["samples"]
        sm += (r.get("nvml") or {}).get("sample_sm") or [None] * len(r["samples"])
    return levels(ms, sm), spearman(ms, sm)


def level_cols(lv, rho):
    """lo_ms hi_ms hi% sm_lo sm_hi rho."""
    lo, hi = (lv or {}).get("low") or {}, (lv or {}).get("high") or {}
    share = 100 * hi["n"] / (lo["n"] + hi["n"]) if lo.get("n") is not None and hi.get("n") is not None else None
    return (
        f"{fmt(lo.get('median_ms'), '.4f', 7)} {fmt(hi.get('median_ms'), '.4f', 7)} {fmt(share, '.0f', 3)} "
        f"{fmt(lo.get('median_sm_mhz'), '.0f', 5)} {fmt(hi.get('median_sm_mhz'), '.0f', 5)} {fmt(rho, '+.2f', 5)}"
    )


def table(path):
    groups = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                groups.setdefault((r["model"], r["config"]), []).append(r)
    print(
        f"{'model':9} {'config':10} {'n':>2} {'med_ms':>7} {'sprd%':>6} {'iqr%':>5} {'vol/call':>8} {'oncpu%':>6} "
        f"{'launch':>7} {'lo_ms':>7} {'hi_ms':>7} {'hi%':>3} {'sm_lo':>5} {'sm_hi':>5} {'rho':>5}  "
        f"flags before>spin>end>after  rc set/back"
    )

    def order(k):
        return (MODELS.index(k[0]) if k[0] in MODELS else 9, CONFIGS.index(k[1]) if k[1] in CONFIGS else 9)

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
        flags = {
            ">".join(str(r.get(k, "-")) for k in ("flags_before", "flags_spin", "flags_end", "flags_after")) for r in ok
        }
        rcs = {f"{r.get('set_spin_rc', '-')}/{r.get('set_back_rc', '-')}" for r in ok}
        print(
            f"{m:9} {c:10} {len(ok):>2} {mm:7.4f} {100 * (max(meds) - min(meds)) / mm:6.2f} "
            f"{statistics.mean(r['iqr_pct'] for r in ok):5.2f} {vol:8.3f} {oncpu:6.1f} {launch:7.4f} "
            f"{level_cols(*pooled_levels(ok))}  "
            f"{' | '.join(sorted(flags)):27}  {' | '.join(sorted(rcs))}"
            + (f"  ({len(rs) - len(ok)} failed)" if len(rs) > len(ok) else "")
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, help="where results.jsonl goes (appended to)")
    ap.add_argument("--repeats", type=int, default=3, help="processes per (model, config) (default 3)")
    ap.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configs (default all)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated models (default all)")
    ap.add_argument("--deadline-s", type=float, default=240, help="no new process after this (default 240)")
    ap.add_argument("--nvml-period-ms", type=float, default=2.0, help="NVML sampler's period (default 2; 0: off)")
    ap.add_argument("--summary-only", action="store_true", help="print the table of OUT/results.jsonl")
    ap.add_argument("--one", metavar="MODEL:CONFIG", help="internal: measure one in this process")
    ap.add_argument("--out", help="internal: --one's JSON line goes here")
    args = ap.parse_args()
    if args.one:
        one(args.one, args.out, args.nvml_period_ms)
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
            proc = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--one",
                    f"{model}:{config}",
                    "--out",
                    str(tmp),
                    "--nvml-period-ms",
                    str(args.nvml_period_ms),
                ],
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT_S,
            )
            error = (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            error = f"timed out after {CHILD_TIMEOUT_S} s"
        rec = json.loads(tmp.read_text()) if tmp.exists() else {"model": model, "config": config, "error": error}
        tmp.unlink(missing_ok=True)
        rec.update(rep=rep, order=index)
        with open(results, "a") as f:
            f.write(json.dumps(rec) + "\n")
        got = (
            f"median {rec['median']:.4f} ms iqr {rec['iqr_pct']:.2f}%"
            if rec.get("median")
            else f"FAILED: {error.strip().splitlines()[-1:] if error else ''}"
        )
        if rec.get("median"):
            rho = (rec.get("nvml") or {}).get("rho_sm")
            got += f"; lo_ms hi_ms hi% sm_lo sm_hi rho: {level_cols(rec.get('levels'), rho)}" + (
                "" if rec.get("nvml") else f" (no NVML: {rec.get('nvml_reason')})"
            )
        print(f"[{time.monotonic() - started:6.1f}s] {model}:{config} rep {rep}: {got}", flush=True)
    table(results)


if __name__ == "__main__":
    main()
