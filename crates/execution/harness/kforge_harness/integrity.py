"""Run-time integrity checks: what a static reading of the source cannot see (`Integrity`: replaced harness
functions, lowered precision, background threads, outputs that alias inputs), memory poisoned before the candidate
runs, and outputs read before and after a device-wide synchronisation (`differs_after_sync`). Findings are data for
the evaluator."""

from __future__ import annotations

import builtins
import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .outputs import Saved, as_bytes, flatten_outputs
from .process import synchronize

if TYPE_CHECKING:
    import torch


def watched_attributes() -> dict[str, tuple[Any, str]]:
    """What a candidate must not replace: clocks, synchronisation, comparison, saving and the profiler."""
    import ctypes

    import torch

    watched = {
        "time.perf_counter": (time, "perf_counter"),
        "time.perf_counter_ns": (time, "perf_counter_ns"),
        "time.monotonic": (time, "monotonic"),
        "time.time": (time, "time"),
        "torch.cuda.synchronize": (torch.cuda, "synchronize"),
        "torch.cuda.Event": (torch.cuda, "Event"),
        "torch.cuda.Event.record": (torch.cuda.Event, "record"),
        "torch.cuda.Event.elapsed_time": (torch.cuda.Event, "elapsed_time"),
        "torch.cuda.Event.synchronize": (torch.cuda.Event, "synchronize"),
        "torch.cuda.current_stream": (torch.cuda, "current_stream"),
        "torch.cuda._sleep": (torch.cuda, "_sleep"),
        "torch.cuda.stream": (torch.cuda, "stream"),
        "torch.allclose": (torch, "allclose"),
        "torch.equal": (torch, "equal"),
        "torch.isclose": (torch, "isclose"),
        "torch.save": (torch, "save"),
        "torch.load": (torch, "load"),
        "torch.Tensor.to": (torch.Tensor, "to"),
        "torch.Tensor.clone": (torch.Tensor, "clone"),
        "torch.Tensor.detach": (torch.Tensor, "detach"),
        "torch.Tensor.cpu": (torch.Tensor, "cpu"),
        "torch.Tensor.contiguous": (torch.Tensor, "contiguous"),
        "torch.Tensor.data_ptr": (torch.Tensor, "data_ptr"),
        "torch.Tensor.copy_": (torch.Tensor, "copy_"),
        "torch.Tensor.resolve_conj": (torch.Tensor, "resolve_conj"),
        "torch.Tensor.resolve_neg": (torch.Tensor, "resolve_neg"),
        "torch.cuda.set_stream": (torch.cuda, "set_stream"),
        "torch.from_file": (torch, "from_file"),
        "torch.Tensor.reshape": (torch.Tensor, "reshape"),
        "torch.Tensor.view": (torch.Tensor, "view"),
        "torch.Tensor.narrow": (torch.Tensor, "narrow"),
        "torch.Tensor.numpy": (torch.Tensor, "numpy"),
        "torch.Tensor.numel": (torch.Tensor, "numel"),
        "torch.Tensor.element_size": (torch.Tensor, "element_size"),
        "torch.Tensor.zero_": (torch.Tensor, "zero_"),
        "os.open": (os, "open"),
        "os.pwrite": (os, "pwrite"),
        "os.posix_fallocate": (os, "posix_fallocate"),
        "os.ftruncate": (os, "ftruncate"),
        "os.close": (os, "close"),
        "ctypes.CDLL": (ctypes, "CDLL"),
        "torch.Tensor.__eq__": (torch.Tensor, "__eq__"),
        "json.dump": (json, "dump"),
        "builtins.open": (vars(builtins), "open"),
    }
    try:
        import torch.autograd.profiler
        import torch.profiler

        watched["torch.profiler.profile"] = (torch.profiler, "profile")
        # What the census profiles with.
        watched["torch.autograd.profiler.profile"] = (torch.autograd.profiler, "profile")
        watched["torch.autograd.profiler.profile.__enter__"] = (torch.autograd.profiler.profile, "__enter__")
        watched["torch.autograd.profiler.profile.__exit__"] = (torch.autograd.profiler.profile, "__exit__")
    except Exception:
        pass
    return watched


def read_attribute(holder: Any, name: str) -> Any:
    return holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)


def precision_state() -> dict[str, Any]:
    import torch

    matmul = torch.backends.cuda.matmul
    return {
        "torch.backends.cuda.matmul.allow_tf32": matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction": matmul.allow_fp16_reduced_precision_reduction,  # noqa: E501
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction": matmul.allow_bf16_reduced_precision_reduction,  # noqa: E501
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


class Integrity:
    """Run-time checks for what a static reading of the source cannot see. Findings are data for the evaluator."""

    def __init__(self) -> None:
        self.watched = watched_attributes()
        self.snapshot = {name: read_attribute(*where) for name, where in self.watched.items()}
        self.precision = precision_state()
        self.threads = {thread.ident for thread in threading.enumerate()}
        self.findings: dict[str, str] = {}

    def add(self, code: str, message: str) -> None:
        self.findings.setdefault(code, message)

    def check_environment(self, when: str) -> None:
        for name, where in self.watched.items():
            if read_attribute(*where) is not self.snapshot[name]:
                self.add("runtime.harness_tampered", f"`{name}` was replaced {when}")
        now = precision_state()
        for name, value in now.items():
            if value != self.precision[name]:
                self.add(
                    "runtime.precision_downgrade", f"`{name}` changed from {self.precision[name]} to {value} {when}"
                )
        extra = [t.name for t in threading.enumerate() if t.ident not in self.threads and self.foreign(t)]
        if extra:
            self.add("runtime.background_thread", f"threads still running {when}: {', '.join(extra[:5])}")

    @staticmethod
    def foreign(thread: threading.Thread) -> bool:
        """A live thread that torch or triton did not start for themselves (inductor's compile pool is theirs)."""
        if not thread.is_alive():
            return False
        target = getattr(thread, "_target", None)
        origin = getattr(target, "__module__", None) or type(thread).__module__ or ""
        if origin.split(".")[0] in ("torch", "triton"):
            return False
        return not (origin.startswith("concurrent.futures") and "torch._inductor" in sys.modules)

    def check_outputs(self, inputs: Sequence[Any], output: Any, trial: int) -> None:
        """Outputs must be new tensors: not an input, not a view of one, not sharing its memory."""
        import torch

        def spans(values: Iterable[Any]) -> Iterator[tuple[torch.Tensor, int, int]]:
            for value in values:
                if isinstance(value, torch.Tensor) and value.numel() > 0:
                    storage = value.untyped_storage()
                    yield value, storage.data_ptr(), storage.data_ptr() + storage.nbytes()

        inputs_spans = list(spans(inputs))
        for index, (out, begin, end) in enumerate(spans(flatten_outputs(output))):
            for inp, in_begin, in_end in inputs_spans:
                if out.device == inp.device and begin < in_end and in_begin < end:
                    self.add(
                        "runtime.output_aliases_input", f"output {index} shares memory with an input (trial {trial})"
                    )


def poison_free_memory(device: torch.device) -> None:
    """Fills memory the CUDA caching allocator will hand out next with NaN, so a kernel that reads an output it
    never wrote (torch.empty) sees NaN rather than the zeros of fresh device memory."""
    import torch

    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    large = torch.empty(min(1 << 30, free // 4) // 4, dtype=torch.float32, device=device).fill_(float("nan"))
    small = [torch.empty(1 << 17, dtype=torch.float32, device=device).fill_(float("nan")) for _ in range(32)]
    synchronize(device)
    del large, small


# Outputs up to this size are read twice (in the caller's stream order, then after synchronising) to name a stream
# race; larger ones are read once, in stream order, and a race shows as a mismatch.
RACE_CHECK_BYTES = 64 << 20


def differs_after_sync(output: Any, ordered: Sequence[Saved]) -> int | None:
    """The index of the first output whose stream-ordered copy differs (bytewise) from its value now, or None."""
    import torch

    values = flatten_outputs(output)
    sizes = [v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor)]
    if sum(sizes) > RACE_CHECK_BYTES:
        return None
    for index, (value, saved) in enumerate(zip(values, ordered)):
        if (
            isinstance(value, torch.Tensor)
            and value.is_cuda
            and "tensor" in saved
            and not torch.equal(as_bytes(value.detach().to("cpu")), as_bytes(saved["tensor"]))
        ):
            return index
    return None
