"""kforge evaluation harness: the only code that runs next to candidate kernels.

The evaluator (Rust) starts this file in a fresh sandboxed process per stage:

    python kforge_harness.py <mode> <spec.json>

and reads the JSON result the mode writes to `spec["result_path"]`. Modes:

- compile:   import the candidate module (building its load_inline extensions into TORCH_EXTENSIONS_DIR).
- reference: run the task's reference Model on the trial inputs; save its outputs; then, when given a candidate's
             saved outputs, compare them. Clean process, no candidate code.
- candidate: run ModelNew on the same inputs; save its outputs; optionally time it (raw samples only).
- check:     compare a candidate's saved outputs with cached reference outputs. Clean process, no candidate code.
- baseline:  time the reference eagerly and under torch.compile. Clean process.

Statistics are computed by the evaluator from raw samples; this file only measures. It works with PyTorch 2.11
and later, on CPU and CUDA.
"""

import hashlib
import importlib.util
import json
import math
import os
import sys
import time
import traceback


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def json_safe(value):
    """Non-finite floats as proto3 JSON spells them ("NaN", "Infinity", "-Infinity"): bare NaN is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_result(spec, result):
    with open(spec["result_path"], "w") as f:
        json.dump(json_safe(result), f, allow_nan=False)


def device_of(spec):
    import torch

    return torch.device(spec["device"])


def synchronize(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(value, device):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def make_inputs(task, seed, device):
    import torch

    torch.manual_seed(seed)
    return to_device(list(task.get_inputs()), device)


def make_model(cls, task, init_seed, device):
    import torch

    torch.manual_seed(init_seed)
    init_inputs = to_device(list(task.get_init_inputs()), device)
    return cls(*init_inputs).to(device)


def flatten_outputs(output):
    """A model's output as a list of values; tuples and lists are flattened one level, in order."""
    if isinstance(output, (list, tuple)):
        return list(output)
    return [output]


def to_cpu_outputs(output):
    """Outputs prepared for saving: tensors detached to CPU with their exact type recorded."""
    import torch

    saved = []
    for value in flatten_outputs(output):
        exact = type(value) is torch.Tensor
        if isinstance(value, torch.Tensor):
            saved.append({"exact_tensor": exact, "device": str(value.device), "tensor": value.detach().to("cpu").clone()})
        else:
            saved.append({"exact_tensor": False, "device": "", "value": repr(value)[:200]})
    return saved


def tensor_digest(values):
    import torch

    digest = hashlib.sha256()
    for value in values:
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------- timing


class Timer:
    """Times one call: CUDA events around it on a GPU, the monotonic clock on CPU; the L2 cache is flushed first."""

    def __init__(self, device):
        import torch

        self.device = device
        self.flush_buffer = None
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            # Twice the L2 size, written between runs, so no run finds its data already cached.
            self.flush_buffer = torch.empty(max(2 * l2, 1 << 20), dtype=torch.uint8, device=device)

    def time_ms(self, fn):
        import torch

        if self.flush_buffer is not None:
            self.flush_buffer.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end)
        begin = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - begin) / 1e6


def measure(fn_for_inputs, input_sets, device, budget):
    """Raw samples of fn over rotating input sets: warm-up and measurement run the same code path.

    Stops when the relative standard error of the mean is under `budget["target_rel_error"]` (after at least
    `min_runs`), or at `max_runs`, or when `max_seconds` of measurement have passed.
    """
    import torch

    timer = Timer(device)
    with torch.no_grad():
        for i in range(budget["warmup_runs"]):
            timer.time_ms(lambda: fn_for_inputs(input_sets[i % len(input_sets)]))
        samples = []
        started = time.monotonic()
        while len(samples) < budget["max_runs"]:
            inputs = input_sets[len(samples) % len(input_sets)]
            samples.append(timer.time_ms(lambda: fn_for_inputs(inputs)))
            n = len(samples)
            if n >= budget["min_runs"]:
                mean = sum(samples) / n
                var = sum((s - mean) ** 2 for s in samples) / (n - 1)
                if mean > 0 and math.sqrt(var / n) / mean < budget["target_rel_error"]:
                    break
            if time.monotonic() - started > budget["max_seconds"]:
                break
    return samples


# ---------------------------------------------------------------------------------------------------- modes


def mode_compile(spec):
    started = time.monotonic()
    module = load_module(spec["candidate_path"], "kforge_candidate")
    if not hasattr(module, "ModelNew"):
        raise RuntimeError("the candidate defines no ModelNew")
    write_result(spec, {"ok": True, "seconds": time.monotonic() - started})


def mode_reference(spec):
    import torch

    device = device_of(spec)
    task = load_module(spec["task_path"], "kforge_task")
    model = make_model(task.Model, task, spec["init_seed"], device)
    for trial, seed in enumerate(spec["seeds"]):
        inputs = make_inputs(task, seed, device)
        with torch.no_grad():
            output = model(*inputs)
        synchronize(device)
        torch.save(to_cpu_outputs(output), os.path.join(spec["reference_dir"], f"reference-{trial}.pt"))
    result = {"ok": True}
    if spec.get("candidate_dir"):
        result["mismatch"] = compare_trials(spec)
    write_result(spec, result)


def mode_candidate(spec):
    import torch

    device = device_of(spec)
    task = load_module(spec["task_path"], "kforge_task")
    try:
        candidate = load_module(spec["candidate_path"], "kforge_candidate")
    except BaseException as error:
        error.kforge_phase = "import"
        raise
    model = make_model(candidate.ModelNew, task, spec["init_seed"], device)
    result = {"ok": True, "mutated_inputs": []}
    for trial, seed in enumerate(spec["seeds"]):
        inputs = make_inputs(task, seed, device)
        before = tensor_digest(inputs)
        with torch.no_grad():
            output = model(*inputs)
        synchronize(device)
        if tensor_digest(inputs) != before:
            result["mutated_inputs"].append(trial)
        torch.save(to_cpu_outputs(output), os.path.join(spec["candidate_dir"], f"candidate-{trial}.pt"))
    if spec.get("timing"):
        input_sets = [make_inputs(task, seed, device) for seed in spec["timing_seeds"]]
        result["samples_ms"] = measure(lambda inputs: model(*inputs), input_sets, device, spec["timing"])
    write_result(spec, result)


def tolerance(dtype, spec):
    import torch

    table = spec["tolerances"]
    key = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}.get(dtype)
    if key is None:
        return 0.0, 0.0  # integers and booleans compare exactly
    return table[key]["atol"], table[key]["rtol"]


def mode_check(spec):
    write_result(spec, {"ok": True, "mismatch": compare_trials(spec)})


def compare_trials(spec):
    """The first mismatch between reference and candidate outputs over every trial, or None."""
    import torch

    for trial in range(len(spec["seeds"])):
        expected = torch.load(os.path.join(spec["reference_dir"], f"reference-{trial}.pt"), weights_only=True)
        try:
            got = torch.load(os.path.join(spec["candidate_dir"], f"candidate-{trial}.pt"), weights_only=True)
        except Exception as error:  # a missing or malformed file is the candidate's output, not ours
            return {"trial": trial, "output_index": 0, "detail": f"outputs unreadable: {type(error).__name__}"}
        mismatch = compare_outputs(expected, got, spec)
        if mismatch is not None:
            mismatch["trial"] = trial
            return mismatch
    return None


def compare_outputs(expected, got, spec):
    import torch

    if not isinstance(got, list) or len(got) != len(expected):
        return {"output_index": 0, "detail": f"expected {len(expected)} outputs, got {len(got) if isinstance(got, list) else 'none'}"}
    for index, (want, have) in enumerate(zip(expected, got)):
        if not isinstance(have, dict) or "tensor" not in have and "value" not in have:
            return {"output_index": index, "detail": "output is not a saved value"}
        if "tensor" not in want:
            if have.get("value") != want.get("value"):
                return {"output_index": index, "detail": f"expected {want.get('value')}, got {have.get('value')}"}
            continue
        if "tensor" not in have or not have.get("exact_tensor"):
            return {"output_index": index, "detail": "output is not a torch.Tensor (type(out) is torch.Tensor failed)"}
        a, b = want["tensor"], have["tensor"]
        if have["device"] != want["device"]:
            return {"output_index": index, "detail": f"device {have['device']} instead of {want['device']}"}
        if b.dtype != a.dtype:
            return {"output_index": index, "detail": f"dtype {b.dtype} instead of {a.dtype}"}
        if tuple(b.shape) != tuple(a.shape):
            return {"output_index": index, "detail": f"shape {tuple(b.shape)} instead of {tuple(a.shape)}"}
        if a.numel() == 0:
            continue
        atol, rtol = tolerance(a.dtype, spec)
        if a.dtype.is_floating_point or a.dtype.is_complex:
            a64, b64 = a.to(torch.float64), b.to(torch.float64)
            finite_expected = torch.isfinite(a64)
            # NaN never passes, and Inf only where the reference has the same Inf.
            bad_nonfinite = ~torch.isfinite(b64) & ~(torch.isinf(a64) & (a64 == b64))
            diff = (a64 - b64).abs()
            diff = torch.where(finite_expected, diff, torch.zeros_like(diff))
            allowed = atol + rtol * a64.abs()
            bad = bad_nonfinite | (finite_expected & (diff > torch.where(finite_expected, allowed, torch.zeros_like(allowed))))
            if bool(bad.any()):
                flat = int(bad.flatten().nonzero()[0])
                where = list(torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() > 0 else []
                rel = diff / a64.abs().clamp_min(1e-12)
                return {
                    "output_index": index,
                    "element_index": [int(i) for i in where],
                    "expected": float(a64.flatten()[flat]),
                    "got": float(b64.flatten()[flat]),
                    "max_abs_error": float(torch.nan_to_num(diff, nan=math.inf).max()),
                    "max_rel_error": float(torch.nan_to_num(rel, nan=math.inf).max()),
                    "detail": "",
                }
        elif not torch.equal(a, b):
            flat = int((a != b).flatten().nonzero()[0])
            where = list(torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() > 0 else []
            return {
                "output_index": index,
                "element_index": [int(i) for i in where],
                "expected": float(a.flatten()[flat]),
                "got": float(b.flatten()[flat]),
                "max_abs_error": float((a.to(torch.float64) - b.to(torch.float64)).abs().max()),
                "max_rel_error": 0.0,
                "detail": "",
            }
    return None


def mode_baseline(spec):
    import torch

    device = device_of(spec)
    task = load_module(spec["task_path"], "kforge_task")
    model = make_model(task.Model, task, spec["init_seed"], device)
    input_sets = [make_inputs(task, seed, device) for seed in spec["timing_seeds"]]
    result = {"ok": True, "eager_ms": measure(lambda inputs: model(*inputs), input_sets, device, spec["timing"])}
    if spec.get("compile"):
        try:
            compiled = torch.compile(model)
            result["compile_ms"] = measure(lambda inputs: compiled(*inputs), input_sets, device, spec["timing"])
        except Exception as error:  # torch.compile is unavailable on some hosts (no C compiler for inductor)
            result["compile_error"] = f"{type(error).__name__}: {error}"[:2000]
    write_result(spec, result)


MODES = {
    "compile": mode_compile,
    "reference": mode_reference,
    "candidate": mode_candidate,
    "check": mode_check,
    "baseline": mode_baseline,
}


def main():
    mode, spec_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        MODES[mode](spec)
    except BaseException as error:  # report every failure as data; the evaluator classifies it
        write_result(spec, {
            "ok": False,
            "error_type": type(error).__name__,
            "phase": getattr(error, "kforge_phase", "run"),
            "error": traceback.format_exc()[-8000:],
        })
        sys.exit(3)


if __name__ == "__main__":
    main()
