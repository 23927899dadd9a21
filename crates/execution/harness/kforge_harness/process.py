"""What is process-wide in a stage's process, kept here and nowhere else.

A stage is one process, and some of its state belongs to the process rather than to any object of the stage:

- the harness's own references to what it measures and saves with (`perf_counter_ns`, `monotonic`, `getrusage`,
  `json_dump`, `open_file`, `exit_now`, `urandom`), taken when the package is imported, before any candidate code
  runs: a candidate that patches `time`, `json`, `os` or `builtins` changes neither the harness's clock nor its
  channel;
- torch's timing, synchronisation and tensor functions as they were before the candidate was imported
  (`originals()`, made once per process);
- the C libraries, loaded once (`libcuda`, `libc_memory`);
- how the process waits for its GPU (`BLOCKING_SYNC`, `blocking_sync`, `set_sync`): a flag of the process's CUDA
  context;
- the staging buffers that outputs files are written through (`STAGING`, filled by `outputs.staging_buffers`):
  pinned host memory, made once per process.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ctypes
    from types import ModuleType

    import torch

# The harness's own references to what it measures and saves with, taken before any candidate code runs: a
# candidate that patches these module attributes changes neither the harness's clock nor its channel.
perf_counter_ns = time.perf_counter_ns
monotonic = time.monotonic
getrusage = resource.getrusage
json_dump = json.dump
open_file = open
exit_now = os._exit
urandom = os.urandom


class Originals:
    """torch's timing and synchronisation functions, and the tensor methods, event calls, file calls and C library
    that writing outputs uses (in the caller's stream order, where a replaced one could synchronise first), as they
    were before the candidate was imported."""

    def __init__(self, torch: ModuleType) -> None:
        self.synchronize = torch.cuda.synchronize
        self.event = torch.cuda.Event
        self.event_record = torch.cuda.Event.record
        self.event_elapsed = torch.cuda.Event.elapsed_time
        self.sleep = torch.cuda._sleep
        self.current_stream = torch.cuda.current_stream
        self.stream = torch.cuda.stream
        self.detach = torch.Tensor.detach
        self.resolve_conj = torch.Tensor.resolve_conj
        self.resolve_neg = torch.Tensor.resolve_neg
        self.contiguous = torch.Tensor.contiguous
        self.to = torch.Tensor.to
        self.clone = torch.Tensor.clone
        self.data_ptr = torch.Tensor.data_ptr
        self.copy = torch.Tensor.copy_
        self.reshape = torch.Tensor.reshape
        self.view = torch.Tensor.view
        self.narrow = torch.Tensor.narrow
        self.numpy = torch.Tensor.numpy
        self.numel = torch.Tensor.numel
        self.element_size = torch.Tensor.element_size
        self.event_synchronize = torch.cuda.Event.synchronize
        self.event_query = torch.cuda.Event.query
        self.zero = torch.Tensor.zero_
        self.from_file = torch.from_file
        self.os_open = os.open
        self.pwrite = os.pwrite
        self.fallocate = os.posix_fallocate
        self.ftruncate = os.ftruncate
        self.close = os.close
        self.memoryview = memoryview
        libc_memory()  # loaded (and kept) now: ctypes.CDLL is the candidate's to replace later


ORIGINALS: Originals | None = None


def originals() -> Originals:
    global ORIGINALS
    if ORIGINALS is None:
        import torch

        ORIGINALS = Originals(torch)  # pyright: ignore[reportConstantRedefinition]  (made once, on first use)
    return ORIGINALS


# Whether this process waits for its GPU asleep (`blocking_sync`); None off the GPU.
BLOCKING_SYNC: bool | None = None


def set_sync(spin: bool) -> bool:
    """Switches how this process waits for its GPU from now on: spinning (`spin`: the fastest wake-up, for the
    timed loop on its reserved CPU, as an independent timer waits) or asleep (`blocking_sync`). Returns whether the
    driver took it (cuCtxSetFlags, CUDA 12.1 and later)."""
    import ctypes

    if not BLOCKING_SYNC:
        return False
    try:
        return libcuda().cuCtxSetFlags(ctypes.c_uint(1 if spin else 4)) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def libcuda() -> ctypes.CDLL:
    """The CUDA driver library, loaded once (the same library torch's runtime uses)."""
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def blocking_sync() -> bool:
    """Makes this process wait for its GPU asleep instead of spinning (CU_CTX_SCHED_BLOCKING_SYNC on the primary
    context, before torch creates it): a process waiting on a kernel that never ends then uses no CPU, which is how
    the evaluator tells a hung call from a busy one, and waiting neighbours leave the CPUs to work that needs them.
    Returns whether it took effect."""
    import ctypes

    try:
        cuda = libcuda()
        device = ctypes.c_int()
        return (
            cuda.cuInit(0) == 0
            and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
            and cuda.cuDevicePrimaryCtxSetFlags_v2(device, 4) == 0
        )
    except (OSError, AttributeError):
        return False


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        originals().synchronize(device)


@functools.cache
def libc_memory() -> ctypes.CDLL:
    """The C library with mmap, munmap, mincore, madvise and fstatfs typed, loaded once."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return libc


# The staging buffers of outputs files (`outputs.staging_buffers`): two, made once per process.
STAGING: list[Any] = []
