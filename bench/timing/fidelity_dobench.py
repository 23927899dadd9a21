"""fidelity.py's do_bench child (`fidelity.py --dobench-one TASK CAND OUTJSON`): Model and ModelNew measured with
triton.testing.do_bench in a clean process, nothing else running in it. torch and triton are imported inside the
child only, so the rest of fidelity.py runs without them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import common

DEVICE = "cuda"  # where --dobench-one measures (a test may point it elsewhere)


def _load_module(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _to_device(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _flatten(output: Any) -> list[Any]:
    return list(output) if isinstance(output, (list, tuple)) else [output]


def _spread(times: list[float]) -> dict[str, Any]:
    return {
        "n": len(times),
        "p20": common.percentile(times, 20),
        "p25": common.percentile(times, 25),
        "p50": common.percentile(times, 50),
        "p75": common.percentile(times, 75),
        "p80": common.percentile(times, 80),
        "min": min(times) if times else None,
        "max": max(times) if times else None,
    }


def dobench_one(task_path: str, candidate_path: str, out_json: str, build_only: bool) -> None:
    """The child: measures Model and ModelNew with do_bench in this clean process; writes OUT_JSON."""
    result: dict[str, Any] = {"task_path": task_path, "candidate_path": candidate_path, "ok": False}
    began = time.monotonic()
    try:
        import torch
        import triton
        import triton.testing

        result["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__}
        task = _load_module(task_path, "kforge_timing_task")
        candidate = _load_module(candidate_path, "kforge_timing_candidate")  # builds its load_inline extensions
        result["import_s"] = time.monotonic() - began
        if build_only:
            result["ok"] = True
            return
        device = torch.device(DEVICE)
        result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        if os.environ.get("KFORGE_DOBENCH_SPIN") == "1" and device.type == "cuda":
            result["sched"] = _wait_spinning(device)
        _compare_and_measure(task, candidate, device, result)
        result["speedup_eager"] = result["eager_median_ms"] / result["candidate_median_ms"]
        result["ok"] = True
    except BaseException as error:  # any failure, KeyboardInterrupt and SystemExit too, is reported in the JSON
        result["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-4000:]}"
    finally:
        result["wall_s"] = time.monotonic() - began
        Path(out_json).write_text(json.dumps(result, indent=1))


def _wait_spinning(device: Any) -> str:
    """The dobench-spin phase: this process waits for its GPU spinning, as kforge's timed loop does
    (CU_CTX_SCHED_SPIN on the primary context, which torch has made current). Returns what `sched` records."""
    import ctypes

    import torch

    torch.zeros(1, device=device)
    status = ctypes.CDLL("libcuda.so.1").cuCtxSetFlags(ctypes.c_uint(1))
    return "spin" if status == 0 else f"spin refused ({status})"


def _compare_and_measure(task: ModuleType, candidate: ModuleType, device: Any, result: dict[str, Any]) -> None:
    """Builds Model and ModelNew with the same parameters (torch seeded 0 before each) and the inputs (seeded 1),
    records how far their outputs are apart, then do_bench's median and spread of each into `result`."""
    import torch
    import triton.testing

    torch.manual_seed(0)
    reference = task.Model(*_to_device(list(task.get_init_inputs()), device)).to(device)
    torch.manual_seed(0)
    new = candidate.ModelNew(*_to_device(list(task.get_init_inputs()), device)).to(device)
    torch.manual_seed(1)
    inputs = _to_device(list(task.get_inputs()), device)
    with torch.no_grad():
        expected = _flatten(reference(*inputs))
        got = _flatten(new(*inputs))
        if device.type == "cuda":
            torch.cuda.synchronize()
        diffs = [
            (g.float() - e.float()).abs().max().item()
            for g, e in zip(got, expected)
            if isinstance(g, torch.Tensor) and g.shape == e.shape
        ]
        result["max_abs_diff"] = max(diffs) if diffs else None
        result["allclose"] = len(diffs) == len(expected) and all(
            torch.allclose(g.float(), e.float(), atol=1e-3, rtol=1e-3) for g, e in zip(got, expected)
        )
        del expected, got
        models = {"eager": reference, "candidate": new}
        for name, model in models.items():
            result[f"{name}_median_ms"] = triton.testing.do_bench(
                lambda model=model: model(*inputs), warmup=25, rep=200, return_mode="median"
            )
        for name, model in models.items():
            times = triton.testing.do_bench(lambda model=model: model(*inputs), warmup=25, rep=200, return_mode="all")
            # return_mode="all" gives every sample (the annotation allows None).
            result[f"{name}_all"] = _spread([float(t) for t in cast("list[float]", times)])
